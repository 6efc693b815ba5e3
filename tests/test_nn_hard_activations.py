"""The hard activations of MobileNetV3, LeViT, EfficientViT-MIT and LowFormer: Mesa
``Hardswish`` (8-bit input) and the clamps ``Hardtanh`` / ``ReLU6`` / ``Hardsigmoid``
(a 1-bit mask, gradients bitwise stock's)."""
import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

CLAMPS = [(nn.Hardtanh, mn.Hardtanh, dict(min_val=-2.0, max_val=1.5)), (nn.ReLU6, mn.ReLU6, {}),
          (nn.Hardsigmoid, mn.Hardsigmoid, {})]


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _forward_backward(module, x, g):
    """Output, input gradient and saved bytes of ``module`` on a fresh leaf copy of ``x``
    (cloned once more inside: an in-place module must not write into the leaf)."""
    leaf = x.clone().requires_grad_()
    with SavedTensorMeter(module) as meter:
        y = module(leaf.clone())
    y.backward(g)
    return y.detach(), leaf.grad, meter.activation_bytes


def _edges(dtype):
    """Values on both sides of every clamp's corners, and exactly on them."""
    corners = torch.tensor([-3.0, 3.0, 0.0, 6.0, -2.0, 1.5])
    ulp = torch.tensor([1e-3, 1e-1, 1e-2])
    return torch.cat([corners, (corners[:, None] + ulp).flatten(), (corners[:, None] - ulp).flatten()]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("stock_cls,mesa_cls,kwargs", CLAMPS, ids=lambda v: getattr(v, "__name__", ""))
def test_clamps_are_bitwise_stock(stock_cls, mesa_cls, kwargs, inplace, dtype):
    torch.manual_seed(0)
    stock = stock_cls(inplace=inplace, **kwargs)
    mesa = mesa_cls.from_module(stock)
    assert type(mesa) is mesa_cls and mesa.inplace == inplace
    x = (torch.randn(4, 8, 5, 5) * 4).to(dtype)
    x.view(-1)[:len(_edges(dtype))] = _edges(dtype)  # the corners, inside the kernels' vectorized body
    g = torch.randn_like(x)
    y0, gx0, b0 = _forward_backward(stock, x, g)
    y1, gx1, b1 = _forward_backward(mesa, x, g)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert b1 == x.numel() // 8 and b1 < b0 / 8  # one bit an element, stock the input itself
    mesa.eval()
    with torch.no_grad():
        assert torch.equal(stock(x.clone()), mesa(x.clone()))


@pytest.mark.parametrize("stock_cls,mesa_cls,kwargs", CLAMPS, ids=lambda v: getattr(v, "__name__", ""))
def test_clamps_odd_sizes_and_nan(stock_cls, mesa_cls, kwargs):
    """An element count that is not a multiple of 8 (the mask's padding), and a NaN input,
    whose gradient is 0 (ATen's vectorized CPU kernels; their scalar tail passes it)."""
    stock, mesa = stock_cls(**kwargs), mesa_cls.from_module(stock_cls(**kwargs))
    x = torch.randn(3, 7, 5) * 4
    g = torch.randn_like(x)
    assert torch.equal(_forward_backward(stock, x, g)[1], _forward_backward(mesa, x, g)[1])
    x[0, 0, 0] = float("nan")
    y, gx, _ = _forward_backward(mesa, x, g)
    assert y[0, 0, 0].isnan() and gx[0, 0, 0] == 0


def test_clamps_compile_without_a_break():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), mn.Hardsigmoid(), nn.Conv2d(8, 8, 1), mn.ReLU6(inplace=True),
                        mn.Hardtanh(-1.0, 2.0))
    x = torch.randn(2, 3, 6, 6)
    ref = copy.deepcopy(net)
    out = torch._dynamo.explain(net)(x)
    assert out.graph_break_count == 0, out.break_reasons
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    y0, y1 = ref(x), compiled(x)
    y0.sum().backward(), y1.sum().backward()
    assert torch.equal(y0, y1)
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("inplace", [False, True])
def test_hardswish(inplace):
    """8-bit input plus two 1-bit masks (10 bits where stock keeps 32): forward bitwise, the
    input gradient close, and bitwise stock's outside [-3, 3], where the masks decide."""
    torch.manual_seed(0)
    stock = nn.Hardswish(inplace=inplace)
    mesa = mn.Hardswish.from_module(stock)
    assert type(mesa) is mn.Hardswish and mesa.inplace == inplace
    x = torch.randn(4, 16, 6, 6) * 2
    g = torch.randn_like(x)
    y0, gx0, b0 = _forward_backward(stock, x, g)
    y1, gx1, b1 = _forward_backward(mesa, x, g)
    assert torch.equal(y0, y1)
    assert _cos(gx0, gx1) > 0.9995
    outside = (x <= -3) | (x >= 3)
    assert outside.any() and torch.equal(gx0[outside], gx1[outside])
    assert 2 * x.numel() // 8 + x.numel() <= b1 < 0.33 * b0, (b1, b0)
    mesa.eval()
    with torch.no_grad():
        assert torch.equal(stock(x.clone()), mesa(x.clone()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python-function"])
def test_hardswish_with_exact_codes_is_stock_bit_for_bit(dtype, layout, fused, monkeypatch):
    """Where the codes hold x exactly (a grid of 256 steps of 1/32 from -4, rounded to nearest:
    the dequantized input is x itself) the gradient is stock's hardswish_backward bit for bit,
    -3 and 3 included (0 and g there, torch 2.14), +0 below -3 whatever g's sign, and inside its
    arithmetic in float with one rounding to a half type at the end (two roundings more, in
    the activation's dtype, changed 708 of these 2048 bfloat16 gradients)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    grid = -4 + torch.arange(256, dtype=torch.float64) / 32
    x = grid[torch.randperm(2048, generator=torch.Generator().manual_seed(0)) % 256].view(2, 4, 16, 16).to(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    if layout == "channels_last":
        x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    y0, gx0, _ = _forward_backward(nn.Hardswish(), x, g)
    y1, gx1, _ = _forward_backward(mn.Hardswish(rounding="nearest"), x, g)
    word = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(y0.view(word), y1.view(word))
    assert gx0.stride() == gx1.stride()
    assert torch.equal(gx0.contiguous().view(word), gx1.contiguous().view(word))


def test_hardswish_masks_fix_the_jumps():
    """Inputs crowded at -3 and 3, where the derivative jumps by 1/2: from the 8-bit input
    alone about half of them would take the other side's slope."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(512) * 4, 3 + torch.randn(256) * 0.02, -3 + torch.randn(256) * 0.02]).view(4, 256)
    g = torch.ones_like(x)
    exact = _forward_backward(nn.Hardswish(), x, g)[1]
    got = _forward_backward(mn.Hardswish(), x, g)[1]
    assert (got - exact).abs().max() < 0.05  # the in-range slope's rounding only (x / 3)


def test_hardswish_gradient_is_nearly_unbiased():
    """Averaged over rounding draws, the input gradient approaches stock's: the error left is
    the derivative's jumps at -3 and 3, which a rounded input crosses."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16) * 2
    g = torch.randn_like(x)
    exact = _forward_backward(nn.Hardswish(), x, g)[1]
    mesa = mn.Hardswish()
    one = _forward_backward(mesa, x, g)[1]
    mean = torch.stack([_forward_backward(mesa, x, g)[1] for _ in range(64)]).mean(0)
    assert (mean - exact).norm() < 0.5 * (one - exact).norm()


def test_patch_model_converts_the_hard_activations():
    """``ops=['hardswish']``: Hardswish and Hardsigmoid; ``ops=['relu']``: ReLU6 and Hardtanh;
    ``ops=['batchnorm']``: BatchNorm1d (LeViT's ``Linear -> BatchNorm1d``); forward bitwise."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.act1, self.gate, self.act2 = nn.Hardswish(), nn.Hardsigmoid(), nn.ReLU6(inplace=True)
            self.fc, self.bn, self.act3 = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Hardtanh()

        def forward(self, x):
            h = self.act2(self.act1(self.conv(x)) * self.gate(x.mean((2, 3), keepdim=True).repeat(1, 3, 1, 1)[:, :8]))
            t = self.fc(h.flatten(2).transpose(1, 2))
            return self.act3(self.bn(t.flatten(0, 1)))

    torch.manual_seed(0)
    stock = Net()
    x = torch.randn(2, 3, 6, 6)
    only = patch_model(copy.deepcopy(stock), ops=["hardswish"])
    assert [type(only.act1), type(only.gate), type(only.act2)] == [mn.Hardswish, mn.Hardsigmoid, nn.ReLU6]
    relu = patch_model(copy.deepcopy(stock), ops=["relu"])
    assert [type(relu.act1), type(relu.act2), type(relu.act3)] == [nn.Hardswish, mn.ReLU6, mn.Hardtanh]
    full = patch_model(copy.deepcopy(stock))
    assert type(full.bn) is mn.BatchNorm1d and full.bn.quantizer.options.num_groups == 8
    torch.manual_seed(1)
    ref = copy.deepcopy(stock)(x)
    torch.manual_seed(1)
    assert torch.equal(ref, full(x))
