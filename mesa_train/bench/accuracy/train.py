"""One training run of the accuracy table: a row's config at one seed, trained by the real
training pipeline (`mesa_train.train.runner.fit`, the same code path as ``train.py`` and
``make demo``), its per-epoch curves read back from the run's ``metrics.jsonl``.

`run_task` is what the worker processes execute; it only takes and returns plain data.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

RUN_FLAGS = ["trainer.progress=false", "trainer.resume=null"]  # every run starts fresh, quietly
CURVE_KEYS = ("epoch", "train_loss", "val_loss", "top1", "top5")


@dataclass(frozen=True)
class Task:
    label: str
    seed: int
    experiment: str
    overrides: tuple[str, ...]
    run_dir: str


@contextlib.contextmanager
def _outside_running_hydra_app():
    """Hydra's compose API refuses to start while a Hydra app (ours, with jobs=1) holds the
    global instance: park that instance, compose, and put it back."""
    from hydra.core.global_hydra import GlobalHydra

    instance = GlobalHydra.instance()
    parked = instance.hydra if instance.is_initialized() else None
    if parked is not None:
        instance.clear()
    try:
        yield
    finally:
        if parked is not None:
            if instance.is_initialized():
                instance.clear()
            instance.initialize(parked)


def compose_run(experiment: str, overrides: list[str], seed: int):
    """The composed training config of one run (train.yaml + experiment + overrides), via
    the demo's compose (the same configs as ``make demo``)."""
    from mesa_train.demo import compose

    with _outside_running_hydra_app():
        return compose(experiment, [*overrides, *RUN_FLAGS, f"trainer.seed={seed}"])


def set_threads(threads: int) -> None:
    """Worker initializer: a fixed thread count per run (small models train faster with
    one thread per process and one process per core)."""
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("mesa_train.train").setLevel(logging.WARNING)


def read_curves(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    curves = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                curves.append({k: row.get(k) for k in CURVE_KEYS})
    return curves


def run_task(task: Task) -> dict[str, Any]:
    """Train one (row, seed); never raises: a failure is returned as ``status='error'``."""
    from mesa_train.train.runner import fit

    start = time.perf_counter()
    out: dict[str, Any] = {"label": task.label, "seed": task.seed, "run_dir": task.run_dir}
    try:
        cfg = compose_run(task.experiment, list(task.overrides), task.seed)
        summary = fit(cfg, task.run_dir)
        curves = read_curves(task.run_dir)
        last = curves[-1] if curves else {}
        out.update(status="ok", top1=summary.get("top1"), top5=summary.get("top5"),
                   val_loss=last.get("val_loss"), train_loss=summary.get("train_loss"),
                   best_top1=summary.get("best_top1"), epochs=summary.get("epochs"),
                   steps=summary.get("step"), saved_bytes=summary.get("saved_bytes"),
                   images_per_s=summary.get("images_per_s_mean"), curves=curves)
    except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
        out.update(status="error", error=f"{type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=8))
    out["wall_s"] = time.perf_counter() - start
    return out
