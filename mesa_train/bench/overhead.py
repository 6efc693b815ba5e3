"""Host time Mesa adds per layer: ``python -m mesa_train.bench.overhead``.

On a GPU, eager Mesa's cost on small and medium tensors is mostly host time: Python in the
layer and the quantizer, and one dispatcher call per op. This measures it on CPU with tiny
tensors (so the data itself costs next to nothing): for each Mesa layer, the median over
passes of one forward + backward minus the stock layer's pass just before it, in
microseconds, each pass on a fresh input computed with gradients, as a layer in a model gets.
(Since session 80; the stock column now includes that input's ``x * 1`` backward and the
leaf's gradient accumulation, which cancel in "Mesa adds": older tables' stock columns are
a few microseconds lower.)

``--baseline-tree DIR`` runs the same measurement on another checkout of the project
(with its extension built, e.g. ``git worktree add /tmp/old <commit>`` plus a build), in
alternating rounds in subprocesses, and prints both side by side with the ratio: a
before/after comparison taken in one run.

``--python-functions`` compares the two paths of this tree in one process instead: each Mesa
layer with its C++ layer op, and with the C++ layer ops switched off (``quantizer._FUSED_LAYERS``,
as the tests switch it: the Python ``autograd.Function`` the layer runs under ``torch.compile``,
and ran in eager mode before its op existed), and stock, timed in turn pass by pass ("Mesa
adds" there is the difference of the medians). (A layer
without a C++ layer op would run the same path twice, its ratio the run's noise: AvgPool2d read
1.02x at a8ba8b1, before it had one; results/overhead/README.md, session 57.)

The last two rows are a whole timm ViT ``Block`` (DeiT's), fused attention with the sdpa set and
explicit attention with every transformer op: what Mesa adds per block, the figure by which an
eager step's host time grows per block where the host sets the pace (the H200's eager DeiT-S
rows were host-bound, stock's too). ``--layers Linear,ViTBlock`` measures only those rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from mesa_train.bench.cli import check_output, fail, positive_int
from mesa_train.bench.report import _git, environment, print_and_save
from mesa_train.patch import patch_model

# the transformer layers, then the convnets' (BatchNorm and below); each a C++ layer op in eager
# training; a baseline tree older than a layer leaves its row out
LAYERS = ("Linear", "GELU", "LayerNorm", "RmsNorm", "Softmax", "MatMul", "Conv2d", "Conv1d", "SDPA", "LayerScale",
          "Affine", "StarReLU", "Normalize", "GatedSiLU", "GatedProduct", "Einsum", "Amax",
          "Clamp", "OneHotTable",
          "BatchNorm2d", "ScaleBranch", "ReLU", "SiLU", "Hardswish", "Hardsigmoid", "MaxPool2d", "AvgPool2d",
          "GroupNorm", "LayerNorm2d", "GlobalResponseNorm",
          "ViTBlock", "ViTBlockExplicit")  # (a whole timm ViT Block: the module doc)


class _MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class _Gated(nn.Module):
    """``act(a) * b``: a SwiGLU MLP's gate (act SiLU), or a plain product (gMLP, FocalNet)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, a, b):
        return self.act(a) * b


class _Normalize(nn.Module):
    """Cosine attention's ``F.normalize`` of q or k (SwinV2, XCiT)."""

    def forward(self, x):
        return torch.nn.functional.normalize(x, dim=-1)


class _Einsum(nn.Module):
    """MViTv2's relative positions: the queries contracted with a position table."""

    def __init__(self, einsum=torch.einsum):
        super().__init__()
        self.einsum = einsum

    def forward(self, q, table):
        return self.einsum("byhwc,hkc->byhwk", q, table)


class _Amax(nn.Module):
    """Hiera's query pooling, ``x.view(B, stride, -1, C).amax(dim=1)``."""

    def __init__(self, amax=torch.amax):
        super().__init__()
        self.amax = amax

    def forward(self, x):
        return self.amax(x, 1)


class _Clamp(nn.Module):
    """Gemma 4's clamped projections: ``torch.clamp(x, lo, hi)`` with buffer bounds."""

    def __init__(self, clamp=torch.clamp):
        super().__init__()
        self.clamp = clamp
        self.register_buffer("lo", torch.tensor(-1.0))
        self.register_buffer("hi", torch.tensor(1.0))

    def forward(self, x):
        return self.clamp(x, self.lo, self.hi)


