"""Micro-benchmark of the quantization kernels as a fraction of ``clone()`` bandwidth.

    python -m mesa_train.quant.benchmark            # GPU if visible (bf16), else CPU (small sizes)
    python -m mesa_train.quant.benchmark --device cpu --quick
    python -m mesa_train.quant.benchmark --cases hidden --ops observe_rows   # a subset, printed only
    python -m mesa_train.quant.benchmark --launch-only --ops ...   # each op once, untimed (under ncu)

Per layout it times, with the ops the layers run:

* the forward compression ``observe + quantize`` (2 launches on CUDA; it reads ``x`` twice
  and writes the uint8 codes), and each of the two ops alone;
* ``dequantize`` (backward: reads the codes, writes ``x``'s dtype);
* estimator ``delayed``'s one-pass ``quantize_observe``, and on the token layout the row
  scales of Linear / LayerNorm inputs (``row_exponents``, ``observe_rows``, the forward the
  layers run, ``observe_rows + quantize``, against the former three-op one, and the backward
  with ``row_exp``), a GELU's backward from the codes (``gelu_backward``) against
  ``dequantize`` + ATen's ``gelu_backward``, and a LayerNorm's ``x_hat`` compressed from its
  input with ``row_mean`` / ``row_rstd`` against a second ``native_layer_norm`` first, and its
  backward with dequantize's ``row_mul`` against the former ``dx * rstd`` after ATen's backward
  (also with a float32 input: a LayerNorm under autocast), and LayerNorm + Linear's rebuild
  of ``x_hat * gamma + beta`` with dequantize's ``col_scale`` / ``col_shift`` against the
  former dequantize, multiply, add and cast, and GELU + Linear's backward from ``h``'s codes
  (``dequantize_gelu`` and ``gelu_backward`` with ``row_exp``) against dequantize, gelu and
  ATen's ``gelu_backward``; on the attention layout a softmax's backward from its codes
  (``softmax_backward``) against dequantize + ATen's ``_softmax_backward_data``;
* on the q of a fused qkv (a strided view, as timm's attention makes it) the forward read in
  place against the contiguous copy it used to start with (``csrc/mesa_common.h``, "strided
  inputs");
* ``x.clone()`` (reads and writes ``x``) as the bandwidth baseline, in the same run.

Bandwidth = (bytes read + bytes written) / median time; "fraction of clone" = that
bandwidth / clone's bandwidth (1.0 = as fast per byte as a plain copy); "time / clone" =
time / clone's time. On a GPU both use the kernels' time (torch.profiler), not the latency
of one call: for small tensors, a custom op's host dispatch hid its kernels.
Layouts: the token layout ``(128, 197, 384)`` and the MLP's hidden ``(128, 197, 1536)`` with
channel groups on ``dim=-1`` and the attention layout ``(128, 6, 197, 197)`` with per-head groups on
``dim=1`` (DeiT-S at batch 128), and q ``(128, 6, 197, 64)`` viewed in a ``(128, 197, 3, 6, 64)``
qkv tensor, per-head groups. CUDA latency uses CUDA events after warm-up (median), kernel
time torch.profiler's kernel durations. The
table is printed and written to ``results/kernels/<device-name>.md``.
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
from mesa_train.quant.reference import LN_MAX_COLS
from mesa_train.quant.reference_check import ReferenceCheck

# MESA_CUDA_GRID's values (csrc/cuda/quant_cuda.cu, elementwise_grid): how many blocks the
# quantize and dequantize kernels launch; the codes are the same under each
GRID_POLICIES = ("capped", "full", "resident")

# (name, shape, dim, groups)
GPU_CASES = [
    ("tokens (128,197,384) C-groups dim -1", (128, 197, 384), -1, 6),
    # the MLP's hidden (GELU's output, fc2's input): the step's largest row-scale ops on the
    # H200 profile, observe_rows' row pass 63 us a call against 28 on the token layout
    ("hidden (128,197,1536) C-groups dim -1", (128, 197, 1536), -1, 6),
    ("attn (128,6,197,197) per-head dim 1", (128, 6, 197, 197), 1, 6),
    ("q of qkv (128,6,197,64) per-head dim 1, strided view", (128, 197, 3, 6, 64), 1, 6),
    # a convnet's NCHW activation grouped per channel (ResNet-50's last stage, its BatchNorms'
    # x_hat at batch 128): 49 elements after the group dim
    ("conv (128,2048,7,7) per-channel dim 1", (128, 2048, 7, 7), 1, 2048),
]
CPU_CASES = [
    ("tokens (8,197,384) C-groups dim -1", (8, 197, 384), -1, 6),
    ("attn (8,6,197,197) per-head dim 1", (8, 6, 197, 197), 1, 6),
    # NCHW per-channel groups with few elements after the group dim (ResNet-50's stages 2 and
    # 4 at 64x64, stage 4 at 224x224): the CPU kernels' short runs (quant_cpu.cpp, "Short runs";
    # the last two: column blocks in the min/max passes)
    ("conv (16,2048,2,2) per-channel dim 1", (16, 2048, 2, 2), 1, 2048),
    ("conv (16,512,8,8) per-channel dim 1", (16, 512, 8, 8), 1, 512),
    ("conv (16,2048,7,7) per-channel dim 1", (16, 2048, 7, 7), 1, 2048),
]
QUICK_CASES = [
    ("tokens (2,65,96) C-groups dim -1", (2, 65, 96), -1, 3),
    ("attn (2,3,65,65) per-head dim 1", (2, 3, 65, 65), 1, 3),
    ("q of qkv (2,3,65,16) per-head dim 1, strided view", (2, 65, 3, 3, 16), 1, 3),
    ("conv (2,24,2,2) per-channel dim 1", (2, 24, 2, 2), 1, 24),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _timer(device: torch.device, warmup: int, repeat: int):
    def run(fn) -> tuple[float, float | None]:
        """(median seconds per call, seconds of GPU kernels per call or None on CPU).

        The first is the op's latency: CUDA events around one call, host dispatch included
        (for a custom op on a small tensor the GPU waits on the host, so this is not the
        kernels' speed). The second sums the durations of the kernels the calls launched,
        from torch.profiler: the GPU time a GPU-bound training step spends on the op."""
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
            # (fewer calls: a profiled call's kernel durations do not vary like host-bound latency)
            return statistics.median(times), _kernel_seconds(fn, min(repeat, 20))
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), None

    return run


def _kernel_seconds(fn, repeat: int) -> float | None:
    """Seconds of GPU kernels per call of ``fn``: every kernel is attached to the host op that
    launched it (``FunctionEvent.kernels``), so their durations sum once each; gaps between
    launches are not counted. None when the profiler saw no kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    us = sum(k.duration for ev in prof.events() for k in ev.kernels)
    return us / 1e6 / repeat if us > 0 else None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def _layer_norm_rows(x, state, dim, G, label):
    """A LayerNorm's compression of ``x_hat`` (token layout; DESIGN.md, "LayerNorm's x_hat inside
    the kernels"): ``observe_rows + quantize`` given the row mean and rstd (``x`` read twice,
    ``x_hat`` never written on CUDA), against the former path that first wrote ``x_hat`` with a
    second ``native_layer_norm`` (read ``x``, write ``x_hat`` in ``x``'s dtype, read it twice).
    Rows: (name, bytes read + written, fn)."""
    n, es = x.numel(), x.element_size()
    _, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)
    mean, rstd = mean.float(), rstd.float()

    def fused():
        a, b, s, k = torch.ops.mesa.observe_rows(x, *state, dim, G, 0.9, False, False, 1, 64, mean, rstd)
        return torch.ops.mesa.quantize(x, a, b, dim, G, True, s, k, mean, rstd)

    def before():
        x_hat = torch.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)[0]
        a, b, s, k = torch.ops.mesa.observe_rows(x_hat, *state, dim, G, 0.9, False, False, 1, 64)
        return torch.ops.mesa.quantize(x_hat, a, b, dim, G, True, s, k)

    a, b, s, k = torch.ops.mesa.observe_rows(x, *state, dim, G, 0.9, False, False, 1, 64, mean, rstd)
    q = torch.ops.mesa.quantize(x, a, b, dim, G, True, s, k, mean, rstd)
    g = torch.randn_like(x, dtype=torch.float32)
    w = torch.ones(x.shape[-1], device=x.device)
    shape = [x.shape[-1]]

    def backward():  # dequantize x - mean (row_mul 1 / rstd), ATen's backward with the real rstd
        xs = torch.ops.mesa.dequantize(q, a, b, dim, G, torch.float32, k, torch.reciprocal(rstd))
        return torch.ops.aten.native_layer_norm_backward(g, xs, shape, torch.zeros_like(rstd), rstd, w, w,
                                                         [True, True, True])

    def backward_before():  # dequantize x_hat, ATen's backward with rstd 1, then dx * rstd
        xh = torch.ops.mesa.dequantize(q, a, b, dim, G, torch.float32, k)
        unit = torch.ones_like(rstd)
        dx = torch.ops.aten.native_layer_norm_backward(g, xh, shape, torch.zeros_like(rstd), unit, w, w,
                                                       [True, True, True])[0]
        return dx * rstd

    return [(f"forward LayerNorm x_hat{label}: observe_rows + quantize with row_mean / row_rstd", 2 * n * es + n,
             fused),
            (f"forward LayerNorm x_hat{label}, before: native_layer_norm + observe_rows + quantize",
             4 * n * es + n, before),
            # float32 gradient and dx (autocast's LayerNorm): codes and g in, dx out (DESIGN.md,
            # "LayerNorm backward from the codes"); the former forms also write and read x_hat
            (f"backward LayerNorm{label}: layer_norm_backward", n + 2 * 4 * n,
             lambda: torch.ops.mesa.layer_norm_backward(g, q, a, b, G, rstd, w, k)),
            (f"backward LayerNorm{label}, before: dequantize with row_mul + native_layer_norm_backward",
             n + 4 * 4 * n, backward),
            (f"backward LayerNorm{label}, first form: dequantize + native_layer_norm_backward + mul",
             n + 6 * 4 * n, backward_before)]


