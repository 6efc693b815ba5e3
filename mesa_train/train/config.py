"""Start-up checks of a composed training config, and the few values derived from it.

Everything a user can mistype is checked here, before a model is built or a file is
written, and all problems are reported together with the valid choices.
"""
from __future__ import annotations

from typing import Any

from mesa_train.models import MODEL_NAMES

# Valid names, as documented in docs/DESIGN.md (mesa_train.patch).
MESA_OPS = ("linear", "matmul", "softmax", "gelu", "layernorm", "conv", "relu", "sdpa", "all")
MESA_MODULES = ("msa", "ffn", "other", "all")
MESA_ESTIMATORS = ("running", "per_sample")
MESA_ROUNDINGS = ("stochastic", "nearest")
AMP_MODES = ("bf16", "fp16", "none")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("cifar100", "imagenet", "digits", "synthetic")


class ConfigError(ValueError):
    """A config value that cannot work; the message says which and what is valid."""


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def validate(cfg) -> None:
    """Raise ``ConfigError`` listing every invalid value of ``cfg``."""
    errors: list[str] = []

    def choice(path: str, value, valid) -> None:
        if value not in valid:
            errors.append(f"{path}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")

    names = list(MODEL_NAMES) + list(MODEL_NAMES.values())
    if cfg.model.name not in names:
        errors.append(
            f"model.name={cfg.model.name!r} is not a known model; choose one of: "
            f"{', '.join(MODEL_NAMES)} (config group: model=NAME)"
        )
    if not isinstance(cfg.model.img_size, int) or cfg.model.img_size < 1:
        errors.append(f"model.img_size={cfg.model.img_size!r} must be a positive integer")

    choice("data.name", cfg.data.name, DATASETS)

    m = cfg.mesa
    if not isinstance(m.enabled, bool):
        errors.append(f"mesa.enabled={m.enabled!r} must be true or false")
    ops, modules = _as_list(m.ops), _as_list(m.modules)
    bad_ops = [o for o in ops if o not in MESA_OPS]
    if bad_ops or not ops:
        errors.append(f"mesa.ops={ops} has unknown ops {bad_ops}; valid ops: {', '.join(MESA_OPS)}")
    bad_modules = [x for x in modules if x not in MESA_MODULES]
    if bad_modules or not modules:
        errors.append(
            f"mesa.modules={modules} has unknown modules {bad_modules}; "
            f"valid modules: {', '.join(MESA_MODULES)}"
        )
    choice("mesa.estimator", m.estimator, MESA_ESTIMATORS)
    choice("mesa.rounding", m.rounding, MESA_ROUNDINGS)
    if not isinstance(m.symmetric, bool):
        errors.append(f"mesa.symmetric={m.symmetric!r} must be true or false")
    if not (isinstance(m.decay, (int, float)) and 0.0 <= m.decay < 1.0):
        errors.append(f"mesa.decay={m.decay!r} must be a number in [0, 1)")
    if m.num_groups is not None and not (isinstance(m.num_groups, int) and m.num_groups >= 1):
        errors.append(f"mesa.num_groups={m.num_groups!r} must be null (one per head) or an integer >= 1")

    t = cfg.trainer
    choice("trainer.amp", t.amp, AMP_MODES)
    choice("trainer.device", t.device, DEVICES)
    for key in ("epochs", "batch_size", "grad_accum", "eval_every"):
        value = t[key]
        if not (isinstance(value, int) and value >= 1):
            errors.append(f"trainer.{key}={value!r} must be an integer >= 1")
    if t.max_steps is not None and not (isinstance(t.max_steps, int) and t.max_steps >= 1):
        errors.append(f"trainer.max_steps={t.max_steps!r} must be null or an integer >= 1")
    if t.clip_grad is not None and not (isinstance(t.clip_grad, (int, float)) and t.clip_grad > 0):
        errors.append(f"trainer.clip_grad={t.clip_grad!r} must be null or a positive number")
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def mesa_options(cfg) -> dict:
    """Keyword arguments of ``mesa_train.patch_model`` from the ``mesa`` group
    (null values are left to the library's defaults)."""
    m = cfg.mesa
    opts = {
        "ops": tuple(_as_list(m.ops)),
        "modules": tuple(_as_list(m.modules)),
        "num_groups": m.num_groups,
        "decay": m.decay,
        "estimator": m.estimator,
        "symmetric": m.symmetric,
        "rounding": m.rounding,
    }
    return {k: v for k, v in opts.items() if v is not None}


def learning_rate(cfg, world_size: int) -> float:
    """``optim.lr`` if set, else the linear scaling rule
    ``base_lr * batch_size * world_size * grad_accum / base_batch``."""
    o = cfg.optim
    if o.lr is not None:
        return float(o.lr)
    total_batch = cfg.trainer.batch_size * world_size * cfg.trainer.grad_accum
    return float(o.base_lr) * total_batch / float(o.base_batch)
