"""timm ``Mlp`` and PVT-v2's ``MlpWithDepthwiseConv`` with one 8-bit copy for GELU and fc2
(``patch_model(mlp="shared")``, the default; mesa_train/nn/gelu_linear.py, patch/mlp.py
``MesaMlp``, ``MesaMlpWithDepthwiseConv``: there the copy is of the depthwise conv's
output, a transposed, non-contiguous view).

Checks: the forward is bitwise stock's (drop-path on, fp32 and CPU bf16 autocast); the
saved bytes drop by exactly fc2's codes and statistics; gradients stay as close to exact as
the separate layers' (and fc2's weight gradient is unbiased up to gelu's curvature term:
averages over rounding seeds converge); rows far below the others keep their fc2 gradient
(row scales); anything between act and fc2 (dropout mask, norm), another act, or
``mlp="separate"`` runs the separate layers; ``torch.compile(fullgraph=True)`` agrees with
eager; the option is validated in ``patch_model`` and the Hydra config.
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers import Mlp

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import gelu_linear as gelu_linear_mod
from mesa_train.patch import patch_model
from mesa_train.patch import mlp as mlp_mod
from mesa_train.patch.mlp import MesaMlp, MesaMlpWithDepthwiseConv
from op_calls import count_calls
from shared_copies import (assert_shared_as_close_as_separate, check_config_choice, cos, run_step,
                           worst_cosines_by_mode)

FAMILIES = ("deit", "pvt")


def _deit(drop_rate=0.0, drop_path_rate=0.1):
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10, drop_rate=drop_rate, drop_path_rate=drop_path_rate).train()


def _model(family, drop_path_rate=0.1):
    """A 2-MLP DeiT-tiny, or a PVT-v2-b0 with one block per stage (4 MLPs: fc1, depthwise
    conv, GELU, fc2) at 32x32."""
    if family == "deit":
        return _deit(drop_path_rate=drop_path_rate)
    torch.manual_seed(0)
    return timm.create_model("pvt_v2_b0", pretrained=False, depths=(1, 1, 1, 1), num_classes=10,
                             drop_path_rate=drop_path_rate).train()


def _mlps(model):
    return [m for m in model.modules() if type(m) in (MesaMlp, MesaMlpWithDepthwiseConv)]


def _images(b=4):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _count_fused(monkeypatch):
    calls = []
    real = mlp_mod.gelu_linear

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(mlp_mod, "gelu_linear", counting)
    return calls


# ----------------------------------------------------------------------------- patching
def test_default_is_shared_and_separate_keeps_timm_mlp():
    shared = patch_model(_deit())
    assert all(type(b.mlp) is MesaMlp and b.mlp.mesa_shared for b in shared.blocks)
    assert isinstance(shared.blocks[0].mlp.act, mnn.GELU) and isinstance(shared.blocks[0].mlp.fc2, mnn.Linear)
    separate = patch_model(_deit(), mlp="separate", norm_linear="separate")
    assert all(type(b.mlp) is Mlp for b in separate.blocks)
    # (with norm_linear="shared" the MLP takes norm2's copy: a MesaMlp that does not share
    # its act's, tests/test_norm_shared.py)
    assert all(type(b.mlp) is MesaMlp and not b.mlp.mesa_shared
               for b in patch_model(_deit(), mlp="separate").blocks)
    # patching again with "separate" turns an installed MesaMlp off
    patch_model(shared, mlp="separate")
    assert all(type(b.mlp) is MesaMlp and not b.mlp.mesa_shared for b in shared.blocks)


def test_state_dict_keys_are_stock():
    stock = _deit()
    assert set(patch_model(copy.deepcopy(stock)).state_dict()) >= set(stock.state_dict())
    patched = patch_model(copy.deepcopy(stock))
    patched.load_state_dict(patched.state_dict())  # strict round trip


def test_bad_choice_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown mlp 'both'; valid choices: shared, separate"):
        patch_model(_deit(), mlp="both")


def test_only_with_gelu_and_linear_ops():
    assert all(type(b.mlp) is Mlp for b in patch_model(_deit(), ops=["gelu"]).blocks)
    assert all(type(b.mlp) is Mlp for b in patch_model(_deit(), ops=["linear", "softmax"]).blocks)
    assert all(type(b.mlp) is MesaMlp for b in patch_model(_deit(), ops=["gelu", "linear"]).blocks)
    assert all(type(b.mlp) is Mlp for b in patch_model(_deit(), modules=["msa"]).blocks)


def test_quick_gelu_mlp_is_not_swapped():
    torch.manual_seed(0)
    mlp = Mlp(16, 32, act_layer=timm.layers.QuickGELU)
    holder = torch.nn.Sequential(mlp)
    patch_model(holder)
    assert type(holder[0]) is Mlp


# ----------------------------------------------------------------------------- forward and memory
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_bitwise_stock_with_drop_path(family, autocast, monkeypatch):
    stock = _model(family)
    patched = patch_model(copy.deepcopy(stock))
    calls = _count_fused(monkeypatch)
    x = _images()
    out_stock, _ = run_step(stock, x, autocast=autocast)
    out_mesa, _ = run_step(patched, x, autocast=autocast)
    assert len(calls) == len(_mlps(patched)) > 0  # every MLP ran fused
    assert torch.equal(out_stock, out_mesa)


def test_saved_bytes_drop_by_fc2_codes_exactly():
    x = _images()
    bytes_ = {}
    for mode in ("separate", "shared"):
        model = patch_model(_deit(), mlp=mode)
        with SavedTensorMeter(model) as meter:
            model(x).sum().backward()
        bytes_[mode] = meter.activation_bytes
    tokens, hidden, groups = 4 * (16 + 1), 4 * 192, 3  # batch x (patches + class token), mlp width, heads
    # per block: fc2's uint8 codes of gelu(h) and its (1, G) float32 alpha and beta
    assert bytes_["separate"] - bytes_["shared"] == 2 * (tokens * hidden + 2 * 4 * groups)


def test_pvt_saved_bytes_drop_by_fc2_codes_exactly():
    """PVT-v2: per stage, fc2's uint8 codes of gelu(dwconv(...)) (batch x tokens x hidden) and
    its (1, G) float32 alpha and beta, G = the stage's heads (capped at the width)."""
    x = _images()
    bytes_, fc2_inputs = {}, []
    for mode in ("separate", "shared"):
        model = patch_model(_model("pvt"), mlp=mode)
        if mode == "separate":
            for stage in model.stages:
                stage.blocks[0].mlp.fc2.register_forward_pre_hook(lambda m, a: fc2_inputs.append(
                    (a[0].numel(), m.quantizer.options.num_groups)))
        with SavedTensorMeter(model) as meter:
            model(x).sum().backward()
        bytes_[mode] = meter.activation_bytes
    assert [n for n, _ in fc2_inputs] == [4 * 64 * 256, 4 * 16 * 512, 4 * 4 * 640, 4 * 1 * 1024]  # b x tokens x hidden
    assert bytes_["separate"] - bytes_["shared"] == sum(n + 2 * 4 * g for n, g in fc2_inputs)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_as_close_to_exact_as_separate_layers(family):
    worst = worst_cosines_by_mode(_model(family), _images(), lambda m, mode: patch_model(m, mlp=mode), "mlp")
    assert_shared_as_close_as_separate(worst)


