"""Run logs: CSV and JSON-lines files always, Weights & Biases optionally. Rank 0 only.

Files in the run directory:
    metrics.csv, metrics.jsonl   one row per evaluated epoch (and at a max_steps stop)
    steps.csv                    one row every trainer.log_every optimizer steps
    summary.json                 the final row plus run facts; read by the sweep summary
"""
from __future__ import annotations

import csv
import json
import math
import os
import secrets
from typing import Any

EPOCH_COLUMNS = [
    "epoch", "step", "train_loss", "lr", "images_per_s", "val_loss", "top1", "top5",
    "ema_top1", "ema_top5", "peak_memory_bytes", "saved_bytes", "stock_saved_bytes", "epoch_time_s",
]
STEP_COLUMNS = ["step", "epoch", "batch", "loss", "lr"]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _truncate_rows(path: str, max_step: int, jsonl: bool = False) -> None:
    """Drop rows logged after ``max_step`` (written by a run that was killed after its
    last checkpoint), so a resumed run does not log the same steps twice."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        lines = f.read().splitlines(keepends=True)
    if jsonl:
        kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= max_step]
    else:
        rows = list(csv.DictReader(lines))
        kept = lines[:1] + [ln for ln, row in zip(lines[1:], rows) if int(float(row["step"] or 0)) <= max_step]
    with open(path, "w", newline="") as f:
        f.writelines(kept)


class RunLogger:
    """Writes the run's logs; every method is a no-op when ``enabled`` is False
    (ranks other than 0)."""

    def __init__(self, run_dir: str, enabled: bool = True, wandb_cfg=None, config: dict | None = None,
                 name: str | None = None, resume_step: int | None = None):
        self.run_dir, self.enabled = run_dir, enabled
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_csv = os.path.join(run_dir, "metrics.csv")
        self.metrics_jsonl = os.path.join(run_dir, "metrics.jsonl")
        self.steps_csv = os.path.join(run_dir, "steps.csv")
        if resume_step is not None:
            _truncate_rows(self.metrics_csv, resume_step)
            _truncate_rows(self.metrics_jsonl, resume_step, jsonl=True)
            _truncate_rows(self.steps_csv, resume_step)
        else:  # a fresh run in an existing directory starts fresh logs
            for path in (self.metrics_csv, self.metrics_jsonl, self.steps_csv):
                if os.path.exists(path):
                    os.remove(path)
        if wandb_cfg is not None and wandb_cfg.get("enabled"):
            self._init_wandb(wandb_cfg, config or {}, name)

    def _init_wandb(self, wcfg, config: dict, name: str | None) -> None:
        import wandb

        mode = wcfg.get("mode") or os.environ.get("WANDB_MODE")
        if not mode:
            mode = "online" if wandb_has_key() else "offline"
        # The run id is stored in the run directory, so a resumed run continues the same
        # wandb run.
        id_file = os.path.join(self.run_dir, "wandb_id.txt")
        run_id = open(id_file).read().strip() if os.path.exists(id_file) else secrets.token_hex(4)
        with open(id_file, "w") as f:
            f.write(run_id)
        self.wandb = wandb.init(
            project=wcfg.get("project", "mesa-train"), entity=wcfg.get("entity"), name=name,
            tags=list(wcfg.get("tags") or []), config=config, dir=self.run_dir, mode=mode,
            id=run_id, resume="allow",
        )

    @staticmethod
    def _append_csv(path: str, columns: list[str], row: dict) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        if not new:  # a resumed run keeps the file's columns (written by an older version?)
            with open(path, newline="") as f:
                columns = next(csv.reader(f), None) or columns
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({k: _clean(row.get(k)) for k in columns})

    def log_epoch(self, row: dict) -> None:
        if not self.enabled:
            return
        self._append_csv(self.metrics_csv, EPOCH_COLUMNS, row)
        with open(self.metrics_jsonl, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"epoch/{k}": v for k, v in row.items() if v is not None}, step=row.get("step"))

    def log_step(self, row: dict) -> None:
        if not self.enabled:
            return
        self._append_csv(self.steps_csv, STEP_COLUMNS, row)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in row.items()}, step=row["step"])

    def write_summary(self, summary: dict) -> None:
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "summary.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({k: _clean(v) for k, v in summary.items()}, f, indent=2)
        os.replace(tmp, path)
        if self.wandb is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)):
                    self.wandb.summary[k] = v

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_has_key() -> bool:
    """An API key in the environment or from `wandb login` (~/.netrc)."""
    return bool(os.environ.get("WANDB_API_KEY")) or _wandb_logged_in()


def _wandb_logged_in() -> bool:
    netrc = os.path.expanduser("~/.netrc")
    try:
        return os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()
    except OSError:
        return False
