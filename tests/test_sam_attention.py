"""SAM's decomposed relative-position attention (``patch/sam.py``, ``nn/sdpa_query_bias.py``):
the forward stays timm's bit for bit, nothing of size N x N is kept for backward, and the
gradients (the position tables' and the queries' share through the bias included) are those
of the attention at the dequantized q, k, v."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from timm.models import vision_transformer_sam as sam

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.memory_compiled import compiled_saved_tensors
from mesa_train.nn.quantizer import decompress
from mesa_train.nn import QueryBias
from mesa_train.patch import patch_model
from mesa_train.patch.sam import MesaSamAttention

sys.path.insert(0, str(Path(__file__).parent))
from source_lines import code_lines  # noqa: E402
from timm_zoo import build, example  # noqa: E402

DIM, HEADS, GRID = 32, 2, 6  # N = 36 tokens


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def test_mesa_forward_is_timms_but_the_attention_call():
    """A timm release that changes SAM's attention forward fails here (then update patch/sam.py)."""
    stock, mesa = code_lines(sam.Attention.forward), code_lines(MesaSamAttention.forward)
    mesa = mesa[mesa.index("return super().forward(x)") + 1:]  # after the branch to the stock forward
    cut = stock.index("q, k = self.q_norm(q), self.k_norm(k)") + 1
    resume = stock.index("x = x.view(B, self.num_heads, N, -1).transpose(1, 2).reshape(B, N, -1)")
    assert mesa[:cut] == stock[:cut]
    assert mesa[-(len(stock) - resume):] == stock[resume:]
    middle = " ".join(stock[cut:resume])
    assert "get_decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W))" in middle
    assert "dropout_p=self.attn_drop.p if self.training else 0.," in middle
    assert mesa[cut:-(len(stock) - resume)] == [
        "bias = QueryBias(functools.partial(_rel_pos_bias, size=(H, W)), (self.rel_pos_h, self.rel_pos_w))",
        "x = self.mesa_sdpa(q, k, v, dropout_p=self.attn_drop.p if self.training else 0., query_bias=bias)"]


def _attention(attn_drop=0.0, seed=0):
    torch.manual_seed(seed)
    attn = sam.Attention(DIM, num_heads=HEADS, use_rel_pos=True, input_size=(GRID, GRID), attn_drop=attn_drop)
    with torch.no_grad():  # timm starts the tables at zero: a bias of zero tests nothing
        attn.rel_pos_h.normal_(0, 0.5)
        attn.rel_pos_w.normal_(0, 0.5)
    return attn.train()


def _x(batch=3, seed=1):
    return torch.randn(batch, GRID, GRID, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn_drop,fused", [(0.0, True), (0.2, True), (0.0, False)],
                         ids=["fused", "fused-dropout", "explicit"])
