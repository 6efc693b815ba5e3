"""Mesa ``GlobalResponseNorm`` (timm's, ConvNeXt-V2's MLP: ``fc1, GELU, GRN, fc2``): exact
forward; keeps its input ``x`` in 8 bits (channel groups) plus the small per-(sample,
channel) norms, instead of two full-precision copies.

timm's forward, with ``S`` the spatial dims and ``c`` the channel dim::

    x_g = ||x||_2 over S            (B, 1, 1, C) or (B, C, 1, 1)
    d   = mean_c(x_g) + eps         (B, 1, 1, 1)
    x_n = x_g / d
    y   = x + bias + weight * (x * x_n)

Stock autograd keeps ``x`` (for the norm and for ``x * x_n``) and ``x * x_n`` (for
``addcmul``'s weight gradient): two tensors of the MLP's hidden width, the widest of a
ConvNeXt-V2 block, in full precision. It was 69% of what a patched ConvNeXt-V2 still kept.
Backward here, with ``g`` the output gradient and ``x~`` the dequantized input::

    dbias   = sum_{B,S} g
    dweight = sum_{B,S} g * x~ * x_n
    t       = sum_S g * weight * x~                       (dL/dx_n)
    dx_g    = t / d - mean_c(t * x_g) / d**2               (through d = mean_c(x_g) + eps)
    dx      = g + weight * x_n * g + dx_g * x~ / x_g       (0 where x_g == 0, as torch's norm)

``x_g`` and ``d`` are kept exactly (one value per sample and channel), so only the products
with ``x`` carry rounding noise: unbiased in ``dweight``, ``t`` and the direct ``dx`` terms
(linear in ``x~``); the last ``dx`` term is a product of ``t`` with ``x~`` and has a bias of
one element's rounding variance out of ``|S|`` in the sum, far below the noise. The backward
computes in float32 and casts each gradient to its input's dtype.

In eager training with a channel format the layer is one C++ op with a C++ autograd node
(``mesa::grn_train``, csrc/grn_autograd.cpp: the same ops, the same bits); ``_GrnFn`` runs
otherwise (under ``torch.compile``, learned thresholds, patch4x4).
"""
from __future__ import annotations

import torch
from timm.layers.grn import GlobalResponseNorm as _TimmGRN
from torch import nn

from .first_order import first_order
from ._common import MesaLayer, copy_estimates, inherit_options, load, no_autocast, save, stock_device
from .quantizer import decompress

__all__ = ["GlobalResponseNorm"]


def _grn_forward(x, weight, bias, eps, spatial_dim, channel_dim, wb_shape):
    """timm's ``GlobalResponseNorm.forward``, call for call; also returns ``x_g`` and ``d``."""
    x_g = x.norm(p=2, dim=spatial_dim, keepdim=True)
    d = x_g.mean(dim=channel_dim, keepdim=True) + eps
    x_n = x_g / d
    return x + torch.addcmul(bias.view(wb_shape), weight.view(wb_shape), x * x_n), x_g, d


class _GrnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, spatial_dim, channel_dim, wb_shape, quantizer):
        out, x_g, d = _grn_forward(x, weight, bias, eps, spatial_dim, channel_dim, wb_shape)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed = quantizer.compress(x, channel_dim % x.dim()) if need_x or need_w else None
        ctx.spatial_dim, ctx.channel_dim, ctx.wb_shape = spatial_dim, channel_dim, wb_shape
        ctx.x_dtype, ctx.w_dtype, ctx.b_dtype = x.dtype, weight.dtype, bias.dtype
        save(ctx, [packed], x_g, d, weight)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (x_g, d, weight) = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[0:3]
        f32 = torch.float32
        channel, spatial = ctx.channel_dim, ctx.spatial_dim
        rows = tuple(i for i in range(g.dim()) if i != channel % g.dim())  # every dim but the channel's
        gx = gw = gb = None
        with no_autocast(g.device.type):
            g = g.to(f32)
            if need_b:
                gb = g.sum(rows).to(ctx.b_dtype)
            if need_x or need_w:
                xh = decompress(packed, f32)
                x_g, d, w = x_g.to(f32), d.to(f32), weight.to(f32).view(ctx.wb_shape)
                x_n = x_g / d
                if need_w:
                    gw = (g * xh * x_n).sum(rows).to(ctx.w_dtype)
                if need_x:
                    t = (g * w * xh).sum(spatial, keepdim=True)
                    dx_g = t / d - (t * x_g).mean(channel, keepdim=True) / (d * d)
                    per_x = torch.where(x_g > 0, dx_g / x_g, torch.zeros_like(x_g))
                    gx = (g + w * x_n * g + per_x * xh).to(ctx.x_dtype)
        return gx, gw, gb, None, None, None, None, None


class GlobalResponseNorm(MesaLayer, _TimmGRN):
    """timm's ``GlobalResponseNorm`` keeping its 8-bit input (channel groups) and its per-
    channel norms. Same parameters, ``state_dict`` keys and layout option."""

    def __init__(self, dim: int, eps: float = 1e-6, channels_last: bool = True, device=None, dtype=None,
                 **quant_options):
        _TimmGRN.__init__(self, dim, eps=eps, channels_last=channels_last, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "GlobalResponseNorm":
        if not isinstance(stock, _TimmGRN):
            raise TypeError(f"expected an instance of timm.layers.GlobalResponseNorm, got {type(stock).__name__}")
        new = cls(stock.weight.shape[0], eps=stock.eps, channels_last=stock.channel_dim == -1, device="meta",
                  dtype=stock.weight.dtype, **inherit_options(stock, quant_options))
        new.weight, new.bias = stock.weight, stock.bias  # the same parameter objects
        copy_estimates(stock, new, stock.weight.device if stock.weight is not None else stock_device(stock, device))
        return new.train(stock.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x, self.weight, self.bias):
            return _TimmGRN.forward(self, x)
        fused = self.quantizer.fused_state_args(x)
        if fused is not None and x.dim() == 4:  # the C++ layer op (mesa::grn_train): the same bits
            return torch.ops.mesa.grn_train(x, self.weight, self.bias, self.eps, list(self.spatial_dim),
                                            self.channel_dim, list(self.wb_shape), *fused)
        return _GrnFn.apply(x, self.weight, self.bias, self.eps, self.spatial_dim, self.channel_dim, self.wb_shape,
                            self.quantizer)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, channels_last={self.channel_dim == -1}, {self._mesa_repr()}"
