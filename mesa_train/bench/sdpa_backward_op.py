"""Host time of the compiled fused attention's backward op, C++ kernel against Python kernel:
``python -m mesa_train.bench.sdpa_backward_op``.

``mesa::sdpa_recompute_backward`` (``mesa_train/nn/sdpa_backward.py``) is what a compiled
Mesa model's backward calls once per fused attention layer: autograd through the stock
``scaled_dot_product_attention`` made again. Its kernel is C++ in the extension
(``csrc/sdpa_autograd.cpp``, session 66) and Python without it. On the H200 (2026-12-04) the
Python kernel took 316-460 us of host time a call in the compiled fused DeiT-S row's profile,
12 calls a step, on a host-bound step.

This registers the Python kernel as a second op of the same schema (``mesa_pyref::``, so that
both calls pay the same dispatcher hop) and times the two in turn, call by call, on tiny CPU
tensors (the data costs next to nothing: host time), in the states a compiled backward calls
it (grad mode off; autocast off or bf16); median per call, median over rounds, ratio C++ /
Python, both in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mesa_train import quant
from mesa_train.bench.cli import check_output, positive_int
from mesa_train.bench.report import environment, print_and_save
from mesa_train.nn import sdpa_backward

_PY_NAMESPACE = "mesa_pyref"
_libs: list = []


def python_op():
    """The Python kernel as an op of its own (registered once a process)."""
    if not hasattr(getattr(torch.ops, _PY_NAMESPACE), sdpa_backward._OP_NAME):
        lib = torch.library.Library(_PY_NAMESPACE, "DEF")
        sdpa_backward.define_python_op(lib)
        _libs.append(lib)
    return getattr(getattr(torch.ops, _PY_NAMESPACE), sdpa_backward._OP_NAME).default


def cases() -> dict[str, tuple]:
    """{name: the op's arguments}: the shapes and states of the layers that call it."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 2, 4, 4) for _ in range(4))
    bias = torch.randn(1, 2, 4, 4)
    window = torch.where(torch.rand(2, 4, 4) > 0.3, 0.0, -100.0)
    qkv = [True, True, True, False]
    return {
        "q, k, v (DeiT, ViT)": (g, q, k, v, None, None, False, None, qkv, False, None),
        "q, k, v under bf16 autocast": (g, q, k, v, None, None, False, None, qkv, True, torch.bfloat16),
        "with a bias and its gradient (BEiT)": (g, q, k, v, bias, None, False, None, qkv[:3] + [True], False, None),
        "with a bias and windows (Swin)": (g, q, k, v, bias, window, False, None, qkv[:3] + [True], False, None),
    }


def _per_call_us(ops, args, reps: int) -> list[float]:
    """Median µs of one call of each op in ``ops``, timed in turn call by call (a drift of the
    machine's speed falls on both alike); grad mode off, as in a backward."""
    times: list[list[float]] = [[] for _ in ops]
    with torch.no_grad():
        for i in range(20 + reps):  # 20 warm-up calls
            for j, op in enumerate(ops):
                t0 = time.perf_counter()
                op(*args)
                if i >= 20:
                    times[j].append(time.perf_counter() - t0)
    return [1e6 * statistics.median(t) for t in times]


def compare(reps: int, rounds: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    ops = (torch.ops.mesa.sdpa_recompute_backward.default, python_op())
    for name, args in cases().items():  # same results first: the comparison is of equals
        for a, b in zip(ops[0](*args), ops[1](*args)):
            if not torch.equal(a, b):
                raise SystemExit(f"error: the C++ and Python kernels differ on '{name}'")
    samples: dict[str, list[list[float]]] = {}
    for _ in range(rounds):
        for name, args in cases().items():
            samples.setdefault(name, []).append(_per_call_us(ops, args, reps))
    return {name: {"cpp_us": statistics.median(r[0] for r in rows), "python_us": statistics.median(r[1] for r in rows)}
            for name, rows in samples.items()}


def markdown(table: dict, reps: int, rounds: int) -> str:
    env = environment(torch.device("cpu"))
    lines = [f"Device: {env['device']}; torch {env['torch']}; git {env['git']}; {env['date']}.", "",
             "| case | Python kernel µs | C++ kernel µs | C++ / Python |", "|---|---:|---:|---:|"]
    for name, r in table.items():
        lines.append(f"| {name} | {r['python_us']:.0f} | {r['cpp_us']:.0f} | {r['cpp_us'] / r['python_us']:.2f}x |")
    return "\n".join(lines) + (f"\n\nOne call of `mesa::sdpa_recompute_backward` (C++) and of its Python kernel "
                               f"(registered as `{_PY_NAMESPACE}::`), tensors (2, 2, 4, 4), 1 CPU thread, grad mode "
                               f"off; median of {reps} calls in turn, median over {rounds} rounds; the two kernels' "
                               "results checked equal first.\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=positive_int, default=2000, help="timed calls per case and round (default 2000)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    p.add_argument("--output", help="also write the Markdown table here")
    args = p.parse_args(argv)
    check_output(args.output)
    if quant.BACKEND != "extension":
        p.error(f"the compiled extension is not loaded ({quant.extension_error}): there is no C++ kernel to time")
    print_and_save(markdown(compare(args.reps, args.rounds), args.reps, args.rounds), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
