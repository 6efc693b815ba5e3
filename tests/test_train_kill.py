"""kill -9 in the middle of a 2-process torchrun training, run the same command again:
the resumed run logs exactly the losses of an uninterrupted one (ddp and fsdp)."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY_MODELS, cli_env

TRAIN = str(REPO / "train.py")
# 80 images over 2 ranks, batch 4: 10 steps per epoch, 2 epochs; a checkpoint every 2 steps.
OVERRIDES = TINY_MODELS["deit"] + [
    "mesa.enabled=true", "optim.drop_path=0.1", "trainer.epochs=2", "trainer.batch_size=4", "data.train_size=80",
    "data.val_size=8", "trainer.num_workers=0", "trainer.device=cpu", "trainer.amp=none",
    "trainer.progress=false", "trainer.log_every=1", "trainer.checkpoint_every=2", "trainer.clip_grad=1.0"]


def _torchrun(run_dir, strategy):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc_per_node=2", TRAIN, *OVERRIDES, f"trainer.strategy={strategy}",
            f"hydra.run.dir={run_dir}"]


def _rows(run_dir):
    path = os.path.join(run_dir, "steps.csv")
    if not os.path.exists(path):
        return []
    return [(r["step"], r["loss"]) for r in csv.DictReader(open(path))]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_kill_9_then_the_same_command_resumes_exactly(tmp_path, strategy):
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = subprocess.run(_torchrun(full, strategy), env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    victim = subprocess.Popen(_torchrun(cut, strategy), env=cli_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = cut / "checkpoints" / ("last.dcp" if strategy == "fsdp" else "last.pt")
    deadline = time.time() + 240
    while time.time() < deadline and victim.poll() is None and not (len(_rows(cut)) >= 5 and checkpoint.exists()):
        time.sleep(0.05)
    assert victim.poll() is None, "the run ended before it could be killed"
    os.killpg(victim.pid, signal.SIGKILL)  # torchrun and both ranks, mid-epoch, no chance to save
    victim.wait()
    killed_at = len(_rows(cut))
    assert 5 <= killed_at < 20

    again = subprocess.run(_torchrun(cut, strategy), env=cli_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in open(cut / "train.log").read()
    assert _rows(cut) == _rows(full) and len(_rows(full)) == 20  # every step's loss, bit for bit
    a, b = (json.load(open(d / "summary.json")) for d in (full, cut))
    assert a["top1"] == b["top1"] and a["train_loss"] == b["train_loss"] and b["buffers_consistent"] is True
