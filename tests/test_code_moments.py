"""``mesa::code_moments`` (csrc/code_moments.cpp): the per-channel mean and variance the Mesa
BatchNorm's backward re-standardises x_hat with, from the 8-bit codes. Checked against the
pure-PyTorch reference bit for bit (each CPU walk: runs of long planes, columns of short planes
or channels-last rows, a strided tensor through ATen; several parallel tasks; 1 and 2 threads),
against float64 moments of the dequantized values, at the uint32 accumulators' limits, for a
constant channel (variance exactly 0), with opcheck, and for bad arguments."""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from mesa_train.quant import reference as R
from kernel_marks import DEVICES, needs_ext

pytestmark = needs_ext

# (shape, dim, groups): which walk each takes on the CPU
CASES = {
    "long-planes": ((4, 6, 9, 9), 1, 6),  # planes of 81 >= 64 codes: summed run by run per channel
    "long-planes-3-tasks": ((2, 8, 100, 100), 1, 4),  # 20000 codes a channel: 3 channels a task
    "short-planes": ((4, 6, 5, 7), 1, 6),  # 35 codes: columns of rows of 6 * 35
    "2x2-maps": ((16, 40, 2, 2), 1, 8),
    "channels-last": ((4, 5, 7, 6), 3, 6),  # a BatchNorm's NHWC view: rows of C codes
    "rows-4-tasks": ((70000, 3), 1, 3),  # 21845 rows a task
    "ncl": ((3, 6, 11), 1, 2),
    "dim0": ((6, 4, 3), 0, 3),
}


def _inputs(shape, G, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    alpha = torch.rand(1, G, generator=gen) * 4 + 0.1
    beta = -torch.rand(1, G, generator=gen) * 2
    return q.to(device), alpha.to(device), beta.to(device)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_the_reference(device, case):
    shape, dim, G = CASES[case]
    q, alpha, beta = _inputs(shape, G, device)
    mean, var = torch.ops.mesa.code_moments(q, alpha, beta, dim, G)
    want_mean, want_var = R.code_moments(q, alpha, beta, dim, G)
    assert _same_bits(mean, want_mean) and _same_bits(var, want_var)


def test_strided_codes_and_thread_counts_give_the_same_bits():
    q, alpha, beta = _inputs((4, 6, 9, 18), 6, "cpu")
    strided = q[..., ::2]  # through ATen's reductions
    assert not strided.is_contiguous()
    want = R.code_moments(strided, alpha, beta, 1, 6)
    got = torch.ops.mesa.code_moments(strided, alpha, beta, 1, 6)
    assert all(_same_bits(a, b) for a, b in zip(got, want))
    before = torch.get_num_threads()
    try:
        for case in ("long-planes-3-tasks", "rows-4-tasks"):
            shape, dim, G = CASES[case]
            q, alpha, beta = _inputs(shape, G, "cpu")
            runs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                runs.append(torch.ops.mesa.code_moments(q, alpha, beta, dim, G))
            assert all(_same_bits(a, b) for a, b in zip(*runs))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", list(CASES))
def test_close_to_the_dequantized_values_float64_moments(case):
    shape, dim, G = CASES[case]
    q, alpha, beta = _inputs(shape, G, "cpu", seed=1)
    xh = R.dequantize(q, alpha, beta, dim, G).double()
    dims = [d for d in range(q.dim()) if d != dim]
    mean, var = torch.ops.mesa.code_moments(q, alpha, beta, dim, G)
    torch.testing.assert_close(mean.double(), xh.mean(dims), rtol=0, atol=1e-6)
    torch.testing.assert_close(var.double(), xh.var(dims, correction=0), rtol=2e-6, atol=0)


@pytest.mark.parametrize("shape,dim", [((1 << 17, 1), 1), ((1, 2, 70000), 1)], ids=["rows-of-one", "long-plane"])
def test_all_255_codes_at_the_uint32_limits(shape, dim):
    """65536 rows (one task of rows of one code) and a plane over 65536 codes: sums of 255^2 that
    a uint32 holds only within kSpan codes."""
    q = torch.full(shape, 255, dtype=torch.uint8)
    q.view(-1)[0] = 0  # not constant: a variance that an overflowed sum would get wrong
    alpha, beta = torch.full((1, q.shape[dim]), 255.0), torch.zeros(1, q.shape[dim])
    mean, var = torch.ops.mesa.code_moments(q, alpha, beta, dim, q.shape[dim])
    want_mean, want_var = R.code_moments(q, alpha, beta, dim, q.shape[dim])
    assert _same_bits(mean, want_mean) and _same_bits(var, want_var)
    n = q.numel() // q.shape[dim]
    assert abs(mean[0].item() - 255.0 * (n - 1) / n) < 1e-3 and var[0].item() > 0


@pytest.mark.parametrize("case", ["long-planes", "short-planes", "channels-last"])
def test_a_constant_channel_has_variance_exactly_zero(case):
    shape, dim, G = CASES[case]
    q, alpha, beta = _inputs(shape, G, "cpu")
    q.select(dim, 2).fill_(77)
    mean, var = torch.ops.mesa.code_moments(q, alpha, beta, dim, G)
    g = 2 * G // q.shape[dim]
    assert var[2].item() == 0.0 and (var > 0).sum() == q.shape[dim] - 1
    assert mean[2].item() == pytest.approx(77 * alpha[0, g].item() / 255 + beta[0, g].item(), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for case in ("short-planes", "channels-last"):
        shape, dim, G = CASES[case]
        opcheck(torch.ops.mesa.code_moments.default, (*_inputs(shape, G, device), dim, G))


def test_bad_arguments_are_clear_errors():
    q, alpha, beta = _inputs((4, 6, 5, 7), 6, "cpu")
    with pytest.raises(ValueError, match=r"shared by all samples, shape \(1, 6\), got \[4, 6\]"):
        torch.ops.mesa.code_moments(q, alpha.expand(4, 6).contiguous(), beta.expand(4, 6).contiguous(), 1, 6)
    with pytest.raises(ValueError, match="the codes are empty"):
        torch.ops.mesa.code_moments(q[:0], alpha, beta, 1, 6)
    with pytest.raises(ValueError, match="uint8"):
        torch.ops.mesa.code_moments(q.float(), alpha, beta, 1, 6)
    for op in (torch.ops.mesa.code_moments, R.code_moments):  # the reference says the same
        with pytest.raises(ValueError, match="shared by all samples"):
            op(q, alpha.expand(4, 6).contiguous(), beta.expand(4, 6).contiguous(), 1, 6)


@pytest.mark.parametrize("kernels", ["ops", "traceable"])
def test_batchnorm_compiled_gradients_are_eager_bits(kernels):
    """The Mesa BatchNorm takes its moments from the codes in forward, eager and compiled alike:
    the op, or under traced kernels its pure-PyTorch reference (the same bits), so the compiled
    step's gradients are eager's bit for bit."""
    import copy

    import mesa_train.nn as mnn
    from mesa_train.quant.compile_kernels import compile_kernels, set_compile_kernels

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), mnn.BatchNorm2d(8), torch.nn.ReLU())
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 3, 9, 9)
    before = compile_kernels()
    set_compile_kernels(kernels)
    try:
        torch._dynamo.reset()
        torch.compile(compiled, backend="aot_eager", fullgraph=True)(x).pow(2).mean().backward()
    finally:
        set_compile_kernels(before)
        torch._dynamo.reset()
    eager(x).pow(2).mean().backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
