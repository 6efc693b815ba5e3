"""What the kernel tests share: when they can run, and the dtypes and devices they run on.

``needs_ext``: the compiled extension is loaded (without it ``torch.ops.mesa`` is the
pure-PyTorch reference, and a test comparing kernel to reference would compare the reference
with itself). ``needs_cuda``: a CUDA GPU is visible; ``CUDA`` is the ``device`` parameter that
carries it with the ``cuda`` marker (``make gpu-results`` selects by that marker); ``DEVICES`` and
``EXT_DEVICES`` are the ``device`` parameters built from it.
"""
from __future__ import annotations

import pytest
import torch

import mesa_train.quant as Q

needs_ext = pytest.mark.skipif(Q.BACKEND != "extension", reason=f"compiled extension not loaded: {Q.extension_error}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])
# The ``device`` parameters of a kernel test: the CPU and, marked, CUDA; ``EXT_DEVICES`` also
# skips the CPU without the extension (where its test needs no ``needs_ext`` of its own)
DEVICES = ["cpu", CUDA]
EXT_DEVICES = [pytest.param("cpu", marks=needs_ext), CUDA]

# The activation dtypes every kernel takes, and short ids for them in test names
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DT_IDS = ("fp32", "fp16", "bf16")


def cpu_uniform(shape, low: float, high: float, seed: int) -> torch.Tensor:
    """Uniform values from a seeded CPU generator, to copy onto any device (a CPU generator
    cannot fill a CUDA tensor in place): the same values on every device."""
    return torch.empty(shape).uniform_(low, high, generator=torch.Generator().manual_seed(seed))
