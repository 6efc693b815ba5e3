"""scripts/op_census.py: the ops a patched model's training step dispatches beyond the stock
model's (and the reverse), found on the CPU."""
from __future__ import annotations

import pytest

from conftest import load_script


def _rows(out: str) -> list[list[str]]:
    """(stock count, mesa count, MB, op, rest) of each table row."""
    return [line.split(maxsplit=4) for line in out.splitlines()[2:-1]]


def test_census_of_a_patched_deit_block(capsys):
    assert load_script("op_census").main(["--depth", "1", "--batch", "2", "--img-size", "32"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    ops = {r[3] for r in rows}
    # the compression itself: in forward, observe + quantize (observe_rows + quantize for the
    # row-scaled Linear / LayerNorm inputs); in backward, dequantize and the Softmax's one-op
    # backward
    assert {"mesa.observe", "mesa.quantize", "mesa.dequantize", "mesa.observe_rows", "mesa.softmax_backward"} <= ops
    # ... which replaces the stock softmax backward
    assert any(r[3] == "aten._softmax_backward_data" and int(r[0]) > int(r[1]) for r in rows)
    # no copy of a (B, H, N, d) operand beyond stock's (MatMul reuses the product's copy)
    assert not [r for r in rows if r[3] == "aten.clone" and r[4].startswith("[(2, 6,")], out
    assert "MB read+written by all recorded ops: stock" in out.splitlines()[-1]


def test_unknown_op_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        load_script("op_census").main(["--ops", "gelu", "attention"])
    err = capsys.readouterr().err
    assert "unknown ops ['attention']; valid: linear" in err


def test_unknown_model_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        load_script("op_census").main(["--model", "swin_t"])
    err = capsys.readouterr().err
    assert "unknown model 'swin_t'; valid choices: deit_ti" in err and "Traceback" not in err
