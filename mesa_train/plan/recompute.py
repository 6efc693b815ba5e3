"""Recompute a block in backward instead of keeping its activations (the planner's
``recompute`` choice): activation checkpointing of one block, as timm's
``set_grad_checkpointing`` does for all of them.

A plan may recompute a block where that buys memory more cheaply than compressing it
(checkpointing keeps only the block's input; its cost is one more forward of the block).
The block keeps its class and its parameters' names, so state_dict keys do not change:
only the instance's ``forward`` is replaced. Non-reentrant ``torch.utils.checkpoint``
restores the RNG state for the recomputation, so dropout masks and gradients are exactly
the stock model's.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute_block", "is_recomputed"]

_FLAG = "_mesa_recompute"


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    # the class's forward, not the instance attribute (which is this function)
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def recompute_block(block: nn.Module) -> nn.Module:
    """Make ``block`` recompute its forward in backward (in place; idempotent)."""
    if not is_recomputed(block):
        # a partial of a module-level function (not a closure or bound method): deepcopy
        # (timm's ModelEmaV3) then rebinds it to the copied block
        block.forward = functools.partial(_checkpointed_forward, block)
        object.__setattr__(block, _FLAG, True)
    return block


def is_recomputed(block: nn.Module) -> bool:
    return bool(getattr(block, _FLAG, False))
