"""The training run: build everything from a config, resume, loop over epochs, save.

``fit(cfg, run_dir)`` is what ``train.py`` (Hydra) and ``mesa_train.demo`` call. ``cfg`` is
the composed config (OmegaConf or anything with the same attribute access).
"""
from __future__ import annotations

import logging
import math
import os
import random
import time

import numpy as np
import torch

from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import distributed as dist_utils
from mesa_train.train.config import learning_rate, validate
from mesa_train.train.data import build_loaders, build_mixup
from mesa_train.train.engine import Parts, TrainState, build_criterion, evaluate, train_one_epoch
from mesa_train.train.loggers import RunLogger
from mesa_train.train.model import build as build_model_from_cfg

log = logging.getLogger("mesa_train.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", dist_utils.env_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def resume_path(cfg, run_dir: str) -> str | None:
    """``trainer.resume``: null -> None; auto -> the run dir's last.pt when it exists;
    anything else is a checkpoint path that must exist."""
    resume = cfg.trainer.resume
    if resume in (None, False, "", "null", "none"):
        return None
    if resume == "auto":
        path = os.path.join(checkpoint_dir(run_dir), "last.pt")
        return path if os.path.isfile(path) else None
    if not os.path.isfile(str(resume)):
        raise ckpt_lib.CheckpointError(f"trainer.resume={resume!r}: no such checkpoint file")
    return str(resume)


def fit(cfg, run_dir: str) -> dict:
    """Train as ``cfg`` says, writing logs and checkpoints under ``run_dir``.
    Returns the summary (also written to ``run_dir/summary.json`` by rank 0)."""
    validate(cfg)  # before anything is built or written
    plain_cfg = ckpt_lib.to_plain(cfg)
    t, o = cfg.trainer, cfg.optim
    dist_utils.init_from_env()
    rank, world = dist_utils.rank(), dist_utils.world_size()
    main = rank == 0
    device = resolve_device(t.device)
    amp_dtype = AMP_DTYPES[t.amp]
    seed_everything(int(t.seed) + rank)

    # Data first: a missing dataset fails before the (possibly large) model is built.
    loaders = build_loaders(cfg, rank=rank, world_size=world, train=True)
    model = build_model_from_cfg(cfg, loaders.num_classes, drop_path=o.drop_path)
    if t.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    if t.channels_last:
        model.to(memory_format=torch.channels_last)
    if main:
        log.info("run directory: %s", os.path.abspath(run_dir))
        log.info("model %s: %.2fM parameters, %d classes", cfg.model.name,
                 sum(p.numel() for p in model.parameters()) / 1e6, loaders.num_classes)
        log.info("Mesa layout:\n%s", _describe(model))

    ema = None
    if o.ema:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=o.ema_decay)
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # DDP's default buffer sync sends rank 0's buffers (the Mesa running estimates) to
        # every rank before each forward, so all ranks quantize with the same estimates.
        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if t.compile:
        train_model = torch.compile(train_model)

    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    lr = learning_rate(cfg, world)
    opt_kwargs = {"eps": o.eps} if o.eps is not None else {}
    optimizer = create_optimizer_v2(model, opt=o.opt, lr=lr, weight_decay=o.weight_decay,
                                    momentum=o.momentum, **opt_kwargs)
    updates_per_epoch = math.ceil(loaders.train_batches / t.grad_accum)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=o.sched, num_epochs=t.epochs, warmup_epochs=o.warmup_epochs,
        warmup_lr=o.warmup_lr, min_lr=o.min_lr, step_on_epochs=False, updates_per_epoch=updates_per_epoch,
    )
    scaler = torch.amp.GradScaler(device.type) if t.amp == "fp16" else None
    mixup = build_mixup(cfg, loaders.num_classes)
    criterion = build_criterion(o.smoothing, mixup is not None)

    # ---- resume
    state = TrainState()
    path = resume_path(cfg, run_dir)
    if path is not None:
        ckpt = ckpt_lib.load_checkpoint(path)
        ckpt_lib.check_compatible(ckpt["config"], plain_cfg, path)
        ckpt_lib.load_model_state(model, ckpt["model"], path)
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scheduler") is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler") is not None:
            scaler.load_state_dict(ckpt["scaler"])
        if ema is not None:
            if ckpt.get("ema") is not None:
                ckpt_lib.load_model_state(ema.module, ckpt["ema"], path, what="EMA")
            else:
                log.warning("checkpoint has no EMA weights; the EMA restarts from the model")
                ema = ModelEmaV3(model, decay=o.ema_decay)
        state = TrainState(**ckpt["state"])
        rngs = ckpt.get("rng") or []
        if len(rngs) == world:
            ckpt_lib.set_rng_state(rngs[rank])
        else:
            log.warning("checkpoint was written by %d ranks, now %d: RNG streams restart", len(rngs), world)
        if main:
            log.info("resumed from %s: epoch %d, batch %d, step %d", path, state.epoch,
                     state.batch_in_epoch, state.step)

    logger = RunLogger(run_dir, enabled=main, wandb_cfg=cfg.logger.wandb, config=plain_cfg,
                       name=str(cfg.name), resume_step=state.step if path else None)
    parts = Parts(model=train_model, optimizer=optimizer, criterion=criterion, device=device,
                  scheduler=scheduler, scaler=scaler, amp_dtype=amp_dtype, mixup=mixup, ema=ema,
                  grad_accum=t.grad_accum, clip_grad=t.clip_grad, channels_last=t.channels_last)
    ckpt_dir = checkpoint_dir(run_dir)

    def save(metrics: dict | None, best: bool) -> None:
        # Every rank takes part (RNG states are gathered); rank 0 writes.
        rngs = [ckpt_lib.rng_state()]
        if world > 1:
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, rngs[0])
            rngs = gathered
        if main:
            payload = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "ema": ema.module.state_dict() if ema is not None else None,
                "state": vars(state).copy(),
                "rng": rngs,
                "config": plain_cfg,
                "num_classes": loaders.num_classes,
                "metrics": metrics or {},
            }
            last = os.path.join(ckpt_dir, "last.pt")
            ckpt_lib.save_checkpoint(payload, last)
            if best:
                ckpt_lib.copy_checkpoint(last, os.path.join(ckpt_dir, "best.pt"))

    def on_step(s: TrainState) -> None:
        if t.checkpoint_every and s.step % t.checkpoint_every == 0 and s.batch_in_epoch < loaders.train_batches:
            save(None, best=False)

    sampler = loaders.train.sampler
    measured = False
    last_row: dict = dict(ckpt.get("metrics") or {}) if path is not None else {}  # a finished run
    saved_bytes = last_row.get("saved_bytes")
    train_images = train_seconds = 0.0  # this process's epochs, for the mean images/s
    status = "done"
    while state.epoch < t.epochs:
        if t.max_steps is not None and state.step >= t.max_steps:
            break
        sampler.set_epoch(state.epoch, start=state.batch_in_epoch * t.batch_size)
        epoch_start = time.perf_counter()
        train_out = train_one_epoch(
            parts, loaders.train, state, batches_per_epoch=loaders.train_batches, max_steps=t.max_steps,
            log_every=t.log_every, on_log=logger.log_step, on_step=on_step,
            measure_saved=not measured and not t.compile, progress=main and bool(t.progress),
        )
        measured = True
        if train_out["images_per_s"] > 0:
            train_images += train_out["train_images"]
            train_seconds += train_out["train_images"] / train_out["images_per_s"]
        saved_bytes = train_out.get("saved_bytes", saved_bytes)
        epoch = state.epoch
        epoch_done = state.batch_in_epoch >= loaders.train_batches
        stopped = t.max_steps is not None and state.step >= t.max_steps
        dist_utils.broadcast_buffers(model)  # rank 0's estimates everywhere before eval/save
        row = {"epoch": epoch, "step": state.step, **train_out, "saved_bytes": saved_bytes}
        if epoch_done:
            state.epoch, state.batch_in_epoch = epoch + 1, 0
        evaluate_now = stopped or state.epoch >= t.epochs or (epoch_done and state.epoch % t.eval_every == 0)
        best = False
        if evaluate_now:
            val = evaluate(model, loaders.val, device, amp_dtype, loaders.num_classes, t.channels_last)
            row.update(val_loss=val["loss"], top1=val["top1"], top5=val["top5"])
            if ema is not None:
                ema_val = evaluate(ema.module, loaders.val, device, amp_dtype, loaders.num_classes, t.channels_last)
                row.update(ema_top1=ema_val["top1"], ema_top5=ema_val["top5"])
            best = val["top1"] > state.best_top1
            state.best_top1 = max(state.best_top1, val["top1"])
        row["epoch_time_s"] = time.perf_counter() - epoch_start
        if main:
            log.info(_format_row(row))
        logger.log_epoch(row)
        save(row, best=best)
        last_row = row
        if stopped:
            status = f"stopped at max_steps={t.max_steps}"
            break

    summary = {
        "name": str(cfg.name), "model": cfg.model.name, "data": cfg.data.name,
        "mesa": bool(cfg.mesa.enabled), "mesa_ops": ",".join(cfg.mesa.ops) if cfg.mesa.enabled else "",
        "mesa_modules": ",".join(cfg.mesa.modules) if cfg.mesa.enabled else "",
        "epochs": state.epoch, "step": state.step, "status": status, "world_size": world,
        "lr": lr, "batch_size_total": t.batch_size * world * t.grad_accum,
        "top1": last_row.get("top1"), "top5": last_row.get("top5"),
        "best_top1": state.best_top1 if state.best_top1 >= 0 else None,
        "ema_top1": last_row.get("ema_top1"), "train_loss": last_row.get("train_loss"),
        "images_per_s": last_row.get("images_per_s"),
        "images_per_s_mean": train_images / train_seconds if train_seconds else last_row.get("images_per_s"),
        "saved_bytes": saved_bytes,
        "peak_memory_bytes": last_row.get("peak_memory_bytes"),
        "buffers_consistent": dist_utils.buffers_consistent(model, device),
        "run_dir": os.path.abspath(run_dir),
    }
    logger.write_summary(summary)
    logger.close()
    dist_utils.barrier()
    return summary


def _describe(model) -> str:
    try:
        from mesa_train.train.model import describe

        return describe(model)
    except ImportError as err:  # the patch library is not importable (yet)
        return f"(mesa_train.describe unavailable: {err})"


def _format_row(row: dict) -> str:
    def fmt(k, v):
        if v is None:
            return None
        if k.endswith("bytes"):
            return f"{k[:-6]}={v / 2**20:.1f}MiB"
        if isinstance(v, float):
            return f"{k}={v:.4g}"
        return f"{k}={v}"

    return "  ".join(s for s in (fmt(k, v) for k, v in row.items()) if s)
