"""Mesa channel gate: ``x * s`` of a squeeze-excite block, ``s`` one value per (sample, channel).

Squeeze-excite (EfficientNet, MobileNetV3, GhostNet, RegNetY, LCNet, RDNet, EfficientViT-M)
ends with ``x * gate(x_se)``: stock autograd keeps ``x``, a whole feature map, for the gate's
gradient ``ds = sum_hw(g * x)``, and the gate ``s`` (``(N, C, 1, 1)``, small) for ``dx = g * s``.
This keeps ``x`` in 8 bits with one group per channel (a gate's gradient sums one channel of
one sample) and ``s`` as it is. In EfficientNet-B0 those ``x`` were 30% of what a patched
model still kept in full precision.

The forward is stock's ``x * s`` (the same operands in the same order); ``patch/squeeze_excite.py``
routes timm's squeeze-excite products here.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch import nn

from ._common import MesaLayer, from_nhwc, load, nhwc_view, no_autocast, save
from .quantizer import decompress

__all__ = ["ChannelGate"]


class _GateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s, quantizer, channel_dim):
        out = x * s
        packed = None
        ctx.nhwc = False
        if ctx.needs_input_grad[1]:
            xv, dim, ctx.nhwc = nhwc_view(x, channel_dim % x.dim(), quantizer.options.is_default_format)
            packed = quantizer.compress(xv, dim)
        ctx.cdt, ctx.x_dtype, ctx.s_dtype, ctx.s_shape = out.dtype, x.dtype, s.dtype, s.shape
        save(ctx, [packed], s if ctx.needs_input_grad[0] else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (packed,), (s,) = load(ctx)
        gx = gs = None
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            if ctx.needs_input_grad[0]:
                gx = (g * s.to(ctx.cdt)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                xh = from_nhwc(decompress(packed, ctx.cdt), ctx.nhwc)
                gs = (g * xh).sum_to_size(ctx.s_shape).to(ctx.s_dtype)
        return gx, gs, None, None


class ChannelGate(MesaLayer, nn.Module):
    """``forward(x, s) = x * s`` keeping 8-bit ``x`` grouped along ``channel_dim`` (1: NCHW;
    -1: channels-last tensors, timm's ``SqueezeExciteCl``; give ``num_groups`` = the channel
    count, one group per channel) and the gate ``s`` itself."""

    def __init__(self, channel_dim: int = 1, *, device=None, **quant_options):
        super().__init__()
        self.channel_dim = int(channel_dim)
        self._init_mesa(quant_options, device)

    def forward(self, x, s):
        if not self._mesa_active(x, s):
            return x * s
        return _GateFn.apply(x, s, self.quantizer, self.channel_dim)

    def extra_repr(self) -> str:
        return f"channel_dim={self.channel_dim}, {self._mesa_repr()}"
