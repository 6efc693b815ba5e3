"""timm's ViT ``Block`` whose LayerNorms share their 8-bit copy with the Linear after them
(``patch_model(norm_linear="shared")``, the default; mesa_train/nn/layernorm_linear.py,
patch/block.py ``MesaViTBlock``): ``norm1 -> attn.qkv`` and ``norm2 -> mlp.fc1``.

Checks: the forward is bitwise stock's (drop-path on, fp32 and CPU bf16 autocast; explicit
and fused attention); the saved bytes drop by exactly the two Linear copies per block;
gradients stay as close to exact as the separate layers' and the Linear's weight gradient
averages to exact over rounding seeds; the C++ node is bitwise the Python Function;
hooks that could read the arguments, ``norm_linear="separate"``, eval mode and a gated
attention run the stock lines; ``torch.compile(fullgraph=True)`` agrees with eager; the
option is validated in ``patch_model`` and the Hydra config; ``describe`` says where the
Linear's input is kept.
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers import Mlp
from timm.models.vision_transformer import Block

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import layernorm_linear as ll_mod
from mesa_train.patch import attention as attention_mod
from mesa_train.patch import mlp as mlp_mod
from mesa_train.patch import patch_model
from mesa_train.patch.block import MesaViTBlock
from mesa_train.patch.mlp import MesaMlp
from shared_copies import check_config_choice, cos, run_step

PATHS = ("explicit", "fused")


def _deit(drop_path_rate=0.1, **kw):
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10, drop_path_rate=drop_path_rate, **kw).train()


def _patch(model, path="explicit", **kw):
    return patch_model(model, attention=path, **kw)


def _images(b=4):
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _count_fused(monkeypatch):
    calls = []
    real = ll_mod.layernorm_linear

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(attention_mod, "layernorm_linear", counting)
    monkeypatch.setattr(mlp_mod, "layernorm_linear", counting)
    return calls


# ----------------------------------------------------------------------------- patching
def test_default_is_shared_and_separate_runs_the_stock_lines():
    shared = _patch(_deit())
    assert all(type(b) is MesaViTBlock and b.mesa_norm_shared for b in shared.blocks)
    assert all(type(b.mlp) is MesaMlp for b in shared.blocks)
    separate = _patch(_deit(), norm_linear="separate")
    assert all(type(b) is Block for b in separate.blocks)
    # patching again with "separate" turns an installed MesaViTBlock off
    _patch(shared, norm_linear="separate")
    assert all(type(b) is MesaViTBlock and not b.mesa_norm_shared for b in shared.blocks)


def test_mlp_separate_still_takes_the_norm():
    """mlp="separate" keeps GELU and fc2 apart; fc1 still shares norm2's copy (a MesaMlp that
    does not share its act's copy)."""
    model = _patch(_deit(), mlp="separate")
    assert all(type(b.mlp) is MesaMlp and not b.mlp.mesa_shared for b in model.blocks)


def test_only_with_layernorm_and_linear_ops():
    assert all(type(b) is Block for b in _patch(_deit(), ops=["linear", "softmax", "matmul"]).blocks)
    assert all(type(b) is Block for b in _patch(_deit(), ops=["layernorm", "gelu"]).blocks)
    assert all(type(b) is MesaViTBlock for b in _patch(_deit(), ops=["layernorm", "linear"]).blocks)
    # the MLP is not touched where the ffn set is not patched
    assert all(type(b.mlp) is Mlp for b in _patch(_deit(), modules=["msa"]).blocks)


def test_state_dict_keys_are_stock():
    stock = _deit()
    patched = _patch(copy.deepcopy(stock))
    assert set(patched.state_dict()) >= set(stock.state_dict())
    patched.load_state_dict(patched.state_dict())


def test_bad_choice_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown norm_linear 'both'; valid choices: shared, separate"):
        patch_model(_deit(), norm_linear="both")


# ----------------------------------------------------------------------------- forward and memory
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("path", PATHS)
def test_forward_bitwise_stock_with_drop_path(path, autocast, monkeypatch):
    stock = _deit()
    stock.blocks.apply(lambda m: setattr(m, "fused_attn", path == "fused") if hasattr(m, "fused_attn") else None)
    patched = _patch(copy.deepcopy(stock), path)
    calls = _count_fused(monkeypatch)
    x = _images()
    out_stock, _ = run_step(stock, x, autocast=autocast)
    out_mesa, _ = run_step(patched, x, autocast=autocast)
    assert [type(c) for c in calls] == [mnn.Linear] * 4  # qkv and fc1 of both blocks
    assert {id(c) for c in calls} == {id(m) for b in patched.blocks for m in (b.attn.qkv, b.mlp.fc1)}
    assert torch.equal(out_stock, out_mesa)


