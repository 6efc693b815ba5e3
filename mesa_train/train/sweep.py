"""Sweep summary: after ``train.py -m ...`` every job's ``summary.json`` (and its command
line overrides) is collected into ``<sweep dir>/summary.csv`` and ``summary.md``.

The throughput column (``images_per_s_mean``) leaves out each job's first few steps
(process start, allocator and compile warm-up). ``SweepSummary`` is a Hydra callback
(configs/hydra/default.yaml); Hydra calls ``on_multirun_end`` once, after the last job. It
needs nothing from Hydra itself.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import sys

from mesa_train.train.rundir import refusal_record

COLUMNS = ["job", "overrides", "status", "epochs", "step", "top1", "top5", "best_top1", "ema_top1",
           "train_loss", "images_per_s_mean", "saved_bytes", "peak_memory_bytes", "error", "run_dir"]


def _overrides(job_dir: str) -> list[str]:
    path = os.path.join(job_dir, ".hydra", "overrides.yaml")
    if not os.path.exists(path):
        return []
    return [line[2:].strip() for line in open(path) if line.startswith("- ")]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


EARLIER = " (earlier run)"  # a job folder's row, where this sweep's job was refused over the run in it


def _folder_row(job_dir: str, failure: dict | None) -> dict:
    """The run in ``job_dir``: its ``summary.json``, or the failure it recorded."""
    row = {"job": os.path.basename(job_dir), "run_dir": job_dir}
    summary = _read_json(os.path.join(job_dir, "summary.json"))
    if failure is not None:
        row.update(status=failure.get("status") or "failed", error=failure.get("error"))
    elif summary is not None:
        row.update({k: v for k, v in summary.items() if k in COLUMNS and k not in row})
    else:
        row["status"] = "failed (no summary.json)"
    return row


def collect(sweep_dir: str) -> tuple[list[dict], list[str]]:
    """One row per job directory under ``sweep_dir``, failed jobs included: a job that
    recorded its failure (``failed.json``, written by train.py) shows ``failed`` and its
    one-line error; a job without any record shows ``failed (no summary.json)``. A job refused
    over an earlier run's folder shows its refusal (its record beside the folder), and the run in
    that folder follows as ``<job> (earlier run)``: its results stay in the table.
    A row's ``overrides`` are those that differ between rows; the second value lists the
    overrides every row shares."""
    rows, per_row = [], []
    for job_dir in sorted(glob.glob(os.path.join(sweep_dir, "*", "")), key=_job_key):
        job_dir = job_dir.rstrip(os.sep)
        refused = _read_json(refusal_record(job_dir))
        if refused is not None:
            rows.append({"job": os.path.basename(job_dir), "run_dir": job_dir,
                         "status": refused.get("status") or "failed", "error": refused.get("error")})
            per_row.append(list(refused.get("overrides") or []))
        failure = _read_json(os.path.join(job_dir, "failed.json"))
        if not os.path.isdir(os.path.join(job_dir, ".hydra")) and failure is None:
            continue
        row = _folder_row(job_dir, failure)
        if refused is not None:
            row["job"] += EARLIER
        rows.append(row)
        per_row.append(_overrides(job_dir) or list((failure or {}).get("overrides") or []))
    common = [o for o in per_row[0] if all(o in job for job in per_row)] if per_row else []
    for row, overrides in zip(rows, per_row):
        row["overrides"] = " ".join(o for o in overrides if o not in common)
    return rows, common


def _job_key(path: str):
    name = os.path.basename(path.rstrip(os.sep))
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return " ".join(str(value).split()).replace("|", "\\|")  # one table cell


def write_summary(sweep_dir: str, interrupted: bool = False) -> list[dict]:
    """``summary.csv`` and ``summary.md`` of the jobs so far; ``interrupted``: a stop signal ended
    the sweep, and the table says the jobs after the last row did not run."""
    rows, common = collect(sweep_dir)
    with open(os.path.join(sweep_dir, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in COLUMNS})
    shown = [c for c in COLUMNS if c != "run_dir"]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in shown) + " |" for row in rows]
    with open(os.path.join(sweep_dir, "summary.md"), "w") as f:
        if interrupted:
            f.write(f"**Interrupted**: a stop signal ended the sweep; the jobs after the last row did not run. To go "
                    f"on, run the same command with hydra.sweep.dir={os.path.abspath(sweep_dir)} (finished jobs are "
                    f"left as they are, the interrupted one resumes).\n\n")
        if common:
            f.write(f"Overrides of every job{' so far' if interrupted else ''}: `{' '.join(common)}`\n\n")
        if any(row["job"].endswith(EARLIER) for row in rows):
            f.write(f"Rows marked *{EARLIER.strip()}* are the runs already in the folders of this sweep's jobs "
                    f"that stopped before they started (refused over that run, or failed at start-up); those "
                    f"folders were left as they were. A job refused because its folder holds another run "
                    f"runs in a new hydra.sweep.dir.\n\n")
        f.write("\n".join(lines) + "\n")
    return rows


class SweepSummary:
    """Hydra callback: write the sweep's summary table when a multirun ends. (Hydra calls
    every hook on every callback, hence the no-op ones.)"""

    def on_run_start(self, config, **kwargs) -> None:
        pass

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_multirun_start(self, config, **kwargs) -> None:
        pass

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        pass

    def on_compose_config(self, config, config_name, overrides) -> None:
        pass

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        if not os.path.isdir(sweep_dir) or int(os.environ.get("RANK", "0")) != 0:
            return  # (under torchrun every rank runs the sweep: rank 0 writes its summary)
        rows = write_summary(sweep_dir)
        jobs = [r for r in rows if not r["job"].endswith(EARLIER)]
        print(f"sweep summary ({len(jobs)} jobs): {os.path.join(sweep_dir, 'summary.md')}")
        failed = [r for r in jobs if str(r.get("status", "")).startswith("failed")]
        if failed:
            print(f"error: {len(failed)} of {len(jobs)} jobs failed: "
                  + "; ".join(f"job {r['job']}: {r.get('error') or r['status']}" for r in failed),
                  file=sys.stderr, flush=True)
            sys.exit(1)
