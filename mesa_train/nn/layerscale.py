"""Mesa layer scale: ``x * gamma`` with a learnable per-channel ``gamma`` (last dim), keeping
``x`` in 8 bits for ``gamma``'s gradient.

Stock autograd keeps ``x`` in full precision (``dgamma = sum_rows(g * x)``); ``dx = g * gamma``
needs only the parameter. In ViTs with layer scale (DeiT3, CaiT, BEiT, EVA, XCiT, relpos,
...) that is one ``(B, N, C)`` tensor per residual branch, 10-20% of what a patched block still
kept in full precision. Two forms:

* ``LayerScale``: timm's ``LayerScale`` module (``x * self.gamma``), converted as a leaf;
  ``LayerScale2d``: the NCHW forms (timm's ``LayerScale2d``, ``x * gamma.view(1, -1, 1, 1)``:
  EfficientFormer(-V2), MaxViT's MBConv, CSATv2, FocalNet; SwiftFormer's and FastViT's own,
  ``x * gamma`` with ``gamma`` of shape ``(dim, 1, 1)``), per-channel groups;
  ``Scale``: MetaFormer's (``x * self.scale.view(dim, 1, 1)`` on NCHW, or ``(dim,)``
  channels last: ConvFormer, CAFormer, PoolFormerV2's layer and residual scales);
* ``Affine``: ResMLP's ``torch.addcmul(beta, alpha, x)`` norm (its own class in timm's
  ``mlp_mixer``; two a block, half of what ResMLP still kept): the same 8-bit ``x``
  (``mesa::affine_train`` in eager training, as ``mesa::scale_train`` for the others);
* ``ChannelScale``: parameter-free, ``forward(x, gamma)`` for blocks that multiply by their
  own ``gamma_1``-style parameter inline (BEiT, CaiT, EVA, XCiT: ``self.gamma_1 * y``); the
  patcher routes that product here (``patch/generic_attention.py``, ``install_scales``).
  Also the learned per-head logit scale / temperature of cosine attention (SwinV2's
  ``(q_n @ k_n^T) * logit_scale.exp()``, XCiT's ``* self.temperature``, shape ``(heads, 1, 1)``):
  then ``x`` (the logits) is kept with per-head groups and ``dgamma`` is summed to its shape;
  also a 0-d scale (lucidrains' LSA, ``dots * self.temperature.exp()``), groups along dim 1.
* ``ChannelGate``: a ``ChannelScale`` for squeeze-excite's ``x * gate(x_se)``, the gate
  ``(N, C, 1, 1)`` (or ``(N, 1, 1, C)``): ``x`` kept with channel groups, ``dgamma`` summed the
  same way (the dim a broadcast ``gamma`` varies along last is the groups' dim).

The forward is ``x * gamma`` (IEEE multiplication is commutative, so ``gamma * x`` is the same
bits); the codes use channel groups over the last dim with power-of-two row scales
(``rowscale.py``), like ``Linear``'s input. In eager training with the paper's format every form
runs as one C++ op with a C++ autograd node (``mesa::scale_train``, csrc/scale_autograd.cpp), the
same bits as ``_ScaleFn``, which runs otherwise (under ``torch.compile``, the variant formats).
"""
from __future__ import annotations

import torch
from torch import nn

from .first_order import first_order
from ._common import (MesaLayer, check_stock, copy_estimates, from_nhwc, inherit_options, load, nhwc_view,
                      no_autocast, save, stock_device)
from .rowscale import compress_rows, decompress_rows, max_exponent

__all__ = ["Affine", "LayerScale", "LayerScale2d", "ChannelScale", "ChannelGate", "Scale", "channel_scale"]


def _broadcast_dim(x: torch.Tensor, gamma: torch.Tensor) -> int:
    """The dim of ``x`` that a broadcast ``gamma`` of 2+ dims varies along last (its groups):
    the heads of a ``(heads, 1, 1)`` logit scale, the channels of a squeeze-excite gate
    ``(N, C, 1, 1)`` or, channels last, ``(N, 1, 1, C)``; dim 1 if none varies."""
    varying = [i for i, n in enumerate(gamma.shape) if n > 1]
    return x.dim() - gamma.dim() + varying[-1] if varying else 1


class _ScaleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, quantizer):
        out = x * gamma
        packed = k = None
        ctx.nhwc = False
        if ctx.needs_input_grad[1]:
            if gamma.dim() == 1:  # per channel (last dim): channel groups, small rows scaled
                packed, k = compress_rows(quantizer, x, 1, max_exponent(x.dtype, out.dtype))
            else:  # per head or per (sample, channel), or one scalar: groups along the dim gamma
                # varies along (a scalar's: dim 1, the heads of attention logits)
                xv, dim, ctx.nhwc = nhwc_view(x, _broadcast_dim(x, gamma), quantizer.options.channel_layout)
                packed = quantizer.compress(xv, dim)
        ctx.cdt, ctx.x_dtype, ctx.g_dtype, ctx.g_shape = out.dtype, x.dtype, gamma.dtype, gamma.shape
        save(ctx, [packed], gamma if ctx.needs_input_grad[0] else None, k)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (gamma, k) = load(ctx)
        gx = gg = None
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            if ctx.needs_input_grad[0]:
                # (a 0-d scale as stock's autograd takes it: a bf16 gradient times the float32
                # scalar, the scalar not rounded to bf16 first)
                gx = (g * (gamma if gamma.dim() == 0 else gamma.to(ctx.cdt))).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                xh = from_nhwc(decompress_rows(packed, ctx.cdt, k), ctx.nhwc)
                if len(ctx.g_shape) == 1:
                    gg = (g * xh).reshape(-1, xh.shape[-1]).sum(0).reshape(ctx.g_shape)
                else:
                    gg = (g * xh).sum_to_size(ctx.g_shape)
                gg = gg.to(ctx.g_dtype)
        return gx, gg, None


