"""The benchmark app (issue 5): cpu-quick end to end in a temp dir, file contents, and the
errors for an unknown preset or a configuration the model cannot take."""
from __future__ import annotations

import csv
import json
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs" / "bench"
PRESETS = sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "mesa_train.bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _compose(preset: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[f"preset={preset}", *overrides])


def _preset_dict(preset: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_compose(preset).preset, resolve=True)


def _float(text: str) -> float | None:
    return float(text) if text not in ("", None) else None


# --------------------------------------------------------------------------- cpu-quick run

@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    start = time.perf_counter()
    proc = _run("preset=cpu-quick", f"output_dir={out}", "progress=false", "threads=1")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    folder = out / "cpu-quick"
    rows = list(csv.DictReader(open(folder / "cpu.csv")))
    return {"dir": folder, "root": out, "proc": proc, "elapsed": elapsed, "rows": rows,
            "preset": _preset_dict("cpu-quick")}


def test_cpu_quick_files_exist(quick):
    folder = quick["dir"]
    for name in ("cpu.md", "cpu.csv", "cpu.search.csv", "cpu.json", "cpu.png"):
        assert (folder / name).is_file() and (folder / name).stat().st_size > 0, name
    index = (quick["root"] / "README.md").read_text()
    assert "cpu-quick/cpu.md" in index
    assert quick["elapsed"] < 240, f"cpu-quick took {quick['elapsed']:.0f} s"


def test_every_row_present_and_ok(quick):
    expected = [r["label"] for r in quick["preset"]["rows"]]
    rows = quick["rows"]
    assert [r["label"] for r in rows] == expected
    md = (quick["dir"] / "cpu.md").read_text()
    for label in expected:
        assert f"| {label}" in md, label
    for r in rows:
        assert r["status"] == "ok", (r["label"], r["error"])
        for key in ("saved_mb", "peak_mb", "step_rss_mb", "throughput", "params_m"):
            assert _float(r[key]) is not None and _float(r[key]) > 0, (r["label"], key)
        assert r["peak_kind"] == "cpu_peak_rss"
        # the preset's steps, timed round-robin with the group (interleave: true)
        assert int(r["timed_steps"]) == _preset_dict("cpu-quick")["common"]["steps"]


def test_ratios_consistent_with_raw_numbers(quick):
    rows = quick["rows"]
    base = {r["group"]: r for r in rows if r["baseline"] == "true"}
    assert set(base) == {r["group"] for r in rows}
    for r in rows:
        b = base[r["group"]]
        for value, ratio in (("saved_mb", "saved_ratio"), ("peak_mb", "peak_ratio"),
                             ("step_rss_mb", "step_rss_ratio"), ("throughput", "throughput_ratio")):
            got = _float(r[ratio])
            assert got is not None, (r["label"], ratio)
            if r is b:
                assert got == 1.0
            else:
                want = _float(r[value]) / _float(b[value])
                # values are written with 3 decimals, ratios with 4
                assert got == pytest.approx(want, rel=2e-3, abs=2e-4), (r["label"], ratio)
        if r["paper_memory_mb"]:
            pb = base[r["group"]]
            assert _float(r["paper_memory_ratio"]) == pytest.approx(
                _float(r["paper_memory_mb"]) / _float(pb["paper_memory_mb"]), abs=1e-4)
    # compression must show in the device-independent figure: all ops < 0.5x stock
    by_label = {r["label"]: r for r in rows}
    assert _float(by_label["DeiT-tiny w/ Mesa all"]["saved_ratio"]) < 0.5
    assert _float(by_label["DeiT-tiny w/ Mesa all"]["paper_memory_ratio"]) == pytest.approx(1855 / 4149, abs=1e-4)


def test_markdown_has_device_versions_date(quick):
    md = (quick["dir"] / "cpu.md").read_text()
    meta = json.loads((quick["dir"] / "cpu.json").read_text())
    env = meta["environment"]
    assert "Device: **CPU" in md
    for key in ("torch", "timm", "mesa_train", "cuda", "date"):
        assert env[key] and str(env[key]) in md, key
    assert "Paper memory MB" in md and "4,149 (1.00×)" in md
    assert "![memory vs throughput](cpu.png)" in md


def test_cpu_rows_have_no_host_time_section(quick):
    # on the CPU a step returns when it is done: no host time is recorded, no section written
    assert all(r["host_ms_median"] == "" for r in quick["rows"])
    assert "Host or GPU" not in (quick["dir"] / "cpu.md").read_text()


def test_host_time_section():
    from mesa_train.bench.report import markdown_host_time
    recs = [{"label": "stock", "step_ms_median": 34.0, "host_ms_median": 12.5},
            {"label": "Mesa", "step_ms_median": 52.0, "host_ms_median": 51.0},
            {"label": "cpu row", "step_ms_median": 9.0, "host_ms_median": None}]
    md = markdown_host_time(recs).splitlines()
    assert md[0] == "| Row | Step ms (median) | Host ms to return (median) | Host / step |"
    assert md[2:] == ["| stock | 34.0 | 12.5 | 0.37 |", "| Mesa | 52.0 | 51.0 | 0.98 |"]
    assert markdown_host_time(recs[2:]) == ""


