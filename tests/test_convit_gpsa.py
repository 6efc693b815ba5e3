"""ConViT's gated positional self-attention (timm's ``GPSA``) by class swap (patch/convit.py):
the swapped forward is timm's source but the core, the train forward stays bitwise stock's
with dropout and drop-path on, gradients close to float64 autograd of the stock lines, and the
four full-precision maps and the expanded position table stock keeps are gone. Before, the
generic routing left the positional softmax, the gate and the renormalisation stock: GPSA kept
0.49x of convit_tiny's stock bytes at 224 px."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from timm.models.convit import GPSA
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.gated_softmax import gated_positional_softmax
from mesa_train.nn.quantizer import assign_rng_keys
from mesa_train.patch import patch_model
from mesa_train.patch.convit import SWAPPABLE, MesaGPSA
from mesa_train.patch.describe import describe_rows

from source_lines import code_lines
from timm_zoo import build, example

# stock line -> Mesa line
SWAPS = {"x = (attn @ v).transpose(1, 2).reshape(B, N, C)":
         "x = self.mesa_av(attn, v).transpose(1, 2).reshape(B, N, C)"}
QK = ("patch_score = (q @ k.transpose(-2, -1)) * self.scale",
      "patch_score = self.mesa_qk(q, k.transpose(-2, -1)) * self.scale")
# the stock lines mesa_gated_softmax computes around q @ k^T (nn/gated_softmax.py follows them op for op)
POSITIONAL = ["pos_score = self.rel_indices.expand(B, -1, -1, -1)",
              "pos_score = self.pos_proj(pos_score).permute(0, 3, 1, 2)"]
GATE = ["patch_score = patch_score.softmax(dim=-1)", "pos_score = pos_score.softmax(dim=-1)",
        "gating = self.gating_param.view(1, -1, 1, 1)",
        "attn = (1. - torch.sigmoid(gating)) * patch_score + torch.sigmoid(gating) * pos_score",
        "attn /= attn.sum(dim=-1).unsqueeze(-1)"]
CORE_CALL = ["attn = self.mesa_gated_softmax(patch_score, self.rel_indices, self.pos_proj.weight, "
             "self.pos_proj.bias,", "self.gating_param)"]


def test_mesa_forward_is_the_stock_source_but_the_core():
    """A timm release that changes GPSA fails here (then update patch/convit.py and
    nn/gated_softmax.py)."""
    assert SWAPPABLE, "timm's GPSA.get_attention computes its positional map otherwise"
    assert code_lines(MesaGPSA.forward) == [SWAPS.get(ln, ln) for ln in code_lines(GPSA.forward)]
    stock = code_lines(GPSA.get_attention)
    core = POSITIONAL + [QK[0]] + GATE
    start = stock.index(core[0])
    assert stock[start:start + len(core)] == core
    assert code_lines(MesaGPSA.get_attention) == stock[:start] + [QK[1]] + CORE_CALL + stock[start + len(core):]


def _inputs(batch=3, heads=4, side=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = side * side
    logits = (torch.randn(batch, heads, n, n, generator=g) * 2).to(dtype).requires_grad_()
    rel = GPSA(8 * heads, heads).get_rel_indices(n).to(dtype)
    weight = torch.randn(heads, 3, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(heads, generator=g).to(dtype).requires_grad_()
    gating = torch.randn(heads, generator=g).to(dtype).requires_grad_()
    return logits, rel, weight, bias, gating


def _grads(fn, logits, rel, weight, bias, gating):
    out = fn(logits, rel, weight, bias, gating)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    return (out,) + torch.autograd.grad((out * w).sum(), (logits, weight, gating))


def test_layer_is_the_stock_lines_with_gradients_of_float64():
    layer = mnn.GatedPositionalSoftmax(num_groups=4)
    assign_rng_keys(layer)
    inputs = _inputs()
    got = _grads(layer, *inputs)
    want = _grads(gated_positional_softmax, *inputs)
    exact = _grads(gated_positional_softmax, *[t.detach().double().requires_grad_(t.requires_grad) for t in inputs])
    assert torch.equal(got[0], want[0])
    for g, w, e in zip(got[1:], want[1:], exact[1:]):
        assert g.shape == w.shape and g.dtype == w.dtype
        # (the 8-bit map's error against the float32 stock gradient's, both to float64 autograd)
        assert F.cosine_similarity(g.double().flatten(), e.flatten(), dim=0) > 0.999
    assert layer.quantizer.initialized


def test_the_map_is_never_clipped_by_learned_thresholds():
    """estimator="learned": the softmax map keeps its running range (no learned clipping of
    the large probabilities, as nn.Softmax)."""
    holder = nn.Sequential()
    holder.add_module("attn", GPSA(32, 4))
    patch_model(holder, estimator="learned")
    assert not holder.attn.mesa_gated_softmax.quantizer.clippable
    assert mnn.Softmax(dim=-1, estimator="learned").quantizer.clippable is False


def test_positional_bias_gradient_is_zero_as_stock():
    """A bias on every positional logit of a head shifts whole softmax rows: its gradient is
    zero (float rounding in stock); the recomputed map keeps it there, not at 8-bit noise."""
    layer = mnn.GatedPositionalSoftmax(num_groups=4)
    assign_rng_keys(layer)
    logits, rel, weight, bias, gating = _inputs()
    out = layer(logits, rel, weight, bias, gating)
    (out * torch.randn(out.shape)).sum().backward()
    assert bias.grad.abs().max() < 1e-5 * weight.grad.abs().max()


def test_under_bf16_autocast_the_forward_is_stock():
    layer = mnn.GatedPositionalSoftmax(num_groups=4)
    assign_rng_keys(layer)
    inputs = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(layer, *inputs)
        want = _grads(gated_positional_softmax, *inputs)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == w.dtype and F.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.99


def _step(model, x, seed=1):
    torch.manual_seed(seed)  # (dropout and drop-path on: the same draws in both)
    out = model(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_convit_trains_bitwise_stock_forward_and_close_gradients():
    stock = build("convit_tiny", drop=True, attn_drop_rate=0.1)
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported unreached, no second core left stock
        patch_model(mesa)
    gpsas = [m for m in mesa.modules() if isinstance(m, GPSA)]
    assert gpsas and all(type(m) is MesaGPSA and type(m.pos_proj) is nn.Linear for m in gpsas)
    x = example("convit_tiny")
    want, want_grads = _step(stock, x)
    got, got_grads = _step(mesa, x)
    assert torch.equal(got, want)
    for n, g in want_grads.items():
        if n.endswith("pos_proj.bias"):  # (zero in exact arithmetic: rounding noise in both)
            continue
        assert F.cosine_similarity(got_grads[n].flatten().double(), g.flatten().double(), dim=0) > 0.99, n
    for m in gpsas:
        assert m.mesa_gated_softmax.quantizer.initialized and m.mesa_qk.quantizer_a.initialized
        assert m.mesa_av.quantizer_a.initialized
    rows = {row[0]: row[1] for row in describe_rows(mesa)}
    assert rows["blocks.0.attn.mesa_gated_softmax"] == "softmax"
    stock.eval(), mesa.eval()
    with torch.no_grad():
        assert torch.equal(mesa(x), stock(x))


def test_gpsa_keeps_a_sixth_of_stock_bytes():
    """One GPSA at 196 tokens, batch 8: stock keeps P, Q, the gated map and the divided map in
    float32 and the expanded position table reshaped (28.6 MB); Mesa the int8 map, the map for
    attn @ v and the linears' int8 inputs, and a reference to the position table (a buffer the
    meter counts as saved: 0.46 MB)."""
    torch.manual_seed(0)
    stock = GPSA(192, 4).train()
    mesa = copy.deepcopy(stock)
    holder = nn.Sequential()
    holder.add_module("attn", mesa)
    patch_model(holder)
    x = torch.randn(8, 196, 192, requires_grad=True)
    sizes = []
    for m in (stock, holder.attn):
        with SavedTensorMeter(m) as meter:
            m(x)
        sizes.append(meter.activation_bytes)
    assert sizes[1] < 0.18 * sizes[0], sizes  # (measured 0.162)


def test_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    holder = nn.Sequential()
    holder.add_module("attn", GPSA(32, 4))
    patch_model(holder)
    twin = copy.deepcopy(holder)
    x = torch.randn(2, 16, 32)
    want, want_grads = _step(holder, x)
    got, _ = _step(torch.compile(twin, backend="aot_eager", fullgraph=True), x)
    torch.testing.assert_close(got, want)
    for n, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("first, then", [(["matmul"], ["softmax"]), (["linear"], ["softmax"]),
                                         (["softmax"], ["matmul"])])
def test_patched_in_two_steps_is_the_one_step_model(first, then):
    """ops=[...] then ops=["softmax"]: the swap replaces the generic routing an earlier matmul
    patch installed (its capturing forward and children) and turns a converted pos_proj back
    into a stock Linear; every Mesa layer runs, the forward is stock's."""
    torch.manual_seed(0)
    stock = nn.Sequential()
    stock.add_module("attn", GPSA(32, 4))
    mesa = copy.deepcopy(stock)
    patch_model(mesa, ops=first)
    patch_model(mesa, ops=then)
    attn = mesa.attn
    assert type(attn) is MesaGPSA and type(attn.pos_proj) is nn.Linear and "forward" not in vars(attn)
    assert attn.pos_proj.weight is stock.attn.pos_proj.weight or torch.equal(attn.pos_proj.weight,
                                                                             stock.attn.pos_proj.weight)
    x = torch.randn(2, 16, 32)
    want, _ = _step(stock, x)
    got, _ = _step(mesa, x)
    assert torch.equal(got, want)
    idle = [n for n, m in mesa.named_modules() if isinstance(m, mnn.MesaLayer)
            and not all(q.initialized for q in m.quantizers())]
    assert not idle, idle
    if "matmul" in first + then:  # (softmax then matmul: the products compress too)
        assert attn.mesa_qk.operands == ("a", "b") and attn.mesa_qk.quantizer_a.initialized