def _scale(x: torch.Tensor, gamma: torch.Tensor, quantizer) -> torch.Tensor:
    """``x * gamma`` keeping a compressed ``x``: the C++ layer op in eager training with a channel
    format (``mesa::scale_train``, csrc/scale_autograd.cpp: a C++ autograd node, the same bits),
    else ``_ScaleFn``."""
    # (a 0-d scale, LSA's learned temperature, runs the Function: the C++ op takes per-channel
    # and broadcast scales only)
    fused = quantizer.fused_layer_args(x) if gamma.dim() else None
    if fused is not None:
        return torch.ops.mesa.scale_train(x, gamma, *fused, quantizer.options.row_scale)
    return _ScaleFn.apply(x, gamma, quantizer)


class Scale(MesaLayer, nn.Module):
    """timm's MetaFormer ``Scale`` (``x * scale.view(shape)``, shape ``(dim, 1, 1)`` on NCHW
    or ``(dim,)`` channels last) keeping its 8-bit input; the same ``scale`` parameter."""

    def __init__(self, dim: int, init_value: float = 1.0, trainable: bool = True, use_nchw: bool = True, *,
                 device=None, dtype=None, **quant_options):
        super().__init__()
        self.shape = (dim, 1, 1) if use_nchw else (dim,)
        self.scale = nn.Parameter(init_value * torch.ones(dim, device=device, dtype=dtype), requires_grad=trainable)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "Scale":
        from timm.models.metaformer import Scale as TimmScale

        check_stock(stock, (TimmScale, Scale))
        new = cls(stock.scale.shape[0], use_nchw=len(stock.shape) == 3, device="meta",
                  **inherit_options(stock, quant_options))
        new.scale = stock.scale  # the same parameter object
        copy_estimates(stock, new, stock.scale.device)
        return new.train(stock.training)

    def forward(self, x):
        gamma = self.scale.view(self.shape)
        if not self._mesa_active(x, gamma):
            return x * gamma
        return _scale(x, gamma, self.quantizer)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, {self._mesa_repr()}"


def channel_scale(x: torch.Tensor, gamma: torch.Tensor, quantizer) -> torch.Tensor:
    return _scale(x, gamma, quantizer)


class ChannelScale(MesaLayer, nn.Module):
    """``x * gamma`` for a ``gamma`` owned elsewhere (a block's inline ``self.gamma_1 * y``)."""

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, x, gamma):
        if not self._mesa_active(x, gamma):
            return x * gamma
        return _scale(x, gamma, self.quantizer)

    def extra_repr(self) -> str:
        return self._mesa_repr()


class ChannelGate(ChannelScale):
    """``x * s`` of a squeeze-excite block (``patch/squeeze_excite.py``), ``s`` the gate
    ``(N, C, 1, 1)`` or, channels last, ``(N, 1, 1, C)``: stock keeps ``x``, a whole feature
    map, for the gate's gradient ``sum_hw(g * x)``; this keeps it in 8 bits along the channel
    dim (give ``num_groups`` = the channel count: one group per channel) and ``s`` itself.
    A ``ChannelScale`` reported as its own op, ``se``."""


class LayerScale(MesaLayer, nn.Module):
    """timm's ``LayerScale`` (``x * gamma``, channels last) keeping its 8-bit input. An
    ``inplace=True`` stock module computes out of place here: same values."""

    def __init__(self, dim: int, init_values: float = 1e-5, inplace: bool = False, *, device=None, dtype=None,
                 **quant_options):
        super().__init__()
        self.init_values = init_values
        self.inplace = inplace
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values), device=device, dtype=dtype))
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "LayerScale":
        new = cls(stock.gamma.shape[0], getattr(stock, "init_values", 1e-5), getattr(stock, "inplace", False),
                  device="meta", **inherit_options(stock, quant_options))
        new.gamma = stock.gamma  # the same parameter object (optimizers keep working)
        copy_estimates(stock, new, stock.gamma.device if stock.gamma is not None else stock_device(stock, device))
        return new.train(stock.training)

    def forward(self, x):
        if not self._mesa_active(x, self.gamma):
            return x.mul_(self.gamma) if self.inplace else x * self.gamma
        return _scale(x, self.gamma, self.quantizer)

    def extra_repr(self) -> str:
        return f"dim={self.gamma.shape[0]}, inplace={self.inplace}, {self._mesa_repr()}"


