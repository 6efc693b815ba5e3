"""timm's ViT ``Block`` whose LayerNorms share their 8-bit copy with the Linear after them
(``patch_model(norm_linear="shared")``, the default; mesa_train/nn/layernorm_linear.py,
patch/block.py ``MesaViTBlock``): ``norm1 -> attn.qkv`` and ``norm2 -> mlp.fc1``; the blocks
of Swin, PVT-v2, BEiT, EVA, CaiT, XCiT and ConvNeXt: the norm before the MLP -> ``mlp.fc1``.

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
from mesa_train.nn import input_copy
from mesa_train.nn import layernorm_linear as ll_mod
from mesa_train.patch import attention as attention_mod
from mesa_train.patch import mlp as mlp_mod
from mesa_train.patch import patch_model
from mesa_train.patch.block import MesaViTBlock
from mesa_train.patch.mlp import MesaMlp
from op_calls import count_calls
from shared_copies import (assert_shared_as_close_as_separate, check_config_choice, cos, run_step,
                           worst_cosines_by_mode)

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
    """The Linears run with their norm as one Function, in call order."""
    calls = []
    real, real_many = ll_mod.layernorm_linear, ll_mod.layernorm_linears

    def counting(x, norm, fc):
        calls.append(fc)
        return real(x, norm, fc)

    def counting_many(x, norm, fcs):
        calls.extend(fcs)
        return real_many(x, norm, fcs)

    monkeypatch.setattr(attention_mod, "layernorm_linear", counting)
    monkeypatch.setattr(mlp_mod, "layernorm_linear", counting)  # an MLP's own norm -> fc2
    monkeypatch.setattr(mlp_mod, "layernorm_linears", counting_many)
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
    worst = worst_cosines_by_mode(_deit(), _images(), lambda m, mode: _patch(m, norm_linear=mode), "blocks")
    assert_shared_as_close_as_separate(worst)


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
@pytest.mark.parametrize("options", [{}, dict(bits=4), dict(bits=2, scale="pow2")], ids=str)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("affine", ["affine", "no-bias"])
def test_cpp_node_bitwise_the_python_function(affine, autocast, options, monkeypatch):
    """Eager runs one C++ op with a C++ autograd node (csrc/layers_autograd.cpp,
    LayerNormLinearTrain), also for the variant formats (packed codes, a float16 rstd at 4 and
    2 bits, the Linear's input rebuilt by ops); the Python Function (torch.compile, learned
    thresholds) must give the same bits, also for a norm without bias (apply's tracked-input
    indices shift)."""
    patched = _patch(_deit(), **options)
    if affine == "no-bias":
        for b in patched.blocks:
            b.norm1.bias = None
    twin = copy.deepcopy(patched)  # same weights and quantizer state (estimates, rounding counters)
    x = _images()
    op_calls = count_calls(monkeypatch, "layer_norm_linear_train")
    out_cpp, g_cpp = run_step(patched, x, autocast=autocast)
    assert len(op_calls) == 4
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


# ----------------------------------------------------------------------------- other families
# one small model per block class of patch/block.py and patch/convnext.py whose MLP half shares
# norm2's copy (the EVA block with each of its MLPs: DINOv3's plain Mlp, EVA-02's GluMlp and,
# with scale_mlp, its SwiGLU whose fc1_g and fc1_x both take the copy; ConvNeXt with Linear
# MLPs, conv_mlp=False)
FAMILIES = {
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(2, 4),
                                                  embed_dim=32)),
    "pvt": ("pvt_v2_b0", dict(depths=(1, 1, 1, 1))),
    "beit": ("beit_base_patch16_224", dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)),
    "eva": ("vit_small_patch16_dinov3", dict(img_size=32, patch_size=8, depth=2)),
    "eva-glu": ("eva02_tiny_patch14_224", dict(img_size=32, patch_size=8, depth=2)),  # GluMlp: one packed fc1
    "eva-swiglu": ("eva02_tiny_patch14_224", dict(img_size=32, patch_size=8, depth=2, scale_mlp=True)),  # fc1_g, fc1_x
    "cait": ("cait_xxs24_224", dict(img_size=32, patch_size=8, depth=2, depth_token_only=1)),
    "xcit": ("xcit_nano_12_p16_224", dict(img_size=32, depth=2)),
    "convnext": ("convnext_atto", dict(conv_mlp=False, depths=(1, 1, 1, 1))),
    "convnext-v2": ("convnextv2_atto", dict(conv_mlp=False, depths=(1, 1, 1, 1))),  # GlobalResponseNormMlp
    # an Mlp with a norm of its own before fc2 (scale_mlp_norm): that norm shares with fc2 too
    "vit-mlp-norm": ("deit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, scale_mlp_norm=True)),
}


def _family(family):
    name, kw = FAMILIES[family]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.1, **kw).train()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_blocks_fc1_takes_the_mlp_norm_copy(family, monkeypatch):
    """Their first norm keeps its own copy (window partition, two consumers, or an attention
    reached generically follows it); the norm before the MLP shares with fc1 (and an MLP's own
    norm with fc2): forward bitwise stock's with drop-path (and the blocks' inline layer
    scales routed), every such Linear fused, saved bytes down by exactly its codes, statistics
    and row exponents."""
    from mesa_train.patch.block import norm_fed_ids

    stock = _family(family)
    x = _images(2)
    shared = patch_model(copy.deepcopy(stock), norm_linear="shared")
    separate = patch_model(copy.deepcopy(stock), norm_linear="separate")
    fed = {name for name, m in shared.named_modules() if id(m) in norm_fed_ids(shared)}
    assert fed and all(name.endswith(("mlp.fc1", "mlp.fc1_g", "mlp.fc1_x", "mlp.fc2", "attn.qkv")) for name in fed)
    assert any(name.endswith("mlp.fc2") for name in fed) == (family in ("eva-swiglu", "vit-mlp-norm"))
    assert not norm_fed_ids(separate)
    fc1_inputs = []
    for name, m in separate.named_modules():
        if name in fed:
            m.register_forward_pre_hook(lambda m, a: fc1_inputs.append(
                (a[0].numel(), a[0].numel() // a[0].shape[-1], m.quantizer.options.num_groups)))
    bytes_ = {}
    for mode, model in (("separate", separate), ("shared", shared)):
        if mode == "shared":
            calls = _count_fused(monkeypatch)
        torch.manual_seed(3)
        # (separate: each fc1 its own copy; SwiGLU's fc1_g and fc1_x, given one tensor, would
        # otherwise keep one between them, nn/input_copy.py)
        with SavedTensorMeter(model) as meter, input_copy.disabled():
            out = model(x)
            out.sum().backward()
        bytes_[mode] = meter.activation_bytes
    torch.manual_seed(3)
    assert torch.equal(out, stock(x))
    assert len(calls) == len(fc1_inputs) == len(fed)
    assert bytes_["separate"] - bytes_["shared"] == sum(n + 2 * 4 * g + rows for n, rows, g in fc1_inputs)


@pytest.mark.parametrize("family", ["beit", "convnext", "eva-swiglu"])
def test_other_blocks_compile_fullgraph(family):
    """A block reached through the generic capture (BEiT: its attention and inline layer
    scales), ConvNeXt's (permuted tokens) and a SwiGLU's two Linears on one copy: one graph,
    gradients as eager's."""
    stock = _family(family)
    stock.drop_path_rate = 0.0
    for m in stock.modules():
        if type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    x = _images(2)
    eager = patch_model(copy.deepcopy(stock))
    compiled = torch.compile(patch_model(copy.deepcopy(stock)), fullgraph=True, backend="aot_eager")
    out_e, g_e = run_step(eager, x)
    out_c, g_c = run_step(compiled, x)
    assert torch.allclose(out_e, out_c, rtol=1e-5, atol=1e-6)
    assert min(cos(g_c[n], g_e[n]) for n in g_e if "mlp.fc1" in n or "norm" in n) > 0.999


