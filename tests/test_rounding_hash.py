"""Statistical quality of the stochastic-rounding hash (DESIGN.md, "Stochastic rounding").

The kernels (CPU, CUDA, traced) are pinned bit for bit to ``reference.uniform_from_hash``
elsewhere; these tests check that what they all compute is a usable source of uniform
noise: one ``lowbias32`` per pair of elements of the Weyl step ``(index_lo >> 1) * 0x9E3779B9 +
key``, the key a hash of the seed, its low 16 bits the even element's and its high 16 bits the
odd one's.
Every bound is about five standard deviations of the statistic under true uniform
independent noise, so a sound hash passes with overwhelming probability (the values are
deterministic: these seeds pass or fail the same way every run), and a structured one
fails (``test_the_checks_catch_weak_hashes`` shows each check can fail).
"""
from __future__ import annotations

import math

import pytest
import torch

from mesa_train.quant import reference as R

N = 1 << 20  # elements per draw: one DeiT-S token activation is ~10M
SIGMAS = 5.0


def _observe_seeds(count: int, key: int = 0x12345678) -> list[torch.Tensor]:
    """The seeds observe hands to quantize over ``count`` consecutive training steps."""
    rng = torch.tensor([key, 0], dtype=torch.int64)
    return [R.seed_step(rng) for _ in range(count)]


def _chi_square(u: torch.Tensor, bins: int) -> float:
    counts = torch.bincount((u * bins).long().clamp_(0, bins - 1), minlength=bins).double()
    expected = u.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def _chi_square_bound(dof: int) -> float:
    return dof + SIGMAS * math.sqrt(2 * dof)


def _joint_chi_square(x: torch.Tensor, y: torch.Tensor, bins: int = 32) -> float:
    """Chi-square of the 2-d histogram of the pairs (x[k], y[k])."""
    a = (x * bins).long().clamp_(0, bins - 1)
    b = (y * bins).long().clamp_(0, bins - 1)
    return _chi_square((a * bins + b).double() / (bins * bins), bins * bins)


def _pair_chi_square(u: torch.Tensor, lag: int, bins: int = 32) -> float:
    """Chi-square of the 2-d histogram of (u[i], u[i + lag]): catches lattice structure
    (a multiplicative hash puts neighbours on a few lines) that 1-d counts miss."""
    return _joint_chi_square(u[:-lag], u[lag:], bins)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double() - a.double().mean()
    b = b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _check_uniform_stream(u: torch.Tensor) -> list[str]:
    """The failed checks (empty: all pass) of one draw of ``u``."""
    failed = []
    n = u.numel()
    if not (0.0 <= float(u.min()) and float(u.max()) < 1.0):
        failed.append("range")
    if abs(float(u.double().mean()) - 0.5) > SIGMAS * math.sqrt(1 / 12 / n):
        failed.append("mean")
    if _chi_square(u, 256) > _chi_square_bound(255):
        failed.append("1-d histogram")
    # neighbours (the two halves of one hash), the next pair, a 16-element step, 16 pairs, a DeiT-S row
    for lag in (1, 2, 16, 32, 384):
        if abs(_correlation(u[:-lag], u[lag:])) > SIGMAS / math.sqrt(n):
            failed.append(f"lag-{lag} correlation")
        if lag in (1, 2, 16, 32) and _pair_chi_square(u, lag) > _chi_square_bound(32 * 32 - 1):
            failed.append(f"lag-{lag} pair histogram")
    # the two halves of each pair's hash alone (lag 1 mixes them with the next pair's neighbours)
    even, odd = u[0 : n - n % 2 : 2], u[1::2]
    if abs(_correlation(even, odd)) > SIGMAS / math.sqrt(n / 2):
        failed.append("pair halves correlation")
    if _joint_chi_square(even, odd) > _chi_square_bound(32 * 32 - 1):
        failed.append("pair halves histogram")
    bits = (u * 2**16).long()
    for b in range(16):  # each of the 16 bits of u is a fair coin
        ones = float(((bits >> b) & 1).double().sum())
        if abs(ones - n / 2) > SIGMAS * math.sqrt(n / 4):
            failed.append(f"bit {b}")
    return failed


@pytest.mark.parametrize("step", [0, 1, 7])
def test_noise_of_one_step_is_uniform_and_independent(step):
    seed = _observe_seeds(step + 1)[step]
    assert _check_uniform_stream(R.uniform_from_hash(N, seed)) == []


