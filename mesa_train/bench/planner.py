"""Bench preset ``planner`` (``python -m mesa_train.bench preset=planner``): the planner's
memory/throughput frontier against the other ways to save activation memory.

Stages:
1. Build the preset's model (stock) and batch; profile it once (:mod:`mesa_train.plan`).
2. Budgets: ``budgets`` fractions spaced evenly from the all-ops floor to stock (an odd
   count includes the halfway budget of the issue's target), plus one budget at the
   measured memory of each baseline that the floor allows ("plan at equal memory").
3. Configurations: stock, all-ops Mesa, timm gradient checkpointing, selective activation
   checkpointing, torch.compile with an activation memory budget, and one plan per budget.
   Each is measured for activation bytes kept for backward (``SavedTensorMeter``; CUDA
   also peak ``max_memory_allocated``) and step time, all configurations' steps
   interleaved round-robin (CPU: process CPU time, see ``mesa_train.plan.measure``).
4. Report: a table (Markdown + CSV + JSON) and the frontier plot, under
   ``<output_dir>/planner/<device>.*``, with the issue's targets checked.
"""
from __future__ import annotations

import copy
import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

from mesa_train.models import build_model
from mesa_train.plan import Budget, make_plan, plan_table, profile_model
from mesa_train.plan.allocate import floor_bytes
from mesa_train.plan.measure import (activation_bytes, clock_description, fastest, interleaved_times, make_batch,
                                     peak_bytes, train_step)
from mesa_train.plan.profile import patch_items

from . import planner_baselines as baselines
from .report import environment

__all__ = ["run_planner"]


def _get(cfg, key, default=None):
    v = cfg.get(key) if hasattr(cfg, "get") else None
    return default if v is None else v


