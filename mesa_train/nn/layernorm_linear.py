"""``fc(norm(x))``: a LayerNorm straight into a Linear, one 8-bit copy (the norm's ``x_hat``)
for both backward passes.

A Mesa ``LayerNorm`` keeps its normalised input ``x_hat`` in 8 bits and the Mesa ``Linear``
after it keeps its own input ``y = x_hat * gamma + beta`` in 8 bits: two copies of the same
token-wide tensor, two min/max passes and two quantize passes in forward. In a pre-norm
transformer block that happens twice (``norm1 -> qkv``, ``norm2 -> fc1``). The Linear's weight
gradient needs ``y``, which backward rebuilds from the norm's copy with one elementwise op
(``gamma`` and ``beta`` are parameters: nothing more is kept). DESIGN.md, "LayerNorm + Linear:
one copy".

Saved: what the LayerNorm saves (``x_hat`` codes with their row exponents, per-row ``rstd``,
its weight) plus ``beta`` and the Linear's weight (parameters). Forward is exactly
``F.linear(F.layer_norm(x, ...), weight, bias)``, the stock pair's two calls (with autocast's
casts where they apply: CUDA runs the norm in float32, the Linear casts its input).

Gradient error: the Linear's weight gradient uses ``(x_hat + e) * gamma + beta`` where the
separate layers used ``y + e'`` (``e``, ``e'``: the 8-bit rounding of ``x_hat`` and of ``y``,
both unbiased). Both are unbiased; per channel ``gamma * e`` has ``|gamma|`` times the step of
``x_hat``'s group where ``e'`` has the step of ``y``'s group, the same ratio when a group holds
one channel and at most the group's spread of ``|gamma|`` otherwise. The norm's own backward
is unchanged (same codes as before).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.memory import INPUT_AGNOSTIC_HOOK

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import active_with_params, autocast_input, load, no_autocast, save
from .layernorm import LayerNorm, layer_norm_forward, layer_norm_grads, ln_backward_from_codes
from .linear import Linear, linear_grads, not_a_view, save_linear_dtypes
from .quantizer import decompress, same_options
from .rowscale import decompress_rows

# the C++ layer op (csrc/layers_autograd.cpp, LayerNormLinearTrain; bitwise this module's
# Function): eager, paper format, an extension built with it
_OP = quantizer_mod._FUSED_LAYERS and hasattr(torch.ops.mesa, "layer_norm_linear_train")

__all__ = ["layernorm_linear", "layernorm_linears", "can_fuse_norm", "norm_pair_fits", "plain_call"]


def rebuild_norm_output(packed, k: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], mdt: torch.dtype, casts: Sequence[torch.dtype]) -> torch.Tensor:
    """The Linear's input rebuilt from the norm's copy: ``x_hat * weight + bias`` (each where
    present; a multiply, then an add, never fused into one) in the math dtype ``mdt``, then
    cast through ``casts`` (the norm's output dtype, autocast's cast, the Linear's compute
    dtype). With float32 math and a weight or bias, one dequantize whose column epilogue
    applies them and rounds once, to the first dtype of ``casts`` that is not float32 (the
    casts before it are exact): on CUDA one pass, 3 bytes an element in bf16 where the
    dequantize, multiply, add and cast moved 27. C++ twin: ``rebuild_norm_output`` in
    ``csrc/layers_autograd.cpp``."""
    j = 0
    if mdt == torch.float32 and (weight is not None or bias is not None):
        while j < len(casts) and casts[j] == torch.float32:
            j += 1
        y = decompress(packed, casts[j] if j < len(casts) else torch.float32, row_exp=k,
                       col_scale=None if weight is None else weight.to(torch.float32),
                       col_shift=None if bias is None else bias.to(torch.float32))
    else:  # the definition itself
        y = decompress_rows(packed, mdt, k)
        if weight is not None:
            y = y * weight.to(mdt)
        if bias is not None:
            y = y + bias.to(mdt)
    for dtype in casts[j:]:  # from the dtype the epilogue rounded to: the rest of the chain
        y = y.to(dtype)
    return y


# the ctx attributes save_linear_dtypes sets and linear_grads reads (one set per Linear)
_LINEAR_META = ("cdt", "w_dtype", "b_dtype", "in_features", "out_features")


class _LayerNormLinearFn(torch.autograd.Function):
    """``F.linear(norm(x), w_i, b_i)`` for one or more Linears on the same norm output (a
    SwiGLU's ``fc1_g`` and ``fc1_x``), all taking their input from the norm's copy. With one
    Linear this is, op for op, the C++ node ``LayerNormLinearTrain``."""

    @staticmethod
    def forward(ctx, x, normalized_shape, ln_weight, ln_bias, eps, quantizer, *weights_biases):
        # exactly the stock norm (its autocast policy included), then exactly the stock Linears
        y, packed, extra = layer_norm_forward(ctx, x, normalized_shape, ln_weight, ln_bias, eps, quantizer)
        yc = autocast_input(y)
        weights, biases = weights_biases[0::2], weights_biases[1::2]
        outs = [F.linear(yc, w, b) for w, b in zip(weights, biases)]
        ctx.y_dtype, ctx.yc_dtype = y.dtype, yc.dtype
        fc_meta = []  # each Linear's dtypes and shape, as save_linear_dtypes leaves them on ctx
        for out, w, b in zip(outs, weights, biases):
            save_linear_dtypes(ctx, out, w, b)
            fc_meta.append(tuple(getattr(ctx, a) for a in _LINEAR_META))
        ctx.fc_meta = tuple(fc_meta)
        save(ctx, [packed], *extra, ln_bias, *weights)
        outs = [not_a_view(out) for out in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    @first_order
    def backward(ctx, *grads):
        n = len(grads)
        (packed,), saved = load(ctx)
        extra, ln_bias, weights = saved[:-1 - n], saved[-1 - n], saved[-n:]
        ln_weight = extra[1]
        need = ctx.needs_input_grad
        rebuilt = {}

        def linear_input(cdt):  # y rebuilt from the norm's codes (extra[2]: its row exponents), once
            if cdt not in rebuilt:
                rebuilt[cdt] = rebuild_norm_output(packed, extra[2], ln_weight, ln_bias, ctx.mdt,
                                                   (ctx.y_dtype, ctx.yc_dtype, cdt))
            return rebuilt[cdt]

        need_y = need[0] or need[2] or need[3]
        # one Linear whose norm's backward reads g in any dtype (layer_norm_backward): its input
        # gradient stays in the Linear's compute dtype, no cast pass (the op's float32 of it is
        # the cast's, exactly). Several Linears add their input gradients in the norm's dtype.
        keep_cdt = n == 1 and ln_backward_from_codes(ctx, packed)
        gy, g_params = None, []
        with no_autocast(grads[0].device.type):
            # each Linear's backward, its input in the stock dtypes (the norm's output dtype, then
            # autocast's cast); its input gradient comes back in the norm's output dtype, as
            # stock casts it, and the Linears' input gradients add up as autograd would add them
            for i, (g, w, meta) in enumerate(zip(grads, weights, ctx.fc_meta)):
                for attr, value in zip(_LINEAR_META, meta):  # what linear_grads reads, this Linear's
                    setattr(ctx, attr, value)
                gyi, gw, gb = linear_grads(ctx, g, w, ctx.cdt if keep_cdt else ctx.y_dtype, need_y, need[6 + 2 * i],
                                           need[7 + 2 * i], lambda: linear_input(ctx.cdt))
                gy = gyi if gy is None else gy + gyi
                g_params += [gw, gb]
        gx = g_lnw = g_lnb = None
        if gy is not None:
            gx, g_lnw, g_lnb = layer_norm_grads(ctx, gy, packed, extra, need[0], need[2], need[3])
        return (gx, None, g_lnw, g_lnb, None, None, *g_params)


def plain_call(m: nn.Module) -> bool:
    """No hook on ``m`` that could read its arguments or output, or expect to be called:
    none, or only hooks marked ``mesa_input_agnostic`` (``SavedTensorMeter``'s, which only
    track which module runs)."""
    if m._backward_hooks or m._backward_pre_hooks:
        return False
    if not m._forward_pre_hooks and not m._forward_hooks:
        return True  # (the common case, asked a few times a block: no tuple of hooks built)
    hooks = (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
    return all(getattr(h, INPUT_AGNOSTIC_HOOK, False) for h in hooks)


def norm_pair_fits(norm: nn.Module, fc: nn.Module) -> bool:
    """The static part of :func:`can_fuse_norm` (also what ``describe`` reports): a Mesa
    ``LayerNorm`` over the last dim and a Mesa ``Linear`` with the same quantization options
    (the copy is made with the norm's)."""
    return (type(norm) is LayerNorm and type(fc) is Linear and len(norm.normalized_shape) == 1
            and same_options(norm.quant_options, fc.quant_options))


def can_fuse_norm(norm: nn.Module, fc: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``fc(norm(x))`` may run as :func:`layernorm_linear`: the pair fits
    (:func:`norm_pair_fits`), both would compress now, and neither has a hook that would miss
    its call (:func:`plain_call`). Under torch.fx tracing: no (the separate layers are the
    graph's leaf nodes, nn/tracing.py)."""
    if isinstance(x, torch.fx.Proxy):
        return False
    return (norm_pair_fits(norm, fc) and plain_call(norm) and plain_call(fc)
            and active_with_params(norm, x) and active_with_params(fc, x))


def layernorm_linear(x: torch.Tensor, norm: LayerNorm, fc: Linear) -> torch.Tensor:
    """``fc(norm(x))`` keeping one 8-bit copy, the norm's ``x_hat`` (made by ``norm``'s
    quantizer), for both backward passes. Call where :func:`can_fuse_norm`."""
    quantizer = norm.quantizer
    fused = quantizer.fused_layer_args(x) if _OP else None
    if fused is not None:  # eager, a channel format: one C++ op with a C++ autograd node
        return torch.ops.mesa.layer_norm_linear_train(x, list(norm.normalized_shape), norm.weight, norm.bias, norm.eps,
                                                      fc.weight, fc.bias, *fused, quantizer.options.row_scale)
    return _LayerNormLinearFn.apply(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps, quantizer,
                                    fc.weight, fc.bias)


def layernorm_linears(x: torch.Tensor, norm: LayerNorm, fcs: Sequence[Linear]) -> Tuple[torch.Tensor, ...]:
    """``tuple(fc(norm(x)) for fc in fcs)`` keeping one 8-bit copy, the norm's ``x_hat``, for
    the norm's backward and every Linear's (a SwiGLU's ``fc1_g`` and ``fc1_x``: three copies
    of the same tokens become one). Call where :func:`can_fuse_norm` holds for each."""
    if len(fcs) == 1:
        return (layernorm_linear(x, norm, fcs[0]),)
    args = [t for fc in fcs for t in (fc.weight, fc.bias)]
    return _LayerNormLinearFn.apply(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps, norm.quantizer, *args)
