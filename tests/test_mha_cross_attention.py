"""Cross-attention through torch's nn.MultiheadAttention (a decoder reading its memory,
``attn(x, memory, memory)``; DETR's ``attn(x + pos, x + pos, x)`` and ``attn(x + pos,
memory + pos, memory)``; separate ``kdim`` / ``vdim`` weights): each input's projection
through its own Mesa child, chosen as torch's ``_in_projection_packed`` / ``_in_projection``
chooses by the inputs' identity; the output and the weights bitwise stock's with dropout on,
gradients close, the module's saved bytes cut. Before, every such call ran stock with a
warning, and a module with ``kdim`` / ``vdim`` was left stock."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import patch_model
from mesa_train.patch.mha import MesaMultiheadAttention


def _inputs(form: str, batch_first: bool, bsz: int = 3, tgt: int = 5, src: int = 7):
    """``(query, key, value)`` with the identities each form has (the same tensor object where
    the caller passes one twice)."""
    def make(tokens, dim=16):
        shape = (bsz, tokens, dim) if batch_first else (tokens, bsz, dim)
        return torch.randn(shape, requires_grad=True)

    x, memory = make(tgt), make(src)
    if form == "memory":  # nn.TransformerDecoderLayer's multihead_attn(x, memory, memory)
        return x, memory, memory
    if form == "detr_self":  # q = k = x + pos, v = x
        q = make(tgt)
        return q, q, x
    if form == "three":  # DETR's cross-attention: memory + pos as the key, memory as the value
        return x, make(src), memory
    if form == "separate_dims":  # kdim=12, vdim=10
        shape = (bsz, src) if batch_first else (src, bsz)
        return x, torch.randn(*shape, 12, requires_grad=True), torch.randn(*shape, 10, requires_grad=True)
    raise ValueError(form)


FORMS = ["memory", "detr_self", "three", "separate_dims"]
CHILDREN = {"memory": ("mesa_in_proj", "mesa_in_proj_k"), "detr_self": ("mesa_in_proj", "mesa_in_proj_k",
                                                                        "mesa_in_proj_v"),
            "three": ("mesa_in_proj", "mesa_in_proj_k", "mesa_in_proj_v"),
            "separate_dims": ("mesa_in_proj", "mesa_in_proj_k", "mesa_in_proj_v")}


def _padding(bsz, tokens):
    return torch.arange(tokens) >= tokens - torch.arange(bsz).unsqueeze(1)  # (sample i pads its last i tokens)


CALLS = {
    "weights": lambda b, t, s, h: dict(),  # torch's default: need_weights=True, the explicit core
    "weights_per_head": lambda b, t, s, h: dict(average_attn_weights=False),
    "weights_padding": lambda b, t, s, h: dict(key_padding_mask=_padding(b, s)),  # (baddbmm: the mask inside)
    "weights_bias_3d": lambda b, t, s, h: dict(attn_mask=torch.randn(b * h, t, s), average_attn_weights=False),
    "sdpa": lambda b, t, s, h: dict(need_weights=False),
    "sdpa_padding": lambda b, t, s, h: dict(need_weights=False, key_padding_mask=_padding(b, s)),
    "sdpa_bias_3d": lambda b, t, s, h: dict(need_weights=False, attn_mask=torch.randn(b * h, t, s)),
    "sdpa_mask_2d_and_padding": lambda b, t, s, h: dict(
        need_weights=False, attn_mask=torch.rand(t, s) > 0.8, key_padding_mask=_padding(b, s)),
}


def _run(module, inputs, kwargs, seed=1):
    torch.manual_seed(seed)  # (attention dropout on: the same mask in both)
    with SavedTensorMeter() as meter:
        out, weights = module(*inputs, **kwargs)
    loss = out.square().sum() + (weights.sum() if weights is not None else 0)
    grads = torch.autograd.grad(loss, [p for p in module.parameters()] + list({id(t): t for t in inputs}.values()))
    return out, weights, meter.activation_bytes, grads


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("form", FORMS)
def test_cross_attention_is_stock_forward_with_each_input_compressed(form, call, batch_first):
    dims = dict(kdim=12, vdim=10) if form == "separate_dims" else {}
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=batch_first, **dims).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unreached, no call runs stock
        patch_model(mesa)
        inputs = _inputs(form, batch_first)
        kwargs = CALLS[call](3, 5, inputs[1].shape[1 if batch_first else 0], 2)
        want, want_w, stock_bytes, want_grads = _run(stock, inputs, kwargs)
        got, got_w, mesa_bytes, got_grads = _run(mesa, inputs, kwargs)
    assert type(mesa) is MesaMultiheadAttention
    assert torch.equal(got, want)
    assert (got_w is None and want_w is None) or torch.equal(got_w, want_w)
    for g, w in zip(got_grads, want_grads):
        assert F.cosine_similarity(g.flatten().double(), w.flatten().double(), dim=0) > 0.99
    for child in CHILDREN[form]:  # each input's projection compressed its own input
        assert getattr(mesa, child).quantizer.initialized, child
    if form == "memory":  # (key is value: one packed key/value projection, no third child runs)
        assert not mesa.mesa_in_proj_v.quantizer.initialized
    # (with dropout the map's mask and the dropped map are kept whole, as stock keeps them)
    bound = 0.45 if call.startswith("weights") else 0.35
    assert mesa_bytes < bound * stock_bytes, (mesa_bytes, stock_bytes)


def _decoder(batch_first: bool):
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, activation="gelu", batch_first=batch_first)
    return nn.TransformerDecoder(layer, num_layers=2)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_decoder_trains_bitwise_stock_with_every_child_run(batch_first):
    """nn.TransformerDecoder with a causal target mask and a memory padding mask: its self- and
    cross-attention compressed, forward bitwise stock's; the layers it knows call the self-
    attention one way, so no child is built that a step would leave idle."""
    torch.manual_seed(0)
    stock = _decoder(batch_first).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(mesa)
    tgt = torch.randn((3, 5, 16) if batch_first else (5, 3, 16))
    memory = torch.randn((3, 7, 16) if batch_first else (7, 3, 16))
    kwargs = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(5), tgt_is_causal=True,
                  memory_key_padding_mask=_padding(3, 7))
    outs = []
    for model in (stock, mesa):
        torch.manual_seed(1)
        with SavedTensorMeter() as meter:
            out = model(tgt, memory, **kwargs)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
        outs.append((out, meter.activation_bytes))
    (want, stock_bytes), (got, mesa_bytes) = outs
    assert torch.equal(got, want)
    for layer in mesa.layers:
        assert layer.self_attn.mesa_in_proj_k is None and layer.self_attn.mesa_in_proj_v is None
        assert layer.multihead_attn.mesa_in_proj_v is None and layer.multihead_attn.mesa_in_proj_k is not None
        for attn in (layer.self_attn, layer.multihead_attn):  # (need_weights=False calls: no explicit core)
            assert attn.mesa_qk is None and attn.mesa_softmax is None and attn.mesa_av is None
            layers = [c for c in attn.modules() if isinstance(c, mnn.MesaLayer)]
            idle = [type(c).__name__ for c in layers if not all(q.initialized for q in c.quantizers())]
            assert layers and not idle, idle
    for name, p in mesa.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert mesa_bytes < 0.45 * stock_bytes, (mesa_bytes, stock_bytes)


class _DetrDecoderLayer(nn.Module):
    """DETR's decoder layer (post-norm): positional embeddings added to the queries and keys,
    not to the values."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=0.1)
        self.multihead_attn = nn.MultiheadAttention(dim, heads, dropout=0.1)
        self.linear1, self.linear2 = nn.Linear(dim, 32), nn.Linear(32, dim)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, tgt, memory, pos, query_pos):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.dropout(self.self_attn(q, k, value=tgt)[0]))
        tgt2 = self.multihead_attn(query=tgt + query_pos, key=memory + pos, value=memory)[0]
        tgt = self.norm2(tgt + self.dropout(tgt2))
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout(tgt2))