def test_saved_bytes_drop_by_the_linear_copies_exactly():
    x = _images()
    bytes_ = {}
    for mode in ("separate", "shared"):
        model = _patch(_deit(), norm_linear=mode)
        with SavedTensorMeter(model) as meter:
            model(x).sum().backward()
        bytes_[mode] = meter.activation_bytes
    rows, width, groups = 4 * (16 + 1), 192, 3  # batch x (patches + class token), width, heads
    # per pair: the Linear's uint8 codes, its (1, G) float32 alpha and beta, one int8 row
    # exponent per token; two pairs per block, two blocks
    assert bytes_["separate"] - bytes_["shared"] == 4 * (rows * width + 2 * 4 * groups + rows)


# ----------------------------------------------------------------------------- gradients
def test_gradients_as_close_to_exact_as_separate_layers():
    stock = _deit()
    x = _images()
    _, g_exact = run_step(copy.deepcopy(stock).double(), x.double())
    worst = {}
    for mode in ("separate", "shared"):
        _, g = run_step(_patch(copy.deepcopy(stock), norm_linear=mode), x)
        worst[mode] = min(cos(g[n], g_exact[n]) for n in g_exact if "blocks" in n)
    assert worst["shared"] >= 0.999, worst
    assert worst["shared"] >= worst["separate"] - 2e-4, worst


def _pair(gamma_spread: float):
    """A LayerNorm -> Linear pair in a block, norm weight spread over ``gamma_spread``."""
    torch.manual_seed(3)
    block = Block(32, num_heads=4).train()
    with torch.no_grad():
        block.norm2.weight.copy_(torch.logspace(0, gamma_spread, 32).flip(0) * torch.randn(32).sign())
        block.norm2.bias.normal_()
    x = torch.randn(8, 24, 32)
    g = torch.randn(8, 24, 32)
    return block, x, g


def _fc1_weight_grad(block, x, g):
    block.zero_grad(set_to_none=True)
    block(x).backward(g)
    return block.mlp.fc1.weight.grad.clone()


def test_linear_weight_gradient_averages_to_exact():
    """Unbiased: the mean over many rounding seeds is much closer to exact than one draw
    (a norm weight spread over two decades, so the rebuilt input's error varies by channel)."""
    block, x, g = _pair(gamma_spread=-2)
    exact = _fc1_weight_grad(copy.deepcopy(block).double(), x.double(), g.double()).float()
    shared = patch_model(torch.nn.Sequential(copy.deepcopy(block)))[0]
    assert type(shared) is MesaViTBlock
    draws = torch.stack([_fc1_weight_grad(shared, x, g) for _ in range(64)])
    one = (draws[0] - exact).norm()
    mean = (draws.mean(0) - exact).norm()
    assert cos(draws[0], exact) > 0.999
    assert mean < one / 4, (float(mean), float(one))


@pytest.mark.skipif(not ll_mod._OP, reason="needs the extension's mesa::layer_norm_linear_train")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("affine", ["affine", "no-bias"])
def test_cpp_node_bitwise_the_python_function(affine, autocast, monkeypatch):
    """Eager runs one C++ op with a C++ autograd node (csrc/layers_autograd.cpp,
    LayerNormLinearTrain); the Python Function (torch.compile, variants) must give the same
    bits, also for a norm without bias (apply's tracked-input indices shift)."""
    patched = _patch(_deit())
    if affine == "no-bias":
        for b in patched.blocks:
            b.norm1.bias = None
    twin = copy.deepcopy(patched)  # same weights and quantizer state (estimates, rounding counters)
    x = _images()
    out_cpp, g_cpp = run_step(patched, x, autocast=autocast)
    monkeypatch.setattr(ll_mod, "_OP", False)
    calls = []
    real = ll_mod._LayerNormLinearFn.apply
    monkeypatch.setattr(ll_mod._LayerNormLinearFn, "apply", lambda *a: calls.append(1) or real(*a))
    out_py, g_py = run_step(twin, x, autocast=autocast)
    assert len(calls) == 4
    assert torch.equal(out_cpp, out_py)
    assert g_cpp.keys() == g_py.keys() and all(torch.equal(g_cpp[n], g_py[n]) for n in g_cpp)


@pytest.mark.parametrize("frozen", ["norm", "linear", "input"])
def test_partly_frozen_gradients_match_the_separate_layers(frozen):
    """Only some inputs need a gradient: the ones that do get the same values as the
    separate layers' where those do not depend on the copy (the norm's and its input's)."""
    block = Block(32, num_heads=4).train()
    x = torch.randn(2, 6, 32, requires_grad=frozen != "input")
    grads = {}
    for mode in ("separate", "shared"):
        b = patch_model(torch.nn.Sequential(copy.deepcopy(block)), norm_linear=mode)[0]
        frozen_params = {"norm": [b.norm1.weight, b.norm1.bias], "linear": [b.attn.qkv.weight],
                         "input": []}[frozen]
        for p in frozen_params:
            p.requires_grad_(False)
        xi = x.detach().clone().requires_grad_(x.requires_grad)
        b(xi).square().sum().backward()
        grads[mode] = {n: p.grad for n, p in b.named_parameters() if p.requires_grad}
        if xi.requires_grad:
            grads[mode]["x"] = xi.grad
        assert all(p.grad is None for p in frozen_params)
    assert grads["shared"].keys() == grads["separate"].keys()
    for n in grads["shared"]:
        assert cos(grads["shared"][n], grads["separate"][n]) > 0.99, n


