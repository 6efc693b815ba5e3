"""Bench rows with ``cuda_graph: true``: the whole eager training step (forward, backward, optimizer)
captured once in a CUDA graph and replayed (preset ``graphs``), so a row's ratio is its GPU time's.
On CPU: the configuration's checks and one-line errors, and the optimizer and autocast a capture
needs. On a GPU: the replays train as the eager steps do."""
from __future__ import annotations

import json

import pytest
import torch

from test_bench import _preset_dict, _run

from mesa_train.bench.measure import amp_context, make_optimizer
from mesa_train.bench.presets import BenchConfigError, RowConfig, check_row, expand_preset, make_row
from mesa_train.bench.report import DESCRIPTIVE_COLUMNS

TINY = {"model": "deit_ti", "batch_size": 4, "img_size": 32, "num_classes": 10, "amp": "bf16",
        "model_kwargs": {"depth": 1, "embed_dim": 24, "patch_size": 16}}


@pytest.mark.parametrize("fields, message", [
    ({"compile": True}, "compile_mode=reduce-overhead"),
    ({"amp": "fp16"}, "valid amp with cuda_graph: bf16, fp32"),
    ({"cuda_graph": "yes"}, "cuda_graph must be true or false"),
])
def test_rows_a_capture_cannot_take_are_one_line_errors(fields, message):
    row = make_row(TINY, {"label": "r", "cuda_graph": True, **fields})
    with pytest.raises(BenchConfigError, match=message) as err:
        check_row(row)
    assert "\n" not in str(err.value)


def test_a_captured_step_gets_a_capturable_optimizer_and_no_cast_cache():
    """AdamW keeps its step count on the device only where the step is captured (capturable
    costs a plain eager step a little); autocast's weight-cast cache would skip the casts in
    every replay after the recording, so a captured step runs without it."""
    model = torch.nn.Linear(4, 2)
    graphed, plain = make_row(TINY, {"label": "g", "cuda_graph": True}), make_row(TINY, {"label": "p"})
    assert make_optimizer(graphed, model).defaults["capturable"] is True
    assert make_optimizer(plain, model).defaults["capturable"] is False
    assert amp_context(graphed, torch.device("cpu"))._cache_enabled is False
    assert amp_context(plain, torch.device("cpu"))._cache_enabled is not False
    assert "cuda-graph" in graphed.describe() and "cuda-graph" not in plain.describe()


def test_the_table_names_a_graphed_eager_step():
    render = DESCRIPTIVE_COLUMNS["compile"][1]
    assert render({"compile": "", "cuda_graph": True}) == "eager, one CUDA graph"
    assert render({"compile": "", "cuda_graph": False}) == "eager"


def test_the_graphs_preset_pairs_graphed_with_graphed():
    """Every graphed Mesa row is compared with a graphed stock row, every eager one with an
    eager one: a ratio of a graphed step to an eager one would measure the host again."""
    rows = expand_preset(_preset_dict("graphs"))
    by_group: dict[str, list[RowConfig]] = {}
    for r in rows:
        by_group.setdefault(r.group_name, []).append(r)
    assert len(by_group) == 4
    for group in by_group.values():
        assert len({r.cuda_graph for r in group}) == 1
        assert [r.baseline for r in group] == [True, False]
    assert sum(r.cuda_graph for r in rows) == 4


def test_graphed_rows_without_a_gpu_are_a_clear_error(tmp_path):
    """On CPU (forced with allow_cpu) the graphed rows stop the run before any model is built,
    naming them and how to leave them out; skipping them runs the rest."""
    shrink = ["+preset.common.model_kwargs={depth:1}", "preset.common.img_size=32", "preset.common.batch_size=2",
              "preset.common.steps=1", "preset.common.warmup=1", "preset.common.num_classes=10",
              "progress=false", "threads=1", f"output_dir={tmp_path}"]
    proc = _run("preset=graphs", "allow_cpu=true", *shrink)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "need a CUDA device" in err[0] and "Mesa fused graphed" in err[0] and "skip=" in err[0]
    proc = _run("preset=graphs", "allow_cpu=true", "skip=graphed", *shrink)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    meta = json.loads((tmp_path / "graphs" / "cpu.json").read_text())
    assert [r["config"]["label"] for r in meta["rows"]] == ["stock fused eager", "Mesa fused eager",
                                                            "stock explicit eager", "Mesa explicit eager"]
    assert all(r["measurement"]["status"] == "ok" for r in meta["rows"])


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_replays_train_as_the_eager_steps_do(attention):
    """A captured Mesa step, replayed, gives the losses of the same steps run eagerly from the same
    state (seed, warm-up) within float noise, and each replay advances every quantizer's device
    counter (fresh rounding noise) as an eager step does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from mesa_train.bench.measure import warm_step
    from mesa_train.nn.quantizer import ActivationQuantizer

    device = torch.device("cuda")
    ops = ["all"] if attention == "explicit" else ["linear", "gelu", "layernorm", "sdpa"]
    losses, counters = {}, {}
    for graphed in (False, True):
        row = make_row(TINY, {"label": "r", "mesa": True, "ops": ops, "attention": attention, "warmup": 3,
                              "cuda_graph": graphed})
        check_row(row)
        step = warm_step(row, device, seed=0)
        assert (step.graph is not None) == graphed
        losses[graphed] = []
        for _ in range(4):
            step()
            losses[graphed].append(float(step.last_loss))
        counters[graphed] = sorted(int(m.rng[1]) for m in step.model.modules() if isinstance(m, ActivationQuantizer)
                                   and bool(m.initialized))
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-4)
    assert counters[True] == counters[False] and counters[True], counters
