"""Mesa ``StarReLU`` (timm's ``timm.models.metaformer.StarReLU``: ConvFormer / CAFormer / PoolFormerV2 activation):
``scale * relu(x) ** 2 + bias``, keeping ``relu(x)`` as 8-bit codes.

The stock autograd graph keeps ``relu(x)`` for the square's backward and ``relu(x) ** 2``
for ``scale``'s gradient (two full-size tensors, plus the ReLU's mask); backward needs only
``r = relu(x)``::

    dx     = g * scale * 2 * r        (0 where x <= 0: r is 0 there, an exact code)
    dscale = sum(g * r ** 2)
    dbias  = sum(g)

``r`` is non-negative, so its 8-bit grid spends no codes on the negative half. Forward is
the stock expression, op for op (bitwise); an ``inplace=True`` stock module computes out of
place here (same values, the input is not overwritten). In eager training with a channel
format the layer is one C++ op with a C++ autograd node (``mesa::star_relu_train``,
csrc/star_relu_autograd.cpp: the same ops, the same bits); ``_StarReLUFn`` runs otherwise
(under ``torch.compile``, learned thresholds, patch4x4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from ._common import (MesaLayer, check_stock, copy_estimates, group_dim_4d, inherit_options, kept_input, load,
                      nhwc_view, no_autocast, save)

__all__ = ["StarReLU"]


class _StarReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, bias, quantizer):
        r = F.relu(x)
        y = scale * r ** 2 + bias  # timm's expression, the same ops in the same order
        need_r = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if need_r:
            rv, dim, ctx.nhwc = nhwc_view(r, group_dim_4d(r), quantizer.options.channel_layout)
            packed = quantizer.compress(rv, dim)
        else:
            packed, ctx.nhwc = None, False
        ctx.cdt, ctx.x_dtype = y.dtype, x.dtype
        ctx.p_dtypes = (scale.dtype, bias.dtype)
        save(ctx, [packed], scale, bias)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (scale, bias) = load(ctx)
        gx = gs = gb = None
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            if packed is not None:
                r = kept_input(ctx, packed)
                if ctx.needs_input_grad[0]:
                    gx = (g * scale.to(ctx.cdt) * 2 * r).to(ctx.x_dtype)
                if ctx.needs_input_grad[1]:
                    gs = (g * r * r).sum_to_size(scale.shape).to(ctx.p_dtypes[0])
            if ctx.needs_input_grad[2]:
                gb = g.sum_to_size(bias.shape).to(ctx.p_dtypes[1])
        return gx, gs, gb, None


class StarReLU(MesaLayer, nn.Module):
    """timm's ``StarReLU`` keeping 8-bit ``relu(x)``; the same ``scale`` / ``bias``
    parameters (and ``state_dict`` keys) and a ``relu`` child, as timm's."""

    def __init__(self, scale_value: float = 1.0, bias_value: float = 0.0, scale_learnable: bool = True,
                 bias_learnable: bool = True, inplace: bool = False, device=None, dtype=None, **quant_options):
        super().__init__()
        self.inplace = inplace
        self.relu = nn.ReLU(inplace=inplace)
        self.scale = nn.Parameter(scale_value * torch.ones(1, device=device, dtype=dtype),
                                  requires_grad=scale_learnable)
        self.bias = nn.Parameter(bias_value * torch.ones(1, device=device, dtype=dtype),
                                 requires_grad=bias_learnable)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "StarReLU":
        from timm.models.metaformer import StarReLU as TimmStarReLU

        check_stock(stock, (TimmStarReLU, StarReLU))
        new = cls(inplace=stock.inplace, device="meta", dtype=stock.scale.dtype,
                  **inherit_options(stock, quant_options))
        new.scale, new.bias, new.relu = stock.scale, stock.bias, stock.relu  # the same objects
        copy_estimates(stock, new, stock.scale.device)
        return new.train(stock.training)

    def forward(self, x):
        if not self._mesa_active(x, self.scale, self.bias):
            return self.scale * self.relu(x) ** 2 + self.bias
        fused = self.quantizer.fused_state_args(x)
        if fused is not None:
            return torch.ops.mesa.star_relu_train(x, self.scale, self.bias, *fused)
        return _StarReLUFn.apply(x, self.scale, self.bias, self.quantizer)

    def extra_repr(self) -> str:
        return self._mesa_repr()
