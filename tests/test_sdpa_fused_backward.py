"""The compiled backward of Mesa's fused attention: ``_fused_attention_backward`` calls a
fused kernel pair (CPU: flash; CUDA: memory-efficient) instead of the float32 formula
whose (B, H, L, S) map made compiled fused attention slower than eager on an H200
(results/gpu-session/README.md). Checked against autograd through F.scaled_dot_product_attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mesa_train.nn import sdpa


def _autograd(q, k, v, g, is_causal, scale):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    return torch.autograd.grad(out, (q, k, v), g)


def _qkvg(device, dtype, L=13, S=13, E=16, gen=0):
    torch.manual_seed(gen)
    q = torch.randn(2, 3, L, E, device=device, dtype=dtype)
    k, v = (torch.randn(2, 3, S, E, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(2, 3, L, E, device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal,L,S,scale", [(False, 13, 13, None), (True, 13, 13, None),
                                                 (False, 13, 5, 0.3)])  # PVT: keys reduced
def test_cpu_pair_is_eager_autograd_bitwise(dtype, is_causal, L, S, scale):
    q, k, v, g = _qkvg("cpu", dtype, L, S)
    got = sdpa._fused_attention_backward(q, k, v, is_causal, scale, g)
    assert got is not None
    for a, b in zip(got, _autograd(q, k, v, g, is_causal, scale)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def test_no_pair_where_the_kernels_do_not_apply():
    q, k, v, g = _qkvg("cpu", torch.float32, E=12)  # rows not a multiple of 8 elements
    assert sdpa._fused_attention_backward(q, k, v, False, None, g) is None
    q, k, v, g = _qkvg("cpu", torch.float32)
    assert sdpa._fused_attention_backward(q, k.double(), v, False, None, g) is None  # mixed dtypes
    assert sdpa._fused_attention_backward(q[0], k[0], v[0], False, None, g[0]) is None  # 3-D
    assert sdpa._fused_attention_backward(q.double(), k.double(), v.double(), False, None, g) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pair_signature_on_meta_tensors(dtype):
    """The CUDA pair's op schemas (the same in torch 2.11 and 2.14), shapes and dtypes,
    checked without a GPU through the ops' meta kernels."""
    q, k, v, g = (t.to("meta") for t in _qkvg("cpu", dtype, 13, 7))
    gq, gk, gv = sdpa._efficient_attention_pair(q, k, v, g, False, None)
    assert (gq.shape, gk.shape, gv.shape) == (q.shape, k.shape, v.shape)
    assert gq.dtype == gk.dtype == gv.dtype == dtype


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_pair_matches_autograd(dtype, tol, is_causal):
    """Eager picks its own backend (cuDNN or flash on Hopper), the pair is the memory-efficient
    kernel: the same gradient up to each kernel's rounding."""
    q, k, v, g = _qkvg("cuda", dtype, 197, 197, 64)
    got = sdpa._fused_attention_backward(q, k, v, is_causal, None, g)
    for a, b in zip(got, _autograd(q, k, v, g, is_causal, None)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert a.dtype == dtype and rel < tol, rel
