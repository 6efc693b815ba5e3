"""RepVGG's and MobileOne's identity-branch BatchNorm hands its copy of the block input to the convs.

A RepVGG block (timm's ``RepVggBlock``, ``MobileOneBlock`` in byobnet and FastViT; the official
RepVGG's ``rbr_identity``, MobileOne's ``rbr_skip``) sums ``bn(x)`` and convs of the same ``x``,
the BatchNorm called first. The convs keep one 8-bit copy of ``x`` between them
(``nn/input_copy.py``), and the BatchNorm kept a second, its 8-bit ``x_hat``. With one
quantization group per channel, the BatchNorm's codes of ``x_hat`` are codes of ``x`` itself,
each group's range and offset rescaled (``csrc/convnet_autograd.cpp``, ``batch_norm_train_offer``),
so a marked BatchNorm leaves them on ``x`` for the convs: one copy of the block input where there
were two. The convs take them only where their quantizer's options equal the BatchNorm's, they
run on the same path (C++ layer ops or Python Functions) and ``x`` is unchanged since
(``input_copy.take``); otherwise each compresses ``x`` as before.

FastViT's ``RepMixer`` computes ``mixer(x) - norm(x)``, ``norm`` a MobileOne block with no conv:
its identity BatchNorm normalises the ``x`` the mixer's identity BatchNorm just offered codes
of, with the same batch statistics. Marked ``TAKES_INPUT``, it keeps those codes as its own
``x_hat``'s (``mesa::batch_norm_train_take``: each channel's range and offset mapped back by its
mean and invstd) instead of an 8-bit copy of its own: one copy of the mixer's input where
there were two. GhostNetV3's ``GhostModuleV3`` calls its identity BatchNorm (``cheap_rpr_skip``)
after the scale conv of the same input (``cheap_rpr_scale(x1) + cheap_rpr_skip(x1)``): marked
``TAKES_INPUT`` too (``TAKING_NAMES``), it keeps the codes that conv made.
"""
from __future__ import annotations

from torch import nn

import mesa_train.nn as mnn
from mesa_train.nn.batchnorm import OFFERS_INPUT, TAKES_INPUT

__all__ = ["IDENTITY_NAMES", "TAKING_NAMES", "mark_identity_norms"]

# the identity branch's attribute in timm's RepVggBlock / MobileOneBlock, the official RepVGG's
# and MobileOne's blocks
IDENTITY_NAMES = ("identity", "rbr_identity", "rbr_skip")
# identity-branch BatchNorms called after a conv of the same input (GhostNetV3's GhostModuleV3)
TAKING_NAMES = ("cheap_rpr_skip",)


def mark_identity_norms(root: nn.Module) -> None:
    """Mark each Mesa ``BatchNorm2d`` held under one of ``IDENTITY_NAMES``: ``OFFERS_INPUT`` by a
    module that also holds Mesa convs, else ``TAKES_INPUT``; under one of ``TAKING_NAMES``:
    ``TAKES_INPUT`` (plain attributes: ``state_dict`` and the module tree are unchanged)."""
    for parent in root.modules():
        for name in TAKING_NAMES:
            bn = parent._modules.get(name)
            if isinstance(bn, mnn.BatchNorm2d):
                bn.__dict__[TAKES_INPUT] = True
        norms = [parent._modules.get(name) for name in IDENTITY_NAMES]
        norms = [bn for bn in norms if isinstance(bn, mnn.BatchNorm2d)]
        offers = any(isinstance(m, mnn.Conv2d) for m in parent.modules())
        for bn in norms:
            bn.__dict__.pop(TAKES_INPUT if offers else OFFERS_INPUT, None)  # (convs converted since)
            bn.__dict__[OFFERS_INPUT if offers else TAKES_INPUT] = True
