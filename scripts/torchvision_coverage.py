"""Saved bytes of torchvision's classification models patched with the defaults, over stock,
and what each keeps whole (``mesa_train.patch.coverage``): the census behind DESIGN.md's
"torchvision's models". Dropout off (a dropout mask is kept as is), train mode, fp32.

    PYTHONPATH=. python scripts/torchvision_coverage.py [--size 224] [--batch 2] [MODEL ...]
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torchvision

from mesa_train.patch import patch_model
from mesa_train.patch.coverage import coverage

MODELS = ("resnet18", "resnext50_32x4d", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "efficientnet_v2_s",
          "regnet_y_400mf", "convnext_tiny", "maxvit_t", "vit_b_16", "swin_t", "swin_v2_t", "shufflenet_v2_x0_5",
          "mnasnet0_5", "densenet121", "googlenet", "inception_v3", "squeezenet1_0", "vgg11")


def _build(name: str) -> torch.nn.Module:
    kwargs = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=True)
    model = getattr(torchvision.models, name)(**kwargs)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--size", type=int, default=224, help="image side (inception_v3 needs >= 75)")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print("| model | saved bytes / stock | kept whole (module: share of stock bytes) | reported not reached |\n"
          "|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = _build(name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patch_model(model)
        try:
            report = coverage(model, torch.randn(args.batch, 3, args.size, args.size))
        except RuntimeError as err:  # (MaxViT: its 7x7 partitions need 224 px)
            print(f"| {name} | failed at --size {args.size}: {str(err).splitlines()[0][:200]} | | |", flush=True)
            continue
        left = ", ".join(f"{r[1]}: {r[3] / report.stock_total:.3f}" for r in report.rows
                         if r[0] != "compressed" and r[3] / report.stock_total >= 0.001)
        unreached = sum("not reached" in str(w.message) for w in caught)
        print(f"| {name} | {report.ratio:.3f} | {left or '-'} | {'yes' if unreached else '-'} |", flush=True)


if __name__ == "__main__":
    main()
