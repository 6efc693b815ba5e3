"""The training run: build everything from a config, resume, loop over epochs, save.

``fit(cfg, run_dir)`` is what ``train.py`` (Hydra) and ``mesa_train.demo`` call. ``cfg`` is
the composed config (OmegaConf or anything with the same attribute access).

Start-up order (a rejected run writes nothing): config checks -> the model built on the meta
device -> the run directory locked -> the checkpoint to resume read and compared -> data,
model, optimizer built -> accepted: ``.hydra/`` written, logs opened, banner printed.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time

import numpy as np
import torch

from mesa_train.compile_scope import compile_model
from mesa_train.patch.reuse import probe_reuse
from mesa_train.patch.start_up import skip_duplicated_at_start_up, start_up_images
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import distributed as dist_utils
from mesa_train.train import rundir
from mesa_train.train import sharded
from mesa_train.train.config import ConfigError, check_known_settings, learning_rate, validate
from mesa_train.train.data import DataError, build_loaders, build_mixup, worker_count
from mesa_train.train.engine import Parts, TrainState, autocast, build_criterion, evaluate, train_one_epoch
from mesa_train.train.estimates import EstimateSync, buffers_identical
from mesa_train.train import errors
from mesa_train.train.errors import Interrupted, RunDirError
from mesa_train.train.loggers import RunLogger
from mesa_train.train.model import build as build_model_from_cfg
from mesa_train.train.model import check_buildable
from mesa_train.train.saver import RunSaver
from mesa_train.quant.compile_kernels import set_compile_kernels
from mesa_train.train.signals import StopSignal

log = logging.getLogger("mesa_train.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", dist_utils.env_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device(name)


def resolve_amp(amp: str, device: torch.device) -> str:
    """``trainer.amp=auto``: bf16 on a GPU that has it, fp32 otherwise (CPU autocast is slow
    and changes numerics for no memory gain worth having)."""
    if amp != "auto":
        return amp
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "none"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def strategy(cfg) -> str:
    return str(cfg.trainer.get("strategy", "ddp"))


def last_checkpoint_name(cfg) -> str:
    """``last.pt`` (one file, DDP / one process) or ``last.dcp`` (sharded, FSDP)."""
    return "last.dcp" if strategy(cfg) == "fsdp" else "last.pt"


def resume_path(cfg, run_dir: str) -> str | None:
    """``trainer.resume``: null -> None; auto -> the run dir's last.pt (last.dcp/ with
    trainer.strategy=fsdp) when it exists; anything else is a checkpoint path that must
    exist and be of the strategy's kind (a file for ddp, a DCP directory for fsdp)."""
    resume = cfg.trainer.resume
    if resume in (None, False, "", "null", "none"):
        return None
    fsdp = strategy(cfg) == "fsdp"
    if resume == "auto":
        path = os.path.join(checkpoint_dir(run_dir), last_checkpoint_name(cfg))
        if not fsdp:
            # (best.pt alone: a save that failed between writing it and copying it to last.pt,
            # RunSaver.save; it is the newer state then)
            best = os.path.join(checkpoint_dir(run_dir), "best.pt")
            return path if os.path.isfile(path) else best if os.path.isfile(best) else None
        # A crash between the two renames of sharded.save_sharded leaves only last.dcp.old.
        return next((p for p in (path, path + ".old") if sharded.is_sharded(p)), None)
    resume = str(resume)
    if not os.path.exists(resume):
        raise ckpt_lib.CheckpointError(f"trainer.resume={resume!r}: no such checkpoint")
    if os.path.isdir(resume) and not sharded.is_sharded(resume):
        not_a_checkpoint_dir(resume, last_checkpoint_name(cfg))
    convert = "python -m mesa_train.train.convert"
    if fsdp and not os.path.isdir(resume):
        raise ckpt_lib.CheckpointError(
            f"trainer.resume={resume!r} is a single-file checkpoint; trainer.strategy=fsdp resumes from a sharded "
            f"one: {convert} {resume} {os.path.splitext(resume)[0]}.dcp")
    if not fsdp and os.path.isdir(resume):
        raise ckpt_lib.CheckpointError(
            f"trainer.resume={resume!r} is a sharded (FSDP) checkpoint; resume it with trainer.strategy=fsdp, or "
            f"make a single file of it: {convert} {resume} {resume.rstrip('/').removesuffix('.dcp')}.pt")
    return resume


