"""Mesa ``LearnableAffineBlock`` (HGNetV2's ``scale * x + bias`` after a conv's activation, two
scalar parameters of shape ``(1,)``: timm's ``hgnetv2_*``, the RT-DETR backbones).

Stock autograd keeps ``x`` whole for ``scale``'s gradient, ``sum(g * x)`` (38% of what a patched
``hgnetv2_b0`` still kept); this keeps it in 8 bits, channel groups (dim 1), through the layer-scale
Function with the scale as a 0-d view. The forward is stock's bits: ``x`` is first cast to the
type stock's product takes (a ``(1,)`` float32 scale times a bfloat16 ``x`` is a float32 product;
a 0-d scale would have kept bfloat16), then ``x * scale + bias``, the same two operations.
"""
from __future__ import annotations

import torch
from torch import nn

from ._common import MesaLayer, check_stock, copy_estimates, inherit_options
from .layerscale import channel_scale

__all__ = ["LearnableAffineBlock"]


class LearnableAffineBlock(MesaLayer, nn.Module):
    """timm's HGNet ``LearnableAffineBlock`` keeping its 8-bit input; the same ``scale`` and
    ``bias`` parameters. Op ``layerscale``."""

    def __init__(self, scale_value: float = 1.0, bias_value: float = 0.0, *, device=None, dtype=None,
                 **quant_options):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([scale_value], device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.tensor([bias_value], device=device, dtype=dtype))
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "LearnableAffineBlock":
        from timm.models.hgnet import LearnableAffineBlock as TimmLearnableAffineBlock

        check_stock(stock, (TimmLearnableAffineBlock, LearnableAffineBlock))
        new = cls(device="meta", **inherit_options(stock, quant_options))
        new.scale, new.bias = stock.scale, stock.bias  # the same parameter objects
        copy_estimates(stock, new, stock.scale.device)
        return new.train(stock.training)

    def forward(self, x):
        if not self._mesa_active(x, self.scale, self.bias) or self.scale.shape != (1,):
            return self.scale * x + self.bias
        x = x.to(torch.promote_types(self.scale.dtype, x.dtype))  # (stock's product type: two dimensioned tensors)
        return channel_scale(x, self.scale.view(()), self.quantizer) + self.bias

    def extra_repr(self) -> str:
        return self._mesa_repr()
