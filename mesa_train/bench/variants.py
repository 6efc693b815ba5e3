"""Quantizer variants table (issue 12): ``python -m mesa_train.bench.variants [--quick]``.

For DeiT-Ti and PVT-v2 (small input so that it runs on a CPU in minutes), per op and per
setting (bits 8/4/2, pow2 steps, learned clipping thresholds, patch4x4 for convs), one op
patched at a time (explicit attention, so ``matmul``/``softmax`` are reached):

- saved bytes of that op's layers (``SavedTensorMeter.per_module`` summed over the layers
  the op patched) against the same layers in the stock model and against the 8-bit setting;
- gradient of all parameters (concatenated) against the exact (stock) gradient on the same
  batch: relative error and cosine of one pass (mean over the passes), and the bias left
  after many passes, ``sqrt(max(0, |mean - g|^2 - s^2 / N)) / |g|`` (``s^2``: the sample
  variance of the N passes: an unbiased estimate of ``|E[g_i] - g|^2``), next to the noise
  level ``noise / sqrt(N)`` it would have from the noise alone.

Every setting first warms its estimates (running ranges, learned thresholds) on
``--warmup`` other batches (forward with gradients needed, no parameter update). Weights are
timm's random initialisation (no network here): the clipping estimator then sees
initialisation activations, not those of a trained model. Writes ``results/variants/cpu.md``
and ``cpu.csv``. Accuracy on digits is not part of this table (see the markdown's note).
"""
from __future__ import annotations

import argparse
import copy
import csv
import math
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

import mesa_train
from mesa_train.memory import SavedTensorMeter
from mesa_train.models import set_fused_attention
from mesa_train.nn import MesaLayer
from mesa_train.patch.core import mesa_layer_op

SETTINGS = {
    "8-bit": dict(),
    "4-bit": dict(bits=4),
    "2-bit": dict(bits=2),
    # the running estimate without its memory (the current batch's range: nothing clipped) and
    # per-sample ranges: where the 8-bit rows' bias comes from (cpu.notes.md, "Where the 8-bit bias comes from")
    "8-bit decay 0": dict(decay=0.0),
    "8-bit per-sample": dict(estimator="per_sample"),
    "8-bit pow2": dict(scale="pow2"),
    "4-bit pow2": dict(bits=4, scale="pow2"),
    "2-bit pow2": dict(bits=2, scale="pow2"),
    "4-bit learned": dict(bits=4, estimator="learned"),
    "2-bit learned": dict(bits=2, estimator="learned"),
    "2-bit learned H64": dict(bits=2, estimator="learned", clip_horizon=64),
    "patch4x4 2-bit": dict(bits=2, layout="patch4x4"),
}
OPS = ("linear", "gelu", "layernorm", "matmul", "softmax", "conv")
MODELS = {
    "deit_ti": ("deit_tiny_patch16_224", dict(img_size=96)),
    "pvt_v2_b0": ("pvt_v2_b0", dict()),  # any input size
}
IMG = 96  # input resolution of every model
COLUMNS = ["model", "op", "setting", "bytes", "bytes_stock", "x_stock", "x_8bit", "rel_err", "cos", "bias_rel",
           "noise_over_sqrt_n", "passes"]


