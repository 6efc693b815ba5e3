"""Estimator ``"delayed"`` (``mesa::quantize_observe``, DESIGN.md "Delayed estimates").

The codes of a batch use the running estimates as they stood before it; the batch's own
min/max then update them for the next one, in one pass over the activation (two passes and
two launches with ``"running"``). The first batch (estimates not initialized) is compressed
exactly as ``"running"`` compresses it, decided on the device. Checked here: the kernels
(CPU; CUDA on a GPU, ``cuda``-marked) against the reference bit for bit over several
batches, the reference against its definition in terms of the other ops, the traced
version under ``torch.compile``, the layers (one op per compression, C++ and Python paths
alike), the options, and that gradients stay as close to exact as the running estimator's.
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mesa_train.nn as mnn
import mesa_train.quant as Q
from mesa_train.nn.quantizer import QuantOptions
from mesa_train.quant import reference as R
from mesa_train.quant import traceable as T
from kernel_marks import DEVICES, needs_ext
from op_recorder import OpRecorder
from bit_patterns import bit_pattern


def _state(G, device, key=11):
    return [torch.zeros(G + 2, device=device), torch.zeros(G + 2, device=device),
            torch.zeros(1, dtype=torch.bool, device=device), Q.rng_state(key, 2**32 - 2, device)]


def _batches(shape, dtype, device, n=4):
    g = torch.Generator().manual_seed(sum(shape))
    out = []
    for i in range(n):
        x = torch.randn(shape, generator=g) * (1 + i) + 0.3 * i  # the range drifts batch to batch
        out.append(x.to(dtype).to(device))
    return out


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,dim,G", [((4, 9, 16), -1, 4), ((3, 7, 131), -1, 3), ((2, 6, 5, 5), 1, 6),
                                         ((5000,), 0, 1)], ids=str)
@pytest.mark.parametrize("symmetric,stochastic", [(False, True), (True, False)])
@pytest.mark.parametrize("rows", [False, True])
def test_kernel_is_the_reference_over_batches(device, dtype, shape, dim, G, symmetric, stochastic, rows):
    """Four batches: the first initializes (running path), the next three use and update the
    delayed estimates; codes, statistics, estimate buffers and rng after every batch."""
    ops_state, ref_state = _state(G, device), _state(G, device)
    for i, x in enumerate(_batches(shape, dtype, device)):
        k = None
        if rows and x.dim() > 1:
            k = R.row_exponents(x, 1, 14 if dtype == torch.float16 else 64)
        got = Q.quantize_observe(x, *ops_state, dim, G, 0.9, symmetric, stochastic, row_exp=k)
        want = R.quantize_observe(x, *ref_state, dim % x.dim(), G, 0.9, symmetric, stochastic, k)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(bit_pattern(a), bit_pattern(b)), i
        for a, b in zip(ops_state, ref_state):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), i


@pytest.mark.parametrize("symmetric", [False, True])
def test_reference_is_the_definition(symmetric):
    """First batch: observe + quantize. Later: quantize with the estimates from before the
    batch and the seed observe would have drawn; the buffers end as observe leaves them."""
    x0, x1, x2 = _batches((6, 10, 8), torch.float32, "cpu", 3)
    s_delayed, s_running = _state(2, "cpu"), _state(2, "cpu")
    q, a, b = R.quantize_observe(x0, *s_delayed, 2, 2, 0.8, symmetric, True)
    ra, rb, seed = R.observe(x0, *s_running, 2, 2, 0.8, False, symmetric)
    assert torch.equal(q, R.quantize(x0, ra, rb, 2, 2, True, seed)) and torch.equal(a, ra) and torch.equal(b, rb)
    for x in (x1, x2):
        before_a, before_b = s_running[0][:2].clone().view(1, 2), s_running[1][:2].clone().view(1, 2)
        q, a, b = R.quantize_observe(x, *s_delayed, 2, 2, 0.8, symmetric, True)
        _, _, seed = R.observe(x, *s_running, 2, 2, 0.8, False, symmetric)
        assert torch.equal(a, before_a) and torch.equal(b, before_b)
        assert torch.equal(q, R.quantize(x, before_a, before_b, 2, 2, True, seed))
        for u, v in zip(s_delayed, s_running):
            assert torch.equal(u, v)


@pytest.mark.parametrize("ready", [False, True], ids=["device flag", "ready on the host"])
def test_traced_version_is_the_op(ready):
    """mesa_train.quant.traceable.quantize_observe (torch.compile with traceable kernels),
    eager and compiled, gives the op's bytes on the first and on later batches: choosing on
    the device flag, or (from the second batch, as mark_estimates_ready allows) in its
    one-pass form."""
    compiled = torch.compile(T.quantize_observe, backend="aot_eager", fullgraph=True)
    for fn in (T.quantize_observe, compiled):
        s_tr, s_op = _state(3, "cpu"), _state(3, "cpu")
        for i, x in enumerate(_batches((4, 5, 12), torch.bfloat16, "cpu", 3)):
            got = fn(x, *s_tr, 2, 3, 0.9, False, True, ready and i > 0)
            want = Q.quantize_observe(x, *s_op, 2, 3, 0.9, False, True)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
            for a, b in zip(s_tr, s_op):
                assert torch.equal(a, b)


# ----------------------------------------------------------------------------- delayed_observe
def test_delayed_observe_is_its_definition():
    """reference.delayed_observe: copies of the estimates as they stand, then observe's update
    from the batch's min/max (its seed unused), the counter one step on; the same on the cells
    of the batch's row segments (what the traced compression passes) as on the batch."""
    x = _batches((6, 10, 8), torch.float32, "cpu", 1)[0]
    s_op, s_obs, s_cells = _state(2, "cpu"), _state(2, "cpu"), _state(2, "cpu")
    for st in (s_op, s_obs, s_cells):
        st[0][:2], st[1][:2] = torch.tensor([2.0, 3.0]), torch.tensor([-1.0, 0.5])
        st[2].fill_(True)
    a, b = R.delayed_observe(x, *s_op, 2, 2, 0.8, False)
    assert torch.equal(a, torch.tensor([[2.0, 3.0]])) and torch.equal(b, torch.tensor([[-1.0, 0.5]]))
    R.observe(x, *s_obs, 2, 2, 0.8, False, False)
    cells = torch.stack([x.view(6, 10, 2, 4).amin(-1), x.view(6, 10, 2, 4).amax(-1)])
    R.delayed_observe(cells, *s_cells, 3, 2, 0.8, False)
    for u, v, w in zip(s_op, s_obs, s_cells):
        assert torch.equal(u, v) and torch.equal(u, w)
    assert not torch.equal(s_op[0][:2], a.view(2))  # (the batch moved the estimates)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_of_is_the_seed_steps_seed_without_the_step(device):
    """mesa::seed_of: the seed observe's seed step would draw, the rng untouched (a strided
    rng too, and the counter at its wrap); a bad rng is a one-line error."""
    for counter in (0, 5, 2**32 - 1):
        rng = Q.rng_state(77, counter, device)
        strided = torch.stack([rng, torch.full_like(rng, -1)], dim=1)[:, 0]
        for r in (rng, strided):
            before = r.clone()
            seed = Q.seed_of(r)
            assert torch.equal(r, before)
            stepped = before.clone()
            assert torch.equal(seed, R.seed_step(stepped)) and int(stepped[1]) == (counter + 1) % 2**32
        opcheck(torch.ops.mesa.seed_of.default, (rng,))
    with pytest.raises(ValueError, match=r"seed_of: rng \(\[key, counter\]\) must be an int64 tensor of shape"):
        Q.seed_of(torch.zeros(3, dtype=torch.int64, device=device))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,dim,G", [((2, 4, 9, 4), 2, 4), ((3, 7, 131), -1, 3), ((0, 5), 1, 5)], ids=str)
