"""Mesa ``AvgPool2d``: exact forward, and nothing kept for backward.

Stock ``nn.AvgPool2d`` keeps its whole input for backward (4 bytes per element in float32),
yet ``avg_pool2d_backward`` reads none of its values: the gradient of an average is the
output gradient spread over each window, divided by the window's count, so only the input's
sizes, dtype, device and memory format matter. This layer runs the stock op in forward (the
output bits are stock's) and keeps those four facts; backward hands the stock backward
kernel an uninitialised tensor of that shape as its ``self``. The gradient is bitwise stock's
(lossless), and the bytes kept are zero. In eager training the layer is one C++ op with a C++
autograd node (``mesa::avg_pool2d_train``, csrc/avgpool_autograd.cpp: the same bits, a fraction
of the Python Function's host time); ``_AvgPool2dFn`` runs under ``torch.compile``.

Where it matters: PoolFormer's and EfficientFormer's token mixer (``pool(x) - x``: the
subtraction keeps nothing, so the pool's copy was the block's only one: 23% and 14% of what
those models still kept), timm's ``AvgPool2dSame`` (the ``tf_`` models) and the average-pool
downsampling of ResNet-D style shortcuts.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers.padding import pad_same
from torch import nn
from torch._prims_common import suggest_memory_format

from . import quantizer as quantizer_mod
from ._common import MesaLayer, check_stock, inherit_options
from .maxpool import pool_args

__all__ = ["AvgPool2d", "AvgPool2dSame"]


class _AvgPool2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        out = F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        # the int[2] forms ATen's backward takes (the stock forward accepted the arguments)
        kernel, stride, padding, _ = pool_args(kernel_size, stride, padding, 1)
        ctx.args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        # what the backward kernel reads of the input: sizes, dtype, device and the memory
        # format it gives the gradient (ATen's suggest_memory_format, as its meta function)
        ctx.x_meta = (x.shape, x.dtype, x.device, suggest_memory_format(x))
        return out

    @staticmethod
    def backward(ctx, g):
        # not @once_differentiable: the pool is linear and keeps nothing lossy, so this backward,
        # recorded under create_graph=True, is stock's and differentiates as stock's does
        shape, dtype, device, fmt = ctx.x_meta
        x_like = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)  # never read, only its sizes
        gx = torch.ops.aten.avg_pool2d_backward(g, x_like, *ctx.args)
        return gx, None, None, None, None, None, None


class AvgPool2d(MesaLayer, nn.AvgPool2d):
    """``torch.nn.AvgPool2d`` that keeps nothing for backward; gradients bitwise stock's.

    Accepts the common quantization options (only ``enabled`` matters: nothing is
    quantized, so it has no buffers).
    """

    _quantizer_names = ()

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override=None, *, device=None, **quant_options):
        super().__init__(kernel_size, stride=stride, padding=padding, ceil_mode=ceil_mode,
                         count_include_pad=count_include_pad, divisor_override=divisor_override)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.AvgPool2d, *, device=None, **quant_options) -> "AvgPool2d":
        """``device`` is accepted like the other parameter-free layers' (nothing to place)."""
        check_stock(stock, nn.AvgPool2d)
        return cls(stock.kernel_size, stock.stride, stock.padding, stock.ceil_mode, stock.count_include_pad,
                   stock.divisor_override, **inherit_options(stock, quant_options)).train(stock.training)

    def forward(self, input, call: Optional[dict] = None):
        """``call``: this call's pooling arguments (a functional call routed here:
        patch/functional_calls.py), else the module's."""
        if call is not None:
            return self.pool(input, **call)
        return self.pool(input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                         self.divisor_override)

    def pool(self, input, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
             divisor_override=None):
        """``F.avg_pool2d(input, ...)`` through this layer (also a functional call a module's
        forward makes: patch/functional_calls.py)."""
        if not self._mesa_active(input):
            return F.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        args = pool_args(kernel_size, stride, padding, 1)
        if args is not None and quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/avgpool_autograd.cpp), the same bits
            return torch.ops.mesa.avg_pool2d_train(input, *args[:3], ceil_mode, count_include_pad, divisor_override)
        return _AvgPool2dFn.apply(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    def extra_repr(self) -> str:
        return f"{nn.AvgPool2d.extra_repr(self)}, {self._mesa_repr()}"


class AvgPool2dSame(AvgPool2d):
    """timm's ``AvgPool2dSame``: zero-padded by the input's size, then the Mesa pool (the
    padding keeps nothing either)."""

    @classmethod
    def from_module(cls, stock: nn.AvgPool2d, *, device=None, **quant_options) -> "AvgPool2dSame":
        from timm.layers.pool2d_same import AvgPool2dSame as TimmAvgPool2dSame

        check_stock(stock, (TimmAvgPool2dSame, AvgPool2dSame))
        return super().from_module(stock, device=device, **quant_options)

    def forward(self, x):
        x = pad_same(x, self.kernel_size, self.stride)  # timm's forward: then padding (0, 0)
        return super().forward(x)
