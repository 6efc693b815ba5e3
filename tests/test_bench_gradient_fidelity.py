"""The gradient-fidelity table (issue 15): gradients-quick end to end in a temp dir (files,
every model x row, finite numbers, the bias / noise arithmetic), the measure on a case with
a known answer, and clear errors for bad presets."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs" / "bench" / "gradients"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "mesa_train.bench.gradient_fidelity", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _preset(name: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=[f"preset={name}"]).preset)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gradients")
    start = time.perf_counter()
    proc = _run("preset=gradients-quick", f"output_dir={out}", "progress=false", "threads=1")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    folder = out / "gradients-quick"
    return {"dir": folder, "elapsed": elapsed, "preset": _preset("gradients-quick"),
            "rows": list(csv.DictReader(open(folder / "cpu.csv"))), "md": (folder / "cpu.md").read_text()}


def test_quick_files_rows_and_numbers(quick):
    for name in ("cpu.md", "cpu.csv", "cpu.json"):
        assert (quick["dir"] / name).stat().st_size > 0
    assert quick["elapsed"] < 60, f"gradients-quick took {quick['elapsed']:.0f} s"
    preset = quick["preset"]
    expected = [(m["label"], r["label"]) for m in preset["models"] for r in preset["rows"]]
    assert [(r["model"], r["label"]) for r in quick["rows"]] == expected
    for r in quick["rows"]:
        assert r["status"] == "ok", r
        assert r["forward_exact"] == "true", r  # Mesa never changes the forward pass
        vals = {k: float(r[k]) for k in ("cos_single", "rel_err_single", "cos_mean", "rel_err_mean",
                                         "bias_rel", "noise_rel", "worst_tensor_cos_mean")}
        assert all(math.isfinite(v) for v in vals.values()), r
        assert 0.9 < vals["cos_single"] <= 1.0 + 1e-9 and 0 < vals["rel_err_single"] < 0.5, r
        # averaging passes cannot be worse than one pass on average (triangle inequality)
        assert vals["rel_err_mean"] <= vals["rel_err_single"] + 1e-9, r
        # bias^2 = max(0, err_mean^2 - noise^2/N) <= err_mean^2
        assert vals["bias_rel"] <= vals["rel_err_mean"] + 1e-12, r
        assert int(r["passes"]) == preset["passes"]
    md = quick["md"]
    for m in preset["models"]:
        assert f"## {m['label']}" in md
    assert "bias (∞ passes)" in md


def test_measure_row_known_answers():
    """A Mesa copy with compression disabled is exact: error 0, cosine 1, no bias, no noise;
    with 8-bit copies the error is small but not zero, and the arithmetic holds."""
    import timm

    from mesa_train.bench.gradient_fidelity import GradRow, digits_batches, gradient, measure_row

    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              num_classes=10, drop_path_rate=0.0).train()
    for m in stock.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    test, warm = digits_batches(2, 2, 32, seed=0)
    exact, sizes, logits = gradient(stock, test)
    names = [n for n, _ in stock.named_parameters()]
    off = measure_row(stock, exact, logits, sizes, names, GradRow("off", quant={"enabled": False}),
                      test, [warm], passes=3)
    assert off["forward_exact"] and off["rel_err_single"] == 0.0 and off["rel_err_mean"] == 0.0
    assert off["bias_rel"] == 0.0 and off["noise_rel"] == 0.0 and off["cos_mean"] == pytest.approx(1.0, abs=1e-12)
    on = measure_row(stock, exact, logits, sizes, names, GradRow("on"), test, [warm], passes=3)
    assert on["forward_exact"] and 0.0 < on["rel_err_single"] < 0.2 and on["noise_rel"] > 0.0
    assert on["bias_rel"] <= on["rel_err_mean"] <= on["rel_err_single"] + 1e-12


def test_bad_presets_are_clear_errors():
    from mesa_train.bench.gradient_fidelity import parse_spec
    from mesa_train.bench.presets import BenchConfigError

    good = _preset("gradients-quick")
    with pytest.raises(BenchConfigError, match="unknown ops.*valid"):
        parse_spec({**good, "rows": [{"label": "x", "ops": ["gelux"]}]})
    with pytest.raises(BenchConfigError, match="unknown quant option.*valid: num_groups"):
        parse_spec({**good, "rows": [{"label": "x", "quant": {"decya": 0.5}}]})
    with pytest.raises(BenchConfigError, match="unknown keys"):
        parse_spec({**good, "rows": [{"label": "all", "per-sample": None}]})  # an unquoted YAML comma
    with pytest.raises(BenchConfigError, match="unknown model"):
        parse_spec({**good, "models": [{"model": "resnet"}]})
    with pytest.raises(BenchConfigError, match="passes must be"):
        parse_spec({**good, "passes": 1})
    proc = _run("preset=gradients", "dry_run=true", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for label in ("DeiT-S", "Swin-T", "PVT-v2-b1", "all, nearest rounding", "all, decay 0.999"):
        assert label in proc.stdout
    proc = _run("preset=gradients-quick", "preset.models.0.kwargs.num_heads=5", timeout=120)
    assert proc.returncode == 2 and "cannot take" in proc.stderr and "Traceback" not in proc.stderr


def test_a_row_measures_the_model_training_runs():
    """duplicates: skip (the default, as mesa.duplicates): PVT-v2's attn.q with ops=[linear] reads
    the input the stock sr conv keeps in full, so training leaves it stock and so does the row,
    which says so; ``keep`` compresses it. A bad value is a one-line error naming the choices."""
    from mesa_train.bench.gradient_fidelity import GradRow, digits_batches, gradient, measure_row, parse_spec
    from mesa_train.bench.presets import BenchConfigError
    from mesa_train.models import build_model

    torch.manual_seed(0)
    stock = build_model("pvt_v2_b0", fused_attn=False, num_classes=10, drop_path_rate=0.0, depths=[1, 1, 1, 1],
                        embed_dims=[16, 32, 32, 64], num_heads=[1, 2, 2, 4]).train()
    test, warm = digits_batches(2, 2, 32, seed=0)
    exact, sizes, logits = gradient(stock, test)
    names = [n for n, _ in stock.named_parameters()]
    row = GradRow("Linear", ops=("linear",))
    skip = measure_row(stock, exact, logits, sizes, names, row, test, [warm], passes=2)
    keep = measure_row(stock, exact, logits, sizes, names, row, test, [warm], passes=2, duplicates="keep")
    assert skip["skipped"].startswith("duplicates=skip: 3 Mesa layer(s) left stock"), skip["skipped"]
    assert keep["skipped"] == "" and skip["forward_exact"] and keep["forward_exact"]
    with pytest.raises(BenchConfigError, match="duplicates must be one of skip, keep, got 'drop'"):
        parse_spec({**_preset("gradients-quick"), "duplicates": "drop"})


def test_a_size_agnostic_model_is_built_without_img_size():
    """The preset's img_size is optional for a model whose constructor takes none (a CNN; PVT-v2
    was a special case by name): resnet18 failed with "takes no argument 'img_size'". Named in
    the model's own kwargs, it is the user's argument and still refused."""
    from mesa_train.bench.gradient_fidelity import build_stock, check_models, parse_spec
    from mesa_train.bench.presets import BenchConfigError

    spec = parse_spec({**_preset("gradients-quick"), "models": [{"model": "resnet18"}]})
    check_models(spec)
    assert type(build_stock(spec, spec.models[0])).__name__ == "ResNet"
    spec = parse_spec({**_preset("gradients-quick"), "models": [{"model": "resnet18", "kwargs": {"img_size": 32}}]})
    with pytest.raises(BenchConfigError, match="takes no argument 'img_size'"):
        check_models(spec)
