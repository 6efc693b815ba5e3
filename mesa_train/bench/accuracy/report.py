"""The accuracy table's files: one record per row (spread over seeds, paired difference to
the stock row, the paper's numbers), Markdown with one section per paper table and the
paper's claims checked against the measured differences, CSV per row and per run, JSON."""
from __future__ import annotations

import io
from typing import Any

from mesa_train.bench.accuracy.paper import TABLE_TITLES, paper_accuracy
from mesa_train.bench.accuracy.spec import AccuracySpec
from mesa_train.bench.accuracy.stats import METRICS, paired, row_spreads, verdict

ROW_COLUMNS = [
    "preset", "label", "setting", "baseline", "seeds", "runs_ok",
    "top1_mean", "top1_std", "top1_min", "top1_max",
    "val_loss_mean", "val_loss_std", "val_loss_min", "val_loss_max",
    "train_loss_mean", "train_loss_std", "train_loss_min", "train_loss_max",
    "top1_delta_mean", "top1_delta_ci_low", "top1_delta_ci_high", "top1_delta_p",
    "val_loss_delta_mean", "saved_mb", "saved_ratio", "wall_s_mean", "top1_by_seed", "paper",
    "device", "torch", "timm", "mesa_train", "git", "date",
]
RUN_COLUMNS = ["preset", "label", "seed", "status", "top1", "top5", "val_loss", "train_loss",
               "best_top1", "epochs", "steps", "saved_bytes", "images_per_s", "wall_s", "error"]


def paper_text(spec: AccuracySpec, label: str) -> str:
    """Every paper number the preset maps onto this row, e.g. ``T7 All: 65.2 (C100)``."""
    parts = []
    for table, entries in spec.tables.items():
        for e in entries:
            if e.row == label and e.paper:
                p = paper_accuracy(e.paper)
                parts.append(f"T{table.removeprefix('table')} {p.row.removeprefix('+ ')}: {p.text()}")
    return "; ".join(parts)


def build_records(spec: AccuracySpec, runs: dict[str, list[dict[str, Any]]],
                  env: dict[str, Any]) -> list[dict[str, Any]]:
    base_runs = runs[spec.baseline.label]
    base_saved = _saved_mb(base_runs)
    records = []
    for row in spec.rows:
        rr = runs[row.label]
        rec: dict[str, Any] = {"preset": spec.name, "label": row.label, "setting": row.setting(),
                               "baseline": row.baseline, "seeds": len(spec.seeds),
                               "runs_ok": sum(r.get("status") == "ok" for r in rr)}
        for metric, spread in row_spreads(rr).items():
            rec.update(spread.as_dict(metric))
        for metric in METRICS:
            rec[f"{metric}_by_seed"] = [r[metric] for r in sorted(rr, key=lambda r: r["seed"])
                                        if r.get("status") == "ok" and r.get(metric) is not None]
        d = paired(rr, base_runs, "top1")
        rec.update(top1_delta_mean=d.mean, top1_delta_ci_low=d.ci_low, top1_delta_ci_high=d.ci_high,
                   top1_delta_p=d.p, val_loss_delta_mean=paired(rr, base_runs, "val_loss").mean)
        rec["saved_mb"] = _saved_mb(rr)
        rec["saved_ratio"] = (rec["saved_mb"] / base_saved if rec["saved_mb"] is not None and base_saved
                              else None)
        walls = [r["wall_s"] for r in rr if r.get("wall_s") is not None]
        rec["wall_s_mean"] = sum(walls) / len(walls) if walls else None
        rec["top1_by_seed_text"] = ";".join(f"{r['seed']}:{r['top1']:.2f}" for r in sorted(rr, key=lambda r: r["seed"])
                                            if r.get("status") == "ok" and r.get("top1") is not None)
        rec["paper"] = paper_text(spec, row.label)
        rec["errors"] = [f"seed {r['seed']}: {r.get('error')}" for r in rr if r.get("status") != "ok"]
        for key in ("device", "torch", "timm", "mesa_train", "git", "date"):
            rec[key] = env.get(key)
        records.append(rec)
    return records


def _saved_mb(runs: list[dict[str, Any]]) -> float | None:
    values = [r["saved_bytes"] for r in runs if r.get("status") == "ok" and r.get("saved_bytes")]
    return sum(values) / len(values) / 2**20 if values else None


def csv_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "top1_by_seed": r["top1_by_seed_text"]} for r in records]


# --------------------------------------------------------------------------- markdown

