"""torchvision MaxViT's ``RelativePositionalMultiHeadAttention``, installed by class swap.

Its products are einsums (``"B G H I D, B G H J D -> B G H I J"`` and back), which the generic
routing does not take (one shared ``Einsum`` child would mix the two products' estimates), so
the module was reported and kept whole: 0.107 of ``maxvit_t``'s stock bytes. The swapped
forward is torchvision's line for line (``tests/test_torchvision_blocks.py`` pins it to the
installed source) but for three children, each the Mesa layer of the stock call:

``mesa_qk``       ``torch.einsum(q k)`` (Mesa ``Einsum``: int8 ``q`` and ``k``), built with ``matmul``
``mesa_softmax``  ``F.softmax(dot_prod + pos_bias, dim=-1)`` (Mesa ``Softmax``: int8 map), with ``softmax``
``mesa_av``       ``torch.einsum(attn v)`` (Mesa ``Einsum``: int8 map and ``v``), with ``matmul``

The softmax not asked for is the stock call (``PlainSoftmax``); ``softmax`` alone does not swap
a stock module (its Mesa copy would sit beside the stock product's full map), so the products
are always compressed; it is remembered, with its options, and a later ``patch_model`` call with
``matmul`` adds the Mesa softmax too (per-op settings: softmax first, then matmul). The
groups are the layers' own: ``Einsum`` along dim 1 (the windows), the 5-D softmax along the last
dim, not per head (gradients at cosine >= 0.9999 to stock's all the same). The map's two
int8 copies (the softmax's and the product's) are not shared: ``Einsum`` groups along dim 1
(the windows of these 5-D tensors), the softmax along the last.
"""
from __future__ import annotations

import torch
from torch import nn
from torchvision.models.maxvit import RelativePositionalMultiHeadAttention as _MaxVitAttention

import mesa_train.nn as mnn

from .attention import PlainSoftmax

__all__ = ["MAXVIT_ATTENTION_CLASSES", "MesaMaxVitAttention", "install"]


class MesaMaxVitAttention(_MaxVitAttention):
    """torchvision MaxViT's attention with its core through Mesa children (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, G, P, D = x.shape
        H, DH = self.n_heads, self.head_dim

        qkv = self.to_qkv(x)
        q, k, v = torch.chunk(qkv, 3, dim=-1)

        q = q.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4)
        k = k.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4)
        v = v.reshape(B, G, P, H, DH).permute(0, 1, 3, 2, 4)

        k = k * self.scale_factor
        dot_prod = self.mesa_qk("B G H I D, B G H J D -> B G H I J", q, k)
        pos_bias = self.get_relative_positional_bias()

        dot_prod = self.mesa_softmax(dot_prod + pos_bias)

        out = self.mesa_av("B G H I J, B G H J D -> B G H I D", dot_prod, v)
        out = out.permute(0, 1, 3, 2, 4).reshape(B, G, P, D)

        out = self.merge(out)
        return out


MAXVIT_ATTENTION_CLASSES = (_MaxVitAttention, MesaMaxVitAttention)
# on a stock module asked for softmax alone: that call's options, for the call that brings matmul
PENDING_SOFTMAX = "_mesa_pending_softmax"


def install(m: nn.Module, ops, device, options: dict) -> bool:
    """Swap ``m`` for :class:`MesaMaxVitAttention` with the children ``ops`` ask for (module
    doc); False (nothing done) for a stock module without ``matmul`` among them: a Mesa
    softmax beside a stock ``attn @ v`` einsum, which keeps the map whole, only adds its codes
    (reported as not reached, as before)."""
    if type(m) not in MAXVIT_ATTENTION_CLASSES or not ({"matmul", "softmax"} & set(ops)):
        return False
    if type(m) is not MesaMaxVitAttention and "matmul" not in ops:
        # remembered with its options: a later call with matmul (per-op settings) adds it
        m.__dict__[PENDING_SOFTMAX] = dict(options)
        return False
    opts = dict(options, num_groups=m.n_heads)
    for name in ("mesa_qk", "mesa_av"):  # (a stock module is swapped with matmul only: they are there after)
        if not isinstance(m._modules.get(name), mnn.Einsum):
            m.add_module(name, mnn.Einsum(device=device, **opts))
    pending = m.__dict__.pop(PENDING_SOFTMAX, None)
    if "softmax" not in ops and pending is not None:
        ops, opts_softmax = (*ops, "softmax"), dict(pending, num_groups=m.n_heads)
    else:
        opts_softmax = opts
    if "softmax" in ops and not isinstance(m._modules.get("mesa_softmax"), mnn.Softmax):
        m.add_module("mesa_softmax", mnn.Softmax(dim=-1, device=device, **opts_softmax))
    elif "mesa_softmax" not in m._modules:
        m.add_module("mesa_softmax", PlainSoftmax(-1))
    m.__class__ = MesaMaxVitAttention
    return True
