"""What a review of train.py / evaluate.py as a demanding user found (session 77), each a run
that went on doing the wrong thing: boolean settings written as words (``trainer.overwrite=no``
was truthy and deleted the run), a resume from another run's checkpoint wiping this directory's
run, class folders renamed under a checkpoint, 16-bit PNGs read as white, best.pt lost to a
full disk, a corrupt image throwing away the epoch, checkpoints from before 2026-11-25 refused
for settings they did not have, and advice the pipeline then refused."""
import errno
import os
import shutil
import time

import numpy as np
import pytest

from conftest import FAST_TRAINER, TINY_MODELS, write_image_folder
from mesa_train.hydra_cli import RunDirBefore, folders_mkdir_makes
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train.config import ConfigError, validate
from mesa_train.train.data import DataError, _NamedImageLoader
from mesa_train.train.errors import RunDirError
from mesa_train.train.evaluation import check_eval_settings, evaluate_checkpoint
from mesa_train.train.runner import fit

BASE = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=false"]


def _snapshot(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("override,said", [
    ("trainer.overwrite=no", "trainer.overwrite='no' must be true or false"),
    ("optim.ema=off", "optim.ema='off' must be true or false"),
    ("trainer.compile=off", "trainer.compile='off' must be true or false"),
    ("trainer.epochs=true", "trainer.epochs=True must be an integer >= 1"),
    ("trainer.batch_size=true", "trainer.batch_size=True must be an integer >= 1"),
    ("trainer.clip_grad=true", "trainer.clip_grad=True must be null or a positive number"),
    ("model.img_size=true", "model.img_size=True must be a positive integer"),
])
def test_a_boolean_is_true_or_false_and_a_number_is_not_a_boolean(compose_train, override, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_train(BASE + [override]))


def test_evaluate_refuses_a_word_for_ema(compose_train):
    with pytest.raises(ConfigError, match="ema='no' must be true or false"):
        check_eval_settings(compose_train(["checkpoint=x.pt", "ema=no"], config_name="eval"))
    check_eval_settings(compose_train(["checkpoint=x.pt", "ema=true"], config_name="eval"))


def test_a_resume_from_another_runs_checkpoint_never_wipes_this_directorys_run(compose_train, tmp_path):
    other, here, fresh = tmp_path / "other", tmp_path / "here", tmp_path / "fresh"
    fit(compose_train(BASE), str(other))
    fit(compose_train(BASE + ["trainer.max_steps=1"]), str(here))
    before = _snapshot(here)
    foreign = ["trainer.max_steps=3", f"trainer.resume={other / 'checkpoints' / 'last.pt'}"]
    with pytest.raises(RunDirError, match="already holds a run .* is a checkpoint from elsewhere"):
        fit(compose_train(BASE + foreign), str(here))
    assert _snapshot(here) == before
    assert fit(compose_train(BASE + foreign), str(fresh))["step"] == 3  # (an empty directory: continued there)
    assert fit(compose_train(BASE + foreign + ["trainer.overwrite=true"]), str(here))["step"] == 3
    steps = (here / "steps.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in steps[1:]] == ["3"]  # (the old run's step-1 row went with it)
    # its own checkpoint, named: continued as resume=auto is
    own = [f"trainer.resume={here / 'checkpoints' / 'last.pt'}", "trainer.max_steps=4"]
    assert fit(compose_train(BASE + own), str(here))["step"] == 4


def test_other_class_folders_are_refused_on_resume_and_evaluation(compose_train, tmp_path):
    data = write_image_folder(tmp_path / "data")
    run = tmp_path / "run"
    on = ["data=imagenet", "data.num_classes=null"]
    fit(compose_train(BASE + on + [f"data.root={data}"]), str(run))
    last = str(run / "checkpoints" / "last.pt")
    assert ckpt_lib.load_checkpoint(last)["classes"] == ["cat", "dog", "fish"]
    renamed = tmp_path / "renamed"  # (cat -> zebra: sorted, the labels move by one)
    shutil.copytree(data, renamed)
    for split in ("train", "val"):
        (renamed / split / "cat").rename(renamed / split / "zebra")
    with pytest.raises(ckpt_lib.CheckpointError, match=r"cannot resume .*classes \(data.root=.*renamed\) differ "
                                                       r"from the ones it was trained on .*0: 'cat' -> 'dog'"):
        fit(compose_train(BASE + on + [f"data.root={renamed}", "trainer.max_steps=3"]), str(run))
    with pytest.raises(ckpt_lib.CheckpointError, match="cannot evaluate .*classes"):
        evaluate_checkpoint(last, data={"root": str(renamed)}, batch_size=4, num_workers=0, device="cpu")
    two = write_image_folder(tmp_path / "two", classes=("cat", "dog"))
    with pytest.raises(ckpt_lib.CheckpointError, match=r"trained on 3 classes, the data \(data.root=.*two\) has 2"):
        fit(compose_train(BASE + on + [f"data.root={two}", "trainer.max_steps=3"]), str(run))
    assert evaluate_checkpoint(last, data={"root": str(data)}, batch_size=4, num_workers=0, device="cpu")["images"] == 8


@pytest.mark.parametrize("mode,dtype,top", [("I;16", np.uint16, 65535), ("I", np.int32, 65535),
                                            ("I", np.int32, 255), ("F", np.float32, 1.0)])
def test_wide_grey_images_are_scaled_to_8_bits(tmp_path, mode, dtype, top):
    """A 16-bit PNG (PIL mode I;16, or I) was converted to RGB by clipping at 255: an almost white
    image. Now scaled by its depth: a ramp over the full range reads as a mid-grey mean."""
    from PIL import Image

    ramp = np.linspace(0, top, 32 * 32).reshape(32, 32).astype(dtype)
    path = tmp_path / ("ramp.png" if mode == "I;16" else "ramp.tiff")
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode == mode
    got = np.asarray(_NamedImageLoader(False)(str(path)))
    assert got.shape == (32, 32, 3) and got.min() == 0 and got.max() == 255
    assert abs(float(got.mean()) - 127.5) < 2


def test_a_failed_copy_to_last_keeps_best_and_the_run_resumes_from_it(compose_train, tmp_path, monkeypatch):
    """best.pt is written first: a full disk between the two files left a last.pt counting a
    best.pt that was never written; now best.pt holds the step and resume=auto takes it."""
    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(ckpt_lib, "copy_checkpoint", full)
    with pytest.raises(OSError):
        fit(compose_train(BASE), str(tmp_path))
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "last.pt").exists()
    assert ckpt_lib.load_checkpoint(str(tmp_path / "checkpoints" / "best.pt"))["state"]["step"] == 2
    assert fit(compose_train(BASE + ["trainer.max_steps=3"]), str(tmp_path))["step"] == 3


def test_an_unreadable_last_checkpoint_points_to_the_runs_best(compose_train, tmp_path):
    """A truncated last.pt beside a readable best.pt stopped the resume with no way forward; the
    error names best.pt, its step, and the setting that resumes from it, which works."""
    fit(compose_train(BASE), str(tmp_path))
    last, best = tmp_path / "checkpoints" / "last.pt", tmp_path / "checkpoints" / "best.pt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(ckpt_lib.CheckpointError, match=rf"cannot read checkpoint .*last.pt: .*; the run's best.pt "
                                                       rf"\(step 2\) can be read: resume from it with "
                                                       rf"trainer.resume={best}, or start again"):
        fit(compose_train(BASE + ["trainer.max_steps=3"]), str(tmp_path))
    assert fit(compose_train(BASE + ["trainer.max_steps=3", f"trainer.resume={best}"]), str(tmp_path))["step"] == 3
    # a checkpoint that reads but is refused (a newer format) gets no advice to start again: update
    import torch

    good = torch.load(str(best), weights_only=True)
    for path in (last, best):
        torch.save({**good, "version": 999}, str(path))
    with pytest.raises(ckpt_lib.CheckpointError) as info:
        fit(compose_train(BASE + ["trainer.max_steps=4"]), str(tmp_path))
    assert str(info.value).endswith("update mesa-train"), str(info.value)
    best.write_bytes(b"garbage")
    last.write_bytes(b"garbage")
    with pytest.raises(ckpt_lib.CheckpointError, match="best.pt cannot be read either: start again with "
                                                       "trainer.overwrite=true trainer.resume=null"):
        fit(compose_train(BASE + ["trainer.max_steps=4"]), str(tmp_path))


