"""CPU time of a Mesa Softmax's backward on an attention map: the former ATen sequence
(dequantize, row renormalisation, _softmax_backward_data) against mesa::softmax_backward.

    python scripts/time_softmax_backward.py [--shape 8 6 197 197] [--repeats 21] [--threads 1]

Prints the median over interleaved repeats of each, per dtype, in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mesa_train.quant as Q


def former(g, q, alpha, beta, dtype):
    yh = torch.ops.mesa.dequantize(q, alpha, beta, 1, alpha.shape[1], dtype)
    yh = yh / yh.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return torch._softmax_backward_data(g, yh, -1, dtype)


def fused(g, q, alpha, beta, dtype):
    return torch.ops.mesa.softmax_backward(g, q, alpha, beta, 1, alpha.shape[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 6, 197, 197])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"backend {Q.BACKEND}, shape {tuple(args.shape)}, {args.threads} thread(s), median of {args.repeats}")
    for dtype in (torch.bfloat16, torch.float32):
        y = torch.softmax(torch.randn(args.shape) * 3, -1).to(dtype)
        G = args.shape[1]
        mn, mx = Q.group_minmax(y, 1, G)
        alpha, beta = mx - mn, mn
        q = Q.quantize(y, alpha, beta, 1, G, True, 0)
        g = torch.randn(args.shape).to(dtype)
        times = {"former": [], "fused": []}
        for _ in range(2):  # warm up
            former(g, q, alpha, beta, dtype), fused(g, q, alpha, beta, dtype)
        for _ in range(args.repeats):
            for name, fn in (("former", former), ("fused", fused)):
                t0 = time.perf_counter()
                fn(g, q, alpha, beta, dtype)
                times[name].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[k]) * 1e3 for k in ("former", "fused"))
        rel = ((fused(g, q, alpha, beta, dtype).float() - former(g, q, alpha, beta, dtype).float()).norm()
               / former(g, q, alpha, beta, dtype).float().norm()).item()
        print(f"{str(dtype):15s} former {a:8.2f} ms   fused {b:8.2f} ms   {a / b:5.2f}x   rel. diff {rel:.2e}")


if __name__ == "__main__":
    main()
