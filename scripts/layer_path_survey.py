"""Which Mesa layers of a patched timm model run as C++ layer ops in eager training, and which still
run Python ``autograd.Function``s (each of those costs about twice the host time: results/overhead/
cpu-paths.md). One patched training forward per model, then a walk of its backward graph, counting
the nodes by name (a C++ node is ``CppNode<mesa::...XxxTrain>``, a Python one ``_XxxFnBackward``):

    python scripts/layer_path_survey.py caformer_s18 xcit_nano_12_p16_224 --bits 4

Sessions 56 and 57 chose their work from this survey (DESIGN.md, "The gated products")."""
from __future__ import annotations

import argparse
import collections

import timm
import torch

from mesa_train.patch import patch_model

_CPP_PREFIX = "torch::autograd::CppNode<mesa::(anonymous namespace)::"


def mesa_nodes(model: torch.nn.Module, x: torch.Tensor) -> dict[str, collections.Counter]:
    """``{"C++": Counter(op node: count), "Python": Counter(Function: count)}`` for one forward of
    ``model`` (its Mesa layers' autograd nodes; stock nodes are not counted)."""
    y = model(x)
    found = {"C++": collections.Counter(), "Python": collections.Counter()}
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name()
        if name.startswith(_CPP_PREFIX):
            found["C++"][name[len(_CPP_PREFIX):].rstrip(">")] += 1
        elif name.startswith("_") and name.endswith("FnBackward"):
            found["Python"][name[1:-len("Backward")]] += 1
        stack += [nxt for nxt, _ in node.next_functions]
    return found


def build(name: str, img_size: int) -> torch.nn.Module:
    try:
        return timm.create_model(name, num_classes=5, img_size=img_size)
    except TypeError:  # a model that takes any input size without being told (convnets, MetaFormer)
        return timm.create_model(name, num_classes=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="timm model names")
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4, 2))
    ap.add_argument("--img-size", type=int, default=64)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    for name in args.models:
        try:
            model = patch_model(build(name, args.img_size).train(), bits=args.bits)
        except RuntimeError as e:  # (timm: an unknown model name)
            raise SystemExit(f"error: {name}: {e}") from None
        found = mesa_nodes(model, torch.randn(2, 3, args.img_size, args.img_size))
        python = ", ".join(f"{n} {c}" for n, c in found["Python"].most_common()) or "none"
        print(f"{name}: {sum(found['C++'].values())} C++ layer op nodes; on Python Functions: {python}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
