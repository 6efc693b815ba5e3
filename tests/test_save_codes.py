"""mesa_train.quant.save_codes: under torch.compile with the traced compression, backward keeps
the one-byte codes, not dequantized copies (the partitioner's choice without the pass)."""
from __future__ import annotations

import collections

import pytest
import timm
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from conftest import load_script
from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
from mesa_train.patch.core import patch_model
from mesa_train.quant.compile_kernels import compile_kernels, set_compile_kernels
from mesa_train.quant.save_codes import SaveCodes, mark_dequantize_for_backward

aten, prims = torch.ops.aten, torch.ops.prims

igc = load_script("inductor_gpu_code")


@pytest.fixture
def kernels_choice():
    before = compile_kernels()
    yield set_compile_kernels
    set_compile_kernels(before)
    torch._dynamo.reset()


def _block(attention: str) -> torch.nn.Module:
    """One patched ViT block (64 wide, 2 heads), explicit or fused attention, with the op set the
    modern preset patches on it."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=64,
                              num_heads=2, num_classes=10)
    for blk in model.blocks:
        blk.attn.fused_attn = attention == "fused"
    patch_model(model, ops=igc.ATTENTION_OPS[attention])
    return model.blocks[0]


def _saved(block: torch.nn.Module, options: dict) -> collections.Counter:
    """(dtype, numel) of each tensor the compiled block's forward graph keeps for backward (the
    traced path keeps its statistics in other shapes: (1, G, 1) for the ops' (1, G))."""
    torch._dynamo.reset()
    x = torch.randn(2, 17, 64, requires_grad=True)
    forward, _ = igc.capture_step_graphs(block, x, steps=1, amp=True, inductor_options=options)
    return collections.Counter(igc.saved_for_backward(forward))


@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_traced_compression_keeps_what_the_ops_keep(attention, kernels_choice):
    """Traced, the block keeps the tensors the extension's ops keep: codes (uint8), statistics,
    row exponents. Without the pass the partitioner kept bf16 copies of q, k, v and of the
    attention output wherever they feed a matmul or the fused attention's backward (a DeiT-S
    block at batch 8: 15.1 MB saved against 12.7 MB with the ops)."""
    kernels_choice("ops")
    with_ops = _saved(_block(attention), {})
    kernels_choice("traceable")
    traced = _saved(_block(attention), dict(TRACED_INDUCTOR_OPTIONS))
    assert traced == with_ops, (f"saved with the ops but not traced: {with_ops - traced}; "
                                f"traced but not with the ops: {traced - with_ops}")
    assert any(dtype == torch.uint8 for dtype, _ in traced)


