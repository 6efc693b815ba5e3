"""Mesa activations beyond GELU: ``QuickGELU`` (CLIP), ``SiLU`` (Swish), ``Mish``, ``Hardswish``
(MobileNetV3, LeViT, EfficientViT-MIT, LowFormer), and the gated ``act(gate) * x`` of
SwiGLU / GLU MLPs (``GatedActivation``).

Each keeps its input(s) as 8-bit codes (channel groups, dim 1 for 4-D inputs, like
``GELU``) instead of the full-precision tensors the stock autograd graph keeps (QuickGELU:
``x`` and ``sigmoid(1.702 x)``; SiLU, Hardswish: ``x``; gated: ``act``'s input *and* both
operands of the product). Forward is bitwise the stock computation; backward evaluates the derivative at
the dequantized input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from ._common import MesaLayer, group_dim_4d, kept_input, load, no_autocast, save, save_elementwise_input
from .quantizer import decompress
from .relu import pack_bits, unpack_bits

__all__ = ["QuickGELU", "SiLU", "Mish", "Hardswish", "GatedActivation", "quick_gelu"]


# the kinds of mesa::elementwise_train (csrc/convnet_autograd.cpp)
_OP_KINDS = {"silu": 0, "quick_gelu": 1, "hardswish": 2}


def _fused(x: torch.Tensor, kind: str, quantizer) -> torch.Tensor | None:
    """``kind(x)`` by the C++ layer op (eager, a channel format: the layer with a C++ autograd
    node, the Python Functions' bits), or ``None`` where the Python Function must run (also for
    a kind the op does not compute: Mish)."""
    if kind not in _OP_KINDS:
        return None
    fused = quantizer.fused_layer_args(x)
    return None if fused is None else torch.ops.mesa.elementwise_train(x, _OP_KINDS[kind], *fused)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)``, the same ops in the same order as ``timm.layers.quick_gelu``."""
    return x * torch.sigmoid(1.702 * x)


def _quick_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU's derivative in ``x``'s dtype, computed in at least float32: in float16
    ``1.702 * x`` overflows past |x| ~ 38.5k and ``inf * (1 - s) = inf * 0`` was NaN where stock's
    autograd gives 0 or 1. C++ twins: csrc/convnet_autograd.cpp, csrc/gated_autograd.cpp."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    s = torch.sigmoid(1.702 * xf)
    return (s * (1 + 1.702 * xf * (1 - s))).to(x.dtype)


class _ElementwiseFn(torch.autograd.Function):
    """``y = f(x)`` keeping 8-bit ``x``; ``kind`` picks f and f'."""

    @staticmethod
    def forward(ctx, x, kind, quantizer):
        y = quick_gelu(x) if kind == "quick_gelu" else F.mish(x) if kind == "mish" else F.silu(x)
        ctx.kind = kind
        save_elementwise_input(ctx, x, y, quantizer)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), _ = load(ctx)
        with no_autocast(g.device.type):
            xh = kept_input(ctx, packed)
            g = g.to(ctx.cdt)
            if ctx.kind == "quick_gelu":
                gx = g * _quick_gelu_grad(xh)
            elif ctx.kind == "mish":
                gx = torch.ops.aten.mish_backward(g, xh)
            else:
                gx = torch.ops.aten.silu_backward(g, xh)
        return gx.to(ctx.x_dtype), None, None


class _ParameterFreeLayer(MesaLayer):
    """``from_module`` for activations whose stock twin has no constructor state to copy."""

    _stock_types: tuple = ()

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        from ._common import copy_estimates, inherit_options, stock_device

        if not isinstance(stock, cls._stock_types):
            names = ", ".join(t.__name__ for t in cls._stock_types)
            raise TypeError(f"expected an instance of {names}, got {type(stock).__name__}")
        new = cls(device="meta", **inherit_options(stock, quant_options))
        copy_estimates(stock, new, stock_device(stock, device))
        return new.train(stock.training)


def _timm_quick_gelu_types() -> tuple:
    try:
        from timm.layers.activations import QuickGELU as TimmQuickGELU
    except ImportError:
        return ()
    return (TimmQuickGELU,)


class QuickGELU(_ParameterFreeLayer, nn.Module):
    """CLIP's ``x * sigmoid(1.702 x)`` (timm's ``QuickGELU``) keeping its 8-bit input."""

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock, *, device=None, **quant_options) -> "QuickGELU":
        cls._stock_types = (QuickGELU,) + _timm_quick_gelu_types()
        return super().from_module(stock, device=device, **quant_options)

    def forward(self, input):
        if not self._mesa_active(input):
            return quick_gelu(input)
        y = _fused(input, "quick_gelu", self.quantizer)
        return y if y is not None else _ElementwiseFn.apply(input, "quick_gelu", self.quantizer)

    def extra_repr(self) -> str:
        return self._mesa_repr()


