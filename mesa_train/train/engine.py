"""One training epoch and one evaluation pass (in the spirit of DeiT's / MAE's engine.py).

Nothing here knows about configs or files: the runner builds the parts, these functions
loop over batches. No host sync per step: losses stay on the device and are read only
every ``log_every`` optimizer steps and at the end of the epoch.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from mesa_train.models import unwrap_model as unwrap
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.train import distributed as dist_utils
from mesa_train.train.errors import NonFiniteError


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0           # current epoch (0-based); == epochs when training is done
    batch_in_epoch: int = 0  # batches of `epoch` already trained (resume starts here)
    step: int = 0            # optimizer steps so far, over all epochs
    best_top1: float = -1.0
    # The current epoch's loss sum and batch count so far, over all ranks: a resumed epoch's
    # train_loss still averages every batch of the epoch.
    epoch_loss_sum: float = 0.0
    epoch_batches: int = 0
    skipped_steps: int = 0   # steps not applied: non-finite loss/gradient (trainer.nonfinite=skip)
    # the latest of them in a row, across epochs and resumes (trainer.max_nonfinite_skips)
    skipped_in_a_row: int = 0


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
    compiled: bool = False         # model is torch.compile'd (marks CUDA-graph step boundaries)
    nonfinite: str = "stop"        # stop | skip (see train_one_epoch)
    max_nonfinite_skips: int = 10  # consecutive skipped steps before stopping anyway
    estimates_marked: bool = False  # mark_estimates_ready has run (compiled runs, after the first step)
    extra: dict = field(default_factory=dict)  # running totals shared with the runner
    # Makes the Mesa running estimates identical on all ranks after each optimizer step
    # (mesa_train.train.estimates.EstimateSync); None in a single process.
    estimate_sync: Any = None


# (what a resume may change is the checkpoint's RESUME_MAY_CHANGE: not the learning rate or the
# clipping, so those go with a new run from the weights; a review found the advice refused)
_NEW_RUN_HINT = ("or start a new run (another hydra.run.dir) from the kept weights "
                 "(model.pretrained_path=<its checkpoint>) with a lower learning rate (optim.lr / optim.base_lr) "
                 "or clipped gradients (trainer.clip_grad=1.0), which a resume cannot change")
NONFINITE_HINT = f"resume skipping such steps (trainer.nonfinite=skip), {_NEW_RUN_HINT}"
# (before the first checkpoint there is nothing to resume or start from: the run starts afresh,
# over its own logs where it wrote some: {again} says how)
NONFINITE_FIRST_HINT = ("{again} skipping such steps (trainer.nonfinite=skip), with a lower learning rate "
                        "(optim.lr / optim.base_lr) or clipped gradients (trainer.clip_grad=1.0)")
# (skip mode is what stopped: the way out on resume is a longer streak)
SKIP_LIMIT_HINT = f"resume allowing more skipped steps in a row (trainer.max_nonfinite_skips), {_NEW_RUN_HINT}"


def epoch_totals(parts: Parts, state: TrainState) -> None:
    """Write the epoch's loss sum and batch count so far (summed over ranks) into
    ``state``, for a checkpoint."""
    loss_sum, batches = parts.extra.get("loss_sum"), parts.extra.get("batches", 0)
    if loss_sum is None:
        return
    totals = dist_utils.all_reduce_sum([float(loss_sum), float(batches)], parts.device)
    state.epoch_loss_sum, state.epoch_batches = totals[0], int(round(totals[1]))


def first_nonfinite_step(parts: Parts, model: nn.Module) -> int | None:
    """The first step whose loss or gradient was non-finite (``None``: all finite), or
    the current step when a weight is non-finite. One host sync; called before every
    checkpoint so that nothing non-finite is ever saved."""
    flagged = parts.extra.get("first_bad")
    step = int(flagged) if flagged is not None else -1
    if step >= 0:
        return step
    from mesa_train.train.fsdp import local_tensor

    # FSDP: each rank checks its own shards (the runner combines the ranks' answers).
    params = [local_tensor(p) for p in unwrap(model).parameters()]
    if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        return int(parts.extra.get("step", 0))
    return None


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


def _grad_norm(parts: Parts, model: nn.Module) -> torch.Tensor:
    """Clip to ``clip_grad`` when set; the total norm either way (inf/nan when a gradient is)."""
    from mesa_train.train.fsdp import full_tensor

    max_norm = parts.clip_grad if parts.clip_grad else float("inf")
    # FSDP: sharded gradients give a DTensor norm; its full value is the global norm.
    return full_tensor(nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _optimizer_step(parts: Parts, model: nn.Module, state: TrainState, step_loss_ok: torch.Tensor) -> bool:
    """One optimizer update. Returns False when the step was skipped (non-finite, skip mode).

    stop mode: no host sync; a device-side flag records the first non-finite step and the
    runner checks it before any checkpoint. skip mode: one sync per step decides whether
    the update is applied (like GradScaler does for fp16)."""
    optimizer, scaler = parts.optimizer, parts.scaler
    check_grads = parts.nonfinite == "skip" and scaler is None  # fp16: the scaler skips inf grads itself
    norm = None
    if scaler is not None and parts.clip_grad:
        scaler.unscale_(optimizer)
    if parts.clip_grad or check_grads:
        norm = _grad_norm(parts, model)
    ok = step_loss_ok if norm is None or scaler is not None else step_loss_ok & torch.isfinite(norm)
    if parts.nonfinite == "skip" and not bool(ok):
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update(scaler.get_scale() / 2)  # the loss itself overflowed
        return False
    first_bad = parts.extra["first_bad"]
    first_bad.copy_(torch.where((first_bad < 0) & ~ok, torch.full_like(first_bad, state.step + 1), first_bad))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


@dataclass
class _EpochTally:
    """Running totals of one ``train_one_epoch`` call. The loss sum and batch count stay on
    the device (added to without a host sync); the rest are host counters."""

    loss_sum: torch.Tensor         # float64, this rank's share of the epoch's loss sum
    batches: torch.Tensor          # float64, batches in the mean (skip mode: finite ones only)
    step_loss_ok: torch.Tensor     # bool: every micro-batch of the current update was finite
    warmup_batches: int            # batches of this call left out of images/s
    start: float = field(default_factory=time.perf_counter)
    timed_start: float | None = None
    num_images: int = 0
    timed_images: int = 0
    run_batches: int = 0           # batches of this call so far
    saved_bytes: int | None = None
    loss_text: str = ""            # the last logged loss, for the progress bar

    def __post_init__(self):
        if self.warmup_batches <= 0:
            self.timed_start = self.start

    def add_batch(self, nonfinite: str, loss: torch.Tensor, images: int) -> None:
        detached = loss.detach()
        finite = torch.isfinite(detached)
        self.step_loss_ok &= finite
        if nonfinite == "skip":
            self.loss_sum += torch.where(finite, detached, torch.zeros_like(detached))
            self.batches += finite
        else:
            self.loss_sum += detached
            self.batches += 1
        self.num_images += images
        self.run_batches += 1
        if self.timed_start is None and self.run_batches >= self.warmup_batches:
            self.timed_start, self.timed_images = time.perf_counter(), 0
        elif self.timed_start is not None:
            self.timed_images += images


def _start_tally(parts: Parts, state: TrainState, warmup_batches: int) -> _EpochTally:
    """The epoch's totals so far (a resumed epoch starts from its checkpoint's), shared with
    the runner through ``parts.extra`` for a mid-epoch checkpoint."""
    device = parts.device
    if state.batch_in_epoch == 0:
        state.epoch_loss_sum, state.epoch_batches = 0.0, 0
    world = dist_utils.world_size()
    # This rank's share of the (all-rank) totals saved at a mid-epoch checkpoint.
    tally = _EpochTally(
        loss_sum=torch.full((), state.epoch_loss_sum / world, device=device, dtype=torch.float64),
        batches=torch.full((), state.epoch_batches / world, device=device, dtype=torch.float64),
        step_loss_ok=torch.ones((), device=device, dtype=torch.bool), warmup_batches=warmup_batches)
    parts.extra.update(loss_sum=tally.loss_sum, batches=tally.batches, step=state.step)
    parts.extra.setdefault("first_bad", torch.full((), -1, device=device, dtype=torch.int64))
    return tally


def _forward_backward(parts: Parts, model: nn.Module, images, targets, update: bool, tally: _EpochTally,
                      measure_saved: bool) -> torch.Tensor:
    """One micro-batch's forward and backward; its (unscaled) loss."""
    # DDP: only all-reduce gradients on the micro-batch that ends an update. (FSDP
    # reduce-scatters every micro-batch into the sharded gradients: keeping whole
    # unsharded gradients between micro-batches would undo its memory saving.)
    sync = model.no_sync() if (not update and hasattr(model, "no_sync")) else contextlib.nullcontext()
    meter = contextlib.nullcontext()
    if measure_saved and tally.saved_bytes is None:
        try:
            from mesa_train.memory import SavedTensorMeter

            meter = SavedTensorMeter(unwrap(model))
        except ImportError:  # the meter is optional for training
            pass
    with sync:
        with autocast(parts.device, parts.amp_dtype):
            # the model's forward only, as the stock figure beside it (runner._stock_saved_bytes):
            # the loss's own saved tensors do not grow with Mesa
            with meter as m:
                outputs = model(images)
            loss = parts.criterion(outputs, targets)
        if m is not None and tally.saved_bytes is None:
            tally.saved_bytes = int(m.activation_bytes)
        scaled = loss / parts.grad_accum
        if parts.scaler is not None:
            parts.scaler.scale(scaled).backward()
        else:
            scaled.backward()
    return loss


