"""Strided inputs read in place (csrc/mesa_common.h, "strided inputs"): the q, k, v that timm's
attention unbinds from one qkv tensor are strided views; the CUDA observe, group_minmax,
quantize and quantize_observe kernels read them where they lie instead of a contiguous copy
(1.1 ms of copies a DeiT-S step on an H100, 36 launches). The results must be those of the
contiguous copy, bit for bit, and no copy may be allocated. The kernels' addressing is also
checked without a GPU by the host emulation (tests/test_cuda_host_emulation.py: the
``*_strided`` cases); on CPU the ops copy, as before, and agree too."""
from __future__ import annotations

import pytest
import torch

import mesa_train.quant  # noqa: F401  (registers the ops)

M = torch.ops.mesa


def _views(device, dtype, B=4, N=13, H=3, E=32):
    """q, k, v as timm's Attention makes them: (B, N, 3, H, E) -> permute -> unbind."""
    torch.manual_seed(0)
    qkv = torch.randn(B, N, 3, H, E, device=device, dtype=dtype) * 3
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _state(G, device, seed=7):
    return [torch.zeros(G, device=device), torch.zeros(G, device=device),
            torch.zeros((), dtype=torch.bool, device=device),
            torch.tensor([seed, 0], dtype=torch.int64, device=device)]


def _compress(x, G, path):
    """One compression of x from a fresh state along ``path`` (the running or delayed
    estimator's ops, or mesa::compress): (codes, alpha, beta, the state after)."""
    st = _state(G, x.device)
    if path == "one_op":  # mesa::compress, as ActivationQuantizer.compress calls it
        q, alpha, beta, _ = M.compress(x, *st, 1, G, 0.9, 0, False, True, 0, 0)
        return [q, alpha, beta] + st
    if path == "delayed":
        out = []
        for _ in range(2):  # the first batch initializes; the second quantizes with the estimates
            out = list(M.quantize_observe(x, *st, 1, G, 0.9, False, True))
        return out + st
    alpha, beta, seed = M.observe(x, *st, 1, G, 0.9, False, False)
    return [M.quantize(x, alpha, beta, 1, G, True, seed), alpha, beta] + st


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)


@pytest.mark.parametrize("path", ["running", "delayed", "one_op"])
def test_cpu_strided_views_match_their_contiguous_copies(path):
    for x in _views("cpu", torch.float32):
        assert not x.is_contiguous()
        _assert_same(_compress(x, 3, path), _compress(x.contiguous(), 3, path))
        _assert_same(M.group_minmax(x, 1, 3, False), M.group_minmax(x.contiguous(), 1, 3, False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["running", "delayed", "one_op"])
def test_cuda_strided_views_read_in_place(dtype, path):
    for x in _views("cuda", dtype, B=8, N=197, H=6, E=64):
        want = _compress(x.contiguous(), 6, path)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = _compress(x, 6, path)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        _assert_same(got, want)
        _assert_same(M.group_minmax(x, 1, 6, False), M.group_minmax(x.contiguous(), 1, 6, False))
        # the codes (1 byte an element) and small tensors, never a copy of x
        assert extra < x.numel() * (1 + x.element_size()), (extra, x.numel())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_layouts_the_kernels_cannot_read_are_copied():
    """Rows not a multiple of 16 elements, or a transposed last dim: a contiguous copy first,
    the same results."""
    torch.manual_seed(0)
    for x in (torch.randn(8, 3, 40, 24, device="cuda")[..., :20],  # rows of 20
              torch.randn(8, 3, 32, 40, device="cuda").transpose(-1, -2)):
        assert not x.is_contiguous()
        _assert_same(_compress(x, 3, "running"), _compress(x.contiguous(), 3, "running"))
