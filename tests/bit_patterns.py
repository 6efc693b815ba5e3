"""Bit-pattern comparisons for the tests that pin bits: ``torch.equal`` takes -0.0 for 0.0 and
fails on NaN, so these compare the floats' integer views (signed zeros, NaN payloads too)."""
from __future__ import annotations

import torch

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """A floating tensor's bit patterns as integers (any other dtype as it is)."""
    return t.detach().contiguous().view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def same_bits_nan_aside(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs aside: NaN at the same places, whatever their sign and payload (x86
    and GPUs propagate different NaN bits, and a compiler may commute an add's operands)."""
    nan = b.isnan()
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), nan)
            and torch.equal(bit_pattern(a)[~nan], bit_pattern(b)[~nan]))


def assert_all_same_bits(got: list, want: list) -> None:
    """Two runs' results, entry by entry (``None`` for a gradient not asked for): the same
    dtype, strides and bit patterns."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and a.stride() == b.stride(), i
            assert torch.equal(bit_pattern(a), bit_pattern(b)), i
