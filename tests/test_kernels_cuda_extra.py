"""Extra CUDA coverage for csrc/cuda/quant_cuda.cu (complements tests/test_kernels.py).

Each case compares the CUDA kernels byte for byte with the pure-PyTorch reference run on
the same CUDA tensors and with the CPU kernels: vector tails for every dtype, sliced
(unaligned) inputs of every op, the three reduction paths of group_minmax (block / warp /
per thread) with NaN, signed zeros and infinities, more than 65535 samples with per-sample
statistics, a side stream and a second device.
"""
from __future__ import annotations

import pytest
import torch

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import DT_IDS, DTYPES, needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]

SEED = 0x1234_5678_9ABC


def _randn(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)


def _params(x, dim, G, per_sample):
    mn, mx = R.group_minmax(x.float().cpu(), dim, G, per_sample)
    mn = torch.where(torch.isfinite(mn), mn, torch.zeros_like(mn))
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    alpha = (mx - mn).clamp_min(0) * 0.9
    return alpha.contiguous(), (mn + 0.05 * alpha).contiguous()


def _same_stats(a, b):
    """Equal, NaN where the other is NaN (NaN payloads may differ)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _check_all(xc, dim, G, per_sample, device="cuda"):
    """CUDA ops on xc.to(device) == reference on the same device == CPU kernels."""
    x = xc.to(device)
    mn, mx = torch.ops.mesa.group_minmax(x, dim, G, per_sample)
    rmn, rmx = R.group_minmax(x, dim, G, per_sample)
    cmn, cmx = torch.ops.mesa.group_minmax(xc.contiguous(), dim, G, per_sample)
    assert mn.device == x.device and mn.dtype == torch.float32
    assert _same_stats(mn, rmn) and _same_stats(mx, rmx)
    assert _same_stats(mn.cpu(), cmn) and _same_stats(mx.cpu(), cmx)
    a_c, b_c = _params(xc, dim, G, per_sample)
    a, b = a_c.to(device), b_c.to(device)
    for st in (False, True):
        q = torch.ops.mesa.quantize(x, a, b, dim, G, st, R.seed_tensor(SEED, x.device))
        assert q.device == x.device and q.is_contiguous()
        assert torch.equal(q, R.quantize(x, a, b, dim, G, st, SEED))
        assert torch.equal(q.cpu(), torch.ops.mesa.quantize(xc.contiguous(), a_c, b_c, dim, G, st,
                                                            R.seed_tensor(SEED, xc.device)))
        for out in DTYPES:
            y = torch.ops.mesa.dequantize(q, a, b, dim, G, out)
            assert y.device == x.device
            assert torch.equal(y, R.dequantize(q, a, b, dim, G, out))
            assert torch.equal(y.cpu(), torch.ops.mesa.dequantize(q.cpu(), a_c, b_c, dim, G, out))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("extra", range(17))
def test_vector_tails(dtype, extra):
    """numel = k * VEC + r for every remainder r (VEC = 4 / 8 elements of 16 bytes)."""
    n = 16 * 37 + extra
    _check_all(_randn((n,), dtype, seed=extra), 0, 5, False)
    _check_all(_randn((1, n), dtype, seed=extra), -1, 3, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("offset", [1, 2, 3, 5, 8])
def test_sliced_inputs_every_op(dtype, offset):
    """Storage offsets: unaligned data pointers for x (quantize, minmax) and q (dequantize)."""
    base = _randn((offset + 50 * 24,), dtype, seed=offset).cuda()
    x = base[offset:].view(50, 24)
    assert x.is_contiguous()
    a, b = _params(x, -1, 4, True)
    a, b = a.cuda(), b.cuda()
    mn, mx = torch.ops.mesa.group_minmax(x, -1, 4, True)
    rmn, rmx = R.group_minmax(x, -1, 4, True)
    assert torch.equal(mn, rmn) and torch.equal(mx, rmx)
    for st in (False, True):
        q = torch.ops.mesa.quantize(x, a, b, -1, 4, st, R.seed_tensor(3, x.device))
        assert torch.equal(q, R.quantize(x, a, b, -1, 4, st, 3))
    qbase = torch.randint(0, 256, (offset + 50 * 24,), dtype=torch.uint8, device="cuda")
    qs = qbase[offset:].view(50, 24)
    for out in DTYPES:
        assert torch.equal(torch.ops.mesa.dequantize(qs, a, b, -1, 4, out), R.dequantize(qs, a, b, -1, 4, out))


# (shape, dim, G): which path of minmax_columns_kernel does the reduction
REDUCTION_LAYOUTS = [
    ((2, 3, 600, 50), 1, 3),  # inner >= 256: several tiles per block, block reduction
    ((4, 6, 197, 197), 1, 6),  # per-head attention map: block reduction, spans across heads
    ((3, 7, 64), 1, 7),  # inner = 64: warp reduction, warps span one d
    ((3, 5, 300), 1, 5),  # inner = 300: block spans crossing a d boundary
    ((5, 33, 96), -1, 6),  # inner = 1 (channels last): one atomic pair per thread
    ((1, 1, 100000), -1, 7),  # one row, many columns
    ((100000, 2), -1, 2),  # many rows, two columns: many row chunks
    # a conv's last stage per channel: runs of 49, so steps of 16 meet two (second_run_at), and
    # more groups than observe's 1,024 shared slots (a window per chunk inside one sample)
    ((8, 1100, 7, 7), 1, 1100),
    ((4, 64, 14, 14), 1, 64),  # runs of 196
]


@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per_sample"])
@pytest.mark.parametrize("shape,dim,G", REDUCTION_LAYOUTS,
                         ids=[f"{'x'.join(map(str, s))}-d{d}" for s, d, _ in REDUCTION_LAYOUTS])
def test_reduction_paths_with_specials(shape, dim, G, per_sample):
    xc = _randn(shape, torch.float32, seed=7)
    flat = xc.view(-1)
    g = torch.Generator().manual_seed(1)
    idx = torch.randperm(flat.numel(), generator=g)[:12]
    flat[idx[:3]] = float("nan")
    flat[idx[3:6]] = float("inf")
    flat[idx[6:9]] = float("-inf")
    flat[idx[9:]] = -0.0
    for dtype in DTYPES:
        _check_all(xc.to(dtype), dim, G, per_sample)


def test_signed_zero_and_constant_groups():
    x = torch.zeros(4, 6, 8)
    x[:, :, :4] = -0.0
    x[1, 2, 5] = -0.0
    x[:, :, 6:] = float("inf")  # a group of +inf only: its encoding equals the initial min
    x[:, 0, 7] = float("-inf")
    _check_all(x, -1, 4, False)
    _check_all(x, -1, 4, True)
    _check_all(x, 1, 3, True)


def test_more_than_65535_samples_per_sample_stats():
    """grid.y would exceed 65535 if samples went there; the CPU kernels have no such limit."""
    xc = _randn((70000, 6), torch.float16, seed=9)
    _check_all(xc, -1, 2, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_channels_last_and_transposed_inputs(dtype):
    xc = _randn((3, 10, 7, 9), dtype, seed=2).to(memory_format=torch.channels_last)
    assert not xc.is_contiguous()
    _check_all(xc, 1, 4, True)
    xt = _randn((3, 16, 10), dtype, seed=4).transpose(1, 2)
    _check_all(xt, 1, 5, False)


def test_dim0_per_sample():
    for shape in ((5, 6), (300,), (17, 3, 40)):
        _check_all(_randn(shape, torch.bfloat16, seed=len(shape)), 0, min(3, shape[0]), True)


def test_empty_inputs_cuda():
    for shape, dim in (((0, 8), -1), ((2, 0, 4), -1), ((0, 3, 5, 5), 1), ((4, 0), 1)):
        x = torch.empty(shape, device="cuda")
        G = 1 if x.shape[dim] == 0 else 2
        for ps in (False, True):
            S = shape[0] if ps else 1
            mn, mx = torch.ops.mesa.group_minmax(x, dim, G, ps)
            assert mn.is_cuda and mn.shape == (S, G) and (mn == float("inf")).all() and (mx == float("-inf")).all()
            a, b = torch.ones(S, G, device="cuda"), torch.zeros(S, G, device="cuda")
            q = torch.ops.mesa.quantize(x, a, b, dim, G, True, R.seed_tensor(1, x.device))
            assert q.is_cuda and q.shape == x.shape and q.dtype == torch.uint8
            y = torch.ops.mesa.dequantize(q, a, b, dim, G, torch.float16)
            assert y.is_cuda and y.shape == x.shape and y.dtype == torch.float16


def test_side_stream():
    """The kernels run on the current stream (not the legacy default stream)."""
    xc = _randn((8, 197, 192), torch.bfloat16, seed=5)
    a_c, b_c = _params(xc, -1, 3, False)
    expect_q = torch.ops.mesa.quantize(xc, a_c, b_c, -1, 3, True, R.seed_tensor(11, xc.device))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = xc.cuda(non_blocking=False)
        a, b = a_c.cuda(), b_c.cuda()
        mn, mx = Q.group_minmax(x, -1, 3)
        q = Q.quantize(x, a, b, -1, 3, True, 11)
        y = Q.dequantize(q, a, b, -1, 3, torch.float32)
    s.synchronize()
    rmn, rmx = R.group_minmax(xc, -1, 3)
    assert torch.equal(mn.cpu(), rmn) and torch.equal(mx.cpu(), rmx)
    assert torch.equal(q.cpu(), expect_q)
    assert torch.equal(y.cpu(), R.dequantize(expect_q, a_c, b_c, -1, 3, torch.float32))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    """Tensors on cuda:1 while cuda:0 is current: device guard, stream and allocations."""
    xc = _randn((4, 6, 33, 17), torch.float16, seed=8)
    with torch.cuda.device(0):
        _check_all(xc, 1, 3, True, device="cuda:1")
        _check_all(xc, -1, 4, False, device="cuda:1")


def test_cpu_params_rejected_for_cuda_input():
    x = torch.randn(2, 8, device="cuda")
    with pytest.raises(ValueError, match="is on"):
        torch.ops.mesa.quantize(x, torch.ones(1, 2), torch.zeros(1, 2, device="cuda"),
                                -1, 2, True, R.seed_tensor(0, x.device))
    with pytest.raises(ValueError, match="float32"):
        torch.ops.mesa.quantize(x, torch.ones(1, 2, device="cuda").half(), torch.zeros(1, 2, device="cuda"),
                                -1, 2, True, R.seed_tensor(0, x.device))


# ----------------------------------------------------------------------------- grid policies
# MESA_CUDA_GRID (csrc/cuda/quant_cuda.cu, elementwise_grid) is read once a process, so each
# policy runs in a process of its own (unset: each launch's own, quantize resident and
# dequantize capped). The token layout of DeiT-S at batch 128 needs more blocks than "capped"
# launches (some threads then take two steps), the odd size a tail.
_GRID_CHECK = r"""
import torch
from mesa_train.quant import reference as R
for shape, dim, G in [((128, 197, 384), -1, 6), ((64, 6, 197, 197), 1, 6), ((3, 5, 1001), 1, 5)]:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16).cuda()
    alpha = torch.rand(1, G, generator=g).add_(0.5).cuda() * 8
    beta = -alpha / 2
    for stochastic in (True, False):
        q = torch.ops.mesa.quantize(x, alpha, beta, dim, G, stochastic, R.seed_tensor(99, x.device))
        assert torch.equal(q, R.quantize(x, alpha, beta, dim, G, stochastic, 99)), (shape, stochastic)
        y = torch.ops.mesa.dequantize(q, alpha, beta, dim, G, torch.bfloat16)
        assert torch.equal(y, R.dequantize(q, alpha, beta, dim, G, torch.bfloat16)), shape
print("same codes")
"""


def _run_with_grid(policy, code: str):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MESA_CUDA_GRID"}
    if policy is not None:
        env["MESA_CUDA_GRID"] = policy
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("policy", [None, "capped", "full", "resident"], ids=["unset", "capped", "full", "resident"])
def test_grid_policies_give_the_reference_codes(policy):
    r = _run_with_grid(policy, _GRID_CHECK)
    assert r.returncode == 0 and "same codes" in r.stdout, r.stderr[-2000:]


def test_unknown_grid_policy_is_a_one_line_error_naming_the_valid_ones():
    code = ("import torch, mesa_train.quant\n"
            "from mesa_train.quant import reference as R\n"
            "x = torch.ones(4, 8, device='cuda')\n"
            "try:\n"
            "    torch.ops.mesa.quantize(x, torch.ones(1, 2, device='cuda'), torch.zeros(1, 2, device='cuda'),"
            " -1, 2, True, R.seed_tensor(0, x.device))\n"
            "except RuntimeError as e:\n"
            "    print('error:', str(e).splitlines()[0])\n")
    r = _run_with_grid("fastest", code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "error: MESA_CUDA_GRID='fastest' is not a grid policy; valid: capped, full, resident" in r.stdout
