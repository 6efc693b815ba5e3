"""The Mesa BatchNorms and GroupNorm on a channel (group) whose variance is far below eps.

With eps 1e-3 (torchvision's MobileNetV3 and EfficientNet, timm's ``tf_*`` ports) and a std of
1e-6, the exact x_hat's mean square ``var / (var + eps)`` is under float32's resolution and
came out 0, while the dequantized x_hat kept a variance from rounding: the re-standardising
factor was 0 and backward divided by it (``restandardise`` in mesa_train/nn/batchnorm.py and
csrc/convnet_autograd.cpp). The input gradient was NaN there, and one NaN channel reached
126 of MobileNetV3-small's 142 parameter gradients. Checks: every gradient finite, the quiet
channel's close to stock's (its exact x_hat is ~0, so 8-bit rounding costs it nothing), the
C++ node bitwise the Python Function, and the whole MobileNetV3-small step finite.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

PATHS = [pytest.param(True, id="cpp", marks=pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS,
                                                                 reason="needs the compiled extension")),
         pytest.param(False, id="python")]


def _bn2d():
    return nn.BatchNorm2d(8, eps=1e-3), mnn.BatchNorm2d(8, eps=1e-3), (2, 8, 1, 1)


def _bn1d():
    return nn.BatchNorm1d(8, eps=1e-3), mnn.BatchNorm1d(8, eps=1e-3), (2, 8)


def _gn():
    return nn.GroupNorm(2, 8, eps=1e-3), mnn.GroupNorm(2, 8, eps=1e-3), (2, 8, 4, 4)


NORMS = {"batchnorm2d": _bn2d, "batchnorm1d": _bn1d, "groupnorm": _gn}


def _input(name: str, shape, std: float) -> tuple[torch.Tensor, tuple]:
    """Random values with one quiet part of std ``std`` around 0.3: channel 3 for a BatchNorm,
    sample 0's first group for the GroupNorm; also the index of that part."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quiet = (slice(None), 3) if name.startswith("batchnorm") else (0, slice(0, 4))
    x[quiet] = 0.3 + std * torch.randn(x[quiet].shape, generator=torch.Generator().manual_seed(1))
    return x, quiet


def _input_grad(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    return x.grad


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("std", [1e-6, 1e-8, 0.0])
@pytest.mark.parametrize("name", list(NORMS))
def test_quiet_channel_gradient_is_finite_and_stock(name, std, fused, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    stock, mesa, shape = NORMS[name]()
    with torch.no_grad():  # (not the initial ones and zeros)
        stock.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
        stock.bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(4))
    mesa.load_state_dict(stock.state_dict(), strict=False)
    x, quiet = _input(name, shape, std)
    want, got = _input_grad(stock, x), _input_grad(mesa, x)
    assert got.isfinite().all(), f"{int((~got.isfinite()).sum())} non-finite input-gradient entries"
    assert all(p.grad.isfinite().all() for p in mesa.parameters())
    torch.testing.assert_close(got[quiet], want[quiet], rtol=1e-4, atol=1e-4 * want[quiet].abs().max().item())


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
@pytest.mark.parametrize("name", list(NORMS))
def test_quiet_channel_cpp_node_is_bitwise_the_python_function(name, monkeypatch):
    grads = []
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        _, mesa, shape = NORMS[name]()
        mesa.quantizer.rng.copy_(torch.tensor([55, 0]))  # (the same rounding draws)
        x, _ = _input(name, shape, 1e-6)
        grads.append(_input_grad(mesa, x))
    assert torch.equal(grads[0], grads[1])


def test_mobilenet_v3_small_step_is_finite():
    """torchvision's MobileNetV3-small at 32 px, batch 2: blocks 10 and 11 see (2, C, 1, 1)
    maps under eps 1e-3, where some channels barely vary."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = patch_model(torchvision.models.mobilenet_v3_small()).train()
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not bad, f"{len(bad)} non-finite parameter gradients, first {bad[:3]}"
