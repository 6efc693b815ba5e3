"""Mesa ``ReLU`` and ``LeakyReLU``: exact forward, saves a 1-bit mask (8 booleans per byte);
``PReLU``: the mask and its 8-bit input (for its weight's gradient)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import (MesaLayer, check_stock, copy_estimates, inherit_options, is_channels_last, kept_input, load,
                      no_autocast, save, save_elementwise_input)

__all__ = ["ReLU", "LeakyReLU", "PReLU", "pack_bits", "unpack_bits", "keep_mask", "kept_mask"]


# the kinds of mesa::mask_train (csrc/convnet_autograd.cpp): the layers that keep one 1-bit mask
MASK_KINDS = {"relu": 0, "hardtanh": 1, "hardsigmoid": 2}


def _shifts(device):
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_bits(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Pack a boolean tensor into uint8, 8 elements per byte (little-endian bits), flat: in
    NCHW order, or for a channels-last mask (``is_channels_last``) in its own memory order
    (its NHWC view), so that :func:`unpack_bits` gives it back channels-last. Returns the bytes
    and whether the mask was channels-last (:func:`unpack_bits`' ``channels_last``). A mask unpacked
    NCHW turned the gradient NCHW (``threshold_backward(g, mask)`` takes the layout of both),
    and the BatchNorm backward before it then took ATen's mixed-layout path: ResNet-50
    trained channels-last ran its BatchNorms' backward 10x slower than stock on CPU."""
    channels_last = is_channels_last(mask)
    if channels_last:
        mask = mask.permute(0, 2, 3, 1)
    # one copy into a contiguous uint8 tensor, then a view: a reshape of the bool mask is
    # traced as a view where the traced strides say contiguous, and a runtime tensor with
    # other strides (PoolFormerV2's StarReLU under torch.compile: a channels-last conv output
    # traced as contiguous) then failed with "view size is not compatible"
    flat = mask.to(torch.uint8, memory_format=torch.contiguous_format).view(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) << _shifts(flat.device)).sum(-1, dtype=torch.uint8), channels_last


def unpack_bits(packed: torch.Tensor, shape, channels_last: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a boolean tensor of ``shape``, channels-last where the mask
    was (``channels_last``: :func:`pack_bits`' flag)."""
    if channels_last:
        n, c, h, w = shape
        return unpack_bits(packed, (n, h, w, c)).permute(0, 3, 1, 2)
    n = 1
    for s in shape:
        n *= s
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(-1)[:n].view(shape).bool()


def keep_mask(ctx, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Save ``mask`` for backward, one bit an element (:func:`kept_mask` gives it back), and
    return the Function's output: ``y``, or where the op ran in place the input object itself,
    marked dirty, as autograd requires (Dynamo gives an in-place functional's result a new
    identity and refused the Function otherwise: MobileNetV3 and GhostNet failed to compile)."""
    if inplace:
        ctx.mark_dirty(x)
        y = x
    bits, ctx.cl = pack_bits(mask)
    ctx.shape = y.shape
    save(ctx, [], bits)
    return y


def kept_mask(ctx) -> torch.Tensor:
    """The boolean mask :func:`keep_mask` saved, in its layout."""
    _, (bits,) = load(ctx)
    return unpack_bits(bits, ctx.shape, ctx.cl)


class _ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace):
        y = F.relu(x, inplace=inplace)  # exactly nn.ReLU.forward
        # where threshold_backward(g, y, 0) passes g: y > 0, and a NaN (y <= 0 is false), as stock
        # gives on every device and dtype (measured, torch 2.14)
        return keep_mask(ctx, x, y, ~(y <= 0), inplace)

    @staticmethod
    @first_order
    def backward(ctx, g):
        # == threshold_backward(g, y, 0), in g's and the mask's layout (masked_fill's out-of-place
        # result is NCHW, whatever its inputs' layout)
        return torch.where(kept_mask(ctx), g, 0), None


class ReLU(MesaLayer, nn.ReLU):
    """``torch.nn.ReLU`` that saves a 1-bit mask instead of its output.

    Accepts the common quantization options (only ``enabled`` matters: there are no
    estimates to keep, so it has no buffers).
    """

    _quantizer_names = ()

    def __init__(self, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(inplace=inplace)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.ReLU, *, device=None, **quant_options) -> "ReLU":
        """``device`` is accepted like the other parameter-free layers' (a ReLU keeps no
        estimates, so there is nothing to place)."""
        check_stock(stock, nn.ReLU)
        return cls(stock.inplace, **inherit_options(stock, quant_options)).train(stock.training)

    def forward(self, input, inplace: Optional[bool] = None):
        """``inplace``: this call's, else the module's (a functional ``F.relu(x, inplace)`` a
        module's forward makes is routed here: patch/functional_calls.py)."""
        inplace = self.inplace if inplace is None else inplace
        if not self._mesa_active(input):
            return F.relu(input, inplace=inplace)
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/convnet_autograd.cpp), the same bits
            op = torch.ops.mesa.mask_train_ if inplace else torch.ops.mesa.mask_train
            return op(input, MASK_KINDS["relu"], 0.0, 0.0)
        return _ReLUFn.apply(input, inplace)  # no seed: traceable by torch.compile

    def extra_repr(self) -> str:
        base = nn.ReLU.extra_repr(self)
        return f"{base}, {self._mesa_repr()}" if base else self._mesa_repr()


class _LeakyReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, negative_slope, inplace):
        # where leaky_relu_backward(g, x, slope) passes g unscaled: x > 0 (a NaN is not), from the
        # input before an in-place call overwrites it (stock reads the result then, the same set
        # for the positive slopes in-place allows)
        mask = x > 0
        ctx.slope = negative_slope
        return keep_mask(ctx, x, F.leaky_relu(x, negative_slope, inplace=inplace), mask, inplace)

    @staticmethod
    @first_order
    def backward(ctx, g):
        return torch.where(kept_mask(ctx), g, g * ctx.slope), None, None


class LeakyReLU(MesaLayer, nn.LeakyReLU):
    """``torch.nn.LeakyReLU`` (TResNet, DarkNet-style CNNs) that saves a 1-bit mask of
    ``x > 0`` instead of its input (out of place) or output (in place). The Python Function
    in eager and compiled training alike (the C++ mask op knows ReLU, Hardtanh and
    Hardsigmoid). Op ``relu``."""

    _quantizer_names = ()

    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False, *, device=None, **quant_options):
        super().__init__(negative_slope=negative_slope, inplace=inplace)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.LeakyReLU, *, device=None, **quant_options) -> "LeakyReLU":
        check_stock(stock, nn.LeakyReLU)
        return cls(stock.negative_slope, stock.inplace, **inherit_options(stock, quant_options)).train(stock.training)

    def forward(self, input, negative_slope: Optional[float] = None, inplace: Optional[bool] = None):
        """``negative_slope``, ``inplace``: this call's, else the module's (a functional
        ``F.leaky_relu(x, 0.2)`` a module's forward makes is routed here: patch/functional_calls.py)."""
        slope = self.negative_slope if negative_slope is None else negative_slope
        inplace = self.inplace if inplace is None else inplace
        if not self._mesa_active(input):
            return F.leaky_relu(input, slope, inplace)
        return _LeakyReLUFn.apply(input, slope, inplace)

    def extra_repr(self) -> str:
        return f"{nn.LeakyReLU.extra_repr(self)}, {self._mesa_repr()}"


