"""The compile path of the quantizer (``mesa_train.quant.traceable``) is bit for bit the
eager ops (``torch.ops.mesa.observe`` / ``quantize`` / ``dequantize``) when run eagerly, so
a compiled Mesa model stores the same codes as an eager one, and it traces with static
shapes (no graph break)."""
from __future__ import annotations

import itertools

import pytest
import torch

from mesa_train.quant import traceable
from kernel_marks import DTYPES

# (shape, dim, groups): channel groups dividing / not dividing D, per-head groups, dim 0
LAYOUTS = [((4, 9, 12), -1, 3), ((4, 9, 12), -1, 5), ((2, 3, 5, 7), 1, 3), ((2, 4, 6, 6), 1, 2),
           ((6, 10), 0, 4), ((3, 16), 1, 16)]


def _state(G: int, key: int = 12345, initialized: bool = False):
    return (torch.rand(G) if initialized else torch.zeros(G), torch.randn(G) if initialized else torch.zeros(G),
            torch.tensor(initialized), torch.tensor([key, 7], dtype=torch.int64))


def _both(x, G, dim, per_sample, symmetric, initialized, decay=0.9):
    """observe through the op and through the traceable path, each on its own state copy."""
    out = []
    for impl in (torch.ops.mesa.observe, traceable.observe):
        a, b, init, rng = _state(G, initialized=initialized)
        torch.manual_seed(0)
        if initialized:
            a, b = torch.rand(G) * 3, torch.randn(G)
        res = impl(x, a, b, init, rng, dim % x.dim(), G, decay, per_sample, symmetric)
        out.append((res, (a, b, init, rng)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("per_sample,symmetric,initialized", list(itertools.product((False, True), repeat=3)))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_observe_and_quantize_match_the_ops_bitwise(layout, dtype, per_sample, symmetric, initialized):
    shape, dim, G = layout
    x = (torch.randn(shape) * 3).to(dtype).contiguous()
    (op_res, op_state), (tr_res, tr_state) = _both(x, G, dim, per_sample, symmetric, initialized)
    for got, want, name in zip(tr_res + tr_state, op_res + op_state,
                               ("alpha", "beta", "seed", "alpha_est", "beta_est", "initialized", "rng")):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(_bits(got), _bits(want)), f"{name}: {got} vs {want}"
    alpha, beta, seed = op_res
    for stochastic in (False, True):
        q_op = torch.ops.mesa.quantize(x, alpha, beta, dim % x.dim(), G, stochastic, seed)
        q_tr = traceable.quantize(x, alpha, beta, dim % x.dim(), G, stochastic, seed)
        assert torch.equal(q_op, q_tr), f"stochastic={stochastic}"
        for out in DTYPES:
            d_op = torch.ops.mesa.dequantize(q_op, alpha, beta, dim % x.dim(), G, out)
            d_tr = traceable.dequantize(q_op, alpha, beta, dim % x.dim(), G, out)
            assert torch.equal(d_op, d_tr), out


def test_non_finite_and_signed_zero_batches_match():
    x = torch.zeros(4, 8)
    x[0, 0] = -0.0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    for per_sample, symmetric in itertools.product((False, True), repeat=2):
        (op_res, op_state), (tr_res, tr_state) = _both(x, 2, 1, per_sample, symmetric, initialized=True)
        for got, want in zip(tr_res + tr_state, op_res + op_state):
            assert torch.equal(_bits(got), _bits(want))


def test_seed_step_advances_counter_and_differs_per_key():
    rng_a = torch.tensor([1, 0], dtype=torch.int64)
    rng_b = torch.tensor([2, 0], dtype=torch.int64)
    s0, s1 = traceable.seed_step(rng_a), traceable.seed_step(rng_a)
    assert rng_a.tolist() == [1, 2] and not torch.equal(s0, s1)
    assert not torch.equal(traceable.seed_step(rng_b), s0)
    wrap = torch.tensor([1, 0xFFFFFFFF], dtype=torch.int64)
    traceable.seed_step(wrap)
    assert wrap.tolist() == [1, 0]
    assert all(0 <= int(v) < 2**32 for v in torch.cat([s0, s1]))


def test_traces_without_graph_break():
    def step(x, a, b, init, rng):
        alpha, beta, seed = traceable.observe(x, a, b, init, rng, 2, 3, 0.9, False, False)
        q = traceable.quantize(x, alpha, beta, 2, 3, True, seed)
        return traceable.dequantize(q, alpha, beta, 2, 3, torch.float32)

    x = torch.randn(2, 5, 12)
    report = torch._dynamo.explain(step)(x, *_state(3))
    assert report.graph_break_count == 0 and report.graph_count == 1


# seed words with the top bit set, zero, all ones, and ordinary ones: the int32 hash must
# reproduce the reference's uint32 arithmetic for every one of them
EDGE_SEEDS = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0x80000000, 0x7FFFFFFF), (0xDEADBEEF, 0x12345678), (1, 0x9E3779B9)]


