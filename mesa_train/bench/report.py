"""Tables: ratios to each group's baseline, paper numbers beside ours, Markdown + CSV +
JSON metadata, and an index of every result file."""
from __future__ import annotations

import csv
import datetime as _dt
import importlib.util
import io
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from mesa_train import inductor_backports
from mesa_train.bench.measure import Measurement
from mesa_train.device_info import device_name
from mesa_train.bench.paper_numbers import TABLES, paper_row
from mesa_train.bench.presets import RowConfig

CSV_COLUMNS = [
    "preset", "label", "group", "baseline", "model", "mesa", "ops", "modules",
    "batch_size", "micro_batch", "accum_steps", "img_size", "amp", "attention",
    "grad_checkpointing", "channels_last", "compile", "cuda_graph", "graphs", "graph_breaks", "compile_s",
    "num_classes", "status", "error",
    "params_m", "saved_mb", "saved_ratio", "peak_mb", "peak_ratio", "peak_kind", "step_rss_mb",
    "step_rss_ratio", "reserved_mb", "throughput", "throughput_ratio", "throughput_mean",
    "step_ms_median", "host_ms_median", "timed_steps", "wall_s", "paper_row", "paper_memory_mb", "paper_memory_ratio",
    "paper_throughput", "paper_throughput_ratio", "paper_top1",
    "device", "torch", "timm", "mesa_train", "cuda", "mesa_extension", "date",
]

SEARCH_CSV_COLUMNS = [
    "preset", "dim", "stock_label", "mesa_label", "stock_max", "mesa_max", "ratio",
    "stock_hit_limit", "mesa_hit_limit", "search_limit", "probes", "cap_gb", "mode",
    "paper_stock", "paper_mesa", "paper_ratio", "device", "torch", "timm", "mesa_train",
    "cuda", "date",
]


# --------------------------------------------------------------------------- environment

def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    import timm

    import mesa_train

    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    env = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "mesa_train": mesa_train.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if device.type == "cuda" else "n/a",
        "mesa_extension": ("compiled (mesa_train._C)" if importlib.util.find_spec("mesa_train._C")
                           else "not built (reference fallback)"),
        "python": platform.python_version(),
        # (compile_model applies them on an older torch: the compiled rows' kernels depend on it)
        "inductor_backports": inductor_backports.status(),
        "git": commit or "unknown",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cpu":
        env["threads"] = torch.get_num_threads()
    else:
        props = torch.cuda.get_device_properties(device)
        env["device_memory_gb"] = round(props.total_memory / 1024 ** 3, 1)
        env["capability"] = f"{props.major}.{props.minor}"
    return env


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


# --------------------------------------------------------------------------- rows

