"""Mesa ``Conv2d``: exact forward, saves the 8-bit input (channel groups over dim 1).

In eager training with a channel format and zero padding (numbers, 'valid', an odd 'same') the
layer runs as one op with a C++ autograd node, ``mesa::conv2d_train`` / ``conv1d_train``
(csrc/layers_autograd.cpp: bitwise ``_Conv2dFn``, tests/test_layers_autograd.py), a scale-branch
link included where its BatchNorm takes its C++ op too (csrc/scale_link.h); under
``torch.compile``, for patch4x4 and learned thresholds, an even 'same' and the other padding
modes, ``_Conv2dFn`` runs. In eager training, parallel convs handed the same tensor (RepVGG's,
MobileOne's and Inception's branches, a ResNet block's ``conv1`` and ``downsample``) keep one copy
of it between them (``input_copy.py``)."""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch
import torch._dynamo.config
from torch import nn
from torch._dynamo import compiled_autograd

from .first_order import first_order
from ._common import (MesaLayer, adopt_parameters, check_stock, from_nhwc, inherit_options, is_channels_last, load,
                      nhwc_view, no_autocast, save)

from . import input_copy
from .quantizer import decompress

__all__ = ["Conv1d", "Conv2d", "ScaleLink", "conv_backward", "conv_forward", "is_scale_conv", "scale_branch_compiled"]


class ScaleLink:
    """Hand-over from a train-mode Mesa ``BatchNorm2d`` to the 1x1 depthwise Mesa ``Conv2d``
    whose output it normalises (a RepVGG / MobileOne "scale branch": ``bn(w * x)``).

    That BatchNorm makes its output invariant to the conv weight ``w_c`` but for its ``eps``,
    so the exact ``dw_c = sum(dy_c * x_c)`` is a cancellation (1e-8 of the largest gradient
    on FastViT) that 8-bit noise of the conv input swamps. With ``y = w * x`` and
    ``x_hat = (y - mean) * invstd``, ``x`` is an affine function of ``x_hat`` (``w_c != 0``)
    and the BatchNorm backward gives, per channel, ``sum(dy) = 0`` and
    ``sum(dy * x_hat) = gamma * invstd * dgamma * (1 - mean(x_hat^2))``, hence::

        dw_c = gamma_c * dgamma_c * (1 - mean(x_hat_c^2)) / w_c      (1 - mean(x_hat^2) = eps * invstd^2)

    The BatchNorm backward stores ``gamma * dgamma * (1 - mean(x_hat^2))`` (from its
    re-standardised ``x_hat``: no cancellation left) and the gradient it hands on; the conv
    backward uses it when the gradient it receives is that very tensor (the BatchNorm is the
    output's only consumer), and its own 8-bit input where ``w_c == 0``. This object serves the
    Python Functions; where both layers run their C++ ops the same hand-over goes between their
    nodes (csrc/scale_link.h)."""

    __slots__ = ("out", "gx", "coef")

    def __init__(self):
        self.out = None   # weakref to the conv output
        self.gx = None    # the gradient the BatchNorm backward returned for it
        self.coef = None  # per channel: gamma * dgamma * (1 - mean(x_hat^2))


def compiled_autograd_may_run() -> bool:
    """Whether this step's backward may run under compiled autograd: inside
    ``compiled_autograd._enable`` (which ``torch.compile`` enters around a compiled function
    when ``torch._dynamo.config.compiled_autograd`` is set, its eager parts included), or with
    that flag set. The C++ scale-branch link keeps its state in the nodes' saved data as a
    capsule, a value compiled autograd cannot key its cache on ("unhashable type: 'Capsule'"),
    so the pair takes the Python ``ScaleLink`` then (tests/test_compiled_autograd.py)."""
    return compiled_autograd.compiled_autograd_enabled or bool(torch._dynamo.config.compiled_autograd)


def scale_branch_compiled(conv: nn.Module, bn: nn.Module) -> bool:
    """Under ``torch.compile``, whether a linked scale branch (``conv`` -> ``bn``, linked by
    ``patch_model``) runs as one Function, the BatchNorm's (``batchnorm._ScaleBranchFn``): the
    link hand-over cannot be traced. Both modules ask it, and both answer alike: the conv then
    returns its input untouched and the BatchNorm computes the pair. Training, both enabled,
    the conv weight wanting its gradient, the BatchNorm on batch statistics."""
    return (torch.compiler.is_compiling() and torch.is_grad_enabled()
            and conv.training and conv._mesa_options.enabled and conv.weight.requires_grad
            and bn.training and bn._mesa_options.enabled)


