"""Who set a step's pace: each Mesa row's throughput ratio where the GPU would set it, beside
the one measured. ``python -m mesa_train.bench.pace RESULTS.json PROFILE.csv``.

A host-bound step (Python, dispatch and launches take longer than the kernels) measures the
host as much as Mesa. On the H200 the same DeiT-S rows read 0.90x in one run and 0.49x two
hours later, on a slower host (results/gpu-session/README.md, session 66). A profile's self
CUDA time per step (every kernel's time, summed) does not depend on the host, so its ratio,
baseline over row, is the throughput ratio the two rows would reach if both ran GPU-bound:
Mesa's ceiling on a host fast enough to keep the GPU busy. Where the measured ratio stays
below it, the host held the Mesa row back; above it, the host held the baseline back (its
GPU sat idle while Mesa's did not). The host side, the same steps' self CPU time (profiler
cost included), says how much launching work Mesa adds.

``profile=true`` writes this table into ``<device>.profile.md``; the command above rebuilds it
for a committed run from the bench's JSON (which rows pair, the measured steps) and its profile
CSV (the times).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from mesa_train.bench.cli import check_output


class PaceError(ValueError):
    """Files that cannot give the table (missing, corrupt, or a CPU profile); one line."""


@dataclass(frozen=True)
class RowTimes:
    """One Mesa row and its group's baseline: profile totals (ms per step) and measured steps."""

    label: str
    baseline: str
    gpu_ms: float  # self CUDA time per step, every kernel
    baseline_gpu_ms: float
    host_ms: float | None  # self CPU time per step, profiler cost included (None: not recorded)
    baseline_host_ms: float | None
    step_ms: float | None = None  # measured median step (no profiler)
    baseline_step_ms: float | None = None


def _ratio(baseline: float | None, row: float | None) -> str:
    """baseline / row (a time ratio read as a throughput ratio); – where either is missing."""
    if not baseline or not row:
        return "–"
    return f"{baseline / row:.2f}x"


def _pair(baseline: float | None, row: float | None, digits: int) -> str:
    if baseline is None or row is None:
        return "–"
    return f"{baseline:,.{digits}f} -> {row:,.{digits}f}"


def pace_table(rows: list[RowTimes]) -> str:
    """Markdown: per Mesa row, the measured throughput ratio, the GPU-time ratio (its ceiling
    where both steps run GPU-bound) and the host-time ratio, with the times they come from."""
    lines = ["| Row | Baseline | Measured throughput ratio | GPU-time ratio (GPU-bound ceiling) "
             "| GPU ms/step (baseline -> row) | Host-time ratio (profiled) "
             "| Host ms/step, profiled (baseline -> row) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.baseline} | {_ratio(r.baseline_step_ms, r.step_ms)} "
                     f"| **{_ratio(r.baseline_gpu_ms, r.gpu_ms)}** | {_pair(r.baseline_gpu_ms, r.gpu_ms, 2)} "
                     f"| {_ratio(r.baseline_host_ms, r.host_ms)} | {_pair(r.baseline_host_ms, r.host_ms, 1)} |")
    return "\n".join(lines)


EXPLANATION = (
    "GPU-time ratio: the baseline's self CUDA time per step over the row's (every kernel, from the "
    "profile): the throughput ratio where both steps run GPU-bound, which does not depend on the "
    "host. A measured ratio below it: the host held the Mesa row back; above it: the host held the "
    "baseline back. Host-time ratio: the same for the profiled self CPU time (profiler cost included).")


# --------------------------------------------------------------------------- committed files

