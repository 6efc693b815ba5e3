"""``mesa::observe`` (group_minmax + update_estimates + the seed step in one op) and
``mesa::quantize`` with a device seed tensor.

The contract (DESIGN.md, "Quantization ops"): observe's ``(alpha, beta)`` and its buffer
updates are bit-identical to ``update_estimates(*group_minmax(x, ...), valid=x.numel() > 0)``;
its seed is ``[lowbias32(counter ^ k), lowbias32(seed_lo ^ k ^ 0x68E31DA4)]`` with
``k = lowbias32(key)`` for ``rng = [key, counter]``, whose counter then advances by one
modulo 2**32 in place. Compared as bit patterns (NaN payloads and zero signs count).
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import EXT_DEVICES as DEVICES, DT_IDS, DTYPES, needs_cuda

M32 = 0xFFFFFFFF

# (shape, dim, G): channel groups, per-head groups, G not dividing D, dim 0, 1-D, G == D,
# and shapes large enough for many CUDA blocks (the last-block estimate update)
LAYOUTS = [
    ((2, 9, 24), -1, 3),
    ((2, 3, 7, 7), 1, 3),
    ((3, 10, 4, 5), 1, 4),
    ((2, 7, 13), -1, 5),
    ((5, 6), 0, 3),
    ((11,), 0, 4),
    ((3, 5, 7, 11), 2, 7),
    ((1, 1, 1), -1, 1),
    ((16, 197, 96), -1, 6),
    ((8, 6, 65, 67), 1, 6),
    ((40, 3, 3), 0, 7),
]
LAYOUT_IDS = [f"{'x'.join(map(str, s))}-d{d}-g{g}" for s, d, g in LAYOUTS]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _randn(shape, dtype, seed=0, kind="finite"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 0.5
    flat = x.view(-1)
    if kind == "nan" and flat.numel():
        flat[flat.numel() // 3] = float("nan")
    elif kind == "inf" and flat.numel():
        flat[-1] = float("-inf")
    elif kind == "constant":
        x = torch.full(shape, 1.25)
    return x.to(dtype)


def _state(G_buf, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return [torch.rand(G_buf, generator=g) * 4, torch.randn(G_buf, generator=g), torch.tensor(False)]


def _reference_chain(x, state, rng, dim, G, decay, per_sample, symmetric):
    """The contract: the reference group_minmax + update_estimates + seed step, on CPU."""
    a, b, init = state
    mn, mx = R.group_minmax(x, dim, G, per_sample)
    alpha, beta = R.update_estimates(mn, mx, a, b, init, decay, per_sample, symmetric, x.numel() > 0)
    return alpha, beta, R.seed_step(rng)


def _compare_observe(x, dim, G, per_sample, symmetric, device, steps=2, decay=0.7, G_buf=None):
    """`steps` calls of the kernel on `device` vs the reference chain on CPU (before and
    after initialisation): outputs, buffers, flag and rng all bit-identical."""
    G_buf = G_buf or G + 1
    want_state = _state(G_buf)
    got_state = [t.clone().to(device) for t in want_state]
    want_rng = torch.tensor([0x9E3779B9, 17], dtype=torch.int64)
    got_rng = want_rng.clone().to(device)
    for step in range(steps):
        xs = x * (step + 1) if x.is_floating_point() and step else x
        got = torch.ops.mesa.observe(xs.to(device), *got_state, got_rng, dim, G, decay, per_sample, symmetric)
        want = _reference_chain(xs, want_state, want_rng, dim, G, decay, per_sample, symmetric)
        for name, g_, w in zip(("alpha", "beta", "seed"), got, want):
            assert g_.device.type == torch.device(device).type and g_.dtype == w.dtype and g_.shape == w.shape, name
            assert torch.equal(_bits(g_), _bits(w)), f"step {step} {name}: {g_} != {w}"
        for name, g_, w in zip(("alpha_est", "beta_est", "initialized", "rng"), (*got_state, got_rng),
                               (*want_state, want_rng)):
            assert torch.equal(_bits(g_), _bits(w)), f"step {step} {name}: {g_} != {w}"


# ----------------------------------------------------------------------------- vs reference
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_sample,symmetric", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["shared", "per_sample", "symmetric", "per_sample-symmetric"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,dim,G", LAYOUTS, ids=LAYOUT_IDS)
def test_observe_matches_reference_chain(shape, dim, G, dtype, per_sample, symmetric, device):
    _compare_observe(_randn(shape, dtype, seed=len(shape) + G), dim, G, per_sample, symmetric, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["nan", "inf", "constant"])
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per_sample"])
def test_observe_specials(kind, per_sample, device):
    for shape, dim, G in (((4, 9, 24), -1, 5), ((6, 3, 40, 41), 1, 3)):
        for symmetric in (False, True):
            _compare_observe(_randn(shape, torch.bfloat16, seed=3, kind=kind), dim, G, per_sample, symmetric, device,
                             steps=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dim", [((0, 8), -1), ((3, 0, 4), 1), ((0, 5, 6), 0)])
def test_observe_empty(shape, dim, device):
    """valid = False: the estimates stay, the seed step still happens."""
    for per_sample in (False, True):
        _compare_observe(torch.empty(shape), dim, 2, per_sample, False, device)


@pytest.mark.parametrize("device", DEVICES)
def test_observe_non_contiguous_input(device):
    base = _randn((3, 16, 10), torch.float16, seed=4)
    for x, dim, G in ((base.transpose(1, 2), 1, 5), (base[:, ::2, :], -1, 3),
                      (base.to(memory_format=torch.contiguous_format)[..., 1:], 1, 4)):
        assert not x.is_contiguous() or x.storage_offset()
        for per_sample in (False, True):
            _compare_observe(x, dim, G, per_sample, False, device)


@pytest.mark.parametrize("device", DEVICES)
def test_observe_equals_the_two_op_kernels(device):
    """observe == the kernels' own group_minmax + update_estimates (same device)."""
    x = _randn((4, 6, 21, 19), torch.bfloat16, seed=9).to(device)
    for dim, G, per_sample in ((1, 6, False), (1, 3, True), (-1, 4, True), (0, 2, True)):
        s1 = [t.to(device) for t in _state(G + 2)]
        s2 = [t.clone() for t in s1]
        for _ in range(2):
            mn, mx = torch.ops.mesa.group_minmax(x, dim, G, per_sample)
            want = torch.ops.mesa.update_estimates(mn, mx, *s1, 0.9, per_sample, True, True)
            got = torch.ops.mesa.observe(x, *s2, Q.rng_state(1, device=device), dim, G, 0.9, per_sample, True)
            for g_, w in zip(got[:2], want):
                assert torch.equal(_bits(g_), _bits(w))
            for g_, w in zip(s2, s1):
                assert torch.equal(_bits(g_), _bits(w))


