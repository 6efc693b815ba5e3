"""Gemma 4's two Mesa-only layers at the encoder's own sizes: stock, the C++ layer op and the
Python Function, forward + backward, in one process.

``Clamp`` (``torch.clamp(x, lo, hi)`` with 0-dim buffer bounds, on the token projections'
inputs and outputs) and ``OneHotTable`` (the position lookup ``one_hot(positions) @ table``).
The per-layer overhead bench (``mesa_train.bench.overhead``) times 64-element tensors, where
only host time counts; here the data passes count too. Rounds alternate stock / op / Python
(200 passes each for a Clamp, 10 for the table), and the figure is the median over rounds of
each round's median.
A whole Gemma 4 step (``scripts/layer_path_ab.py --layers gemma4``) is dominated by its
matmuls and on a 2-core VM varies by more than these layers cost, so this is the measure of
them.

    python scripts/gemma4_layers_bench.py [--threads 1] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn.one_hot_table import one_hot_lookup

# (tokens per image at 64 px, batch 16): Gemma-4-ViT-167M's width 768 and MLP width 3072, its
# position table (2 axes, 10240 positions)
BATCH, TOKENS, WIDTH, MLP_WIDTH, POSITIONS = 16, 16, 768, 3072, 10240


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _cases() -> dict:
    """{name: (stock pass, Mesa pass, reps)}: each a forward + backward."""
    lo, hi = torch.tensor(-2.0), torch.tensor(2.0)
    clamp, table_layer = mnn.Clamp(), mnn.OneHotTable()
    cases = {}
    for width in (WIDTH, MLP_WIDTH):
        x = torch.randn(BATCH, TOKENS, width, requires_grad=True)
        cases[f"Clamp ({BATCH}, {TOKENS}, {width})"] = (
            lambda x=x: torch.clamp(x, lo, hi).sum().backward(),
            lambda x=x: clamp(x, lo, hi).sum().backward(), 200)
    table = torch.randn(2, POSITIONS, WIDTH, requires_grad=True)
    positions = torch.randint(0, POSITIONS, (BATCH, TOKENS, 2))
    cases[f"OneHotTable ({BATCH}, {TOKENS}, 2) x (2, {POSITIONS}, {WIDTH})"] = (
        lambda: one_hot_lookup(positions, table).sum().backward(),
        lambda: table_layer(positions, table).sum().backward(), 10)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the steadiest figures)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median over them")
    args = ap.parse_args()
    if not quantizer_mod._FUSED_LAYERS:
        raise SystemExit("error: needs the compiled extension (mesa_train._C) for the C++ layer ops")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    real = quantizer_mod._FUSED_LAYERS
    print(f"{args.threads} thread(s), median over {args.rounds} alternating rounds; fwd + bwd, microseconds")
    print("| layer | stock | Mesa C++ op | Mesa Python Function | op / stock | op / Python |")
    print("|---|---|---|---|---|---|")
    for name, (stock, mesa, reps) in _cases().items():
        runs = {"stock": [], "op": [], "python": []}
        for _ in range(args.rounds):
            runs["stock"].append(_median_us(stock, reps))
            for path, fused in (("op", real), ("python", False)):
                quantizer_mod._FUSED_LAYERS = fused
                try:
                    runs[path].append(_median_us(mesa, reps))
                finally:
                    quantizer_mod._FUSED_LAYERS = real
        s, o, p = (statistics.median(runs[k]) for k in ("stock", "op", "python"))
        print(f"| {name} | {s:.0f} | {o:.0f} | {p:.0f} | {o / s:.2f}x | {o / p:.2f}x |")


if __name__ == "__main__":
    main()
