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


def test_a_checkpoint_of_data_without_files_with_a_data_root_still_evaluates(trained, tmp_path):
    """data.root with data=digits / synthetic is refused since session 88; a checkpoint written before kept
    one (never read) and evaluate.py refused it, with advice it could not follow (data.root=null
    is ignored). Its own root is dropped; one given now is still refused."""
    import torch

    summary, path = trained
    ckpt = torch.load(str(path), weights_only=True)
    name = ckpt["config"]["data"]["name"]
    assert name in ("digits", "synthetic")
    ckpt["config"]["data"]["root"] = "data/my_images"
    old = tmp_path / "old.pt"
    torch.save(ckpt, str(old))
    assert evaluate_checkpoint(str(old), num_workers=0, device="cpu")["top1"] == summary["top1"]
    with pytest.raises(ConfigError, match=f"data.root='/x' is not read by data={name}"):
        evaluate_checkpoint(str(old), data={"root": "/x"}, num_workers=0, device="cpu")


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
    log = (tmp_path / "hydra" / "evaluate.log").read_text()
    assert f"evaluating {path} (EMA weights, model " in log and "on 8 images of synthetic" in log, log


def test_non_finite_weights_are_refused_where_a_checkpoint_is_loaded(trained, compose_train, tmp_path):
    """A checkpoint written after a run diverged (a NaN weight) is refused, naming the file and
    the tensor, by evaluate, by resume and as pretrained weights, not evaluated to garbage or
    blamed on the learning rate; the EMA weights are checked too."""
    import torch

    _, path = trained
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    key = next(k for k, v in ckpt["model"].items() if k.endswith("head.weight"))
    bad = dict(ckpt, model={**ckpt["model"], key: ckpt["model"][key].clone().fill_(float("nan"))})
    nan_path = tmp_path / "nan.pt"
    torch.save(bad, nan_path)
    message = f"{nan_path} holds non-finite weights: {key} has"
    with pytest.raises(CheckpointError, match=message):
        evaluate_checkpoint(str(nan_path), num_workers=0, device="cpu")
    with pytest.raises(CheckpointError, match=f"model.pretrained_path={nan_path} holds non-finite weights"):
        fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [f"model.pretrained_path={nan_path}"]),
            str(tmp_path / "finetune"))
    with pytest.raises(CheckpointError, match=message):
        fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["optim.ema=true", "optim.ema_decay=0.5",
                                                                  f"trainer.resume={nan_path}", "trainer.max_steps=4"]),
            str(tmp_path / "resumed"))
    ema_bad = dict(ckpt, ema={**ckpt["ema"], key: ckpt["ema"][key].clone().fill_(float("inf"))})
    torch.save(ema_bad, tmp_path / "ema.pt")
    assert evaluate_checkpoint(str(tmp_path / "ema.pt"), num_workers=0, device="cpu")["ema"] is False
    with pytest.raises(CheckpointError, match="the EMA weights in .* holds non-finite weights"):
        evaluate_checkpoint(str(tmp_path / "ema.pt"), num_workers=0, device="cpu", ema=True)


def test_evaluate_refuses_settings_it_would_ignore(trained, tmp_path, run_cli):
    """'+model.name=deit_s' (the model is the checkpoint's), '+foo=1' and '+data.rooot=x' were
    added by Hydra and ignored, the metrics printed as if they had applied: refused, exit 2."""
    _, path = trained
    result = run_cli([sys.executable, REPO / "evaluate.py", f"checkpoint={path}", "data=synthetic",
                      "data.val_size=8", "trainer.num_workers=0", "trainer.device=cpu", "+model.name=deit_s",
                      "+foo=1", "+data.rooot=x", f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    err = result.stderr
    assert "Traceback" not in err
    assert "model is not a setting of evaluate.py (settings: checkpoint, ema, output, data, trainer;" in err
    assert "foo is not a setting of evaluate.py" in err
    assert "data.rooot is not a setting (close: root" in err
    assert not (tmp_path / "hydra").exists()  # (refused before it began: no log, no directory)


def test_a_call_refused_before_it_began_leaves_no_directory(tmp_path, run_cli):
    """A missing checkpoint used to leave outputs/<date>/<time>/evaluate.log (its one line,
    "evaluating nope.pt") behind each try; a directory that existed before stays."""
    (tmp_path / "mine").mkdir()
    for extra in ([], ["hydra.run.dir=mine"]):
        result = run_cli([sys.executable, REPO / "evaluate.py", "checkpoint=nope.pt", *extra], cwd=tmp_path)
        assert result.returncode == 2 and result.stderr == "error: checkpoint not found: nope.pt\n", result.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["mine"]


def test_a_full_disk_leaves_no_empty_metrics_file(tmp_path, monkeypatch):
    """eval.json is written whole or not at all: a write that fails half-way (a full disk)
    removes what it wrote, where a plain open() left an empty eval.json that looks like a
    result."""
    import errno
    import importlib.util
    import json as json_mod

    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def full_disk(obj, f, **kwargs):
        f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_mod, "dump", full_disk)
    with pytest.raises(OSError, match="No space left"):
        script._write_json({"top1": 1.0}, str(tmp_path / "eval.json"))
    assert list(tmp_path.iterdir()) == []
