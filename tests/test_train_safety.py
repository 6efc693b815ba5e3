"""Nothing lost, nothing silently wrong (issue 11): non-finite states never reach a
checkpoint, a run directory has one owner and is never overwritten by accident, resumed
runs keep their settings, and a resumed epoch's numbers cover the whole epoch."""
import copy
import csv
import os
import signal
import warnings

import pytest
import torch

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train import runner
from mesa_train.train.errors import Interrupted, NonFiniteError, RunDirError, describe
from mesa_train.train.rundir import RunDirLock
from mesa_train.train.runner import fit

BASE = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=false"]


def _last(run_dir):
    return ckpt_lib.load_checkpoint(str(run_dir / "checkpoints" / "last.pt"))


def _all_finite(state_dict):
    return all(torch.isfinite(v).all() for v in state_dict.values() if v.is_floating_point())


def _poison_loss_from_call(monkeypatch, first_bad_call):
    """The criterion returns NaN from its ``first_bad_call``-th call on."""
    from mesa_train.train.engine import build_criterion

    def build(*args):
        criterion, calls = build_criterion(*args), [0]

        def poisoned(outputs, targets):
            calls[0] += 1
            loss = criterion(outputs, targets)
            return loss * float("nan") if calls[0] >= first_bad_call else loss

        return poisoned

    monkeypatch.setattr(runner, "build_criterion", build)


def test_nonfinite_loss_never_reaches_a_checkpoint(compose_train, tmp_path, monkeypatch):
    fit(compose_train(BASE), str(tmp_path))  # a good last.pt at step 2
    # Resume to step 6, saving every step; the loss turns NaN at the second step after the
    # resume, and log_every is larger than the run (the old code only looked at the loss there).
    _poison_loss_from_call(monkeypatch, 2)
    cfg = compose_train(BASE + ["trainer.max_steps=6", "trainer.checkpoint_every=1", "trainer.log_every=100"])
    with pytest.raises(NonFiniteError, match="step 4.*last.pt still holds step 3") as info:
        fit(cfg, str(tmp_path))
    assert describe(info.value)[0] == 3
    ckpt = _last(tmp_path)
    assert ckpt["state"]["step"] == 3 and _all_finite(ckpt["model"]) and _all_finite(ckpt["optimizer"]["state"][0])
    assert "resume skipping such steps" in str(info.value)


def test_nonfinite_before_any_checkpoint_says_to_run_again(compose_train, tmp_path, monkeypatch):
    """With no checkpoint written yet the advice was to resume, or to start from "the kept
    weights" (model.pretrained_path=<its checkpoint>): there were none. Running again starts
    afresh in the same directory, which the advice now says."""
    _poison_loss_from_call(monkeypatch, 1)
    with pytest.raises(NonFiniteError, match=r"no checkpoint was written\. To go on: run again \(the same run "
                                             r"directory starts afresh\)") as info:
        fit(compose_train(BASE), str(tmp_path))
    assert "pretrained_path" not in str(info.value)
    monkeypatch.undo()
    assert fit(compose_train(BASE), str(tmp_path))["step"] == 2
    # after a steps.csv row (log_every=1) the directory holds a run a fresh start refuses to replace:
    # the advice is overwrite, and it works
    run = tmp_path / "logged"
    _poison_loss_from_call(monkeypatch, 2)
    with pytest.raises(NonFiniteError, match=r"To go on: run again with trainer.overwrite=true \(it replaces this "
                                             r"run's steps.csv; no checkpoint\)") as info:
        fit(compose_train(BASE + ["trainer.max_steps=3", "trainer.log_every=1"]), str(run))
    monkeypatch.undo()
    assert fit(compose_train(BASE + ["trainer.overwrite=true"]), str(run))["step"] == 2


def test_nonfinite_steps_can_be_skipped(compose_train, tmp_path, monkeypatch):
    from mesa_train.train.engine import build_criterion

    calls = [0]

    def build(*args):
        criterion = build_criterion(*args)

        def sometimes_nan(outputs, targets):  # call 2 (step 2) is NaN
            calls[0] += 1
            loss = criterion(outputs, targets)
            return loss * float("nan") if calls[0] == 2 else loss

        return sometimes_nan

    monkeypatch.setattr(runner, "build_criterion", build)
    summary = fit(compose_train(BASE + ["trainer.nonfinite=skip", "trainer.max_steps=3"]), str(tmp_path))
    assert summary["step"] == 3 and summary["skipped_steps"] == 1
    assert _all_finite(_last(tmp_path)["model"])


