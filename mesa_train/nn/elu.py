"""Mesa ``ELU``, ``CELU`` and ``SELU`` (timm's ``act_layer="elu"`` / ``"celu"`` / ``"selu"``, DPN's
head, self-normalising MLPs): the exact forward, and for backward the 8-bit input plus a 1-bit
mask of its side of 0, instead of the full-precision input stock keeps (an out-of-place call)
or output (in place).

All three are ATen's ``elu`` with ``(alpha, scale, input_scale)``::

    y  = scale * x                                          x > 0
         scale * alpha * (exp(x * input_scale) - 1)          x <= 0
    dx = g * scale                                          x > 0
         g * scale * alpha * input_scale * exp(x * input_scale)   x <= 0

The slope jumps at 0 where ``alpha * input_scale != 1`` (SELU: 1.05 -> 1.76), so an element
rounded to the wrong side of 0 would take the other slope: the mask keeps the side exact (the
positive side's gradient is stock's, bit for bit), and the negative side's derivative is taken
at the dequantized input, clamped to it. The Python Function runs eager and compiled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from .activations import _InplaceActivation
from ._common import kept_input, load, no_autocast, save_elementwise_input
from .relu import pack_bits, unpack_bits

__all__ = ["ELU", "CELU", "SELU"]

# torch's SELU constants (aten/src/ATen/native/Activation.cpp)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


class _EluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, function, alpha: float, scale: float, input_scale: float, quantizer):
        y = function(x)  # (the stock function, out of place, inside: autograd keeps none of its tensors)
        # the positive side, elu_backward's own test (not x <= 0); a NaN input lands there and
        # gets g * scale, where stock's gradient is NaN
        positive, ctx.cl = pack_bits(~(x <= 0))
        ctx.shape, ctx.coefs = x.shape, (alpha, scale, input_scale)
        save_elementwise_input(ctx, x, y, quantizer, positive)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (positive,) = load(ctx)
        alpha, scale, input_scale = ctx.coefs
        with no_autocast(g.device.type):
            xh = kept_input(ctx, packed)
            positive = unpack_bits(positive, ctx.shape, ctx.cl)
            # the side from the mask: 1 on the positive side, the input clamped to <= 0 elsewhere
            side = torch.where(positive, 1.0, xh.clamp(max=0)).to(ctx.cdt)
            gx = torch.ops.aten.elu_backward(g.to(ctx.cdt), alpha, scale, input_scale, False, side)
        return gx.to(ctx.x_dtype), None, None, None, None, None


class _EluFamily(_InplaceActivation):
    """An ELU-family activation: its stock function out of place (the codes' input is not
    overwritten; the same values as in place), then ``_EluFn`` keeps its input."""

    def _function(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _coefs(self) -> tuple:
        raise NotImplementedError

    def _compressed(self, input):
        return _EluFn.apply(input, self._function, *self._coefs(), self.quantizer)


class _WithAlpha(_EluFamily):
    """``alpha`` beside ``inplace`` (ELU, CELU), taken from the stock module."""

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(inplace=inplace, device=device, **quant_options)
        self.alpha = alpha

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        new = super().from_module(stock, device=device, **quant_options)
        new.alpha = stock.alpha
        return new


class ELU(_WithAlpha, nn.ELU):
    """``torch.nn.ELU`` keeping its 8-bit input and a 1-bit side mask. Op ``relu``."""

    _stock_types = (nn.ELU,)

    def _function(self, x):
        return F.elu(x, self.alpha)

    def _coefs(self) -> tuple:
        return self.alpha, 1.0, 1.0


class CELU(_WithAlpha, nn.CELU):
    """``torch.nn.CELU`` (``elu`` with ``input_scale = 1 / alpha``). Op ``relu``."""

    _stock_types = (nn.CELU,)

    def _function(self, x):
        return F.celu(x, self.alpha)

    def _coefs(self) -> tuple:
        return self.alpha, 1.0, 1.0 / self.alpha


class SELU(_EluFamily, nn.SELU):
    """``torch.nn.SELU`` (``elu`` with torch's fixed alpha and scale). Op ``relu``."""

    _stock_types = (nn.SELU,)

    def _function(self, x):
        return F.selu(x)

    def _coefs(self) -> tuple:
        return _SELU_ALPHA, _SELU_SCALE, 1.0
