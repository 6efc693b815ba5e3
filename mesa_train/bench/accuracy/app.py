"""The accuracy app without Hydra: `run_app(cfg)` takes the composed config (the preset under
``cfg.preset``), validates every row, trains every (row, seed) in worker processes, and
writes ``<output_dir>/<preset>/digits.{md,csv,runs.csv,json,png,summary.png}``."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from mesa_train.bench import report as bench_report
from mesa_train.bench.accuracy import plot, report
from mesa_train.bench.accuracy.spec import AccuracySpec, check_training_configs, parse_spec
from mesa_train.bench.accuracy.train import Task, run_task, set_threads
from mesa_train.bench.presets import BenchConfigError, check_switches

SLUG = "digits"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _say(msg: str, bar=None) -> None:
    if bar is not None and not bar.disable:
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def prepare(cfg: Any) -> AccuracySpec:
    from omegaconf import OmegaConf

    preset = cfg.preset if isinstance(cfg.preset, dict) else OmegaConf.to_container(cfg.preset, resolve=True)
    spec = parse_spec(dict(preset))
    jobs = _get(cfg, "jobs")
    if jobs is not None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise BenchConfigError(f"jobs={jobs!r}: must be a positive integer (parallel training processes)")
        spec.jobs = jobs
    check_training_configs(spec)
    return spec


def tasks_for(spec: AccuracySpec, work_dir: str) -> list[Task]:
    """Every (row, seed), seed-major so a partial run already covers every row."""
    tasks = []
    for seed in spec.seeds:
        for i, row in enumerate(spec.rows):
            run_dir = os.path.join(work_dir, f"{i:02d}", f"seed{seed}")
            tasks.append(Task(row.label, seed, spec.experiment, tuple([*spec.train, *row.overrides()]), run_dir))
    return tasks


def train_all(spec: AccuracySpec, tasks: list[Task], show: bool) -> dict[str, list[dict[str, Any]]]:
    """Run the tasks (inline with one job, else a spawn process pool); results by row label."""
    from tqdm.auto import tqdm

    runs: dict[str, list[dict[str, Any]]] = {r.label: [] for r in spec.rows}
    bar = tqdm(total=len(tasks), desc=f"accuracy {spec.name}", unit="run", disable=not show,
               file=sys.stderr, dynamic_ncols=True)

    def done(result: dict[str, Any]) -> None:
        runs[result["label"]].append(result)
        if result["status"] == "ok":
            bar.set_postfix_str(f"{result['label'][:24]} s{result['seed']}: {result['top1']:.1f}%")
        else:
            _say(f"{result['label']} seed {result['seed']}: {result['error']}", bar)
        bar.update(1)

    try:
        if spec.jobs == 1:
            previous = torch.get_num_threads()
            set_threads(spec.threads_per_job)
            try:
                for task in tasks:
                    done(run_task(task))
            finally:
                torch.set_num_threads(previous)
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(max_workers=spec.jobs, mp_context=mp.get_context("spawn"),
                                     initializer=set_threads, initargs=(spec.threads_per_job,)) as pool:
                futures = [pool.submit(run_task, t) for t in tasks]
                for future in as_completed(futures):
                    done(future.result())
    finally:
        bar.close()
    for label in runs:
        runs[label].sort(key=lambda r: r["seed"])
    return runs


def run_app(cfg: Any, command: str) -> int:
    """Exit status 0, or 1 when a run failed. Raises BenchConfigError for a bad preset."""
    check_switches(cfg, ("dry_run", "progress"))
    spec = prepare(cfg)
    if _get(cfg, "dry_run", False):
        print(f"preset {spec.name}: {len(spec.rows)} rows x {len(spec.seeds)} seeds, {spec.jobs} job(s), "
              f"experiment {spec.experiment} {' '.join(spec.train)}")
        for row in spec.rows:
            print(f"  {'*' if row.baseline else ' '} {row.label:<28} {' '.join(row.overrides())}")
        return 0
    env = bench_report.environment(torch.device("cpu"))
    load_start, started = os.getloadavg(), time.perf_counter()
    keep = _get(cfg, "keep_runs")
    with tempfile.TemporaryDirectory(prefix="mesa-accuracy-") as tmp:
        work_dir = str(keep) if keep else tmp
        runs = train_all(spec, tasks_for(spec, work_dir), bool(_get(cfg, "progress", True)))
    wall = time.perf_counter() - started
    load_end = os.getloadavg()
    facts = [f"{spec.jobs} parallel run(s) x {spec.threads_per_job} thread(s)",
             f"{len(spec.rows)} rows x {len(spec.seeds)} seeds = {len(spec.rows) * len(spec.seeds)} runs",
             f"wall time {wall:.0f} s"
             + (f" ({reused} run(s) reused from keep_runs)" if (reused := sum(r.get('reused', False)
                                                                         for rs in runs.values() for r in rs)) else ""),
             f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end "
             f"(1-minute; {os.cpu_count()} CPUs)"]

    records = report.build_records(spec, runs, env)
    out_dir = Path(_get(cfg, "output_dir", "results")) / spec.name
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"md": out_dir / f"{SLUG}.md", "csv": out_dir / f"{SLUG}.csv", "runs": out_dir / f"{SLUG}.runs.csv",
             "json": out_dir / f"{SLUG}.json", "curves": out_dir / f"{SLUG}.png",
             "summary": out_dir / f"{SLUG}.summary.png"}
    tables = {t: list(dict.fromkeys(e.row for e in entries)) for t, entries in spec.tables.items()}
    curves = plot.curves_plot(files["curves"], tables, runs, spec.title)
    summary = plot.summary_plot(files["summary"], records, spec.title)
    bench_report.write_csv(files["csv"], report.csv_rows(records), report.ROW_COLUMNS)
    bench_report.write_csv(files["runs"], [{**r, "preset": spec.name} for rs in runs.values() for r in rs],
                           report.RUN_COLUMNS)
    notes = [
        "Top-1 and loss are measured on the held-out digits (360 images with the full split: one "
        "image = 0.28 points; data.val_size may limit it); the split is fixed (data.split_seed), the "
        "seed changes initialisation, data order, augmentation and Mesa's stochastic rounding.",
        "Paper numbers are DeiT-Ti trained 300 epochs on CIFAR-100 (C100) or ImageNet (IN), copied "
        "from the paper text (mesa_train/bench/accuracy/paper.py): compare directions, not values.",
        f"Per-run numbers: {files['runs'].name}; per-epoch curves of every run: {files['json'].name}.",
    ]
    md, claims = report.render_markdown(
        spec=spec, env=env, records=records, runs=runs, command=command, facts=facts, notes=notes,
        files={"curves": files["curves"].name if curves else "", "summary": files["summary"].name if summary else ""})
    files["md"].write_text(md)
    meta = {"preset": cfg_preset_dict(cfg), "environment": env, "command": command, "wall_s": wall,
            "load_average": {"start": load_start, "end": load_end}, "cpus": os.cpu_count(),
            "rows": records, "claims": claims, "runs": runs}
    files["json"].write_text(json.dumps(meta, indent=2, default=str))
    bench_report.write_index(out_dir.parent)
    print(md)
    _say("wrote " + ", ".join(str(p) for p in files.values() if p.exists()))
    failed = sum(len(r["errors"]) for r in records)
    if failed:
        _say(f"error: {failed} run(s) failed (see the table's notes)")
        return 1
    return 0


def cfg_preset_dict(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return cfg.preset if isinstance(cfg.preset, dict) else OmegaConf.to_container(cfg.preset, resolve=True)
