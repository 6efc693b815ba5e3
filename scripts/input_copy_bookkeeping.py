"""Host time of the parallel-layer bookkeeping (``nn/input_copy.py``) per Mesa Linear forward.

A Mesa conv or Linear in eager training asks whether its input may carry one copy for the
parallel layers given the same tensor, builds its signature, looks for another layer's codes
and, on a miss (the common case: most layers are their input's only consumer), leaves its own.
This times exactly that, on fresh non-leaf inputs, without the op between (the layer bench,
``python -m mesa_train.bench.overhead``, swings by more than this on a shared VM).

    PYTHONPATH=TREE python scripts/input_copy_bookkeeping.py

Run it with ``PYTHONPATH`` at two checkouts, in turn, for a before/after: a tree from before
``input_copy.may_share`` (f9a4f15) is timed in its own form (``take`` and ``offer`` checked
for themselves).
"""
from __future__ import annotations

import timeit

import torch

from mesa_train.nn import input_copy, linear
from mesa_train.nn.linear import Linear


def bookkeeping(quantizer, weight, codes):
    """One forward's bookkeeping, as ``nn/linear.py``'s ``_compressed_linear`` does it."""
    if hasattr(input_copy, "may_share"):
        def call(x):
            sig = (linear.copy_signature("op", quantizer, x, weight)
                   if weight.requires_grad and input_copy.may_share(x) else None)
            shared = input_copy.take(x, sig, quantizer) if sig is not None else None
            if sig is not None and shared is None:  # (the op's empty codes where it took some)
                input_copy.offer(x, sig, codes)
    else:  # f9a4f15: take and offer checked the tensor and the mode each
        def call(x):
            sig = linear.copy_signature("op", quantizer, x, weight) if weight.requires_grad else None
            if input_copy.take(x, sig, quantizer) is None:
                input_copy.offer(x, sig, codes)
    return call


def main(calls: int = 30000, repeat: int = 5) -> None:
    torch.set_num_threads(1)
    layer = Linear(8, 8).train()
    call = bookkeeping(layer.quantizer, layer.weight, (torch.zeros(1),) * 4)
    leaf = torch.randn(8, 8, requires_grad=True)
    fresh = iter([leaf * 1 for _ in range(calls * repeat)])  # (a new non-leaf per call: each a miss)
    best = min(timeit.repeat(lambda: call(next(fresh)), number=calls, repeat=repeat)) / calls
    print(f"{1e6 * best:.2f} us per call (best of {repeat} x {calls} calls, 1 thread)")


if __name__ == "__main__":
    main()
