"""The power-of-two row scales inside the kernels (``row_exp`` of ``mesa::observe`` /
``quantize`` / ``dequantize``, and ``mesa::row_exponents``) against their definition.

Definition (``mesa_train.quant.reference``, DESIGN.md "Rows far below the grid"): quantize and
observe see ``x * exp2(k)`` computed in ``x``'s dtype, dequantize returns its output times
``exp2(-k)`` rounded to the output dtype, and ``row_exponents`` is
``clamp(floor(log2(row_max_mean(r) / r)), 0, max_k)`` of the row maxima ``r = max|x|``. The CPU kernels
and (on a GPU, ``cuda``-marked) the CUDA kernels, which scale in registers instead of making a
scaled copy, must give the same bytes for every dtype, layout and exponent range the layers
use, rows that straddle a 16-element vector step included.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import DEVICES, DTYPES, needs_cuda, needs_ext
from bit_patterns import bit_pattern

# (shape, row_dims): rows of 16 (whole vector steps), 24 and 131 (steps straddle rows, and a tail),
# two row dims (LayerNorm over (H, W)), one long row
SHAPES = [((4, 6, 16), 1), ((3, 5, 24), 1), ((2, 7, 131), 1), ((2, 3, 4, 6), 2), ((2, 4100), 1)]


def _rows(shape, dtype, device, case="spread"):
    """Rows whose magnitudes span many octaves (so k covers its range), with NaN, inf, zero
    and subnormal entries where asked."""
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=g)
    rows = x.numel() // shape[-1]
    mags = torch.logspace(-12 if dtype != torch.float16 else -4, 1, rows).view(*shape[:-1], 1)
    x = x * mags
    flat = x.view(-1, shape[-1])
    if case == "specials":
        flat[0, 0] = float("nan")
        flat[1 % rows, -1] = float("inf")
        flat[2 % rows, 2:] = 0.0
        flat[2 % rows, 2] = -0.0
        flat[-1, 3] = 1e-41 if dtype == torch.float32 else 1e-7  # subnormal in the dtype
    return x.to(dtype).to(device)


def _random_k(x, row_dims, top, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, top + 1, R.row_shape(x, row_dims), dtype=torch.int8, generator=g)
    k.view(-1)[0] = top  # the largest exponent at least once
    return k.to(x.device)


def _top(*dtypes):
    return 14 if torch.float16 in dtypes else 64


def _state(G, device):
    return (torch.zeros(G, device=device), torch.zeros(G, device=device),
            torch.zeros(1, dtype=torch.bool, device=device), Q.rng_state(7, 3, device))


# ----------------------------------------------------------------------------- row_exponents
@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
@pytest.mark.parametrize("case", ["spread", "specials"])
def test_row_exponents_kernel_is_the_definition(device, dtype, shape, row_dims, case):
    x = _rows(shape, dtype, device, case)
    for max_k in (_top(dtype), 3, 0):
        got = torch.ops.mesa.row_exponents(x, row_dims, max_k)
        want = R.row_exponents(x, row_dims, max_k)
        assert got.dtype == torch.int8 and got.shape == want.shape == R.row_shape(x, row_dims)
        assert torch.equal(got, want), (max_k, got.view(-1), want.view(-1))
    if case == "spread":  # the exponents are exercised: small rows get large k
        assert int(torch.ops.mesa.row_exponents(x, row_dims, _top(dtype)).max()) >= 3


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_row_exponents_edge_shapes(device):
    x = _rows((4, 6, 16), torch.float32, device)
    nc = x.transpose(0, 1)  # non-contiguous
    assert torch.equal(torch.ops.mesa.row_exponents(nc, 1, 64), R.row_exponents(nc, 1, 64))
    for shape in [(0, 16), (3, 0), (2, 0, 5)]:
        e = torch.zeros(shape, device=device)
        got = torch.ops.mesa.row_exponents(e, 1, 64)
        assert got.shape == R.row_shape(e, 1) and not got.any() and torch.equal(got, R.row_exponents(e, 1, 64))
    one = torch.ones(1, 1, device=device)  # one row: k = 0
    assert int(torch.ops.mesa.row_exponents(one, 1, 64)) == 0


# ----------------------------------------------------------------------------- observe / quantize / dequantize
@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
@pytest.mark.parametrize("per_sample", [False, True])
def test_observe_and_quantize_with_row_exp_are_the_definition(device, dtype, shape, row_dims, per_sample):
    x = _rows(shape, dtype, device, "specials" if per_sample else "spread")
    k = _random_k(x, row_dims, _top(dtype))
    dim, G = x.dim() - 1, 4
    ops_state, ref_state = _state(G, device), _state(G, device)
    for step in range(2):  # the second step blends into the running estimates
        got = Q.observe(x, *ops_state, dim, G, 0.9, per_sample, False, row_exp=k)
        want = R.observe(x, *ref_state, dim, G, 0.9, per_sample, False, row_exp=k)
        for a, b in zip(got, want):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), step
        for a, b in zip(ops_state, ref_state):
            assert torch.equal(a, b), step
    alpha, beta, seed = got
    for stochastic in (True, False):
        q = Q.quantize(x, alpha, beta, dim, G, stochastic, seed, row_exp=k)
        assert torch.equal(q, R.quantize(x, alpha, beta, dim, G, stochastic, seed, row_exp=k)), stochastic
    # and the definition is the scaled copy the kernels no longer make
    xs = R.scale_rows(x, k)
    assert torch.equal(Q.quantize(x, alpha, beta, dim, G, True, seed, row_exp=k),
                       Q.quantize(xs, alpha, beta, dim, G, True, seed))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
def test_dequantize_with_row_exp_is_the_definition(device, in_dtype, out_dtype, shape, row_dims):
    """Including float16 outputs pushed into the subnormal range by 2**-14 (rounded twice, as
    the unscale of a float16 tensor rounds them)."""
    x = _rows(shape, in_dtype, device)
    k = _random_k(x, row_dims, _top(in_dtype, out_dtype), seed=3)
    dim, G = x.dim() - 1, 4
    alpha, beta, seed = Q.observe(x, *_state(G, device), dim, G, 0.9, False, False, row_exp=k)
    q = Q.quantize(x, alpha, beta, dim, G, True, seed, row_exp=k)
    got = Q.dequantize(q, alpha, beta, dim, G, out_dtype, row_exp=k)
    want = R.dequantize(q, alpha, beta, dim, G, out_dtype, row_exp=k)
    assert got.dtype == want.dtype == out_dtype
    assert torch.equal(bit_pattern(got), bit_pattern(want))
    plain = Q.dequantize(q, alpha, beta, dim, G, out_dtype)
    assert torch.equal(bit_pattern(got), bit_pattern(R.unscale_rows(plain, k)))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_rows_survive_the_round_trip(device, dtype):
    """What the row scales are for: a row 1e-3 of the others comes back within a few grid
    steps of its own size with row_exponents' k, and as noise without."""
    x = _rows((8, 64), torch.float32, "cpu")
    x = (x / x.abs().amax(-1, keepdim=True)).to(dtype).to(device)  # rows of max 1
    x[0] *= 1e-3
    k = Q.row_exponents(x, 1, _top(dtype))
    assert int(k[0]) == 9 and not k[1:].any()

    def row_error(row_exp):
        alpha, beta, seed = Q.observe(x, *_state(4, device), -1, 4, 0.9, False, False, row_exp=row_exp)
        q = Q.quantize(x, alpha, beta, -1, 4, False, seed, row_exp=row_exp)
        y = Q.dequantize(q, alpha, beta, -1, 4, torch.float32, row_exp=row_exp)
        return float((y[0] - x[0].float()).abs().max() / x[0].float().abs().max())

    assert row_error(k) < 0.02 < 0.3 < row_error(None)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_row_exp_groups_along_another_dim(device):
    """Rows are the last dims whatever dim the groups lie along (a (B, C, H, W) conv map with
    channel groups over dim 1 and one exponent per (B, C) plane or per B)."""
    x = _rows((2, 4, 3, 5), torch.bfloat16, device)
    for row_dims in (1, 2, 3):
        k = _random_k(x, row_dims, 64, seed=row_dims)
        st1, st2 = _state(2, device), _state(2, device)
        got = Q.observe(x, *st1, 1, 2, 0.5, False, False, row_exp=k)
        want = R.observe(x, *st2, 1, 2, 0.5, False, False, row_exp=k)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        q = Q.quantize(x, got[0], got[1], 1, 2, True, got[2], row_exp=k)
        assert torch.equal(q, R.quantize(x, got[0], got[1], 1, 2, True, got[2], row_exp=k))
        y = Q.dequantize(q, got[0], got[1], 1, 2, torch.bfloat16, row_exp=k)
        want = R.dequantize(q, got[0], got[1], 1, 2, torch.bfloat16, row_exp=k)
        assert torch.equal(bit_pattern(y), bit_pattern(want))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_zero_exponents_change_nothing(device):
    x = _rows((3, 5, 24), torch.float16, device, "specials")
    k = torch.zeros(3, 5, 1, dtype=torch.int8, device=device)
    a1, b1, s1 = Q.observe(x, *_state(4, device), -1, 4, 0.9, False, False, row_exp=k)
    a2, b2, s2 = Q.observe(x, *_state(4, device), -1, 4, 0.9, False, False)
    assert torch.equal(bit_pattern(a1), bit_pattern(a2)) and torch.equal(bit_pattern(b1), bit_pattern(b2))
    assert torch.equal(s1, s2)
    q = Q.quantize(x, a1, b1, -1, 4, True, s1, row_exp=k)
    assert torch.equal(q, Q.quantize(x, a1, b1, -1, 4, True, s1))
    assert torch.equal(bit_pattern(Q.dequantize(q, a1, b1, -1, 4, torch.float16, row_exp=k)),
                       bit_pattern(Q.dequantize(q, a1, b1, -1, 4, torch.float16)))