@pytest.mark.parametrize("seed", EDGE_SEEDS, ids=lambda s: f"{s[0]:x}-{s[1]:x}")
def test_int32_hash_equals_the_reference_hash(seed):
    from mesa_train.quant.reference import lowbias32, uniform_from_hash

    words = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, seed[0], seed[1]], dtype=torch.int64)
    got = traceable._lowbias32_i32(traceable._as_int32_bits(words))
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, lowbias32(words))
    n = 4099  # not a multiple of any vector width
    t = torch.tensor(seed, dtype=torch.int64)
    assert torch.equal(traceable._uniform(n, t, "cpu"), uniform_from_hash(n, t))


def test_int32_hash_under_inductor_equals_eager():
    """Inductor's generated C++ (vectorised and tail loops) wraps int32 products as eager does."""
    seed = torch.tensor(EDGE_SEEDS[2], dtype=torch.int64)
    fn = torch.compile(lambda s: traceable._uniform(4099, s, "cpu"), backend="inductor", fullgraph=True)
    assert torch.equal(fn(seed), traceable._uniform(4099, seed, "cpu"))


def _unfolded_size(fn, *args) -> int:
    """Nodes of ``fn``'s aten graph unfolded into a tree: a node counted once per path to the
    output. Inductor traces an unrealized pointwise input once per read of it, so this is the
    work its lowering does for the traced compression (``traceable._uniform``'s docstring)."""
    import functools

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn)(*args)

    @functools.lru_cache(maxsize=None)
    def size(node):
        return 1 + sum(size(a) for a in node.all_input_nodes)

    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return sum(size(a) for a in out.all_input_nodes)


def test_traced_hash_graph_unfolds_to_a_bounded_tree():
    """The seed words are converted reading each once, and the runtime zero in the Weyl step is
    made of a seed word, not of the key (``key ^ key`` read the two nested ``lowbias32`` of the
    key twice more). torch 2.14: 16,759 nodes unfolded before, 5,583 after; a traced GELU's
    fake-H100 census 2.3x faster. A regression to either form fails here."""
    seed = torch.tensor(EDGE_SEEDS[3], dtype=torch.int64)
    words = torch.tensor([0, 0x80000000, 0xFFFFFFFF], dtype=torch.int64)
    assert _unfolded_size(traceable._as_int32_bits, words) <= 4  # xor, sub, cast: one read
    assert _unfolded_size(lambda s: traceable._uniform(4099, s, "cpu"), seed) <= 6000


