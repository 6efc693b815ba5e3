"""Regional compilation (mesa_train/compile_scope.py): each repeated block compiled on its own.

Backend ``aot_eager`` (as tests/test_compile_fullgraph.py): forward and backward traced as
Inductor would trace them, run as ATen ops, so the compiled steps compare bit for bit with
eager Mesa, and a graph break inside a block fails (``fullgraph=True``)."""
from __future__ import annotations

import copy
import re

import pytest
import timm
import torch
from torch import nn
from torch._dynamo.utils import counters

from mesa_train.compile_scope import (SCOPES, TRACED_INDUCTOR_OPTIONS, WRAPPER_INDUCTOR_OPTIONS, compile_model,
                                      inductor_kwargs, repeated_blocks)
from mesa_train.nn import input_copy
from mesa_train.patch import patch_model
from mesa_train.quant.compile_kernels import set_compile_kernels

from test_patch_helpers import TINY, build, grads, inputs, loss_of


def test_repeated_blocks_follow_timm_block_containers():
    assert [n for n, _ in repeated_blocks(build("deit"))] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in repeated_blocks(build("swin"))] == [
        "layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]
    assert [n for n, _ in repeated_blocks(build("pvt"))] == [f"stages.{i}.blocks.0" for i in range(4)]


def test_repeated_blocks_look_through_wrappers_and_skip_nested_containers():
    model = build("deit")
    # a `blocks` container inside a block belongs to that block's region
    model.blocks[0].inner = nn.Module()
    model.blocks[0].inner.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])
    wrapped = nn.DataParallel(torch.compile(model, backend="eager"))
    assert [n for n, _ in repeated_blocks(wrapped)] == ["blocks.0", "blocks.1"]


def test_scope_errors_name_the_choices():
    with pytest.raises(ValueError, match=r"compile scope must be one of model, blocks, got 'layers'"):
        compile_model(build("deit"), "layers")
    with pytest.raises(ValueError, match=r"Sequential has no 'blocks' container .* valid choices for it: model"):
        compile_model(nn.Sequential(nn.Linear(2, 2)), "blocks", backend="eager")
    assert SCOPES == ("model", "blocks")


def test_blocks_scope_refuses_attention_dropout_naming_the_modules():
    """Each block compiles with fullgraph=True, which Mesa's attention with dropout > 0 breaks
    (its backward replays the mask): refused before compiling, in one line; stock attention,
    or eval mode, compiles."""
    kwargs = dict(TINY["deit"][0], attn_drop_rate=0.1)
    mesa = patch_model(timm.create_model(pretrained=False, **kwargs).train())
    with pytest.raises(ValueError, match=r"dropout > 0 \(2 modules: blocks.0.attn, blocks.1.attn\)") as err:
        compile_model(mesa, "blocks", backend="aot_eager")
    assert "\n" not in str(err.value)
    compile_model(timm.create_model(pretrained=False, **kwargs).train(), "blocks", backend="aot_eager")
    compile_model(mesa.eval(), "blocks", backend="aot_eager")


def _deep_deit():
    kwargs = dict(TINY["deit"][0], depth=4)
    torch.manual_seed(0)
    return timm.create_model(pretrained=False, **kwargs).train()


def test_identical_blocks_share_one_graph_and_train_like_eager():
    """Four DeiT blocks: one graph (the compile time of one block), forward and gradients bit
    for bit eager Mesa's over two steps, the estimates and counters advanced as in eager."""
    torch._dynamo.reset()
    counters.clear()
    stock = _deep_deit()
    model = patch_model(copy.deepcopy(stock), ops=("all",))
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    x = inputs("deit")
    compiled = compile_model(model, "blocks", backend="aot_eager")
    assert compiled is model and list(model.state_dict()) == keys  # no _orig_mod. prefix
    for step in range(2):
        out = compiled(x)
        loss_of(out).backward()
        ref = eager(x)
        loss_of(ref).backward()
        assert torch.equal(out, ref), f"step {step}: per-block compiled forward differs from eager Mesa"
        assert torch.equal(ref, stock(x)), f"step {step}: eager Mesa differs from stock"
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    got, want = grads(model), grads(eager)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    bufs = dict(eager.named_buffers())
    assert all(torch.equal(b, bufs[n]) for n, b in model.named_buffers())


