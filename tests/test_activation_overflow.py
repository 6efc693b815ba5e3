"""QuickGELU (CLIP) in float16 near the top of its range: its derivative
``s * (1 + 1.702 x (1 - s))`` overflowed at ``1.702 * x`` past |x| ~ 38.5k, and ``inf * 0`` was
NaN where stock's autograd gives 0 or 1 (finite inputs, a NaN gradient). It is now computed in
float32 (activations._quick_gelu_grad and its C++ twins), plain and gated (SwiGLU-style
``act(gate) * x``), on the C++ node and the Python Function alike."""
from __future__ import annotations

import pytest
import timm.layers
import torch

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod

PATHS = [pytest.param(True, id="cpp", marks=pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS,
                                                                 reason="needs the compiled extension")),
         pytest.param(False, id="python")]
X = [[-40000.0, -1.0, 0.0, 0.5, 2.0, 39008.0, 60000.0, 3.0]]


def _grads(stock_fn, mesa_fn, dtype):
    out = []
    for fn in (stock_fn, mesa_fn):
        x = torch.tensor(X, dtype=dtype, requires_grad=True)
        y = fn(x)
        y.float().sum().backward()
        out.append((y.detach(), x.grad))
    return out


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_quick_gelu_gradient_is_finite_at_the_top_of_the_range(gated, dtype, fused, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    if gated:
        ones = torch.ones(1, 8, dtype=dtype)
        stock_fn = lambda x: timm.layers.QuickGELU()(x) * ones  # noqa: E731
        mesa_fn = lambda x: mnn.GatedActivation(timm.layers.QuickGELU()).train()(x, ones)  # noqa: E731
    else:
        stock_fn, mesa_fn = timm.layers.QuickGELU(), mnn.QuickGELU().train()
    (want_y, want), (got_y, got) = _grads(stock_fn, mesa_fn, dtype)
    assert torch.equal(got_y, want_y)
    assert got.isfinite().all(), got
    # the tails: 0 below, 1 above (stock's); the rest within 8-bit rounding of the input
    torch.testing.assert_close(got[0, [0, 5, 6]].float(), torch.tensor([0.0, 1.0, 1.0]))