def not_a_checkpoint_dir(path: str, last: str, key: str = "trainer.resume") -> None:
    """``key`` (trainer.resume; evaluate.py's checkpoint) named a folder that is no sharded
    checkpoint (a run directory, its checkpoints/ folder): the checkpoints inside it, if any,
    as the value to give instead."""
    # the run's own checkpoint name first, then either format's, inside checkpoints/ or here
    names = [last] + [name for name in ("last.pt", "last.dcp") if name != last]
    inside = [os.path.join(path, "checkpoints", name) for name in names] + [os.path.join(path, name) for name in names]
    found = [p for p in inside if os.path.isfile(p) or sharded.is_sharded(p)]
    hint = (f"; did you mean {key}={found[0]}?" if found else
            " (a checkpoint is a file, last.pt, or a sharded folder, last.dcp/, with meta.pt inside)")
    raise ckpt_lib.CheckpointError(f"{key}={path!r} is a folder, not a checkpoint{hint}")


def _on_rank0(fn, main: bool, world: int):
    """Run ``fn`` on rank 0; when it fails (run directory refused or not writable) every
    rank raises the same error, so that no rank waits forever in a collective."""
    error = None
    if main:
        try:
            fn()
        except (RunDirError, OSError) as err:
            error = err
    if world > 1:
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


def _replaces_run(cfg, run_dir: str, path: str | None) -> bool:
    """Whether this run writes over what ``run_dir`` holds instead of continuing it: a fresh
    start, or a resume from a checkpoint outside it (another run's: its metrics.csv rows past
    that step and its best.pt would be mixed with this one's; a review found such a run wiped
    without a word)."""
    if path is None:
        return True
    inside = os.path.realpath(path).startswith(os.path.realpath(run_dir) + os.sep)
    return cfg.trainer.resume != "auto" and not inside


def _read_resume_checkpoint(cfg, run_dir: str, plain_cfg: dict):
    """The checkpoint to resume (or None), checked against this run's settings; a fresh
    start refuses to replace an earlier run's files unless trainer.overwrite=true."""
    path = resume_path(cfg, run_dir)
    if path is not None and cfg.trainer.get("overwrite") and cfg.trainer.resume == "auto":
        # (both read as wishes: continue the run found, and replace it; neither is guessed)
        raise RunDirError(f"trainer.overwrite=true, but trainer.resume=auto found {path} to continue: add "
                          "trainer.resume=null to replace that run, or drop trainer.overwrite to continue it")
    if _replaces_run(cfg, run_dir, path):
        if not cfg.trainer.get("overwrite"):
            _on_rank0(lambda: rundir.refuse_or_clear(run_dir, overwrite=False, resume=path),
                      dist_utils.rank() == 0, dist_utils.world_size())
        if path is None:
            return None, None
    try:
        ckpt = sharded.load_meta(path) if os.path.isdir(path) else ckpt_lib.load_checkpoint(path)
    except ckpt_lib.CheckpointError as err:
        raise ckpt_lib.CheckpointError(f"{err}{_other_checkpoint_advice(cfg, run_dir, path, err)}") from None
    ckpt_lib.check_compatible(ckpt["config"], plain_cfg, path)
    ckpt_lib.check_same_settings(ckpt["config"], plain_cfg, path)
    ckpt_lib.check_same_world(ckpt, dist_utils.world_size(), cfg.trainer, path)
    return path, ckpt


def _other_checkpoint_advice(cfg, run_dir: str, unreadable: str, err: Exception) -> str:
    """Where the run's own last checkpoint cannot be read (a truncated copy, a disk that failed):
    how to go on from the run's best.pt, if it is there and readable, or to start again. Not for
    a checkpoint that reads but is refused (a newer format: update mesa-train, wipe nothing)."""
    best = os.path.join(checkpoint_dir(run_dir), "best.pt")
    if (not str(err).startswith(ckpt_lib.UNREADABLE) or cfg.trainer.resume != "auto" or not os.path.isfile(best)
            or os.path.realpath(unreadable) == os.path.realpath(best)):
        return ""
    try:
        step = ckpt_lib.load_checkpoint(best)["state"].get("step")
    except ckpt_lib.CheckpointError as best_err:
        if not str(best_err).startswith(ckpt_lib.UNREADABLE):
            return ""
        return "; the run's best.pt cannot be read either: start again with trainer.overwrite=true trainer.resume=null"
    return (f"; the run's best.pt (step {step}) can be read: resume from it with trainer.resume={best}, or "
            "start again with trainer.overwrite=true trainer.resume=null")


def fit(cfg, run_dir: str, on_accept=None) -> dict:
    """Train as ``cfg`` says, writing logs and checkpoints under ``run_dir``.
    Returns the summary (also written to ``run_dir/summary.json`` by rank 0).
    ``on_accept()`` runs once the run passed every start-up check (train.py records its
    Hydra config there)."""
    validate(cfg)  # before anything is built or written
    check_known_settings(cfg)
    check_buildable(cfg, int(cfg.data.num_classes or 10))
    plain_cfg = ckpt_lib.to_plain(cfg)
    dist_utils.init_from_env()
    # FSDP needs a process group even for one process (sharding over one rank).
    own_group = strategy(cfg) == "fsdp" and dist_utils.init_single_process_group()
    try:
        return _fit(cfg, run_dir, plain_cfg, on_accept)
    finally:
        if own_group:
            dist_utils.cleanup()


