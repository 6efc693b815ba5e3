"""Mesa layers that one forward calls more than once take per-sample ranges.

A quantizer's running range (``estimator="running"``, the paper's, or ``"delayed"``) is one
(alpha, beta) pair per group, a moving average over the calls. A module that a forward calls
twice on different inputs averages two distributions into one range: RegionViT's attention
runs on the 16 region tokens, then on 50-token windows whose attention maps peak 4-5x higher,
and the windows' maps were clamped to the regions' range (a block's LayerNorm weight gradient
at cosine 0.43 against stock's). In timm: CoaT's shared convolutional position encodings
(``cpe*``, ``crpe*``) and ``coat_tiny``'s ``mlp2`` (also its ``mlp3``, ``mlp4``).

``watch_reuse(root)`` (installed by ``patch_model``) counts, during the first eager training
forward of ``root``, the calls of each module that holds Mesa layers with a moving range. The
layers of a module called more than once switch to ``estimator="per_sample"`` (each call's own
statistics: the paper's Table 2 ablation, nothing clamped) at the start of the next training
forward, and one warning says so at the end of the first. Not at once: activation
checkpointing recomputes the first step's segments in its backward, and they must save what
the forward saved (same estimator, same shapes), so the first step keeps its running ranges
(its second call clamped, as without this module). The hooks read no argument (the memory
meter's input-agnostic mark: a patched block still fuses norm + Linear while watched) and go
with the switch: no cost afterwards.

Not watched: a forward under ``torch.compile`` (traced: the check waits for an eager one; blocks
compiled in place end it, their hooks would be traced into each block's graph), a reentrant
checkpoint's segment (its forward runs without gradients), ``nn.DataParallel`` replicas (they
share the model's hook dicts). :func:`probe_reuse` covers those and the clamped first step: one
forward of an example input in eval mode without gradients, before training, that switches at
once. The training runner and the bench call it after patching (a blank image of the run's
size), so a compiled run, a resumed run (the estimator is not in the format record) and the
first step of any run get the per-sample ranges. The switch is written in each layer's
``state_dict`` metadata (``per_sample_by_reuse``), so a model patched afresh takes it when it
loads a checkpoint (``load_state_dict``, no probe needed to resume). :func:`keep_running_ranges` turns
the check off for a model.
"""
from __future__ import annotations

import collections
import sys
import warnings
import weakref

import torch
from torch import nn

from mesa_train.memory import INPUT_AGNOSTIC_HOOK
from mesa_train.models import unwrap_module
from mesa_train.nn import MesaLayer
from mesa_train.nn._common import KEEP_RUNNING_RANGES
from mesa_train.warning_site import outside_stacklevel

__all__ = ["watch_reuse", "probe_reuse", "keep_running_ranges", "range_layers", "calls_repeat_one_input",
           "RANGE_ESTIMATORS"]

# the estimators whose range is one moving average over the calls (what a second call disturbs)
RANGE_ESTIMATORS = ("running", "delayed")
# set on a layer that patch_model calls several times a forward on one tensor by design (MViTv2's
# and SAM's rel-pos einsum child: the same q with rel_h, then rel_w): one distribution, not counted
REPEATS_ONE_INPUT = "mesa_calls_repeat_one_input"
# on the root between its first training forward and the next: the modules found called again
PENDING = "_mesa_reuse_pending"
# on every module of a model given to keep_running_ranges (a probe of a part of it sees it too)
KEEP = KEEP_RUNNING_RANGES
# the session under way: (weak reference to its root, {module name: calls}, counting hook
# handles, holders); weak and checked at each start, so an interrupted forward (Ctrl-C skips the
# always-call hook) neither keeps its model alive nor blocks the next model's watch
_active: list = []


def watch_reuse(root: nn.Module) -> None:
    """Count the calls in ``root``'s next eager training forward (see the module doc); once per
    root, again after a later ``patch_model`` of it."""
    for m in root.modules():  # (patched again: checked again, as the watch below)
        m.__dict__.pop(KEEP, None)
    if _watched(root):
        return
    root.register_forward_pre_hook(_start, prepend=True)
    root.register_forward_hook(_finish, always_call=True)


