"""One bench row's model outside the bench, for the scripts that time a single mechanism on it
(``scripts/compile_ab.py``, ``scripts/guard_census.py``): built from the preset file through the
same Hydra composition and the same ``build_for_row`` as the bench's own rows, so a script and
the preset it explains measure one model (they had drifted: 6 heads in one, 3 in the other).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mesa_train.bench import CONFIG_DIR
from mesa_train.bench.measure import build_for_row
from mesa_train.bench.presets import BenchConfigError, RowConfig, expand_preset

__all__ = ["preset_row", "preset_model"]


def preset_row(preset: str, label: str) -> RowConfig:
    """The row labelled exactly ``label`` of ``configs/bench/preset/<preset>.yaml``, validated."""
    names = sorted(p.stem for p in (Path(CONFIG_DIR) / "preset").glob("*.yaml"))
    if preset not in names:
        raise BenchConfigError(f"no bench preset {preset!r}; valid: {', '.join(names)}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"preset={preset}"])
    rows = expand_preset(OmegaConf.to_container(cfg.preset, resolve=True))
    for row in rows:
        if row.label == label:
            return row
    raise BenchConfigError(f"preset {preset!r} has no row {label!r}; rows: {', '.join(r.label for r in rows)}")


def preset_model(preset: str, label: str, **model_kwargs) -> torch.nn.Module:
    """That row's model on the CPU in train mode (timm build, attention kind, Mesa patch),
    ``model_kwargs`` added to the row's own (``depth=2`` for a quicker compile)."""
    row = preset_row(preset, label)
    row = dataclasses.replace(row, model_kwargs={**row.model_kwargs, **model_kwargs})
    return build_for_row(row, "cpu")
