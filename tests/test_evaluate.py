"""evaluate.py: rebuilds the model from a checkpoint, reproduces the training-time
validation numbers, optionally with the EMA weights, and fails clearly on bad input."""
import json
import sys

import pytest

from conftest import FAST_TRAINER, REPO, TINY_MODELS
from mesa_train.train.checkpoint import CheckpointError
from mesa_train.train.config import ConfigError
from mesa_train.train.evaluation import evaluate_checkpoint
from mesa_train.train.runner import fit


@pytest.fixture
def trained(compose_train, tmp_path):
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["optim.ema=true", "optim.ema_decay=0.5"])
    summary = fit(cfg, str(tmp_path / "run"))
    return summary, tmp_path / "run" / "checkpoints" / "last.pt"


def test_evaluate_checkpoint_matches_training(trained):
    summary, path = trained
    metrics = evaluate_checkpoint(str(path), num_workers=0, device="cpu")
    assert metrics["top1"] == summary["top1"] and metrics["top5"] == summary["top5"]
    ema = evaluate_checkpoint(str(path), num_workers=0, device="cpu", ema=True)
    assert ema["top1"] == summary["ema_top1"] and ema["ema"] is True


def test_evaluate_on_other_data_checks_classes(trained, cifar100_root):
    _, path = trained
    with pytest.raises(ConfigError, match="10 classes"):
        evaluate_checkpoint(str(path), data={"name": "cifar100", "root": str(cifar100_root), "download": False,
                                             "verify_md5": False, "num_classes": 100, "mean": [0.5] * 3,
                                             "std": [0.5] * 3, "crop_pct": 1.0, "scale": None, "ratio": None,
                                             "hflip": 0.5}, num_workers=0, device="cpu")
    with pytest.raises(CheckpointError, match="not found"):
        evaluate_checkpoint(str(path) + ".missing")


def test_evaluate_cli_prints_and_writes(trained, tmp_path, run_cli):
    summary, path = trained
    out_dir = tmp_path / "eval"
    result = run_cli([sys.executable, REPO / "evaluate.py", f"checkpoint={path}", "data=synthetic",
                      "data.val_size=8", "trainer.num_workers=0", "trainer.device=cpu", "ema=true", f"output={out_dir}",
                      f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.load(open(out_dir / "eval.json"))
    assert metrics["top1"] == summary["ema_top1"] and metrics["images"] == 8
    assert f"top1 {metrics['top1']:.2f}" in result.stdout
