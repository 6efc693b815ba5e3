"""The compiled backward of Mesa's fused attention: ``mesa::sdpa_recompute_backward``
(mesa_train/nn/sdpa_backward.py) runs autograd through the stock
``F.scaled_dot_product_attention`` at run time, so the backend is the stock dispatcher's
choice (cuDNN on an H100, where the traced memory-efficient pair it replaced took twice as
long), masks and their gradients included. Checked against autograd through the stock call,
bit for bit; the fake kernel against the real one; PyTorch's opcheck; the C++ kernel (the
extension's) against the Python one it replaced."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mesa_train.nn.sdpa  # noqa: F401  (registers the op)
from mesa_train.nn import sdpa_backward
from mesa_train.nn.sdpa_backward import build_window_mask
from kernel_marks import needs_ext

_OP = torch.ops.mesa.sdpa_recompute_backward.default


def _qkvg(device, dtype, L=13, S=13, E=16, B=4, H=3, gen=0):
    torch.manual_seed(gen)
    q = torch.randn(B, H, L, E, device=device, dtype=dtype)
    k, v = (torch.randn(B, H, S, E, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(B, H, L, E, device=device, dtype=dtype)


def _autograd(q, k, v, g, attn_mask=None, window_mask=None, is_causal=False, scale=None, mask_grad=False):
    """The stock call differentiated by autograd: what eager Mesa's backward computes."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if attn_mask is not None:
        attn_mask = attn_mask.detach().requires_grad_(mask_grad)
        if mask_grad:
            leaves.append(attn_mask)
    mask = build_window_mask(attn_mask, window_mask, q.shape[0], q.shape[1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return torch.autograd.grad(out, leaves, g.to(out.dtype))


def _masks(kind, q, S):
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    torch.manual_seed(1)
    if kind == "none":
        return None, None, False
    if kind == "bool":  # a padding mask: no gradient
        keep = torch.rand(B, 1, L, S) > 0.2
        keep[..., 0] = True
        return keep, None, False
    if kind == "bias":  # BEiT's relative position bias: a gradient
        return torch.randn(1, H, L, S, dtype=q.dtype), None, True
    if kind == "windows":  # Swin: relative position bias plus the (nW, N, N) shifted-window mask
        win = torch.where(torch.rand(2, L, S) > 0.3, 0.0, -100.0).to(q.dtype)
        return torch.randn(1, H, L, S, dtype=q.dtype), win, True
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool", "bias", "windows"])
@pytest.mark.parametrize("is_causal,L,S,scale", [(False, 13, 13, None), (True, 13, 13, None),
                                                 (False, 13, 5, 0.3)])  # PVT: keys reduced
def test_op_is_autograd_through_the_stock_call_bitwise(dtype, mask, is_causal, L, S, scale):
    if is_causal and mask != "none":
        pytest.skip("sdpa takes either a mask or is_causal")
    if mask == "windows" and L != S:
        pytest.skip("Swin's windows attend within themselves (L == S)")
    q, k, v, g = _qkvg("cpu", dtype, L, S)
    attn_mask, window_mask, mask_grad = _masks(mask, q, S)
    want = _autograd(q, k, v, g, attn_mask, window_mask, is_causal, scale, mask_grad)
    with torch.no_grad():  # as in a backward: the op turns grad mode on itself
        got = _OP(g, q, k, v, attn_mask, window_mask, is_causal, scale, [True, True, True, mask_grad], False, None)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
        assert torch.equal(a, b)


def test_op_returns_only_the_wanted_gradients_in_order():
    q, k, v, g = _qkvg("cpu", torch.float32)
    bias, _, _ = _masks("bias", q, 13)
    gq, gk, gv, gm = _autograd(q, k, v, g, bias, mask_grad=True)
    got = _OP(g, q, k, v, bias, None, False, None, [False, True, False, True], False, None)
    assert len(got) == 2 and torch.equal(got[0], gk) and torch.equal(got[1], gm)
    assert _OP(g, q, k, v, None, None, False, None, [False] * 4, False, None) == []


def test_op_names_a_bad_output_mask():
    q, k, v, g = _qkvg("cpu", torch.float32)
    with pytest.raises(ValueError, match="one flag per input"):
        _OP(g, q, k, v, None, None, False, None, [True, True, True], False, None)
    with pytest.raises(ValueError, match="attn_mask is None"):
        _OP(g, q, k, v, None, None, False, None, [True, True, True, True], False, None)
    keep, _, _ = _masks("bool", q, 13)
    with pytest.raises(ValueError, match="torch.bool; only a floating mask"):
        _OP(g, q, k, v, keep, None, False, None, [True, True, True, True], False, None)


def test_op_reenters_the_forwards_autocast():
    """Under bf16 autocast the forward ran the attention in bfloat16 on float32 inputs: the
    recomputation does too (its gradients are those of the bf16 call, cast back)."""
    q, k, v, g = _qkvg("cpu", torch.float32)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(qq, kk, vv)
    want = torch.autograd.grad(out, (qq, kk, vv), g.to(out.dtype))
    got = _OP(g, q, k, v, None, None, False, None, [True] * 3 + [False], True, torch.bfloat16)
    plain = _OP(g, q, k, v, None, None, False, None, [True] * 3 + [False], False, None)
    for a, b, c in zip(got, want, plain):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_fake_kernel_states_the_real_outputs():
    q, k, v, g = _qkvg("cpu", torch.bfloat16, 13, 13)
    bias, win, _ = _masks("windows", q, 13)
    args = (False, None, [True, False, True, True], False, None)
    real = _OP(g, q, k, v, bias, win, *args)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (g, q, k, v, bias, win)]
        fake = _OP(*fakes, *args)
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


@pytest.mark.parametrize("mask", ["none", "windows"])
def test_opcheck(mask):
    q, k, v, g = _qkvg("cpu", torch.float32, 13, 13, 8, B=2, H=2)
    attn_mask, window_mask, mask_grad = _masks(mask, q, 13)
    torch.library.opcheck(_OP, (g, q, k, v, attn_mask, window_mask, False, None, [True, True, True, mask_grad],
                                False, None))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bias"])
def test_cuda_op_is_autograd_through_the_stock_call(dtype, mask):
    """On a GPU the op runs the backend stock picks (cuDNN or flash on Hopper), at run time:
    the gradients are autograd's through the stock call, bit for bit."""
    q, k, v, g = _qkvg("cuda", dtype, 197, 197, 64, B=8, H=6)
    attn_mask, _, mask_grad = _masks(mask, q.cpu(), 197)
    attn_mask = attn_mask.cuda() if attn_mask is not None else None
    want = _autograd(q, k, v, g, attn_mask, None, False, None, mask_grad)
    with torch.no_grad():
        got = _OP(g, q, k, v, attn_mask, None, False, None, [True, True, True, mask_grad], False, None)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_op_under_a_dispatch_mode():
    """A dispatch mode (a FLOP counter, scripts/op_census.py) hands kernels their call below
    autograd; the op's recomputation still runs autograd and returns the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v, g = _qkvg("cpu", torch.float32)
    bias, _, _ = _masks("bias", q, 13)
    args = (g, q, k, v, bias, None, False, None, [True, True, True, True], False, None)
    with Passthrough():
        got = _OP(*args)
    for a, b in zip(got, _autograd(q, k, v, g, bias, mask_grad=True)):
        assert torch.equal(a, b)


@needs_ext
def test_the_extension_serves_the_op_in_cpp():
    """With the extension the op's kernel is C++ (csrc/sdpa_autograd.cpp: about a third of the
    Python kernel's host time); the fake kernel stays Python's."""
    dump = torch._C._dispatch_dump("mesa::sdpa_recompute_backward")
    kernels = {line.split(":")[0]: line for line in dump.splitlines() if "registered at" in line}
    assert "sdpa_autograd.cpp" in kernels["CompositeExplicitAutograd[alias]"], dump
    assert "fallthrough" in kernels["Autograd[alias]"], dump
    assert "sdpa_backward.py" in kernels["Meta"], dump


@pytest.mark.parametrize("mask", ["none", "bool", "windows"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_python_fallback_kernel_equals_the_op(mask, autocast):
    """The Python kernel (the op where the extension lacks it) gives the op's gradients, bit for
    bit, masks and autocast included."""
    q, k, v, g = _qkvg("cpu", torch.float32)
    attn_mask, window_mask, mask_grad = _masks(mask, q, 13)
    args = (g, q, k, v, attn_mask, window_mask, False, None, [True, False, True, mask_grad], autocast,
            torch.bfloat16 if autocast else None)
    want = _OP(*args)
    got = sdpa_backward._op_kernel(*args)
    assert len(got) == len(want) == 2 + mask_grad
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)
