"""The benchmark app without Hydra: `run_app(cfg)` takes the composed config (the preset
under ``cfg.preset``), validates every configuration, measures, writes the files."""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mesa_train.bench import measure as _measure
from mesa_train.bench import profile as _profile
from mesa_train.bench import report
from mesa_train.bench.cli import folder_write_problem
from mesa_train.bench.measure import Measurement, MesaUnavailable, resolve_device, run_row
from mesa_train.bench.plot import tradeoff_plot
from mesa_train.bench.model_check import check_model
from mesa_train.bench.presets import BenchConfigError, RowConfig, expand_preset
from mesa_train.bench.search import Searcher, check_search, parse_search, summarize


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="cfg", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=True)


def _say(msg: str, bar=None) -> None:
    if bar is not None and not bar.disable:
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _device_problems(cfg: Any, preset: dict, device: torch.device, rows: list[RowConfig], search) -> list[str]:
    """Why the preset cannot be measured on ``device`` (a GPU preset, CUDA-graph rows, the
    capped search on a CPU), each with the way out."""
    name, problems = preset["name"], []
    if device.type == "cpu" and preset.get("requires_cuda") and not _get(cfg, "allow_cpu", False):
        extra = ""
        if search is not None:
            extra = (" Its search enforces the memory cap with torch.cuda.set_per_process_memory_fraction "
                     "and treats CUDA out-of-memory as 'does not fit'; on CPU add "
                     "allow_cpu=true preset.search.emulate_on_cpu=true to emulate it with the "
                     "saved-bytes budget (an estimate), or see the emulated search in preset=cpu-quick.")
        problems.append(
            f"preset {name!r} is a GPU preset and no CUDA device is in use (device={device}).{extra} "
            "Run preset=cpu-quick on CPU, or force this preset with allow_cpu=true (slow; shrink it "
            "with e.g. preset.common.batch_size=2 preset.common.img_size=64).")
    graphed = [r.label for r in rows if r.cuda_graph]
    if graphed and device.type != "cuda":
        problems.append(f"preset {name!r}: rows {graphed} capture the step in a CUDA graph (cuda_graph=true) "
                        f"and need a CUDA device (device={device}); leave them out with skip=..., or run on a GPU")
    if search is not None and device.type == "cpu" and not search.emulate_on_cpu:
        problems.append(
            f"preset {name!r}: the largest-model search needs a CUDA GPU (the cap is enforced with "
            "torch.cuda.set_per_process_memory_fraction); set preset.search.emulate_on_cpu=true "
            "to emulate it on CPU with the saved-bytes budget")
    return problems


def prepare(cfg: Any) -> tuple[dict, torch.device, list[RowConfig], Any]:
    """Everything that can fail before measuring: device, rows, search, model shapes."""
    from omegaconf import OmegaConf

    preset = OmegaConf.to_container(cfg.preset, resolve=True) if not isinstance(cfg.preset, dict) else dict(cfg.preset)
    name = preset.get("name")
    if not name:
        raise BenchConfigError("the preset has no name")
    device = resolve_device(_get(cfg, "device") or preset.get("device") or "auto")
    rows = expand_preset(preset, only=_get(cfg, "only"), skip=_get(cfg, "skip"))
    search = parse_search(preset.get("search"), dict(preset.get("common") or {}))
    for problem in _device_problems(cfg, preset, device, rows, search):
        if not _get(cfg, "dry_run", False):
            raise BenchConfigError(problem)
        # (a dry run builds every model on the meta device: it validates a GPU preset on a laptop)
        _say(f"note: {problem} (a dry run validates it here all the same)")
    if search is not None and _get(cfg, "only"):
        search = None  # only= narrows the table rows; skip the search
    if not rows and search is None:
        raise BenchConfigError(f"preset {name!r} has no rows and no search")
    t0 = time.perf_counter()
    for row in rows:
        check_model(row)
    if search is not None:
        check_search(search)
    _say(f"preset {name}: {len(rows)} configurations validated in {time.perf_counter() - t0:.1f} s")
    return preset, device, rows, search