def test_nonfinite_skip_gives_up_after_too_many(compose_train, tmp_path, monkeypatch):
    _poison_loss_from_call(monkeypatch, 1)
    cfg = compose_train(BASE + ["trainer.nonfinite=skip", "trainer.max_nonfinite_skips=2", "trainer.max_steps=4"])
    with pytest.raises(NonFiniteError, match="2 steps in a row"):
        fit(cfg, str(tmp_path))
    assert not (tmp_path / "checkpoints" / "last.pt").exists()



def test_the_skip_limit_counts_across_epochs(compose_train, tmp_path, monkeypatch):
    """Epochs of 2 steps, a limit of 4: steps 2 to 5 skipped in a row (over two epochs' ends)
    stop the run. Before, the count restarted every epoch and a run whose every step was
    non-finite trained to max_steps; the epochs without a finite batch logged train_loss 0."""
    _poison_loss_from_call(monkeypatch, 2)
    cfg = compose_train(BASE + ["data.train_size=8", "trainer.nonfinite=skip", "trainer.max_nonfinite_skips=4",
                                "trainer.max_steps=8"])
    with pytest.raises(NonFiniteError, match=r"4 steps in a row .*last: step 5\).*trainer.max_nonfinite_skips") as err:
        fit(cfg, str(tmp_path))
    assert "trainer.nonfinite=skip" not in str(err.value)  # (it is on: not advised again)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [row["train_loss"] for row in rows][1:] == [""]  # epoch 2: every step skipped, no loss
    assert float(rows[0]["train_loss"]) > 0  # epoch 1: step 1's loss


def test_second_live_run_is_refused_naming_the_owner(compose_train, tmp_path):
    with RunDirLock(str(tmp_path)):  # another run holds the directory
        with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()} on host"):
            fit(compose_train(BASE), str(tmp_path))
    assert not (tmp_path / "metrics.csv").exists()
    fit(compose_train(BASE), str(tmp_path))  # the lock went with its owner


def _snapshot(folder):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_fresh_start_never_replaces_an_earlier_run(compose_train, tmp_path):
    fit(compose_train(BASE), str(tmp_path))
    before = _snapshot(tmp_path)
    # trainer.resume=null over an existing run: refused, nothing touched.
    with pytest.raises(RunDirError, match="already holds a run.*trainer.overwrite=true"):
        fit(compose_train(BASE + ["trainer.resume=null"]), str(tmp_path))
    assert _snapshot(tmp_path) == before
    # overwrite=true while resume=auto finds last.pt: contradictory, refused naming both ways out
    with pytest.raises(RunDirError, match="trainer.overwrite=true, but trainer.resume=auto found .*last.pt to "
                                          "continue: add trainer.resume=null to replace that run"):
        fit(compose_train(BASE + ["trainer.overwrite=true"]), str(tmp_path))
    assert _snapshot(tmp_path) == before
    # Explicit: replaced, no row of the old run survives.
    summary = fit(compose_train(BASE + ["trainer.resume=null", "trainer.overwrite=true", "trainer.max_steps=1"]),
                  str(tmp_path))
    assert summary["step"] == 1 and _last(tmp_path)["state"]["step"] == 1
    assert len((tmp_path / "steps.csv").read_text().splitlines()) == 2  # header + step 1


def test_resume_with_changed_settings_refuses_listing_them(compose_train, tmp_path):
    fit(compose_train(BASE + ["optim.lr=1e-3"]), str(tmp_path))
    before = _snapshot(tmp_path)
    cfg = compose_train(BASE + ["optim.lr=5e-4", "trainer.batch_size=2", "trainer.max_steps=4"])
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=r"(?s)changed settings.*optim.lr: 0.001 -> 0.0005.*trainer.batch_size: 4 -> 2"):
        fit(cfg, str(tmp_path))
    assert _snapshot(tmp_path) == before  # a run rejected at start-up leaves the directory as it was
    # Runtime settings may change: a longer run, other logging and workers.
    summary = fit(compose_train(BASE + ["optim.lr=1e-3", "trainer.max_steps=3", "trainer.log_every=2"]),
                  str(tmp_path))
    assert summary["step"] == 3 and summary["lr"] == 1e-3


def test_resumed_epoch_train_loss_covers_the_whole_epoch(compose_train, tmp_path):
    one_epoch = BASE + ["trainer.max_steps=null", "trainer.epochs=1"]  # 16 images / 4 = 4 steps
    full = fit(compose_train(one_epoch), str(tmp_path / "full"))
    fit(compose_train(one_epoch + ["trainer.max_steps=2"]), str(tmp_path / "cut"))
    resumed = fit(compose_train(one_epoch), str(tmp_path / "cut"))
    assert resumed["step"] == full["step"] == 4
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=1e-12)


