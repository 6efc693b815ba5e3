"""Training with a compression plan (issue 13): ``mesa.plan=auto mesa.budget=...`` plans at
start-up, ``mesa.plan=FILE`` reuses one, the checkpoint stores the plan applied and a resumed
run applies that plan again; bad plan settings are one-line config errors."""
import pytest
import yaml

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.plan import save_plan
from mesa_train.plan.planfile import Plan
from mesa_train.plan import train_hook
from mesa_train.train.checkpoint import load_checkpoint
from mesa_train.train.config import ConfigError
from mesa_train.train.runner import fit

BASE = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true"]


def _quantized_layers(ckpt_model: dict) -> set:
    """Module paths (up to the Mesa layer) that own quantizer state in a checkpoint."""
    return {k.split(".quantizer")[0].split(".q_")[0] for k in ckpt_model if k.endswith(".rng")}


def _last(tmp_path):
    return load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))


def test_plan_file_patches_only_its_layers_and_is_checkpointed(compose_train, tmp_path):
    plan = Plan(layers={"(other)": (), "blocks.0": ("gelu",), "blocks.1": ()})
    path = save_plan(plan, tmp_path / "plan.yaml")
    summary = fit(compose_train(BASE + [f"mesa.plan={path}"]), str(tmp_path / "run"))
    assert summary["step"] == 2
    ckpt = _last(tmp_path / "run")
    quantized = _quantized_layers(ckpt["model"])
    assert quantized and all(k.startswith("blocks.0.mlp") for k in quantized), quantized
    assert ckpt["mesa_plan"]["layers"] == {"(other)": [], "blocks.0": ["gelu"], "blocks.1": []}


def test_auto_plan_fits_the_budget_and_resume_reuses_the_checkpoint_plan(compose_train, tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    first = fit(compose_train(BASE + ["mesa.plan=auto", "mesa.budget=0.6", "trainer.max_steps=1"]), run)
    assert first["step"] == 1
    stored = _last(tmp_path / "run")["mesa_plan"]
    assert stored["budget"]["asked"] == "budget=0.6" and any(stored["layers"].values())
    # the resumed run must not plan again (another plan could not load the saved estimates)
    monkeypatch.setattr(train_hook, "plan_from_config", lambda *a, **k: pytest.fail("re-planned on resume"))
    resumed = fit(compose_train(BASE + ["mesa.plan=auto", "mesa.budget=0.6"]), run)
    assert resumed["step"] == 2
    assert _last(tmp_path / "run")["mesa_plan"]["layers"] == stored["layers"]


@pytest.mark.parametrize("overrides,message", [
    (["mesa.budget=0.5"], "need mesa.plan=auto"),
    (["mesa.plan=auto"], "exactly one of mesa.budget"),
    (["mesa.plan=auto", "mesa.budget=1.5"], r"mesa.budget=1.5 must be a fraction in \(0, 1\]"),
    (["mesa.plan=auto", "mesa.budget_gb=-2"], "must be a positive number of GB"),
    # the planner's own rule (Budget.check): an infinite budget is not a budget
    (["mesa.plan=auto", "mesa.budget_gb=inf"], r"mesa.budget_gb=inf must be a positive number of GB"),
    (["mesa.plan=/no/such/plan.yaml"], "no such plan file"),
])
def test_bad_plan_settings_are_config_errors(compose_train, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        fit(compose_train(BASE + overrides), str(tmp_path))


def test_a_budget_below_the_floor_names_the_smallest_achievable(compose_train, tmp_path):
    with pytest.raises(ConfigError, match="mesa.plan: budget too small.*smallest"):
        fit(compose_train(BASE + ["mesa.plan=auto", "mesa.budget=0.01"]), str(tmp_path))


def test_a_plan_for_another_model_is_refused_with_its_layer_names(compose_train, tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"format": "mesa-train-plan/1", "layers": {"stages.0": ["gelu"]}}))
    with pytest.raises(ConfigError, match=r"mesa.plan: .*does not have: \['stages.0'\]"):
        fit(compose_train(BASE + [f"mesa.plan={path}"]), str(tmp_path / "run"))
