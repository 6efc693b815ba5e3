"""ConvNeXt's layer scale in 8 bits: timm's ``ConvNeXtBlock`` multiplies its branch by
``self.gamma.reshape(1, -1, 1, 1)`` inline (NCHW, one value per channel), which stock autograd
pays for with the branch output in full precision (``dgamma = sum(g * x)`` over N, H, W): a
fifth of what a patched ConvNeXt still kept. :class:`MesaConvNeXtBlock` (a class swap, like
the MLPs in ``mlp.py``; parameters and state_dict keys unchanged, plus the child's estimates)
runs that product through a ``ChannelScale`` child, ``mesa_scale_gamma``, which keeps ``x``
as 8-bit codes with channel groups over dim 1 (its per-head form, ``nn/layerscale.py``) and
sums ``dgamma`` to ``(1, C, 1, 1)``. The forward is the stock one line for line (the same
``x * gamma`` multiplication).
"""
from __future__ import annotations

import torch
from timm.models.convnext import ConvNeXtBlock as _ConvNeXtBlock

__all__ = ["MesaConvNeXtBlock", "CONVNEXT_CLASSES", "STOCK_CONVNEXT_CLASSES", "SCALE_CHILD"]

SCALE_CHILD = "mesa_scale_gamma"


class MesaConvNeXtBlock(_ConvNeXtBlock):
    """timm ``ConvNeXtBlock`` whose layer scale keeps its input in 8 bits (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x)
        if self.use_conv_mlp:
            x = self.norm(x)
            x = self.mlp(x)
        else:
            x = x.permute(0, 2, 3, 1)
            x = self.norm(x)
            x = self.mlp(x)
            x = x.permute(0, 3, 1, 2)
        if self.gamma is not None:
            x = self._modules[SCALE_CHILD](x, self.gamma.reshape(1, -1, 1, 1))
        x = self.drop_path(x) + self.shortcut(shortcut)
        return x


CONVNEXT_CLASSES = {_ConvNeXtBlock: MesaConvNeXtBlock}
STOCK_CONVNEXT_CLASSES = {v: k for k, v in CONVNEXT_CLASSES.items()}
