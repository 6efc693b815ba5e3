"""Evaluate a saved checkpoint (``evaluate.py``): rebuild the model from the config stored
in the checkpoint, load its (or its EMA's) weights, run ``engine.evaluate``."""
from __future__ import annotations

from omegaconf import OmegaConf

import os

from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import sharded
from mesa_train.train.config import (NO_ROOT_DATA, ConfigError, bool_errors, bool_settings, group_errors, key_tree,
                                     validate)
from mesa_train.train.data import build_loaders
from mesa_train.train.engine import evaluate
from mesa_train.train.model import build as build_model_from_cfg
from mesa_train.train.runner import AMP_DTYPES, resolve_amp, resolve_device

# trainer.* values evaluate.py takes from its own command line (train.py's names)
TRAINER_KEYS = ("batch_size", "num_workers", "device", "amp", "pin_memory", "channels_last")
# evaluate.py's own top-level settings (configs/eval.yaml); the model comes from the checkpoint
EVAL_KEYS = ("checkpoint", "ema", "output", "data", "trainer")


# train.py's groups that evaluate.py takes from the checkpoint's config, never from its command line
CHECKPOINT_GROUPS = ("model", "mesa")


def checkpoint_setting(key: str) -> str | None:
    """Why the dotted ``key`` is no setting of evaluate.py where it is one of train.py's that the
    checkpoint holds (``model.img_size``, ``mesa.bits``), in one line, or None."""
    if key.partition(".")[0] not in CHECKPOINT_GROUPS:
        return None
    return f"evaluate.py takes the model and Mesa settings from the checkpoint; valid keys: {', '.join(EVAL_KEYS)}"


def refuses_new_key(key: str) -> bool:
    """Whether ``check_eval_settings`` refuses the dotted ``key`` added with '+': any but evaluate.py's
    own and the data / trainer keys of their option files. (hydra_cli advises '+' only where it passes.)"""
    group, _, rest = key.partition(".")
    if group not in EVAL_KEYS:
        return True
    return group in ("data", "trainer") and bool(rest) and bool(group_errors(group, key_tree(rest)))


def check_eval_settings(cfg) -> None:
    """``ConfigError`` for a key evaluate.py would ignore: one no setting of configs/eval.yaml
    ('+model.name=deit_s': the model is the checkpoint's), or a ``data.*`` / ``trainer.*`` key
    no option file of the group has ('+data.rooot=x')."""
    errors = [f"{key} is not a setting of evaluate.py (settings: {', '.join(EVAL_KEYS)}; the model and "
              "its Mesa layout come from the checkpoint)" for key in cfg if key not in EVAL_KEYS]
    for group in ("data", "trainer"):
        if cfg.get(group) is not None:
            errors += group_errors(group, OmegaConf.to_container(cfg[group], resolve=False))
    # (ema=no was truthy: the EMA weights evaluated)
    errors += bool_errors(cfg, ["ema", *(k for k in bool_settings() if k.split(".")[0] in ("data", "trainer"))])
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def evaluate_checkpoint(path: str, data: dict | None = None, ema: bool = False, batch_size: int = 128,
                        num_workers: int = 4, device: str = "auto", amp: str = "auto",
                        trainer: dict | None = None, on_accept=None) -> dict:
    """Top-1/top-5/loss of checkpoint ``path``. ``data``: a whole data group (with a
    ``name``), or single values (no ``name``, nulls ignored) applied to the checkpoint's
    own data config. ``trainer`` (train.py's ``trainer.*`` names) wins over the keyword
    defaults ``batch_size``, ``num_workers``, ``device``, ``amp``. ``on_accept(cfg, images)``
    is called once the checkpoint, data and weights are in place, before the pass over the
    data (evaluate.py logs from there on, so a call refused before leaves no log file)."""
    # A sharded FSDP checkpoint (last.dcp/) is read whole into this one process.
    if os.path.isdir(path) and not sharded.is_sharded(path):  # (a run directory: its checkpoints named)
        from mesa_train.train.runner import not_a_checkpoint_dir

        not_a_checkpoint_dir(path, "best.pt", key="checkpoint")
    ckpt = sharded.load_meta(path) if os.path.isdir(path) else ckpt_lib.load_checkpoint(path)
    cfg = OmegaConf.create(ckpt["config"])
    if cfg.data.get("name") in NO_ROOT_DATA:  # (a checkpoint from before data.root was refused there: unread)
        cfg.data.root = None
    if data:
        values = {k: v for k, v in data.items() if v is not None}
        if values.get("name") is not None:
            cfg.data = OmegaConf.create(data)
        else:
            cfg.data = OmegaConf.merge(cfg.data, values)
    settings = dict(batch_size=int(batch_size), num_workers=int(num_workers), device=device, amp=amp)
    settings.update({k: v for k, v in (trainer or {}).items() if k in TRAINER_KEYS and v is not None})
    for key, value in settings.items():
        cfg.trainer[key] = value
    validate(cfg)
    loaders = build_loaders(cfg, train=False)
    num_classes = int(ckpt.get("num_classes") or loaders.num_classes)
    if loaders.num_classes != num_classes:
        raise ConfigError(
            f"the checkpoint's model has {num_classes} classes, data {cfg.data.name!r} has "
            f"{loaders.num_classes}; evaluate on data with the same classes"
        )
    ckpt_lib.check_same_classes(ckpt, loaders.num_classes, loaders.classes, cfg.data.get("root"), path, "evaluate")
    if len(loaders.val.dataset) == 0:
        raise ConfigError(f"data {cfg.data.name!r} has no validation images (data.val_size=0?)")
    cfg.model.pretrained_path = None  # the checkpoint's own weights are loaded below
    model = build_model_from_cfg(cfg, num_classes)
    if ema:
        if ckpt.get("ema") is None:
            raise ckpt_lib.CheckpointError(f"{path} has no EMA weights (trained with optim.ema=false)")
        ckpt_lib.load_model_state(model, ckpt["ema"], path, what="EMA")
    elif ckpt.get("sharded"):
        sharded.load_sharded(path, model)
    else:
        ckpt_lib.load_model_state(model, ckpt["model"], path)
    dev = resolve_device(cfg.trainer.device)
    model.to(dev)
    amp_mode = resolve_amp(cfg.trainer.amp, dev)
    if on_accept is not None:
        on_accept(cfg, len(loaders.val.dataset))
    metrics = evaluate(model, loaders.val, dev, AMP_DTYPES[amp_mode], num_classes, bool(cfg.trainer.channels_last))
    metrics.update(checkpoint=str(path), ema=bool(ema), data=cfg.data.name, amp=amp_mode,
                   model=cfg.model.name, step=int(ckpt["state"].get("step", 0)))
    return metrics
