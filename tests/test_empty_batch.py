"""An empty batch in training (a detection mask head with GroupNorm that gets no RoIs in a
step, an MoE expert that gets no tokens) runs as stock does: an empty output and zero
gradients. The Mesa GroupNorm and BatchNorms raised from their grouped statistics of nothing
(a reshape of 0 elements, an index out of range, 'code_moments: the codes are empty'); every
Mesa layer now takes the stock path for an empty input (MesaLayer._mesa_active)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mesa_train.nn import MesaLayer
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

MODELS = {
    "conv_groupnorm_relu": (lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU()),
                            (0, 8, 6, 6)),
    "groupnorm_no_affine": (lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8, affine=False)),
                            (0, 8, 6, 6)),
    "conv_batchnorm2d_silu_pool": (lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
                                                         nn.MaxPool2d(2), nn.AvgPool2d(2)), (0, 8, 8, 8)),
    "linear_batchnorm1d": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), (0, 8)),
    "linear_layernorm_gelu": (lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)),
                              (0, 5, 8)),
    "linear_without_outputs": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 0)), (3, 8)),
}
PATHS = [pytest.param(True, id="cpp", marks=pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS,
                                                                 reason="needs the compiled extension")),
         pytest.param(False, id="python")]


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_empty_batch_trains_as_stock(name, fused, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    make, shape = MODELS[name]
    torch.manual_seed(0)
    stock = make().train()
    mesa = patch_model(copy.deepcopy(stock))
    assert any(isinstance(m, MesaLayer) for m in mesa.modules())
    outs = []
    for model in (stock, mesa):
        x = torch.randn(shape, requires_grad=True)
        y = model(x)
        y.sum().backward()
        outs.append((y, x.grad, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_x, want_p), (got, got_x, got_p) = outs
    assert got.shape == want.shape and got_x.shape == want_x.shape
    for n, g in want_p.items():
        assert torch.equal(got_p[n], g), n
    # and the next, non-empty batch compresses as usual
    x = torch.randn((2,) + shape[1:])
    mesa(x).sum().backward()