def test_forward_bitwise_and_gradients_close(attn_drop, fused):
    """``fused=False``: the explicit path runs timm's forward under the generic routing."""
    stock = _attention(attn_drop)
    stock.fused_attn = fused
    patched = patch_model(copy.deepcopy(stock), ops=["sdpa", "matmul", "softmax"], attention="auto")
    assert type(patched) is MesaSamAttention
    x = _x()
    grad = torch.randn(3, GRID, GRID, DIM, generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (stock, patched):
        torch.manual_seed(5)  # the same dropout mask for both: Mesa draws nothing from the global stream
        y = model(x)
        y.backward(grad)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    ran = patched.mesa_sdpa.q_quantizer if fused else patched.mesa_softmax.quantizer  # the path taken
    assert bool(ran.initialized.all())
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        # with a dropout mask the backward must replay it: a fresh mask gives cosines near 0.8
        assert _cos(p.grad, q.grad) > 0.999, name


def test_nothing_of_size_n_by_n_is_kept():
    stock = _attention()
    patched = patch_model(copy.deepcopy(stock))  # all ops: the qkv and proj Linears keep int8 inputs too
    n = GRID * GRID
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        patched(_x())
    assert shapes and not [s for s in shapes if s[-2:] == (n, n)], shapes
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stock(_x())
    assert [s for s in shapes if s[-2:] == (n, n)], "the stock bias no longer reaches sdpa: test is moot"
    with SavedTensorMeter(stock) as s_meter:
        stock(_x())
    with SavedTensorMeter(patched) as p_meter:
        patched(_x())
    # int8 q, k, v and Linear inputs (plus statistics) against float32 ones, the bias, output and lse
    assert p_meter.activation_bytes < 0.2 * s_meter.activation_bytes


def test_bf16_autocast_forward_bitwise():
    stock = _attention()
    patched = patch_model(copy.deepcopy(stock), ops=["sdpa"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, yp = stock(_x()), patched(_x())
        yp.float().sum().backward()
    assert ys.dtype == yp.dtype == torch.bfloat16
    assert torch.equal(ys, yp)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in patched.parameters())


def test_eval_and_disabled_are_stock():
    stock = _attention()
    patched = patch_model(copy.deepcopy(stock), ops=["sdpa"], enabled=False)
    x = _x()
    stock(x).sum().backward()
    patched(x).sum().backward()
    for p, q in zip(stock.parameters(), patched.parameters()):
        assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        assert torch.equal(stock.eval()(x), patched.eval()(x))


def test_layer_gradient_is_the_attentions_at_the_dequantized_inputs():
    """The layer's own gradient, q's share through the bias included: the reference is autograd
    through the stock call at the q, k, v the backward restores (the same codes, dequantized)."""
    torch.manual_seed(0)
    layer = mn.ScaledDotProductAttention(num_groups=2).train()
    bh, n, d, g = 4, 9, 8, 3
    q, k, v = (torch.randn(bh, n, d, requires_grad=True) for _ in range(3))
    table = torch.randn(g, g, d, requires_grad=True)

    def fn(q, table):  # depends on q and on a parameter, like SAM's
        qr = q.reshape(bh, g, g, d)
        rel = torch.einsum("bhwc,hkc->bhwk", qr, table)
        return (rel[..., None] + rel[..., None, :]).reshape(bh, n, g * g)

    before = copy.deepcopy(layer)  # its quantizers' state (estimates, rounding counter) before the call
    out = layer(q, k, v, query_bias=QueryBias(fn, (table,)))
    grad = torch.randn_like(out)
    out.backward(grad)
    restored = [decompress(quantizer.compress(t.detach(), t.dim() - 1), t.dtype)  # the codes the call kept
                for quantizer, t in ((before.q_quantizer, q), (before.k_quantizer, k), (before.v_quantizer, v))]
    leaves = [t.requires_grad_() for t in restored] + [table.detach().requires_grad_()]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=fn(leaves[0], leaves[3]))
    expected = torch.autograd.grad(ref, leaves, grad)
    for got, want in zip((q.grad, k.grad, v.grad, table.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_query_bias_argument_errors():
    layer = mn.ScaledDotProductAttention(num_groups=1).train()
    q = torch.randn(2, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask and window_mask must be None"):
        layer(q, q, q, attn_mask=torch.zeros(4, 4), query_bias=QueryBias(lambda q: q[..., :4]))
    with pytest.raises(TypeError, match=r"QueryBias\(fn, inputs\)"):
        layer(q, q, q, query_bias=lambda q: q[..., :4])


def test_zoo_samvit_compiles_fullgraph_bitwise_eager_mesa():
    """Compiled, the backward rebuilds the bias from the dequantized q too (``torch.func.vjp``
    of the bias function, traced, and the attention's op): no graph break, forward and
    gradients bitwise eager Mesa's, and no N x N tensor kept."""
    stock = build("samvit_base_patch16")
    with torch.no_grad():  # timm starts the tables at zero: q's share through the bias would be zero
        for name, p in stock.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 0.5)
    patched = patch_model(copy.deepcopy(stock))
    assert sum(type(m) is MesaSamAttention for m in patched.modules()) == 2
    x = example("samvit_base_patch16")
    compiled = copy.deepcopy(patched)  # the quantizer state the eager call starts from
    y = patched(x)
    assert torch.equal(stock(x), y)
    y.sum().backward()
    yc, kept = compiled_saved_tensors(compiled, x)
    assert torch.equal(yc, y)
    yc.sum().backward()
    for (name, p), c in zip(patched.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, c.grad), name
    n = x.shape[-1] // 16
    n *= n
    assert kept and not [k for k in kept if k.shape[-2:] == (n, n)], kept
    _, stock_kept = compiled_saved_tensors(copy.deepcopy(stock), x)
    assert [k for k in stock_kept if k.shape[-2:] == (n, n)], "compiled stock keeps no bias: test is moot"


@pytest.mark.parametrize("q_grad,table_grad", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["all", "frozen-table", "frozen-q", "kv-only"])
def test_compiled_layer_gradients_equal_eager(q_grad, table_grad):
    """The compiled backward's two halves (the attention's op, the bias function's vjp) give
    eager's gradients for each set of inputs that want one (a frozen table: no table
    gradient; q frozen: the bias's gradient still reaches the table)."""
    torch.manual_seed(0)
    layer = mn.ScaledDotProductAttention(num_groups=2).train()
    bh, g, d = 4, 3, 8
    n = g * g

    def fn(q, table):
        rel = torch.einsum("bhwc,hkc->bhwk", q.reshape(bh, g, g, d), table)
        return (rel[..., None] + rel[..., None, :]).reshape(bh, n, n)

    inputs = [torch.randn(bh, n, d) for _ in range(3)] + [torch.randn(g, g, d)]
    grad = torch.randn(bh, n, d)
    twin = copy.deepcopy(layer)  # the same quantizer state for the compiled call
    results = []
    for run in (lambda *a: layer(*a[:3], query_bias=QueryBias(fn, a[3:])),
                torch.compile(lambda *a: twin(*a[:3], query_bias=QueryBias(fn, a[3:])), backend="aot_eager",
                              fullgraph=True)):
        leaves = [t.clone().requires_grad_(w) for t, w in zip(inputs, (q_grad, True, True, table_grad))]
        out = run(*leaves)
        out.backward(grad)
        results.append((out, [t.grad for t in leaves]))
    (eager_out, eager_grads), (compiled_out, compiled_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    for name, e, c in zip("qkvt", eager_grads, compiled_grads):
        assert (e is None) == (c is None), name
        if e is not None:
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("attn_drop,autocast", [(0.2, False), (0.0, True)], ids=["dropout", "bf16-autocast"])
def test_compiled_attention_matches_eager_mesa(attn_drop, autocast):
    """Dropout: the call runs eagerly inside the compiled model (its backward replays the mask
    from the captured RNG state, which cannot be traced), so forward and gradients are eager's.
    bf16 autocast: the compiled backward rebuilds the bias and recomputes the attention in the
    forward's autocast state."""
    stock = _attention(attn_drop)
    eager = patch_model(copy.deepcopy(stock), ops=["sdpa"])
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=not attn_drop)
    x = _x()
    outs = []
    for model in (eager, compiled):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
            y.float().sum().backward()
        outs.append(y)
    assert outs[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(outs[0], outs[1])
    for (name, p), c in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(c.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