def test_weyl_product_is_a_value_not_an_index_expression():
    """The Weyl step's multiply must not take ``arange`` directly: Inductor folds
    ``arange * 0x9E3779B9`` into index arithmetic, and on CUDA (torch 2.11, H200) Triton then
    refused a stride product past int32 ('Scalar -5354694904128 is out of range for type
    int32'; results/cuda-tests/NVIDIA-H200.md). The runtime zero added to the index keeps
    the product a wrapping int32 value. CPU Inductor indexes in int64 and never showed it, so
    this pins the traced graph's shape instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seed = torch.tensor(EDGE_SEEDS[3], dtype=torch.int64)
    gm = make_fx(lambda s: traceable._uniform(4099, s, "cpu"))(seed)
    weyl = 0x9E3779B9 - (1 << 32)  # the constant as the int32 graph holds it
    (mul,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor and weyl in n.args[1:]]
    index = mul.args[0]
    if index.target == torch.ops.aten.__rshift__.Scalar:  # the pair's index, i >> 1, of the value i
        index = index.args[0]
    aranges = [a for a in index.args if getattr(a, "target", None) == torch.ops.aten.arange.default]
    others = [a for a in index.args if getattr(a, "target", None) not in (None, torch.ops.aten.arange.default)]
    # add(arange, <a tensor computed from the seed>), never mul(arange, ...) nor add(arange, constant)
    assert index.target == torch.ops.aten.add.Tensor and len(aranges) == 1 and others, gm.code


def _edge_codes_input(top: float, seed: torch.Tensor) -> torch.Tensor:
    """(2, 16 * 4099) float32: group 0 cycles through values at every edge of the codes (NaN,
    +-inf, signed zeros, just below 0, -1 and -0.5, the top code and just below and above it),
    each paired with many hash values; the top itself where ``u`` is its largest, ``1 - 2**-16``,
    so that ``top + u`` is the float32 just below ``top + 1`` (exact: 16-bit u on the float32
    grid of ``[128, 256)``; with the 24-bit u before 2026-11-30 it rounded up to ``top + 1``);
    group 1 the same values with ``alpha`` 0 (``inv`` 0: ``inf * 0`` is NaN)."""
    below = torch.nextafter(torch.tensor(top), torch.tensor(0.0)).item()
    edges = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1e-30, -0.25, -0.5, -0.75, -1.0, -2.5,
             0.5, 1.0, top - 1.5, below, top, top + 0.25, top + 1.0]
    n = 16 * 4099
    vals = torch.tensor(edges, dtype=torch.float32).repeat(n // len(edges) + 1)[:n]
    x = torch.stack([vals, vals.roll(7)])
    largest = traceable._uniform(x.numel(), seed, "cpu") == 1 - 2**-16
    x.view(-1)[largest] = top
    assert largest[:n].any(), seed
    return x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_codes_at_every_edge_match_the_op(stochastic, compiled):
    """NaN -> 0, negatives -> 0, past the top -> the top, and ``v + u`` rounding up past the
    top in float32, for the codes the traced quantize makes (8 bits and packed 4 bits), eager
    and under CPU Inductor: bitwise the ops'. The traced form has no ``isnan`` and no floor
    (``traceable._clamp_codes``, ``quantize``); the op applies the definition as written
    (``where(isnan, 0, floor(v + u)).clamp``). The values before the uint8 cast are finite and
    in range (a NaN or 256 cast to uint8 is undefined; x86 and CUDA happen to give 0 for both,
    so the codes alone would not show it)."""
    seed = torch.tensor([0, 0], dtype=torch.int64)
    quantize, quantize_bits = traceable.quantize, traceable.quantize_bits
    if compiled:
        quantize = torch.compile(quantize, backend="inductor", fullgraph=True)
        quantize_bits = torch.compile(quantize_bits, backend="inductor", fullgraph=True)
    # alpha = top, beta = 0: inv = top / alpha = 1 exactly, so v is x itself; group 1 alpha 0
    x = _edge_codes_input(255.0, seed)
    alpha, beta = torch.tensor([[255.0, 0.0]]), torch.zeros(1, 2)
    got = quantize(x, alpha, beta, 0, 2, stochastic, seed)
    want = torch.ops.mesa.quantize(x, alpha, beta, 0, 2, stochastic, seed)
    assert torch.equal(got, want), (got != want).nonzero()[:8]
    assert want[0].max() == 255 and (want[0] == 0).any()  # the edges were reached
    u = traceable._uniform(x.numel(), seed, "cpu").view(x.shape) if stochastic else None
    values = traceable._clamp_codes(x if u is None else x + u, 255.0)
    assert values.isfinite().all() and values.min() >= 0 and values.max() <= 255
    x = _edge_codes_input(15.0, seed)
    alpha = torch.tensor([[15.0, 0.0]])
    got = quantize_bits(x, alpha, beta, 0, 2, 4, False, stochastic, seed)
    want = torch.ops.mesa.quantize_bits(x, alpha, beta, 0, 2, 4, False, stochastic, seed)
    assert torch.equal(got, want), (got != want).nonzero()[:8]