@pytest.mark.cuda
def test_cuda_row_records_host_time():
    import torch
    from mesa_train.bench.measure import run_row
    from mesa_train.bench.presets import RowConfig
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    row = RowConfig(label="tiny", model="deit_ti", group="g", baseline=True, mesa=True, batch_size=4,
                    img_size=32, num_classes=10, warmup=1, steps=3,
                    model_kwargs={"depth": 1, "embed_dim": 24, "patch_size": 16})
    m = run_row(row, torch.device("cuda"), measure_saved=False)
    assert m.status == "ok", m.error
    assert 0 < m.host_ms_median <= m.step_ms_median


def test_search_table(quick):
    srows = list(csv.DictReader(open(quick["dir"] / "cpu.search.csv")))
    assert [r["dim"] for r in srows] == ["depth", "width", "resolution"]
    for r in srows:
        stock, mesa = int(r["stock_max"]), int(r["mesa_max"])
        assert stock >= 1 and mesa >= stock  # Mesa saves memory, so it fits at least as much
        assert _float(r["ratio"]) == pytest.approx(mesa / stock, abs=1e-4)
        assert r["mode"] == "cpu-emulated"
    assert [r["paper_ratio"] for r in srows] == ["3.3000", "2.2000", "1.5000"]


def test_png_is_valid(quick):
    data = (quick["dir"] / "cpu.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 200
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data[-8:-4] == b"IEND"


# --------------------------------------------------------------------------- errors

def test_unknown_preset_is_a_clear_error():
    proc = _run("preset=nope", timeout=120)
    assert proc.returncode != 0
    err = proc.stderr
    assert "nope" in err
    for name in ("cpu-quick", "table1", "table9", "modern"):
        assert name in err


def test_unknown_model_is_a_clear_error():
    proc = _run("preset=cpu-quick", "preset.common.model=nope", "dry_run=true", timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'nope'" in proc.stderr and "deit_ti" in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("threads=-3", "threads=-3: must be a positive integer (CPU threads), or null for torch's default"),
    ("threads=0", "threads=0: must be a positive integer"),
    ("output_dir={file}", "output_dir: cannot write results to {file}/cpu-quick"),
])
def test_bad_threads_and_an_unwritable_output_are_refused_before_measuring(tmp_path, override, message):
    """threads=-3 was torch's traceback; an output_dir that is a file lost the measurement made
    before writing it. Refused first, in one line."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = _run("preset=cpu-quick", "only=Swin", "progress=false", override.format(file=blocker), timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message.format(file=blocker) in proc.stderr and "Traceback" not in proc.stderr
    assert "measured" not in proc.stdout + proc.stderr


def test_unknown_device_is_a_clear_error():
    from mesa_train.bench.measure import resolve_device
    from mesa_train.bench.presets import BenchConfigError

    for name in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(BenchConfigError, match=f"device='{name}' is not supported; valid choices: auto, cpu, "
                                                   "cuda, cuda:N"):
            resolve_device(name)
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="tests the CPU refusal")
def test_gpu_preset_on_cpu_is_a_clear_error():
    proc = _run("preset=table9", timeout=120)
    assert proc.returncode == 2
    assert "set_per_process_memory_fraction" in proc.stderr and "cpu-quick" in proc.stderr


def test_bad_row_values_name_the_choices():
    from mesa_train.bench.presets import BenchConfigError, check_row, expand_preset, make_row
    from mesa_train.compile_scope import SCOPES as COMPILE_SCOPES

    common = {"model": "deit_ti", "batch_size": 8, "img_size": 32}
    cases = [
        ({"label": "a", "mesa": True, "ops": ["gelu", "bogus"]}, ["gelu", "layernorm", "sdpa"]),
        ({"label": "a", "mesa": True, "modules": ["mlp"]}, ["msa", "ffn"]),
        ({"label": "a", "amp": "fp8"}, ["bf16", "fp16"]),
        ({"label": "a", "attention": "flash"}, ["explicit", "fused"]),
        ({"label": "a", "accum_steps": 3}, ["divisible"]),
        ({"label": "a", "paper": "table7/nope"}, ["table7/+ Mesa w/ GELU"]),
        ({"label": "a", "compile": True, "compile_kernels": "fast"}, ["auto", "ops", "traceable"]),
        ({"label": "a", "compile": True, "compile_scope": "layers"}, ["compile_scope='layers'", "model, blocks"]),
        ({"label": "a", "channels_last": "yes"}, ["channels_last must be true or false"]),
        ({"label": "a", "mesa": True, "duplicates": "drop"}, ["duplicates='drop'", "skip, keep"]),
    ]
    for row, words in cases:
        with pytest.raises(BenchConfigError) as info:
            check_row(make_row(common, row))
        for word in words:
            assert word in str(info.value), (row, str(info.value))
    with pytest.raises(BenchConfigError, match="valid fields"):
        make_row(common, {"label": "a", "batchsize": 4})
    # every compile scope has its name in the tables
    row = make_row(common, {"label": "a", "compile": True, "compile_kernels": "traceable", "compile_scope": "blocks"})
    assert row.compile_tags() == ["traceable kernels", "per block"]
    assert [make_row(common, {"label": "a", "compile_scope": s}).compile_tags()
            for s in COMPILE_SCOPES] == [[], ["per block"]]
    with pytest.raises(BenchConfigError, match="exactly one baseline"):
        expand_preset({"common": common, "rows": [{"label": "a"}, {"label": "b"}]})


def test_cuda_graphs_with_gradient_accumulation_is_a_clear_error():
    from mesa_train.bench.presets import BenchConfigError, check_row, make_row

    row = make_row({"model": "deit_ti"}, {"label": "x", "compile": True, "compile_mode": "reduce-overhead",
                                          "accum_steps": 2})
    with pytest.raises(BenchConfigError, match="captures CUDA graphs.*use accum_steps=1 or compile_mode=default"):
        check_row(row)


def test_compile_options_are_inductor_options():
    """A row's ``compile_options`` are checked against Inductor's config before anything runs:
    an unknown name (with the close ones), a value that is not a scalar; a mode beside them is
    merged by compile_model."""
    from torch import nn

    from mesa_train.bench.presets import BenchConfigError, check_row, make_row
    from mesa_train.compile_scope import WRAPPER_INDUCTOR_OPTIONS, inductor_kwargs

    def row(**kw):
        return make_row({"model": "deit_ti"}, {"label": "x", "compile": True, **kw})

    check_row(row(compile_options={"coordinate_descent_tuning": True}))
    assert "coordinate_descent_tuning=True" in row(compile_options={"coordinate_descent_tuning": True}).describe()
    with pytest.raises(BenchConfigError, match="'coordinate_descent_tunin', not an Inductor option.*close: "
                                               "coordinate_descent_tuning"):
        check_row(row(compile_options={"coordinate_descent_tunin": True}))
    with pytest.raises(BenchConfigError, match=r"compile_options\['realize_opcount_threshold'\] must be a bool"):
        check_row(row(compile_options={"realize_opcount_threshold": [1]}))
    # a mode beside options: compile_model gives torch.compile the mode's options and these
    both = row(compile_options={"cpp_wrapper": True}, compile_mode="reduce-overhead")
    check_row(both)
    assert inductor_kwargs(nn.Linear(2, 2), {"mode": both.compile_mode, "options": dict(both.compile_options)}) == {
        "options": {"triton.cudagraphs": True, **WRAPPER_INDUCTOR_OPTIONS, "cpp_wrapper": True}}
    with pytest.raises(BenchConfigError, match="must be a mapping"):
        check_row(row(compile_options=["coordinate_descent_tuning"]))


@pytest.mark.parametrize("backend, passed", [("inductor", {"coordinate_descent_tuning": False}),
                                             ("aot_eager", None)])
def test_compile_options_reach_inductor(monkeypatch, backend, passed):
    """The row's options go to torch.compile with Inductor (which merges them over Mesa's traced
    options: a caller's win); another backend gets none."""
    import torch

    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row

    seen = {}

    def fake_compile_model(model, scope, **kwargs):
        seen.update(kwargs)
        return model

    monkeypatch.setattr(measure, "compile_model", fake_compile_model)
    row = make_row({"model": "deit_ti"}, {"label": "x", "compile": True, "compile_backend": backend,
                                          "compile_options": {"coordinate_descent_tuning": False}})
    measure.TrainStep(row, torch.nn.Linear(2, 2), torch.device("cpu"))
    assert seen.get("options") == passed and seen["backend"] == backend