class _HardswishFn(torch.autograd.Function):
    """``hardswish(x)`` keeping 8-bit ``x`` plus two 1-bit masks, ``x <= -3`` and ``x >= 3``.

    The derivative is 0 at and below -3, ``x / 3 + 1/2`` between and 1 from 3 up (stock's
    ``hardswish_backward``, torch 2.14): it jumps by 1/2 at both ends. From the 8-bit input
    alone, every element within one rounding step of -3 or 3 may land on the wrong side, and
    those errors all lean one way against the normalised input of the BatchNorm before (large
    ``|x|``): EfficientViT-B0's BatchNorm weights reached only cosine 0.985. With the two masks
    the side is exact (outside: stock's gradient, bit for bit), and inside the gradient is stock's
    arithmetic on the dequantized input (in float for half types, one rounding at the end), so
    the error is the input's rounding over 3 alone. 10 bits an element where stock keeps 32."""

    @staticmethod
    def forward(ctx, x, quantizer):
        y = F.hardswish(x)
        (below, ctx.cl), (above, _) = pack_bits(x <= -3), pack_bits(x >= 3)  # hardswish_backward's own
        ctx.shape = x.shape  # (ctx.cl: both masks' channels-last flag, x's)
        save_elementwise_input(ctx, x, y, quantizer, below, above)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (below, above) = load(ctx)
        with no_autocast(g.device.type):
            xh = kept_input(ctx, packed)
            g = g.to(ctx.cdt)
            xf = xh.to(torch.promote_types(xh.dtype, torch.float32))  # hardswish_backward's opmath
            slope = (xf / 3 + 0.5).clamp(-0.5, 1.5)  # a rounded x may leave [-3, 3]: the end's slope
            inside = (g.to(xf.dtype) * slope).to(ctx.cdt)
            below, above = unpack_bits(below, ctx.shape, ctx.cl), unpack_bits(above, ctx.shape, ctx.cl)
            gx = torch.where(below, 0, torch.where(above, g, inside))  # (in xh's layout: not masked_fill)
        return gx.to(ctx.x_dtype), None


