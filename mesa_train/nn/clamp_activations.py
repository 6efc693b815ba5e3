"""Mesa ``Hardtanh``, ``ReLU6``, ``Hardsigmoid`` (a 1-bit mask saved) and ``Clamp``
(``torch.clamp`` with tensor bounds: two 1-bit masks): exact forward.

Each is a clamp: its derivative is a constant inside one open interval and zero outside
(``Hardtanh(lo, hi)`` and ``ReLU6``: 1 on ``(lo, hi)``; ``Hardsigmoid``: 1/6 on ``(-3, 3)``).
So backward needs only *whether* each element was inside, one bit, where stock keeps the
whole input (fp32: 4 bytes an element). The gradient is bitwise stock's on finite inputs:
the mask is taken from the input before an in-place op overwrites it, and ``Hardsigmoid``'s
backward is ATen's kernel itself, fed a stand-in input that is inside exactly where the mask
says. A NaN input gets a zero gradient, as in ATen's vectorized CPU kernels (their scalar
tail, for the last few elements, lets a NaN pass the gradient: stock is not consistent there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import MesaLayer, check_stock, inherit_options, load, save
from .relu import MASK_KINDS, keep_mask, kept_mask, pack_bits, unpack_bits

__all__ = ["Hardtanh", "ReLU6", "Hardsigmoid", "Clamp"]


class _ClampMaskFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, lo, hi, inplace):
        # the derivative's support, open at both ends and compared as ATen's backward kernels
        # compare: a half or bfloat16 x in float (x = half(-0.1) is above -0.1, not above
        # half(-0.1), as gt with a number would take it: Hardtanh(-0.1, 0.7))
        xc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        inside = (xc > lo) & (xc < hi)
        y = F.hardtanh(x, lo, hi, inplace) if kind == "hardtanh" else F.hardsigmoid(x, inplace)
        ctx.kind = kind
        return keep_mask(ctx, x, y, inside, inplace)

    @staticmethod
    @first_order
    def backward(ctx, g):
        inside = kept_mask(ctx)
        if ctx.kind == "hardtanh":
            return torch.where(inside, g, 0), None, None, None, None  # (the ReLU's: in g's layout)
        # ATen's own kernel (its g * 1/6 rounding), on 0 inside and 3 (outside) elsewhere
        stand_in = (~inside).to(g.dtype) * 3
        return torch.ops.aten.hardsigmoid_backward(g, stand_in), None, None, None, None


class _ClampActivation(MesaLayer):
    """Shared by the three: no estimates (a mask has none), ``from_module`` copies the stock
    constructor's arguments (``_ctor_args``)."""

    _quantizer_names = ()
    _stock_type: type = nn.Module

    def _clamp_args(self) -> tuple:
        """(kind, lo, hi) for ``_ClampMaskFn``: a ``Hardtanh``'s own bounds (``ReLU6``: 0, 6)."""
        return ("hardtanh", self.min_val, self.max_val)

    @classmethod
    def _ctor_args(cls, stock: nn.Module) -> tuple:
        return (stock.inplace,)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        """``device`` is accepted like the other parameter-free layers' (nothing to place)."""
        check_stock(stock, cls._stock_type)
        return cls(*cls._ctor_args(stock), **inherit_options(stock, quant_options)).train(stock.training)

    def forward(self, input):
        if not self._mesa_active(input):
            return super().forward(input)
        kind, lo, hi = self._clamp_args()
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/convnet_autograd.cpp), the same bits
            op = torch.ops.mesa.mask_train_ if self.inplace else torch.ops.mesa.mask_train
            return op(input, MASK_KINDS[kind], float(lo), float(hi))
        return _ClampMaskFn.apply(input, kind, lo, hi, self.inplace)  # no seed: traceable

    def extra_repr(self) -> str:
        base = self._stock_type.extra_repr(self)
        return f"{base}, {self._mesa_repr()}" if base else self._mesa_repr()


class Hardtanh(_ClampActivation, nn.Hardtanh):
    """``torch.nn.Hardtanh`` saving a 1-bit mask instead of its input."""

    _stock_type = nn.Hardtanh

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *, device=None,
                 **quant_options):
        super().__init__(min_val, max_val, inplace)
        self._init_mesa(quant_options, device)

    @classmethod
    def _ctor_args(cls, stock: nn.Hardtanh) -> tuple:
        return (stock.min_val, stock.max_val, stock.inplace)


