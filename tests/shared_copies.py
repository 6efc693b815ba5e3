"""Helpers of the copy-sharing tests (``test_mlp_shared.py``, ``test_norm_shared.py``): one
training step with the RNG reseeded, gradient cosines, and the check that a
``shared | separate`` choice reaches ``patch_model`` through the Hydra config."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def run_step(model, x, seed=5, autocast=False):
    """(output, {name: grad}) of one train step, the RNG reseeded (drop-path masks equal)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().mean().backward()
    return out.detach(), {n.removeprefix("_orig_mod."): p.grad.detach().clone()  # (torch.compile's wrapper)
                          for n, p in model.named_parameters() if p.grad is not None}


def cos(a, b):
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def check_config_choice(compose_train, key: str) -> None:
    """``mesa.<key>``: ``shared`` by default, ``separate`` reaches ``mesa_options``, anything
    else is one ConfigError naming the choices."""
    from omegaconf import OmegaConf

    from mesa_train.train.config import ConfigError, mesa_options, validate

    cfg = compose_train([])
    assert cfg.mesa[key] == "shared"
    assert mesa_options(compose_train([f"mesa.{key}=separate"]))[key] == "separate"
    OmegaConf.update(cfg, f"mesa.{key}", "fused")
    with pytest.raises(ConfigError, match=rf"mesa.{key}='fused' is not valid; choose one of: shared, separate"):
        validate(cfg)
