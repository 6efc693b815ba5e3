"""Per-model numbers of the timm sweep (issue 10), one model at a time in one process:
train forward bitwise equal to stock (timm defaults + dropout/drop-path on), worst gradient
cosine against a float64 stock run (the metric of tests/test_timm_models.py), and saved bytes
of the patched model over stock (fp32, ops=all, zoo size, batch 32).

    PYTHONPATH=. python scripts/timm_sweep.py [--out results/timm/sweep.md] [MODEL ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from timm_zoo import ZOO, build, example  # noqa: E402
from test_timm_models import (GRADIENT_KNOWN, _exact_grads, _grads, _loss, _patched, _seeded,  # noqa: E402
                              _worst_cosines)

from mesa_train.memory import SavedTensorMeter  # noqa: E402


def _bytes(model, x):
    with SavedTensorMeter(model) as meter:
        torch.manual_seed(0)
        model(x)
    return meter.activation_bytes


def measure(name: str) -> dict:
    row = {"model": name}
    stock = build(name, drop=True)
    x = example(name)
    row["forward"] = "equal" if torch.equal(_seeded(stock, x), _seeded(_patched(stock), x)) else "DIFFERS"
    stock = build(name)
    patched = _patched(stock)
    exact = _exact_grads(stock, x)
    fp32 = copy.deepcopy(stock)
    _loss(_seeded(fp32, x)).backward()
    _loss(_seeded(patched, x)).backward()
    worst = _worst_cosines(exact, _grads(patched), _grads(fp32))
    row["cosine"], row["worst"] = worst[0][1], worst[0][0]
    xb = example(name, batch=32)
    row["ratio"] = _bytes(_patched(stock), xb) / _bytes(stock, xb)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for name in args.models or list(ZOO):
        t = time.time()
        try:
            row = measure(name)
        except Exception as e:  # a crash is a result too
            row = {"model": name, "forward": f"CRASH {type(e).__name__}: {e}"[:120], "cosine": float("nan"),
                   "worst": "", "ratio": float("nan")}
        row["known"] = "yes" if name in GRADIENT_KNOWN else ""
        rows.append(row)
        print(f"{name:40s} fwd={row['forward']:6s} cos={row['cosine']:.4f} ({row['worst']}) "
              f"bytes={row['ratio']:.3f}x {row['known']} [{time.time() - t:.0f}s]", flush=True)
    if args.out:
        lines = ["| model | train forward vs stock | worst grad cosine | parameter | saved bytes / stock (b=32) | "
                 "in GRADIENT_KNOWN |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['model']} | {r['forward']} | {r['cosine']:.4f} | {r['worst']} | {r['ratio']:.3f} | "
                         f"{r['known']} |")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