def test_delayed_observe_kernel_is_the_reference(device, dtype, shape, dim, G):
    """The op (CPU; CUDA on a GPU) against the reference over batches, bit for bit: outputs,
    estimate buffers, initialized flag and counter, from uninitialized estimates on, a batch
    with a NaN (estimates kept) and an empty one (valid = False) included."""
    ops_state, ref_state = _state(G, device), _state(G, device)
    for i, x in enumerate(_batches(shape, dtype, device)):
        if i == 2 and x.numel() > 0:
            x.view(-1)[3] = float("nan")
        got = Q.delayed_observe(x, *ops_state, dim, G, 0.9, i % 2 == 1)
        want = R.delayed_observe(x, *ref_state, dim % x.dim(), G, 0.9, i % 2 == 1)
        for a, b in zip(got, want):
            assert a.shape == (1, G) and torch.equal(bit_pattern(a), bit_pattern(b)), i
        for a, b in zip(ops_state, ref_state):
            assert torch.equal(bit_pattern(a), bit_pattern(b)), i
    assert int(ops_state[3][1]) == (2**32 - 2 + 4) % 2**32  # one step a batch, across the wrap


def test_traced_version_under_inductor_is_the_op():
    """The one-pass traced form compiled by Inductor (not aot_eager: its own kernels, its own
    order of the buffer reads and of the op that updates them) gives the op's codes, returned
    estimates, buffers and counter, bit for bit, while each batch's range is 10x the last one's
    (codes made after the update, with the new range, would differ almost everywhere)."""
    torch._dynamo.reset()
    compiled = torch.compile(T.quantize_observe, fullgraph=True)
    s_tr, s_op = _state(4, "cpu"), _state(4, "cpu")
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        x = torch.randn(6, 10, 32, generator=g) * 10**i
        got = (compiled if i > 0 else T.quantize_observe)(x, *s_tr, 2, 4, 0.9, False, True, i > 0)
        want = Q.quantize_observe(x, *s_op, 2, 4, 0.9, False, True)
        for a, b in zip(got, want):
            assert torch.equal(a, b), i
        for a, b in zip(s_tr, s_op):
            assert torch.equal(a, b), i