def _graphs_of_a_per_block_step(model, x) -> int:
    """One training step of ``model`` compiled per block (aot_eager), its forward and gradients
    checked bit for bit against an eager copy's; the graphs Dynamo captured (no break allowed)."""
    torch._dynamo.reset()
    counters.clear()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, "blocks", backend="aot_eager")
    # compiled graphs keep each parallel layer's own copy: so do the eager twin and what of the
    # model runs eager around its compiled blocks (CaiT's class-attention blocks)
    with input_copy.disabled():
        out = compiled(x)
        loss_of(out).backward()
        ref = eager(x)
        loss_of(ref).backward()
    assert torch.equal(out, ref)
    assert not counters["graph_break"]
    got, want = grads(model), grads(eager)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family, graphs", [("swin", 3), ("pvt", 4)])
def test_blocks_of_different_shapes_get_their_own_graphs(family, graphs):
    """Swin (unshifted, shifted with its mask, the narrower second stage) and PVT-v2 (one
    width per stage): a static graph per distinct block, still bitwise eager Mesa."""
    model = patch_model(build(family, fused=False), ops=("all",))
    assert _graphs_of_a_per_block_step(model, inputs(family)) == graphs


# attention reached generically (patch/generic_attention.py): EVA-02 (rope), CaiT (talking
# heads; its class-attention blocks, not in `blocks`, stay eager)
GENERIC = {"eva02_tiny_patch14_224": dict(img_size=28, depth=4),
           "cait_xxs24_224": dict(img_size=32, patch_size=16, depth=4, embed_dim=48, num_heads=4)}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_generic_attention_blocks_share_one_graph(name):
    """Identical blocks whose attention is captured generically share one graph (a capture
    hook per module with always_call=True had given one graph per block: Dynamo guarded on
    each hook's id), forward and gradients still bit for bit eager Mesa's."""
    kwargs = GENERIC[name]
    torch.manual_seed(0)
    model = patch_model(timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train(), ops=("all",))
    assert any(n.endswith("attn.mesa_qk") or n.endswith("attn.mesa_sdpa") for n, _ in model.named_modules())
    x = torch.randn(2, 3, kwargs["img_size"], kwargs["img_size"], generator=torch.Generator().manual_seed(1))
    assert _graphs_of_a_per_block_step(model, x) == 1


def test_lists_of_blocks_inside_blocks_are_looked_through():
    """Twins keeps one ModuleList of blocks per stage in ``blocks``: the lists are iterated,
    never called, so the blocks are their children (compiling the lists compiled nothing:
    0 graphs, the model ran eager)."""
    torch.manual_seed(0)
    model = patch_model(timm.create_model("twins_svt_small", pretrained=False, num_classes=10, depths=(2, 1, 1, 1),
                                          img_size=64).train(), ops=("all",))
    names = [n for n, _ in repeated_blocks(model)]
    assert names == ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.2.0", "blocks.3.0"]
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    # stage 1's two blocks alternate local and global attention; one width per stage. The
    # local attention's 5-D q, k, v: its compiled backward is eager's recomputation too
    # (mesa::sdpa_recompute_backward), bit for bit (a float32 formula took them before)
    assert _graphs_of_a_per_block_step(model, x) == 5


def test_recompile_limit_covers_every_block():
    """12 blocks that could each be distinct: the limit is raised so none falls back to eager."""
    limit = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        model = nn.Module()
        model.blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
        compile_model(model, "blocks", backend="eager")
        assert torch._dynamo.config.recompile_limit == 24
    finally:
        torch._dynamo.config.recompile_limit = limit


