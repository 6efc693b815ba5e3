"""Where a forward runs within ``torch.utils.checkpoint``'s non-reentrant checkpointing (timm's
``set_grad_checkpointing``, ``checkpoint(..., use_reentrant=False)``, selective checkpointing).

Such a checkpoint runs a segment's forward twice: once in the forward pass (its saved tensors
dropped) and again in backward, to save them anew. The quantizers update their running
estimates, rounding counter and learned thresholds at every compression, so the second run
updated them again: every checkpointed step blended its batch into the estimates twice (decay
0.81 where 0.9 was set), advanced the counter by two and took two Adam steps of the thresholds.
In a recomputation the quantizers now compress with scratch copies of their state, their
counter where the forward's call found it (``ActivationQuantizer._state``). A reentrant
checkpoint's first pass runs under ``no_grad`` (Mesa layers compress nothing there), so its
recomputation is the one compressing call and updates the state as a plain forward does. Under
``torch.compile`` the compiled graph recomputes what it saved (the state is updated once), and
this is not asked; a block compiled on its own inside an eager checkpoint is refused
(``compile_scope.compile_model``).

torch marks the two passes only through the saved-tensor hooks it installs for them
(``torch.utils.checkpoint._checkpoint_hook`` and ``_recomputation_hook``);
``tests/test_checkpoint_recompute.py`` pins that on the installed torch, so a torch that renames
them fails there, not silently.
"""
from __future__ import annotations

import torch

__all__ = ["checkpoint_phase", "recomputing", "FORWARD", "RECOMPUTE"]

FORWARD, RECOMPUTE = 1, 2
# (the qualified names' starts of the pack hooks torch.utils.checkpoint pushes for its two passes)
_PHASES = (("_checkpoint_hook.", FORWARD), ("_recomputation_hook.", RECOMPUTE))


def checkpoint_phase() -> int:
    """``FORWARD`` inside a non-reentrant checkpoint's first pass, ``RECOMPUTE`` inside its
    recomputation (in backward), else 0 (also while traced)."""
    if torch.compiler.is_compiling():
        return 0
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return 0
    name = getattr(hooks[0], "__qualname__", "")
    for start, phase in _PHASES:
        if name.startswith(start):
            return phase
    return 0


def recomputing() -> bool:
    """Whether this call runs inside a non-reentrant checkpoint's recomputation."""
    return checkpoint_phase() == RECOMPUTE