def _graph(forward_use: bool, big_other: bool = False) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A joint graph in miniature: codes -> float -> * scale (-> * other) -> times the output
    gradient; ``forward_use``: the scaled value is also a forward output."""
    g = fx.Graph()
    nodes = {"codes": g.placeholder("primals_1"), "scale": g.placeholder("primals_2"),
             "tangent": g.placeholder("tangents_1")}
    nodes["codes"].meta["val"] = torch.zeros(64, dtype=torch.uint8)
    nodes["scale"].meta["val"] = torch.zeros(1)
    nodes["tangent"].meta["val"] = torch.zeros(64)
    nodes["float"] = g.call_function(prims.convert_element_type.default, (nodes["codes"], torch.float32))
    nodes["scaled"] = g.call_function(aten.mul.Tensor, (nodes["float"], nodes["scale"]))
    value = nodes["scaled"]
    if big_other:  # a large forward activation (not a graph input) joining the chain
        nodes["act"] = g.call_function(aten.relu.default, (nodes["scale"],))
        nodes["act"].meta["val"] = torch.zeros(64)
        value = g.call_function(aten.mul.Tensor, (value, nodes["act"]))
        value.meta["val"] = torch.zeros(64)
    nodes["grad"] = g.call_function(aten.mm.default, (value, nodes["tangent"]))
    for k in ("float", "scaled"):
        nodes[k].meta["val"] = torch.zeros(64)
    nodes["grad"].meta["val"] = torch.zeros(64)
    g.output((nodes["scaled"], nodes["grad"]) if forward_use else (nodes["grad"],))
    return g, nodes


def test_pass_tags_a_dequantize_chain_for_backward():
    g, n = _graph(forward_use=False)
    assert mark_dequantize_for_backward(g) == 1
    assert n["float"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert n["scaled"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert n["codes"].meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert "recompute" not in n["grad"].meta  # (backward's own work: depends on the gradient)


@pytest.mark.parametrize("case", ["forward use", "large other input"])
def test_pass_leaves_chains_that_would_not_pay(case):
    g, n = _graph(forward_use=case == "forward use", big_other=case == "large other input")
    assert mark_dequantize_for_backward(g) == 0
    assert not any("recompute" in node.meta for node in g.nodes)


def test_pass_is_cacheable():
    """Inductor keeps its FX graph cache on for a pass with a uuid (the hash of its file)."""
    assert SaveCodes().uuid() == SaveCodes().uuid() is not None


def _step_graph(step_forward_use: bool) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A joint graph in miniature with the dequantize's step: estimate -> / 255 -> view -> times
    the codes -> times the output gradient. The estimate also feeds a forward output (as the
    quantize's ``255 / alpha`` does); ``step_forward_use``: so does the step."""
    g = fx.Graph()
    nodes = {"codes": g.placeholder("primals_1"), "stats": g.placeholder("primals_2"),
             "tangent": g.placeholder("tangents_1")}
    vals = {"codes": torch.zeros(64, dtype=torch.uint8), "stats": torch.zeros(4), "tangent": torch.zeros(64)}
    nodes["estimate"] = g.call_function(aten.relu.default, (nodes["stats"],))
    nodes["full"] = g.call_function(aten.full.default, ([4], 255.0))
    nodes["step"] = g.call_function(aten.div.Tensor, (nodes["estimate"], nodes["full"]))
    nodes["step_view"] = g.call_function(aten.view.default, (nodes["step"], [4, 1]))
    nodes["float"] = g.call_function(prims.convert_element_type.default, (nodes["codes"], torch.float32))
    nodes["float_view"] = g.call_function(aten.view.default, (nodes["float"], [4, 16]))
    nodes["scaled"] = g.call_function(aten.mul.Tensor, (nodes["float_view"], nodes["step_view"]))
    nodes["grad"] = g.call_function(aten.mm.default, (nodes["scaled"], nodes["tangent"]))
    nodes["inverse"] = g.call_function(aten.div.Tensor, (nodes["full"], nodes["estimate"]))
    vals.update(estimate=torch.zeros(4), full=torch.zeros(4), step=torch.zeros(4), step_view=torch.zeros(4, 1),
                float=torch.zeros(64), float_view=torch.zeros(4, 16), scaled=torch.zeros(4, 16),
                grad=torch.zeros(4, 4), inverse=torch.zeros(4))
    for k, v in vals.items():
        nodes[k].meta["val"] = v
    outputs = [nodes["inverse"], nodes["grad"]] + ([nodes["step"]] if step_forward_use else [])
    g.output(tuple(outputs))
    return g, nodes


def test_pass_moves_the_step_into_backward():
    """``alpha / 255`` and its view, made only for the dequantize, are recomputed with it (no
    forward launch, the estimate saved instead); the estimate, which the forward uses, is not."""
    g, n = _step_graph(step_forward_use=False)
    assert mark_dequantize_for_backward(g) == 1
    for k in ("step", "step_view", "float", "float_view", "scaled"):
        assert n[k].meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE, k
    for k in ("estimate", "full", "inverse", "grad"):
        assert "recompute" not in n[k].meta, k


def test_pass_keeps_a_step_the_forward_uses():
    g, n = _step_graph(step_forward_use=True)
    assert mark_dequantize_for_backward(g) == 1
    assert n["step_view"].meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in n["step"].meta


def _divisions_by_a_constant(gm: torch.fx.GraphModule) -> int:
    """``x / full(...)`` nodes: the dequantize's ``alpha / 255`` (the quantize's ``255 / alpha``
    divides the constant)."""
    return sum(1 for node in gm.graph.nodes if node.target == aten.div.Tensor
               and isinstance(node.args[1], fx.Node) and node.args[1].target == aten.full.default)


@pytest.mark.parametrize("variant", ["traceable", "delayed"])
def test_traced_forward_computes_no_dequantize_step(variant, kernels_choice):
    """The compiled block's forward graph divides no estimate by 255 (each was a launch of its
    own, its result saved); its backward does, inside the dequantize. deit_ti's first block,
    running (``traceable``) and delayed estimates, captured as the census captures it."""
    (forward, backward), _ = igc.capture_block("deit_ti", variant, batch=2, amp=True)
    assert _divisions_by_a_constant(forward.gm) == 0
    assert _divisions_by_a_constant(backward.gm) >= 4  # the matmul operands' dequantizes (q, k^T, map, v)
