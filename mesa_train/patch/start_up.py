"""The start-up forwards that ``train.py`` and the bench's rows make on a patched model, shared so
that a bench row measures the model training runs.

- ``start_up_images``: the example images, in the size and memory format training feeds (a layout
  can change what a forward keeps: a channels-last conv keeps its input channels-last);
- ``skip_duplicated_at_start_up``: ``skip_duplicated`` (patch/duplicates.py) for a run that goes on
  whatever it finds. A measuring forward that fails (a model that refuses two random images) leaves
  the layers the ops ask for compressed, as patched; the result's ``failed`` says why and so does a
  mark on the model (``skip_failure``, read by ``describe`` and a bench row's notes). Out of memory
  stops a bench row (its status: oom) and is one more such failure in training (a batch of one may
  fit where the two example images do not).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from mesa_train.models import unwrap_module

from .duplicates import (SkippedDuplicates, full_operand_duplicates, fused_back_attentions, left_stock_duplicates,
                         skip_duplicated)
from .skip_marks import SKIP_FAILED_ATTR

__all__ = ["skip_duplicated_at_start_up", "skip_failure", "skipped_note", "start_up_images"]


def start_up_images(n: int, img_size: int, *, channels_last: bool, device: torch.device | str,
                    random: bool = False) -> torch.Tensor:
    """``n`` RGB images of ``img_size``: zeros (the reuse probe, a stock figure), or normal noise from
    a fixed seed (``random``: a measurement every rank and a resumed run repeat), leaving the global
    RNG untouched; channels-last where training feeds that."""
    shape = (n, 3, img_size, img_size)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) if random else torch.zeros(shape)
    return x.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def skip_duplicated_at_start_up(model: nn.Module, example_input, *, run: Optional[Callable] = None,
                                stop_on_oom: bool = True) -> SkippedDuplicates:
    """``skip_duplicated(model, example_input, run=run)``, or, where a measuring forward fails, the
    model as patched and a result whose ``failed`` (also ``skip_failure(model)``) says why. Out of
    memory goes on where ``stop_on_oom`` (a bench row: its status is oom); training passes False:
    its batch may be smaller than the example's two images and fit."""
    try:
        return skip_duplicated(model, example_input, run=run)
    except torch.cuda.OutOfMemoryError:
        if stop_on_oom:
            raise
        torch.cuda.empty_cache()
        return _failed(model, "ran out of memory")
    except Exception as err:  # (skip_duplicated undid its switches before the error came here)
        return _failed(model, f"failed ({err})")


def _failed(model: nn.Module, how: str) -> SkippedDuplicates:
    why = f"measured nothing, its forward of the example input {how}; the layers the ops ask for stay compressed"
    unwrap_module(model, "skip_duplicated").__dict__[SKIP_FAILED_ATTR] = why
    return SkippedDuplicates(failed=why)


def skip_failure(model: nn.Module) -> str:
    """Why the last ``skip_duplicated_at_start_up`` of ``model`` measured nothing ("" if it did)."""
    return unwrap_module(model, "skip_failure").__dict__.get(SKIP_FAILED_ATTR, "")


def skipped_note(model: nn.Module) -> str:
    """One short note of what the last start-up ``skip_duplicated`` of ``model`` left stock, kept in
    full or put back on the fused path, or why it measured nothing ("" if it changed nothing): a
    bench row's notes, a gradient-fidelity row's."""
    if skip_failure(model):
        return "duplicates=skip " + skip_failure(model)
    layers, fused = len(left_stock_duplicates(model)), len(fused_back_attentions(model))
    operands = len(full_operand_duplicates(model))
    parts = [f"{layers} Mesa layer(s) left stock"] * bool(layers) + \
        [f"{operands} MatMul(s) keeping an operand in full"] * bool(operands) + \
        [f"{fused} attention(s) back on their fused path"] * bool(fused)
    return ("duplicates=skip: " + ", ".join(parts) + " (their copies duplicated what other modules keep)"
            if parts else "")
