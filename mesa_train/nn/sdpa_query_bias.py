"""Mesa fused attention whose additive bias is computed from the queries (SAM's decomposed
relative positions): int8 q, k, v kept, the ``(B*heads, N, N)`` bias never.

SAM's ViT (timm's ``vision_transformer_sam.Attention``) builds its bias from ``q`` and two small
position tables (``get_decomposed_rel_pos_bias``: two einsums, then ``rel_h + rel_w`` broadcast
to ``(B*heads, N, N)``) and hands it to ``F.scaled_dot_product_attention`` as ``attn_mask``.
The stock backward keeps that bias (N = 4096 in SAM's global blocks at 1024 px: 64 MiB per head
and image in float32, far more than q, k and v) and the einsums keep ``q`` again.

Here the bias is a function of the queries, ``bias_fn(q, *bias_inputs)`` (:class:`QueryBias`).
Forward calls it on the real ``q`` and runs the stock attention call (bitwise the stock output);
only the 8-bit q, k, v and the bias inputs (the position tables: parameters, nothing per
sample) are kept. Backward dequantizes q, k, v, calls ``bias_fn`` again on ``q_hat`` and
backpropagates through bias and attention together: the exact gradient of the whole map at
``(q_hat, k_hat, v_hat)``, the queries' share through the bias included, as the plain layer's
is at its inputs (``sdpa.py``).

Not fused into the C++ layer: the eager backward runs autograd through a Python function.
Under ``torch.compile`` (``autograd.grad`` cannot be traced) the backward takes the two halves
apart (``_grads_compiled``): ``torch.func.vjp`` of the bias function at the dequantized q (traced,
so the compiler sees the bias function's own backward) and the attention's gradients, the
bias's included, from the op the plain layer's compiled backward calls
(``mesa::sdpa_recompute_backward``). No graph break and nothing N x N kept, compiled as eager;
with the ``aot_eager`` backend the gradients are eager's bit for bit
(``tests/test_sam_attention.py``). With attention dropout the call runs eagerly inside the
compiled model (one graph break), as the plain layer's does: the mask replay is not traceable.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from mesa_train.nn.first_order import first_order
from mesa_train.nn._common import autocast_input, autocast_state
from mesa_train.nn.sdpa_backward import (DROPOUT_UNTRACEABLE, capture_rng, grads_through, operand_group_dim,
                                         recompute_grads_compiled, restore_operand)

__all__ = ["QueryBias", "biased_attention", "compressed_query_bias_sdpa"]


class QueryBias(NamedTuple):
    """An additive attention bias computed from the queries: ``fn(q, *inputs)``."""
    fn: Callable[..., torch.Tensor]
    inputs: Tuple[torch.Tensor, ...] = ()


def _bias(q: torch.Tensor, query_bias: QueryBias, inputs) -> torch.Tensor:
    """The bias for the forward call, built without a graph (nothing of it is kept), cast for
    autocast as sdpa would cast it, then marked as requiring grad exactly when the stock bias
    does: a mask that requires grad rules out the fused CPU kernel, so the stock call's backend
    (and bits) follow from it. (Built with grad mode on instead, its einsums' graph held full
    copies of q until the forward returned.)"""
    if torch.compiler.is_compiling():
        # (Dynamo breaks the graph at requires_grad_: the bias is built with grad mode on, so
        # it requires grad exactly when the stock one does; a compiled graph keeps nothing of
        # a forward's intermediate that its backward does not read)
        with torch.enable_grad():
            return autocast_input(query_bias.fn(q, *inputs))
    bias = autocast_input(query_bias.fn(q, *inputs))
    return bias.requires_grad_(q.requires_grad or any(t.requires_grad for t in inputs))


def biased_attention(q, k, v, query_bias: QueryBias, dropout_p, is_causal, scale, inputs=None):
    """The stock call: ``F.scaled_dot_product_attention`` with ``attn_mask=query_bias.fn(q, ...)``."""
    bias = query_bias.fn(q, *(query_bias.inputs if inputs is None else inputs))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


class _MesaQueryBiasSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query_bias, dims, opts, qq, qa, qb, kq, ka, kb, vq, va, vb, q, k, v, *bias_inputs):
        dropout_p, is_causal, scale = opts
        bias = _bias(q, query_bias, bias_inputs)
        device_type = q.device.type
        ctx.autocast = (device_type,) + autocast_state(device_type)
        ctx.rng = capture_rng(dropout_p, q)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale)
        ctx.query_bias, ctx.dims, ctx.opts = query_bias, dims, opts
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(qq, qa, qb, kq, ka, kb, vq, va, vb, *bias_inputs)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        codes, bias_inputs = saved[:9], saved[9:]
        operands = [restore_operand(*codes[3 * i:3 * i + 3], *ctx.dims[i], ctx.dtypes[i]) for i in range(3)]
        dropout_p, is_causal, scale = ctx.opts
        query_bias = ctx.query_bias

        needs = ctx.needs_input_grad[12:]
        if torch.compiler.is_compiling():  # (dropout_p > 0 never gets here, see compressed_query_bias_sdpa)
            grads = _grads_compiled(grad_out, operands, bias_inputs, query_bias, is_causal, scale, needs, ctx.autocast)
            return (None,) * 12 + grads

        def call(q, k, v, *inputs):
            return biased_attention(q, k, v, query_bias, dropout_p, is_causal, scale, inputs)

        grads = grads_through(call, (*operands, *bias_inputs), needs, grad_out, ctx.autocast, ctx.rng)
        return (None,) * 12 + grads


def _grads_compiled(grad_out, operands, bias_inputs, query_bias: QueryBias, is_causal, scale, needs, autocast):
    """The backward's gradients in a graph ``torch.compile`` traces: ``autograd.grad`` through
    the bias function cannot be traced, so the two halves are taken apart. The bias is rebuilt
    from the dequantized q with ``torch.func.vjp`` (traced: the compiler sees the bias
    function's own backward), the attention's gradients, the bias's included, come from the
    op the plain layer's compiled backward calls (``mesa::sdpa_recompute_backward``: the stock
    backend at run time), and the bias's gradient goes back through the vjp to q and the
    bias inputs. The same map as eager's at the same operands; the sums are added in another
    order."""
    q, k, v = operands
    device_type, ac_enabled, ac_dtype = autocast
    with torch.autocast(device_type, dtype=ac_dtype, enabled=ac_enabled):
        bias, bias_vjp = torch.func.vjp(query_bias.fn, q, *bias_inputs)
    need_bias = needs[0] or any(needs[3:])
    dq, dk, dv, dbias = recompute_grads_compiled(grad_out, q, k, v, bias, None, is_causal, scale,
                                                 (needs[0], needs[1], needs[2], need_bias), autocast)
    if not need_bias:
        return (dq, dk, dv) + (None,) * len(bias_inputs)
    dq_bias, *d_inputs = bias_vjp(dbias)
    if needs[0]:
        dq = dq + dq_bias
    return (dq, dk, dv) + tuple(d if n else None for d, n in zip(d_inputs, needs[3:]))


def compressed_query_bias_sdpa(module, q, k, v, query_bias: QueryBias, dropout_p: float, is_causal: bool,
                               scale: Optional[float]) -> torch.Tensor:
    """The layer's training call with a query bias: q, k, v compressed by ``module``'s
    quantizers (``ScaledDotProductAttention``), the rest as the module docstring says."""
    if dropout_p > 0.0 and torch.compiler.is_compiling():
        # the backward replays the forward's dropout mask from the captured RNG state, which
        # cannot be traced: this call runs eagerly (one graph break per call), as sdpa's does
        return _compressed_query_bias_sdpa_eager(module, q, k, v, query_bias, dropout_p, is_causal, scale)
    packed = [quantizer.compress(x.detach(), operand_group_dim(x))
              for quantizer, x in ((module.q_quantizer, q), (module.k_quantizer, k), (module.v_quantizer, v))]
    dims = tuple((p.dim, p.num_groups, p.fmt) for p in packed)
    codes = [t for p in packed for t in (p.q, p.alpha, p.beta)]
    return _MesaQueryBiasSDPA.apply(query_bias, dims, (float(dropout_p), bool(is_causal), scale), *codes, q, k, v,
                                    *query_bias.inputs)


_compressed_query_bias_sdpa_eager = torch.compiler.disable(compressed_query_bias_sdpa, reason=DROPOUT_UNTRACEABLE)