def test_convnext_layer_scale_and_norm_share_either_order():
    """ConvNeXt's block swap serves two steps (layer scale, norm sharing): with either alone,
    both, or ``separate``, the block is the Mesa one only where asked, and re-patching adds
    what is new without a second scale child."""
    from mesa_train.patch.convnext import SCALE_CHILD, MesaConvNeXtBlock

    def blocks(model):
        return [m for m in model.modules() if isinstance(m, timm.models.convnext.ConvNeXtBlock)]

    sep = patch_model(_family("convnext"), norm_linear="separate")
    assert all(type(b) is MesaConvNeXtBlock and not b.mesa_norm_shared and SCALE_CHILD in b._modules
               for b in blocks(sep))
    norm_only = patch_model(_family("convnext"), ops=["layernorm", "linear"])
    assert all(b.mesa_norm_shared and SCALE_CHILD not in b._modules for b in blocks(norm_only))
    patch_model(norm_only, ops=["all"])
    assert all(b.mesa_norm_shared and list(b._modules).count(SCALE_CHILD) == 1 for b in blocks(norm_only))
    scale_only = patch_model(_family("convnext"), ops=["layerscale"])
    assert all(type(b) is MesaConvNeXtBlock and not b.mesa_norm_shared for b in blocks(scale_only))
    patch_model(scale_only, ops=["all"])
    assert all(b.mesa_norm_shared and list(b._modules).count(SCALE_CHILD) == 1 for b in blocks(scale_only))
    stock = _family("convnext")
    x = _images(2)
    torch.manual_seed(3)
    out = norm_only(x)
    torch.manual_seed(3)
    assert torch.equal(out, stock(x))


# ----------------------------------------------------------------------------- SwiGLU: one copy for three
def test_swiglu_gradients_as_close_to_exact_as_separate_layers():
    """EVA-02's SwiGLU (``fc1_g``, ``fc1_x``) takes norm2's copy for both weight gradients; its
    input gradient is the sum of both Linears' (as autograd adds them): every block gradient
    as close to float64 stock's as the separate layers' (three copies)."""
    stock = _family("eva-swiglu")
    for m in stock.modules():
        if type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    worst = worst_cosines_by_mode(stock, _images(), lambda m, mode: patch_model(m, norm_linear=mode), "blocks")
    assert_shared_as_close_as_separate(worst)


@pytest.mark.parametrize("frozen", ["fc1_g.weight", "fc1_x.bias", "norm2.weight", "fc1_g.weight+fc1_x.weight"])
def test_swiglu_partly_frozen_leaves_the_other_gradients_bitwise(frozen):
    """Each Linear's parameters are their own inputs of the shared Function: freezing any of
    them (or the norm's weight) drops exactly that gradient and changes no other bit."""
    model = patch_model(_family("eva-swiglu"))
    x = _images()
    twin = copy.deepcopy(model)
    _, g_all = run_step(model, x)
    suffixes = tuple("." + f for f in frozen.split("+"))
    for n, p in twin.named_parameters():
        if n.endswith(suffixes):
            p.requires_grad_(False)
    _, g_part = run_step(twin, x)
    dropped = set(g_all) - set(g_part)
    assert dropped and all(n.endswith(suffixes) for n in dropped)
    assert all(torch.equal(g_part[n], g_all[n]) for n in g_part)
