"""The accuracy command (issue 15): accuracy-quick end to end in a temp dir (files, rows,
finite numbers, spread recomputed from the per-run file), the full preset validated without
training, and the errors for bad presets."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs" / "bench" / "accuracy"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "mesa_train.bench.accuracy", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _preset(name: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"preset={name}"])
    return OmegaConf.to_container(cfg.preset, resolve=True)


def _float(text: str) -> float:
    value = float(text)
    assert math.isfinite(value), text
    return value


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy")
    start = time.perf_counter()
    proc = _run("preset=accuracy-quick", f"output_dir={out}", "progress=false")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    folder = out / "accuracy-quick"
    return {"dir": folder, "root": out, "elapsed": elapsed, "preset": _preset("accuracy-quick"),
            "rows": list(csv.DictReader(open(folder / "digits.csv"))),
            "runs": list(csv.DictReader(open(folder / "digits.runs.csv"))),
            "meta": json.loads((folder / "digits.json").read_text()),
            "md": (folder / "digits.md").read_text()}


def test_quick_writes_every_file_in_well_under_a_minute(quick):
    for name in ("digits.md", "digits.csv", "digits.runs.csv", "digits.json", "digits.png", "digits.summary.png"):
        path = quick["dir"] / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in ("digits.png", "digits.summary.png"):
        assert (quick["dir"] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "accuracy-quick/digits.md" in (quick["root"] / "README.md").read_text()
    assert quick["elapsed"] < 60, f"accuracy-quick took {quick['elapsed']:.0f} s"


def test_every_row_and_seed_ran_with_finite_numbers(quick):
    preset = quick["preset"]
    labels = [r["label"] for r in preset["rows"]]
    assert [r["label"] for r in quick["rows"]] == labels
    assert sorted((r["label"], int(r["seed"])) for r in quick["runs"]) == sorted(
        (lab, s) for lab in labels for s in preset["seeds"])
    for run in quick["runs"]:
        assert run["status"] == "ok", run
        assert 0.0 <= _float(run["top1"]) <= 100.0
        assert _float(run["val_loss"]) > 0 and _float(run["train_loss"]) > 0
        assert int(run["epochs"]) == 2
    for row in quick["rows"]:
        assert int(row["runs_ok"]) == len(preset["seeds"])
        for key in ("top1_mean", "top1_std", "val_loss_mean", "val_loss_std", "train_loss_mean"):
            _float(row[key])


def test_spread_is_computed_over_the_seeds(quick):
    """mean/std/min/max in the row table equal those recomputed from the per-run file, and
    the paired delta equals the mean seed-by-seed difference to the stock row."""
    runs = quick["runs"]
    by = {(r["label"], int(r["seed"])): r for r in runs}
    seeds = quick["preset"]["seeds"]
    for row in quick["rows"]:
        for metric in ("top1", "val_loss", "train_loss"):
            values = np.array([float(by[(row["label"], s)][metric]) for s in seeds])
            assert _float(row[f"{metric}_mean"]) == pytest.approx(values.mean(), abs=2e-3)
            assert _float(row[f"{metric}_std"]) == pytest.approx(values.std(ddof=1), abs=2e-3)
            assert _float(row[f"{metric}_min"]) == pytest.approx(values.min(), abs=2e-3)
            assert _float(row[f"{metric}_max"]) == pytest.approx(values.max(), abs=2e-3)
        diffs = [float(by[(row["label"], s)]["top1"]) - float(by[("stock", s)]["top1"]) for s in seeds]
        assert _float(row["top1_delta_mean"]) == pytest.approx(np.mean(diffs), abs=2e-3)
        assert len(row["top1_by_seed"].split(";")) == len(seeds)


def test_mesa_rows_compress_and_stock_does_not(quick):
    rows = {r["label"]: r for r in quick["rows"]}
    assert _float(rows["stock"]["saved_ratio"]) == 1.0
    assert _float(rows["Mesa (all ops)"]["saved_ratio"]) < 0.5


def test_markdown_has_paper_tables_claims_and_curves(quick):
    md = quick["md"]
    for label in (r["label"] for r in quick["preset"]["rows"]):
        assert f"| {label} |" in md, label
    assert "## Table 3: nearest (NR) vs stochastic rounding (SR)" in md
    assert "64.7 (C100), failed (IN)" in md  # the paper's NR row, beside ours
    assert "failed (C100)" in md  # Table 6, decay 0.999
    assert "stochastic beats nearest rounding" in md and "Verdict" in md
    assert "![training curves](digits.png)" in md
    meta = quick["meta"]
    assert [c["table"] for c in meta["claims"]] == ["table1", "table3"]
    assert all(c["n"] == 2 for c in meta["claims"])
    curves = meta["runs"]["stock"][0]["curves"]
    assert [c["epoch"] for c in curves] == [0, 1] and all(math.isfinite(c["top1"]) for c in curves)


def test_full_preset_is_valid_without_training():
    """Every row of the full table composes into a valid training config (dry run)."""
    proc = _run("preset=accuracy", "dry_run=true", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    preset = _preset("accuracy")
    assert len(preset["seeds"]) >= 3
    for row in preset["rows"]:
        assert row["label"] in proc.stdout
    tables = set(preset["tables"])
    assert {f"table{i}" for i in range(1, 9)} <= tables


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml")
                                        if p.stem not in ("accuracy", "accuracy-quick")))
def test_other_presets_are_valid_without_training(name):
    """The other presets (delayed, variants, demo) compose into valid training configs too, so a
    typo in one is found here, not after minutes of training."""
    proc = _run(f"preset={name}", "dry_run=true", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in _preset(name)["rows"]:
        assert row["label"] in proc.stdout


def test_demo_preset_trains_what_make_demo_trains():
    """preset=demo repeats make demo's comparison over seeds: the same experiment and epochs
    (digits_deit_baseline's trainer.epochs), seed 0 (make demo's trainer.seed) among its seeds,
    and a Mesa row with the defaults (digits_deit_mesa: every op, every module)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        demo = compose("train", overrides=["experiment=digits_deit_mesa"])
    preset = _preset("demo")
    assert preset["experiment"] == "digits_deit_baseline"
    assert f"trainer.epochs={demo.trainer.epochs}" in preset["train"]
    assert demo.trainer.seed in preset["seeds"] and len(preset["seeds"]) >= 8
    assert list(demo.mesa.ops) == ["all"] and list(demo.mesa.modules) == ["all"]
    assert {"label": "Mesa (all ops)", "mesa": {}} in preset["rows"]


