"""Saved-bytes tables like the paper's Tables 7 (per op) and 8 (per module set).

```python
from mesa_train.patch.report import OP_CONFIGS, MODULE_CONFIGS, saved_bytes_rows, format_saved_bytes_table
rows = saved_bytes_rows(lambda: timm.create_model("deit_tiny_patch16_224"), torch.randn(8, 3, 224, 224),
                        OP_CONFIGS + MODULE_CONFIGS, autocast_dtype=torch.bfloat16)
print(format_saved_bytes_table(rows, "DeiT-Ti, bf16"))
```

Every figure is ``SavedTensorMeter.activation_bytes`` of one training forward (bytes kept
for backward, parameters excluded). Each row is compared with two stock baselines: the
stock model with explicit attention (``fused_attn=False``: the paper's baseline, which
keeps the attention map) and with fused attention (``F.scaled_dot_product_attention``:
today's timm default, which does not).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from mesa_train.memory import SavedTensorMeter

from .core import patch_model
from .table import format_table

__all__ = [
    "Config",
    "OP_CONFIGS",
    "MODULE_CONFIGS",
    "SDPA_CONFIGS",
    "measure_saved_bytes",
    "saved_bytes_rows",
    "format_saved_bytes_table",
]


@dataclass(frozen=True)
class Config:
    """One row: ``ops``/``modules`` for ``patch_model`` (``ops=None``: the stock model) and
    the attention path of the stock model before patching (``fused``: True/False)."""

    label: str
    ops: Optional[Tuple[str, ...]]
    modules: Tuple[str, ...] = ("all",)
    fused: bool = False
    options: dict = field(default_factory=dict)


# Table 7 (one op type at a time, everything else stock; explicit attention)
OP_CONFIGS = [
    Config("stock (explicit attn)", None, fused=False),
    Config("stock (fused sdpa)", None, fused=True),
    Config("linear", ("linear",)),
    Config("matmul", ("matmul",)),
    Config("softmax", ("softmax",)),
    Config("gelu", ("gelu",)),
    Config("layernorm", ("layernorm",)),
    Config("conv", ("conv",)),
    Config("all (explicit attn)", ("all",)),
]
# Table 8 (all ops, one module set at a time)
MODULE_CONFIGS = [
    Config("all ops, msa", ("all",), ("msa",)),
    Config("all ops, ffn", ("all",), ("ffn",)),
    Config("all ops, msa+ffn", ("all",), ("msa", "ffn")),
    Config("all ops, other", ("all",), ("other",)),
    Config("all ops, all modules", ("all",), ("all",)),
]
# Fused attention kept: compare with the stock fused baseline
SDPA_CONFIGS = [
    Config("sdpa only", ("sdpa",), fused=True),
    Config("all but matmul/softmax, sdpa", ("linear", "gelu", "layernorm", "conv", "relu", "sdpa"), fused=True),
]


def measure_saved_bytes(model: nn.Module, inputs: torch.Tensor, *, autocast_dtype: Optional[torch.dtype] = None,
                        backward: bool = False) -> "object":
    """One training forward of ``model`` on ``inputs`` under a ``SavedTensorMeter``;
    returns the meter. ``backward=True`` also runs the backward (checks it works)."""
    ctx = (torch.autocast(inputs.device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    with SavedTensorMeter(model) as meter:
        with ctx:
            out = model(inputs)
        loss = out.float().sum()
    if backward:
        loss.backward()
    return meter


def _set_fused(model: nn.Module, fused: bool) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = bool(fused)


def saved_bytes_rows(build: Callable[[], nn.Module], inputs: torch.Tensor, configs: Sequence[Config] = OP_CONFIGS,
                     *, autocast_dtype: Optional[torch.dtype] = None, seed: int = 0,
                     **quant_options) -> List[dict]:
    """Measure every config on a fresh model from ``build()`` (train mode). Rows:
    ``label, ops, modules, activation_bytes, vs_explicit, vs_fused`` (ratios to the two stock
    baselines, always measured)."""

    def run(cfg: Config) -> int:
        torch.manual_seed(seed)
        model = build().to(inputs.device).train()
        _set_fused(model, cfg.fused)
        if cfg.ops is not None:
            patch_model(model, ops=cfg.ops, modules=cfg.modules, **{**quant_options, **cfg.options})
        return measure_saved_bytes(model, inputs, autocast_dtype=autocast_dtype).activation_bytes

    base_explicit = run(Config("stock explicit", None, fused=False))
    base_fused = run(Config("stock fused", None, fused=True))
    rows = []
    for cfg in configs:
        if cfg.ops is None:
            b = base_fused if cfg.fused else base_explicit
        else:
            b = run(cfg)
        rows.append(dict(label=cfg.label, ops=cfg.ops, modules=cfg.modules, fused=cfg.fused,
                         activation_bytes=b, vs_explicit=b / max(base_explicit, 1), vs_fused=b / max(base_fused, 1)))
    return rows


def format_saved_bytes_table(rows: List[dict], title: str = "") -> str:
    """Text table: config, saved activation MiB, % of stock explicit, % of stock fused."""
    body = [[r["label"], f"{r['activation_bytes'] / 2**20:.3f}", f"{100 * r['vs_explicit']:.1f}%",
             f"{100 * r['vs_fused']:.1f}%"] for r in rows]
    table = format_table(["config", "saved MiB", "vs stock explicit", "vs stock fused"], body, "lrrr")
    return f"{title}\n{table}" if title else table