# ----------------------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("case", ["separate", "eval", "hook", "gate"])
def test_stock_lines_where_it_cannot_share(case, monkeypatch):
    block = Block(32, num_heads=4).train()
    if case == "gate":  # a gated attention: the gate reads the normalised input too
        block.attn = timm.layers.Attention(32, num_heads=4, gated=True)
    stock = torch.nn.Sequential(block).train()
    patched = patch_model(copy.deepcopy(stock), norm_linear="separate" if case == "separate" else "shared")
    seen = []
    if case == "eval":
        patched.eval()
        stock.eval()
    if case == "hook":  # a hook that reads the attention's input must see the normalised one
        patched[0].attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    calls = _count_fused(monkeypatch)
    x = torch.randn(2, 5, 32, requires_grad=True)
    out = patched(x)
    assert torch.equal(out, stock(x))
    if case != "eval":
        out.sum().backward()
    if case == "hook":
        assert torch.equal(seen[0], patched[0].norm1(x).detach())
        assert [type(c) for c in calls] == [mnn.Linear]  # the MLP side still shares
    elif case == "gate":
        assert [c is patched[0].mlp.fc1 for c in calls] == [True]
    else:
        assert calls == []


# ----------------------------------------------------------------------------- compile and config
def test_compiled_fullgraph_matches_eager():
    stock = _deit(drop_path_rate=0.0)
    x = _images()
    eager = _patch(copy.deepcopy(stock))
    compiled = torch.compile(_patch(copy.deepcopy(stock)), fullgraph=True, backend="aot_eager")
    out_e, g_e = run_step(eager, x)
    out_c, g_c = run_step(compiled, x)
    assert torch.allclose(out_e, out_c, rtol=1e-5, atol=1e-6)
    assert min(cos(g_c[n], g_e[n]) for n in g_e if "blocks" in n) > 0.999


def test_config_norm_linear_reaches_patch_model(compose_train):
    check_config_choice(compose_train, "norm_linear")


def test_describe_says_the_linear_shares_the_norm_copy():
    """qkv's and fc1's own quantizers never run: describe says where their input is kept
    instead of reporting them uninitialized after a training step; coverage counts the
    shared copies as compressed."""
    from mesa_train.patch import describe
    from mesa_train.patch.coverage import coverage

    model = _patch(_deit())
    model(_images(2))
    text = describe(model)
    lines = [line for line in text.splitlines() if line.lstrip().startswith("blocks.")
             and (".attn.qkv" in line or ".mlp.fc1" in line)]
    assert len(lines) == 4 and all("linear[norm-shared]" in line and "norm's copy" in line for line in lines)
    assert "uninitialized" not in text
    cov = coverage(_patch(_deit()), _images(2))
    assert not any(kind == "left as is" and what.startswith(("MesaViT", "MesaMlp")) for kind, what, *_ in cov.rows)
    separate = _patch(_deit(), norm_linear="separate")
    separate(_images(2))
    assert "norm-shared" not in describe(separate) and "uninitialized" not in describe(separate)


# ----------------------------------------------------------------------------- Swin and PVT-v2
def _hier(family):
    torch.manual_seed(0)
    if family == "swin":
        return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                                 depths=(1, 1), num_heads=(2, 4), embed_dim=32, num_classes=10,
                                 drop_path_rate=0.1).train()
    return timm.create_model("pvt_v2_b0", pretrained=False, depths=(1, 1, 1, 1), num_classes=10,
                             drop_path_rate=0.1).train()


@pytest.mark.parametrize("family", ["swin", "pvt"])
def test_swin_and_pvt_fc1_takes_norm2_copy(family, monkeypatch):
    """Their norm1 keeps its own copy (window partition / two consumers follow it); norm2 ->
    fc1 shares: forward bitwise stock's with drop-path, saved bytes down by exactly fc1's
    codes, statistics and row exponents per block."""
    stock = _hier(family)
    x = _images(2)
    fc1_inputs, bytes_ = [], {}
    for mode in ("separate", "shared"):
        model = patch_model(copy.deepcopy(stock), norm_linear=mode)
        if mode == "separate":
            for name, m in model.named_modules():
                if name.endswith("mlp.fc1"):
                    m.register_forward_pre_hook(lambda m, a: fc1_inputs.append(
                        (a[0].numel(), a[0].numel() // a[0].shape[-1], m.quantizer.options.num_groups)))
        else:
            calls = _count_fused(monkeypatch)
        torch.manual_seed(3)
        with SavedTensorMeter(model) as meter:
            out = model(x)
            out.sum().backward()
        bytes_[mode] = meter.activation_bytes
    torch.manual_seed(3)
    assert torch.equal(out, stock(x))
    assert len(calls) == len(fc1_inputs) == sum(1 for n, _ in stock.named_modules() if n.endswith("mlp.fc1"))
    assert bytes_["separate"] - bytes_["shared"] == sum(n + 2 * 4 * g + rows for n, rows, g in fc1_inputs)
