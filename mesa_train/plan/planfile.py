"""The plan: which ops each unit compresses, as a dataclass and a YAML file.

```yaml
format: mesa-train-plan/1
model: {architecture: vit_tiny_patch16_224, fingerprint: 3f2e7ce9b8}
quant_options: {}            # passed to patch_model for every unit
layers:                      # unit -> compressed ops ([] = stock)
  (other): []
  blocks.0: [gelu, softmax]
  blocks.1: [recompute]      # checkpointed: recomputed in backward
fingerprints: {(other): a9401eacb2, blocks.0: 3f2e7ce9b8}
budget: {...}                # what was asked (informational)
predicted: {...}             # planner's cost model for this plan
measured: {...}              # measured after applying it
```
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple, Union

import yaml

from mesa_train.nn.quantizer import QuantOptions
from mesa_train.patch.core import OPS

__all__ = ["Plan", "PlanError", "FORMAT", "RECOMPUTE", "PLAN_OPS", "load_plan", "save_plan", "as_plan"]

FORMAT = "mesa-train-plan/1"
# A plan's per-layer choice besides compressing ops: recompute the block in backward
# (activation checkpointing, mesa_train.plan.recompute). It replaces compression there.
RECOMPUTE = "recompute"
PLAN_OPS = tuple(OPS) + (RECOMPUTE,)


class PlanError(ValueError):
    """A plan that cannot be used (bad file, other model, unknown layers or ops, budget
    below the floor). The message is one line naming what is wrong."""


@dataclass
class Plan:
    layers: Dict[str, Tuple[str, ...]]
    architecture: str = ""
    fingerprints: Dict[str, str] = field(default_factory=dict)
    quant_options: Dict[str, Any] = field(default_factory=dict)
    budget: Dict[str, Any] = field(default_factory=dict)
    predicted: Dict[str, Any] = field(default_factory=dict)
    measured: Dict[str, Any] = field(default_factory=dict)

    @property
    def compressed(self) -> Dict[str, Tuple[str, ...]]:
        return {k: v for k, v in self.layers.items() if v}

    def to_dict(self) -> Dict[str, Any]:
        return {
            "format": FORMAT,
            "model": {"architecture": self.architecture},
            "quant_options": dict(self.quant_options),
            "layers": {k: list(v) for k, v in self.layers.items()},
            "fingerprints": dict(self.fingerprints),
            "budget": _plain(self.budget),
            "predicted": _plain(self.predicted),
            "measured": _plain(self.measured),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanError(f"{source}: not a mesa-train plan (format {got!r}, expected {FORMAT!r})")
        layers = data.get("layers")
        if not isinstance(layers, dict):
            raise PlanError(f"{source}: 'layers' must be a mapping of layer name -> list of ops")
        parsed: Dict[str, Tuple[str, ...]] = {}
        bad_ops = []
        for name, ops in layers.items():
            ops = [] if ops is None else ([ops] if isinstance(ops, str) else list(ops))
            bad_ops += [f"{name}: {o}" for o in ops if o not in PLAN_OPS]
            parsed[str(name)] = tuple(o for o in PLAN_OPS if o in ops)
        if bad_ops:
            raise PlanError(f"{source}: unknown ops {bad_ops}; valid ops: {', '.join(PLAN_OPS)}")
        mixed = [n for n, ops in parsed.items() if RECOMPUTE in ops and len(ops) > 1]
        if mixed:
            raise PlanError(f"{source}: layers {mixed} both recompute and compress: a recomputed block keeps only "
                            f"its input, so list either [{RECOMPUTE}] or the ops to compress")
        quant_options = data.get("quant_options") or {}
        if not isinstance(quant_options, dict):
            raise PlanError(f"{source}: 'quant_options' must be a mapping of option -> value")
        try:  # (checked on load: a plan whose layers are all stock never reaches patch_model's check)
            QuantOptions.from_kwargs(**quant_options)
        except (TypeError, ValueError) as err:
            raise PlanError(f"{source}: quant_options: {err}") from None
        model = data.get("model") or {}
        return cls(layers=parsed, architecture=str(model.get("architecture", "")),
                   fingerprints={str(k): str(v) for k, v in (data.get("fingerprints") or {}).items()},
                   quant_options=dict(quant_options),
                   budget=dict(data.get("budget") or {}), predicted=dict(data.get("predicted") or {}),
                   measured=dict(data.get("measured") or {}))


def _plain(d: Dict[str, Any]) -> Dict[str, Any]:
    """YAML-safe copy (numpy/torch scalars -> Python numbers)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _plain(v)
        elif hasattr(v, "item"):
            out[k] = v.item()
        elif isinstance(v, tuple):
            out[k] = list(v)
        else:
            out[k] = v
    return out


def save_plan(plan: Plan, path: Union[str, os.PathLike]) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("# mesa-train compression plan: python -m mesa_train.plan; use with "
                "patch_model(model, plan=PATH) or train.py mesa.plan=PATH\n")
        yaml.safe_dump(plan.to_dict(), f, sort_keys=False, default_flow_style=None)
    return path


def load_plan(path: Union[str, os.PathLike]) -> Plan:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PlanError(f"plan file {path!r} does not exist")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise PlanError(f"plan file {path!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    return Plan.from_dict(data, source=f"plan file {path!r}")


def as_plan(plan_or_path: Any) -> Plan:
    """A :class:`Plan` from a Plan, a dict (the YAML content) or a path."""
    if isinstance(plan_or_path, Plan):
        return plan_or_path
    if isinstance(plan_or_path, dict):
        return Plan.from_dict(plan_or_path)
    if isinstance(plan_or_path, (str, os.PathLike)):
        return load_plan(plan_or_path)
    raise PlanError(f"plan must be a Plan, a dict or a path to a plan file, got {type(plan_or_path).__name__}")
