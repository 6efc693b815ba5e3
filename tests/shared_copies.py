"""Helpers of the copy-sharing tests (``test_mlp_shared.py``, ``test_norm_shared.py``): one
training step with the RNG reseeded, gradient cosines, shared vs separate copies against a
float64 step, and the check that a ``shared | separate`` choice reaches ``patch_model``
through the Hydra config."""
from __future__ import annotations

import copy

import pytest
import torch


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
    """Cosine of two gradients, exact at any scale (``F.cosine_similarity`` clamps the norms
    to 1e-8, which reads BEiT's ~1e-12 gradients of a fresh model as orthogonal); 1.0 for two
    zero tensors, 0.0 for one."""
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return float(na == nb)
    return float(torch.dot(a / na, b / nb))


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


def worst_cosines_by_mode(stock, x, patch, key: str) -> dict:
    """``{"separate": c, "shared": c}``: the worst cosine, over the gradients whose names
    contain ``key``, of one step of ``patch(copy_of_stock, mode)`` against a float64 stock step."""
    _, g_exact = run_step(copy.deepcopy(stock).double(), x.double())
    worst = {}
    for mode in ("separate", "shared"):
        _, g = run_step(patch(copy.deepcopy(stock), mode), x)
        worst[mode] = min(cos(g[n], g_exact[n]) for n in g_exact if key in n)
    return worst


def assert_shared_as_close_as_separate(worst: dict) -> None:
    """One shared copy loses no gradient fidelity: >= 0.999, within 2e-4 of separate copies."""
    assert worst["shared"] >= 0.999, worst
    assert worst["shared"] >= worst["separate"] - 2e-4, worst
