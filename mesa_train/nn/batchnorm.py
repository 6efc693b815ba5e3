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
the real ``invstd`` folded into the weight it is handed. Stock BatchNorm keeps its whole
input (fp32: 4 bytes per element); this keeps 1 byte per element plus ``2 * C + C`` floats
(on the CPU ``2 * C`` more: x_hat's moments from the codes, ``code_moments``).

Eval mode with running statistics, ``enabled=False`` or no gradient needed: the stock
forward.
"""
from __future__ import annotations

import torch
from torch import nn

from mesa_train.quant import reference
from mesa_train.quant.compile_kernels import traced_as_pytorch

from .first_order import first_order
from ._common import (DropActChildren, MesaLayer, adopt_parameters, check_stock, from_nhwc, inherit_options, load,
                      nhwc_view, no_autocast, save)
from .conv import conv_backward, conv_forward, scale_branch_compiled
from . import input_copy
from .quantizer import decompress

__all__ = ["BatchNorm2d", "BatchNorm1d", "BatchNormAct2d", "OFFERS_INPUT"]

# set (in its __dict__, by patch/identity_norm.py) on the identity-branch BatchNorm of a RepVGG /
# MobileOne block, whose input the block's convs take next: it leaves its codes on that input
OFFERS_INPUT = "_mesa_offers_input"
# set (likewise) on an identity-branch BatchNorm in a block without convs (FastViT's RepMixer
# norm, run on the input its mixer's identity BatchNorm offered codes of): it keeps those codes
# as its x_hat's where they fit, instead of compressing x_hat again
TAKES_INPUT = "_mesa_takes_input"


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (like.dim() - 2))


# The least re-standardising factor. Backward divides by it (dx's invstd / s), so an s of 0
# gave inf * 0 = NaN: a channel whose variance is far below eps (a std of 1e-6 under eps 1e-3,
# torchvision's MobileNetV3 and EfficientNet, timm's tf_* ports) has an exact mean square
# var / (var + eps) under float32's resolution, computed as 0, while rounding noise leaves its
# dequantized x_hat a variance above 0. Such a channel's exact x_hat is ~0, and the x_hat term
# of dx is of the order of that mean square against dx's g - mean(g): any s between 0 and the
# exact one gives dx to float32's resolution, and this floor keeps dx finite.
RESTANDARDISE_FLOOR = 1e-6


def restandardise(var: torch.Tensor, invstd: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, s)``: the exact x_hat's mean square ``1 - eps * invstd^2`` and the factor that
    brings the dequantized x_hat, of variance ``var``, to it (1 where ``var`` is 0; at least
    ``RESTANDARDISE_FLOOR``); per channel (BatchNorm) or per (sample, group) (GroupNorm).
    ``bn_backward`` says why. C++ twin: ``restandardise`` in csrc/convnet_autograd.cpp."""
    target = (1 - eps * invstd.square()).clamp_min(0)
    s = (target / var).sqrt().clamp_min(RESTANDARDISE_FLOOR)
    return target, torch.where(var > 0, s, torch.ones_like(var))


def code_moments(packed, mdt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The per-channel ``(mean, var)`` of the values ``packed`` dequantizes to, for the backward's
    re-standardisation (``bn_backward``), taken in forward: on the CPU, for the paper's format
    with statistics shared by the batch and a float32 compute dtype, from the codes
    (``mesa::code_moments``: exact integer sums over a quarter of the bytes; ATen's NCHW
    statistics loop on the float32 x_hat in backward was the largest cost Mesa added to a
    ResNet-50 step on the CPU, 13.4 of about 50 ms), or under ``torch.compile``'s traced kernels
    its pure-PyTorch reference (the same bits: compiled and eager gradients stay equal). In
    forward because they depend on forward values only: the compiled graph computes them there
    and keeps them (8 bytes a channel), and so does eager. ``()`` elsewhere (CUDA: backward's
    statistics kernel on x_hat, one fast kernel). C++ twin: ``BatchNormTrain`` in
    csrc/convnet_autograd.cpp."""
    if packed.fmt is None and packed.alpha.shape[0] == 1 and mdt == torch.float32 and packed.q.device.type == "cpu":
        moments = reference.code_moments if traced_as_pytorch(packed.q) else torch.ops.mesa.code_moments
        return tuple(moments(packed.q, packed.alpha, packed.beta, packed.dim, packed.num_groups))
    return ()


def remember_dtypes(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """The dtypes a norm's gradients go back in (``None`` for an absent parameter)."""
    ctx.x_dtype = x.dtype
    ctx.w_dtype = weight.dtype if weight is not None else None
    ctx.b_dtype = bias.dtype if bias is not None else None


def bn_forward(x, weight, bias, running_mean, running_var, momentum, eps, quantizer, offer: bool = False,
               codes_of_x=None):
    """The training forward of the Mesa BatchNorms: ``(out, packed x_hat, nhwc, invstd, compute
    dtype, moments)`` (``code_moments``: empty, or x_hat's per-channel statistics for
    backward); ``nhwc``: a channels-last ``x_hat`` was compressed as its NHWC view (``nhwc_view``:
    no copy to NCHW, and backward gets ``x_hat`` channels-last again, as ``g`` and stock's
    ``native_batch_norm_backward`` see it; mixed layouts took ATen's slow path, 4x stock's
    BatchNorm step on CPU). ``offer``: an identity branch's (``OFFERS_INPUT``), which leaves
    x_hat's codes on ``x`` as codes of ``x`` for the block's convs (``_codes_of_input``).
    ``codes_of_x``: codes of ``x`` another layer left (``TAKES_INPUT``), kept as x_hat's where
    they fit (``_codes_of_x_hat``)."""
    # exactly what F.batch_norm runs (torch.batch_norm -> _batch_norm_impl_index), which
    # also hands back the batch mean and invstd it normalised with
    out, mean, invstd, _, _ = torch.ops.aten._batch_norm_impl_index(
        x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled)
    with no_autocast(x.device.type):
        mdt = torch.promote_types(x.dtype, torch.float32)
        x_hat = (x.to(mdt) - _per_channel(mean.to(mdt), x)) * _per_channel(invstd.to(mdt), x)
    xv, dim, nhwc = nhwc_view(x_hat, 1, quantizer.options.channel_layout)
    packed = _codes_of_x_hat(codes_of_x, xv, dim, mean, invstd) if codes_of_x is not None else None
    if packed is None:
        packed = quantizer.compress(xv, dim)
    if offer:
        codes = _codes_of_input(x, packed, nhwc, mean, invstd, quantizer)
        if codes is not None:
            input_copy.offer(x, input_copy.conv_function_signature(2, quantizer.options), codes)
    return out, packed, nhwc, invstd, mdt, code_moments(packed, mdt)


def _codes_of_input(x, packed, nhwc: bool, mean, invstd, quantizer):
    """x_hat's codes read as codes of ``x`` (``mesa::batch_norm_train_offer``'s arithmetic):
    with one group per channel, the default format's ``x_hat = q * alpha / 255 + beta`` is
    ``x = q * (alpha / invstd) / 255 + (beta / invstd + mean)``. ``None`` where that does not
    hold (a variant format, groups spanning channels) or where a conv would view ``x`` in
    another layout than the codes'."""
    if packed.fmt is not None or packed.num_groups != x.shape[1] or \
            nhwc_view(x, 1, quantizer.options.channel_layout)[2] != nhwc:
        return None
    alpha = packed.alpha / invstd.to(packed.alpha.dtype)
    beta = packed.beta / invstd.to(packed.beta.dtype) + mean.to(packed.beta.dtype)
    return packed._replace(alpha=alpha, beta=beta)


def _codes_of_x_hat(codes, xv: torch.Tensor, dim: int, mean, invstd):
    """``x``'s codes read as x_hat's (``mesa::batch_norm_train_take``'s arithmetic, the reverse of
    ``_codes_of_input``): ``alpha * invstd`` and ``(beta - mean) * invstd`` per group, a group a
    channel. ``None`` where they do not fit: a variant format, groups spanning channels, codes of
    another view than ``xv``, x_hat's (NCHW or NHWC)."""
    C = xv.shape[dim]
    if codes.fmt is not None or codes.num_groups != C or codes.dim != dim or codes.q.shape != xv.shape:
        return None
    alpha = codes.alpha * invstd.to(codes.alpha.dtype)
    beta = (codes.beta - mean.to(codes.beta.dtype)) * invstd.to(codes.beta.dtype)
    return codes._replace(alpha=alpha, beta=beta)


def bn_backward(g, packed, nhwc, invstd, weight, mdt, eps, needs, scale_coef: bool, moments=()):
    """``(dx, dweight, dbias, coef)`` in the compute dtype ``mdt`` (``needs``: which of the first
    three are wanted; ``moments``: ``bn_forward``'s, else the statistics of the dequantized
    x_hat). ``scale_coef``: also ``coef = gamma * dgamma * (1 - mean(x_hat^2))`` per channel,
    the weight gradient's numerator of a 1x1 depthwise conv in front (``ScaleLink``)."""
    need_x, need_w, need_b = needs
    coef = None
    with no_autocast(g.device.type):
        xh = from_nhwc(decompress(packed, mdt), nhwc)
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
        # (the BatchNorm statistics kernel: 5-28x faster than var_mean over (N, H, W) on CPU,
        # the same values; EfficientNet-B0's step spent 12% of its time in var_mean)
        xh_mean, var = moments if moments else torch.batch_norm_update_stats(xh, None, None, 0.0)
        target, s = restandardise(var, invstd.to(mdt), eps)
        w = weight.to(mdt) if weight is not None else None
        gm = g.to(mdt)
        # The kernel's dx is its weight * s * (...) per channel; the real one wants invstd in
        # place of s, so invstd / s rides in the weight it is handed (the weight and bias
        # gradients do not read it): no extra pass over dx.
        w_dx = invstd.to(mdt) / s if w is None else w * (invstd.to(mdt) / s)
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            gm, xh, w_dx, None, None, xh_mean, s, True, eps,
            [need_x, (need_w or scale_coef) and w is not None, need_b])
        if scale_coef:  # the 1x1 depthwise conv in front takes its weight gradient from here
            if w is None:  # dgamma = sum(g * x_hat'), x_hat' the re-standardised x_hat
                dims = [d for d in range(xh.dim()) if d != 1]
                dgamma = (gm * ((xh - _per_channel(xh_mean, xh)) * _per_channel(s, xh))).sum(dims)
            else:
                dgamma = dw
            coef = (w if w is not None else 1) * dgamma * (1 - target)
    return (dx if need_x else None), (dw if need_w and w is not None else None), (db if need_b else None), coef


class _BatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, quantizer, link=None, offer=False,
                codes_of_x=None):
        out, packed, ctx.nhwc, invstd, mdt, moments = bn_forward(x, weight, bias, running_mean, running_var,
                                                                 momentum, eps, quantizer, offer, codes_of_x)
        ctx.mdt, ctx.eps, ctx.link = mdt, eps, link
        remember_dtypes(ctx, x, weight, bias)
        save(ctx, [packed], invstd, weight, *moments)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (invstd, weight, *moments) = load(ctx)
        needs = tuple(ctx.needs_input_grad[:3])
        link = ctx.link if needs[0] else None  # (kept: a second backward with retain_graph hands over again)
        gx, gw, gb, coef = bn_backward(g, packed, ctx.nhwc, invstd, weight, ctx.mdt, ctx.eps, needs, link is not None,
                                       moments)
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        if link is not None:
            link.coef, link.gx = coef, gx
        gw = gw.to(ctx.w_dtype) if gw is not None else None
        gb = gb.to(ctx.b_dtype) if gb is not None else None
        return gx, gw, gb, None, None, None, None, None, None, None, None


