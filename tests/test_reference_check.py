"""mesa_train.quant.reference_check: the kernel benchmark's check that each timed op computed the
reference's results on its shape. It must see a wrong result, in an output or in the state an op
updates in place, and hold the GELU ops to their ulp bound only."""
from __future__ import annotations

import pytest
import torch

from mesa_train import quant as Q
from mesa_train.quant import benchmark
from mesa_train.quant import reference as R
from mesa_train.quant.reference_check import ReferenceCheck, compare


def _tokens(dtype=torch.bfloat16):
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    state = [torch.zeros(4), torch.zeros(4), torch.zeros((), dtype=torch.bool), Q.rng_state(0)]
    return x, state


def test_correct_ops_are_equal_and_only_top_level_calls_are_checked():
    x, state = _tokens()
    with ReferenceCheck() as check:
        a, b, seed = torch.ops.mesa.observe(x, *state, -1, 4, 0.9, False, False)
        torch.ops.mesa.quantize(x, a, b, -1, 4, True, seed)
        # one op that calls observe_rows and quantize inside it: one check, of compress itself
        torch.ops.mesa.compress(x, *state, 2, 4, 0.9, 0, False, True, 1, 64)
        y = x.float() * 2  # (not a mesa:: op: passed through, not checked)
    assert [op for op, _, _ in check.found] == ["mesa::observe", "mesa::quantize", "mesa::compress"]
    assert check.verdict() == "equal" and torch.equal(y, x.float() * 2)
    with ReferenceCheck() as none:
        x.clone()
    assert none.verdict() is None


def test_a_wrong_output_is_a_mismatch(monkeypatch):
    def off_by_one(x, alpha, beta, dim, num_groups, stochastic, seed, *rest):
        q = R.quantize(x, alpha, beta, dim, num_groups, stochastic, seed, *rest)
        q.view(-1)[5] += 1
        return q

    monkeypatch.setitem(Q._REF_IMPLS, "quantize", off_by_one)
    x, state = _tokens()
    a, b, seed = torch.ops.mesa.observe(x, *state, -1, 4, 0.9, False, False)
    with ReferenceCheck() as check:
        torch.ops.mesa.quantize(x, a, b, -1, 4, True, seed)
    assert check.verdict() == f"MISMATCH mesa::quantize: 1 of {x.numel()} elements differ"


def test_wrong_state_updated_in_place_is_a_mismatch(monkeypatch):
    """observe advances the rounding counter and the estimates in place: a reference that leaves
    the counter where it was disagrees in a written buffer, not in an output."""
    def no_step(x, alpha_est, beta_est, initialized, rng, *rest, **named):
        saved = rng.clone()
        out = R.observe(x, alpha_est, beta_est, initialized, rng, *rest, **named)
        rng.copy_(saved)
        return out

    monkeypatch.setitem(Q._REF_IMPLS, "observe", no_step)
    x, state = _tokens()
    with ReferenceCheck() as check:
        torch.ops.mesa.observe(x, *state, -1, 4, 0.9, False, False)
    verdict = check.verdict()
    assert verdict.startswith("MISMATCH mesa::observe:") and "of 2 elements differ" in verdict
    # the same with the written buffer passed by name. A call through torch.ops reaches the mode
    # with every argument moved into args (no mesa:: op has keyword-only arguments), so the
    # by-name path is driven directly, as a caller handing the mode kwargs would
    by_name = ReferenceCheck()
    by_name.__torch_dispatch__(torch.ops.mesa.observe.default, (), (x, *state[:3]),
                               dict(rng=state[3], dim=-1, num_groups=4, decay=0.9, per_sample=False,
                                    symmetric=False))
    verdict = by_name.verdict()
    assert verdict.startswith("MISMATCH mesa::observe:") and "of 2 elements differ" in verdict


@pytest.mark.parametrize("dtype,ulps,ok", [(torch.bfloat16, 1, True), (torch.bfloat16, 2, False),
                                           (torch.float32, 8, True), (torch.float32, 9, False)])
def test_gelu_ops_are_held_to_their_ulp_bound_others_to_the_bits(dtype, ulps, ok):
    want = torch.full((4,), 1.0, dtype=dtype)  # (at 1.0 one step up is one ulp of the measure)
    got = want.clone()
    for _ in range(ulps):
        got[1] = torch.nextafter(got[1:2], torch.full((1,), 2.0, dtype=dtype))[0]
    good, what = compare(got, want, (1.0, 8.0))
    assert good is ok, what
    assert not compare(got, want, None)[0]  # no bound: one ulp is a mismatch
    assert compare(want, want.clone(), None) == (True, "equal")
    # NaN bits: a canonical NaN against another payload is a difference, as on the bitwise tests
    nan = torch.tensor([float("nan")], dtype=torch.float32)
    other = nan.view(torch.int32).add(1).view(torch.float32)
    assert not compare(other, nan, None)[0] and compare(nan, nan.clone(), None)[0]


def test_benchmark_table_shows_a_mismatch(monkeypatch, tmp_path, capsys):
    def wrong(q, alpha, beta, dim, num_groups, dtype, *rest):
        return R.dequantize(q, alpha, beta, dim, num_groups, dtype, *rest) * 2

    monkeypatch.setitem(Q._REF_IMPLS, "dequantize", wrong)
    table = benchmark.main(["--device", "cpu", "--quick", "--dtypes", "fp32", "--cases", "attn",
                            "--ops", "^backward: dequantize$"])
    row = next(line for line in table.splitlines() if "| backward: dequantize |" in line)
    assert "MISMATCH mesa::dequantize:" in row
    out = capsys.readouterr().out
    assert ("reference: 0 rows equal bit for bit, 0 within the GELU ops' ulp bound, 1 MISMATCH: attn (2,3,65,65) "
            "per-head dim 1 | fp32 | backward: dequantize") in out
    unchecked = benchmark.main(["--device", "cpu", "--quick", "--dtypes", "fp32", "--cases", "attn",
                                "--ops", "^backward: dequantize$", "--no-check"])
    row = next(line for line in unchecked.splitlines() if "| backward: dequantize |" in line)
    assert row.endswith("| not checked |") and "Reference: not checked (--no-check)." in unchecked
