"""Mesa ``MaxPool2d``: exact forward, saves one uint8 window-local argmax per output element.

In training, stock ``nn.MaxPool2d`` keeps for backward its whole input (4 bytes per input
element in float32) *and* the int64 argmax of each window (8 bytes per output element). The
backward reads neither the input's values (``max_pool2d_with_indices_backward`` takes only
its sizes and memory format) nor needs global indices: only *which element of its window*
each output took. That window-local index ``lh * kW + lw`` lies in ``0 .. kH*kW - 1`` and
fits in a uint8 for ``kH * kW <= 256``, so this layer keeps 1 byte per output element
(ResNet's stem pool, k=3 s=2 on float32: stock keeps 4 x 4 bytes of input plus 8 bytes of
index, 24 bytes per output element, against 1). Backward rebuilds the int64 indices
transiently and calls the stock kernel with them, so the gradient is bitwise stock's:
lossless, ties included (the same element of each window is picked, since the forward is
the stock op). Under ``torch.compile`` with Inductor, stock max pooling is already lowered to
int8 window offsets; the saving is for eager (and aot_eager) training.

``return_indices=True`` (the caller keeps the int64 indices anyway) and windows over 256
elements (no uint8 local index) run the stock forward. In eager training with the compiled
extension the layer is one op, ``mesa::max_pool2d_train`` (csrc/convnet_autograd.cpp), with
a C++ autograd node and the index arithmetic as one loop each way on the CPU
(csrc/maxpool_index.cpp): the same bits, at a fifth of this Function's host time.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import suggest_memory_format

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import MesaLayer, check_stock, inherit_options, load, save

__all__ = ["MaxPool2d", "pool_args"]

_MAX_WINDOW = 256  # a uint8 holds the local indices 0 .. 255


def _pair(v) -> tuple:
    """``F.max_pool2d``'s argument forms: an int, or a sequence of one or two ints."""
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return v * 2 if len(v) == 1 else v


def pool_args(kernel_size, stride, padding, dilation) -> tuple | None:
    """``(kernel, stride, padding, dilation)`` as 2-tuples (a None or empty stride is the
    kernel size, as in ``F.max_pool2d`` and ``F.avg_pool2d``), or None when they are not all pairs (the stock
    forward then runs and raises ATen's own error)."""
    k = _pair(kernel_size)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _pair(stride)
    args = (k, s, _pair(padding), _pair(dilation))
    return args if all(len(a) == 2 for a in args) else None


def _window_origins(out: torch.Tensor, stride, padding, dtype=torch.int64):
    """Per output position: the row ``h0`` and column ``w0`` of its window's top-left
    element (negative in the padding), as ``(OH, 1)`` / ``(OW,)`` grids on the output's
    device (one ``arange`` each: no host sync, traceable; they broadcast over (N, C) or (C,))."""
    (oh, ow), (sh, sw), (ph, pw) = out.shape[-2:], stride, padding
    h0 = torch.arange(-ph, oh * sh - ph, sh, device=out.device, dtype=dtype).unsqueeze(-1)
    w0 = torch.arange(-pw, ow * sw - pw, sw, device=out.device, dtype=dtype)
    return h0, w0


def _window_local(idx: torch.Tensor, out: torch.Tensor, in_size, kernel, stride, padding, dilation):
    """The uint8 window-local index ``lh * kW + lw`` of each output's element from ATen's
    per-plane index ``idx = h * W + w`` on an ``in_size = (H, W)`` input (the output's layout:
    elementwise ops)."""
    height, width = in_size
    # int32 holds h * W + w for any plane under 2**31 elements: CPU divides int32 vectorised,
    # ~6x faster than int64
    if height * width < 2 ** 31:
        idx = idx.int()
    h0, w0 = _window_origins(out, stride, padding, idx.dtype)
    h = torch.div(idx, width, rounding_mode="floor")
    if dilation == (1, 1):
        # lh = h - h0, lw = idx - h * W - w0, so lh * kW + lw = idx + h * (kW - W) - (h0 * kW + w0):
        # two ops on the output's size where the written-out form takes five
        local = torch.add(idx, h, alpha=kernel[1] - width) - torch.add(w0, h0, alpha=kernel[1])
    else:
        # the window's row / column of that element is its distance from the window origin
        # in dilation steps (exact: a window only holds elements on that lattice)
        lh = torch.div(h - h0, dilation[0], rounding_mode="floor")
        lw = torch.div(idx - h * width - w0, dilation[1], rounding_mode="floor")
        local = lh * kernel[1] + lw
    return local.to(torch.uint8)


