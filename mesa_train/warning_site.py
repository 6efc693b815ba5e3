"""Where a warning raised inside a forward should point: the first frame outside mesa_train
and torch, the line of the user's code (or of timm's) that called the model or the module.
A warning from a forward hook or a patched module's forward with a fixed ``stacklevel`` points
into torch's ``module.py`` or into mesa_train, and Python 3.11's ``warnings.warn`` has no
``skip_file_prefixes``."""
from __future__ import annotations

import os
import sys

import torch

__all__ = ["outside_stacklevel"]

# (a separator at the end: a sibling directory such as mesa_train_extra/ is outside)
_INSIDE = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def outside_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function: the first frame outside
    mesa_train and torch."""
    frame, level = sys._getframe(1), 1  # (level 1: the function calling warnings.warn)
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level
