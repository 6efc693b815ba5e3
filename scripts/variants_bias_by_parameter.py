"""Which parameters carry the gradient bias of a variants-table row, and whether the running
estimate's clipping is its source.

The variants table (``python -m mesa_train.bench.variants``) resolves a bias in some 8-bit rows
(PVT-v2 linear: 0.017 against 0.003 of noise). Rounding is unbiased, so the suspect is the
running min/max: it blends the current batch's range into an average of earlier batches', and
values outside the blend are clipped. This reruns the table's setting (same model, batch,
seeds and warm-up) with the paper's running estimate, with ``decay=0`` (the current batch's
range: nothing clipped) and with per-sample ranges, and prints each one's total bias and, for
the running estimate, the parameters whose gradient carries most of it.

    python scripts/variants_bias_by_parameter.py [--model pvt_v2_b0] [--op linear] [--passes 12] [--batch 2]

``--batch`` other than the table's 2 asks how the clipping shrinks as the batch grows (the
warm-up batches have the same size).
"""
from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F

import mesa_train
from mesa_train.bench.variants import MODELS, OPS, _build, bias_squared, table_batch

ESTIMATES = {"running (paper)": {}, "decay 0": {"decay": 0.0}, "per-sample": {"estimator": "per_sample"}}


def _grads(model, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def measure(model_name: str, op: str, *, passes: int, warmup: int, batch: int) -> dict[str, dict]:
    """Per estimate: its relative bias, the noise of an N-pass mean, and (running estimate)
    each parameter's share of the bias^2, largest first."""
    base = _build(model_name)
    x, y, warm = table_batch(warmup, batch)  # the variants table's data (at batch 2)
    exact = _grads(copy.deepcopy(base), x, y)
    flat_exact = torch.cat([g.reshape(-1) for g in exact.values()])
    norm = float(flat_exact.norm())

    out = {}
    for label, opts in ESTIMATES.items():
        model = mesa_train.patch_model(copy.deepcopy(base), ops=[op], attention="explicit", **opts)
        for w in warm:
            model(w).sum().backward()
        draws = [_grads(model, x, y) for _ in range(passes)]
        total = torch.stack([torch.cat([d[n].reshape(-1) for n in exact]) for d in draws])
        bias2, var = bias_squared(total, flat_exact)
        shares = []
        if not opts and bias2 > 0:  # (shares of a bias the passes do not resolve would mean nothing)
            shares = sorted(((bias_squared(torch.stack([d[n].reshape(-1) for d in draws]), exact[n].reshape(-1))[0]
                              / bias2, n) for n in exact), reverse=True)
        out[label] = {"bias": math.sqrt(max(0.0, bias2)) / norm, "noise": math.sqrt(var / passes) / norm,
                      "shares": shares}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pvt_v2_b0", choices=list(MODELS))
    ap.add_argument("--op", default="linear", choices=list(OPS))
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=5, help="parameters listed for the running estimate")
    ap.add_argument("--batch", type=int, default=2, help="images a batch (the variants table: 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print(f"{args.model}, op {args.op}, 8-bit, batch {args.batch}, {args.passes} passes: relative bias "
          "(noise/sqrt(N))")
    for label, r in measure(args.model, args.op, passes=args.passes, warmup=args.warmup, batch=args.batch).items():
        print(f"  {label:16s} bias {r['bias']:.5f} ({r['noise']:.5f})")
        for share, name in r["shares"][:args.top]:
            print(f"      {name:45s} {100 * share:5.1f}% of the bias^2")


if __name__ == "__main__":
    main()
