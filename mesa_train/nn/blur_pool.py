"""Mesa ``BlurPool2d`` (timm's anti-aliased downsampling: TResNet, the ``*aa`` ResNets,
``aa_layer="blur"``): a depthwise convolution with a fixed binomial filter (a buffer), after a
reflect (or constant) padding.

The filter takes no gradient, so the input gradient is all backward needs, and it needs only
the filter and the input's shape and layout (``convolution_backward`` with a stand-in input,
as the Mesa ``Conv2d`` does when only ``dx`` is wanted). Stock autograd keeps the whole padded
input for a weight gradient nobody asks for: in ``tresnet_m`` 29% of what a patched model still
kept, and its reflect padding the input once more. This keeps nothing of either (both
backwards run on stand-ins in one Function). Nothing is quantized: the gradient is stock's;
the forward is timm's own calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import BlurPool2d as TimmBlurPool2d
from torch._prims_common import suggest_memory_format

from ._common import MesaLayer, check_stock, inherit_options, load, no_autocast, save
from .quantizer import LAYOUTS

__all__ = ["BlurPool2d"]


class _BlurFn(torch.autograd.Function):
    """timm's ``F.pad`` then ``F.conv2d`` with the fixed filter, as one Function: the reflect
    padding's own backward keeps its input as well (``reflection_pad2d_backward`` reads only
    its shape), so both steps' backwards run here on stand-ins, each in the memory format its
    real input had (CUDA's reflect pad returns NCHW for a channels-last input, the CPU's keeps
    it). The backward is differentiable (both ATen backwards have derivatives): nothing is
    lost, so a second derivative is stock's, as for the other lossless layers."""

    @staticmethod
    def forward(ctx, x, weight, padding, pad_mode: str, stride: int, groups: int):
        ctx.shape, ctx.x_format, ctx.x_dtype = x.shape, suggest_memory_format(x), x.dtype
        ctx.padding, ctx.pad_mode, ctx.stride, ctx.groups = padding, pad_mode, stride, groups
        padded = F.pad(x, padding, mode=pad_mode)  # timm's calls
        ctx.padded_shape, ctx.padded_format = padded.shape, suggest_memory_format(padded)
        out = F.conv2d(padded, weight, stride=stride, groups=groups)
        ctx.cdt = out.dtype  # (the autocast dtype where autocast cast the input and the filter)
        save(ctx, [], weight)
        return out

    @staticmethod
    def backward(ctx, g):
        _, (weight,) = load(ctx)
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            stand_in = torch.empty(ctx.padded_shape, dtype=ctx.cdt, device=g.device, memory_format=ctx.padded_format)
            gp = torch.ops.aten.convolution_backward(
                g, stand_in, weight.to(ctx.cdt), None, [ctx.stride] * 2, [0, 0], [1, 1], False, [0, 0],
                ctx.groups, [True, False, False])[0]
            gp = gp.to(ctx.x_dtype)  # (as stock: autocast's cast of the padded input sits after the pad)
            if ctx.pad_mode == "reflect":
                stand_in = torch.empty(ctx.shape, dtype=gp.dtype, device=g.device, memory_format=ctx.x_format)
                gx = torch.ops.aten.reflection_pad2d_backward(gp, stand_in, list(ctx.padding))
            else:  # constant: the padded gradient's inner window (constant_pad_nd's backward)
                left, _, top, _ = ctx.padding
                gx = gp[:, :, top:top + ctx.shape[2], left:left + ctx.shape[3]].contiguous(
                    memory_format=ctx.x_format)
        return gx, None, None, None, None, None


class BlurPool2d(MesaLayer, TimmBlurPool2d):
    """timm's ``BlurPool2d`` keeping nothing of its input for backward (the filter is fixed).
    Op ``conv``; no estimates (nothing is quantized)."""

    _quantizer_names = ()
    # (nothing is quantized: any layout an ops=["conv"] patch asks for is fine here)
    _layouts = LAYOUTS

    def __init__(self, channels=None, filt_size: int = 3, stride: int = 2, pad_mode: str = "reflect", *,
                 device=None, dtype=None, **quant_options):
        super().__init__(channels, filt_size, stride, pad_mode, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: TimmBlurPool2d, *, device=None, **quant_options) -> "BlurPool2d":
        check_stock(stock, TimmBlurPool2d)
        filt = stock.filt
        new = cls(stock.channels, stock.filt_size, stock.stride, stock.pad_mode, device=filt.device,
                  dtype=filt.dtype, **inherit_options(stock, quant_options))
        new.filt = filt  # (the same buffer object)
        return new.train(stock.training)

    def forward(self, x):
        if (not self._mesa_active(x) or self.filt.requires_grad or self.pad_mode not in ("reflect", "constant")
                or x.dim() != 4):
            return super().forward(x)  # (a learned filter, another padding mode: timm's as it is)
        channels = self.channels if self.channels is not None else x.shape[1]
        weight = self.filt if self.channels is not None else self.filt.expand(channels, 1, self.filt_size,
                                                                             self.filt_size)
        return _BlurFn.apply(x, weight, tuple(self.padding), self.pad_mode, self.stride, channels)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, filt_size={self.filt_size}, stride={self.stride}, "
                f"pad_mode={self.pad_mode}, {self._mesa_repr()}")
