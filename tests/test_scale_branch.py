"""A 1x1 depthwise conv straight into a train-mode BatchNorm (RepVGG / MobileOne scale branch):
the conv takes its weight gradient from the BatchNorm (``mesa_train.nn.conv.ScaleLink``).

Its exact weight gradient is zero but for the BatchNorm's eps (scale invariance); from the
8-bit conv input it was noise (FastViT cosine 0.37, RepViT -0.27)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mesa_train.patch import patch_model


class ConvNorm(nn.Sequential):  # RepViT's ConvNorm: Sequential(conv, bn)
    def __init__(self, c, stride=1):
        super().__init__()
        self.add_module("c", nn.Conv2d(c, c, 1, stride, 0, groups=c, bias=False))
        self.add_module("bn", nn.BatchNorm2d(c))


class Branches(nn.Module):
    def __init__(self, c=8, stride=1, extra_use=False):
        super().__init__()
        self.scale = ConvNorm(c, stride)
        self.conv = nn.Conv2d(c, c, 3, stride, 1, groups=c)
        self.extra_use = extra_use
        self.seen = []

    def forward(self, x):
        if self.extra_use:  # the conv output also goes elsewhere: no cancellation, no link use
            h = self.scale.c.register_forward_hook(lambda m, i, o: self.seen.append(o))
        y = self.scale(x) + self.conv(x)
        if self.extra_use:
            h.remove()
            y = y + self.seen.pop().square().mean()
        return y


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _grads(model, x, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    g = torch.Generator().manual_seed(3)
    out = model(x.to(dtype))
    (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = Branches(**kw).train()
    with torch.no_grad():
        m.scale.c.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_scale_conv_weight_gradient_matches_exact(stride, rounding):
    stock = _model(stride=stride)
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock), rounding=rounding)
    assert patched.scale.c.__dict__.get("_mesa_scale_bn") is patched.scale.bn
    torch.manual_seed(0)
    assert torch.equal(stock(x), patched(x))
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    name = "scale.c.weight"
    assert exact[name].norm() < 1e-3 * max(g.norm() for g in exact.values())  # a cancellation indeed
    assert _cos(exact[name], got[name]) > 0.999
    for n in exact:
        assert _cos(exact[n], got[n]) > 0.99, n


def test_unlinked_without_the_pattern_and_state_dict_unchanged():
    stock = _model()
    patched = patch_model(copy.deepcopy(stock))
    assert {k for k in patched.state_dict() if ".quantizer." not in k} == set(stock.state_dict())
    assert patched.conv.__dict__.get("_mesa_scale_bn") is None  # 3x3: not a scale branch


def test_other_consumer_uses_the_conv_input():
    """The conv output also feeds something else: its gradient is not the BatchNorm's, the
    closed form would be wrong; the 8-bit input is used (compared with the link removed)."""
    stock = _model(extra_use=True)
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    linked = patch_model(copy.deepcopy(stock), rounding="nearest")
    unlinked = copy.deepcopy(linked)
    del unlinked.scale.c.__dict__["_mesa_scale_bn"]
    a, b = _grads(linked, x), _grads(unlinked, x)
    assert torch.equal(a["scale.c.weight"], b["scale.c.weight"])
    exact = _grads(stock, x, torch.float64)
    assert _cos(exact["scale.c.weight"], a["scale.c.weight"]) > 0.999  # no cancellation now


def test_zero_weight_channel_falls_back_to_the_conv_input():
    stock = _model()
    with torch.no_grad():
        stock.scale.c.weight[3] = 0.0
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    gw = got["scale.c.weight"].flatten()
    assert torch.isfinite(gw).all()
    # channel 3: x_hat is 0, nothing to reconstruct x from; the 8-bit input's gradient
    assert ((gw[3] - exact["scale.c.weight"].flatten()[3]).abs()
            < 0.05 * exact["scale.c.weight"].flatten()[3].abs() + 1e-6)


def test_link_never_left_on_the_module():
    """A BatchNorm that does not compress (here: disabled) still drops the conv's hand-over,
    so nothing unpicklable stays on the model."""
    import io

    stock = _model()
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock))
    patched.scale.bn.set_quant_options(enabled=False)
    out = patched(x)
    assert "_mesa_scale_pending" not in patched.scale.bn.__dict__
    torch.save(patched, io.BytesIO())
    out.sum().backward()
    assert torch.isfinite(patched.scale.c.weight.grad).all()
