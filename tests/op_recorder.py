"""The ATen / mesa ops a block of code dispatches, by name (``aten.mm``, ``mesa.quantize``),
in order: the op-count tests of several files share it.

    with OpRecorder() as rec:
        y = layer(x)
    rec.ops  # ["mesa.observe", "mesa.quantize", ...]

``keep(name)``: which names to record (default all).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    def __init__(self, keep: Optional[Callable[[str], bool]] = None):
        super().__init__()
        self.keep = keep
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if self.keep is None or self.keep(name):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