def run_app(cfg: Any, command: str = "python -m mesa_train.bench") -> int:
    """Returns the exit status: 0 ok, 1 when a row failed with an error (OOM is a result,
    not a failure). Raises BenchConfigError / MesaUnavailable for bad configurations."""
    # 1. validate everything before running anything
    threads = _threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    preset, device, rows, search = prepare(cfg)
    name = preset["name"]
    search, mesa_error = _mesa_availability(cfg, rows, search)
    profile_steps = _profile_steps(cfg) if _get(cfg, "profile", False) else None  # None: no profile
    if _get(cfg, "dry_run", False):
        _print_plan(name, device, rows, search, profile_steps)
        return 0

    # 2. measure the rows, then the largest-model search; the files after each row
    seed = int(_get(cfg, "seed", 0))
    show = bool(_get(cfg, "progress", True))
    run = _RunFiles(out_dir=Path(_get(cfg, "output_dir", "results")) / name, slug=report.device_slug(device),
                    env=report.environment(device), command=command, started=time.perf_counter())
    _check_writable(run.out_dir)  # (before minutes of measuring, not after)
    results = _measure_rows(cfg, preset, device, rows, mesa_error, seed, show, run)
    rows_s = time.perf_counter() - run.started
    search_summary: list[dict[str, Any]] = []
    search_notes: list[str] = []
    searcher = None
    if search is not None:
        _say(f"search: largest {', '.join(d.name for d in search.dims)} under {search.cap_gb:g} GB", None)
        searcher = Searcher(search, device, seed=seed, on_probe=lambda msg: _say("  " + msg))
        outcomes = searcher.run()
        search_summary = summarize(search, outcomes)
        search_notes = searcher.notes
    search_s = time.perf_counter() - run.started - rows_s
    _say(f"measured {len(rows)} configurations in {rows_s:.1f} s"
         + (f", search in {search_s:.1f} s" if search is not None else ""))
    md = _write_outputs(run.out_dir, run.slug, preset=preset, env=run.env, device=device, rows=rows,
                        results=results, command=command, started=run.started,
                        search=search, searcher=searcher, search_summary=search_summary,
                        search_notes=search_notes, mesa_error=mesa_error)
    print(md)
    failed = [r.label for r, m in zip(rows, results) if m.status == "error"]

    # 3. the profile, after the measurement files are on disk: a crash here cannot lose them
    if profile_steps is not None:
        failed += _profile_rows(name, device, rows, results, profile_steps, seed, show, run)
    if failed:
        _say(f"error: {len(failed)} configuration(s) failed: {', '.join(failed)}")
        return 1
    return 0


@dataclasses.dataclass
class _RunFiles:
    """Where one run writes (``<output_dir>/<preset>/<slug>.*``) and what every file states."""

    out_dir: Path
    slug: str
    env: dict
    command: str
    started: float


def _threads(cfg: Any) -> int | None:
    """``threads``: CPU threads for the run (null: torch's default)."""
    value = _get(cfg, "threads")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchConfigError(f"threads={value!r}: must be a positive integer (CPU threads), or null for "
                               "torch's default")
    return value


def _check_writable(out_dir: Path) -> None:
    """The run's output folder exists or can be made, and takes a file."""
    problem = folder_write_problem(str(out_dir))
    if problem is not None:
        raise BenchConfigError(f"output_dir: cannot write results to {out_dir}: {problem}; "
                               "choose a writable output_dir")


def _mesa_availability(cfg: Any, rows: list[RowConfig], search):
    """``(search, mesa_error)``: with ``mesa_missing=skip`` and no Mesa, the Mesa rows are
    skipped (``mesa_error`` says why) and the search (stock against Mesa) is dropped."""
    mesa_missing = _get(cfg, "mesa_missing", "error")
    if mesa_missing not in ("error", "skip"):
        raise BenchConfigError(f"mesa_missing={mesa_missing!r}; valid choices: error, skip")
    mesa_error = None
    if any(r.mesa for r in rows) or (search is not None):
        try:
            _measure.mesa_patch_model()
        except MesaUnavailable as err:
            if mesa_missing == "error":
                raise
            mesa_error = str(err)
            if search is not None:  # the search compares stock with Mesa: nothing to do
                search = None
                mesa_error += " (the largest-model search was skipped too)"
    if mesa_error and any(r.mesa and r.baseline for r in rows):
        raise MesaUnavailable(mesa_error)
    return search, mesa_error


def _print_plan(name: str, device: torch.device, rows: list[RowConfig], search, profile_steps: int | None) -> None:
    """dry_run: what would run, baselines starred."""
    print(f"preset {name}: {len(rows)} configurations on {device} (validated, not run)")
    for row in rows:
        print(f"  {'*' if row.baseline else ' '} {row.label:<36} {row.describe()}")
    if search is not None:
        print(f"  search: {', '.join(d.name for d in search.dims)} for "
              f"{' vs '.join(v.label for v in search.variants)}, cap {search.cap_gb:g} GB")
    if profile_steps is not None:  # dry_run promises to run nothing: say what profile=true would add
        print(f"  profile: each row again, {profile_steps} step(s) under torch.profiler "
              "after its warm-up (not run: dry_run)")


