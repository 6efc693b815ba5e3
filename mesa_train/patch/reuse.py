"""Mesa layers that one forward calls more than once take per-sample ranges.

A quantizer's running range (``estimator="running"``, the paper's, or ``"delayed"``) is one
(alpha, beta) pair per group, a moving average over the calls. A module that a forward calls
twice on different inputs averages two distributions into one range: RegionViT's attention
runs on the 16 region tokens, then on 50-token windows whose attention maps peak 4-5x higher,
and the windows' maps were clamped to the regions' range (a block's LayerNorm weight gradient
at cosine 0.43 against stock's). timm has such modules too: CoaT's shared convolutional
position encodings and ``mlp2``, EfficientViT's ``PatchMerging.act`` and ``LiteMLA.kernel_func``,
MViTv2's relative-position einsum, Gemma 4's clamps.

``watch_reuse(root)`` (installed by ``patch_model``) counts, during the first eager training
forward of ``root``, how often each Mesa layer that keeps a running range is called. A layer
is switched to ``estimator="per_sample"`` (each call's own statistics: the paper's Table 2
ablation, nothing clamped) at its second call, before that call compresses: its first call
started the running range from its own batch, so no call of the first step is clamped. One
warning at the end of that forward lists the layers. The counting hooks
exist for that one forward only (no cost afterwards). Not under ``torch.compile``: a compiled
first forward is traced, so the check waits for an eager one (give such models
``estimator="per_sample"`` yourself).
"""
from __future__ import annotations

import collections
import warnings

import torch
from torch import nn

from mesa_train.memory import INPUT_AGNOSTIC_HOOK
from mesa_train.nn import MesaLayer

__all__ = ["watch_reuse", "reused_layers", "calls_repeat_one_input", "RANGE_ESTIMATORS"]

# the estimators whose range is one moving average over the calls (what a second call disturbs)
RANGE_ESTIMATORS = ("running", "delayed")
# set on a layer that patch_model calls several times a forward on one tensor by design (MViTv2's
# and SAM's rel-pos einsum child: the same q with rel_h, then rel_w): one distribution, not counted
REPEATS_ONE_INPUT = "mesa_calls_repeat_one_input"
_active: list = []  # the session under way: [root, {layer name: calls}, layer hook handles]


def watch_reuse(root: nn.Module) -> None:
    """Count the Mesa layers' calls in ``root``'s next eager training forward (see the module
    doc); once per root, again after a later ``patch_model`` of it."""
    if _watched(root):
        return
    root.register_forward_pre_hook(_start, prepend=True)
    root.register_forward_hook(_finish, always_call=True)


def _watched(m: nn.Module) -> bool:
    # (found by the hook functions themselves, not handles: a deep copy of the model, as
    # ModelEmaV3 makes, has its own hook dicts, and a copied handle would remove the original's)
    return any(h is _start for h in m._forward_pre_hooks.values())


def calls_repeat_one_input(layer: MesaLayer) -> MesaLayer:
    """Mark ``layer`` as called several times a forward on the same input (see
    ``REPEATS_ONE_INPUT``); returns it."""
    object.__setattr__(layer, REPEATS_ONE_INPUT, True)
    return layer


def reused_layers(root: nn.Module) -> dict[str, MesaLayer]:
    """The Mesa layers of ``root`` whose range a second call would disturb: running or delayed
    estimates on channel groups, at least one quantizer (a ReLU's bit mask has no range)."""
    return {name: m for name, m in root.named_modules()
            if isinstance(m, MesaLayer) and m.quantizers() and m.quant_options.layout == "channel"
            and m.quant_options.estimator in RANGE_ESTIMATORS}


def _holders(root: nn.Module) -> dict[str, tuple[nn.Module, list]]:
    """Each module below ``root`` that holds range-keeping Mesa layers (itself or inside it),
    with them. Modules, not only the layers, are counted: a patched block may run its layers
    inside one op without calling them (the norm and qkv of a shared copy)."""
    layers = reused_layers(root)
    holders: dict[str, tuple[nn.Module, list]] = {}
    for name, module in root.named_modules():
        if name and not getattr(module, REPEATS_ONE_INPUT, False):
            inside = [m for n, m in layers.items() if n == name or n.startswith(name + ".")]
            if inside:
                holders[name] = (module, inside)
    return holders


def _start(root: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or _active or not (root.training and torch.is_grad_enabled()):
        return  # (traced; an inner root's forward within the session under way; eval)
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in root.modules()):
        _stop_watching(root)  # blocks compiled in place (compile_scope "blocks"): hooks would be traced
        return
    holders = _holders(root)
    if not holders:
        _stop_watching(root)
        return
    calls: collections.Counter = collections.Counter()
    hooks = [m.register_forward_pre_hook(_counter(calls, name, inside)) for name, (m, inside) in holders.items()]
    _active.append((root, calls, hooks, holders))


def _counter(calls, name, inside):
    def count(module, args):
        if not torch.is_grad_enabled():  # (a call under no_grad keeps nothing)
            return
        calls[name] += 1
        if calls[name] == 2:  # before this call compresses: the first step's second call is not clamped either
            for layer in inside:
                if layer.quant_options.estimator in RANGE_ESTIMATORS:
                    layer.set_quant_options(estimator="per_sample")
    # reads no argument: a patched block still runs norm + Linear as one call (layernorm_linear.plain_call),
    # so the first forward saves what every later one does (activation checkpointing compares them)
    setattr(count, INPUT_AGNOSTIC_HOOK, True)
    return count


def _finish(root: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling() or not _active or _active[0][0] is not root:
        return
    _, calls, hooks, holders = _active.pop()
    for h in hooks:
        h.remove()
    _stop_watching(root)
    reused = [name for name, n in calls.items() if n > 1]
    # the outermost modules called again (their children ran again with them)
    outer = [n for n in reused if not any(n.startswith(o + ".") for o in reused)]
    if outer:
        switched = {id(m) for n in outer for m in holders[n][1]}
        names = ", ".join(f"{n} ({type(holders[n][0]).__name__}, {calls[n]} calls)" for n in outer)
        warnings.warn(
            f"mesa_train: module(s) of {type(root).__name__} ran more than once in one forward: {names}. One "
            "running range cannot follow each call's inputs (the larger ones were clamped), so their "
            f"{len(switched)} Mesa layer(s) now use estimator='per_sample' (each call's own ranges). To keep "
            "running ranges, give each call its own module", UserWarning, stacklevel=2)


def _stop_watching(root: nn.Module) -> None:
    """Remove the watch of ``root`` and of every root inside it (patched on its own before)."""
    for m in root.modules():
        if not _watched(m):
            continue
        for key in [k for k, h in m._forward_pre_hooks.items() if h is _start]:
            del m._forward_pre_hooks[key]
        for key in [k for k, h in m._forward_hooks.items() if h is _finish]:
            del m._forward_hooks[key]
            m._forward_hooks_always_called.pop(key, None)
