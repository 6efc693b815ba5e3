"""Mesa forwards for timm's MLPs, installed like the attention ones (``attention.py``).

Plain ``Mlp`` (``fc1, act, drop1, norm, fc2``) and PVT-v2's ``MlpWithDepthwiseConv`` (``fc1,
dwconv, act, drop, fc2``): :class:`MesaMlp` / :class:`MesaMlpWithDepthwiseConv` run
``fc2(act(h))`` as one Function keeping a single 8-bit copy of ``h`` for both backward passes
(:func:`mesa_train.nn.gelu_linear.gelu_linear`; ``patch_model(mlp="shared")``, the default)
where the act is a Mesa ``GELU``, ``fc2`` a Mesa ``Linear`` and nothing runs between them;
otherwise they are the stock forward line for line.

Gated MLPs (``SwiGLU``, ``GluMlp``), installed like the
attention ones (``attention.py``): the instance's class is swapped for a subclass whose
forward is the stock one line for line, except that ``act(gate) * x`` runs through a
``gated`` child (:class:`mesa_train.nn.GatedActivation`, 8-bit gate and value). The
Linear children (``fc1_g``/``fc1_x``/``fc1``, ``fc2``) and norms are converted by the
ordinary leaf conversion; the MLP's ``act`` is not (``gated`` runs it), so it stays stock.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn
from timm.layers.mlp import GluMlp as _GluMlp, Mlp as _Mlp, SwiGLU as _SwiGLU
from timm.models.pvt_v2 import MlpWithDepthwiseConv as _MlpWithDepthwiseConv

from mesa_train.nn.gelu_linear import can_fuse, gelu_linear
from mesa_train.nn.layernorm_linear import can_fuse_norm, layernorm_linear

__all__ = ["MesaSwiGLU", "MesaGluMlp", "MesaMlp", "MesaMlpWithDepthwiseConv", "MLP_CLASSES", "STOCK_MLP_CLASSES",
           "SHARED_MLP_CLASSES", "STOCK_SHARED_MLP_CLASSES", "MLP_COPIES"]

# patch_model(mlp=...): "shared": fc2 takes its weight gradient from the GELU's copy of h;
# "separate": each layer keeps its own copy (the paper's layers)
MLP_COPIES = ("shared", "separate")


def _act_to_fc2(mlp, h: torch.Tensor, drop, norm=None) -> torch.Tensor:
    """``mlp.fc2(norm(drop(mlp.act(h))))``: one Function keeping one copy of ``h`` where it
    can (``can_fuse``; ``mesa_shared = False`` on the instance: never), else the stock lines."""
    if getattr(mlp, "mesa_shared", True) and can_fuse(mlp.act, drop, norm, mlp.fc2, h):
        return gelu_linear(h, mlp.act, mlp.fc2)
    h = drop(mlp.act(h))
    if norm is not None:
        h = norm(h)
    return mlp.fc2(h)


def _norm_to_fc1(mlp, x: torch.Tensor, pre_norm: Optional[nn.Module]) -> torch.Tensor:
    """``mlp.fc1(x)``, or with ``pre_norm`` (``x`` before the block's norm: ``patch/block.py``)
    ``mlp.fc1(pre_norm(x))`` keeping one 8-bit copy where it can (``can_fuse_norm``)."""
    if pre_norm is None:
        return mlp.fc1(x)
    if can_fuse_norm(pre_norm, mlp.fc1, x):
        return layernorm_linear(x, pre_norm, mlp.fc1)
    return mlp.fc1(pre_norm(x))


class MesaMlp(_Mlp):
    """timm ``Mlp`` whose ``fc2(act(h))`` keeps one 8-bit copy (module doc)."""

    def forward(self, x: torch.Tensor, pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``pre_norm``: ``x`` is the block's input before its norm (``patch/block.py``), and
        ``fc1(pre_norm(x))`` keeps one 8-bit copy where it can (``can_fuse_norm``)."""
        x = _norm_to_fc1(self, x, pre_norm)
        x = _act_to_fc2(self, x, self.drop1, self.norm)
        x = self.drop2(x)
        return x


class MesaMlpWithDepthwiseConv(_MlpWithDepthwiseConv):
    """timm PVT-v2 ``MlpWithDepthwiseConv`` whose ``fc2(act(h))`` keeps one 8-bit copy, of the
    depthwise conv's output ``h`` (module doc)."""

    def forward(self, x: torch.Tensor, feat_size: List[int], pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        x = _norm_to_fc1(self, x, pre_norm)
        B, N, C = x.shape
        x = x.transpose(1, 2).view(B, C, feat_size[0], feat_size[1])
        x = self.relu(x)
        x = self.dwconv(x)
        x = x.flatten(2).transpose(1, 2)
        x = _act_to_fc2(self, x, self.drop)
        x = self.drop(x)
        return x


class MesaSwiGLU(_SwiGLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_gate = self.fc1_g(x)
        x = self.fc1_x(x)
        x = self.gated(x_gate, x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class MesaGluMlp(_GluMlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x1, x2 = x.chunk(2, dim=self.chunk_dim)
        x = self.gated(x2, x1) if self.gate_last else self.gated(x1, x2)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


MLP_CLASSES = {_SwiGLU: MesaSwiGLU, _GluMlp: MesaGluMlp}
STOCK_MLP_CLASSES = {v: k for k, v in MLP_CLASSES.items()}
SHARED_MLP_CLASSES = {_Mlp: MesaMlp, _MlpWithDepthwiseConv: MesaMlpWithDepthwiseConv}
STOCK_SHARED_MLP_CLASSES = {v: k for k, v in SHARED_MLP_CLASSES.items()}
