"""Blocks whose LayerNorms hand their 8-bit copy to the Linear after them, keeping one copy,
the norm's ``x_hat``, instead of two (``patch_model(norm_linear="shared")``, the default;
mesa_train/nn/layernorm_linear.py):

- timm's ViT ``Block`` (ViT, DeiT, DeiT3, ...): ``norm1 -> attn.qkv`` and ``norm2 -> mlp.fc1``;
- the blocks of Swin, PVT-v2, BEiT, EVA, CaiT and XCiT: ``norm2 -> mlp.fc1`` (their ``norm1``
  is followed by a window partition, by two consumers, or by an attention reached
  generically, whose Linear calls are not the block's);
- ConvNeXt's (``patch/convnext.py``): ``norm -> mlp.fc1`` where the MLP is Linear.

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

from typing import List, Optional, Tuple

import torch
from timm.models.beit import Block as _BeitBlock
from timm.models.cait import LayerScaleBlock as _CaitBlock
from timm.models.eva import EvaBlock as _EvaBlock
from timm.models.pvt_v2 import Block as _PvtBlock
from timm.models.swin_transformer import SwinTransformerBlock as _SwinBlock
from timm.models.vision_transformer import Block as _Block
from timm.models.xcit import XCABlock as _XcitBlock
from torch import nn

from mesa_train.nn.layernorm_linear import norm_pair_fits, plain_call

from .attention import MesaViTAttention
from .convnext import CONVNEXT_CLASSES
from .mlp import NORM_MLP_CLASSES
from .norm_share import NormSharingBlock, mlp_after_norm

__all__ = ["MesaViTBlock", "MesaSwinBlock", "MesaPvtV2Block", "MesaBeitBlock", "MesaEvaBlock", "MesaCaitBlock",
           "MesaXcitBlock", "BLOCK_CLASSES", "STOCK_BLOCK_CLASSES", "NORM_LINEAR_COPIES", "norm_fed_linears",
           "norm_fed_ids"]

# patch_model(norm_linear=...): "shared": qkv / fc1 take their weight gradient from the
# norm's copy; "separate": each layer keeps its own copy (the paper's layers)
NORM_LINEAR_COPIES = ("shared", "separate")


class MesaViTBlock(NormSharingBlock, _Block):
    """timm ViT ``Block`` whose norms share their copy with qkv and fc1 (module doc)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        attn = self.attn  # (once: each read is nn.Module.__getattr__, a slow path)
        if self.mesa_norm_shared and type(attn) is MesaViTAttention and plain_call(attn):
            y = attn(x, attn_mask=attn_mask, is_causal=is_causal, pre_norm=self.norm1)
        else:
            y = attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(mlp_after_norm(self, x)))
        return x

    def mesa_norm_pairs(self) -> List[Tuple[nn.Module, nn.Module]]:
        attn = self.attn
        pairs = super().mesa_norm_pairs()
        if type(attn) is MesaViTAttention and attn.mesa_attn_path != "stock" and attn.gate is None:
            pairs.insert(0, (self.norm1, attn.qkv))
        return pairs


class MesaSwinBlock(NormSharingBlock, _SwinBlock):
    """timm Swin block whose ``norm2`` shares its copy with ``mlp.fc1`` (``norm1`` is followed
    by the window shift, padding and partition, not by qkv: it keeps its own copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x + self.drop_path1(self._attn(self.norm1(x)))
        x = x.reshape(B, -1, C)
        x = x + self.drop_path2(mlp_after_norm(self, x))
        x = x.reshape(B, H, W, C)
        return x


class MesaPvtV2Block(NormSharingBlock, _PvtBlock):
    """timm PVT-v2 block whose ``norm2`` shares its copy with ``mlp.fc1`` (``norm1`` feeds
    both ``q`` and the spatial reduction: it keeps its own copy)."""

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(mlp_after_norm(self, x, feat_size))
        return x


class MesaBeitBlock(NormSharingBlock, _BeitBlock):
    """timm BEiT block whose ``norm2`` shares its copy with ``mlp.fc1`` (its attention builds
    qkv with ``F.linear`` and a concatenated bias: reached generically, own copy)."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.gamma_1 is None:
            x = x + self.drop_path1(self.attn(self.norm1(x), shared_rel_pos_bias=shared_rel_pos_bias))
            x = x + self.drop_path2(mlp_after_norm(self, x))
        else:
            x = x + self.drop_path1(self.gamma_1 * self.attn(self.norm1(x), shared_rel_pos_bias=shared_rel_pos_bias))
            x = x + self.drop_path2(self.gamma_2 * mlp_after_norm(self, x))
        return x


class MesaEvaBlock(NormSharingBlock, _EvaBlock):
    """timm EVA block (EVA, DINOv3, PE, ...) whose ``norm2`` shares its copy with
    ``mlp.fc1`` where the MLP is a plain ``Mlp`` (a SwiGLU / GluMlp keeps its own copies)."""

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        x_attn = self.attn(self.norm1(x), rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        if self.gamma_1 is not None:
            x_attn = self.gamma_1 * x_attn
        x = x + self.drop_path1(x_attn)
        x_mlp = mlp_after_norm(self, x)
        if self.gamma_2 is not None:
            x_mlp = self.gamma_2 * x_mlp
        x = x + self.drop_path2(x_mlp)
        return x


class MesaCaitBlock(NormSharingBlock, _CaitBlock):
    """timm CaiT ``LayerScaleBlock`` whose ``norm2`` shares its copy with ``mlp.fc1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.gamma_1 * self.attn(self.norm1(x)))
        x = x + self.drop_path(self.gamma_2 * mlp_after_norm(self, x))
        return x


class MesaXcitBlock(NormSharingBlock, _XcitBlock):
    """timm XCiT ``XCABlock`` whose ``norm2`` shares its copy with ``mlp.fc1``."""

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        x = x + self.drop_path1(self.gamma1 * self.attn(self.norm1(x)))
        # timm's order (3 then 2), kept for the checkpoints' sake
        x = x + self.drop_path3(self.gamma3 * self.local_mp(self.norm3(x), H, W))
        x = x + self.drop_path2(self.gamma2 * mlp_after_norm(self, x))
        return x


def norm_fed_linears(module: nn.Module) -> List[nn.Module]:
    """The Linears that ``module`` (a Mesa block, or a Mesa MLP with a norm of its own before
    fc2) runs as one Function with the norm before them when it trains (the static
    conditions: block, attention path, ``norm_pair_fits``; for ``describe``)."""
    if type(module) in NORM_MLP_CLASSES and module.mesa_norm_shared:
        pairs = [(getattr(module, "norm", None), module.fc2)]
    elif type(module) in STOCK_BLOCK_CLASSES and module.mesa_norm_shared:
        pairs = module.mesa_norm_pairs()
    else:
        return []
    return [fc for norm, fc in pairs if norm_pair_fits(norm, fc)]


def norm_fed_ids(root: nn.Module) -> set:
    """``id()`` of every Linear under ``root`` that :func:`norm_fed_linears` names."""
    return {id(fc) for block in root.modules() for fc in norm_fed_linears(block)}


BLOCK_CLASSES = {_Block: MesaViTBlock, _SwinBlock: MesaSwinBlock, _PvtBlock: MesaPvtV2Block,
                 _BeitBlock: MesaBeitBlock, _EvaBlock: MesaEvaBlock, _CaitBlock: MesaCaitBlock,
                 _XcitBlock: MesaXcitBlock, **CONVNEXT_CLASSES}
STOCK_BLOCK_CLASSES = {v: k for k, v in BLOCK_CLASSES.items()}
