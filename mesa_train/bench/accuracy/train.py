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


def _task_key(task: Task) -> dict[str, Any]:
    return {"experiment": task.experiment, "overrides": list(task.overrides), "seed": task.seed}


def finished_summary(task: Task) -> dict[str, Any] | None:
    """The summary of an earlier, finished run of exactly this task in ``task.run_dir``
    (``keep_runs=DIR``: an interrupted table restarts where it stopped), else None."""
    key_path, summary_path = (os.path.join(task.run_dir, n) for n in ("task.json", "summary.json"))
    try:
        with open(key_path) as f:
            same = json.load(f) == _task_key(task)
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if same and summary.get("status") == "done" else None


def run_task(task: Task) -> dict[str, Any]:
    """Train one (row, seed); never raises: a failure is returned as ``status='error'``."""
    from mesa_train.train.runner import fit

    start = time.perf_counter()
    out: dict[str, Any] = {"label": task.label, "seed": task.seed, "run_dir": task.run_dir}
    try:
        summary = finished_summary(task)
        out["reused"] = summary is not None
        if summary is None:
            cfg = compose_run(task.experiment, list(task.overrides), task.seed)
            os.makedirs(task.run_dir, exist_ok=True)
            with open(os.path.join(task.run_dir, "task.json"), "w") as f:
                json.dump(_task_key(task), f)
            summary = fit(cfg, task.run_dir)
            summary["wall_s"] = time.perf_counter() - start
            with open(os.path.join(task.run_dir, "summary.json"), "w") as f:  # with the wall time
                json.dump(summary, f, default=str)
        curves = read_curves(task.run_dir)
        last = curves[-1] if curves else {}
        out.update(status="ok", top1=summary.get("top1"), top5=summary.get("top5"),
                   val_loss=last.get("val_loss"), train_loss=summary.get("train_loss"),
                   best_top1=summary.get("best_top1"), epochs=summary.get("epochs"),
                   steps=summary.get("step"), saved_bytes=summary.get("saved_bytes"),
                   images_per_s=summary.get("images_per_s_mean"), curves=curves)
        out["wall_s"] = summary.get("wall_s")
    except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
        out.update(status="error", error=f"{type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=8))
        out["wall_s"] = time.perf_counter() - start
    return out
