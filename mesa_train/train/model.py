"""Build the model a config describes: timm architecture, then Mesa patching."""
from __future__ import annotations

import torch.nn as nn

from mesa_train.models import build_model
from mesa_train.train.config import mesa_options


def build(cfg, num_classes: int, drop_path: float | None = None) -> nn.Module:
    """``mesa_train.build_model`` with the ``model`` group's overrides, then
    ``mesa_train.patch_model`` with the ``mesa`` group when ``mesa.enabled``."""
    m = cfg.model
    overrides = dict(m.kwargs or {})
    named = dict(depth=m.depth, embed_dim=m.embed_dim, num_heads=m.num_heads, drop_path_rate=drop_path)
    overrides.update({k: v for k, v in named.items() if v is not None}, num_classes=num_classes)
    if m.img_size_kwarg:
        overrides["img_size"] = m.img_size
    # OmegaConf lists -> tuples (timm compares/iterates them).
    overrides = {k: tuple(v) if isinstance(v, (list,)) or type(v).__name__ == "ListConfig" else v
                 for k, v in overrides.items()}
    model = build_model(m.name, fused_attn=m.fused_attn, **overrides)
    if cfg.mesa.enabled:
        from mesa_train import patch_model

        model = patch_model(model, **mesa_options(cfg))
    return model


def describe(model: nn.Module) -> str:
    """``mesa_train.describe`` (the Mesa layout table)."""
    from mesa_train import describe as _describe

    return _describe(model)