def test_config_the_model_cannot_take():
    from mesa_train.bench.model_check import check_model
    from mesa_train.bench.presets import BenchConfigError, make_row

    common = {"model": "deit_ti", "batch_size": 2, "img_size": 32, "num_classes": 10}
    # 192 channels cannot be split into 5 heads
    with pytest.raises(BenchConfigError, match="cannot take"):
        check_model(make_row(common, {"label": "heads", "model_kwargs": {"num_heads": 5}}))
    # (the one argument named: the message listed every override)
    with pytest.raises(BenchConfigError, match=r"model 'deit_ti' \(deit_tiny_patch16_224\) takes no argument "
                                               r"'no_such_arg': VisionTransformer"):
        check_model(make_row(common, {"label": "kw", "model_kwargs": {"no_such_arg": 1}}))
    check_model(make_row(common, {"label": "ok", "model_kwargs": {"depth": 1}}))
    # the row's img_size is optional for a CNN; named in its model_kwargs it is not
    cnn = {**common, "model": "resnet18"}
    check_model(make_row(cnn, {"label": "cnn"}))
    with pytest.raises(BenchConfigError, match=r"takes no argument 'img_size'"):
        check_model(make_row(cnn, {"label": "cnn-kw", "model_kwargs": {"img_size": 32}}))