def _f(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _mean_std(rec: dict[str, Any], metric: str, digits: int) -> str:
    if rec.get(f"{metric}_mean") is None:
        return "–"
    std = rec.get(f"{metric}_std")
    return _f(rec[f"{metric}_mean"], digits) + (f" ± {std:.{digits}f}" if std is not None else "")


def _range(rec: dict[str, Any], metric: str, digits: int) -> str:
    if rec.get(f"{metric}_min") is None:
        return "–"
    return f"{rec[f'{metric}_min']:.{digits}f}–{rec[f'{metric}_max']:.{digits}f}"


def _delta(rec: dict[str, Any]) -> str:
    if rec["baseline"]:
        return "(stock)"
    if rec.get("top1_delta_mean") is None:
        return "–"
    text = _f(rec["top1_delta_mean"], 2, signed=True)
    if rec.get("top1_delta_ci_low") is not None:
        text += f" [{rec['top1_delta_ci_low']:+.2f}, {rec['top1_delta_ci_high']:+.2f}]"
    return text


def _status(rec: dict[str, Any]) -> str:
    return "" if not rec["errors"] else f" (**{len(rec['errors'])} run(s) failed**)"


def all_rows_table(records: list[dict[str, Any]]) -> str:
    head = ["Row", "Setting", "Top-1 % (mean ± std)", "Top-1 min–max", "Δ top-1 vs stock [95% CI]",
            "Val loss (mean ± std)", "Val loss min–max", "Saved for backward MiB", "Paper top-1 %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        saved = "–" if r["saved_mb"] is None else f"{r['saved_mb']:.2f} ({r['saved_ratio']:.2f}×)"
        lines.append("| " + " | ".join([
            r["label"] + _status(r), r["setting"], _mean_std(r, "top1", 2), _range(r, "top1", 2), _delta(r),
            _mean_std(r, "val_loss", 3), _range(r, "val_loss", 3), saved, r["paper"] or "–",
        ]) + " |")
    return "\n".join(lines)


def paper_table(spec: AccuracySpec, table: str, by_label: dict[str, dict[str, Any]]) -> str:
    head = ["Paper row", "Our row", "Ours: top-1 % mean ± std [min–max]", "Δ vs stock [95% CI]",
            "Ours: val loss", "Paper: top-1 %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in spec.tables[table]:
        r = by_label[e.row]
        p = paper_accuracy(e.paper) if e.paper else None
        lines.append("| " + " | ".join([
            p.row if p else "–", e.row, f"{_mean_std(r, 'top1', 2)} [{_range(r, 'top1', 2)}]", _delta(r),
            _mean_std(r, "val_loss", 3), p.text() if p else "–",
        ]) + " |")
    return "\n".join(lines)


def claims_table(spec: AccuracySpec, runs: dict[str, list[dict[str, Any]]]) -> tuple[str, list[dict[str, Any]]]:
    head = ["Table", "Paper's claim", "a", "b", "a − b top-1 (mean [95% CI], p)", "Verdict at this scale"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out = []
    for c in spec.claims:
        d = paired(runs[c.a], runs[c.b], "top1")
        v = verdict(c.kind, d, c.tol)
        diff = "–" if d.mean is None else (
            f"{d.mean:+.2f}" + (f" [{d.ci_low:+.2f}, {d.ci_high:+.2f}], p={d.p:.2g}" if d.ci_low is not None else ""))
        lines.append(f"| {c.table.replace('table', 'T')} | {c.text} | {c.a} | {c.b} | {diff} | {v} |")
        out.append({"table": c.table, "kind": c.kind, "a": c.a, "b": c.b, "text": c.text, "tol": c.tol,
                    "n": d.n, "diff_mean": d.mean, "ci_low": d.ci_low, "ci_high": d.ci_high, "p": d.p,
                    "verdict": v})
    return "\n".join(lines), out


def render_markdown(*, spec: AccuracySpec, env: dict[str, Any], records: list[dict[str, Any]],
                    runs: dict[str, list[dict[str, Any]]], command: str, facts: list[str],
                    files: dict[str, str], notes: list[str]) -> tuple[str, list[dict[str, Any]]]:
    out = io.StringIO()
    w = out.write
    w(f"# {spec.title}\n\n")
    if spec.description:
        w(spec.description + "\n\n")
    w(f"- Device: **{env['device']}**; {', '.join(facts)}\n")
    w(f"- Date: {env['date']}; versions: torch {env['torch']}, timm {env['timm']}, "
      f"mesa_train {env['mesa_train']}, Python {env['python']}; Mesa extension: {env['mesa_extension']}; "
      f"git {env['git']}\n")
    w(f"- Command: `{command}`\n")
    w(f"- Training: experiment `{spec.experiment}`" + (f" with `{' '.join(spec.train)}`" if spec.train else "")
      + f"; seeds {spec.seeds} (fixed in the preset before the run, the same for every row)\n\n")
    w("## Every row\n\n")
    w("Final metrics after the last epoch (not the best epoch), over the seeds. Δ is the mean "
      "seed-by-seed difference to the stock row (same seed = same initialisation and data order), "
      "with its 95% t-interval.\n\n")
    w(all_rows_table(records) + "\n\n")
    by_label = {r["label"]: r for r in records}
    for table in spec.tables:
        w(f"## {TABLE_TITLES[table]}\n\n" + paper_table(spec, table, by_label) + "\n\n")
    claims_md, claims = claims_table(spec, runs)
    if claims:
        w("## The paper's directions, tested on this run\n\n")
        w("Paired over seeds, top-1 points. 'reproduced' needs the 95% interval to exclude 0 "
          "(better) or to lie within the tolerance (on par); otherwise the run cannot tell.\n\n")
        w(claims_md + "\n\n")
    for key, alt in (("curves", "training curves"), ("summary", "final top-1 and loss per row")):
        if files.get(key):
            w(f"![{alt}]({files[key]})\n\n")
    failed = [f"{r['label']} {e}" for r in records for e in r["errors"]]
    w("## Notes\n\n")
    for note in [*notes, *spec.notes, *(f"Failed run: {f}" for f in failed)]:
        w(f"- {note}\n")
    return out.getvalue(), claims
