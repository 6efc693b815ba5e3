"""torchrun environment: process group set-up, rank helpers, a shared run stamp.

Launch with ``torchrun --nproc_per_node=N train.py ...``. torchrun sets ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``; without them everything here is a single process.
The process group is created *before* Hydra starts so that rank 0 can hand its timestamp
to the other ranks (``MESA_RUN_STAMP``): every rank then resolves the same run directory.
The backend is ``cpu:gloo,cuda:nccl`` when CUDA is available (NCCL for GPU tensors, gloo
for the few CPU collectives) and ``gloo`` otherwise.
"""
from __future__ import annotations

import datetime as _dt
import inspect
import os

import torch
import torch.distributed as dist

RUN_STAMP_ENV = "MESA_RUN_STAMP"


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def init_from_env() -> bool:
    """Create the default process group when launched by torchrun (WORLD_SIZE > 1).
    Returns whether this is a distributed run. Safe to call twice."""
    if env_world_size() <= 1:
        return False
    if not is_distributed():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(env_local_rank() % torch.cuda.device_count())
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(minutes=30))
    return True


def init_single_process_group() -> bool:
    """A one-rank process group (FSDP needs one even in a single process). Returns True
    when it created it (the caller then destroys it); False when a group exists."""
    if is_distributed():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def share_run_stamp() -> None:
    """Give every rank rank 0's timestamp (in ``MESA_RUN_STAMP``), so that the Hydra
    run directory ``outputs/${oc.env:MESA_RUN_STAMP,...}`` is the same on all ranks.
    A stamp already in the environment (set by the user) is kept."""
    if not is_distributed() or os.environ.get(RUN_STAMP_ENV):
        return
    stamp = [_dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")] if is_main() else [None]
    dist.broadcast_object_list(stamp, src=0)
    os.environ[RUN_STAMP_ENV] = stamp[0]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over ranks (one collective)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (Mesa running estimates, ...) to every rank.
    DDP already does this before every training forward; this makes the state that is
    evaluated and saved at the end of an epoch identical on all ranks too."""
    if not is_distributed():
        return
    for buf in module.buffers():
        dist.broadcast(buf.data, src=src)


def broadcast_state(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (what DDP does when it
    wraps a model; FSDP2 does not)."""
    if not is_distributed() or world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def wrap_ddp(module: torch.nn.Module, device_ids=None) -> torch.nn.Module:
    """``DistributedDataParallel`` that syncs parameters and buffers once, when it wraps
    ``module``, and never broadcasts buffers before a forward: the Mesa estimates follow
    the trainer's cross-rank policy instead (EstimateSync after each optimizer step).

    That is ``forward_sync_buffers=False`` (torch >= 2.13). Older torch has only
    ``broadcast_buffers=False``, which also leaves the buffers out of the sync at wrap time:
    there rank ``0``'s buffers are broadcast here first, so both give the same state."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)
    broadcast_buffers(module)
    return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


def buffers_consistent(module: torch.nn.Module, device: torch.device) -> bool:
    """True when every rank holds the same floating-point buffers (compared by sum and
    sum of squares per buffer, gathered in one collective)."""
    bufs = [b for b in module.buffers() if b.is_floating_point()]
    if not is_distributed() or not bufs:
        return True
    stats = torch.stack(
        [torch.stack([b.double().sum(), b.double().square().sum()]) for b in bufs]
    ).to(device)
    gathered = [torch.empty_like(stats) for _ in range(world_size())]
    dist.all_gather(gathered, stats)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()
