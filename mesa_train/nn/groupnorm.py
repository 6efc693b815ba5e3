"""Mesa ``GroupNorm`` (``torch.nn.GroupNorm`` and timm's ``GroupNorm1``: PoolFormer's,
LowFormer's and CPUBone's norms): exact forward; saves the 8-bit *normalised* input per
channel plus the per-(sample, group) ``rstd``, as the Mesa ``BatchNorm2d`` does per channel.

``x_hat = (x - mean) * rstd`` has zero mean and unit mean square over each (sample, group);
backward, with means over each (sample, group)::

    dx      = rstd * (w g - mean(w g) - x_hat * mean(w g * x_hat))
    dweight = sum(g * x_hat)          dbias = sum(g)

computed by ATen's ``native_group_norm_backward`` fed the dequantized ``x_hat``, standardised
again with its own moments (so that ``dx`` stays orthogonal to the constant and to ``x_hat``
in each group, as exactly as for the stock norm: a rescaling in front gets no gradient from
rounding noise), then one multiply per (sample, group) by the real ``rstd``. Stock GroupNorm
keeps its whole input (fp32: 4 bytes per element); this keeps 1 byte per element plus
``2 * N * G`` floats.

Eval mode, ``enabled=False`` or no gradient needed: the stock forward.
"""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format
from torch import nn

from .first_order import first_order
from ._common import (DropActChildren, MesaLayer, adopt_parameters, check_stock, from_nhwc, inherit_options, load,
                      nhwc_view, no_autocast, save)
from .batchnorm import remember_dtypes, restandardise
from .quantizer import decompress

__all__ = ["GroupNorm", "GroupNormAct"]


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``(N, C, *)`` as ``(N, G, C // G * prod(*))``: the elements of each (sample, group)."""
    return t.reshape(t.shape[0], groups, -1)


def _per_channel(t: torch.Tensor, groups: int, like: torch.Tensor) -> torch.Tensor:
    """A per-(sample, group) ``(N, G)`` tensor as ``(N, C, 1, ...)``, each group's value for each
    of its channels: it broadcasts over ``like`` in ``like``'s own layout (a grouped reshape of
    a channels-last tensor is an NCHW copy)."""
    n, c = like.shape[0], like.shape[1]
    return t.repeat_interleave(c // groups, dim=1).view((n, c) + (1,) * (like.dim() - 2))


def _group_norm_format(x: torch.Tensor) -> torch.memory_format:
    """The layout ``torch.group_norm`` makes its input contiguous in before ``native_group_norm``
    (ATen's group_norm.cpp): the input's suggested format on CPU, plain contiguous elsewhere (the
    CUDA kernel takes no other). Stock's backward gets that input, so backward uses it too."""
    return suggest_memory_format(x) if x.device.type == "cpu" else torch.contiguous_format


class _GroupNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups, weight, bias, eps, quantizer):
        n, c = x.shape[0], x.shape[1]
        hxw = x[0, 0].numel()
        # what F.group_norm runs (torch.group_norm -> native_group_norm, which also hands back
        # the per-(sample, group) mean and rstd it normalised with), x made contiguous first as
        # torch.group_norm does: torch 2.11's CPU kernel refuses a strided x (SHViT's channel
        # slice), and the CUDA kernel a channels-last one
        fmt = _group_norm_format(x)
        x = x.contiguous(memory_format=fmt)
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c, hxw, groups, eps)
        with no_autocast(x.device.type):
            mdt = torch.promote_types(x.dtype, torch.float32)
            x_hat = (x.to(mdt) - _per_channel(mean.to(mdt), groups, x)) * _per_channel(rstd.to(mdt), groups, x)
        # (a channels-last x_hat through its NHWC view: no copy to NCHW, as the BatchNorm's)
        xv, dim, ctx.nhwc = nhwc_view(x_hat, 1, quantizer.options.channel_layout)
        packed = quantizer.compress(xv, dim)
        del x_hat, xv
        ctx.mdt, ctx.eps, ctx.groups, ctx.nc_hxw, ctx.fmt = mdt, eps, groups, (n, c, hxw), fmt
        remember_dtypes(ctx, x, weight, bias)
        save(ctx, [packed], rstd, weight)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (rstd, weight) = load(ctx)
        mdt, groups, (n, c, hxw) = ctx.mdt, ctx.groups, ctx.nc_hxw
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[2] and weight is not None, ctx.needs_input_grad[3]]
        with no_autocast(g.device.type):
            xh = from_nhwc(decompress(packed, mdt), ctx.nhwc).contiguous(memory_format=ctx.fmt)
            # standardise the dequantized x_hat again per (sample, group), to the exact x_hat's
            # mean square var / (var + eps) = 1 - eps * rstd^2 (the BatchNorm's reasoning)
            var, xh_mean = torch.var_mean(_grouped(xh, groups), dim=-1, correction=0)
            _, s = restandardise(var, rstd.to(mdt), ctx.eps)
            w = weight.to(mdt) if weight is not None else None
            dx, dw, db = torch.ops.aten.native_group_norm_backward(
                g.to(mdt).contiguous(memory_format=ctx.fmt), xh, xh_mean, s, w, n, c, hxw, groups, need)
            gx = gw = gb = None
            if need[0]:
                gx = (dx * _per_channel(rstd.to(mdt) / s, groups, dx)).to(ctx.x_dtype)
            if need[1]:
                gw = dw.to(ctx.w_dtype)
            if need[2] and db is not None:
                gb = db.to(ctx.b_dtype)
        return gx, None, gw, gb, None, None


