"""``mesa::gelu_backward``: the exact GELU's backward straight from its 8-bit codes
(DESIGN.md, "GELU backward from the codes").

Definition (``mesa_train.quant.reference.gelu_backward``): ``aten.gelu_backward(g,
dequantize(q, alpha, beta, dim, G, g.dtype))``. The CPU kernel is that composition, so it must
give the same bits; the CUDA kernel computes it in one pass with ATen's float32 formula and no
FMA contraction, so on a GPU (``cuda``-marked) it must lie within one unit in the last place
of the output dtype (float32: a few ulps) of the composition. The layers' use of it (op counts,
C++ node == Python Function) is in test_op_counts.py and test_layers_autograd.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import DEVICES, DTYPES, needs_ext

# (shape, group dim, groups, per-sample statistics): the MLP's (B, N, 4C) with channel groups,
# a conv activation per channel (dim 1), groups that do not divide the dim, a vector tail
LAYOUTS = [((4, 9, 48), -1, 6, False), ((2, 8, 5, 5), 1, 8, False), ((3, 7, 10), -1, 3, True),
           ((5, 33), 1, 4, False), ((2, 3, 4, 6), 1, 3, True)]


def _case(shape, dim, G, per_sample, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    mn, mx = R.group_minmax(x, dim, G, per_sample)
    q = R.quantize(x, mx - mn, mn, dim, G, True, 11)
    return [t.to(device) for t in (g, q, mx - mn, mn)]


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the last place of want's dtype at want's magnitude."""
    eps = torch.finfo(want.dtype).eps
    tiny = torch.finfo(want.dtype).tiny
    scale = want.float().abs().clamp_min(tiny) * eps
    return float(((got.float() - want.float()).abs() / scale).max())


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
def test_cpu_kernel_is_the_composition(dtype, shape, dim, G, per_sample):
    g, q, alpha, beta = _case(shape, dim, G, per_sample, dtype, "cpu")
    got = Q.gelu_backward(g, q, alpha, beta, dim, G)
    xh = Q.dequantize(q, alpha, beta, dim, G, dtype)
    want = torch.ops.aten.gelu_backward(g, xh)
    assert got.dtype == dtype and got.shape == g.shape
    assert torch.equal(got, want)
    assert torch.equal(got, R.gelu_backward(g, q, alpha, beta, dim, G))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
def test_kernel_is_within_an_ulp_of_the_composition(device, dtype, shape, dim, G, per_sample):
    g, q, alpha, beta = _case(shape, dim, G, per_sample, dtype, device)
    got = Q.gelu_backward(g, q, alpha, beta, dim, G)
    want = R.gelu_backward(g, q, alpha, beta, dim, G)
    # one ulp of a 16-bit dtype; float32: erf/exp differ by an ulp or two between libraries
    assert _ulps(got, want) <= (1.0 if dtype != torch.float32 else 8.0)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_strided_gradient_empty_and_specials(device):
    g, q, alpha, beta = _case((4, 9, 48), -1, 6, False, torch.bfloat16, device)
    gs = g.transpose(0, 1).contiguous().transpose(0, 1)  # same values, another layout
    assert torch.equal(Q.gelu_backward(gs, q, alpha, beta, -1, 6), Q.gelu_backward(g, q, alpha, beta, -1, 6))
    e = torch.zeros(0, 48, device=device)
    out = Q.gelu_backward(e, e.to(torch.uint8), alpha, beta, -1, 6)
    assert out.shape == (0, 48) and out.dtype == e.dtype
    # a NaN or infinite incoming gradient stays NaN / inf where gelu' is nonzero
    g2 = g.clone()
    g2.view(-1)[0], g2.view(-1)[1] = float("nan"), float("inf")
    got, want = Q.gelu_backward(g2, q, alpha, beta, -1, 6), R.gelu_backward(g2, q, alpha, beta, -1, 6)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))