class _OneHotTable(nn.Module):
    """Gemma 4's position embeddings, ``one_hot(positions) @ table`` on fixed (B, N, 2) positions;
    the input is the table (the gradient's only target)."""

    def __init__(self, lookup=None):
        super().__init__()
        self.lookup = lookup
        self.register_buffer("positions", torch.randint(0, 16, (2, 4, 2), generator=torch.Generator().manual_seed(0)))

    def forward(self, table):
        if self.lookup is not None:
            return self.lookup(self.positions, table)
        # stock's expression written out, not nn.one_hot_table.one_hot_lookup: this file also runs
        # in a --baseline-tree checkout that may predate that module
        one_hot = torch.nn.functional.one_hot(self.positions, table.shape[1]).permute(0, 2, 1, 3)
        return one_hot.to(table) @ table


class _SDPA(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _cases(layers=None):
    """{layer: (stock factory, converter, inputs factory)} for the layers this tree's
    ``mesa_train.nn`` has (a baseline tree may predate some), or only ``layers`` of them."""
    import mesa_train.nn as M

    cases = {**_transformer_cases(M), **_convnet_cases(M), **_block_cases()}
    return {name: case for name, case in cases.items() if case is not None and (layers is None or name in layers)}


def _block_cases():
    """A timm ViT ``Block`` of width 8 and two heads, patched as DeiT is: fused attention with
    the sdpa set, and explicit attention with every transformer op (the paper's setting)."""
    from timm.models.vision_transformer import Block

    def block(fused: bool):
        def make():
            b = Block(dim=8, num_heads=2)
            b.attn.fused_attn = fused
            return b
        return make

    x = lambda: (torch.randn(2, 4, 8),)  # noqa: E731
    return {
        "ViTBlock": (block(True), lambda s: patch_model(s, ops=["linear", "gelu", "layernorm", "sdpa"]), x),
        "ViTBlockExplicit": (block(False), lambda s: patch_model(s, ops=["linear", "gelu", "layernorm", "matmul",
                                                                         "softmax"], attention="explicit"), x),
    }


def _transformer_cases(M):
    from timm.layers import LayerScale, RmsNorm
    from timm.models.metaformer import StarReLU
    from timm.models.mlp_mixer import Affine

    x = lambda: torch.randn(2, 4, 8)  # noqa: E731 - tiny: the host time is what is measured
    return {
        "Linear": (lambda: nn.Linear(8, 8), M.Linear.from_module, lambda: (x(),)),
        "GELU": (nn.GELU, M.GELU.from_module, lambda: (x(),)),
        "LayerNorm": (lambda: nn.LayerNorm(8), M.LayerNorm.from_module, lambda: (x(),)),
        # timm's RmsNorm (ViT-XP, Gemma-4's and DeepSeek's ViTs)
        "RmsNorm": (lambda: RmsNorm(8), M.RmsNorm.from_module, lambda: (x(),)),
        "Softmax": (lambda: nn.Softmax(-1), M.Softmax.from_module, lambda: (torch.randn(2, 2, 4, 4),)),
        "MatMul": (_MatMul, lambda s: M.MatMul(), lambda: (torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 4))),
        "Conv2d": (lambda: nn.Conv2d(2, 4, 3, padding=1), M.Conv2d.from_module, lambda: (torch.randn(2, 2, 4, 4),)),
        # EfficientViM's and CoaT's token convs, ECA attention's
        "Conv1d": (lambda: nn.Conv1d(2, 4, 3, padding=1), M.Conv1d.from_module, lambda: (torch.randn(2, 2, 16),)),
        # fused attention (the sdpa set): three compressed operands, backward recomputes
        "SDPA": (_SDPA, lambda s: M.ScaledDotProductAttention(num_groups=2),
                 lambda: tuple(torch.randn(2, 2, 4, 4) for _ in range(3))),
        # timm's LayerScale (DeiT3, CaiT, EVA: two a block); the same Function serves the NCHW
        # layer scales and squeeze-excite's gate
        "LayerScale": (lambda: LayerScale(8), M.LayerScale.from_module, lambda: (x(),)),
        # ResMLP's Affine (two a block) and MetaFormer's StarReLU (ConvFormer, CAFormer: two a block)
        "Affine": (lambda: Affine(8), M.Affine.from_module, lambda: (x(),)),
        "StarReLU": (StarReLU, M.StarReLU.from_module, lambda: (x(),)),
        "Normalize": (_Normalize, lambda s: M.Normalize(), lambda: (torch.randn(2, 2, 4, 4),)),
        # the gated products (two compressed operands): EVA-02's SwiGLU, FocalNet's and gMLP's a * b
        "GatedSiLU": (lambda: _Gated(nn.SiLU()), lambda s: M.GatedActivation(nn.SiLU()), lambda: (x(), x())),
        "GatedProduct": (lambda: _Gated(nn.Identity()), lambda s: M.GatedActivation(nn.Identity()),
                         lambda: (x(), x())),
        # MViTv2's relative-position einsums (the query compressed, the table kept as it is) and
        # Hiera's max pools written as amax (a 1-bit mask kept)
        "Einsum": (_Einsum, lambda s: _Einsum(M.Einsum()),
                   lambda: (torch.randn(2, 2, 4, 4, 8), torch.randn(4, 7, 8))),
        "Amax": (_Amax, lambda s: _Amax(M.Amax()), lambda: (torch.randn(2, 4, 4, 8),)),
        # Gemma 4's clamps with buffer bounds (two 1-bit masks) and its position-table lookup
        # (the positions kept); a baseline tree without the layer leaves the row out
        "Clamp": (_Clamp, lambda s: _Clamp(M.Clamp()), lambda: (x(),)) if hasattr(M, "Clamp") else None,
        "OneHotTable": ((_OneHotTable, lambda s: _OneHotTable(M.OneHotTable()), lambda: (torch.randn(2, 16, 4),))
                        if hasattr(M, "OneHotTable") else None),
    }