# ----------------------------------------------------------------------------- seed step
def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def _seed_step_ints(key: int, counter: int) -> tuple[int, int]:
    k = _lowbias32(key)
    lo = _lowbias32(counter ^ k)
    return lo, _lowbias32(lo ^ k ^ 0x68E31DA4)


def test_seed_step_python_ints_pinned():
    """The Python-int spec itself, pinned to literal values (so a changed hash fails)."""
    # lowbias32(1) by hand: 1 ^ (1 >> 16) = 1; * 0x7FEB352D = 0x7FEB352D; ^ (>> 15 = 0xFFD6)
    # = 0x7FEBCAFB; * 0x846CA68B mod 2**32 = 0x6889F849; ^ (>> 16 = 0x6889) = 0x688990C0
    assert _lowbias32(0) == 0 and _lowbias32(1) == 0x688990C0
    assert R.lowbias32(torch.tensor([1, 0x12345678])).tolist() == [0x688990C0, 0xF5E71C96]
    # k = lowbias32(0x12345678) = 0xF5E71C96; lo = lowbias32(7 ^ k); hi = lowbias32(lo ^ k ^ 0x68E31DA4)
    assert _seed_step_ints(0x12345678, 7) == (0xF970E808, 0x30BBFB28)
    assert _seed_step_ints(0, 0) != _seed_step_ints(0, 1) != _seed_step_ints(1, 0)


