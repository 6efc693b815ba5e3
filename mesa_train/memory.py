"""Memory accounting: bytes of the tensors autograd saves for backward.

```python
with SavedTensorMeter(model) as meter:      # model optional (per-module names, parameter set)
    loss = model(x).sum()
meter.activation_bytes, meter.parameter_bytes, meter.total_bytes, meter.per_module
print(meter.summary()); print(meter.table())
```

How it counts (``torch.autograd.graph.saved_tensors_hooks``; the pack hook records sizes
and returns the tensor detached, the same storage, so nothing about training changes, and a
graph dropped without a backward is freed):

* Each *storage* is counted once, with its full size (``untyped_storage().nbytes()``),
  however many views of it are saved or by how many ops. Storages are keyed by data
  pointer and tracked with a weak reference, so a freed and re-allocated address counts
  again.
* ``parameter_bytes``: parameters, views of parameters and autocast (or other ``.to``)
  copies of parameters, recognised by the storage (when a ``model`` is given), by type, or
  by walking the saved tensor's ``grad_fn`` through view/copy nodes to the
  ``AccumulateGrad`` of an ``nn.Parameter``. Copies of *frozen* parameters
  (``requires_grad=False``) have no ``grad_fn`` and count as activations.
* ``activation_bytes``: everything else. Every "saved bytes" target in this project
  means ``activation_bytes``.
* ``per_module``: activation bytes attributed to the innermost module of ``model`` whose
  forward was running when the tensor was saved (forward pre/post hooks); bytes saved
  outside any module go to ``"<outside>"``; the root module is ``""``. ``savers_of(t)``: every
  module that saved the storage of ``t`` with its present values, while the storage lives.
* Tensors packed while autograd is running a backward pass (e.g. the recomputation of
  reentrant activation checkpointing) are not counted.

Activation checkpointing composes with the meter (it is not broken by it):

* non-reentrant (``use_reentrant=False``, the default): the checkpoint installs its own
  saved-tensor hooks inside the checkpointed region, and the innermost hooks win, so the
  meter sees nothing saved inside the region (those tensors are recomputed in backward and
  not kept). The checkpoint saves the region's tensor inputs as saved tensors outside its
  hooks, so the meter counts them (attributed to the module calling ``checkpoint``).
* reentrant (``use_reentrant=True``): the region runs without grad, and the checkpoint
  saves its inputs with ``save_for_backward``; the meter counts those inputs.

So with checkpointing the meter reports what is really kept between forward and backward:
the checkpoint inputs plus whatever is saved outside checkpointed regions. Recomputation
in backward is never counted (see above), even when backward runs inside the ``with``.

The meter is for eager-mode measurement; under ``torch.compile`` the compiled graph
decides what to save and the figures are not meaningful: ``memory_compiled.compiled_saved_tensors``
counts what a compiled forward keeps.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn

__all__ = ["SavedTensorMeter", "format_bytes"]

# grad_fn nodes that a view or a dtype/device copy of a parameter goes through
_PASS_THROUGH = {
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "TransposeBackward1", "PermuteBackward0",
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "AsStridedBackward0",
    "AsStridedBackward1", "SliceBackward0", "SelectBackward0", "AliasBackward0", "UnsqueezeBackward0",
    "UnsqueezeBackward1", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3",
    "SqueezeBackward4", "ViewAsRealBackward0", "ViewAsComplexBackward0", "UnbindBackward0",
    "SplitBackward0", "SplitWithSizesBackward0", "NarrowBackward0", "DiagonalBackward0",
}
_MAX_WALK = 16
OUTSIDE = "<outside>"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _from_parameter(t: torch.Tensor) -> bool:
    fn = t.grad_fn
    for _ in range(_MAX_WALK):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
        if name not in _PASS_THROUGH or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


class SavedTensorMeter:
    """Context manager recording the bytes saved for backward (see module docstring).

    Counts accumulate over every ``with`` block of one meter; :meth:`reset` clears them.
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self._hooks_ctx = None
        self._handles: list = []
        self._stack: list[str] = []
        self._param_ptrs: set[int] = set()
        self.reset()

    # ------------------------------------------------------------------ results
    def reset(self) -> None:
        self.activation_bytes = 0
        self.parameter_bytes = 0
        self.per_module: dict[str, int] = {}
        self.num_storages = 0  # distinct storages counted
        self.num_saved = 0  # pack-hook calls (tensors saved), duplicates included
        self._seen: dict[int, weakref.ref] = {}
        # activation storage's data pointer -> {(module, the tensor's _version when saved)}: savers
        self._savers: dict[int, set[tuple[str, int]]] = {}

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.parameter_bytes

    def summary(self) -> str:
        return (f"saved for backward: activations {format_bytes(self.activation_bytes)}, parameters "
                f"{format_bytes(self.parameter_bytes)}, total {format_bytes(self.total_bytes)} "
                f"({self.num_storages} storages from {self.num_saved} saved tensors)")

    def table(self) -> str:
        rows = [(name or "(root)", b) for name, b in self.per_module.items() if b]
        width = max([len("module")] + [len(r[0]) for r in rows])
        total = max(self.activation_bytes, 1)
        lines = [f"{'module':<{width}}  {'activation bytes':>16}  {'share':>6}"]
        for name, b in rows:
            lines.append(f"{name:<{width}}  {b:>16,d}  {100.0 * b / total:5.1f}%")
        lines.append(f"{'total':<{width}}  {self.activation_bytes:>16,d}  {100.0 if rows else 0.0:5.1f}%")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SavedTensorMeter({self.summary()})"

    def savers_of(self, t: torch.Tensor) -> frozenset:
        """The modules (``per_module``'s keys) that saved ``t``'s storage as an activation with
        its values as they are now (``t._version``), every one (a storage is counted once, for
        the first), while the storage lives: coverage's test of whether a Mesa layer's copy
        duplicates a tensor another module keeps in full. Empty for a storage nobody saved, or
        one freed since (whatever has its address now)."""
        return self.savers(t.untyped_storage().data_ptr(), t._version)

    def savers(self, ptr: int, version: int) -> frozenset:
        """``savers_of`` by the storage's data pointer and the tensor version."""
        ref = self._seen.get(ptr)
        if ref is None or ref() is None:
            return frozenset()
        return frozenset(k for k, v in self._savers.get(ptr, ()) if v == version)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "SavedTensorMeter":
        if self._hooks_ctx is not None:
            raise RuntimeError("SavedTensorMeter is not re-entrant")
        self._stack = []
        if self.model is not None:
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
            for name, mod in self.model.named_modules():
                self._handles.append(mod.register_forward_pre_hook(_input_agnostic(partial(self._pre, name))))
                self._handles.append(mod.register_forward_hook(_input_agnostic(partial(self._post, name)),
                                                               always_call=True))
        # The graph keeps its pack hook alive until it is freed (even without a backward),
        # so the hook holds the meter only weakly: a dropped graph never pins meter or model.
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(partial(_pack, weakref.ref(self)), _unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._hooks_ctx.__exit__(*exc)
        finally:
            self._hooks_ctx = None
            for h in self._handles:
                h.remove()
            self._handles = []
            self._stack = []

    def _pre(self, name, module, args):
        self._stack.append(name)

    def _post(self, name, module, args, output):
        # pop back to this module's entry (robust to a forward that raised in a child)
        while self._stack:
            if self._stack.pop() == name:
                break

    # ------------------------------------------------------------------ hooks
    def _is_parameter(self, t: torch.Tensor, ptr: int | None) -> bool:
        if isinstance(t, nn.Parameter):
            return True
        if ptr is not None and ptr in self._param_ptrs:
            return True
        base = t._base
        if base is not None and isinstance(base, nn.Parameter):
            return True
        return _from_parameter(t)

    def _pack(self, t: torch.Tensor):
        if torch._C._current_graph_task_id() != -1:
            return t  # packed during a backward pass (checkpoint recomputation): not counted
        self.num_saved += 1
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # tensors without a plain storage (fake, sparse, subclasses, ...)
            storage, ptr, nbytes = None, None, t.numel() * t.element_size()
        key = self._stack[-1] if self._stack else OUTSIDE
        if ptr is not None and nbytes > 0:
            ref = self._seen.get(ptr)
            if ref is not None and ref() is not None:
                if ptr in self._savers:  # (an activation storage already counted)
                    self._savers[ptr].add((key, t._version))
                return t  # this storage is already counted
            self._seen[ptr] = weakref.ref(storage)
            self._savers.pop(ptr, None)  # (a freed storage's address, taken by a new one)
        self.num_storages += 1
        if self._is_parameter(t, ptr):
            self.parameter_bytes += nbytes
        else:
            self.activation_bytes += nbytes
            self.per_module[key] = self.per_module.get(key, 0) + nbytes
            if ptr is not None and nbytes > 0:
                self._savers[ptr] = {(key, t._version)}
        return t


# A module hook marked with this attribute reads neither the module's arguments nor its
# output (the meter's: a name on a stack). A patched block may then hand its attention / MLP
# the un-normalised input and run norm + Linear as one call (patch/block.py); any other hook
# there turns that off, so that it sees the arguments and calls it expects.
INPUT_AGNOSTIC_HOOK = "mesa_input_agnostic"


def _input_agnostic(hook):
    setattr(hook, INPUT_AGNOSTIC_HOOK, True)
    return hook


def _pack(meter_ref, t: torch.Tensor):
    # Detached: autograd stores what the pack hook returns. A saved *output* returned as is
    # carries its grad_fn, the very node that saves it: a cycle through C++ that Python's gc
    # cannot see, so a graph measured without a backward (plan's activation_bytes, describe)
    # was never freed (its activations leaked, one forward's worth a measurement). detach()
    # shares the storage: backward reads the same bytes.
    meter = meter_ref()
    return (t if meter is None else meter._pack(t)).detach()


def _unpack(t):
    return t
