"""What a whole-model torch.compile costs before any code is generated: Dynamo tracing,
AOTAutograd and Inductor's min-cut partitioner (no-op compilers), for a DeiT-S stock or
patched with every op and the compression as the extension's ops or traced PyTorch (bf16
autocast, batch 2, 32x32 images: the cost depends on the graph, not the tensor sizes).

    python scripts/trace_cost.py --mode traceable --depth 2   # seconds and graph sizes
    python scripts/trace_cost.py --mode traceable --estimator delayed   # its one-pass traced form

Prints the first forward's and the backward's wall time and the nodes of the forward and
backward graphs (the figures quoted for mesa::estimate_and_seed in compile_kernels.py).
"""
from __future__ import annotations

import argparse
import time

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from mesa_train.models import build_model
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.patch import patch_model
from mesa_train.quant.compile_kernels import CHOICES, set_compile_kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("stock", *CHOICES), default="traceable",
                    help="stock, or Mesa (all ops) with these compiled compression kernels")
    ap.add_argument("--depth", type=int, default=2, help="DeiT-S blocks")
    ap.add_argument("--estimator", choices=("running", "delayed"), default="running",
                    help="Mesa's estimator; delayed: one eager step and mark_estimates_ready first, so the "
                         "traced one-pass form is what compiles")
    args = ap.parse_args(argv)

    nodes = {}

    def count(name):
        def compiler(gm, example_inputs):
            nodes[name] = len(gm.graph.nodes)
            return gm
        return compiler

    backend = aot_autograd(fw_compiler=count("forward"), bw_compiler=count("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    model = build_model("deit_s", fused_attn=False, img_size=32, num_classes=10, depth=args.depth)
    if args.mode != "stock":
        patch_model(model, ops=["all"], estimator=args.estimator)
        set_compile_kernels(args.mode)
        if args.estimator == "delayed":  # the estimates initialized, as after a first training step
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(2, 3, 32, 32)).sum().backward()
            mark_estimates_ready(model)
            model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16, as the GPU presets train
        out = compiled(torch.randn(2, 3, 32, 32))
    forward_s = time.perf_counter() - start
    out.sum().backward()
    total_s = time.perf_counter() - start
    print(f"{args.mode} {args.estimator} depth={args.depth}: trace+partition {forward_s:.1f} s "
          f"(with backward {total_s:.1f} s), "
          f"nodes forward {nodes.get('forward')} backward {nodes.get('backward')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
