"""Cost model and QSync-style greedy allocator.

Cost model (on the stock step): a plan compressing the item set C keeps
``stock_activation_bytes - sum(saved_bytes[i] for i in C) - sum(extra_bytes[p] for the
profiled pairs p within C)`` activation bytes and takes ``stock_step_s + sum(time_s[i] for
i in C)`` per step. A pair's extra is what two ops of one unit save together beyond their
single savings: a tensor both save (PVT's attention input, read by its q Linear and its
spatial-reduction conv) is freed only when both are compressed, and ops compressed together
can share int8 copies. An op may save only with its partner (``useful_items``). Sharing
among three or more ops is not modelled (it only adds savings, so the model stays
conservative there); the all-ops floor is the measured one.

Allocator. In QSync, lower precision is faster and the allocator starts from the fastest
setting and recovers precision. In Mesa compression is what costs time, so the fastest
plan that fits compresses as few bytes' worth of time as possible:

1. *Floor.* Compressing every item gives the least memory; a budget below it is an
   error naming the floor.
2. *Speed.* Start from every item compressed and give items back to full precision in
   order of time recovered per byte spent (``time_s / saved_bytes``, largest first),
   skipping any that would no longer fit; items that cost no time come last (given back
   only for precision), items that save nothing are never compressed. Then swap a
   compressed item for a cheaper uncompressed one while the plan still fits (the ratio
   order alone can keep a big item where a small one would do).
3. *Precision recovery.* Then, most sensitive compressed item first, swap it for a
   less sensitive uncompressed item that saves at least as much memory (the plan still
   fits) and costs at most ``time_slack`` more time per step (throughput does not drop
   beyond that). This is QSync's "recover precision while memory fits and throughput does
   not drop", greedy by the sensitivity indicator.
4. *Recomputation.* A block may instead be recomputed in backward (activation
   checkpointing: it keeps only its input, costs one more forward of the block, changes no
   gradient). For k = 0, 1, ... blocks recomputed, cheapest time per byte first, steps 1-3
   plan the other layers for what is left of the budget; the plan with the least
   predicted step time wins. So a plan is never predicted slower than checkpointing alone
   at the same memory, and mixes the two where that is fastest.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Set, Tuple

from .planfile import RECOMPUTE, Plan, PlanError
from .profile import ItemProfile, Profile

__all__ = ["Prediction", "predict", "allocate", "budget_bytes", "Budget", "floor_bytes", "lowest_bytes",
           "useful_items"]

Key = Tuple[str, str]


@dataclass
class Prediction:
    activation_bytes: float
    saved_bytes: float
    step_s: float
    peak_bytes: float | None  # CUDA: stock peak minus saved bytes

    def as_dict(self) -> Dict:
        return {"activation_bytes": int(self.activation_bytes), "saved_bytes": int(self.saved_bytes),
                "step_s": float(self.step_s),
                "peak_bytes": None if self.peak_bytes is None else int(self.peak_bytes)}


class _Savings:
    """Bytes an item set saves: single savings plus the extras of the profiled pairs in it.
    ``gain(k, others)`` is what adding ``k`` to ``others`` saves, so the allocator's greedy
    steps stay incremental."""

    def __init__(self, profile: Profile):
        self.single = {it.key: it.saved_bytes for it in profile.items}
        self.extra: Dict[Key, Dict[Key, float]] = {}
        for p in profile.pairs:
            a, b = p.keys
            total = self.extra.get(a, {}).get(b, 0.0) + p.extra_bytes
            self.extra.setdefault(a, {})[b] = total
            self.extra.setdefault(b, {})[a] = total

    def best(self, k: Key) -> float:
        """The most ``k`` can save: alone, plus every pair extra in its favour."""
        return self.single[k] + sum(e for e in self.extra.get(k, {}).values() if e > 0)

    def paired(self, a: Key, b: Key) -> bool:
        return b in self.extra.get(a, {})

    def gain(self, k: Key, others: Iterable[Key]) -> float:
        extra = self.extra.get(k, {})
        return self.single[k] + sum(extra.get(j, 0.0) for j in others if j != k)

    def of(self, chosen: Iterable[Key]) -> float:
        chosen = set(chosen)
        pairs = sum(e for k in chosen for j, e in self.extra.get(k, {}).items() if j in chosen) / 2
        return sum(self.single[k] for k in chosen) + pairs


def useful_items(profile: Profile) -> Set[Key]:
    """Compression items that save memory, alone or with a pair partner (recompute items are
    chosen apart, step 4). A Swin attention's softmax alone costs bytes (its int8 copy beside
    the map the ``attn @ v`` matmul still keeps) but saves them with that matmul compressed."""
    savings = _Savings(profile)
    return {it.key for it in profile.items if it.op != RECOMPUTE and savings.best(it.key) > 0}


def floor_bytes(profile: Profile) -> float:
    """The fewest activation bytes any plan keeps (every op compressed)."""
    return predict(profile, useful_items(profile)).activation_bytes


def predict(profile: Profile, chosen: Iterable[Key]) -> Prediction:
    items = {it.key: it for it in profile.items}
    chosen = list(chosen)
    saved = _Savings(profile).of(chosen)
    recomputed = any(k[1] == RECOMPUTE for k in chosen)
    if profile.floor_activation_bytes is not None and not recomputed and set(chosen) >= useful_items(profile):
        saved = profile.stock_activation_bytes - profile.floor_activation_bytes  # measured, not summed
    step = profile.stock_step_s + sum(items[k].time_s for k in chosen)
    peak = None if profile.stock_peak_bytes is None else profile.stock_peak_bytes - saved
    return Prediction(profile.stock_activation_bytes - saved, saved, step, peak)


@dataclass
class Budget:
    """A budget, turned into the activation bytes a plan may keep."""
    fraction: float | None = None  # of stock activation bytes
    gb: float | None = None  # peak GB (CUDA) or, elsewhere, the estimate below

    def describe(self) -> str:
        return f"budget={self.fraction}" if self.fraction is not None else f"budget_gb={self.gb}"

    def check(self, prefix: str = "") -> "Budget":
        """Itself, validated (PlanError, one line, otherwise): exactly one of the two, a number,
        the fraction in (0, 1], the GB positive and finite. Callers check before profiling,
        which takes minutes and a stock training step's memory. ``prefix``: the config group
        the messages name the values by (the trainer's ``mesa.``)."""
        if (self.fraction is None) == (self.gb is None):
            raise PlanError(f"give exactly one of {prefix}budget (fraction of stock activation memory, e.g. 0.6) "
                            f"or {prefix}budget_gb (peak GB on the device)")
        value, name = (self.fraction, "budget") if self.fraction is not None else (self.gb, "budget_gb")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name == "budget" and not (number and 0 < value <= 1):
            raise PlanError(f"{prefix}budget={value!r} must be a fraction in (0, 1] of stock activation memory, "
                            "e.g. 0.6")
        if name == "budget_gb" and not (number and math.isfinite(value) and value > 0):
            raise PlanError(f"{prefix}budget_gb={value!r} must be a positive number of GB (peak memory on the "
                            "device)")
        return self


def budget_bytes(profile: Profile, budget: Budget) -> Tuple[float, str]:
    """(activation bytes a plan may keep, how the budget was read)."""
    budget.check()
    if budget.fraction is not None:
        return budget.fraction * profile.stock_activation_bytes, (
            f"{budget.fraction:g} x stock activation memory ({profile.stock_activation_bytes / 2**20:.2f} MiB)")
    limit = float(budget.gb) * 2**30
    if profile.stock_peak_bytes is not None:
        # peak = everything else at the stock peak + the activations kept
        rest = profile.stock_peak_bytes - profile.stock_activation_bytes
        return limit - rest, (f"{budget.gb:g} GB peak (max_memory_allocated; "
                              f"stock peak {profile.stock_peak_bytes / 2**30:.3f} GB)")
    # no peak counter (CPU): estimate peak as activations + parameters, gradients and two
    # Adam moments (4 x parameter bytes)
    rest = 4 * profile.parameter_bytes
    return limit - rest, (f"{budget.gb:g} GB estimated peak on {profile.device} (no peak-memory counter there: "
                          f"activation bytes kept + 4 x parameter bytes {rest / 2**20:.1f} MiB)")


def _recompute_items(profile: Profile) -> List[ItemProfile]:
    """Blocks that may be recomputed, cheapest time per byte saved first."""
    rec = [it for it in profile.items if it.op == RECOMPUTE and it.saved_bytes > 0]
    return sorted(rec, key=lambda it: (it.time_s / it.saved_bytes, it.unit))


def _rest_after_recompute(profile: Profile, recomputed: List[ItemProfile]) -> Profile:
    """The profile of the layers left to compress once ``recomputed`` blocks are checkpointed:
    their savings and time folded into the "stock" figures, their compression items gone."""
    if not recomputed:
        return dataclasses.replace(profile, items=[it for it in profile.items if it.op != RECOMPUTE])
    units = {it.unit for it in recomputed}
    return dataclasses.replace(
        profile, items=[it for it in profile.items if it.op != RECOMPUTE and it.unit not in units],
        pairs=[p for p in profile.pairs if p.unit not in units],
        stock_activation_bytes=profile.stock_activation_bytes - sum(it.saved_bytes for it in recomputed),
        stock_step_s=profile.stock_step_s + sum(it.time_s for it in recomputed),
        floor_activation_bytes=None)  # the measured floor had every block compressed


def lowest_bytes(profile: Profile) -> float:
    """The fewest activation bytes any plan keeps (compression and recomputation mixed)."""
    rec = _recompute_items(profile)
    return min(floor_bytes(_rest_after_recompute(profile, rec[:k])) for k in range(len(rec) + 1))


def allocate(profile: Profile, allowed_bytes: float, *, time_slack: float = 0.02) -> Set[Key]:
    """The item set (compressed ops, recomputed blocks) of the plan with the least predicted
    step time that keeps at most ``allowed_bytes`` activations (steps 1-4 above)."""
    rec = _recompute_items(profile)
    best = None
    for k in range(len(rec) + 1):
        rest = _rest_after_recompute(profile, rec[:k])
        if floor_bytes(rest) > allowed_bytes:
            continue
        chosen = _allocate_compression(rest, allowed_bytes, time_slack) | {it.key for it in rec[:k]}
        step = predict(profile, chosen).step_s
        if best is None or step < best[0] - 1e-12:
            best = (step, chosen)
    if best is None:
        low = lowest_bytes(profile)
        raise PlanError(
            f"budget too small: it allows {allowed_bytes / 2**20:.2f} MiB of activations, but the smallest "
            f"any plan reaches is {low / 2**20:.2f} MiB ({low / profile.stock_activation_bytes:.3f} x stock, "
            f"every op compressed{' and blocks recomputed' if rec else ''}); raise the budget to at least that")
    return best[1]


def _allocate_compression(profile: Profile, allowed_bytes: float, time_slack: float) -> Set[Key]:
    """Steps 1-3: the compressed item set keeping at most ``allowed_bytes`` activations.
    ``time_slack``: fraction of the stock step a precision-recovery swap may cost."""
    items: Dict[Key, ItemProfile] = {it.key: it for it in profile.items}
    need = profile.stock_activation_bytes - allowed_bytes  # bytes the plan must save
    useful = useful_items(profile)
    floor = floor_bytes(profile)
    if floor > allowed_bytes:
        raise PlanError(
            f"budget too small: it allows {allowed_bytes / 2**20:.2f} MiB of activations, but the smallest "
            f"any plan reaches is {floor / 2**20:.2f} MiB (every op compressed, "
            f"{floor / profile.stock_activation_bytes:.3f} x stock); raise the budget to at least that")

    savings = _Savings(profile)
    if profile.stock_activation_bytes - savings.of(useful) > allowed_bytes:
        return set(useful)  # only the shared copies of every op compressed together fit
    # 2. speed: give back items by time recovered per byte, while the savings still cover need
    chosen = set(useful)
    saved = savings.of(chosen)
    # (ties: the bigger item first, then by name, so the result does not depend on set order)
    worth = {k: savings.gain(k, chosen) for k in chosen}  # what giving k back alone would lose
    order = sorted(chosen, key=lambda k: (-items[k].time_s / worth[k] if worth[k] > 0 else float("-inf"),
                                          -worth[k], k))
    for k in order:  # free items (time_s <= 0) come last: given back only if memory allows
        lose = savings.gain(k, chosen)
        if saved - lose >= need:
            chosen.discard(k)
            saved -= lose

    def swapped(outs: Tuple[Key, ...], ins: Tuple[Key, ...]) -> float:
        """What the plan saves with ``outs`` given back and ``ins`` compressed instead."""
        rest, out = set(chosen), saved
        for a in outs:
            rest.discard(a)
            out -= savings.gain(a, rest)
        for b in ins:
            out += savings.gain(b, rest)
            rest.add(b)
        return out

    def moves(keys: Set[Key]) -> List[Tuple[Key, ...]]:
        """Single items and profiled pairs (which may save more together than apart)."""
        keys = sorted(keys)
        return [(k,) for k in keys] + [(a, b) for a, b in itertools.combinations(keys, 2) if savings.paired(a, b)]

    def time_of(keys: Tuple[Key, ...]) -> float:
        return sum(items[k].time_s for k in keys)

    # greedy by ratio can keep a big item where a smaller, cheaper one would do: swap
    # compressed items for uncompressed ones (an item or a pair each side, or none coming
    # in) while that is faster and still fits
    improved = True
    while improved:
        improved = False
        ins = [()] + moves(useful - chosen)
        swaps = [(time_of(b) - time_of(a), a, b) for a in moves(chosen) for b in ins
                 if time_of(b) < time_of(a) - 1e-12 and swapped(a, b) >= need]
        if swaps:
            _, a, b = min(swaps)
            saved = swapped(a, b)
            chosen.difference_update(a)
            chosen.update(b)
            improved = True

    # 3. precision: swap a sensitive compressed item for a less sensitive free one
    slack = time_slack * profile.stock_step_s
    for a in sorted(chosen, key=lambda k: (-items[k].sensitivity, k)):
        if a not in chosen:
            continue
        candidates = [b for b in sorted(useful - chosen)
                      if items[b].sensitivity < items[a].sensitivity
                      and swapped((a,), (b,)) >= need
                      and items[b].time_s <= items[a].time_s + slack]
        if candidates:
            b = min(candidates, key=lambda k: (items[k].sensitivity, items[k].time_s))
            saved = swapped((a,), (b,))
            chosen.discard(a)
            chosen.add(b)
    return chosen


def to_plan(profile: Profile, chosen: Set[Key], **info) -> Plan:
    layers = {u.name: ((RECOMPUTE,) if (u.name, RECOMPUTE) in chosen
                       else tuple(op for op in u.ops if (u.name, op) in chosen)) for u in profile.units}
    return Plan(layers=layers, architecture=profile.architecture,
                fingerprints={u.name: u.fingerprint for u in profile.units},
                quant_options=dict(profile.quant_options), **info)
