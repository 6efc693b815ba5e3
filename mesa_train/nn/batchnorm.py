"""Mesa ``BatchNorm2d`` and ``BatchNorm1d``: exact forward (batch statistics, running-stat update included);
saves the 8-bit *normalised* input, per channel, plus the per-channel ``invstd``.

Same idea as the Mesa ``LayerNorm`` (see ``layernorm.py``), along the channel dim: in
training mode BatchNorm normalises every channel with its batch statistics, so
``x_hat = (x - mean) * invstd`` has unit variance in *every* channel; quantized with one
group per channel (``num_groups`` = channel count unless given), every channel uses its 8-bit
grid fully, however different the channels' input scales are (a depthwise conv in front
of it, as in FastViT / EfficientViT-M, produces channels orders of magnitude apart).
Backward, with means over ``(N, H, W)`` per channel::

    dx      = invstd * weight * (g - mean(g) - x_hat * mean(g * x_hat))
    dweight = sum(g * x_hat)          dbias = sum(g)

computed by ATen's ``native_batch_norm_backward`` fed ``x_hat`` with mean 0 and invstd 1,
then one per-channel multiply by the real ``invstd``. Stock BatchNorm keeps its whole
input (fp32: 4 bytes per element); this keeps 1 byte per element plus ``2 * C + C`` floats.

Eval mode with running statistics, ``enabled=False`` or no gradient needed: the stock
forward.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch import nn

from ._common import (DropActChildren, MesaLayer, adopt_parameters, check_stock, inherit_options, load,
                      no_autocast, save)
from .quantizer import decompress

__all__ = ["BatchNorm2d", "BatchNorm1d", "BatchNormAct2d"]


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (like.dim() - 2))


class _BatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, quantizer, link=None):
        # exactly what F.batch_norm runs (torch.batch_norm -> _batch_norm_impl_index), which
        # also hands back the batch mean and invstd it normalised with
        out, mean, invstd, _, _ = torch.ops.aten._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled)
        with no_autocast(x.device.type):
            mdt = torch.promote_types(x.dtype, torch.float32)
            x_hat = (x.to(mdt) - _per_channel(mean.to(mdt), x)) * _per_channel(invstd.to(mdt), x)
        packed = quantizer.compress(x_hat, 1)
        del x_hat
        ctx.mdt, ctx.eps, ctx.link = mdt, eps, link
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype if weight is not None else None
        ctx.b_dtype = bias.dtype if bias is not None else None
        save(ctx, [packed], invstd, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (packed,), (invstd, weight) = load(ctx)
        mdt = ctx.mdt
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        link, ctx.link = ctx.link, None
        link = link if need_x else None
        gx = gw = gb = None
        with no_autocast(g.device.type):
            xh = decompress(packed, mdt)
            # The exact x_hat has zero mean and unit mean square per channel, which makes dx
            # orthogonal to both the constant and x_hat itself over each channel: whatever is
            # added per channel before the BatchNorm gets an exactly-zero gradient, and so does
            # a pure rescaling of its input (a conv or BatchNorm weight in front: a cancellation
            # that 8-bit noise would otherwise swamp; EfficientViT-M's conv1.bn.weight went to
            # cosine 0.08). The dequantized x_hat is off by rounding noise, so it is
            # standardised again with its own per-channel moments (to the exact x_hat's mean
            # square), handed to the kernel as the mean/invstd it normalises with (no extra
            # pass over the tensor for the scaling).
            # (The exact mean square is var / (var + eps) = 1 - eps * invstd^2, not 1, for a
            # channel whose variance is not far above eps.)
            # (the BatchNorm statistics kernel: 5-28x faster than var_mean over (N, H, W) on
            # CPU, the same values; EfficientNet-B0's step spent 12% of its time in var_mean)
            xh_mean, var = torch.batch_norm_update_stats(xh, None, None, 0.0)
            target = (1 - ctx.eps * invstd.to(mdt).square()).clamp_min(0)
            s = torch.where(var > 0, (target / var).sqrt(), torch.ones_like(var))
            w = weight.to(mdt) if weight is not None else None
            gm = g.to(mdt)
            dx, dw, db = torch.ops.aten.native_batch_norm_backward(
                gm, xh, w, None, None, xh_mean, s, True, ctx.eps,
                [need_x, (need_w or link is not None) and w is not None, need_b])
            if need_x:
                gx = (dx * _per_channel(invstd.to(mdt) / s, dx)).to(ctx.x_dtype)
            if link is not None:  # the 1x1 depthwise conv in front takes its weight gradient from here
                if w is None:  # dgamma = sum(g * x_hat'), x_hat' the re-standardised x_hat
                    dims = [d for d in range(xh.dim()) if d != 1]
                    dgamma = (gm * ((xh - _per_channel(xh_mean, xh)) * _per_channel(s, xh))).sum(dims)
                else:
                    dgamma = dw
                link.coef = (w if w is not None else 1) * dgamma * (1 - target)
                link.gx = gx
            if need_w and w is not None and dw is not None:
                gw = dw.to(ctx.w_dtype)
            if need_b and db is not None:
                gb = db.to(ctx.b_dtype)
        return gx, gw, gb, None, None, None, None, None, None


def _train_forward(bn: nn.modules.batchnorm._BatchNorm, input: torch.Tensor, link, stock_forward):
    """The Mesa BatchNorms' forward: ``_BatchNormFn`` in training with batch statistics, with
    ``nn.BatchNorm*d``'s momentum bookkeeping; ``stock_forward`` otherwise."""
    bn_training = bn.training or (bn.running_mean is None and bn.running_var is None)
    if not (bn_training and bn._mesa_active(input, bn.weight, bn.bias)):
        return stock_forward(input)
    bn._check_input_dim(input)
    # nn.BatchNorm2d's momentum bookkeeping, unchanged
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    track = bn.running_mean is not None and (not bn.training or bn.track_running_stats)
    return _BatchNormFn.apply(input, bn.weight, bn.bias, bn.running_mean if track else None,
                              bn.running_var if track else None, factor, bn.eps, bn.quantizer, link)


