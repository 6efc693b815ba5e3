"""Plan for a budget end to end: profile, allocate, measure the plan, make the table."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

from torch import nn

from mesa_train.patch.table import format_table

from .allocate import Budget, Key, Prediction, allocate, budget_bytes, predict, to_plan, useful_items
from .measure import Batch, activation_bytes, fastest, interleaved_times, peak_bytes, train_step
from .planfile import RECOMPUTE, Plan
from .profile import Profile, patch_items, profile_model

__all__ = ["make_plan", "measure_plans", "plan_table", "summary_table", "Measured"]


@dataclass
class Measured:
    activation_bytes: int
    step_s: float
    peak_bytes: Optional[int]

    def as_dict(self) -> Dict:
        return {"activation_bytes": self.activation_bytes, "step_s": self.step_s, "peak_bytes": self.peak_bytes}


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def measure_plans(model: nn.Module, batch: Batch, layer_sets: List[Dict[str, tuple]], quant_options: Dict,
                  rounds: int = 5) -> List[Measured]:
    """Measure each plan (layers dict; {} = stock) on copies of the stock ``model``,
    step times interleaved."""
    models = [patch_items(copy.deepcopy(model), layers, quant_options) if any(layers.values()) else model
              for layers in layer_sets]
    acts = [activation_bytes(m, batch) for m in models]
    peaks = [peak_bytes(m, batch) for m in models]
    times = interleaved_times([(lambda m=m: train_step(m, batch)) for m in models], batch.device, rounds)
    return [Measured(a, fastest(t), p) for a, t, p in zip(acts, times, peaks)]


def make_plan(model: nn.Module, batch: Batch, budget: Budget, *, profile: Optional[Profile] = None,
              rounds: int = 5, quant_options: Optional[Dict] = None, measure: bool = True,
              log=print) -> tuple[Plan, Profile, Dict[str, Dict]]:
    """The plan for ``budget`` (model stays stock). Returns (plan, profile, rows): rows
    maps ``stock``/``plan``/``all ops`` to predicted and measured figures."""
    if profile is None:
        profile = profile_model(model, batch, rounds=rounds, quant_options=quant_options, log=log)
    allowed, how = budget_bytes(profile, budget)
    chosen = allocate(profile, allowed)
    every: Set[Key] = useful_items(profile)
    preds = {"stock": predict(profile, ()), "plan": predict(profile, chosen), "all ops": predict(profile, every)}
    plan = to_plan(profile, chosen, budget={"asked": budget.describe(), "read_as": how,
                                             "allowed_activation_bytes": int(allowed)},
                   predicted=preds["plan"].as_dict())
    rows: Dict[str, Dict] = {k: {"predicted": p} for k, p in preds.items()}
    if measure:
        layer_sets = [{}, dict(plan.layers), {u.name: u.ops for u in profile.units}]
        for key, m in zip(("stock", "plan", "all ops"),
                          measure_plans(model, batch, layer_sets, profile.quant_options, rounds)):
            rows[key]["measured"] = m
        plan.measured = rows["plan"]["measured"].as_dict()
        plan.measured["stock_step_s"] = rows["stock"]["measured"].step_s
    return plan, profile, rows


def plan_table(plan: Plan, profile: Profile) -> str:
    """One row per layer: ops compressed, predicted bytes saved, time added, sensitivity."""
    rows = []
    for u in profile.units:
        ops = plan.layers.get(u.name, ())
        its = [profile.item(u.name, op) for op in ops]
        saved = predict(profile, [i.key for i in its]).saved_bytes  # with the unit's pairs
        left = ["(recomputed)"] if RECOMPUTE in ops else [op for op in u.ops if op not in ops]
        rows.append([u.name, ",".join(ops) or "(stock)", ",".join(left) or "-",
                     _mib(saved), f"{1e3 * sum(i.time_s for i in its):+.2f}",
                     f"{max([i.sensitivity for i in its], default=0.0):.2e}"])
    return format_table(["layer", "compressed", "kept exact", "saved MiB", "ms/step", "max sens."], rows)


def summary_table(rows: Dict[str, Dict], profile: Profile) -> str:
    """stock / plan / all ops: predicted vs measured activation memory, step time, speed."""
    out = []
    stock_meas = rows["stock"].get("measured")
    for key, r in rows.items():
        p: Prediction = r["predicted"]
        m: Optional[Measured] = r.get("measured")
        line = [key, _mib(p.activation_bytes), _mib(m.activation_bytes) if m else "-",
                f"{p.activation_bytes / profile.stock_activation_bytes:.3f}",
                f"{1e3 * p.step_s:.1f}", f"{1e3 * m.step_s:.1f}" if m else "-",
                f"{profile.stock_step_s / p.step_s:.3f}",
                f"{stock_meas.step_s / m.step_s:.3f}" if m and stock_meas else "-"]
        if profile.stock_peak_bytes is not None:
            line += [_mib(p.peak_bytes), _mib(m.peak_bytes) if m else "-"]
        out.append(line)
    headers = ["", "act MiB pred", "act MiB meas", "x stock", "ms pred", "ms meas", "speed pred", "speed meas"]
    if profile.stock_peak_bytes is not None:
        headers += ["peak MiB pred", "peak MiB meas"]
    return format_table(headers, out)
