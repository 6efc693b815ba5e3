"""Apply a plan to a model: ``patch_model(model, plan=...)`` lands here."""
from __future__ import annotations

from typing import Any

from torch import nn

from mesa_train.models import unwrap_model
from mesa_train.nn.quantizer import assign_rng_keys
from mesa_train.patch.checkpoint import accept_stock_checkpoints
from mesa_train.patch.core import check_patch_arguments, patch_model
from mesa_train.patch.reuse import watch_reuse
from mesa_train.patch.skip_marks import undo_skips_around
from mesa_train.patch.table import format_table

from .planfile import RECOMPUTE, Plan, PlanError, as_plan
from .recompute import recompute_block
from .units import OTHER, find_units, model_architecture

__all__ = ["apply_plan", "check_plan", "PLAN_ATTR", "plan_of", "describe_plan"]

PLAN_ATTR = "_mesa_plan"


def check_plan(model: nn.Module, plan: Plan) -> dict:
    """Refuse a plan made for another model: unknown layer names, a layer whose parameter
    shapes differ, or an op a layer does not have. Raises :class:`PlanError`. Returns the
    model's units by name (``find_units``), which the caller need not find again."""
    units = {u.name: u for u in find_units(model)}
    arch = model_architecture(model)
    unknown = [n for n in plan.layers if n not in units]
    if unknown:
        raise PlanError(f"plan (for {plan.architecture or 'an unknown model'}) names layers this model "
                        f"({arch}) does not have: {unknown}; its layers: {list(units)}")
    changed = [n for n, fp in plan.fingerprints.items() if n in units and units[n].fingerprint != fp]
    if changed:
        raise PlanError(f"plan was made for another model ({plan.architecture or '?'}, this is {arch}): "
                        f"layers with other parameter shapes: {changed}")
    bad = [f"{n}: {o}" for n, ops in plan.layers.items() for o in ops
           if o not in units[n].ops and not (o == RECOMPUTE and units[n].recomputable)]
    if bad:
        raise PlanError(f"plan asks ops these layers do not have: {bad}")
    return units


def apply_plan(model: nn.Module, plan_or_path: Any, attention: str = "auto", **quant_options) -> nn.Module:
    """Patch ``model`` in place as ``plan`` says and return it. ``quant_options`` override
    the plan's. The plan is kept on the model (:func:`plan_of`). Every layer's arguments are
    checked before any layer is changed: a wrong option leaves the model as it was."""
    plan = as_plan(plan_or_path)
    units = check_plan(model, plan)
    root = unwrap_model(model)
    options = {**plan.quant_options, **quant_options}
    # mlp / norm_linear "separate": the planner prices each (layer, op) on its own and adds them
    # up; fc2 taking the GELU's copy or qkv / fc1 the norm's (patch_model's defaults) would
    # make the bytes depend on pairs of items
    copies = {"mlp": options.pop("mlp", "separate"), "norm_linear": options.pop("norm_linear", "separate")}
    # the outside-blocks unit: the layers of modules=other; in a model with no transformer block
    # (ConvNeXt, a CNN) every layer is outside, its MLPs (module set ffn) too, so all sets
    blockless = list(units) == [OTHER]
    calls = [(root, plan.layers.get(OTHER, ()), ("all",) if blockless else ("other",))]
    calls += [(root.get_submodule(name), ops, ("all",)) for name, ops in plan.layers.items() if name != OTHER]
    for _, ops, modules in calls:  # (validation first, as patch_model's own)
        if ops and RECOMPUTE not in ops:
            check_patch_arguments(ops, modules, options, attention=attention, **copies)
    # skip_duplicated's switches measured the model before this plan (patch/skip_marks.py): every
    # one undone, not only the units' the plan patches
    undo_skips_around(root)
    for unit, ops, modules in calls:
        if not ops:
            continue
        if RECOMPUTE in ops:  # the plan file check allows nothing beside it
            recompute_block(unit)
        else:
            patch_model(unit, ops=ops, modules=modules, attention=attention, **copies, **options)
    # per-block patching keyed the quantizers by block-relative names: key them by their
    # names in the whole model, as a whole-model patch does
    assign_rng_keys(root)
    # one stock-checkpoint hook, the whole model's, in place of the units' (patch/checkpoint.py)
    accept_stock_checkpoints(root)
    # (the units' own watches end with the whole model's: a unit called twice is one unit forward each)
    watch_reuse(root)
    object.__setattr__(root, PLAN_ATTR, plan)
    return model


def plan_of(model: nn.Module) -> Plan | None:
    """The plan applied to ``model`` (None if none was)."""
    return getattr(unwrap_model(model), PLAN_ATTR, None)


def describe_plan(model: nn.Module) -> str:
    """The applied plan as a table (layer, compressed ops, budget and predicted figures);
    an empty string when the model was not patched from a plan."""
    plan = plan_of(model)
    if plan is None:
        return ""
    rows = [[name, ", ".join(ops) or "(stock)"] for name, ops in plan.layers.items()]
    lines = [f"plan for {plan.architecture or '?'}" + (f", {plan.budget['asked']}" if plan.budget.get("asked") else "")]
    pred = plan.predicted
    if pred.get("activation_bytes") is not None:
        lines.append(f"predicted: {pred['activation_bytes'] / 2**20:.2f} MiB activations, "
                     f"{1e3 * pred.get('step_s', 0.0):.1f} ms/step")
    return "\n".join(lines + [format_table(["layer", "compressed ops"], rows)])
