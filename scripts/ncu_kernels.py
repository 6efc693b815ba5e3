"""Hardware counters of the Mesa kernels that hold a DeiT-S step's Mesa GPU time, by Nsight
Compute (ncu), on their DeiT-S shapes (bf16, batch 128): why each runs below the copy
bandwidth (memory throughput, occupancy, what its warps stall on), where the kernel table
(``python -m mesa_train.quant.benchmark``) says only how long.

Why: on the H200 (2026-11-29, ``results/host/nvidia-h200.profile.md``) the mesa:: kernels took
10.1 of a CUDA-graph step's 29.8 ms of GPU time, and the slowest of them for their bytes was
observe_rows' row pass (``row_cells_kernel``: 63 us for the 77 MB of the MLP's hidden, about a
quarter of the copy bandwidth), whose time follows the rows, not the bytes (28 and 25 us for
the 39 and 19 MB of the token layout's float32 and bf16 rows); a change of its machine code
made without counters (session 18) moved it by nothing (session 37 replaced it on the layers'
layouts by ``row_cells_flat_kernel``, still without counters: this report says whether that
did). One ncu run of the kernel table's ops,
each called once (``--launch-only``), only the kernels below profiled:

    python scripts/ncu_kernels.py                       # on the GPU machine: results/ncu/<device>.md
    python scripts/ncu_kernels.py --ops '^observe_rows$' --cases hidden
    python scripts/ncu_kernels.py --dry-run             # the ncu command, anywhere

The report is ncu's text (its sections as it prints them) in a code block under a header with
the device, versions and command. ncu needs the GPU's performance counters: where the machine
refuses them (KINDS.md of the device tool: gVisor machines did) the report says so and the
script exits 1.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The ops of the kernel table (mesa_train/quant/benchmark.py) whose kernels held the most Mesa
# GPU time a DeiT-S step on the H200, each on the layouts it runs on there
OPS = (r"^(observe_rows|observe|quantize \(stochastic\)|backward: dequantize|backward softmax: softmax_backward"
       r"|backward LayerNorm: layer_norm_backward|backward GELU \+ Linear: gelu_value_and_grad \(row scales\)"
       r"|backward LayerNorm \+ Linear rebuild: dequantize with col_scale / col_shift)$")
CASES = r"^(tokens|hidden|attn)"
# the extension's kernels by function name (ncu's "function" base: no parameters or template
# arguments; unanchored, whether or not it keeps the namespace); row_cells_flat_kernel holds
# observe_rows' whole work on the layers' layouts (its last block the mean, k and the totals)
KERNELS = (r"regex:(row_cells_flat_kernel|row_cells_kernel|row_absmax_kernel|row_finish_grid_kernel|observe_kernel"
           r"|quantize_kernel"
           r"|dequantize_kernel|softmax_backward_kernel|layer_norm_backward_kernel)")
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats")


def find_ncu(given: str | None) -> str | None:
    if given:
        return given if os.access(given, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    # (the GPU image's Nsight Compute lives under /opt without being on PATH)
    for pattern in ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, python: str, ops: str, cases: str) -> list[str]:
    # --clock-control none: the clocks as the benchmarks ran them (ncu locks them to base by default)
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name-base", "function",
           "--kernel-name", KERNELS]
    for section in SECTIONS:
        cmd += ["--section", section]
    return cmd + [python, "-m", "mesa_train.quant.benchmark", "--launch-only", "--cases", cases, "--ops", ops]


# A profiled launch's first line in ncu's text: "  NAME (grid)x(block), Context 1, Stream 7, ..."
LAUNCH = re.compile(r"^\s*(?P<name>\S.*?) \((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\)", re.M)
# a section table's row: name, unit (none for some), value
METRIC = re.compile(r"^\s+(?P<name>[A-Za-z][^\n]*?)\s{2,}(?:(?P<unit>[^\s\d][^\s]*)\s+)?"
                    r"(?P<value>[\d,]+(?:\.\d+)?)\s*$", re.M)
# the Warp State Statistics rule's sentence on the largest stall (wrapped over lines in the text)
STALL = re.compile(r"spends ([\d.]+) cycles being stalled (.+?)\.\s.*?This stall type represents about ([\d.]+)%",
                   re.S)
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
# the summary's columns: ncu's metric names in its sections' tables
COLUMNS = ("Memory Throughput", "DRAM Throughput", "Achieved Occupancy", "Theoretical Occupancy",
           "Registers Per Thread", "Warp Cycles Per Issued Instruction")


def short_name(name: str) -> str:
    """A kernel's name without return type, namespaces and parameter list (its template
    arguments kept: they tell the instantiations apart)."""
    # (the anonymous namespace as the test's text spells it, and as the H200's ncu printed it on
    # 2026-12-04: "unnamed>::", its "<" lost, which left the brackets unbalanced)
    name = re.sub(r"^void ", "", name.strip())
    for prefix in ("mesa::(anonymous namespace)::", "(anonymous namespace)::", "<unnamed>::", "unnamed>::", "mesa::"):
        name = name.replace(prefix, "")
    depth = 0
    for i, ch in enumerate(name):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def summarize(output: str) -> list[dict]:
    """One dict per profiled launch of ncu's text output: name, grid, block, duration (us), the
    COLUMNS' values, and the largest stall (its reason and share of the cycles between issues)."""
    starts = list(LAUNCH.finditer(output))
    rows = []
    for m, nxt in zip(starts, starts[1:] + [None]):
        text = output[m.end():nxt.start() if nxt else len(output)]
        row = {"kernel": short_name(m.group("name")), "grid": m.group("grid"), "block": m.group("block")}
        for metric in METRIC.finditer(text):
            name, unit, value = metric.group("name").strip(), metric.group("unit"), metric.group("value")
            number = float(value.replace(",", ""))
            if name == "Duration" and unit in TO_US:
                row.setdefault("duration_us", number * TO_US[unit])
            elif name in COLUMNS:
                row.setdefault(name, number)
        stall = STALL.search(text)
        if stall:
            why = " ".join(stall.group(2).split())
            row["stall"] = f"{why[:70]} ({stall.group(3)}%)"
        rows.append(row)
    return rows


