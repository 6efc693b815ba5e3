"""timm's ``ConvNeXtBlock`` as a Mesa block (a class swap, like the MLPs in ``mlp.py``;
parameters and state_dict keys unchanged, plus the child's estimates). Two things differ
from the stock forward, which it otherwise follows line for line:

- **Layer scale in 8 bits.** The stock block multiplies its branch by
  ``self.gamma.reshape(1, -1, 1, 1)`` inline (NCHW, one value per channel), which stock
  autograd pays for with the branch output in full precision (``dgamma = sum(g * x)`` over
  N, H, W): a fifth of what a patched ConvNeXt still kept. With the ``layerscale`` op that
  product runs through a ``ChannelScale`` child, ``mesa_scale_gamma``, which keeps ``x`` as
  8-bit codes with channel groups over dim 1 (its per-head form, ``nn/layerscale.py``) and
  sums ``dgamma`` to ``(1, C, 1, 1)`` (the same ``x * gamma`` multiplication).
- **The norm shares its copy with fc1** (``norm_linear="shared"``, ``patch/norm_share.py``):
  where the MLP is Linear (``conv_mlp=False``: ConvNeXt-T and up; the small variants use
  1x1 convolutions), ``mlp.fc1(norm(x))`` keeps the norm's ``x_hat`` only.

InceptionNeXt's ``MetaNeXtBlock`` scales its branch the same way and gets the same child
(session 78; its norm is a BatchNorm, nothing shared).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from timm.models.convnext import ConvNeXtBlock as _ConvNeXtBlock
from timm.models.inception_next import MetaNeXtBlock as _MetaNeXtBlock
from torch import nn

from .norm_share import NormSharingBlock, mlp_after_norm

__all__ = ["MesaConvNeXtBlock", "MesaMetaNeXtBlock", "CONVNEXT_CLASSES", "SCALED_BLOCK_CLASSES",
           "STOCK_SCALED_BLOCK_CLASSES", "SCALE_CHILD"]

SCALE_CHILD = "mesa_scale_gamma"


class MesaConvNeXtBlock(NormSharingBlock, _ConvNeXtBlock):
    """timm ``ConvNeXtBlock`` with an 8-bit layer scale and/or a norm sharing fc1's copy
    (module doc)."""

    mesa_mlp_norm = "norm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x)
        if self.use_conv_mlp:
            x = self.norm(x)
            x = self.mlp(x)
        else:
            x = x.permute(0, 2, 3, 1)
            x = mlp_after_norm(self, x)
            x = x.permute(0, 3, 1, 2)
        if self.gamma is not None:
            if SCALE_CHILD in self._modules:
                x = self._modules[SCALE_CHILD](x, self.gamma.reshape(1, -1, 1, 1))
            else:
                x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        x = self.drop_path(x) + self.shortcut(shortcut)
        return x

    def mesa_norm_pairs(self) -> List[Tuple[nn.Module, nn.Module]]:
        return [] if self.use_conv_mlp else super().mesa_norm_pairs()


class MesaMetaNeXtBlock(_MetaNeXtBlock):
    """InceptionNeXt's ``MetaNeXtBlock``: the same inline ``x.mul(self.gamma.reshape(1, -1, 1, 1))``
    through the ``ChannelScale`` child (it kept the MLP's output whole without a word)."""

    def forward(self, x):
        shortcut = x
        x = self.token_mixer(x)
        x = self.norm(x)
        x = self.mlp(x)
        if self.gamma is not None:
            if SCALE_CHILD in self._modules:
                x = self._modules[SCALE_CHILD](x, self.gamma.reshape(1, -1, 1, 1))
            else:
                x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        x = self.drop_path(x) + shortcut
        return x


# the blocks whose norm shares fc1's copy (patch/block.py: norm-sharing blocks), and all the
# blocks with the inline layer-scale swap (core._patch_inline_scales)
CONVNEXT_CLASSES = {_ConvNeXtBlock: MesaConvNeXtBlock}
SCALED_BLOCK_CLASSES = {**CONVNEXT_CLASSES, _MetaNeXtBlock: MesaMetaNeXtBlock}
STOCK_SCALED_BLOCK_CLASSES = {v: k for k, v in SCALED_BLOCK_CLASSES.items()}