def test_no_validation_set_means_no_top1_and_no_best(compose_train, tmp_path):
    summary = fit(compose_train(BASE + ["data.val_size=0"]), str(tmp_path))
    assert summary["top1"] is None and summary["best_top1"] is None and summary["step"] == 2
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "checkpoints" / "best.pt").exists()


def test_checkpoint_every_saves_on_its_steps_only(compose_train, tmp_path, monkeypatch):
    steps = []
    real = ckpt_lib.save_checkpoint
    monkeypatch.setattr(ckpt_lib, "save_checkpoint", lambda payload, path: (steps.append(payload["state"]["step"]),
                                                                              real(payload, path)))
    fit(compose_train(BASE + ["trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.epochs=1"]),
        str(tmp_path))
    assert steps == [2, 4]  # every 2 steps mid-epoch, and at the end of the epoch


def test_ctrl_c_saves_last_and_resumes(compose_train, tmp_path, monkeypatch):
    from mesa_train.train.loggers import RunLogger

    real = RunLogger.log_step

    def interrupt_at_step_2(self, row):
        real(self, row)
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C

    monkeypatch.setattr(RunLogger, "log_step", interrupt_at_step_2)
    cfg = compose_train(BASE + ["trainer.max_steps=4", "trainer.epochs=1"])
    with pytest.raises(Interrupted, match="interrupted at step 2.*last.pt") as info:
        fit(cfg, str(tmp_path))
    assert info.value.exit_code == 130
    assert _last(tmp_path)["state"]["step"] == 2
    monkeypatch.setattr(RunLogger, "log_step", real)
    assert fit(cfg, str(tmp_path))["step"] == 4


def test_stale_temporaries_are_removed_and_checkpoints_get_the_umask_mode(compose_train, tmp_path):
    stale = tmp_path / "checkpoints" / ".last.pt.abc123.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a checkpoint")
    old_mask = os.umask(0o022)
    try:
        fit(compose_train(BASE), str(tmp_path))
    finally:
        os.umask(old_mask)
    assert not stale.exists()
    for name in ("last.pt", "best.pt"):
        assert (tmp_path / "checkpoints" / name).stat().st_mode & 0o777 == 0o644


def test_full_disk_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    import tempfile

    # Writes to /dev/full fail with ENOSPC, as on a full disk.
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: (os.open("/dev/full", os.O_WRONLY),
                                                            str(tmp_path / ".last.pt.x.tmp")))
    with pytest.raises(OSError) as info:
        ckpt_lib.save_checkpoint({"model": {"w": torch.ones(1000)}, "config": {}, "state": {}},
                                 str(tmp_path / "last.pt"))
    assert describe(info.value) == (1, f"no space left on {tmp_path}")


def test_a_rank_that_lost_its_peer_is_one_line():
    """Under torchrun, the rank whose shard held a corrupt image says so; the other rank's next
    collective then failed (gloo: "Connection closed by peer", NCCL: a DistBackendError) and
    Hydra dumped that rank's traceback, burying the real error."""
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                        "by peer [127.0.0.1]:24492. This is typically caused by a remote worker crashing.")
    nccl = torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
                                              "there was a network error, NCCL version 2.21.5\nncclRemoteError: x")
    for err, gist in ((gloo, "Connection closed by peer [127.0.0.1]:24492"),
                      (nccl, "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
                             "network error, NCCL version 2.21.5")):
        assert describe(err) == (1, f"lost contact with another process of this run ({gist}): it failed or was "
                                    f"stopped, and its own error is printed above or in its log; or the network "
                                    f"between them failed")
    assert describe(RuntimeError("shape mismatch")) is None  # (a bug stays a traceback)
    # a rank's own NCCL failure or a timeout is not a lost peer: their whole text stays (a traceback)
    for own in (torch.distributed.DistBackendError("NCCL error in: x.cpp:1, unhandled cuda error\nCuda failure "
                                                   "'out of memory'"),
                torch.distributed.DistStoreError("Timed out after 901 seconds waiting for clients. 1/2 joined."),
                torch.distributed.DistBackendError("[Rank 0] Watchdog caught collective operation timeout")):
        assert describe(own) is None, own


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir_is_one_line(compose_train, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o500)
    try:
        with pytest.raises(OSError) as info:
            fit(compose_train(BASE), str(run_dir))
    finally:
        run_dir.chmod(0o700)
    code, message = describe(info.value)
    assert code == 1 and message.startswith("cannot write to") and str(run_dir) in message


