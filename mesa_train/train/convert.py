"""Convert between a sharded FSDP checkpoint (``last.dcp/``) and a single-file one (``last.pt``).

    python -m mesa_train.train.convert outputs/run/checkpoints/last.dcp last.pt   # for evaluate.py
    python -m mesa_train.train.convert outputs/run/checkpoints/last.pt last.dcp   # to go on under FSDP

The direction follows the source: a DCP directory becomes one file, a file becomes a DCP
directory. One process, no GPU, no process group: the model and optimizer are rebuilt on
the CPU from the config stored in the checkpoint, DCP reshards the saved shards into them
(any number of ranks wrote them), and the other format is written. Everything is kept:
weights, Mesa estimates, optimizer state, scheduler, TrainState, per-rank RNG states and
metrics, so the converted checkpoint resumes exactly. Its ``trainer.strategy`` becomes
the one its format belongs to (a file: ddp, a directory: fsdp); resume it with that. An
EMA copy (DDP runs only) is dropped on the way to DCP, with a warning.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from omegaconf import OmegaConf

from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import sharded
from mesa_train.train.config import learning_rate
from mesa_train.train.model import build as build_model_from_cfg

log = logging.getLogger("mesa_train.convert")

_STATE_KEYS = ("model", "optimizer", "format", "version", "sharded")


def _rebuild(ckpt: dict):
    """The checkpoint's model and optimizer (empty state), on the CPU."""
    from mesa_train.train.runner import build_optimizer

    cfg = OmegaConf.create(ckpt["config"])
    cfg.model.pretrained_path = None
    num_classes = int(ckpt.get("num_classes") or cfg.data.num_classes)
    model = build_model_from_cfg(cfg, num_classes, drop_path=cfg.optim.drop_path, pretrained=False)
    world = max(len(ckpt.get("rng") or []), 1)
    optimizer, _ = build_optimizer(cfg, model, learning_rate(cfg, world), train_batches=1)
    return model, optimizer


def _meta(ckpt: dict, strategy: str) -> dict:
    meta = {k: v for k, v in ckpt.items() if k not in _STATE_KEYS}
    meta["config"] = dict(meta["config"])
    meta["config"]["trainer"] = {**(meta["config"].get("trainer") or {}), "strategy": strategy}
    return meta


def sharded_to_file(src: str, dst: str) -> None:
    ckpt = sharded.load_meta(src)
    model, optimizer = _rebuild(ckpt)
    sharded.load_sharded(src, model, optimizer)
    payload = _meta(ckpt, "ddp")
    payload.update(model=model.state_dict(), optimizer=optimizer.state_dict())
    ckpt_lib.save_checkpoint(payload, dst)


def file_to_sharded(src: str, dst: str) -> None:
    ckpt = ckpt_lib.load_checkpoint(src)
    model, optimizer = _rebuild(ckpt)
    ckpt_lib.load_model_state(model, ckpt["model"], src)
    if ckpt.get("optimizer") is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    meta = _meta(ckpt, "fsdp")
    if meta.get("ema") is not None:
        log.warning("%s has EMA weights: FSDP runs have no EMA, they are left out", src)
    meta["ema"] = None
    sharded.save_sharded(dst, model, optimizer, meta)


def convert(src: str, dst: str) -> str:
    """Convert ``src`` to ``dst``; returns the direction as text."""
    src, dst = src.rstrip("/"), dst.rstrip("/")
    if not os.path.exists(src):
        raise ckpt_lib.CheckpointError(f"no such checkpoint: {src}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ckpt_lib.CheckpointError("source and destination are the same path")
    if os.path.isdir(src):
        if os.path.isdir(dst):
            raise ckpt_lib.CheckpointError(f"{dst} is a directory; a sharded checkpoint becomes one file "
                                           "(e.g. last.pt)")
        sharded_to_file(src, dst)
        return "sharded -> single file"
    if os.path.isfile(dst):
        raise ckpt_lib.CheckpointError(f"{dst} is a file; a single-file checkpoint becomes a DCP directory "
                                       "(e.g. last.dcp)")
    file_to_sharded(src, dst)
    return "single file -> sharded"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesa_train.train.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a DCP checkpoint directory (last.dcp) or a single-file checkpoint (last.pt)")
    parser.add_argument("dst", help="where to write the other format")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        how = convert(args.src, args.dst)
    except (ckpt_lib.CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{how}: {args.src} -> {args.dst}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    sys.exit(main())
