"""Two "nodes" of one process each on this machine: torchrun --nnodes=2 with c10d
rendezvous over 127.0.0.1 (what several real nodes run, see configs/README.md)."""
import glob
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import FAST_TRAINER, REPO, TINY_MODELS, cli_env

TRAIN = str(REPO / "train.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_over_localhost_train_fsdp_with_c10d_rendezvous(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    nodes = []
    for node in range(2):
        # node 0 hosts the rendezvous store on the endpoint; node 1 connects to it
        cmd = [torchrun, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=mesa-test", f"--rdzv_conf=is_host={int(node == 0)}",
               "--local_addr=127.0.0.1", TRAIN, *TINY_MODELS["deit"], *FAST_TRAINER, "mesa.enabled=true",
               "trainer.strategy=fsdp"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in nodes:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, out in zip(nodes, outputs):
        assert p.returncode == 0, out[-3000:]
    run_dirs = glob.glob(str(tmp_path / "outputs" / "*" / "*"))
    assert len(run_dirs) == 1, run_dirs  # both nodes resolved rank 0's run directory
    summary = json.load(open(os.path.join(run_dirs[0], "summary.json")))
    assert summary["world_size"] == 2 and summary["step"] == 2 and summary["strategy"] == "fsdp"
    assert summary["buffers_consistent"] is True
    shards = sorted(os.listdir(os.path.join(run_dirs[0], "checkpoints", "last.dcp")))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # one shard file per rank
