"""Sharded checkpoints (``torch.distributed.checkpoint``, DCP) for ``trainer.strategy=fsdp``.

A sharded checkpoint is a directory, ``checkpoints/last.dcp/``::

    .metadata, __<rank>_0.distcp   DCP: the model (weights and Mesa estimates) and the
                                   optimizer state, keyed by parameter name, each rank
                                   writing its own shards (no gather on one rank)
    meta.pt                        everything else of a single-file checkpoint (format tag,
                                   scheduler, scaler, TrainState, one RNG state per rank,
                                   config, metrics), written by rank 0

Every rank writes into ``.last.dcp.tmp/``; once all have finished, rank 0 swaps it in for
``last.dcp`` (rename), so a crash mid-write leaves the previous checkpoint intact. On
several nodes the run directory must be on a file system every node sees.

DCP reshards on load: a checkpoint saved by N ranks loads on M ranks, or into one plain
process (``mesa_train.train.convert`` turns it into the single-file ``last.pt`` that
``evaluate.py`` reads, and back).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import distributed as dist_utils

META = "meta.pt"


def dcp_failure(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (a BaseException whose
    text is every rank's traceback), so that a full disk reads as the OSError it is."""
    for failure in (getattr(err, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, Exception):
            return inner
    return err


def is_sharded(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it "assumes the intent is to save in a single process" each time it
    runs without a process group (the converter, evaluate.py): that is the intent."""
    with warnings.catch_warnings():
        if not dist_utils.is_distributed():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def save_sharded(path: str, model: nn.Module, optimizer, meta: dict, copy_to: str | None = None) -> None:
    """Collective: every rank calls it. ``meta`` (rank 0's) goes to ``meta.pt``; then
    rank 0 copies the checkpoint to ``copy_to`` when given (best.dcp)."""
    import torch.distributed.checkpoint as dcp

    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp")

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    def finish():
        ckpt_lib.save_checkpoint({"model": None, "sharded": True, **meta}, os.path.join(tmp, META))
        _swap_in(tmp, path)
        if copy_to is not None:
            copy_sharded(path, copy_to)

    _on_rank0(prepare)
    try:
        with _quiet_single_process():
            dcp.save(_state_dicts(model, optimizer), checkpoint_id=tmp)  # raises on every rank if one fails
    except CheckpointException as err:  # (a full disk: the OSError inside, as a .pt save raises it)
        _on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise dcp_failure(err) from None
    _on_rank0(finish)


def _on_rank0(fn) -> None:
    """``fn()`` on rank 0; a file-system error there is raised on every rank (no rank is
    left waiting in the next collective)."""
    error = None
    if dist_utils.rank() == 0:
        try:
            fn()
        except OSError as err:
            error = err
    if dist_utils.world_size() > 1:
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


def _swap_in(tmp: str, path: str) -> None:
    old = path + ".old"
    if os.path.exists(path):  # (else an .old is the only checkpoint: keep it until tmp is in)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    ckpt_lib._fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def copy_sharded(src: str, dst: str) -> None:
    """last.dcp -> best.dcp (rank 0), through a temporary directory and a rename."""
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    _swap_in(tmp, dst)


def load_meta(path: str) -> dict:
    """``meta.pt`` of a sharded checkpoint, checked like a single-file checkpoint."""
    if not os.path.isdir(path):
        raise ckpt_lib.CheckpointError(f"sharded checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ckpt_lib.CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata)")
    meta = ckpt_lib.load_checkpoint(os.path.join(path, META))
    if not meta.get("sharded"):
        raise ckpt_lib.CheckpointError(f"{path}/{META} does not belong to a sharded checkpoint")
    return meta


def load_sharded(path: str, model: nn.Module, optimizer=None) -> None:
    """Load the model (and optimizer) state of ``path`` into ``model``, sharded or not.
    Collective when ``model`` is sharded (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _state_dicts(model, optimizer)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # keys or shapes of another model, damaged shards
        inner = dcp_failure(err)
        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
        raise ckpt_lib.CheckpointError(
            f"the sharded checkpoint {path} cannot be loaded into the model ({type(inner).__name__}: {first[:300]}). "
            "Was it trained with another model or Mesa setting (mesa.enabled/ops/modules), or are its shards "
            "damaged?") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
