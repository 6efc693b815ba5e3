"""`python -m mesa_train.bench.overhead`: one row per Mesa layer, the provenance line, the
Markdown file; a wrong baseline tree is a one-line error. (Timings are not checked: they
belong to the benchmark's output, not to a unit test.)"""
from __future__ import annotations

import re

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


def _usage_error(capsys, argv) -> str:
    """The one stderr line and exit 2 of a refused command line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        overhead.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_baseline_tree_without_the_package_is_a_clear_error(tmp_path, capsys):
    assert "has no mesa_train package" in _usage_error(capsys, ["--baseline-tree", str(tmp_path)])


def test_python_functions_compares_both_paths_of_every_layer_and_restores_the_switch(tmp_path, monkeypatch):
    """``--python-functions``: a row per layer with both paths' columns and their ratio, each
    path really taken (the C++ layer op's spy counts calls only while the switch is on), and the
    switch back as it was, also after a failure."""
    from mesa_train.nn import quantizer as quantizer_mod
    from op_calls import count_calls

    if not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    calls = count_calls(monkeypatch, "star_relu_train")
    seen = []
    real = overhead._interleaved_us

    def spy(runs, inputs, reps, set_fused):
        seen.append([fused for _, fused in runs])
        return real(runs, inputs, reps, set_fused)

    monkeypatch.setattr(overhead, "_interleaved_us", spy)
    out = tmp_path / "paths.md"
    assert overhead.main(["--python-functions", "--reps", "2", "--rounds", "1", "--output", str(out)]) == 0
    md = out.read_text()
    assert "Mesa adds µs (Python Functions) | Mesa adds µs (C++ ops) | ratio |" in md
    for name in overhead.LAYERS:
        assert f"| {name} |" in md
    assert seen and all(s == [True, False, True] for s in seen)
    assert len(calls) == 22  # StarReLU's op: 20 warm-up + 2 timed passes on the C++ path, none on the Python one
    assert quantizer_mod._FUSED_LAYERS is True
    monkeypatch.setattr(overhead, "_cases", lambda layers=None: {"boom": (lambda: 1 / 0, None, lambda: ())})
    with pytest.raises(ZeroDivisionError):
        overhead.compare_paths(1, 1)
    assert quantizer_mod._FUSED_LAYERS is True


def test_the_two_comparisons_are_one_at_a_time(tmp_path, capsys):
    err = _usage_error(capsys, ["--python-functions", "--baseline-tree", str(tmp_path)])
    assert "two different comparisons: pick one" in err


def test_bad_numbers_and_outputs_are_refused_before_any_timing(tmp_path, capsys, monkeypatch):
    """--reps 0 timed nothing and died on an empty median; --rounds 0 printed an empty table; an
    --output under a file or at a folder failed after the timing. All refused first."""
    monkeypatch.setattr(overhead, "measure", lambda *a, **k: pytest.fail("measured despite a bad argument"))
    for argv, message in ((["--reps", "0"], "argument --reps: 0 must be at least 1"),
                          (["--rounds", "0"], "argument --rounds: 0 must be at least 1"),
                          (["--reps", "-5"], "argument --reps: -5 must be at least 1"),
                          (["--reps", "many"], "argument --reps: 'many' is not a whole number")):
        with pytest.raises(SystemExit) as exit_:
            overhead.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert "cannot make the folder" in _usage_error(capsys, ["--output", str(tmp_path / "a_file" / "x.md")])
    assert "is a folder" in _usage_error(capsys, ["--output", str(tmp_path)])


def test_layers_picks_rows_and_an_unknown_name_is_a_one_line_error(tmp_path, capsys):
    """``--layers``: only the named rows (a whole ViT block among them); a name that is not a row
    is refused with the valid names, before anything is measured."""
    out = tmp_path / "some.md"
    assert overhead.main(["--reps", "2", "--layers", "linear,VITBLOCK", "--output", str(out)]) == 0
    rows = [line.split("|")[1].strip() for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows == ["layer", "Linear", "ViTBlock"]
    err = _usage_error(capsys, ["--layers", "Linear,Nope"])
    assert re.search(r"--layers 'Linear,Nope': unknown Nope; valid: Linear, GELU, .*ViTBlock", err)