# ----------------------------------------------------------------------------- errors
def test_bad_row_exp_is_a_one_line_error():
    x = torch.randn(2, 3, 8)
    a, b = torch.ones(1, 2), torch.zeros(1, 2)
    cases = [
        (torch.zeros(2, 3, 1), "int8"),
        (torch.zeros(2, 3, 8, dtype=torch.int8), "x.shape[:-n]"),
        (torch.zeros(2, 1, 8, dtype=torch.int8), "x.shape[:-n]"),
        (torch.zeros(2, 3, dtype=torch.int8), "x.shape[:-n]"),
        (torch.zeros(3, 3, 1, dtype=torch.int8), "x.shape[:-n]"),
    ]
    for k, msg in cases:
        for call in (lambda: Q.quantize(x, a, b, -1, 2, True, 0, row_exp=k),
                     lambda: Q.dequantize(x.to(torch.uint8), a, b, -1, 2, torch.float32, row_exp=k),
                     lambda: Q.observe(x, *_state(2, "cpu"), -1, 2, 0.9, row_exp=k)):
            with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
                call()
    # the kernels check too (the layers call them without the Python wrappers)
    with pytest.raises(ValueError, match="row_exp must have shape"):
        torch.ops.mesa.quantize(x, a, b, 2, 2, True, Q.seed_tensor(0), torch.zeros(2, 3, 8, dtype=torch.int8))
    # several trailing size-1 dims are fine: rows of the last two dims
    Q.quantize(x, a, b, -1, 2, True, 0, row_exp=torch.zeros(2, 1, 1, dtype=torch.int8))


