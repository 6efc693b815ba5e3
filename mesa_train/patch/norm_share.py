"""What every block that shares a LayerNorm's copy with the Linear after it has in common
(``patch/block.py``, ``patch/convnext.py``): the ``mesa_norm_shared`` switch, the MLP half
``mlp(norm(x))`` run with ``pre_norm=``, and the static list of pairs ``describe`` reports."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from mesa_train.nn.layernorm_linear import plain_call

from .mlp import NORM_MLP_CLASSES as NORM_MLPS  # the Mesa MLPs that take pre_norm

__all__ = ["NormSharingBlock", "mlp_after_norm", "NORM_MLPS"]


class NormSharingBlock:
    """Mixin of the Mesa block classes (listed first in their bases; no state of its own).

    ``mesa_norm_shared``: ``False`` (``norm_linear="separate"``) runs the stock lines.
    ``mesa_mlp_norm``: the name of the norm before the MLP (timm: ``norm2``; ConvNeXt:
    ``norm``)."""

    mesa_norm_shared: bool = True
    mesa_mlp_norm: str = "norm2"

    def mesa_norm_pairs(self) -> List[Tuple[nn.Module, nn.Module]]:
        """(norm, Linear) pairs this block runs as one Function when both are Mesa layers
        that fit (``norm_pair_fits`` is checked by the caller)."""
        mlp = getattr(self, "mlp", None)
        if type(mlp) in NORM_MLPS:
            return [(getattr(self, self.mesa_mlp_norm), getattr(mlp, name)) for name in mlp.mesa_norm_fcs]
        return []


def mlp_after_norm(block: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
    """``block.mlp(norm(x), *args)`` (``norm``: the block's ``mesa_mlp_norm``), fc1 taking the
    norm's copy where it can (the MLP checks ``can_fuse_norm`` at every call)."""
    norm, mlp = getattr(block, block.mesa_mlp_norm), block.mlp
    if block.mesa_norm_shared and type(mlp) in NORM_MLPS and plain_call(mlp):
        return mlp(x, *args, pre_norm=norm)
    return mlp(norm(x), *args)
