"""A spy on a ``torch.ops.mesa`` op: which tests use it ask whether a layer took its C++ fast
path (the op still runs)."""
from __future__ import annotations

import copy

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


def assert_patched_model_takes_the_op(monkeypatch, model, example_input, op_name, layer_types) -> None:
    """Two training steps of a patched ``model`` (``example_input(step)`` its input; seeded, so
    dropout and drop-path draw the same masks) on the C++ layer op ``op_name`` and on the Python
    Functions: the same outputs, parameter gradients and buffers, and the op called once per
    forward of a ``layer_types`` layer (counted by pre-hooks: a layer may run several times a
    step, as CoaT's shared position encodings do) on the first path, never on the second.
    ``op_name``: a name, or a tuple of the names one layer type calls (a BatchNorm's
    ``batch_norm_train`` or, on an identity branch, ``batch_norm_train_offer`` or ``batch_norm_train_take``)."""
    from mesa_train.nn import quantizer as quantizer_mod

    runs = []
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        names = (op_name,) if isinstance(op_name, str) else tuple(op_name)
        calls = [count_calls(monkeypatch, name) for name in names]
        m = copy.deepcopy(model)
        layer_calls = []
        for layer in (mod for mod in m.modules() if isinstance(mod, layer_types)):
            layer.register_forward_pre_hook(lambda *_: layer_calls.append(1))
        out = []
        for step in range(2):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            y = m(example_input(step))
            (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
            out += [y.detach()] + [p.grad for p in m.parameters() if p.grad is not None]
        runs.append(out + [b.clone() for b in m.buffers()])
        ran = sum(len(c) for c in calls)
        assert layer_calls and ran == (len(layer_calls) if fused else 0), (names, ran)
        monkeypatch.undo()
    assert_all_same_bits(runs[0], runs[1])
