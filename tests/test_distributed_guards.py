"""What a review of torchrun runs found (session 77), each checked here without torchrun:
an FSDP evaluation hung when the ranks had different numbers of validation batches (the batch
count was agreed after the loop, inside the longer rank's next sharded forward); FSDP's sharded
checkpoint (DCP) crashed on the quantizer entries that are no attribute (``format`` of any
non-default format, ``per_sample_by_reuse``); the learned clipping thresholds drifted apart per
rank; a stop signal was compared every 10 steps only, past torchrun's 30 s grace for slow steps."""
import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import FAST_TRAINER, TINY_MODELS

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, *args):
    mp.start_processes(worker, args=(_free_port(), *args), nprocs=2, join=True, start_method="spawn")


def _join(rank: int, port: int) -> None:
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    # (a hang fails in seconds, not gloo's 30 minutes)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))


class _Collective(nn.Module):
    """A forward that is a collective, as a sharded FSDP model's is (it all-gathers weights)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        w = self.fc.weight.detach().clone()
        dist.all_reduce(w)
        return x.flatten(1)[:, :3] @ w.t()


def _evaluate_worker(rank, port, out):
    from mesa_train.train.engine import evaluate

    _join(rank, port)
    try:
        torch.manual_seed(0)
        model = _Collective()
        n = 3 if rank == 0 else 1  # (batches of 2: rank 0 two of them, rank 1 one)
        data = torch.utils.data.TensorDataset(torch.randn(n, 3, 2, 2), torch.randint(0, 4, (n,)))
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        metrics = evaluate(model, loader, torch.device("cpu"), num_classes=4, lockstep_shape=(2, 3, 2, 2))
        torch.save(metrics, os.path.join(out, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sharded_evaluation_with_uneven_batches_finishes(tmp_path):
    _spawn(_evaluate_worker, str(tmp_path))
    a, b = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    assert a == b and a["images"] == 4


def _learned_worker(rank, port, out):
    from mesa_train.nn import Linear
    from mesa_train.nn.quantizer import LEARNED_BUFFERS
    from mesa_train.train.estimates import EstimateSync, buffers_identical

    _join(rank, port)
    try:
        torch.manual_seed(0)
        layer = Linear(8, 8, estimator="learned").train()
        torch.manual_seed(rank)  # (each rank its own data: its thresholds move its own way)
        for _ in range(3):
            layer(torch.randn(16, 8) * (1 + rank)).sum().backward()
        assert all(n in layer.quantizer._buffers for n in LEARNED_BUFFERS)
        before = buffers_identical(layer, torch.device("cpu"))
        EstimateSync(layer).sync()
        same = buffers_identical(layer, torch.device("cpu"))
        torch.save({"same": same, "before": before}, os.path.join(out, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_learned_thresholds_are_the_same_on_every_rank_after_a_sync(tmp_path):
    _spawn(_learned_worker, str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["same"] and not got["before"]


def test_the_quantizer_entries_resolve_as_attributes_for_dcp():
    """DCP's get_state_dict (FSDP's sharded checkpoints) reads every key by getattr."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mesa_train.nn import GELU, Linear

    model = nn.Sequential(Linear(4, 4, bits=4), GELU())
    model[1].switch_to_per_sample_for_reuse()  # (metadata: no entry for DCP to resolve)
    state = get_model_state_dict(model)
    assert torch.equal(state["0.quantizer.format"], model[0].quantizer.format)
    assert set(state) == set(model.state_dict())


def test_fsdp_saves_and_resumes_a_non_default_format(compose_train, tmp_path):
    from mesa_train.train.runner import fit

    fsdp = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "trainer.strategy=fsdp", "mesa.bits=4"]
    assert fit(compose_train(fsdp), str(tmp_path))["step"] == 2
    assert fit(compose_train(fsdp + ["trainer.max_steps=3"]), str(tmp_path))["step"] == 3


@pytest.mark.parametrize("step_seconds,interval", [(3.0, 1), (1.0, 5), (0.1, 10)])
def test_ranks_compare_stop_flags_within_seconds_of_steps(monkeypatch, step_seconds, interval):
    """The number of steps between checks follows the step time (about 5 s of steps, at most
    10): with 3 s steps every step is checked; every rank computes it from the reduced values."""
    from mesa_train.train import signals

    clock = [0.0]
    reduced = []
    monkeypatch.setattr(signals.dist_utils, "world_size", lambda: 2)
    monkeypatch.setattr(signals.dist_utils, "all_reduce_sum",
                        lambda values, device: reduced.append(values) or [2 * v for v in values])
    monkeypatch.setattr(signals.time, "perf_counter", lambda: clock[0])
    stop = signals.StopSignal(torch.device("cpu"))
    for _ in range(40):
        clock[0] += step_seconds
        assert not stop.requested()
    checks = len(reduced)
    assert checks >= 40 // interval and checks <= 40 // interval + 1, (checks, interval)
    stop.signum = 15
    for steps in range(1, interval + 1):
        clock[0] += step_seconds
        if stop.requested():
            break
    assert steps <= interval