def keep_running_ranges(model: nn.Module) -> None:
    """Turn the check off for ``model``: reused modules keep one running range per layer (the
    paper's estimator as it is). Before its second training forward, this also cancels a switch
    the first one found."""
    root = unwrap_module(model, "keep_running_ranges")
    _stop_watching(root)
    root.__dict__.pop(PENDING, None)
    for m in root.modules():
        m.__dict__[KEEP] = True


def _watched(m: nn.Module) -> bool:
    # (found by the hook functions themselves, not handles: a deep copy of the model, as
    # ModelEmaV3 makes, has its own hook dicts, and a copied handle would remove the original's)
    return any(h is _start for h in m._forward_pre_hooks.values())


def calls_repeat_one_input(layer: MesaLayer) -> MesaLayer:
    """Mark ``layer`` as called several times a forward on the same input (see
    ``REPEATS_ONE_INPUT``); returns it."""
    object.__setattr__(layer, REPEATS_ONE_INPUT, True)
    return layer


def range_layers(root: nn.Module) -> dict[str, MesaLayer]:
    """The Mesa layers of ``root`` whose range a second call would disturb: running or delayed
    estimates on channel groups, at least one quantizer (a ReLU's bit mask has no range)."""
    return {name: m for name, m in root.named_modules()
            if isinstance(m, MesaLayer) and m.quantizers() and m.quant_options.layout == "channel"
            and m.quant_options.estimator in RANGE_ESTIMATORS}


def _holders(root: nn.Module) -> dict[str, tuple[nn.Module, list]]:
    """Each module below ``root`` that holds range-keeping Mesa layers (itself or inside it),
    with the names of those layers. Modules, not only the layers, are counted: a patched block
    may run its layers inside one op without calling them (the norm and qkv of a shared copy)."""
    inside: dict[str, list] = collections.defaultdict(list)
    for layer in range_layers(root):  # (each layer to itself and every module above it)
        parts = layer.split(".")
        for depth in range(1, len(parts) + 1):
            inside[".".join(parts[:depth])].append(layer)
    return {name: (module, inside[name]) for name, module in root.named_modules()
            if name and name in inside and not getattr(module, REPEATS_ONE_INPUT, False)}


def _in_backward() -> bool:
    """Whether autograd's engine is running (a checkpoint recomputing a segment)."""
    return torch._C._current_graph_task_id() != -1


def _start(root: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or not (root.training and torch.is_grad_enabled()) or _in_backward():
        return  # (traced; eval; a recomputation)
    if getattr(root, "_is_replica", False):
        return  # (nn.DataParallel: a replica shares the model's hook dicts, its options are its own)
    if _active:
        session_root = _active[0][0]()
        if session_root is not None and session_root is not root and any(m is root for m in session_root.modules()):
            return  # an inner root's forward within the session under way
        _end_session()  # left by an interrupted forward
    pending = root.__dict__.pop(PENDING, None)
    if pending is not None:  # the first forward found reuse: switch now, before anything compresses
        _switch(root, pending)
        _stop_watching(root)
        return
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in root.modules()):
        _stop_watching(root)  # blocks compiled in place (compile_scope "blocks"): hooks would be traced
        return
    holders = _holders(root)
    if not holders:
        _stop_watching(root)
        return
    calls, hooks = _count_calls(holders)
    _active.append((weakref.ref(root), calls, hooks, holders))


def _count_calls(holders, under_no_grad: bool = False):
    """``(calls, hook handles)``: a pre-hook on each holder counting its calls into ``calls``
    (in training, a call under no_grad keeps nothing and is not counted; the probe counts all)."""
    calls: collections.Counter = collections.Counter()

    def counter(name):
        def count(module, args):
            if under_no_grad or torch.is_grad_enabled():
                calls[name] += 1
        setattr(count, INPUT_AGNOSTIC_HOOK, True)
        return count

    return calls, [m.register_forward_pre_hook(counter(name)) for name, (m, _) in holders.items()]


def _end_session():
    _, calls, hooks, holders = _active.pop()
    for h in hooks:
        h.remove()
    return calls, holders


