"""``mesa::update_estimates``: the running-estimate step as one op (one launch on CUDA).

The contract is the reference ``mesa_train.quant.reference.update_estimates`` (DESIGN.md,
"Running estimates"): the CPU and CUDA kernels must give the same bits for the returned
``(alpha, beta)``, the mutated buffers and ``initialized``, including NaN / inf batches,
per-sample statistics, the symmetric range and buffers larger than ``G``.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.library import opcheck

import mesa_train.quant as Q
from mesa_train.nn import ActivationQuantizer
from mesa_train.quant import reference as R
from kernel_marks import EXT_DEVICES as DEVICES, needs_cuda
from op_recorder import OpRecorder
from bit_patterns import bit_pattern


def _stats(S, G, kind, seed):
    g = torch.Generator().manual_seed(seed)
    mn = torch.randn(S, G, generator=g) * 2 - 1
    mx = mn + torch.rand(S, G, generator=g) * 3
    if kind == "nan" and S * G:
        mn.view(-1)[(S * G) // 2] = float("nan")
    elif kind == "inf" and S * G:
        mx.view(-1)[-1] = float("inf")
    elif kind == "constant":
        mx = mn.clone()
    return mn.contiguous(), mx.contiguous()


def _state(G_buf, init, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    a = torch.rand(G_buf, generator=g) * 4
    b = torch.randn(G_buf, generator=g)
    return a, b, torch.tensor(init)


def _run(fn, mn, mx, state, decay, per_sample, symmetric, valid, device):
    a, b, init = (t.clone().to(device) for t in state)
    out = fn(mn.to(device), mx.to(device), a, b, init, decay, per_sample, symmetric, valid)
    return [t.cpu() for t in (*out, a, b, init)]


CASES = list(
    itertools.product(
        [False, True],  # per_sample
        [False, True],  # symmetric
        [False, True],  # initialized
        [True, False],  # valid
        ["finite", "nan", "inf", "constant"],
    )
)


def _case_args(per_sample, kind, i):
    S = 5 if per_sample else 1
    G, G_buf = 3, 4 + (i % 3)  # buffers larger than G: only the first G entries move
    decay = (0.9, 0.0, 0.37)[i % 3]
    return _stats(S, G, kind, i), _state(G_buf, False, i), decay


def _check_same(got, want):
    names = ("alpha", "beta", "alpha_est", "beta_est", "initialized")
    for n, g_, w in zip(names, got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype, n
        assert torch.equal(bit_pattern(g_), bit_pattern(w)), f"{n}: {g_} != {w}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_sample,symmetric,init,valid,kind", CASES)
def test_kernel_matches_reference(per_sample, symmetric, init, valid, kind, device):
    """The CPU / CUDA kernel against the reference on CPU."""
    i = CASES.index((per_sample, symmetric, init, valid, kind))
    (mn, mx), (a, b, _), decay = _case_args(per_sample, kind, i)
    state = (a, b, torch.tensor(init))
    got = _run(torch.ops.mesa.update_estimates, mn, mx, state, decay, per_sample, symmetric, valid, device)
    want = _run(R.update_estimates, mn, mx, state, decay, per_sample, symmetric, valid, "cpu")
    _check_same(got, want)


def test_reference_semantics():
    """The reference itself, against hand-computed values (so kernel == reference means something)."""
    mn = torch.tensor([[-1.0, 2.0]])
    mx = torch.tensor([[3.0, 2.5]])
    a, b, init = torch.zeros(3), torch.zeros(3), torch.tensor(False)
    alpha, beta = R.update_estimates(mn, mx, a, b, init, 0.9, False, False)
    assert alpha.tolist() == [[4.0, 0.5]] and beta.tolist() == [[-1.0, 2.0]]
    assert a.tolist() == [4.0, 0.5, 0.0] and bool(init)  # third entry untouched
    alpha, beta = R.update_estimates(mn * 3, mx * 3, a, b, init, 0.5, False, False)
    assert torch.allclose(alpha, torch.tensor([[8.0, 1.0]])) and torch.allclose(beta, torch.tensor([[-2.0, 4.0]]))
    assert torch.equal(alpha.view(2), a[:2])
    # a non-finite batch: estimates kept and used, buffers unchanged
    before = a.clone()
    alpha, _ = R.update_estimates(torch.tensor([[float("nan"), 0.0]]), mx, a, b, init, 0.5, False, False)
    assert torch.equal(a, before) and torch.equal(alpha.view(2), before[:2])
    # symmetric: range [-m, m]
    alpha, beta = R.update_estimates(torch.tensor([[-5.0]]), torch.tensor([[2.0]]), torch.zeros(1), torch.zeros(1),
                                     torch.tensor(False), 0.9, False, True)
    assert alpha.item() == 10.0 and beta.item() == -5.0
    # per sample: this batch's own ranges; the buffers follow the batch-wide range
    mn = torch.tensor([[0.0], [-2.0]])
    mx = torch.tensor([[1.0], [5.0]])
    a1, b1, i1 = torch.zeros(1), torch.zeros(1), torch.tensor(False)
    alpha, beta = R.update_estimates(mn, mx, a1, b1, i1, 0.9, True, False)
    assert alpha.tolist() == [[1.0], [7.0]] and beta.tolist() == [[0.0], [-2.0]]
    assert a1.tolist() == [7.0] and b1.tolist() == [-2.0]


def test_outputs_never_alias_the_buffers():
    mn, mx = _stats(1, 2, "finite", 0)
    a, b, init = torch.zeros(2), torch.zeros(2), torch.tensor(True)
    alpha, beta = Q.update_estimates(mn, mx, a, b, init, 0.9)
    a.add_(100.0)
    assert not torch.equal(alpha.view(2), a) and alpha.data_ptr() != a.data_ptr() and beta.data_ptr() != b.data_ptr()


def test_empty_per_sample_batch_keeps_estimates():
    mn = torch.empty(0, 2)
    a, b, init = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor(True)
    alpha, beta = Q.update_estimates(mn, mn.clone(), a, b, init, 0.9, per_sample=True, valid=False)
    assert alpha.shape == (0, 2) and a.tolist() == [1.0, 2.0] and bool(init)


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.zeros(3), torch.tensor(False), 0.9, False),
         "shape \\(1, G\\)"),
        ((torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(3), torch.zeros(3), torch.tensor(False), 0.9, False),
         "one shape"),
        ((torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(2), torch.zeros(3), torch.tensor(False), 0.9, False),
         "G_buf >= 3"),
        ((torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(3), torch.zeros(3, dtype=torch.float16),
          torch.tensor(False), 0.9, False), "beta_est"),
        ((torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(3), torch.zeros(3), torch.zeros(()), 0.9, False),
         "bool"),
        ((torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(3), torch.zeros(3), torch.tensor(False), 1.0, False),
         "decay"),
    ],
)
@pytest.mark.parametrize("impl", ["wrapper", "op"])
def test_invalid_arguments_raise_value_error(args, match, impl):
    if impl == "wrapper":
        with pytest.raises(ValueError, match=match):
            Q.update_estimates(*args)
    else:
        with pytest.raises(ValueError, match=match):
            torch.ops.mesa.update_estimates(*args, False, True)


def _opcheck_cases(device):
    mn, mx = _stats(4, 3, "finite", 3)
    cases = []
    for per_sample, symmetric, init in [(True, False, False), (False, True, True)]:
        m, x = (mn, mx) if per_sample else (mn[:1].contiguous(), mx[:1].contiguous())
        cases.append((m.to(device), x.to(device), torch.rand(5, device=device), torch.rand(5, device=device),
                      torch.tensor(init, device=device), 0.9, per_sample, symmetric, True))
    return cases


def test_opcheck_cpu():
    for args in _opcheck_cases("cpu"):
        opcheck(torch.ops.mesa.update_estimates.default, args)


@pytest.mark.parametrize("estimator", ["running", "per_sample"])
def test_compress_dispatches_few_ops(estimator):
    """One compression = observe (minmax + estimates + seed step) + quantize (+ the
    transitional CPU key draw of the quantizer).

    Before the fused ops the estimate update alone was ~20 small tensor ops, i.e. ~20
    kernel launches per compressed activation on a GPU.
    """
    aq = ActivationQuantizer(num_groups=4, estimator=estimator)
    x = torch.randn(2, 7, 16)
    aq.compress(x, -1)  # first call initialises
    with OpRecorder() as counter:
        aq.compress(x, -1)
    on_data = [o for o in counter.ops if o.startswith("mesa.")]
    assert on_data == ["mesa.observe", "mesa.quantize"], counter.ops
    assert len(counter.ops) <= 5, counter.ops  # + randint, .item() and the rng tensor of the key draw


def test_quantizer_matches_step_by_step_reference():
    """ActivationQuantizer over several batches (one non-finite) == the reference chain."""
    aq = ActivationQuantizer(num_groups=3, decay=0.8)
    a, b, init = torch.zeros(3), torch.zeros(3), torch.tensor(False)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        x = torch.randn(4, 6, 9, generator=g) * (step + 1)
        if step == 2:
            x[0, 0, 0] = float("inf")
        packed = aq.compress(x, -1)
        alpha, beta, G = packed.alpha, packed.beta, packed.num_groups
        mn, mx = R.group_minmax(x, -1, G, False)
        ra, rb = R.update_estimates(mn, mx, a, b, init, 0.8, False, False, True)
        assert torch.equal(bit_pattern(alpha), bit_pattern(ra)) and torch.equal(bit_pattern(beta), bit_pattern(rb))
        assert torch.equal(aq.alpha, a) and torch.equal(aq.beta, b) and bool(aq.initialized) == bool(init)


@pytest.mark.cuda
@needs_cuda
def test_cuda_many_groups_and_opcheck():
    """G > one block's threads (strided loop + block-wide finite vote)."""
    for kind in ("finite", "nan"):
        mn, mx = _stats(3, 1000, kind, 7)
        state = _state(1000, True, 7)
        got = _run(torch.ops.mesa.update_estimates, mn, mx, state, 0.9, True, False, True, "cuda")
        want = _run(R.update_estimates, mn, mx, state, 0.9, True, False, True, "cpu")
        _check_same(got, want)
    for args in _opcheck_cases("cuda"):
        opcheck(torch.ops.mesa.update_estimates.default, args)