def test_empty_batch_keeps_the_estimates():
    st = _state(2, "cpu")
    Q.quantize_observe(torch.randn(3, 4), *st, 1, 2, 0.9)
    before = [t.clone() for t in st]
    q, a, b = Q.quantize_observe(torch.empty(0, 4), *st, 1, 2, 0.9)
    assert q.shape == (0, 4) and torch.equal(a.view(-1), before[0][:2]) and torch.equal(st[0], before[0])
    assert int(st[3][1]) == (int(before[3][1]) + 1) % 2**32  # the seed step still runs (counter wraps)


# ----------------------------------------------------------------------------- layers
def _ops_of(layer, x):
    with OpRecorder(keep=lambda name: name.startswith("mesa.")) as rec:
        layer(x).sum().backward()
    return rec.ops


@needs_ext
@pytest.mark.parametrize("fused", [True, False], ids=["C++ layer", "Python Function"])
def test_one_op_per_compression(fused, monkeypatch):
    from mesa_train.nn import quantizer as quantizer_mod

    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x = torch.randn(2, 5, 16, requires_grad=True)
    # (backward: dequantize, or for the exact GELU and the LayerNorm their one-op backward from the codes)
    for layer, fwd, bwd in ((mnn.GELU(estimator="delayed"), ["mesa.quantize_observe"], ["mesa.gelu_backward"]),
                            (mnn.Linear(16, 8, estimator="delayed"), ["mesa.row_exponents", "mesa.quantize_observe"],
                             ["mesa.dequantize"]),
                            (mnn.LayerNorm(16, estimator="delayed", row_scale=False), ["mesa.quantize_observe"],
                             ["mesa.layer_norm_backward"])):
        ops = _ops_of(layer, x)
        assert ops == fwd + bwd, ops
        assert _ops_of(layer, x) == ops  # the first batch too: decided on the device, same ops


def test_mark_estimates_ready_and_checkpoints():
    from mesa_train.nn.quantizer import mark_estimates_ready

    model = torch.nn.Sequential(mnn.Linear(8, 8, estimator="delayed"), mnn.GELU(estimator="delayed"),
                                mnn.GELU())  # the last one: running, not counted
    assert mark_estimates_ready(model) == 0 and not model[0].quantizer._delayed_ready
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert mark_estimates_ready(model) == 2 and model[1].quantizer._delayed_ready
    assert not model[2].quantizer._delayed_ready
    fresh = torch.nn.Sequential(mnn.Linear(8, 8, estimator="delayed"), mnn.GELU(estimator="delayed"), mnn.GELU())
    fresh.load_state_dict(model.state_dict())
    assert fresh[0].quantizer._delayed_ready and fresh[1].quantizer._delayed_ready
    fresh[0].quantizer.reset_estimates()
    assert not fresh[0].quantizer._delayed_ready


@pytest.mark.parametrize("estimator", ["running", "delayed"])
def test_inductor_fuses_the_delayed_compression_into_the_producer(estimator, monkeypatch):
    """Issue 9's "one generated kernel": a Mesa GELU (which keeps its input) compiled with
    traceable kernels. With estimator=delayed (estimates known to be initialized) Inductor
    emits ONE kernel that reads the input once for the GELU output, the per-group min/max
    and the stochastic-rounding codes; with running estimates the codes need this batch's
    finished reduction, so a second kernel reads the input again for them. (CPU Inductor
    here; the same graph goes to Triton on a GPU.)"""
    from torch._inductor.utils import run_and_get_code

    from mesa_train.nn.quantizer import mark_estimates_ready
    from mesa_train.quant import compile_kernels

    monkeypatch.setattr(compile_kernels, "_mode", "traceable")
    torch._dynamo.reset()
    layer = mnn.GELU(estimator=estimator, num_groups=4)
    x = torch.randn(4, 10, 32, requires_grad=True)
    layer(x).sum().backward()  # the first step (eager): estimates initialized
    mark_estimates_ready(layer)

    def fwd(t):
        return layer(t)

    _, code = run_and_get_code(torch.compile(fwd, fullgraph=True), x)
    src = "\n".join(code)
    kernels = [k.split("(")[0] for k in src.split("def kernel")[0].split("cpp_fused_")[1:]]
    gelu = [k for k in kernels if "gelu" in k]
    assert gelu, kernels
    # (the codes: the rounding hash's shifts; the min/max: amax / amin)
    fused = any("rshift" in k and ("amax" in k or "amin" in k) for k in gelu)
    assert fused == (estimator == "delayed"), kernels


