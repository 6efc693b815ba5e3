"""torch's nn.MultiheadAttention (torchvision's ViT, nn.TransformerEncoderLayer, hand-written
blocks): its projections and sdpa are compressed (patch/mha.py), the forward stays bitwise the
stock one with dropout on, and every call the Mesa path does not replicate runs stock and says
why (cross-attention: tests/test_mha_cross_attention.py). Before, the whole module was reported
as "functional ops not reached" and left as is: 65% of a torchvision ViT's saved bytes."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import (mesa_state_keys, patch_model, patched_to_stock_state_dict,
                              stock_to_patched_state_dict)
from mesa_train.patch.coverage import coverage
from mesa_train.patch.describe import describe_rows
from mesa_train.patch.mha import MesaMultiheadAttention


def _vit(dropout: float = 0.1):
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                                mlp_dim=64, num_classes=10, dropout=dropout, attention_dropout=dropout)


def _encoder_layer(batch_first: bool, norm_first: bool):
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, activation="gelu",
                                                            batch_first=batch_first, norm_first=norm_first),
                                 num_layers=2, enable_nested_tensor=False)


MODELS = {
    "torchvision_vit": (_vit, lambda: torch.randn(2, 3, 32, 32)),
    "encoder_batch_first_post_norm": (lambda: _encoder_layer(True, False), lambda: torch.randn(2, 5, 16)),
    "encoder_seq_first_pre_norm": (lambda: _encoder_layer(False, True), lambda: torch.randn(5, 2, 16)),
}


def _step(model, x, seed=3):
    torch.manual_seed(seed)  # (dropout on: the same masks in both models)
    out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weight).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_is_stock_forward_and_close_gradients(name):
    make, make_input = MODELS[name]
    torch.manual_seed(0)
    stock = make().train()
    for p in stock.parameters():  # (torchvision's zero-initialised head would zero every gradient)
        if p.dim() >= 2 and not p.abs().sum():
            nn.init.normal_(p, std=0.02)
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported unreached, no call runs stock
        patch_model(mesa, ops=["linear", "sdpa", "gelu", "layernorm"])
    mhas = [m for m in mesa.modules() if isinstance(m, nn.MultiheadAttention)]
    assert mhas and all(type(m) is MesaMultiheadAttention for m in mhas)
    x = make_input()
    want, want_grads = _step(stock, x)
    got, got_grads = _step(mesa, x)
    assert torch.equal(got, want)
    for n, g in want_grads.items():
        cos = F.cosine_similarity(got_grads[n].flatten().double(), g.flatten().double(), dim=0)
        assert cos > 0.99, (n, float(cos))
    # each attention's input projection and q, k, v were quantized in that step
    for m in mhas:
        assert m.mesa_in_proj.quantizer.initialized and m.mesa_sdpa.q_quantizer.initialized
        assert m.out_proj.quantizer.initialized
    stock.eval(), mesa.eval()
    with torch.no_grad():
        assert torch.equal(mesa(x), stock(x))


def test_torchvision_vit_saves_a_quarter_of_stock_bytes_and_keeps_its_keys():
    model = _vit(dropout=0.0)  # (a dropout mask is kept as is)
    stock_keys = set(model.state_dict())
    patch_model(model)
    report = coverage(model, torch.randn(2, 3, 32, 32))
    # (0.485x of stock with the attention left as is, 65% of what was kept)
    assert report.uncovered_bytes == 0 and report.ratio < 0.3, report
    assert set(model.state_dict()) - mesa_state_keys(model) == stock_keys
    ops = {row[0]: row[1] for row in describe_rows(model)}
    assert ops["encoder.layers.encoder_layer_0.self_attention.mesa_in_proj"] == "linear"
    assert ops["encoder.layers.encoder_layer_0.self_attention.out_proj"] == "linear"
    assert ops["encoder.layers.encoder_layer_0.self_attention.mesa_sdpa"] == "sdpa"
    # a stock checkpoint loads into the patched model and back
    fresh = _vit()
    patched = stock_to_patched_state_dict(fresh.state_dict(), model)
    model.load_state_dict(patched)
    back = patched_to_stock_state_dict(model.state_dict(), model)
    assert set(back) == stock_keys and all(torch.equal(back[k], v) for k, v in fresh.state_dict().items())


def _patched_mha(**kwargs):
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True, **kwargs)
    holder = nn.Sequential()
    holder.add_module("attn", copy.deepcopy(stock))
    patch_model(holder, ops=["linear", "sdpa"])
    return stock, holder.attn


@pytest.mark.parametrize("call, reason", [
    (lambda m, x, y: m(x, x, x), "need_weights=True computes the attention map explicitly, and this module has no "
                                 "Mesa children for it (the ops asked for leave its matmul or softmax stock"),
    (lambda m, x, y: (lambda u: m(u, u, u, need_weights=False))(x[0]), "an unbatched 2-D input"),
], ids=["need_weights", "unbatched"])
def test_a_call_the_mesa_path_does_not_replicate_runs_stock_and_says_why_once(call, reason):
    stock, mesa = _patched_mha()
    x, y = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 7, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        got = call(mesa, x, y)
        call(mesa, x, y)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and reason in messages[0], messages
    torch.manual_seed(1)
    want = call(stock, x, y)
    assert torch.equal(got[0], want[0])
    assert not mesa.mesa_in_proj.quantizer.initialized  # (it ran stock)


def _padding(bsz, tokens, dtype=torch.bool):
    """Key padding: sample i pads its last i tokens (as float: -inf there)."""
    pad = torch.arange(tokens) >= tokens - torch.arange(bsz).unsqueeze(1)
    return pad if dtype == torch.bool else torch.zeros(bsz, tokens).masked_fill(pad, float("-inf"))


MASKS = {
    "padding_bool": lambda b, n, h: dict(key_padding_mask=_padding(b, n)),
    "padding_float": lambda b, n, h: dict(key_padding_mask=_padding(b, n, torch.float32)),
    "causal_2d_bool": lambda b, n, h: dict(attn_mask=torch.triu(torch.ones(n, n, dtype=torch.bool), 1)),
    "causal_hint": lambda b, n, h: dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(n), is_causal=True),
    "bias_3d_and_padding": lambda b, n, h: dict(attn_mask=torch.randn(b * h, n, n),
                                                key_padding_mask=_padding(b, n, torch.float32)),
    "causal_hint_and_padding": lambda b, n, h: dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(n),
                                                    is_causal=True, key_padding_mask=_padding(b, n, torch.float32)),
}


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", list(MASKS))
def test_masked_self_attention_is_stock_forward_and_compressed(mask, batch_first, need_weights):
    """Masks (nn.TransformerEncoderLayer's padding and causal masks, a float bias): with
    need_weights=False made additive, spread over the heads and merged as torch's function
    does, then the Mesa sdpa; with torch's default need_weights=True added inside
    ``baddbmm(mask, q_scaled, k^T)``, which the Mesa q @ k^T computes itself (before, that call
    ran stock with a warning). The output and the weights bitwise stock's."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=batch_first).train()
    mesa = copy.deepcopy(stock)
    x = torch.randn(3, 7, 16) if batch_first else torch.randn(7, 3, 16)
    kwargs = MASKS[mask](3, 7, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "ran uncompressed" warning)
        patch_model(mesa)
        outs = []
        for m in (stock, mesa):
            torch.manual_seed(1)
            with SavedTensorMeter() as meter:
                out, weights = m(x, x, x, need_weights=need_weights, **kwargs)
            (out.square().sum() + (weights.nan_to_num().sum() if need_weights else 0)).backward()
            outs.append((out, weights, meter.activation_bytes, {n: p.grad for n, p in m.named_parameters()}))
    (want, want_w, stock_bytes, want_grads), (got, got_w, mesa_bytes, got_grads) = outs
    assert torch.equal(got, want) and (not need_weights or torch.equal(got_w, want_w))
    for n, g in want_grads.items():
        assert F.cosine_similarity(got_grads[n].flatten(), g.flatten(), dim=0) > 0.99, n
    if need_weights:
        assert mesa.mesa_qk.quantizer_a.initialized and mesa.mesa_softmax.quantizer.initialized
        assert mesa_bytes < 0.5 * stock_bytes, (mesa_bytes, stock_bytes)
    else:
        assert mesa.mesa_sdpa.q_quantizer.initialized and mesa_bytes < 0.4 * stock_bytes


def test_a_learned_float_mask_gets_its_gradient():
    """A float attn_mask that requires grad (a learned bias) with need_weights=True: its
    gradient flows through the Mesa baddbmm as through torch's (the product's gradient summed
    over the dims the mask broadcasts)."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, batch_first=True).train()
    mesa = patch_model(copy.deepcopy(stock))
    x = torch.randn(3, 7, 16)
    grads, learned = [], torch.randn(7, 7)
    for m in (stock, mesa):
        bias = learned.clone().requires_grad_()
        out, _ = m(x, x, x, attn_mask=bias)
        out.square().sum().backward()
        grads.append(bias.grad)
    assert F.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0) > 0.99


def test_encoder_with_padding_and_causal_masks():
    """nn.TransformerEncoder trained with src_key_padding_mask and a causal mask."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    stock = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(mesa)
        x, causal = torch.randn(3, 7, 16), nn.Transformer.generate_square_subsequent_mask(7)
        outs = []
        for m in (stock, mesa):
            torch.manual_seed(1)
            out = m(x, mask=causal, src_key_padding_mask=_padding(3, 7, torch.float32), is_causal=True)
            out.square().sum().backward()
            outs.append(out)
    assert torch.equal(outs[1], outs[0])
    assert all(layer.self_attn.mesa_sdpa.q_quantizer.initialized for layer in mesa.layers)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("average", [True, False])
def test_need_weights_true_runs_the_explicit_core_compressed(dropout, average):
    """torch's default call, ``attn(x, x, x)`` (need_weights=True: the map computed with bmm,
    softmax, dropout, bmm, and returned averaged over the heads): the same steps through Mesa
    MatMul / Softmax children; the output and the weights bitwise stock's."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, dropout=dropout, batch_first=True).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "ran uncompressed" warning)
        patch_model(mesa)
        x = torch.randn(2, 5, 16)
        outs = []
        for m in (stock, mesa):
            torch.manual_seed(1)
            with SavedTensorMeter() as meter:
                out, weights = m(x, x, x, average_attn_weights=average)
            (out.square().sum() + weights.sum()).backward()
            outs.append((out, weights, meter.activation_bytes, {n: p.grad for n, p in m.named_parameters()}))
    (want, want_w, stock_bytes, want_grads), (got, got_w, mesa_bytes, got_grads) = outs
    assert torch.equal(got, want) and torch.equal(got_w, want_w)
    for n, g in want_grads.items():
        assert F.cosine_similarity(got_grads[n].flatten(), g.flatten(), dim=0) > 0.99, n
    assert mesa_bytes < 0.4 * stock_bytes
    assert mesa.mesa_qk.quantizer_a.initialized and mesa.mesa_softmax.quantizer.initialized
    assert mesa.mesa_av.quantizer_b.initialized and not mesa.mesa_sdpa.q_quantizer.initialized


def test_a_module_the_mesa_forward_does_not_replicate_is_reported_and_left_stock():
    torch.manual_seed(0)
    holder = nn.Sequential()
    holder.add_module("attn", nn.MultiheadAttention(16, 2, add_bias_kv=True))
    with pytest.warns(UserWarning, match=r"functional ops not reached .*attn \(MultiheadAttention: "):
        patch_model(holder, ops=["linear", "sdpa"])
    assert type(holder.attn) is nn.MultiheadAttention
    assert type(holder.attn.out_proj) is not mnn.Linear  # (its forward never calls out_proj)
    # the same module as the model itself: reported as <root>, no Mesa out_proj left unused
    bare = nn.MultiheadAttention(16, 2, add_zero_attn=True)
    with pytest.warns(UserWarning, match=r"functional ops not reached .*<root> \(MultiheadAttention: "):
        patch_model(bare, ops=["linear", "sdpa"])
    assert type(bare) is nn.MultiheadAttention and type(bare.out_proj) is not mnn.Linear
    # a supported one as the model itself is patched as inside a model
    root = patch_model(nn.MultiheadAttention(16, 2), ops=["linear", "sdpa"])
    assert type(root) is MesaMultiheadAttention and type(root.out_proj) is mnn.Linear


def test_only_the_ops_asked_for_are_compressed():
    _, mesa = _patched_mha()
    assert mesa.mesa_in_proj is not None and mesa.mesa_sdpa is not None
    holder = nn.Sequential()
    holder.add_module("attn", nn.MultiheadAttention(16, 2))
    patch_model(holder, ops=["sdpa"])
    assert holder.attn.mesa_in_proj is None and type(holder.attn.out_proj) is not MesaMultiheadAttention
    assert not hasattr(holder.attn.out_proj, "quantizer")
    x = torch.randn(5, 2, 16, requires_grad=True)
    holder.attn(x, x, x, need_weights=False)[0].sum().backward()
    assert holder.attn.mesa_sdpa.q_quantizer.initialized


def test_compiles_whole_and_matches_eager():
    """torch.compile(fullgraph=True) of a training step (attention dropout 0: sdpa's dropout
    mask cannot be replayed in a traced backward, one graph break per call, as for timm)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True)
    patch_model(model)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    want, want_grads = _step(model, x)
    got, _ = _step(torch.compile(twin, backend="aot_eager", fullgraph=True), x)
    torch.testing.assert_close(got, want)
    for n, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n])


