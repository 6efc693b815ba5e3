"""Mesa fused attention: ``F.scaled_dot_product_attention`` in forward, int8 q, k, v for backward.

The stock fused kernels keep q, k, v, the output and the per-row log-sum-exp (lse) in
16/32 bit for their backward. :class:`ScaledDotProductAttention` runs exactly the same
``F.scaled_dot_product_attention`` call in forward (the output is bitwise the stock one)
but keeps only

* q, k, v as uint8 codes with per-head statistics (groups over the head dim, ``dim=-3``
  of a ``(..., heads, L, E)`` tensor; the last dim for 3-D inputs),
* the additive attention bias / mask as given (for Swin: the ``(1, heads, N, N)`` relative
  position bias and the ``(nW, N, N)`` window mask, not their ``(B*nW, heads, N, N)`` sum);
  a bias computed from the queries (``query_bias=QueryBias(fn, inputs)``, SAM's decomposed
  relative positions) is not kept at all, only ``fn``'s small ``inputs``: backward calls
  ``fn`` again on the dequantized q (``sdpa_query_bias.py``; compiled too).

Backward dequantizes q, k, v and recomputes the attention from them with autograd
enabled, then backpropagates ``grad_output`` through that recomputation. The softmax
statistics (the lse a fused kernel would reuse) therefore belong to the dequantized q and
k actually used for the gradients: the backward is the exact gradient of attention at
``(q_hat, k_hat, v_hat)``, never a mix of exact lse and approximate inputs. The output is
not saved at all: its one compressed copy is the input kept by the following projection
(``proj``), so no tensor is stored twice. The price is one extra attention forward per
backward (like activation checkpointing of the attention core).

Dropout (``dropout_p > 0``): the RNG state (CPU, and the device's for CUDA) is captured
right before the forward call and restored for the recomputation, so the same mask is
drawn, provided the backend choice is the same with grad enabled (it is on CPU; on CUDA
keep ``dropout_p = 0`` if exactness of the dropout mask matters — DeiT/Swin/PVT train with
attention dropout 0).

Autocast: the autocast state of the forward is re-entered for the recomputation, so the
dtypes match the forward.

Eager fast path: in eager training with a channel format (the paper's 8-bit one or a
variant), ``dropout_p == 0`` and the compiled extension, the whole layer is one op with a
C++ autograd node,
``mesa::sdpa_train`` (``csrc/sdpa_autograd.cpp``): the same compressions, mask, attention
call and recomputing backward as ``_MesaSDPA``, so outputs, codes, estimates and gradients
are bitwise this Python path's (``tests/test_layers_autograd.py``), at less than half the
host time Mesa adds per call (``results/overhead/``). Dropout (the RNG replay),
``torch.compile`` and learned thresholds run ``_MesaSDPA``. Under ``torch.compile`` its
backward's recomputation is the op ``mesa::sdpa_recompute_backward`` (``sdpa_backward.py``):
``autograd.grad`` cannot be traced, the op runs it at run time, on the backend stock picks.

Eval mode, ``enabled=False``, or no input requiring grad: the stock call, stock gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn.first_order import first_order
from mesa_train.nn._common import MesaLayer, autocast_input, autocast_state
from mesa_train.nn.sdpa_backward import (DROPOUT_UNTRACEABLE, attention, build_window_mask, capture_rng,
                                         operand_group_dim, recompute_grads, recompute_grads_compiled, restore_operand)
from mesa_train.nn.sdpa_query_bias import QueryBias, biased_attention, compressed_query_bias_sdpa

__all__ = ["QueryBias", "ScaledDotProductAttention", "build_window_mask"]


class _MesaSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, window_mask,
                qq, qa, qb, kq, ka, kb, vq, va, vb,
                dims, dropout_p, is_causal, scale):
        # q, k, v: the real inputs (used for the forward only); *q/*a/*b: their uint8 codes
        # and (S, G) statistics, computed by the module before this call.
        # The backend choice depends on whether the mask requires grad (a mask that does rules
        # out the fused CPU kernel): the mask is built with grad mode on, so it requires grad
        # exactly when the stock call's would (attn_mask does) and the forward is bitwise the
        # stock one. (Not requires_grad_ on the result: Dynamo in torch 2.11 breaks the graph
        # there.) Nothing flows back through it: backward uses the saved masks.
        with torch.enable_grad():
            mask = build_window_mask(attn_mask, window_mask, q.shape[0], q.shape[-3] if q.dim() >= 4 else 1)
        device_type = q.device.type
        ctx.autocast = (device_type,) + autocast_state(device_type)
        ctx.rng = capture_rng(dropout_p, q)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        ctx.dims = dims
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.opts = (dropout_p, is_causal, scale)
        ctx.has_mask = (attn_mask is not None, window_mask is not None)
        saved = [qq, qa, qb, kq, ka, kb, vq, va, vb]
        if attn_mask is not None:
            saved.append(attn_mask)
        if window_mask is not None:
            saved.append(window_mask)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        (qq, qa, qb, kq, ka, kb, vq, va, vb), rest = saved[:9], saved[9:]
        attn_mask = rest.pop(0) if ctx.has_mask[0] else None
        window_mask = rest.pop(0) if ctx.has_mask[1] else None
        (dq_, Gq, fq), (dk_, Gk, fk), (dv_, Gv, fv) = ctx.dims
        tq, tk, tv = ctx.dtypes
        dropout_p, is_causal, scale = ctx.opts
        needs = ctx.needs_input_grad

        q = restore_operand(qq, qa, qb, dq_, Gq, fq, tq)
        k = restore_operand(kq, ka, kb, dk_, Gk, fk, tk)
        v = restore_operand(vq, va, vb, dv_, Gv, fv, tv)
        mask_needs_grad = attn_mask is not None and needs[3] and attn_mask.is_floating_point()
        wanted = (needs[0], needs[1], needs[2], mask_needs_grad)
        if torch.compiler.is_compiling():  # (dropout_p > 0 never gets here, see _compressed_sdpa)
            grads = recompute_grads_compiled(grad_out, q, k, v, attn_mask, window_mask, is_causal, scale, wanted,
                                             ctx.autocast)
        else:
            grads = recompute_grads(grad_out, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale, wanted,
                                    ctx.autocast, ctx.rng)
        return grads + (None,) * 14


class ScaledDotProductAttention(MesaLayer, nn.Module):
    """``F.scaled_dot_product_attention`` that keeps int8 q, k, v for backward.

    ``forward(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
    window_mask=None, query_bias=None)`` takes the arguments of
    ``F.scaled_dot_product_attention``; the optional ``window_mask`` (``(nW, N, N)``, additive)
    is added to ``attn_mask`` per window the way Swin builds its shifted-window mask (see
    :func:`build_window_mask`); ``query_bias`` (a :class:`QueryBias`, instead of ``attn_mask``)
    is a mask computed from the queries, ``fn(q, *inputs)``.

    Quantization options are those of :class:`mesa_train.nn.QuantOptions`; ``num_groups``
    is the number of head groups (``patch_model`` sets it to the number of heads). One
    :class:`ActivationQuantizer` per operand: ``q_quantizer``, ``k_quantizer``,
    ``v_quantizer``.
    """

    _quantizer_names = ("q_quantizer", "k_quantizer", "v_quantizer")

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def extra_repr(self) -> str:
        return self._mesa_repr()

    def forward(self, q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                scale: Optional[float] = None, *, window_mask: Optional[torch.Tensor] = None,
                query_bias: Optional[QueryBias] = None):
        if query_bias is not None:
            return self._forward_query_bias(q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale, query_bias)
        if not self._mesa_active(q, k, v, attn_mask):
            return attention(q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale)
        if window_mask is None and attn_mask is not None:
            # autocast casts sdpa's mask to its dtype, and in the stock call (grad mode on) the
            # cast mask requires grad, which rules out the fused CPU kernel; cast inside our
            # forward (grad mode off) it did not, and a float32 bias (MaxViT's, CoAtNet's relative
            # position bias) took the fused kernel: other bits. Cast here, as autocast would,
            # with grad mode on (the mask's gradient flows back through the cast, as in stock).
            attn_mask = autocast_input(attn_mask)
        return _compressed_sdpa(self, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale)

    def _forward_query_bias(self, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale, query_bias):
        """The call with a bias computed from the queries (``nn/sdpa_query_bias.py``)."""
        if attn_mask is not None or window_mask is not None:
            raise ValueError("ScaledDotProductAttention: query_bias is the whole additive mask; attn_mask and "
                             "window_mask must be None with it")
        if not isinstance(query_bias, QueryBias):
            raise TypeError(f"ScaledDotProductAttention: query_bias must be a QueryBias(fn, inputs), got "
                            f"{type(query_bias).__name__}")
        if not self._mesa_active(q, k, v, *query_bias.inputs):
            return biased_attention(q, k, v, query_bias, dropout_p, is_causal, scale)
        return compressed_query_bias_sdpa(self, q, k, v, query_bias, dropout_p, is_causal, scale)


# whether the extension has the C++ layer (a build older than csrc/sdpa_autograd.cpp has not)
_SDPA_OP = quantizer_mod._FUSED_LAYERS and hasattr(torch.ops.mesa, "sdpa_train")


def _fused_args(module, q, k, v) -> list | None:
    """The quantizer arguments of ``mesa::sdpa_train`` (per operand: the buffer list, then the
    options), or ``None`` where ``_MesaSDPA`` must run: under ``torch.compile``, for learned
    thresholds, without the extension (see ``ActivationQuantizer.fused_layer_args``)."""
    if not _SDPA_OP:
        return None
    quantizers = module._modules  # (not module.q_quantizer: nn.Module.__getattr__ is a slow path)
    args = []
    for name, x in (("q_quantizer", q), ("k_quantizer", k), ("v_quantizer", v)):
        fused = quantizers[name].fused_state_args(x)
        if fused is None:
            return None
        args += fused
    return args


def _compressed_sdpa(module, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale):
    if dropout_p > 0.0 and torch.compiler.is_compiling():
        # the backward replays the forward's dropout mask from the captured RNG state,
        # which cannot be traced: this call runs eagerly (one graph break per call)
        return _compressed_sdpa_eager(module, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale)
    if dropout_p == 0.0:
        fused = _fused_args(module, q, k, v)
        if fused is not None:  # eager, a channel format: the layer with a C++ autograd node (csrc/sdpa_autograd.cpp)
            return torch.ops.mesa.sdpa_train(q, k, v, attn_mask, window_mask, bool(is_causal), scale, *fused)
    pq = module.q_quantizer.compress(q.detach(), operand_group_dim(q))
    pk = module.k_quantizer.compress(k.detach(), operand_group_dim(k))
    pv = module.v_quantizer.compress(v.detach(), operand_group_dim(v))
    dims = ((pq.dim, pq.num_groups, pq.fmt), (pk.dim, pk.num_groups, pk.fmt), (pv.dim, pv.num_groups, pv.fmt))
    return _MesaSDPA.apply(
        q, k, v, attn_mask, window_mask,
        pq.q, pq.alpha, pq.beta, pk.q, pk.alpha, pk.beta, pv.q, pv.alpha, pv.beta,
        dims, float(dropout_p), bool(is_causal), scale)


_compressed_sdpa_eager = torch.compiler.disable(_compressed_sdpa, reason=DROPOUT_UNTRACEABLE)