def _train_tiny(estimator, steps=30, seed=0):
    """A 2-layer MLP with LayerNorm and GELU, all compressed, trained on a fixed regression
    task; returns the losses and the last step's gradients (Mesa) and exact gradients."""
    torch.manual_seed(seed)
    stock = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    mesa = torch.nn.Sequential(mnn.Linear.from_module(stock[0], estimator=estimator, num_groups=4),
                               mnn.LayerNorm.from_module(stock[1], estimator=estimator, num_groups=4),
                               mnn.GELU.from_module(stock[2], estimator=estimator, num_groups=4),
                               mnn.Linear.from_module(stock[3], estimator=estimator, num_groups=4))
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(12, 4, generator=g)
    opt = torch.optim.SGD(mesa.parameters(), lr=0.05)
    losses, cos = [], []
    for _ in range(steps):
        x = torch.randn(64, 12, generator=g)
        y = x @ w_true
        loss = torch.nn.functional.mse_loss(mesa(x), y)
        opt.zero_grad()
        loss.backward()
        exact = torch.autograd.grad(torch.nn.functional.mse_loss(stock(x), y), list(stock.parameters()))
        cos.append(min(float(torch.nn.functional.cosine_similarity(p.grad.flatten(), e.flatten(), dim=0))
                       for p, e in zip(mesa.parameters(), exact)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, cos


def test_gradients_as_close_to_exact_as_running():
    """Same model, same data: the worst per-parameter gradient cosine against exact, over 30
    steps, is as good with delayed estimates as with running ones (the codes use last step's
    range, clamping what grew beyond it), and training converges the same."""
    run_losses, run_cos = _train_tiny("running")
    del_losses, del_cos = _train_tiny("delayed")
    assert min(del_cos) > 0.99 and min(run_cos) > 0.99, (min(del_cos), min(run_cos))
    assert del_losses[-1] < 0.3 * del_losses[0]
    assert abs(del_losses[-1] - run_losses[-1]) < 0.1 * run_losses[0]


def test_options():
    QuantOptions(estimator="delayed")
    for bad in (dict(bits=4), dict(scale="pow2"), dict(layout="patch4x4")):
        with pytest.raises(ValueError, match="estimator='delayed'.*valid with it: bits=8"):
            QuantOptions(estimator="delayed", **bad)
    with pytest.raises(ValueError, match="delayed"):
        QuantOptions(estimator="later")  # the error names the valid estimators, delayed among them


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(3, 5, 24, device=device, dtype=torch.bfloat16)
    k = R.row_exponents(x, 1, 64)
    for init in (False, True):
        st = _state(4, device)
        st[2].fill_(init)
        st[0][:4] = 2.0
        opcheck(torch.ops.mesa.quantize_observe.default, (x, *st, 2, 4, 0.9, False, True, k))
        opcheck(torch.ops.mesa.quantize_observe.default, (x, *st, 2, 4, 0.9, True, False, None))
        opcheck(torch.ops.mesa.delayed_observe.default, (x, *st, 2, 4, 0.9, False))


def test_compiled_traceable_training_matches_eager():
    """A patched DeiT (every op compressed, estimator=delayed) compiled whole with traceable
    kernels: the first step on the device-flag form, then (mark_estimates_ready, one
    rebuild) the one-pass form; outputs, estimate buffers, rounding counters and gradients
    equal eager Mesa's bit for bit at every step (aot_eager: the same kernels run)."""
    import copy

    from test_patch_helpers import build, grads, inputs, loss_of

    from mesa_train.nn.quantizer import mark_estimates_ready
    from mesa_train.patch import patch_model
    from mesa_train.quant.compile_kernels import set_compile_kernels

    torch._dynamo.reset()
    model = patch_model(build("deit", fused=False), ops=("all",), estimator="delayed")
    eager = copy.deepcopy(model)
    x = inputs("deit")
    set_compile_kernels("traceable")
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for step in range(3):
            out = compiled(x)
            loss_of(out).backward()
            ref = eager(x)
            loss_of(ref).backward()
            assert torch.equal(out, ref), step
            if step == 0:
                assert mark_estimates_ready(model) > 0
    finally:
        set_compile_kernels("auto")
    bufs, ref_bufs = dict(model.named_buffers()), dict(eager.named_buffers())
    for name, b in bufs.items():
        assert torch.equal(b, ref_bufs[name]), name
    g, rg = grads(model), grads(eager)
    for n in g:
        assert torch.equal(g[n], rg[n]), n
