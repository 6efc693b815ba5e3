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

from bit_patterns import bit_pattern
from kernel_marks import DEVICES, DTYPES, needs_ext
from test_row_scale_kernels import SHAPES, _rows, _state
from test_row_scale_kernels import _observe_rows_both as _observe_rows_pair


def _stats(x, row_dims):
    """LayerNorm's float32 mean and rstd of x over its last row_dims dims, as native_layer_norm
    returns them (float32 on CUDA; cast here for the CPU's half dtypes)."""
    _, mean, rstd = torch.native_layer_norm(x.float(), list(x.shape[x.dim() - row_dims:]), None, None, 1e-5)
    return mean, rstd


def _observe_rows_both(x, G, per_sample, symmetric, row_dims, mean, rstd, dim=None):
    return _observe_rows_pair(x, G, per_sample, symmetric, row_dims, 64, mean=mean, rstd=rstd, dim=dim)


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
        assert torch.equal(bit_pattern(a), bit_pattern(b))


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
        assert torch.equal(bit_pattern(a), bit_pattern(b))
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
        assert torch.equal(bit_pattern(a), bit_pattern(b))
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


# ----------------------------------------------------------------------------- mesa::compress
# A Python LayerNorm (the eager fallback, torch.compile with the ops) compresses x_hat in one
# mesa::compress given x, mean and rstd: the codes, statistics, exponents and buffers of
# compress(normalize_rows(x, mean, rstd)), bit for bit, for every estimator (the delayed one
# compresses the normalised copy) and with and without row exponents.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("estimator", [0, 1, 2])
@pytest.mark.parametrize("max_k", [0, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_with_statistics_is_compress_of_x_hat(device, impl, estimator, max_k, dtype):
    if impl == "op" and Q.BACKEND != "extension":
        pytest.skip(f"compiled extension not loaded: {Q.extension_error}")
    fn = torch.ops.mesa.compress if impl == "op" else R.compress
    x = _rows((4, 6, 24), dtype, device, "specials" if estimator == 1 else "spread")
    mean, rstd = _stats(x, 1)
    x_hat = R.normalize_rows(x, mean, rstd)
    state, ref = _state(4, device), _state(4, device)
    for step in range(2):  # (the second with initialised estimates: the delayed estimator's one pass)
        got = fn(x, *state, 2, 4, 0.9, estimator, False, True, 1, max_k, mean, rstd)
        want = R.compress(x_hat, *ref, 2, 4, 0.9, estimator, False, True, 1, max_k)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(bit_pattern(a), bit_pattern(b)), step
        for a, b in zip(state, ref):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), step
    assert got[3].numel() == (0 if max_k == 0 else 24)


@needs_ext
def test_compress_with_one_statistic_is_a_one_line_error():
    x = torch.randn(3, 5, 8)
    m = torch.zeros(3, 5, 1)
    for fn in (torch.ops.mesa.compress, R.compress):
        with pytest.raises(ValueError, match="row_mean and row_rstd go together .* got only row_mean") as e:
            fn(x, *_state(2, "cpu"), 2, 2, 0.9, 0, False, True, 1, 0, m, None)
        assert "\n" not in str(e.value)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_compress_with_statistics(device):
    x = _rows((3, 5, 24), torch.bfloat16, device)
    mean, rstd = _stats(x, 1)
    for estimator, max_k in ((0, 64), (1, 0), (2, 64)):
        opcheck(torch.ops.mesa.compress.default,
                (x, *_state(4, device), 2, 4, 0.9, estimator, False, True, 1, max_k, mean, rstd))


def test_compiled_layernorm_hands_the_op_x_and_its_statistics():
    """Under torch.compile with the ops, the LayerNorm's compression is one mesa.compress given
    x, mean and rstd: the forward graph computes no x_hat for it (Inductor wrote it in float32
    for the op to read, a pass over the activation), and the step equals eager bit for bit."""
    import mesa_train.nn as mnn
    from mesa_train.quant.compile_kernels import set_compile_kernels

    from graph_capture import recording_backend

    backend, graphs = recording_backend()
    torch._dynamo.reset()
    set_compile_kernels("ops")
    try:
        layers = [mnn.LayerNorm(24, num_groups=4) for _ in range(2)]
        layers[1].quantizer.rng.copy_(layers[0].quantizer.rng)
        compiled = torch.compile(layers[1], backend=backend, fullgraph=True)
        x = torch.randn(4, 6, 24) * 3
        grads = []
        for fn in (layers[0], compiled):
            xi = x.clone().requires_grad_()
            out = fn(xi)
            out.backward(torch.ones_like(out))
            grads.append((out, xi.grad))
    finally:
        set_compile_kernels("auto")
    (gm,) = graphs["forward"]
    # (the op is functionalized: auto_functionalized_v2(mesa.compress.default, x=..., ...))
    (compress,) = [n for n in gm.graph.nodes if n.op == "call_function" and "mesa.compress" in str(n.args)]
    assert compress.kwargs["x"].op == "placeholder", gm.code  # x itself, not a computed x_hat
    assert compress.kwargs["row_mean"] is not None and compress.kwargs["row_rstd"] is not None, gm.code
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# ----------------------------------------------------------------------------- dequantize's row_mul
# A LayerNorm's backward dequantizes x - mean = x_hat / rstd in the dequantize kernel (row_mul
# = 1 / rstd per row), so that ATen's backward, given the real rstd, needs no multiply after it.
# Definition (reference.multiply_rows): the value dequantize stores (after the row exponents)
# times the row's factor, in float32, rounded to the output dtype.
def _codes(shape, G, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
    alpha = (torch.rand(1, G, generator=g) * 4).to(device)
    beta = (torch.randn(1, G, generator=g)).to(device)
    return q, alpha, beta


def _row_mul(shape_rows, device, seed=4):
    g = torch.Generator().manual_seed(seed)
    m = torch.exp2(torch.randn(shape_rows, generator=g) * 6)
    flat = m.view(-1)
    flat[0] = float("nan")
    flat[-1] = 0.0
    if flat.numel() > 2:
        flat[1] = float("inf")
    return m.to(device)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,row_dims", SHAPES, ids=str)
@pytest.mark.parametrize("with_k", [False, True])
def test_dequantize_row_mul_is_the_definition(device, dtype, shape, row_dims, with_k):
    q, alpha, beta = _codes(shape, 4, device)
    rows = R.row_shape(q, row_dims)
    m = _row_mul(rows, device)
    k = torch.randint(0, 14, rows, dtype=torch.int8).to(device) if with_k else None
    dim = q.dim() - 1
    got = Q.dequantize(q, alpha, beta, dim, 4, dtype, k, m)
    assert got.dtype == dtype
    assert torch.equal(bit_pattern(got), bit_pattern(R.dequantize(q, alpha, beta, dim, 4, dtype, k, m)))
    # ... which is the multiply it replaces, after the dequantize it is part of
    replaced = R.multiply_rows(Q.dequantize(q, alpha, beta, dim, 4, dtype, k), m)
    assert torch.equal(bit_pattern(got), bit_pattern(replaced))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_row_mul_other_layouts(device):
    """Groups along another dim than the rows' (per-head), factors per row of two dims with
    exponents per row of one (the kernel's second-pass path), empty codes."""
    q, alpha, beta = _codes((4, 6, 5, 24), 6, device)
    m = _row_mul((4, 6, 5, 1), device)
    for k in (None, torch.randint(0, 9, (4, 6, 5, 1), dtype=torch.int8).to(device)):
        assert torch.equal(bit_pattern(Q.dequantize(q, alpha, beta, 1, 6, torch.float32, k, m)),
                           bit_pattern(R.dequantize(q, alpha, beta, 1, 6, torch.float32, k, m)))
    q, alpha, beta = _codes((4, 6, 5, 24), 4, device)
    m2 = _row_mul((4, 6, 1, 1), device)
    k1 = torch.randint(0, 9, (4, 6, 5, 1), dtype=torch.int8).to(device)
    assert torch.equal(bit_pattern(Q.dequantize(q, alpha, beta, 3, 4, torch.bfloat16, k1, m2)),
                       bit_pattern(R.dequantize(q, alpha, beta, 3, 4, torch.bfloat16, k1, m2)))
    e = torch.zeros(0, 8, dtype=torch.uint8, device=device)
    assert Q.dequantize(e, alpha[:, :2], beta[:, :2], 1, 2, torch.float32, None,
                        torch.zeros(0, 1, device=device)).shape == (0, 8)


@pytest.mark.parametrize("bad,match", [
    (lambda m: m.double(), "row_mul must be (a )?float32"),
    (lambda m: m.view(3, 5), r"row_mul must have shape q.shape\[:-n\] \+ \(1,\) \* n"),
    (lambda m: m[:2], r"row_mul must have shape"),
])
def test_bad_row_mul_is_a_one_line_error(bad, match):
    q, alpha, beta = _codes((3, 5, 8), 2, "cpu")
    m = bad(torch.ones(3, 5, 1))
    calls = [lambda: R.dequantize(q, alpha, beta, 2, 2, torch.float32, None, m),
             lambda: Q.dequantize(q, alpha, beta, 2, 2, torch.float32, None, m)]
    if Q.BACKEND == "extension":
        calls.append(lambda: torch.ops.mesa.dequantize(q, alpha, beta, 2, 2, torch.float32, None, m))
    for call in calls:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert len(str(e.value).strip().splitlines()) == 1


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_dequantize_row_mul(device):
    q, alpha, beta = _codes((3, 5, 24), 4, device)
    m = _row_mul((3, 5, 1), device).nan_to_num(1.0, 2.0, 0.5)  # (opcheck compares outputs without NaN equality)
    k = torch.randint(0, 9, (3, 5, 1), dtype=torch.int8).to(device)
    opcheck(torch.ops.mesa.dequantize.default, (q, alpha, beta, 2, 4, torch.bfloat16, k, m))
    opcheck(torch.ops.mesa.dequantize.default, (q, alpha, beta, 2, 4, torch.float32, None, m))


@pytest.mark.parametrize("shape,normalized", [((4, 9, 16), (16,)), ((3, 4, 16), (4, 16))], ids=str)
def test_layernorm_backward_from_x_minus_mean_is_the_formula(shape, normalized):
    """The Mesa LayerNorm's gradients equal the closed form evaluated (in float64) on the x_hat
    its codes hold: dx = rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat)), dweight = sum(g *
    x_hat), dbias = sum(g), to float32 rounding; rows of very different spread (rstd from 1e-3
    to 1e3) so that a wrong or missing rstd factor shows."""
    import mesa_train.nn as mn

    torch.manual_seed(0)
    spread = torch.logspace(-3, 3, shape[0]).view(-1, *([1] * (len(shape) - 1)))
    x = (torch.randn(shape) * spread + 5).requires_grad_()
    layer = mn.LayerNorm(normalized, rounding="nearest")
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    g = torch.randn(shape)
    layer(x).backward(g)
    # the x_hat the codes hold: the quantizer's state after this step describes them, so rebuild
    # them from the same ops (nearest rounding: no seed dependence)
    nd = len(normalized)
    _, mean, rstd = torch.native_layer_norm(x.detach(), list(normalized), None, None, layer.eps)
    x_hat = R.normalize_rows(x.detach(), mean, rstd)
    # float64 closed form on the exact x_hat: Mesa's gradients sit within the 8-bit error of it
    dims = tuple(range(x.dim() - nd, x.dim()))
    gw = (g * layer.weight.detach()).double()
    xh = x_hat.double()
    r = rstd.double()
    dx = r * (gw - gw.mean(dims, keepdim=True) - xh * (gw * xh).mean(dims, keepdim=True))
    rel = ((x.grad.double() - dx).norm(dim=dims) / dx.norm(dim=dims))
    assert rel.max() < 0.02, rel  # every row, whatever its rstd (8-bit x_hat: ~0.5% here)
    dw = (g.double() * xh).sum(tuple(range(x.dim() - nd)))
    assert ((layer.weight.grad.double() - dw).norm() / dw.norm()) < 0.01
    assert torch.allclose(layer.bias.grad.double(), g.double().sum(tuple(range(x.dim() - nd))), rtol=1e-5, atol=1e-5)