def test_every_preset_is_valid():
    """Names, numbers, groups, paper keys and the search spec of every preset (no model is
    built: the GPU presets are exercised on a GPU)."""
    from mesa_train.bench.presets import expand_preset
    from mesa_train.bench.search import parse_search

    assert {"auto", "cpu-quick", "cpu-compile", "table1", "table7", "table8", "table9", "table13", "table14",
            "modern"} <= set(PRESETS)
    for name in PRESETS:
        preset = _preset_dict(name)
        if name == "auto":
            assert preset["on_cpu"] == "cpu-quick" and preset["on_cuda"] in PRESETS
            continue
        if preset.get("kind") == "planner":  # no rows: checked in tests/test_plan_bench.py
            continue
        assert preset["name"] == name
        rows = expand_preset(preset)
        search = parse_search(preset.get("search"), dict(preset.get("common") or {}))
        assert rows or search, name
        if not name.startswith("cpu-"):
            assert preset.get("requires_cuda") is True, name
            assert all(r.batch_size in (64, 128) for r in rows), name
    table9 = parse_search(_preset_dict("table9")["search"], _preset_dict("table9")["common"])
    assert table9.cap_gb == 32 and [d.name for d in table9.dims] == ["depth", "width", "resolution"]


# --------------------------------------------------------------------------- pure logic

def test_largest_fitting_search():
    from mesa_train.bench.search import largest_fitting

    for limit in (1, 5, 12, 13, 40, 63, 64, 100):
        calls = []

        def fits(u, limit=limit):
            calls.append(u)
            return u <= limit

        got, hit = largest_fitting(fits, 12, 64)
        assert got == min(limit, 64) and hit == (limit >= 64)
        assert len(calls) <= 12
    assert largest_fitting(lambda u: False, 12, 64) == (0, False)


def test_a_channels_last_row_trains_channels_last():
    """``channels_last: true``: the model's 4-D weights and the step's input are NHWC, the row
    says so in its description and its table's Layout column."""
    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row
    from mesa_train.bench.report import DESCRIPTIVE_COLUMNS, build_records

    row = make_row({"model": "resnet18", "batch_size": 2, "img_size": 32, "num_classes": 3, "amp": "fp32"},
                   {"label": "r", "baseline": True, "channels_last": True})
    model = measure.build_for_row(row)
    step = measure.TrainStep(row, model, torch.device("cpu"))
    nhwc = torch.channels_last
    assert model.conv1.weight.is_contiguous(memory_format=nhwc) and not model.conv1.weight.is_contiguous()
    assert step.x.is_contiguous(memory_format=nhwc) and not step.x.is_contiguous()
    step()
    assert "channels_last" in row.describe()
    env = {k: "x" for k in ("device", "torch", "timm", "mesa_train", "cuda", "mesa_extension", "date")}
    rec = build_records("t", [row], [measure.Measurement(peak_mb=1.0, saved_mb=1.0, throughput=1.0)], env)[0]
    assert rec["channels_last"] is True and DESCRIPTIVE_COLUMNS["layout"][1](rec) == "channels-last"


def test_ratios_without_a_measured_baseline():
    from mesa_train.bench.measure import Measurement
    from mesa_train.bench.presets import make_row
    from mesa_train.bench.report import build_records

    env = {k: "x" for k in ("device", "torch", "timm", "mesa_train", "cuda", "mesa_extension", "date")}
    rows = [make_row({"model": "deit_ti"}, {"label": "b", "baseline": True}),
            make_row({"model": "deit_ti"}, {"label": "m", "mesa": True})]
    results = [Measurement(status="oom", error="CUDA out of memory"),
               Measurement(peak_mb=10.0, saved_mb=1.0, throughput=5.0)]
    recs = build_records("t", rows, results, env)
    assert recs[0]["peak_ratio"] is None and recs[1]["peak_ratio"] is None
    assert recs[0]["status"] == "oom"


def test_mesa_ops_must_keep_the_attention_kind():
    """matmul/softmax without sdpa exist only on the explicit path: a fused row with them is
    an error that names the fused op set (the modern preset uses it). (ops=all includes sdpa
    and keeps a fused attention fused since issue 10.)"""
    from mesa_train.bench.model_check import check_model
    from mesa_train.bench.presets import BenchConfigError, make_row

    common = {"model": "deit_ti", "batch_size": 2, "img_size": 32, "num_classes": 10,
              "model_kwargs": {"depth": 1}, "attention": "fused", "mesa": True}
    with pytest.raises(BenchConfigError, match=r"\[linear, gelu, layernorm, conv, relu, sdpa\]"):
        check_model(make_row(common, {"label": "bad", "ops": ["linear", "softmax"]}))
    modern = _preset_dict("modern")
    fused_ops = {tuple(r["ops"]) for r in modern["rows"] if r.get("mesa") and r["attention"] == "fused"}
    assert len(fused_ops) == 1
    check_model(make_row(common, {"label": "ok", "ops": list(fused_ops.pop())}))


