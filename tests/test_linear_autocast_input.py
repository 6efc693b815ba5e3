"""A Mesa Linear under autocast compresses the tensor stock's linear multiplies: its input
cast to the autocast dtype (DESIGN.md, "Linear under autocast"). Before, it compressed the
float32 input itself (a LayerNorm output under CUDA autocast): twice the bytes to read, and
not the tensor stock's backward keeps. The forward stays bitwise stock's; the weight gradient
is the one of a Mesa Linear fed the cast input; the input gradient keeps the input's dtype.
Both paths (the C++ node, the Python Function)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mesa_train import nn as M
from mesa_train.nn import _common, quantizer as quantizer_mod


def _pair(seed=0):
    torch.manual_seed(seed)
    stock = nn.Linear(48, 24)
    return stock, M.Linear.from_module(copy.deepcopy(stock))  # (from_module adopts the parameters)


@pytest.mark.parametrize("path", ["fused", "python"])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_linear_compresses_the_cast_input(path, amp, monkeypatch):
    if path == "python":
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    x = torch.randn(3, 7, 48) * 2
    stock, mesa = _pair()
    _, mesa_cast = _pair()
    with torch.no_grad():  # the same rounding stream (a new layer draws its own key)
        mesa_cast.quantizer.rng.copy_(mesa.quantizer.rng)
    ys, ym, yc = [], [], []
    xs = [x.clone().requires_grad_() for _ in range(3)]
    with torch.autocast("cpu", dtype=amp):
        for _ in range(2):  # (the second step: initialised estimates)
            for m in (stock, mesa, mesa_cast):
                m.zero_grad()
            ys = stock(xs[0])
            ym = mesa(xs[1])
            yc = mesa_cast(xs[2].to(amp))  # the cast made by hand
            for y in (ys, ym, yc):
                y.float().pow(2).sum().backward()
    assert torch.equal(ym, ys)  # forward: stock's bits
    # the saved copy is the cast input's: the same weight gradient as when fed the cast
    assert torch.equal(mesa.weight.grad, mesa_cast.weight.grad)
    assert xs[1].grad.dtype == torch.float32 and torch.equal(xs[1].grad, xs[0].grad)
    cos = torch.nn.functional.cosine_similarity(mesa.weight.grad.flatten(), stock.weight.grad.flatten(), dim=0)
    assert cos > 0.999


def test_autocast_input_rule():
    x = torch.randn(4, 8)
    assert _common.autocast_input(x) is x  # no autocast: no cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _common.autocast_input(x).dtype == torch.bfloat16
        xb = x.to(torch.bfloat16)
        assert _common.autocast_input(xb) is xb
        xd = x.double()
        assert _common.autocast_input(xd) is xd  # autocast leaves float64 alone
        xi = torch.ones(3, dtype=torch.int64)
        assert _common.autocast_input(xi) is xi