def _rebuild_rows(q, alpha, beta, k, dim, G, dtype):
    """LayerNorm + Linear's backward rebuilds the Linear's input x_hat * gamma + beta (float32,
    then the Linear's dtype) from the norm's codes: dequantize's column epilogue in one pass,
    against the former dequantize to float32, multiply, add and cast."""
    n, es = q.numel(), torch.finfo(dtype).bits // 8
    C = q.shape[-1]
    gamma = torch.randn(C, device=q.device)
    shift = torch.randn(C, device=q.device)

    def before():
        y = torch.ops.mesa.dequantize(q, alpha, beta, dim, G, torch.float32, k)
        return (y * gamma + shift).to(dtype)

    return [("backward LayerNorm + Linear rebuild: dequantize with col_scale / col_shift", n + n * es,
             lambda: torch.ops.mesa.dequantize(q, alpha, beta, dim, G, dtype, k, None, gamma, shift)),
            ("backward LayerNorm + Linear rebuild, before: dequantize (float32) + mul + add + cast",
             n + 4 * n + 4 * (4 * n) + 4 * n + n * es, before)]


def _gelu_linear_rows(q, alpha, beta, k, dim, G, g):
    """GELU + fc2's backward from h's codes (row scales, as fc2's input): fc2's input gelu(h)
    and the GELU's gradient from one op reading the codes once, against the two ops that each
    read them and the former dequantize, gelu and gelu_backward (h written once, read twice)."""
    n, es = q.numel(), g.element_size()

    def fused():
        return (torch.ops.mesa.dequantize_gelu(q, alpha, beta, dim, G, g.dtype, k),
                torch.ops.mesa.gelu_backward(g, q, alpha, beta, dim, G, k))

    def before():
        hh = torch.ops.mesa.dequantize(q, alpha, beta, dim, G, g.dtype, k)
        return torch.nn.functional.gelu(hh), torch.ops.aten.gelu_backward(g, hh)

    return [("backward GELU + Linear: gelu_value_and_grad (row scales)", n + 3 * n * es,
             lambda: torch.ops.mesa.gelu_value_and_grad(g, q, alpha, beta, dim, G, k)),
            ("backward GELU + Linear, two ops: dequantize_gelu + gelu_backward (row scales)",
             (n + n * es) + (n + 2 * n * es), fused),
            ("backward GELU + Linear, before: dequantize + gelu + gelu_backward", (n + n * es) + 2 * n * es
             + 3 * n * es, before)]