def test_cuda_search_control_flow_with_a_simulated_gpu(monkeypatch):
    """The CUDA branch of the Table 9 search without a GPU: the cap becomes a memory
    fraction (reset afterwards), an OOM probe means 'does not fit'."""
    import types

    import torch

    from mesa_train.bench import search as search_mod
    from mesa_train.bench.measure import Measurement

    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(total_memory=80 * 1024 ** 3))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda frac, dev=None: fractions.append(frac))
    monkeypatch.setattr(search_mod, "release", lambda dev: None)
    limits = {"depth": (20, 45), "width": (15, 26), "resolution": (272, 336)}

    def fake_run_row(row, device, **kw):
        dim = ("depth" if row.model_kwargs.get("depth") not in (None, 12) else
               "width" if row.model_kwargs.get("num_heads") not in (None, 12) else "resolution")
        value = {"depth": row.model_kwargs.get("depth", 12), "width": row.model_kwargs.get("num_heads", 12),
                 "resolution": row.img_size}[dim]
        if dim != "resolution" and row.img_size != 224:
            raise AssertionError("only one dim changes at a time")
        limit = limits[dim][1 if row.mesa else 0]
        if value <= limit:
            return Measurement(peak_mb=1000.0 * value / limit)
        return Measurement(status="oom", error="CUDA out of memory")

    monkeypatch.setattr(search_mod, "run_row", fake_run_row)
    spec = search_mod.parse_search(_preset_dict("table9")["search"], _preset_dict("table9")["common"])
    searcher = search_mod.Searcher(spec, torch.device("cuda", 0))
    summary = search_mod.summarize(spec, searcher.run())
    assert fractions == [pytest.approx(32 / 80), 1.0]
    got = {s["dim"]: (s["stock_max"], s["mesa_max"]) for s in summary}
    assert got == {"depth": (20, 45), "width": (15, 26), "resolution": (272, 336)}
    assert summary[0]["paper_ratio"] == 3.3


# --------------------------------------------------------------------------- cpu-compile run

def test_cpu_compile_preset_runs_whole_graph(tmp_path):
    """Eager and compiled, stock and Mesa, in one run: the compiled Mesa row is one graph
    with no break, every row has a ratio against its own group's baseline, and the step
    times were interleaved. (aot_eager here: the committed results use Inductor.)"""
    proc = _run("preset=cpu-compile", f"output_dir={tmp_path}", "progress=false", "threads=1",
                "preset.common.steps=3", "preset.common.warmup=1", "preset.common.compile_backend=aot_eager")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    rows = {r["label"]: r for r in csv.DictReader(open(tmp_path / "cpu-compile" / "cpu.csv"))}
    assert list(rows) == [r["label"] for r in _preset_dict("cpu-compile")["rows"]]
    for label, r in rows.items():
        assert r["status"] == "ok", (label, r["error"])
        assert _float(r["throughput_ratio"]) > 0, label
        assert "interleaved" in r["error"], label  # the note column
    mesa = rows["DeiT-tiny compiled w/ Mesa all"]
    assert mesa["compile"] == "default" and mesa["graphs"] == "1" and mesa["graph_breaks"] == "0", mesa
    assert rows["DeiT-tiny eager w/ Mesa all"]["compile"] == ""
    traced = rows["DeiT-tiny compiled w/ Mesa all (traceable)"]  # the compression as plain PyTorch
    assert traced["compile"] == "default, traceable kernels" and traced["graph_breaks"] == "0", traced
    md = (tmp_path / "cpu-compile" / "cpu.md").read_text()
    assert re.search(r"default \(1 / 0, \d+ s\)", md) and "eager" in md
    # compiled rows report their first (compiling) step's time; eager rows have none
    assert _float(mesa["compile_s"]) > 0 and rows["DeiT-tiny eager w/ Mesa all"]["compile_s"] == ""


# --------------------------------------------------------------------------- partial files

def test_a_stopped_run_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """A run stopped between rows (a time limit on a lent GPU, a lost machine) leaves the
    rows measured so far on disk, marked partial, instead of nothing."""
    from mesa_train.bench import runner
    from mesa_train.bench.measure import Measurement

    calls = []

    def fake_run_row(row, device, **kw):
        calls.append(row.label)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the time limit's signal, after the first row
        return Measurement(peak_mb=123.0, saved_mb=45.0)

    monkeypatch.setattr(runner, "run_row", fake_run_row)
    cfg = _compose("cpu-quick", f"output_dir={tmp_path}", "progress=false", "process_warmup=false")
    with pytest.raises(KeyboardInterrupt):
        runner.run_app(cfg)
    folder = tmp_path / "cpu-quick"
    md = (folder / "cpu.md").read_text()
    total = len(_preset_dict("cpu-quick")["rows"])
    assert f"PARTIAL: 1 of {total} configurations measured" in md
    assert calls[0] in md and calls[1] not in md
    meta = json.loads((folder / "cpu.json").read_text())
    assert meta["partial"] == {"measured": 1, "of": total}
    assert [r["config"]["label"] for r in meta["rows"]] == calls[:1]
    rows = list(csv.DictReader(open(folder / "cpu.csv")))
    assert [r["label"] for r in rows] == calls[:1] and float(rows[0]["peak_mb"]) == 123.0