def test_inductor_per_block_forward_equals_compiled_stock():
    """Inductor itself (C++ code generation, about half a minute on 2 cores): per block, the
    patched model's forward is bit for bit the per-block compiled stock model's over two
    training steps (fp32; also with compile_kernels=traceable and as one graph, measured
    with the same script: docs/DESIGN.md, "Regional compilation")."""
    torch._dynamo.reset()
    stock = build("deit", fused=False)
    model = patch_model(copy.deepcopy(stock), ops=("all",))
    x = inputs("deit")
    c_stock, c_model = compile_model(stock, "blocks"), compile_model(model, "blocks")
    for step in range(2):
        ref, out = c_stock(x), c_model(x)
        assert torch.equal(out, ref), f"step {step}: max difference {(out - ref).abs().max().item():.3g}"
        loss_of(ref).backward()
        loss_of(out).backward()


def test_blocks_compiled_inside_fsdp_units_train_like_eager_fsdp(tmp_path):
    """FSDP2 (fully_shard per block, then the model) with each block compiled in place: one
    graph, no break, and the steps and gradients equal eager FSDP's bit for bit (one rank)."""
    import torch.distributed as dist

    from mesa_train.train.fsdp import apply_fsdp

    torch._dynamo.reset()
    counters.clear()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = patch_model(build("deit", fused=False), ops=("all",))
        eager = copy.deepcopy(model)
        for m in (model, eager):
            apply_fsdp(m, param_dtype=None, reshard_after_forward=True, cpu_offload=False)
        compile_model(model, "blocks", backend="aot_eager")
        x = inputs("deit")
        for step in range(2):
            out, ref = model(x), eager(x)
            loss_of(out).backward()
            loss_of(ref).backward()
            assert torch.equal(out, ref), f"step {step}"
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        want = {n: p.grad.full_tensor() for n, p in eager.named_parameters() if p.grad is not None}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- Inductor options
@pytest.fixture
def traced_compression():
    set_compile_kernels("traceable")
    yield
    set_compile_kernels("auto")


def test_traced_compression_gets_its_inductor_options(traced_compression):
    """A Mesa model compiled by Inductor with the traced compression gets
    TRACED_INDUCTOR_OPTIONS (a mode becomes its options); every model compiled by Inductor,
    stock or Mesa, WRAPPER_INDUCTOR_OPTIONS; another backend keeps what the caller gave."""
    stock = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    mesa = patch_model(copy.deepcopy(stock), ops=("all",))
    wrapper = WRAPPER_INDUCTOR_OPTIONS
    assert inductor_kwargs(stock, {"mode": "reduce-overhead"}) == {"options": {"triton.cudagraphs": True, **wrapper}}
    assert inductor_kwargs(mesa, {"backend": "aot_eager"}) == {"backend": "aot_eager"}
    got = inductor_kwargs(mesa, {"mode": "reduce-overhead", "dynamic": False})
    assert got == {"dynamic": False, "options": {"triton.cudagraphs": True, **wrapper, **TRACED_INDUCTOR_OPTIONS}}
    assert inductor_kwargs(mesa, {"options": {"realize_opcount_threshold": 64, "size_asserts": True}}) == {
        "options": {**wrapper, **TRACED_INDUCTOR_OPTIONS, "realize_opcount_threshold": 64,
                    "size_asserts": True}}  # the caller's options win
    set_compile_kernels("ops")
    assert inductor_kwargs(mesa, {"mode": "default"}) == {"options": wrapper}
    assert inductor_kwargs(stock, {}) == {"options": wrapper}


def test_inductor_asserts_env_variable_wins(monkeypatch):
    """TORCHINDUCTOR_SIZE_ASSERTS set by the user (to debug a fake kernel) is not overridden:
    that option is left to Inductor's config, which read the variable; the other stays off."""
    stock = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    monkeypatch.setenv("TORCHINDUCTOR_SIZE_ASSERTS", "1")
    assert inductor_kwargs(stock, {}) == {"options": {"alignment_asserts": False}}
    monkeypatch.setenv("TORCHINDUCTOR_ALIGNMENT_ASSERTS", "1")
    assert inductor_kwargs(stock, {}) == {"options": {}}


