"""Two kernel tables of ``python -m mesa_train.quant.benchmark`` side by side: each op's kernel
time in the first (before) and the second (after), their ratio, and each one's fraction of
clone's bandwidth (clone measured in its own run).

Why: a kernel change made without a GPU is measured by the next GPU call, and a table from an
earlier session differs by the machine and its clocks as much as by the code. The GPU session's
``kernels-base`` step times an older build of the extension right after this tree's (the same
Python, the same GPU, minutes apart: ``scripts/gpu_session.sh``), and this script sets the
two tables side by side:

    python scripts/compare_kernel_tables.py results/kernels/NVIDIA-H200.base-42cbf3f.md \\
        results/kernels/NVIDIA-H200.md -o results/kernels/NVIDIA-H200.vs-base-42cbf3f.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

KEY = ("case", "dtype", "op")
TIME = "kernel time (us)"
FRACTION = "fraction of clone bandwidth"


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_table(path: Path) -> tuple[str, dict[tuple[str, str, str], dict[str, str]]]:
    """(the table's title, {(case, dtype, op): {column: cell}}) of a benchmark table file."""
    if not path.is_file():
        fail(f"{path}: no such file (a kernel table of python -m mesa_train.quant.benchmark)")
    lines = path.read_text().splitlines()
    title = next((line.lstrip("# ").strip() for line in lines if line.startswith("# ")), path.name)
    header = next((i for i, line in enumerate(lines) if line.startswith("| case |")), None)
    if header is None:
        fail(f"{path}: no kernel table in it (no '| case |' header row)")
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    missing = [c for c in (*KEY, TIME, FRACTION) if c not in columns]
    if missing:
        fail(f"{path}: the table lacks the columns {missing}; it has {columns}")
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        rows[tuple(cells[k] for k in KEY)] = cells
    return title, rows


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None  # "-" (no kernel time: the CPU) or absent


def compare(before: Path, after: Path) -> str:
    """The markdown comparison of two tables: the rows both have, in the second table's order."""
    title_b, rows_b = read_table(before)
    title_a, rows_a = read_table(after)
    common = [k for k in rows_a if k in rows_b]
    if not common:
        fail(f"{before} and {after} have no (case, dtype, op) row in common")
    out = [
        "# Kernel time, two kernel tables side by side",
        "",
        f"Before: `{before.name}` ({title_b}). After: `{after.name}` ({title_a}). "
        "Kernel time per call in microseconds (the op's kernels, from torch.profiler); after / before "
        "below 1 is faster; each fraction of clone's bandwidth is against clone in its own run. "
        f"`python scripts/compare_kernel_tables.py {before} {after}`.",
        "",
        "| case | dtype | op | before (us) | after (us) | after / before | before: fraction of clone "
        "| after: fraction of clone |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for key in common:
        b, a = rows_b[key], rows_a[key]
        tb, ta = _number(b[TIME]), _number(a[TIME])
        ratio = f"{ta / tb:.2f}" if tb and ta is not None else "-"
        out.append(f"| {' | '.join(key)} | {b[TIME]} | {a[TIME]} | {ratio} | {b[FRACTION]} | {a[FRACTION]} |")
    only = sorted(set(rows_a) ^ set(rows_b))
    if only:
        out += ["", f"Rows in one table only ({len(only)}): " + "; ".join(" / ".join(k) for k in only) + "."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path, help="the earlier build's table")
    p.add_argument("after", type=Path, help="this build's table")
    p.add_argument("-o", "--output", type=Path, default=None, help="also write the comparison here")
    args = p.parse_args(argv)
    text = compare(args.before, args.after)
    print(text, end="")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