def test_bad_arguments_are_one_line_errors():
    g, q, alpha, beta = _case((4, 9, 48), -1, 6, False, torch.float32, "cpu")
    for args, match in [((g.double(), q, alpha, beta, -1, 6), "g must be float32, float16 or bfloat16"),
                        ((g, q.float(), alpha, beta, -1, 6), "expects uint8 codes"),
                        ((g[:2], q, alpha, beta, -1, 6), "g has shape"),
                        ((g, q, alpha, beta, -1, 5), r"alpha/beta|\(S, 5\)"),
                        ((g, q, alpha, beta, 3, 6), "out of range")]:
        for fn in (Q.gelu_backward, torch.ops.mesa.gelu_backward, R.gelu_backward):
            with pytest.raises(ValueError, match=match) as info:
                fn(*args)
            assert "\n" not in str(info.value).strip(), str(info.value)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gelu_backward(device):
    for shape, dim, G, per_sample in LAYOUTS[:3]:
        g, q, alpha, beta = _case(shape, dim, G, per_sample, torch.bfloat16, device)
        opcheck(torch.ops.mesa.gelu_backward.default, (g, q, alpha, beta, dim, G))


# ----------------------------------------------------------------------------- GELU + Linear
# fc2's input h is compressed with power-of-two row scales (Linear inputs): the backward of the
# MLP's shared copy takes them as row_exp (gelu_backward) and recomputes fc2's input gelu(h)
# with dequantize_gelu, each one op reading the codes (DESIGN.md, "MLP: one copy for GELU and
# fc2"). Definitions: the same compositions with dequantize's row_exp.
def _rows_case(shape, dim, G, per_sample, dtype, device, seed=0):
    g, q, alpha, beta = _case(shape, dim, G, per_sample, dtype, "cpu", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = torch.randint(0, 7, tuple(shape[:-1]) + (1,), generator=gen, dtype=torch.int8)
    return [t.to(device) for t in (g, q, alpha, beta, k)]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
def test_cpu_kernels_with_row_exp_are_the_compositions(dtype, shape, dim, G, per_sample):
    g, q, alpha, beta, k = _rows_case(shape, dim, G, per_sample, dtype, "cpu")
    xh = Q.dequantize(q, alpha, beta, dim, G, dtype, k)
    assert not torch.equal(xh, Q.dequantize(q, alpha, beta, dim, G, dtype))  # the exponents matter here
    got = Q.gelu_backward(g, q, alpha, beta, dim, G, k)
    assert torch.equal(got, torch.ops.aten.gelu_backward(g, xh))
    assert torch.equal(got, R.gelu_backward(g, q, alpha, beta, dim, G, k))
    y = Q.dequantize_gelu(q, alpha, beta, dim, G, dtype, k)
    assert y.dtype == dtype and torch.equal(y, torch.nn.functional.gelu(xh))
    assert torch.equal(y, R.dequantize_gelu(q, alpha, beta, dim, G, dtype, k))
    assert torch.equal(Q.dequantize_gelu(q, alpha, beta, dim, G, dtype),
                       torch.nn.functional.gelu(Q.dequantize(q, alpha, beta, dim, G, dtype)))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
def test_kernels_with_row_exp_are_within_an_ulp(device, dtype, shape, dim, G, per_sample):
    g, q, alpha, beta, k = _rows_case(shape, dim, G, per_sample, dtype, device)
    tol = 1.0 if dtype != torch.float32 else 8.0  # erf / exp: an ulp or two between libraries
    assert _ulps(Q.gelu_backward(g, q, alpha, beta, dim, G, k), R.gelu_backward(g, q, alpha, beta, dim, G, k)) <= tol
    assert _ulps(Q.dequantize_gelu(q, alpha, beta, dim, G, dtype, k),
                 R.dequantize_gelu(q, alpha, beta, dim, G, dtype, k)) <= tol


@needs_ext
def test_row_exp_and_dequantize_gelu_errors_are_one_line():
    g, q, alpha, beta, k = _rows_case((4, 9, 48), -1, 6, False, torch.float32, "cpu")
    for call, match in [(lambda f: f.gelu_backward(g, q, alpha, beta, -1, 6, k.float()), "row_exp must be"),
                        (lambda f: f.gelu_backward(g, q, alpha, beta, -1, 6, k[:2]), "row_exp must have shape"),
                        (lambda f: f.dequantize_gelu(q, alpha, beta, -1, 6, torch.float64), "float32, float16 or "
                                                                                             "bfloat16"),
                        (lambda f: f.dequantize_gelu(q, alpha, beta, -1, 6, torch.float32, k[:, :2]),
                         "row_exp must have shape")]:
        for f in (Q, torch.ops.mesa, R):
            with pytest.raises(ValueError, match=match) as info:
                call(f)
            assert "\n" not in str(info.value).strip(), str(info.value)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_row_exp_and_dequantize_gelu(device):
    g, q, alpha, beta, k = _rows_case((4, 9, 48), -1, 6, False, torch.bfloat16, device)
    opcheck(torch.ops.mesa.gelu_backward.default, (g, q, alpha, beta, -1, 6, k))
    for dtype in DTYPES:
        opcheck(torch.ops.mesa.dequantize_gelu.default, (q, alpha, beta, 2, 6, dtype, k))
        opcheck(torch.ops.mesa.dequantize_gelu.default, (q, alpha, beta, 2, 6, dtype, None))


# ----------------------------------------------------------------------------- both at once
# GELU + Linear's backward needs fc2's input gelu(h) and the GELU's gradient from the same codes:
# mesa::gelu_value_and_grad gives both from one read (on CUDA one pass, one erf per element),
# each output the bits of its own op on every device (the shared erff is the same value).
@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
@pytest.mark.parametrize("rows", [False, True], ids=["", "row-exp"])
def test_value_and_grad_are_the_two_ops(device, dtype, shape, dim, G, per_sample, rows):
    g, q, alpha, beta, k = _rows_case(shape, dim, G, per_sample, dtype, device)
    k = k if rows else None
    y, dx = Q.gelu_value_and_grad(g, q, alpha, beta, dim, G, k)
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == g.shape
    assert torch.equal(y, Q.dequantize_gelu(q, alpha, beta, dim, G, dtype, k))
    assert torch.equal(dx, Q.gelu_backward(g, q, alpha, beta, dim, G, k))
    if device == "cpu":  # the definition, on the host
        ry, rdx = R.gelu_value_and_grad(g, q, alpha, beta, dim, G, k)
        assert torch.equal(y, ry) and torch.equal(dx, rdx)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_value_and_grad_opcheck_empty_and_errors(device):
    g, q, alpha, beta, k = _rows_case((4, 9, 48), -1, 6, False, torch.bfloat16, device)
    opcheck(torch.ops.mesa.gelu_value_and_grad.default, (g, q, alpha, beta, -1, 6, k))
    opcheck(torch.ops.mesa.gelu_value_and_grad.default, (g.float(), q, alpha, beta, 2, 6, None))
    e = torch.zeros(0, 48, device=device)
    y, dx = Q.gelu_value_and_grad(e, e.to(torch.uint8), alpha, beta, -1, 6)
    assert y.shape == dx.shape == (0, 48)
    for args, match in [((g.double(), q, alpha, beta, -1, 6), "g must be float32, float16 or bfloat16"),
                        ((g[:2], q, alpha, beta, -1, 6), "g has shape"),
                        ((g, q, alpha, beta, -1, 6, k[:2]), "row_exp must have shape")]:
        for fn in (Q.gelu_value_and_grad, torch.ops.mesa.gelu_value_and_grad, R.gelu_value_and_grad):
            with pytest.raises(ValueError, match=match) as info:
                fn(*args)
            assert "\n" not in str(info.value).strip(), str(info.value)
