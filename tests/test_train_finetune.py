"""What a timm user expects (issue 11): any timm model name, fine-tuning from a local file
(a timm weights file or our checkpoint, head re-initialised for another class count),
layer-wise lr decay."""
import pytest
import torch

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train.model import build
from mesa_train.train.runner import fit


def _backbone(state):
    return {k: v for k, v in state.items() if not k.startswith("head.") and "quantizer" not in k}


def test_finetune_from_our_checkpoint_reinitialises_a_new_head(compose_train, tmp_path):
    fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true"]), str(tmp_path / "pre"))
    path = tmp_path / "pre" / "checkpoints" / "last.pt"
    trained = ckpt_lib.load_checkpoint(str(path))["model"]
    # Another class count (5 instead of 10), Mesa on: backbone from the file, a fresh head.
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["data.num_classes=5", f"model.pretrained_path={path}"])
    model = build(cfg, 5)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in _backbone(trained).items())
    assert state["head.weight"].shape == (5, 32)
    # the same class count keeps the head too
    model = build(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [f"model.pretrained_path={path}"]), 10)
    assert torch.equal(model.state_dict()["head.weight"], trained["head.weight"])
    summary = fit(cfg, str(tmp_path / "fine"))  # and it trains
    assert summary["step"] == 2



@pytest.mark.parametrize("fmt", ["mesa.bits=4", "mesa.estimator=learned"])
def test_finetune_from_a_checkpoint_of_another_format(compose_train, tmp_path, fmt):
    """A run trained in a variant format (its quantizers' state_dicts carry a ``format`` record,
    learned thresholds ``clip_*``) is a starting point too: its Mesa state is dropped like the
    estimates, for a run in the same format and for a stock one (before, both were refused with
    "unexpected: ...quantizer.format")."""
    fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", fmt]), str(tmp_path / "pre"))
    path = tmp_path / "pre" / "checkpoints" / "last.pt"
    trained = ckpt_lib.load_checkpoint(str(path))["model"]
    assert any(k.endswith((".format", ".clip_log")) for k in trained)  # (what the fix is about)
    for mesa in (["mesa.enabled=true", fmt], ["mesa.enabled=false"]):
        cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + mesa + [f"model.pretrained_path={path}"])
        state = build(cfg, 10).state_dict()
        assert all(torch.equal(state[k], v) for k, v in _backbone(trained).items())


def test_finetune_from_a_timm_weights_file(compose_train, tmp_path):
    import timm

    stock = timm.create_model("deit_tiny_patch16_224", img_size=32, depth=2, embed_dim=32, num_heads=2,
                              patch_size=8, num_classes=1000)
    path = tmp_path / "weights.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in stock.state_dict().items()}}, path)
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [f"model.pretrained_path={path}", "mesa.enabled=true"])
    state = build(cfg, 10).state_dict()
    assert all(torch.equal(state[k], v) for k, v in _backbone(stock.state_dict()).items())
    # a file of another architecture is a clear error
    other = timm.create_model("deit_tiny_patch16_224", img_size=32, depth=3, embed_dim=32, num_heads=2,
                              patch_size=8)
    torch.save(other.state_dict(), tmp_path / "other.pth")
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [f"model.pretrained_path={tmp_path / 'other.pth'}"])
    with pytest.raises(ckpt_lib.CheckpointError, match="does not fit model VisionTransformer.*unexpected: blocks.2"):
        build(cfg, 10)


def test_an_unreadable_weights_file_is_one_line_without_torchs_advice(compose_train, tmp_path):
    """A truncated or foreign weights file: one line naming the file and what is wrong, with the
    same wording as a torn checkpoint (checkpoint.load_failure). torch's own text for a pickle
    holding code advises weights_only=False, i.e. running the file's code: never passed on."""
    import pickle

    truncated = tmp_path / "truncated.pth"
    torch.save({"w": torch.zeros(64)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    with_code = tmp_path / "code.pth"
    with open(with_code, "wb") as f:
        pickle.dump({"w": ckpt_lib.CheckpointError("x")}, f)  # (a class instance: not plain data)
    for path, says in ((truncated, "cannot read weights (RuntimeError: "), (with_code, "UnpicklingError: it holds")):
        cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [f"model.pretrained_path={path}"])
        with pytest.raises(ckpt_lib.CheckpointError) as err:
            build(cfg, 10)
        text = str(err.value)
        assert text.startswith(f"model.pretrained_path={path}: ") and says in text, text
        assert "\n" not in text and "weights_only=False" not in text, text


def test_layer_decay_scales_the_lr_per_block(compose_train, tmp_path):
    fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["optim.layer_decay=0.5"]), str(tmp_path))
    groups = ckpt_lib.load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))["optimizer"]["param_groups"]
    scales = sorted({round(g["lr_scale"], 6) for g in groups})
    # timm's layer ids for a 2-block ViT: embeddings 0, blocks 1-2, final norm + head 3 -> 0.5 ** (3 - id)
    assert scales == [0.125, 0.25, 0.5, 1.0]


def test_any_timm_model_trains(compose_train, tmp_path):
    cfg = compose_train(FAST_TRAINER + ["model.name=vit_tiny_patch16_224", "model.img_size=32", "model.depth=1",
                                        "+model.kwargs.patch_size=16", "mesa.enabled=true"])
    assert fit(cfg, str(tmp_path))["step"] == 2
