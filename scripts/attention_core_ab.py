"""A ViT's training step with its attention core (Softmax, MatMul, fused SDPA) on the C++ layer
ops against the same layers on their Python Functions, and against stock, in one process.

Before session 55 the attention core ran its Python ``autograd.Function`` at 4 or 2 bits (the
C++ ops took the default 8-bit format only); this script puts those layers back on that path
("python": their quantizers' ``fused_layer_args`` answers ``None``, what it answered then) and
times it, interleaved with the C++ path and the stock model, median of ``--steps`` steps each:

    python scripts/attention_core_ab.py --model deit_tiny_patch16_224 --bits 4 --attention explicit
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import timm
import torch

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

CORE = (mnn.Softmax, mnn.MatMul, mnn.ScaledDotProductAttention)


def python_core_switch(model):
    """A one-element list: while its item is True, the attention core's quantizers answer
    ``fused_layer_args`` with ``None`` (their layers run the Python Functions)."""
    core = {id(q) for m in model.modules() if isinstance(m, CORE) for q in m.quantizers()}
    real = quantizer_mod.ActivationQuantizer.fused_layer_args
    switch = [False]

    def fused_layer_args(self, x):
        return None if switch[0] and id(self) in core else real(self, x)

    quantizer_mod.ActivationQuantizer.fused_layer_args = fused_layer_args
    return switch, len(core)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deit_tiny_patch16_224")
    ap.add_argument("--bits", type=int, default=4, choices=(8, 4, 2))
    ap.add_argument("--attention", default="explicit", choices=("explicit", "auto"),
                    help="explicit: Softmax + MatMul (the paper's attention); auto: timm's fused SDPA")
    ap.add_argument("--img-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()

    torch.manual_seed(0)
    stock = timm.create_model(args.model, num_classes=10, img_size=args.img_size).train()
    if args.attention == "explicit":  # the stock model on the same path
        for m in stock.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
    mesa = patch_model(copy.deepcopy(stock), bits=args.bits, attention=args.attention).train()
    switch, n_core = python_core_switch(mesa)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size)

    def step(model, python_core=False):
        switch[0] = python_core
        start = time.perf_counter()
        model(x).sum().backward()
        return 1000 * (time.perf_counter() - start)

    runs = {"stock": (stock, False), "mesa, core on Python Functions": (mesa, True),
            "mesa, core on C++ ops": (mesa, False)}
    times = {name: [] for name in runs}
    for i in range(args.steps + 2):  # two warm-up rounds
        for name, (model, python_core) in runs.items():
            t = step(model, python_core)
            if i >= 2:
                times[name].append(t)
    base = statistics.median(times["stock"])
    print(f"{args.model}, {args.bits} bits, attention={args.attention}, {args.img_size}px, batch {args.batch}, "
          f"{n_core} attention-core quantizers, median of {args.steps} steps")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:32s} {ms:8.1f} ms  {ms / base:.2f}x stock")


if __name__ == "__main__":
    main()
