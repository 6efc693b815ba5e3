"""A model's training step with some Mesa layers on their C++ layer ops against the same layers
on their Python Functions, and against stock, in one process.

``--layers attention`` (the attention core: Softmax, MatMul, fused SDPA) ran its Python
``autograd.Function`` at 4 or 2 bits before session 55; ``--layers gated`` (the gated products,
``GatedActivation``: SwiGLU, gMLP, FocalNet, MambaOut, StarNet, CoaT) ran it in every format before
session 56; ``--layers star_relu`` (MetaFormer's StarReLU: ConvFormer, CAFormer), ``--layers affine``
(ResMLP's Affine), ``--layers normalize`` (cosine attention's F.normalize: XCiT, SwinV2) and
``--layers grn`` (ConvNeXt-V2's GlobalResponseNorm) before session 57; ``--layers einsum``
(MViTv2's relative-position einsums) before session 58; ``--layers scale_branch`` (a 1x1
depthwise conv linked to the BatchNorm after it: FastViT, MobileOne, RepViT), ``--layers
padded_conv`` (convs padded 'same' / 'valid': ConvMixer; and every Conv1d: EfficientViM, CoaT) and
``--layers groupnorm`` (the GroupNorms; PoolFormerV2's have no bias, which kept them off the op) and
``--layers rmsnorm`` (timm's RmsNorm: ViT-XP, Gemma-4, DeepSeek's ViT) before session 59;
``--layers gemma4`` (Gemma 4's Clamp and OneHotTable, layers with no quantizer) before session 60.
The script puts those layers back on that path ("python": their quantizers' ``fused_layer_args``
answers ``None``, what it answered then; a layer with no quantizer runs with the C++ layer ops
off) and times it, interleaved with the C++ path and the stock model, median of ``--steps``
steps each:

    python scripts/layer_path_ab.py --model deit_tiny_patch16_224 --bits 4 --attention explicit
    python scripts/layer_path_ab.py --layers gated --model focalnet_tiny_srf --bits 8
    python scripts/layer_path_ab.py --layers star_relu --model caformer_s18 --bits 8
    python scripts/layer_path_ab.py --layers einsum --model mvitv2_tiny --bits 8
    python scripts/layer_path_ab.py --layers scale_branch --model fastvit_t8 --bits 8
    python scripts/layer_path_ab.py --layers padded_conv --model convmixer_768_32 --bits 8
    python scripts/layer_path_ab.py --layers groupnorm --model poolformerv2_s12 --bits 8
    python scripts/layer_path_ab.py --layers gemma4 --model gemma4_vit_167m --bits 8
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

def linked_scale_branches(model):
    """The scale-branch convs ``patch_model`` linked to a BatchNorm (conv.ScaleLink), and those BatchNorms."""
    for m in model.modules():
        bn = m.__dict__.get("_mesa_scale_bn")
        if bn is not None:
            yield from (m, bn)


def padded_convs(model):
    """The convs padded by a string ('same', 'valid'), and every Conv1d."""
    return (m for m in model.modules()
            if isinstance(m, mnn.Conv1d) or (isinstance(m, mnn.Conv2d) and isinstance(m.padding, str)))


# the layers each --layers choice switches: their classes, or a function that finds them in the model
LAYER_SETS = {"attention": (mnn.Softmax, mnn.MatMul, mnn.ScaledDotProductAttention),
              "gated": (mnn.GatedActivation,), "star_relu": (mnn.StarReLU,), "affine": (mnn.Affine,),
              "normalize": (mnn.Normalize,), "grn": (mnn.GlobalResponseNorm,), "einsum": (mnn.Einsum,),
              "scale_branch": linked_scale_branches, "padded_conv": padded_convs, "groupnorm": (mnn.GroupNorm,),
              "rmsnorm": (mnn.RmsNorm,), "gemma4": (mnn.Clamp, mnn.OneHotTable)}


def python_path_switch(model, layers):
    """A one-element list: while its item is True, the quantizers of the ``layers`` (a
    ``LAYER_SETS`` entry) answer ``fused_layer_args`` with ``None``, and those layers that have
    no quantizer (Gemma 4's Clamp and OneHotTable: masks and positions) run with the C++ layer
    ops switched off: those layers run the Python Functions. Also the number switched."""
    found = list(layers(model) if callable(layers) else (m for m in model.modules() if isinstance(m, layers)))
    chosen = {id(q) for m in found for q in m.quantizers()}
    real = quantizer_mod.ActivationQuantizer.fused_layer_args
    switch = [False]

    def fused_layer_args(self, x):
        return None if switch[0] and id(self) in chosen else real(self, x)

    quantizer_mod.ActivationQuantizer.fused_layer_args = fused_layer_args
    plain = [m for m in found if not list(m.quantizers())]
    for layer in plain:
        layer.forward = _on_python_path_while(switch, layer.forward)
    return switch, len(chosen) + len(plain)


def _on_python_path_while(switch, forward):
    """``forward`` run with the C++ layer ops off (``quantizer._FUSED_LAYERS``) while ``switch[0]``."""
    def switched(*args, **kwargs):
        if not switch[0]:
            return forward(*args, **kwargs)
        real = quantizer_mod._FUSED_LAYERS
        quantizer_mod._FUSED_LAYERS = False
        try:
            return forward(*args, **kwargs)
        finally:
            quantizer_mod._FUSED_LAYERS = real
    return switched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="attention", choices=sorted(LAYER_SETS),
                    help="which layers switch between their C++ ops and Python Functions")
    ap.add_argument("--model", default="deit_tiny_patch16_224")
    ap.add_argument("--bits", type=int, default=4, choices=(8, 4, 2))
    ap.add_argument("--attention", default="explicit", choices=("explicit", "auto"),
                    help="explicit: Softmax + MatMul (the paper's attention); auto: timm's fused SDPA")
    ap.add_argument("--img-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()

    torch.manual_seed(0)
    try:
        stock = timm.create_model(args.model, num_classes=10, img_size=args.img_size).train()
    except TypeError:  # a convnet-like model (FocalNet, MambaOut, MetaFormer) takes any size untold
        stock = timm.create_model(args.model, num_classes=10).train()
    if args.attention == "explicit":  # the stock model on the same path
        for m in stock.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
    mesa = patch_model(copy.deepcopy(stock), bits=args.bits, attention=args.attention).train()
    switch, n_chosen = python_path_switch(mesa, LAYER_SETS[args.layers])
    x = torch.randn(args.batch, 3, args.img_size, args.img_size)

    def step(model, python_path=False):
        switch[0] = python_path
        start = time.perf_counter()
        model(x).sum().backward()
        return 1000 * (time.perf_counter() - start)

    runs = {"stock": (stock, False), f"mesa, {args.layers} on Python Functions": (mesa, True),
            f"mesa, {args.layers} on C++ ops": (mesa, False)}
    times = {name: [] for name in runs}
    for i in range(args.steps + 2):  # two warm-up rounds
        for name, (model, python_path) in runs.items():
            t = step(model, python_path)
            if i >= 2:
                times[name].append(t)
    base = statistics.median(times["stock"])
    print(f"{args.model}, {args.bits} bits, attention={args.attention}, {args.img_size}px, batch {args.batch}, "
          f"{n_chosen} layers/quantizers switched ({args.layers}), median of {args.steps} steps")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:44s} {ms:8.1f} ms  {ms / base:.2f}x stock")


if __name__ == "__main__":
    main()
