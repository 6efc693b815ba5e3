"""Which kernels Mesa's compression runs under ``torch.compile``.

Two ways to put the quantizer into a compiled graph:

- ``"ops"``: the extension's own ops (``mesa::observe`` / ``quantize`` / ``dequantize`` and the
  packed-bits pair) stay opaque nodes of the graph; Inductor calls the C++ kernels, as eager
  does. Same bits as eager by construction.
- ``"traceable"``: the same arithmetic as plain PyTorch (:mod:`mesa_train.quant.traceable`,
  bit-identical, tests/test_traceable.py), which Inductor compiles and may fuse into the
  surrounding kernels.

``"auto"`` (the default) takes ``"ops"`` whenever the compiled extension is loaded, on CPU and
GPU alike, and ``"traceable"`` otherwise (the pure-PyTorch fallback ops have no fast kernel to
call). Why: the traced compression is slow to compile and no faster to run.

- CPU: Inductor's C++ code for the compression is slower than the extension's vectorised
  kernels (the stochastic-rounding hash, and the estimate update that the partitioner
  recomputes as scalar code inside backward loops), and takes minutes to compile. Measured on
  the cpu-quick DeiT (2 blocks, batch 32, Inductor, 1 thread, median of interleaved steps):
  compiled Mesa at 1.13x compiled stock's step time with ``"ops"`` against 1.47x-1.6x with
  ``"traceable"``, and about 20 s of compile instead of several minutes (results/cpu-compile/).
- GPU (H100, torch 2.11, 2026-11-24): compiling DeiT-S with every op compressed did not finish
  in 6 minutes with ``"traceable"`` (the stock model compiles in under one), while the ops
  path's kernels already run at 0.55-0.9 of a clone's bandwidth (results/kernels/). Since
  then the traced compression calls one op for its estimate and seed steps
  (``mesa::estimate_and_seed``; traced they were 64% of its graph nodes): a 2-block DeiT-S
  traces and partitions in 9.0 s instead of 15.9 s on CPU, 3159 forward-graph nodes instead
  of 6985 (``ops``: 3.6 s, 757; ``scripts/trace_cost.py`` on both trees); not re-timed on a
  GPU yet. Since then the traced min/max has two stages, the first fused into the producing
  kernel and the second ``mesa::observe`` on its cells (which also took over the estimate and
  seed steps; on a GPU the one-stage form was a split reduction of its own, found in
  Inductor's Triton code generated on this CPU: ``scripts/inductor_gpu_code.py``, DESIGN.md
  "The traced compression in Inductor's GPU code"); with ``estimator="delayed"``
  ``mesa::seed_of`` before the codes and ``mesa::delayed_observe`` on those cells after them,
  two small ops a compression in forward where it was three and a fill kernel. The modern and
  speed presets run ``traceable`` per block
  (:mod:`mesa_train.compile_scope`: the identical blocks share one graph, so it compiles in
  the time of one block) against stock compiled per block.

Set it with :func:`set_compile_kernels` (before the first compiled call: Dynamo guards on
it, so a change recompiles) or the environment variable ``MESA_COMPILE_KERNELS``.
"""
from __future__ import annotations

import os

import torch

from mesa_train import quant

__all__ = ["CHOICES", "set_compile_kernels", "compile_kernels", "traced_as_pytorch", "traced_row_sums",
           "traced_when_compiled"]

CHOICES = ("auto", "ops", "traceable")


def _check(mode: str) -> str:
    if mode not in CHOICES:
        raise ValueError(f"compile kernels must be one of {', '.join(CHOICES)}, got {mode!r}")
    return mode


_mode = _check(os.environ.get("MESA_COMPILE_KERNELS", "auto") or "auto")


def set_compile_kernels(mode: str) -> None:
    """Choose the compiled compression kernels: ``auto``, ``ops`` or ``traceable`` (module doc)."""
    global _mode
    _mode = _check(mode)


def compile_kernels() -> str:
    """The current choice (``auto``, ``ops`` or ``traceable``)."""
    return _mode


def traced_as_pytorch(t: torch.Tensor) -> bool:
    """Whether the compression of ``t`` runs as plain PyTorch here: only while compiling,
    and then as the current choice says (``t``'s device does not matter: ``auto`` follows
    the backend, see the module doc)."""
    return torch.compiler.is_compiling() and traced_when_compiled()


def traced_row_sums(t: torch.Tensor) -> bool:
    """Whether a backward whose rows end in warp-order sums (``softmax_backward``,
    ``layer_norm_backward``) runs as plain PyTorch here: as :func:`traced_as_pytorch`, but only
    without the compiled extension. Traced, those sums keep the CUDA kernel's order to give its
    bits, so they are slices and adds, not a reduction Inductor can keep inside one row kernel:
    on a GPU each sweep over the rows became a kernel of its own (Inductor's H100 code for a
    DeiT-S block, ``scripts/inductor_gpu_code.py``: the softmax backward four passes over the
    attention map, 743 MB a block, where stock's is one of 180). Nothing around these ops
    fuses with them anyway (matmuls on both sides), so the extension's op, one launch, serves
    ``traceable`` too; the pure-PyTorch fallback still traces them."""
    return traced_as_pytorch(t) and quant.BACKEND != "extension"


def traced_when_compiled() -> bool:
    """Whether a compiled graph traces the compression as plain PyTorch (the current choice,
    ``auto`` resolved: traced only without the compiled extension)."""
    if _mode != "auto":
        return _mode == "traceable"
    return quant.BACKEND != "extension"