def _convnet_cases(M):
    from timm.layers import LayerNorm2d
    from timm.layers.grn import GlobalResponseNorm

    img = lambda: (torch.randn(2, 2, 4, 4),)  # noqa: E731

    def case(cls_name, make_stock):
        cls = getattr(M, cls_name, None)
        return None if cls is None else (make_stock, cls.from_module, img)

    def scale_branch():  # a 1x1 depthwise conv straight into a BatchNorm (conv.ScaleLink)
        return nn.Sequential(nn.Conv2d(2, 2, 1, groups=2, bias=False), nn.BatchNorm2d(2))

    return {
        "BatchNorm2d": case("BatchNorm2d", lambda: nn.BatchNorm2d(2)),
        # FastViT / MobileOne / RepViT's scale branch, the pair linked by patch_model: the conv's
        # weight gradient handed over from the BatchNorm's backward (both layers in the row)
        "ScaleBranch": (scale_branch, lambda s: patch_model(s, ops=["conv", "batchnorm"]), img),
        "ReLU": case("ReLU", nn.ReLU),
        "SiLU": case("SiLU", nn.SiLU),
        "Hardswish": case("Hardswish", nn.Hardswish),
        "Hardsigmoid": case("Hardsigmoid", nn.Hardsigmoid),
        "MaxPool2d": case("MaxPool2d", lambda: nn.MaxPool2d(3, 2, 1)),
        "AvgPool2d": case("AvgPool2d", lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False)),
        "GroupNorm": case("GroupNorm", lambda: nn.GroupNorm(1, 2)),
        "LayerNorm2d": case("LayerNorm2d", lambda: LayerNorm2d(2)),
        # ConvNeXt-V2's MLP norm (NCHW form; its weight 0 at init does not change the work)
        "GlobalResponseNorm": case("GlobalResponseNorm", lambda: GlobalResponseNorm(2, channels_last=False)),
    }


