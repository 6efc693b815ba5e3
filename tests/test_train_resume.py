"""Checkpoints: resuming after an interruption continues exactly; writes are atomic;
bad checkpoints are clear errors."""
import csv
import os

import pytest
import torch

from conftest import TINY_MODELS
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train.runner import fit

# Small DeiT on the digits data with the full DeiT recipe (RandAugment, random erasing,
# mixup/cutmix, label smoothing, drop path), Mesa with stochastic rounding, and EMA:
# every source of randomness the pipeline has. 96 images / 32 = 3 steps per epoch.
RESUME = TINY_MODELS["deit"] + [
    "data=digits", "model.img_size=16", "model.kwargs.patch_size=4", "optim=deit", "optim.drop_path=0.1",
    "optim.ema=true", "mesa.enabled=true", "trainer.epochs=2", "trainer.batch_size=32", "data.train_size=96",
    "data.val_size=64", "trainer.num_workers=0", "trainer.device=cpu", "trainer.amp=none", "trainer.progress=false",
    "trainer.log_every=1",
]


def _losses(run_dir):
    return [(int(r["step"]), r["loss"]) for r in csv.DictReader(open(os.path.join(run_dir, "steps.csv")))]


def test_resume_equals_uninterrupted_run(compose_train, tmp_path):
    full = fit(compose_train(RESUME), str(tmp_path / "full"))
    # Interrupted at step 2 (mid-epoch 0), then resumed (resume=auto: same run dir) to the
    # end, crossing the epoch boundary at step 3.
    part = fit(compose_train(RESUME + ["trainer.max_steps=2"]), str(tmp_path / "cut"))
    assert part["step"] == 2
    ckpt = ckpt_lib.load_checkpoint(str(tmp_path / "cut" / "checkpoints" / "last.pt"))
    assert ckpt["state"]["epoch"] == 0 and ckpt["state"]["batch_in_epoch"] == 2
    resumed = fit(compose_train(RESUME), str(tmp_path / "cut"))
    assert resumed["step"] == full["step"] == 6
    full_losses, cut_losses = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    assert [s for s, _ in cut_losses] == list(range(1, 7))
    assert cut_losses == full_losses  # bit-identical losses (as logged, full precision)
    assert resumed["top1"] == full["top1"] and resumed["ema_top1"] == full["ema_top1"]
    a = ckpt_lib.load_checkpoint(str(tmp_path / "full" / "checkpoints" / "last.pt"))["model"]
    b = ckpt_lib.load_checkpoint(str(tmp_path / "cut" / "checkpoints" / "last.pt"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # weights and Mesa estimates


def test_finished_run_resumes_to_nothing(compose_train, tmp_path):
    from conftest import FAST_TRAINER

    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER)
    first = fit(cfg, str(tmp_path))
    again = fit(cfg, str(tmp_path))  # resume=auto finds last.pt at step 2 == max_steps
    assert again["step"] == 2 and again["top1"] == first["top1"]
    # the summary it rewrites is the finished run's: its status and evaluated images, not "done"
    # with none (FAST_TRAINER stops at max_steps=2 within the first epoch)
    assert first["status"] == again["status"] == "stopped at max_steps=2"
    assert first["val_images"] and again["val_images"] == first["val_images"]
    # rerun with a lower max_steps: still the run's status, not "stopped at max_steps=1" at step 2
    lower = fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["trainer.max_steps=1"]), str(tmp_path))
    assert lower["step"] == 2 and lower["status"] == first["status"]
    # a run interrupted at its last step, run again with max_steps at that step: stopped there, not
    # "interrupted" for ever (the review's find: the earlier summary's status was copied)
    import json

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "status": "interrupted at step 2"}))
    assert fit(cfg, str(tmp_path))["status"] == "stopped at max_steps=2"


def test_a_finished_runs_summary_keeps_its_mean_speed(compose_train, tmp_path):
    """Run again over a finished two-epoch run: the mean images/s is the run's, not its last epoch's."""
    first = fit(compose_train(RESUME), str(tmp_path))
    assert first["images_per_s_mean"] != first["images_per_s"]  # (else the check below could not fail)
    again = fit(compose_train(RESUME), str(tmp_path))
    assert again["step"] == first["step"] == 6 and again["status"] == first["status"] == "done"
    assert again["images_per_s_mean"] == first["images_per_s_mean"]