def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PaceError(f"{path}: no such file (the bench writes <device>.json beside its .md)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PaceError(f"{path}: not a bench results JSON ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise PaceError(f"{path}: not a bench results JSON (no 'rows' list)")
    return data


def _read_totals(path: Path) -> tuple[dict[tuple[str, str], float], set[tuple[str, str]]]:
    """{(label, "self_cuda" | "self_cpu"): ms per step} summed over a profile CSV's ops, and the
    (device, date) runs its lines name (none in a CSV written before those columns)."""
    totals: dict[tuple[str, str], float] = defaultdict(float)  # (a profile before the host side: no self_cpu)
    runs: set[tuple[str, str]] = set()
    try:
        with open(path, newline="") as f:
            for line in csv.DictReader(f):
                totals[(line["label"], line["time"])] += float(line["ms_per_step"])
                if line.get("date"):
                    runs.add((line.get("device") or "", line["date"]))
    except FileNotFoundError:
        raise PaceError(f"{path}: no such file (profile=true writes <device>.profile.csv)") from None
    except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise PaceError(f"{path}: not a bench profile CSV ({type(err).__name__}: {err})") from None
    if not any(kind == "self_cuda" for _, kind in totals):
        raise PaceError(f"{path}: no self_cuda times (a CPU profile); the GPU-time ratio needs a GPU run")
    return totals, runs


def _check_same_run(results_json: Path, data: dict, profile_csv: Path, runs: set[tuple[str, str]]) -> None:
    """A profile of another run (another GPU, or the same preset another day) read against these
    results would pair their step times with its kernel times: refused where the CSV names its run."""
    env = data.get("environment") or {}
    this = (str(env.get("device", "")), str(env.get("date", "")))
    if not runs:  # (a CSV written before the device and date columns: nothing to check against)
        stems = (results_json.name.removesuffix(".json"), profile_csv.name.removesuffix(".profile.csv"))
        differ = f"; their names differ ({stems[0]} vs {stems[1]})" if stems[0] != stems[1] else ""
        print(f"note: {profile_csv} does not name its run (written before profiles carried device and date): "
              f"it cannot be checked to be the profile of {results_json}{differ}", file=sys.stderr)
    other = sorted(run for run in runs if run != this)
    if other:
        device, date = other[0]
        raise PaceError(f"{profile_csv} is another run's profile ({device}, {date}) than {results_json} "
                        f"({this[0] or 'no device'}, {this[1] or 'no date'}); give the profile.csv written "
                        "beside that JSON")


def times_from_files(results_json: Path, profile_csv: Path) -> list[RowTimes]:
    """Each Mesa row of a bench run with its group's baseline, both profiled."""
    data = _read_json(results_json)
    rows = data["rows"]
    totals, runs = _read_totals(profile_csv)
    _check_same_run(results_json, data, profile_csv, runs)
    try:
        # (the bench's pairing: RowConfig.group_name, the group or else the model)
        configs = [(r["config"]["label"], r["config"].get("group") or r["config"].get("model") or r["config"]["label"],
                    bool(r["config"].get("baseline")), (r.get("measurement") or {}).get("step_ms_median"))
                   for r in rows]
    except (KeyError, TypeError) as err:
        raise PaceError(f"{results_json}: a row without its config label ({type(err).__name__}: {err})") from None
    baselines = {group: (label, step) for label, group, is_base, step in configs if is_base}
    out = []
    for label, group, is_base, step in configs:
        if is_base or group not in baselines:
            continue
        base, base_step = baselines[group]
        if (label, "self_cuda") not in totals or (base, "self_cuda") not in totals:
            continue  # not profiled (failed, skipped, or cut by a time limit)
        out.append(RowTimes(label, base, totals[(label, "self_cuda")], totals[(base, "self_cuda")],
                            totals.get((label, "self_cpu")), totals.get((base, "self_cpu")),  # (older: none)
                            step, base_step))
    if not out:
        raise PaceError(f"{profile_csv}: no Mesa row profiled together with its baseline "
                        f"(rows in {results_json}: {', '.join(c[0] for c in configs)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesa_train.bench.pace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results_json", type=Path, help="the bench's <device>.json (measured steps, row pairs)")
    parser.add_argument("profile_csv", type=Path, help="the same run's <device>.profile.csv (profile=true)")
    parser.add_argument("--output", type=Path, help="also write the table (and its explanation) here")
    args = parser.parse_args(argv)
    check_output(None if args.output is None else str(args.output))
    try:
        table = pace_table(times_from_files(args.results_json, args.profile_csv))
    except PaceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = f"{table}\n\n{EXPLANATION}\n"
    print(text, end="")
    if args.output is not None:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
