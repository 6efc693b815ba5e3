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
