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
