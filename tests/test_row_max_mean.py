"""The mean of the row maxima that the row exponents are measured against
(``reference.row_max_mean``; DESIGN.md, "The mean of the row maxima").

It is an exact int64 sum in fixed point, not a float reduction, so that the reference, the CPU
kernels, the CUDA kernels (where one block finds it inside the row pass) and the traced form
under Inductor give the same bits whatever order they add in. Checked here: the definition's
own properties (the same bits for any order, within one float32 rounding of the exact mean, the
degenerate batches), and that every implementation agrees on rows built so that ``mean / r`` is
exactly 2 or 4, or one ulp to either side: a mean one ulp off flips one of those rows' ``k``.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from mesa_train.quant import reference as R
from kernel_marks import DEVICES, EXT_DEVICES, needs_ext


def _spread(n: int, seed: int) -> torch.Tensor:
    """n float32 row maxima over 60 octaves (the float sums of them round at every step)."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 0.5
    return (mant * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())).float()


def _exact_mean(r: torch.Tensor) -> Fraction:
    return sum((Fraction(v) for v in r.double().tolist()), Fraction(0)) / r.numel()


@pytest.mark.parametrize("n", [1, 2, 3, 197, 4096, 25216])
def test_same_bits_in_any_order_and_within_one_rounding_of_the_exact_mean(n):
    r = _spread(n, n)
    mean = R.row_max_mean(r)
    assert mean.dtype == torch.float32 and mean.shape == ()
    g = torch.Generator().manual_seed(0)
    for order in [torch.arange(n).flip(0)] + [torch.randperm(n, generator=g) for _ in range(5)]:
        assert R.row_max_mean(r[order]).view(torch.int32) == mean.view(torch.int32)
    exact = _exact_mean(r)
    # one float32 rounding (2**-24) plus the fixed point's truncation (below 2**-30)
    assert abs(Fraction(mean.item()) - exact) <= exact * Fraction(1, 2**23)
    assert torch.equal(R.row_max_mean(r.view(-1, 1)), mean)  # (any shape: the rows' own)


def test_one_row_and_equal_rows_are_their_value():
    for v in (1.0, 3.0e38, 1.4e-45, 0.1):
        r = torch.tensor([v], dtype=torch.float32)
        assert R.row_max_mean(r).item() == r.item()
        assert R.row_max_mean(r.expand(1000).contiguous()).item() == r.item()


def test_no_rows_is_a_one_line_error():
    with pytest.raises(ValueError, match="at least one row maximum"):
        R.row_max_mean(torch.empty(0))
    assert R.row_exponents(torch.empty(0, 5), 1, 64).shape == (0, 1)  # (row_exponents: no rows, no k)


def test_degenerate_batches_give_the_float_mean_each_k_zero_with():
    nan, inf = float("nan"), float("inf")
    assert torch.isnan(R.row_max_mean(torch.tensor([1.0, nan, 2.0])))
    assert R.row_max_mean(torch.tensor([1.0, inf, 2.0])).item() == inf
    assert R.row_max_mean(torch.zeros(5)).item() == 0.0
    # a NaN / inf row in a batch: every row's k is 0, as with ATen's mean
    x = torch.tensor([[1.0, 2.0], [1e-6, 0.0], [nan, 1.0]])
    assert R.row_exponents(x, 1, 64).eq(0).all()
    x[2, 0] = inf
    assert R.row_exponents(x, 1, 64).eq(0).all()


