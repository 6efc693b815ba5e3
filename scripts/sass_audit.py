"""Machine-code audit of the CUDA kernels, without a GPU: registers, occupancy and how many
global loads each kernel keeps in flight, read from the sm_90 cubin nvcc builds here.

Why: three of the slowest kernels of the H100 profile had faults visible in their machine code
and nowhere else (found with cuobjdump, 2026-11-27): ``layer_norm_backward_kernel`` waited for
each column's loads in turn (2 loads in flight per lane, 74 us where its bytes take ~20),
dequantize's column epilogue issued 32 scalar loads per 16 elements, and ``row_cells_kernel``
called a 64-bit division routine twice per pass. A profiler says a kernel is slow; this says
why, and ``tests/test_sass_audit.py`` keeps the fixed kernels fixed.

    python scripts/sass_audit.py                                   # every kernel, sm_90
    python scripts/sass_audit.py --kernels 'layer_norm_backward'   # a regex over the names
    python scripts/sass_audit.py --baseline-rev 2e156b2            # and the same kernels there

Columns: registers and spilled bytes (ptxas), static shared memory, resident 256-thread blocks
per SM (H100: 64K registers, 228 KB of shared memory, 32 blocks), global loads (LDG) in the
code, and the most loads in flight: walking the instructions in order, a load is in flight
from its issue until the first instruction that reads its destination register (branches are
not followed: a lower bound on a loop body's, exact for straight-line code), the instructions
in the code (every path, the slow ones too) and how many of them are the conversion unit's
(F2I / I2F / F2F; not their packed forms). Needs nvcc and cuobjdump (on PATH, or the one
Triton's wheel carries); about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
SOURCE = Path("csrc/cuda/quant_cuda.cu")
# H100 (sm_90) per-SM limits for the occupancy column
SM_REGISTERS, SM_SHARED, SM_BLOCKS, REG_UNIT = 65536, 228 * 1024, 32, 256


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


@functools.cache
def _ptx_cost():
    """scripts/ptx_cost.py (its nvcc invocation, checkout and demangling), loaded once."""
    spec = importlib.util.spec_from_file_location("ptx_cost", REPO / "scripts" / "ptx_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    fail("cuobjdump not found (CUDA toolkit or Triton's wheel)")


def compile_cubin(arch: str, tree: Path = REPO) -> tuple[bytes, str]:
    """(cubin, ptxas's -v report) of ``tree``'s csrc/cuda/quant_cuda.cu with the extension's flags."""
    return _ptx_cost().run_nvcc(tree, arch, "cubin", ("-Xptxas", "-v"))


def ptxas_resources(report: str) -> dict[str, tuple[int, int, int]]:
    """{mangled kernel: (registers, spilled bytes, static shared bytes)} from ptxas -v."""
    out, name, spill = {}, None, 0
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name, spill = m.group(1), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            out[name] = (int(m.group(1)), spill, int(smem.group(1)) if smem else 0)
            name = None
    return out


def dump(cubin: bytes, flag: str = "-sass") -> str:
    """cuobjdump's ``flag`` output (``-sass``, ``-res-usage``) for a cubin held in memory."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([cuobjdump(), flag, str(path)], capture_output=True, text=True).stdout


def sass_by_kernel(cubin: bytes) -> dict[str, list[str]]:
    """{mangled kernel: its instructions (text, without addresses and encodings)}."""
    text = dump(cubin)
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m and current is not None:
            current.append(m.group(1))
    return out


def _operands(instruction: str) -> tuple[str, list[str]]:
    body = re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction)
    op, _, rest = body.partition(" ")
    return op, [t.strip() for t in rest.split(",")] if rest else []


def opcode(instruction: str) -> str:
    """An instruction's opcode with its modifiers (``LDG.E.128.CONSTANT``), predicate dropped."""
    return _operands(instruction)[0]


def loads_in_flight(instructions: list[str]) -> int:
    """The most global loads outstanding at once along the instruction stream (module doc)."""
    pending: dict[int, int] = {}  # destination register -> load number
    outstanding: set[int] = set()
    most = count = 0
    for ins in instructions:
        name, ops = _operands(ins)
        sources = ops[1:] if not name.startswith(("ST", "RED", "ATOM")) else ops
        read = {int(r) for op in sources for r in re.findall(r"\bR(\d+)\b", op)}
        done = {pending[r] for r in read if r in pending}
        if done:
            outstanding -= done
            pending = {r: n for r, n in pending.items() if n not in done}
        if name.startswith("LDG") and ops:
            dest = re.match(r"R(\d+)", ops[0])
            if dest:
                count += 1
                width = 4 if ".128" in name else 2 if ".64" in name else 1
                for k in range(width):
                    pending[int(dest.group(1)) + k] = count
                outstanding.add(count)
                most = max(most, len(outstanding))
    return most


def conversions(instructions: list[str]) -> int:
    """Instructions of the conversion unit (F2I, I2F, F2F: 16 results an SM a clock on sm_90,
    an eighth of the FP32 rate); their packed forms (F2IP, I2FP, F2FP) are not counted."""
    return sum(opcode(i).split(".")[0] in ("F2I", "I2F", "F2F") for i in instructions)


def blocks_per_sm(registers: int, smem: int, threads: int = 256) -> int:
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    by_regs = SM_REGISTERS // (per_warp * warps) if registers else SM_BLOCKS
    by_smem = SM_SHARED // smem if smem else SM_BLOCKS
    return min(by_regs, by_smem, SM_BLOCKS)


def audit(pattern: str = "", arch: str = "sm_90", tree: Path = REPO) -> list[dict]:
    """One row per kernel of ``tree`` whose demangled name matches ``pattern``."""
    cubin, report = compile_cubin(arch, tree)
    resources = ptxas_resources(report)
    code = sass_by_kernel(cubin)
    names = list(code)
    readable = _ptx_cost().readable_counts({n: n for n in names})
    rows = []
    for pretty, mangled in readable.items():
        if not re.search(pattern, pretty):
            continue
        regs, spill, smem = resources.get(mangled, (0, 0, 0))
        ins = code[mangled]
        rows.append({"kernel": pretty, "registers": regs, "spill": spill, "smem": smem,
                     "blocks_per_sm": blocks_per_sm(regs, smem),
                     "loads": sum(opcode(i).startswith("LDG") for i in ins),
                     "in_flight": loads_in_flight(ins), "count": len(ins), "conversions": conversions(ins),
                     "instructions": ins})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="target (default sm_90, the H100's)")
    p.add_argument("--kernels", default="", help="regex over the demangled kernel names (default: all)")
    p.add_argument("--baseline-rev", help="git revision to compare with (its csrc/, same flags)")
    args = p.parse_args(argv)
    rows = audit(args.kernels, args.arch)
    if not rows:
        fail(f"no kernel matches {args.kernels!r}")
    base = {}
    if args.baseline_rev:
        with tempfile.TemporaryDirectory() as tmp:
            base = {r["kernel"]: r for r in audit(args.kernels, args.arch,
                                                  _ptx_cost().checkout(args.baseline_rev, Path(tmp)))}
    cols = ("registers", "spill", "smem", "blocks_per_sm", "loads", "in_flight", "count", "conversions")
    print(f"{args.arch} machine code of {SOURCE}" + (f"; baseline {args.baseline_rev} -> this tree" if base else "")
          + "\n")
    print("| kernel | registers | spilled bytes | shared bytes | blocks/SM (256 threads) | loads | most in flight "
          "| instructions | conversion unit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["kernel"]):
        b = base.get(r["kernel"])
        cells = [f"{b[c]} -> {r[c]}" if b is not None and b[c] != r[c] else f"{r[c]}" for c in cols]
        print(f"| `{r['kernel'][:110]}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