def is_scale_conv(m: nn.Module) -> bool:
    """A 1x1 depthwise conv (one output channel per input channel, no padding)."""
    return (isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and m.groups == m.in_channels == m.out_channels
            and not isinstance(m.padding, str) and tuple(m.padding) == (0, 0) and m.padding_mode == "zeros")


def conv_forward(x, weight, bias, module, quantizer, weight_grad: bool):
    """The Mesa convs' training forward: ``(y, packed input or None, its layout meta)``; the input
    is compressed only when the weight gradient needs it (``weight_grad``), and only once for
    the parallel convs given the same tensor (``input_copy.py``)."""
    y = module._conv_forward(x, weight, bias)  # exactly nn.Conv2d.forward
    # a channels-last input is kept in its own layout: backward hands convolution_backward
    # a channels-last input, so the input gradient is stock's, layout and bits
    spatial = len(module.kernel_size)  # 2 for Conv2d, 1 for Conv1d
    xv, dim, nhwc_codes = nhwc_view(x, x.dim() - spatial - 1, quantizer.options.channel_layout)
    packed = None
    if weight_grad:
        # (learned thresholds learn from their own codes: those convs keep their own)
        signature = (input_copy.conv_function_signature(spatial, quantizer.options)
                     if quantizer.options.estimator != "learned" and input_copy.may_share(x) else None)
        packed = input_copy.take_or_make(x, signature, quantizer, lambda: quantizer.compress(xv, dim))
    return y, packed, (is_channels_last(x), nhwc_codes, x.shape)


def conv_backward(g, packed, weight, module, meta, need, cdt, scale_coef=None):
    """``(dx, dweight, dbias)`` in the compute dtype ``cdt`` (``need``: which are wanted).
    ``scale_coef``: a scale branch's BatchNorm hand-over (``ScaleLink``): the weight gradient is
    ``coef / w`` where ``w != 0``, from the 8-bit input elsewhere."""
    channels_last, nhwc_codes, x_shape = meta
    m = module
    with no_autocast(g.device.type):
        g = g.to(cdt)
        w = weight.to(cdt)
        if packed is not None:
            xh = from_nhwc(decompress(packed, cdt), nhwc_codes)
        else:  # only the input gradient is needed: the values of x do not matter, its layout does
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            xh = torch.empty(x_shape, dtype=cdt, device=g.device, memory_format=fmt)
        spatial = len(m.kernel_size)
        unbatched = xh.dim() == spatial + 1
        if unbatched:
            xh, g = xh.unsqueeze(0), g.unsqueeze(0)
        padding = _explicit_padding(m)
        if padding is not None:
            gx, gw, gb = torch.ops.aten.convolution_backward(
                g, xh, w, [w.shape[0]] if need[2] else None, list(m.stride), padding,
                list(m.dilation), False, [0] * spatial, m.groups, list(need))
        else:  # 'same' with an even kernel, non-zero padding modes: autograd re-derivation
            gx, gw, gb = _autograd_backward(m, g, xh, w, list(need))
        if unbatched and gx is not None:
            gx = gx.squeeze(0)
        if scale_coef is not None and gw is not None:  # scale branch into a BatchNorm (ScaleLink)
            nz = w != 0
            closed = scale_coef.to(cdt).view_as(w) / torch.where(nz, w, torch.ones_like(w))
            gw = torch.where(nz, closed, gw)
    return gx, gw, gb