def test_detr_decoder_layer_compresses_both_attentions():
    torch.manual_seed(0)
    stock = _DetrDecoderLayer().train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(mesa)
    tgt, query_pos = torch.randn(6, 2, 16), torch.randn(6, 1, 16)
    memory, pos = torch.randn(9, 2, 16), torch.randn(9, 1, 16)
    outs = []
    for model in (stock, mesa):
        torch.manual_seed(1)
        with SavedTensorMeter() as meter:
            out = model(tgt, memory, pos, query_pos)
        # (a weighted sum: the square of a LayerNorm's output sums to a constant, zero gradients)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
        outs.append((out, meter.activation_bytes, {n: p.grad for n, p in model.named_parameters()}))
    (want, stock_bytes, want_grads), (got, mesa_bytes, got_grads) = outs
    assert torch.equal(got, want)
    for n, g in want_grads.items():
        assert F.cosine_similarity(got_grads[n].flatten(), g.flatten(), dim=0) > 0.99, n
    for attn in (mesa.self_attn, mesa.multihead_attn):
        for child in ("mesa_in_proj", "mesa_in_proj_k", "mesa_in_proj_v", "out_proj"):
            assert getattr(attn, child).quantizer.initialized, child
        assert attn.mesa_qk.quantizer_a.initialized
    assert mesa_bytes < 0.45 * stock_bytes, (mesa_bytes, stock_bytes)