class LayerScale2d(MesaLayer, nn.Module):
    """An NCHW layer scale keeping its 8-bit input, one group per channel block: timm's
    ``LayerScale2d`` (``gamma`` of shape ``(dim,)``, viewed ``(1, dim, 1, 1)``) and SwiftFormer's
    / FastViT's (``gamma`` of shape ``(dim, 1, 1)``); the same ``gamma`` parameter. An
    ``inplace=True`` stock module computes out of place here: same values."""

    def __init__(self, dim: int, init_values: float = 1e-5, inplace: bool = False, *, gamma_shape=None,
                 device=None, dtype=None, **quant_options):
        super().__init__()
        self.inplace = inplace
        shape = tuple(gamma_shape) if gamma_shape is not None else (dim,)
        self.gamma = nn.Parameter(torch.full(shape, float(init_values), device=device, dtype=dtype))
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "LayerScale2d":
        gamma = stock.gamma
        if gamma.dim() not in (1, 3) or (gamma.dim() == 3 and gamma.shape[1:] != (1, 1)):
            raise TypeError(f"LayerScale2d.from_module: gamma of shape (dim,) or (dim, 1, 1) expected, got "
                            f"{tuple(gamma.shape)} ({type(stock).__name__})")
        new = cls(gamma.shape[0], inplace=getattr(stock, "inplace", False), gamma_shape=gamma.shape, device="meta",
                  **inherit_options(stock, quant_options))
        new.gamma = gamma  # the same parameter object (optimizers keep working)
        copy_estimates(stock, new, gamma.device)
        return new.train(stock.training)

    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1) if self.gamma.dim() == 1 else self.gamma
        if not self._mesa_active(x, gamma):
            return x.mul_(gamma) if self.inplace else x * gamma
        return _scale(x, gamma, self.quantizer)

    def extra_repr(self) -> str:
        return f"dim={self.gamma.shape[0]}, inplace={self.inplace}, {self._mesa_repr()}"


class _AffineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, beta, quantizer):
        out = torch.addcmul(beta, alpha, x)  # exactly timm's Affine.forward
        packed = k = None
        if ctx.needs_input_grad[1]:  # dalpha = sum(g * x): x kept in 8 bits, channel groups
            packed, k = compress_rows(quantizer, x, 1, max_exponent(x.dtype, out.dtype))
        ctx.cdt, ctx.x_dtype = out.dtype, x.dtype
        ctx.shapes = (alpha.shape, alpha.dtype, beta.shape, beta.dtype)
        save(ctx, [packed], alpha if ctx.needs_input_grad[0] else None, k)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (alpha, k) = load(ctx)
        a_shape, a_dtype, b_shape, b_dtype = ctx.shapes
        need = ctx.needs_input_grad
        gx = ga = gb = None
        with no_autocast(g.device.type):
            g = g.to(ctx.cdt)
            if need[0]:  # addcmul's tensor2 gradient: grad * (tensor1 * value), value 1
                gx = (g * alpha.to(ctx.cdt)).to(ctx.x_dtype)
            if need[1]:
                ga = (g * decompress_rows(packed, ctx.cdt, k)).sum_to_size(a_shape).to(a_dtype)
            if need[2]:
                gb = g.sum_to_size(b_shape).to(b_dtype)
        return gx, ga, gb, None


class Affine(MesaLayer, nn.Module):
    """ResMLP's ``Affine`` (``torch.addcmul(beta, alpha, x)``, ``alpha`` and ``beta`` of shape
    ``(1, 1, dim)``) keeping its 8-bit input; the same parameters. ``dx`` and ``dbeta`` are
    stock's (they need no activation)."""

    def __init__(self, dim: int, *, device=None, dtype=None, **quant_options):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones((1, 1, dim), device=device, dtype=dtype))
        self.beta = nn.Parameter(torch.zeros((1, 1, dim), device=device, dtype=dtype))
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "Affine":
        new = cls(stock.alpha.shape[-1], device="meta", **inherit_options(stock, quant_options))
        new.alpha, new.beta = stock.alpha, stock.beta  # the same parameter objects
        copy_estimates(stock, new, stock.alpha.device)
        return new.train(stock.training)

    def forward(self, x):
        if not self._mesa_active(x, self.alpha, self.beta):
            return torch.addcmul(self.beta, self.alpha, x)
        # the C++ layer op (mesa::affine_train, csrc/scale_autograd.cpp: the same bits) in eager
        # training with a channel format, for x with one channel per alpha (as ResMLP calls it)
        fused = self.quantizer.fused_state_args(x)
        if fused is not None and x.dim() > 0 and x.shape[-1] == self.alpha.shape[-1]:
            return torch.ops.mesa.affine_train(x, self.alpha, self.beta, *fused, self.quantizer.options.row_scale)
        return _AffineFn.apply(x, self.alpha, self.beta, self.quantizer)

    def extra_repr(self) -> str:
        return f"dim={self.alpha.shape[-1]}, {self._mesa_repr()}"
