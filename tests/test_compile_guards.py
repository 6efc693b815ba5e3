"""What a compiled Mesa model checks on the host each step: Dynamo's guards.

Each call of a torch.compile'd model first evaluates its guards, and on an H200 every compiled
Mesa row was host-bound (configs/bench/preset/host.yaml). A fused pair of layers (LayerNorm +
Linear, GELU + Linear) checks in forward that both carry the same options: compared with ``==``
Dynamo traced the dataclass ``__eq__`` and guarded every field of both layers' options (864
guards in a 12-block tiny ViT; its cache lookup went from 2.05 to 1.63 ms a step on this CPU when
they went). The layers' and their quantizers' options are interned so that the check is an
identity, and so that Dynamo's aliasing guards between a layer's and its quantizers' options hold
alike in every block."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import mesa_train
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn.quantizer import QuantOptions, same_options


def _patched_vit(depth: int = 1, explicit: bool = True):
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=16, embed_dim=48, depth=depth,
                                                             num_heads=6, num_classes=10)
    for block in model.blocks:
        block.attn.fused_attn = not explicit
    mesa_train.patch_model(model, ops=["all"])
    return model.train()


def _guarded_option_fields(model, layer: str) -> set[str]:
    """The fields of ``layer``'s options that Dynamo guards when it traces ``model``'s forward."""
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert explanation.graph_break_count == 0
    marker = f"['{layer}']._mesa_options."
    names = [str(getattr(g, "name", g)) for g in explanation.out_guards]
    return {n.split(marker, 1)[1] for n in names if marker in n}


def test_layers_share_one_interned_options_instance():
    model = _patched_vit(depth=2)
    block = model.blocks[0]
    layers = [block.norm1, block.attn.qkv, block.norm2, block.mlp.fc1, block.mlp.act, block.mlp.fc2]
    assert all(m.quant_options is layers[0].quant_options for m in layers)
    # the quantizers too, in every block: Dynamo guards that objects reached by two paths stay
    # the same object, so a block where the layer's and its quantizer's options were one object
    # and another where they were two equal ones made a second graph of the per-block compile
    # (scripts/compile_sweep.py found it: 2 graphs for vit_tiny's 2 blocks)
    quantizers = [q for b in model.blocks for m in b.modules() if hasattr(m, "quantizers") for q in m.quantizers()]
    assert quantizers and all(q.options is layers[0].quant_options for q in quantizers)
    assert model.blocks[1].norm1.quant_options is layers[0].quant_options
    # a copy (an EMA model, a checkpoint round trip through deepcopy) keeps the shared instance
    assert copy.deepcopy(model).blocks[0].norm1.quant_options is layers[0].quant_options
    # changed options are interned again: the pair that still agrees still shares one instance
    block.norm1.set_quant_options(rounding="nearest")
    block.attn.qkv.set_quant_options(rounding="nearest")
    assert block.norm1.quant_options is block.attn.qkv.quant_options is block.norm1.quantizer.options
    assert block.norm1.quant_options is not block.norm2.quant_options
    # same_options is equality, by identity first
    assert same_options(QuantOptions(bits=4), QuantOptions(bits=4))
    assert not same_options(QuantOptions(bits=4), QuantOptions(bits=2))



@pytest.mark.parametrize("explicit", [False, True], ids=["fused-attention", "explicit-attention"])
def test_identical_blocks_share_one_graph_when_compiled_per_block(explicit):
    """Two identical patched blocks compiled one by one: one graph, no recompile (the guards
    that hold for the first block hold for the second). With fused attention the sdpa's
    quantizers and the norm's layer are read in one frame: before the quantizers' options were
    interned too, they were the layer's instance in the first block only, and the second block
    recompiled."""
    from mesa_train.compile_scope import compile_model

    torch._dynamo.reset()
    # as in a fresh process (scripts/compile_sweep.py): the first options of each kind are then
    # interned while the model is patched, which is when the two blocks' aliasing differed
    quantizer_mod._INTERNED.clear()
    model = _patched_vit(depth=2, explicit=explicit)
    compile_model(model, "blocks", backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("layer", ["qkv", "fc2"])
def test_fused_partner_options_are_not_guarded_field_by_field(layer):
    """qkv runs inside norm1's fused LayerNorm+Linear and fc2 inside the GELU's fused
    GELU+Linear: their options are only compared with the partner's, so none of their fields
    is guarded (before interning, all twelve were, and the partner's too)."""
    assert _guarded_option_fields(_patched_vit(), layer) == set()


def test_unequal_options_still_split_the_fused_pair():
    """The identity check is a shortcut, not the test: a pair with different options runs as
    two layers (each its own copy), as before."""
    model = _patched_vit()
    block = model.blocks[0]
    block.mlp.fc2.set_quant_options(rounding="nearest")
    assert not same_options(block.mlp.act.quant_options, block.mlp.fc2.quant_options)
    # fc2 now runs its own forward: its own options are read (and guarded) again
    assert "rounding" in _guarded_option_fields(model, "fc2")