def test_a_corrupt_image_met_mid_run_keeps_the_training_done(compose_train, tmp_path):
    """The first evaluation met a corrupt file after an epoch of training: the run stopped with
    nothing saved. Now last.pt keeps the steps, and the run resumes once the data is fixed."""
    data = write_image_folder(tmp_path / "data")
    bad = data / "val" / "dog" / "1.png"
    good = bad.read_bytes()
    bad.write_bytes(b"not an image")
    run = tmp_path / "run"
    epochs = ["data=imagenet", "data.num_classes=null", f"data.root={data}", "trainer.max_steps=null",
              "trainer.epochs=2", "data.train_size=null", "data.val_size=null"]
    with pytest.raises(DataError, match=r"cannot read image .*1.png.* keeps the training up to step 4: run the same"):
        fit(compose_train(BASE + epochs), str(run))
    assert ckpt_lib.load_checkpoint(str(run / "checkpoints" / "last.pt"))["state"]["step"] == 4
    bad.write_bytes(good)
    assert fit(compose_train(BASE + epochs), str(run))["step"] == 8
    # the epoch whose evaluation failed is evaluated on resume: both epochs have their row
    rows = (run / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1"] and "top1" in rows[0]


def test_the_advice_to_resume_works_for_a_run_started_from_elsewhere(compose_train, tmp_path):
    """A run started with trainer.resume=<another run's checkpoint> was told to "run the same
    command to resume", which then refused (that path lies outside a directory holding a run)."""
    from mesa_train.train.runner import _resume_advice

    other, here = tmp_path / "other", tmp_path / "here"
    fit(compose_train(BASE), str(other))
    cfg = compose_train(BASE + ["trainer.max_steps=3", f"trainer.resume={other / 'checkpoints' / 'last.pt'}"])
    fit(cfg, str(here))
    assert _resume_advice(cfg, str(here)) == "run the same command with trainer.resume=auto to resume"
    assert fit(compose_train(BASE + ["trainer.max_steps=4", "trainer.resume=auto"]), str(here))["step"] == 4
    assert _resume_advice(compose_train(BASE), str(here)) == "run the same command to resume"


def test_a_checkpoint_from_before_the_newer_mesa_settings_resumes_as_it_trained():
    """Settings added to configs/ after checkpoints existed read, where a checkpoint lacks them,
    as the behaviour of the code that wrote it: an old run resumes with mesa.mlp=separate (and
    norm_linear, and mesa.duplicates=keep) as it trained, and a changed default is named, not None."""
    now = {"mesa": {"enabled": True, "row_scale": True, "scale": "linear", "bits": 8, "layout": "channel",
                    "plan": None, "budget": None, "budget_gb": None, "cancelling_bn": "stock", "clip_horizon": 1,
                    "mlp": "shared", "norm_linear": "shared", "duplicates": "skip"},
           "optim": {"lr": 1.0, "layer_decay": None}, "trainer": {"epochs": 2, "strategy": "ddp"}}
    old = {"mesa": {"enabled": True}, "optim": {"lr": 1.0}, "trainer": {"epochs": 2}}
    assert ckpt_lib.changed_settings(old, now) == ["mesa.duplicates: 'keep' -> 'skip'",
                                                   "mesa.mlp: 'separate' -> 'shared'",
                                                   "mesa.norm_linear: 'separate' -> 'shared'"]
    now["mesa"].update(mlp="separate", norm_linear="separate", duplicates="keep")
    assert ckpt_lib.changed_settings(old, now) == []


def test_a_sweep_run_again_over_finished_jobs_leaves_them_as_they_were(tmp_path, run_cli):
    """Jobs refused over a finished sweep's job directories wrote failed.json into them: the
    summary then showed the finished runs as failed, with their old overrides beside the new
    error. Now the refusal is recorded beside them (failed-<job>.json) and the table shows this
    sweep's overrides, then the finished run as "<job> (earlier run)"; a later accepted job
    clears the record."""
    import csv
    import sys

    from conftest import REPO

    sweep, train = tmp_path / "sweep", str(REPO / "train.py")
    args = [sys.executable, train, "-m", f"hydra.sweep.dir={sweep}", *TINY_MODELS["deit"], *FAST_TRAINER,
            "trainer.max_steps=1", "mesa.enabled=false"]
    assert run_cli(args + ["optim.lr=1e-3"], cwd=tmp_path, timeout=300).returncode == 0
    before = _snapshot(sweep / "0")
    result = run_cli(args + ["optim.lr=5e-4"], cwd=tmp_path, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert _snapshot(sweep / "0") == before and (sweep / "failed-0.json").exists()
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert rows[0]["status"] == "failed" and "optim.lr: 0.001 -> 0.0005" in rows[0]["error"]
    assert rows[0]["overrides"] == "optim.lr=0.0005"  # (this sweep's, not the finished job's)
    # the finished run in the folder keeps its row (the refused sweep's table replaced it)
    assert [r["job"] for r in rows] == ["0", "0 (earlier run)"] and rows[1]["step"] == "1"
    assert rows[1]["overrides"] == "optim.lr=0.001" and not rows[1]["status"].startswith("failed")
    assert "runs in a new hydra.sweep.dir" in (sweep / "summary.md").read_text()
    assert run_cli(args + ["optim.lr=1e-3", "trainer.max_steps=2"], cwd=tmp_path, timeout=300).returncode == 0
    assert not (sweep / "failed-0.json").exists()
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["job"] for r in rows] == ["0"] and rows[0]["step"] == "2"


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, run_cli):
    """Hydra makes the run directory before the job: a parent that is a file (or a read-only
    one) gave its traceback; evaluate.py's output= failed only after the whole evaluation, and a
    missing checkpoint= left an empty run directory, a run directory named as checkpoint= a
    DCP message."""
    import sys

    from conftest import REPO

    blocker = tmp_path / "afile"
    blocker.write_text("")
    result = run_cli([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={blocker / 'run'}",
                      *TINY_MODELS["deit"], *FAST_TRAINER], cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: cannot create the run directory {blocker / 'run'}: {blocker} is a file" in result.stderr
    evaluate = [sys.executable, str(REPO / "evaluate.py")]
    run = tmp_path / "ev"
    result = run_cli(evaluate + [f"checkpoint={tmp_path}", f"output={blocker / 'sub'}", f"hydra.run.dir={run}"],
                     cwd=tmp_path)
    assert result.returncode == 1 and "cannot create the output folder" in result.stderr, result.stderr[-2000:]
    result = run_cli(evaluate + [f"hydra.run.dir={run}"], cwd=tmp_path)
    assert result.returncode == 2 and "needs checkpoint=PATH" in result.stderr and not run.exists()
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    (tmp_path / "old" / "checkpoints" / "last.pt").write_bytes(b"")
    result = run_cli(evaluate + [f"checkpoint={tmp_path / 'old'}", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert result.returncode == 2 and "is a folder, not a checkpoint; did you mean checkpoint=" in result.stderr, \
        result.stderr[-2000:]
    assert not run.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_that_refuses_new_folders_is_one_line_also_for_root(tmp_path, run_cli):
    """The check asked os.access, which says yes to root everywhere: /proc (or a read-only mount)
    then failed in Hydra's mkdir with a traceback. It now tries to make a folder there."""
    import sys

    from conftest import REPO
    from mesa_train.hydra_cli import directory_problem

    assert directory_problem(str(tmp_path / "new" / "run"), "the run directory") is None
    assert directory_problem("/proc/x/run", "the run directory").startswith(
        "cannot create the run directory /proc/x/run: /proc is not writable (")
    result = run_cli([sys.executable, str(REPO / "train.py"), "hydra.run.dir=/proc/x", *TINY_MODELS["deit"],
                      *FAST_TRAINER], cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot create the run directory /proc/x")
    assert not [p for p in tmp_path.iterdir()]  # (the probe folder went)


def test_a_refused_run_removes_every_folder_it_made_and_no_other(tmp_path, run_cli):
    """hydra.run.dir=deep/a/b refused at start-up: b went, but deep/a stayed behind. Now every
    folder below the deepest one that existed before the run goes, and that one stays, even
    empty (its time stamps moved when Hydra made the run's folder in it)."""
    import sys

    from conftest import REPO
    from mesa_train.train import rundir

    evaluate = [sys.executable, str(REPO / "evaluate.py")]
    result = run_cli(evaluate + [f"hydra.run.dir={tmp_path / 'deep' / 'a' / 'b'}"], cwd=tmp_path)
    assert result.returncode == 2 and "needs checkpoint=PATH" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "deep").exists()
    (tmp_path / "kept").mkdir()
    result = run_cli(evaluate + ["hydra.run.dir=kept/a/b"], cwd=tmp_path)  # (relative to the cwd)
    assert result.returncode == 2 and (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "a").exists()
    # the run folder named by a setting of the command line (it was composed with defaults: the
    # folder of batch size 128 was taken for the one made, and bs8/x stayed behind)
    (tmp_path / "runs" / "bs128").mkdir(parents=True)
    (tmp_path / "runs" / "bs8").mkdir()
    result = run_cli(evaluate + ["hydra.run.dir=runs/bs${trainer.batch_size}/x", "trainer.batch_size=8"],
                     cwd=tmp_path)
    assert result.returncode == 2 and (tmp_path / "runs" / "bs8").is_dir(), result.stderr[-2000:]
    assert not (tmp_path / "runs" / "bs8" / "x").exists()
    # (train.py's refusal takes the same call; a folder with something in it stops the walk)
    (tmp_path / "x" / "y" / "run").mkdir(parents=True)
    (tmp_path / "x" / "note.txt").write_text("")
    rundir.remove_if_left_empty(str(tmp_path / "x" / "y" / "run"), 0.0, RunDirBefore(str(tmp_path), ()))
    assert not (tmp_path / "x" / "y").exists() and (tmp_path / "x" / "note.txt").exists()
    (tmp_path / "mine" / "run").mkdir(parents=True)  # (a planned folder not on the way: the time rule)
    rundir.remove_if_left_empty(str(tmp_path / "mine" / "run"), time.time() + 60,
                                RunDirBefore(str(tmp_path / "other"), ()))
    assert (tmp_path / "mine" / "run").is_dir()


def test_a_refused_run_removes_the_folders_a_dot_dot_made(tmp_path, run_cli):
    """hydra.run.dir=./x/../y/z: Hydra's mkdir makes x on the way (the path as written), and a
    refused run left it behind; os.path.abspath's y/z never named it."""
    import sys

    from conftest import REPO

    assert folders_mkdir_makes(str(tmp_path / "x" / ".." / "y" / "z")) == tuple(
        str(tmp_path / p) for p in ("x", "y", "y/z"))
    (tmp_path / "y").mkdir()
    assert folders_mkdir_makes(str(tmp_path / "y" / "." / "z")) == (str(tmp_path / "y" / "z"),)
    (tmp_path / "y").rmdir()
    result = run_cli([sys.executable, str(REPO / "evaluate.py"), "hydra.run.dir=./x/../y/z"], cwd=tmp_path)
    assert result.returncode == 2 and "needs checkpoint=PATH" in result.stderr, result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    (tmp_path / "x" / "keep").mkdir(parents=True)  # (made before the run: stays; so does what holds a file)
    result = run_cli([sys.executable, str(REPO / "evaluate.py"), "hydra.run.dir=./w/../x/keep/../y/z"],
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["x", "x/keep"]


def test_a_full_disk_while_taking_the_lock_leaves_no_lock_and_names_the_folder(tmp_path, monkeypatch):
    from mesa_train.train import rundir
    from mesa_train.train.errors import describe

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", full)
    run = tmp_path / "run"
    with pytest.raises(OSError) as info:
        rundir.RunDirLock(str(run)).acquire()
    assert describe(info.value) == (1, f"no space left on {run}")
    assert not run.exists()  # (made for the lock, removed with it)
