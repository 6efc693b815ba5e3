"""trainer.compile=true with Mesa: the whole model is one graph (fullgraph), the run trains,
checkpoints the estimates and the rounding counters, and resumes.

``torch.compile`` is wrapped here to add ``backend="aot_eager", fullgraph=True``: AOTAutograd
traces forward and backward as Inductor would (any graph break fails the run), without the
minutes of C++ code generation on 2 cores. Inductor itself runs in
``python -m mesa_train.bench preset=cpu-compile``."""
import functools

import torch

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train.checkpoint import load_checkpoint
from mesa_train.train.runner import fit


def test_compiled_mesa_training_is_one_graph(compose_train, tmp_path, monkeypatch):
    calls = []
    real_compile = torch.compile

    def strict_compile(model, **kwargs):
        calls.append(kwargs)
        return real_compile(model, **{**kwargs, "backend": "aot_eager", "fullgraph": True})

    monkeypatch.setattr(torch, "compile", functools.wraps(real_compile)(strict_compile))
    torch._dynamo.reset()
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "trainer.compile=true"])
    summary = fit(cfg, str(tmp_path))
    assert calls, "trainer.compile=true did not call torch.compile"
    assert summary["step"] == 2 and summary["top1"] is not None
    ckpt = load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))["model"]
    counters = [int(v[1]) for k, v in ckpt.items() if k.endswith(".rng")]
    # every quantizer that ran advanced its device-side counter once per training forward
    assert counters and max(counters) == 2, counters


def test_compile_mode_reaches_torch_compile(compose_train, tmp_path, monkeypatch):
    """trainer.compile_mode=reduce-overhead (CUDA graphs) reaches torch.compile (as the mode's
    Inductor options, beside compile_scope.WRAPPER_INDUCTOR_OPTIONS), and the training loop
    marks a step boundary before each batch (on CPU Inductor would skip the graphs; here the
    options are recorded and the run trains under aot_eager)."""
    calls, marks = [], []
    real_compile = torch.compile

    def strict_compile(model, **kwargs):
        calls.append(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("mode", "options")}  # (Inductor's)
        return real_compile(model, **{**kwargs, "backend": "aot_eager", "fullgraph": True})

    monkeypatch.setattr(torch, "compile", functools.wraps(real_compile)(strict_compile))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    torch._dynamo.reset()
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "trainer.compile=true",
                                                              "trainer.compile_mode=reduce-overhead"])
    summary = fit(cfg, str(tmp_path))
    assert [(c.get("options") or {}).get("triton.cudagraphs") for c in calls] == [True]
    assert summary["step"] == 2 and len(marks) == 2


def test_compile_scope_blocks_compiles_each_block(compose_train, tmp_path, aot_eager_compile):
    """trainer.compile_scope=blocks: each timm block compiled in place as one whole graph (the
    stem and head eager), the run trains, and the checkpoint keys are the model's own (no
    torch.compile wrapper prefix), so a resume loads them."""
    calls = aot_eager_compile
    overrides = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "trainer.compile=true",
                                                      "trainer.compile_scope=blocks"]
    summary = fit(compose_train(overrides), str(tmp_path))
    assert summary["step"] == 2
    # one call per block of the tiny DeiT, each fullgraph with static shapes
    assert len(calls) >= 2 and all(c["fullgraph"] and c["dynamic"] is False for c in calls), calls
    ckpt = load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))["model"]
    assert not any("_orig_mod" in k for k in ckpt) and any(k.startswith("blocks.0.") for k in ckpt)


def test_compile_mode_errors_name_the_choices(compose_train):
    import pytest

    from mesa_train.train.config import ConfigError, validate

    cases = [
        (["trainer.compile=true", "trainer.compile_mode=fast"],
         "trainer.compile_mode='fast' is not valid; choose one of: default, reduce-overhead, max-autotune, "
         "max-autotune-no-cudagraphs"),
        (["trainer.compile_mode=reduce-overhead"], "trainer.compile_mode=reduce-overhead needs trainer.compile=true"),
        (["trainer.compile=true", "trainer.compile_scope=layers"],
         "trainer.compile_scope='layers' is not valid; choose one of: model, blocks"),
        (["trainer.compile_scope=blocks"], "trainer.compile_scope=blocks needs trainer.compile=true"),
        (["trainer.compile=true", "trainer.compile_mode=reduce-overhead", "trainer.grad_accum=2"],
         "captures CUDA graphs and cannot accumulate gradients over micro-batches (trainer.grad_accum=2); use "
         "trainer.grad_accum=1 or trainer.compile_mode=default"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            validate(compose_train(TINY_MODELS["deit"] + overrides))
        assert message in str(err.value), (overrides, str(err.value))


def test_compile_scope_may_change_on_resume(compose_train):
    """A compile scope does not enter the arithmetic (per block and one graph are bitwise eager
    under aot_eager): a run may resume with another one, and checkpoints written before the
    setting existed resume."""
    from mesa_train.train import checkpoint as ckpt_lib

    cfg = ckpt_lib.to_plain(compose_train(TINY_MODELS["deit"] + ["trainer.compile=true"]))
    blocks = ckpt_lib.to_plain(compose_train(TINY_MODELS["deit"] + ["trainer.compile=true",
                                                                    "trainer.compile_scope=blocks"]))
    old = {**cfg, "trainer": {k: v for k, v in cfg["trainer"].items() if k != "compile_scope"}}
    assert ckpt_lib.changed_settings(cfg, blocks) == []
    assert ckpt_lib.changed_settings(old, blocks) == []