@pytest.mark.parametrize("seed", [0, 1, 2**32, 0xFFFFFFFF, -1])
def test_small_and_edge_python_seeds_give_uniform_noise(seed):
    """Python-int seeds (the legacy API) including 0, whose key is lowbias32(0) = 0."""
    assert _check_uniform_stream(R.uniform_from_hash(N, seed)) == []


def test_noise_above_two_to_the_32_is_uniform():
    """Indices whose high word is nonzero use a different key (the 64-bit index path)."""
    assert _check_uniform_stream(R.uniform_from_hash(N, 99, start=2**32 - N // 2)) == []


def test_consecutive_steps_draw_independent_noise():
    """An element's noise at one step says nothing about its noise at the next: the
    correlation of whole draws, step to step, is within noise, and so is the correlation
    between a draw and the next step's draw shifted by one index."""
    seeds = _observe_seeds(6)
    draws = [R.uniform_from_hash(N, s) for s in seeds]
    bound = SIGMAS / math.sqrt(N)
    for a, b in zip(draws, draws[1:]):
        assert abs(_correlation(a, b)) < bound
        assert abs(_correlation(a[:-1], b[1:])) < bound
        assert float((a == b).double().mean()) < 1e-3  # 16-bit values: ~1.5e-5 expected


def test_stochastic_rounding_with_this_noise_is_unbiased():
    """E[floor(v + u)] = v for fractional v: the mean of 64 steps' codes of one tensor is
    within five standard errors of v, per element group of the fractional parts."""
    frac = torch.linspace(0.0, 1.0, 17)[:-1]  # 16 fractional parts, including 0
    v = (frac.repeat(N // 16 // 16) + 7.0)  # 65536 elements
    total = torch.zeros_like(v, dtype=torch.float64)
    for seed in _observe_seeds(64):
        total += torch.floor(v + R.uniform_from_hash(v.numel(), seed)).double()
    mean = (total / 64).view(-1, 16).mean(0)  # average over 4096 elements x 64 steps each
    trials = 64 * v.numel() // 16
    se = torch.sqrt(frac.double() * (1 - frac.double()) / trials).clamp_min(1e-12)
    assert torch.all((mean - (frac.double() + 7.0)).abs() <= SIGMAS * se + 1e-12), mean - (frac + 7.0)


def test_the_checks_catch_weak_hashes():
    """The checks fail on plausible but weak hashes, so a regression in the definition
    (dropping the Weyl step or half a round, a multiply-only hash, a bare xor, one half
    of a pair's hash for both its elements) shows."""
    i = torch.arange(N, dtype=torch.int64)
    pair = i >> 1
    key = int(R.hash_key(torch.tensor(5), torch.tensor(9), torch.tensor(0)))

    def as_u(h):  # each element's half of its pair's 32 bits, as the definition takes it
        return (((h & 0xFFFFFFFF) >> ((i & 1) << 4)) & 0xFFFF).to(torch.float32) * 2.0**-16

    bare_xor = as_u(pair ^ key)  # no mixing at all
    multiply_only = as_u((pair ^ key) * 0x7FEB352D)  # one multiply: neighbours on a lattice
    half_round = as_u(((pair ^ key) ^ ((pair ^ key) >> 16)) * 0x7FEB352D)  # first half of lowbias32
    # the definition without its Weyl step: lowbias32 of pair ^ key leaves pairs 16 apart
    # (elements 32 apart) dependent: pair chi-square 1275 against a bound of 1249, the reason it is there
    no_weyl_step = as_u(R.lowbias32(pair ^ key))
    # both elements of a pair given the same half: neighbours equal half the time
    h = R.lowbias32((R._mul32(pair, 0x9E3779B9) + key) & 0xFFFFFFFF)
    one_half_for_both = (h & 0xFFFF).to(torch.float32) * 2.0**-16
    weak = [("bare xor", bare_xor), ("multiply only", multiply_only), ("half round", half_round),
            ("no Weyl step", no_weyl_step), ("one half for both", one_half_for_both)]
    for name, u in weak:
        assert _check_uniform_stream(u) != [], name
    assert {"pair halves correlation", "pair halves histogram"} <= set(_check_uniform_stream(one_half_for_both))
    # and the definition itself, written out here, passes them
    assert _check_uniform_stream(as_u(h)) == []
    assert torch.equal(as_u(h), R.uniform_from_hash(N, torch.tensor([5, 9])))
