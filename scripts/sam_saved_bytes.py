"""Bytes a full SAM ViT keeps for backward at its real input size: stock, Mesa with SAM's
attention routed generically (the bias kept as a mask), and Mesa with ``patch/sam.py``'s swap
(the bias rebuilt from the 8-bit q in backward). One fp32 training forward each, on CPU.
``--compile`` adds stock and Mesa compiled (fullgraph, aot_eager), counted by
``mesa_train.memory_compiled`` (what the compiled forward graph keeps for backward).

    PYTHONPATH=. OMP_NUM_THREADS=2 python scripts/sam_saved_bytes.py --img 1024   # ~10 GiB of RAM

``--img 1024`` is SAM's own size (N = 4096 tokens in the global blocks); smaller sizes run faster.
"""
from __future__ import annotations

import argparse
import copy

import timm
import torch

import mesa_train.patch.core as patch_core
from mesa_train.memory import format_bytes
from mesa_train.memory_compiled import compiled_saved_bytes
from mesa_train.patch import patch_model
from mesa_train.patch.report import measure_saved_bytes


def _saved(model: torch.nn.Module, x: torch.Tensor) -> int:
    return measure_saved_bytes(model, x).activation_bytes


def _patched_without_swap(model: torch.nn.Module) -> torch.nn.Module:
    """Mesa as it was before the swap: the generic routing keeps the N x N bias."""
    swap = patch_core.swap_sam_attention
    patch_core.swap_sam_attention = lambda module: False
    try:
        return patch_model(copy.deepcopy(model))
    finally:
        patch_core.swap_sam_attention = swap


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="samvit_base_patch16", help="a timm samvit_* model name")
    parser.add_argument("--img", type=int, default=512, help="input size in pixels (SAM's own: 1024)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="add compiled stock and compiled Mesa rows")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    stock = timm.create_model(args.model, img_size=args.img, pretrained=False).train()
    x = torch.randn(args.batch, 3, args.img, args.img)
    with torch.no_grad():  # timm starts the position tables at zero; give the bias values
        for name, p in stock.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 0.02)
    rows = [("stock", _saved(stock, x)),
            ("Mesa, bias kept as a mask", _saved(_patched_without_swap(stock), x)),
            ("Mesa, bias rebuilt from q (patch/sam.py)", _saved(patch_model(copy.deepcopy(stock)), x))]
    if args.compile:
        rows += [("stock, compiled", compiled_saved_bytes(copy.deepcopy(stock), x)),
                 ("Mesa (patch/sam.py), compiled", compiled_saved_bytes(patch_model(copy.deepcopy(stock)), x))]
    print(f"{args.model}, {args.img} px, batch {args.batch}, fp32: bytes kept for backward")
    print("| run | saved | vs stock |\n|---|---|---|")
    for label, saved in rows:
        print(f"| {label} | {format_bytes(saved)} | {saved / rows[0][1]:.3f}x |")


if __name__ == "__main__":
    main()
