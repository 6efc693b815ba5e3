"""Memory-saving baselines the planner is compared with (bench preset ``planner``):
timm's gradient checkpointing, PyTorch selective activation checkpointing, and
``torch.compile``'s activation memory budget. Each takes a stock model and returns a
new one (the stock model is not changed)."""
from __future__ import annotations

import collections
import copy
import inspect
import types
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mesa_train.models import unwrap_model
from mesa_train.plan.units import OTHER, find_units

__all__ = ["grad_checkpointing", "partial_checkpointing", "selective_checkpointing", "compiled_with_budget"]

# SAC keeps the outputs of the expensive ops (matmuls, attention) and recomputes the cheap,
# memory-bound rest (norms, activations, softmax, adds) in backward: the policy from
# PyTorch's SAC tutorial for transformers
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def grad_checkpointing(model: nn.Module) -> nn.Module:
    """timm's ``set_grad_checkpointing``: every block recomputed in backward."""
    out = copy.deepcopy(model)
    unwrap_model(out).set_grad_checkpointing(True)
    return out


def _blocks(root: nn.Module):
    return [root.get_submodule(u.name) for u in find_units(root) if u.name != OTHER]


def partial_checkpointing(model: nn.Module, count: int) -> nn.Module:
    """The first ``count`` blocks under (non-reentrant) activation checkpointing, the rest
    stock: checkpointing's memory/speed points between none and timm's all blocks."""
    out = copy.deepcopy(model)
    for block in _blocks(unwrap_model(out))[:count]:
        plain = block.forward

        def forward(self, *args, _plain=plain, **kwargs):
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        block.forward = types.MethodType(forward, block)
    return out


# torch >= 2.13: checkpoint(respect_saved_tensors_hooks=True) sends what SAC keeps through
# the surrounding saved-tensor hooks (the SavedTensorMeter), as autograd's own saved tensors
_SAC_HOOKS_ARG = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


class _PackedList(list):
    """One op's list in the SAC cache (older torch): each entry's tensors also go through
    ``pack`` (the meter's hook) when SAC caches them, as respect_saved_tensors_hooks does."""

    def __init__(self, pack):
        super().__init__()
        self._pack, self._packed = pack, []

    def append(self, entry):
        super().append(entry)
        for leaf in torch.utils._pytree.tree_leaves(entry):
            val = getattr(leaf, "val", None)  # SAC's _VersionWrapper
            if isinstance(val, torch.Tensor):
                self._packed.append(self._pack(val))


def _sac_contexts():
    fwd, rec = create_selective_checkpoint_contexts(_policy)
    if _SAC_HOOKS_ARG:
        return fwd, rec
    # Older torch (2.11) has no respect_saved_tensors_hooks: SAC's cache bypasses the hooks
    # and the meter would not count what SAC keeps. The hooks in force now (checkpoint calls
    # context_fn before it pushes its own) see each cached tensor through the cache's lists.
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    storage = getattr(fwd, "storage", None)
    if hooks is not None and isinstance(storage, collections.defaultdict) and getattr(rec, "storage", None) is storage:
        fwd.storage = rec.storage = collections.defaultdict(partial(_PackedList, hooks[0]))
    return fwd, rec


def selective_checkpointing(model: nn.Module) -> nn.Module:
    """Every block under non-reentrant checkpoint with a selective policy (save matmuls)."""
    out = copy.deepcopy(model)
    root = unwrap_model(out)
    extra = {"respect_saved_tensors_hooks": True} if _SAC_HOOKS_ARG else {}
    for block in _blocks(root):
        plain = block.forward

        def forward(self, *args, _plain=plain, **kwargs):
            # respect_saved_tensors_hooks: what SAC saves goes through the SavedTensorMeter
            return checkpoint(_plain, *args, use_reentrant=False, context_fn=_sac_contexts, **extra, **kwargs)

        block.forward = types.MethodType(forward, block)
    return out


def compiled_with_budget(model: nn.Module, budget: float, backend: str, example_step) -> nn.Module:
    """``torch.compile`` with ``torch._functorch.config.activation_memory_budget=budget``
    (the min-cut partitioner recomputes ops until the saved activations fit that fraction).
    The config is read when the graph compiles, so ``example_step(model)`` runs once inside it."""
    import torch._functorch.config as functorch_config

    out = torch.compile(copy.deepcopy(model), backend=backend)
    with functorch_config.patch(activation_memory_budget=float(budget)):
        example_step(out)
    return out
