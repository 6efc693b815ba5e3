"""torch.compile per block (``compile_scope=blocks``) across the timm zoo of
tests/test_timm_models.py: per family, the patched model (ops=all, zoo size, fp32, batch 2)
trains one step with each block of its ``blocks`` containers compiled on its own
(``fullgraph=True``, backend ``aot_eager``: Inductor's tracing, ATen's kernels, so the bits
can be compared) against an eager copy of the same patched model.

Columns: blocks compiled, graphs Dynamo captured (identical blocks share one), forward and
gradients against eager Mesa (``equal`` or the largest difference relative to the largest
gradient), the same gradient difference for the stock model compiled the same way, compile
time of the first step, and the first line of the error where the patched (``error``) or the
stock model (``stock error``) failed. A family without ``blocks`` containers gets
``compile_scope=model``'s one-line error.

    PYTHONPATH=. python scripts/compile_sweep.py [--out results/timm/compile-per-block.md] [MODEL ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from timm_zoo import ZOO, build, example  # noqa: E402

from mesa_train.compile_scope import compile_model, repeated_blocks  # noqa: E402
from mesa_train.patch import patch_model  # noqa: E402

COLUMNS = ("model", "blocks", "graphs", "breaks", "forward", "gradients", "stock gradients", "compile_s", "error",
           "stock error")


def _step(model, x):
    out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach()


def _gradient_difference(compiled, eager) -> str:
    """``equal``, or the largest |compiled - eager| over the largest |eager| (all parameters)."""
    worst, scale = 0.0, 0.0
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        if a.grad is None and b.grad is None:
            continue
        if a.grad is None or b.grad is None:
            return f"missing ({name})"
        worst = max(worst, (a.grad - b.grad).abs().max().item())
        scale = max(scale, b.grad.abs().max().item())
    return "equal" if worst == 0 else f"{worst / max(scale, 1e-30):.1e}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


def per_block_step(model, x) -> dict:
    """One training step of ``model`` compiled per block against an eager copy's."""
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    try:
        compile_model(model, "blocks", backend="aot_eager")
        t0 = time.perf_counter()
        out = _step(model, x)
        compile_s = time.perf_counter() - t0
    except Exception as err:  # the sweep reports a family's failure and goes on
        return {"error": _first_line(err)}
    ref = _step(eager, x)
    return {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": int(sum(counters["graph_break"].values())),
            "forward": "equal" if torch.equal(out, ref) else f"{(out - ref).abs().max().item():.1e}",
            "gradients": _gradient_difference(model, eager), "compile_s": compile_s}


def measure(name: str) -> dict:
    """The patched model's per-block step, and the stock model's beside it (its gradient
    difference, the same compile's own rounding, and whether it compiles at all)."""
    torch.manual_seed(0)
    stock = build(name)
    x = example(name)
    patched = patch_model(copy.deepcopy(stock), ops=("all",))
    row = {"model": name, "blocks": len(repeated_blocks(patched))}
    row.update(per_block_step(patched, x))
    base = per_block_step(stock, x)
    row["stock gradients"] = base.get("gradients")
    row["stock error"] = base.get("error")
    return row


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return ""
    return f"{value:.1f}" if isinstance(value, float) else str(value).replace("|", "/")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="zoo names (default: the whole zoo)")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    args = ap.parse_args()
    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        print(f"compile_sweep: unknown model(s) {', '.join(unknown)}; valid: {', '.join(ZOO)}")
        return 2
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for i, name in enumerate(args.models or list(ZOO)):
        row = measure(name)
        lines.append("| " + " | ".join(_cell(row, k) for k in COLUMNS) + " |")
        print(f"[{i + 1}/{len(args.models or ZOO)}] " + lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
