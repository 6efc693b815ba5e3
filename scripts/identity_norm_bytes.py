"""Saved bytes of the timm models whose identity-branch BatchNorm session 83 made hand its copy
of the block input to the block's convs (``patch/identity_norm.py``), against the same patched
model with those BatchNorms unmarked (each conv then keeps, between them, a second copy).
``--take``: FastViT and GhostNetV3, against the same model with only its taking BatchNorms
unmarked (session 85, ``TAKES_INPUT``: FastViT's RepMixer norms keep the codes the mixer's identity
BatchNorm offered, GhostNetV3's ``cheap_rpr_skip`` those its scale conv made).

    python scripts/identity_norm_bytes.py [--take]

fp32, train mode, batch 2, 64 px, ``SavedTensorMeter`` bytes over the stock model's, in the same
run; one markdown row per model, with the cosine of all parameter gradients together against
stock's (float32), before and after, and the worst single tensor's against a float64 stock copy
over the parameters whose float32 stock gradient agrees with float64 (cosine > 0.999).
"""
from __future__ import annotations

import argparse
import copy

import timm
import torch
import torch.nn.functional as F

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.batchnorm import OFFERS_INPUT, TAKES_INPUT
from mesa_train.patch import patch_model

MODELS = ("mobileone_s0", "mobileone_s1", "repvgg_a0", "repvgg_b0", "fastvit_t8", "fastvit_sa12")
TAKERS = ("ghostnetv3_050",)  # (--take only, beside FastViT: GhostNetV3's cheap_rpr_skip)


def step(model, x) -> tuple[int, dict]:
    """Saved bytes of one training step and its parameter gradients (float64 copies)."""
    torch.manual_seed(1)
    with SavedTensorMeter(model) as meter:
        model(x).square().sum().backward()
    return meter.activation_bytes, {n: p.grad.double().flatten() for n, p in model.named_parameters()}


def unmarked(model, flags=(OFFERS_INPUT, TAKES_INPUT)):
    model = copy.deepcopy(model)
    for m in model.modules():
        for flag in flags:
            m.__dict__.pop(flag, None)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--take", action="store_true", help="FastViT: before = its RepMixer norms unmarked only")
    args = parser.parse_args()
    flags = (TAKES_INPUT,) if args.take else (OFFERS_INPUT, TAKES_INPUT)
    print(f"| model | {'taking BatchNorms' if args.take else 'identity BatchNorms'} | bytes before | bytes after "
          "| all gradients' cosine before | after | worst tensor's cosine (float64) before | after |")
    print("|---|---|---|---|---|---|---|---|")
    names = [m for m in MODELS if m.startswith("fastvit")] + list(TAKERS) if args.take else list(MODELS)
    for name in names:
        torch.manual_seed(0)
        stock = timm.create_model(name, num_classes=10).train()
        after = patch_model(copy.deepcopy(stock)).train()
        before = unmarked(after, flags)
        marked = sum(bool(m.__dict__.get(flags[0])) for m in after.modules())
        x = torch.randn(2, 3, 64, 64)
        _, exact = step(copy.deepcopy(stock).double(), x.double())
        stock_bytes, fp32 = step(stock, x)
        (b_bytes, b_grads), (a_bytes, a_grads) = step(before, x), step(after, x)

        def cos(a, b):
            return F.cosine_similarity(a, b, 0).item()

        def concat(grads):
            return torch.cat([grads[n] for n in fp32])

        measured = [n for n in exact if exact[n].norm() > 0 and cos(fp32[n], exact[n]) > 0.999]
        worst = [min(cos(g[n], exact[n]) for n in measured) for g in (b_grads, a_grads)]
        print(f"| `{name}` | {marked} | {b_bytes / stock_bytes:.3f}x | {a_bytes / stock_bytes:.3f}x "
              f"| {cos(concat(b_grads), concat(fp32)):.5f} | {cos(concat(a_grads), concat(fp32)):.5f} "
              f"| {worst[0]:.4f} | {worst[1]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