def _softmax_rows(x, state, dim, G, dtype):
    """A softmax's backward from the codes of its output (the attention map): the one-pass
    ``mesa::softmax_backward`` (codes and g read, gx written) against dequantize then ATen's
    ``_softmax_backward_data`` (the map written once and read again)."""
    p = x.float().softmax(-1).to(dtype)  # a real map: rows of probabilities
    a, b, s = torch.ops.mesa.observe(p, *state, dim, G, 0.9, False, False)
    q = torch.ops.mesa.quantize(p, a, b, dim, G, True, s)
    g = torch.randn_like(p)
    n, es = p.numel(), p.element_size()

    def before():
        y = torch.ops.mesa.dequantize(q, a, b, dim, G, dtype)
        return torch.ops.aten._softmax_backward_data(g, y, -1, dtype)

    return [("backward softmax: softmax_backward", n + 2 * n * es,
             lambda: torch.ops.mesa.softmax_backward(g, q, a, b, dim, G)),
            ("backward softmax, before: dequantize + _softmax_backward_data", (n + n * es) + 3 * n * es, before)]


def _case_ops(device: torch.device, name: str, shape, dim: int, G: int, dtype) -> tuple[torch.Tensor, list]:
    """(x, [(name, bytes read + written, fn)]) of one case: clone (the baseline), the
    compression ops and, by layout, the row-scale, LayerNorm, GELU and softmax ops."""
    x = torch.randn(shape, device=device).to(dtype)
    strided = len(shape) == 5  # (B, N, 3, H, E): q as timm's attention unbinds it
    if strided:
        x = x.permute(2, 0, 3, 1, 4)[0]
    state = [torch.zeros(G, device=device), torch.zeros(G, device=device),
             torch.zeros((), dtype=torch.bool, device=device), Q.rng_state(0, device=device)]
    alpha, beta, seed = torch.ops.mesa.observe(x, *state, dim, G, 0.9, False, False)
    q = torch.ops.mesa.quantize(x, alpha, beta, dim, G, True, seed)
    ops = _compression_ops(x, q, alpha, beta, seed, state, dim, G, dtype, strided)
    if dim in (-1, x.dim() - 1):  # Linear / LayerNorm inputs: power-of-two row scales in the kernels
        ops += _row_scale_ops(x, q, alpha, beta, state, dim, G, dtype)
    if name.startswith("attn"):  # the attention map: its softmax's backward
        ops += _softmax_rows(x, state, dim, G, dtype)
    return x, ops


