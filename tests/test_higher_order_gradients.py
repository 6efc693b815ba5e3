"""Higher-order gradients through Mesa's Python autograd Functions.

Their backward reads the 8-bit copy of the input, so it has no graph back to the input: a
gradient taken with ``create_graph=True`` and differentiated again would silently miss every
second-order term through that copy. Each backward is ``@first_order`` (``nn/first_order.py``):
a backward with ``create_graph=True`` is refused in one line, at the first derivative, as the
C++ layer nodes refuse it (tests/test_layers_autograd.py). Until session 82 it was
``@once_differentiable``, which refused only an incoming gradient that required grad: with a
constant one the gradient came back without its second-order term, without a word
(tests/test_first_order.py).

The exceptions are the layers whose backward reads nothing lossy and is linear in the incoming
gradient: AvgPool2d (keeps nothing), Amax and Clamp (exact 1-bit masks). Under ``create_graph=True``
their backward ops are recorded, on both paths, and the second derivative is stock's, bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod


class _GateAndValue(nn.Module):
    """GatedActivation takes (gate, x): both from the one test input."""

    def __init__(self, gated: nn.Module):
        super().__init__()
        self.gated = gated

    def forward(self, x):
        return self.gated(x, 2 * x)


def _cases():
    """(name, module, input shape): one per Python Function, the module and input shape
    that route through it."""
    return [
        ("Linear", lambda: mnn.Linear(8, 8), (2, 5, 8)),
        ("GELU", lambda: mnn.GELU(), (2, 5, 8)),
        ("LayerNorm", lambda: mnn.LayerNorm(8), (2, 5, 8)),
        ("Softmax", lambda: mnn.Softmax(-1), (2, 3, 5, 8)),
        ("ReLU", lambda: mnn.ReLU(), (2, 5, 8)),
        ("SiLU", lambda: mnn.SiLU(), (2, 5, 8)),
        ("QuickGELU", lambda: mnn.QuickGELU(), (2, 5, 8)),
        ("GatedActivation", lambda: _GateAndValue(mnn.GatedActivation(nn.SiLU())), (2, 5, 8)),
        ("RmsNorm", lambda: mnn.RmsNorm(8), (2, 5, 8)),
        ("LayerScale", lambda: mnn.LayerScale(8, init_values=0.5), (2, 5, 8)),
        ("Conv2d", lambda: mnn.Conv2d(3, 4, 3, padding=1), (2, 3, 6, 6)),
        ("BatchNorm2d", lambda: mnn.BatchNorm2d(3), (2, 3, 6, 6)),
    ]


def _loss(module, x):
    return module(x).pow(2).sum()


@pytest.mark.parametrize("name,make,shape", _cases(), ids=[c[0] for c in _cases()])
def test_create_graph_is_refused_in_one_line_and_first_order_is_unchanged(name, make, shape, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)  # the Python Function path
    torch.manual_seed(0)
    module = make().train()
    twin = copy.deepcopy(module)  # the same estimates and rounding seeds: the same codes
    x = torch.randn(shape, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^mesa: higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(_loss(module, x), x, create_graph=True)
    (plain,) = torch.autograd.grad(_loss(twin, x), x)  # first order: as before
    assert torch.isfinite(plain).all() and plain.abs().sum() > 0, name


def test_matmul_second_derivative_is_an_error(monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    a = torch.randn(2, 3, 5, 8, requires_grad=True)
    b = torch.randn(2, 3, 8, 5, requires_grad=True)
    mm = mnn.MatMul().train()
    with pytest.raises(RuntimeError, match="mesa: higher-order gradients .* through a Mesa MatMul "):
        torch.autograd.grad(mm(a, b).pow(2).sum(), (a, b), create_graph=True)


# (stock module, Mesa module, input shape): the lossless layers whose backward differentiates
_LOSSLESS = {
    "AvgPool2d": (lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
                  lambda: mnn.AvgPool2d(3, 2, 1, count_include_pad=False), (2, 3, 7, 6)),
    "Amax": (lambda: (lambda x: x.amax((2, 3), keepdim=True)),
             lambda: (lambda x, amax=mnn.Amax(): amax(x, (2, 3), True)), (2, 3, 4, 5)),
    # Gemma 4's clamp with buffer bounds: x rounded to 0.1 meets both bounds (ties: g / 2 on 2.14)
    "Clamp": (lambda: (lambda x: torch.clamp(x, torch.tensor(-0.5, dtype=x.dtype), torch.tensor(0.7, dtype=x.dtype))),
              lambda: (lambda x, clamp=mnn.Clamp(): clamp(x, torch.tensor(-0.5, dtype=x.dtype),
                                                          torch.tensor(0.7, dtype=x.dtype))), (2, 3, 4, 5)),
    # timm's anti-aliasing BlurPool2d (a fixed filter: nothing kept, both backwards on stand-ins);
    # the filter, a buffer, follows the input's dtype
    "BlurPool2d": (lambda: (lambda x, m=_timm_blur(): m.to(x.dtype)(x)),
                   lambda: (lambda x, m=mnn.BlurPool2d.from_module(_timm_blur()): m.to(x.dtype)(x)), (2, 3, 9, 8)),
}


def _timm_blur():
    from timm.layers import BlurPool2d

    return BlurPool2d(3)


@pytest.mark.parametrize("path", ["op", "python"])
@pytest.mark.parametrize("name", list(_LOSSLESS))
def test_lossless_layers_second_derivative_is_stocks(name, path, monkeypatch):
    """A gradient penalty through the layer (the gradient taken with create_graph=True, then
    differentiated again): the same first and second derivatives as stock, bit for bit, on the
    C++ layer op and on the Python Function; and gradgradcheck passes in float64."""
    if path == "op" and not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", path == "op")
    make_stock, make_mesa, shape = _LOSSLESS[name]
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # ties for Amax
    got = []
    for layer in (make_stock(), make_mesa()):
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad(layer(x).pow(3).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        got.append((gx.detach(), x.grad))
    (stock_g, stock_gg), (mesa_g, mesa_gg) = got
    assert torch.equal(stock_g, mesa_g) and torch.equal(stock_gg, mesa_gg)
    assert stock_gg.abs().sum() > 0  # the second-order term is really there
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # no ties
    assert torch.autograd.gradgradcheck(make_mesa(), (x.requires_grad_(),))
