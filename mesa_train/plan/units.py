"""Plan units: the pieces of a model a plan compresses independently.

A *unit* is one transformer block (a module with ``attn`` and ``mlp`` children, found by
:func:`mesa_train.patch.rules.classify`), named by its qualified module name
(``blocks.0``, ``layers.1.blocks.0``), plus one unit for everything outside the blocks
(patch embedding, downsampling, final norm, head), named :data:`OTHER`. A unit is patched
by calling ``patch_model`` on the block itself (or on the model with ``modules=other``; every
module set in a model with no block, such as ConvNeXt, whose MLPs are outside any block),
so it gets exactly the layers, groups and options a whole-model patch would give it.

An *item* is one (unit, op) pair: the planner's decision variable. A block unit has one
more item, ``(block, "recompute")``: checkpoint the block instead of compressing in it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Tuple

from torch import nn

from mesa_train.models import unwrap_model
from mesa_train.patch.core import OPS, _leaf_rules, mesa_layer_op  # the rules patch_model applies
from mesa_train.patch.rules import classify, scan_functional_ops

__all__ = ["OTHER", "Unit", "find_units", "unit_ops", "fingerprint", "model_architecture"]

OTHER = "(other)"  # not a valid module name, so it cannot clash with one

# ops a block can compress, by attention path; the explicit path (softmax(q @ k^T) @ v)
# has matmul/softmax, the fused one sdpa (asking matmul/softmax there would switch it to
# the explicit path and store the attention map: more memory, not less)
_EXPLICIT_OPS = ("linear", "matmul", "softmax", "gelu", "layernorm", "conv", "relu")
_FUSED_OPS = ("linear", "gelu", "layernorm", "conv", "relu", "sdpa")
_OTHER_OPS = ("linear", "layernorm", "conv", "relu", "gelu")


@dataclass(frozen=True)
class Unit:
    name: str  # qualified block name, or OTHER
    ops: Tuple[str, ...]  # ops the planner may choose in this unit (those it contains)
    fingerprint: str  # hash of the unit's parameter names and shapes
    group: str  # units with the same group key are identical (profiled together)
    recomputable: bool = False  # a block: may be recomputed in backward instead (RECOMPUTE)


def _block_names(root: nn.Module) -> List[str]:
    info = classify(root)
    names: List[str] = []
    for mi in info.values():
        if mi.block is not None and mi.block not in names:
            names.append(mi.block)
    return names


def fingerprint(module: nn.Module, skip_prefixes: Tuple[str, ...] = ()) -> str:
    """Short hash of the module's class, parameter names and shapes (not values)."""
    h = hashlib.sha1(type(module).__name__.encode())
    for name, p in module.named_parameters():
        if any(name.startswith(s) for s in skip_prefixes):
            continue
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:10]


def _present_ops(modules, candidates: Tuple[str, ...]) -> Tuple[str, ...]:
    """Which of ``candidates`` the modules contain (as stock or Mesa layers)."""
    rules = _leaf_rules()
    found = set()
    for m in modules:
        op = mesa_layer_op(m) or (rules[type(m)][0] if type(m) in rules else None)
        if op is not None:
            found.add(op)
        if hasattr(m, "fused_attn") and hasattr(m, "num_heads"):  # a timm attention
            found.update(("sdpa",) if m.fused_attn else ("matmul", "softmax"))
        elif isinstance(getattr(m, "num_heads", None), int) and not isinstance(m, nn.MultiheadAttention):
            # an attention without the flag (ConViT's GPSA and MHSA): the products its forward calls
            found.update(o for o in ("matmul", "softmax") if o in scan_functional_ops(type(m)))
        for op in getattr(m, "mesa_core_ops", ()):
            found.add(op)
    return tuple(o for o in candidates if o in found)


def find_units(model: nn.Module) -> List[Unit]:
    """The model's units in module order, OTHER first."""
    root = unwrap_model(model)
    blocks = _block_names(root)
    inside = tuple(b + "." for b in blocks)
    # the outside-blocks unit (patch embedding, downsampling, norms, head): everything
    # not inside a block
    outside = [m for n, m in root.named_modules() if n and not (n in blocks or n.startswith(inside))]
    units = [Unit(OTHER, _present_ops(outside, _OTHER_OPS), fingerprint(root, inside), OTHER)]
    for b in blocks:
        block = root.get_submodule(b)
        attn = getattr(block, "attn", None)
        fused = bool(getattr(attn, "fused_attn", False)) and getattr(attn, "mesa_attn_path", "fused") == "fused"
        ops = _present_ops(block.modules(), _FUSED_OPS if fused else _EXPLICIT_OPS)
        fp = fingerprint(block)
        units.append(Unit(b, ops, fp, f"{type(block).__name__}:{fp}", recomputable=True))
    return units


def unit_ops(units: List[Unit]) -> Dict[str, Tuple[str, ...]]:
    return {u.name: u.ops for u in units}


def model_architecture(model: nn.Module) -> str:
    root = unwrap_model(model)
    cfg = getattr(root, "pretrained_cfg", None) or {}
    return str(cfg.get("architecture") or type(root).__name__)


assert set(_EXPLICIT_OPS) | set(_FUSED_OPS) <= set(OPS)