def test_bad_row_exponents_arguments():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"row_dims must be in \[1, 3\]"):
        Q.row_exponents(x, 4, 64)
    with pytest.raises(ValueError, match=r"max_k must be in \[0, 126\]"):
        Q.row_exponents(x, 1, 127)
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        Q.row_exponents(x.double(), 1, 64)
    if Q.BACKEND == "extension":
        with pytest.raises(ValueError, match=r"row_dims must be in \[1, 3\]"):
            torch.ops.mesa.row_exponents(x, 0, 64)


# ----------------------------------------------------------------------------- opcheck
@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_row_scale_signatures(device):
    """PyTorch's own op checks (schema, fake/meta, autograd registration, dispatcher) on the
    signatures with row_exp and on row_exponents."""
    x = _rows((3, 5, 24), torch.bfloat16, device)
    k = _random_k(x, 1, 64)
    opcheck(torch.ops.mesa.row_exponents.default, (x, 1, 64))
    opcheck(torch.ops.mesa.row_exponents.default, (x, 2, 14))
    alpha, beta, seed = Q.observe(x, *_state(4, device), 2, 4, 0.9, False, False, row_exp=k)
    opcheck(torch.ops.mesa.observe.default, (x, *_state(4, device), 2, 4, 0.9, False, False, k))
    opcheck(torch.ops.mesa.quantize.default, (x, alpha, beta, 2, 4, True, seed, k))
    q = Q.quantize(x, alpha, beta, 2, 4, True, seed, row_exp=k)
    opcheck(torch.ops.mesa.dequantize.default, (q, alpha, beta, 2, 4, torch.float32, k))