def _measure_rows(cfg: Any, preset: dict, device: torch.device, rows: list[RowConfig], mesa_error: str | None,
                  seed: int, show: bool, run: _RunFiles) -> list[Measurement]:
    """Every row's memory (and, on a GPU without interleave, its time) in order, the files
    rewritten after each (marked partial); then the CPU's or the interleaved timing pass."""
    # Everything imported so far lives for the whole run: keep it out of the collections
    # that run between configurations (a full gc pass over timm + torch takes ~0.4 s).
    gc.collect()
    gc.freeze()
    if rows and _get(cfg, "process_warmup", True):
        # first-use costs (thread pools, allocator, lazy imports) must not land on the first row
        first = next((r for r in rows if not (r.mesa and mesa_error)), None)
        if first is not None:
            run_row(dataclasses.replace(first, warmup=1, steps=1), device, seed=seed,
                    measure_saved=False, timed=False)
    # On CPU every row's memory step runs before any timed step: timed steps switch glibc to
    # heap reuse (measure.CpuRss), and a heap grown that way inflates later memory steps' RSS
    # (Mesa's step RSS read 1.7x stock's instead of 0.64x). So CPU rows are timed in a second
    # pass, round-robin per group with `interleave: true`, else one row after another.
    time_later = device.type == "cpu" or bool(preset.get("interleave"))
    results: list[Measurement] = []
    bar = _progress(len(rows), show, f"bench {preset['name']}")
    try:
        for row in rows:
            bar.set_postfix_str(row.label[:40])
            if row.mesa and mesa_error:
                m = Measurement(status="skipped", error="Mesa unavailable (mesa_missing=skip)")
            else:
                m = run_row(row, device, seed=seed, timed=not time_later)
            results.append(m)
            if m.status == "ok":
                mem = f"peak {m.peak_mb:,.0f} MB" if m.peak_mb is not None else ""
                saved = f", saved {m.saved_mb:,.1f} MB" if m.saved_mb is not None else ""
                speed = f", {m.throughput:,.1f} img/s" if m.throughput is not None else ""
                _say(f"{row.label}: {mem}{saved}{speed}", bar)
            else:
                _say(f"{row.label}: {m.status} {m.error}", bar)
            bar.update(1)
            if len(results) < len(rows):
                # a run stopped here (time limit, lost machine) keeps what it measured
                _write_outputs(run.out_dir, run.slug, preset=preset, env=run.env, device=device,
                               rows=rows[:len(results)], results=results, command=run.command,
                               started=run.started, mesa_error=mesa_error, partial_of=len(rows))
    finally:
        bar.close()
    if preset.get("interleave"):
        _time_groups_interleaved(rows, results, device, seed=seed, show=show)
    elif time_later:
        _time_rows_after(rows, results, device, seed=seed, show=show)
    return results


def _profile_rows(name: str, device: torch.device, rows: list[RowConfig], results: list[Measurement],
                  profile_steps: int, seed: int, show: bool, run: _RunFiles) -> list[str]:
    """profile=true: each row that measured ok again under torch.profiler, the profile files
    rewritten after each; the labels of the rows whose profile failed."""
    paths = [run.out_dir / f"{run.slug}.profile.md", run.out_dir / f"{run.slug}.profile.csv"]

    step_ms = {row.label: m.step_ms_median for row, m in zip(rows, results)}  # (the pace table's measured side)

    def write_profiles(profiles, partial_of=None):
        return _profile.write_files(*paths, preset=name, env=run.env, command=run.command, steps=profile_steps,
                                    rows=rows, profiles=profiles, partial_of=partial_of, step_ms=step_ms)

    profiles = _profile.run_profiles(
        rows, [m.status for m in results], device, steps=profile_steps, seed=seed,
        progress=lambda n, what: _progress(n, show, f"{what} {name}"), say=_say,
        on_row=lambda so_far: write_profiles(so_far, partial_of=len(rows)))
    print(write_profiles(profiles))
    _say("wrote " + ", ".join(str(p) for p in paths))
    report.write_index(run.out_dir.parent)  # again: now it links the profile too
    return [f"{p.label} (profile)" for p in profiles if p.status == "error"]


