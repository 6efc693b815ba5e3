"""``torch.nn.MultiheadAttention`` (torchvision's ViT, ``nn.TransformerEncoderLayer``, many
hand-written ViTs): its whole computation is one call, ``F.multi_head_attention_forward``,
which no leaf rule and no intercepted functional call reaches (a ``TorchFunctionMode`` sees
that call only, not the ``linear`` and ``scaled_dot_product_attention`` inside it).

``install`` swaps the module's class for :class:`MesaMultiheadAttention` and gives it two
Mesa children; the parameters stay where they are, so the ``state_dict`` keys are the stock
ones plus the quantizers':

``mesa_in_proj``  the packed q/k/v projection ``F.linear(x, in_proj_weight, in_proj_bias)``
                  (a :class:`~mesa_train.nn.LinearOf`: int8 ``x``)
``mesa_sdpa``     ``F.scaled_dot_product_attention`` on the heads (int8 q, k, v)
``mesa_qk``, ``mesa_softmax``, ``mesa_av``
                  the explicit core of a ``need_weights=True`` call (torch's default:
                  ``bmm(q_scaled, k^T)``, softmax, dropout, ``bmm(., v)``; the map's int8 copy
                  shared with ``attn @ v`` where no dropout comes between)

and ``out_proj`` becomes a Mesa ``Linear`` (the same Parameters). In a training call of the
form those users make, self-attention (``query is key is value``, batched), its forward is
the steps of ``F.multi_head_attention_forward`` on that path (``need_weights=False``: sdpa,
with the key padding and attention masks made additive, spread over the heads and merged as
torch does, an ``is_causal`` hint kept where torch keeps it; ``True``, unmasked: the explicit
core, the weights returned averaged or not), in its order, with those layers: the output and
the weights are bitwise the stock ones. Any other call (eval or no grad, cross-attention, an
unbatched input, a mask with ``need_weights=True``: torch adds it inside ``baddbmm``, or
``need_weights=True`` without ``matmul`` and ``softmax`` among the ops) runs the stock forward
uncompressed; in training a warning says why, once per module.
Modules built with separate q/k/v weights (``kdim`` / ``vdim``), ``add_bias_kv`` or
``add_zero_attn`` are left stock and reported as not reached.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.nn.tracing import MesaTracingError, register_fx_leaf

__all__ = ["MesaMultiheadAttention", "install", "supported"]


def supported(m: nn.Module) -> bool:
    """A stock ``nn.MultiheadAttention`` whose training path the Mesa forward replicates."""
    return (type(m) is nn.MultiheadAttention and m._qkv_same_embed_dim and m.bias_k is None
            and not m.add_zero_attn)


def install(m: nn.Module, make_linear: Optional[Callable[[], nn.Module]],
            make_sdpa: Optional[Callable[[], nn.Module]], convert_linear: Optional[Callable],
            make_core: Optional[Callable[[], tuple]] = None) -> None:
    """Swap ``m``'s class and add the children the ops asked for build (``None``: that part
    stays stock); ``make_core``: the explicit core's ``(q @ k^T MatMul, Softmax, attn @ v
    MatMul)`` for ``need_weights=True`` calls (``matmul`` and ``softmax`` asked for)."""
    m.__class__ = MesaMultiheadAttention
    m.mesa_in_proj = make_linear() if make_linear is not None else None
    m.mesa_sdpa = make_sdpa() if make_sdpa is not None else None
    m.mesa_qk, m.mesa_softmax, m.mesa_av = make_core() if make_core is not None else (None, None, None)
    if convert_linear is not None:
        m.out_proj = convert_linear(m.out_proj)
    m._mesa_warned = False


class MesaMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose self-attention training calls compress (module doc)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        if isinstance(query, torch.fx.Proxy):  # (the stock module is a leaf to torch.fx; this one must be told)
            raise MesaTracingError(
                "torch.fx traced into MesaMultiheadAttention: the graph would run the stock attention. Treat it as a "
                "leaf with the Mesa layers (leaf_modules=[mesa_train.nn.MesaLayer, "
                "mesa_train.patch.mha.MesaMultiheadAttention]; timm's create_feature_extractor does)")
        why = self._stock_because(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if why is None:
            mask, is_causal = self._sdpa_mask(query, key_padding_mask, attn_mask, is_causal)
            return self._compressed_forward(query, need_weights, average_attn_weights, mask, is_causal)
        if why and not self._mesa_warned:
            self._mesa_warned = True
            warnings.warn(f"mesa_train: an nn.MultiheadAttention ran uncompressed in training: {why}", UserWarning,
                          stacklevel=2)
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)

    def _stock_because(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """None when this call takes the Mesa path; '' when it is stock by design (eval, no
        gradient); else the reason, for the warning."""
        if not (self.training and torch.is_grad_enabled()):
            return ""
        if query is not key or key is not value:
            return "cross-attention (query, key and value are not one tensor); only self-attention is compressed"
        if query.dim() != 3:
            return f"an unbatched {query.dim()}-D input; pass (batch, tokens, dim) or (tokens, batch, dim)"
        if need_weights and self.mesa_softmax is None:
            return ("need_weights=True computes the attention map explicitly, and the ops asked for leave its "
                    "matmul or softmax stock; pass need_weights=False (the same output, through "
                    "scaled_dot_product_attention) to compress it")
        masked = attn_mask is not None or key_padding_mask is not None or is_causal
        if masked and (need_weights or self.mesa_sdpa is None):
            return ("a mask (attn_mask, key_padding_mask or is_causal) with need_weights=True (torch adds it inside "
                    "baddbmm) or without 'sdpa' among the ops; pass need_weights=False to compress it")
        if masked and not self._mask_shapes_expected(query, key_padding_mask, attn_mask, is_causal):
            return ""  # (stock raises torch's own error on them)
        return None

    def _mask_shapes_expected(self, query, key_padding_mask, attn_mask, is_causal) -> bool:
        """The masks torch's function takes without an error: key_padding_mask (batch, tokens),
        attn_mask (tokens, tokens) or (batch * heads, tokens, tokens), is_causal with an attn_mask."""
        tokens, bsz = (query.shape[1], query.shape[0]) if self.batch_first else (query.shape[0], query.shape[1])
        if is_causal and attn_mask is None:
            return False
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (bsz, tokens):
            return False
        return attn_mask is None or tuple(attn_mask.shape) in ((tokens, tokens), (bsz * self.num_heads, tokens, tokens))

    def _sdpa_mask(self, query, key_padding_mask, attn_mask, is_causal):
        """``(attn_mask, is_causal)`` as ``F.multi_head_attention_forward`` hands them to
        ``scaled_dot_product_attention`` on its ``need_weights=False`` path: boolean masks made
        additive float ones (``F._canonical_mask``, as ``nn.MultiheadAttention.forward`` and the
        function each do), the key padding mask spread over the heads and added, an is_causal
        hint kept only where no key padding mask is given."""
        if key_padding_mask is None and attn_mask is None:
            return None, is_causal
        dtype, heads = query.dtype, self.num_heads
        tokens, bsz = (query.shape[1], query.shape[0]) if self.batch_first else (query.shape[0], query.shape[1])
        kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=dtype)
        mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                 target_type=dtype, check_other=False)
        if is_causal and kpm is None:
            return None, True  # (torch drops the mask and passes the hint)
        if mask is not None and mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if kpm is not None:
            kpm = kpm.view(bsz, 1, 1, tokens).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, tokens)
            mask = kpm if mask is None else mask + kpm
            is_causal = False
        mask = mask.unsqueeze(0) if mask.size(0) == 1 and mask.dim() == 3 else mask.view(bsz, heads, -1, tokens)
        return mask, is_causal

    def _compressed_forward(self, query, need_weights: bool, average_attn_weights: bool, mask=None,
                            is_causal: bool = False):
        """``F.multi_head_attention_forward``'s self-attention path without a mask: the same ops
        on the same tensors, the projections, sdpa (``need_weights=False``) or the explicit
        core (``need_weights=True``, torch's default) through the Mesa children; returns
        ``(output, weights or None)``."""
        x = query.transpose(1, 0) if self.batch_first else query  # (tokens, batch, dim)
        tgt_len, bsz, embed_dim = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        in_proj = self.mesa_in_proj
        if in_proj is not None:
            proj = in_proj(x, self.in_proj_weight, self.in_proj_bias)
        else:
            proj = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
        proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = (t.view(tgt_len, bsz * heads, head_dim).transpose(0, 1) for t in (proj[0], proj[1], proj[2]))
        weights = None
        if need_weights:  # torch's explicit path: bmm, softmax, dropout, bmm
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            scores = self.mesa_qk(q_scaled, k.transpose(-2, -1))
            weights, copy = self.mesa_softmax(scores, with_copy=True)
            if self.dropout > 0.0:
                weights, copy = nn.functional.dropout(weights, p=self.dropout), None
            out = self.mesa_av(weights, v, shared_a=copy)
            out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            weights = weights.view(bsz, heads, tgt_len, tgt_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            q, k, v = (t.view(bsz, heads, tgt_len, head_dim) for t in (q, k, v))
            sdpa = self.mesa_sdpa if self.mesa_sdpa is not None else nn.functional.scaled_dot_product_attention
            out = sdpa(q, k, v, mask, self.dropout, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = self.out_proj(out)
        out = out.view(tgt_len, bsz, out.size(1))
        return (out.transpose(1, 0) if self.batch_first else out), weights


register_fx_leaf(MesaMultiheadAttention)  # timm's FX feature extraction keeps it one node (nn/tracing.py)
