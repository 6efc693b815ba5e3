"""Bench preset ``planner``: the baselines are correct (same gradients as stock, less
memory) and a tiny run writes the table, CSV, JSON and plot with every configuration."""
from __future__ import annotations

import json
import sys

import torch
from omegaconf import OmegaConf

from mesa_train.bench import planner_baselines as baselines
from mesa_train.bench.planner import run_planner
from mesa_train.models import build_model
from mesa_train.plan.measure import activation_bytes, gradients, make_batch


def tiny():
    torch.manual_seed(0)
    return build_model("deit_ti", depth=2, embed_dim=32, num_heads=2, patch_size=8, img_size=32, num_classes=5,
                       fused_attn=False)


def test_checkpointing_baselines_keep_gradients_and_save_memory():
    model, batch = tiny(), make_batch(8, 32, 5, "cpu")
    exact, stock_bytes = gradients(model, batch), activation_bytes(model, batch)
    measured = {}
    for name, variant in (("full", baselines.grad_checkpointing(model)),
                          ("half", baselines.partial_checkpointing(model, 1)),
                          ("sac", baselines.selective_checkpointing(model))):
        for g, e in zip(gradients(variant, batch), exact):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        measured[name] = activation_bytes(variant, batch)
    assert measured["full"] < measured["half"] < stock_bytes
    assert measured["sac"] < stock_bytes  # counted: SAC's saved tensors go through the meter's hooks
    assert activation_bytes(model, batch) == stock_bytes  # the stock model was not changed


def test_tiny_planner_bench_writes_every_configuration(tmp_path, capsys):
    preset = {"name": "planner", "kind": "planner", "title": "tiny", "device": "cpu", "model": "deit_ti",
              "model_kwargs": {"depth": 2, "embed_dim": 32, "num_heads": 2, "patch_size": 8}, "fused_attn": False,
              "img_size": 32, "num_classes": 5, "batch_size": 8, "budgets": 3, "profile_rounds": 1, "rounds": 2,
              "compile_backend": "aot_eager_decomp_partition", "compile_budgets": []}
    cfg = OmegaConf.create({"preset": preset, "output_dir": str(tmp_path), "seed": 0})
    assert run_planner(cfg) == 0
    out = tmp_path / "planner"
    for ext in ("md", "csv", "json", "png"):
        assert (out / f"cpu.{ext}").stat().st_size > 0
    records = json.loads((out / "cpu.json").read_text())["records"]
    kinds = [r["kind"] for r in records]
    assert kinds[:4] == ["stock", "mesa-all", "ckpt", "sac"] and kinds.count("plan") >= 3
    for r in records:
        if r["kind"] == "plan":  # every plan keeps what its budget allows
            assert r["memory_ratio"] <= r["budget"] * 1.001
            assert abs(r["saved_error"]) <= 0.10 or r["memory_ratio"] > 0.999
    assert any("halfway" in r["label"] for r in records)
    assert "Targets:" in capsys.readouterr().out


def test_bench_cli_dispatches_the_planner_preset(run_cli):
    r = run_cli([sys.executable, "-m", "mesa_train.bench", "preset=planner", "dry_run=true"])
    assert r.returncode == 0, r.stderr[-1500:]
    assert "preset planner: deit_ti on cpu" in r.stdout


def test_planner_preset_file_has_what_run_planner_reads():
    from pathlib import Path

    import yaml

    preset = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs/bench/preset/planner.yaml").read_text())
    assert preset["name"] == "planner" and preset["kind"] == "planner" and preset["device"] == "cpu"
    for key in ("model", "model_kwargs", "img_size", "num_classes", "batch_size", "budgets", "profile_rounds",
                "rounds", "compile_backend", "compile_budgets"):
        assert key in preset, key
    assert preset["budgets"] % 2 == 1  # odd: the halfway budget is one of them
    build_model(preset["model"], img_size=preset["img_size"], num_classes=preset["num_classes"],
                **preset["model_kwargs"])
