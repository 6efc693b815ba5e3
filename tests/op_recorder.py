"""The ATen / mesa ops a block of code dispatches, by name (``aten.mm``, ``mesa.quantize``),
in order: the op-count tests of several files share it.

    with OpRecorder() as rec:
        y = layer(x)
    rec.ops  # ["mesa.observe", "mesa.quantize", ...]

``keep(name)``: which names to record (default all).

``mesa::compress`` (one op for a whole compression, the Python Functions' path) is recorded
as the ops it runs, so that counts are launches whichever path a layer takes:
``observe`` + ``quantize``, with row exponents (``max_k > 0``) or a LayerNorm's ``row_mean`` /
``row_rstd`` ``observe_rows`` + ``quantize``; for the delayed estimator (code 2)
``quantize_observe``, after ``row_exponents`` with row exponents (and the normalised copy with
``row_mean``). test_op_counts.py pins that expansion against the profiler's record of what the
op calls.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def compress_ops(args, kwargs=None) -> list[str]:
    """The ops ``mesa::compress(x, alpha_est, beta_est, initialized, rng, dim, num_groups,
    decay, estimator, symmetric, stochastic, row_dims, max_k)`` runs, in order."""
    names = [a.name for a in torch.ops.mesa.compress.default._schema.arguments]
    bound = {**dict(zip(names, args)), **(kwargs or {})}
    estimator, max_k = bound["estimator"], bound["max_k"]
    norm = bound.get("row_mean") is not None  # a LayerNorm's x_hat, made by the kernels
    if estimator == 2:
        return (["aten.sub", "aten.mul_"] if norm else []) + (["mesa.row_exponents"] if max_k > 0 else []) \
            + ["mesa.quantize_observe"]
    return ["mesa.observe_rows" if max_k > 0 or norm else "mesa.observe", "mesa.quantize"]


class OpRecorder(TorchDispatchMode):
    def __init__(self, keep: Optional[Callable[[str], bool]] = None):
        super().__init__()
        self.keep = keep
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        names = compress_ops(args, kwargs) if name == "mesa.compress" else [name]
        self.ops.extend(n for n in names if self.keep is None or self.keep(n))
        return func(*args, **(kwargs or {}))