def test_atomic_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "last.pt")
    ckpt_lib.save_checkpoint({"model": {"w": torch.ones(3)}, "config": {}, "state": {"step": 1}}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt_lib.save_checkpoint({"model": {"w": torch.zeros(3)}, "config": {}, "state": {"step": 2}}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["last.pt"]  # no temporary file left behind
    assert ckpt_lib.load_checkpoint(path)["state"]["step"] == 1


def test_corrupt_and_foreign_checkpoints_are_clear_errors(tmp_path):
    good = str(tmp_path / "good.pt")
    ckpt_lib.save_checkpoint({"model": {}, "config": {}, "state": {}}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(good, "rb").read()[:100])
    with pytest.raises(ckpt_lib.CheckpointError, match="corrupt or truncated") as info:
        ckpt_lib.load_checkpoint(str(truncated))
    # (torch's zip error is sentences of advice: its first, whole, ends the line; no half sentence)
    assert str(info.value).endswith("(RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
                                    "central directory)")
    foreign = str(tmp_path / "foreign.pt")
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ckpt_lib.CheckpointError, match="not a mesa-train checkpoint"):
        ckpt_lib.load_checkpoint(foreign)
    with pytest.raises(ckpt_lib.CheckpointError, match="not found"):
        ckpt_lib.load_checkpoint(str(tmp_path / "missing.pt"))
    # garbage bytes and a pickle of more than plain data: one line, without torch's advice to
    # load with weights_only=False (running the file's code)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("garbage!")
    code = str(tmp_path / "code.pt")
    torch.save({"when": __import__("datetime").date(2026, 12, 1)}, code)
    for bad in (str(garbage), code):
        with pytest.raises(ckpt_lib.CheckpointError) as info:
            ckpt_lib.load_checkpoint(bad)
        message = str(info.value)
        assert "\n" not in message and "weights_only" not in message and "corrupt or truncated" in message


def test_incompatible_checkpoint_is_a_clear_error(compose_train, tmp_path):
    from conftest import FAST_TRAINER

    fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=false"]), str(tmp_path))
    # Same run dir, now with Mesa and a deeper model: refuse, naming the differences.
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "model.depth=3",
                                                              "trainer.max_steps=4"])
    with pytest.raises(ckpt_lib.CheckpointError, match="(?s)model.depth.*mesa.enabled"):
        fit(cfg, str(tmp_path))
    # The weights check catches what the config check cannot (hand-edited checkpoints).
    from mesa_train.train.model import build

    model = build(cfg, 10)
    stock = ckpt_lib.load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))["model"]
    with pytest.raises(ckpt_lib.CheckpointError, match="missing keys"):
        ckpt_lib.load_model_state(model, stock, "last.pt")


def test_a_run_of_another_process_count_is_not_resumed(compose_train, tmp_path):
    """The global batch is batch_size x processes x grad_accum: a checkpoint written by 2
    processes (one RNG state each) resumed by 1 would halve it while the saved schedule kept
    the old learning rate (the banner printing the new one) and the data position meant
    batches per rank of 2. Refused, naming the count to resume with; nothing is written."""
    from conftest import FAST_TRAINER

    base = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=false"]
    fit(compose_train(base), str(tmp_path))
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt = ckpt_lib.load_checkpoint(str(path))
    ckpt["rng"] = ckpt["rng"] * 2  # as torchrun --nproc_per_node=2 writes it
    ckpt_lib.save_checkpoint({k: v for k, v in ckpt.items() if k not in ("format", "version")}, str(path))
    before = path.read_bytes()
    with pytest.raises(ckpt_lib.CheckpointError, match=r"with 1 process\(es\): it was written by 2 \(global batch "
                                                       r"8 = 4 x 2 x 1 accumulation, now 4\).*Resume with 2 processes"):
        fit(compose_train(base + ["trainer.max_steps=4"]), str(tmp_path))
    assert path.read_bytes() == before


def test_mesa_estimates_alone_not_matching_load_with_one_warning():
    """A checkpoint whose Mesa estimates do not match the model's layers (a layer a newer
    version compresses: MHA cross-attention children, MaxViT's attention; one it no longer
    has) loads: the missing estimates start from the next batch (initialized False), the
    stale ones are dropped, one warning names them. A missing weight is still an error."""
    import warnings

    import torch
    from torch import nn

    from mesa_train.patch import patch_model

    def model():
        torch.manual_seed(0)
        return patch_model(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))

    trained = model()
    trained(torch.randn(4, 8, requires_grad=True)).sum().backward()
    state = trained.state_dict()
    old = {k: v for k, v in state.items() if not k.startswith("1.quantizer.")}  # (written before GELU was)
    for entry in ("alpha", "beta", "initialized"):  # (a layer this model does not have)
        old[f"3.quantizer.{entry}"] = state[f"2.quantizer.{entry}"]
    fresh = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt_lib.load_model_state(fresh, old, "old.pt")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "1 Mesa layers of this model have no estimates in it (1.quantizer)" in messages[0]
    assert "the estimates of 1 layers this model does not have (3.quantizer) are dropped" in messages[0], messages
    assert not bool(fresh[1].quantizer.initialized) and bool(fresh[0].quantizer.initialized)
    assert torch.equal(fresh[0].weight, trained[0].weight)
    del old["0.weight"]
    with pytest.raises(ckpt_lib.CheckpointError, match="missing keys: 0.weight"):
        ckpt_lib.load_model_state(model(), old, "old.pt")
    # not estimates that may start afresh: a lone `*quantizer*.alpha` (a user's own quantization-aware
    # clip, PACT / LSQ) and a format record (another bit width) are errors as before
    lone = dict(state, **{"act_quantizer.alpha": torch.tensor(6.0)})
    with pytest.raises(ckpt_lib.CheckpointError, match="unexpected keys: act_quantizer.alpha"):
        ckpt_lib.load_model_state(model(), lone, "qat.pt")
    four = patch_model(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), bits=4)
    four(torch.randn(4, 8, requires_grad=True)).sum().backward()
    with pytest.raises(ckpt_lib.CheckpointError, match="unexpected keys: .*quantizer.format"):
        ckpt_lib.load_model_state(model(), four.state_dict(), "four.pt")
