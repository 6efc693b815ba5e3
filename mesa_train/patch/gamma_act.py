"""NFNet's ``GammaAct`` (``act_fn(x).mul_(gamma)``: every activation of the ``dm_nfnet_*``,
``nfnet_*`` and ``nf_*`` models, the act a plain function from timm's ``get_act_fn``), swapped
like the squeeze-excite blocks (``squeeze_excite.py``): the activation runs through a Mesa
layer child, ``mesa_act``, then the same in-place ``mul_(gamma)`` (a Python float: autograd keeps
nothing for it).

Stock keeps the activation's full input (GELU's ``x``; ReLU's output), and neither a module rule
nor the functional scan saw it: on ``dm_nfnet_f0`` the activations are nearly all of what grows
with the batch. Only the functions whose Mesa layer computes the same bits are taken (timm's
``gelu`` / ``gelu_tanh`` are ``F.gelu``; torch's ``silu``, ``relu``, ``mish``, ``hardswish``);
another act type stays stock.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import activations as timm_acts
from timm.models.nfnet import GammaAct as _GammaAct
from torch import nn

import mesa_train.nn as mnn

__all__ = ["GAMMA_ACT_CHILD", "MesaGammaAct", "STOCK_GAMMA_ACT", "gamma_act_layer"]

GAMMA_ACT_CHILD = "mesa_act"
STOCK_GAMMA_ACT = _GammaAct


class MesaGammaAct(_GammaAct):
    """``GammaAct`` whose activation is the ``mesa_act`` child (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mesa_act(x)
        # Traced, out of place (the same bits; the compiler plans the buffers itself): torch 2.11's
        # Dynamo, the GPU image's, refuses mul_ on the output of the in-place Mesa ReLU's Function
        # (marked dirty: "a view ... of a function that returns multiple views"); 2.14 takes it
        return y * self.gamma if torch.compiler.is_compiling() else y.mul_(self.gamma)


# act function -> (op, Mesa layer built from (inplace, options)); the same bits as the function
_LAYERS: Dict[Callable, Tuple[str, Callable[..., nn.Module]]] = {
    timm_acts.gelu: ("gelu", lambda inplace, **o: mnn.GELU(**o)),
    timm_acts.gelu_tanh: ("gelu", lambda inplace, **o: mnn.GELU(approximate="tanh", **o)),
    F.gelu: ("gelu", lambda inplace, **o: mnn.GELU(**o)),
    F.silu: ("silu", lambda inplace, **o: mnn.SiLU(inplace, **o)),
    F.relu: ("relu", lambda inplace, **o: mnn.ReLU(inplace, **o)),
    F.mish: ("silu", lambda inplace, **o: mnn.Mish(inplace, **o)),
    F.hardswish: ("hardswish", lambda inplace, **o: mnn.Hardswish(inplace, **o)),
}


def gamma_act_layer(m: _GammaAct) -> Optional[Tuple[str, Callable[..., nn.Module]]]:
    """``(op, build(device=..., **options))`` for a stock ``GammaAct``'s activation, or None (an
    act function with no Mesa layer of the same bits)."""
    entry = _LAYERS.get(m.act_fn)
    if entry is None:
        return None
    op, make = entry
    return op, (lambda **options: make(m.inplace, **options))
