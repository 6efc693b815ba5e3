"""A spy on a ``torch.ops.mesa`` op: which tests use it ask whether a layer took its C++ fast
path (the op still runs)."""
from __future__ import annotations

import torch

from bit_patterns import assert_all_same_bits


def count_calls(monkeypatch, op_name: str) -> list:
    """A list that gets one entry per call of ``torch.ops.mesa.<op_name>`` (which still runs)."""
    calls = []
    real = getattr(torch.ops.mesa, op_name)
    inside = []  # a torch function mode (patch/generic_attention.py) hands the call back to the spy

    def spy(*args):
        if inside:
            return real(*args)
        calls.append(1)
        inside.append(1)
        try:
            return real(*args)
        finally:
            inside.pop()

    monkeypatch.setattr(torch.ops.mesa, op_name, spy)
    return calls


def assert_op_path_is_the_python_path(monkeypatch, op_name: str, run, *args) -> None:
    """``run(fused, monkeypatch, *args)`` (two training steps; everything observable, ``None``
    for a gradient not asked for) on the C++ layer op, which must run on each step, and on the
    Python Functions: the same dtypes, strides and bits (``bit_patterns.assert_all_same_bits``)."""
    calls = count_calls(monkeypatch, op_name)
    got = run(True, monkeypatch, *args)
    assert calls == [1, 1], f"mesa::{op_name} ran {len(calls)} times in two steps"
    assert_all_same_bits(got, run(False, monkeypatch, *args))
