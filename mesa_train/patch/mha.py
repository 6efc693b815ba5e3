"""``torch.nn.MultiheadAttention`` (torchvision's ViT, ``nn.TransformerEncoderLayer`` /
``DecoderLayer``, DETR-style decoders, many hand-written ViTs): its whole computation is one
call, ``F.multi_head_attention_forward``, which no leaf rule and no intercepted functional call
reaches (a ``TorchFunctionMode`` sees that call only, not the ``linear`` and
``scaled_dot_product_attention`` inside it).

``install`` swaps the module's class for :class:`MesaMultiheadAttention` and gives it Mesa
children; the parameters stay where they are, so the ``state_dict`` keys are the stock ones
plus the quantizers':

``mesa_in_proj``    the query's projection: the packed q/k/v one ``F.linear(x, in_proj_weight,
                    in_proj_bias)`` in self-attention, the query rows of the weight otherwise
                    (a :class:`~mesa_train.nn.LinearOf`: int8 input)
``mesa_in_proj_k``  the key's projection in cross-attention (the packed k/v rows where ``key
                    is value``, a decoder reading its memory); built unless the module's
                    parent is known to call it as self-attention only (:func:`call_forms`)
``mesa_in_proj_v``  the value's projection where the value is a third tensor (DETR's
                    ``attn(q, k=q, v=x)``, or separate ``kdim`` / ``vdim`` weights)
``mesa_sdpa``       ``F.scaled_dot_product_attention`` on the heads (int8 q, k, v)
``mesa_qk``, ``mesa_softmax``, ``mesa_av``
                    the explicit core of a ``need_weights=True`` call (torch's default:
                    ``bmm(q_scaled, k^T)``, softmax, dropout, ``bmm(., v)``; the map's int8 copy
                    shared with ``attn @ v`` where no dropout comes between)

and ``out_proj`` becomes a Mesa ``Linear`` (the same Parameters). In a batched training call
its forward is the steps of ``F.multi_head_attention_forward`` (the in-projection as
``_in_projection_packed`` or ``_in_projection`` chooses it by the inputs' identity,
``need_weights=False``: sdpa, with the key padding and attention masks made additive, spread
over the heads and merged as torch does, an ``is_causal`` hint kept where torch keeps it;
``True``: the explicit core, a mask added inside ``baddbmm``, the weights returned averaged or
not), in its order, with those layers: the output and the weights are bitwise the stock ones.
Any other call (eval or no grad, an unbatched input, ``need_weights=True`` without ``matmul``
and ``softmax`` among the ops) runs the stock forward uncompressed; in training a warning says
why, once per module. Modules built
with ``add_bias_kv`` or ``add_zero_attn`` are left stock and reported as not reached.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.nn.tracing import MesaTracingError, register_fx_leaf
from mesa_train.warning_site import outside_stacklevel

__all__ = ["MesaMultiheadAttention", "call_forms", "install", "supported"]

# Parents whose (unsubclassed) forward calls the attention in one form only: the children
# they would never run are not built. The value: the inputs besides the query that the call
# projects separately ("k": the key, with the value where ``key is value``), and whether it
# asks for the weights (need_weights=True: the explicit core's children).
_KNOWN_CALLS = {
    ("torch.nn.modules.transformer", "TransformerEncoderLayer", "self_attn"): ((), False),
    ("torch.nn.modules.transformer", "TransformerDecoderLayer", "self_attn"): ((), False),
    ("torch.nn.modules.transformer", "TransformerDecoderLayer", "multihead_attn"): (("k",), False),  # (x, mem, mem)
    ("torchvision.models.vision_transformer", "EncoderBlock", "self_attention"): ((), False),
}


def supported(m: nn.Module) -> bool:
    """A stock ``nn.MultiheadAttention`` whose training path the Mesa forward replicates."""
    return type(m) is nn.MultiheadAttention and m.bias_k is None and not m.add_zero_attn


def call_forms(m: nn.Module, parents: Sequence[Tuple[nn.Module, str]]) -> Tuple[Tuple[str, ...], bool]:
    """``(roles, weights)``: the inputs besides the query whose projection needs its own child,
    and whether calls may ask for the weights (``need_weights=True``, torch's default: the
    explicit core). All of it (``("k", "v")``, True) for a module called from code this module
    does not know (a user's decoder may pass ``(q, memory, memory)`` or DETR's ``(q, q, x)``,
    with the default ``need_weights``) or as the model itself; less for the torch and
    torchvision layers that call it one way. The key and value roles always for separate
    ``kdim`` / ``vdim`` weights (three projections in every call)."""
    roles, weights = set(), False
    for parent, key in parents or [(None, "")]:
        cls = type(parent)
        known = _KNOWN_CALLS.get((cls.__module__, cls.__qualname__, key)) if parent is not None else None
        if known is None:
            roles.update(("k", "v"))
            weights = True
        else:
            roles.update(known[0])
            weights = weights or known[1]
    if not m._qkv_same_embed_dim:
        roles.update(("k", "v"))
    return tuple(r for r in ("k", "v") if r in roles), weights


def install(m: nn.Module, make_linear: Optional[Callable[[], nn.Module]],
            make_sdpa: Optional[Callable[[], nn.Module]], convert_linear: Optional[Callable],
            make_core: Optional[Callable[[], tuple]] = None, roles: Sequence[str] = ("k", "v")) -> None:
    """Swap ``m``'s class and add the children the ops asked for build (``None``: that part
    stays stock); ``make_core``: the explicit core's ``(q @ k^T MatMul, Softmax, attn @ v
    MatMul)`` for ``need_weights=True`` calls (``matmul`` and ``softmax`` asked for);
    ``roles``: the cross-attention inputs that get their own projection child
    (:func:`call_forms`)."""
    m.__class__ = MesaMultiheadAttention
    m.mesa_in_proj = make_linear() if make_linear is not None else None
    m.mesa_in_proj_k = make_linear() if make_linear is not None and "k" in roles else None
    m.mesa_in_proj_v = make_linear() if make_linear is not None and "v" in roles else None
    m.mesa_sdpa = make_sdpa() if make_sdpa is not None else None
    m.mesa_qk, m.mesa_softmax, m.mesa_av = make_core() if make_core is not None else (None, None, None)
    if convert_linear is not None:
        m.out_proj = convert_linear(m.out_proj)
    m._mesa_warned = False
    m._mesa_warned_roles = False


def _linear(layer: Optional[nn.Module], x, weight, bias):
    """The projection through its Mesa child, or ``F.linear`` where none was built."""
    return layer(x, weight, bias) if layer is not None else F.linear(x, weight, bias)


def _split_packed(proj: torch.Tensor, parts: int, embed_dim: int) -> torch.Tensor:
    """``_in_projection_packed``'s reshuffle of a packed projection: ``(parts, ..., E)``
    contiguous."""
    return proj.unflatten(-1, (parts, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()


class MesaMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose training calls compress (module doc)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        if isinstance(query, torch.fx.Proxy):  # (the stock module is a leaf to torch.fx; this one must be told)
            raise MesaTracingError(
                "torch.fx traced into MesaMultiheadAttention: the graph would run the stock attention. Treat it as a "
                "leaf with the Mesa layers (leaf_modules=[mesa_train.nn.MesaLayer, "
                "mesa_train.patch.mha.MesaMultiheadAttention]; timm's create_feature_extractor does)")
        why = self._stock_because(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if why is None:
            query, key, value = self._sequence_first(query, key, value)
            mask, is_causal = self._merged_mask(query, key, key_padding_mask, attn_mask, is_causal, need_weights)
            return self._compressed_forward(query, key, value, need_weights, average_attn_weights, mask, is_causal)
        if why and not self._mesa_warned:
            self._mesa_warned = True
            warnings.warn(f"mesa_train: an nn.MultiheadAttention ran uncompressed in training: {why}", UserWarning,
                          stacklevel=outside_stacklevel())
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)

    def _stock_because(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """None when this call takes the Mesa path; '' when it is stock by design (eval, no
        gradient, inputs torch's function rejects: it raises its own error); else the reason,
        for the warning."""
        if not (self.training and torch.is_grad_enabled()):
            return ""
        if query.dim() != 3:
            return f"an unbatched {query.dim()}-D input; pass (batch, tokens, dim) or (tokens, batch, dim)"
        if need_weights and self.mesa_softmax is None:
            return ("need_weights=True computes the attention map explicitly, and this module has no Mesa children "
                    "for it (the ops asked for leave its matmul or softmax stock, or the torch layer holding it calls "
                    "it with need_weights=False only); pass need_weights=False (the same output, through "
                    "scaled_dot_product_attention) to compress it")
        if not self._shapes_expected(query, key, value, key_padding_mask, attn_mask, is_causal, need_weights):
            return ""
        return None

    def _shapes_expected(self, query, key, value, key_padding_mask, attn_mask, is_causal, need_weights) -> bool:
        """The batched inputs and masks torch's function takes without an error: key and value
        3-D with the query's batch, of ``kdim`` / ``vdim`` features, one length between them;
        key_padding_mask (batch, source tokens); attn_mask (target, source) or (batch * heads,
        target, source); is_causal with an attn_mask."""
        if key.dim() != 3 or value.dim() != 3 or query.size(-1) != self.embed_dim:
            return False
        b = 0 if self.batch_first else 1
        t = 1 - b
        bsz, tgt, src = query.shape[b], query.shape[t], key.shape[t]
        if key.shape[b] != bsz or key.size(-1) != self.kdim or value.size(-1) != self.vdim:
            return False
        if value.shape[:2] != key.shape[:2]:
            return False
        if is_causal and attn_mask is None:
            return False
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (bsz, src):
            return False
        if is_causal and key_padding_mask is None and not need_weights:
            return True  # (torch drops the mask for the hint, unread: a placeholder mask is fine)
        return attn_mask is None or tuple(attn_mask.shape) in ((tgt, src), (bsz * self.num_heads, tgt, src))

    def _sequence_first(self, query, key, value):
        """``nn.MultiheadAttention.forward``'s transposes of batch-first inputs, keeping the
        identities (``query is key``, ``key is value``) that choose the in-projection."""
        if not self.batch_first:
            return query, key, value
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
                return query, key, value
            query, key = (x.transpose(1, 0) for x in (query, key))
            return query, key, key
        return tuple(x.transpose(1, 0) for x in (query, key, value))

    def _merged_mask(self, query, key, key_padding_mask, attn_mask, is_causal, need_weights):
        """``(attn_mask, is_causal)`` as ``F.multi_head_attention_forward`` prepares them for
        its core: boolean masks made additive float ones (``F._canonical_mask``, as
        ``nn.MultiheadAttention.forward`` and the function each do), a 2-D mask unsqueezed,
        the key padding mask spread over the heads and added (3-D: ``(1 or batch * heads,
        target or 1, source)``), an is_causal hint kept, without the mask, only on the
        ``need_weights=False`` path where no key padding mask is given. Inputs sequence-first."""
        if key_padding_mask is None and attn_mask is None:
            return None, is_causal
        dtype, heads = query.dtype, self.num_heads
        bsz, src = query.shape[1], key.shape[0]
        kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=dtype)
        mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                 target_type=dtype, check_other=False)
        if is_causal and kpm is None and not need_weights:
            return None, True  # (torch drops the mask and passes the hint)
        if mask is not None and mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if kpm is not None:
            kpm = kpm.view(bsz, 1, 1, src).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src)
            mask = kpm if mask is None else mask + kpm
            is_causal = False
        return mask, is_causal

    def _in_projection(self, query, key, value):
        """``(q, k, v)`` as torch's ``_in_projection_packed`` (one weight: a single packed
        projection in self-attention, the query's rows and the packed key/value rows where
        ``key is value``, three row blocks otherwise) or ``_in_projection`` (separate
        ``kdim`` / ``vdim`` weights) computes them, each input through its own child."""
        q_proj, k_proj, v_proj = self.mesa_in_proj, self.mesa_in_proj_k, self.mesa_in_proj_v
        bias = self.in_proj_bias
        if q_proj is not None and (k_proj is None or v_proj is None) and not (key is value and query is key):
            self._say_missing_roles(k_proj is None, v_proj is None and key is not value)
        if not self._qkv_same_embed_dim:
            b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
            return (_linear(q_proj, query, self.q_proj_weight, b_q), _linear(k_proj, key, self.k_proj_weight, b_k),
                    _linear(v_proj, value, self.v_proj_weight, b_v))
        weight, embed_dim = self.in_proj_weight, query.size(-1)
        if key is value and query is key:
            proj = _split_packed(_linear(q_proj, query, weight, bias), 3, embed_dim)
            return proj[0], proj[1], proj[2]
        if key is value:
            w_q, w_kv = weight.split([embed_dim, embed_dim * 2])
            b_q, b_kv = bias.split([embed_dim, embed_dim * 2]) if bias is not None else (None, None)
            q = _linear(q_proj, query, w_q, b_q)
            kv = _split_packed(_linear(k_proj, key, w_kv, b_kv), 2, embed_dim)
            return q, kv[0], kv[1]
        w_q, w_k, w_v = weight.chunk(3)
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        return _linear(q_proj, query, w_q, b_q), _linear(k_proj, key, w_k, b_k), _linear(v_proj, value, w_v, b_v)

    def _say_missing_roles(self, key: bool, value: bool) -> None:
        """Once per module, in eager training: a cross-attention call reached a module whose
        parent, a torch layer, calls it as self-attention only, so the key/value projection
        children were not built (``call_forms``): those projections run uncompressed."""
        if self._mesa_warned_roles or torch.compiler.is_compiling() or not (key or value):
            return
        self._mesa_warned_roles = True
        which = " and ".join(n for n, missing in (("key", key), ("value", value)) if missing)
        warnings.warn(f"mesa_train: an nn.MultiheadAttention held by a torch layer that calls it as self-attention "
                      f"ran a cross-attention call: its {which} projection ran uncompressed (no Mesa child was "
                      "built for it). Use a module of its own for the cross-attention", UserWarning,
                      stacklevel=outside_stacklevel())

    def _compressed_forward(self, query, key, value, need_weights: bool, average_attn_weights: bool, mask=None,
                            is_causal: bool = False):
        """``F.multi_head_attention_forward``'s path for batched sequence-first inputs: the
        same ops on the same tensors, the projections, sdpa (``need_weights=False``) or the
        explicit core (``need_weights=True``, torch's default: a mask added inside ``baddbmm``)
        through the Mesa children; ``mask``: as :meth:`_merged_mask` made it; returns
        ``(output, weights or None)``."""
        tgt_len, bsz, embed_dim = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self._in_projection(query, key, value)
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        src_len = k.size(1)
        weights = None
        if need_weights:  # torch's explicit path: bmm, softmax, dropout, bmm
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            scores = self.mesa_qk(q_scaled, k.transpose(-2, -1), addend=mask)
            weights, copy = self.mesa_softmax(scores, with_copy=True)
            if self.dropout > 0.0:
                weights, copy = nn.functional.dropout(weights, p=self.dropout), None
            out = self.mesa_av(weights, v, shared_a=copy)
            out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            q = q.view(bsz, heads, tgt_len, head_dim)
            k, v = (t.view(bsz, heads, src_len, head_dim) for t in (k, v))
            if mask is not None:
                mask = (mask.unsqueeze(0) if mask.size(0) == 1 and mask.dim() == 3
                        else mask.view(bsz, heads, -1, src_len))
            sdpa = self.mesa_sdpa if self.mesa_sdpa is not None else nn.functional.scaled_dot_product_attention
            out = sdpa(q, k, v, mask, self.dropout, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = self.out_proj(out)
        out = out.view(tgt_len, bsz, out.size(1))
        return (out.transpose(1, 0) if self.batch_first else out), weights


register_fx_leaf(MesaMultiheadAttention)  # timm's FX feature extraction keeps it one node (nn/tracing.py)
