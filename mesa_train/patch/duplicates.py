"""Leave stock the Mesa layers whose copies only duplicate what other modules keep in full:
``skip_duplicated(model, example_input)``.

A Mesa layer saves memory by keeping 8-bit codes of a tensor *instead of* the tensor. Where
another module keeps that very tensor in full anyway, the codes come on top: a conv after a
stock ReLU (which keeps its output, the conv's input) with ``ops=["conv"]``, a ViT's ``attn.proj``
after timm's fused attention (which keeps its output) with ``ops=["linear"]``, a conv beside a
scale conv the cancellation analysis keeps stock. Such a layer adds bytes and gradient noise
and saves nothing: ``coverage`` reports it (``Coverage.duplicated``), and ``resnet18`` with
``ops=["conv"]`` keeps 1.026x of stock's bytes (results/timm/duplicated.md).

``skip_duplicated`` measures one training forward (``coverage.measured_copies``), finds the
layers *every* copy of which another module keeps in full, switches them to their stock
computation (``enabled=False``: the stock forward and gradient, and the stock layer keeps a
reference to the tensor the other module keeps, no new bytes), and measures again. It goes op
by op and keeps a switch only where the measured bytes went down: under autocast a stock conv
keeps its own 16-bit cast of the ReLU's fp32 output, more than Mesa's codes, and the switch is
undone. Switching a layer can make another one's copy a duplicate (a Mesa ReLU left stock keeps
its output in full, the next conv's input), so it measures again until nothing changes.

The same goes for a timm attention built fused that ``ops`` with ``softmax`` or ``matmul`` but not
``sdpa`` moved to the explicit path (``patch_model`` warns): that path keeps an N x N map the fused
one never does, so ``ops=["softmax"]`` keeps 1.046x of deit_tiny's stock bytes and the README's
``ops=["gelu", "softmax"]`` 0.864x, where ``["gelu"]`` alone keeps 0.819x. Those attentions are one
more try: back on the fused path they were built with (the stock forward, ``qkv`` / ``proj`` still
Mesa where asked; ``FUSED_BACK_ATTR``), kept where the bytes go down (with ``matmul`` the explicit
path's 8-bit q, k, v keep less than the fused path's, and it stays).

Measured forwards are on ``example_input`` with the model restored after each (buffers, RNG,
train flags: ``coverage._untouched``); the switches are the only change, each layer marked with
``LEFT_STOCK_ATTR`` so ``describe`` names them. Training calls it at start-up with
``mesa.duplicates=skip`` (the default; ``keep`` compresses what the ops ask, as an ablation may
want). The data flow it reads is the model's, not the values': a model whose forward takes other
paths for other inputs is measured on the path ``example_input`` takes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from mesa_train.models import unwrap_module
from mesa_train.nn.matmul import MatMul

from .attention import STOCK_FUSED_ATTR
from .core import mesa_layer_op
from .coverage import measured_copies
from .skip_marks import FULL_OPERANDS_ATTR, FUSED_BACK_ATTR, LEFT_STOCK_ATTR, record_skipped_root, undo_skips

__all__ = ["DUPLICATES", "FUSED_BACK_ATTR", "LEFT_STOCK_ATTR", "SkippedDuplicates", "full_operand_duplicates",
           "fused_back_attentions", "left_stock_duplicates", "skip_duplicated"]

# mesa.duplicates: skip (leave such layers stock, the default) | keep (compress what the ops ask)
DUPLICATES = ("skip", "keep")

_ATTENTIONS = "attention"  # (the try of the attentions moved to the explicit path)
_OPERANDS = "operands"  # (the try of the MatMul operands other modules keep in full)


@dataclass
class SkippedDuplicates:
    """``layers``: the Mesa layers switched to stock, by op; ``kept``: those whose copies are all
    duplicates but whose stock computation keeps more (a switch undone), by op; ``before`` /
    ``after``: the bytes one training forward on the example input kept before and after."""

    layers: Dict[str, List[str]] = field(default_factory=dict)
    kept: Dict[str, List[str]] = field(default_factory=dict)
    before: int = 0
    after: int = 0
    # the attentions put back on the fused path they were built with
    fused_back: List[str] = field(default_factory=list)
    # the MatMuls that keep an operand in full, a reference to the tensor another module keeps anyway
    # and quantize the other: name -> those operands
    full_operands: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    # why nothing was measured: a start-up call whose forward failed (patch/start_up.py; "" otherwise)
    failed: str = ""

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.layers.values())

    def _progress(self) -> tuple:
        return self.count, len(self.fused_back), len(self.full_operands)

    def summary(self) -> str:
        """One line for a log: what was left stock and what it saved."""
        if self.failed:
            return self.failed
        kept = sum(len(v) for v in self.kept.values())
        parts = []
        if self.count:
            parts.append(f"left {self.count} Mesa layer(s) stock whose copies other modules keep in full anyway "
                         f"({_by_op(self.layers)})")
        if self.full_operands:
            parts.append(f"kept {sum(map(len, self.full_operands.values()))} operand(s) of "
                         f"{len(self.full_operands)} Mesa MatMul(s) in full, as references to the tensors other "
                         f"modules keep in full anyway (their other operands stay 8-bit)")
        if self.fused_back:
            parts.append(f"put {len(self.fused_back)} attention(s) back on the fused path they were built with "
                         f"(the explicit path that softmax / matmul without sdpa chose kept an N x N map; sdpa in "
                         f"the ops compresses the fused path)")
        text = (" and ".join(parts) + f": kept bytes {self.after / max(self.before, 1):.3f}x of before" if parts
                else "no Mesa layer left stock")
        if kept:
            text += (f"; {kept} layer(s) whose copies other modules keep in full stay compressed, as leaving "
                     f"them stock kept as much or more ({_by_op(self.kept)}: e.g. autocast's 16-bit casts of "
                     f"their inputs, a scale branch's BatchNorm input)")
        return text


def _by_op(layers: Dict[str, List[str]]) -> str:
    return ", ".join(f"{op} {len(names)}" for op, names in sorted(layers.items()))


def skip_duplicated(model: nn.Module, example_input, *, run: Optional[Callable] = None,
                    max_rounds: int = 8) -> SkippedDuplicates:
    """Switch to stock the Mesa layers of ``model`` whose every copy another module keeps in
    full, and put attentions built fused back on that path, where that lowers the bytes one
    training forward keeps (module doc). ``run(model, example_input)`` replaces
    ``model(example_input)`` (several inputs, autocast). The switches of an earlier call are
    undone first (the model may have been patched since: ``skip_marks``); if a measuring forward
    fails, every switch is undone before the error goes on."""
    root = unwrap_module(model, "skip_duplicated")
    modules = dict(root.named_modules())
    undo_skips(root)
    record_skipped_root(root)
    try:
        return _skip(root, modules, example_input, run, max_rounds)
    except BaseException:
        undo_skips(root)  # (a half-measured model keeps nothing of this call)
        raise


def _skip(root: nn.Module, modules: Dict[str, nn.Module], example_input, run, max_rounds: int) -> SkippedDuplicates:
    total, layers, _ = measured_copies(root, example_input, run)
    result = SkippedDuplicates(before=total, after=total)

    def measure() -> tuple:
        after, _, per_module = measured_copies(root, example_input, run, copies=False)
        return after, per_module

    def attempt(op: str, units: List[List[str]], switch, whole: bool) -> None:
        """Switch ``units`` (lists of names that go together) and keep what lowers the bytes.
        A stock layer that keeps bytes of its own (autocast's cast of its input: the meter credits
        a storage to its first saver, and one only referenced is the keeper's) is an adder: where
        some units have adders and some not, the adders go back on and that is measured too (the
        review's find: one try for both gained less than the good one alone, or nothing). A MatMul
        keeping an operand in full still keeps the other's codes: it is an adder where its own bytes
        did not drop (under autocast, a 16-bit cast of an fp32 operand instead of its 8-bit codes)."""
        nonlocal total
        group = [n for unit in units for n in unit]
        switch(modules, group, stock=True)

        def adds(unit: List[str], per_module: Dict[str, int]) -> bool:
            if op == _OPERANDS:
                return any(per_module.get(n, 0) >= layers[n][0] for n in unit)
            return any(per_module.get(n, 0) for n in unit)

        try:
            after, per_module = measure()
            adders = [u for u in units if adds(u, per_module)] if not whole else []
            if adders and len(adders) < len(units):
                switch(modules, [n for u in adders for n in u], stock=False)
                fewer, _ = measure()
                if fewer < min(after, total):
                    after, group = fewer, [n for u in units if u not in adders for n in u]
                    if op != _OPERANDS:
                        _add(result.kept, modules, [n for u in adders for n in u if n in layers])
                else:
                    switch(modules, [n for u in adders for n in u], stock=True)
        except BaseException:
            switch(modules, [n for unit in units for n in unit], stock=False)  # (never half a try left behind)
            raise
        if after < total:
            total = after
            if op == _ATTENTIONS:
                result.fused_back.extend(group)
            elif op == _OPERANDS:
                result.full_operands.update((n, modules[n].__dict__[FULL_OPERANDS_ATTR]) for n in group)
            else:
                _add(result.layers, modules, group)
            return
        switch(modules, group, stock=False)
        if op not in (_ATTENTIONS, _OPERANDS):  # (the stock layers keep copies of their own, e.g. autocast's casts)
            _add(result.kept, modules, [n for n in group if n in layers])  # (not a scale partner)

    for _ in range(max_rounds):
        progress = result._progress()
        for op, units, switch, whole in _tries(modules, layers):
            attempt(op, units, switch, whole)
        if result._progress() == progress:
            break
        total, layers, _ = measured_copies(root, example_input, run)
    result.after = total
    switched_names = {n for names in result.layers.values() for n in names}
    result.kept = {op: kept for op, names in result.kept.items()
                   if (kept := [n for n in names if n not in switched_names])}
    # (a MatMul whose other operand became a duplicate too went stock whole in a later round)
    result.full_operands = {n: ops for n, ops in result.full_operands.items() if n not in switched_names}
    return result


def _tries(modules: Dict[str, nn.Module], layers: Dict[str, tuple]):
    """``(op, units, switch, whole)`` per try. The candidates: the layers every copy of which
    another module keeps in full, by op, largest first, in units of the layers that copy the same
    tensors (one made the copy, the others took it: ``nn/input_copy.py``; they go together, or
    the copy stays). Each op's linked scale branches go whole, partner included, in a try of their
    own kept if the bytes drop at all (the stock BatchNorm keeps its input, which the other
    layers' try need not pay for). Then the MatMuls only some of whose operands are duplicates:
    those operands kept in full (a reference to the keeper's tensor), in one try whose adders are
    measured apart. Last, the attentions built fused now on the explicit path."""
    by_op: Dict[str, Dict[frozenset, List[str]]] = {}
    partial: Dict[str, Tuple[str, ...]] = {}
    for name, (_own, copied, duplicated, _keepers, tensors, operands) in layers.items():
        if modules[name].__dict__.get(LEFT_STOCK_ATTR):
            continue
        if duplicated == copied:
            by_op.setdefault(mesa_layer_op(modules[name]), {}).setdefault(tensors, []).append(name)
        elif operands and isinstance(modules[name], MatMul):
            partial[name] = tuple(sorted(operands | set(modules[name].__dict__.get(FULL_OPERANDS_ATTR, ()))))
    for op, units in sorted(by_op.items(), key=lambda kv: -sum(layers[n][0] for u in kv[1].values() for n in u)):
        plain = [u for u in units.values() if not any(_scale_partner(modules[n]) is not None for n in u)]
        paired = [_with_scale_partners(modules, u) for u in units.values() if u not in plain]
        if plain:
            yield op, plain, _switch, False
        if paired:
            yield op, paired, _switch, True
    if partial:
        yield _OPERANDS, [[n] for n in partial], functools.partial(_keep_full, partial), False
    explicit = [n for n, m in modules.items()
                if m.__dict__.get(STOCK_FUSED_ATTR) and getattr(m, "mesa_attn_path", "stock") == "explicit"]
    if explicit:
        yield _ATTENTIONS, [explicit], _fuse_back, True


def _fuse_back(modules: Dict[str, nn.Module], names: List[str], stock: bool) -> None:
    """The attentions ``names`` on the fused path they were built with (``stock``), or back on
    the explicit path ``patch_model`` gave them."""
    for name in names:
        attn = modules[name]
        if stock:
            attn.__dict__[FUSED_BACK_ATTR] = (attn.mesa_attn_path, attn.fused_attn)
            attn.mesa_attn_path, attn.fused_attn = "stock", attn.__dict__[STOCK_FUSED_ATTR]
        else:
            attn.mesa_attn_path, attn.fused_attn = attn.__dict__.pop(FUSED_BACK_ATTR)


def _keep_full(operands: Dict[str, Tuple[str, ...]], modules: Dict[str, nn.Module], names: List[str],
               stock: bool) -> None:
    """The MatMuls ``names`` keep ``operands[name]`` in full, as given (``stock``), or
    quantize every operand of theirs again."""
    for name in names:
        if stock:
            modules[name].__dict__[FULL_OPERANDS_ATTR] = operands[name]
        else:
            modules[name].__dict__.pop(FULL_OPERANDS_ATTR, None)


def full_operand_duplicates(model: nn.Module) -> Dict[str, Tuple[str, ...]]:
    """The MatMuls ``skip_duplicated`` left keeping some operands in full, and those operands."""
    root = unwrap_module(model, "full_operand_duplicates")
    return {name: m.__dict__[FULL_OPERANDS_ATTR] for name, m in root.named_modules()
            if m.__dict__.get(FULL_OPERANDS_ATTR) and m.quant_options.enabled}


def fused_back_attentions(model: nn.Module) -> List[str]:
    """The attentions ``skip_duplicated`` put back on their fused path and that are still there."""
    root = unwrap_module(model, "fused_back_attentions")
    return [name for name, m in root.named_modules()
            if FUSED_BACK_ATTR in m.__dict__ and getattr(m, "mesa_attn_path", None) == "stock"]


def _add(by_op: Dict[str, List[str]], modules: Dict[str, nn.Module], names: List[str]) -> None:
    for name in names:
        listed = by_op.setdefault(mesa_layer_op(modules[name]), [])
        if name not in listed:
            listed.append(name)


def _scale_partner(layer: nn.Module) -> Optional[nn.Module]:
    return layer.__dict__.get("_mesa_scale_bn") or layer.__dict__.get("_mesa_scale_conv")


def _with_scale_partners(modules: Dict[str, nn.Module], names: List[str]) -> List[str]:
    """``names`` and the other half of each linked scale branch among them (patch/scale_branch.py):
    a stock conv beside a Mesa BatchNorm takes its weight gradient from the BatchNorm's 8-bit
    input gradient, the cancellation the link exists to avoid (mobileone_s0's ``conv_scale``
    weights at cosine -0.89 with the conv alone switched), so a pair goes stock whole or not at
    all."""
    ids = {id(m): n for n, m in modules.items()}
    out = list(names)
    for name in names:
        layer = modules[name]
        partner = _scale_partner(layer)
        # (a partner the user switched off stays as it is: both halves are then stock)
        if (partner is not None and id(partner) in ids and ids[id(partner)] not in out
                and partner.quant_options.enabled):
            out.append(ids[id(partner)])
    return out


def left_stock_duplicates(model: nn.Module) -> List[str]:
    """The names of the layers ``skip_duplicated`` switched to stock and that are still so."""
    root = unwrap_module(model, "left_stock_duplicates")
    return [name for name, m in root.named_modules()
            if m.__dict__.get(LEFT_STOCK_ATTR) and not m.quant_options.enabled]


def _switch(modules: Dict[str, nn.Module], names: List[str], stock: bool) -> None:
    for name in names:
        layer = modules[name]
        layer.set_quant_options(enabled=not stock)
        if stock:
            layer.__dict__[LEFT_STOCK_ATTR] = True
        else:
            layer.__dict__.pop(LEFT_STOCK_ATTR, None)
