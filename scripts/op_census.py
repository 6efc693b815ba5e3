"""Which ops a patched model dispatches in one eager training step that the stock model does
not (and the reverse), by (op, input shapes, output dtype), with where each was called from:
the tool that found MatMul's second copy of q, k, v (no GPU needed).

    python scripts/op_census.py                        # DeiT-S, 1 block, batch 4, bf16 autocast
    python scripts/op_census.py --model swin_ti --depth 0 --ops linear gelu --autocast none

Each row: count in the stock step, count in the Mesa step, the op with the shapes of its
first two tensor inputs and its output dtype, and the MB it reads and writes per call (tensor
arguments plus outputs: an upper bound on its memory traffic), then the Python line (in
mesa_train or timm) or the autograd node that issued it. View ops and allocations are
left out. A Mesa op that runs other ops (``mesa::compress``) counts as one row; its kernels
are the ones tests/op_recorder.py lists. CPU dispatch: under CUDA autocast some ops (LayerNorm,
softmax) run in float32 instead, so dtypes and MB can differ on a GPU, the op counts do not.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mesa_train.models import build_model
from mesa_train.patch import OPS, patch_model

# metadata-only ops and allocations: no pass over data
NOT_A_PASS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.unsqueeze", "aten.squeeze", "aten.select", "aten.slice", "aten.detach", "aten.alias",
    "aten.unbind", "aten.split", "aten.as_strided", "aten.reshape", "aten.empty", "aten.new_empty",
    "aten.empty_strided", "aten.promote_types",
}
Key = tuple  # (op, input shapes, output dtype)


class Census(TorchDispatchMode):
    """Counts (op, shapes, dtype) keys, their per-call MB and where they were called from."""

    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()
        self.mb: dict[Key, float] = {}
        self.where: dict[Key, set] = collections.defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in NOT_A_PASS:
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        key = (name, tuple(tuple(t.shape) for t in tensors[:2]),
               str(outs[0].dtype).removeprefix("torch.") if outs else "")
        self.count[key] += 1
        self.mb[key] = sum(t.numel() * t.element_size() for t in tensors + outs) / 1e6
        self.where[key].add(_caller())
        return out


def _caller() -> str:
    """The innermost mesa_train / timm frame, else the autograd node running (backward)."""
    frames = [f for f in traceback.extract_stack() if "mesa_train" in f.filename or "/timm/" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("op_census.py")]
    if frames:
        f = frames[-1]
        return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
    node = torch._C._current_autograd_node()
    return f"backward of {node.name()}" if node is not None else "?"


def census(model: torch.nn.Module, x: torch.Tensor, autocast: str) -> Census:
    """One warm-up step (estimates, lazy state), then the recorded step."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)
    for record in (False, True):
        mode = Census()
        with mode if record else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            out.float().sum().backward()
    return mode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deit_s", help="a mesa_train.models name or a timm name (default deit_s)")
    ap.add_argument("--depth", type=int, default=1, help="blocks (default 1); 0: the model's own")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--img-size", type=int, default=None,
                    help="input size (default 224); also passed to the model, which not every timm model takes")
    ap.add_argument("--ops", nargs="+", default=["all"], help=f"Mesa ops, of {', '.join(OPS)} or all")
    ap.add_argument("--fused-attn", action="store_true",
                    help="timm's fused attention (with --ops sdpa); default: the explicit attention")
    ap.add_argument("--autocast", choices=("bf16", "fp16", "none"), default="bf16")
    args = ap.parse_args(argv)
    bad = [o for o in args.ops if o not in (*OPS, "all")]
    if bad:
        ap.error(f"unknown ops {bad}; valid: {', '.join(OPS)}, all")

    def build():
        torch.manual_seed(0)
        depth = {"depth": args.depth} if args.depth else {}
        return build_model(args.model, fused_attn=args.fused_attn, img_size=args.img_size,
                           **depth)  # (None: not passed)

    try:
        build()
    except ValueError as err:  # an unknown model or an override it does not take: one line
        ap.error(str(err))
    size = args.img_size or 224
    x = torch.randn(args.batch, 3, size, size)
    stock = census(build(), x, args.autocast)
    mesa = census(patch_model(build(), ops=args.ops), x, args.autocast)
    rows = [k for k in sorted(set(stock.count) | set(mesa.count)) if stock.count[k] != mesa.count[k]]
    print(f"{args.model}, depth {args.depth or 'all'}, batch {args.batch}, {size}px, autocast {args.autocast}, "
          f"Mesa ops {' '.join(args.ops)}: {len(rows)} (op, shapes, dtype) keys differ")
    print(f"{'stock':>5} {'mesa':>5} {'MB/call':>8}  op [shapes] -> dtype  @ called from")
    for k in rows:
        where = sorted(stock.where.get(k, set()) | mesa.where.get(k, set()))
        mb = mesa.mb.get(k, stock.mb.get(k, 0.0))
        print(f"{stock.count[k]:5d} {mesa.count[k]:5d} {mb:8.2f}  {k[0]} {list(k[1])} -> {k[2]}  "
              f"@ {', '.join(where[:3])}")
    total = {name: sum(c.count[k] * c.mb[k] for k in c.count) for name, c in (("stock", stock), ("mesa", mesa))}
    print(f"MB read+written by all recorded ops: stock {total['stock']:.1f}, Mesa {total['mesa']:.1f} "
          f"({total['mesa'] / max(total['stock'], 1e-9):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
