"""Every ``mesa::`` op some code calls, checked against the pure-PyTorch reference on the same
inputs and device: what the kernel benchmark uses to say, beside each time, whether the kernel it
timed computed the right thing on that shape.

Why beside the times: the CUDA kernels changed several times without a GPU to run them, and a
lent GPU's first call times them on the DeiT-S shapes (tens of MB, the resident grid's loops,
32-bit index paths) before its CUDA tests, which use small shapes, run, if they run at all. A
fast wrong kernel must not read as a win.

    with ReferenceCheck() as check:
        fn()                        # any code calling mesa:: ops
    check.verdict()                 # "equal", "<= 1 ulp", "MISMATCH mesa::quantize: ...", or None

Each top-level ``mesa::`` call (a TorchDispatchMode sees the ops the Python side calls, not
those a C++ op calls inside itself) runs as usual; then its reference (``mesa_train.quant``'s
``_REF_IMPLS``, the functions that serve the ops without the extension) runs on copies of the
inputs taken before the call, so the state buffers an op updates in place start alike. Outputs
and updated buffers must be bit for bit the reference's (the contract the CUDA tests check on
small shapes), except the GELU ops', which the tests bound by ulps of the output dtype (an
``erff`` / ``expf`` of another library): 1 ulp for 16-bit outputs, 8 for float32.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from mesa_train.quant import _REF_IMPLS

__all__ = ["ReferenceCheck", "ULP_BOUNDS"]

# ops whose kernels may differ from the reference by transcendental rounding, and how far (in
# ulps of the output dtype: 16-bit, float32), as tests/test_gelu_backward.py bounds them
ULP_BOUNDS = {"gelu_backward": (1.0, 8.0), "dequantize_gelu": (1.0, 8.0), "gelu_value_and_grad": (1.0, 8.0)}


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in ulps of want's dtype at want's magnitude (NaN where they differ in NaN-ness)."""
    eps, tiny = torch.finfo(want.dtype).eps, torch.finfo(want.dtype).tiny
    g, w = got.float(), want.float()
    nan_apart = bool((torch.isnan(g) != torch.isnan(w)).any())
    if nan_apart:
        return float("nan")
    both = ~torch.isnan(w)
    if not bool(both.any()):
        return 0.0
    return float(((g[both] - w[both]).abs() / (w[both].abs().clamp_min(tiny) * eps)).max())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage bits as integers (floats compared bit for bit: NaN payloads and signed zeros too)."""
    if t.is_floating_point():
        return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    return t


def compare(got: torch.Tensor, want: torch.Tensor, bound: tuple[float, float] | None) -> tuple[bool, str]:
    """(within the contract, what was found) for one output of an op against its reference's."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"{tuple(got.shape)} {got.dtype} where the reference gives {tuple(want.shape)} {want.dtype}"
    differ = _bits(got) != _bits(want)
    n = int(differ.sum())
    if n == 0:
        return True, "equal"
    if got.is_floating_point():
        ulps = _ulps(got, want)
        if bound is not None:
            limit = bound[1] if got.dtype == torch.float32 else bound[0]
            if ulps <= limit:
                return True, f"<= {limit:g} ulp"
        return False, f"{n} of {got.numel()} elements differ, at most {ulps:.3g} ulp"
    return False, f"{n} of {got.numel()} elements differ"


class ReferenceCheck(TorchDispatchMode):
    """Checks each ``mesa::`` op called inside it (module doc); ``found``: (op, ok, what) per call."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, bool, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        if namespace != "mesa" or name not in _REF_IMPLS:
            return func(*args, **kwargs)
        before = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, (args, kwargs))
        out = func(*args, **kwargs)
        want = _REF_IMPLS[name](*before[0], **before[1])
        # its outputs, and what it changed in place (its schema's written arguments, given by
        # position or by name)
        pairs = list(zip(tree_flatten(out)[0], tree_flatten(want)[0]))
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if i < len(args):
                pairs.append((args[i], before[0][i]))
            elif arg.name in kwargs:
                pairs.append((kwargs[arg.name], before[1][arg.name]))
        bound = ULP_BOUNDS.get(name)
        ok, notes = True, []
        for got, ref in pairs:
            if not isinstance(got, torch.Tensor):
                continue
            good, what = compare(got, ref, bound)
            ok = ok and good
            if what != "equal":
                notes.append(what)
        self.found.append((f"mesa::{name}", ok, "; ".join(notes) or "equal"))
        return out

    def verdict(self) -> str | None:
        """One cell: "equal" when every call matched bit for bit, "<= n ulp" when within the GELU
        ops' bound, else "MISMATCH" with the first failing op; None when no mesa:: op was called."""
        if not self.found:
            return None
        bad = [(op, what) for op, ok, what in self.found if not ok]
        if bad:
            return f"MISMATCH {bad[0][0]}: {bad[0][1]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        loose = [what for _, _, what in self.found if what != "equal"]
        return max(loose, key=len) if loose else "equal"
