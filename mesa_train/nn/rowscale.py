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
``[0, 64]`` (``[0, 14]`` with float16 involved), i.e. only rows at least 2x smaller than a typical row are scaled, into the
typical range; ``k`` is saved as one int8 per row and undone after dequantization. Powers of
two scale exactly (no rounding in the scaling itself), rows of ordinary spread keep
``k = 0`` (the bytes are those without row scales), and the cost is one byte per row
(``1/C`` of the codes) plus a max-reduction and a scaled transient copy in forward.
"""
from __future__ import annotations

import torch

__all__ = ["row_exponents", "scale_rows", "unscale_rows", "max_exponent", "compress_rows"]


def max_exponent(*dtypes: torch.dtype) -> int:
    """Largest ``k`` with ``2**k`` and ``2**-k`` normal in every dtype (float16: 14)."""
    return 14 if torch.float16 in dtypes else 64


@torch.no_grad()
def row_exponents(x: torch.Tensor, row_dims: int = 1, max_k: int = 64) -> torch.Tensor:
    """int8 exponents ``k`` of shape ``x.shape[:-row_dims] + (1,) * row_dims`` (see module doc).

    One read pass over ``x`` (row min and max; two with several row dims); the rest works on
    one float per row."""
    # max(amax, -amin), not vector_norm(inf): the same values (exact; NaN propagates; abs()
    # only makes a -0.0 row +0.0) without a temporary, at 1/18 of the CPU time measured on a
    # (32, 257, 384) fp32 tensor (0.5 ms against 9.6 ms). One row dim (Linear, LayerNorm):
    # aminmax reads x once where amin and amax read it twice (on an H100 the pair was 3.1 ms
    # of a DeiT-S step, results/table1/*.profile.md)
    if row_dims == 1:
        mn, mx = torch.aminmax(x, dim=-1, keepdim=True)
    else:
        dims = tuple(range(x.dim() - row_dims, x.dim()))
        mn, mx = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    r = torch.maximum(mx, mn.neg()).abs()
    r = r.to(torch.float32)
    # ratio = m * 2**e with m in [0.5, 1): floor(log2(ratio)) = e - 1. A zero row (ratio inf)
    # or an all-zero batch (nan) gets e = 0, i.e. k = 0.
    _, e = torch.frexp(r.mean() / r)
    return (e - 1).clamp_(0, max_k).to(torch.int8)


def scale_rows(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` (a new tensor of ``x``'s dtype; exact for powers of two).

    ``2**k`` is exact in ``x``'s dtype for the ``k`` range :func:`max_exponent` allows, so
    this is bitwise ``torch.ldexp(x, k)``, which computes ``pow(2, k)`` per element of the
    broadcast result instead (15-20x slower on CPU)."""
    return x * torch.exp2(k.to(x.dtype))


def unscale_rows(x: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """``x * 2**-k`` in place (``x`` is a fresh dequantized tensor); ``k=None``: ``x``."""
    if k is None:
        return x
    return x.mul_(torch.exp2(k.to(x.dtype).neg_()))


def compress_rows(quantizer, x: torch.Tensor, row_dims: int, max_k: int):
    """``(packed, k)``: ``x`` compressed with channel groups over its last dim, its small rows
    scaled first when the quantizer's ``row_scale`` option is on (else ``k`` is ``None`` and
    no extra pass is made)."""
    if not quantizer.options.row_scale:
        return quantizer.compress(x, x.dim() - 1), None
    k = row_exponents(x, row_dims, max_k)
    return quantizer.compress(scale_rows(x, k), x.dim() - 1), k
