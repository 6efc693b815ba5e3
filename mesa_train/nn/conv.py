"""Mesa ``Conv2d``: exact forward, saves the 8-bit input (channel groups over dim 1)."""
from __future__ import annotations

import torch
from torch import nn

from ._common import MesaLayer, adopt_parameters, check_stock, inherit_options, load, no_autocast, save

from .quantizer import decompress

__all__ = ["Conv2d"]


class _Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, quantizer):
        y = module._conv_forward(x, weight, bias)  # exactly nn.Conv2d.forward
        packed = quantizer.compress(x, x.dim() - 3) if ctx.needs_input_grad[1] else None
        ctx.module = module
        ctx.cdt, ctx.x_dtype, ctx.w_dtype = y.dtype, x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.x_shape = x.shape
        save(ctx, [packed], weight)
        return y

    @staticmethod
    def backward(ctx, g):
        (packed,), (weight,) = load(ctx)
        m = ctx.module
        cdt = ctx.cdt
        need = list(ctx.needs_input_grad[:3])
        with no_autocast(g.device.type):
            g = g.to(cdt)
            w = weight.to(cdt)
            if packed is not None:
                xh = decompress(packed, cdt)
            else:  # only the input gradient is needed: the values of x do not matter
                xh = torch.empty(ctx.x_shape, dtype=cdt, device=g.device)
            unbatched = xh.dim() == 3
            if unbatched:
                xh, g = xh.unsqueeze(0), g.unsqueeze(0)
            if m.padding_mode == "zeros" and not isinstance(m.padding, str):
                gx, gw, gb = torch.ops.aten.convolution_backward(
                    g, xh, w, [w.shape[0]] if need[2] else None, list(m.stride), list(m.padding),
                    list(m.dilation), False, [0, 0], m.groups, need)
            else:  # 'same'/'valid' padding strings or non-zero padding modes: autograd re-derivation
                gx, gw, gb = _autograd_backward(m, g, xh, w, need)
            if unbatched and gx is not None:
                gx = gx.squeeze(0)
        gx = gx.to(ctx.x_dtype) if gx is not None and need[0] else None
        gw = gw.to(ctx.w_dtype) if gw is not None and need[1] else None
        gb = gb.to(ctx.b_dtype) if gb is not None and need[2] else None
        return gx, gw, gb, None, None


def _autograd_backward(m, g, xh, w, need):
    with torch.enable_grad():
        xd = xh.detach().requires_grad_(need[0])
        wd = w.detach().requires_grad_(need[1])
        bd = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device, requires_grad=need[2]) if need[2] else None
        y = m._conv_forward(xd, wd, bd)
        inputs = [t for t, n in zip((xd, wd, bd), need) if n]
        grads = iter(torch.autograd.grad(y, inputs, g))
    return tuple(next(grads) if n else None for n in need)


class Conv2d(MesaLayer, nn.Conv2d):
    """``torch.nn.Conv2d`` whose saved input is 8-bit (channel groups over dim 1), or with
    ``layout="patch4x4"`` a min/max per 4x4 spatial block of each channel (DESIGN.md)."""

    _layouts = ("channel", "patch4x4")

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, **quant_options):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Conv2d, **quant_options) -> "Conv2d":
        check_stock(stock, nn.Conv2d)
        new = cls(stock.in_channels, stock.out_channels, stock.kernel_size, stride=stock.stride,
                  padding=stock.padding, dilation=stock.dilation, groups=stock.groups, bias=stock.bias is not None,
                  padding_mode=stock.padding_mode, device="meta", dtype=stock.weight.dtype,
                  **inherit_options(stock, quant_options))
        return adopt_parameters(stock, new)

    def forward(self, input):
        if not self._mesa_active(input, self.weight, self.bias):
            return super().forward(input)
        return _Conv2dFn.apply(input, self.weight, self.bias, self, self.quantizer)

    def extra_repr(self) -> str:
        return f"{nn.Conv2d.extra_repr(self)}, {self._mesa_repr()}"
