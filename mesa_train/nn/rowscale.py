"""Power-of-two row scales: keep rows far smaller than their neighbours representable.

A channel group's 8-bit grid is shared by every row (token) of the batch. A row whose values
are much smaller than the others' falls below one grid step and is saved as noise. In
timm's DeiT3 the class token starts at std 1e-6 with no position embedding and layer scale
1e-6 keeps it there: its LayerNorm variance is far below ``eps`` (normalised values ~1e-3)
and every Linear input of its row (LayerNorm output, GELU output) is ~1e-3 of the patch
rows'. That row carries most of the loss gradient, so the weight gradients built from it
reached cosine 0.03-0.3 against exact.

Fix (``docs/DESIGN.md``, "Rows far below the grid"): before quantizing, each row is
multiplied by ``2**k`` with ``k = floor(log2(mean_row_absmax / row_absmax))`` clamped to
``[0, 64]`` (``[0, 14]`` with float16 involved), i.e. only rows at least 2x smaller than a
typical row are scaled, into the typical range; ``k`` is saved as one int8 per row and undone
after dequantization. Powers of two scale exactly (no rounding in the scaling itself), rows
of ordinary spread keep ``k = 0`` (the bytes are those without row scales), and the cost is
one byte per row (``1/C`` of the codes) plus one reduction over the rows in forward:
``mesa::row_exponents`` finds ``k``, and ``mesa::observe`` / ``quantize`` / ``dequantize``
take it as ``row_exp`` and scale inside their kernels (no scaled copy, no undo pass). Traced
as plain PyTorch under ``torch.compile`` (and for the variant formats) the same scaling is
a multiply that Inductor fuses.
"""
from __future__ import annotations

import torch

from mesa_train.quant import reference
from mesa_train.quant.compile_kernels import traced_as_pytorch
from mesa_train.quant.reference import scale_rows, unscale_rows

from .quantizer import Packed, decompress

__all__ = ["row_exponents", "scale_rows", "unscale_rows", "max_exponent", "compress_rows", "decompress_rows"]

_ROW_EXPONENTS = torch.ops.mesa.row_exponents.default


def max_exponent(*dtypes: torch.dtype) -> int:
    """Largest ``k`` with ``2**k`` and ``2**-k`` normal in every dtype (float16: 14)."""
    return 14 if torch.float16 in dtypes else 64


def row_exponents(x: torch.Tensor, row_dims: int = 1, max_k: int = 64) -> torch.Tensor:
    """int8 exponents ``k`` of shape ``x.shape[:-row_dims] + (1,) * row_dims`` (see module doc):
    the extension's op (one pass over ``x``, then per-row work), or its definition in plain
    PyTorch where the compression is traced."""
    if traced_as_pytorch(x):
        return reference.row_exponents(x, row_dims, max_k)
    return _ROW_EXPONENTS(x, row_dims, max_k)


def compress_normalized(quantizer, x: torch.Tensor, row_mean: torch.Tensor, row_rstd: torch.Tensor, row_dims: int,
                        max_k: int):
    """``(packed, k)``: a LayerNorm's ``x_hat = (x - mean) * rstd`` compressed as
    :func:`compress_rows` compresses it, in one op that computes ``x_hat`` in its kernels where
    the quantizer can (``ActivationQuantizer.takes_row_norm``: the same values, so the same
    codes; ``x_hat`` never written), else from the normalised copy."""
    if quantizer.takes_row_norm(x):
        k_max = max_k if quantizer.options.row_scale else 0
        return quantizer.compress_normalized(x, row_mean.float(), row_rstd.float(), row_dims, k_max)
    return compress_rows(quantizer, reference.normalize_rows(x, row_mean, row_rstd), row_dims, max_k)


def compress_rows(quantizer, x: torch.Tensor, row_dims: int, max_k: int):
    """``(packed, k)``: ``x`` compressed with channel groups over its last dim, its small rows
    scaled first when the quantizer's ``row_scale`` option is on (else ``k`` is ``None`` and
    no extra pass is made)."""
    if not quantizer.options.row_scale:
        return quantizer.compress(x, x.dim() - 1), None
    return quantizer.compress_rows(x, row_dims, max_k)  # (one op with the extension: mesa::compress)


def decompress_rows(packed: Packed, dtype: torch.dtype, k: torch.Tensor | None,
                    row_mul: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`compress_rows` saved, back as ``dtype`` with the row scales undone (then
    times ``row_mul`` per row, in the same kernel where it is the extension's)."""
    return decompress(packed, dtype, row_exp=k, row_mul=row_mul)
