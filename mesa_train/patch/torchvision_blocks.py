"""Mesa forwards for torchvision blocks that apply an activation functionally, installed by
class swap like ``gating.py``: GoogLeNet's and Inception-v3's ``BasicConv2d`` end in
``F.relu(self.bn(self.conv(x)), inplace=True)``, so stock autograd keeps the ReLU's output in
full precision for its backward (27% of GoogLeNet's stock activation bytes, reported as a
functional op not reached). Here the ReLU is a ``mesa_relu`` child (``mesa_train.nn.ReLU``,
in place as stock's: a 1-bit mask); the conv and the BatchNorm are converted by the leaf
conversion, and the forward is stock's line for line.
"""
from __future__ import annotations

from functools import partial

import torch
from torchvision.models.googlenet import BasicConv2d as _GoogLeNetBasicConv2d
from torchvision.models.inception import BasicConv2d as _InceptionBasicConv2d

import mesa_train.nn as mnn

__all__ = ["TORCHVISION_CLASSES", "STOCK_TORCHVISION_CLASSES"]


class _MesaBasicConv2d:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = self.bn(x)
        return self.mesa_relu(x)


class MesaGoogLeNetBasicConv2d(_MesaBasicConv2d, _GoogLeNetBasicConv2d):
    """torchvision GoogLeNet's ``BasicConv2d`` with a Mesa ReLU child."""


class MesaInceptionBasicConv2d(_MesaBasicConv2d, _InceptionBasicConv2d):
    """torchvision Inception-v3's ``BasicConv2d`` with a Mesa ReLU child."""


# (op, Mesa class, (child name, layer factory)): patch/core.py's class swaps
TORCHVISION_CLASSES = {
    _GoogLeNetBasicConv2d: ("relu", MesaGoogLeNetBasicConv2d, ("mesa_relu", partial(mnn.ReLU, True))),
    _InceptionBasicConv2d: ("relu", MesaInceptionBasicConv2d, ("mesa_relu", partial(mnn.ReLU, True))),
}
STOCK_TORCHVISION_CLASSES = {mesa: stock for stock, (_, mesa, _) in TORCHVISION_CLASSES.items()}
