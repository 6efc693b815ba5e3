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
import shutil
import sys

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

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


def _check_destination(src: str, dst: str) -> None:
    """Where the other format may be written: never over a path that exists (a checkpoint
    there would be lost), into a folder that exists, and under a name that does not say the
    other format (``last.pt`` for a directory, ``last.dcp`` for a file)."""
    to_file = os.path.isdir(src)
    if os.path.lexists(dst):
        kind = "a directory" if os.path.isdir(dst) else "a file"
        raise ckpt_lib.CheckpointError(f"{dst} already exists ({kind}); convert never writes over a path: "
                                       "remove it first or choose another destination")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise ckpt_lib.CheckpointError(f"no such directory: {parent} (the destination's folder must exist)")
    suffix = os.path.splitext(dst)[1]
    if to_file and suffix == ".dcp":
        raise ckpt_lib.CheckpointError(f"{dst}: a sharded checkpoint becomes one file; name it e.g. last.pt")
    if not to_file and suffix in (".pt", ".pth"):
        raise ckpt_lib.CheckpointError(f"{dst}: a single-file checkpoint becomes a DCP directory; name it e.g. "
                                       "last.dcp")


def _write_failure(err: BaseException) -> str:
    """A failed write in one line: the file system's reason where it has one."""
    err = sharded.dcp_failure(err)
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def convert(src: str, dst: str) -> str:
    """Convert ``src`` to ``dst``; returns the direction as text. A write that fails (a full
    disk) leaves nothing behind: not the half-written destination, not DCP's temporary folder."""
    src, dst = src.rstrip("/"), dst.rstrip("/")
    if not os.path.exists(src):
        raise ckpt_lib.CheckpointError(f"no such checkpoint: {src}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ckpt_lib.CheckpointError("source and destination are the same path")
    _check_destination(src, dst)
    to_file = os.path.isdir(src)
    try:
        if to_file:
            sharded_to_file(src, dst)
        else:
            file_to_sharded(src, dst)
    except ckpt_lib.CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # OSError (a full disk), or DCP's wrapper of one
        folder, name = os.path.split(os.path.abspath(dst))
        shutil.rmtree(os.path.join(folder, f".{name}.tmp"), ignore_errors=True)
        raise ckpt_lib.CheckpointError(f"cannot write {dst}: {_write_failure(err)}") from err
    return "sharded -> single file" if to_file else "single file -> sharded"


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
