"""SAM's ViT attention with its decomposed relative positions kept as what they are made of.

timm's ``vision_transformer_sam.Attention`` (``use_rel_pos=True``: every ``samvit_*`` model)
builds an additive bias from the queries and two position tables and hands the
``(B*heads, N, N)`` result to ``F.scaled_dot_product_attention``. The generic attention routing
(``generic_attention.py``) compresses q, k and v but must keep that bias, and the bias's einsums
keep ``q`` in full precision: at SAM's 1024 px (N = 4096 in the global blocks) the bias is
nearly all of what the attention keeps.

The class swap below runs the stock forward line for line, except that the fused attention call
goes to the module's ``mesa_sdpa`` child with a :class:`QueryBias`: timm's own
``get_decomposed_rel_pos_bias`` of the queries and the two tables, evaluated in forward on the
real ``q`` (bitwise the stock output) and again in backward on the dequantized ``q``
(``nn/sdpa_query_bias.py``). Nothing of size N x N is kept.

Only the fused rel-pos path is changed. The explicit path (``fused_attn=False``) and the rope
variant run the stock forward under the generic routing, as before the swap.
"""
from __future__ import annotations

import functools

import torch
from timm.models.vision_transformer_sam import Attention as _SamAttention, get_decomposed_rel_pos_bias

from mesa_train.nn import QueryBias
from mesa_train.patch.generic_attention import capture_calls, is_generic_attention

__all__ = ["MesaSamAttention", "STOCK_SAM_CLASSES", "swap_sam_attention"]


def _rel_pos_bias(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor, *, size) -> torch.Tensor:
    """timm's bias of a self-attention over a ``size`` grid (queries and keys on the same grid)."""
    return get_decomposed_rel_pos_bias(q, rel_pos_h, rel_pos_w, size, size)


class MesaSamAttention(_SamAttention):
    """``vision_transformer_sam.Attention`` whose fused rel-pos call keeps no N x N bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.use_rel_pos and self.fused_attn):
            with capture_calls(self):  # the generic routing, as the other SAM paths had it
                return super().forward(x)
        # the stock forward (timm 1.0.31), its rel-pos bias handed over as a QueryBias
        B, H, W, _ = x.shape
        N = H * W
        x = x.reshape(B, N, -1)
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, N, -1).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        bias = QueryBias(functools.partial(_rel_pos_bias, size=(H, W)), (self.rel_pos_h, self.rel_pos_w))
        x = self.mesa_sdpa(q, k, v, dropout_p=self.attn_drop.p if self.training else 0., query_bias=bias)
        x = x.view(B, self.num_heads, N, -1).transpose(1, 2).reshape(B, N, -1)
        x = self.proj(x)
        x = self.proj_drop(x)
        x = x.view(B, H, W, -1)
        return x


STOCK_SAM_CLASSES = {MesaSamAttention: _SamAttention}


def swap_sam_attention(module) -> bool:
    """Swap a SAM attention the generic routing gave a ``mesa_sdpa`` child (op ``sdpa``) for
    :class:`MesaSamAttention`; its forward enters the generic routing itself where it still
    needs it, so the instance's capturing forward is dropped. Returns whether it swapped."""
    if type(module) is not _SamAttention or not is_generic_attention(module):
        return False
    if not module.use_rel_pos or "mesa_sdpa" not in module._modules:
        return False
    module.__class__ = MesaSamAttention
    module.__dict__.pop("forward", None)
    return True
