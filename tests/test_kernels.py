"""Quantization kernels (torch.ops.mesa.*) against the pure-PyTorch reference.

The contract is docs/DESIGN.md ("Quantization ops"): same bytes as the reference for
nearest *and* stochastic rounding (same seed, same device). CPU tests always run; tests
marked ``cuda`` run when a GPU is visible and compare the CUDA kernels with the reference
on CUDA and with the CPU kernels.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import load_script
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import DT_IDS, DTYPES, needs_cuda, needs_ext


cuda = pytest.mark.cuda

# (shape, dim, num_groups): channel groups, per-head groups, conv layout, uneven groups,
# grouping over dim 0, 1-D, G == D, G == 1, odd prime-sized shapes.
LAYOUTS = [
    ((2, 9, 24), -1, 3),  # (B, N, C) channel blocks
    ((2, 3, 7, 7), 1, 3),  # (B, H, N, N) one group per head
    ((2, 4, 5, 6), 1, 2),  # two heads per group
    ((3, 10, 4, 5), 1, 4),  # conv (B, C, H, W), uneven: 10 channels, 4 groups
    ((4, 24, 2, 2), 1, 24),  # conv, 2 x 2 per channel: the CPU kernels' flattened short runs
    ((2, 7, 13), -1, 5),  # uneven channel groups
    ((5, 6), 0, 3),  # grouping over the batch dim
    ((11,), 0, 4),  # 1-D
    ((3, 5, 7, 11), 2, 7),  # G == D
    ((3, 5, 7, 11), -2, 1),  # G == 1
    ((1, 1, 1), -1, 1),  # single element
]
LAYOUT_IDS = [f"{'x'.join(map(str, s))}-d{d}-g{g}" for s, d, g in LAYOUTS]


def _params(x, dim, G, per_sample, shrink=True):
    """Finite (alpha, beta) from the reference stats; optionally shrunk so values saturate."""
    mn, mx = R.group_minmax(x, dim, G, per_sample)
    mn = torch.where(torch.isfinite(mn), mn, torch.zeros_like(mn))
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    alpha = (mx - mn).clamp_min(0)
    if shrink:  # some elements fall outside [beta, beta + alpha] -> exercise saturation
        alpha = alpha * 0.9
        mn = mn + 0.05 * alpha
    return alpha.contiguous(), mn.contiguous()


def _randn(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(device)


# ----------------------------------------------------------------------------- vs reference
@needs_ext
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per_sample"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,dim,G", LAYOUTS, ids=LAYOUT_IDS)
def test_cpu_kernels_match_reference(shape, dim, G, dtype, per_sample):
    x = _randn(shape, dtype)
    mn, mx = torch.ops.mesa.group_minmax(x, dim, G, per_sample)
    rmn, rmx = R.group_minmax(x, dim, G, per_sample)
    assert mn.dtype == torch.float32 and mn.shape == (shape[0] if per_sample else 1, G)
    assert torch.equal(mn, rmn) and torch.equal(mx, rmx)
    alpha, beta = _params(x, dim, G, per_sample)
    for stochastic in (False, True):
        q = torch.ops.mesa.quantize(x, alpha, beta, dim, G, stochastic, R.seed_tensor(987654321987, x.device))
        rq = R.quantize(x, alpha, beta, dim, G, stochastic, 987654321987)
        assert q.dtype == torch.uint8 and q.shape == x.shape and q.is_contiguous()
        assert torch.equal(q, rq), f"stochastic={stochastic}: {(q != rq).sum()} bytes differ"
        for out in DTYPES:
            y = torch.ops.mesa.dequantize(q, alpha, beta, dim, G, out)
            assert y.dtype == out
            assert torch.equal(y, R.dequantize(q, alpha, beta, dim, G, out))


@needs_ext
@pytest.mark.parametrize("groups", ["per_channel", "grouped"])
@pytest.mark.parametrize("shape", [(8, 200, 4, 4), (8, 512, 4, 4), (3, 400, 7, 7), (3, 20000), (4099, 23),
                                   (700, 3, 2, 2)],
                         ids=["flat_chunks", "flat_column_blocks", "flat_column_blocks_partial", "row_column_blocks",
                              "tiled_rows", "flat_tiled_rows"])
def test_short_runs_match_reference_multithreaded(shape, groups):
    """NCHW activations with few elements per channel and channel groups (ResNet's later stages
    at low resolution), a long row, and short rows (a channels-last activation with few
    channels, viewed as (N*H*W, C)): the CPU kernels walk the NCHW ones flattened (quant_cpu.cpp,
    "Short runs"), 200 x 4 x 4 in parallel chunks of the flat index, the next three in column
    blocks (at 1 and 2 threads a row of the walk of kColumnBlocks or more: 400 x 7 x 7 in two
    blocks, the second partial), and the short rows tiled ("Short rows": 23 -> 44 rows a walk row, the last
    partial; 3 x 2 x 2 flattened, then tiled). Statistics, codes (8, 4 and 2 bits; 4099 x 23
    elements leave a partial last byte), values, estimates and rng are the reference's, NaN,
    infinities and signed zeros included, for 1 and 2 threads."""
    G = shape[1] if groups == "per_channel" else max(1, min(48, shape[1] // 2))
    x = _randn(shape, torch.float32, seed=5)
    flat = x.view(-1)
    flat[flat.numel() // 7], flat[flat.numel() // 3] = float("nan"), float("inf")
    x[2, min(7, shape[1] - 1)] = -0.0
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            mn, mx = torch.ops.mesa.group_minmax(x, 1, G, False)
            rmn, rmx = R.group_minmax(x, 1, G, False)
            assert torch.equal(mn.view(torch.int32), rmn.view(torch.int32))
            assert torch.equal(mx.view(torch.int32), rmx.view(torch.int32))
            alpha, beta = _params(x, 1, G, False)
            for stochastic in (False, True):
                q = torch.ops.mesa.quantize(x, alpha, beta, 1, G, stochastic, R.seed_tensor(31337, x.device))
                assert torch.equal(q, R.quantize(x, alpha, beta, 1, G, stochastic, 31337))
                assert torch.equal(torch.ops.mesa.dequantize(q, alpha, beta, 1, G, torch.bfloat16),
                                   R.dequantize(q, alpha, beta, 1, G, torch.bfloat16))
                for bits in (4, 2):
                    seed = Q.seed_tensor(31337)
                    qb = Q.quantize_bits(x, alpha, beta, 1, G, bits, False, stochastic, seed)
                    assert torch.equal(qb, R.quantize_bits(x, alpha, beta, 1, G, bits, False, stochastic, seed)), bits
                    assert torch.equal(Q.dequantize_bits(qb, alpha, beta, x.shape, 1, G, bits, False, torch.bfloat16),
                                       R.dequantize_bits(qb, alpha, beta, x.shape, 1, G, bits, False, torch.bfloat16))
            for name in ("observe", "quantize_observe"):
                ops_state = [torch.zeros(G + 2), torch.zeros(G + 2), torch.zeros(1, dtype=torch.bool),
                             Q.rng_state(7, 3)]
                ref_state = [t.clone() for t in ops_state]
                for _ in range(2):  # (quantize_observe: the first batch initializes, the second uses them)
                    if name == "observe":
                        got = Q.observe(x, *ops_state, 1, G, 0.9)
                        want = R.observe(x, *ref_state, 1, G, 0.9, False, False)
                    else:
                        got = Q.quantize_observe(x, *ops_state, 1, G, 0.9, False, True)
                        want = R.quantize_observe(x, *ref_state, 1, G, 0.9, False, True)
                    for a, b in zip([*got, *ops_state], [*want, *ref_state]):
                        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                           b.view(torch.int32) if b.dtype == torch.float32 else b), name
    finally:
        torch.set_num_threads(old)


@needs_ext
def test_large_tensor_matches_reference_multithreaded():
    """Several parallel chunks (partials in minmax), both walk modes; thread-count invariant."""
    x = _randn((4, 6, 50, 64), torch.float32, seed=3)
    results = []
    old = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            out = []
            for dim, G in ((-1, 4), (1, 3)):
                for ps in (False, True):
                    mn, mx = Q.group_minmax(x, dim, G, ps)
                    a, b = (mx - mn), mn
                    out += [mn, mx, Q.quantize(x, a, b, dim, G, True, 5), Q.quantize(x, a, b, dim, G, False)]
            results.append(out)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    mn, mx = R.group_minmax(x, 1, 3, True)
    assert torch.equal(results[0][-4], mn)
    assert torch.equal(results[0][-2], R.quantize(x, mx - mn, mn, 1, 3, True, 5))


def test_reference_hash_matches_python_ints():
    """The int64-torch lowbias32 hash equals a plain uint32 implementation, incl. i >= 2^32."""
    M = 0xFFFFFFFF

    def lb(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & M
        v ^= v >> 15
        v = (v * 0x846CA68B) & M
        v ^= v >> 16
        return v

    def u(i, seed):  # DESIGN.md: key = lowbias32(seed_lo ^ lowbias32(seed_hi ^ index_hi * golden))
        key = lb((seed & M) ^ lb(((seed >> 32) & M) ^ ((((i >> 32) & M) * 0x9E3779B9) & M)))
        h = lb((((i & M) >> 1) * 0x9E3779B9 + key) & M)  # one hash a pair of elements
        return ((h >> 16) if i % 2 else (h & 0xFFFF)) * 2.0**-16

    for seed in (0, 1, 2**40 + 7, -5, 2**63 - 1, -(2**63)):
        for start in (0, 1, 2**32 - 3, 2**35 + 11):
            got = R.uniform_from_hash(6, seed, start=start).tolist()
            assert got == [u(start + k, seed) for k in range(6)]


# ----------------------------------------------------------------------------- properties
def test_stochastic_error_below_one_step():
    x = _randn((8, 64, 48), torch.float32, seed=1)
    alpha, beta = _params(x, -1, 6, False, shrink=False)
    step = (alpha / 255).view(1, 1, 6).repeat_interleave(8, dim=2)
    for seed in range(5):
        q = Q.quantize(x, alpha, beta, -1, 6, stochastic=True, seed=seed)
        err = (Q.dequantize(q, alpha, beta, -1, 6) - x).abs()
        assert (err < step * (1 + 1e-5)).all()
    qn = Q.quantize(x, alpha, beta, -1, 6, stochastic=False)
    errn = (Q.dequantize(qn, alpha, beta, -1, 6) - x).abs()
    assert (errn <= step * (0.5 + 1e-5)).all()


def test_stochastic_rounding_is_unbiased():
    """mean over K seeds of dequantize(quantize(x)) -> x; the error shrinks like 1/sqrt(K)."""
    x = _randn((4, 512), torch.float32, seed=2)
    alpha, beta = _params(x, -1, 4, False, shrink=False)
    step = float(alpha.max() / 255)
    acc = torch.zeros_like(x)
    errors = {}
    for k in range(1, 1025):
        acc += Q.dequantize(Q.quantize(x, alpha, beta, -1, 4, True, 1000 + k), alpha, beta, -1, 4)
        if k in (4, 64, 1024):
            errors[k] = float((acc / k - x).abs().mean())
    assert errors[64] < 0.5 * errors[4], errors
    assert errors[1024] < 0.5 * errors[64], errors
    assert errors[1024] < 0.02 * step, errors
    # nearest rounding is biased: its error does not shrink
    xn = Q.dequantize(Q.quantize(x, alpha, beta, -1, 4, False), alpha, beta, -1, 4)
    assert float((xn - x).abs().mean()) > 5 * errors[1024]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_saturation_never_wraps(dtype, stochastic):
    alpha = torch.tensor([[2.0, 2.0]])
    beta = torch.tensor([[-1.0, 10.0]])
    vals = [-1e4, -3.0, -1.0 - 1e-3, -1.0, 1.0, 1.0 + 1e-2, 2.5, 1e4, float("inf"), float("-inf")]
    x = torch.tensor(vals).view(-1, 1).repeat(1, 2)
    x[:, 1] += 11.0  # same positions relative to the second group's range [10, 12]
    x = x.to(dtype)
    q = Q.quantize(x, alpha, beta, -1, 2, stochastic, 7)
    expect_lo = torch.tensor([0, 0, 0, 0], dtype=torch.uint8)
    for g in range(2):
        col = q[:, g]
        assert torch.equal(col[:3], expect_lo[:3]), col  # below the range -> 0
        assert col[4] == 255 and col[7] == 255 and col[8] == 255 and col[9] == 0, col
        assert col[5] == 255  # just above the range -> 255, not 0 (no wrap modulo 256)
    assert q[3, 0] == 0  # x == beta


def test_constant_group_is_exact():
    x = torch.full((3, 4, 8), 1.25)
    x[..., 4:] = torch.randn(3, 4, 4)
    mn, mx = Q.group_minmax(x, -1, 2)
    alpha, beta = mx - mn, mn
    assert alpha[0, 0] == 0
    for stochastic in (False, True):
        q = Q.quantize(x, alpha, beta, -1, 2, stochastic, 3)
        assert (q[..., :4] == 0).all()
        y = Q.dequantize(q, alpha, beta, -1, 2)
        assert torch.equal(y[..., :4], x[..., :4])
    # tiny ranges (the original fp16 scale overflowed below ~4e-3): fp32 scale math is fine
    x = torch.linspace(0, 1e-6, 256).view(1, 256)
    mn, mx = Q.group_minmax(x, -1, 1)
    q = Q.quantize(x, mx - mn, mn, -1, 1, False)
    assert torch.equal(q.view(-1), torch.arange(256, dtype=torch.uint8))
    # alpha below the 1e-12 epsilon counts as constant
    q = Q.quantize(torch.tensor([[0.0, 5e-13]]), torch.tensor([[5e-13]]), torch.tensor([[0.0]]), -1, 1, False)
    assert torch.equal(q, torch.zeros(1, 2, dtype=torch.uint8))


@pytest.mark.parametrize("shape,dim", [((0, 8), -1), ((2, 0, 4), -1), ((0, 3, 5, 5), 1), ((4, 0), 1)])
def test_empty_inputs(shape, dim):
    x = torch.empty(shape)
    G = 1 if x.shape[dim] == 0 else 2
    for ps in (False, True):
        mn, mx = Q.group_minmax(x, dim, G, ps)
        S = shape[0] if ps else 1
        assert mn.shape == (S, G) and (mn == float("inf")).all() and (mx == float("-inf")).all()
        alpha, beta = torch.ones(S, G), torch.zeros(S, G)
        q = Q.quantize(x, alpha, beta, dim, G)
        assert q.shape == x.shape and q.dtype == torch.uint8
        y = Q.dequantize(q, alpha, beta, dim, G, torch.bfloat16)
        assert y.shape == x.shape and y.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_non_contiguous_inputs(dtype):
    base = _randn((3, 16, 10), dtype, seed=4)
    x = base.transpose(1, 2)  # (3, 10, 16), non-contiguous
    assert not x.is_contiguous()
    xc = x.contiguous()
    mn, mx = Q.group_minmax(x, 1, 5, True)
    mnc, mxc = Q.group_minmax(xc, 1, 5, True)
    assert torch.equal(mn, mnc) and torch.equal(mx, mxc)
    alpha, beta = (mx - mn), mn
    a_nc = alpha.t().contiguous().t()  # (S, G) non-contiguous params
    b_nc = beta.t().contiguous().t()
    q = Q.quantize(x, a_nc, b_nc, 1, 5, True, 11)
    assert q.is_contiguous() and torch.equal(q, Q.quantize(xc, alpha, beta, 1, 5, True, 11))
    q_nc = q.transpose(0, 2).contiguous().transpose(0, 2)
    assert torch.equal(Q.dequantize(q_nc, alpha, beta, 1, 5, dtype), Q.dequantize(q, alpha, beta, 1, 5, dtype))
    # sliced view with a storage offset (unaligned data pointer)
    xs = _randn((1001,), dtype, seed=5)[1:].view(40, 25)
    a, b = torch.full((1, 5), 4.0), torch.full((1, 5), -2.0)
    assert torch.equal(Q.quantize(xs, a, b, -1, 5, True, 1), R.quantize(xs.contiguous(), a, b, -1, 5, True, 1))


def test_nan_and_inf_handling():
    x = torch.randn(2, 3, 8)
    x[0, 1, 2] = float("nan")
    x[1, 2, 7] = float("inf")
    mn, mx = Q.group_minmax(x, -1, 2, per_sample=True)
    assert mn[0, 0].isnan() and mx[0, 0].isnan()
    assert torch.isfinite(mn[0, 1]) and torch.isfinite(mn[1]).all()
    assert mx[1, 1] == float("inf") and torch.isfinite(mx[1, 0])
    mn_s, mx_s = Q.group_minmax(x, -1, 2)
    assert mn_s[0, 0].isnan() and mx_s[0, 0].isnan() and mx_s[0, 1] == float("inf")
    alpha, beta = torch.full((1, 2), 4.0), torch.full((1, 2), -2.0)
    for st in (False, True):
        q = Q.quantize(x, alpha, beta, -1, 2, st, 1)
        assert q[0, 1, 2] == 0 and q[1, 2, 7] == 255
        assert torch.equal(q, R.quantize(x, alpha, beta, -1, 2, st, 1))
    # NaN parameters do not crash and give the reference's bytes
    q = Q.quantize(x, torch.tensor([[float("nan"), 1.0]]), torch.tensor([[0.0, float("nan")]]), -1, 2, False)
    assert (q == 0).all()


def test_seed_reproducibility():
    x = _randn((4, 33, 17), torch.float16, seed=6)
    alpha, beta = _params(x, 1, 3, True)
    q1 = Q.quantize(x, alpha, beta, 1, 3, True, 42)
    q2 = Q.quantize(x, alpha, beta, 1, 3, True, 42)
    q3 = Q.quantize(x, alpha, beta, 1, 3, True, 43)
    q4 = Q.quantize(x, alpha, beta, 1, 3, True, 42 + (1 << 32))  # high seed word matters too
    assert torch.equal(q1, q2)
    assert not torch.equal(q1, q3) and not torch.equal(q1, q4)
    # seeds outside int64 wrap modulo 2^64 (same low 64 bits -> same bytes)
    assert torch.equal(Q.quantize(x, alpha, beta, 1, 3, True, 2**64 + 42), q1)
    assert torch.equal(Q.quantize(x, alpha, beta, 1, 3, True, -1), Q.quantize(x, alpha, beta, 1, 3, True, 2**64 - 1))


def test_negative_dim_is_normalised():
    x = _randn((2, 3, 4, 6), torch.float32)
    for neg, pos in ((-1, 3), (-3, 1)):
        G = 2
        mn, mx = Q.group_minmax(x, neg, G, True)
        mn2, mx2 = Q.group_minmax(x, pos, G, True)
        assert torch.equal(mn, mn2) and torch.equal(mx, mx2)
        a, b = mx - mn, mn
        assert torch.equal(Q.quantize(x, a, b, neg, G, True, 1), Q.quantize(x, a, b, pos, G, True, 1))
        q = Q.quantize(x, a, b, pos, G, True, 1)
        assert torch.equal(Q.dequantize(q, a, b, neg, G), Q.dequantize(q, a, b, pos, G))


@pytest.mark.parametrize("impl", ["wrapper", "op"])
def test_invalid_arguments_raise_value_error(impl):
    if impl == "wrapper":
        qf = Q.quantize
    else:
        def qf(x, a, b, dim, G, st, seed):
            return torch.ops.mesa.quantize(x, a, b, dim, G, st, R.seed_tensor(seed))
    mmf = Q.group_minmax if impl == "wrapper" else torch.ops.mesa.group_minmax
    dqf = Q.dequantize if impl == "wrapper" else torch.ops.mesa.dequantize
    x = torch.randn(2, 3, 8)
    a, b = torch.ones(1, 2), torch.zeros(1, 2)
    q = torch.zeros(2, 3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dim"):
        mmf(x, 3, 2, False)
    with pytest.raises(ValueError, match="dim"):
        qf(x, a, b, -4, 2, True, 0)
    with pytest.raises(ValueError, match="num_groups"):
        mmf(x, -1, 0, False)
    with pytest.raises(ValueError, match="num_groups"):
        mmf(x, -1, 9, False)
    with pytest.raises(ValueError, match="shape"):
        qf(x, torch.ones(1, 3), torch.zeros(1, 3), -1, 2, True, 0)
    with pytest.raises(ValueError, match="S in"):
        qf(x, torch.ones(3, 2), torch.zeros(3, 2), -1, 2, True, 0)
    with pytest.raises(ValueError, match="shape"):
        qf(x, torch.ones(2), torch.zeros(2), -1, 2, True, 0)
    with pytest.raises(ValueError, match="float32"):
        qf(x, a.double(), b, -1, 2, True, 0)
    with pytest.raises(ValueError, match="bfloat16"):
        qf(x.double(), a, b, -1, 2, True, 0)
    with pytest.raises(ValueError, match="bfloat16"):
        mmf(x.to(torch.int32), -1, 2, False)
    with pytest.raises(ValueError, match="uint8"):
        dqf(x, a, b, -1, 2, torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        dqf(q, a, b, -1, 2, torch.float64)
    with pytest.raises(ValueError, match="at least one dimension"):
        mmf(torch.tensor(1.0), 0, 1, False)


# ----------------------------------------------------------------------------- torch.library
def _opcheck_cases(device):
    x = _randn((2, 3, 5, 8), torch.float16, device=device)
    a, b = _params(x.cpu(), 1, 3, True)
    a, b = a.to(device), b.to(device)
    q = R.quantize(x, a, b, 1, 3, True, 3)
    xg = _randn((4, 6, 10), torch.float32, device=device).requires_grad_()
    ag, bg = torch.rand(1, 2, device=device) + 0.5, torch.randn(1, 2, device=device)
    return [
        (torch.ops.mesa.group_minmax.default, (x, 1, 3, True)),
        (torch.ops.mesa.group_minmax.default, (xg, -1, 4, False)),
        (torch.ops.mesa.quantize.default, (x, a, b, 1, 3, True, R.seed_tensor(3, device))),
        (torch.ops.mesa.quantize.default, (xg, ag.requires_grad_(), bg, -1, 2, False, R.seed_tensor(0, device))),
        (torch.ops.mesa.dequantize.default, (q, a, b, 1, 3, torch.bfloat16)),
        (torch.ops.mesa.dequantize.default, (q, a.requires_grad_(), b, 1, 3, torch.float32)),
    ] + [  # one op per compression: every estimator, with and without row scales, a strided x
        (torch.ops.mesa.compress.default,
         (xs, torch.zeros(4, device=device), torch.zeros(4, device=device),
          torch.zeros(1, dtype=torch.bool, device=device),
          Q.rng_state(5, device=device), 2, 4, 0.9, estimator, False, True, 1, max_k))
        for xs in (_randn((3, 8, 6), torch.bfloat16, device=device)[:, ::2],)
        for estimator in (0, 1, 2) for max_k in (0, 64)
    ]


def test_opcheck_cpu():
    for op, args in _opcheck_cases("cpu"):
        opcheck(op, args)


def test_outputs_are_not_differentiable():
    x = torch.randn(2, 8, requires_grad=True)
    mn, mx = Q.group_minmax(x, -1, 2)
    assert not mn.requires_grad and not mx.requires_grad
    a = (mx - mn).requires_grad_()
    y = Q.dequantize(Q.quantize(x, a, mn, -1, 2), a, mn, -1, 2)
    assert not y.requires_grad


def test_torch_compile_traces_ops():
    def f(x, seed):
        mn, mx = torch.ops.mesa.group_minmax(x, -1, 2, False)
        q = torch.ops.mesa.quantize(x, mx - mn, mn, -1, 2, True, seed)
        return torch.ops.mesa.dequantize(q, mx - mn, mn, -1, 2, x.dtype)

    x = torch.randn(3, 5, 8)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, R.seed_tensor(9)), f(x, R.seed_tensor(9)))


# ----------------------------------------------------------------------------- fallback
def test_fallback_when_extension_disabled():
    """MESA_DISABLE_EXTENSION=1: the ops are defined from Python, one warning, same bytes."""
    code = textwrap.dedent(
        """
        import hashlib, warnings, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import mesa_train.quant as Q
        msgs = [str(m.message) for m in w if "mesa_train" in str(m.message)]
        assert len(msgs) == 1 and "could not be loaded" in msgs[0] and "reference" in msgs[0], msgs
        assert Q.BACKEND == "reference"
        x = (torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
        mn, mx = torch.ops.mesa.group_minmax(x, 1, 3, True)
        q = Q.quantize(x, mx - mn, mn, 1, 3, True, 77)
        y = torch.ops.mesa.dequantize(q, mx - mn, mn, 1, 3, torch.float16)
        torch.library.opcheck(torch.ops.mesa.quantize.default, (x, mx - mn, mn, 1, 3, True, Q.seed_tensor(77)))
        torch.library.opcheck(torch.ops.mesa.observe.default, (x, torch.zeros(3), torch.zeros(3), torch.tensor(False),
                                                                Q.rng_state(5), 1, 3, 0.9, True, False))
        torch.library.opcheck(torch.ops.mesa.update_estimates.default,
                              (mn, mx, torch.zeros(3), torch.zeros(3), torch.tensor(False), 0.9, True, False, True))
        torch.library.opcheck(torch.ops.mesa.compress.default, (x, torch.zeros(3), torch.zeros(3),
                              torch.zeros(1, dtype=torch.bool), Q.rng_state(5), 1, 3, 0.9, 0, False, True, 1, 64))
        torch.library.opcheck(torch.ops.mesa.observe_rows.default, (x, torch.zeros(3), torch.zeros(3),
                              torch.zeros(1, dtype=torch.bool), Q.rng_state(5), 2, 3, 0.9, False, False, 1, 64))
        print(hashlib.sha256(q.numpy().tobytes()).hexdigest())
        """
    )
    env = dict(os.environ, MESA_DISABLE_EXTENSION="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    x = (torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    mn, mx = Q.group_minmax(x, 1, 3, True)
    q = Q.quantize(x, mx - mn, mn, 1, 3, True, 77)
    assert out.stdout.strip().splitlines()[-1] == hashlib.sha256(q.numpy().tobytes()).hexdigest()


# ----------------------------------------------------------------------------- CUDA
@cuda
@needs_cuda
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per_sample"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,dim,G", LAYOUTS + [((4, 6, 197, 197), 1, 6), ((8, 197, 384), -1, 6)],
                         ids=LAYOUT_IDS + ["attn", "tokens"])
def test_cuda_kernels_match_reference_and_cpu(shape, dim, G, dtype, per_sample):
    xc = _randn(shape, dtype)
    x = xc.cuda()
    mn, mx = torch.ops.mesa.group_minmax(x, dim, G, per_sample)
    rmn, rmx = R.group_minmax(x, dim, G, per_sample)
    assert mn.is_cuda and torch.equal(mn, rmn) and torch.equal(mx, rmx)
    cmn, cmx = torch.ops.mesa.group_minmax(xc, dim, G, per_sample)
    assert torch.equal(mn.cpu(), cmn) and torch.equal(mx.cpu(), cmx)
    alpha_c, beta_c = _params(xc, dim, G, per_sample)
    alpha, beta = alpha_c.cuda(), beta_c.cuda()
    for stochastic in (False, True):
        q = torch.ops.mesa.quantize(x, alpha, beta, dim, G, stochastic, R.seed_tensor(123456789, x.device))
        assert torch.equal(q, R.quantize(x, alpha, beta, dim, G, stochastic, 123456789))
        assert torch.equal(q.cpu(), torch.ops.mesa.quantize(xc, alpha_c, beta_c, dim, G, stochastic,
                                                            R.seed_tensor(123456789, xc.device)))
        for out in DTYPES:
            y = torch.ops.mesa.dequantize(q, alpha, beta, dim, G, out)
            assert torch.equal(y, R.dequantize(q, alpha, beta, dim, G, out))
            assert torch.equal(y.cpu(), torch.ops.mesa.dequantize(q.cpu(), alpha_c, beta_c, dim, G, out))


@cuda
@needs_cuda
def test_cuda_unaligned_nan_empty_and_no_host_sync():
    xs = _randn((4097,), torch.float16, device="cuda")[1:].view(64, 64)  # unaligned pointer
    a, b = torch.full((1, 4), 4.0, device="cuda"), torch.full((1, 4), -2.0, device="cuda")
    for st in (False, True):
        assert torch.equal(Q.quantize(xs, a, b, -1, 4, st, 1), R.quantize(xs, a, b, -1, 4, st, 1))
    xn = torch.randn(2, 3, 8, device="cuda")
    xn[0, 1, 2] = float("nan")
    mn, mx = Q.group_minmax(xn, -1, 2, True)
    assert mn[0, 0].isnan() and mx[0, 0].isnan() and torch.isfinite(mn[1]).all()
    e = torch.empty(0, 8, device="cuda")
    assert Q.quantize(e, torch.ones(1, 2, device="cuda"), torch.zeros(1, 2, device="cuda"), -1, 2).shape == (0, 8)
    x = torch.randn(8, 197, 192, device="cuda", dtype=torch.bfloat16)
    seed = Q.seed_tensor(5, "cuda")  # an int seed would be copied to the device (a sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mn, mx = Q.group_minmax(x, -1, 3, False)
        q = Q.quantize(x, mx - mn, mn, -1, 3, True, seed)
        Q.dequantize(q, mx - mn, mn, -1, 3, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@needs_cuda
def test_cuda_kernels_are_built():
    """On a GPU machine the extension must carry its CUDA kernels (not the reference)."""
    assert Q.BACKEND == "extension", Q.extension_error
    assert Q.CUDA_BACKEND == "extension", "extension built without CUDA kernels (MESA_NO_CUDA / no nvcc?)"
    # every op, not only the core ones: a stale build serves the newer ones (the fused Softmax
    # backward, the estimate step) from the reference on CUDA, right but slow
    assert Q.CUDA_REFERENCE_OPS == (), f"CUDA kernels missing for {Q.CUDA_REFERENCE_OPS} (rebuild: make install)"


@cuda
@needs_cuda
@pytest.mark.slow
def test_cuda_64bit_indexing():
    """numel > 2^32: the 64-bit index path and the high word of the hash counter."""
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip("needs 20 GiB of free GPU memory")
    R_, C_ = 2**22 + 4, 1024
    x = torch.randn(R_, C_, device="cuda", dtype=torch.float16)
    alpha = torch.tensor([[6.0, 7.0, 8.0, 9.0]], device="cuda")
    beta = torch.tensor([[-3.0, -3.5, -4.0, -4.5]], device="cuda")
    seed = 0x123456789ABC
    q = Q.quantize(x, alpha, beta, -1, 4, True, seed)
    flat_x, flat_q = x.view(-1), q.view(-1)
    n = x.numel()
    for start in (0, 2**31 - 2048, 2**32 - 2048, n - 4096):
        idx = torch.arange(start, start + 4096, device="cuda")
        g = (idx % C_) * 4 // C_
        inv = torch.full_like(alpha[0], 255.0) / alpha[0]
        v = (flat_x[idx].float() - beta[0][g]) * inv[g]
        v = torch.floor(v + R.uniform_from_hash(4096, seed, "cuda", start)).clamp(0, 255)
        assert torch.equal(flat_q[idx], v.to(torch.uint8)), start
    y = Q.dequantize(q, alpha, beta, -1, 4, torch.float16)
    tail = slice(n - 4096, n)
    assert torch.equal(y.view(-1)[tail], R.dequantize(q.view(-1, C_)[-4:], alpha, beta, -1, 4, torch.float16).view(-1))
    del q, y
    mn, mx = Q.group_minmax(x, -1, 4)
    xv = x.view(R_, 4, C_ // 4)
    assert torch.equal(mn[0], xv.amin(dim=(0, 2)).float()) and torch.equal(mx[0], xv.amax(dim=(0, 2)).float())


@cuda
@needs_cuda
def test_opcheck_cuda():
    for op, args in _opcheck_cases("cuda"):
        opcheck(op, args)


# ----------------------------------------------------------------------------- benchmark
def test_benchmark_runs_on_cpu(tmp_path):
    from mesa_train.quant import benchmark

    table = benchmark.main(["--device", "cpu", "--quick", "--out-dir", str(tmp_path), "--dtypes", "bf16,fp32"])
    ops = ["clone (baseline)", "forward: observe + quantize", "observe", "quantize (stochastic)",
           "backward: dequantize", "forward delayed: quantize_observe",
           "forward delayed: quantize_observe (nearest)", "row_exponents", "observe_rows",
           "forward with row scales: observe_rows + quantize",
           "forward with row scales, before: row_exponents + observe + quantize",
           "backward with row scales: dequantize", "backward GELU: gelu_backward",
           "backward GELU, before: dequantize + gelu_backward",
           "forward LayerNorm x_hat: observe_rows + quantize with row_mean / row_rstd",
           "forward LayerNorm x_hat, before: native_layer_norm + observe_rows + quantize",
           "forward LayerNorm x_hat (float32 input, as under autocast): observe_rows + quantize with row_mean / "
           "row_rstd", "backward LayerNorm: layer_norm_backward",
           "backward LayerNorm, before: dequantize with row_mul + native_layer_norm_backward",
           "backward LayerNorm, first form: dequantize + native_layer_norm_backward + mul",
           "backward LayerNorm + Linear rebuild: dequantize with col_scale / col_shift",
           "backward LayerNorm + Linear rebuild, before: dequantize (float32) + mul + add + cast",
           "backward GELU + Linear: gelu_value_and_grad (row scales)",
           "backward GELU + Linear, two ops: dequantize_gelu + gelu_backward (row scales)",
           "backward GELU + Linear, before: dequantize + gelu + gelu_backward",
           "backward softmax: softmax_backward", "backward softmax, before: dequantize + _softmax_backward_data",
           "forward, before: contiguous copy + observe + quantize"]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # 2 dtypes x (8 rows per layout + 5 row-scale, 2 GELU, 5 LayerNorm, 2 LayerNorm + Linear
    # and 3 GELU + Linear rows on the token layout, 2 softmax rows on the attention layout, and
    # the copy-first forward on the strided q of a qkv), plus bf16's 5 LayerNorm rows with a
    # float32 input; the conv layout has the 8 compression rows only (no softmax of a conv)
    assert len(rows) == 2 * (4 * 8 + 5 + 2 + 5 + 2 + 3 + 2 + 1) + 5
    assert sum(r.startswith("| conv (2,24,2,2)") for r in rows) == 2 * 8
    for op in ops:
        assert any(f"| {op} |" in r for r in rows), op
    files = list(tmp_path.glob("*.md"))
    assert len(files) == 1 and "fraction of clone bandwidth" in files[0].read_text()
    # the written table read as scripts/compare_kernel_tables.py reads it, by column name
    cells = list(load_script("compare_kernel_tables").read_table(files[0])[1].values())
    assert len(cells) == len(rows)
    clone_rows = [c for c in cells if c["op"] == "clone (baseline)"]
    assert clone_rows and all(c["time / clone"] == "1.00" for c in clone_rows)  # the baseline against itself
    # every other row's mesa:: ops gave the reference's bits on its shape (the CPU kernels' contract)
    assert all(c["reference"] == "–" for c in clone_rows)
    assert all(c["reference"] == "equal" for c in cells if c["op"] != "clone (baseline)"), \
        [(c["op"], c["reference"]) for c in cells if c["reference"] not in ("equal", "–")]
    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cpu", "--quick", "--dtypes", "fp64", "--out-dir", str(tmp_path)])


def test_every_gpu_case_builds_and_checks_its_rows_on_cpu():
    """The GPU table's layouts (batch cut to 2, widths and groups kept), each op run once and
    checked against the reference on the CPU: a layout one op refuses must leave that op out,
    not stop the table (the H200 run of 2026-12-04 lost its whole table to the MLP hidden's
    1536-wide rows, which layer_norm_backward refuses)."""
    from mesa_train.quant import benchmark

    cases = [(name, (2,) + shape[1:], dim, groups) for name, shape, dim, groups in benchmark.GPU_CASES]
    rows = benchmark.run_benchmark(torch.device("cpu"), cases, ["bf16"], 0, 1)
    assert {r["case"] for r in rows} == {name for name, *_ in cases}
    assert {r["reference"] for r in rows if not r["op"].startswith("clone")} == {"equal"}
    hidden = [r["op"] for r in rows if r["case"].startswith("hidden")]
    assert "observe_rows" in hidden and not any("LayerNorm x_hat" in op for op in hidden)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_benchmark_device_is_one_line_when_wrong_or_absent(tmp_path, capsys):
    from mesa_train.quant import benchmark

    for device, message in (("cuda", "--device cuda: no CUDA device is visible here; valid: cpu"),
                            ("tpu", "invalid choice: 'tpu' (choose from 'cuda', 'cpu')")):
        with pytest.raises(SystemExit):
            benchmark.main(["--device", device, "--quick", "--out-dir", str(tmp_path)])
        assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.md"))


def test_benchmark_grid_policy_names_the_valid_ones_and_needs_cuda(tmp_path, monkeypatch, capsys):
    """--grid (MESA_CUDA_GRID) sizes the CUDA launches: an unknown policy is refused with the
    valid ones named, and a CPU run refuses it (a table headed with a grid that did nothing)."""
    from mesa_train.quant import benchmark

    monkeypatch.delenv("MESA_CUDA_GRID", raising=False)
    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cpu", "--quick", "--grid", "fastest", "--out-dir", str(tmp_path)])
    assert "choose from 'capped', 'full', 'resident'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cpu", "--quick", "--grid", "full", "--out-dir", str(tmp_path)])
    assert "sets the CUDA kernels' grid; this run is on cpu" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.md"))
    assert "MESA_CUDA_GRID" not in os.environ  # refused before it was set


def test_benchmark_variant_names_the_build_in_the_table_and_its_file(tmp_path, capsys):
    """--variant NAME (gpu_session.sh's kernels-base step: an older build of the extension
    loaded in this one's place) heads the table with the build's name and writes
    <device>.NAME.md beside this build's <device>.md; a name that cannot be a file name part is
    refused before anything runs."""
    from mesa_train.quant import benchmark

    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cpu", "--quick", "--variant", "../up", "--out-dir", str(tmp_path)])
    assert "letters, digits, '.', '_' and '-' only" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    table = benchmark.main(["--device", "cpu", "--quick", "--dtypes", "bf16", "--variant", "base-42cbf3f",
                            "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("*.md")
    assert path.name.endswith(".base-42cbf3f.md") and path.read_text() == table
    assert table.splitlines()[0].endswith(", extension `base-42cbf3f`")


def test_benchmark_kernel_time_sums_each_kernel_once(monkeypatch):
    """The GPU column: kernel durations attached to the host ops that launched them, summed
    once each and divided by the calls (the profiler and torch.cuda stand in: no GPU here)."""
    import types

    import torch.profiler

    from mesa_train.quant import benchmark

    k = lambda us: types.SimpleNamespace(name="kernel", device=0, duration=us)  # noqa: E731
    events = [types.SimpleNamespace(name="mesa::observe_rows", kernels=[k(30.0), k(5.0)]),
              types.SimpleNamespace(name="aten::mean", kernels=[k(4.0)]),
              types.SimpleNamespace(name="aten::empty", kernels=[])]

    class FakeProfile:
        def __init__(self, activities):
            assert torch.profiler.ProfilerActivity.CUDA in activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    calls = []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert benchmark._kernel_seconds(lambda: calls.append(1), 3) == pytest.approx(13e-6)
    assert len(calls) == 3
    events[:] = [types.SimpleNamespace(name="aten::empty", kernels=[])]
    assert benchmark._kernel_seconds(lambda: None, 2) is None