def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def build_records(preset: str, rows: list[RowConfig], results: list[Measurement],
                  env: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat dict per row with ratios to the group's baseline (ours and the paper's)."""
    baselines = {r.group_name: (r, m) for r, m in zip(rows, results) if r.baseline}
    records = []
    for row, m in zip(rows, results):
        brow, bm = baselines[row.group_name]
        ok = m.status == "ok" and bm.status == "ok"
        p = paper_row(row.paper)
        bp = paper_row(brow.paper)
        rec: dict[str, Any] = {
            "preset": preset, "label": row.label, "group": row.group_name,
            "baseline": row.baseline, "model": row.model, "mesa": row.mesa,
            "ops": "+".join(row.ops) if row.mesa else "", "modules": "+".join(row.modules) if row.mesa else "",
            "batch_size": row.batch_size, "micro_batch": row.micro_batch, "accum_steps": row.accum_steps,
            "img_size": row.img_size, "amp": row.amp, "attention": row.attention,
            "grad_checkpointing": row.grad_checkpointing, "channels_last": row.channels_last,
            "num_classes": row.num_classes, "cuda_graph": row.cuda_graph,
            "compile": ((row.compile_mode or "default") + "".join(f", {tag}" for tag in row.compile_tags())
                        if row.compile else ""),
            "graphs": m.graphs, "graph_breaks": m.graph_breaks, "compile_s": m.compile_s,
            "status": m.status, "error": m.error or "; ".join(m.notes),
            "params_m": None if m.n_params is None else m.n_params / 1e6,
            "saved_mb": m.saved_mb, "peak_mb": m.peak_mb, "peak_kind": m.peak_kind,
            "step_rss_mb": m.step_rss_mb, "reserved_mb": m.reserved_mb,
            "throughput": m.throughput, "throughput_mean": m.throughput_mean,
            "step_ms_median": m.step_ms_median, "host_ms_median": m.host_ms_median,
            "timed_steps": m.timed_steps, "wall_s": m.wall_s,
            "paper_row": p.source if p else "",
            "paper_memory_mb": p.memory_mb if p else None,
            "paper_throughput": p.throughput if p else None,
            "paper_top1": p.top1 if p else None,
        }
        for key in ("saved_mb", "peak_mb", "step_rss_mb", "throughput"):
            out = key.replace("_mb", "") + "_ratio"
            rec[out] = (1.0 if row.baseline and getattr(m, key) is not None
                        else _ratio(getattr(m, key), getattr(bm, key)) if ok else None)
        rec["paper_memory_ratio"] = _ratio(p.memory_mb, bp.memory_mb) if p and bp else None
        rec["paper_throughput_ratio"] = _ratio(p.throughput, bp.throughput) if p and bp else None
        for key in ("device", "torch", "timm", "mesa_train", "cuda", "mesa_extension", "date"):
            rec[key] = env[key]
        records.append(rec)
    return records


def _csv_value(value: Any, key: str) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4f}" if key.endswith("ratio") else f"{value:.3f}"
    return value


def write_csv(path: Path, records: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for rec in records:
            writer.writerow({k: _csv_value(rec.get(k), k) for k in columns})


# --------------------------------------------------------------------------- markdown

def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _with_ratio(value: float | None, ratio: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return _num(value, digits) + (f" ({ratio:.2f}×)" if ratio is not None else "")


DESCRIPTIVE_COLUMNS = {
    "model": ("Model", lambda r: r["model"]),
    "params": ("Params (M)", lambda r: _num(r["params_m"], 1)),
    "batch": ("Batch", lambda r: str(r["micro_batch"])
              + (f" ×{r['accum_steps']} accum" if r["accum_steps"] > 1 else "")),
    "img_size": ("Res.", lambda r: str(r["img_size"])),
    "amp": ("AMP", lambda r: r["amp"]),
    "attention": ("Attention", lambda r: r["attention"]),
    "ops": ("Mesa ops", lambda r: r["ops"] or "–"),
    "modules": ("Mesa modules", lambda r: r["modules"] or "–"),
    "ckpt": ("Checkpointing", lambda r: "yes" if r["grad_checkpointing"] else "no"),
    "layout": ("Layout", lambda r: "channels-last" if r.get("channels_last") else "NCHW"),
    "compile": ("torch.compile (graphs / breaks, first step s)",
                lambda r: (f"{r['compile']} ({r['graphs']} / {r['graph_breaks']}"
                           + ("" if r.get("compile_s") is None else f", {r['compile_s']:.0f} s") + ")")
                if r["compile"] else ("eager, one CUDA graph" if r.get("cuda_graph") else "eager")),
}


def markdown_table(records: list[dict[str, Any]], columns: list[str], device_type: str) -> str:
    cols = [c for c in columns if c in DESCRIPTIVE_COLUMNS]
    peak_name = "Peak MB (max_memory_allocated)" if device_type == "cuda" else "Peak RSS MB (process)"
    head = ["Method", *[DESCRIPTIVE_COLUMNS[c][0] for c in cols], "Saved for backward MB", peak_name]
    if device_type == "cpu":
        head.append("Step RSS MB (above start)")
    head += ["Throughput img/s", "Paper memory MB", "Paper img/s", "Status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [r["label"] + (" (baseline)" if r["baseline"] else "")]
        cells += [DESCRIPTIVE_COLUMNS[c][1](r) for c in cols]
        cells.append(_with_ratio(r["saved_mb"], r["saved_ratio"], 1))
        cells.append(_with_ratio(r["peak_mb"], r["peak_ratio"]))
        if device_type == "cpu":
            cells.append(_with_ratio(r["step_rss_mb"], r["step_rss_ratio"], 1))
        cells.append(_with_ratio(r["throughput"], r["throughput_ratio"], 1))
        cells.append(_with_ratio(r["paper_memory_mb"], r["paper_memory_ratio"]))
        cells.append(_with_ratio(r["paper_throughput"], r["paper_throughput_ratio"]))
        status = r["status"]
        if status != "ok":
            status += f": {r['error']}" if r["error"] else ""
        cells.append(status.replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_search(summary: list[dict[str, Any]], cap_gb: float, mode: str) -> str:
    if not summary:
        return ""
    stock, mesa = summary[0]["stock_label"], summary[0]["mesa_label"]

    def val(v, hit, dim):
        if v is None:
            return "none fits"
        text = f"{v}" + (" px" if dim == "resolution" else "")
        return text + (" (search limit)" if hit else "")

    head = ["Dim", stock, mesa, "Ratio", f"Paper {stock}", f"Paper {mesa}", "Paper ratio", "Probes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        lines.append("| " + " | ".join([
            s["dim"].capitalize(),
            val(s["stock_max"], s["stock_hit_limit"], s["dim"]),
            val(s["mesa_max"], s["mesa_hit_limit"], s["dim"]),
            f"{s['ratio']:.2f}×" if s["ratio"] else "–",
            _num(s["paper_stock"]), _num(s["paper_mesa"]),
            f"{s['paper_ratio']:.1f}×" if s["paper_ratio"] else "–",
            str(s["probes"]),
        ]) + " |")
    what = ("under a {:g} GB cap (torch.cuda.set_per_process_memory_fraction)".format(cap_gb)
            if mode == "cuda" else
            "under a {:g} GB *estimated* budget (CPU emulation: saved activation bytes + "
            "4x parameter bytes; not a measurement)".format(cap_gb))
    return f"Largest configuration that trains {what}.\n\n" + "\n".join(lines)


def markdown_targets(targets: list[dict[str, Any]], records: list[dict[str, Any]],
                     device_type: str) -> str:
    """The issue's targets for this preset, met or not, with the measured figure."""
    if not targets:
        return ""
    by_label = {r["label"]: r for r in records}
    mem_key = "peak_ratio" if device_type == "cuda" else "saved_ratio"
    mem_name = "peak memory" if device_type == "cuda" else "saved bytes (CPU: no peak-memory target)"
    lines = ["| Row | Target | Measured | Met |", "|---|---|---|---|"]
    for t in targets:
        r = by_label.get(t.get("row"))
        checks = []
        if "memory_ratio_max" in t:
            checks.append((mem_name, mem_key, "≤", t["memory_ratio_max"]))
        if "throughput_ratio_min" in t:
            checks.append(("throughput", "throughput_ratio", "≥", t["throughput_ratio_min"]))
        for name, key, op, bound in checks:
            got = None if r is None else r.get(key)
            if got is None:
                measured, met = "not measured", "–"
            else:
                ok = got <= bound if op == "≤" else got >= bound
                measured, met = f"{got:.2f}×", "yes" if ok else "**no**"
            lines.append(f"| {t.get('row')} | {name} {op} {bound:g}× stock | {measured} | {met} |")
        if "memory_ratio_max" not in t and r is not None and r.get(mem_key) is not None:
            lines.append(f"| {t.get('row')} | {mem_name} (stated) | {r[mem_key]:.2f}× | – |")
    return "\n".join(lines)


