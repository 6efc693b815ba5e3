"""Position-table MLPs recomputed in backward instead of stored.

timm's ``RelPosMlp`` (relpos ViT, MaxViT-style) and SwinV2's ``cpb_mlp`` turn a constant
coordinate *table* (a buffer) into a relative-position bias. Their activations do not grow
with the batch, but at small batches or small images they were the largest uncompressed
item (SwinV2 tiny at 32 px: 60% of everything a patched model kept). Quantizing them adds
rounding noise to gradients that are already cancellations (sums of attention-logit
gradients over a few ``(2w-1)^2`` rows), so they are not quantized: their forward is re-run
in backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved so a dropout
inside draws the same mask). Forward bits and gradients are exactly stock's; what is kept is
the table buffer itself. The cost is one more forward of a table-sized MLP per step.

The swap is a ``__class__`` change to a subclass with the same parameters and state_dict
keys (``RecomputedSequential``, ``RecomputedMlp``); ``mesa_recompute = False`` on the module
(or ``set_recompute(model, False)``, used by ``coverage`` for its stock figure) turns it off.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["RecomputedSequential", "RecomputedMlp", "make_recomputed", "set_recompute", "RECOMPUTED_CLASSES"]


def _run(module: nn.Module, base_forward, x):
    if module.training and torch.is_grad_enabled() and getattr(module, "mesa_recompute", True):
        return checkpoint(base_forward, x, use_reentrant=False, preserve_rng_state=True)
    return base_forward(x)


class RecomputedSequential(nn.Sequential):
    """SwinV2's ``cpb_mlp`` (``Linear, ReLU, Linear``), recomputed in backward."""

    def forward(self, input):
        return _run(self, super().forward, input)


def _timm_mlp():
    from timm.layers import Mlp

    return Mlp


class RecomputedMlp(_timm_mlp()):
    """timm ``Mlp`` of a ``RelPosMlp`` (``Linear, ReLU, Dropout, Linear``), recomputed in backward."""

    def forward(self, x):
        return _run(self, super().forward, x)


RECOMPUTED_CLASSES = {nn.Sequential: RecomputedSequential, _timm_mlp(): RecomputedMlp}


def make_recomputed(module: nn.Module) -> bool:
    """Swap ``module`` (exact ``nn.Sequential`` or timm ``Mlp``) to its recomputed twin."""
    if type(module) in RECOMPUTED_CLASSES.values():
        return True
    cls = RECOMPUTED_CLASSES.get(type(module))
    if cls is None:
        return False
    module.__class__ = cls
    module.mesa_recompute = True
    return True


def set_recompute(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if type(m) in RECOMPUTED_CLASSES.values():
            m.mesa_recompute = bool(enabled)
