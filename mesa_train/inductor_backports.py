"""Fixes from newer Inductors, applied to an older torch where they are missing.

One so far: **the persistent-reduction decision sees the tiling scores.** Inductor writes a
row reduction that fits in registers (at most 1024 elements a row, hint ``INNER``) as one
persistent kernel, and a longer or non-inner one as a loop that reads its rows again for
every reduction it holds. Before torch 2.14 the decision
(``InductorChoices.should_use_persistent_reduction``) read the kernel's reduction hint without
the tiling scores that the kernel's own code generation passes: a fused kernel whose pointwise
part reads a transposed or strided input is downgraded to hint ``DEFAULT`` (threshold 64), and
its code is then generated as a loop but labelled ``INNER``. torch 2.14 reads the scores in both
places (``SIMDKernelFeatures.get_reduction_hint`` defaults to the features' own scores).

Why Mesa cares: the lent GPU machines run torch 2.11. There a DeiT-S block's softmax over its
197 columns, stock or Mesa's, is a looped reduction, and so are the traced compression's coding
kernels of the softmax and the GELU, which hold a row's min / max and its codes. Inductor's
kernels compiled for sm_90 with torch 2.11, without a GPU (``scripts/triton_sass.py``,
``results/triton-sass/torch2.11/``): the softmax's coding kernel issues 170 instructions an
element looped against 95 persistent; a block's forward 557 us against 471 (delayed estimates;
stock 321 against 267), the same for stock and Mesa, so the ratio between them hardly moves.

:func:`install` patches the decision (``TritonKernel.should_use_persistent_reduction``) to pass
the kernel's tiling scores, as torch 2.14 does, on a torch that lacks it, and does nothing on
one that has it. It changes which kernels Inductor writes for every model compiled in the
process, stock or Mesa, so :func:`mesa_train.compile_scope.compile_model` (the trainer's and the
bench's compile) calls it for both. ``MESA_INDUCTOR_BACKPORTS=0`` turns it off (Inductor's cache
does not key on it: give a run with the switch flipped its own ``TORCHINDUCTOR_CACHE_DIR``).
"""
from __future__ import annotations

import inspect
import os

ENV_SWITCH = "MESA_INDUCTOR_BACKPORTS"

_installed = False


class _FeaturesWithScores:
    """A kernel's ``SIMDKernelFeatures`` whose reduction hint defaults to the kernel's tiling
    scores (what torch 2.14's features do); everything else is the features' own."""

    def __init__(self, features, tiling_scores):
        self._features = features
        self._tiling_scores = tiling_scores

    def __getattr__(self, name):
        return getattr(self._features, name)

    def get_reduction_hint(self, tiling_scores=None):
        return self._features.get_reduction_hint(self._tiling_scores if tiling_scores is None else tiling_scores)


def persistent_decision_needs_scores() -> bool:
    """True on a torch whose persistent-reduction decision ignores the tiling scores (the
    features have no scores of their own, and their hint takes the scores as an argument)."""
    try:
        from torch._inductor.codegen.simd_kernel_features import SIMDKernelFeatures
        from torch._inductor.codegen.triton import TritonKernel
    except ImportError:  # (an Inductor without these modules: none of this applies)
        return False
    takes_scores = "tiling_scores" in inspect.signature(SIMDKernelFeatures.get_reduction_hint).parameters
    return (takes_scores and not hasattr(SIMDKernelFeatures, "with_tiling_scores")
            and "should_use_persistent_reduction" in vars(TritonKernel))


def status() -> str:
    """For a run's report: ``"on"``, ``"off (MESA_INDUCTOR_BACKPORTS=0)"`` or ``"not needed"`` (this
    torch has the fix)."""
    if not persistent_decision_needs_scores():
        return "not needed"
    return f"off ({ENV_SWITCH}=0)" if os.environ.get(ENV_SWITCH, "1") == "0" else "on"


def install() -> bool:
    """Apply the backports this torch lacks (module doc), once per process; returns whether the
    persistent-reduction fix is in place now (False where torch has it or the switch is off)."""
    global _installed
    if _installed:
        return True
    if status() != "on":
        return False
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    def should_use_persistent_reduction(self) -> bool:
        # (torch 2.11's body, with the features given the kernel's tiling scores; the kernel sets
        # self.tiling_scores before it asks: SIMDKernel.__init__)
        return self.inside_reduction and V.choices.should_use_persistent_reduction(
            _FeaturesWithScores(self.features, getattr(self, "tiling_scores", None)), self.cooperative_reduction
        )

    TritonKernel.should_use_persistent_reduction = should_use_persistent_reduction
    _installed = True
    return True