def test_a_checkpoint_of_the_generic_routing_loads():
    """A patched ConViT checkpoint from before the swap (the generic routing's mesa_softmax,
    mesa_logit_scale and Mesa pos_proj estimates) loads strictly: the patch softmax's estimates
    become the gated layer's, the others are dropped."""
    holder = nn.Sequential()
    holder.add_module("attn", GPSA(32, 4))
    patch_model(holder)
    state = holder.state_dict()
    old = {k.replace("mesa_gated_softmax.", "mesa_softmax."): v for k, v in state.items()}
    old.update({"attn.mesa_logit_scale.quantizer.alpha": torch.zeros(4, 1), "attn.pos_proj.quantizer.beta":
                torch.zeros(3, 1)})
    old["attn.mesa_softmax.quantizer.alpha"] = torch.full_like(state["attn.mesa_gated_softmax.quantizer.alpha"], 0.5)
    holder.load_state_dict(old)
    assert torch.equal(holder.attn.mesa_gated_softmax.quantizer.alpha,
                       old["attn.mesa_softmax.quantizer.alpha"])


def test_a_checkpoint_of_the_generic_routing_resumes_through_the_trainer():
    """The trainer compares keys before loading (train/checkpoint.load_model_state): the old
    keys are moved first (patch/checkpoint.upgrade_state_dict), so the patch softmax's
    estimates carry over without a warning."""
    from mesa_train.train.checkpoint import load_model_state

    holder = nn.Sequential()
    holder.add_module("attn", GPSA(32, 4))
    patch_model(holder)
    state = holder.state_dict()
    old = {k.replace("mesa_gated_softmax.", "mesa_softmax."): v for k, v in state.items()}
    old["attn.pos_proj.quantizer.alpha"] = torch.zeros(3, 1)
    old["attn.mesa_softmax.quantizer.alpha"] = torch.full_like(state["attn.mesa_gated_softmax.quantizer.alpha"], 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model_state(holder, old, "old.pt")
    assert torch.equal(holder.attn.mesa_gated_softmax.quantizer.alpha, old["attn.mesa_softmax.quantizer.alpha"])