def _selected(name: str, ops_pattern: str | None) -> bool:
    return ops_pattern is None or re.search(ops_pattern, name) is not None


def _reference_verdict(fn) -> str:
    """``fn`` called once more, untimed, each mesa:: op it calls checked against the reference
    on the same inputs (``reference_check``): the table's "reference" cell ("–": no mesa:: op)."""
    with ReferenceCheck() as check:
        fn()
    return check.verdict() or "–"


def run_benchmark(device: torch.device, cases, dtypes, warmup: int, repeat: int,
                  ops_pattern: str | None = None, check: bool = True) -> list[dict]:
    """The table's rows: every op of every case and dtype (``ops_pattern``: only the ops whose
    name it matches, and clone, the baseline); ``check``: each row's ops also checked against
    the reference (its "reference" cell; else "not checked")."""
    timeit = _timer(device, warmup, repeat)
    rows = []
    for name, shape, dim, G in cases:
        for dname in dtypes:
            x, ops = _case_ops(device, name, shape, dim, G, DTYPES[dname])
            n, es = x.numel(), x.element_size()
            t_clone, k_clone = timeit(lambda: x.clone())
            for op, nbytes, fn in ops:
                if not (op.startswith("clone") or _selected(op, ops_pattern)):
                    continue
                t, kt = (t_clone, k_clone) if op.startswith("clone") else timeit(fn)
                verdict = "–" if op.startswith("clone") else _reference_verdict(fn) if check else "not checked"
                # bandwidth from the kernels' time where measured (GPU), else from the latency
                base, tt = (k_clone, kt) if kt is not None and k_clone is not None else (t_clone, t)
                rows.append(dict(case=name, dtype=dname, op=op, us=t * 1e6,
                                 kernel_us=None if kt is None else kt * 1e6, gbps=nbytes / tt / 1e9,
                                 frac=(nbytes / tt) / (2 * n * es / base), vs_clone=tt / base,
                                 reference=verdict))
            x = ops = None  # (freed before the next case's tensors are made)
    return rows