def _finish(root: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling() or not _active or _active[0][0]() is not root:
        return
    calls, holders = _end_session()
    if sys.exc_info()[0] is not None:
        return  # the forward raised: the watch stays for the next one
    outer, layers = _reused(calls, holders)
    if not outer:
        _stop_watching(root)
        return
    root.__dict__[PENDING] = layers
    _warn(root, outer, calls, holders, len(layers), "from the next training step")


def probe_reuse(model: nn.Module, *example_args, **example_kwargs) -> list[str]:
    """Find the reused modules of ``model`` with one forward of the example inputs, before
    training, and switch their Mesa layers to ``estimator="per_sample"`` at once; returns the
    names of the layers switched.

    For what the first-training-forward watch cannot see: a model trained under
    ``torch.compile`` (whose forwards are traced), a reentrant checkpoint's segments, and the
    first step of every run and resumed run (clamped by the watch). The probe runs in eval mode
    without gradients, so nothing is compressed and nothing changes: no Mesa estimate, no
    BatchNorm statistic, no draw from torch's generators (forked). Each module's train/eval flag
    is restored. Call it after ``patch_model`` and before compiling or wrapping; an input of one
    sample is enough (the calls a forward makes do not depend on the batch). The watch of the
    first eager training forward stays for the layers still on running ranges: a module reused
    in training only, or a Mesa child that a forward reaches only with gradients on (a routed
    functional call), is switched from the second step, as without the probe. Calls under
    ``no_grad`` inside the forward count here (the watch skips them): such a module gets
    per-sample ranges it did not need. A part of a patched model can be probed on its own.
    After :func:`keep_running_ranges` it does nothing."""
    root = unwrap_module(model, "probe_reuse")
    if root.__dict__.get(KEEP):
        return []
    holders = _holders(root)  # (layers on running ranges only: none switched before)
    if not holders:
        return []
    calls, hooks = _count_calls(holders, under_no_grad=True)
    try:
        _forward_unchanged(root, example_args, example_kwargs)
    finally:
        for h in hooks:
            h.remove()
    outer, layers = _reused(calls, holders)
    if not outer:
        return []
    _switch(root, layers)
    _warn(root, outer, calls, holders, len(layers), "from the first training step")
    return layers


def _forward_unchanged(root: nn.Module, args, kwargs) -> None:
    """One forward of ``root`` in eval mode without gradients, leaving every module's flag as
    it was and torch's generators where they were."""
    flags = {m: m.training for m in root.modules()}
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    cuda = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), warnings.catch_warnings():
            # (a reentrant checkpoint warns that no input requires a gradient: none does here)
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
            root.eval()
            root(*args, **kwargs)
    finally:
        # train() first: a module's own train() clears what its eval forward cached (LeViT's
        # attention-bias cache); then the flags of modules that were in the other mode (frozen ones)
        root.train(flags[root])
        for m, training in flags.items():
            m.training = training


def _reused(calls, holders) -> tuple[list[str], list[str]]:
    """The outermost modules called more than once (their children ran again with them), and
    the names of the Mesa layers they hold."""
    reused = [name for name, n in calls.items() if n > 1]
    outer = [n for n in reused if not any(n.startswith(o + ".") for o in reused)]
    return outer, sorted({layer for n in outer for layer in holders[n][1]})


def _warn(root, outer, calls, holders, num_layers: int, when: str) -> None:
    names = ", ".join(f"{n} ({type(holders[n][0]).__name__}, {calls[n]} calls)" for n in outer)
    warnings.warn(
        f"mesa_train: module(s) of {type(root).__name__} ran more than once in one forward: {names}. One "
        f"running range per layer would clamp the larger calls' values, so {when} their "
        f"{num_layers} Mesa layer(s) use estimator='per_sample' (each call's own ranges); "
        "mesa_train.patch.reuse.keep_running_ranges(model) keeps the running ranges", UserWarning,
        stacklevel=outside_stacklevel())


def _switch(root: nn.Module, names) -> None:
    for name in names:
        try:
            layer = root.get_submodule(name)
        except AttributeError:
            continue  # (patched again since, or removed)
        if isinstance(layer, MesaLayer) and layer.quant_options.estimator in RANGE_ESTIMATORS:
            layer.switch_to_per_sample_for_reuse()  # (marked in its state_dict: a resume takes it)


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


# the root's own hooks read no argument either (a root patched on its own, an attention inside a
# model patched after it, must not turn its block's norm + qkv fusion off while watched)
setattr(_start, INPUT_AGNOSTIC_HOOK, True)
setattr(_finish, INPUT_AGNOSTIC_HOOK, True)
