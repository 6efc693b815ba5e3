"""Mesa ``HardMish`` (timm's ``act_layer="hard_mish"``: ``HardMishMe`` by default, ``HardMish``
when timm is set exportable or scriptable): the exact forward, and for backward the 8-bit input
plus a 1-bit mask of ``x < -2``, instead of what stock keeps (``HardMishMe``: the full input;
``HardMish``'s autograd graph: ``x + 2``, ``x / 2`` and the clamp, three full tensors)::

    y  = x / 2 * clamp(x + 2, 0, 2)
    dx = 0          x < -2
         x + 1      -2 <= x <= 0
         1          x > 0

The derivative jumps at -2 (from 0 to -1), so an element rounded to the wrong side of -2 would
take the other slope: the mask keeps that side exact. At -2 itself the two stock modules differ:
``HardMishMe``'s own backward gives -1, ``HardMish``'s autograd the clamp's rule at its bound (0
in torch 2.14, whose scalar ``clamp`` passes no gradient at a bound; -1 before), so the layer
takes the rule of the module it replaces. At 0 it is continuous, so the slope at the
dequantized input, clamped to [-1, 1], stays within one rounding step of stock's. Op
``hardswish`` (the piecewise-polynomial activations). The Python Function runs eager and compiled.
"""
from __future__ import annotations

import torch
from torch import nn

from .first_order import first_order
from .activations import _InplaceActivation
from ._common import kept_input, load, no_autocast, save_elementwise_input
from .relu import pack_bits, unpack_bits

__all__ = ["HardMish", "hard_mish", "timm_hard_mish_types"]


def hard_mish(x: torch.Tensor) -> torch.Tensor:
    """timm's ``hard_mish`` out of place, the same ops in the same order (its ``hard_mish_fwd``)."""
    return 0.5 * x * (x + 2).clamp(min=0, max=2)


def _stock_clamp_passes_at_bound() -> bool:
    """Whether this torch's ``clamp(x, min=0)`` passes the gradient where ``x == 0`` (torch 2.11:
    yes; 2.14: no). Asked of stock once, at import, on the CPU (the device-independent formula)."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, device="cpu", dtype=torch.float32, requires_grad=True)
        x.clamp(min=0, max=2).sum().backward()
    return bool(x.grad[0] == 1)


# (a module constant: the probe's autograd call must not run inside a compiled or traced region)
STOCK_CLAMP_PASSES_AT_BOUND = _stock_clamp_passes_at_bound()


def timm_hard_mish_types() -> tuple:
    """timm's two HardMish modules (both compute :func:`hard_mish`), or none for a timm without them."""
    try:
        from timm.layers.activations import HardMish as TimmHardMish
        from timm.layers.activations_me import HardMishMe as TimmHardMishMe
    except ImportError:
        return ()
    return (TimmHardMish, TimmHardMishMe)


class _HardMishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer, zero_at_minus_2: bool):
        y = hard_mish(x)
        below, ctx.cl = pack_bits(x <= -2 if zero_at_minus_2 else x < -2)
        ctx.shape = x.shape
        save_elementwise_input(ctx, x, y, quantizer, below)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (below,) = load(ctx)
        with no_autocast(g.device.type):
            xh = kept_input(ctx, packed)
            xf = xh.to(torch.promote_types(xh.dtype, torch.float32))  # (one rounding at the end for half types)
            slope = (xf + 1).clamp(-1, 1)  # a rounded x may leave [-2, 0]: the end's slope
            gx = (g.to(xf.dtype) * slope).to(ctx.cdt)
            gx = torch.where(unpack_bits(below, ctx.shape, ctx.cl), 0, gx)
        return gx.to(ctx.x_dtype), None, None


class HardMish(_InplaceActivation, nn.Module):
    """timm's ``HardMish`` / ``HardMishMe`` keeping its 8-bit input and a 1-bit mask of
    ``x < -2`` (``_HardMishFn``). ``inplace=True`` computes out of place (same values). Op
    ``hardswish``. ``zero_at_minus_2``: the gradient at -2 itself, 0 (timm's ``HardMish`` on a torch
    whose clamp passes nothing at a bound) or ``g * -1`` (``HardMishMe``, the default)."""

    def __init__(self, inplace: bool = False, *, zero_at_minus_2: bool = False, device=None, **quant_options):
        nn.Module.__init__(self)
        self.inplace, self.zero_at_minus_2 = inplace, zero_at_minus_2
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "HardMish":
        cls._stock_types = timm_hard_mish_types()
        # (past _InplaceActivation's, which copies `inplace`: HardMishMe takes the argument and
        # keeps no attribute, and computes out of place)
        new = super(_InplaceActivation, cls).from_module(stock, device=device, **quant_options)
        new.inplace = getattr(stock, "inplace", False)
        new.zero_at_minus_2 = isinstance(stock, cls._stock_types[0]) and not STOCK_CLAMP_PASSES_AT_BOUND
        return new

    def forward(self, input):
        if not self._mesa_active(input):
            return input.mul_(0.5 * (input + 2).clamp(min=0, max=2)) if self.inplace else hard_mish(input)
        return _HardMishFn.apply(input, self.quantizer, self.zero_at_minus_2)

    def extra_repr(self) -> str:
        return f"inplace=True, {self._mesa_repr()}" if self.inplace else self._mesa_repr()
