"""A LayerNorm's normalised input made inside the compression kernels (``row_mean`` /
``row_rstd`` of ``mesa::observe_rows`` and ``mesa::quantize``; DESIGN.md, "LayerNorm's x_hat
inside the kernels").

Definition (``mesa_train.quant.reference.normalize_rows``): the ops take ``x`` as
``x_hat = (x - mean) * rstd`` per row in float32, each operation rounded once, then do what they
do without them (row scales rounded to float32, x_hat's dtype). The CPU kernels run on that
copy; the CUDA kernels (``cuda``-marked) compute it in registers, so x_hat never reaches
memory. Both must give the definition's bytes: statistics, seed, exponents, buffers and codes,
for every dtype, the layouts the layers use (rows of the last dim, two row dims, groups along
another dim: the copy paths), NaN / inf / zero rows, and rows whose variance is far below
``eps`` (DeiT3's class token: large row exponents).
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.quant import reference as R

from test_row_scale_kernels import DEVICES, DTYPES, SHAPES, _bits, _rows, _state, needs_ext


def _stats(x, row_dims):
    """LayerNorm's float32 mean and rstd of x over its last row_dims dims, as native_layer_norm
    returns them (float32 on CUDA; cast here for the CPU's half dtypes)."""
    _, mean, rstd = torch.native_layer_norm(x.float(), list(x.shape[x.dim() - row_dims:]), None, None, 1e-5)
    return mean, rstd


def _observe_rows_both(x, G, per_sample, symmetric, row_dims, mean, rstd, dim=None, steps=2):
    dim = x.dim() - 1 if dim is None else dim
    ops_state, ref_state = _state(G, x.device), _state(G, x.device)
    for step in range(steps):
        got = Q.observe_rows(x, *ops_state, dim, G, 0.9, per_sample, symmetric, row_dims, 64, mean, rstd)
        want = R.observe_rows(x, *ref_state, dim, G, 0.9, per_sample, symmetric, row_dims, 64, mean, rstd)
        for name, a, b in zip(("alpha", "beta", "seed", "k"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, step)
            assert torch.equal(_bits(a), _bits(b)), (name, step)
        for a, b in zip(ops_state, ref_state):
            assert torch.equal(_bits(a), _bits(b)), step
    return got


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
@pytest.mark.parametrize("case", ["spread", "specials"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_observe_rows_and_quantize_take_x_hat_as_defined(device, dtype, shape, row_dims, case, per_sample):
    x = _rows(shape, dtype, device, case)
    mean, rstd = _stats(x, row_dims)
    alpha, beta, seed, k = _observe_rows_both(x, 4, per_sample, case == "specials", row_dims, mean, rstd)
    if case == "spread":  # rows of tiny variance: x_hat ~ x / sqrt(eps), scaled up by 2**k
        assert int(k.max()) >= 3
    dim = x.dim() - 1
    x_hat = R.normalize_rows(x, mean, rstd)
    assert x_hat.dtype == torch.float32
    for stochastic in (True, False):
        q = Q.quantize(x, alpha, beta, dim, 4, stochastic, seed, k, mean, rstd)
        assert torch.equal(q, R.quantize(x, alpha, beta, dim, 4, stochastic, seed, k, mean, rstd)), stochastic
        # ... which are the codes of the float32 x_hat the kernels no longer write
        assert torch.equal(q, Q.quantize(x_hat, alpha, beta, dim, 4, stochastic, seed, k)), stochastic
    # and observe_rows' results are those of x_hat itself
    got = Q.observe_rows(x_hat, *_state(4, device), dim, 4, 0.9, per_sample, case == "specials", row_dims, 64)
    want = Q.observe_rows(x, *_state(4, device), dim, 4, 0.9, per_sample, case == "specials", row_dims, 64,
                          mean, rstd)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_x_hat_without_row_scales_and_in_other_layouts(device):
    """max_k = 0 (a LayerNorm with row_scale off: every k is 0, so observe's statistics and
    quantize's codes of x_hat); groups along another dim than the rows' and a strided x (the
    copy paths); rows of row_exp and of the statistics of different lengths (quantize's copy
    path); one group per channel; an all-NaN statistics row."""
    x = _rows((6, 7, 24), torch.bfloat16, device, "specials")
    mean, rstd = _stats(x, 1)
    rstd.view(-1)[5] = float("nan")
    state, ref = _state(5, device), _state(5, device)
    got = Q.observe_rows(x, *state, 2, 5, 0.9, False, False, 1, 0, mean, rstd)
    want = Q.observe(R.normalize_rows(x, mean, rstd), *ref, 2, 5, 0.9, False, False)
    assert int(got[3].abs().max()) == 0
    for a, b in zip(got[:3], want):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(Q.quantize(x, got[0], got[1], 2, 5, True, got[2], got[3], mean, rstd),
                       Q.quantize(R.normalize_rows(x, mean, rstd), got[0], got[1], 2, 5, True, got[2]))
    _observe_rows_both(x, 24, True, False, 1, mean, rstd)
    xt = x.transpose(0, 1)
    mt, rt = _stats(xt, 1)
    _observe_rows_both(xt, 3, True, False, 1, mt, rt)
    x4 = _rows((4, 6, 5, 24), torch.float32, device)
    m4, r4 = _stats(x4, 1)
    _observe_rows_both(x4, 6, True, False, 1, m4, r4, dim=1)
    m2, r2 = _stats(x4, 2)  # statistics over (5, 24), exponents per row of 24
    k = torch.randint(0, 5, (4, 6, 5, 1), dtype=torch.int8).to(device)
    a, b, s = Q.observe(x4, *_state(4, device), 3, 4, 0.9, False, False)
    assert torch.equal(Q.quantize(x4, a, b, 3, 4, True, s, k, m2, r2), R.quantize(x4, a, b, 3, 4, True, s, k, m2, r2))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_empty_x_with_statistics(device):
    e = torch.zeros(0, 16, device=device)
    m = torch.zeros(0, 1, device=device)
    got = Q.observe_rows(e, *_state(2, device), 1, 2, 0.9, False, False, 1, 64, m, m)
    want = R.observe_rows(e, *_state(2, device), 1, 2, 0.9, False, False, 1, 64, m, m)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))
    alpha, beta = torch.ones(1, 2, device=device), torch.zeros(1, 2, device=device)
    assert Q.quantize(e, alpha, beta, 1, 2, True, 0, None, m, m).shape == (0, 16)


BAD = [
    (lambda x, m: (m, None), r"row_mean and row_rstd go together .* got only row_mean"),
    (lambda x, m: (m.half(), m), r"row_mean must be a float32 tensor, got torch.float16|row_mean must be float32"),
    (lambda x, m: (m, m[:2]), r"must have one shape|must have shape x.shape\[:-n\]"),
    (lambda x, m: (m.view(3, 5), m.view(3, 5)), r"must have shape x.shape\[:-n\] \+ \(1,\) \* n"),
]


@pytest.mark.parametrize("make,match", BAD)
def test_bad_statistics_are_a_one_line_error(make, match):
    x = torch.randn(3, 5, 8)
    m = torch.zeros(3, 5, 1)
    mean, rstd = make(x, m)
    alpha, beta, seed = torch.ones(1, 2), torch.zeros(1, 2), Q.seed_tensor(0)
    calls = [lambda: R.quantize(x, alpha, beta, 2, 2, True, seed, None, mean, rstd),
             lambda: R.observe_rows(x, *_state(2, "cpu"), 2, 2, 0.9, False, False, 1, 64, mean, rstd)]
    if Q.BACKEND == "extension":
        calls += [lambda: torch.ops.mesa.quantize(x, alpha, beta, 2, 2, True, seed, None, mean, rstd),
                  lambda: torch.ops.mesa.observe_rows(x, *_state(2, "cpu"), 2, 2, 0.9, False, False, 1, 64, mean,
                                                      rstd)]
    for call in calls:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value).strip().splitlines()[0] and len(str(e.value).splitlines()) <= 2


def test_float64_input_with_statistics_is_a_one_line_error():
    x = torch.randn(3, 8, dtype=torch.float64)
    m = torch.zeros(3, 1)
    with pytest.raises(ValueError, match="float32, float16 (and|or) bfloat16"):
        Q.quantize(x, torch.ones(1, 2), torch.zeros(1, 2), 1, 2, True, 0, None, m, m)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_statistics(device):
    x = _rows((3, 5, 24), torch.bfloat16, device)
    mean, rstd = _stats(x, 1)
    for per_sample in (False, True):
        opcheck(torch.ops.mesa.observe_rows.default,
                (x, *_state(4, device), 2, 4, 0.9, per_sample, False, 1, 64, mean, rstd))
    a, b, s, k = Q.observe_rows(x, *_state(4, device), 2, 4, 0.9, False, False, 1, 64, mean, rstd)
    opcheck(torch.ops.mesa.quantize.default, (x, a, b, 2, 4, True, s, k, mean, rstd))
    opcheck(torch.ops.mesa.quantize.default, (x, a, b, 2, 4, False, s, None, mean, rstd))