class ReLU6(_ClampActivation, nn.ReLU6):
    """``torch.nn.ReLU6`` (MobileNetV2, timm's ``relu6``) saving a 1-bit mask instead of its input."""

    _stock_type = nn.ReLU6

    def __init__(self, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(inplace)
        self._init_mesa(quant_options, device)


class Hardsigmoid(_ClampActivation, nn.Hardsigmoid):
    """``torch.nn.Hardsigmoid`` (the gate of MobileNetV3's and GhostNet's squeeze-excite, timm's
    ``hard_sigmoid``) saving a 1-bit mask instead of its input."""

    _stock_type = nn.Hardsigmoid

    def __init__(self, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(inplace)
        self._init_mesa(quant_options, device)

    def _clamp_args(self) -> tuple:
        return ("hardsigmoid", -3.0, 3.0)


def _stock_clamp_splits_ties() -> bool:
    """Whether this torch's ``clamp`` with tensor bounds gives an element on a bound ``g / 2``
    (as ``maximum`` / ``minimum`` share a tie: pytorch PR 191142, 2026-07, in 2.14) rather than
    ``g`` (torch 2.11: ``g`` where ``lo <= x <= hi``). Asked of stock once, at import, with a
    3-element call: the rule is then this torch's, whichever release it is."""
    # (explicit device and dtype: an import under `with torch.device("meta")` or another default
    # dtype still asks the CPU kernels' autograd formula, which is the device-independent one)
    cpu = {"device": "cpu", "dtype": torch.float32}
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.tensor([1.0, 1.5, 3.0], requires_grad=True, **cpu)
        torch.clamp(x, torch.tensor(1.0, **cpu), torch.tensor(2.0, **cpu)).sum().backward()
    return bool(x.grad[0] == 0.5)


# (a module constant: the probe's autograd call must not run inside a compiled or traced region)
STOCK_CLAMP_SPLITS_TIES = _stock_clamp_splits_ties()


def clamp_masks(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, split_ties: bool):
    """Stock's clamp gradient with tensor bounds as masks: ``(passes, ties)``, where it is ``g``
    and where ``g / 2`` (``ties`` None where the rule has none), elsewhere 0. Probed over every
    order of x, lo and hi with NaNs and infinities (tests/test_clamp_table_autograd.py):
    * split ties (2.14): 0 where ``x < lo`` or ``x > hi``; ``g / 2`` where x is on a bound of a
      proper interval (``lo < hi``); else ``g``: inside, a NaN x or bound, ``x == lo == hi``;
    * else (2.11): ``g`` where ``lo <= x <= hi`` (a NaN anywhere: 0)."""
    if not split_ties:
        return (x >= lo) & (x <= hi), None
    ties = ((x == lo) | (x == hi)) & (lo < hi)
    return ~((x < lo) | (x > hi) | ties), ties


class _ClampFn(torch.autograd.Function):
    """``torch.clamp(x, lo, hi)`` with tensor bounds that take no gradient (buffers), keeping
    ``clamp_masks``' bits (two, or one where the running torch has no ties) for stock's
    gradient. Eager training runs the same ops as ``mesa::clamp_train``
    (csrc/clamp_autograd.cpp), a C++ autograd node: the same bits, less host time."""

    @staticmethod
    def forward(ctx, x, lo, hi, split_ties):
        y = torch.clamp(x, lo, hi)
        passes, ties = clamp_masks(x, lo, hi, split_ties)
        passes, ctx.cl = pack_bits(passes)
        ctx.shape = x.shape
        save(ctx, [], passes, *([] if ties is None else [pack_bits(ties)[0]]))
        return y

    @staticmethod
    def backward(ctx, g):
        # not @once_differentiable: the masks are exact and the gradient linear in g, so this
        # backward, recorded under create_graph=True, differentiates as stock's does
        _, masks = load(ctx)
        passes, *ties = (unpack_bits(m, ctx.shape, ctx.cl) for m in masks)
        other = torch.where(ties[0], g * 0.5, 0) if ties else 0
        return torch.where(passes, g, other), None, None, None


class Clamp(MesaLayer, nn.Module):
    """``forward(x, lo, hi) = torch.clamp(x, lo, hi)`` with tensor bounds that take no gradient
    (Gemma 4's clamp buffers), keeping two 1-bit masks where stock keeps ``x`` itself (one under
    a torch whose clamp has no ties: ``STOCK_CLAMP_SPLITS_TIES``); the gradient is the running
    torch's stock's bit for bit. No estimates (a mask has none)."""

    _quantizer_names = ()

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(x) or lo.requires_grad or hi.requires_grad:
            return torch.clamp(x, lo, hi)
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/clamp_autograd.cpp), the same bits
            return torch.ops.mesa.clamp_train(x, lo, hi, STOCK_CLAMP_SPLITS_TIES)
        return _ClampFn.apply(x, lo, hi, STOCK_CLAMP_SPLITS_TIES)

    def extra_repr(self) -> str:
        return self._mesa_repr()