def test_a_run_stopped_while_profiling_keeps_the_rows_it_profiled(tmp_path, monkeypatch):
    """profile=true runs every row again under the profiler after the table: a time limit
    there (the GPU session's deadline) leaves the rows profiled so far on disk, marked
    partial, instead of only the lines printed."""
    from mesa_train.bench import profile, runner
    from mesa_train.bench.measure import Measurement

    monkeypatch.setattr(runner, "run_row", lambda row, device, **kw: Measurement(peak_mb=1.0, saved_mb=1.0))
    monkeypatch.setattr(runner, "_time_rows_after", lambda *a, **kw: None)
    profiled = []

    def fake_profile_row(row, device, **kw):
        profiled.append(row.label)
        if len(profiled) == 2:
            raise KeyboardInterrupt  # the time limit's signal, after the first row's profile
        return profile.RowProfile(row.label, ops={("aten::mm", "matmul"): (1.5, 2.0)}, wall_ms=2.0)

    monkeypatch.setattr(profile, "profile_row", fake_profile_row)
    cfg = _compose("cpu-quick", f"output_dir={tmp_path}", "progress=false", "process_warmup=false",
                   "profile=true", "only=DeiT-tiny")
    with pytest.raises(KeyboardInterrupt):
        runner.run_app(cfg)
    folder = tmp_path / "cpu-quick"
    total = len(json.loads((folder / "cpu.json").read_text())["rows"])  # the table is complete
    assert total > 2
    md = (folder / "cpu.profile.md").read_text()
    assert f"PARTIAL: 1 of {total} rows profiled" in md
    assert f"| {profiled[0]} (baseline) | 1.50 |" in md and profiled[1] not in md
    rows = list(csv.DictReader(open(folder / "cpu.profile.csv")))
    assert [(r["label"], r["op"], r["ms_per_step"]) for r in rows] == [(profiled[0], "aten::mm", "1.5000")]


def test_skip_drops_rows_but_keeps_baselines():
    from mesa_train.bench.presets import BenchConfigError, expand_preset

    modern = _preset_dict("modern")
    every = [r.label for r in expand_preset(modern, only="DeiT-S")]
    kept = [r.label for r in expand_preset(modern, only="DeiT-S", skip="traceable")]
    assert any("traceable" in label for label in every)
    assert kept == [label for label in every if "traceable" not in label]
    assert "DeiT-S explicit compiled" in kept  # the group's baseline stays
    with pytest.raises(BenchConfigError, match="skip='nothing' matches no"):
        expand_preset(modern, skip="nothing")
    # several texts (gpu_session.sh's speed step leaves out the rows its other steps run)
    speed = _preset_dict("speed")
    every = [r.label for r in expand_preset(speed)]
    kept = [r.label for r in expand_preset(speed, skip=["traceable", "fused"])]
    # the fused and per-block groups lose every Mesa row, so their baselines go too
    assert kept == [label for label in every if label != "stock compiled per block"
                    and "traceable" not in label and "fused" not in label]
    assert "Mesa eager" in kept and "stock eager" in kept and "stock CUDA graphs" in kept
    assert [r.label for r in expand_preset(speed, skip="")] == every
    with pytest.raises(BenchConfigError, match="skip='nothing' matches no"):
        expand_preset(speed, skip=["fused", "nothing"])
    # only= and skip= naming the same rows left nothing, and the run said the preset had no rows
    with pytest.raises(BenchConfigError, match=r"skip='DeiT-S' drops every row of the rows only='DeiT-S' kept: "
                                               r"nothing left to measure; rows: DeiT-S explicit, "):
        expand_preset(modern, only="DeiT-S", skip="DeiT-S")
    with pytest.raises(BenchConfigError, match=r"skip=\['Mesa', 'stock'\] drops every row: nothing left"):
        expand_preset(speed, skip=["Mesa", "stock"])


def test_only_takes_one_text_or_several():
    """only=[A,B] (a list, as skip= takes) keeps the rows matching any text; it crashed on a list."""
    from mesa_train.bench.presets import BenchConfigError, expand_preset

    modern = _preset_dict("modern")
    one = [r.label for r in expand_preset(modern, only="DeiT-S")]
    both = [r.label for r in expand_preset(modern, only=["DeiT-S", "Swin"])]
    assert one and set(one) < set(both) and any("Swin" in label for label in both)
    assert both == [r.label for r in expand_preset(modern) if r.label in both]  # (the preset's order)
    with pytest.raises(BenchConfigError, match="only='nothing' matches no row"):
        expand_preset(modern, only=["DeiT-S", "nothing"])


def test_a_dry_run_validates_a_gpu_preset_on_a_cpu(capsys):
    """dry_run builds every model on the meta device, yet a GPU preset's dry run on a laptop
    stopped at "is a GPU preset" (exit 2) until allow_cpu=true. It now notes each thing that
    needs a GPU (the preset, the CUDA-graph rows, the capped search) and validates; a real run
    is still refused."""
    from mesa_train.bench.presets import BenchConfigError
    from mesa_train.bench.runner import run_app

    for preset, needs in (("graphs", "capture the step in a CUDA graph"), ("table9", "search needs a CUDA GPU")):
        assert run_app(_compose(preset, "device=cpu", "dry_run=true")) == 0
        out, err = capsys.readouterr()
        assert f"preset {preset}: " in out and "(validated, not run)" in out
        assert f"note: preset '{preset}' is a GPU preset and no CUDA device is in use" in err and needs in err, err
        with pytest.raises(BenchConfigError, match="is a GPU preset"):
            run_app(_compose(preset, "device=cpu"))


