"""Profile every (unit, op) item of a model on the real device.

For each item the profile records

* ``saved_bytes``: activation bytes it saves against stock (``SavedTensorMeter``),
* ``time_s``: what it adds to a training step (forward + backward),
* ``sensitivity``: the gradient error it introduces (0 for ``recompute``: exact), ``||g_item - g|| / ||g||`` over all
  parameter gradients of the model (the exact gradient ``g`` from the stock model on the
  same batch). Relative to the whole model's gradient norm, an item's error counts in
  proportion to the gradient it disturbs, QSync's weighting.

and for each pair of ops of one unit, ``pairs``: the bytes the two save together beyond the
sum of their single savings (a tensor two layers both save, e.g. a PVT attention's input,
read by its q Linear and its spatial-reduction conv, is freed only when both are
compressed). Memory only, no timing: one forward per pair.

Identical blocks (same class and parameter shapes) are profiled together for memory and
time: the op is compressed in all of them at once and the effect split evenly, which
gives a signal n times larger than the timer noise. Sensitivity is per block.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from torch import nn

from .apply import apply_plan
from .planfile import RECOMPUTE, Plan
from .measure import Batch, activation_bytes, fastest, gradients, interleaved_times, median, peak_bytes, train_step
from .units import Unit, find_units, model_architecture

__all__ = ["ItemProfile", "PairProfile", "Profile", "profile_model", "patch_items"]


@dataclass
class ItemProfile:
    unit: str
    op: str
    saved_bytes: float
    time_s: float
    sensitivity: float

    @property
    def key(self):
        return (self.unit, self.op)


@dataclass
class PairProfile:
    """Two ops of one unit whose saving together is not the sum of their single savings:
    ``extra_bytes`` is the difference (positive where they keep a tensor in common)."""
    unit: str
    ops: tuple
    extra_bytes: float

    @property
    def keys(self):
        return tuple((self.unit, op) for op in self.ops)


@dataclass
class Profile:
    architecture: str
    device: str
    batch_size: int
    img_size: int
    stock_activation_bytes: int
    stock_step_s: float
    step_noise: float  # relative spread (IQR / median) of the stock step time
    parameter_bytes: int
    stock_peak_bytes: Optional[int]  # CUDA max_memory_allocated of a stock step
    items: List[ItemProfile] = field(default_factory=list)
    units: List[Unit] = field(default_factory=list)
    quant_options: Dict = field(default_factory=dict)
    # measured activation bytes with every op compressed: below the additive estimate when
    # compressed ops share int8 copies (the additive model stays conservative elsewhere)
    floor_activation_bytes: Optional[int] = None
    pairs: List[PairProfile] = field(default_factory=list)

    def item(self, unit: str, op: str) -> ItemProfile:
        for it in self.items:
            if it.unit == unit and it.op == op:
                return it
        raise KeyError((unit, op))

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["units"] = [asdict(u) for u in self.units]
        return d


def patch_items(model: nn.Module, layers: Dict[str, tuple], quant_options: Dict) -> nn.Module:
    return apply_plan(model, Plan(layers=dict(layers), architecture=model_architecture(model)), **quant_options)


def _spread(values: List[float]) -> float:
    s = sorted(values)
    q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
    return (q3 - q1) / max(median(s), 1e-12)


def _calibrate(keys, costs: List[float]) -> List[float]:
    """Ops of one block share work (e.g. one int8 copy serves a LayerNorm and the Linear
    after it), so single-op costs overestimate a block with several ops compressed. Scale
    each group's single-op costs so that they add up to the measured all-ops cost of the
    group (one factor per group, in [0.25, 1]); the additive model is then exact at both
    ends (stock, all ops) and interpolates in between."""
    out = list(costs)
    for i, ((members, op), c_all) in enumerate(zip(keys, costs)):
        if op != "*":
            continue
        idx = [j for j, (m, o) in enumerate(keys) if m is members and o not in ("*", RECOMPUTE)]
        total = sum(costs[j] for j in idx)
        factor = min(1.0, max(0.25, c_all / total)) if total > 0 else 1.0
        for j in idx:
            out[j] = costs[j] * factor
    return out


def profile_model(model: nn.Module, batch: Batch, *, rounds: int = 5, quant_options: Optional[Dict] = None,
                  log=print) -> Profile:
    """Profile ``model`` (stock, not modified) on ``batch``'s device. ``rounds`` timed
    steps per variant, interleaved with stock steps."""
    quant_options = dict(quant_options or {})
    model = model.to(batch.device).train()
    units = find_units(model)
    stock_bytes = activation_bytes(model, batch)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stock_peak = peak_bytes(model, batch)

    groups: Dict[str, List[Unit]] = {}
    for u in units:
        groups.setdefault(u.group, []).append(u)

    # ---- memory and time, per (group, op)
    variants, keys = [], []
    for members in groups.values():
        ops = members[0].ops
        choices = ops + (("*",) if len(ops) > 1 else ())  # "*": every op at once, for calibration
        if members[0].recomputable:
            choices += (RECOMPUTE,)  # checkpoint the block instead (no compression in it)
        for op in choices:
            chosen = ops if op == "*" else (op,)
            variant = patch_items(copy.deepcopy(model), {u.name: chosen for u in members}, quant_options)
            variants.append(variant)
            keys.append((members, op))
    log(f"profiling {len(keys)} (layer group, op) variants x {rounds} rounds on {batch.device} ...")
    saved = [stock_bytes - activation_bytes(v, batch) for v in variants]
    steps = [lambda: train_step(model, batch)] + [(lambda v=v: train_step(v, batch)) for v in variants]
    times = interleaved_times(steps, batch.device, rounds)
    # fastest of the interleaved rounds: on a shared machine other work only ever adds time,
    # and the minimum is the most repeatable estimate (a measured speed-up is timer noise:
    # compression adds work, so costs are clamped at 0)
    stock_t = fastest(times[0])
    costs = [max(0.0, fastest(tv) - stock_t) for tv in times[1:]]
    del variants
    costs = _calibrate(keys, costs)

    # ---- sensitivity, per (unit, op)
    exact = gradients(model, batch)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in exact)) or 1.0
    items: List[ItemProfile] = []
    for (members, op), s, c in zip(keys, saved, costs):
        if op == "*":
            continue
        for u in members:
            if op == RECOMPUTE:  # the same arithmetic again, RNG state restored: exact gradients
                items.append(ItemProfile(u.name, op, s / len(members), c / len(members), 0.0))
                continue
            variant = patch_items(copy.deepcopy(model), {u.name: (op,)}, quant_options)
            err = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(gradients(variant, batch), exact)))
            items.append(ItemProfile(u.name, op, s / len(members), c / len(members), err / norm))
    every = patch_items(copy.deepcopy(model), {u.name: u.ops for u in units}, quant_options)
    floor = activation_bytes(every, batch)
    del every
    single = {(id(members), op): s for (members, op), s in zip(keys, saved)}
    pairs = _pair_extras(model, batch, groups, single, stock_bytes, quant_options)
    if pairs:  # why a plan's savings are not the sum of its layers' (the table's "saved MiB")
        shown = ", ".join(f"{p.unit} {'+'.join(p.ops)} {p.extra_bytes / 2**10:+.1f} KiB" for p in pairs[:6])
        log(f"{len(pairs)} op pairs do not save the sum of their own savings (a tensor both keep): {shown}"
            + (", ..." if len(pairs) > 6 else ""))
    order = {u.name: i for i, u in enumerate(units)}
    items.sort(key=lambda it: (order[it.unit], it.op))
    return Profile(model_architecture(model), str(batch.device), int(batch.x.shape[0]), int(batch.x.shape[-1]),
                   stock_bytes, stock_t, _spread(times[0]), param_bytes, stock_peak, items, units, quant_options,
                   floor, pairs)


def _pair_extras(model: nn.Module, batch: Batch, groups: Dict[str, List[Unit]], single_saved: Dict, stock_bytes: int,
                 quant_options: Dict) -> List[PairProfile]:
    """Each pair of a group's ops compressed together in all its members: what they save
    beyond their two single savings, split evenly among the members (as the singles are).
    Only pairs whose saving is not the sum are kept. ``single_saved``: by (id(members), op)."""
    pairs: List[PairProfile] = []
    for members in groups.values():
        for a, b in itertools.combinations(members[0].ops, 2):
            variant = patch_items(copy.deepcopy(model), {u.name: (a, b) for u in members}, quant_options)
            together = stock_bytes - activation_bytes(variant, batch)
            del variant
            extra = together - single_saved[(id(members), a)] - single_saved[(id(members), b)]
            if extra != 0:
                pairs += [PairProfile(u.name, (a, b), extra / len(members)) for u in members]
    return pairs
