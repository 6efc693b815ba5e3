"""Mesa ``Normalize``: ``F.normalize(x, p=2, dim=-1, eps)`` keeping its 8-bit *output* plus
the per-row divisor.

Cosine attention (SwinV2, SwinV2-CR, XCiT) normalises q and k before ``q @ k^T``. Stock
autograd keeps ``x`` (for the norm and the division) and the norm; ``x`` is a view of the
whole qkv projection output, so the full ``(3, B, heads, N, d)`` tensor stays alive. Here
``y = x / n`` with ``n = max(||x||, eps)``, kept as uint8 ``y`` (per-head groups, dim 1 of
4-D tensors; every row has unit norm, so rows share the grid well, like LayerNorm's ``x_hat``)
and float ``n`` (one value per row, ``1/d`` of the codes). Backward:

    dx = (g - y * sum(g * y)) / n     where ||x|| > eps,   dx = g / n   where clamped

The forward is ``F.normalize`` itself (bitwise stock). In eager training with a channel format
the layer is one C++ op with a C++ autograd node (``mesa::normalize_train``,
csrc/normalize_autograd.cpp: the same ops, the same bits); ``_NormalizeFn`` runs otherwise
(under ``torch.compile``, learned thresholds, patch4x4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from ._common import MesaLayer, group_dim_4d, load, no_autocast, save
from .quantizer import decompress

__all__ = ["Normalize"]


class _NormalizeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, eps, quantizer):
        # the ops of F.normalize itself (same bits), with the divisor kept for backward
        n = x.norm(2.0, dim, keepdim=True).clamp_min(eps)
        y = x / n.expand_as(x)
        packed = quantizer.compress(y.detach(), group_dim_4d(y))  # detach: see nn/softmax.py
        ctx.cdt, ctx.x_dtype, ctx.dim, ctx.eps = y.dtype, x.dtype, dim, eps
        save(ctx, [packed], n)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (n,) = load(ctx)
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            yh = decompress(packed, ctx.cdt)
            radial = yh * (g * yh).sum(ctx.dim, keepdim=True)
            gx = torch.where(n > ctx.eps, g - radial, g) / n
        return gx.to(ctx.x_dtype), None, None, None


class Normalize(MesaLayer, nn.Module):
    """``F.normalize(x, 2, dim, eps)`` as a layer (what the generic attention routes a cosine
    attention's ``F.normalize(q)`` / ``F.normalize(k)`` to)."""

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, input, dim: int = -1, eps: float = 1e-12):
        if not self._mesa_active(input):
            return F.normalize(input, p=2.0, dim=dim, eps=eps)
        fused = self.quantizer.fused_state_args(input)
        if fused is not None:
            return torch.ops.mesa.normalize_train(input, dim, eps, *fused)
        return _NormalizeFn.apply(input, dim, eps, self.quantizer)

    def extra_repr(self) -> str:
        return self._mesa_repr()