def test_attention_dropout_compiles_with_breaks_and_fullgraph_says_why():
    """nn.TransformerEncoderLayer's default dropout 0.1 reaches the attention: its compressed
    call replays the dropout mask in backward, so under torch.compile it runs eagerly (a graph
    break; the step equals eager's), and fullgraph=True fails on a message that says why and
    names the choices. compile_model does not refuse the module itself: its default call
    (need_weights=True) runs the explicit core, which compiles whole."""
    from mesa_train.compile_scope import compile_model

    torch.manual_seed(0)
    model = patch_model(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True))
    twin, whole = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    want, want_grads = _step(model, x)
    got, _ = _step(torch.compile(twin, backend="aot_eager"), x)
    torch.testing.assert_close(got, want)
    for n, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="attention dropout > 0 under torch.compile.*fullgraph=False"):
        _step(torch.compile(whole, backend="aot_eager", fullgraph=True), x)
    mha = patch_model(nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)).train()
    compiled = compile_model(mha, fullgraph=True, backend="aot_eager")
    out, weights = compiled(x, x, x)
    (out.sum() + weights.sum()).backward()
    assert mha.mesa_softmax.quantizer.initialized


def test_torch_fx_keeps_it_a_leaf_or_says_how():
    """Stock nn.MultiheadAttention is a leaf to torch.fx (a torch.nn module); the Mesa one is
    traced into unless told: one clear error, and as a leaf the graph runs it (compressing)."""
    import torch.fx as fx

    from mesa_train.nn import MesaLayer
    from mesa_train.nn.tracing import MesaTracingError
    from mesa_train.patch.mha import MesaMultiheadAttention

    class _Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    model = patch_model(_Block(), ops=["linear", "sdpa"])
    with pytest.raises(MesaTracingError, match=r"leaf_modules=\[mesa_train.nn.MesaLayer, mesa_train.patch.mha"):
        fx.symbolic_trace(model)

    class _Leaves(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, (MesaLayer, MesaMultiheadAttention)) or super().is_leaf_module(m, qualname)

    graph = fx.GraphModule(model, _Leaves().trace(model))
    x = torch.randn(2, 5, 16, requires_grad=True)
    graph(x).sum().backward()
    assert model.attn.mesa_in_proj.quantizer.initialized


def test_matmul_and_softmax_ops_alone_compress_the_default_call():
    """ops=['matmul', 'softmax'] (no linear, no sdpa): the default need_weights=True call runs the
    explicit core through the Mesa children (it stayed stock: the swap needed linear or sdpa)."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, batch_first=True).train()
    mesa = patch_model(copy.deepcopy(stock), ops=["matmul", "softmax"])
    assert mesa.mesa_in_proj is None and mesa.mesa_sdpa is None and type(mesa.out_proj) is not mnn.Linear
    x = torch.randn(2, 5, 16)
    got, want = mesa(x, x, x), stock(x, x, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got[0].sum().backward()
    assert mesa.mesa_softmax.quantizer.initialized
