"""CUDA autocast's softmax on the CPU, for tests: ``aten::softmax`` under CPU autocast runs in
float32 on a half input and returns float32, as CUDA autocast's policy does (CPU autocast
keeps bf16 / f16). Registered at the dispatcher (``AutocastCPU``), so that the C++ layer ops'
``at::softmax`` sees it as well as ``F.softmax``: the one case on which Mesa's attention
behaves differently on a GPU (a float32 map handed to a bf16 ``attn @ v``).

    with cuda_autocast_softmax():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ...
"""
from __future__ import annotations

import contextlib

import torch

_HALF = (torch.float16, torch.bfloat16)


def _softmax_in_float32(x, dim, dtype=None):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    with torch._C._ExcludeDispatchKeyGuard(keys):
        if dtype is None and x.dtype in _HALF:
            x = x.float()
        return torch.ops.aten.softmax.int(x, dim, dtype)


@contextlib.contextmanager
def cuda_autocast_softmax():
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("softmax.int", _softmax_in_float32, "AutocastCPU")
        yield
    finally:
        lib._destroy()
