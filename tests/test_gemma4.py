"""Gemma 4's vision encoder (``patch/gemma4.py``): the clamped Linears keep 1-bit masks
(``Clamp``), the position table keeps the positions, not the one-hot matrix (``OneHotTable``),
and the gated MLP runs through a ``GatedActivation``."""
import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import clamp_activations
from mesa_train.patch import patch_model
from mesa_train.patch.gemma4 import GEMMA4_CLASSES
from mesa_train.patch.mlp import MLP_CLASSES

gemma4 = pytest.importorskip("timm.models.gemma4_vit")
sys.path.insert(0, str(Path(__file__).parent))
from source_lines import code_lines  # noqa: E402
from timm_zoo import build, example  # noqa: E402


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("method", [(gemma4.Gemma4ClippableLinear, "forward"),
                                    (gemma4.Gemma4PatchEmbed, "_position_embeddings"),
                                    (gemma4.Gemma4GatedMlp, "forward")], ids=lambda m: m[0].__name__)
def test_mesa_methods_are_timms_but_the_marked_calls(method):
    """A timm release that changes one of these methods fails here (then update patch/gemma4.py)."""
    stock_cls, name = method
    mesa_cls = GEMMA4_CLASSES[stock_cls][1] if stock_cls in GEMMA4_CLASSES else MLP_CLASSES[stock_cls]
    stock, mesa = code_lines(getattr(stock_cls, name)), code_lines(getattr(mesa_cls, name))
    swaps = {"torch.clamp(x, self.input_min, self.input_max)": "self.mesa_clamp(x, self.input_min, self.input_max)",
             "torch.clamp(x, self.output_min, self.output_max)": "self.mesa_clamp(x, self.output_min, self.output_max)",
             "self.act(self.gate_proj(x)) * self.up_proj(x)": "self.gated(self.gate_proj(x), self.up_proj(x))"}
    expected = []
    for ln in stock:
        for old, new in swaps.items():
            ln = ln.replace(old, new)
        expected.append(ln)
    if name == "_position_embeddings":  # three stock lines become one call
        one_hot = [i for i, ln in enumerate(expected) if "one_hot" in ln]
        assert len(one_hot) == 3, stock
        expected[one_hot[0]:one_hot[0] + 3] = [
            "position_embeddings = self.mesa_table(clamped_positions, self.position_embedding_table)"]
    assert mesa == expected


