"""Blocks whose LayerNorms hand their 8-bit copy to the Linear after them, keeping one copy,
the norm's ``x_hat``, instead of two (``patch_model(norm_linear="shared")``, the default;
mesa_train/nn/layernorm_linear.py): timm's ViT ``Block`` (ViT, DeiT, DeiT3, ...) for
``norm1 -> attn.qkv`` and ``norm2 -> mlp.fc1``; Swin's and PVT-v2's blocks for ``norm2 ->
mlp.fc1`` (their ``norm1`` is followed by the window partition / by two consumers).

Each is a class swap like the MLPs' (``mlp.py``): parameters, children and
state_dict keys unchanged. Its forward is the stock one line for line, except that the
attention (a ``MesaViTAttention``) and the MLP (a ``MesaMlp``) get the block's input with the
norm to apply (``pre_norm=``), and run ``Linear(norm(x))`` as one Function where
``can_fuse_norm`` says so, else the norm first (the stock order). The choice is made at every
call, so torch.compile guards on it. ``mesa_norm_shared = False`` on the block (what
``norm_linear="separate"`` sets) runs the stock lines.

A forward hook (or backward hook) on the attention or MLP that could read their arguments
would see the un-normalised input: the block then calls them stock-wise. Hooks that read
nothing (``SavedTensorMeter``'s, marked ``mesa_input_agnostic``) do not count.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from timm.models.pvt_v2 import Block as _PvtBlock
from timm.models.swin_transformer import SwinTransformerBlock as _SwinBlock
from timm.models.vision_transformer import Block as _Block
from torch import nn

from mesa_train.nn.layernorm_linear import norm_pair_fits, plain_call

from .attention import MesaViTAttention
from .mlp import STOCK_SHARED_MLP_CLASSES as NORM_MLPS  # MesaMlp, MesaMlpWithDepthwiseConv: take pre_norm

__all__ = ["MesaViTBlock", "MesaSwinBlock", "MesaPvtV2Block", "BLOCK_CLASSES", "STOCK_BLOCK_CLASSES",
           "NORM_LINEAR_COPIES", "norm_fed_linears", "norm_fed_ids"]

# patch_model(norm_linear=...): "shared": qkv / fc1 take their weight gradient from the
# norm's copy; "separate": each layer keeps its own copy (the paper's layers)
NORM_LINEAR_COPIES = ("shared", "separate")


def _mlp_after_norm(block: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
    """``block.mlp(block.norm2(x), *args)``, fc1 taking norm2's copy where it can."""
    if block.mesa_norm_shared and type(block.mlp) in NORM_MLPS and plain_call(block.mlp):
        return block.mlp(x, *args, pre_norm=block.norm2)
    return block.mlp(block.norm2(x), *args)


class MesaViTBlock(_Block):
    """timm ViT ``Block`` whose norms share their copy with qkv and fc1 (module doc)."""

    mesa_norm_shared: bool = True

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if self.mesa_norm_shared and type(self.attn) is MesaViTAttention and plain_call(self.attn):
            y = self.attn(x, attn_mask=attn_mask, is_causal=is_causal, pre_norm=self.norm1)
        else:
            y = self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(_mlp_after_norm(self, x)))
        return x


class MesaSwinBlock(_SwinBlock):
    """timm Swin block whose ``norm2`` shares its copy with ``mlp.fc1`` (``norm1`` is followed
    by the window shift, padding and partition, not by qkv: it keeps its own copy)."""

    mesa_norm_shared: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x + self.drop_path1(self._attn(self.norm1(x)))
        x = x.reshape(B, -1, C)
        x = x + self.drop_path2(_mlp_after_norm(self, x))
        x = x.reshape(B, H, W, C)
        return x


class MesaPvtV2Block(_PvtBlock):
    """timm PVT-v2 block whose ``norm2`` shares its copy with ``mlp.fc1`` (``norm1`` feeds
    both ``q`` and the spatial reduction: it keeps its own copy)."""

    mesa_norm_shared: bool = True

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(_mlp_after_norm(self, x, feat_size))
        return x


def norm_fed_linears(block: nn.Module) -> List[nn.Module]:
    """The Linears of ``block`` that take their input from a norm's copy when it trains (the
    static conditions: block, attention path, ``norm_pair_fits``; for ``describe``)."""
    if type(block) not in STOCK_BLOCK_CLASSES or not block.mesa_norm_shared:
        return []
    pairs = []
    attn, mlp = block.attn, block.mlp
    if type(block) is MesaViTBlock and type(attn) is MesaViTAttention and attn.mesa_attn_path != "stock" \
            and attn.gate is None:
        pairs.append((block.norm1, attn.qkv))
    if type(mlp) in NORM_MLPS:
        pairs.append((block.norm2, mlp.fc1))
    return [fc for norm, fc in pairs if norm_pair_fits(norm, fc)]


def norm_fed_ids(root: nn.Module) -> set:
    """``id()`` of every Linear under ``root`` that :func:`norm_fed_linears` names."""
    return {id(fc) for block in root.modules() for fc in norm_fed_linears(block)}


BLOCK_CLASSES = {_Block: MesaViTBlock, _SwinBlock: MesaSwinBlock, _PvtBlock: MesaPvtV2Block}
STOCK_BLOCK_CLASSES = {v: k for k, v in BLOCK_CLASSES.items()}