class _InplaceActivation(_ParameterFreeLayer):
    """A ``torch.nn`` activation with an ``inplace`` flag, keeping its 8-bit input
    (``_compressed``; by default ``_ElementwiseFn`` for the ``_kind`` it names).
    ``inplace=True`` computes out of place here: same values, and the input the codes were
    taken from is not overwritten."""

    _kind = ""

    def __init__(self, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(inplace=inplace)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        new = super().from_module(stock, device=device, **quant_options)
        new.inplace = stock.inplace
        return new

    def forward(self, input):
        if not self._mesa_active(input):
            return super().forward(input)
        return self._compressed(input)

    def _compressed(self, input):
        y = _fused(input, self._kind, self.quantizer)
        return y if y is not None else _ElementwiseFn.apply(input, self._kind, self.quantizer)

    def extra_repr(self) -> str:
        base = self._stock_types[0].extra_repr(self)
        return f"{base}, {self._mesa_repr()}" if base else self._mesa_repr()


class SiLU(_InplaceActivation, nn.SiLU):
    """``torch.nn.SiLU`` keeping its 8-bit input."""

    _stock_types, _kind = (nn.SiLU,), "silu"


class Mish(_InplaceActivation, nn.Mish):
    """``torch.nn.Mish`` (``x * tanh(softplus(x))``: timm's ``act_layer="mish"``, CSP-DarkNet-style
    nets) keeping its 8-bit input; the Python Function in eager and compiled training alike (the
    C++ elementwise op has no Mish kind). Op ``silu``."""

    _stock_types, _kind = (nn.Mish,), "mish"


class Hardswish(_InplaceActivation, nn.Hardswish):
    """``torch.nn.Hardswish`` (what timm's ``hard_swish`` resolves to) keeping its 8-bit
    input and which side of -3 and 3 each element is on (``_HardswishFn``). Stock keeps the
    full-precision input."""

    _stock_types = (nn.Hardswish,)

    def _compressed(self, input):
        y = _fused(input, "hardswish", self.quantizer)
        return y if y is not None else _HardswishFn.apply(input, self.quantizer)


def _act_vjp(act: nn.Module, x: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g * act'(x)`` (``h = act(x)``): closed form for the activations timm's gated MLPs
    use (no ``torch.autograd.grad`` in a backward: ``torch.compile`` cannot trace that), else
    autograd through ``h``."""
    kind = type(act)
    if not _has_closed_form(act):
        (gx,) = torch.autograd.grad(h, x, g)
        return gx
    if kind is nn.Identity:  # a plain product u * v (patch/gating.py)
        return g
    if kind is nn.SiLU:
        return torch.ops.aten.silu_backward(g, x)
    if kind is nn.Sigmoid:
        return torch.ops.aten.sigmoid_backward(g, h.detach())
    if kind is nn.GELU:
        return torch.ops.aten.gelu_backward(g, x, approximate=act.approximate)
    if kind is nn.Tanh:
        return torch.ops.aten.tanh_backward(g, h.detach())
    return g * _quick_gelu_grad(x)  # QuickGELU


# the activations mesa::gated_train evaluates (csrc/gated_autograd.cpp, GateAct), and the
# module classes that are them (exact classes: a subclass may override forward; GELU and
# timm's QuickGELU: _gated_act_code)
_GATED_ACTS = {"identity": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "sigmoid": 4, "tanh": 5, "quick_gelu": 6}
_GATED_ACT_CLASSES = {nn.Identity: "identity", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh"}


def _has_closed_form(act: nn.Module) -> bool:
    kind = type(act)
    return kind in (nn.SiLU, nn.Sigmoid, nn.GELU, nn.Tanh, nn.Identity, QuickGELU) or kind in _timm_quick_gelu_types()


def _gated_act_code(act: nn.Module) -> int | None:
    """The ``act`` argument of ``mesa::gated_train`` (csrc/gated_autograd.cpp) for the
    activation modules it evaluates itself, as the Python Function runs and differentiates them
    (``_act_vjp``'s closed forms), else ``None``: a Mesa ``QuickGELU`` (a layer that compresses
    on its own), an activation with hooks (the op would skip them), any other module or a plain
    function."""
    if not isinstance(act, nn.Module) or act._forward_hooks or act._forward_pre_hooks:
        return None
    kind = type(act)
    if kind is nn.GELU:
        name = "gelu_tanh" if act.approximate == "tanh" else "gelu"
    else:
        name = _GATED_ACT_CLASSES.get(kind) or ("quick_gelu" if kind in _timm_quick_gelu_types() else None)
    return None if name is None else _GATED_ACTS[name]


class _GatedFn(torch.autograd.Function):
    """``act(a) * b`` (``gate_last``: ``b * act(a)``), keeping 8-bit ``a`` and ``b``."""

    @staticmethod
    def forward(ctx, a, b, act, gate_last, quantizer_a, quantizer_b):
        a_in = a.clone() if getattr(act, "inplace", False) else a  # keep a for its codes
        y = b * act(a_in) if gate_last else act(a_in) * b
        pa = quantizer_a.compress(a, group_dim_4d(a)) if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else None
        pb = quantizer_b.compress(b, group_dim_4d(b)) if ctx.needs_input_grad[0] else None
        ctx.act, ctx.cdt, ctx.dtypes = act, y.dtype, (a.dtype, b.dtype)
        save(ctx, [pa, pb])
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (pa, pb), _ = load(ctx)
        ga = gb = None
        with no_autocast(g.device.type), torch.enable_grad():
            g = g.to(ctx.cdt)
            closed = _has_closed_form(ctx.act)
            ah = decompress(pa, ctx.cdt).requires_grad_(ctx.needs_input_grad[0] and not closed)
            # the activation re-run at the dequantized gate (any act module)
            h = ctx.act(ah.clone() if getattr(ctx.act, "inplace", False) else ah)
            if ctx.needs_input_grad[1]:
                gb = (g * h).detach().to(ctx.dtypes[1])
            if ctx.needs_input_grad[0]:
                bh = decompress(pb, ctx.cdt)
                ga = _act_vjp(ctx.act, ah, h, g * bh).detach().to(ctx.dtypes[0])
        return ga, gb, None, None, None, None


class GatedActivation(MesaLayer, nn.Module):
    """``act(gate) * x`` of a gated MLP (timm's ``SwiGLU``, ``GluMlp``) as one layer that
    keeps ``gate`` and ``x`` in 8 bits; ``act`` is the MLP's own activation module (run on
    the dequantized gate in backward), held as a plain attribute, not a child. ``nn.Identity()``
    makes it a plain product ``gate * x`` (gMLP, FocalNet: ``patch/gating.py``); the
    operands may broadcast (autograd sums each gradient to its operand's shape)."""

    _quantizer_names = ("quantizer_a", "quantizer_b")

    def __init__(self, act: nn.Module, *, gate_last: bool = False, device=None, **quant_options):
        super().__init__()
        object.__setattr__(self, "act_fn", act)
        self.gate_last = bool(gate_last)
        self._init_mesa(quant_options, device)

    def forward(self, gate, x):
        if not self._mesa_active(gate, x):
            return x * self.act_fn(gate) if self.gate_last else self.act_fn(gate) * x
        y = self._fused(gate, x)
        if y is not None:
            return y
        return _GatedFn.apply(gate, x, self.act_fn, self.gate_last, self.quantizer_a, self.quantizer_b)

    def _fused(self, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The product by the C++ layer op (eager, a channel format, an activation it evaluates:
        ``_gated_act_code``; the Python Function's bits), or ``None`` where that Function must run."""
        code = _gated_act_code(self.act_fn)
        if code is None or gate.dim() == 0 or x.dim() == 0:
            return None
        fa = self.quantizer_a.fused_state_args(gate)
        fb = self.quantizer_b.fused_state_args(x) if fa is not None else None
        if fb is None:
            return None
        return torch.ops.mesa.gated_train(gate, x, code, self.gate_last, *fa, *fb)

    def extra_repr(self) -> str:
        return f"act={type(self.act_fn).__name__}, gate_last={self.gate_last}, {self._mesa_repr()}"
