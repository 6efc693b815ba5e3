"""What Dynamo checks before each call of a compiled model, stock against Mesa: the guards of a
small ViT's compiled forward by kind, and the time of the cache lookup that evaluates them.

Why: on the H200 (2026-11-29, results/host/nvidia-h200.profile.md) a compiled Mesa DeiT-S step
spent 1.38 ms in `TorchDynamo Cache Lookup` against stock's 0.09, with default launches (host
time of a host-bound step) and under CUDA graphs alike (where it delays each step's first
replay). Session 34 removed the guards on the layers' options; what remains follows the model's
tensors: every quantizer's four state buffers (alpha and beta estimates, `initialized`, the
rounding counter `rng`) are inputs of the graph, each with its own tensor guard, and all of them
are checked against aliasing one another.

    PYTHONPATH=. python scripts/guard_census.py                  # 12 blocks: results/guards/cpu.md
    PYTHONPATH=. python scripts/guard_census.py --depth 2 --out -  # printed only

The model is the cpu-host preset's (configs/bench/preset/cpu-host.yaml, built as the bench builds
its rows): a ViT of width 48, 3 heads, explicit attention, 32x32 images, batch 2, patched with
every op (`ops=["all"]`), compiled with backend "eager" (the guards are Dynamo's, whatever the
backend). Guard kinds are counted in the printed guard tree (`TENSOR_MATCH` per tensor input,
`NO_TENSOR_ALIASING` once per tensor it covers, ...); the lookup time is the profiler's self CPU
time of `TorchDynamo Cache Lookup` per call (profiler overhead included, as in the GPU profiles).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import re
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.profiler import ProfilerActivity, profile

from mesa_train.bench.preset_model import preset_model
from mesa_train.nn.quantizer import ActivationQuantizer

REPO = Path(__file__).resolve().parent.parent
KINDS = ("TENSOR_MATCH", "NO_TENSOR_ALIASING", "OBJECT_ALIASING", "DICT_CONTAINS", "TYPE_MATCH", "ID_MATCH",
         "EQUALS_MATCH", "DIMENSION_DYNAMIC_MARKING_GUARD")


def build(depth: int, mesa: bool) -> torch.nn.Module:
    """The cpu-host preset's "Mesa compiled" (every op) or "stock compiled" row's model, ``depth`` blocks."""
    torch.manual_seed(0)
    return preset_model("cpu-host", "Mesa compiled" if mesa else "stock compiled", depth=depth)


def frame_locals(model: torch.nn.Module, x: torch.Tensor) -> dict:
    """The locals of the forward frame Dynamo compiled: self, x and the other arguments' defaults."""
    params = inspect.signature(type(model).forward).parameters
    values = {k: (p.default if p.default is not inspect.Parameter.empty else None) for k, p in params.items()}
    values.update(self=model, x=x)
    return values


def census(model: torch.nn.Module, calls: int = 20) -> dict:
    """Guard kinds of the compiled forward, its number of cache entries, the time of one
    evaluation of its guards (us, the guard manager called directly, as each call does) and the
    profiler's self CPU time of the cache lookup a call (ms)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 3, 32, 32)
    for _ in range(3):  # forward and backward, as a training step runs them
        compiled(x).sum().backward()
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    manager = entries[0].guard_manager
    tree = str(manager)
    kinds = collections.Counter(m.group(1) for m in re.finditer(r"\+- ([A-Z_]+)", tree))
    # the quantizers whose state the forward reads (a layer sharing another's copy leaves its own unused)
    tensor_guards = "\n".join(line for line in tree.splitlines() if "TENSOR_MATCH" in line)
    read = set(re.findall(r"(L\['self'\]\S*?)\._buffers\['alpha'\]", tensor_guards))
    values = frame_locals(model, x)
    verdict = manager.check_verbose(values)
    if not verdict.result:  # (the locals are not the frame's: the timing would be of a failing check)
        raise RuntimeError(f"the guards fail on this frame's locals: {verdict.verbose_code_parts}")
    start = time.perf_counter()
    for _ in range(200):
        manager.check(values)
    check_us = (time.perf_counter() - start) / 200 * 1e6
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            compiled(x)
    lookups = [e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
    lookup_ms = lookups[0].self_cpu_time_total / lookups[0].count / 1e3 if lookups else float("nan")
    return dict(graphs=len(entries), nodes=len(tree.splitlines()), kinds=kinds, check_us=check_us,
                lookup_ms=lookup_ms, quantizers_read=len(read))


def table(depth: int, rows: dict[str, dict], quantizers: int) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [
        f"# Dynamo's guards on a compiled {depth}-block ViT (width 48): stock and Mesa",
        "",
        f"{when}, torch {torch.__version__}, CPU; `python scripts/guard_census.py --depth {depth}`. Mesa: "
        f"`ops=[\"all\"]`, {quantizers} quantizers with 4 state buffers each. Counts are guards in the printed "
        "guard tree of the forward's cache entry (a relational guard such as `NO_TENSOR_ALIASING` once per "
        "tensor it covers). Check: one evaluation of the guards, the guard manager called on the frame's "
        "locals (mean of 200); profiled lookup: the profiler's self CPU time of `TorchDynamo Cache Lookup` "
        "a call, as the GPU profiles report it (the profiler's own cost included).",
        "",
        "| model | graphs | guard-tree lines | " + " | ".join(f"`{k}`" for k in KINDS)
        + " | check us | profiled lookup ms |",
        "|---|---:|---:|" + "---:|" * len(KINDS) + "---:|---:|",
    ]
    for name, r in rows.items():
        counts = " | ".join(str(r["kinds"].get(k, 0)) for k in KINDS)
        lines.append(f"| {name} | {r['graphs']} | {r['nodes']} | {counts} | {r['check_us']:.0f} "
                     f"| {r['lookup_ms']:.2f} |")
    extra = rows["Mesa"]["kinds"]["TENSOR_MATCH"] - rows["stock"]["kinds"]["TENSOR_MATCH"]
    read = rows["Mesa"]["quantizers_read"]
    lines += ["", f"Mesa's tensor guards beyond stock's: {extra}, {extra / max(read, 1):.1f} for each of the {read} "
              f"quantizers whose state the forward reads (of {quantizers}: a layer that shares another's copy "
              "leaves its own quantizer unused).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=12, help="blocks of the ViT (default 12, as cpu-host)")
    p.add_argument("--calls", type=int, default=20, help="profiled calls for the lookup time")
    p.add_argument("--out", default=str(REPO / "results" / "guards" / "cpu.md"), help="the table's file; - prints only")
    args = p.parse_args(argv)
    if args.depth < 1 or args.calls < 1:
        p.error("--depth and --calls must be at least 1")
    rows = {}
    quantizers = 0  # (the Mesa model's; stock has none)
    for name, mesa in (("stock", False), ("Mesa", True)):
        model = build(args.depth, mesa)
        quantizers += sum(isinstance(m, ActivationQuantizer) for m in model.modules())
        rows[name] = census(model, args.calls)
    text = table(args.depth, rows, quantizers)
    print(text)
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