def markdown_host_time(records: list[dict[str, Any]]) -> str:
    """Per row (CUDA): the median step, the median time its Python took to return (every
    kernel launched, before the synchronize), and their ratio. A ratio near 1 means the host
    set the pace (Python, dispatch, launches; or CUDA's launch queue was full); well below 1,
    the GPU did. Empty when no row has the host time (CPU rows)."""
    rows = [r for r in records if r.get("host_ms_median") is not None and r.get("step_ms_median")]
    if not rows:
        return ""
    lines = ["| Row | Step ms (median) | Host ms to return (median) | Host / step |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {_num(r['step_ms_median'], 1)} | {_num(r['host_ms_median'], 1)} "
                     f"| {r['host_ms_median'] / r['step_ms_median']:.2f} |")
    return "\n".join(lines)


def render_markdown(*, preset: dict, env: dict[str, Any], records: list[dict[str, Any]],
                    search_md: str, notes: list[str], command: str, files: dict[str, str]) -> str:
    title = preset.get("title") or preset["name"]
    out = io.StringIO()
    w = out.write
    w(f"# {title}\n\n")
    if preset.get("description"):
        w(str(preset["description"]).strip() + "\n\n")
    w(f"- Device: **{env['device']}**"
      + (f" ({env['device_memory_gb']} GB, compute capability {env['capability']})"
         if env.get("device_memory_gb") else "") + "\n")
    w(f"- Date: {env['date']}\n")
    w(f"- Versions: torch {env['torch']}, timm {env['timm']}, mesa_train {env['mesa_train']}, "
      f"CUDA {env['cuda']}" + (f", cuDNN {env['cudnn']}" if env.get("cudnn") not in (None, "n/a") else "")
      + f", Python {env['python']}; Mesa extension: {env['mesa_extension']}"
      + (f"; Inductor backports: {env['inductor_backports']}"
         if env.get("inductor_backports", "not needed") != "not needed" else "")
      + f"; git {env['git']}\n")
    w(f"- Command: `{command}`\n")
    paper_tables = preset.get("paper_tables") or []
    for t in paper_tables:
        if t in TABLES:
            w(f"- Paper columns: {TABLES[t]}\n")
    w("\n")
    if records:
        w("## Training step: memory and throughput\n\n")
        w("Ratios in parentheses are to the group's baseline row measured in this run "
          "(paper ratios: to the paper's baseline row).\n\n")
        w(markdown_table(records, list(preset.get("columns") or []), env["device_type"]) + "\n\n")
        targets = markdown_targets(list(preset.get("targets") or []), records, env["device_type"])
        if targets:
            w("### Targets (the preset's `targets`)\n\n" + targets + "\n\n")
        host = markdown_host_time(records)
        if host:
            w("### Host or GPU: what the timed steps waited on\n\n" + host + "\n\n")
    if search_md:
        w("## Largest model before out-of-memory\n\n" + search_md + "\n\n")
    if files.get("png"):
        w(f"![memory vs throughput]({files['png']})\n\n")
    w("## Notes\n\n")
    for note in notes:
        w(f"- {note}\n")
    return out.getvalue()


