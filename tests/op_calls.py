"""A spy on a ``torch.ops.mesa`` op: which tests use it ask whether a layer took its C++ fast
path (the op still runs)."""
from __future__ import annotations

import torch


def count_calls(monkeypatch, op_name: str) -> list:
    """A list that gets one entry per call of ``torch.ops.mesa.<op_name>`` (which still runs)."""
    calls = []
    real = getattr(torch.ops.mesa, op_name)

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch.ops.mesa, op_name, spy)
    return calls
