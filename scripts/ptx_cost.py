"""Static instruction counts of the CUDA kernels, this tree against a git revision.

Without a GPU, the kernels' per-element work can still be compared: this compiles
csrc/cuda/quant_cuda.cu to PTX for one architecture (the build's flags: -O3, --fmad=false,
no fast-math) and counts the instructions of each kernel instantiation. PTX is not the
machine code (ptxas optimises further) and a count is not a time: use it to see what a
change removes from a kernel, and measure on a GPU (python -m mesa_train.quant.benchmark).

    python scripts/ptx_cost.py                               # this tree, sm_90
    python scripts/ptx_cost.py --baseline-rev b120c3a        # and the same kernels there
    python scripts/ptx_cost.py --kernels 'BFloat16, unsigned int, 16'   # bf16, 16-element steps

About a minute per tree on 2 cores (nvcc compiles every instantiation).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
SOURCE = Path("csrc/cuda/quant_cuda.cu")
# setup.py's nvcc flags for the extension (torch's own, COMMON_NVCC_FLAGS, are added in compile_ptx)
NVCC_FLAGS = ["-O3", "--fmad=false", "-std=c++20", "-DMESA_WITH_CUDA"]


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def kernel_counts(ptx: str) -> dict[str, collections.Counter]:
    """{mangled entry name: Counter of instruction opcodes (the part before the first '.'),
    plus the total under ''} for every ``.entry`` of a PTX file."""
    out = {}
    for m in re.finditer(r"\.entry\s+([A-Za-z0-9_$]+)", ptx):
        start = ptx.index("{", m.end())
        depth, end = 0, start
        for end in range(start, len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[end], 0)
            if depth == 0:
                break
        counts: collections.Counter = collections.Counter()
        for line in ptx[start + 1:end].splitlines():
            line = line.strip()
            if not line.endswith(";") or line.startswith((".", "//", "{", "}")):
                continue  # directives, comments, declarations
            opcode = line.split()[0]
            if opcode.startswith("@"):  # predicated: @%p1 bra ...
                opcode = line.split()[1]
            counts[opcode.split(".")[0]] += 1
            counts[""] += 1
        out[m.group(1)] = counts
    return out


def readable_counts(counts: dict[str, collections.Counter]) -> dict[str, collections.Counter]:
    """The same counts keyed by the demangled kernel (c++filt when present), without the return
    type and the anonymous namespace, whose mangled name differs between source trees."""
    names = list(counts)
    if shutil.which("c++filt") is None:
        return counts
    text = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    out = {}
    for mangled, readable in zip(names, text.splitlines()):
        readable = re.sub(r"mesa::\(anonymous namespace\)::", "", readable)
        out[re.sub(r"^void |\(.*", "", readable)] = counts[mangled]
    return out


def run_nvcc(tree: Path, arch: str, kind: str, extra: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """(output file, nvcc's stderr) of ``tree``'s csrc/cuda/quant_cuda.cu compiled with the
    extension's flags to ``kind`` ("ptx" or "cubin") for ``arch``; ``extra``: more nvcc flags."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        fail("nvcc not found (needs a CUDA toolkit; no GPU needed)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"k.{kind}"
        includes = [f"-I{p}" for p in include_paths(device_type="cuda")]
        cmd = [nvcc, f"-{kind}", f"-arch={arch}", *NVCC_FLAGS, *COMMON_NVCC_FLAGS, *extra, *includes,
               str(tree / SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            fail(f"nvcc failed on {tree / SOURCE}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return out.read_bytes(), proc.stderr


def compile_ptx(tree: Path, arch: str) -> str:
    return run_nvcc(tree, arch, "ptx")[0].decode()


def checkout(rev: str, into: Path) -> Path:
    """The csrc/ of `rev` (git archive) under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "csrc"], capture_output=True)
    if archive.returncode != 0:
        fail(f"unknown revision {rev!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def table(this: dict, base: dict | None, pattern: str) -> str:
    names = sorted(n for n in set(this) | set(base or {}) if re.search(pattern, n))
    if not names:
        fail(f"no kernel matches {pattern!r}; kernels: {', '.join(sorted(this))}")
    head = "| kernel | PTX instructions | mul/mad | xor |"
    lines = [head + (" baseline instructions | ratio |" if base is not None else ""),
             "|---" * (6 if base is not None else 4) + "|"]
    for name in names:
        c = this.get(name, collections.Counter())
        row = f"| `{name}` | {c[''] or '–'} | {c['mul'] + c['mad']} | {c['xor']} |"
        if base is not None:
            b = base.get(name, collections.Counter())
            ratio = f"{c[''] / b['']:.2f}x" if b[""] and c[""] else "–"
            row += f" {b[''] or '–'} | {ratio} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="PTX target (default sm_90, the H100's)")
    p.add_argument("--baseline-rev", help="git revision to compare with (its csrc/, same flags)")
    p.add_argument("--kernels", default=r"^(quantize|dequantize|observe|quantize_observe)_kernel<",
                   help="regex over the demangled kernel names (default: the 8-bit quantization kernels)")
    args = p.parse_args(argv)
    this = readable_counts(kernel_counts(compile_ptx(REPO, args.arch)))
    base = None
    if args.baseline_rev:
        with tempfile.TemporaryDirectory() as tmp:
            base = readable_counts(kernel_counts(compile_ptx(checkout(args.baseline_rev, Path(tmp)), args.arch)))
    print(f"PTX for {args.arch}, {SOURCE}" + (f", against {args.baseline_rev}" if base else "") + "\n")
    print(table(this, base, args.kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
