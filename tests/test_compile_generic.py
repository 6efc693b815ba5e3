"""torch.compile(fullgraph=True, backend="aot_eager") of timm models reached through the
generic attention's capture (a TorchFunctionMode entered inside the module's forward) and the gated
MLP layer, in train mode: zero graph breaks (``torch._dynamo.explain``), forward equal to
eager Mesa and to stock, gradients close to eager Mesa.

EVA-02 (rope, SwiGLU, fused sdpa intercepted) runs by default; BEiT (relative-position bias,
explicit path, layer scale, F.linear qkv) and SwinV2 (cosine attention: normalize, logit scale,
recomputed position MLP) with ``MESA_SLOW_TESTS=1`` (one to two minutes each on 2 CPU cores).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from mesa_train.nn import GatedActivation
from mesa_train.patch import patch_model

from timm_zoo import build, example

RUN_SLOW = os.environ.get("MESA_SLOW_TESTS") == "1"


def _loss(out):
    g = torch.Generator().manual_seed(7)
    return (out * torch.randn(out.shape, generator=g)).sum()


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "beit_base_patch16_224", "swinv2_tiny_window8_256"])
def test_generic_attention_fullgraph_train_step(name):
    if name != "eva02_tiny_patch14_224" and not RUN_SLOW:
        pytest.skip("MESA_SLOW_TESTS=1 runs this model too")
    torch._dynamo.reset()
    stock = build(name)
    model = patch_model(copy.deepcopy(stock), ops=("all",), rounding="nearest")
    eager = copy.deepcopy(model)
    x = example(name)

    report = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert report.graph_break_count == 0 and report.graph_count == 1, [str(r.reason) for r in report.break_reasons]

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    _loss(out).backward()
    ref = eager(x)
    _loss(ref).backward()
    assert torch.equal(out, ref) and torch.equal(ref, stock(x))
    got, want = dict(model.named_parameters()), dict(eager.named_parameters())
    for n, p in want.items():
        if p.grad is None:
            continue
        a, b = got[n].grad.double().flatten(), p.grad.double().flatten()
        assert torch.isfinite(a).all(), n
        den = a.norm() * b.norm()
        cos = (a @ b / den).item() if den > 0 else float(a.norm() == b.norm())
        assert cos > 0.9999, f"{n}: cosine {cos:.6f} against eager Mesa"


@pytest.mark.parametrize("act", [torch.nn.SiLU(), torch.nn.Sigmoid(), torch.nn.GELU(), torch.nn.GELU("tanh"),
                                 torch.nn.Tanh()])
def test_gated_backward_closed_form_matches_autograd(act, monkeypatch):
    """The gate's derivative is written out for the usual activations (``torch.autograd.grad``
    inside a backward cannot be traced by torch.compile); it equals the autograd path (still
    used for any other activation) at the same saved codes."""
    import mesa_train.nn.activations as acts

    torch.manual_seed(0)
    layer = GatedActivation(act)
    twin = copy.deepcopy(layer)  # same estimates and rounding seeds: same codes
    a = torch.randn(4, 6, 8, requires_grad=True)
    b = torch.randn(4, 6, 8, requires_grad=True)
    g = torch.randn(4, 6, 8)
    layer(a, b).backward(g)
    closed = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    monkeypatch.setattr(acts, "_has_closed_form", lambda act: False)
    twin(a, b).backward(g)
    torch.testing.assert_close(closed[0], a.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(closed[1], b.grad)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_string_padding_conv_compiles_fullgraph(padding):
    """A Mesa Conv2d with ``padding='same'`` / ``'valid'`` (ConvMixer's depthwise convs) takes
    its backward from ``convolution_backward`` with the padding as ints, not from autograd
    re-derived inside the backward, which torch.compile cannot trace ("tensor creation
    function with requires_grad=True"); the gradients are eager Mesa's bits."""
    import mesa_train.nn as mn

    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = mn.Conv2d.from_module(torch.nn.Conv2d(8, 8, 5, padding=padding, dilation=2, groups=8), rounding="nearest")
    eager = copy.deepcopy(conv)
    x = torch.randn(2, 8, 11, 11)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out = torch.compile(conv, backend="aot_eager", fullgraph=True)(xs[0])
    ref = eager(xs[1])
    _loss(out).backward()
    _loss(ref).backward()
    assert torch.equal(out, ref)
    assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(conv.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_functional_softmax_routed_in_eager_as_under_compile():
    """``F.softmax(x, dim=-1)`` reaches the capture with its defaults as keywords
    (``dtype=None``, ``_stacklevel``); eager left it stock while Dynamo's trace routed it, so a
    compiled model (MobileViTv2's LinearSelfAttention) differed from eager Mesa (2.5e-3 of the
    largest gradient with round-to-nearest). Now both compress it: the same gradients."""
    import torch.nn.functional as F

    class FunctionalAttention(torch.nn.Module):
        def __init__(self, c=16):
            super().__init__()
            self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.proj(F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)

    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = FunctionalAttention()
    model = patch_model(copy.deepcopy(stock), rounding="nearest")
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    ref = eager(x)
    _loss(out).backward()
    _loss(ref).backward()
    assert torch.equal(out, ref) and torch.equal(ref, stock(x))
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert eager.mesa_softmax.quantizer.initialized.all(), "eager never compressed the map"
