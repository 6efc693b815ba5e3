"""``make demo``: a small DeiT on the embedded digits data, on CPU, once stock and once with
Mesa (every op compressed), through the real training pipeline (``runner.fit`` with the
``digits_deit_baseline`` / ``digits_deit_mesa`` experiment configs). Prints top-1,
images/s and the activation memory kept for backward side by side.

    python -m mesa_train.demo                      # both runs, a few minutes on 2 cores
    python -m mesa_train.demo trainer.epochs=3     # extra Hydra overrides for both runs
    python -m mesa_train.demo -h                   # this text
"""
from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RUNS = (("stock", "digits_deit_baseline"), ("Mesa", "digits_deit_mesa"))


def compose(experiment: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return hydra_compose("train", overrides=[f"experiment={experiment}", *overrides])


def run(overrides: list[str] | None = None, out_dir: str | None = None) -> dict:
    """Train both models; return {label: summary}. Logs and checkpoints go to
    ``out_dir/{stock,mesa}`` (default: outputs/demo/<date>_<time>)."""
    from mesa_train.train.runner import fit

    overrides = list(overrides or [])
    out_dir = out_dir or os.path.join("outputs", "demo", _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    results = {}
    for label, experiment in RUNS:
        cfg = compose(experiment, overrides)
        print(f"\n=== {label}: experiment={experiment} ===", flush=True)
        start = time.perf_counter()
        summary = fit(cfg, os.path.join(out_dir, label.lower()))
        summary["wall_s"] = time.perf_counter() - start
        results[label] = summary
    return results


def table(results: dict) -> str:
    stock, mesa = results["stock"], results["Mesa"]

    def mib(b):
        return f"{b / 2**20:.2f} MiB" if b is not None else "n/a"

    def pct(x):
        return f"{x:.2f}%" if x is not None else "n/a"

    rows = [
        ("", "stock", "Mesa (all ops, 8-bit)"),
        ("top-1 (val)", pct(stock["top1"]), pct(mesa["top1"])),
        ("top-5 (val)", pct(stock["top5"]), pct(mesa["top5"])),
        ("best top-1", pct(stock["best_top1"]), pct(mesa["best_top1"])),
        ("train images/s (mean)", f"{stock['images_per_s_mean']:.0f}", f"{mesa['images_per_s_mean']:.0f}"),
        ("saved for backward / batch", mib(stock["saved_bytes"]), mib(mesa["saved_bytes"])),
        ("wall time", f"{stock['wall_s']:.0f} s", f"{mesa['wall_s']:.0f} s"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    if stock["saved_bytes"] and mesa["saved_bytes"]:
        lines.append(f"Mesa keeps {stock['saved_bytes'] / mesa['saved_bytes']:.2f}x less activation memory "
                     f"for backward ({100 * (1 - mesa['saved_bytes'] / stock['saved_bytes']):.0f}% saved).")
    lines.append(top1_gap_line(stock["top1"], mesa["top1"], mesa.get("val_images")))
    return "\n".join(lines)


def chance_half_width(top1_a: float, top1_b: float, images: int) -> float:
    """Half-width, in points, of the 95% interval the validation sample alone puts around a
    difference of two top-1 accuracies (%) measured on ``images`` images each: each accuracy a
    binomial proportion (normal approximation), the two taken as independent. On the same
    images the two runs' errors overlap, so the true interval is narrower: this one errs wide.
    Training noise (another seed) comes on top of it."""
    a, b = top1_a / 100, top1_b / 100
    return 100 * 1.96 * math.sqrt((a * (1 - a) + b * (1 - b)) / max(images, 1))


def top1_gap_line(stock_top1: float, mesa_top1: float, images: int | None) -> str:
    """The demo's last line: Mesa's top-1 minus stock's, read against what one run on this
    validation set can resolve (a few hundred images: a couple of points either way)."""
    gap = mesa_top1 - stock_top1
    head = f"top-1 difference Mesa - stock: {gap:+.2f} points"
    if not images:
        return head + "."
    half = chance_half_width(stock_top1, mesa_top1, images)
    head += f" ({round(abs(gap) * images / 100)} of {images} validation images)"
    if abs(gap) <= half:
        reading = (f"within the +-{half:.1f} points (95%) the validation set alone allows one run, so this run "
                   "does not tell the two apart")
    else:
        reading = (f"beyond the +-{half:.1f} points (95%) the validation set alone allows one run (another "
                   "seed's training noise is not in that bound)")
    return f"{head}: {reading}. results/demo/digits.md: this comparison over 16 seeds."


def bad_override(args: list[str]) -> str | None:
    """The one-line complaint about the first argument that is not a Hydra override (``None``
    when all parse): composing would otherwise end in Hydra's lexer traceback."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in args:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            return (f"{arg!r} is not a Hydra override: arguments are key=value overrides applied to both runs, "
                    "e.g. trainer.epochs=3 (-h for help)")
    return None


def main(argv: list[str] | None = None) -> int:
    """The ``make demo`` entry point. Bad input ends in one line ``error: ...`` and exit code 2
    (as train.py; mesa_train/train/errors.py), never a traceback."""
    from hydra.errors import HydraException

    from mesa_train.hydra_cli import override_error
    from mesa_train.train import errors

    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    # (an unknown key or config group: one line naming the valid ones, before anything trains)
    message = bad_override(args) or override_error(str(CONFIGS), "train", [f"experiment={RUNS[0][1]}", *args])
    if message is None:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            results = run(args)
        except HydraException as err:  # an unknown key or config group (Hydra's own lines, joined)
            message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        except BaseException as err:  # noqa: BLE001 - a known failure gets its line, a bug its traceback
            described = errors.describe(err)
            if described is None:
                raise
            print(f"error: {described[1]}", file=sys.stderr, flush=True)
            return described[0]
    if message is not None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