def test_the_apps_switches_are_true_or_false():
    """dry_run=no was read as true (a non-empty text): a dry run nobody asked for, exit 0. Each
    bench app refuses a switch that is not true or false, in one line, exit 2."""
    proc = _run("preset=cpu-quick", "dry_run=no")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        "mesa_train.bench: error: dry_run='no' must be true or false", proc.stderr
    assert "Traceback" not in proc.stderr and "validated, not run" not in proc.stdout
    for module, switch in (("mesa_train.bench.gradient_fidelity", "progress=no"),
                           ("mesa_train.bench.accuracy", "dry_run=yes")):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", module, switch], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2 and "must be true or false" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_speed_preset_runs_every_knob(tmp_path):
    """The speed preset's knobs (row scales off, nearest rounding, ops vs traceable under
    compile, CUDA graphs) each reach the measured model: shrunk onto the CPU (aot_eager)."""
    proc = _run("preset=speed", "allow_cpu=true", f"output_dir={tmp_path}", "progress=false", "threads=1",
                "+preset.common.model_kwargs={depth:1}", "preset.common.img_size=32", "preset.common.batch_size=2",
                "preset.common.steps=1", "preset.common.warmup=1", "+preset.common.compile_backend=aot_eager",
                "preset.common.num_classes=10")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    meta = json.loads((tmp_path / "speed" / "cpu.json").read_text())
    rows = {r["config"]["label"]: r for r in meta["rows"]}
    assert [r["config"]["label"] for r in meta["rows"]] == [r["label"] for r in _preset_dict("speed")["rows"]]
    assert all(r["measurement"]["status"] == "ok" for r in rows.values()), rows
    assert rows["Mesa eager no row scale"]["config"]["quant"] == {"row_scale": False}
    assert rows["Mesa eager nearest"]["config"]["quant"] == {"rounding": "nearest"}
    assert rows["Mesa compiled traceable"]["config"]["compile_kernels"] == "traceable"
    assert rows["Mesa compiled traceable"]["config"]["compile_scope"] == "blocks"
    assert rows["Mesa compiled traceable"]["measurement"]["graphs"] == 1  # the one block's graph
    assert rows["Mesa eager delayed"]["config"]["quant"] == {"estimator": "delayed"}
    assert rows["Mesa compiled traceable delayed"]["config"]["quant"] == {"estimator": "delayed"}
    assert rows["Mesa compiled traceable delayed"]["measurement"]["graph_breaks"] == 0
    assert rows["Mesa compiled traceable delayed no row scale"]["config"]["quant"] == {
        "estimator": "delayed", "row_scale": False}
    assert rows["Mesa compiled traceable delayed no row scale"]["measurement"]["graph_breaks"] == 0
    assert rows["Mesa compiled traceable delayed untuned"]["config"]["compile_options"] == {
        "coordinate_descent_tuning": False}
    assert rows["stock compiled per block tuned as traceable"]["config"]["compile_options"] == {
        "coordinate_descent_tuning": True}
    for label in ("Mesa compiled traceable delayed combo kernels",
                  "stock compiled per block combo kernels beside traceable"):
        assert rows[label]["config"]["compile_options"] == {"combo_kernels": True}
    assert rows["Mesa CUDA graphs"]["config"]["compile_mode"] == "reduce-overhead"
    # the fused-attention group: each part of the sdpa set keeps less than stock, both together least
    fused = ("stock fused eager", "Mesa fused eager", "Mesa fused eager sdpa only", "Mesa fused eager without sdpa")
    assert all(rows[k]["config"]["attention"] == "fused" for k in fused)
    stock_mb, all_mb, sdpa_mb, rest_mb = (rows[k]["measurement"]["saved_mb"] for k in fused)
    assert all_mb < min(sdpa_mb, rest_mb) and max(sdpa_mb, rest_mb) < stock_mb, (stock_mb, all_mb, sdpa_mb, rest_mb)
    assert rows["Mesa CUDA graphs"]["measurement"]["graph_breaks"] == 0


@pytest.mark.parametrize("mode,reset_before_warmup", [("reduce-overhead", True), ("default", False)])
def test_cuda_graph_rows_read_the_peak_across_their_recording(monkeypatch, mode, reset_before_warmup):
    """A CUDA graph's replay allocates nothing (its activations sit in the graph pool, taken
    while it is recorded in warm-up): the H200 speed table read 412 MB for both stock and
    Mesa DeiT-S CUDA-graph steps. Their peak counter is reset before the warm-up; every other
    row's right before its memory step. (torch.cuda and the warm-up stand in: no GPU here.)"""
    import torch

    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row

    events = []

    class FakeStep:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        first_step_s = 0.0
        last_loss = torch.tensor(1.0)

        def __call__(self):
            events.append("step")

    def fake_warm_step(row, device, *, seed):
        events.append("warm-up")
        return FakeStep()

    monkeypatch.setattr(measure, "warm_step", fake_warm_step)
    monkeypatch.setattr(measure, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * measure.MB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4 * measure.MB)
    row = make_row({"model": "deit_ti", "warmup": 0}, {"label": "x", "compile": True, "compile_mode": mode})
    m = measure._measure(row, torch.device("cuda"), seed=0, measure_saved=False, timed=False, rss=None)
    expected = ["reset", "warm-up", "step"] if reset_before_warmup else ["warm-up", "reset", "step"]
    assert events == expected
    assert m.peak_mb == 3.0
    assert m.peak_kind == ("cuda_max_memory_allocated_from_warmup" if reset_before_warmup
                           else "cuda_max_memory_allocated")
    assert measure.cuda_graph_peak(row, torch.device("cpu")) is False