def _write_outputs(out_dir: Path, slug: str, *, preset: dict, env: dict, device: torch.device,
                   rows: list[RowConfig], results: list[Measurement], command: str, started: float,
                   search=None, searcher=None, search_summary: list[dict[str, Any]] | None = None,
                   search_notes: list[str] | None = None, mesa_error: str | None = None,
                   partial_of: int | None = None) -> str:
    """Write <out_dir>/<slug>.{md,csv,json,png} (and .search.csv) and the results index;
    returns the markdown. ``partial_of``: the run's row count when only ``rows`` (its first
    rows) are measured so far: the files then say so, and the plot waits for the end."""
    name = preset["name"]
    search_summary = search_summary or []
    records = report.build_records(name, rows, results, env)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {k: out_dir / f"{slug}.{k}" for k in ("md", "csv", "json", "png")}
    search_csv = out_dir / f"{slug}.search.csv"

    png = None
    if partial_of is None:
        png = tradeoff_plot(files["png"], records, [r.plot_label for r in rows],
                            title=preset.get("title") or name, device=env["device"],
                            device_type=device.type, search=search_summary or None)
    if records:
        report.write_csv(files["csv"], records, report.CSV_COLUMNS)
    if search_summary:
        mode = "cuda" if device.type == "cuda" else "cpu-emulated"
        cap = searcher.effective_cap_gb if searcher else search.cap_gb
        srecs = [{**s, "preset": name, "cap_gb": cap, "mode": mode,
                  **{k: env[k] for k in ("device", "torch", "timm", "mesa_train", "cuda", "date")}}
                 for s in search_summary]
        report.write_csv(search_csv if records else files["csv"], srecs, report.SEARCH_CSV_COLUMNS)
    notes = report.standard_notes(device.type) + list(preset.get("notes") or []) + list(search_notes or [])
    if partial_of is not None:
        notes.insert(0, f"PARTIAL: {len(rows)} of {partial_of} configurations measured; the run "
                        "was stopped or is still going (its end rewrites these files).")
        if device.type == "cpu":
            notes.insert(1, "On CPU throughput is measured after every row's memory step: "
                            "the partial files have no timings yet.")
    if any(r.grad_checkpointing for r in rows):
        notes.append("Checkpointing rows: the meter sees only tensors saved outside the "
                     "checkpointed blocks (each block's input, kept by the checkpoint itself, "
                     "is not counted), so their saved bytes understate; their peak is exact.")
    if any(r.accum_steps > 1 for r in rows):
        notes.append("Gradient accumulation rows: 'Batch' is the micro-batch; throughput counts "
                     "every image of the optimizer step; saved bytes are for one micro-batch.")
    if mesa_error:
        notes.append("Mesa rows skipped: " + mesa_error)
    notes.append(f"Wall time of this run: {time.perf_counter() - started:.0f} s.")
    search_md = ""
    if search_summary:
        search_md = report.markdown_search(
            search_summary, searcher.effective_cap_gb if searcher else search.cap_gb,
            "cuda" if device.type == "cuda" else "cpu")
    md = report.render_markdown(preset=preset, env=env, records=records, search_md=search_md,
                                notes=notes, command=command,
                                files={"png": files["png"].name if png else ""})
    files["md"].write_text(md)
    meta = {"preset": preset, "environment": env, "command": command,
            "rows": [{"config": _row_dict(r), "measurement": m.as_dict()} for r, m in zip(rows, results)],
            "search": search_summary}
    if partial_of is not None:
        meta["partial"] = {"measured": len(rows), "of": partial_of}
    files["json"].write_text(json.dumps(meta, indent=2, default=str))
    report.write_index(out_dir.parent)
    if partial_of is None:
        written = [p for p in (files["md"], files["csv"], search_csv, files["json"], files["png"]) if p.exists()]
        _say("wrote " + ", ".join(str(p) for p in written))
    return md


def _time_groups_interleaved(rows: list[RowConfig], results: list[Measurement], device: torch.device, *,
                             seed: int, show: bool) -> None:
    """Re-time each group's rows round-robin (preset ``interleave: true``): on a shared
    machine the ratios to the baseline then compare steps taken side by side."""
    groups: dict[str, list[int]] = {}
    for i, (r, m) in enumerate(zip(rows, results)):
        if m.status == "ok":
            groups.setdefault(r.group_name, []).append(i)
    bar = _progress(len(groups), show, "interleaved timing")
    try:
        for idx in groups.values():
            times = _measure.interleaved_step_times([rows[i] for i in idx], device, seed=seed)
            for i, t in zip(idx, times):
                _measure.apply_step_times(rows[i], results[i], t)
                results[i].notes.append("throughput: median of steps interleaved with its group's rows")
            bar.update(1)
    finally:
        bar.close()


def _time_rows_after(rows: list[RowConfig], results: list[Measurement], device: torch.device, *,
                     seed: int, show: bool) -> None:
    """Time each measured row on its own (built and warmed up again), after every row's
    memory step (CPU: see ``time_later`` in run_app)."""
    bar = _progress(len(rows), show, "timing")
    try:
        for row, result in zip(rows, results):
            if result.status == "ok":
                (times,) = _measure.interleaved_step_times([row], device, seed=seed)
                _measure.apply_step_times(row, result, times)
            bar.update(1)
    finally:
        bar.close()


def _profile_steps(cfg: Any) -> int:
    value = _get(cfg, "profile_steps", 3)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchConfigError(f"profile_steps={value!r}: must be a positive integer "
                               "(training steps under the profiler, per row)")
    return value


def _row_dict(row: RowConfig) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(row)
    d["ops"], d["modules"] = list(row.ops), list(row.modules)
    return d