class _PReLUFn(torch.autograd.Function):
    """``prelu(x, weight)`` keeping 8-bit ``x`` and a 1-bit mask of ``x > 0`` (stock keeps ``x``):
    the input gradient from the mask and the weight, exact (stock's ``where(x > 0, g, w * g)``);
    the weight's, ``sum(g * x)`` over the negative side, from the codes clamped to <= 0."""

    @staticmethod
    def forward(ctx, x, weight, quantizer):
        y = F.prelu(x, weight)
        positive, ctx.cl = pack_bits(x > 0)  # (prelu_backward's test: a NaN is not positive, as stock's)
        ctx.shape = x.shape
        save_elementwise_input(ctx, x, y, quantizer, positive, weight)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (positive, weight) = load(ctx)
        with no_autocast(g.device.type):
            positive = unpack_bits(positive, ctx.shape, ctx.cl)
            g = g.to(ctx.cdt)
            # the weight over dim 1 (channels) where it has more than one entry, as F.prelu's
            shape = [1] * g.dim()
            if weight.numel() > 1:
                shape[1] = -1
            w = weight.to(ctx.cdt).view(shape)
            gx = torch.where(positive, g, g * w)
            gw = None
            if ctx.needs_input_grad[1]:
                xh = kept_input(ctx, packed)
                part = g.float() * torch.where(positive, 0.0, xh.clamp(max=0).float())
                dims = [d for d in range(g.dim()) if not (weight.numel() > 1 and d == 1)]
                gw = part.sum(dim=dims).reshape(weight.shape).to(weight.dtype)
        return gx.to(ctx.x_dtype), gw, None


class PReLU(MesaLayer, nn.PReLU):
    """``torch.nn.PReLU`` (timm's ``act_layer="prelu"``) keeping its 8-bit input and a 1-bit
    mask of ``x > 0``: input gradients bitwise stock's, the weight's from the codes. The Python
    Function in eager and compiled training alike. Op ``relu``."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, *, device=None, dtype=None, **quant_options):
        super().__init__(num_parameters=num_parameters, init=init, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.PReLU, *, device=None, **quant_options) -> "PReLU":
        check_stock(stock, nn.PReLU)
        new = cls(stock.num_parameters, device="meta", dtype=stock.weight.dtype,
                  **inherit_options(stock, quant_options))
        new.weight = stock.weight  # (the same Parameter: optimizers keep it)
        copy_estimates(stock, new, stock.weight.device)
        return new.train(stock.training)

    def forward(self, input):
        if not self._mesa_active(input, self.weight) or input.dim() < 2:
            return F.prelu(input, self.weight)
        return _PReLUFn.apply(input, self.weight, self.quantizer)

    def extra_repr(self) -> str:
        return f"{nn.PReLU.extra_repr(self)}, {self._mesa_repr()}"