def test_clamp_is_bitwise_stock_and_keeps_a_bit_a_mask():
    torch.manual_seed(0)
    x = torch.randn(4, 33) * 3
    x[0, :4] = torch.tensor([-1.5, 2.0, float("nan"), 0.0])  # on the bounds (torch 2.14: g / 2, a NaN g)
    lo, hi = torch.tensor(-1.5), torch.tensor(2.0)
    g = torch.randn_like(x)
    grads, saved = [], []
    for fn in (torch.clamp, mn.Clamp()):
        leaf = x.clone().requires_grad_()
        with SavedTensorMeter(fn if isinstance(fn, torch.nn.Module) else torch.nn.Module()) as meter:
            y = fn(leaf, lo, hi)
        y.backward(g)
        grads.append((y.detach(), leaf.grad))
        saved.append(meter.activation_bytes)
    assert torch.equal(grads[0][0].nan_to_num(), grads[1][0].nan_to_num())
    assert torch.equal(grads[0][1], grads[1][1])  # (the running torch's rule: STOCK_CLAMP_SPLITS_TIES)
    split = clamp_activations.STOCK_CLAMP_SPLITS_TIES
    assert grads[1][1][0, 0] == (g[0, 0] / 2 if split else g[0, 0]) and grads[1][1][0, 2] == (g[0, 2] if split else 0)
    assert saved[1] == (2 if split else 1) * ((x.numel() + 7) // 8)


def test_one_hot_table_keeps_the_positions():
    torch.manual_seed(0)
    positions = torch.randint(0, 50, (3, 7, 2))
    table = torch.randn(2, 50, 16, requires_grad=True)
    g = torch.randn(3, 2, 7, 16)
    stock = (torch.nn.functional.one_hot(positions, 50).permute(0, 2, 1, 3).to(table) @ table)
    stock.backward(g)
    ref = table.grad.clone()
    table.grad = None
    layer = mn.OneHotTable()
    with SavedTensorMeter(layer) as meter:
        out = layer(positions, table)
    out.backward(g)
    assert torch.equal(out, stock)
    torch.testing.assert_close(table.grad, ref, rtol=1e-6, atol=1e-6)
    assert meter.activation_bytes == positions.numel() * 8  # stock: the (3, 2, 7, 50) float one-hot
    layer.set_quant_options(enabled=False)
    assert torch.equal(layer(positions, table), stock)


def with_finite_clamps(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a Gemma 4 ViT) with finite clamp bounds, as the E4B checkpoints have, so that both
    clamps of every projection bite (the zoo's random init leaves them infinite)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, gemma4.Gemma4ClippableLinear) and m.use_clipped:
                m.input_min.fill_(-1.0), m.input_max.fill_(1.0), m.output_min.fill_(-0.5), m.output_max.fill_(0.5)
    return model


def test_patched_gemma4_with_finite_clamps():
    """The zoo's Gemma 4 ViT with finite clamp bounds (as the E4B checkpoints have), so both
    clamps of every projection bite: forward bitwise, gradients close, a tenth of stock's bytes."""
    stock = with_finite_clamps(build("gemma4_vit_167m"))
    x = example("gemma4_vit_167m")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = patch_model(copy.deepcopy(stock))
    # left: the rotary table's and the pooler's small matmuls, not the patch embedding's
    assert not any("patch_embed" in str(w.message) for w in caught)
    assert isinstance(patched.encoder.patch_embed.mesa_table, mn.OneHotTable)
    assert isinstance(patched.encoder.blocks[0].mlp.gated, mn.GatedActivation)
    assert isinstance(patched.encoder.blocks[0].attn.q_proj.mesa_clamp, mn.Clamp)
    ref, got = stock(x), patched(x)
    assert torch.equal(ref, got)
    ref.square().sum().backward(), got.square().sum().backward()
    grads = dict(patched.named_parameters())
    worst = min(_cos(p.grad, grads[n].grad) for n, p in stock.named_parameters() if p.grad is not None and p.grad.any())
    assert worst > 0.99
    with SavedTensorMeter(stock) as a:
        stock(x)
    with SavedTensorMeter(patched) as b:
        patched(x)
    assert b.activation_bytes < 0.2 * a.activation_bytes, (b.activation_bytes, a.activation_bytes)
    assert set(patched.state_dict()) >= set(stock.state_dict())


def test_patched_gemma4_compiles_fullgraph_and_matches_eager():
    """Under torch.compile the Python Functions run (Clamp's backward now differentiable, not
    once_differentiable): one graph, no break, a training step whose forward is eager Mesa's and
    stock's bit for bit, gradients as eager Mesa's."""
    torch._dynamo.reset()
    stock = with_finite_clamps(build("gemma4_vit_167m"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the rotary table's and the pooler's matmuls stay stock)
        model = patch_model(copy.deepcopy(stock), rounding="nearest")
    eager, x = copy.deepcopy(model), example("gemma4_vit_167m")
    report = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert report.graph_count == 1 and report.graph_break_count == 0, [str(r.reason) for r in report.break_reasons]
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    ref = eager(x)
    assert torch.equal(out, ref) and torch.equal(ref, stock(x))
    out.square().sum().backward(), ref.square().sum().backward()
    want = dict(eager.named_parameters())
    worst = min(_cos(p.grad, want[n].grad) for n, p in model.named_parameters() if p.grad is not None and p.grad.any())
    assert worst > 0.9999