def _fresh(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each pass's inputs, made before its clock starts: a layer in a model is handed a tensor
    computed with gradients (not a leaf), a new one every step, and Mesa does for such a tensor
    what it does not for a leaf (leaves one copy of it for a parallel layer: nn/input_copy.py);
    a leaf given pass after pass left that out of the measured time."""
    return [x * 1 for x in xs]


def _paired_us(stock: nn.Module, mesa: nn.Module, inputs, reps: int) -> dict[str, float]:
    """``{stock_us, mesa_us, added_us}``: one stock pass, then one Mesa pass, rep by rep; the
    medians of each and of the per-rep differences. Paired, so that a drift of the machine's
    speed (a shared VM's CPU swings by a third between seconds) falls on both alike: the
    difference of two medians taken one after the other swung by as much as Mesa adds."""
    xs = [t.clone().requires_grad_() for t in inputs]
    times: dict[str, list[float]] = {"stock_us": [], "mesa_us": [], "added_us": []}
    for i in range(20 + reps):  # 20 warm-up passes: lazy state, estimates initialised
        a, b = _fresh(xs), _fresh(xs)
        t0 = time.perf_counter()
        stock(*a).sum().backward()
        t1 = time.perf_counter()
        mesa(*b).sum().backward()
        t2 = time.perf_counter()
        if i >= 20:
            times["stock_us"].append(t1 - t0)
            times["mesa_us"].append(t2 - t1)
            times["added_us"].append((t2 - t1) - (t1 - t0))
    return {key: 1e6 * statistics.median(t) for key, t in times.items()}


def measure(reps: int, layers=None) -> dict[str, dict[str, float]]:
    """{layer: {stock_us, mesa_us, added_us}} for this process's mesa_train (``layers``: only those)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return {name: _paired_us(make_stock(), convert(make_stock()), inputs(), reps)
            for name, (make_stock, convert, inputs) in _cases(layers).items()}


def _run_tree(tree: str, reps: int, layers=None) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    # this file, loaded by path: `import mesa_train` inside it then resolves to `tree`
    code = ("import importlib.util, json; spec = importlib.util.spec_from_file_location('overhead', %r); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(json.dumps(m.measure(%d, %r)))") % (str(Path(__file__).resolve()), reps, layers)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: measuring in {tree} failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(this_tree: str, baseline_tree: str, reps: int, rounds: int, layers=None) -> dict[str, dict[str, float]]:
    """Alternate subprocess rounds between the two trees; median of each figure over rounds."""
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    for _ in range(rounds):
        runs["baseline"].append(_run_tree(baseline_tree, reps, layers))
        runs["this"].append(_run_tree(this_tree, reps, layers))
    table = {}
    for name in LAYERS:
        if not all(name in r for results in runs.values() for r in results):
            continue  # a layer one of the trees does not have
        row = {}
        for which, results in runs.items():
            for key in ("stock_us", "added_us"):
                row[f"{which}_{key}"] = statistics.median(r[name][key] for r in results)
        row["added_ratio"] = row["this_added_us"] / row["baseline_added_us"]
        table[name] = row
    return table


def _interleaved_us(runs, inputs, reps: int, set_fused) -> list[float]:
    """Median µs of one forward + backward for each ``(module, fused)`` in ``runs``, timed in
    turn pass by pass (``set_fused(fused)`` before each), so that a drift of the machine's speed
    falls on every path alike."""
    xs = [t.clone().requires_grad_() for t in inputs]
    times: list[list[float]] = [[] for _ in runs]
    for i in range(20 + reps):  # 20 warm-up passes: lazy state, estimates initialised
        for k, (module, fused) in enumerate(runs):
            set_fused(fused)
            ys = _fresh(xs)
            t0 = time.perf_counter()
            module(*ys).sum().backward()
            if i >= 20:
                times[k].append(time.perf_counter() - t0)
    return [1e6 * statistics.median(t) for t in times]


def compare_paths(reps: int, rounds: int, layers=None) -> dict[str, dict[str, float]]:
    """Each layer on its Python Function and on its C++ layer op, with stock, pass by pass in
    this process (see the module doc); median of each figure over ``rounds``, in ``compare``'s
    row format (the Python Functions as the baseline)."""
    from mesa_train.nn import quantizer as quantizer_mod

    torch.set_num_threads(1)
    torch.manual_seed(0)
    real = quantizer_mod._FUSED_LAYERS

    def set_fused(on: bool) -> None:
        quantizer_mod._FUSED_LAYERS = on

    samples: dict[str, list[list[float]]] = {}
    try:
        for _ in range(rounds):
            for name, (make_stock, convert, inputs) in _cases(layers).items():
                stock, mesa = make_stock(), convert(make_stock())
                got = _interleaved_us([(stock, real), (mesa, False), (mesa, real)], inputs(), reps, set_fused)
                samples.setdefault(name, []).append(got)
    finally:
        set_fused(real)
    table = {}
    for name, rows in samples.items():
        stock, python, op = (statistics.median(r[k] for r in rows) for k in range(3))
        table[name] = {"this_stock_us": stock, "baseline_added_us": python - stock, "this_added_us": op - stock,
                       "added_ratio": (op - stock) / (python - stock)}
    return table


def markdown(table: dict, baseline_tree: str | None, reps: int, rounds: int, python_functions: bool = False) -> str:
    # the header names the thread count the figures were measured with (measure() sets 1,
    # also in the subprocesses of a comparison), not this process's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        env = environment(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    if baseline_tree:
        revision = _git("-C", str(Path(baseline_tree).resolve()), "rev-parse", "--short", "HEAD") or "?"
        against = f" against {revision} (the baseline column)"
    else:
        against = ""
    if python_functions:
        against = "; each layer on its Python Function (the baseline column) and on its C++ layer op"
    two = bool(baseline_tree) or python_functions
    lines = [f"Device: {env['device']}; torch {env['torch']}; git {env['git']}{against}; {env['date']}.", ""]
    columns = (" (Python Functions) | Mesa adds µs (C++ ops) | ratio |" if python_functions
               else " (baseline) | Mesa adds µs (this) | ratio |")
    lines += ["| layer | stock fwd+bwd µs | Mesa adds µs" + (columns if two else " |")]
    lines.append("|---" * (5 if two else 3) + "|")
    for name, r in table.items():
        if two:
            lines.append(f"| {name} | {r['this_stock_us']:.0f} | {r['baseline_added_us']:.0f} | "
                         f"{r['this_added_us']:.0f} | {r['added_ratio']:.2f}x |")
        else:
            lines.append(f"| {name} | {r['stock_us']:.0f} | {r['added_us']:.0f} |")
    how = (f"medians of {reps} forward+backward passes on fresh non-leaf inputs"
           + ("" if python_functions else ", Mesa adds: of the per-pass differences to a stock pass just before")
           + (f", median over {rounds} alternating rounds" if two else ""))
    return "\n".join(lines) + f"\n\nTensors of 64 elements, 1 CPU thread, {how}.\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=positive_int, default=2000, help="timed passes per layer (default 2000)")
    p.add_argument("--baseline-tree", help="another checkout (extension built) to compare with, same run")
    p.add_argument("--python-functions", action="store_true",
                   help="compare each layer's C++ layer op with its Python Function, same process")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="alternating rounds with --baseline-tree or --python-functions (default 3)")
    p.add_argument("--output", help="also write the Markdown table here")
    p.add_argument("--layers", help="only these rows, comma-separated, any case (default: every layer)")
    args = p.parse_args(argv)
    check_output(args.output)
    layers = None
    if args.layers:
        # (case-insensitive: gelu, GeLU and GELU name one row; the table keeps the row's own spelling)
        by_lower = {name.lower(): name for name in LAYERS}
        given = [name.strip() for name in args.layers.split(",") if name.strip()]
        unknown = [name for name in given if name.lower() not in by_lower]
        layers = [by_lower[name.lower()] for name in given if name.lower() in by_lower]
        if unknown or not given:
            fail(f"--layers {args.layers!r}: unknown {', '.join(unknown) or '(none given)'}; "
                 f"valid: {', '.join(LAYERS)}")
    if args.baseline_tree and args.python_functions:
        fail("--baseline-tree and --python-functions are two different comparisons: pick one")
    if args.python_functions:
        table = compare_paths(args.reps, args.rounds, layers)
    elif args.baseline_tree:
        if not (Path(args.baseline_tree) / "mesa_train").is_dir():
            fail(f"--baseline-tree {args.baseline_tree} has no mesa_train package")
        table = compare(str(Path(__file__).resolve().parents[2]), args.baseline_tree, args.reps, args.rounds, layers)
    else:
        table = measure(args.reps, layers)
    print_and_save(markdown(table, args.baseline_tree, args.reps, args.rounds, args.python_functions), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