def _build(name: str):
    timm_name, kw = MODELS[name]
    torch.manual_seed(0)
    m = timm.create_model(timm_name, num_classes=10, **kw)
    set_fused_attention(m, False)  # explicit attention: matmul / softmax are reached
    return m.train()


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def _grad(model, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return _flat_grad(model)


def table_batch(warmup: int, batch: int = 2):
    """The table's data: ``(x, y, warm)``, a batch of random images and labels and ``warmup``
    other batches for the estimates, from seed 1 (drawn after the model's own seed-0 init)."""
    torch.manual_seed(1)
    x = torch.randn(batch, 3, IMG, IMG)
    y = torch.randint(0, 10, (batch,))
    return x, y, [torch.randn_like(x) for _ in range(warmup)]


def bias_squared(draws: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """``(|E[g] - g|^2, s^2)`` from N gradient draws (rows of ``draws``): the squared bias with
    the noise's share ``s^2 / N`` taken out (an unbiased estimate, so it may come out
    negative), and ``s^2``, the summed sample variance of one draw."""
    passes = draws.shape[0]
    mean = draws.mean(0)
    var = float(((draws - mean) ** 2).sum() / max(passes - 1, 1))
    return float((mean - exact).pow(2).sum()) - var / passes, var


def _op_bytes(model, x, names) -> int:
    """Bytes attributed to ``names`` and their submodules."""
    def match(n, k):
        return n == k or n.startswith(k + ".")

    with SavedTensorMeter(model) as meter:
        model(x).sum()
    return sum(b for n, b in meter.per_module.items() if any(match(n, k) for k in names))


def _patched_names(model, op):
    out = []
    for n, m in model.named_modules():
        if isinstance(m, MesaLayer):
            lop = mesa_layer_op(m)
            if lop == "matmul" and op == "softmax" and not m.operands:
                continue  # share-only attn @ v: its bytes are the softmax's shared copy
            if lop == op:
                out.append(n)
    return out


def run(quick: bool, passes: int, warmup: int, out_dir: Path, models, ops, settings) -> list[dict]:
    rows = []
    for mname in models:
        base = _build(mname)
        x, y, warm = table_batch(warmup)
        stock = copy.deepcopy(base)
        exact = _grad(stock, x, y)
        for op in ops:
            probe = mesa_train.patch_model(copy.deepcopy(base), ops=[op], attention="explicit")
            names = _patched_names(probe, op)
            if not names:
                continue
            # stock attention saves q, k, v and the softmax output in one module (no matmul /
            # softmax submodules): no per-op stock bytes for those two ops
            stock_bytes = 0 if op in ("matmul", "softmax") else _op_bytes(stock, x, names)
            bytes8 = None
            for sname in settings:
                opts = SETTINGS[sname]
                if opts.get("layout") == "patch4x4" and op != "conv":
                    continue
                t0 = time.time()
                m = mesa_train.patch_model(copy.deepcopy(base), ops=[op], attention="explicit", **opts)
                for w in warm:
                    m(w.requires_grad_(False)).sum().backward()
                nbytes = _op_bytes(m, x, names)
                if sname == "8-bit":
                    bytes8 = nbytes
                gs = [_grad(m, x, y) for _ in range(passes)]
                gn = exact.norm()
                rel1 = float(sum((g - exact).norm() for g in gs) / passes / gn)
                cos1 = float(sum(F.cosine_similarity(g, exact, 0) for g in gs) / passes)
                bias2, var = bias_squared(torch.stack(gs), exact)
                rows.append(dict(
                    model=mname, op=op, setting=sname, bytes=nbytes, bytes_stock=stock_bytes,
                    x_stock=round(nbytes / stock_bytes, 4) if stock_bytes else "",
                    x_8bit=round(nbytes / bytes8, 4) if bytes8 else "",
                    rel_err=round(rel1, 5), cos=round(cos1, 6),
                    bias_rel=round(math.sqrt(max(0.0, bias2)) / float(gn), 5),
                    noise_over_sqrt_n=round(math.sqrt(var) / float(gn) / math.sqrt(passes), 5),
                    passes=passes))
                print(f"{mname:10s} {op:10s} {sname:15s} bytes {nbytes:9d} x8 {rows[-1]['x_8bit']!s:7s} "
                      f"rel {rel1:.4f} cos {cos1:.5f} bias {rows[-1]['bias_rel']} ({time.time() - t0:.1f}s)",
                      flush=True)
    return rows


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` rows (a previous ``cpu.csv``) with those ``new`` redoes replaced and the others
    kept, in table order (models, then ``OPS``, then ``SETTINGS``)."""
    key = lambda r: (r["model"], r["op"], r["setting"])  # noqa: E731
    rows = {key(r): r for r in old}
    rows.update({key(r): r for r in new})

    def order(k):
        m, op, s = k
        return (list(MODELS).index(m) if m in MODELS else len(MODELS), OPS.index(op) if op in OPS else len(OPS),
                list(SETTINGS).index(s) if s in SETTINGS else len(SETTINGS))

    return [rows[k] for k in sorted(rows, key=order)]


def write(rows, out_dir: Path, args) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "update", False) and (out_dir / "cpu.csv").exists():
        with open(out_dir / "cpu.csv", newline="") as f:
            rows = merge(list(csv.DictReader(f)), rows)
    with open(out_dir / "cpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Quantizer variants: saved bytes and gradient error per op (CPU)",
        "",
        f"Command: `python -m mesa_train.bench.variants --passes {args.passes} --warmup {args.warmup}"
        + (" --quick" if args.quick else "") + f" --ops {' '.join(args.ops)} --settings "
        + " ".join(f"'{s}'" for s in args.settings) + (" --update" if getattr(args, "update", False) else "")
        + "`" + (" (the last run; `--update` kept the rows it did not redo from the previous `cpu.csv`)"
                 if getattr(args, "update", False) else "") + ". Models: " + ", ".join(
            f"{k} (`{v[0]}`, {IMG}x{IMG}, batch 2, random init)" for k, v in MODELS.items())
        + "; one op patched at a time, explicit attention; estimates warmed on "
          f"{args.warmup} batches first. Module doc: `mesa_train/bench/variants.py`.",
        "",
        "Columns: `bytes` = bytes the op's layers keep for backward; `x stock` / `x 8-bit` = against the "
        "same layers stock / at 8 bits; `rel err`, `cos` = one pass, all parameter gradients vs exact; "
        "`bias` = relative bias left after infinitely many passes (estimated from the passes), next to "
        "`noise/sqrt(N)` (what the mean of N passes keeps from the noise alone: a bias well below it "
        "is not resolved).",
        "",
        "Not in this table: digits accuracy over seeds (`digits.md` next to this file: "
        "`python -m mesa_train.bench.accuracy preset=variants output_dir=results`), and a "
        "trained model's activations (random init; `tests/test_variants.py::"
        "test_learned_no_worse_than_running_on_heavy_tails` covers heavy-tailed inputs). "
        "`x stock` is blank for matmul and softmax: stock timm attention saves q, k, v and the "
        "attention map in one module, with no per-op split.",
        "",
    ]
    for mname in dict.fromkeys(r["model"] for r in rows):
        lines += [f"## {mname}", "",
                  "| op | setting | bytes | x stock | x 8-bit | rel err | cos | bias | noise/sqrt(N) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["model"] == mname:
                lines.append(f"| {r['op']} | {r['setting']} | {r['bytes']} | {r['x_stock']} | {r['x_8bit']} | "
                             f"{r['rel_err']} | {r['cos']} | {r['bias_rel']} | {r['noise_over_sqrt_n']} |")
        lines.append("")
    notes = out_dir / "cpu.notes.md"  # hand-written reading notes, kept across reruns
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    (out_dir / "cpu.md").write_text("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="deit_ti, linear and gelu, 3 settings")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out-dir", default="results/variants")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                    help="any of: " + ", ".join(f"'{k}'" for k in SETTINGS))
    ap.add_argument("--update", action="store_true",
                    help="merge into the existing cpu.csv: replace the rows this run redoes, keep the others")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    models, ops, settings = args.models, args.ops, args.settings
    if args.quick:
        models, ops, settings = ["deit_ti"], ["linear", "gelu"], ["8-bit", "4-bit", "2-bit"]
    if "8-bit" not in settings:
        settings = ["8-bit", *settings]
    rows = run(args.quick, args.passes, args.warmup, Path(args.out_dir), models, ops, settings)
    write(rows, Path(args.out_dir), args)


if __name__ == "__main__":
    main()
