"""Mesa layers added for timm models beyond DeiT/Swin/PVT (issue 10): BatchNorm2d, RmsNorm,
QuickGELU, SiLU, GatedActivation (SwiGLU / GLU), and the power-of-two row scales."""
import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _run(module, *inputs, grad):
    xs = [x.clone().requires_grad_() for x in inputs]
    with SavedTensorMeter(module) as meter:
        y = module(*xs)
    y.backward(grad)
    params = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return y.detach(), [x.grad for x in xs], params, meter.activation_bytes


def _compare(stock, mesa, *inputs, min_cos=0.999):
    torch.manual_seed(0)
    grad = torch.randn_like(copy.deepcopy(stock)(*inputs))  # a copy: BatchNorm stats move
    ref = _run(stock, *inputs, grad=grad)
    got = _run(mesa, *inputs, grad=grad)
    assert torch.equal(ref[0], got[0]), "forward differs from stock"
    for a, b in zip(ref[1] + ref[2], got[1] + got[2]):
        assert _cos(a, b) >= min_cos
    assert got[3] < ref[3], f"saved {got[3]} bytes, stock {ref[3]}"
    mesa.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(stock(*inputs), mesa(*inputs))


@pytest.mark.parametrize("affine,track,momentum", [(True, True, 0.1), (False, True, None), (True, False, 0.1)])
def test_batchnorm2d(affine, track, momentum):
    """Channels five decades apart (a depthwise conv in front): per-channel groups of the
    normalised input keep every channel's gradient."""
    torch.manual_seed(0)
    stock = nn.BatchNorm2d(6, affine=affine, track_running_stats=track, momentum=momentum)
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.BatchNorm2d.from_module(copy.deepcopy(stock))
    assert mesa.quantizer.options.num_groups == 6
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-3, 2, 6).view(1, 6, 1, 1) + 3
    _compare(stock, mesa, x)
    if track:
        assert torch.equal(stock.running_mean, mesa.running_mean) and torch.equal(stock.running_var, mesa.running_var)
        assert stock.num_batches_tracked == mesa.num_batches_tracked


def test_rmsnorm_with_a_row_far_below_the_others():
    from timm.layers import RmsNorm as TimmRmsNorm

    torch.manual_seed(0)
    stock = TimmRmsNorm(32)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 32)
    x[:, 0] *= 1e-4
    _compare(stock, mn.RmsNorm.from_module(copy.deepcopy(stock)), x)


def test_rmsnorm_without_affine():
    """timm's ``RmsNorm(affine=False)`` (Gemma 4's ViT norms): converted with ``weight`` a None
    parameter, as stock's (a plain ``None`` attribute used to block ``register_parameter``)."""
    from timm.layers import RmsNorm as TimmRmsNorm

    stock = TimmRmsNorm(32, affine=False)
    mesa = mn.RmsNorm.from_module(copy.deepcopy(stock))
    assert mesa.weight is None and "weight" in mesa._parameters
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    x = torch.randn(2, 7, 32)
    x[:, 0] *= 1e-4
    _compare(stock, mesa, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fp32(dtype):
    """timm's ``RmsNormFp32`` (DeepSeek's ViT): float32 arithmetic whatever the input's dtype,
    the input's dtype out; the Mesa layer gives the same bits."""
    from timm.layers import RmsNormFp32 as TimmRmsNormFp32

    torch.manual_seed(0)
    stock = TimmRmsNormFp32(32).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = mn.RmsNormFp32.from_module(copy.deepcopy(stock))
    x = torch.randn(2, 7, 32).to(dtype)
    if dtype == torch.float32:
        _compare(stock, mesa, x)
        return
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, ym = stock(xs), mesa(xm)
    assert ym.dtype == dtype and torch.equal(ys, ym)
    g = torch.randn_like(ys)
    ys.backward(g), ym.backward(g)
    assert _cos(xs.grad, xm.grad) > 0.999 and _cos(stock.weight.grad, mesa.weight.grad) > 0.999
    with pytest.raises(TypeError, match="RmsNormFp32"):
        mn.RmsNormFp32.from_module(nn.LayerNorm(32))


@pytest.mark.parametrize("kind", ["quick_gelu", "silu"])
def test_activations(kind):
    from timm.layers.activations import QuickGELU as TimmQuickGELU

    stock = TimmQuickGELU() if kind == "quick_gelu" else nn.SiLU()
    mesa = (mn.QuickGELU if kind == "quick_gelu" else mn.SiLU).from_module(stock)
    _compare(stock, mesa, torch.randn(2, 7, 32) * 3)


@pytest.mark.parametrize("gate_last", [False, True])
def test_gated_activation(gate_last):
    act = nn.SiLU()

    class Stock(nn.Module):
        def forward(self, a, b):
            return b * act(a) if gate_last else act(a) * b

    _compare(Stock(), mn.GatedActivation(act, gate_last=gate_last), torch.randn(2, 7, 32), torch.randn(2, 7, 32))


def test_linear_row_scales_keep_a_tiny_row():
    """A row ~1e-3 of the others that carries most of the gradient (DeiT3's class token):
    without row scales it falls below its group's 8-bit step (weight-gradient cosine ~0.1)."""
    from mesa_train.nn.rowscale import row_exponents

    torch.manual_seed(0)
    x = torch.randn(4, 17, 64)
    x[:, 0] *= 1e-3
    g = torch.randn(4, 17, 32) * 1e-3
    g[:, 0] = torch.randn(4, 32)
    stock = nn.Linear(64, 32)
    mesa = mn.Linear.from_module(copy.deepcopy(stock))
    grads = []
    for m in (stock, mesa):
        m(x).backward(g)
        grads.append(m.weight.grad)
    assert _cos(grads[0], grads[1]) >= 0.999
    k = row_exponents(x)
    assert (k[:, 0] >= 9).all() and (k[:, 1:] == 0).all()  # only the tiny row is scaled (2**9 ~ 1e3)