def _fit(cfg, run_dir: str, plain_cfg: dict, on_accept) -> dict:
    rank, world = dist_utils.rank(), dist_utils.world_size()
    main = rank == 0
    lock = rundir.RunDirLock(run_dir) if main else None
    _on_rank0(lambda: lock.acquire(), main, world)
    try:
        path, ckpt = _read_resume_checkpoint(cfg, run_dir, plain_cfg)
        run = _build(cfg, run_dir, plain_cfg, rank, world, path, ckpt)
        if main:
            if _replaces_run(cfg, run_dir, path):
                rundir.refuse_or_clear(run_dir, overwrite=True)  # trainer.overwrite=true (or nothing there)
            for stale in rundir.clean_stale_temporaries(checkpoint_dir(run_dir)):
                log.info("removed %s (left by an interrupted checkpoint write)", stale)
            rundir.record_config(run_dir, cfg)
            _remove(os.path.join(run_dir, "failed.json"))  # an earlier failure of this run dir
        if on_accept is not None:
            on_accept()
        return _train(cfg, run_dir, run)
    finally:
        if lock is not None:
            lock.release()


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


class _Run:
    """Everything ``_train`` needs (built by ``_build``)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _build(cfg, run_dir, plain_cfg, rank, world, path, ckpt) -> _Run:
    t, o = cfg.trainer, cfg.optim
    device = resolve_device(t.device)
    amp = resolve_amp(t.amp, device)
    amp_dtype = AMP_DTYPES[amp]
    seed_everything(int(t.seed) + rank)

    # Data first: a missing dataset fails before the (possibly large) model is built.
    loaders = build_loaders(cfg, rank=rank, world_size=world, train=True)
    if ckpt is not None:
        ckpt_lib.check_same_classes(ckpt, loaders.num_classes, loaders.classes, cfg.data.get("root"), path, "resume")
    model = build_model_from_cfg(cfg, loaders.num_classes, drop_path=o.drop_path, pretrained=ckpt is None)
    if t.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    _apply_plan(cfg, model, device, amp_dtype, loaders.num_classes, ckpt)
    if t.channels_last:
        model.to(memory_format=torch.channels_last)
    if cfg.mesa.enabled:
        _probe_reuse(cfg, model, device)
        _skip_duplicates(cfg, model, device, amp_dtype, rank)

    ema = None
    if o.ema:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=o.ema_decay)
    train_model = _wrap(cfg, model, device, amp_dtype, world)
    if t.compile:
        set_compile_kernels(cfg.mesa.get("compile_kernels", "auto"))  # before the first traced call
        mode = t.get("compile_mode", "default")
        scope = t.get("compile_scope", "model")
        try:
            # scope "model": one graph (DDP splits it at its buckets, so no fullgraph); "blocks":
            # each block of the unwrapped model compiled in place, one whole graph per block
            train_model = compile_model(train_model, scope, fullgraph=scope == "blocks",
                                        mode=None if mode == "default" else mode)
        except ValueError as err:  # a model without blocks: the one-line error names the choices
            raise ConfigError(f"trainer.compile_scope={scope}: {err}") from None

    lr = learning_rate(cfg, world)
    optimizer, scheduler = build_optimizer(cfg, model, lr, loaders.train_batches)
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    mixup = build_mixup(cfg, loaders.num_classes)
    criterion = build_criterion(o.smoothing, mixup is not None)

    state = TrainState()
    if ckpt is not None:
        ema = _restore(ckpt, path, model, optimizer, scheduler, scaler, ema, o, rank, world)
        state = TrainState(**ckpt["state"])
        if rank == 0:
            log.info("resumed from %s: epoch %d, batch %d, step %d", path, state.epoch, state.batch_in_epoch,
                     state.step)
    parts = Parts(model=train_model, optimizer=optimizer, criterion=criterion, device=device,
                  scheduler=scheduler, scaler=scaler, amp_dtype=amp_dtype, mixup=mixup, ema=ema,
                  grad_accum=t.grad_accum, clip_grad=t.clip_grad, channels_last=t.channels_last,
                  compiled=bool(t.compile),
                  nonfinite=t.get("nonfinite", "stop"), max_nonfinite_skips=int(t.get("max_nonfinite_skips", 10)),
                  estimate_sync=EstimateSync(model) if world > 1 else None)
    return _Run(device=device, amp=amp, amp_dtype=amp_dtype, loaders=loaders, model=model, ema=ema,
                optimizer=optimizer, scheduler=scheduler, scaler=scaler, parts=parts, state=state, lr=lr,
                path=path, ckpt=ckpt, rank=rank, world=world, plain_cfg=plain_cfg,
                val_images=None)  # (set by each evaluation: the summary's count of validation images)


def _apply_plan(cfg, model, device, amp_dtype, num_classes, ckpt) -> None:
    """``mesa.plan``: patch the stock model per layer (a resumed run: the checkpoint's plan)."""
    saved = ckpt.get("mesa_plan") if ckpt is not None else None
    if not cfg.mesa.enabled or (cfg.mesa.get("plan") is None and saved is None):
        return
    from mesa_train.plan.planfile import PlanError
    from mesa_train.plan.train_hook import apply_plan_from_config

    try:
        apply_plan_from_config(cfg, model, device, amp_dtype, num_classes, saved_plan=saved)
    except PlanError as err:
        raise ConfigError(f"mesa.plan: {err}") from None


def _start_up_images(cfg, n: int, device, *, random: bool = False) -> torch.Tensor:
    """Start-up images in the size and memory format training feeds the model (trainer.channels_last)."""
    return start_up_images(n, cfg.model.img_size, channels_last=cfg.trainer.channels_last, device=device,
                           random=random)


def _probe_reuse(cfg, model, device) -> None:
    """Modules a forward calls more than once get per-sample ranges from the first step, also
    compiled and resumed (one eval forward of a blank image: mesa_train/patch/reuse.py)."""
    layers = probe_reuse(model, _start_up_images(cfg, 1, device))
    if layers:
        log.info("estimator=per_sample for %d Mesa layer(s) of modules called more than once a forward",
                 len(layers))


def _skip_duplicates(cfg, model, device, amp_dtype, rank: int) -> None:
    """``mesa.duplicates=skip``: the Mesa layers whose every copy another module keeps in full
    anyway go stock, and fused attentions the ops moved to the explicit path go back, where that
    lowers the bytes a training forward of two random images keeps under the run's autocast
    (mesa_train/patch/duplicates.py). Before DDP / FSDP / compile; every
    rank and a resumed run find the same layers (the data flow is the model's, not the data's)."""
    if cfg.mesa.get("duplicates", "skip") != "skip":
        return

    def run(m, images):
        with autocast(device, amp_dtype):
            return m(images)

    result = skip_duplicated_at_start_up(model, _start_up_images(cfg, 2, device, random=True), run=run,
                                         stop_on_oom=False)
    if rank != 0:
        return
    if result.failed:  # (a model whose forward refuses two random images: train as asked)
        log.warning("mesa.duplicates=skip %s", result.failed)
        return
    changed = result.count or result.fused_back or result.full_operands
    if changed or result.kept:
        log.info("%s%s", result.summary(), " (mesa.duplicates=keep: as the ops ask)" if changed else "")


def _wrap(cfg, model, device, amp_dtype, world):
    """The module that trains: FSDP2 shards ``model`` in place (trainer.strategy=fsdp);
    DDP wraps it (several processes); one process trains ``model`` itself."""
    if strategy(cfg) == "fsdp":
        from mesa_train.train.fsdp import apply_fsdp

        options = cfg.trainer.get("fsdp") or {}
        # Each rank initialised its own weights (seed + rank); fully_shard keeps each rank's
        # slice of its own copy, so start every rank from rank 0's model, as DDP does.
        dist_utils.broadcast_state(model)
        return apply_fsdp(model, param_dtype=amp_dtype,
                          reshard_after_forward=bool(options.get("reshard_after_forward", True)),
                          cpu_offload=bool(options.get("cpu_offload", False)))
    if world > 1:
        # No buffer broadcast before each forward: the Mesa estimates follow the trainer's
        # cross-rank policy instead (EstimateSync after each optimizer step, as under FSDP).
        return dist_utils.wrap_ddp(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def build_optimizer(cfg, model, lr: float, train_batches: int):
    """timm optimizer and per-update scheduler as ``optim`` says (``model`` may be sharded:
    the optimizer then holds this rank's shards)."""
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    t, o = cfg.trainer, cfg.optim
    opt_kwargs = {"eps": o.eps} if o.eps is not None else {}
    if o.get("layer_decay") is not None:
        opt_kwargs["layer_decay"] = float(o.layer_decay)
    optimizer = create_optimizer_v2(model, opt=o.opt, lr=lr, weight_decay=o.weight_decay,
                                    momentum=o.momentum, **opt_kwargs)
    updates_per_epoch = math.ceil(train_batches / t.grad_accum)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=o.sched, num_epochs=t.epochs, warmup_epochs=o.warmup_epochs,
        warmup_lr=o.warmup_lr, min_lr=o.min_lr, step_on_epochs=False, updates_per_epoch=updates_per_epoch,
    )
    return optimizer, scheduler


def _restore(ckpt, path, model, optimizer, scheduler, scaler, ema, o, rank, world):
    if ckpt.get("sharded"):
        sharded.load_sharded(path, model, optimizer)  # every rank reads its shards
    else:
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
            from timm.utils import ModelEmaV3

            log.warning("checkpoint has no EMA weights; the EMA restarts from the model")
            ema = ModelEmaV3(model, decay=o.ema_decay)
    rngs = ckpt.get("rng") or []
    if len(rngs) == world:
        ckpt_lib.set_rng_state(rngs[rank])
    else:  # (a checkpoint from before the RNG states were saved; another count is refused earlier)
        log.warning("checkpoint has no RNG states for %d process(es): RNG streams restart", world)
    return ema


def _banner(cfg, run_dir: str, r: _Run) -> None:
    """What this run is, in a few lines: the facts people otherwise dig out of configs."""
    t, o = cfg.trainer, cfg.optim
    total_batch = t.batch_size * r.world * t.grad_accum
    lr_note = ("optim.lr as given" if o.lr is not None
               else f"base_lr {o.base_lr:g} x {total_batch} / {o.base_batch}")
    n_params = sum(p.numel() for p in r.model.parameters()) / 1e6
    n_train, n_val = len(r.loaders.train.dataset), len(r.loaders.val.dataset)
    steps_per_epoch = math.ceil(r.loaders.train_batches / t.grad_accum)
    total_steps = steps_per_epoch * t.epochs
    if t.max_steps is not None:
        total_steps = min(total_steps, t.max_steps)
    mesa = (f"Mesa ops={','.join(cfg.mesa.ops)} modules={','.join(cfg.mesa.modules)}" if cfg.mesa.enabled
            else "Mesa off (stock model)")
    workers = worker_count(t.num_workers, r.world)
    lines = [
        f"run directory: {os.path.abspath(run_dir)}",
        f"model {cfg.model.name}: {n_params:.2f}M parameters, {r.loaders.num_classes} classes, "
        f"{cfg.model.img_size}px; {mesa}",
        f"data {cfg.data.name}: {n_train} train / {n_val} val images; {workers} loader workers per process"
        + (f" (trainer.num_workers={t.num_workers} capped by the CPU cores)" if workers < t.num_workers else ""),
        f"device {r.device} x {r.world} process(es); AMP {r.amp}" + (" (trainer.amp=auto)" if t.amp == "auto" else "")
        + f"; {_strategy_text(cfg, r.world)}",
        f"global batch {total_batch} ({t.batch_size} x {r.world} x {t.grad_accum} accumulation); "
        f"lr {r.lr:.3g} ({lr_note}); {o.opt}, {o.sched} schedule"
        + (f", layer decay {o.layer_decay}" if o.get("layer_decay") is not None else ""),
        f"{t.epochs} epochs x {steps_per_epoch} steps = {total_steps} steps"
        + (f" (trainer.max_steps={t.max_steps})" if t.max_steps is not None else "")
        + (f"; resuming at step {r.state.step}" if r.path else ""),
    ]
    for line in lines:
        log.info(line)
    if n_val == 0:
        log.warning("no validation images (data.val_size=0): no evaluation, no top-1, no best.pt")
    if cfg.data.name == "synthetic" and t.max_steps is None and t.epochs > 20:
        log.warning("data=synthetic is random images with random labels (a smoke test), and this run is %d "
                    "epochs. Pick a dataset (data=digits|cifar100|imagenet) or shorten it (trainer.epochs=..., "
                    "trainer.max_steps=...)", t.epochs)
    log.info("Mesa layout:\n%s", _describe(r.model))


def _strategy_text(cfg, world: int) -> str:
    if strategy(cfg) == "fsdp":
        o = cfg.trainer.get("fsdp") or {}
        return (f"FSDP2 per block (reshard_after_forward={o.get('reshard_after_forward', True)}, "
                f"cpu_offload={o.get('cpu_offload', False)}), sharded checkpoints")
    return "DDP" if world > 1 else "no data parallelism"


def _train(cfg, run_dir: str, r: _Run) -> dict:
    t = cfg.trainer
    main = r.rank == 0
    state, model, parts, loaders = r.state, r.model, r.parts, r.loaders
    if main:
        _banner(cfg, run_dir, r)
    logger = RunLogger(run_dir, enabled=main, wandb_cfg=cfg.logger.wandb, config=r.plain_cfg,
                       name=str(cfg.name), resume_step=state.step if r.path else None)
    ckpt_dir = checkpoint_dir(run_dir)
    fsdp = strategy(cfg) == "fsdp"
    saver = RunSaver(r, ckpt_dir, fsdp, last_checkpoint_name(cfg), state.step if r.path else None)

    def on_step(s: TrainState) -> None:
        if t.checkpoint_every and s.step % t.checkpoint_every == 0 and s.batch_in_epoch < loaders.train_batches:
            saver.save(None, best=False)

    sampler = loaders.train.sampler
    measured = False
    last_row: dict = dict(r.ckpt.get("metrics") or {}) if r.path is not None else {}  # a finished run
    saved_bytes = last_row.get("saved_bytes")
    stock_bytes = last_row.get("stock_saved_bytes")
    timed_images = timed_seconds = 0.0  # this process's epochs, warm-up left out, for the mean images/s
    first_epoch = True
    at_max_steps = t.max_steps is not None and state.step >= t.max_steps
    status = f"stopped at max_steps={t.max_steps}" if at_max_steps and state.epoch < t.epochs else "done"
    # a finished run resumed trains nothing: its summary stays the run's (status, mean speed), not
    # this process's reading of it ("stopped at max_steps=2" for a run at step 6; the last epoch's
    # images/s as the run's mean), where the summary there is of this checkpoint's step (a process
    # killed after its last save wrote none)
    previous = _previous_summary(run_dir) if at_max_steps or state.epoch >= t.epochs else {}
    previous = previous if previous.get("step") == state.step else {}
    if at_max_steps and state.step > t.max_steps:  # (a lower max_steps than the run has: not where it stopped)
        status = previous.get("status") or f"stopped at step {state.step}"
    if main and (at_max_steps or state.epoch >= t.epochs):  # (a finished run resumed: say so, train nothing)
        # (a resume may raise max_steps, not epochs: the schedule was built from them)
        how = ("raise trainer.max_steps to train further" if state.epoch < t.epochs else
               "the run has trained its trainer.epochs, which a resume cannot change: to train longer, start a new "
               "run (another hydra.run.dir) from its weights with model.pretrained_path=<its last checkpoint>")
        log.info("nothing to train: the checkpoint is at step %d, epoch %d (trainer.max_steps=%s, trainer.epochs=%d); "
                 "%s", state.step, state.epoch, t.max_steps, t.epochs, how)
    stop_signal = StopSignal(r.device)
    evaluating: list = []  # [the epoch] while its end-of-epoch evaluation runs
    try:
        with stop_signal:
            while state.epoch < t.epochs:
                if t.max_steps is not None and state.step >= t.max_steps:
                    break
                # 1. train (to the epoch's end, max_steps or a stop signal)
                sampler.set_epoch(state.epoch, start=state.batch_in_epoch * t.batch_size)
                # The saved-tensor meter tells parameters from activations by storage: it
                # cannot see through FSDP's gathered parameters, so FSDP runs skip it.
                measure = not measured and not t.compile and not fsdp
                if measure and cfg.mesa.enabled and stock_bytes is None:
                    stock_bytes = _stock_saved_bytes(model, cfg, r)  # (before the epoch's clock starts)
                epoch_start = time.perf_counter()
                train_out = train_one_epoch(
                    parts, loaders.train, state, batches_per_epoch=loaders.train_batches, max_steps=t.max_steps,
                    log_every=t.log_every, on_log=logger.log_step, on_step=on_step, measure_saved=measure,
                    progress=main and bool(t.progress), epochs=t.epochs,
                    warmup_batches=min(3, loaders.train_batches // 2) if first_epoch else 0,
                    stop_requested=stop_signal.requested,
                )
                first_epoch, measured = False, True
                saver.ensure_finite()  # before evaluating or logging a broken state
                timed_images += train_out.pop("timed_images")
                timed_seconds += train_out.pop("timed_seconds")
                saved_bytes = train_out.get("saved_bytes", saved_bytes)
                if measure and cfg.mesa.enabled and main:
                    _warn_if_more_than_stock(saved_bytes, stock_bytes)
                # (at the epoch's end too: a signal since the last check stops before evaluating)
                if train_out.pop("interrupted", False) or stop_signal.agreed_now():
                    saver.save(None, best=False)
                    status = f"interrupted at step {state.step}"
                    break

                # 2. evaluate when due, then log and save the epoch's row
                epoch = state.epoch
                epoch_done = state.batch_in_epoch >= loaders.train_batches
                stopped = t.max_steps is not None and state.step >= t.max_steps
                row = {"epoch": epoch, "step": state.step, **train_out, "saved_bytes": saved_bytes,
                       "stock_saved_bytes": stock_bytes}
                if epoch_done:
                    state.epoch, state.batch_in_epoch = epoch + 1, 0
                evaluate_now = len(loaders.val.dataset) > 0 and (
                    stopped or state.epoch >= t.epochs or (epoch_done and state.epoch % t.eval_every == 0))
                evaluating[:] = [epoch] if epoch_done else []  # (a corrupt image there: _save_after_data_error)
                best = _evaluate_into(row, cfg, r, fsdp) if evaluate_now else False
                evaluating.clear()
                row["epoch_time_s"] = time.perf_counter() - epoch_start
                if main:
                    log.info(format_row(row))
                saver.save(row, best=best)
                logger.log_epoch(row)
                last_row = row
                if stopped:
                    status = f"stopped at max_steps={t.max_steps}"
                    break
    except DataError as err:
        _save_after_data_error(err, cfg, run_dir, r, saver, evaluating)
    finally:
        logger.close()

    # 3. the run's summary (summary.json, wandb)
    summary = _summary(cfg, run_dir, r, status, last_row, saved_bytes, stock_bytes,
                       timed_images / timed_seconds if timed_seconds else
                       previous.get("images_per_s_mean", last_row.get("images_per_s")))
    logger.write_summary(summary)
    dist_utils.barrier()
    if stop_signal.signum is not None:
        raise Interrupted(f"interrupted at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch}): "
                          f"saved {os.path.join(ckpt_dir, last_checkpoint_name(cfg))}; {_resume_advice(cfg, run_dir)}",
                          stop_signal.signum)
    return summary


def _save_after_data_error(err, cfg, run_dir: str, r: _Run, saver: RunSaver, evaluating: list):
    """A corrupt image met mid-run (training or evaluation): keep the training done so far in
    last.pt, as a stop signal does, then stop with the data's error and how to go on (it threw
    away the epoch, hours on ImageNet). One process only: the ranks that read fine would wait in
    the save's collectives for the one that stopped. A step cut off mid-accumulation is taken
    back (its micro-batches run again on resume); an epoch whose evaluation failed is saved at
    its last batch, not past it, so the resumed run evaluates it (and logs its row)."""
    if r.world > 1 or r.state.step == saver.step or r.state.step == 0:
        raise err  # (several ranks; or nothing trained since the last save)
    if evaluating:
        r.state.epoch, r.state.batch_in_epoch = evaluating[0], r.loaders.train_batches
    if r.state.batch_in_epoch < r.loaders.train_batches:  # (mid-epoch: back to the last whole step)
        r.state.batch_in_epoch -= r.state.batch_in_epoch % int(cfg.trainer.grad_accum)
    saver.save(None, best=False)
    # (a worker's error arrives wrapped with its traceback: its own message, then ours)
    raise DataError(f"{errors.unwrap_worker_message(str(err))} (checkpoints/{last_checkpoint_name(cfg)} keeps the "
                    f"training up to step {r.state.step}: {_resume_advice(cfg, run_dir)} once the data is "
                    "fixed)") from None


def _resume_advice(cfg, run_dir: str) -> str:
    """How to continue this run: the same command, unless it started from a checkpoint
    elsewhere (that command would now refuse: the directory holds this run), then resume=auto."""
    resume = cfg.trainer.resume
    if resume not in (None, False, "", "null", "none", "auto") and _replaces_run(cfg, run_dir, str(resume)):
        return "run the same command with trainer.resume=auto to resume"
    return "run the same command to resume"


def _evaluate_into(row: dict, cfg, r: _Run, fsdp: bool) -> bool:
    """Validation loss and top-1 / top-5 (and the EMA model's) into ``row``; whether top-1 is
    the run's best so far."""
    t, loaders, state = cfg.trainer, r.loaders, r.state
    # A sharded model's forward is a collective: all ranks evaluate the same number of batches.
    lockstep = (1, 3, cfg.model.img_size, cfg.model.img_size) if fsdp else None
    val = evaluate(r.model, loaders.val, r.device, r.amp_dtype, loaders.num_classes, t.channels_last,
                   lockstep_shape=lockstep)
    row.update(val_loss=val["loss"], top1=val["top1"], top5=val["top5"])
    r.val_images = val["images"]  # (how far apart two runs' top-1 can be by chance: demo.top1_gap_line)
    if r.parts.ema is not None:
        ema_val = evaluate(r.parts.ema.module, loaders.val, r.device, r.amp_dtype, loaders.num_classes,
                           t.channels_last)
        row.update(ema_top1=ema_val["top1"], ema_top5=ema_val["top5"])
    best = val["top1"] > state.best_top1
    state.best_top1 = max(state.best_top1, val["top1"])
    return best


def _summary(cfg, run_dir: str, r: _Run, status: str, last_row: dict, saved_bytes, stock_bytes,
             images_per_s_mean) -> dict:
    t, state = cfg.trainer, r.state
    return {
        "name": str(cfg.name), "model": cfg.model.name, "data": cfg.data.name,
        "mesa": bool(cfg.mesa.enabled), "mesa_ops": ",".join(cfg.mesa.ops) if cfg.mesa.enabled else "",
        "mesa_modules": ",".join(cfg.mesa.modules) if cfg.mesa.enabled else "",
        "epochs": state.epoch, "step": state.step, "status": status, "world_size": r.world,
        "lr": r.lr, "batch_size_total": t.batch_size * r.world * t.grad_accum, "amp": r.amp,
        "top1": last_row.get("top1"), "top5": last_row.get("top5"),
        "best_top1": state.best_top1 if state.best_top1 >= 0 else None,
        # (None: no evaluation ran, in this process or, resumed, in the run's last summary)
        "val_images": r.val_images if r.val_images is not None else _previous_summary(run_dir).get("val_images"),
        "ema_top1": last_row.get("ema_top1"), "train_loss": last_row.get("train_loss"),
        "images_per_s": last_row.get("images_per_s"),
        "images_per_s_mean": images_per_s_mean,
        "saved_bytes": saved_bytes, "stock_saved_bytes": stock_bytes,
        "skipped_steps": state.skipped_steps,
        "peak_memory_bytes": last_row.get("peak_memory_bytes"),
        "buffers_consistent": buffers_identical(r.model, r.device),
        "strategy": strategy(cfg),
        "run_dir": os.path.abspath(run_dir),
    }


def _previous_summary(run_dir: str) -> dict:
    """The run directory's summary.json as the last process wrote it ({} if none or unreadable)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return {}
    return previous if isinstance(previous, dict) else {}


def _stock_saved_bytes(model, cfg, r: _Run) -> int | None:
    """Bytes the stock model would keep for backward for one training batch, from forwards of the
    model as the stock one it was patched from (``coverage.stock_forwards``: Mesa layers off, the
    attentions on the path the model was built with; buffers, options and the RNG restored after,
    so training is unaffected): of the batch itself up to 4 images, else of 2 and 4 images
    extrapolated to the batch (a BatchNorm's statistics do not grow with it: scaling one image's
    figure overstated resnet18's at 32 px by 4%, and a train-mode BatchNorm over a 1x1 map
    refuses a batch of one)."""
    try:
        from mesa_train.memory import SavedTensorMeter
        from mesa_train.patch.coverage import stock_forwards
    except ImportError:
        return None
    batch = int(cfg.trainer.batch_size)

    def saved(n: int) -> int:
        x = _start_up_images(cfg, n, r.device)
        with SavedTensorMeter(model) as meter:
            with autocast(r.device, r.amp_dtype):
                model(x)
        return int(meter.activation_bytes)

    try:
        with stock_forwards(model):
            model.train()
            if batch <= 4:
                return saved(batch)
            two, four = saved(2), saved(4)
            return two + (four - two) * (batch - 2) // 2
    except Exception as err:  # a figure for the log only: never stop training for it
        log.info("no stock saved-bytes figure beside kept_for_backward: its forward failed: %s", err)
        return None


def _warn_if_more_than_stock(saved_bytes, stock_bytes) -> None:
    """The patched model keeping more for backward than stock would: some Mesa layers copy a
    tensor another module keeps in full anyway (``mesa.ops=[conv]`` without ``relu``: each stock
    ReLU keeps its output, the next conv's input), or a fused attention runs the explicit path
    (``mesa.ops=[softmax]``: deit_tiny at 224 px keeps 1.046x of the fused stock's bytes). Said
    once, at the first measured epoch."""
    if saved_bytes and stock_bytes and saved_bytes > stock_bytes:  # (both the model's forward alone)
        log.warning("the Mesa model keeps more for backward than stock would (%.1f MiB against ~%.1f MiB): some "
                    "Mesa layers copy tensors other modules keep in full (e.g. mesa.ops=[conv] without relu under "
                    "mesa.duplicates=keep, or layers only part of whose copies are duplicates; "
                    "mesa_train.describe(model, example_input) names them and the ops that would remove them), or "
                    "the attention left its fused path (softmax or matmul without sdpa keeps an N x N map the fused "
                    "stock does not: add sdpa, or set model.fused_attn=false for the paper's baseline)",
                    saved_bytes / 2**20, stock_bytes / 2**20)


def _describe(model) -> str:
    try:
        from mesa_train.train.model import describe

        return describe(model)
    except ImportError as err:  # the patch library is not importable (yet)
        return f"(mesa_train.describe unavailable: {err})"


def format_row(row: dict) -> str:
    """One epoch's log line. ``saved_bytes`` is the activation memory autograd keeps for
    backward for one batch (not memory "saved"); the stock model's figure sits beside it."""
    def fmt(k, v):
        if v is None or k in ("stock_saved_bytes", "train_images", "train_seconds"):
            return None
        if k == "saved_bytes":
            stock = row.get("stock_saved_bytes")
            beside = f" (stock ~{stock / 2**20:.1f}MiB)" if stock else ""
            return f"kept_for_backward={v / 2**20:.1f}MiB{beside}"
        if k.endswith("bytes"):
            return f"{k[:-6]}={v / 2**20:.1f}MiB"
        if isinstance(v, float):
            return f"{k}={v:.4g}"
        return f"{k}={v}"

    return "  ".join(s for s in (fmt(k, v) for k, v in row.items()) if s)