def standard_notes(device_type: str) -> list[str]:
    notes = ["One process, one run: every configuration is measured after the same warm-up; "
             "a training step is forward + backward + optimizer step (AdamW unless stated) on "
             "random images and labels.",
             "Saved for backward: bytes autograd keeps between forward and backward for one "
             "micro-batch (mesa_train.memory.SavedTensorMeter, activations only, parameters excluded)."]
    if device_type == "cuda":
        notes.append("Peak MB: torch.cuda.max_memory_allocated over one training step after "
                     "warm-up (weights, gradients, optimizer state and activations), as in the paper.")
        notes.append("Throughput: batch size / median step time over the timed steps, with "
                     "torch.cuda.synchronize around each step (CSV: throughput_mean over their sum).")
        notes.append("Host or GPU: 'Host ms to return' is the median time a timed step's Python "
                     "took to return (every kernel launched, before the closing synchronize). Near "
                     "the step time, the host set the pace (or CUDA's launch queue was full); well "
                     "below it, the GPU did. The profile's self CPU times add the profiler's own cost "
                     "per op, this does not.")
    else:
        notes.append("Peak RSS MB: the process's resident set peak during one training step "
                     "(VmHWM reset through /proc/self/clear_refs before it; glibc set to return "
                     "freed tensors to the OS for that step only, timed steps reuse the heap as an "
                     "ordinary run does). It includes the Python interpreter and the libraries "
                     "(a few hundred MB), so its ratios are close to 1; 'Step RSS' is that peak minus "
                     "the RSS when the step started (activations, gradients and temporaries).")
        notes.append("Throughput: batch size / median step time over the timed steps (CSV: "
                     "throughput_mean over their sum). CPU throughput is indicative only (shared "
                     "cores, tiny models, Mesa's CPU kernels); the "
                     "paper's throughput and memory come from V100 / RTX 3090 GPUs.")
    notes.append("Paper numbers are copied from the paper text (mesa_train/bench/paper_numbers.py); "
                 "paper rows were measured with fp16 AMP on other GPUs, so compare ratios, not MB.")
    return notes