# ----------------------------------------------------------------------------- observe_rows
# mesa::observe_rows = row_exponents, then observe with row_exp = k (DESIGN.md, "observe_rows").
# With groups and rows over the last dim it takes one pass over x (per row: max|x| and each
# group segment's min/max, scaled by the row's 2**k, then observe over those cells); every
# other layout runs the two ops. Both must give the definition's bits: statistics, seed, k and
# every buffer, also on the second step (blending into initialized estimates).
def _observe_rows_both(x, G, per_sample, symmetric, row_dims, max_k, steps=2, mean=None, rstd=None, dim=None):
    """(mean, rstd: a LayerNorm's statistics, tests/test_layernorm_x_hat.py; dim: the groups' dim)"""
    dim = x.dim() - 1 if dim is None else dim
    ops_state, ref_state = _state(G, x.device), _state(G, x.device)
    for step in range(steps):
        got = Q.observe_rows(x, *ops_state, dim, G, 0.9, per_sample, symmetric, row_dims, max_k, mean, rstd)
        want = R.observe_rows(x, *ref_state, dim, G, 0.9, per_sample, symmetric, row_dims, max_k, mean, rstd)
        for name, a, b in zip(("alpha", "beta", "seed", "k"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, step)
            assert torch.equal(bit_pattern(a), bit_pattern(b)), (name, step)
        for a, b in zip(ops_state, ref_state):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), step
    return got


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
@pytest.mark.parametrize("case", ["spread", "specials"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_observe_rows_is_row_exponents_then_observe(device, dtype, shape, row_dims, case, per_sample):
    x = _rows(shape, dtype, device, case)
    # 4 groups (segments of unequal length for 131 and 6) and the symmetric ranges
    alpha, beta, seed, k = _observe_rows_both(x, 4, per_sample, case == "specials", row_dims, _top(dtype))
    if case == "spread":  # the exponents are exercised: small rows get large k
        assert int(k.max()) >= 3
    # and the one op is the two ops of the extension too
    state = _state(4, device)
    k2 = torch.ops.mesa.row_exponents(x, row_dims, _top(dtype))
    want = Q.observe(x, *state, x.dim() - 1, 4, 0.9, per_sample, case == "specials", row_exp=k2)
    assert torch.equal(k, k2)
    got = Q.observe_rows(x, *_state(4, device), x.dim() - 1, 4, 0.9, per_sample, case == "specials", row_dims,
                         _top(dtype))
    for a, b in zip(got[:3], want):
        assert torch.equal(bit_pattern(a), bit_pattern(b))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("G", [1, 5, 24])
def test_observe_rows_group_counts_and_layouts(device, G):
    """One group, groups that do not divide the row (24 / 5), one group per channel; a
    non-contiguous x, groups along another dim than the rows' (the two-op path), one-d x
    (one row for all samples: the two-op path), no row scales (max_k = 0) and one-row x."""
    x = _rows((6, 7, 24), torch.bfloat16, device, "specials")
    _observe_rows_both(x, G, False, False, 1, 64)
    _observe_rows_both(x.transpose(0, 1), G, True, False, 1, 64)
    _observe_rows_both(x, G, False, False, 1, 0)
    _observe_rows_both(x[:1, :1], G, True, False, 1, 64)
    _observe_rows_both(x.reshape(-1)[:40], min(G, 40), False, False, 1, 64)
    state, ref = _state(G, device), _state(G, device)
    x4 = _rows((4, 6, 5, 24), torch.float32, device)
    got = Q.observe_rows(x4, *state, 1, min(G, 6), 0.9, True, False, 1, 64)
    want = R.observe_rows(x4, *ref, 1, min(G, 6), 0.9, True, False, 1, 64)
    for a, b in zip(got, want):
        assert torch.equal(bit_pattern(a), bit_pattern(b))


def _token_rows(dtype, device, case):
    """DeiT-S-like token rows (8 images of 197 tokens, 384 channels): "class" rows of one scale
    with each image's first token 2**-12 of the rest (DeiT3's class token: most chunks of 32 rows
    have no scaled row, some one), or "spread" (every row its own scale: scaled rows everywhere).
    Class: the rows' last 192 channels are 1/64 of their first, the class token's the other way
    round, so that scaled it holds the extremes of those groups (its unscaled cells would not)."""
    if case == "spread":
        return _rows((8, 197, 384), dtype, device)
    x = torch.randn(8, 197, 384, generator=torch.Generator().manual_seed(3))
    x[:, 1:, 192:] *= 2.0 ** -6
    x[:, 0, :192] *= 2.0 ** -18
    x[:, 0, 192:] *= 2.0 ** -12
    return x.to(dtype).to(device)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["class", "spread"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_observe_rows_on_the_layers_token_layout(device, dtype, case, per_sample):
    """The layers' layout, where CUDA takes the flat row pass (6 groups of 64 channels, whole
    16-byte chunks) and, with shared statistics, finishes k, the group totals and the estimate
    and seed steps in its last block (from per-chunk partial totals, or a chunk's scaled cells)."""
    x = _token_rows(dtype, device, case)
    alpha, beta, seed, k = _observe_rows_both(x, 6, per_sample, case == "spread", 1, 64, steps=3)
    if case == "class":  # the class rows scaled, the rest not; scaled, they set the last groups' ranges
        assert k[:, 0].min() >= 10 and int(k[:, 1:].max()) == 0
        x_hat = x.float() * torch.exp2(k.float())
        assert alpha.shape == (x.shape[0] if per_sample else 1, 6)
        assert torch.equal(x_hat[..., 192:].amax((1, 2)), x_hat[:, 0, 192:].amax(-1))


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # (the first call on a stream creates its workspace)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@needs_ext
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("per_sample", [False, True])
def test_cuda_row_scaled_compression_launches(per_sample):
    """Issue 9's two launches a compression, with row scales: shared statistics, observe_rows is
    the flat row pass alone (its last block finds the mean, k, the totals, the estimate and seed
    steps), then quantize; per sample, observe over the cells comes between. No memset, no ATen
    mean, no host sync; captured in a CUDA graph (the workspace then a memset node of its own),
    each replay equals the reference chain. The finish (MESA_ROW_FINISH, default auto): in the
    pass's last block outside a capture, unless grid; row_finish_grid_kernel after the pass in
    the graph, unless block (a replay launches nothing from the host, so the faster finish)."""
    mode = os.environ.get("MESA_ROW_FINISH", "auto")
    x = _token_rows(torch.bfloat16, "cuda", "class")
    state = _state(6, "cuda")

    def forward():
        a, b, seed, k = torch.ops.mesa.observe_rows(x, *state, 2, 6, 0.9, per_sample, False, 1, 64)
        return torch.ops.mesa.quantize(x, a, b, 2, 6, True, seed, k), k

    def launches(on_grid: bool) -> list[str]:
        return (["row_cells_flat_kernel"] + (["row_finish_grid_kernel"] if on_grid else [])
                + (["observe_kernel"] if per_sample else []) + ["quantize_kernel"])

    names = _cuda_kernels(forward)
    want = launches(mode == "grid")
    assert len(names) == len(want) and all(w in n for w, n in zip(want, names)), names
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # CUDA graph: replays against the reference chain on the same state
    ref_state = [t.clone() for t in state]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        q, k = forward()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        a, b, seed, k_ref = R.observe_rows(x, *ref_state, 2, 6, 0.9, per_sample, False, 1, 64)
        assert torch.equal(k, k_ref)
        assert torch.equal(q, R.quantize(x, a, b, 2, 6, True, seed, k_ref))
        for got_t, want_t in zip(state, ref_state):
            assert torch.equal(bit_pattern(got_t), bit_pattern(want_t))
    replayed = [n for n in _cuda_kernels(graph.replay) if "kernel" in n]  # (not the workspace's memset)
    want = launches(mode != "block")
    assert len(replayed) == len(want) and all(w in n for w, n in zip(want, replayed)), replayed


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_observe_rows_empty_and_bad_arguments(device):
    for shape in [(0, 16), (3, 0), (2, 0, 5)]:
        e = torch.zeros(shape, device=device)
        G = 1
        got = Q.observe_rows(e, *_state(G, device), e.dim() - 1 if shape[-1] else 0, G, 0.9, False, False, 1, 64)
        want = R.observe_rows(e, *_state(G, device), e.dim() - 1 if shape[-1] else 0, G, 0.9, False, False, 1, 64)
        for a, b in zip(got, want):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), shape
    x = _rows((3, 5, 24), torch.float32, device)
    with pytest.raises(ValueError, match=r"max_k must be in \[0, 126\]"):
        torch.ops.mesa.observe_rows(x, *_state(4, device), 2, 4, 0.9, False, False, 1, 127)
    with pytest.raises(ValueError, match=r"row_dims must be in \[1, 3\]"):
        torch.ops.mesa.observe_rows(x, *_state(4, device), 2, 4, 0.9, False, False, 4, 64)
    with pytest.raises(ValueError, match=r"num_groups=30 must be in \[1, 24\]"):
        torch.ops.mesa.observe_rows(x, *_state(30, device), 2, 30, 0.9, False, False, 1, 64)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_observe_rows(device):
    x = _rows((3, 5, 24), torch.bfloat16, device)
    for per_sample, row_dims in [(False, 1), (True, 1), (False, 2)]:
        opcheck(torch.ops.mesa.observe_rows.default, (x, *_state(4, device), 2, 4, 0.9, per_sample, False, row_dims,
                                                      14))
