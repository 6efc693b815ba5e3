"""ActNN's correctness checks, in our own words (ucbrise/actnn: tests/test_act_quantized_ops.py,
tests/test_minimax.py, tests/test_linear.py), run on Mesa's layers and kernels.

ActNN checks its compressed ops against PyTorch itself, not against its own reference: a ReLU
that keeps a 1-bit mask returns the stock output and gradient exactly; its per-row min/max
kernel returns what ``torch.min`` / ``torch.max`` return; a quantized Linear with compression
off gives the stock gradients; a BatchNorm in eval mode is the stock one; and a stack of ten
conv + BatchNorm + ReLU layers keeps a fraction of the stock activation bytes. The shapes are
smaller (CPU), the assertions stricter where ActNN only printed (memory, Linear gradients).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mesa_train
import mesa_train.nn as M
from mesa_train.memory import SavedTensorMeter
from kernel_marks import DT_IDS, DTYPES, needs_ext


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_relu_output_and_gradient_are_stock_and_mask_is_one_bit(dtype):
    """ActNN test_relu_correctness: (128, 56, 56, 31) there, a smaller tensor with the same odd
    last dim here (the mask's bytes do not divide evenly), and a random upstream gradient
    where ActNN used ones. Also: the only thing saved is the packed mask, one bit an element."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 14, 14, 31, generator=g).to(dtype)
    x[0, 0, 0, :4] = 0.0  # ReLU's gradient at exactly 0 is 0 in both
    head = torch.randn(x.shape, generator=g).to(dtype)

    def run(layer):
        xi = x.clone().requires_grad_()
        with SavedTensorMeter() as meter:
            y = layer(xi)
        y.backward(head)
        return y.detach(), xi.grad, meter.activation_bytes

    y_ref, g_ref, _ = run(nn.ReLU())
    y, gx, saved = run(M.ReLU.from_module(nn.ReLU()))
    assert torch.equal(y, y_ref) and torch.equal(gx, g_ref)
    assert saved == (x.numel() + 7) // 8


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_group_minmax_is_torch_min_max(dtype):
    """ActNN test_minimax_correctness: per-row min and max of a (1024, 256) tensor equal to
    torch.min / torch.max; here also per channel group and over the whole batch (shared)."""
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = x.float()
    mn, mx = torch.ops.mesa.group_minmax(x, 1, 1, True)  # per sample, one group
    assert torch.equal(mn[:, 0], torch.min(rows, 1)[0]) and torch.equal(mx[:, 0], torch.max(rows, 1)[0])
    groups = rows.view(1024, 4, 64)
    mn, mx = torch.ops.mesa.group_minmax(x, 1, 4, True)  # per sample, 4 channel groups of 64
    assert torch.equal(mn, groups.amin(-1)) and torch.equal(mx, groups.amax(-1))
    mn, mx = torch.ops.mesa.group_minmax(x, 1, 4, False)  # shared over the batch
    assert torch.equal(mn[0], groups.amin((0, 2))) and torch.equal(mx[0], groups.amax((0, 2)))


def _square_loss_grads(layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    torch.square(layer(x)).sum().backward()
    return layer.weight.grad.clone(), layer.bias.grad.clone()


def test_linear_gradients_stock_when_off_and_close_when_on():
    """ActNN test_linear: nn.Linear(100, 10) on (128, 64, 100), loss sum(y^2); with compression
    off the quantized layer's gradients are the stock ones. ActNN printed the gap with it on;
    here 8 bits must keep it under 1% of the gradient's norm."""
    torch.manual_seed(0)
    stock = nn.Linear(100, 10)
    x = torch.randn(16, 64, 100)
    w_ref, b_ref = _square_loss_grads(stock, x)
    off = M.Linear.from_module(copy.deepcopy(stock), enabled=False)
    w_off, b_off = _square_loss_grads(off, x)
    assert torch.equal(w_off, w_ref) and torch.equal(b_off, b_ref)
    on = M.Linear.from_module(copy.deepcopy(stock))
    w_on, b_on = _square_loss_grads(on, x)
    assert torch.equal(b_on, b_ref)  # the bias gradient needs no saved activation
    err = float((w_on - w_ref).norm() / w_ref.norm())
    assert 0 < err < 1e-2, err


def test_batchnorm_in_eval_mode_is_stock():
    """ActNN test_bn_correctness (training=False): output and the input, weight and bias
    gradients of an eval-mode BatchNorm equal to stock."""
    g = torch.Generator().manual_seed(2)
    stock = nn.BatchNorm2d(32)
    with torch.no_grad():
        stock.running_mean.copy_(torch.randn(32, generator=g))
        stock.running_var.copy_(torch.rand(32, generator=g) + 0.5)
        stock.weight.copy_(torch.randn(32, generator=g))
        stock.bias.copy_(torch.randn(32, generator=g))
    x = torch.randn(4, 32, 14, 14, generator=g) * 0.01

    def run(layer):
        layer.eval().zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(torch.ones_like(y))
        return [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad]

    ref = run(stock)
    got = run(M.BatchNorm2d.from_module(copy.deepcopy(stock)))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_conv_bn_relu_stack_keeps_a_quarter_of_the_bytes():
    """ActNN test_conv2d_memory_analytical: ten conv 3x3 + BatchNorm + ReLU layers, activation
    bytes kept for backward, stock against compressed. Stock keeps each BatchNorm input and
    ReLU output in float32, the ReLU output being the next conv's input (one storage): 8 bytes
    an element a layer, plus the first conv's input (84 in all). Mesa keeps an 8-bit conv
    input, an 8-bit normalised BatchNorm input and a 1-bit mask: 2.125 bytes a layer (21.25),
    0.253x, plus per-group ranges. The forward stays the stock one bit for bit (train mode)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(10):
        layers += [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    stock = nn.Sequential(*layers).train()
    mesa = mesa_train.patch_model(copy.deepcopy(stock), ops=["conv", "batchnorm", "relu"])
    assert sum(isinstance(m, (M.Conv2d, M.BatchNorm2d, M.ReLU)) for m in mesa.modules()) == 30
    x = torch.randn(4, 16, 28, 28)

    def saved(model):
        with SavedTensorMeter(model) as meter:
            y = model(x.clone().requires_grad_())
        return y, meter.activation_bytes

    y_ref, stock_bytes = saved(stock)
    y, mesa_bytes = saved(mesa)
    assert torch.equal(y, y_ref)
    ratio = mesa_bytes / stock_bytes
    assert 21.25 / 84 <= ratio < 0.26, ratio