def test_amp_auto_is_fp32_on_cpu_and_banner(compose_train, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="mesa_train.train")
    summary = fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["trainer.amp=auto"]), str(tmp_path))
    assert summary["amp"] == "none"
    text = caplog.text
    for needle in ("run directory:", "device cpu x 1 process(es); AMP none (trainer.amp=auto)",
                   "global batch 4 (4 x 1 x 1 accumulation); lr", "Mesa ops=all modules=all",
                   "kept_for_backward=", "(stock ~"):
        assert needle in text, needle


def test_warmup_batches_are_left_out_of_the_throughput(compose_train, tmp_path):
    from mesa_train.train.data import build_loaders
    from mesa_train.train.engine import Parts, TrainState, train_one_epoch
    from mesa_train.train.model import build

    cfg = compose_train(BASE + ["trainer.max_steps=null"])
    loaders = build_loaders(cfg)
    model = build(cfg, loaders.num_classes)
    parts = Parts(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                  criterion=torch.nn.CrossEntropyLoss(), device=torch.device("cpu"))
    loaders.train.sampler.set_epoch(0)
    out = train_one_epoch(parts, loaders.train, TrainState(), batches_per_epoch=loaders.train_batches,
                          log_every=0, warmup_batches=2)
    assert out["train_images"] == 16 and out["timed_images"] == 8  # 4 batches of 4, the first 2 untimed


def test_environment_errors_read_as_one_line():
    import errno

    assert describe(OSError(errno.EROFS, "Read-only file system", "/runs/a")) == (
        1, "cannot write to /runs/a: read-only file system")
    assert describe(PermissionError(errno.EACCES, "Permission denied", "/runs/a")) == (
        1, "cannot write to /runs/a: permission denied")
    assert describe(KeyboardInterrupt())[0] == 130
    assert describe(ValueError("a bug")) is None  # bugs keep their traceback
    from mesa_train.train.data import DataError

    wrapped = DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                        "last):\n  File \"x.py\", line 1, in f\nmesa_train.train.data.DataError: cannot read image "
                        "/d/1.png: boom")
    assert describe(wrapped) == (2, "cannot read image /d/1.png: boom")


def test_resumed_logs_keep_the_columns_of_their_file(tmp_path):
    from mesa_train.train.loggers import RunLogger

    (tmp_path / "metrics.csv").write_text("epoch,step,train_loss\n0,2,1.5\n")  # an older version's columns
    logger = RunLogger(str(tmp_path), resume_step=2)
    logger.log_epoch({"epoch": 1, "step": 4, "train_loss": 1.25, "stock_saved_bytes": 7})
    assert (tmp_path / "metrics.csv").read_text() == "epoch,step,train_loss\n0,2,1.5\n1,4,1.25\n"


def test_unwritable_run_dir_is_refused_before_anything_runs(compose_train, tmp_path, monkeypatch):
    import errno

    # As root a chmod-ed directory stays writable: simulate the read-only mount instead.
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(tmp_path / "run")) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError) as info:
        fit(compose_train(BASE), str(tmp_path / "run"))
    assert describe(info.value) == (1, f"cannot write to {tmp_path / 'run'}: read-only file system")


def test_a_model_keeping_more_than_stock_is_warned_about(compose_train, tmp_path, caplog):
    """``mesa.ops=[conv]`` on a ReLU convnet with ``mesa.duplicates=keep``: each stock ReLU keeps
    its output, the next conv's input, so the convs' 8-bit copies come on top (resnet18 at 64 px:
    1.026x of stock's bytes). The run says so once, and names the tool. With the default
    ``duplicates=skip`` those convs go stock at start-up (logged) and it keeps less than stock;
    with relu too, or with nothing patched (the review's find: the loss's saved tensors were
    counted on Mesa's side only), it says nothing either."""
    import logging

    caplog.set_level(logging.INFO, logger="mesa_train.train")
    model = ["model.name=resnet18", "model.img_size=32", "model.img_size_kwarg=false"]
    fit(compose_train(model + FAST_TRAINER + ["mesa.enabled=true", "mesa.ops=[conv]", "mesa.duplicates=keep"]),
        str(tmp_path / "keep"))
    warned = [r.getMessage() for r in caplog.records if "keeps more for backward than stock" in r.getMessage()]
    assert len(warned) == 1 and "describe(model, example_input)" in warned[0], warned
    assert "left 18 Mesa layer(s) stock" not in caplog.text
    for ops in ("[conv]", "[conv,relu]", "[grn]"):  # (grn: nothing patched, the same bytes; the loss's once counted)
        caplog.clear()
        run_dir = tmp_path / ops.strip("[]").replace(",", "_")
        fit(compose_train(model + FAST_TRAINER + ["mesa.enabled=true", f"mesa.ops={ops}"]), str(run_dir))
        assert "keeps more for backward" not in caplog.text, ops
        assert ("left 18 Mesa layer(s) stock whose copies other modules keep in full anyway (conv 18)"
                in caplog.text) == (ops == "[conv]"), ops


