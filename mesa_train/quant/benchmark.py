"""Micro-benchmark of the quantization kernels: achieved bandwidth vs a plain device copy.

    python -m mesa_train.quant.benchmark            # GPU if visible, else CPU (small sizes)
    python -m mesa_train.quant.benchmark --device cpu --quick

For each activation shape and dtype it times ``quantize`` (stochastic and nearest),
``dequantize`` and ``group_minmax`` and reports the achieved bandwidth
``(bytes read + bytes written) / time`` as a fraction of the bandwidth of a plain copy
(``torch.empty_like(b).copy_(b)``) that moves the same number of bytes (a uint8 buffer of
half that size: read once, written once). CUDA timings use CUDA events after warm-up and
report the median. The table is printed and written to
``results/kernels/<device-name>.md``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import time

import torch

from mesa_train import quant as Q
from mesa_train.device_info import device_name

# (name, shape, dim, groups): DeiT-B/ViT-B activations at batch 64 and smaller variants.
GPU_CASES = [
    ("tokens B64 (64,197,768) C-groups", (64, 197, 768), -1, 12),
    ("mlp B64 (64,197,3072) C-groups", (64, 197, 3072), -1, 12),
    ("attn B64 (64,12,197,197) per-head", (64, 12, 197, 197), 1, 12),
    ("conv (64,64,56,56) C-groups", (64, 64, 56, 56), 1, 8),
]
CPU_CASES = [
    ("tokens (8,197,192) C-groups", (8, 197, 192), -1, 3),
    ("attn (8,3,197,197) per-head", (8, 3, 197, 197), 1, 3),
]
QUICK_CASES = [
    ("tokens (2,65,96) C-groups", (2, 65, 96), -1, 3),
    ("attn (2,3,65,65) per-head", (2, 3, 65, 65), 1, 3),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _timer(device: torch.device, warmup: int, repeat: int):
    def run(fn) -> float:
        """Median seconds per call."""
        for _ in range(warmup):
            fn()
        times = []
        if device.type == "cuda":
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def run_benchmark(device: torch.device, cases, dtypes, warmup: int, repeat: int) -> list[dict]:
    timeit = _timer(device, warmup, repeat)
    rows = []
    for name, shape, dim, G in cases:
        for dname in dtypes:
            dtype = DTYPES[dname]
            x = torch.randn(shape, device=device).to(dtype)
            n, es = x.numel(), x.element_size()
            mn, mx = Q.group_minmax(x, dim, G)
            alpha, beta = (mx - mn).contiguous(), mn.contiguous()
            q = Q.quantize(x, alpha, beta, dim, G, True, 0)
            moved = n * es + n  # read x + write q (and the reverse for dequantize)
            buf = torch.empty(moved // 2, dtype=torch.uint8, device=device)
            t_copy = timeit(lambda: torch.empty_like(buf).copy_(buf))
            copy_bw = 2 * buf.numel() / t_copy
            ops = [
                ("quantize (stochastic)", moved, lambda: Q.quantize(x, alpha, beta, dim, G, True, 1)),
                ("quantize (nearest)", moved, lambda: Q.quantize(x, alpha, beta, dim, G, False, 0)),
                ("dequantize", moved, lambda: Q.dequantize(q, alpha, beta, dim, G, dtype)),
                ("group_minmax", n * es, lambda: Q.group_minmax(x, dim, G)),
            ]
            for op, nbytes, fn in ops:
                t = timeit(fn)
                bw = nbytes / t
                if op == "group_minmax":  # read-only: compare with a copy moving the same bytes
                    b2 = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
                    ref_bw = 2 * b2.numel() / timeit(lambda: torch.empty_like(b2).copy_(b2))
                else:
                    ref_bw = copy_bw
                rows.append(
                    dict(case=name, dtype=dname, op=op, us=t * 1e6, gbps=bw / 1e9, copy_gbps=ref_bw / 1e9,
                         frac=bw / ref_bw)
                )
            del x, q, buf
    return rows


def format_table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| case | dtype | op | time (us) | GB/s | copy GB/s | fraction of copy |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['op']} | {r['us']:.1f} | {r['gbps']:.1f} | "
            f"{r['copy_gbps']:.1f} | {r['frac']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--dtypes", default="fp32,fp16,bf16")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--out-dir", default=os.path.join("results", "kernels"))
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        cases, warmup, repeat = GPU_CASES, 10, 50
    else:
        cases, warmup, repeat = CPU_CASES, 2, 5
    if args.quick:
        cases, warmup, repeat = QUICK_CASES, 1, 3
    warmup = args.warmup if args.warmup is not None else warmup
    repeat = args.repeat if args.repeat is not None else repeat
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    name = device_name(device)
    rows = run_benchmark(device, cases, dtypes, warmup, repeat)
    header = (
        f"# mesa quantization kernels on {name}\n\n"
        f"torch {torch.__version__}, backend `{Q.BACKEND}`, "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. "
        "Bandwidth = (bytes read + bytes written) / median time; 'fraction of copy' compares with "
        "`torch.empty_like(b).copy_(b)` moving the same number of bytes."
    )
    table = format_table(rows, header)
    print(table)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, _slug(name) + ".md")
    with open(path, "w") as f:
        f.write(table)
    print(f"written to {path}")
    return table


if __name__ == "__main__":
    main()
