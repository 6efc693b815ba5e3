"""scripts/layer_path_survey.py: the count of a patched model's Mesa nodes by path (C++ layer op or
Python Function), from its backward graph."""
from __future__ import annotations

import pytest

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

from conftest import load_script
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")


def test_survey_counts_each_path_and_follows_the_switch(monkeypatch):
    """Hiera: every Mesa node on a C++ op since session 58 (its Amax calls counted one by one);
    with the C++ layer ops switched off every node is a Python Function, as many of each layer.
    FastViT: every node on a C++ op since session 59 (its linked scale-branch conv + BatchNorm
    pairs too), and a mixed model once one such BatchNorm takes learned thresholds (that pair
    runs Python Functions), both sides counted."""
    survey = load_script("layer_path_survey")
    model = patch_model(build("hiera_tiny_224"))
    amax_calls = []  # one autograd node per call of a Mesa Amax (Hiera's pooling)
    for layer in (m for m in model.modules() if isinstance(m, mnn.Amax)):
        layer.register_forward_pre_hook(lambda *_: amax_calls.append(1))
    found = survey.mesa_nodes(model, example("hiera_tiny_224"))
    assert amax_calls and found["C++"]["AmaxTrain"] == len(amax_calls) and not found["Python"]
    assert found["C++"]["LinearTrain"] > 0 and "LayerNormTrain" in found["C++"]
    fastvit = patch_model(build("fastvit_t8"))
    all_ops = survey.mesa_nodes(fastvit, example("fastvit_t8"))
    assert all_ops["C++"]["Conv2dTrain"] > 0 and all_ops["C++"]["BatchNormTrain"] > 0 and not all_ops["Python"]
    linked_bn = next(m.__dict__["_mesa_scale_bn"] for m in fastvit.modules() if "_mesa_scale_bn" in m.__dict__)
    linked_bn.set_quant_options(estimator="learned")
    mixed = survey.mesa_nodes(fastvit, example("fastvit_t8"))
    assert dict(mixed["Python"]) == {"Conv2dFn": 1, "BatchNormFn": 1}
    assert mixed["C++"]["Conv2dTrain"] == all_ops["C++"]["Conv2dTrain"] - 1
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    amax_calls.clear()
    off = survey.mesa_nodes(model, example("hiera_tiny_224"))
    assert not off["C++"] and off["Python"]["AmaxFn"] == len(amax_calls)
    for layer in ("Linear", "LayerNorm", "GeluLinear", "Conv2d", "Amax"):  # one node a call, either path
        assert off["Python"][f"{layer}Fn"] == found["C++"][f"{layer}Train"] > 0, layer


def test_survey_names_an_unknown_model_in_one_line(capsys):
    survey = load_script("layer_path_survey")
    with pytest.raises(SystemExit, match=r"error: no_such_model: Unknown model"):
        survey.main(["no_such_model"])
