"""mesa_train.bench.preset_model: a bench row's model built outside the bench, as the bench builds
it (the scripts that explain a preset time the preset's model)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mesa_train.bench.measure import build_for_row
from mesa_train.bench.preset_model import preset_model, preset_row
from mesa_train.bench.presets import BenchConfigError
from mesa_train.nn._common import MesaLayer


def test_cpu_host_rows_build_the_bench_models():
    row = preset_row("cpu-host", "Mesa compiled")
    assert row.mesa and row.compile and row.model_kwargs == {"depth": 12, "embed_dim": 48}
    torch.manual_seed(0)
    mesa = preset_model("cpu-host", "Mesa compiled", depth=2)
    torch.manual_seed(0)
    stock = preset_model("cpu-host", "stock compiled", depth=2)
    assert len(mesa.blocks) == len(stock.blocks) == 2 and mesa.embed_dim == 48
    assert mesa.blocks[0].attn.num_heads == 3  # deit_ti's heads, as the preset's rows have them
    assert any(isinstance(m, MesaLayer) for m in mesa.modules())
    assert not any(isinstance(m, MesaLayer) for m in stock.modules())
    assert mesa.training and stock.training
    # the same weights as the bench's own build of the row at the same seed, and the same forward
    torch.manual_seed(0)
    bench = build_for_row(dataclasses.replace(row, model_kwargs={"depth": 2, "embed_dim": 48}))
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    ours = mesa(x)
    torch.manual_seed(1)
    assert torch.equal(ours, bench(x))


def test_unknown_preset_or_row_is_one_line_with_the_choices():
    with pytest.raises(BenchConfigError, match=r"no bench preset 'cpu-hots'; valid: .*cpu-host"):
        preset_row("cpu-hots", "Mesa compiled")
    with pytest.raises(BenchConfigError, match=r"preset 'cpu-host' has no row 'Mesa'; rows: stock eager, Mesa eager"):
        preset_row("cpu-host", "Mesa")