class GroupNorm(MesaLayer, nn.GroupNorm):
    """``torch.nn.GroupNorm`` (and timm's ``GroupNorm1``, one group) that keeps, in training
    mode, its normalised input in 8 bits (one quantization group per channel by default)
    plus the per-(sample, group) ``rstd``. Same parameters and ``state_dict`` keys."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, *,
                 quant_options: dict = None, **more_quant_options):
        # ``num_groups`` is the norm's own group count here (nn.GroupNorm's argument); the
        # quantization's group count goes in ``quant_options`` (default: one per channel)
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        options = {"num_groups": num_channels, **(quant_options or {}), **more_quant_options}
        self._init_mesa(options, device)

    @classmethod
    def from_module(cls, stock: nn.GroupNorm, *, device=None, **quant_options) -> "GroupNorm":
        check_stock(stock, nn.GroupNorm)
        ref = stock.weight
        new = cls(stock.num_groups, stock.num_channels, eps=stock.eps, affine=stock.affine, device="meta",
                  dtype=ref.dtype if ref is not None else None, quant_options=inherit_options(stock, quant_options))
        return adopt_parameters(stock, new, device)

    def forward(self, input):
        if input.dim() < 2 or not self._mesa_active(input, self.weight, self.bias):
            return super().forward(input)
        # eager, channel format, a weight (a bias or none: timm's GroupNorm1NoBias, PoolFormerV2's):
        # the layer with a C++ autograd node (csrc/convnet_autograd.cpp)
        fused = self.quantizer.fused_layer_args(input) if self.weight is not None else None
        if fused is not None:
            return torch.ops.mesa.group_norm_train(input, self.weight, self.bias, self.num_groups, self.eps, *fused)
        return _GroupNormFn.apply(input, self.num_groups, self.weight, self.bias, self.eps, self.quantizer)

    def extra_repr(self) -> str:
        return f"{nn.GroupNorm.extra_repr(self)}, {self._mesa_repr()}"


class GroupNormAct(DropActChildren, GroupNorm):
    """timm's ``GroupNormAct`` (BiT ResNet-V2, the ViT hybrids' stems, RegNet with group norm):
    the Mesa :class:`GroupNorm`, then its own ``drop`` and ``act`` children, converted on their
    own (a Mesa ReLU keeps one bit). Same parameters and ``state_dict`` keys as timm's."""

    _timm_name = "GroupNormAct"

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, *,
                 drop: nn.Module = None, act: nn.Module = None, quant_options: dict = None, **more_quant_options):
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype,
                         quant_options=quant_options, **more_quant_options)
        self._set_drop_act(drop, act)