class _MesaBatchNorm(MesaLayer):
    """Construction and ``from_module`` of the Mesa BatchNorms (``_stock``: the torch class):
    one quantization group per channel by default; the stock module's parameters and
    running-statistic buffers (the same tensors)."""

    _stock: type = nn.BatchNorm2d

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None, **quant_options):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=device, dtype=dtype)
        quant_options.setdefault("num_groups", num_features)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        check_stock(stock, cls._stock)
        ref = stock.weight if stock.weight is not None else stock.running_mean
        new = cls(stock.num_features, eps=stock.eps, momentum=stock.momentum, affine=stock.affine,
                  track_running_stats=stock.track_running_stats, device="meta",
                  dtype=ref.dtype if ref is not None else None, **inherit_options(stock, quant_options))
        # running statistics are the stock module's buffers (same tensors, like the parameters)
        new.running_mean, new.running_var = stock.running_mean, stock.running_var
        new.num_batches_tracked = stock.num_batches_tracked
        return adopt_parameters(stock, new, device)

    def extra_repr(self) -> str:
        return f"{self._stock.extra_repr(self)}, {self._mesa_repr()}"


class BatchNorm2d(_MesaBatchNorm, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` that keeps, in training mode, its per-channel normalised
    input in 8 bits (one group per channel by default) plus the per-channel invstd."""

    _stock = nn.BatchNorm2d

    def forward(self, input):
        if torch.compiler.is_compiling():
            # nothing is pending under compile: a scale branch runs stock there, this BatchNorm
            # too (nn/conv.py); and Dynamo in torch 2.11 cannot trace a pop from a __dict__
            if getattr(self, "_mesa_scale_conv", None) is not None:
                return super().forward(input)
            link = None
        else:
            # taken on every call (never left on the module): a 1x1 depthwise conv in front (conv.ScaleLink)
            link = self.__dict__.pop("_mesa_scale_pending", None)
        if link is not None and link.out() is not input:
            link = None
        return _train_forward(self, input, link, super().forward)


class BatchNorm1d(_MesaBatchNorm, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` on ``(N, C)`` or ``(N, C, L)`` (LeViT's ``Linear -> BatchNorm1d``
    on all tokens, NextViT's pooled keys), kept as :class:`BatchNorm2d` keeps its input: the
    8-bit normalised input, one group per channel, and the per-channel invstd."""

    _stock = nn.BatchNorm1d

    def forward(self, input):
        return _train_forward(self, input, None, super().forward)


class BatchNormAct2d(DropActChildren, BatchNorm2d):
    """timm's ``BatchNormAct2d`` (the BatchNorm of its ``ConvNormAct``: EfficientNet, MobileNet,
    RegNet, ByobNet, the hybrids' stems): the Mesa :class:`BatchNorm2d` (8-bit ``x_hat``, not
    the 4-byte input stock keeps), then its own ``drop`` and ``act`` children, which are
    converted on their own (a Mesa ReLU keeps one bit). Same parameters, buffers and
    ``state_dict`` keys as timm's."""

    _timm_name = "BatchNormAct2d"

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 drop: nn.Module = None, act: nn.Module = None, device=None, dtype=None, **quant_options):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=device, dtype=dtype, **quant_options)
        self._set_drop_act(drop, act)