# --------------------------------------------------------------------------- estimate_and_seed
# update_estimates + the seed step in one op: what the traced compression calls after its own
# min/max pass under torch.compile (quant/traceable.py).

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_sample,symmetric,init,valid,kind", CASES)
def test_estimate_and_seed_matches_reference(per_sample, symmetric, init, valid, kind, device):
    """Bit for bit the reference's update_estimates followed by its seed step: outputs, the
    mutated buffers and flag, and the rng counter (also at the 2**32 wrap)."""
    i = CASES.index((per_sample, symmetric, init, valid, kind))
    (mn, mx), (a, b, _), decay = _case_args(per_sample, kind, i)
    rng = Q.rng_state(key=1000 + i, counter=(2**32 - 1) if i % 5 == 0 else i)

    def run(fn, dev):
        a_, b_, init_, rng_ = a.clone().to(dev), b.clone().to(dev), torch.tensor(init, device=dev), rng.clone().to(dev)
        out = fn(mn.to(dev), mx.to(dev), a_, b_, init_, rng_, decay, per_sample, symmetric, valid)
        return [t.cpu() for t in (*out, a_, b_, init_, rng_)]

    def reference(mn_, mx_, a_, b_, init_, rng_, *rest):
        alpha, beta = R.update_estimates(mn_, mx_, a_, b_, init_, *rest)
        return alpha, beta, R.seed_step(rng_)

    got = run(torch.ops.mesa.estimate_and_seed, device)
    want = run(reference, "cpu")
    names = ("alpha", "beta", "seed", "alpha_est", "beta_est", "initialized", "rng")
    for n, g_, w in zip(names, got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype, n
        assert torch.equal(bit_pattern(g_), bit_pattern(w)), f"{n}: {g_} != {w}"


def test_estimate_and_seed_equals_observe_after_its_minmax():
    """observe == group_minmax + estimate_and_seed, on the same state (the traced path's split)."""
    x = torch.randn(4, 7, 12)
    state = [torch.rand(3), torch.randn(3), torch.tensor(True), Q.rng_state(key=9, counter=41)]
    s1, s2 = [t.clone() for t in state], [t.clone() for t in state]
    want = torch.ops.mesa.observe(x, *s1, 2, 3, 0.9, False, False)
    mn, mx = torch.ops.mesa.group_minmax(x, 2, 3, False)
    got = torch.ops.mesa.estimate_and_seed(mn, mx, *s2, 0.9, False, False, True)
    for g_, w in zip([*got, *s2], [*want, *s1]):
        assert torch.equal(bit_pattern(g_), bit_pattern(w))


def test_estimate_and_seed_bad_rng_is_a_one_line_error():
    mn, mx = _stats(1, 3, "finite", 0)
    args = (mn, mx, torch.zeros(3), torch.zeros(3), torch.tensor(False))
    for impl in (Q.estimate_and_seed, torch.ops.mesa.estimate_and_seed):
        with pytest.raises(ValueError, match=r"estimate_and_seed: rng \(\[key, counter\]\) must be an int64 tensor "
                                             r"of shape \(2,\)"):
            impl(*args, torch.zeros(3, dtype=torch.int64), 0.9, False, False, True)


def _opcheck_seed_cases(device):
    return [(*args[:5], Q.rng_state(key=3, counter=7, device=device), *args[5:])
            for args in _opcheck_cases(device)]


def test_estimate_and_seed_opcheck_cpu():
    for args in _opcheck_seed_cases("cpu"):
        opcheck(torch.ops.mesa.estimate_and_seed.default, args)


@pytest.mark.cuda
@needs_cuda
def test_estimate_and_seed_opcheck_cuda():
    for args in _opcheck_seed_cases("cuda"):
        opcheck(torch.ops.mesa.estimate_and_seed.default, args)
