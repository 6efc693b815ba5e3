"""Memory vs throughput trade-off (the paper's Figure 6): one point per configuration
(op combination), the baseline marked, one colour per group. Right panel: the same as
ratios to the baseline, with the paper's ratios (hollow markers) where it has the row."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _memory_key(records: list[dict[str, Any]], device_type: str) -> tuple[str, str, str]:
    """(value key, ratio key, axis label). CUDA: peak allocated; CPU: bytes saved for
    backward (the process RSS is dominated by the interpreter for tiny models)."""
    if device_type == "cuda" or not any(r.get("saved_mb") for r in records):
        label = ("peak memory, max_memory_allocated (MB)" if device_type == "cuda"
                 else "peak RSS of the process (MB)")
        return "peak_mb", "peak_ratio", label
    return "saved_mb", "saved_ratio", "activation memory saved for backward (MB)"


def tradeoff_plot(path: Path, records: list[dict[str, Any]], plot_labels: list[str], *,
                  title: str, device: str, device_type: str,
                  search: list[dict[str, Any]] | None = None) -> Path | None:
    """Memory vs throughput of the measured rows (absolute, and as ratios to each group's
    baseline beside the paper's), plus the largest-model search's bars when given."""
    ok = [(r, lab) for r, lab in zip(records, plot_labels) if r["status"] == "ok"
          and r.get("throughput") is not None]
    if not ok and not search:
        return None
    ncols = (2 if ok else 0) + (1 if search else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.8), squeeze=False)
    axes = list(axes[0])
    if ok:
        _draw_rows(axes[0], axes[1], ok, device_type)
    if search:
        _draw_search(axes[-1], search)
    fig.suptitle(f"{title}\n{device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_rows(ax, axr, ok: list[tuple[dict[str, Any], str]], device_type: str) -> None:
    """Left panel: memory against images/s; right panel: both as ratios to the group's
    baseline, with the paper's ratios as hollow squares. One colour per group."""
    mkey, rkey, mlabel = _memory_key([r for r, _ in ok], device_type)
    groups = list(dict.fromkeys(r["group"] for r, _ in ok))
    cmap = plt.get_cmap("tab10")
    colour = {g: cmap(i % 10) for i, g in enumerate(groups)}
    for r, lab in ok:
        c = colour[r["group"]]
        base = r["baseline"]
        kw = dict(marker="*" if base else "o", s=220 if base else 55, color=c,
                  edgecolors="black" if base else c, zorder=3)
        if r.get(mkey) is not None:
            ax.scatter(r[mkey], r["throughput"], **kw)
            ax.annotate(lab, (r[mkey], r["throughput"]), textcoords="offset points",
                        xytext=(5, 4), fontsize=7)
        if r.get(rkey) is not None and r.get("throughput_ratio") is not None:
            axr.scatter(r[rkey], r["throughput_ratio"], **kw)
            axr.annotate(lab, (r[rkey], r["throughput_ratio"]), textcoords="offset points",
                         xytext=(5, 4), fontsize=7)
        if r.get("paper_memory_ratio") is not None and r.get("paper_throughput_ratio") is not None:
            axr.scatter(r["paper_memory_ratio"], r["paper_throughput_ratio"], marker="s",
                        s=45, facecolors="none", edgecolors=c, zorder=2)
            if not r["baseline"]:
                axr.annotate(lab, (r["paper_memory_ratio"], r["paper_throughput_ratio"]),
                             textcoords="offset points", xytext=(5, -9), fontsize=6, color="grey")
    # legends: one entry per group (named by its baseline row), then the marker kinds
    names = {r["group"]: r["label"] for r, _ in ok if r["baseline"]}
    for g in groups:
        ax.scatter([], [], color=colour[g], label=names.get(g, g))
    ax.scatter([], [], marker="*", s=150, color="grey", edgecolors="black", label="baseline")
    axr.scatter([], [], marker="o", color="grey", label="ours")
    axr.scatter([], [], marker="s", facecolors="none", edgecolors="grey", label="paper")
    ax.set_xlabel(mlabel)
    ax.set_ylabel("training throughput (images/s)")
    ax.set_title("measured", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    axr.set_xlabel("memory / baseline (" + ("saved bytes" if mkey == "saved_mb" else "peak") + ")")
    axr.set_ylabel("throughput / baseline")
    axr.axhline(1.0, color="grey", lw=0.6, ls="--")
    axr.axvline(1.0, color="grey", lw=0.6, ls="--")
    axr.set_title("ratios to the baseline (paper: hollow squares)", fontsize=10)
    axr.grid(alpha=0.3)
    axr.legend(fontsize=7, loc="best")


def _draw_search(axs, search: list[dict[str, Any]]) -> None:
    """Bars: the largest size that fits under the memory cap, Mesa / stock, ours and the paper's."""
    dims = [s["dim"] for s in search]
    xs = range(len(dims))
    ours = [s["ratio"] or 0 for s in search]
    paper = [s["paper_ratio"] or 0 for s in search]
    axs.bar([x - 0.2 for x in xs], ours, width=0.4, label="ours (Mesa / stock)")
    axs.bar([x + 0.2 for x in xs], paper, width=0.4, label="paper", color="lightgrey",
            edgecolor="black")
    axs.set_xticks(list(xs), dims)
    axs.set_ylabel("largest size that fits, Mesa / stock")
    axs.axhline(1.0, color="grey", lw=0.6, ls="--")
    axs.set_title("largest model under the memory cap", fontsize=10)
    axs.legend(fontsize=7)
