"""ConViT's gated positional self-attention (timm's ``GPSA``), installed by class swap.

timm's ``get_attention`` mixes two softmaxes per head by a learned gate and renormalises the
rows; stock autograd keeps four full-precision maps there plus a copy of the batch-expanded
relative positions (the generic attention routing reached only ``q @ k^T``, the patch softmax
and ``attn @ v``, and said that the positional softmax ran stock). ``MesaGPSA``'s forward and
``get_attention`` are timm's line for line (``tests/test_convit_gpsa.py`` pins them to the
installed timm's source) but for:

``mesa_qk``             ``q @ k.transpose(-2, -1)`` (Mesa ``MatMul``, int8 ``q`` and ``k``)
``mesa_gated_softmax``  both softmaxes, the gate and the renormalisation (Mesa
                        :class:`~mesa_train.nn.GatedPositionalSoftmax`: one int8 map kept,
                        the positional map recomputed from ``pos_proj``'s parameters)
``mesa_av``             ``attn @ v`` (Mesa ``MatMul``, int8 map and ``v``)

``pos_proj`` is called through ``mesa_gated_softmax`` with its parameters and stays a stock
``nn.Linear`` (its input is the expanded position table, which the layer does not keep; one
an earlier ``ops=["linear"]`` patch converted is turned back). A timm release whose
``get_attention`` computes the positional map otherwise is not swapped: the generic routing
takes the module as before. A checkpoint of the generic routing's children (before session
74) loads: its patch softmax's estimates become ``mesa_gated_softmax``'s, the positional
Linear's and the logit scale's are dropped.
"""
from __future__ import annotations

import inspect

import torch
from timm.models.convit import GPSA as _GPSA
from torch import nn

from mesa_train.nn.gated_softmax import GatedPositionalSoftmax
from mesa_train.nn.linear import Linear as MesaLinear
from mesa_train.nn.matmul import MatMul

from .checkpoint import rename_mesa_keys
from .generic_attention import GENERIC_ATTENTION_ATTR, SOFTMAX_ANY_DIM_ATTR

__all__ = ["GPSA_CLASSES", "MesaGPSA", "SWAPPABLE", "install", "stock_position_linears"]

_POSITIONAL_LINES = ("pos_score = self.rel_indices.expand(B, -1, -1, -1)",
                     "pos_score = self.pos_proj(pos_score).permute(0, 3, 1, 2)")
# whether the installed timm computes the positional map as nn/gated_softmax.py does
SWAPPABLE = all(line in inspect.getsource(_GPSA.get_attention) for line in _POSITIONAL_LINES)
_CHILD = "mesa_gated_softmax"
# the generic routing's children (before session 74) -> what became of their estimates
_OLD_KEYS = {"mesa_softmax.quantizer.": f"{_CHILD}.quantizer.", "mesa_logit_scale.quantizer.": None,
             "pos_proj.quantizer.": None}


class MesaGPSA(_GPSA):
    """timm's ``GPSA`` with its attention core through Mesa children (module doc)."""

    def forward(self, x):
        B, N, C = x.shape
        if self.rel_indices is None or self.rel_indices.shape[1] != N:
            self.rel_indices = self.get_rel_indices(N)
        attn = self.get_attention(x)
        v = self.v(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        x = self.mesa_av(attn, v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    def get_attention(self, x):
        B, N, C = x.shape
        qk = self.qk(x).reshape(B, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k = qk[0], qk[1]
        patch_score = self.mesa_qk(q, k.transpose(-2, -1)) * self.scale
        attn = self.mesa_gated_softmax(patch_score, self.rel_indices, self.pos_proj.weight, self.pos_proj.bias,
                                       self.gating_param)
        attn = self.attn_drop(attn)
        return attn

    # a checkpoint of the generic routing (module doc): its children's keys renamed or dropped,
    # here and where the trainer compares keys first (patch/checkpoint.py, upgrade_state_dict)
    mesa_key_upgrades = _OLD_KEYS

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        rename_mesa_keys(state_dict, prefix, _OLD_KEYS)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


GPSA_CLASSES = (_GPSA, MesaGPSA)


def _stock_linear(m: nn.Module) -> nn.Module:
    """A Mesa ``Linear`` turned back into a stock ``nn.Linear`` with the same Parameters."""
    if not isinstance(m, MesaLinear):
        return m
    stock = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    stock.weight, stock.bias = m.weight, m.bias
    return stock.train(m.training)


def install(m: _GPSA, matmul: bool, device, options: dict) -> bool:
    """Swap ``m`` (a stock ``GPSA``) for :class:`MesaGPSA` with its children; the ``MatMul``
    children compress their operands when ``matmul`` is asked for, else none (the stock
    products' operands, as stock keeps them). False where the installed timm's form is
    unknown (nothing done)."""
    if not SWAPPABLE or type(m) not in GPSA_CLASSES:
        return False
    operands = ("a", "b") if matmul else ()
    for name in ("mesa_qk", "mesa_av"):
        cur = m._modules.get(name)
        if not isinstance(cur, MatMul) or (matmul and cur.operands != operands):
            m.add_module(name, MatMul.from_module(cur, operands=operands, device=device, **options))
    if not isinstance(m._modules.get(_CHILD), GatedPositionalSoftmax):
        m.add_module(_CHILD, GatedPositionalSoftmax(device=device, **options))
    # (an earlier patch's generic routing: its capturing forward and the children this swap replaces)
    for stale in ("mesa_softmax", "mesa_logit_scale"):
        m._modules.pop(stale, None)
    for attr in ("forward", GENERIC_ATTENTION_ATTR, SOFTMAX_ANY_DIM_ATTR):
        m.__dict__.pop(attr, None)
    m.pos_proj = _stock_linear(m.pos_proj)
    m.__class__ = MesaGPSA
    return True


def stock_position_linears(root: torch.nn.Module) -> set:
    """The ids of the swapped modules' ``pos_proj``: called through ``mesa_gated_softmax``,
    left stock by the leaf conversion."""
    return {id(m.pos_proj) for m in root.modules() if type(m) is MesaGPSA}