def summary_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["No profiled launch was found in ncu's output (below): its format or the run failed."]
    head = ("| # | kernel | grid x block | us | memory % | DRAM % | occupancy achieved / theoretical % "
            "| registers | cycles per issue | largest stall (share of cycles) |")
    lines = [head, "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def num(row, key, fmt="{:.1f}"):
        return fmt.format(row[key]) if key in row else "–"

    for i, r in enumerate(rows, 1):
        occupancy = f"{num(r, 'Achieved Occupancy')} / {num(r, 'Theoretical Occupancy')}"
        lines.append(f"| {i} | `{r['kernel']}` | ({r['grid']}) x ({r['block']}) | {num(r, 'duration_us')} "
                     f"| {num(r, 'Memory Throughput')} | {num(r, 'DRAM Throughput')} | {occupancy} "
                     f"| {num(r, 'Registers Per Thread', '{:.0f}')} "
                     f"| {num(r, 'Warp Cycles Per Issued Instruction')} | {r.get('stall', '–')} |")
    return lines


def report(device: str, versions: str, cmd: list[str], output: str, rc: int) -> str:
    rows = summarize(output)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = f"{len(rows)} kernel launches profiled" if rc == 0 else f"**ncu exited {rc}**: the report below says why"
    return "\n".join([
        f"# Nsight Compute: the Mesa kernels of a DeiT-S step on {device}",
        "",
        f"- Date: {when}; {versions}",
        f"- Command: `{shlex.join(cmd)}` (scripts/ncu_kernels.py)",
        f"- {status}. Each op of the kernel table called once on its DeiT-S shape (bf16, batch 128); "
        "the case and op of each call are the `launched ...` lines at the end of ncu's output, in launch "
        "order (an op launches one to three of these kernels; each case first makes its codes with one "
        "observe and one quantize).",
        "",
        "## Summary (from ncu's sections below)",
        "",
        *summary_table(rows),
        "",
        "## ncu's output",
        "",
        "```",
        output.rstrip(),
        "```",
        "",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=OPS, help="regex over the kernel table's op names")
    p.add_argument("--cases", default=CASES, help="regex over its case names (tokens, hidden, attn, q of qkv)")
    p.add_argument("--ncu", default=None, help="the ncu executable (default: on PATH, else /opt/nvidia/nsight-compute)")
    p.add_argument("--out-dir", default=str(REPO / "results" / "ncu"))
    p.add_argument("--variant", default=None,
                   help="a name for the report beside the default one: <device>.<variant>.md (e.g. row-finish-grid)")
    p.add_argument("--dry-run", action="store_true", help="print the ncu command and exit")
    args = p.parse_args(argv)
    ncu = find_ncu(args.ncu)
    if ncu is None:
        where = f"--ncu {args.ncu} is not an executable" if args.ncu else "ncu is not on PATH nor under /opt/nvidia"
        p.error(f"Nsight Compute not found: {where}")
    cmd = ncu_command(ncu, sys.executable, args.ops, args.cases)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0

    import torch

    from mesa_train.bench.report import device_slug

    if not torch.cuda.is_available():
        p.error("no CUDA device visible: ncu profiles GPU kernels")
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = f".{args.variant}" if args.variant else ""
    path = out_dir / f"{device_slug(torch.device('cuda'))}{suffix}.md"  # (the bench's name for the device)
    rc, output = run_streaming(cmd)
    path.write_text(report(device, versions, cmd, output, rc))
    print(f"written to {path}")
    return 0 if rc == 0 else 1


def run_streaming(cmd: list[str]) -> tuple[int, str]:
    """(exit status, output) of cmd, its output printed line by line as it comes: a device call
    stopped at its limit (gpu_session.sh interrupts a step) keeps what was profiled, in its log
    and in the report (status 130 when interrupted)."""
    lines = []
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        return proc.wait(), "".join(lines)
    except KeyboardInterrupt:
        proc.terminate()
        lines.append("\n(interrupted: the kernels above were profiled)\n")
        return 130, "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
