"""scripts/compile_ab.py: two Inductor option sets on one model, interleaved."""
from __future__ import annotations

import re

import pytest
from conftest import load_script


def test_times_both_variants_each_compiled_on_its_own(capsys):
    """Both variants step (a time each and their difference), each compiled as its own graph even
    with the same options: two copies of one class would share Dynamo's cache entry (one graph),
    and each lookup would try the other variant's guards first."""
    import torch._dynamo

    ab = load_script("compile_ab")
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert ab.main(["--depth", "1", "--steps", "2", "--a", "{}", "--b", "{}"]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    capsys.readouterr()
    assert ab.main(["--depth", "1", "--steps", "2", "--a", '{"size_asserts": true}', "--reverse"]) == 0
    out = capsys.readouterr().out
    assert "compiled in the order B A" in out
    assert re.search(r'A \{"size_asserts": true\}: \d+\.\d\d ms a step', out)
    assert re.search(r"B \{\}: \d+\.\d\d ms a step", out)
    assert re.search(r"B - A: [+-]\d+\.\d\d ms a step; B / A: \d\.\d{3}", out)


def test_skip_guards_times_one_compiled_model_with_and_without_its_guards(capsys, monkeypatch):
    """--skip-guards: one graph, stepped with Dynamo's guards evaluated and skipped (each timed
    step under the stance its row names, both orders); the stance is restored after (a later
    compile still checks its guards)."""
    import torch
    import torch._dynamo
    import torch._dynamo.eval_frame as eval_frame  # (set_stance rebinds eval_frame._stance: read it there)

    ab = load_script("compile_ab")
    stances = []  # skip_guard_eval_unsafe during each timed step
    timed = ab._seconds

    def spy(step, compiled, opt):
        stances.append(bool(eval_frame._stance.skip_guard_eval_unsafe))
        return timed(step, compiled, opt)

    monkeypatch.setattr(ab, "_seconds", spy)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert ab.main(["--depth", "1", "--steps", "2", "--skip-guards", "--stock"]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    out = capsys.readouterr().out
    assert out.startswith("stock, cpu-host model (1 blocks), one compile {}, 2 steps each, interleaved:")
    assert re.search(r"guards evaluated: \d+\.\d\d ms a step", out)
    assert re.search(r"guards skipped \(skip_guard_eval_unsafe\): \d+\.\d\d ms a step", out)
    assert re.search(r"the guards: [+-]\d+\.\d\d ms a step", out)
    assert stances == [True, False, False, True]  # step 0 skipped first, step 1 evaluated first
    assert not eval_frame._stance.skip_guard_eval_unsafe


@pytest.mark.parametrize("argv, message", [
    (["--a", "[1]"], "options must be a JSON object"),
    (["--b", "{size_asserts: 1}"], "options must be a JSON object"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--depth", "0"], "--depth must be at least 1"),
    (["--skip-guards", "--reverse"], "--reverse has no second compile"),
    (["--b", '{"size_assert": false}'], "'size_assert' is not an Inductor option .*; close: size_asserts"),
])
def test_bad_arguments_get_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        load_script("compile_ab").main(argv)
