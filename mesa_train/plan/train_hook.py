"""Training-side use of plans: ``mesa.plan=auto mesa.budget=0.6`` (plan at start-up) or
``mesa.plan=FILE`` (reuse one). The training runner calls :func:`apply_plan_from_config`
after the *stock* model is on its device (``mesa_train.train.model.build`` leaves a model
with ``mesa.plan`` unpatched); rank 0 plans, every rank applies the same plan (broadcast).
A resumed run applies the plan its checkpoint stores (``mesa_plan``), never a new one: a
re-planned model could have other Mesa layers than the saved weights and estimates.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .allocate import Budget
from .apply import apply_plan, plan_of
from .measure import make_batch
from .planfile import Plan, PlanError, as_plan
from .planner import make_plan, plan_table

__all__ = ["plan_from_config", "apply_plan_from_config", "plan_for_checkpoint"]

log = logging.getLogger("mesa_train.plan")


def _get(node: Any, key: str, default=None):
    value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    return default if value is None else value


# the mesa group's quantizer options a plan is made and applied with (mesa.bits=4 and the other
# variants were left out without a word: planned and trained at 8 bits); ops and modules are the
# plan's own choice
QUANT_KEYS = ("num_groups", "decay", "estimator", "symmetric", "rounding", "row_scale", "bits", "scale", "layout",
              "clip_horizon")


def quant_options(mesa) -> dict:
    """``patch_model``'s quantizer options from a ``mesa`` config group (train.py's, or the plan
    command's), the unset ones left to the library's defaults."""
    opts = {k: _get(mesa, k) for k in QUANT_KEYS}
    return {k: v for k, v in opts.items() if v is not None}


def _broadcast(plan: Optional[Plan], error: Optional[str]) -> Plan:
    """Rank 0's plan (or its error) on every rank."""
    if dist.is_available() and dist.is_initialized():
        box = [plan.to_dict() if plan is not None else None, error]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_dict(box[0]) if box[0] is not None else None
        error = box[1]
    if error:
        raise PlanError(error)
    assert plan is not None
    return plan


def plan_from_config(cfg, model: nn.Module, device: torch.device, amp_dtype: Optional[torch.dtype],
                     num_classes: int) -> Optional[Plan]:
    """The plan ``cfg.mesa`` asks for (None without ``mesa.plan``)."""
    mesa = cfg.mesa
    source = _get(mesa, "plan")
    if source is None or not _get(mesa, "enabled", True):
        return None
    if str(source) != "auto":
        return as_plan(str(source))

    plan, error = None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        try:
            budget = Budget(fraction=_get(mesa, "budget"), gb=_get(mesa, "budget_gb"))
            batch = make_batch(int(cfg.trainer.batch_size), int(cfg.model.img_size), num_classes, device, amp_dtype)
            plan, profile, _ = make_plan(model, batch, budget, rounds=3, quant_options=quant_options(mesa),
                                         measure=False, log=log.info)
            log.info("mesa.plan=auto (%s):\n%s", plan.budget.get("read_as"), plan_table(plan, profile))
        except PlanError as err:
            error = str(err)
    return _broadcast(plan, error)


def apply_plan_from_config(cfg, model: nn.Module, device: torch.device, amp_dtype: Optional[torch.dtype],
                           num_classes: int, saved_plan: Optional[dict] = None) -> Optional[Plan]:
    """Patch the stock ``model`` with the configured plan, or with ``saved_plan`` (the dict a
    checkpoint stores) when resuming; returns the plan applied (None: no plan)."""
    if saved_plan is not None:
        plan = Plan.from_dict(saved_plan, source="the checkpoint's mesa_plan")
        log.info("mesa.plan: the resumed checkpoint's plan (%d layers)", len(plan.layers))
    else:
        plan = plan_from_config(cfg, model, device, amp_dtype, num_classes)
    if plan is not None:
        options = quant_options(cfg.mesa)
        _check_sizes(plan, options)
        apply_plan(model, plan, **options)
    return plan


# the options that set how many bytes a copy takes: a plan's memory was predicted with its own
# (the others, such as decay, may differ from the plan's and override them)
_SIZE_KEYS = ("bits", "layout")


def _check_sizes(plan: Plan, options: dict) -> None:
    """``PlanError`` where the config asks another copy size than the plan was made with
    (a plan made at mesa.bits=4, trained at 8, keeps twice the bytes it was planned to)."""
    made = plan.quant_options
    differ = [k for k in _SIZE_KEYS if k in made and k in options and made[k] != options[k]]
    if differ:
        said = "; ".join(f"{k}={made[k]!r}, but mesa.{k}={options[k]!r}" for k in differ)
        fix = " ".join(f"mesa.{k}={made[k]}" for k in differ)
        raise PlanError(f"the plan was made with {said}: its memory was planned at the plan's sizes; set {fix}, "
                        f"or make a plan with these settings")


def plan_for_checkpoint(model: nn.Module) -> Optional[dict]:
    """The applied plan as the plain dict a checkpoint stores (None: no plan)."""
    plan = plan_of(model)
    return plan.to_dict() if plan is not None else None