def _finish_update(parts: Parts, model: nn.Module, state: TrainState, tally: _EpochTally) -> None:
    """After the micro-batch that ends an update: the optimizer step (or its skip), then what
    follows every step (estimates, EMA, scheduler)."""
    applied = _optimizer_step(parts, model, state, tally.step_loss_ok)
    if parts.compiled and not parts.estimates_marked:
        # estimator=delayed, traced compression: after the first step the estimates
        # are initialized, and the compiled graph can fuse the one-pass form (rebuilt once)
        mark_estimates_ready(unwrap(model))
        parts.estimates_marked = True
    if parts.estimate_sync is not None:  # every rank, applied or skipped: a collective
        parts.estimate_sync.sync()
    tally.step_loss_ok.fill_(True)
    state.step += 1
    parts.extra["step"] = state.step
    if applied:
        state.skipped_in_a_row = 0
        if parts.ema is not None:
            parts.ema.update(unwrap(model), step=state.step)
    else:
        state.skipped_steps += 1
        state.skipped_in_a_row += 1  # (in the state: an epoch shorter than the limit cannot reset it)
        logging.getLogger("mesa_train.train").warning(
            "step %d skipped: non-finite loss or gradient (%d skipped in total)", state.step, state.skipped_steps)
        if state.skipped_in_a_row >= parts.max_nonfinite_skips:
            raise NonFiniteError(
                f"{state.skipped_in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                f"{state.step}); stopped. The last checkpoint is unaffected; {SKIP_LIMIT_HINT}")
    if parts.scheduler is not None:
        parts.scheduler.step_update(num_updates=state.step)


