"""Whether a forward is ``torch.utils.checkpoint``'s non-reentrant recomputation (timm's
``set_grad_checkpointing``, ``checkpoint(..., use_reentrant=False)``).

Such a checkpoint runs a segment's forward twice: once in the forward pass (its saved tensors
dropped) and again in backward, to save them anew. The quantizers update their running
estimates, rounding counter and learned thresholds at every compression, so the second run
updated them again: every checkpointed step blended its batch into the estimates twice (decay
0.81 where 0.9 was set), advanced the counter by two and took two Adam steps of the thresholds.
In a recomputation the quantizers now compress with scratch copies of their state
(``ActivationQuantizer._state``). A reentrant checkpoint's first pass runs under ``no_grad``
(Mesa layers compress nothing there), so its recomputation is the one compressing call and
updates the state as a plain forward does. Under ``torch.compile`` the compiled graph
recomputes what it saved (the state is updated once), and this is not asked.

torch marks the recomputation only through the saved-tensor hooks it installs for it
(``torch.utils.checkpoint._recomputation_hook``); ``tests/test_checkpoint_recompute.py`` pins
that on the installed torch, so a torch that renames it fails there, not silently.
"""
from __future__ import annotations

import torch

__all__ = ["recomputing"]

_RECOMPUTE_HOOK = "_recomputation_hook."  # (the qualified name's start of its pack hook)


def recomputing() -> bool:
    """Whether this call runs inside a non-reentrant checkpoint's recomputation (in backward)."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
        return False  # (traced; or autograd's engine is not running: a forward pass)
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(_RECOMPUTE_HOOK)