def launch_once(device: torch.device, cases, dtypes, ops_pattern: str | None = None) -> list[str]:
    """Each selected op called once, nothing timed: the launches a hardware-counter profiler
    (scripts/ncu_kernels.py) replays. (torch.profiler, which the timing uses, and ncu both take
    the GPU's profiling interface.) Returns "case | dtype | op" of each call, in order."""
    called = []
    for name, shape, dim, G in cases:
        for dname in dtypes:
            _, ops = _case_ops(device, name, shape, dim, G, DTYPES[dname])
            for op, _, fn in ops:
                if _selected(op, ops_pattern):
                    fn()
                    called.append(f"{name} | {dname} | {op}")
            if device.type == "cuda":
                torch.cuda.synchronize()
            ops = None  # (the case's tensors freed before the next case's are made)
    return called


def _compression_ops(x, q, alpha, beta, seed, state, dim: int, G: int, dtype, strided: bool) -> list:
    """[(name, bytes read + written, fn)]: clone, each compression op and its backward's
    dequantize; for a strided q, the contiguous copy it started with before."""
    n, es = x.numel(), x.element_size()

    def observe():
        return torch.ops.mesa.observe(x, *state, dim, G, 0.9, False, False)

    def compress():
        a, b, s = observe()
        return torch.ops.mesa.quantize(x, a, b, dim, G, True, s)

    ops = [
        ("clone (baseline)", 2 * n * es, lambda: x.clone()),
        ("forward: observe + quantize", 2 * n * es + n, compress),
        ("observe", n * es, observe),
        ("quantize (stochastic)", n * es + n, lambda: torch.ops.mesa.quantize(x, alpha, beta, dim, G, True, seed)),
        ("quantize (nearest)", n * es + n, lambda: torch.ops.mesa.quantize(x, alpha, beta, dim, G, False, seed)),
        ("backward: dequantize", n + n * es, lambda: torch.ops.mesa.dequantize(q, alpha, beta, dim, G, dtype)),
    ]
    if strided:  # the copy every compression of q, k, v started with before they were read in place
        def compress_copy():
            xc = x.contiguous()
            a, b, s = torch.ops.mesa.observe(xc, *state, dim, G, 0.9, False, False)
            return torch.ops.mesa.quantize(xc, a, b, dim, G, True, s)

        ops.append(("forward, before: contiguous copy + observe + quantize", 4 * n * es + n, compress_copy))
    # estimator=delayed: one pass (initialized estimates: quantize with them, reduce for the next)
    ops.append(("forward delayed: quantize_observe", n * es + n,
                lambda: torch.ops.mesa.quantize_observe(x, *state, dim, G, 0.9, False, True)))
    # (nearest: whether the one-pass kernel's time is the rounding hash's compute; the
    # delayed estimator ran slower than observe + quantize on the H200)
    ops.append(("forward delayed: quantize_observe (nearest)", n * es + n,
                lambda: torch.ops.mesa.quantize_observe(x, *state, dim, G, 0.9, False, False)))
    return ops


