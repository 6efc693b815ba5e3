"""What a compiled patched model keeps for backward, against eager Mesa and stock, over the timm
zoo of ``tests/test_timm_models.py`` (zoo sizes, fp32, ops=all, one thread):

* eager: ``SavedTensorMeter`` activation bytes of one training forward (stock, Mesa);
* compiled: ``mesa_train.memory_compiled.compiled_saved_bytes`` of the patched model compiled
  whole (``fullgraph=True``, ``aot_eager``: the saved tensors of Inductor's min-cut partitioner, ATen's
  kernels), from the same quantizer state as the eager call.

    PYTHONPATH=. python scripts/compiled_saved_sweep.py [--batch 4] [--out results/timm/compiled-saved.md] [MODEL ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from timm_zoo import ZOO, build, example  # noqa: E402

from mesa_train.memory_compiled import compiled_saved_bytes  # noqa: E402
from mesa_train.patch import patch_model  # noqa: E402
from mesa_train.patch.report import measure_saved_bytes  # noqa: E402


def measure(name: str, batch: int) -> dict:
    stock, x = build(name), example(name, batch=batch)
    patched = patch_model(copy.deepcopy(stock))
    twin = copy.deepcopy(patched)  # the quantizer state the eager call starts from
    row = {"model": name, "stock": measure_saved_bytes(stock, x).activation_bytes,
           "eager": measure_saved_bytes(patched, x).activation_bytes}
    torch._dynamo.reset()
    row["compiled"] = compiled_saved_bytes(twin, x)
    return row


def _markdown(rows) -> str:
    lines = ["| model | eager Mesa / stock | compiled Mesa / stock | compiled / eager Mesa | note |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | | {r['error']} |")
            continue
        lines.append(f"| {r['model']} | {r['eager'] / r['stock']:.3f} | {r['compiled'] / r['stock']:.3f} | "
                     f"{r['compiled'] / r['eager']:.3f} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = args.models or list(ZOO)
    rows = []
    for i, name in enumerate(names, 1):
        t = time.time()
        try:
            row = measure(name, args.batch)
            text = (f"eager {row['eager'] / row['stock']:.3f}  compiled {row['compiled'] / row['stock']:.3f}  "
                    f"compiled/eager {row['compiled'] / row['eager']:.3f}")
        except Exception as e:  # a model that does not compile whole is a result too
            row = {"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"[:150]}
            text = row["error"]
        rows.append(row)
        print(f"[{i}/{len(names)}] {name:36s} {text} [{time.time() - t:.0f}s]", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(_markdown(rows))


if __name__ == "__main__":
    main()