def test_the_readme_example_puts_the_fused_attentions_back(compose_train, tmp_path, caplog):
    """``mesa.ops=[gelu,softmax]`` on timm's fused DeiT moves its attentions to the explicit path,
    which keeps an N x N map: at start-up (``mesa.duplicates=skip``) they go back on their fused
    path, logged, and the run keeps less than stock; ``keep`` leaves them explicit."""
    import logging

    caplog.set_level(logging.INFO, logger="mesa_train.train")
    # (at 96 px, 145 tokens: two heads' 1-byte maps outweigh the 32-channel output the fused path
    # keeps; at the tiny model's 32 px, 17 tokens, the explicit path keeps less and stays)
    ops = ["mesa.enabled=true", "mesa.ops=[gelu,softmax]", "model.img_size=96"]
    with warnings.catch_warnings(record=True) as caught:  # (patch_model's explicit-path warning: said
        warnings.simplefilter("always")                     # by the start-up line instead, with skip)
        fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ops), str(tmp_path / "skip"))
    assert "put 2 attention(s) back on the fused path they were built with" in caplog.text
    assert "keeps more for backward" not in caplog.text
    assert not [w for w in caught if "now run the explicit path" in str(w.message)]
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ops + ["mesa.duplicates=keep"]),
            str(tmp_path / "keep"))
    assert "attention(s) back" not in caplog.text
    assert [w for w in caught if "now run the explicit path" in str(w.message)]


def test_stock_saved_bytes_estimate_is_exact_and_leaves_the_buffers():
    """The stock figure beside ``kept_for_backward``: from 2 and 4 images, extrapolated, it is
    the batch's own figure (saved bytes are affine in the batch: the BatchNorm statistics stay;
    one image scaled overstated it), and the BatchNorms' running statistics are as before."""
    from types import SimpleNamespace

    import timm
    from mesa_train.memory import SavedTensorMeter
    from mesa_train.patch import patch_model
    from mesa_train.train.runner import _stock_saved_bytes

    torch.manual_seed(0)
    stock = timm.create_model("resnet18", num_classes=10).train()
    with SavedTensorMeter(stock) as meter:
        stock(torch.zeros(8, 3, 32, 32))
    model = patch_model(copy.deepcopy(stock), ops=["conv"])
    before = {k: b.clone() for k, b in model.named_buffers()}
    cfg = SimpleNamespace(trainer=SimpleNamespace(batch_size=8, channels_last=False),
                          model=SimpleNamespace(img_size=32))
    run = SimpleNamespace(device=torch.device("cpu"), amp_dtype=None)
    assert _stock_saved_bytes(model, cfg, run) == meter.activation_bytes
    for k, b in model.named_buffers():
        assert torch.equal(before[k], b), k
    assert all(m.quant_options.enabled for m in model.modules() if hasattr(m, "quant_options"))


def test_stock_saved_bytes_is_the_model_as_built():
    """``mesa.ops=[softmax]`` on a fused ViT runs its attention explicit; the stock figure is the
    fused model's (as built), not the explicit path's with its N x N map."""
    import warnings
    from types import SimpleNamespace

    import timm
    from mesa_train.memory import SavedTensorMeter
    from mesa_train.patch import patch_model
    from mesa_train.train.runner import _stock_saved_bytes

    torch.manual_seed(0)
    stock = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4).train()
    with SavedTensorMeter(stock) as meter:
        stock(torch.zeros(2, 3, 32, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the attentions moved to the explicit path: said elsewhere)
        model = patch_model(copy.deepcopy(stock), ops=["softmax"])
    cfg = SimpleNamespace(trainer=SimpleNamespace(batch_size=2, channels_last=False),
                          model=SimpleNamespace(img_size=32))
    run = SimpleNamespace(device=torch.device("cpu"), amp_dtype=None)
    assert _stock_saved_bytes(model, cfg, run) == meter.activation_bytes