class _ScaleBranchFn(torch.autograd.Function):
    """``bn(conv(x))`` for a 1x1 depthwise Mesa conv feeding a train-mode Mesa BatchNorm, under
    ``torch.compile``: eager's two Functions and their ``ScaleLink`` hand-over in one (the conv's
    8-bit input, the BatchNorm's 8-bit ``x_hat``; the conv weight's gradient ``coef / w`` from
    the BatchNorm's backward, its 8-bit input where ``w == 0``). Same forward ops and the same
    backward arithmetic as eager's pair."""

    @staticmethod
    def forward(ctx, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, momentum, eps, conv,
                bn_quantizer):
        y, packed_x, ctx.conv_meta = conv_forward(x, conv_weight, conv_bias, conv, conv.quantizer,
                                                  ctx.needs_input_grad[1])
        out, packed_xh, ctx.nhwc, invstd, mdt, moments = bn_forward(y, bn_weight, bn_bias, running_mean,
                                                                    running_var, momentum, eps, bn_quantizer)
        ctx.conv, ctx.mdt, ctx.eps = conv, mdt, eps
        ctx.dtypes = (x.dtype, conv_weight.dtype, conv_bias.dtype if conv_bias is not None else None, y.dtype,
                      bn_weight.dtype if bn_weight is not None else None,
                      bn_bias.dtype if bn_bias is not None else None)
        save(ctx, [packed_x, packed_xh], invstd, bn_weight, conv_weight, *moments)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed_x, packed_xh), (invstd, bn_weight, conv_weight, *moments) = load(ctx)
        need = ctx.needs_input_grad
        need_conv = tuple(need[:3])
        x_dtype, cw_dtype, cb_dtype, y_dtype, bw_dtype, bb_dtype = ctx.dtypes
        gy, gbw, gbb, coef = bn_backward(g, packed_xh, ctx.nhwc, invstd, bn_weight, ctx.mdt, ctx.eps,
                                         (any(need_conv), need[3], need[4]), need[1], moments)
        gx = gw = gb = None
        if gy is not None:  # (as eager's pair: the BatchNorm hands the conv its input's gradient)
            gx, gw, gb = conv_backward(gy.to(y_dtype), packed_x, conv_weight, ctx.conv, ctx.conv_meta, need_conv,
                                       y_dtype, coef if need[1] else None)
        casts = ((gx, x_dtype, need[0]), (gw, cw_dtype, need[1]), (gb, cb_dtype, need[2]), (gbw, bw_dtype, need[3]),
                 (gbb, bb_dtype, need[4]))
        grads = tuple(t.to(dtype) if t is not None and wanted else None for t, dtype, wanted in casts)
        return grads + (None,) * 6


