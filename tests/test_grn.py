"""Mesa ``GlobalResponseNorm`` (mesa_train/nn/grn.py; ConvNeXt-V2's MLP): forward bitwise
timm's in both layouts and under bf16 autocast; the backward formula exact when the 8-bit
copy is replaced by the true input (zero-norm channels included); gradients close with the
8-bit copy and the weight gradient unbiased over rounding draws; one 8-bit copy saved instead
of two full-precision ones; patched ConvNeXt-V2 converts every GRN and stays bitwise stock."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers.grn import GlobalResponseNorm as TimmGRN

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import grn as grn_mod
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model
from shared_copies import cos

LAYOUTS = {"channels_last": (True, (4, 6, 5, 24)), "channels_first": (False, (4, 24, 6, 5))}


def _pair(layout):
    channels_last, shape = LAYOUTS[layout]
    torch.manual_seed(0)
    stock = TimmGRN(24, channels_last=channels_last).train()
    with torch.no_grad():  # timm initialises both to zero: the GRN term would vanish
        stock.weight.normal_()
        stock.bias.normal_()
    x = torch.randn(shape) * torch.logspace(-1, 1, 24).view(stock.wb_shape)  # channels of different scale
    return stock, mn.GlobalResponseNorm.from_module(copy.deepcopy(stock), num_groups=4), x


def _grads(module, x, g):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with SavedTensorMeter(module) as meter:
        y = module(x)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad, meter.activation_bytes


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_bitwise_and_one_8bit_copy(layout):
    stock, mesa, x = _pair(layout)
    g = torch.randn_like(x)
    ref, got = _grads(stock, x, g), _grads(mesa, x, g)
    assert torch.equal(ref[0], got[0])
    assert all(cos(a, b) >= 0.999 for a, b in zip(ref[1:4], got[1:4])), [cos(a, b) for a, b in zip(ref[1:4], got[1:4])]
    # stock keeps x and x * x_n in float32 (8 bytes an element); here 1 byte an element plus
    # the per-(sample, channel) norms and the group statistics
    assert got[4] < x.numel() * 1.5 and ref[4] >= 8 * x.numel()
    mesa.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), mesa(x))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_backward_formula_exact_with_the_true_input(layout, monkeypatch):
    """With the copy's dequantization replaced by the true input, every gradient equals stock
    autograd's to float32 rounding: the formula in grn.py is the derivative (the term through
    the channel mean, and zero-norm channels where torch's norm gives 0, included)."""
    stock, mesa, x = _pair(layout)
    channel = 1 if layout == "channels_first" else -1
    x.select(channel, 3)[0].zero_()  # one (sample, channel) with norm 0
    monkeypatch.setattr(grn_mod, "decompress", lambda packed, dtype: x.to(dtype))
    # the Python Function, whose dequantization this swaps (the C++ op is its bits:
    # tests/test_grn_autograd.py)
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    g = torch.randn_like(x)
    ref, got = _grads(stock, x, g), _grads(mesa, x, g)
    for a, b in zip(ref[1:4], got[1:4]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_weight_gradient_averages_to_exact():
    """The 8-bit copy's rounding is unbiased: the mean of 64 draws of the weight gradient is
    about 8x closer to stock's than a typical draw (the root-mean-square error of one; a
    bias would not shrink with the count)."""
    stock, mesa, x = _pair("channels_last")
    g = torch.randn_like(x)
    exact = _grads(stock, x, g)[2]
    draws = torch.stack([_grads(mesa, x, g)[2] for _ in range(64)])
    one = (draws - exact).norm(dim=1).square().mean().sqrt()
    mean = (draws.mean(0) - exact).norm()
    assert mean < one / 4, (float(one), float(mean))


def test_bf16_autocast_forward_bitwise():
    stock, mesa, x = _pair("channels_last")
    g = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _grads(stock, x, g), _grads(mesa, x, g)
    assert torch.equal(ref[0], got[0])
    assert got[1].dtype == x.dtype and got[2].dtype == stock.weight.dtype
    assert all(cos(a, b) >= 0.99 for a, b in zip(ref[1:4], got[1:4]))


@pytest.mark.parametrize("conv_mlp", [True, False], ids=["conv-mlp", "linear-mlp"])
def test_convnext_v2_patched_bitwise_stock(conv_mlp):
    torch.manual_seed(0)
    stock = timm.create_model("convnextv2_atto", pretrained=False, depths=(1, 1, 1, 1), num_classes=10,
                              drop_path_rate=0.1, conv_mlp=conv_mlp).train()
    model = patch_model(copy.deepcopy(stock))
    grns = [m for m in model.modules() if isinstance(m, TimmGRN)]
    assert len(grns) == 4 and all(type(m) is mn.GlobalResponseNorm for m in grns)
    assert all(type(m) is TimmGRN for m in patch_model(copy.deepcopy(stock), ops=["gelu"]).modules()
               if isinstance(m, TimmGRN))
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    out = model(x)
    torch.manual_seed(1)
    assert torch.equal(out, stock(x))
    assert model.stages[0].blocks[0].mlp.grn.weight is not stock.stages[0].blocks[0].mlp.grn.weight
    assert set(dict(model.named_parameters())) == set(dict(stock.named_parameters()))