def _epoch_result(parts: Parts, state: TrainState, tally: _EpochTally, interrupted: bool) -> dict:
    """The epoch's figures over all ranks (one all-reduce), and its totals into ``state``."""
    device = parts.device
    end = time.perf_counter()
    elapsed = end - tally.start
    if tally.timed_start is None or tally.timed_images == 0:  # too few batches to leave the warm-up out
        timed_images, timed_elapsed = tally.num_images, elapsed
    else:
        timed_images, timed_elapsed = tally.timed_images, end - tally.timed_start
    totals = dist_utils.all_reduce_sum(
        [float(tally.loss_sum), float(tally.batches), float(tally.num_images), float(timed_images)], device)
    state.epoch_loss_sum, state.epoch_batches = totals[0], int(round(totals[1]))
    out = {
        # (no finite batch, every step skipped: no loss to report, logged empty rather than 0)
        "train_loss": totals[0] / totals[1] if totals[1] > 0 else float("nan"),
        "lr": parts.optimizer.param_groups[0]["lr"],
        "images_per_s": totals[3] / timed_elapsed if timed_elapsed > 0 else float("nan"),
        "train_images": int(totals[2]),
        "train_seconds": elapsed,
        "timed_images": int(totals[3]),
        "timed_seconds": timed_elapsed,
    }
    if interrupted:
        out["interrupted"] = True
    if device.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if tally.saved_bytes is not None:
        out["saved_bytes"] = tally.saved_bytes
    return out


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
    epochs: int | None = None,
    warmup_batches: int = 0,
    stop_requested: Callable[[], bool] | None = None,
) -> dict:
    """Train ``state.epoch`` from batch ``state.batch_in_epoch`` to the end of the epoch,
    or until ``state.step == max_steps``, or until ``stop_requested()`` (checked after each
    optimizer step; the result then has ``interrupted=True``). ``loader`` must already
    start at that batch.

    Returns the epoch's mean loss (the batches of a resumed epoch before the resume
    included), learning rate, images/s over all ranks (the first ``warmup_batches`` of this
    call excluded: start-up, allocator and compile warm-up), peak memory (CUDA: max
    allocated bytes) and, with ``measure_saved``, the bytes saved for backward by the first
    micro-batch (``mesa_train.memory.SavedTensorMeter``).

    A non-finite loss or gradient: ``parts.nonfinite="stop"`` records its step on the device
    (``first_nonfinite_step``), ends the epoch at the next log step, and the runner stops
    without saving; ``"skip"`` drops that update (counted in ``state.skipped_steps``, left
    out of the mean loss) and raises ``NonFiniteError`` after ``max_nonfinite_skips`` in a row."""
    model, device, accum = parts.model, parts.device, parts.grad_accum
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tally = _start_tally(parts, state, warmup_batches)
    interrupted = False
    bar = None
    if progress:
        from tqdm import tqdm

        desc = f"epoch {state.epoch + 1}/{epochs}" if epochs else f"epoch {state.epoch + 1}"
        bar = tqdm(total=batches_per_epoch, initial=state.batch_in_epoch, desc=desc, dynamic_ncols=True,
                   leave=False)
    batches_left_after = (epochs - state.epoch - 1) * batches_per_epoch if epochs else 0

    for images, targets in loader:
        # 1. one micro-batch: forward, backward, its loss counted on the device
        i = state.batch_in_epoch  # index of this batch in the epoch
        if parts.compiled:
            # a step boundary for CUDA-graph trees (trainer.compile_mode=reduce-overhead): the
            # last step's graph outputs may be reused from here on (a no-op without graphs)
            torch.compiler.cudagraph_mark_step_begin()
        images, targets = _to_device(parts, images, targets)
        if parts.mixup is not None:
            images, targets = parts.mixup(images, targets)
        update = (i + 1) % accum == 0 or i + 1 == batches_per_epoch
        loss = _forward_backward(parts, model, images, targets, update, tally, measure_saved)
        tally.add_batch(parts.nonfinite, loss, images.shape[0])
        state.batch_in_epoch = i + 1

        # 2. the micro-batch that ends an update: optimizer step, then logging, progress, stop
        if update:
            _finish_update(parts, model, state, tally)
            if log_every and state.step % log_every == 0:
                value = loss.item()  # the only host sync of the loop (stop mode)
                if not math.isfinite(value) and parts.nonfinite == "stop":
                    break  # the runner reports it (first_nonfinite_step) and saves nothing
                if on_log is not None:
                    on_log({"step": state.step, "epoch": state.epoch, "batch": i + 1, "loss": value,
                            "lr": parts.optimizer.param_groups[0]["lr"]})
                tally.loss_text = f"loss {value:.4f}  "
            if on_step is not None:
                on_step(state)
            if bar is not None:
                bar.set_postfix_str(tally.loss_text + _eta(time.perf_counter() - tally.start, tally.run_batches,
                                                           batches_per_epoch - state.batch_in_epoch
                                                           + batches_left_after, max_steps, state.step, accum),
                                    refresh=False)
            stop = max_steps is not None and state.step >= max_steps
            if not stop and stop_requested is not None and stop_requested():
                stop = interrupted = True
            if stop:
                if bar is not None:
                    bar.update(1)
                break
        if bar is not None:
            bar.update(1)

    if bar is not None:
        bar.close()
    return _epoch_result(parts, state, tally, interrupted)


