"""Mesa forwards for timm's MLPs, installed like the attention ones (``attention.py``).

Plain ``Mlp`` (``fc1, act, drop1, norm, fc2``) and PVT-v2's ``MlpWithDepthwiseConv`` (``fc1,
dwconv, act, drop, fc2``): :class:`MesaMlp` / :class:`MesaMlpWithDepthwiseConv` run
``fc2(act(h))`` as one Function keeping a single 8-bit copy of ``h`` for both backward passes
(:func:`mesa_train.nn.gelu_linear.gelu_linear`; ``patch_model(mlp="shared")``, the default)
where the act is a Mesa ``GELU``, ``fc2`` a Mesa ``Linear`` and nothing runs between them;
otherwise they are the stock forward line for line.

Gated MLPs (``SwiGLU``, ``GluMlp``, Gemma 4's ``Gemma4GatedMlp``: ``gemma4.py``), installed like the
attention ones (``attention.py``): the instance's class is swapped for a subclass whose
forward is the stock one line for line, except that ``act(gate) * x`` runs through a
``gated`` child (:class:`mesa_train.nn.GatedActivation`, 8-bit gate and value). The
Linear children (``fc1_g``/``fc1_x``/``fc1``, ``fc2``) and norms are converted by the
ordinary leaf conversion; the MLP's ``act`` is not (``gated`` runs it), so it stays stock.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn
from timm.layers.mlp import GlobalResponseNormMlp as _GrnMlp, GluMlp as _GluMlp, Mlp as _Mlp, SwiGLU as _SwiGLU
from timm.models.pvt_v2 import MlpWithDepthwiseConv as _MlpWithDepthwiseConv

from mesa_train.nn.gelu_linear import can_fuse, gelu_linear
from .gemma4 import GATED_MLP_CLASSES as GEMMA4_GATED_MLP_CLASSES
from mesa_train.nn.layernorm_linear import can_fuse_norm, layernorm_linear, layernorm_linears

__all__ = ["MesaSwiGLU", "MesaGluMlp", "MesaMlp", "MesaMlpWithDepthwiseConv", "MLP_CLASSES", "STOCK_MLP_CLASSES",
           "SHARED_MLP_CLASSES", "STOCK_SHARED_MLP_CLASSES", "NORM_MLP_CLASSES", "NORM_ONLY_MLP_CLASSES",
           "MesaGlobalResponseNormMlp", "MLP_COPIES"]

# patch_model(mlp=...): "shared": fc2 takes its weight gradient from the GELU's copy of h;
# "separate": each layer keeps its own copy (the paper's layers)
MLP_COPIES = ("shared", "separate")


def _act_to_fc2(mlp, h: torch.Tensor, drop, norm=None) -> torch.Tensor:
    """``mlp.fc2(norm(drop(mlp.act(h))))``: one Function keeping one copy of ``h`` where it
    can (``can_fuse``; ``mesa_shared = False`` on the instance: never), else the stock lines."""
    act, fc2 = mlp.act, mlp.fc2  # (once: each read is nn.Module.__getattr__, a slow path)
    if getattr(mlp, "mesa_shared", True) and can_fuse(act, drop, norm, fc2, h):
        return gelu_linear(h, act, fc2)
    return _norm_to_fc2(mlp, drop(act(h)), norm)


def _norm_to_fc2(mlp, h: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
    """``mlp.fc2(norm(h))``; where the MLP has a norm of its own before fc2 (timm's
    ``scale_mlp``: EVA-02's SwiGLU, ``Mlp(norm_layer=...)``) and it is a Mesa LayerNorm, one
    Function keeping the norm's copy for both (``mesa_norm_shared``, ``norm_linear``)."""
    if norm is not None and mlp.mesa_norm_shared and can_fuse_norm(norm, mlp.fc2, h):
        return layernorm_linear(h, norm, mlp.fc2)
    if norm is not None:
        h = norm(h)
    return mlp.fc2(h)


def _norm_to_fcs(mlp, x: torch.Tensor, pre_norm: Optional[nn.Module]) -> Tuple[torch.Tensor, ...]:
    """``fc(x)`` for each of the MLP's first Linears (``mesa_norm_fcs``: ``fc1``, or a SwiGLU's
    ``fc1_g`` and ``fc1_x``), or with ``pre_norm`` (``x`` before the block's norm:
    ``patch/block.py``) ``fc(pre_norm(x))``, all keeping the norm's 8-bit copy where they can
    (``can_fuse_norm``)."""
    fcs = [getattr(mlp, name) for name in mlp.mesa_norm_fcs]
    if pre_norm is None:
        return tuple(fc(x) for fc in fcs)
    if all(can_fuse_norm(pre_norm, fc, x) for fc in fcs):
        return layernorm_linears(x, pre_norm, fcs)
    y = pre_norm(x)
    return tuple(fc(y) for fc in fcs)


class MesaMlp(_Mlp):
    """timm ``Mlp`` whose ``fc2(act(h))`` keeps one 8-bit copy (module doc)."""

    mesa_norm_fcs = ("fc1",)  # the Linears that can take the block norm's copy (pre_norm=)
    mesa_norm_shared = True  # False (norm_linear="separate"): its own norm before fc2 keeps its copy

    def forward(self, x: torch.Tensor, pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``pre_norm``: ``x`` is the block's input before its norm (``patch/block.py``), and
        ``fc1(pre_norm(x))`` keeps one 8-bit copy where it can (``can_fuse_norm``)."""
        x, = _norm_to_fcs(self, x, pre_norm)
        x = _act_to_fc2(self, x, self.drop1, self.norm)
        x = self.drop2(x)
        return x


class MesaMlpWithDepthwiseConv(_MlpWithDepthwiseConv):
    """timm PVT-v2 ``MlpWithDepthwiseConv`` whose ``fc2(act(h))`` keeps one 8-bit copy, of the
    depthwise conv's output ``h`` (module doc)."""

    mesa_norm_fcs = ("fc1",)
    mesa_norm_shared = True

    def forward(self, x: torch.Tensor, feat_size: List[int], pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        x, = _norm_to_fcs(self, x, pre_norm)
        B, N, C = x.shape
        x = x.transpose(1, 2).view(B, C, feat_size[0], feat_size[1])
        x = self.relu(x)
        x = self.dwconv(x)
        x = x.flatten(2).transpose(1, 2)
        x = _act_to_fc2(self, x, self.drop)
        x = self.drop(x)
        return x


class MesaSwiGLU(_SwiGLU):
    mesa_norm_fcs = ("fc1_g", "fc1_x")  # both read the block norm's output: one copy for three
    mesa_norm_shared = True

    def forward(self, x: torch.Tensor, pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        x_gate, x = _norm_to_fcs(self, x, pre_norm)
        x = self.gated(x_gate, x)
        x = _norm_to_fc2(self, self.drop1(x), self.norm)
        x = self.drop2(x)
        return x


class MesaGluMlp(_GluMlp):
    mesa_norm_fcs = ("fc1",)
    mesa_norm_shared = True

    def forward(self, x: torch.Tensor, pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        x, = _norm_to_fcs(self, x, pre_norm)
        x1, x2 = x.chunk(2, dim=self.chunk_dim)
        x = self.gated(x2, x1) if self.gate_last else self.gated(x1, x2)
        x = _norm_to_fc2(self, self.drop1(x), self.norm)
        x = self.drop2(x)
        return x


class MesaGlobalResponseNormMlp(_GrnMlp):
    """timm ``GlobalResponseNormMlp`` (ConvNeXt-V2 with Linear MLPs) whose fc1 can take the
    block norm's copy (``pre_norm=``); otherwise the stock forward line for line."""

    mesa_norm_fcs = ("fc1",)
    mesa_norm_shared = True

    def forward(self, x: torch.Tensor, pre_norm: Optional[nn.Module] = None) -> torch.Tensor:
        x, = _norm_to_fcs(self, x, pre_norm)
        x = self.act(x)
        x = self.drop1(x)
        x = self.grn(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


MLP_CLASSES = {_SwiGLU: MesaSwiGLU, _GluMlp: MesaGluMlp, **GEMMA4_GATED_MLP_CLASSES}
STOCK_MLP_CLASSES = {v: k for k, v in MLP_CLASSES.items()}
SHARED_MLP_CLASSES = {_Mlp: MesaMlp, _MlpWithDepthwiseConv: MesaMlpWithDepthwiseConv}
STOCK_SHARED_MLP_CLASSES = {v: k for k, v in SHARED_MLP_CLASSES.items()}
# the Mesa MLPs that take ``pre_norm=`` (a block's norm to run with their first Linears)
NORM_MLP_CLASSES = (MesaMlp, MesaMlpWithDepthwiseConv, MesaSwiGLU, MesaGluMlp, MesaGlobalResponseNormMlp)
# MLPs swapped only for the norm's sharing (patch/block.py; no GELU + fc2 pair: GRN between)
NORM_ONLY_MLP_CLASSES = {_GrnMlp: MesaGlobalResponseNormMlp}
