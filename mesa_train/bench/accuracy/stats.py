"""Statistics over seeds: per-row mean / std / min / max of the final metrics, mean curves,
and paired comparisons between rows (every row is trained with the same seeds, so the
seed-by-seed differences cancel the shared init / data-order noise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

METRICS = ("top1", "val_loss", "train_loss")


@dataclass(frozen=True)
class Spread:
    n: int
    mean: float | None
    std: float | None  # sample standard deviation (ddof=1); None for one seed
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        vals = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
        if vals.size == 0:
            return cls(0, None, None, None, None)
        std = float(vals.std(ddof=1)) if vals.size > 1 else None
        return cls(int(vals.size), float(vals.mean()), std, float(vals.min()), float(vals.max()))

    def as_dict(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_{k}": getattr(self, k) for k in ("mean", "std", "min", "max")} | {f"{prefix}_n": self.n}


@dataclass(frozen=True)
class Paired:
    """a - b over the seeds both rows finished: mean, its standard error, t and p
    (two-sided paired t-test), and a 95% confidence interval."""
    n: int
    mean: float | None
    se: float | None
    t: float | None
    p: float | None
    ci_low: float | None
    ci_high: float | None


def final_values(runs: list[dict[str, Any]], metric: str) -> dict[int, float]:
    return {r["seed"]: float(r[metric]) for r in runs
            if r.get("status") == "ok" and r.get(metric) is not None}


def row_spreads(runs: list[dict[str, Any]]) -> dict[str, Spread]:
    return {m: Spread.of(list(final_values(runs, m).values())) for m in METRICS}


def paired(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]], metric: str = "top1") -> Paired:
    from scipy import stats

    a, b = final_values(a_runs, metric), final_values(b_runs, metric)
    seeds = sorted(set(a) & set(b))
    diff = np.asarray([a[s] - b[s] for s in seeds], dtype=float)
    if diff.size == 0:
        return Paired(0, None, None, None, None, None, None)
    mean = float(diff.mean())
    if diff.size < 2:
        return Paired(1, mean, None, None, None, None, None)
    se = float(diff.std(ddof=1) / math.sqrt(diff.size))
    half = float(stats.t.ppf(0.975, diff.size - 1)) * se
    if se == 0.0:
        t, p = (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), diff.size - 1))
    return Paired(int(diff.size), mean, se, t, p, mean - half, mean + half)


def verdict(kind: str, d: Paired, tol: float) -> str:
    """How the measured paired difference (a - b, top-1 points) bears on the paper's claim.
    ``better``: the paper has a above b. ``on_par``: the paper has a within ``tol`` of b."""
    if d.mean is None or d.ci_low is None:
        return "not measured (fewer than 2 common seeds)"
    if kind == "better":
        if d.ci_low > 0:
            return "reproduced (a > b, 95% CI excludes 0)"
        if d.ci_high < 0:
            return "contradicted (a < b, 95% CI excludes 0)"
        return ("same direction, within noise" if d.mean > 0 else
                "no difference measured" if d.mean == 0 else "opposite direction, within noise")
    if kind == "on_par":
        if -tol <= d.ci_low and d.ci_high <= tol:
            return f"reproduced (95% CI within ±{tol:g})"
        if d.ci_high < -tol or d.ci_low > tol:
            return f"contradicted (95% CI outside ±{tol:g})"
        if d.ci_high < 0:
            return f"a below b (95% CI excludes 0, reaches past -{tol:g})"
        return f"inconclusive (95% CI wider than ±{tol:g})"
    raise ValueError(f"unknown claim kind {kind!r}; valid: better, on_par")


def mean_curves(runs: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(epochs, mean, min, max) of a per-epoch metric over the seeds (epochs all runs have)."""
    curves = [r["curves"] for r in runs if r.get("status") == "ok" and r.get("curves")]
    if not curves:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    length = min(len(c) for c in curves)
    values = np.asarray([[float(c[i][key]) if c[i].get(key) is not None else np.nan for i in range(length)]
                         for c in curves])
    epochs = np.arange(1, length + 1)
    return epochs, np.nanmean(values, 0), np.nanmin(values, 0), np.nanmax(values, 0)