def test_recorded_command_names_the_cache_environment(monkeypatch):
    """A cold Inductor cache (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1) changes the compile times a
    table reports: the recorded command carries it, so the run can be repeated as it was."""
    from mesa_train.bench.__main__ import _environment_prefix

    for key in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_CACHE_DIR", "MESA_COMPILE_KERNELS"):
        monkeypatch.delenv(key, raising=False)
    assert _environment_prefix() == ""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/a b")
    assert _environment_prefix() == "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TORCHINDUCTOR_CACHE_DIR='/tmp/a b' "


def test_results_index_lists_every_committed_table():
    """results/README.md is the list users open first: every table under results/ (the bench's
    and the scripts') has its line, none is missing after a script wrote one."""
    from mesa_train.bench.report import index_text

    root = REPO / "results"
    assert (root / "README.md").read_text() == index_text(root), \
        "results/README.md is not the list of results/*/*.md: run python -m mesa_train.bench.report"


def test_a_mesa_row_of_a_model_with_reused_modules_takes_per_sample_ranges_from_its_first_step():
    """The bench probes as training does (mesa_train/patch/reuse.py): CoaT's shared position
    encodings are switched before the first (warm-up, compiled or eager) step."""
    import warnings

    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row

    row = make_row({"model": "coat_lite_tiny", "batch_size": 2, "img_size": 32, "num_classes": 3, "amp": "fp32",
                    "model_kwargs": {"embed_dims": [8, 16, 16, 16], "serial_depths": [2, 1, 1, 1]}},
                   {"label": "m", "mesa": True})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = measure.build_for_row(row)
    assert any("cpe1 (ConvPosEnc, 2 calls)" in str(w.message) for w in said)
    assert model.cpe1.proj.quant_options.estimator == "per_sample" and model.training
    assert model.serial_blocks1[0].mlp.fc1.quant_options.estimator == "running"


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_mesa_row_leaves_duplicated_layers_stock_as_training_does(channels_last):
    """``duplicates: skip`` (the default, train.py's mesa.duplicates): a fused DeiT row whose ops
    leave out sdpa keeps each attention's output in the stock SDPA, so its ``proj`` copy only adds
    bytes and goes stock; the row's saved bytes drop, its notes say so, the data and the RNG are
    untouched (the step's input is the keep row's), and ``duplicates: keep`` compresses every layer."""
    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row
    from mesa_train.patch.duplicates import left_stock_duplicates

    common = {"model": "deit_ti", "batch_size": 2, "img_size": 32, "num_classes": 3, "amp": "fp32",
              "attention": "fused", "mesa": True, "ops": ["linear", "gelu", "layernorm"], "warmup": 0,
              "model_kwargs": {"depth": 2}, "channels_last": channels_last}
    saved, notes, inputs = {}, {}, {}
    for mode in ("skip", "keep"):
        row = make_row(common, {"label": mode, "duplicates": mode})
        torch.manual_seed(0)
        model = measure.build_for_row(row)
        step = measure.TrainStep(row, model, torch.device("cpu"))
        inputs[mode] = (step.x.clone(), torch.randn(3))
        stock = left_stock_duplicates(model)
        assert stock == (["blocks.0.attn.proj", "blocks.1.attn.proj"] if mode == "skip" else []), (mode, stock)
        saved[mode] = measure.saved_bytes(step)[0]
        notes[mode] = measure.skipped_duplicates_note(row, model)
    assert saved["skip"] < saved["keep"], saved
    assert notes["skip"].startswith("duplicates=skip: 2 Mesa layer(s) left stock") and notes["keep"] == ""
    assert all(torch.equal(a, b) for a, b in zip(inputs["skip"], inputs["keep"]))
    assert "duplicates=keep" in make_row(common, {"label": "k", "duplicates": "keep"}).describe()


def test_a_failing_skip_measurement_warns_and_measures_the_row_as_patched(monkeypatch):
    """As training does: a row whose skip forward fails is measured with every layer compressed,
    says so in a warning and its notes (the bench goes on); out of memory stays the row's oom."""
    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row
    from mesa_train.patch import start_up

    row = make_row({"model": "deit_ti", "batch_size": 2, "img_size": 32, "num_classes": 3, "amp": "fp32",
                    "model_kwargs": {"depth": 1}}, {"label": "m", "mesa": True})

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(start_up, "skip_duplicated", boom)
    with pytest.warns(UserWarning, match=r"row 'm': duplicates=skip measured nothing.*\(boom\)"):
        model = measure.build_for_row(row)
    assert "failed (boom)" in measure.skipped_duplicates_note(row, model)

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(start_up, "skip_duplicated", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        measure.build_for_row(row)


def test_a_rows_notes_name_the_matmuls_keeping_an_operand_in_full():
    from test_skip_duplicates import PartlyKeptProduct

    from mesa_train.bench import measure
    from mesa_train.bench.presets import make_row
    from mesa_train.patch.duplicates import skip_duplicated

    torch.manual_seed(0)
    model = PartlyKeptProduct().train()
    skip_duplicated(model, torch.randn(2, 8, 16))
    row = make_row({"model": "deit_ti"}, {"label": "m", "mesa": True})
    assert measure.skipped_duplicates_note(row, model).startswith("duplicates=skip: 1 MatMul(s) keeping an operand")