def _scale_branch_forward(conv, bn, x: torch.Tensor) -> torch.Tensor:
    """The linked pair under compile (``_ScaleBranchFn``), with ``bn``'s momentum bookkeeping."""
    bn._check_input_dim(x)
    running_mean, running_var, factor = running_stats_step(bn)
    return _ScaleBranchFn.apply(x, conv.weight, conv.bias, bn.weight, bn.bias, running_mean, running_var, factor,
                                bn.eps, conv, bn.quantizer)


def _train_forward(bn: nn.modules.batchnorm._BatchNorm, input: torch.Tensor, link, stock_forward):
    """The Mesa BatchNorms' forward: ``_BatchNormFn`` in training with batch statistics, with
    ``nn.BatchNorm*d``'s momentum bookkeeping; ``stock_forward`` otherwise."""
    if not (batch_statistics(bn) and bn._mesa_active(input, bn.weight, bn.bias)):
        return stock_forward(input)
    bn._check_input_dim(input)
    running_mean, running_var, factor = running_stats_step(bn)
    # eager, channel format, affine, no Python link from a conv in front (a link between C++
    # nodes the op finds itself, csrc/scale_link.h): the layer with a C++ autograd node
    fused = bn.quantizer.fused_layer_args(input) \
        if link is None and bn.weight is not None and bn.bias is not None else None
    # an identity branch's (RepVGG, MobileOne) leaves its codes on the input for the block's convs;
    # one in a block without convs (FastViT's RepMixer norm) takes codes another left there
    offer = bool(bn.__dict__.get(OFFERS_INPUT)) and input.dim() == 4 and input_copy.may_share(input)
    # (a variant format's codes are never x_hat's)
    take = (not offer and bool(bn.__dict__.get(TAKES_INPUT)) and bn.quantizer.options.is_default_format
            and input.dim() == 4 and input_copy.may_share(input))
    if fused is not None:
        if offer:
            return _offer_input(bn, input, running_mean, running_var, factor, fused)
        codes = input_copy.take(input, input_copy.conv_op_signature(2, bn.quantizer.options), bn.quantizer) \
            if take else None
        if codes is not None:
            return torch.ops.mesa.batch_norm_train_take(input, bn.weight, bn.bias, running_mean, running_var, factor,
                                                        bn.eps, *codes, *fused)
        return torch.ops.mesa.batch_norm_train(input, bn.weight, bn.bias, running_mean, running_var, factor, bn.eps,
                                               *fused)
    codes = input_copy.take(input, input_copy.conv_function_signature(2, bn.quantizer.options), bn.quantizer) \
        if take else None
    return _BatchNormFn.apply(input, bn.weight, bn.bias, running_mean, running_var, factor, bn.eps, bn.quantizer,
                              link, offer, codes)