def test_misspelt_compile_option_is_one_line_with_the_close_names():
    """An option Inductor does not know fails in compile_model with one line naming the close
    ones (torch.compile's own error lists every Inductor option, about 20,000 characters)."""
    stock = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.raises(ValueError) as err:
        compile_model(stock, options={"size_assert": False})
    message = str(err.value)
    assert "\n" not in message and len(message) < 300
    assert "'size_assert' is not an Inductor option" in message and "size_asserts" in message
    with pytest.raises(ValueError, match="close: triton.cudagraphs"):
        compile_model(stock, mode="reduce-overhead", options={"triton.cudagraph": True})
    with pytest.raises(ValueError, match="'no_such_thing_at_all' is not an Inductor option"):
        inductor_kwargs(stock, {"options": {"no_such_thing_at_all": 1}})
    # options torch.compile itself takes from `options` pass (a guard filter: not Inductor's)
    keep_all = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe
    got = inductor_kwargs(stock, {"options": {"guard_filter_fn": keep_all}})
    assert got["options"]["guard_filter_fn"] is keep_all
    compiled = compile_model(stock, options={"guard_filter_fn": keep_all})
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), stock(x))  # (Inductor's fused GELU: last-bit differences)


def test_compiled_wrapper_runs_no_size_asserts():
    """compile_model's Inductor code calls the mesa:: ops without checking each output against
    its fake (WRAPPER_INDUCTOR_OPTIONS): no assert_tensor_metadata / assert_size_stride lines in
    the generated wrapper, where torch.compile's defaults write them for every op output; the
    same forward either way."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    mesa = patch_model(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), ops=("all",)).train()
    x = torch.randn(3, 5, 8)
    codes = {}
    for name, compiled in (("default", torch.compile(mesa, fullgraph=True)), ("ours", compile_model(mesa))):
        torch._dynamo.reset()
        out, code = run_and_get_code(compiled, x)
        codes[name] = ("\n".join(code), out)
    def checks(code: str) -> set:  # the runtime checks the wrapper calls
        return set(re.findall(r"\b(assert_(?:tensor_metadata|size_stride\w*|alignment))\(", code))

    assert "torch.ops.mesa." in codes["ours"][0]
    assert checks(codes["default"][0])  # (torch 2.14: assert_tensor_metadata and the grouped input
    # check; 2.11, the lent GPUs' image, writes assert_size_stride for each)
    assert checks(codes["ours"][0]) == set()
    assert torch.equal(codes["default"][1], codes["ours"][1])


def _buffers_of_traced_quantize(options) -> list[tuple[str, str]]:
    """The buffers Inductor's code for the traced stochastic quantize of an attention map
    allocates, (numel, dtype) of each 1-d one (CPU code; the GPU's default threshold, 30, set
    unless options say otherwise)."""
    from torch._inductor.utils import run_and_get_code

    from mesa_train.quant import traceable

    torch._dynamo.reset()
    x = torch.randn(2, 3, 17, 17)
    a, b, seed = torch.rand(1, 3) + 1, -torch.rand(1, 3), torch.tensor([5, 7])
    fn = torch.compile(lambda x, a, b, s: traceable.quantize(x, a, b, 1, 3, True, s),
                       options={"realize_opcount_threshold": 30, **options})
    out, code = run_and_get_code(fn, x, a, b, seed)
    assert torch.equal(out, traceable.quantize(x, a, b, 1, 3, True, seed))
    return re.findall(r"buf\d+ = empty_strided_cpu\(\((\d+), \)[^)]*\), torch\.(\w+)", "\n".join(code))


def test_traced_quantize_is_one_expression_with_the_options():
    """Under the GPU's default threshold the traced quantize writes and reads an int32 buffer
    of every element mid-hash; with TRACED_INDUCTOR_OPTIONS it computes the codes in one
    expression (no buffer but the codes)."""
    numel = str(2 * 3 * 17 * 17)
    assert (numel, "int32") in _buffers_of_traced_quantize({})
    assert _buffers_of_traced_quantize(TRACED_INDUCTOR_OPTIONS) == []
