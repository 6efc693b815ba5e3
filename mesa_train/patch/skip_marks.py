"""The marks ``skip_duplicated`` (patch/duplicates.py) leaves on a model, and their undoing.

A switch is a measurement of the model as it was patched: a later ``patch_model`` call changes
what the other modules keep (``ops=["relu"]`` after ``["conv"]``: the ReLUs keep 1-bit masks,
no longer the convs' inputs), so it undoes every switch first (``undo_skips``), and so does
``skip_duplicated`` itself before it measures again. Apart from ``duplicates.py`` so that
``patch/core.py`` can undo them without importing the measuring code (which imports it).
"""
from __future__ import annotations

import weakref

from torch import nn

from mesa_train.nn.matmul import FULL_OPERANDS_ATTR

__all__ = ["FULL_OPERANDS_ATTR", "FUSED_BACK_ATTR", "LEFT_STOCK_ATTR", "SKIP_FAILED_ATTR", "record_skipped_root",
           "undo_skips", "undo_skips_around"]

# (in a Mesa layer's __dict__: True where skip_duplicated switched it to stock)
LEFT_STOCK_ATTR = "_mesa_left_stock_duplicate"
# (in an attention's __dict__: its explicit path and fused_attn, where skip_duplicated put it back fused)
FUSED_BACK_ATTR = "_mesa_fused_back"
# (in a model's __dict__: why a start-up skip_duplicated measured nothing, patch/start_up.py)
SKIP_FAILED_ATTR = "_mesa_skip_failed"


# the models skip_duplicated switched layers in (weakly: a model dropped is forgotten), so that a
# later patch_model call on one of their submodules, or a plan's per-unit calls, undoes the
# switches of the whole model it changes (the review's find: a sibling's stayed)
_SKIPPED_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def record_skipped_root(root: nn.Module) -> None:
    _SKIPPED_ROOTS.add(root)


def undo_skips_around(module: nn.Module) -> int:
    """``undo_skips`` of ``module`` and of every model ``skip_duplicated`` switched that holds it."""
    changed = undo_skips(module)
    for root in list(_SKIPPED_ROOTS):
        if root is not module and any(m is module for m in root.modules()):
            changed += undo_skips(root)
    return changed


def undo_skips(root: nn.Module) -> int:
    """Switch back on the layers ``skip_duplicated`` left stock, quantize again the MatMul
    operands it left in full and put its fused-back attentions on the explicit path again; the
    number of modules changed. A failed start-up measurement's mark goes too (it was of the model
    as it was patched)."""
    changed = 0
    root.__dict__.pop(SKIP_FAILED_ATTR, None)
    for m in root.modules():
        if m.__dict__.pop(LEFT_STOCK_ATTR, None):
            m.set_quant_options(enabled=True)
            changed += 1
        if m.__dict__.pop(FULL_OPERANDS_ATTR, None):
            changed += 1
        back = m.__dict__.pop(FUSED_BACK_ATTR, None)
        if back is not None:
            m.mesa_attn_path, m.fused_attn = back
            changed += 1
    return changed