def _mlp_case(tiny_row: bool):
    torch.manual_seed(3)
    mlp = Mlp(32, 128, out_features=16)
    torch.nn.init.zeros_(mlp.fc1.bias)  # (timm's init): a tiny input row gives a tiny h row
    h_in = torch.randn(8, 24, 32)
    if tiny_row:  # DeiT3's class token: one row ~1e-4 of the others, carrying the loss
        h_in[:, 0] *= 1e-4
    g_out = torch.zeros(8, 24, 16)
    g_out[:, 0 if tiny_row else slice(None)] = torch.randn(8, 24, 16)[:, 0 if tiny_row else slice(None)]
    return mlp, h_in, g_out


def _fc2_weight_grad(mlp, x, g):
    mlp.zero_grad(set_to_none=True)
    mlp(x).backward(g)
    return mlp.fc2.weight.grad.clone()


def test_fc2_weight_gradient_of_a_tiny_row_is_kept():
    mlp, x, g = _mlp_case(tiny_row=True)
    exact = _fc2_weight_grad(copy.deepcopy(mlp).double(), x.double(), g.double())
    shared = patch_model(torch.nn.Sequential(copy.deepcopy(mlp)))[0]
    assert type(shared) is MesaMlp
    assert cos(_fc2_weight_grad(shared, x, g), exact) > 0.999
    # without row scales the same row is rounding noise: the check above can fail
    no_rows = patch_model(torch.nn.Sequential(copy.deepcopy(mlp)), row_scale=False)[0]
    assert cos(_fc2_weight_grad(no_rows, x, g), exact) < 0.9