class _Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, quantizer, link=None):
        y, packed, ctx.meta = conv_forward(x, weight, bias, module, quantizer, ctx.needs_input_grad[1])
        ctx.link = link
        ctx.module = module
        ctx.cdt, ctx.x_dtype, ctx.w_dtype = y.dtype, x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        save(ctx, [packed], weight)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (weight,) = load(ctx)
        need = tuple(ctx.needs_input_grad[:3])
        link = ctx.link  # (kept: a second backward with retain_graph hands over again)
        linked = link is not None and link.coef is not None and g is link.gx and need[1]
        if link is not None:
            link.gx = None
        gx, gw, gb = conv_backward(g, packed, weight, ctx.module, ctx.meta, need, ctx.cdt,
                                   link.coef if linked else None)
        if link is not None:
            link.coef = None
        gx = gx.to(ctx.x_dtype) if gx is not None and need[0] else None
        gw = gw.to(ctx.w_dtype) if gw is not None and need[1] else None
        gb = gb.to(ctx.b_dtype) if gb is not None and need[2] else None
        return gx, gw, gb, None, None, None


def _explicit_padding(m) -> Optional[List[int]]:
    """``m``'s zero padding as ints per side for ``convolution_backward``; ``'valid'`` is 0 and
    ``'same'`` is ``dilation * (k - 1) / 2`` where that is whole (ConvMixer's depthwise convs),
    which is what ``F.conv2d`` pads. None where only autograd re-derives it (``'same'`` with an
    even kernel pads one side more; reflect / replicate / circular modes): a path that
    ``torch.compile`` cannot trace inside a backward."""
    if m.padding_mode != "zeros":
        return None
    if not isinstance(m.padding, str):
        return list(m.padding)
    if m.padding == "valid":
        return [0] * len(m.kernel_size)
    total = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)]
    return [t // 2 for t in total] if all(t % 2 == 0 for t in total) else None


def _autograd_backward(m, g, xh, w, need):
    with torch.enable_grad():
        xd = xh.detach().requires_grad_(need[0])
        wd = w.detach().requires_grad_(need[1])
        bd = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device, requires_grad=need[2]) if need[2] else None
        y = m._conv_forward(xd, wd, bd)
        inputs = [t for t, n in zip((xd, wd, bd), need) if n]
        grads = iter(torch.autograd.grad(y, inputs, g))
    return tuple(next(grads) if n else None for n in need)


