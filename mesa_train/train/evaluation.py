"""Evaluate a saved checkpoint (``evaluate.py``): rebuild the model from the config stored
in the checkpoint, load its (or its EMA's) weights, run ``engine.evaluate``."""
from __future__ import annotations

from omegaconf import OmegaConf

from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train.config import ConfigError, validate
from mesa_train.train.data import build_loaders
from mesa_train.train.engine import evaluate
from mesa_train.train.model import build as build_model_from_cfg
from mesa_train.train.runner import AMP_DTYPES, resolve_device


def evaluate_checkpoint(path: str, data: dict | None = None, ema: bool = False, batch_size: int = 128,
                        num_workers: int = 4, device: str = "auto", amp: str = "none") -> dict:
    """Top-1/top-5/loss of checkpoint ``path`` on ``data`` (a data-group dict; default:
    the checkpoint's own data config)."""
    ckpt = ckpt_lib.load_checkpoint(path)
    cfg = OmegaConf.create(ckpt["config"])
    if data is not None:
        cfg.data = OmegaConf.create(data)
    cfg.trainer.batch_size, cfg.trainer.num_workers = int(batch_size), int(num_workers)
    cfg.trainer.device, cfg.trainer.amp = device, amp
    validate(cfg)
    loaders = build_loaders(cfg, train=False)
    num_classes = int(ckpt.get("num_classes") or loaders.num_classes)
    if loaders.num_classes != num_classes:
        raise ConfigError(
            f"the checkpoint's model has {num_classes} classes, data {cfg.data.name!r} has "
            f"{loaders.num_classes}; evaluate on data with the same classes"
        )
    model = build_model_from_cfg(cfg, num_classes)
    if ema:
        if ckpt.get("ema") is None:
            raise ckpt_lib.CheckpointError(f"{path} has no EMA weights (trained with optim.ema=false)")
        ckpt_lib.load_model_state(model, ckpt["ema"], path, what="EMA")
    else:
        ckpt_lib.load_model_state(model, ckpt["model"], path)
    dev = resolve_device(device)
    model.to(dev)
    metrics = evaluate(model, loaders.val, dev, AMP_DTYPES[amp], num_classes)
    metrics.update(checkpoint=str(path), ema=bool(ema), data=cfg.data.name,
                   model=cfg.model.name, step=int(ckpt["state"].get("step", 0)))
    return metrics
