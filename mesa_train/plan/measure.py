"""Measurements the planner takes on the real device: activation bytes kept for backward
(``SavedTensorMeter``), peak memory (CUDA), and step times interleaved across models so
that drift in a shared machine's speed hits every model alike."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.memory import SavedTensorMeter

__all__ = ["Batch", "make_batch", "train_step", "activation_bytes", "peak_bytes", "interleaved_times",
           "step_clock", "clock_description", "median", "fastest", "autocast"]


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    amp: Optional[torch.dtype] = None  # autocast dtype (None: fp32)

    @property
    def device(self) -> torch.device:
        return self.x.device


def make_batch(batch_size: int, img_size: int, num_classes: int, device, amp: Optional[torch.dtype] = None,
               seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, img_size, img_size, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), generator=g)
    return Batch(x.to(device), y.to(device), amp)


def autocast(batch: Batch):
    if batch.amp is None:
        return contextlib.nullcontext()
    return torch.autocast(batch.device.type, dtype=batch.amp)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    with autocast(batch):
        return F.cross_entropy(model(batch.x), batch.y)


def train_step(model: nn.Module, batch: Batch) -> None:
    """Forward, backward, gradients dropped (the optimizer step is the same for every plan,
    so it is left out of what the planner compares)."""
    _loss(model, batch).backward()
    model.zero_grad(set_to_none=True)


def gradients(model: nn.Module, batch: Batch) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
             for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def activation_bytes(model: nn.Module, batch: Batch) -> int:
    """Bytes of activations autograd keeps for backward in one forward pass."""
    with SavedTensorMeter(model) as meter:
        loss = _loss(model, batch)
    del loss
    return int(meter.activation_bytes)


def peak_bytes(model: nn.Module, batch: Batch) -> Optional[int]:
    """CUDA: ``max_memory_allocated`` over one training step (None on other devices)."""
    if batch.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, batch)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock step times are read with: wall time (between synchronizations on CUDA),
    except on a CPU running one intra-op thread, where this process's CPU time
    (``time.process_time``) is the step's compute time and other processes' load on a
    shared machine does not inflate it. With several threads CPU time is wrong: OpenMP
    workers spin-wait through the serial stretches between parallel regions and that
    waiting counts as CPU time (measured on the 2-thread planner DeiT: stock 15.4 ms of CPU
    time for 9.1 ms of wall time, and a Mesa Linear's cost doubled and no longer additive)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def clock_description(device: torch.device) -> str:
    """How :func:`step_clock` measures, for reports."""
    if step_clock(device) is time.process_time:
        return "CPU time of this process per step (time.process_time, 1 intra-op thread)"
    threads = f", {torch.get_num_threads()} intra-op threads" if device.type == "cpu" else ""
    return f"wall time per step (time.perf_counter{threads})"


def interleaved_times(steps: Sequence[Callable[[], None]], device: torch.device, rounds: int,
                      warmup: int = 1) -> List[List[float]]:
    """Seconds per call of each step (:func:`step_clock`), ``rounds`` times, round-robin; the
    order rotates every round, so no step always runs first (or after the same one)."""
    clock = step_clock(device)
    for step in steps:
        for _ in range(warmup):
            step()
    _sync(device)
    times: List[List[float]] = [[] for _ in steps]
    for r in range(rounds):
        for j in range(len(steps)):
            i = (j + r) % len(steps)
            step = steps[i]
            _sync(device)
            t0 = clock()
            step()
            _sync(device)
            times[i].append(clock() - t0)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def fastest(values: Sequence[float]) -> float:
    """The step time the planner uses: the minimum over interleaved rounds (other processes
    on a shared machine only ever add time; the minimum repeats best across runs)."""
    return float(min(values))
