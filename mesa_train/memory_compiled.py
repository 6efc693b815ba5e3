"""What a ``torch.compile``d training forward keeps for backward.

``SavedTensorMeter`` (``memory.py``) counts through autograd's saved-tensor hooks, which Dynamo
refuses to trace. A compiled model's forward is one graph whose outputs are the model's results,
the buffers' new values and the tensors its backward will read (the partitioner's choice, which
may differ from eager autograd's). :func:`compiled_saved_tensors` compiles the model with torch's
``aot_eager`` backend (its min-cut partitioner, Inductor's, which recomputes cheap ops rather
than keep their outputs) and a forward compiler of its own that takes a weak reference to every
output's storage, and reports the storages still
alive when the forward has returned that are neither the model's result nor a parameter or
buffer: the compiled graph's autograd node holds them for backward (a buffer's new value is
copied into the buffer and dropped).

```python
out, kept = compiled_saved_tensors(model, x)   # one training forward, fullgraph
sum(k.nbytes for k in kept)                     # bytes, each storage once
```
"""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["KeptStorage", "compiled_saved_bytes", "compiled_saved_tensors"]


class KeptStorage(NamedTuple):
    """One storage a compiled forward keeps: the shape and dtype of the graph output that
    first named it, and the storage's whole size."""
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def compiled_saved_tensors(model: nn.Module, *inputs) -> Tuple[object, List[KeptStorage]]:
    """``(output, kept)``: ``model(*inputs)`` compiled (fullgraph, aot_eager), and one
    :class:`KeptStorage` per storage its compiled forward keeps for backward, parameters and
    buffers left out. Builds a fresh compiled wrapper: one call per measurement."""
    from torch._dynamo.backends.debugging import aot_eager

    outputs: List[Tuple[StorageWeakRef, int, KeptStorage]] = []

    def forward_compiler(gm, example_inputs):
        def run(args):  # boxed: aot_autograd hands over its argument list
            outs = gm(*args)
            # weak references to storages: the autograd node keeps a saved tensor's storage,
            # not the Python tensor the graph returned (that one is dropped at once)
            for t in outs:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    outputs.append((StorageWeakRef(storage), storage.data_ptr(),
                                    KeptStorage(tuple(t.shape), t.dtype, storage.nbytes())))
            return outs
        run._boxed_call = True
        return run

    # torch's own aot_eager (its partitioner, Inductor's min-cut one) with a watching forward compiler
    backend = functools.partial(aot_eager, fw_compiler=forward_compiler)
    output = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *_tensors(output))}
    kept = {}
    for ref, ptr, desc in outputs:
        if not ref.expired() and ptr not in excluded:
            kept.setdefault(ptr, desc)
    return output, list(kept.values())


def compiled_saved_bytes(model: nn.Module, *inputs) -> int:
    """Bytes of the storages :func:`compiled_saved_tensors` finds, each counted whole, once."""
    _, kept = compiled_saved_tensors(model, *inputs)
    return sum(k.nbytes for k in kept)


def _tensors(output) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