def test_fc2_weight_gradient_averages_to_exact():
    """Unbiased up to gelu's curvature term (nn/gelu_linear.py): the mean over many rounding
    seeds is much closer to exact than one draw."""
    mlp, x, g = _mlp_case(tiny_row=False)
    exact = _fc2_weight_grad(copy.deepcopy(mlp).double(), x.double(), g.double()).float()
    shared = patch_model(torch.nn.Sequential(copy.deepcopy(mlp)))[0]
    draws = torch.stack([_fc2_weight_grad(shared, x, g) for _ in range(64)])
    one = (draws[0] - exact).norm()
    mean = (draws.mean(0) - exact).norm()
    assert mean < one / 4, (float(mean), float(one))


@pytest.mark.skipif(not gelu_linear_mod._OP, reason="needs the extension's mesa::gelu_linear_train")
@pytest.mark.parametrize("options", [{}, dict(bits=4), dict(bits=2, scale="pow2")], ids=str)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_node_bitwise_the_python_function(family, autocast, options, monkeypatch):
    """Eager runs one C++ op with a C++ autograd node (csrc/layers_autograd.cpp,
    GeluLinearTrain), also for the variant formats (h's packed codes dequantized once in
    backward); the Python Function (torch.compile, learned thresholds) must give the same bits
    (PVT-v2: on a transposed, non-contiguous h)."""
    patched = patch_model(_model(family), **options)
    twin = copy.deepcopy(patched)  # same weights and quantizer state (estimates, rounding counters)
    x = _images()
    op_calls = count_calls(monkeypatch, "gelu_linear_train")
    out_cpp, g_cpp = run_step(patched, x, autocast=autocast)
    assert len(op_calls) == len(_mlps(patched))
    monkeypatch.setattr(gelu_linear_mod, "_OP", False)
    calls = []
    real = gelu_linear_mod._GeluLinearFn.apply
    monkeypatch.setattr(gelu_linear_mod._GeluLinearFn, "apply", lambda *a: calls.append(1) or real(*a))
    out_py, g_py = run_step(twin, x, autocast=autocast)
    assert len(calls) == len(_mlps(twin))
    assert torch.equal(out_cpp, out_py)
    assert g_cpp.keys() == g_py.keys() and all(torch.equal(g_cpp[n], g_py[n]) for n in g_cpp)


# ----------------------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("case", ["dropout", "norm", "separate", "eval"])
def test_anything_between_runs_separate_layers(case, monkeypatch):
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm if case == "norm" else None
    mlp = Mlp(16, 64, drop=0.1 if case == "dropout" else 0.0, norm_layer=norm)
    stock = torch.nn.Sequential(mlp).train()
    patched = patch_model(copy.deepcopy(stock), mlp="separate" if case == "separate" else "shared")
    if case == "eval":
        patched.eval()
        stock.eval()
    calls = _count_fused(monkeypatch)
    x = torch.randn(2, 5, 16, requires_grad=True)
    torch.manual_seed(1)
    out = patched(x)
    torch.manual_seed(1)
    assert torch.equal(out, stock(x))
    out.sum().backward()
    assert calls == []


# ----------------------------------------------------------------------------- compile and config
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_fullgraph_matches_eager(family):
    stock = _model(family, drop_path_rate=0.0)
    x = _images()
    eager = patch_model(copy.deepcopy(stock))
    compiled_model = patch_model(copy.deepcopy(stock))
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    out_e, g_e = run_step(eager, x)
    out_c, g_c = run_step(compiled, x)
    assert torch.allclose(out_e, out_c, rtol=1e-5, atol=1e-6)
    assert min(cos(g_c[n], g_e[n]) for n in g_e if "mlp" in n) > 0.999


def test_config_mlp_reaches_patch_model(compose_train):
    check_config_choice(compose_train, "mlp")


@pytest.mark.parametrize("family", FAMILIES)
def test_describe_counts_the_shared_copy_as_compressed(family):
    from mesa_train.patch.coverage import coverage

    cov = coverage(patch_model(_model(family)), _images(2))
    kinds = {(r[0], r[1]): r[3] for r in cov.rows}
    assert kinds.get(("compressed", "shared copies (mlp)"), 0) > 0
    assert not any(kind == "left as is" and what.startswith("MesaMlp") for kind, what in kinds)


def test_describe_says_fc2_shares_the_act_copy():
    """fc2's own quantizer never runs in a shared MLP: describe says where its input is kept
    instead of reporting it uninitialized after a training step."""
    from mesa_train.patch import describe

    model = patch_model(_model("pvt"))
    model(_images(2))
    text = describe(model)
    fc2 = [line for line in text.splitlines() if ".mlp.fc2" in line]
    assert len(fc2) == 4 and all("linear[mlp-shared]" in line and "act's copy" in line for line in fc2)
    assert "uninitialized" not in text
    separate = patch_model(_model("pvt"), mlp="separate")
    separate(_images(2))
    assert "mlp-shared" not in describe(separate) and "uninitialized" not in describe(separate)
