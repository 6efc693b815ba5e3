"""A training run's checkpoints: ``last`` after every epoch (and every
``trainer.checkpoint_every`` steps), ``best`` beside it, never a non-finite state.

One file per checkpoint (``torch.save``, written by rank 0) under DDP or a single process;
DCP shards that every rank writes under FSDP2 (``mesa_train.train.sharded``).
"""
from __future__ import annotations

import os

import torch

from mesa_train.plan.train_hook import plan_for_checkpoint
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import distributed as dist_utils
from mesa_train.train import sharded
from mesa_train.train.engine import NONFINITE_FIRST_HINT, NONFINITE_HINT, epoch_totals, first_nonfinite_step
from mesa_train.train.errors import NonFiniteError
from mesa_train.train.rundir import existing_run


class RunSaver:
    """Saves the run ``r`` (the runner's built parts) into ``ckpt_dir``. ``step`` is the step
    the last checkpoint holds (None: none written yet), named in the error that refuses to
    save a non-finite state."""

    def __init__(self, r, ckpt_dir: str, fsdp: bool, last_name: str, step: int | None):
        self.r, self.ckpt_dir, self.fsdp, self.last_name, self.step = r, ckpt_dir, fsdp, last_name, step

    def ensure_finite(self) -> None:
        """Raise NonFiniteError when a loss, gradient or weight went non-finite on any rank
        (every rank checks, all agree): nothing non-finite reaches a checkpoint."""
        r = self.r
        bad = first_nonfinite_step(r.parts, r.model)
        any_bad = dist_utils.all_reduce_sum([0.0 if bad is None else 1.0], r.device)[0] > 0
        if any_bad:
            kept = (f"checkpoints/{self.last_name} still holds step {self.step}" if self.step is not None
                    else "no checkpoint was written")
            where = f"at step {bad}" if bad is not None else "on another rank"
            hint = NONFINITE_HINT if self.step is not None else NONFINITE_FIRST_HINT.format(again=self._again())
            raise NonFiniteError(f"non-finite loss or gradient {where} (epoch {r.state.epoch}); stopped without "
                                 f"saving it: {kept}. To go on: {hint}")

    def _again(self) -> str:
        """How to start this run again when it wrote no checkpoint: in its directory, over the logs
        it wrote (steps.csv, metrics: a run a fresh start refuses to replace) where there are some."""
        logs = existing_run(os.path.dirname(os.path.abspath(self.ckpt_dir)))
        if logs:
            return f"run again with trainer.overwrite=true (it replaces this run's {', '.join(logs)}; no checkpoint)"
        return "run again (the same run directory starts afresh)"

    def save(self, metrics: dict | None, best: bool) -> None:
        """Write ``last`` (and copy it to ``best``). Every rank takes part (RNG states are
        gathered; FSDP: every rank writes its shards)."""
        r = self.r
        self.ensure_finite()
        epoch_totals(r.parts, r.state)
        rngs = [ckpt_lib.rng_state()]
        if r.world > 1:
            gathered = [None] * r.world
            torch.distributed.all_gather_object(gathered, rngs[0])
            rngs = gathered
        common = {
            "scheduler": r.scheduler.state_dict(),
            "scaler": r.scaler.state_dict() if r.scaler is not None else None,
            "state": vars(r.state).copy(),
            "rng": rngs,
            "config": r.plain_cfg,
            "num_classes": r.loaders.num_classes,
            "classes": r.loaders.classes,  # (a resume or evaluation on other class folders is refused)
            "metrics": metrics or {},
            "mesa_plan": plan_for_checkpoint(r.model),  # a resumed run applies this plan again
        }
        if self.fsdp:
            last = os.path.join(self.ckpt_dir, "last.dcp")
            sharded.save_sharded(last, r.model, r.optimizer, {**common, "ema": None},
                                 copy_to=os.path.join(self.ckpt_dir, "best.dcp") if best else None)
        elif r.rank == 0:
            ema = r.parts.ema.module.state_dict() if r.parts.ema is not None else None
            payload = {"model": r.model.state_dict(), "optimizer": r.optimizer.state_dict(), **common, "ema": ema}
            last, best_path = os.path.join(self.ckpt_dir, "last.pt"), os.path.join(self.ckpt_dir, "best.pt")
            # best first: a write that fails between the two (a full disk) leaves last.pt at the
            # step before, so a resume redoes this epoch and writes both; last.pt first left a
            # last.pt that counted this best while best.pt was never written (a review's case)
            ckpt_lib.save_checkpoint(payload, best_path if best else last)
            if best:
                ckpt_lib.copy_checkpoint(best_path, last)
        self.step = r.state.step
