"""scripts/compare_kernel_tables.py: two kernel tables of the benchmark side by side (the GPU
session's kernels-base step: an older build of the extension timed right after this one)."""
from __future__ import annotations

import pytest

from conftest import load_script

HEADER = ("| case | dtype | op | latency (us) | kernel time (us) | GB/s | fraction of clone bandwidth "
          "| time / clone |\n|---|---|---|---:|---:|---:|---:|---:|\n")


def _table(path, title, rows):
    path.write_text(f"# {title}\n\ntext\n\n" + HEADER
                    + "".join(f"| {c} | bf16 | {op} | 50.0 | {t} | 1000.0 | {f} | 1.00 |\n" for c, op, t, f in rows)
                    + "\nafter the table\n")
    return path


def test_each_common_row_gets_both_times_and_their_ratio(tmp_path):
    m = load_script("compare_kernel_tables")
    before = _table(tmp_path / "H200.base-abc.md", "kernels, extension `base-abc`",
                    [("tokens", "clone (baseline)", "7.7", "1.00"), ("tokens", "observe", "13.5", "0.28"),
                     ("tokens", "gone op", "3.0", "0.50")])
    after = _table(tmp_path / "H200.md", "kernels", [("tokens", "clone (baseline)", "7.6", "1.00"),
                                                      ("tokens", "observe", "6.75", "0.55"),
                                                      ("tokens", "cpu op", "-", "0.10")])
    out = tmp_path / "cmp" / "H200.vs-base-abc.md"
    assert m.main([str(before), str(after), "-o", str(out)]) == 0
    text = out.read_text()
    assert "| tokens | bf16 | observe | 13.5 | 6.75 | 0.50 | 0.28 | 0.55 |" in text
    assert "| tokens | bf16 | clone (baseline) | 7.7 | 7.6 | 0.99 | 1.00 | 1.00 |" in text
    assert "extension `base-abc`" in text  # each table's title says which build it timed
    # a row in one table only is named, not compared
    assert "Rows in one table only (2): tokens / bf16 / cpu op; tokens / bf16 / gone op." in text
    assert "after the table" not in text


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    m = load_script("compare_kernel_tables")
    good = _table(tmp_path / "a.md", "kernels", [("tokens", "observe", "13.5", "0.28")])
    with pytest.raises(SystemExit) as e:
        m.main([str(tmp_path / "missing.md"), str(good)])
    assert e.value.code == 2 and "missing.md: no such file" in capsys.readouterr().err
    (tmp_path / "notes.md").write_text("# notes\n\nno table here\n")
    with pytest.raises(SystemExit):
        m.main([str(tmp_path / "notes.md"), str(good)])
    assert "no kernel table in it" in capsys.readouterr().err
    other = _table(tmp_path / "b.md", "kernels", [("attn", "observe", "30.0", "0.5")])
    with pytest.raises(SystemExit):
        m.main([str(other), str(good)])
    assert "no (case, dtype, op) row in common" in capsys.readouterr().err
