"""``fc2(gelu(h))`` of an MLP that keeps one 8-bit copy, of ``h``, for both layers' backward.

A Mesa ``GELU`` keeps its input ``h`` in 8 bits and the Mesa ``Linear`` after it keeps its
own input ``gelu(h)`` in 8 bits: two copies of the widest activation of a ViT block (4x the
width), two min/max passes and two quantize passes in forward. Both gradients can come
from the first copy: ``fc2``'s weight gradient needs ``gelu(h)``, which backward recomputes
from the dequantized ``h`` (one elementwise op), and the GELU's gradient needs ``h`` itself.
DESIGN.md, "MLP: one copy for GELU and fc2".

Saved: ``h`` compressed as a Linear input is (channel groups over the last dim, int8
power-of-two row exponents: ``rowscale.py``; a row far below the others, DeiT3's class
token, would otherwise give ``fc2`` a weight gradient of rounding noise), plus ``fc2``'s
weight (a parameter). Forward is exactly ``F.linear(F.gelu(h), weight, bias)``, the stock
MLP's two calls (with autocast's cast of ``gelu(h)`` where it applies).

Gradient error: ``fc2``'s weight gradient uses ``gelu(h + e)`` where the unfused layers used
``gelu(h) + e'`` (``e``, ``e'``: the 8-bit rounding of ``h`` and of ``gelu(h)``, unbiased).
``gelu`` being curved, ``E[gelu(h + e)] - gelu(h) ~ gelu''(h) Var(e) / 2``: at most about
``0.4 * step**2 / 4`` per element (``step``: the group's 8-bit step), far below float16 or
bfloat16's own rounding of ``gelu(h)`` for ordinary ranges. The GELU's own backward from its
codes has the same curvature term (it always had).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mesa_train.quant  # noqa: F401  (registers torch.ops.mesa.gelu_backward / dequantize_gelu)
from mesa_train.quant.compile_kernels import traced_as_pytorch

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import active_with_params, autocast_input, load, no_autocast, save
from .layernorm_linear import plain_call
from .gelu import GELU
from .linear import Linear, linear_grads, not_a_view, save_linear_dtypes
from .quantizer import same_options
from .rowscale import compress_rows, decompress_rows, max_exponent

# the C++ layer op (csrc/layers_autograd.cpp, GeluLinearTrain; bitwise this module's Function):
# eager, paper format, an extension built with it
_OP = quantizer_mod._FUSED_LAYERS and hasattr(torch.ops.mesa, "gelu_linear_train")
_GELU_BACKWARD = torch.ops.mesa.gelu_backward.default
_DEQUANTIZE_GELU = torch.ops.mesa.dequantize_gelu.default
_GELU_VALUE_AND_GRAD = torch.ops.mesa.gelu_value_and_grad.default

__all__ = ["gelu_linear", "can_fuse"]


class _GeluLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, approximate, weight, bias, quantizer):
        y = F.gelu(h, approximate=approximate)  # exactly the stock act
        yc = autocast_input(y)  # the cast F.linear would make under autocast
        out = F.linear(yc, weight, bias)  # exactly the stock fc2
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        packed = k = None
        if need_h or need_w:
            packed, k = compress_rows(quantizer, h, 1, max_exponent(h.dtype, out.dtype))
        ctx.approximate = approximate
        ctx.h_dtype, ctx.yc_dtype = h.dtype, yc.dtype
        save_linear_dtypes(ctx, out, weight, bias)
        save(ctx, [packed], weight if need_h else None, k)
        return not_a_view(out)

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (weight, k) = load(ctx)
        gh = None
        with no_autocast(g.device.type):
            # the exact GELU from the paper format's codes in eager or the ops path: each backward
            # pass one op reading h's codes (on CUDA the dequantized h never reaches memory; C++
            # twin: GeluLinearTrain::backward); else (tanh, variants, traced kernels) h once
            from_codes = (packed is not None and ctx.approximate == "none" and packed.fmt is None
                          and not traced_as_pytorch(packed.q))
            codes = (packed.q, packed.alpha, packed.beta, packed.dim, packed.num_groups) if from_codes else None
            hh = decompress_rows(packed, ctx.h_dtype, k) if packed is not None and not from_codes else None

            def fc2_input():  # gelu in h's dtype, then autocast's cast, as stock computed it
                y = (_DEQUANTIZE_GELU(*codes, ctx.h_dtype, k) if from_codes
                     else F.gelu(hh, approximate=ctx.approximate))
                return y.to(ctx.yc_dtype).to(ctx.cdt)

            need = ctx.needs_input_grad
            if from_codes and need[0] and need[2]:
                # fc2's input gradient gy first, then ONE read of h's codes gives both fc2's input
                # gelu(h) (for its weight gradient) and the GELU's gradient (the bits of
                # dequantize_gelu and gelu_backward; C++ twin: GeluLinearTrain::backward)
                gy, _, gb = linear_grads(ctx, g, weight, ctx.h_dtype, True, False, need[3], None)
                y, gh = _GELU_VALUE_AND_GRAD(gy, *codes, k)
                _, gw, _ = linear_grads(ctx, g, weight, ctx.h_dtype, False, True, False,
                                        lambda: y.to(ctx.yc_dtype).to(ctx.cdt))
                return gh, None, gw, gb, None
            # fc2's backward; its input gradient comes back in h's dtype, as stock casts it
            gy, gw, gb = linear_grads(ctx, g, weight, ctx.h_dtype, need[0], need[2], need[3], fc2_input)
            if gy is not None:
                gh = (_GELU_BACKWARD(gy, *codes, k) if from_codes
                      else torch.ops.aten.gelu_backward.default(gy, hh, approximate=ctx.approximate))
        return gh, None, gw, gb, None


def _dropout_is_identity(m: nn.Module) -> bool:
    if isinstance(m, nn.Identity):
        return True
    return isinstance(m, nn.Dropout) and (m.p == 0 or not m.training)


def can_fuse(act: nn.Module, drop: nn.Module, norm: Optional[nn.Module], fc2: nn.Module, h: torch.Tensor) -> bool:
    """Whether ``fc2(norm(drop(act(h))))`` may run as :func:`gelu_linear`: a Mesa ``GELU`` and
    a Mesa ``Linear`` that would both compress now, with the same quantization options (the
    copy is made with them), nothing between them (no dropout mask, no norm: ``norm`` is
    ``None`` for an MLP without one) and the default row layout (channels last: the
    Linear's), and no hook on any of them that would miss its call (``plain_call``: a
    forward hook on ``fc2`` that changed the output was skipped, as were timm's feature hooks
    and pruning's pre-hook). Under torch.fx tracing: no (the separate layers are the graph's
    leaf nodes, nn/tracing.py)."""
    if isinstance(h, torch.fx.Proxy):
        return False
    return (type(act) is GELU and type(fc2) is Linear and (norm is None or type(norm) is nn.Identity)
            and _dropout_is_identity(drop) and same_options(act.quant_options, fc2.quant_options)
            and plain_call(act) and plain_call(fc2) and plain_call(drop) and (norm is None or plain_call(norm))
            and act._mesa_active(h) and active_with_params(fc2, h))


def gelu_linear(h: torch.Tensor, act: GELU, fc2: Linear) -> torch.Tensor:
    """``fc2(act(h))`` keeping one 8-bit copy of ``h`` (made by ``act``'s quantizer, whose
    running estimates track ``h``) for both backward passes. Call where :func:`can_fuse`."""
    quantizer = act.quantizer
    fused = quantizer.fused_layer_args(h) if _OP else None
    if fused is not None:  # eager, a channel format: one C++ op with a C++ autograd node
        return torch.ops.mesa.gelu_linear_train(h, fc2.weight, fc2.bias, *fused, act.approximate,
                                                quantizer.options.row_scale)
    return _GeluLinearFn.apply(h, act.approximate, fc2.weight, fc2.bias, quantizer)