@pytest.mark.parametrize("device", DEVICES + [pytest.param("cpu-reference")])
def test_seed_step_values_and_counter(device):
    impl_name = "reference" if device == "cpu-reference" else "kernel"
    device = "cpu" if device == "cpu-reference" else device
    fn = R.observe if impl_name == "reference" else torch.ops.mesa.observe
    x = torch.randn(2, 8, device=device)
    state = [torch.zeros(2, device=device), torch.zeros(2, device=device), torch.tensor(False, device=device)]
    assert _seed_step_ints(0x12345678, 7) == (0xF970E808, 0x30BBFB28)  # the hand-computed example
    for key, counter in ((0x12345678, 7), (0, 0), (M32, M32 - 1), (0xDEADBEEF, M32)):
        rng = torch.tensor([key, counter], dtype=torch.int64, device=device)
        ptr = rng.data_ptr()
        _, _, seed = fn(x, *state, rng, -1, 2, 0.9, False, False)
        lo, hi = _seed_step_ints(key, counter)
        assert seed.dtype == torch.int64 and seed.shape == (2,) and seed.device == rng.device
        assert seed.tolist() == [lo, hi]
        assert seed.data_ptr() != rng.data_ptr()  # fresh output, never an alias of rng
        # rng mutated in place: same storage, key kept, counter + 1 modulo 2**32 (wraps at 2**32)
        assert rng.data_ptr() == ptr and rng.tolist() == [key, (counter + 1) & M32]
    # consecutive calls give consecutive counters, hence different seeds
    rng = Q.rng_state(5, device=device)
    seeds = [tuple(fn(x, *state, rng, -1, 2, 0.9, False, False)[2].tolist()) for _ in range(4)]
    assert seeds == [_seed_step_ints(5, c) for c in range(4)] and len(set(seeds)) == 4
    assert rng.tolist() == [5, 4]


def test_rng_state_helper():
    assert Q.rng_state(-1, 2**32 + 3).tolist() == [M32, 3]
    assert Q.seed_tensor(-1).tolist() == [M32, M32]
    assert Q.seed_tensor((7 << 32) | 9).tolist() == [9, 7]


# ----------------------------------------------------------------------------- quantize seeds
@pytest.mark.parametrize("device", DEVICES)
def test_quantize_tensor_seed_equals_int_seed_bytes(device):
    """For a 64-bit seed s, [s & M, (s >> 32) & M] gives exactly the int-seed bytes (the
    reference's int path is the pre-tensor definition, pinned by test_kernels' hash test)."""
    x = _randn((4, 33, 17), torch.float16, seed=6).to(device)
    mn, mx = R.group_minmax(x.cpu(), 1, 3, True)
    a, b = (mx - mn).to(device), mn.to(device)
    for s in (0, 1, 42 + (1 << 32), 2**63 - 1, -5, 0xFFFFFFFF, 1 << 32):
        want = R.quantize(x.cpu(), a.cpu(), b.cpu(), 1, 3, True, s)
        seed = torch.tensor([s & M32, (s >> 32) & M32], dtype=torch.int64, device=device)
        assert torch.equal(torch.ops.mesa.quantize(x, a, b, 1, 3, True, seed).cpu(), want), s
        assert torch.equal(Q.quantize(x, a, b, 1, 3, True, s).cpu(), want), s
        assert torch.equal(Q.quantize(x, a, b, 1, 3, True, seed).cpu(), want), s
        assert torch.equal(R.quantize(x.cpu(), a.cpu(), b.cpu(), 1, 3, True, seed.cpu()), want), s
    # a non-contiguous seed view is read with its stride
    both = torch.tensor([[5, 0], [9, 0]], dtype=torch.int64, device=device)[:, 0]
    assert torch.equal(torch.ops.mesa.quantize(x, a, b, 1, 3, True, both).cpu(),
                       R.quantize(x.cpu(), a.cpu(), b.cpu(), 1, 3, True, (9 << 32) | 5))


