"""Canonical float bits (DESIGN.md, "Canonical bits").

Every float32 that ``group_minmax``, ``update_estimates`` and ``observe`` return or write
into the estimate buffers is canonical: any NaN is 0x7FC00000 and any zero is +0.0. That
makes min/max reductions order-independent, so CPU, CUDA and the reference agree bit for
bit whatever NaN payload or signed zero the input carries. Compared as int32 bit patterns.
"""
from __future__ import annotations

import pytest
import torch

import mesa_train.quant as Q
from mesa_train.quant import reference as R
from kernel_marks import needs_cuda, needs_ext


CANON_NAN = 0x7FC00000
# (implementation, device): the compiled kernels on CPU / CUDA and the reference
IMPLS = [
    pytest.param("kernel", "cpu", marks=needs_ext, id="cpu-kernel"),
    pytest.param("reference", "cpu", id="reference"),
    pytest.param("kernel", "cuda", marks=[pytest.mark.cuda, needs_cuda], id="cuda-kernel"),
    pytest.param("reference", "cuda", marks=[pytest.mark.cuda, needs_cuda], id="cuda-reference"),
]


def _ops(impl):
    return torch.ops.mesa if impl == "kernel" else R


def _from_bits(bits, dtype=torch.float32):
    """A float tensor with exactly these bit patterns (NaN payloads, -0.0)."""
    if dtype == torch.float32:
        return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype)


def _bits(t):
    return t.contiguous().view(torch.int32).cpu()


def _assert_canonical(t, name):
    b = _bits(t).view(-1)
    nan = torch.isnan(t.cpu().view(-1))
    assert torch.all(b[nan] == CANON_NAN), f"{name}: NaN bits {[hex(v & 0xFFFFFFFF) for v in b[nan].tolist()]}"
    assert not torch.any(b == -(2**31)), f"{name}: -0.0 in {t}"


# input bit patterns: a positive NaN with a payload, the negative default NaN, -0.0, +0.0
F32_CASES = {
    "nan-payload": [0x3F800000, 0x7FC00001, 0xBF800000],
    "negative-nan": [0x3F800000, 0xFFC00000, 0x40000000],
    "neg-zero": [0x80000000, 0x80000000, 0x80000000],
    "mixed-zeros": [0x00000000, 0x80000000, 0x80000000, 0x00000000],
}
HALF_CASES = {  # (dtype, 16-bit patterns)
    "bf16-nan-payload": (torch.bfloat16, [0x3F80, 0x7FC1, 0xFFC0]),
    "fp16-nan-payload": (torch.float16, [0x3C00, 0x7E01, 0xFE00]),
    "fp16-neg-zero": (torch.float16, [0x8000, 0x8000]),
}


def _inputs():
    for name, bits in F32_CASES.items():
        yield name, _from_bits(bits)
    for name, (dtype, bits) in HALF_CASES.items():
        yield name, _from_bits(bits, dtype)


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("name", list(F32_CASES) + list(HALF_CASES))
def test_group_minmax_outputs_are_canonical(impl, device, name):
    x = dict(_inputs())[name].to(device)
    for rows in (1, 3):  # also an order where the special value is met in different chunks
        xx = x.repeat(rows, 1)
        mn, mx = _ops(impl).group_minmax(xx, 1, 1, False)
        _assert_canonical(mn, f"{name} min")
        _assert_canonical(mx, f"{name} max")
        mn_s, mx_s = _ops(impl).group_minmax(xx, 1, 1, True)
        _assert_canonical(mn_s, f"{name} per-sample min")
        _assert_canonical(mx_s, f"{name} per-sample max")


def test_group_minmax_expected_bits():
    """Hand-written expected patterns (so 'canonical' cannot be met by, e.g., all zeros)."""
    x = _from_bits([0x3F800000, 0x7FC00001, 0xBF800000, 0x80000000]).view(2, 2)
    for ops in (R,) + ((torch.ops.mesa,) if Q.BACKEND == "extension" else ()):
        mn, mx = ops.group_minmax(x, 1, 2, False)  # groups: column 0 = [1, -1], column 1 = [NaN, -0]
        assert _bits(mn).tolist() == [[0xBF800000 - 2**32, CANON_NAN]]
        assert _bits(mx).tolist() == [[0x3F800000, CANON_NAN]]
        z = _from_bits([0x80000000, 0x80000000])
        mn, mx = ops.group_minmax(z, 0, 1, False)
        assert _bits(mn).tolist() == [[0]] and _bits(mx).tolist() == [[0]]