def test_cross_attention_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    mesa = patch_model(nn.MultiheadAttention(16, 2, batch_first=True)).train()
    twin = copy.deepcopy(mesa)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    want = mesa(x, memory, memory, need_weights=False)[0]
    want.square().sum().backward()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    got = compiled(x, memory, memory, need_weights=False)[0]
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    for (n, p), q in zip(mesa.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)
    assert twin.mesa_in_proj_k.quantizer.initialized


def test_mismatched_shapes_raise_torchs_own_error():
    """Inputs torch's function rejects take the stock forward, which raises its error."""
    mesa = patch_model(nn.MultiheadAttention(16, 2, batch_first=True)).train()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    with pytest.raises((RuntimeError, AssertionError), match="key_padding_mask|shape|expected"):
        mesa(x, memory, memory, key_padding_mask=_padding(2, 5), need_weights=False)
    with pytest.raises((RuntimeError, AssertionError)):
        mesa(x, memory, torch.randn(2, 6, 16), need_weights=False)


def test_a_self_attention_module_called_as_cross_attention_says_so():
    """An encoder layer's self_attn (built without key/value children: its layer calls it as
    self-attention) called by other code with a memory: the output is stock's, the key/value
    projection runs uncompressed, and a warning says so once."""
    class _Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)

        def forward(self, x, memory):
            return self.enc.self_attn(self.enc(x), memory, memory, need_weights=False)[0]

    torch.manual_seed(0)
    stock = _Reuse().train()
    mesa = patch_model(copy.deepcopy(stock))
    x, memory = torch.randn(5, 3, 16), torch.randn(7, 3, 16)
    with pytest.warns(UserWarning, match="ran a cross-attention call: its key projection ran uncompressed") as said:
        got = mesa(x, memory)
    assert {w.filename for w in said} == {__file__}  # (the line calling the attention, not torch's)
    assert torch.equal(got, stock(x, memory))


def test_a_placeholder_mask_with_the_causal_hint_is_compressed():
    """need_weights=False, is_causal=True, no key padding: torch drops attn_mask unread (any
    shape will do, and callers pass placeholders); the call is compressed, not run stock."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(16, 2, batch_first=True).train()
    mesa = patch_model(copy.deepcopy(stock))
    x = torch.randn(2, 6, 16)
    kwargs = dict(need_weights=False, is_causal=True, attn_mask=torch.ones(1, 1, dtype=torch.bool).triu(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = mesa(x, x, x, **kwargs)[0]
    assert torch.equal(got, stock(x, x, x, **kwargs)[0])
    assert mesa.mesa_sdpa.q_quantizer.initialized