@pytest.mark.parametrize("device", DEVICES)
def test_observe_then_quantize_chain(device):
    """The two-op compression (observe's seed feeds quantize) == the reference chain."""
    x = _randn((4, 6, 30, 31), torch.bfloat16, seed=2)
    st_k = [t.to(device) for t in _state(6)]
    st_r = _state(6)
    rng_k, rng_r = Q.rng_state(99, device=device), Q.rng_state(99)
    for _ in range(3):
        a, b, seed = torch.ops.mesa.observe(x.to(device), *st_k, rng_k, 1, 6, 0.9, False, False)
        q = torch.ops.mesa.quantize(x.to(device), a, b, 1, 6, True, seed)
        ra, rb, rseed = R.observe(x, *st_r, rng_r, 1, 6, 0.9, False, False)
        assert torch.equal(q.cpu(), R.quantize(x, ra, rb, 1, 6, True, rseed))


# ----------------------------------------------------------------------------- torch.library
def _observe_opcheck_cases(device):
    x = _randn((2, 3, 5, 8), torch.float16).to(device)
    xg = torch.randn(4, 6, 10, device=device, requires_grad=True)

    def st(G):
        return [torch.zeros(G + 1, device=device), torch.zeros(G + 1, device=device),
                torch.tensor(False, device=device), Q.rng_state(3, device=device)]

    return [
        (torch.ops.mesa.observe.default, (x, *st(3), 1, 3, 0.9, True, False)),
        (torch.ops.mesa.observe.default, (x, *st(2), -1, 2, 0.5, False, True)),
        (torch.ops.mesa.observe.default, (xg, *st(4), -1, 4, 0.9, False, False)),
        (torch.ops.mesa.quantize.default, (x, torch.ones(1, 3, device=device), torch.zeros(1, 3, device=device), 1, 3,
                                           True, Q.seed_tensor(7, device))),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _observe_opcheck_cases(device):
        opcheck(op, args)


def test_opcheck_reference_fallback_schema():
    """The Python-side fake matches the reference's shapes (what torch.compile traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 4, 10)
        out = torch.ops.mesa.observe(x, torch.zeros(5), torch.zeros(5), torch.tensor(False),
                                     torch.zeros(2, dtype=torch.int64), 1, 4, 0.9, True, False)
        assert [tuple(t.shape) for t in out] == [(3, 4), (3, 4), (2,)]
        assert [t.dtype for t in out] == [torch.float32, torch.float32, torch.int64]


def test_observe_under_torch_compile():
    def f(x, a, b, init, rng):
        alpha, beta, seed = torch.ops.mesa.observe(x, a, b, init, rng, -1, 2, 0.9, False, False)
        return torch.ops.mesa.quantize(x, alpha, beta, -1, 2, True, seed)

    x = torch.randn(3, 5, 8)
    s1 = [torch.zeros(2), torch.zeros(2), torch.tensor(False), Q.rng_state(4)]
    s2 = [t.clone() for t in s1]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        assert torch.equal(compiled(x, *s1), f(x, *s2))
    for a, b in zip(s1, s2):
        assert torch.equal(a, b)
    assert s1[3].tolist() == [4, 2]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("impl", ["wrapper", "op", "reference"])
def test_observe_invalid_arguments(impl):
    fn = {"wrapper": Q.observe, "op": torch.ops.mesa.observe, "reference": R.observe}[impl]
    x = torch.randn(2, 3, 8)
    a, b, init, rng = torch.zeros(2), torch.zeros(2), torch.tensor(False), Q.rng_state(1)

    def call(**kw):
        args = dict(x=x, alpha_est=a, beta_est=b, initialized=init, rng=rng, dim=-1, num_groups=2, decay=0.9,
                    per_sample=False, symmetric=False)
        args.update(kw)
        return fn(*args.values())

    bad = [
        (dict(rng=rng.to(torch.int32)), "rng.*int64 tensor of shape \\(2,\\)"),
        (dict(rng=torch.zeros(3, dtype=torch.int64)), "rng.*int64 tensor of shape \\(2,\\)"),
        (dict(rng=torch.zeros(1, 2, dtype=torch.int64)), "rng.*int64 tensor of shape \\(2,\\)"),
        (dict(rng=torch.zeros(2, dtype=torch.int64, device="meta")), "rng.*is on meta"),
        (dict(alpha_est=torch.zeros(1)), "alpha_est.*G_buf >= 2"),
        (dict(beta_est=torch.zeros(2, dtype=torch.float64)), "beta_est.*float32"),
        (dict(initialized=torch.tensor([True, False])), "initialized.*one-element bool"),
        (dict(decay=1.0), "decay.*\\[0, 1\\)"),
        (dict(dim=3), "dim 3 out of range"),
        (dict(num_groups=9), "num_groups=9 must be in \\[1, 8\\]"),
        (dict(x=x.double()), "float32, float16 and bfloat16"),
        (dict(x=torch.tensor(1.0), dim=0, num_groups=1), "at least one dimension"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call(**kw)
    assert rng.tolist() == [1, 0] and not bool(init)  # nothing was mutated by a rejected call


@pytest.mark.parametrize("impl", ["wrapper", "op", "reference"])
def test_quantize_invalid_seed(impl):
    fn = {"wrapper": Q.quantize, "op": torch.ops.mesa.quantize, "reference": R.quantize}[impl]
    x, a, b = torch.randn(2, 8), torch.ones(1, 2), torch.zeros(1, 2)
    for seed, msg in ((torch.zeros(2, dtype=torch.int32), "seed.*int64 tensor of shape \\(2,\\)"),
                      (torch.zeros(3, dtype=torch.int64), "seed.*int64 tensor of shape \\(2,\\)"),
                      (torch.zeros(2, dtype=torch.int64, device="meta"), "seed.*is on meta")):
        with pytest.raises(ValueError, match=msg):
            fn(x, a, b, -1, 2, True, seed)
    if impl == "wrapper":
        with pytest.raises(ValueError, match="seed must be an int or an int64"):
            fn(x, a, b, -1, 2, True, 1.5)


# ----------------------------------------------------------------------------- CUDA only
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,dim,G,per_sample", [
    ((64, 197, 384), -1, 6, False),    # token layout, channel groups: many blocks, one group per thread
    ((64, 197, 384), -1, 6, True),
    ((16, 6, 197, 197), 1, 6, False),  # attention layout, per-head groups
    ((16, 6, 197, 197), 1, 6, True),
    ((4, 3000), -1, 1500, True),       # G > the 1024 shared-memory slots: global atomics path
    ((3000, 7), 0, 5, True),           # per-sample statistics over dim 0, many samples
    ((33, 1025, 3), 1, 1025, False),   # G = D > one block's threads
], ids=["token", "token-ps", "attn", "attn-ps", "g1500", "dim0-ps", "g1025"])
@pytest.mark.cuda
@needs_cuda
def test_cuda_observe_large(shape, dim, G, per_sample, dtype):
    x = _randn(shape, dtype, seed=G)
    _compare_observe(x, dim, G, per_sample, False, "cuda", steps=2)
    _compare_observe(x, dim, G, per_sample, True, "cuda", steps=1)


@pytest.mark.cuda
@needs_cuda
def test_cuda_workspace_grows_and_is_reset():
    """Different (S, G) sizes in a row share the per-stream workspace: grown, reset, reused."""
    for S, G in ((2, 3), (300, 40), (4, 2), (600, 20), (1, 1)):
        x = _randn((S, G * 3, 5), torch.bfloat16, seed=S)
        _compare_observe(x, 1, G, True, False, "cuda", steps=2)
        _compare_observe(x, 1, G, False, False, "cuda", steps=1)


def _cuda_kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm up (the first call on a stream creates its workspace)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@needs_cuda
def test_cuda_launches_and_no_host_sync():
    """forward = observe + quantize = 2 kernels, backward = dequantize = 1; no host sync."""
    x = torch.randn(8, 197, 192, device="cuda", dtype=torch.bfloat16)
    st = [torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda"), torch.tensor(False, device="cuda")]
    rng = Q.rng_state(3, device="cuda")

    def forward():
        a, b, seed = torch.ops.mesa.observe(x, *st, rng, -1, 3, 0.9, False, False)
        return a, b, torch.ops.mesa.quantize(x, a, b, -1, 3, True, seed)

    names = _cuda_kernel_names(forward)
    assert len(names) == 2 and "observe_kernel" in names[0] and "quantize_kernel" in names[1], names
    a, b, q = forward()
    names = _cuda_kernel_names(lambda: torch.ops.mesa.dequantize(q, a, b, -1, 3, torch.bfloat16))
    assert len(names) == 1 and "dequantize_kernel" in names[0], names
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, b, q = forward()
        torch.ops.mesa.dequantize(q, a, b, -1, 3, torch.bfloat16)
        torch.ops.mesa.group_minmax(x, -1, 3, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_cuda
def test_cuda_concurrent_streams():
    """Two streams running observe at once use separate workspaces."""
    xs = [_randn((32, 197, 192), torch.bfloat16, seed=s) for s in range(2)]
    want = []
    for x in xs:
        state = _state(4)
        want.append(_reference_chain(x, state, Q.rng_state(1), -1, 3, 0.9, True, False)[:2])
    streams = [torch.cuda.Stream() for _ in xs]
    got = []
    xg = [x.cuda() for x in xs]
    sts = [[t.cuda() for t in _state(4)] for _ in xs]
    torch.cuda.synchronize()
    for _ in range(3):
        got = []
        for s, x, st in zip(streams, xg, sts):
            with torch.cuda.stream(s):
                st_copy = [t.clone() for t in st]
                got.append(torch.ops.mesa.observe(x, *st_copy, Q.rng_state(1, device="cuda"), -1, 3, 0.9, True,
                                                  False)[:2])
        torch.cuda.synchronize()
        for g_, w in zip(got, want):
            for a, b in zip(g_, w):
                assert torch.equal(_bits(a), _bits(b))


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_capture_of_a_compression():
    """observe + quantize + dequantize captured in a CUDA graph: each replay advances the
    device rng and equals the reference chain (no host state baked into the graph)."""
    x = _randn((8, 6, 33, 35), torch.bfloat16, seed=1).cuda()
    st = [torch.zeros(6, device="cuda"), torch.zeros(6, device="cuda"), torch.tensor(False, device="cuda")]
    rng = Q.rng_state(77, device="cuda")

    def step():
        a, b, seed = torch.ops.mesa.observe(x, *st, rng, 1, 6, 0.9, False, False)
        q = torch.ops.mesa.quantize(x, a, b, 1, 6, True, seed)
        return q, torch.ops.mesa.dequantize(q, a, b, 1, 6, torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, y_out = step()
    ref_state = [t.cpu() for t in st]
    ref_rng = rng.cpu()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        ra, rb, rseed = R.observe(x.cpu(), *ref_state, ref_rng, 1, 6, 0.9, False, False)
        rq = R.quantize(x.cpu(), ra, rb, 1, 6, True, rseed)
        assert torch.equal(q_out.cpu(), rq)
        assert torch.equal(y_out.cpu(), R.dequantize(rq, ra, rb, 1, 6, torch.bfloat16))
        assert torch.equal(rng.cpu(), ref_rng)
