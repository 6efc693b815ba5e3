"""Where a Mesa copy duplicates a tensor another module keeps in full (``Coverage.duplicated``):
the test-zoo models (``tests/timm_zoo.py``) patched with all ops, then op subsets on a few full
timm models. Such a copy adds bytes instead of saving them; with a subset (``ops=["conv"]`` on a
ReLU convnet) the patched model can keep more than stock. Train mode, fp32, the zoo's inputs.
The last column: the same model after ``skip_duplicated`` (``patch/duplicates.py``: the layers
every copy of which another module keeps in full go stock, and attentions built fused that the ops
moved to the explicit path go back, where that lowers the bytes).

    PYTHONPATH=.:tests python scripts/duplicated_copies.py [--zoo] [--subsets] > results/timm/duplicated.md
"""
from __future__ import annotations

import argparse
import copy
import warnings

import timm
import torch

from mesa_train.memory import format_bytes
from mesa_train.patch import patch_model
from mesa_train.patch.coverage import coverage
from mesa_train.patch.duplicates import skip_duplicated
from timm_zoo import ZOO, build, example

# (model, image side, op subsets): a ReLU convnet, a RepVGG-style one, a ViT on fused attention
SUBSETS = (("resnet18", 64, (["conv"], ["conv", "relu"], ["batchnorm"], ["conv", "batchnorm"], ["all"])),
           ("mobileone_s0", 64, (["conv"], ["conv", "relu"], ["batchnorm"], ["conv", "batchnorm"],
                                 ["conv", "batchnorm", "relu"], ["all"])),
           ("deit_tiny_patch16_224", 224, (["linear"], ["gelu", "softmax"], ["softmax"], ["linear", "sdpa"], ["all"])))


def _row(name: str, ops, model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """The table row, and whether the model had duplicated copies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (functional ops not reached: describe's business)
        patch_model(model, ops=ops)
    cov = coverage(model, x)
    found = "; ".join(f"{n} {op} layers, {format_bytes(b)} ({', '.join(f'{k} {c}' for k, c in kinds.items())}"
                      f"{'; ask ' + ', '.join(asks) if asks else ''})" for op, n, b, kinds, asks in cov.duplicated)
    share = sum(r[2] for r in cov.duplicated) / max(cov.stock_total, 1)
    result = skip_duplicated(model, x)
    left = [f"{op} {len(names)}" for op, names in sorted(result.layers.items())]
    left += [f"{len(result.fused_back)} attentions fused as built"] if result.fused_back else []
    left += [f"{len(result.full_operands)} matmul operands in full"] if result.full_operands else []
    skipped = f"{coverage(model, x).ratio:.3f} ({', '.join(left) or 'none'})"
    return (f"| {name} | {','.join(ops)} | {cov.ratio:.3f} | {share:.4f} | {found or '-'} | {skipped} |",
            bool(cov.duplicated))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="the test zoo with all ops (rows with duplicates only)")
    parser.add_argument("--subsets", action="store_true", help="op subsets on full timm models")
    parser.add_argument("--batch", type=int, default=2, help="batch of the subsets' inputs")
    args = parser.parse_args()
    header = ("| model | ops | saved bytes / stock | duplicated / stock | duplicated copies (kept in full by; "
              "ops to ask) | after skip_duplicated (layers left stock) |\n|---|---|---|---|---|---|")
    if args.subsets or not args.zoo:
        print(f"Op subsets (batch {args.batch}):\n\n{header}")
        for name, size, subsets in SUBSETS:
            torch.manual_seed(0)
            stock = timm.create_model(name, pretrained=False).train()
            x = torch.randn(args.batch, 3, size, size, generator=torch.Generator().manual_seed(1))
            for ops in subsets:
                print(_row(name, ops, copy.deepcopy(stock), x)[0], flush=True)
    if args.zoo or not args.subsets:
        print(f"\nThe test zoo ({len(ZOO)} models), all ops; the models with duplicated copies:\n\n{header}")
        for name in ZOO:
            line, duplicated = _row(name, ["all"], build(name), example(name))
            if duplicated:
                print(line, flush=True)


if __name__ == "__main__":
    main()
