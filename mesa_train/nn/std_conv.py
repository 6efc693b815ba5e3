"""Mesa ``StdConv2d`` / ``StdConv2dSame``: timm's weight-standardized convs (BiT ResNet-V2,
the ViT hybrids' ResNet stems) keeping their 8-bit input; ``ScaledStdConv2d`` /
``ScaledStdConv2dSame``: the NFNets' (a learned gain in the standardization).

The forward is timm's line for line: ``pad_same`` for the ``Same`` variant, the weight
standardized per output channel by ``F.batch_norm`` (stock autograd: the weight is small),
then the convolution, which here is the Mesa ``Conv2d``'s (``_compressed_conv``) fed the
standardized weight. Stock keeps the full-precision input of every such conv: in
``vit_base_r26_s32_224`` 76% of what a patched model still kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers.padding import pad_same
from torch import nn

from ._common import autocast_casts, check_stock
from .conv import Conv2d

__all__ = ["StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame"]


class StdConv2d(Conv2d):
    """timm's ``StdConv2d`` with the Mesa conv's 8-bit input. Same parameters and state_dict keys."""

    _timm_name = "StdConv2d"
    same_pad = False

    @classmethod
    def from_module(cls, stock, **quant_options) -> "StdConv2d":
        import timm.layers

        check_stock(stock, getattr(timm.layers, cls._timm_name))
        new = super().from_module(stock, **quant_options)
        new.eps = stock.eps
        new.same_pad = getattr(stock, "same_pad", False)
        return new

    def _standardized_weight(self) -> torch.Tensor:
        return F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.,
                            eps=self.eps).reshape_as(self.weight)

    def forward(self, x):
        if self.same_pad:
            x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        weight = self._standardized_weight()
        # (ScaledStdConv2d's gain too: a gain-only fine-tune still needs the input for its gradient)
        if not self._mesa_active(x, self.weight, self.bias, getattr(self, "gain", None)):
            return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if autocast_casts(weight):
            # what stock's conv keeps under autocast: the autocast dtype's copy of the standardized
            # weight (the same cast autocast makes, so the same bits). The Mesa conv keeps the
            # weight it is handed, and a float32 standardized weight (not a parameter) was twice
            # stock's copy: resnetv2_50x1_bit at 64 px under bf16 kept 1.82x of stock's bytes
            weight = weight.to(torch.get_autocast_dtype(weight.device.type))
        return self._compressed_conv(x, weight)

    def extra_repr(self) -> str:
        return f"{nn.Conv2d.extra_repr(self)}, eps={self.eps}, same_pad={self.same_pad}, {self._mesa_repr()}"


class StdConv2dSame(StdConv2d):
    """timm's ``StdConv2dSame`` (TF-style 'same' padding computed from the input's size)."""

    _timm_name = "StdConv2dSame"


class ScaledStdConv2d(StdConv2d):
    """timm's ``ScaledStdConv2d`` (NFNets, NF-RegNets, NF-ResNets): the weight standardized per
    output channel with a learned gain times ``gamma / sqrt(fan_in)`` as the batch norm's
    weight (the same ``gain`` parameter), then the Mesa conv. Stock keeps every such conv's
    full-precision input: 88% of what a patched ``nf_regnet_b0`` still kept."""

    _timm_name = "ScaledStdConv2d"

    @classmethod
    def from_module(cls, stock, **quant_options) -> "ScaledStdConv2d":
        new = super().from_module(stock, **quant_options)
        new.scale, new.gain_init = stock.scale, stock.gain_init
        new.gain = stock.gain  # the same parameter object (optimizers keep working)
        return new

    def _standardized_weight(self) -> torch.Tensor:
        return F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                            weight=(self.gain * self.scale).view(-1), training=True, momentum=0.,
                            eps=self.eps).reshape_as(self.weight)


class ScaledStdConv2dSame(ScaledStdConv2d):
    """timm's ``ScaledStdConv2dSame`` (the ``eca_nfnet`` / ``dm_nfnet`` family's TF 'same' padding)."""

    _timm_name = "ScaledStdConv2dSame"
