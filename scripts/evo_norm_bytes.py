"""Saved bytes, gradient agreement and CPU step time of timm models with EvoNorm / FRN layers
(``nn/evo_norm.py``), against the same patched model with those layers' compression off.

    python scripts/evo_norm_bytes.py            # bytes and cosines (fp32, batch 2, 64 px)
    python scripts/evo_norm_bytes.py --time     # + step time, batch 8, medians of 7 interleaved repeats

"before" is ``patch_model(model)`` with every EvoNorm / FRN twin set ``enabled=False`` (their
stock forward, what the code before session 81 ran); "after" the same patch as it comes. One
markdown row per model, ratios over the stock model's, in the same run.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.evo_norm import EVO_NORM_CLASSES
from mesa_train.patch import patch_model

MODELS = ("resnetv2_50d_evos", "resnetv2_50d_frn", "regnetz_b16_evos", "regnetz_c16_evos")


def three_models(name: str):
    """(stock, patched with the norms' compression off, patched), from one seed."""
    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=5).train()
    before, after = patch_model(copy.deepcopy(stock)), patch_model(copy.deepcopy(stock))
    for m in before.modules():
        if isinstance(m, tuple(EVO_NORM_CLASSES.values())):
            m.set_quant_options(enabled=False)
    return stock, before, after


def bytes_and_cosine(models, x) -> tuple:
    out = []
    for m in models:
        torch.manual_seed(1)
        with SavedTensorMeter(m) as meter:
            y = m(x)
        y.sum().backward()
        out.append((meter.activation_bytes, {n: p.grad for n, p in m.named_parameters()}))
    grads0, grads2 = out[0][1], out[2][1]
    cos = min(F.cosine_similarity(grads0[n].flatten(), grads2[n].flatten(), 0).item()
              for n in grads0 if grads0[n].norm() > 0)
    return out[1][0] / out[0][0], out[2][0] / out[0][0], cos


def step_times(models, x, repeats: int = 7) -> list:
    times = [[] for _ in models]
    for r in range(repeats + 1):  # interleaved; the first round warms up
        for i, m in enumerate(models):
            t = time.perf_counter()
            m(x).sum().backward()
            if r:
                times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time a training step (batch 8)")
    args = parser.parse_args()
    print("| model | bytes before | bytes after | worst gradient cosine |"
          + (" step before / stock | step after / stock | after / before |" if args.time else ""))
    print("|---|---|---|---|" + ("---|---|---|" if args.time else ""))
    for name in MODELS:
        models = three_models(name)
        before, after, cos = bytes_and_cosine(models, torch.randn(2, 3, 64, 64))
        row = f"| `{name}` | {before:.3f}x | {after:.3f}x | {cos:.4f} |"
        if args.time:
            stock_s, before_s, after_s = step_times(models, torch.randn(8, 3, 64, 64))
            row += f" {before_s / stock_s:.2f}x | {after_s / stock_s:.2f}x | {after_s / before_s:.2f}x |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
