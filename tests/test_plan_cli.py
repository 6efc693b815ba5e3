"""``python -m mesa_train.plan``: writes a usable plan, prints the table, one-line errors."""
from __future__ import annotations

import sys

import torch

import mesa_train
from mesa_train.models import build_model
from mesa_train.plan import load_plan
from mesa_train.plan.measure import activation_bytes, make_batch

TINY = ["model.img_size=32", "model.depth=2", "model.embed_dim=32", "model.num_heads=2",
        "+model.kwargs.patch_size=8", "model.fused_attn=false", "trainer.batch_size=8", "trainer.device=cpu",
        "trainer.amp=none", "data.num_classes=5", "rounds=1"]


def test_cli_writes_a_plan_that_fits_and_prints_the_table(run_cli, tmp_path):
    out = tmp_path / "plan.yaml"
    r = run_cli([sys.executable, "-m", "mesa_train.plan", "budget=0.6", f"out={out}", *TINY])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "blocks.1" in r.stdout and "act MiB pred" in r.stdout and "all ops" in r.stdout
    plan = load_plan(out)
    assert plan.measured["activation_bytes"] <= 1.10 * plan.budget["allowed_activation_bytes"]
    # the file drives patch_model on a fresh model of the same config
    torch.manual_seed(0)
    model = build_model("deit_ti", depth=2, embed_dim=32, num_heads=2, patch_size=8, img_size=32, num_classes=5,
                        fused_attn=False)
    mesa_train.patch_model(model, plan=out)
    assert activation_bytes(model, make_batch(8, 32, 5, "cpu")) == plan.measured["activation_bytes"]


def test_cli_budget_below_floor_and_missing_budget_are_one_line_errors(run_cli, tmp_path):
    r = run_cli([sys.executable, "-m", "mesa_train.plan", "budget=0.01", f"out={tmp_path / 'p.yaml'}",
                 "measure=false", *TINY])
    assert r.returncode == 2
    assert r.stderr.strip().startswith("mesa_train.plan: error: budget too small")
    assert "smallest any plan reaches is" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.yaml").exists()
    r = run_cli([sys.executable, "-m", "mesa_train.plan", *TINY])
    assert r.returncode == 2 and "give exactly one of budget" in r.stderr
