"""Time to the first compiled-autograd step of a patched timm model whose forward runs eagerly
inside a compiled function (``torch.compiler.disable``, as a graph break would), with
``torch._dynamo.config.compiled_autograd`` set: its layers on their Python Functions (what
``quantizer.fused_layers_on`` gives inside compiled autograd's context since session 84),
against the C++ layer ops' nodes (session 83's behaviour, forced here), and the stock model.

    python scripts/compiled_autograd_time.py [model ...]   (default: resnet10t mobileone_s0)

fp32, batch 2, 64 px, backend aot_eager, CPU. Each row: seconds of the first step (capture and
compile of the backward included), of a second step (Dynamo compiles once more there) and of a
third (cached: the steady step), the graphs Dynamo compiled
(``counters["stats"]["unique_graphs"]``: the step's own pieces around the eager forward, and
the backward's, one more per opaque C++ node it calls), and the cosine of all the gradients
together against the stock model's (in its own run; the same seeds). A row reads "> limit" when
the way ran past ``--limit`` seconds.
"""
from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import queue as queue_mod
import tempfile
import time

import timm
import torch
import torch.nn.functional as F

DEFAULT_MODELS = ("resnet10t", "mobileone_s0")
WAYS = ("stock", "python functions", "cpp nodes")


def _run(name: str, way: str, grads_file: str, queue) -> None:
    """One way in a fresh process (compiled autograd's caches and Dynamo's counters start empty)."""
    from torch._dynamo.utils import counters

    from mesa_train.nn import quantizer as quantizer_mod
    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=10).train()
    model = stock if way == "stock" else patch_model(copy.deepcopy(stock)).train()
    if way == "cpp nodes":  # session 83: the C++ nodes inside compiled autograd's context too
        quantizer_mod.fused_layers_on = lambda: quantizer_mod._FUSED_LAYERS and not torch.compiler.is_compiling()
    x = torch.randn(2, 3, 64, 64)
    eager_forward = torch.compiler.disable(model)

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        eager_forward(x).square().sum().backward()

    seconds = []
    with torch._dynamo.config.patch(compiled_autograd=True):  # (read when torch.compile is called)
        compiled = torch.compile(step, backend="aot_eager")
        for _ in range(3):
            start = time.perf_counter()
            compiled()
            seconds.append(time.perf_counter() - start)
    torch.save(torch.cat([p.grad.flatten() for p in model.parameters()]), grads_file)
    queue.put((seconds, counters["stats"]["unique_graphs"]))


def _timed(name: str, way: str, limit: float):
    """``(seconds of the three steps, graphs, gradients)`` of one way, or ``None`` past ``limit``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        grads_file = os.path.join(tmp, "grads.pt")
        proc = ctx.Process(target=_run, args=(name, way, grads_file, queue))
        proc.start()
        try:
            seconds, graphs = queue.get(timeout=limit)
        except queue_mod.Empty:
            return None
        finally:
            proc.kill()
            proc.join()
        return seconds, graphs, torch.load(grads_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--limit", type=float, default=900.0, help="seconds a way may run (default 900)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CPU, fp32, batch 2, 64 px, aot_eager")
    print("| model | way | first step (s) | second step (s) | third step (s) | graphs compiled "
          "| gradients' cosine to stock |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        stock_grads = None
        for way in WAYS:
            got = _timed(name, way, args.limit)
            if got is None:
                print(f"| `{name}` | {way} | > {args.limit:.0f} | - | - | - | - |", flush=True)
                continue
            (first, second, third), graphs, grads = got
            stock_grads = grads if way == "stock" else stock_grads
            cos = F.cosine_similarity(grads.double(), stock_grads.double(), 0).item()
            print(f"| `{name}` | {way} | {first:.1f} | {second:.2f} | {third:.3f} | {graphs} | {cos:.5f} |",
                  flush=True)


if __name__ == "__main__":
    main()