def _row_scale_ops(x, q, alpha, beta, state, dim: int, G: int, dtype) -> list:
    """The ops of a Linear / LayerNorm input (groups over the last dim): row scales, the GELU
    and LayerNorm backwards from codes, the rebuilds of the shared copies."""
    n, es = x.numel(), x.element_size()
    k = torch.ops.mesa.row_exponents(x, 1, 64)

    def compress_rows_three_ops():  # (the layers' path before observe_rows: x read three times)
        kr = torch.ops.mesa.row_exponents(x, 1, 64)
        a, b, s = torch.ops.mesa.observe(x, *state, dim, G, 0.9, False, False, kr)
        return torch.ops.mesa.quantize(x, a, b, dim, G, True, s, kr)

    def observe_rows():
        return torch.ops.mesa.observe_rows(x, *state, dim, G, 0.9, False, False, 1, 64)

    def compress_rows():  # the layers' path (mesa::compress with row scales)
        a, b, s, kr = observe_rows()
        return torch.ops.mesa.quantize(x, a, b, dim, G, True, s, kr)

    g = torch.randn_like(x)
    ops = [  # a GELU's backward from its codes: one pass, or dequantize then ATen's
        ("backward GELU: gelu_backward", n + 2 * n * es,
         lambda: torch.ops.mesa.gelu_backward(g, q, alpha, beta, dim, G)),
        ("backward GELU, before: dequantize + gelu_backward", n + 4 * n * es,
         lambda: torch.ops.aten.gelu_backward(g, torch.ops.mesa.dequantize(q, alpha, beta, dim, G, dtype))),
    ]
    ops += _rebuild_rows(q, alpha, beta, k, dim, G, dtype)
    ops += _gelu_linear_rows(q, alpha, beta, k, dim, G, g)
    if x.shape[-1] <= LN_MAX_COLS:  # (wider rows are no LayerNorm's: the op refuses them)
        ops += _layer_norm_rows(x, state, dim, G, "")
        if dtype != torch.float32:  # under autocast a LayerNorm's input is the float32 residual stream
            ops += _layer_norm_rows(x.float(), state, dim, G, " (float32 input, as under autocast)")
    ops += [
        ("row_exponents", n * es, lambda: torch.ops.mesa.row_exponents(x, 1, 64)),
        ("observe_rows", n * es, observe_rows),
        ("forward with row scales: observe_rows + quantize", 2 * n * es + n, compress_rows),
        ("forward with row scales, before: row_exponents + observe + quantize", 3 * n * es + n,
         compress_rows_three_ops),
        ("backward with row scales: dequantize", n + n * es,
         lambda: torch.ops.mesa.dequantize(q, alpha, beta, dim, G, dtype, k)),
    ]
    return ops


def reference_summary(rows: list[dict]) -> str:
    """One line: how many rows' ops matched the reference, and which did not."""
    checked = [r for r in rows if r.get("reference") not in (None, "–", "not checked")]
    bad = [f"{r['case']} | {r['dtype']} | {r['op']}" for r in checked if r["reference"].startswith("MISMATCH")]
    loose = sum(1 for r in checked if r["reference"].startswith("<="))
    line = (f"reference: {len(checked) - len(bad) - loose} rows equal bit for bit, {loose} within the GELU ops' "
            f"ulp bound, {len(bad)} MISMATCH")
    return line + (": " + "; ".join(bad) if bad else "")