def _eta(elapsed: float, batches: int, batches_left: int, max_steps: int | None, step: int, accum: int) -> str:
    """'run ETA h:mm:ss' from this epoch's pace, to the end of training."""
    if max_steps is not None:
        batches_left = min(batches_left, max(max_steps - step, 0) * accum)
    if batches == 0:
        return ""
    seconds = int(elapsed / batches * batches_left)
    return f"run ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp_dtype=None,
             num_classes: int = 1000, channels_last: bool = False, lockstep_shape=None) -> dict:
    """Cross-entropy loss, top-1 and top-5 accuracy (%) over the whole loader, summed over
    ranks. Pass the unwrapped model (no DDP collectives during evaluation).

    ``lockstep_shape`` (an image batch shape, for a sharded FSDP model whose forward is a
    collective): every rank runs as many forwards as the rank with the most batches, the
    extra ones on a zero batch of that shape and left out of the metrics."""
    from timm.utils import accuracy

    model.eval()
    topk = (1, min(5, num_classes))
    criterion = nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, images
    batches = 0
    most = None
    if lockstep_shape is not None and dist_utils.world_size() > 1:
        # (agreed before the loop: a collective after it met the longer rank's next sharded
        # forward, and the run hung; a review's 129 images over 2 ranks)
        most = torch.tensor([len(loader)], device=device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    for images, targets in loader:
        batches += 1
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
    if most is not None:
        for _ in range(int(most) - batches):
            with autocast(device, amp_dtype):
                model(torch.zeros(tuple(lockstep_shape), device=device))
    loss, top1, top5, total = dist_utils.all_reduce_sum(sums.tolist(), device)
    total = max(total, 1.0)
    return {"loss": loss / total, "top1": 100.0 * top1 / total, "top5": 100.0 * top5 / total, "images": int(total)}
