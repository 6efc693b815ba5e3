"""The ``mesa.*`` keys of the quantizer variants (issue 12): ``bits``, ``scale``, ``layout``,
``estimator=learned``. Bad values and unsupported combinations are start-up ConfigErrors that
name the valid choices; valid ones reach ``patch_model`` and a tiny training run."""
import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train import config as config_lib
from mesa_train.train.checkpoint import load_checkpoint
from mesa_train.train.config import ConfigError, mesa_options
from mesa_train.train.runner import fit

BAD = [
    ({"mesa.bits": 3}, r"mesa.bits=3 is not valid; choose one of: 8, 4, 2"),
    ({"mesa.bits": 16}, r"mesa.bits=16 is not valid; choose one of: 8, 4, 2"),
    ({"mesa.bits": True}, r"mesa.bits=True is not valid; choose one of: 8, 4, 2"),
    ({"mesa.bits": "four"}, r"mesa.bits='four' is not valid; choose one of: 8, 4, 2"),
    ({"mesa.scale": "log"}, r"mesa.scale='log' is not valid; choose one of: linear, pow2"),
    ({"mesa.layout": "patch8x8"}, r"mesa.layout='patch8x8' is not valid; choose one of: channel, patch4x4"),
    ({"mesa.estimator": "learnt"}, r"mesa.estimator='learnt' is not valid; choose one of: running, per_sample, "
                                   r"learned"),
    # combinations
    ({"mesa.layout": "patch4x4"}, r"patch4x4 applies to conv activations only: it needs mesa.ops=\[conv\]"),
    ({"mesa.layout": "patch4x4", "mesa.ops": ["conv", "gelu"]}, r"needs mesa.ops=\[conv\]"),
    ({"mesa.estimator": "learned", "mesa.symmetric": True},
     r"(?s)estimator='learned'.*symmetric=True is not supported.*valid: symmetric=False"),
    ({"mesa.layout": "patch4x4", "mesa.ops": ["conv"], "mesa.estimator": "learned"},
     r"patch4x4.*estimator='running'.*symmetric=False"),
    ({"mesa.layout": "patch4x4", "mesa.ops": ["conv"], "mesa.symmetric": True},
     r"patch4x4.*estimator='running'.*symmetric=False"),
    ({"mesa.estimator": "learned", "mesa.clip_horizon": 0.5}, r"mesa: clip_horizon must be a finite number >= 1"),
    ({"mesa.estimator": "learned", "mesa.clip_horizon": "long"}, r"clip_horizon must be a finite number >= 1"),
    ({"mesa.clip_horizon": 64}, r"clip_horizon=64 weighs the clipping of estimator='learned' only"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[str(o) for o, _ in BAD])
def test_bad_variant_values_are_config_errors_naming_the_choices(compose_train, overrides, message):
    cfg = compose_train([])
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(cfg)


def test_bad_variant_values_are_reported_together(compose_train):
    cfg = compose_train(["mesa.bits=3", "mesa.scale=log", "mesa.layout=blocks"])
    with pytest.raises(ConfigError, match=r"(?s)mesa.bits=3.*mesa.scale='log'.*mesa.layout='blocks'"):
        config_lib.validate(cfg)


@pytest.mark.parametrize("overrides,expected", [
    ([], {"bits": 8, "scale": "linear", "layout": "channel", "estimator": "running"}),
    (["mesa.bits=4"], {"bits": 4}),
    (["mesa.bits=2", "mesa.scale=pow2"], {"bits": 2, "scale": "pow2"}),
    (["mesa.bits=2", "mesa.estimator=learned"], {"bits": 2, "estimator": "learned"}),
    (["mesa.bits=2", "mesa.estimator=learned", "mesa.clip_horizon=64"],
     {"bits": 2, "estimator": "learned", "clip_horizon": 64}),
    (["mesa.ops=[conv]", "mesa.layout=patch4x4", "mesa.bits=2"], {"layout": "patch4x4", "bits": 2}),
])
def test_valid_variant_values_reach_patch_model(compose_train, overrides, expected):
    cfg = compose_train(overrides)
    config_lib.validate(cfg)
    opts = mesa_options(cfg)
    for key, value in expected.items():
        assert opts[key] == value


def _formats(ckpt_model: dict) -> set:
    """The stored-format records ([bits, scale, layout, learned]) of a checkpoint's quantizers."""
    return {tuple(int(v) for v in t) for k, t in ckpt_model.items() if k.endswith(".format")}


@pytest.mark.parametrize("overrides,record", [
    (["mesa.bits=4"], (4, 0, 0, 0)),
    (["mesa.bits=2", "mesa.scale=pow2", "mesa.estimator=learned"], (2, 1, 0, 1)),
])
def test_tiny_training_run_with_variant_bits(compose_train, tmp_path, overrides, record):
    run = tmp_path / "run"
    summary = fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", *overrides]), str(run))
    assert summary["step"] == 2
    ckpt = load_checkpoint(str(run / "checkpoints" / "last.pt"))
    model = ckpt["model"]
    assert _formats(model) == {record}  # every quantizer stored the requested format
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())
    if record[3]:
        assert any(k.endswith("clip_log") for k in model)
