"""Share one compressed copy of a tensor between a producer and its consumer.

A Mesa ``Softmax`` saves its output compressed; when that output is directly the left
operand of a Mesa ``MatMul`` (``attn @ v``), the MatMul would quantize the same values
again. Instead the producer *offers* its :class:`~mesa_train.nn.quantizer.Packed` here and
the consumer *takes* it, so both backward passes use one uint8 copy.

The cache is thread-local and keyed by the tensor's memory (data pointer, offset, sizes,
strides, dtype, device). An entry is valid only while the offered tensor is alive (weak
reference, the entry is dropped when it dies) and unmodified (same ``_version``), and only
for the same grouping (``dim``, ``num_groups``). Nothing here runs under ``torch.compile``
(tracing sees fake tensors): there the attention paths hand the copy over explicitly
(``Softmax.forward_with_copy`` -> ``MatMul(..., shared_a=)``, in patch/attention.py and
patch/generic_attention.py); any other producer/consumer pair quantizes twice when compiled.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from .quantizer import Packed

__all__ = ["offer", "take", "clear", "size", "disabled", "is_enabled"]


class _Local(threading.local):
    # class-level defaults: reading a thread's unset attribute then finds these instead of
    # raising inside getattr(_local, name, default) (~0.8 us a read; is_enabled runs per layer)
    off = 0
    cache = None


_local = _Local()


def _cache() -> dict:
    c = _local.cache
    if c is None:
        c = _local.cache = {}
    return c


def is_enabled() -> bool:
    """Sharing is on unless inside :func:`disabled` (this thread) or while compiling."""
    return not _local.off and not torch.compiler.is_compiling()


_enabled = is_enabled


@contextlib.contextmanager
def disabled():
    """Turn sharing off in this thread (every consumer quantizes its own copy)."""
    _local.off += 1
    try:
        yield
    finally:
        _local.off -= 1


def _key(t: torch.Tensor):
    return (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def offer(t: torch.Tensor, packed: Packed) -> None:
    """Register ``packed`` as the compressed copy of ``t`` (as it is now)."""
    if not _enabled() or t.numel() == 0:
        return
    cache = _cache()
    key = _key(t)

    def _drop(_ref, key=key, cache=cache):
        entry = cache.get(key)
        if entry is not None and entry[0] is _ref:
            del cache[key]

    cache[key] = (weakref.ref(t, _drop), t._version, packed)


def take(t: torch.Tensor, dim: int, num_groups: int) -> Packed | None:
    """The compressed copy of ``t`` if one was offered for this grouping, else ``None``."""
    if not _enabled() or t.numel() == 0:
        return None
    cache = _cache()
    if not cache:
        return None
    entry = cache.get(_key(t))
    if entry is None:
        return None
    ref, version, packed = entry
    if ref() is None or t._version != version:
        return None
    if packed.dim != dim % t.dim() or packed.num_groups != num_groups:
        return None
    return packed


def clear() -> None:
    _cache().clear()


def size() -> int:
    return len(_cache())
