"""patch_model on tiny timm DeiT, Swin and PVT-v2: exact forward, close gradients."""
import copy

import pytest
import torch
import torch.nn.functional as F

from mesa_train.patch import describe, patch_model

from test_patch_helpers import build, grads, inputs, loss_of

MODELS = ("deit", "swin", "pvt")
# op sets; fused=True: the attention keeps F.scaled_dot_product_attention (compare with the
# stock fused path), else the explicit path (compare with the stock explicit path)
OP_SETS = {
    "linear": (("linear",), False),
    "matmul": (("matmul",), False),
    "softmax": (("softmax",), False),
    "gelu": (("gelu",), False),
    "layernorm": (("layernorm",), False),
    "conv": (("conv",), False),
    "sdpa": (("sdpa",), True),
    "fused_all": (("linear", "gelu", "layernorm", "conv", "relu", "sdpa"), True),
    "all": (("all",), False),
}


def _pair(name, ops, fused, modules=("all",), **opts):
    stock = build(name, fused=fused)
    patched = patch_model(copy.deepcopy(stock), ops=ops, modules=modules, **opts)
    return stock, patched


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss_of(out).backward()
    return out.detach(), grads(model)


def _cosines(g_ref, g):
    assert g_ref.keys() == g.keys()
    return {n: F.cosine_similarity(g_ref[n].double().flatten(), g[n].double().flatten(), 0).item()
            for n in g_ref}


@pytest.mark.parametrize("op_set", list(OP_SETS))
@pytest.mark.parametrize("name", MODELS)
def test_forward_bitwise_and_grads_close(name, op_set):
    ops, fused = OP_SETS[op_set]
    stock, patched = _pair(name, ops, fused)
    x = inputs(name)
    ref_out, ref_g = _step(stock, x)
    out, g = _step(patched, x)
    assert torch.equal(out, ref_out), f"{name}/{op_set}: forward differs from stock"
    cos = _cosines(ref_g, g)
    bad = {n: c for n, c in cos.items() if c < 0.99}  # every parameter, no exceptions
    assert not bad, f"{name}/{op_set}: gradient cosine below threshold: {bad}"


@pytest.mark.parametrize("modules", [("msa",), ("ffn",), ("other",), ("msa", "ffn")])
@pytest.mark.parametrize("name", MODELS)
def test_module_sets_forward_bitwise(name, modules):
    stock, patched = _pair(name, ("all",), False, modules=modules)
    x = inputs(name)
    assert torch.equal(stock(x), patched(x))


@pytest.mark.parametrize("name", MODELS)
def test_disabled_is_stock(name):
    stock, patched = _pair(name, ("all",), False, enabled=False)
    x = inputs(name)
    ref_out, ref_g = _step(stock, x)
    out, g = _step(patched, x)
    assert torch.equal(out, ref_out)
    for n in ref_g:
        assert torch.equal(ref_g[n], g[n]), n
    # fused path too
    stock, patched = _pair(name, ("linear", "gelu", "layernorm", "conv", "sdpa"), True, enabled=False)
    ref_out, ref_g = _step(stock, x)
    out, g = _step(patched, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(ref_g[n], g[n]) for n in ref_g)


@pytest.mark.parametrize("name", MODELS)
def test_eval_is_stock_and_estimates_untouched(name):
    stock, patched = _pair(name, ("all",), False)
    stock.eval(), patched.eval()
    x = inputs(name)
    with torch.no_grad():
        assert torch.equal(stock(x), patched(x))
    assert "uninitialized" in describe(patched) and " initialized" not in describe(patched).replace("uninitialized", "")


def test_structure_of_patched_models():
    _, deit = _pair("deit", ("all",), False)
    attn = deit.blocks[0].attn
    assert type(attn).__name__ == "MesaViTAttention" and attn.mesa_attn_path == "explicit"
    assert type(attn.qk_matmul).__name__ == "MatMul" and type(attn.softmax).__name__ == "Softmax"
    assert attn.qk_matmul.quantizer_a.options.num_groups == 3  # per head
    assert deit.blocks[0].mlp.fc1.quantizer.options.num_groups == 3  # channel groups = heads
    assert deit.patch_embed.proj.quantizer.options.num_groups == 3  # capped at 3 RGB channels

    _, swin = _pair("swin", ("all",), False)
    assert swin.layers[1].blocks[1].attn.qk_matmul.quantizer_a.options.num_groups == 4
    assert swin.layers[1].downsample.reduction.quantizer.options.num_groups == 4  # stage 1 heads
    assert swin.layers[0].blocks[1].attn.softmax.dim == -1

    _, pvt = _pair("pvt", ("all",), False)
    a0 = pvt.stages[0].blocks[0].attn
    assert type(a0.sr).__name__ == "Conv2d" and type(a0.norm).__name__ == "LayerNorm"  # MSA set
    assert type(pvt.stages[0].blocks[0].mlp.dwconv).__name__ == "Conv2d"  # FFN set

    _, fused = _pair("deit", ("sdpa",), True)
    a = fused.blocks[0].attn
    assert a.mesa_attn_path == "fused" and type(a.sdpa).__name__ == "ScaledDotProductAttention"
    assert type(fused.blocks[0].attn.qkv).__name__ == "Linear" and not hasattr(fused.blocks[0].attn.qkv, "quantizer")


def test_layernorm_low_variance_rows():
    """Regression: DeiT's class-token row before the first attention is ``cls_token +
    pos_embed[0]`` (std ~0.03 at init vs ~0.6 for patch rows) and receives most of the
    head's gradient. When LayerNorm kept its 8-bit *input* and rebuilt ``(x - mean) *
    rstd`` in backward, that row's rounding error was multiplied by its large rstd: the
    ``blocks.0.norm1/norm2.weight`` gradients reached only cosine ~0.97 here (0.88 on the
    full-size DeiT-Ti). LayerNorm now keeps the 8-bit normalised values (DESIGN.md), every
    row uses the grid equally well, and every LayerNorm weight is >= 0.999 (measured 0.9999)."""
    stock, patched = _pair("deit", ("layernorm",), False)
    x = inputs("deit")
    _, ref_g = _step(stock, x)
    _, g = _step(patched, x)
    cos = _cosines(ref_g, g)
    ln = {n: c for n, c in cos.items() if ".norm" in n or n.startswith("norm.")}
    assert "blocks.0.norm1.weight" in ln and "blocks.0.norm2.weight" in ln
    worst = min(ln, key=ln.get)
    print(f"\nDeiT layernorm-only: worst LayerNorm gradient cosine {worst} = {ln[worst]:.5f}")
    assert ln[worst] >= 0.999, ln


def test_pvt_linear_variant_with_relu():
    stock, patched = _pair("pvt_li", ("all",), False)
    assert type(patched.stages[0].blocks[0].mlp.relu).__name__ == "ReLU"
    assert hasattr(patched.stages[0].blocks[0].mlp.relu, "quantizers")  # the Mesa ReLU
    assert type(patched.stages[0].blocks[0].attn.act).__name__ == "GELU"
    x = inputs("pvt_li")
    ref_out, ref_g = _step(stock, x)
    out, g = _step(patched, x)
    assert torch.equal(out, ref_out)
    cos = _cosines(ref_g, g)
    assert min(cos.values()) >= 0.99, min(cos.items(), key=lambda kv: kv[1])