def test_bad_presets_are_clear_errors():
    from mesa_train.bench.accuracy.spec import parse_spec
    from mesa_train.bench.presets import BenchConfigError

    good = _preset("accuracy-quick")
    with pytest.raises(BenchConfigError, match="unknown mesa option.*valid: ops"):
        parse_spec({**good, "rows": [*good["rows"], {"label": "x", "mesa": {"decya": 0.5}}]})
    with pytest.raises(BenchConfigError, match="exactly one row must be the baseline"):
        parse_spec({**good, "rows": [{**r, "baseline": False} for r in good["rows"]]})
    with pytest.raises(BenchConfigError, match="unknown paper row"):
        parse_spec({**good, "tables": {"table3": [{"row": "stock", "paper": "table3/nope"}]}})
    with pytest.raises(BenchConfigError, match="seeds must be distinct"):
        parse_spec({**good, "seeds": [1, 1]})
    proc = _run("preset=accuracy-quick", "dry_run=true", "+preset.rows.0.mesa.ops=[nope]", timeout=120)
    assert proc.returncode == 2
    assert "mesa.ops" in proc.stderr and "valid ops" in proc.stderr and "Traceback" not in proc.stderr


def test_verdicts():
    from mesa_train.bench.accuracy.stats import Paired, paired, verdict

    runs = lambda vals: [{"seed": i, "status": "ok", "top1": v} for i, v in enumerate(vals)]  # noqa: E731
    d = paired(runs([95.0, 96.0, 94.0, 95.5]), runs([93.0, 94.5, 92.0, 93.0]))
    assert d.n == 4 and d.mean == pytest.approx(2.0) and d.ci_low > 0
    assert verdict("better", d, 1.0).startswith("reproduced")
    assert verdict("better", paired(runs([1, 2, 3]), runs([3, 4, 5.5])), 1.0).startswith("contradicted")
    assert verdict("on_par", Paired(5, 0.1, 0.1, 1.0, 0.3, -0.2, 0.4), 1.0).startswith("reproduced")
    assert verdict("on_par", Paired(5, 0.1, 1.0, 0.1, 0.9, -2.5, 2.7), 1.0).startswith("inconclusive")


def test_keep_runs_restarts_where_it_stopped(tmp_path):
    """keep_runs=DIR: a second command reuses every finished run (same numbers, no training),
    and a run whose config changed is trained again."""
    from mesa_train.bench.accuracy.train import Task, finished_summary

    keep, out = tmp_path / "runs", tmp_path / "out"
    args = ("preset=accuracy-quick", f"output_dir={out}", f"keep_runs={keep}", "progress=false",
            "preset.seeds=[0]", "'preset.rows=[{label: stock, mesa: null, baseline: true}, {label: Mesa, mesa: {}}]'",
            "~preset.tables", "~preset.claims")
    first = _run(*[a.strip("'") for a in args])
    assert first.returncode == 0, first.stderr[-3000:]
    table = (out / "accuracy-quick" / "digits.csv").read_text()
    second = _run(*[a.strip("'") for a in args])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "2 run(s) reused from keep_runs" in (out / "accuracy-quick" / "digits.md").read_text()
    assert _top1s(out) == _top1s_text(table)
    task_dir = str(keep / "00" / "seed0")
    meta = json.loads((keep / "00" / "seed0" / "task.json").read_text())
    same = Task("stock", 0, meta["experiment"], tuple(meta["overrides"]), task_dir)
    assert finished_summary(same) is not None
    changed = Task("stock", 0, meta["experiment"], tuple(meta["overrides"]) + ("trainer.epochs=3",), task_dir)
    assert finished_summary(changed) is None


def _top1s(out: Path) -> list[str]:
    return _top1s_text((out / "accuracy-quick" / "digits.csv").read_text())


def _top1s_text(text: str) -> list[str]:
    return [r["top1_by_seed"] for r in csv.DictReader(text.splitlines())]