def _offer_input(bn, input: torch.Tensor, running_mean, running_var, factor: float, fused) -> torch.Tensor:
    """An identity-branch BatchNorm's C++ op (``OFFERS_INPUT``): its 8-bit x_hat, read as codes
    of ``input`` itself (one group per channel: each group's range and offset in the input's
    units, csrc/convnet_autograd.cpp), left on ``input`` for the block's convs, which take it
    next (``input_copy``) instead of keeping a second copy of the block input."""
    y, q, alpha, beta = torch.ops.mesa.batch_norm_train_offer(input, bn.weight, bn.bias, running_mean, running_var,
                                                              factor, bn.eps, *fused)
    if q.numel():  # (empty where its codes are not x's: a variant format, groups across channels, another layout)
        input_copy.offer(input, input_copy.conv_op_signature(2, bn.quantizer.options), (q, alpha, beta))
    return y


def batch_statistics(bn: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether ``bn`` normalises with the batch's statistics (as ``nn.BatchNorm2d.forward`` decides)."""
    return bn.training or (bn.running_mean is None and bn.running_var is None)


def running_stats_step(bn: nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm*d``'s momentum bookkeeping, unchanged (``num_batches_tracked`` counted
    here): ``(running_mean, running_var, momentum factor)`` to hand the batch-norm op."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    track = bn.running_mean is not None and (not bn.training or bn.track_running_stats)
    return (bn.running_mean if track else None), (bn.running_var if track else None), factor


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

    def _runs_layer_op(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x``, an input that needs a gradient, runs ``mesa::batch_norm_train``
        (``_train_forward``'s test): what a linked scale-branch conv in front asks before it
        takes its C++ op (conv.Conv2d.forward), whose node only a C++ BatchNorm node hands over to."""
        return (batch_statistics(self) and self.training and self._mesa_options.enabled and self.weight is not None
                and self.bias is not None and self.quantizer.fused_layer_args(x) is not None)

    def extra_repr(self) -> str:
        return f"{self._stock.extra_repr(self)}, {self._mesa_repr()}"


class BatchNorm2d(_MesaBatchNorm, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` that keeps, in training mode, its per-channel normalised
    input in 8 bits (one group per channel by default) plus the per-channel invstd."""

    _stock = nn.BatchNorm2d

    def forward(self, input):
        if torch.compiler.is_compiling():
            # nothing is pending under compile (Dynamo in torch 2.11 cannot trace a pop from a
            # __dict__): a linked scale branch runs here as one Function, its conv having
            # handed over its own input (conv.scale_branch_compiled)
            conv = getattr(self, "_mesa_scale_conv", None)
            if conv is not None and scale_branch_compiled(conv, self):
                return _scale_branch_forward(conv, self, input)
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
