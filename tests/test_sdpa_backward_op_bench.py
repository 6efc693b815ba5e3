"""``python -m mesa_train.bench.sdpa_backward_op``: the compiled fused attention's backward op,
its C++ kernel against its Python one, timed in one run."""
from __future__ import annotations

import re

import pytest
import torch

from mesa_train.bench import sdpa_backward_op as bench
from kernel_marks import needs_ext


@needs_ext
def test_the_table_has_each_case_and_both_kernels(tmp_path, capsys):
    out = tmp_path / "op.md"
    assert bench.main(["--reps", "3", "--rounds", "1", "--output", str(out)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(bench.cases())
    for row in rows:
        python_us, cpp_us, ratio = re.findall(r"\| ([\d.]+)x? ", row + " ")[-3:]
        assert float(python_us) > 0 and float(cpp_us) > 0 and ratio


@needs_ext
def test_the_python_op_is_the_python_kernel_and_equals_the_cpp_one():
    op = bench.python_op()
    dump = torch._C._dispatch_dump(f"{bench._PY_NAMESPACE}::sdpa_recompute_backward")
    assert "sdpa_backward_op.py" in dump and "sdpa_autograd.cpp" not in dump  # (a Python kernel)
    assert bench.python_op() is op  # (registered once)
    for args in bench.cases().values():
        with torch.no_grad():
            for a, b in zip(op(*args), torch.ops.mesa.sdpa_recompute_backward(*args)):
                assert torch.equal(a, b)


def test_without_the_extension_it_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(bench.quant, "BACKEND", "python")
    with pytest.raises(SystemExit) as err:
        bench.main(["--reps", "1"])
    assert err.value.code == 2
    assert "the compiled extension is not loaded" in capsys.readouterr().err