def _estimate_cases():
    """(name, mn, mx, per_sample, symmetric, init)."""
    nanp = _from_bits([0x7FC00001])
    nneg = _from_bits([0xFFC00000])
    nz = _from_bits([0x80000000])
    one = torch.tensor([1.0])
    yield "sym-zero-range", torch.zeros(1, 2), torch.zeros(1, 2), False, True, False
    yield "sym-neg-zero", nz.repeat(1, 2), nz.repeat(1, 2), False, True, False
    yield "sym-zero-init", torch.zeros(1, 2), torch.zeros(1, 2), False, True, True
    yield "sym-zero-per-sample", torch.zeros(3, 2), torch.zeros(3, 2), True, True, False
    yield "neg-zero-asym", nz.repeat(1, 2), nz.repeat(1, 2), False, False, False
    yield "nan-payload", torch.cat([nanp, one]).view(1, 2), torch.cat([one, one * 2]).view(1, 2), False, False, False
    yield "neg-nan", torch.cat([nneg, one]).view(1, 2), torch.cat([one, nneg]).view(1, 2), False, True, False
    yield "nan-per-sample", torch.cat([nanp, one, one, nneg]).view(2, 2), torch.full((2, 2), 3.0), True, False, False


ESTIMATE_CASES = {c[0]: c[1:] for c in _estimate_cases()}


def _run_estimates(impl, device, mn, mx, per_sample, symmetric, init):
    a = torch.tensor([0.5, 0.0, 2.0], device=device)
    b = _from_bits([0x80000000, 0x80000000, 0x3F800000]).to(device)  # -0.0 in the buffers already
    flag = torch.tensor(init, device=device)
    alpha, beta = _ops(impl).update_estimates(mn.to(device), mx.to(device), a, b, flag, 0.5, per_sample, symmetric,
                                              True)
    return alpha, beta, a, b


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("name", list(ESTIMATE_CASES))
def test_update_estimates_outputs_and_buffers_are_canonical(impl, device, name):
    alpha, beta, a, b = _run_estimates(impl, device, *ESTIMATE_CASES[name])
    for t, n in ((alpha, "alpha"), (beta, "beta"), (a[:2], "alpha_est"), (b[:2], "beta_est")):
        _assert_canonical(t, f"{name} {n}")
    assert _bits(b[2:]).tolist() == [0x3F800000]  # entries past G are never written


def test_symmetric_zero_range_expected_bits():
    """m = 0: alpha = 0 and beta = -m = +0.0 (was -0.0)."""
    for ops in (R,) + ((torch.ops.mesa,) if Q.BACKEND == "extension" else ()):
        impl = "reference" if ops is R else "kernel"
        alpha, beta, a, b = _run_estimates(impl, "cpu", *ESTIMATE_CASES["sym-zero-range"])
        assert _bits(alpha).tolist() == [[0, 0]] and _bits(beta).tolist() == [[0, 0]]
        assert _bits(a).tolist()[:2] == [0, 0] and _bits(b).tolist()[:2] == [0, 0]


@needs_ext
@pytest.mark.parametrize("name", list(ESTIMATE_CASES))
def test_update_estimates_kernel_equals_reference_bits(name):
    got = _run_estimates("kernel", "cpu", *ESTIMATE_CASES[name])
    want = _run_estimates("reference", "cpu", *ESTIMATE_CASES[name])
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w))


@needs_ext
@pytest.mark.parametrize("name", list(F32_CASES) + list(HALF_CASES))
def test_group_minmax_kernel_equals_reference_bits(name):
    x = dict(_inputs())[name].repeat(4, 3)
    for per_sample in (False, True):
        for g, w in zip(torch.ops.mesa.group_minmax(x, 1, 2, per_sample), R.group_minmax(x, 1, 2, per_sample)):
            assert torch.equal(_bits(g), _bits(w))


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("name", list(F32_CASES) + list(HALF_CASES))
def test_observe_outputs_and_buffers_are_canonical(impl, device, name):
    x = dict(_inputs())[name].repeat(2, 1).to(device)
    fn = torch.ops.mesa.observe if impl == "kernel" else R.observe
    for per_sample in (False, True):
        for symmetric in (False, True):
            a = torch.tensor([0.5, 1.0], device=device)
            b = _from_bits([0x80000000, 0x80000000]).to(device)
            for init in (False, True):  # before and after initialisation
                flag = torch.tensor(init, device=device)
                rng = torch.tensor([1, 2], dtype=torch.int64, device=device)
                alpha, beta, _ = fn(x, a, b, flag, rng, 1, 1, 0.5, per_sample, symmetric)
                for t, n in ((alpha, "alpha"), (beta, "beta"), (a[:1], "alpha_est"), (b[:1], "beta_est")):
                    _assert_canonical(t, f"{name} per_sample={per_sample} symmetric={symmetric} {n}")
