"""One compressed copy shared by Softmax (producer) and MatMul (consumer, attn @ v)."""
from __future__ import annotations

import gc
import warnings

import torch

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import sharing

warnings.filterwarnings("ignore", message=".*compiled extension.*")


class Attn(torch.nn.Module):
    def __init__(self, heads=2):
        super().__init__()
        self.softmax = mn.Softmax(-1, num_groups=heads)
        self.av = mn.MatMul(num_groups=heads)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, s, v):
        return self.av(self.drop(self.softmax(s)), v)


def _measure(model, s, v):
    with SavedTensorMeter(model) as meter:
        out = model(s.detach().requires_grad_(), v.detach().requires_grad_())
    return meter, out


def test_softmax_output_shared_with_matmul():
    torch.manual_seed(0)
    model = Attn()
    s, v = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 8)
    shared, out1 = _measure(model, s, v)
    with sharing.disabled():
        separate, out2 = _measure(model, s, v)
    assert torch.equal(out1, out2)
    attn_bytes = s.numel()  # one uint8 copy of the attention map
    assert separate.per_module["av"] - shared.per_module["av"] >= attn_bytes
    assert shared.per_module["softmax"] == separate.per_module["softmax"]
    assert separate.activation_bytes - shared.activation_bytes >= attn_bytes
    # gradients with the shared copy are still close to exact
    sr, vr = s.clone().requires_grad_(), v.clone().requires_grad_()
    exact = torch.autograd.grad(torch.softmax(sr, -1) @ vr, (sr, vr), torch.ones_like(out1))
    ss, vs = s.clone().requires_grad_(), v.clone().requires_grad_()
    approx = torch.autograd.grad(model(ss, vs), (ss, vs), torch.ones_like(out1))
    for a, e in zip(approx, exact):
        assert (a - e).norm() / e.norm() < 0.03


def test_cache_entries_die_with_the_tensor_and_check_versions():
    sm = mn.Softmax(-1, num_groups=2)
    x = torch.randn(2, 2, 4, 4, requires_grad=True)
    y = sm(x)
    assert sharing.take(y, 1, 2) is not None
    assert sharing.take(y, 1, 1) is None  # other grouping
    assert sharing.take(y.detach().clone(), 1, 2) is None  # other memory
    with torch.no_grad():
        y.mul_(1.0)  # in-place change bumps the version
    assert sharing.take(y, 1, 2) is None
    del y
    gc.collect()
    assert sharing.size() == 0


def test_share_only_matmul_keeps_the_map_once_in_8_bits():
    """Softmax compressed, matmul not (paper Table 7 "Softmax" row): ``MatMul(operands=())``
    keeps the attention map through the Softmax's shared int8 copy and ``v`` in full
    precision, as the stock matmul does."""
    torch.manual_seed(0)
    heads = 2
    s, v = torch.randn(2, heads, 16, 16), torch.randn(2, heads, 16, 8)

    class SoftmaxOnly(torch.nn.Module):
        def __init__(self, av):
            super().__init__()
            self.softmax = mn.Softmax(-1, num_groups=heads)
            self.av = av

        def forward(self, s, v):
            return self.av(self.softmax(s), v)

    model = SoftmaxOnly(mn.MatMul(operands=(), num_groups=heads))
    meter, out = _measure(model, s, v)
    assert model.av.last_saved == ("shared", "full")
    assert meter.per_module["softmax"] == s.numel() + 2 * heads * 4  # uint8 map + (1, G) alpha, beta
    assert meter.per_module["av"] == v.numel() * 4  # v as the stock matmul keeps it, no map copy
    with SavedTensorMeter() as m_stock:
        sr, vr = s.clone().requires_grad_(), v.clone().requires_grad_()
        torch.softmax(sr, -1) @ vr
    assert meter.activation_bytes < m_stock.activation_bytes  # map: fp32 -> uint8, v unchanged
    assert m_stock.activation_bytes - meter.activation_bytes == s.numel() * 3 - 2 * heads * 4
    # gradients: v's is exact up to the map's rounding, s's close
    sr, vr = s.clone().requires_grad_(), v.clone().requires_grad_()
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    exact = torch.autograd.grad(torch.softmax(sr, -1) @ vr, (sr, vr), gout)
    ss, vs = s.clone().requires_grad_(), v.clone().requires_grad_()
    approx = torch.autograd.grad(model(ss, vs), (ss, vs), gout)
    for a, e in zip(approx, exact):
        assert (a - e).norm() / e.norm() < 0.03
    # without a shared copy (sharing off / a dropout in between) it is exactly the stock op
    with sharing.disabled():
        exact2 = torch.autograd.grad(model(ss, vs), (ss, vs), gout)
    assert model.av.last_saved == ("full", "full")
    assert torch.equal(exact2[1], exact[1])
