"""Figures of the accuracy table: training curves per paper table (mean over seeds, min-max
band) and the final top-1 / loss of every row with its spread over seeds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mesa_train.bench.accuracy.paper import TABLE_TITLES  # noqa: E402
from mesa_train.bench.accuracy.stats import mean_curves  # noqa: E402

CURVES = (("top1", "validation top-1 (%)", False), ("val_loss", "validation loss", True))


def curves_plot(path: Path, tables: dict[str, list[str]], runs: dict[str, list[dict[str, Any]]],
                title: str) -> Path | None:
    """One column per paper table (its rows, the stock row included), top: validation top-1
    per epoch, bottom: validation loss; lines are the mean over seeds, bands min..max."""
    if not tables or not any(r.get("curves") for rs in runs.values() for r in rs):
        return None
    names = list(tables)
    fig, axes = plt.subplots(2, len(names), figsize=(3.6 * len(names), 6.4), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for col, table in enumerate(names):
        for i, label in enumerate(tables[table]):
            for row, (key, ylabel, log) in enumerate(CURVES):
                ax = axes[row][col]
                epochs, mean, low, high = mean_curves(runs.get(label, []), key)
                if epochs.size == 0:
                    continue
                colour = cmap(i % 10)
                ax.plot(epochs, mean, color=colour, lw=1.4, label=label)
                ax.fill_between(epochs, low, high, color=colour, alpha=0.15, lw=0)
                if log:
                    ax.set_yscale("log")
                if col == 0:
                    ax.set_ylabel(ylabel)
                ax.set_xlabel("epoch")
                ax.grid(alpha=0.3)
        top = axes[0][col]
        top.set_title(TABLE_TITLES.get(table, table).split(":")[0], fontsize=10)
        epochs, mean, _, _ = mean_curves(runs.get(tables[table][0], []), "top1")
        if epochs.size:  # zoom on the second half of training, where the rows differ
            finals = [mean_curves(runs.get(lab, []), "top1") for lab in tables[table]]
            lows = [lo[len(lo) // 2:].min() for _, _, lo, _ in finals if lo.size]
            top.set_ylim(max(0.0, min(lows) - 2.0) if lows else None, 100.5)
        axes[1][col].legend(fontsize=6, loc="upper right")
    fig.suptitle(f"{title}\nmean over seeds (line) and min..max (band)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_plot(path: Path, records: list[dict[str, Any]], title: str) -> Path | None:
    """Final top-1 and validation loss per row: mean with std bars, each seed as a dot."""
    ok = [r for r in records if r.get("top1_mean") is not None]
    if not ok:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * len(ok) + 1.8), squeeze=False)
    ys = list(range(len(ok)))[::-1]
    for ax, key, xlabel in ((axes[0][0], "top1", "final validation top-1 (%)"),
                            (axes[0][1], "val_loss", "final validation loss")):
        for y, rec in zip(ys, ok):
            colour = "black" if rec["baseline"] else "tab:blue"
            ax.errorbar(rec[f"{key}_mean"], y, xerr=rec[f"{key}_std"] or 0, fmt="o", color=colour,
                        capsize=3, ms=5, zorder=3)
            ax.scatter(rec[f"{key}_by_seed"], [y] * len(rec[f"{key}_by_seed"]), s=10,
                       color="tab:orange", alpha=0.7, zorder=2)
        base = next((r for r in ok if r["baseline"]), None)
        if base is not None:
            ax.axvline(base[f"{key}_mean"], color="grey", ls="--", lw=0.8)
        ax.set_yticks(ys, [r["label"] for r in ok], fontsize=8)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="x")
    axes[0][0].set_title("mean ± std over seeds (dots: each seed)", fontsize=9)
    axes[0][1].set_title("dashed: the stock row's mean", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