def write_index(root: Path) -> None:
    """results/README.md: one line per result table found under ``root``."""
    (root / "README.md").write_text(index_text(root))


def index_text(root: Path) -> str:
    """The text of ``root``'s README.md index (:func:`write_index`): every ``*/*.md`` but the
    profiles, which their table's line links, with the device and date of its JSON when it has one."""
    entries = []
    for md in sorted(root.glob("*/*.md")):
        if md.name.endswith(".profile.md"):  # linked from its table's line below
            continue
        meta = md.with_suffix(".json")
        info = {}
        if meta.exists():
            try:
                info = json.loads(meta.read_text())
            except (OSError, ValueError):
                info = {}
        env = info.get("environment", {})
        rel = md.relative_to(root).as_posix()
        png = md.with_suffix(".png")
        extra = f" ([plot]({png.relative_to(root).as_posix()}))" if png.exists() else ""
        profile = md.with_name(md.stem + ".profile.md")
        if profile.exists():
            extra += f" ([profile]({profile.relative_to(root).as_posix()}))"
        entries.append(f"| `{md.parent.name}` | {env.get('device', md.stem)} | {env.get('date', '')} "
                       f"| [{rel}]({rel}){extra} |")
    return ("# Benchmark results\n\n"
            "Generated by `python -m mesa_train.bench preset=NAME` (see `configs/bench/`). "
            "Each preset writes `<preset>/<device>.{md,csv,json,png}` "
            "(and `<device>.profile.{md,csv}` with `profile=true`). Tables other commands write "
            "(scripts/, `python -m mesa_train.bench.overhead`, ...) are listed too, each folder's README "
            "saying how they were made; `python -m mesa_train.bench.report` refreshes this list.\n\n"
            "| preset | device | date | table |\n|---|---|---|---|\n" + "\n".join(entries) + "\n")


def print_and_save(text: str, output: str | None) -> None:
    """A command's Markdown table: printed, and written to ``output`` when given (its folder
    made)."""
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)


def relpath(path: Path, start: Path) -> str:
    return os.path.relpath(path, start).replace(os.sep, "/")


if __name__ == "__main__":  # refresh results/README.md after a script wrote a table there
    _results = Path(__file__).resolve().parents[2] / "results"
    if not _results.is_dir():
        raise SystemExit(f"error: no results/ folder at {_results} (run this in a checkout of mesa-train)")
    write_index(_results)
