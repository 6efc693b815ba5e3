"""Machine code of the Triton kernels Inductor generates for a block, without a GPU: registers,
occupancy, the instructions each thread runs, and whether an H100 would spend a kernel's time
on its bytes or on issuing its instructions (an estimate from the code, not a measurement).

Why: Inductor's kernel source says what a kernel loads and stores (``inductor_gpu_code.py``
counts the bytes); only its machine code says how much work each element costs and how many
registers a thread holds. Read this way (2026-11-27), the traced compression's fused kernels
run 67-78 instructions an element where a kernel moving their bytes at clone's rate may spend
about 50, and the two largest hold 128 and 166 registers a thread where stock's softmax holds
72: Inductor's persistent-reduction heuristic gives a row-wise kernel one warp and 32 elements
a thread, which fits a LayerNorm, not a softmax carrying a hash and a quantize per element.
This compiles each kernel of the census with Triton for sm_90 (Triton compiles without a GPU)
and reads the cubin with cuobjdump.

    python scripts/triton_sass.py                               # DeiT-S block, traced, batch 128
    python scripts/triton_sass.py --variant delayed --top 12
    python scripts/triton_sass.py --variant stock --kernels softmax --configs   # + other launch shapes
    python scripts/triton_sass.py --cache /tmp/k.json ...       # keep (or reuse) the captured kernels

Columns, per config Inductor lists for a kernel (the autotuner on a GPU times each and keeps
the fastest): how many times the block's graph launches the kernel (Inductor defines one kernel
per distinct source: two compressions of same-shaped operands share one); registers a thread;
resident warps per SM (64 at most; fewer than ~16 leaves a scheduler too few warps to hide
latency, which this estimate does not model); instructions a thread runs (straight-line code
once, each loop body, from a backward branch to its target, ``ceil(r0_numel / R0_BLOCK)``
times); the same per element; issue time = programs x warps x instructions a thread runs /
(132 SMs x 4 schedulers x 1.755 GHz), a floor; byte time = Inductor's ``kernel_num_gb`` at
2.6 TB/s (clone of a DeiT-S attention map on the H100,
``results/kernels/NVIDIA-H100-80GB-HBM3.md``); both times are a launch's. The last line sums
each graph's kernels, each times its launches, and the extension's ``mesa::`` ops beside them at
their tensors' bytes' time (a floor; matmuls are not counted), and the same with each launch
and op costing at least ``LAUNCH_FLOOR_US``. ``--configs``: each persistent reduction again
with XBLOCK 1-8 and 1-4 warps (what coordinate-descent tuning may reach). Needs Triton and
cuobjdump (Triton's wheel carries one); a traced block takes ~8 minutes to capture on 2 cores.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import math
import re
import sys
import tempfile
import types
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
# H100 SXM: SMs, warp schedulers per SM (one warp instruction each a cycle), sustained clock,
# and the copy bandwidth clone() reached there (module doc); per-SM limits for the occupancy
SMS, SCHEDULERS, CLOCK_HZ, BYTES_PER_S = 132, 4, 1.755e9, 2.6e12
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS, REG_UNIT = 65536, 228 * 1024, 64, 32, 256
# what a launch costs the GPU at least when the host runs ahead (no CUDA graph): its start and
# drain, a few microseconds; an assumed round figure, not measured here. Tiny kernels and
# Mesa's small ops (one float, a group's estimates) cost this rather than their bytes' time.
LAUNCH_FLOOR_US = 2.5
# an Inductor kernel's dims (its ``xnumel = ...`` lines) and the config key of each one's block
BLOCK_NAMES = {"x": "XBLOCK", "y": "YBLOCK", "r0_": "R0_BLOCK"}


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


@functools.cache
def _script(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- compiling
@functools.cache
def _kernel_dir() -> tempfile.TemporaryDirectory:
    """One folder for the kernel modules of this process, removed when it exits."""
    return tempfile.TemporaryDirectory(prefix="triton_sass_")


def load_autotuner(name: str, source: str):
    """The ``CachingAutotuner`` an Inductor kernel module defines (its JIT function, Triton
    signature and the configs Inductor would benchmark), loaded on the fake H100 (call inside
    ``inductor_gpu_code.fake_h100()``; selecting Triton's GPU driver would look for libcuda)."""
    from unittest import mock

    from torch._inductor.runtime import triton_helpers

    path = Path(_kernel_dir().name) / f"{name}.py"  # (@triton.jit reads its source from a file)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(triton_helpers, "set_driver_to_gpu", lambda: None):
        spec.loader.exec_module(module)
    tuner = getattr(module, name, None)
    if tuner is None or not hasattr(tuner, "configs"):
        fail(f"{name}: the module defines no autotuned kernel of that name")
    return tuner


def compile_config(tuner, config) -> tuple[bytes, int]:
    """(sm_90 cubin, dynamic shared memory bytes) of one config of an Inductor kernel: Triton's
    compiler with the signature, constants, argument attributes (16-byte divisibility: vector
    loads) and options Inductor's own precompile passes (its private helpers, so the code is
    the one a GPU run compiles)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    meta = tuner._create_compile_meta(config)
    src = ASTSource(tuner.fn, meta["signature"], meta["constants"], meta["configs"][0])
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=tuner._create_compile_options(config, meta))
    return compiled.asm["cubin"], int(getattr(compiled.metadata, "shared", 0) or 0)


# ----------------------------------------------------------------------------- reading SASS
def sass_with_addresses(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text) of the cubin's one kernel."""
    return [(int(m.group(1), 16), m.group(2))
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", _script("sass_audit").dump(cubin))]


def registers(cubin: bytes) -> int:
    found = re.search(r"REG:(\d+)", _script("sass_audit").dump(cubin, "-res-usage"))
    return int(found.group(1)) if found else 0


def executed_per_thread(code: list[tuple[int, str]], trips: int) -> int:
    """Instructions one thread runs: each instruction once, plus ``trips - 1`` more times for
    every instruction inside a loop (from a backward branch's target to the branch)."""
    step = (code[1][0] - code[0][0]) if len(code) > 1 else 16
    in_loop = set()
    for address, text in code:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:  # (the branch to itself after EXIT is no loop)
            in_loop.update(range(int(m.group(1), 16), address + step, step))
    useful = [a for a, t in code if not t.startswith("NOP")]
    return len(useful) + (trips - 1) * sum(a in in_loop for a in useful)


def warps_per_sm(regs: int, smem: int, warps: int) -> int:
    """Resident warps per SM for blocks of ``warps`` warps (H100 limits; registers are
    allocated per warp in units of 256)."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    blocks = min(SM_BLOCKS, SM_WARPS // warps, SM_REGISTERS // (per_warp * warps) if regs else SM_BLOCKS,
                 SM_SHARED // smem if smem else SM_BLOCKS)
    return blocks * warps


# ----------------------------------------------------------------------------- the estimate
def numel(source: str, name: str) -> int:
    m = re.search(rf"\b{name} = (\d+)\b", source)
    return int(m.group(1)) if m else 1


def config_row(tuner, config, sizes: dict[str, int], megabytes: float) -> dict:
    """One config's row (module doc, columns)."""
    cubin, smem = compile_config(tuner, config)
    blocks = {dim: config.kwargs.get(block) for dim, block in BLOCK_NAMES.items()}
    # programs tile x and y; a reduction's r0 is inside each program, looped where R0_BLOCK < r0_numel
    programs = math.prod(math.ceil(sizes[d] / (blocks[d] or sizes[d])) for d in ("x", "y"))
    trips = math.ceil(sizes["r0_"] / blocks["r0_"]) if blocks["r0_"] else 1
    per_thread = executed_per_thread(sass_with_addresses(cubin), trips)
    warp_instructions = programs * config.num_warps * per_thread
    regs = registers(cubin)
    return {"config": ", ".join(f"{k}={v}" for k, v in config.kwargs.items()) + f", warps={config.num_warps}",
            "registers": regs, "warps_per_sm": warps_per_sm(regs, smem, config.num_warps),
            "per_thread": per_thread, "per_element": warp_instructions * 32 / math.prod(sizes.values()),
            "issue_us": warp_instructions / (SMS * SCHEDULERS * CLOCK_HZ) * 1e6,
            "bytes_us": megabytes * 1e12 / BYTES_PER_S, "mb": megabytes}


def kernel_rows(name: str, source: str, megabytes: float, alternatives: bool = False) -> list[dict]:
    """A row per config Inductor lists for the kernel; ``alternatives``: a persistent reduction's
    other launch shapes too (XBLOCK 1-8, 1-4 warps), marked ``alternative``."""
    import triton

    tuner = load_autotuner(name, source)
    sizes = {dim: numel(source, f"{dim}numel") for dim in BLOCK_NAMES}
    configs = [(c, False) for c in tuner.configs]
    if alternatives and name.startswith("triton_per_"):  # (Inductor's prefix for a persistent reduction)
        listed = {(c.kwargs.get("XBLOCK"), c.num_warps) for c in tuner.configs}
        configs += [(triton.Config({"XBLOCK": x}, num_warps=w, num_stages=1), True)
                    for x in (1, 2, 4, 8) for w in (1, 2, 4) if (x, w) not in listed]
    return [{"kernel": name, "alternative": alt, **config_row(tuner, c, sizes, megabytes)} for c, alt in configs]


def census_kernels(variant: str, batch: int, attention: str, model: str,
                   cache: Path | None = None) -> tuple[list[tuple[str, str, str, float, int]],
                                                       list[tuple[str, str, float]]]:
    """``(kernels, ops)``: (graph part, kernel name, Triton source, MB a launch, launches) of every
    Triton kernel the census generates (Inductor defines a kernel once and may launch it several
    times: two compressions of same-shaped operands share one), and (graph part, op, MB) of each
    opaque ``mesa::`` op call beside them (minutes: a traced block compiles twice). ``cache``: a
    JSON file of both, read if it exists, else written, so the code can be read again without
    capturing."""
    if cache is not None and cache.exists():
        data = json.loads(cache.read_text())
        kernels = data.get("kernels", []) if isinstance(data, dict) else []
        if not isinstance(data, dict) or any(len(k) != 5 for k in kernels):
            fail(f"{cache} was written before kernels were counted by launch (or is not this script's cache): "
                 "delete it to capture again")
        return [tuple(k) for k in kernels], [tuple(o) for o in data["ops"]]
    gpu_code = _script("inductor_gpu_code")
    graphs, options = gpu_code.capture_block(model, variant, batch, True, attention)
    kernels, ops = [], []
    for graph in graphs:
        sources, mesa_ops, launches = gpu_code.lower_for_h100(graph, options)
        part = "backward" if graph.kwargs.get("is_backward") else "forward"
        calls = collections.Counter(launches)  # (in first-launch order)
        mb = {n: b for n, _, b in gpu_code.kernel_rows(sources, list(calls))}
        kernels += [(part, n, sources[n], mb[n], calls[n]) for n in calls]
        ops += [(part, name, b) for name, _, b in mesa_ops]
    if cache is not None:
        cache.write_text(json.dumps({"kernels": kernels, "ops": ops}))
    return kernels, ops


def ops_summary(ops: list[tuple[str, str, float]]) -> dict[str, tuple[int, float, float]]:
    """Per graph part, (calls, us, us with each call at least LAUNCH_FLOOR_US) of the extension's
    ops: their tensors' bytes at clone's rate, a floor (each op is one or two CUDA kernels)."""
    out: dict[str, tuple[int, float, float]] = {}
    for part, _, mb in ops:
        calls, us, padded = out.get(part, (0, 0.0, 0.0))
        t = mb * 1e12 / BYTES_PER_S
        out[part] = (calls + 1, us + t, padded + max(t, LAUNCH_FLOOR_US))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| part | kernel | launches | config | registers | warps / SM | instr / thread | instr / element "
             "| issue us | bytes us | bound |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    last = None
    for r in rows:
        first = r["kernel"] != last
        name, launches = (f"`{r['kernel']}`", str(r["launches"])) if first else ("", "")
        last = r["kernel"]
        bound = "issue" if r["issue_us"] > r["bytes_us"] else "bytes"
        config = r["config"] + (" (alternative)" if r["alternative"] else "")
        lines.append(f"| {r['part']} | {name} | {launches} | {config} | {r['registers']} | {r['warps_per_sm']} | "
                     f"{r['per_thread']} | {r['per_element']:.1f} | {r['issue_us']:.1f} | {r['bytes_us']:.1f} | "
                     f"{bound} |")
    return "\n".join(lines)


def totals(rows: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Per graph part, (launches, us, us with each launch at least LAUNCH_FLOOR_US): its kernels'
    launches, and the sum over kernels of their best listed config's larger time times their
    launches."""
    best: dict[tuple[str, str], tuple[int, float]] = {}
    for r in rows:
        if not r["alternative"]:
            key = (r["part"], r["kernel"])
            t = max(r["issue_us"], r["bytes_us"])
            best[key] = (r["launches"], min(best.get(key, (0, math.inf))[1], t))
    out: dict[str, tuple[int, float, float]] = {}
    for (part, _), (launches, t) in best.items():
        n, us, padded = out.get(part, (0, 0.0, 0.0))
        out[part] = (n + launches, us + t * launches, padded + max(t, LAUNCH_FLOOR_US) * launches)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_s")
    p.add_argument("--variant", default="traceable", choices=_script("inductor_gpu_code").VARIANTS)
    p.add_argument("--attention", default="explicit", choices=("explicit", "fused"))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--kernels", default="", help="a regex over kernel names")
    p.add_argument("--top", type=int, default=0, help="only the N kernels with the largest time")
    p.add_argument("--configs", action="store_true", help="persistent reductions: other launch shapes too")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    p.add_argument("--cache", type=Path,
                   help="a JSON file of the census's kernel sources: read if it exists, else written")
    args = p.parse_args(argv)
    if args.batch < 1:
        fail(f"--batch must be at least 1, got {args.batch}")
    try:
        pattern = re.compile(args.kernels)
    except re.error as e:
        fail(f"--kernels {args.kernels!r} is not a regular expression: {e}")
    gpu_code = _script("inductor_gpu_code")
    kernels, ops = census_kernels(args.variant, args.batch, args.attention, args.model, args.cache)
    kernels = [k for k in kernels if pattern.search(k[1])]
    if not kernels:
        fail(f"no kernel matches --kernels {args.kernels!r}")
    groups = []
    with gpu_code.fake_h100():  # (loading a kernel module asks torch.cuda about the device)
        for part, name, source, mb, launches in kernels:
            groups.append([{"part": part, "launches": launches, **r}
                           for r in kernel_rows(name, source, mb, args.configs)])
    # (largest first: a kernel's time is its best listed config's, times its launches)
    groups.sort(key=lambda g: -min(max(r["issue_us"], r["bytes_us"]) * r["launches"]
                                   for r in g if not r["alternative"]))
    if args.top:
        groups = groups[: args.top]
    rows = [r for g in groups for r in g]
    # (the extension ops belong to the whole block: left out where only some kernels are shown)
    whole = not args.kernels and not args.top
    text = table(rows) + "\n\n" + totals_line(totals(rows), ops_summary(ops) if whole else {})
    print(text, end="")
    if args.out is not None:
        write_markdown(args.out, args, list(argv if argv is not None else sys.argv[1:]), text)
    return 0


def totals_line(triton: dict[str, tuple[int, float, float]], op_parts: dict[str, tuple[int, float, float]]) -> str:
    parts = []
    for part in sorted(set(triton) | set(op_parts)):
        launches, us, padded = triton.get(part, (0, 0.0, 0.0))
        line = f"{part}: {us:.0f} us in {launches} Triton kernel launches"
        if part in op_parts:
            line += f" + {op_parts[part][1]:.0f} us in {op_parts[part][0]} extension ops"
            padded += op_parts[part][2]
        parts.append(line + f" ({padded:.0f} us with each launch at least {LAUNCH_FLOOR_US:g} us)")
    return "; ".join(parts) + (". Each kernel at its best listed config's larger time, times its launches; an op at"
                               " its bytes' time.\n")


def write_markdown(out: Path, args, given: list[str], text: str) -> None:
    """The table under a title and the command that makes it (local paths dropped)."""
    import torch
    import triton

    for flag in ("--cache", "--out"):  # (the command reads the same without them)
        if flag in given:
            del given[given.index(flag): given.index(flag) + 2]
    command = " ".join(["python scripts/triton_sass.py", *given])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# sm_90 machine code of Inductor's kernels: {args.model} block, {args.variant}, "
                   f"{args.attention} attention, batch {args.batch}\n\n`{command}` (torch {torch.__version__}"
                   f"{_script('inductor_gpu_code').backports_note()}, "
                   f"Triton {triton.__version__}; compiled and read without a GPU: estimates, see the script's "
                   "doc)\n\n" + text)


if __name__ == "__main__":
    sys.exit(main())
