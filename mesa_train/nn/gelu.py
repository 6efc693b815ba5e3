"""Mesa ``GELU`` (erf and tanh forms): exact forward, saves the 8-bit input."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mesa_train.quant  # noqa: F401  (registers torch.ops.mesa.gelu_backward)
from mesa_train.quant.compile_kernels import traced_as_pytorch

from .first_order import first_order
from ._common import (MesaLayer, from_nhwc, kept_input, load, no_autocast, rebuild_parameter_free,
                      save_elementwise_input, to_nhwc)

__all__ = ["GELU"]

_GELU_BACKWARD = torch.ops.mesa.gelu_backward.default


class _GeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate, quantizer):
        y = F.gelu(x, approximate=approximate)  # exactly nn.GELU.forward
        ctx.approximate = approximate
        save_elementwise_input(ctx, x, y, quantizer)
        return y

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), _ = load(ctx)
        with no_autocast(g.device.type):
            if ctx.approximate == "none" and packed.fmt is None and not traced_as_pytorch(packed.q):
                # one op from the codes: on CUDA the dequantized input never reaches memory
                # (DESIGN.md, "GELU backward from the codes"); the traced kernels leave that
                # fusion to Inductor
                gv = to_nhwc(g.to(ctx.cdt), ctx.nhwc)
                gx = from_nhwc(_GELU_BACKWARD(gv, packed.q, packed.alpha, packed.beta, packed.dim,
                                              packed.num_groups), ctx.nhwc)
            else:
                xh = kept_input(ctx, packed)
                gx = torch.ops.aten.gelu_backward.default(g.to(ctx.cdt), xh, approximate=ctx.approximate)
        return gx.to(ctx.x_dtype), None, None


class GELU(MesaLayer, nn.GELU):
    """``torch.nn.GELU`` whose saved input is 8-bit (channel groups; dim 1 for 4-D inputs)."""

    def __init__(self, approximate: str = "none", *, device=None, **quant_options):
        super().__init__(approximate=approximate)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.GELU, *, device=None, **quant_options) -> "GELU":
        """See :func:`rebuild_parameter_free` for where the estimates go."""
        return rebuild_parameter_free(cls, stock, nn.GELU, (stock.approximate,), device, quant_options)

    def forward(self, input, approximate: Optional[str] = None):
        """``approximate``: this call's, else the module's (a functional ``F.gelu`` a module's
        forward makes is routed here: patch/functional_calls.py)."""
        approximate = self.approximate if approximate is None else approximate
        if not self._mesa_active(input):
            return F.gelu(input, approximate=approximate)
        fused = self.quantizer.fused_layer_args(input)
        if fused is not None:  # eager, a channel format: the layer with a C++ autograd node
            return torch.ops.mesa.gelu_train(input, *fused, approximate)
        return _GeluFn.apply(input, approximate, self.quantizer)

    def extra_repr(self) -> str:
        return f"{nn.GELU.extra_repr(self)}, {self._mesa_repr()}"

