"""``mesa::dequantize(..., col_scale, col_shift)``: a LayerNorm's output ``x_hat * gamma + beta``
rebuilt from ``x_hat``'s codes in one pass (DESIGN.md, "LayerNorm + Linear: one copy").

Definition (``mesa_train.quant.reference.dequantize``): the values dequantize makes for
float32 (row exponents and ``row_mul`` included), times ``col_scale``, then plus ``col_shift``
(two float32 roundings, never one fused op), then rounded once to ``dtype``. The CPU kernel and
the CUDA epilogue (``cuda``-marked) must give those bits; the LayerNorm + Linear backward that
uses it must give the bits of the chain it replaces (dequantize, multiply, add, casts), which
``test_rebuild_is_the_chain_it_replaces`` checks against that chain written out, and the C++
node against the Python Function (tests/test_norm_shared.py).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.nn.layernorm_linear import rebuild_norm_output
from mesa_train.nn.quantizer import Packed, decompress
from mesa_train.quant import reference as R
from kernel_marks import DEVICES, DTYPES, needs_ext
from bit_patterns import bit_pattern

# (shape, group dim, groups, per-sample): LayerNorm tokens (B, N, C) with channel groups, a
# last dim that is not a multiple of the 16-element vector step (C = 40, 3, 1), groups along
# another dim, per-sample statistics, and a row of one element per vector step
LAYOUTS = [((4, 9, 48), -1, 6, False), ((2, 7, 40), -1, 5, True), ((5, 11, 3), 1, 1, False),
           ((3, 2, 33), 0, 3, False), ((17, 1), -1, 1, False)]


def _case(shape, dim, G, per_sample, device, seed=0, row_exp=False, row_mul=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 2
    mn, mx = R.group_minmax(x, dim, G, per_sample)
    q = R.quantize(x, mx - mn, mn, dim, G, True, 7)
    C = shape[-1]
    scale = torch.randn(C, generator=gen) * 3
    shift = torch.randn(C, generator=gen)
    rows = tuple(shape[:-1]) + (1,)
    k = torch.randint(0, 9, rows, generator=gen, dtype=torch.int8) if row_exp else None
    m = (torch.rand(rows, generator=gen) + 0.25) if row_mul else None
    return [None if t is None else t.to(device) for t in (q, mx - mn, mn, scale, shift, k, m)]


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", LAYOUTS, ids=str)
@pytest.mark.parametrize("rows", ["none", "row_exp", "row_exp+row_mul"])
def test_kernel_gives_the_definitions_bits(device, dtype, shape, dim, G, per_sample, rows):
    q, alpha, beta, scale, shift, k, m = _case(shape, dim, G, per_sample, device, row_exp=rows != "none",
                                               row_mul=rows == "row_exp+row_mul")
    for cs, ct in ((scale, shift), (scale, None), (None, shift)):
        got = Q.dequantize(q, alpha, beta, dim, G, dtype, k, m, cs, ct)
        want = R.dequantize(q, alpha, beta, dim, G, dtype, k, m, cs, ct)
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.equal(bit_pattern(got), bit_pattern(want)), (cs is None, ct is None)


def test_definition_is_the_float32_chain_rounded_once():
    """The reference as the composition it stands for, op by op: no FMA, one final rounding."""
    q, alpha, beta, scale, shift, k, _ = _case((4, 9, 48), -1, 6, False, "cpu", row_exp=True)
    y32 = R.dequantize(q, alpha, beta, -1, 6, torch.float32, k)
    for dtype in DTYPES:
        want = torch.add(torch.mul(y32, scale), shift).to(dtype)
        got = R.dequantize(q, alpha, beta, -1, 6, dtype, k, None, scale, shift)
        assert torch.equal(bit_pattern(got), bit_pattern(want))
    # and not the dtype's own dequantize followed by the affine (that rounds twice)
    twice = (R.dequantize(q, alpha, beta, -1, 6, torch.bfloat16, k).float() * scale + shift).to(torch.bfloat16)
    once = R.dequantize(q, alpha, beta, -1, 6, torch.bfloat16, k, None, scale, shift)
    assert not torch.equal(bit_pattern(twice), bit_pattern(once))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_strided_codes_empty_and_specials(device):
    q, alpha, beta, scale, shift, _, _ = _case((4, 9, 48), -1, 6, False, device)
    qs = q.transpose(0, 1).contiguous().transpose(0, 1)  # same codes, another layout
    assert torch.equal(Q.dequantize(qs, alpha, beta, -1, 6, torch.bfloat16, None, None, scale, shift),
                       Q.dequantize(q, alpha, beta, -1, 6, torch.bfloat16, None, None, scale, shift))
    e = torch.zeros(0, 48, dtype=torch.uint8, device=device)
    out = Q.dequantize(e, alpha, beta, -1, 6, torch.float16, None, None, scale, shift)
    assert out.shape == (0, 48) and out.dtype == torch.float16
    special = scale.clone()
    special[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    got = Q.dequantize(q, alpha, beta, -1, 6, torch.float32, None, None, special, shift)
    want = R.dequantize(q, alpha, beta, -1, 6, torch.float32, None, None, special, shift)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_ext
def test_bad_arguments_are_one_line_errors():
    q, alpha, beta, scale, shift, _, _ = _case((4, 9, 48), -1, 6, False, "cpu")
    cases = [((None, scale[:-1]), "col_shift must have shape (C,) with C = q.shape[-1]"),
             ((scale.double(), None), "col_scale must be"),
             ((scale.view(6, 8), None), "col_scale must have shape (C,)"),
             ((scale.to("meta"), None), "col_scale is on meta but the codes are on cpu")]
    for (cs, ct), msg in cases:
        for fn in (Q.dequantize, torch.ops.mesa.dequantize, R.dequantize):
            with pytest.raises(ValueError, match=re.escape(msg)) as info:
                fn(q, alpha, beta, 2, 6, torch.float32, None, None, cs, ct)
            assert "\n" not in str(info.value).strip()


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_dequantize_with_columns(device):
    q, alpha, beta, scale, shift, k, m = _case((2, 7, 40), -1, 5, True, device, row_exp=True, row_mul=True)
    for dtype in DTYPES:
        opcheck(torch.ops.mesa.dequantize.default, (q, alpha, beta, 2, 5, dtype, k, m, scale, shift))
        opcheck(torch.ops.mesa.dequantize.default, (q, alpha, beta, 2, 5, dtype, None, None, None, shift))


def _chain(packed, k, weight, bias, casts):
    """What the LayerNorm + Linear backward computed before the column epilogue: float32
    x_hat, a multiply, an add, then each cast of the chain."""
    y = decompress(packed, torch.float32, row_exp=k)
    if weight is not None:
        y = y * weight.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    for dtype in casts:
        y = y.to(dtype)
    return y


@pytest.mark.parametrize("casts", [(torch.float32, torch.bfloat16, torch.bfloat16),  # CUDA autocast
                                   (torch.float32, torch.float32, torch.float32),  # fp32
                                   (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # a bf16 model
                                   (torch.bfloat16, torch.float16, torch.float16)],  # two roundings
                         ids=lambda c: "-".join(str(d).split(".")[-1] for d in c))
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_rebuild_is_the_chain_it_replaces(casts, affine):
    q, alpha, beta, _, _, k, _ = _case((4, 9, 48), -1, 6, False, "cpu", row_exp=True)
    packed = Packed(q, alpha, beta, 2, 6)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, generator=gen).to(casts[0]) if affine in ("both", "weight") else None
    bias = torch.randn(48, generator=gen).to(casts[0]) if affine in ("both", "bias") else None
    got = rebuild_norm_output(packed, k, weight, bias, torch.float32, casts)
    want = _chain(packed, k, weight, bias, casts)
    assert got.dtype == want.dtype == casts[-1]
    assert torch.equal(bit_pattern(got), bit_pattern(want))
