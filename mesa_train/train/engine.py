"""One training epoch and one evaluation pass (in the spirit of DeiT's / MAE's engine.py).

Nothing here knows about configs or files: the runner builds the parts, these functions
loop over batches. No host sync per step: losses stay on the device and are read only
every ``log_every`` optimizer steps and at the end of the epoch.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from mesa_train.models import unwrap_model as unwrap
from mesa_train.train import distributed as dist_utils


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0           # current epoch (0-based); == epochs when training is done
    batch_in_epoch: int = 0  # batches of `epoch` already trained (resume starts here)
    step: int = 0            # optimizer steps so far, over all epochs
    best_top1: float = -1.0


@dataclass
class Parts:
    """Everything one optimizer step needs."""

    model: nn.Module               # possibly DDP-wrapped / compiled
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    device: torch.device
    scheduler: Any = None          # timm scheduler, stepped per optimizer update
    scaler: Any = None             # torch.amp.GradScaler for fp16, else None
    amp_dtype: torch.dtype | None = None
    mixup: Callable | None = None  # timm Mixup
    ema: Any = None                # timm ModelEmaV3
    grad_accum: int = 1
    clip_grad: float | None = None
    channels_last: bool = False
    extra: dict = field(default_factory=dict)


def build_criterion(smoothing: float, mixup_active: bool) -> nn.Module:
    """Mixup/cutmix give soft targets (smoothing is folded into them by timm's Mixup);
    otherwise label-smoothed or plain cross-entropy."""
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if mixup_active:
        return SoftTargetCrossEntropy()
    if smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=smoothing)
    return nn.CrossEntropyLoss()


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _to_device(parts: Parts, images, targets):
    images = images.to(parts.device, non_blocking=True)
    targets = targets.to(parts.device, non_blocking=True)
    if parts.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, targets


def train_one_epoch(
    parts: Parts,
    loader,
    state: TrainState,
    *,
    batches_per_epoch: int,
    max_steps: int | None = None,
    log_every: int = 50,
    on_log: Callable[[dict], None] | None = None,
    on_step: Callable[[TrainState], None] | None = None,
    measure_saved: bool = False,
    progress: bool = False,
) -> dict:
    """Train ``state.epoch`` from batch ``state.batch_in_epoch`` to the end of the epoch,
    or until ``state.step == max_steps``. ``loader`` must already start at that batch.

    Returns the epoch's mean loss, learning rate, images/s (all ranks), peak memory
    (CUDA: max allocated bytes) and, with ``measure_saved``, the bytes saved for backward
    by the first micro-batch (``mesa_train.memory.SavedTensorMeter``)."""
    model, optimizer, device = parts.model, parts.optimizer, parts.device
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    accum = parts.grad_accum
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    num_batches = num_images = 0
    saved_bytes = None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=batches_per_epoch, initial=state.batch_in_epoch, desc=f"epoch {state.epoch}",
                   dynamic_ncols=True, leave=False)
    start = time.perf_counter()

    for images, targets in loader:
        i = state.batch_in_epoch  # index of this batch in the epoch
        images, targets = _to_device(parts, images, targets)
        if parts.mixup is not None:
            images, targets = parts.mixup(images, targets)
        update = (i + 1) % accum == 0 or i + 1 == batches_per_epoch
        # DDP: only all-reduce gradients on the micro-batch that ends an update.
        sync = model.no_sync() if (not update and hasattr(model, "no_sync")) else contextlib.nullcontext()
        meter = contextlib.nullcontext()
        if measure_saved and saved_bytes is None:
            try:
                from mesa_train.memory import SavedTensorMeter

                meter = SavedTensorMeter(unwrap(model))
            except ImportError:  # the meter is optional for training
                pass
        with sync:
            with meter as m:
                with autocast(device, parts.amp_dtype):
                    outputs = model(images)
                    loss = parts.criterion(outputs, targets)
            if m is not None and saved_bytes is None:
                saved_bytes = int(m.activation_bytes)
            scaled = loss / accum
            if parts.scaler is not None:
                parts.scaler.scale(scaled).backward()
            else:
                scaled.backward()

        loss_sum += loss.detach()
        num_batches += 1
        num_images += images.shape[0]
        state.batch_in_epoch = i + 1

        if update:
            if parts.scaler is not None:
                if parts.clip_grad:
                    parts.scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)
                parts.scaler.step(optimizer)
                parts.scaler.update()
            else:
                if parts.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            if parts.ema is not None:
                parts.ema.update(unwrap(model), step=state.step)
            if parts.scheduler is not None:
                parts.scheduler.step_update(num_updates=state.step)

            if log_every and state.step % log_every == 0:
                value = loss.item()  # the only host sync of the loop
                if not math.isfinite(value):
                    raise FloatingPointError(f"loss is {value} at step {state.step}; stopping")
                if on_log is not None:
                    on_log({"step": state.step, "epoch": state.epoch, "batch": i + 1, "loss": value,
                            "lr": optimizer.param_groups[0]["lr"]})
                if bar is not None:
                    bar.set_postfix(loss=f"{value:.4f}", refresh=False)
            if on_step is not None:
                on_step(state)
            if max_steps is not None and state.step >= max_steps:
                if bar is not None:
                    bar.update(1)
                break
        if bar is not None:
            bar.update(1)

    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    totals = dist_utils.all_reduce_sum([float(loss_sum), float(num_batches), float(num_images)], device)
    mean_loss = totals[0] / max(totals[1], 1.0)
    if not math.isfinite(mean_loss):
        raise FloatingPointError(f"training loss is {mean_loss} in epoch {state.epoch}; stopping")
    out = {
        "train_loss": mean_loss,
        "lr": optimizer.param_groups[0]["lr"],
        "images_per_s": totals[2] / elapsed if elapsed > 0 else float("nan"),
        "train_images": int(totals[2]),
    }
    if device.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if saved_bytes is not None:
        out["saved_bytes"] = saved_bytes
    return out


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp_dtype=None,
             num_classes: int = 1000, channels_last: bool = False) -> dict:
    """Cross-entropy loss, top-1 and top-5 accuracy (%) over the whole loader, summed over
    ranks. Pass the unwrapped model (no DDP collectives during evaluation)."""
    from timm.utils import accuracy

    model.eval()
    topk = (1, min(5, num_classes))
    criterion = nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, images
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp_dtype):
            outputs = model(images)
        outputs = outputs.float()
        n = images.shape[0]
        acc1, acc5 = accuracy(outputs, targets, topk=topk)
        sums += torch.stack([criterion(outputs, targets).double(), acc1.double() * n / 100,
                             acc5.double() * n / 100, torch.tensor(float(n), device=device, dtype=torch.float64)])
    loss, top1, top5, total = dist_utils.all_reduce_sum(sums.tolist(), device)
    total = max(total, 1.0)
    return {"loss": loss / total, "top1": 100.0 * top1 / total, "top5": 100.0 * top5 / total, "images": int(total)}