class _MesaConv(MesaLayer):
    """What the Mesa ``Conv2d`` and ``Conv1d`` share: the stock constructor's arguments, and
    ``from_module`` adopting the stock conv's parameters (``_stock`` is the torch class)."""

    _stock: type = nn.Conv2d
    _train_op: str = "conv2d_train"  # the C++ layer op, torch.ops.mesa.<_train_op>

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, **quant_options):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, **quant_options):
        check_stock(stock, cls._stock)
        new = cls(stock.in_channels, stock.out_channels, stock.kernel_size, stride=stock.stride,
                  padding=stock.padding, dilation=stock.dilation, groups=stock.groups, bias=stock.bias is not None,
                  padding_mode=stock.padding_mode, device="meta", dtype=stock.weight.dtype,
                  **inherit_options(stock, quant_options))
        return adopt_parameters(stock, new)

    def _compressed_conv(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``self._conv_forward(input, weight, self.bias)`` keeping the 8-bit input; ``weight``
        is this layer's own or one derived from it (weight standardization: ``std_conv.py``)."""
        padding = _explicit_padding(self)
        # eager, a channel format, zero padding the op can be given as numbers (numbers, 'valid',
        # an odd 'same': what F.conv2d pads; ConvMixer's depthwise convs): the layer with a C++
        # autograd node; otherwise (compile, patch4x4, learned thresholds, an even 'same', the
        # other padding modes) the Python Function
        fused = self.quantizer.fused_layer_args(input) if padding is not None else None
        if fused is not None:
            return self._conv_op(input, weight, padding, fused)
        return _Conv2dFn.apply(input, weight, self.bias, self, self.quantizer)

    def _conv_op(self, input, weight, padding, fused, scale_link: bool = False) -> torch.Tensor:
        """The C++ layer op; the input's codes are made once for the parallel convs given the
        same tensor (``input_copy.py``): taken where another left them, else left for the next."""
        quantizer = self.quantizer
        signature = (input_copy.conv_op_signature(len(self.kernel_size), quantizer.options)
                     if weight.requires_grad and input_copy.may_share(input) else None)
        shared = input_copy.take(input, signature, quantizer) if signature is not None else None
        link = (scale_link,) if self._train_op == "conv2d_train" else ()
        y, q, alpha, beta = getattr(torch.ops.mesa, self._train_op)(
            input, weight, self.bias, self.stride, padding, self.dilation, self.groups, *fused, *link,
            () if shared is None else shared)
        if signature is not None and q.numel():  # (made here, not taken: empty when shared)
            input_copy.offer(input, signature, (q, alpha, beta))
        return y


class Conv2d(_MesaConv, nn.Conv2d):
    """``torch.nn.Conv2d`` whose saved input is 8-bit (channel groups over dim 1), or with
    ``layout="patch4x4"`` a min/max per 4x4 spatial block of each channel (DESIGN.md).
    A 1x1 depthwise conv whose output goes straight into a Mesa ``BatchNorm2d`` (linked by
    ``patch_model``) takes its weight gradient from that BatchNorm (``ScaleLink``)."""

    _layouts = ("channel", "patch4x4")
    _stock = nn.Conv2d

    def forward(self, input):
        if not self._mesa_active(input, self.weight, self.bias):
            return super().forward(input)
        bn = self.__dict__.get("_mesa_scale_bn")
        if bn is None or not self.weight.requires_grad:
            return self._compressed_conv(input, self.weight)
        if torch.compiler.is_compiling():
            # The link is a Python object the two backwards hand over through, which a traced
            # autograd.Function may not mutate (Dynamo: "HOP: Unsafe side effect"). Without it
            # this conv's weight gradient is a cancellation that 8-bit noise in the BatchNorm's
            # backward swamps (RepViT: 0.9 relative error). Under compile the BatchNorm runs
            # the pair as one Function instead (batchnorm._ScaleBranchFn: the same hand-over
            # inside one backward); this conv hands it its input. (patch_model links only a
            # pair whose container runs exactly bn(conv(x)).)
            if scale_branch_compiled(self, bn):
                return input
            return self._compressed_conv(input, self.weight)
        fused = (self.quantizer.fused_layer_args(input)
                 if bn._runs_layer_op(input) and not compiled_autograd_may_run() else None)
        if fused is not None:
            # both on their C++ ops: the BatchNorm's node finds this conv's as its input's
            # grad_fn and hands the weight gradient over there (csrc/scale_link.h); a
            # BatchNorm on its Python Function could not, so then both run here in Python
            return self._conv_op(input, self.weight, list(self.padding), fused, scale_link=True)
        link = ScaleLink()
        y = _Conv2dFn.apply(input, self.weight, self.bias, self, self.quantizer, link)
        link.out = weakref.ref(y)
        bn.__dict__["_mesa_scale_pending"] = link  # taken by the BatchNorm if y is its input
        return y

    def extra_repr(self) -> str:
        return f"{nn.Conv2d.extra_repr(self)}, {self._mesa_repr()}"


class Conv1d(_MesaConv, nn.Conv1d):
    """``torch.nn.Conv1d`` whose saved input is 8-bit (channel groups over the channel dim):
    in eager training ``mesa::conv1d_train`` (``Conv2d``'s C++ node, one spatial dim), else the
    Python Function of ``Conv2d`` (``_Conv2dFn``, any number of spatial dims); the stock
    forward, ``convolution_backward`` on the dequantized input. EfficientViM's token
    convolutions (16% of what it kept; 18 a step in EfficientViM-M1), CoaT's, ECA attention's."""

    _stock = nn.Conv1d
    _train_op = "conv1d_train"

    def _init_mesa(self, quant_options: dict, device=None) -> None:
        # layout="patch4x4" tiles a (B, C, H, W) feature map: a 1-D conv in a model patched with
        # it (patch_model(..., ops=["conv"], layout="patch4x4")) keeps the channel layout
        opts = quant_options.get("options")
        if quant_options.get("layout") == "patch4x4":
            quant_options = {**quant_options, "layout": "channel"}
        elif opts is not None and opts.layout == "patch4x4":
            quant_options = {**quant_options, "options": opts.replace(layout="channel")}
        super()._init_mesa(quant_options, device)

    def forward(self, input):
        if not self._mesa_active(input, self.weight, self.bias):
            return super().forward(input)
        return self._compressed_conv(input, self.weight)

    def extra_repr(self) -> str:
        return f"{nn.Conv1d.extra_repr(self)}, {self._mesa_repr()}"
