"""A patched model in DistributedDataParallel (gloo, 2 CPU processes) trains a step."""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, result_dir: str) -> None:
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from mesa_train.patch import describe, patch_model
        from torch.nn.parallel import DistributedDataParallel as DDP

        from test_patch_helpers import build, inputs, loss_of

        model = patch_model(build("deit", fused=False))  # same seed on both ranks
        ddp = DDP(model)
        patch_model(ddp)  # patching through the wrapper is a no-op here, and must not break DDP
        assert "blocks.0.attn.qk_matmul" in describe(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = inputs("deit", seed=10 + rank)  # different data per rank
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad()
            loss = loss_of(ddp(x))
            loss.backward()
            opt.step()
        changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        buffers = torch.cat([b.detach().float().flatten() for b in model.buffers()])
        torch.save(dict(flat=flat, buffers=buffers, changed=changed, loss=float(loss)),
                   os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_train_a_step(tmp_path):
    # "spawn", not "fork": in a full test session autograd's worker threads already exist,
    # and forking a process that has run backward is unsupported (and fails).
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["changed"] > 0 and torch.isfinite(torch.tensor(r0["loss"]))
    assert torch.equal(r0["flat"], r1["flat"])  # gradients were all-reduced: same weights
    # Mesa estimates are buffers: DDP broadcasts rank 0's at every forward, so they agree
    # as of the last forward's start; each rank then updates them from its own batch.
    assert r0["buffers"].shape == r1["buffers"].shape