def _global_index(local: torch.Tensor, width: int, kernel, stride, padding, dilation) -> torch.Tensor:
    """ATen's int64 per-plane index ``h * W + w`` back from :func:`_window_local`'s: the
    window origin's plus a kH * kW-entry offset table looked up per output element (no
    per-element division; transient, like the indices stock keeps)."""
    h0, w0 = _window_origins(local, stride, padding)
    rows = torch.arange(0, kernel[0] * dilation[0] * width, dilation[0] * width, device=local.device)
    cols = torch.arange(0, kernel[1] * dilation[1], dilation[1], device=local.device)
    offset = (rows.unsqueeze(-1) + cols).view(-1)
    return torch.add(w0, h0, alpha=width) + offset[local.long()]


class _MaxPool2dFn(torch.autograd.Function):
    # csrc/convnet_autograd.cpp's MaxPool2dTrain (mesa::max_pool2d_train) is this, op for op
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        out, idx = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        local = _window_local(idx, out, x.shape[-2:], kernel, stride, padding, dilation)
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        # what the backward kernel reads of the input: sizes, dtype, device and the memory
        # format it gives the gradient (ATen's suggest_memory_format, as the meta function)
        ctx.x_meta = (x.shape, x.dtype, x.device, suggest_memory_format(x))
        save(ctx, [], local)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        _, (local,) = load(ctx)
        kernel, stride, padding, dilation, ceil_mode = ctx.args
        shape, dtype, device, fmt = ctx.x_meta
        idx = _global_index(local, shape[-1], kernel, stride, padding, dilation)
        x_like = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)  # never read, only its sizes
        gx = torch.ops.aten.max_pool2d_with_indices_backward(g, x_like, kernel, stride, padding, dilation,
                                                             ceil_mode, idx)
        return gx, None, None, None, None, None


class MaxPool2d(MesaLayer, nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` that saves a uint8 window-local argmax instead of its input
    and int64 indices; gradients are bitwise stock's.

    Accepts the common quantization options (only ``enabled`` matters: nothing is
    quantized, so it has no buffers). ``return_indices=True`` or a window of more than 256
    elements runs the stock forward.
    """

    _quantizer_names = ()

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, *, device=None, **quant_options):
        super().__init__(kernel_size, stride=stride, padding=padding, dilation=dilation,
                         return_indices=return_indices, ceil_mode=ceil_mode)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.MaxPool2d, *, device=None, **quant_options) -> "MaxPool2d":
        """``device`` is accepted like the other parameter-free layers' (a max pool keeps no
        estimates, so there is nothing to place)."""
        check_stock(stock, nn.MaxPool2d)
        return cls(stock.kernel_size, stock.stride, stock.padding, stock.dilation, stock.return_indices,
                   stock.ceil_mode, **inherit_options(stock, quant_options)).train(stock.training)

    def forward(self, input, call: Optional[dict] = None):
        """``call``: this call's pooling arguments (a functional call routed here:
        patch/functional_calls.py), else the module's."""
        if call is not None:
            return self.pool(input, **call)
        if self.return_indices:  # (the caller keeps the int64 indices anyway)
            return super().forward(input)
        return self.pool(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def pool(self, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        """``F.max_pool2d(input, ...)`` (no indices returned) through this layer (also a
        functional call a module's forward makes: patch/functional_calls.py). The stock op
        where the window has more than 256 elements or the arguments are malformed (stock
        raises its error)."""
        args = pool_args(kernel_size, stride, padding, dilation) if self._mesa_active(input) else None
        if args is None or args[0][0] * args[0][1] > _MAX_WINDOW:
            return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/convnet_autograd.cpp), the same bits
            return torch.ops.mesa.max_pool2d_train(input, *args, ceil_mode)
        return _MaxPool2dFn.apply(input, *args, ceil_mode)

    def extra_repr(self) -> str:
        return f"{nn.MaxPool2d.extra_repr(self)}, {self._mesa_repr()}"
