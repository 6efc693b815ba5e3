"""scripts/guard_census.py: what Dynamo checks before each call of a compiled model, stock
against Mesa (results/guards/cpu.md). The counts are Dynamo's and the model's; this pins what
the table's reader relies on: every state buffer a patched forward reads is a guarded graph
input (four a quantizer), the guard check is timed on locals that pass it, and the table is
written."""
from __future__ import annotations


import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def guard_census():
    return load_script("guard_census")


def test_each_quantizer_read_adds_four_guarded_tensors(guard_census, tmp_path):
    out = tmp_path / "guards.md"
    assert guard_census.main(["--depth", "1", "--calls", "2", "--out", str(out)]) == 0
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line
            for line in text.splitlines() if line.startswith(("| stock", "| Mesa"))}
    assert set(rows) == {"stock", "Mesa"}
    assert "4.0 for each of the" in text and "quantizers whose state the forward reads" in text


def test_census_counts_and_times_a_passing_check(guard_census):
    stock = guard_census.census(guard_census.build(1, mesa=False), calls=2)
    mesa = guard_census.census(guard_census.build(1, mesa=True), calls=2)
    assert stock["graphs"] == mesa["graphs"] == 1
    assert mesa["quantizers_read"] > 0 and stock["quantizers_read"] == 0
    extra = mesa["kinds"]["TENSOR_MATCH"] - stock["kinds"]["TENSOR_MATCH"]
    assert extra == 4 * mesa["quantizers_read"]
    # every graph input covered once by the no-aliasing guard: the image and the state buffers
    assert mesa["kinds"]["NO_TENSOR_ALIASING"] == 1 + extra
    assert 0 < stock["check_us"] and 0 < mesa["check_us"]


def test_bad_arguments_are_one_line_errors(guard_census, capsys):
    with pytest.raises(SystemExit):
        guard_census.main(["--depth", "0", "--out", "-"])
    assert "--depth and --calls must be at least 1" in capsys.readouterr().err
