"""Mesa ``Conv2dSame`` and ``MaxPool2dSame``: timm's TensorFlow-style 'SAME' layers (the
``tf_`` EfficientNets and MobileNetV3s, MixNet, the ViT hybrids' stems), which pad by the
input's size (``pad_same``) in their own forward and so were left stock.

Each is timm's forward line for line, the padding then the Mesa layer's own path: the conv
keeps its 8-bit input (``Conv2d._compressed_conv``), the pool its uint8 window-local argmax
(lossless, ``maxpool.py``), both on the padded input.
"""
from __future__ import annotations

import torch.nn.functional as F
from timm.layers.padding import pad_same
from torch import nn

from ._common import check_stock
from .conv import Conv2d
from .maxpool import MaxPool2d

__all__ = ["Conv2dSame", "MaxPool2dSame"]


class Conv2dSame(Conv2d):
    """timm's ``Conv2dSame`` with the Mesa conv's 8-bit input. Same parameters and state_dict keys."""

    @classmethod
    def from_module(cls, stock, **quant_options) -> "Conv2dSame":
        from timm.layers import Conv2dSame as TimmConv2dSame

        check_stock(stock, (TimmConv2dSame, Conv2dSame))
        return super().from_module(stock, **quant_options)

    def forward(self, x):
        # timm's conv2d_same: pad by the input's size, then a convolution without padding
        x = pad_same(x, self.weight.shape[-2:], self.stride, self.dilation)
        if not self._mesa_active(x, self.weight, self.bias):
            return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)
        return self._compressed_conv(x, self.weight)  # self.padding is (0, 0), as timm's


class MaxPool2dSame(MaxPool2d):
    """timm's ``MaxPool2dSame``: padded with -inf by the input's size, then the lossless Mesa pool."""

    @classmethod
    def from_module(cls, stock: nn.MaxPool2d, *, device=None, **quant_options) -> "MaxPool2dSame":
        from timm.layers.pool2d_same import MaxPool2dSame as TimmMaxPool2dSame

        check_stock(stock, (TimmMaxPool2dSame, MaxPool2dSame))
        return super().from_module(stock, device=device, **quant_options)

    def forward(self, x):
        x = pad_same(x, self.kernel_size, self.stride, self.dilation, value=-float("inf"))
        return super().forward(x)  # self.padding is (0, 0), as timm's