def format_table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| case | dtype | op | latency (us) | kernel time (us) | GB/s | fraction of clone bandwidth | "
        "time / clone | reference |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        kernel = "–" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['op']} | {r['us']:.1f} | {kernel} | {r['gbps']:.1f} | "
            f"{r['frac']:.2f} | {r['vs_clone']:.2f} | {r.get('reference', 'not checked')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when visible")
    p.add_argument("--dtypes", default="bf16", help="comma-separated subset of fp32,fp16,bf16")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--out-dir", default=os.path.join("results", "kernels"))
    p.add_argument("--cases", default=None, help="regex: only the cases whose name it matches (e.g. 'hidden')")
    p.add_argument("--ops", default=None, help="regex: only the ops whose name it matches (and clone, the baseline)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the reference check of each row's ops (an older build's codes, e.g. kernels-base)")
    p.add_argument("--launch-only", action="store_true",
                   help="call each selected op once, time nothing, write no table (for ncu: scripts/ncu_kernels.py)")
    p.add_argument("--grid", choices=GRID_POLICIES, default=None,
                   help="grid of the CUDA quantize / dequantize launches (MESA_CUDA_GRID, read once a process; "
                        "default: each launch's own, quantize resident and dequantize capped); the table goes to "
                        "<device>.grid-<policy>.md")
    p.add_argument("--variant", default=None,
                   help="name of the extension build being timed (letters, digits, '.', '_', '-'; e.g. base-42cbf3f "
                        "for an older build loaded in its place, scripts/gpu_session.sh step kernels-base); the table "
                        "says it and goes to <device>.<variant>.md (scripts/compare_kernel_tables.py sets two side "
                        "by side)")
    args = p.parse_args(argv)
    if args.variant is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.variant):
        p.error(f"--variant {args.variant!r}: letters, digits, '.', '_' and '-' only (it names the table's file)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here; valid: cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grid = args.grid or os.environ.get("MESA_CUDA_GRID")
    if grid and device.type != "cuda":
        p.error(f"--grid / MESA_CUDA_GRID={grid} sets the CUDA kernels' grid; this run is on {device.type}")
    if args.grid is not None:
        # (before the first launch: the extension reads it once a process)
        os.environ["MESA_CUDA_GRID"] = args.grid
    if device.type == "cuda":
        cases, warmup, repeat = GPU_CASES, 10, 50
    else:
        cases, warmup, repeat = CPU_CASES, 2, 5
    if args.quick:
        cases, warmup, repeat = QUICK_CASES, 1, 3
    warmup = args.warmup if args.warmup is not None else warmup
    repeat = args.repeat if args.repeat is not None else repeat
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    for flag, pattern in (("--cases", args.cases), ("--ops", args.ops)):
        try:
            re.compile(pattern or "")
        except re.error as e:
            p.error(f"{flag} {pattern!r} is not a regular expression: {e}")
    if args.cases is not None:
        names = [c[0] for c in cases]
        cases = [c for c in cases if re.search(args.cases, c[0])]
        if not cases:
            p.error(f"--cases {args.cases!r} matches no case; cases: {names}")

    if args.launch_only:
        called = launch_once(device, cases, dtypes, args.ops)
        if not called:
            p.error(f"--ops {args.ops!r} matches no op of the selected cases")
        print("\n".join(f"launched {c}" for c in called))
        return ""

    name = device_name(device)
    rows = run_benchmark(device, cases, dtypes, warmup, repeat, args.ops, check=not args.no_check)
    header = (
        f"# mesa quantization kernels on {name}" + (f", grid policy `{grid}`" if grid else "")
        + (f", extension `{args.variant}`" if args.variant else "") + "\n\n"
        f"torch {torch.__version__}, backend `{Q.BACKEND}`, "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. "
        "Latency: CUDA events around one call, median (host dispatch included: for a small tensor the GPU "
        "waits on the host). Kernel time: the durations of the kernels the op launched, per call, from "
        "torch.profiler (launch gaps excluded; what a GPU-bound training step spends). "
        "Bandwidth = (bytes read + bytes written) / kernel time (latency where no kernel time: CPU); "
        "'fraction of clone bandwidth' divides it by the bandwidth of `x.clone()` measured the same way in "
        "the same run; 'time / clone' is the time over clone's. "
        + ("Reference: each row's mesa:: ops called once more, untimed, and their outputs and updated state "
           "compared with the pure-PyTorch reference run on the same inputs and device "
           "(mesa_train.quant.reference_check): 'equal' bit for bit, '<= n ulp' within the GELU ops' bound, "
           "else MISMATCH and how far." if not args.no_check else "Reference: not checked (--no-check).")
    )
    table = format_table(rows, header)
    print(table)
    if not args.no_check:
        print(reference_summary(rows))
    if args.cases is not None or args.ops is not None:  # (the file is the whole table, not a subset)
        print("a subset (--cases / --ops): printed, not written")
        return table
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, _slug(name) + (f".grid-{grid}" if grid else "")
                        + (f".{args.variant}" if args.variant else "") + ".md")
    with open(path, "w") as f:
        f.write(table)
    print(f"written to {path}")
    return table


if __name__ == "__main__":
    main()
