"""`python -m mesa_train.bench.overhead`: one row per Mesa layer, the provenance line, the
Markdown file; a wrong baseline tree is a one-line error. (Timings are not checked: they
belong to the benchmark's output, not to a unit test.)"""
from __future__ import annotations

import pytest

from mesa_train.bench import overhead


def test_overhead_table_has_every_layer_and_its_provenance(tmp_path, capsys):
    out = tmp_path / "overhead.md"
    assert overhead.main(["--reps", "3", "--output", str(out)]) == 0
    md = out.read_text()
    assert md.startswith("Device: ") and "torch " in md and "git " in md
    for name in overhead.LAYERS:
        assert f"| {name} |" in md
    assert md == capsys.readouterr().out.rstrip("\n") + "\n"


def test_a_baseline_tree_without_the_package_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="has no mesa_train package"):
        overhead.main(["--baseline-tree", str(tmp_path)])