def _at_the_boundaries(n: int, seed: int, device) -> torch.Tensor:
    """(n + 6, 64) float32 rows: n of spread magnitudes, then six rows whose max is the
    batch's own mean over 2 and 4 exactly and one float32 ulp to either side of mean / 2, the
    mean taken with those rows (found as a fixed point: each probe is a function of the mean
    it changes, by an ulp at most after the first round)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 64, generator=g) * _spread(n, seed).view(n, 1)
    probes = torch.zeros(6, 64)
    mean = R.row_max_mean(base.abs().amax(1))
    for _ in range(50):
        half = mean / 2
        values = torch.stack([half, mean / 4, torch.nextafter(half, torch.tensor(0.0)),
                              torch.nextafter(half, torch.tensor(float("inf"))), half, mean / 4])
        probes[:, 7] = values * torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])
        x = torch.cat([base, probes])
        new = R.row_max_mean(x.abs().amax(1))
        if torch.equal(new, mean):
            return x.to(device)
        mean = new
    raise AssertionError("no fixed point for the boundary rows")


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [40, 3000])
def test_every_implementation_finds_the_same_k_at_the_boundaries(device, n):
    x = _at_the_boundaries(n, n, device)
    want = R.row_exponents(x, 1, 64)
    # the probes: mean / r exactly 2 and 4 (k 1, 2), just above 2 (k 1), just below (k 0)
    assert want.view(-1)[n:].tolist() == [1, 2, 1, 0, 1, 2]
    assert torch.equal(torch.ops.mesa.row_exponents(x, 1, 64), want)
    # observe_rows' one pass (on CUDA the flat row pass's last block finds the mean)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        state = (torch.zeros(4, device=device), torch.zeros(4, device=device),
                 torch.zeros(1, dtype=torch.bool, device=device))
        rng = torch.tensor([7, 3], dtype=torch.int64, device=device)
        *_, k = torch.ops.mesa.observe_rows(xd, *state, rng, 1, 4, 0.9, False, False, 1, 64)
        assert torch.equal(k, R.row_exponents(xd, 1, 64)), dtype


def test_traced_under_inductor_is_the_eager_definition():
    """The traced compression computes k with the reference's ops; Inductor's own reductions
    must not change the mean's bits (a float mean would be summed in Inductor's order)."""
    torch._dynamo.reset()
    r = _spread(25216, 5)
    compiled = torch.compile(R.row_max_mean, backend="inductor", fullgraph=True)
    assert compiled(r).view(torch.int32) == R.row_max_mean(r).view(torch.int32)
    x = _at_the_boundaries(300, 1, "cpu")
    rows = torch.compile(R.row_exponents, backend="inductor", fullgraph=True)
    assert torch.equal(rows(x, 1, 64), R.row_exponents(x, 1, 64))


def _truncation_probe(device) -> torch.Tensor:
    """(2**20, 4) float32 rows where the fixed point's truncation decides a row's k: one row of
    max 1, 2**20 - 2 rows of max 0.75 * 2**-40 (below one unit of the sum, b = 62 - 21 = 41 bits
    under the top's 2**1: each term truncates to 0, would round to 1, 2**-20 of the sum in all;
    under 2**19 rows that is below a float32 rounding of the mean), and a probe row just above
    half the mean (found as a fixed point, as _at_the_boundaries does), whose k is 0 with the
    truncated sum and 1 with any mean larger by more than 2**-23 of it."""
    n = 2**20
    r = torch.full((n,), 0.75 * 2.0**-40)
    r[0] = 1.0
    mean = R.row_max_mean(r)
    for _ in range(50):
        r[-1] = torch.nextafter(mean / 2, torch.tensor(float("inf")))
        new = R.row_max_mean(r)
        if torch.equal(new, mean):
            x = torch.zeros(n, 4)
            x[:, 1] = r * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
            return x.to(device)
        mean = new
    raise AssertionError("no fixed point for the probe row")


def _k_of(mean: float, r: float) -> int:
    return max(0, min(64, int(torch.frexp(torch.tensor(mean / r, dtype=torch.float32)).exponent) - 1))


def test_the_fixed_point_terms_are_truncated_not_rounded():
    """The definition truncates each row maximum to its units (floor): a sum of rounded terms,
    or a float mean, is larger here by about 2**-20 of the mean, which moves the probe row's k
    from 0 to 1. The reference, the ops (CPU, CUDA) and observe_rows' pass must all truncate."""
    x = _truncation_probe("cpu")
    r = x.abs().amax(1)
    n, b, e = r.numel(), 62 - (2**20).bit_length(), 1
    truncated = sum(int(v * 2**(b - e)) for v in r.double().tolist())
    assert truncated == 2**(b - e) + int(r[-1].double() * 2**(b - e))  # (the small rows add nothing)
    mean = R.row_max_mean(r).item()
    assert mean == float(torch.tensor(float(Fraction(truncated, 2**(b - e)) / n), dtype=torch.float32))
    rounded = sum(round(v * 2**(b - e)) for v in r.double().tolist())
    rounded_mean = float(torch.tensor(float(Fraction(rounded, 2**(b - e)) / n), dtype=torch.float32))
    probe = r[-1].item()
    # the case has teeth: the definition's k for the probe is 0, rounded terms or a float mean give 1
    assert _k_of(mean, probe) == 0 and _k_of(rounded_mean, probe) == 1 and _k_of(r.mean().item(), probe) == 1
    want = R.row_exponents(x, 1, 64)
    assert want[-1].item() == 0 and want[0].item() == 0 and want[1].item() == _k_of(mean, r[1].item())


@pytest.mark.parametrize("device", EXT_DEVICES)
def test_the_ops_truncate_the_fixed_point_terms_too(device):
    """The same probe through the kernels: row_exponents and observe_rows' one pass (on CUDA the
    flat row pass's last block sums the terms) give the reference's k, the probe's 0 among them."""
    x = _truncation_probe("cpu")
    want = R.row_exponents(x, 1, 64)
    assert want[-1].item() == 0
    xd = x.to(device)
    assert torch.equal(torch.ops.mesa.row_exponents(xd, 1, 64).cpu(), want)
    state = (torch.zeros(4, device=device), torch.zeros(4, device=device),
             torch.zeros(1, dtype=torch.bool, device=device))
    rng = torch.tensor([7, 3], dtype=torch.int64, device=device)
    *_, k = torch.ops.mesa.observe_rows(xd, *state, rng, 1, 4, 0.9, False, False, 1, 64)
    assert torch.equal(k.cpu(), want)
