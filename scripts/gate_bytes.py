"""Saved bytes of timm models whose channel gates session 82 routed through a ``mesa_gate``
(HGNet's ``EseModule``, GCNet's ``GlobalContext``), against the same patch without op ``se``.

    python scripts/gate_bytes.py

"before" is ``patch_model(model, ops=<every op but se>)``: for these models what the code before
session 82 did (their only ``se`` products are these gates; GlobalContext's attention pooling is
the generic capture's either way). fp32, train mode, batch 2, 64 px, ``SavedTensorMeter`` bytes
over the stock model's, in the same run; one markdown row per model, with the worst parameter
gradient cosine, before and after, against a float64 stock copy's, over the parameters whose
float32 stock gradient agrees with float64 (cosine > 0.999; the others are rounding noise of an
exact ~0).
"""
from __future__ import annotations

import copy

import timm
import torch
import torch.nn.functional as F

from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import OPS, patch_model

MODELS = ("hgnet_tiny", "hgnet_small", "gc_efficientnetv2_rw_t", "gcresnet33ts", "gcresnext26ts")


def saved_bytes(model, x) -> int:
    with SavedTensorMeter(model) as meter:
        model(x)
    return meter.activation_bytes


def gradients(model, x) -> dict:
    torch.manual_seed(1)
    model(x).square().sum().backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def main() -> None:
    print("| model | bytes before | bytes after | worst gradient cosine before | after |")
    print("|---|---|---|---|---|")
    for name in MODELS:
        torch.manual_seed(0)
        stock = timm.create_model(name, num_classes=5).train()
        before = patch_model(copy.deepcopy(stock), ops=[o for o in OPS if o != "se"])
        after = patch_model(copy.deepcopy(stock))
        x = torch.randn(2, 3, 64, 64)
        stock_bytes = saved_bytes(stock, x)
        exact, fp32 = gradients(copy.deepcopy(stock).double(), x.double()), gradients(stock, x)

        def cos(a, b):
            return F.cosine_similarity(a.flatten(), b.flatten(), 0).item()

        measured = [n for n in exact if exact[n].norm() > 0 and cos(fp32[n], exact[n]) > 0.999]
        worst = [min((cos(g[n], exact[n]), n) for n in measured) for g in (gradients(before, x), gradients(after, x))]
        print(f"| `{name}` | {saved_bytes(before, x) / stock_bytes:.3f}x | {saved_bytes(after, x) / stock_bytes:.3f}x "
              f"| {worst[0][0]:.4f} (`{worst[0][1]}`) | {worst[1][0]:.4f} (`{worst[1][1]}`) |", flush=True)


if __name__ == "__main__":
    main()