def _device(cfg, preset) -> torch.device:
    name = str(_get(cfg, "device", None) or preset.get("device", "cpu"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        from .presets import BenchConfigError

        raise BenchConfigError(f"device={name} but no CUDA device is visible; use device=cpu")
    return torch.device(name)


def _configs(model, batch, profile, preset, log) -> List[Dict[str, Any]]:
    """[{label, kind, model, predicted?}] for every configuration measured."""
    every = {u.name: u.ops for u in profile.units}
    # budgets run from all-ops Mesa (compression only; plans may also recompute blocks) to stock
    floor = floor_bytes(profile)
    floor_frac = floor / profile.stock_activation_bytes
    step = lambda m: train_step(m, batch)  # noqa: E731
    configs = [dict(label="stock", kind="stock", model=model),
               dict(label="Mesa all ops", kind="mesa-all",
                    model=patch_items(copy.deepcopy(model), every, profile.quant_options)),
               dict(label="grad checkpointing (timm)", kind="ckpt", model=baselines.grad_checkpointing(model)),
               dict(label="selective AC (save matmuls)", kind="sac", model=baselines.selective_checkpointing(model))]
    n_blocks = len(profile.units) - 1
    for k in range(1, n_blocks):  # checkpointing part of the blocks: its points in between
        configs.append(dict(label=f"checkpointing {k}/{n_blocks} blocks", kind="ckpt",
                            model=baselines.partial_checkpointing(model, k)))
    backend = preset.get("compile_backend")
    for b in preset.get("compile_budgets") or []:
        log(f"compiling with activation_memory_budget={b} (backend {backend}) ...")
        configs.append(dict(label=f"compile budget {b}", kind="compile",
                            model=baselines.compiled_with_budget(model, b, backend, step)))
    # the baselines' memory, for plans at equal memory
    for c in configs:
        c["activation_bytes"] = activation_bytes(c["model"], batch)
    n = int(preset.get("budgets", 5))
    fractions = [floor_frac + (1 - floor_frac) * k / (n - 1) for k in range(n)]
    fractions[0] *= 1 + 1e-9  # the floor itself, safe from rounding
    equal = [(c["activation_bytes"] / profile.stock_activation_bytes, c["label"]) for c in configs
             if c["kind"] in ("ckpt", "sac", "compile")]
    wanted = [(f, "halfway" if k == (n - 1) / 2 else None) for k, f in enumerate(fractions)]
    wanted += [(f, f"= {lab}") for f, lab in equal if floor_frac <= f <= 1]
    for f, why in wanted:
        plan, _, rows = make_plan(model, batch, Budget(fraction=min(1.0, f)), profile=profile, measure=False)
        label = f"plan {f:.3f}" + (f" ({why})" if why else "")
        configs.append(dict(label=label, kind="plan", budget=f, note=why, plan=plan,
                            predicted=rows["plan"]["predicted"],
                            model=patch_items(copy.deepcopy(model), plan.layers, profile.quant_options)))
    return configs


def _same_as(c) -> Any:
    """Configurations with equal keys are the same model: plans with the same layers."""
    plan = c.get("plan")
    return ("plan", tuple(sorted(plan.layers.items()))) if plan is not None else ("config", id(c))


def _measure(configs, batch, rounds: int) -> None:
    """Memory, then step times interleaved over the distinct configurations: two budgets
    that give the same plan are one model, timed once (two timings of one model differ
    only by timer noise, which a table should not show as a difference)."""
    for c in configs:
        c["activation_bytes"] = activation_bytes(c["model"], batch)
        c["peak_bytes"] = peak_bytes(c["model"], batch)
    distinct: Dict[Any, Dict[str, Any]] = {}
    for c in configs:
        distinct.setdefault(_same_as(c), c)
    reps = list(distinct.values())
    times = interleaved_times([(lambda m=c["model"]: train_step(m, batch)) for c in reps], batch.device, rounds)
    timed = {_same_as(c): t for c, t in zip(reps, times)}
    for c in configs:
        t = timed[_same_as(c)]
        c["step_s"] = fastest(t)
        c["step_times"] = t


def _records(configs, profile, batch_size) -> List[Dict[str, Any]]:
    stock = configs[0]
    out = []
    for c in configs:
        p = c.get("predicted")
        r = {"label": c["label"], "kind": c["kind"], "budget": c.get("budget"),
             "activation_mb": c["activation_bytes"] / 2**20,
             "memory_ratio": c["activation_bytes"] / stock["activation_bytes"],
             "peak_mb": None if c["peak_bytes"] is None else c["peak_bytes"] / 2**20,
             "step_ms": 1e3 * c["step_s"], "throughput": batch_size / c["step_s"],
             "throughput_ratio": stock["step_s"] / c["step_s"],
             "ops": None, "pred_activation_mb": None, "pred_step_ms": None}
        if p is not None:
            r["pred_activation_mb"] = p.activation_bytes / 2**20
            r["pred_step_ms"] = 1e3 * p.step_s
            r["saved_error"] = ((stock["activation_bytes"] - p.activation_bytes) /
                                max(stock["activation_bytes"] - c["activation_bytes"], 1) - 1)
            # predicted step on the profile's stock time, measured on this run's: compare ratios
            r["step_error"] = (p.step_s / profile.stock_step_s) / (c["step_s"] / stock["step_s"]) - 1
            r["ops"] = "; ".join(f"{k}: {','.join(v)}" for k, v in c["plan"].layers.items() if v) or "(stock)"
        out.append(r)
    return out


def _interp_plan_throughput(records, ratio, kinds=("plan",)):
    """Throughput ratio of a frontier (the records of ``kinds``) at a memory ratio, linear
    between its points; None outside them."""
    pts = sorted((r["memory_ratio"], r["throughput_ratio"]) for r in records if r["kind"] in kinds)
    for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
        if m0 <= ratio <= m1:
            return t0 if m1 == m0 else t0 + (t1 - t0) * (ratio - m0) / (m1 - m0)
    return None


def _targets(records) -> List[str]:
    by_kind = {r["kind"]: r for r in records if r["kind"] != "plan"}
    lines = []
    plans = [r for r in records if r["kind"] == "plan"]
    worst_mem = max(abs(r["saved_error"]) for r in plans if r["memory_ratio"] < 0.999) if plans else None
    worst_t = max(abs(r["step_error"]) for r in plans) if plans else None
    if worst_mem is not None:
        lines.append(f"- predicted saved bytes within 10% of measured: worst {worst_mem:.1%} "
                     f"-> {'PASS' if worst_mem <= 0.10 else 'FAIL'}")
    if worst_t is not None:
        lines.append(f"- predicted step time within 15% of measured (as ratios to each run's stock step): "
                     f"worst {worst_t:.1%} -> {'PASS' if worst_t <= 0.15 else 'FAIL'}")
    half = next((r for r in plans if "halfway" in (r["label"] or "")), None)
    if half and "mesa-all" in by_kind:
        a = by_kind["mesa-all"]
        lines.append(f"- halfway plan throughput {half['throughput_ratio']:.3f} x stock vs all-ops Mesa "
                     f"{a['throughput_ratio']:.3f} -> "
                     f"{'PASS' if half['throughput_ratio'] > a['throughput_ratio'] else 'FAIL'}")
    if half:
        at = _interp_plan_throughput(records, half["memory_ratio"], ("stock", "ckpt"))
        if at is not None:
            lines.append(f"- halfway plan vs checkpointing at equal memory ({half['memory_ratio']:.3f} x stock, "
                         f"interpolated between stock and checkpointing k of n blocks): {half['throughput_ratio']:.3f} "
                         f"vs {at:.3f} -> {'PASS' if half['throughput_ratio'] > at else 'FAIL'}")
    for kind in ("ckpt", "sac", "compile"):
        for b in [r for r in records if r["kind"] == kind]:
            at = _interp_plan_throughput(records, b["memory_ratio"])
            if at is None:
                lines.append(f"- {b['label']} keeps {b['memory_ratio']:.3f} x stock activations, below the "
                             f"planner's floor: Mesa plans cannot reach it (the baseline wins on memory there)")
            else:
                lines.append(f"- at {b['label']}'s memory ({b['memory_ratio']:.3f} x stock) the plan frontier gives "
                             f"{at:.3f} x stock throughput vs {b['throughput_ratio']:.3f} -> "
                             f"{'plan faster' if at > b['throughput_ratio'] else 'baseline faster'}")
    return lines


def _noise(configs) -> List[str]:
    """Configurations measured twice under different names (a plan equal to stock, to
    all-ops Mesa, or to another plan): their step-time difference is the run's noise."""
    every = None
    keyed: Dict[Any, List[Dict[str, Any]]] = {}
    for c in configs:
        if c["kind"] == "stock":
            key = "stock"
        elif c["kind"] == "mesa-all":
            key = every = "all"
        elif c["kind"] == "plan":
            layers = tuple(sorted((k, v) for k, v in c["plan"].layers.items() if v))
            key = "stock" if not layers else layers
            if every is not None and c["activation_bytes"] == configs[1]["activation_bytes"]:
                key = "all"
        else:
            continue
        keyed.setdefault(key, []).append(c)
    lines = []
    for group in keyed.values():
        if len({_same_as(c) for c in group}) > 1:  # (equal plans were timed once: no spread to show)
            t = [c["step_s"] for c in group]
            lines.append(f"- same configuration, {' / '.join(c['label'] for c in group)}: "
                         f"{' / '.join(f'{1e3 * x:.1f}' for x in t)} ms (spread {max(t) / min(t) - 1:.1%})")
    return lines


def _markdown(records, env, preset, profile, table, targets, clock_note, noise=()) -> str:
    head = ["configuration", "act. MiB", "x stock", "pred. MiB", "ms/step", "pred. ms", "img/s", "x stock"]
    rows = []
    for r in records:
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        rows.append([r["label"], f(r["activation_mb"], ".2f"), f(r["memory_ratio"], ".3f"),
                     f(r["pred_activation_mb"], ".2f"), f(r["step_ms"], ".1f"), f(r["pred_step_ms"], ".1f"),
                     f(r["throughput"], ".0f"), f(r["throughput_ratio"], ".3f")])
    md = [f"# {preset.get('title', 'planner')}", "", preset.get("description", "").strip(), "",
          f"Device: {env['device']}; torch {env['torch']}, timm {env['timm']}, git {env['git']}, {env['date']}.",
          f"Step time: {clock_note}. Stock step noise (IQR/median over the profile's rounds): "
          f"{profile.step_noise:.1%}.", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "Plans (ops compressed per layer):", ""]
    md += [f"- {r['label']}: {r['ops']}" for r in records if r["kind"] == "plan"]
    md += ["", "Targets:", "", *targets]
    if noise:
        md += ["", "Timer noise (the same model measured twice in this run; differences below this are ties):",
               "", *noise]
    md += ["", "Halfway plan, per layer:", "", "```", table, "```", ""]
    return "\n".join(md)


def _plot(path: Path, records, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    plans = sorted((r for r in records if r["kind"] == "plan"), key=lambda r: r["memory_ratio"])
    ax.plot([r["memory_ratio"] for r in plans], [r["throughput_ratio"] for r in plans], "o-", color="C0",
            label="planner (measured)", zorder=3)
    ckpt = sorted((r for r in records if r["kind"] in ("ckpt", "stock")), key=lambda r: r["memory_ratio"])
    ax.plot([r["memory_ratio"] for r in ckpt], [r["throughput_ratio"] for r in ckpt], ":", color="C2", alpha=0.7)
    pred = [(r["pred_activation_mb"] / records[0]["activation_mb"], r["throughput_ratio"] / (1 + r["step_error"]))
            for r in plans]
    ax.plot(*zip(*sorted(pred)), "x--", color="C0", alpha=0.6, label="planner (predicted)")
    style = {"stock": ("*", "black"), "mesa-all": ("s", "C3"), "ckpt": ("^", "C2"), "sac": ("v", "C4"),
             "compile": ("D", "C1")}
    for r in records:
        if r["kind"] in style:
            m, c = style[r["kind"]]
            ax.scatter(r["memory_ratio"], r["throughput_ratio"], marker=m, color=c, s=80, zorder=4, label=r["label"])
    ax.set_xlabel("activation memory kept for backward (x stock)")
    ax.set_ylabel("throughput (x stock)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_planner(cfg, command: str = "python -m mesa_train.bench preset=planner") -> int:
    preset = dict(cfg.preset)
    device = _device(cfg, preset)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if _get(cfg, "threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(_get(cfg, "seed", 0)))
    model = build_model(preset["model"], fused_attn=preset.get("fused_attn"), img_size=preset["img_size"],
                        img_size_optional=True,  # (a size-agnostic model, PVT-v2 or a CNN, takes none)
                        num_classes=preset["num_classes"], **dict(preset.get("model_kwargs") or {})).to(device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(preset.get("amp", "fp32")))
    batch = make_batch(int(preset["batch_size"]), int(preset["img_size"]), int(preset["num_classes"]), device, amp)
    if _get(cfg, "dry_run", False):
        print(f"preset planner: {preset['model']} on {device}: profile, {preset.get('budgets', 5)} budgets + "
              f"baselines (not run: dry_run)")
        return 0
    profile = profile_model(model, batch, rounds=int(preset.get("profile_rounds", 5)), log=log)
    configs = _configs(model, batch, profile, preset, log)
    log(f"measuring {len(configs)} configurations x {preset.get('rounds', 7)} interleaved rounds ...")
    _measure(configs, batch, int(preset.get("rounds", 7)))
    records = _records(configs, profile, int(preset["batch_size"]))
    targets = _targets(records)
    half = next((c for c in configs if c.get("note") == "halfway"), None)
    table = plan_table(half["plan"], profile) if half else ""
    clock_note = clock_description(device) + " (forward+backward), fastest of the interleaved rounds"
    env = environment(device)
    out_dir = Path(str(_get(cfg, "output_dir", "results"))) / preset["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / device.type
    md = _markdown(records, env, preset, profile, table, targets, clock_note, _noise(configs))
    stem.with_suffix(".md").write_text(md + f"\nCommand: `{command}`\n")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        keys = [k for k in records[0] if k != "step_times"] + ["saved_error", "step_error"]
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(keys)), extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    stem.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "preset": preset, "command": command, "records": records,
         "profile": {"stock_step_s": profile.stock_step_s, "step_noise": profile.step_noise,
                     "stock_activation_bytes": profile.stock_activation_bytes,
                     "items": [vars(it) for it in profile.items]},
         "targets": targets}, indent=1, default=str))
    _plot(stem.with_suffix(".png"), records, preset.get("title", "planner"))
    print(md)
    print(f"\nwrote {stem}.md/.csv/.json/.png")
    return 0
