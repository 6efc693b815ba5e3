"""Mesa ``RmsNorm`` (timm's ``timm.layers.RmsNorm``): exact forward; saves the 8-bit
normalised input ``x_hat = x * rrms`` (with power-of-two row scales, ``rowscale.py``) plus
the per-row ``rrms``, like the Mesa ``LayerNorm``. Backward, with ``gw = grad_out * weight``
and means over the normalised dims::

    dx      = rrms * (gw - x_hat * mean(gw * x_hat))
    dweight = sum_rows(grad_out * x_hat)

The stock autograd graph keeps ``x``, ``rrms`` and ``x * rrms`` (two full-size tensors);
this keeps one byte per element plus two small per-row tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import (MesaLayer, check_stock, copy_estimates, inherit_options, load, no_autocast, save,
                      stock_device)
from .rowscale import compress_rows, decompress_rows, max_exponent
from timm.layers.norm import rms_norm as timm_rms_norm  # what timm's RmsNorm.forward calls

__all__ = ["RmsNorm", "RmsNormFp32"]

# The C++ layer op (mesa::rms_norm_train, csrc/rmsnorm_autograd.cpp) runs torch's rms_norm: the
# stock forward only where timm's RmsNorm calls that very function (timm 1.0.31 does; an older
# timm wrote the ops out, and its RmsNorm keeps the Python Function here)
_OP = (quantizer_mod._FUSED_LAYERS and hasattr(torch.ops.mesa, "rms_norm_train")
       and timm_rms_norm is getattr(torch.nn.functional, "rms_norm", None))


def _dims(ndim: int):
    return tuple(range(-1, -ndim - 1, -1))


def _normalised(x: torch.Tensor, nd: int, eps: float):
    """``(x * rrms, rrms)`` in float32 at least (``torch.rms_norm``'s opmath, which upcasts a
    half-precision input): what backward needs, computed beside the forward's own call."""
    with no_autocast(x.device.type):
        xm = x.to(torch.promote_types(x.dtype, torch.float32))
        rrms = torch.rsqrt(xm.pow(2).mean(dim=_dims(nd), keepdim=True) + eps)
        return xm * rrms, rrms


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, quantizer):
        # the function timm's RmsNorm calls (torch's rms_norm where torch has one): stock's
        # output, dtype and bits; under bf16 it upcasts and returns the input's dtype, which
        # the ops written out (timm's fallback) did not (they returned float32)
        out = timm_rms_norm(x, normalized_shape, weight, eps)
        nd = len(normalized_shape)
        x_hat, rrms = _normalised(x, nd, eps)
        packed, k = compress_rows(quantizer, x_hat, nd, max_exponent(x_hat.dtype))
        del x_hat
        ctx.nd, ctx.x_dtype = nd, x.dtype
        ctx.mdt = rrms.dtype
        ctx.w_dtype = weight.dtype if weight is not None else None
        save(ctx, [packed], rrms, weight, k)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (rrms, weight, k) = load(ctx)
        mdt, dims = ctx.mdt, _dims(ctx.nd)
        gx = gw = None
        with no_autocast(g.device.type):
            xh = decompress_rows(packed, mdt, k)
            g = g.to(mdt)
            gwt = g * weight.to(mdt) if weight is not None else g
            if ctx.needs_input_grad[0]:
                gx = (rrms.to(mdt) * (gwt - xh * (gwt * xh).mean(dim=dims, keepdim=True))).to(ctx.x_dtype)
            if weight is not None and ctx.needs_input_grad[2]:
                gw = (g * xh).reshape(-1, *weight.shape).sum(0).to(ctx.w_dtype)
        return gx, None, gw, None, None


class RmsNorm(MesaLayer, nn.Module):
    """timm's ``RmsNorm`` keeping its 8-bit normalised input (channel groups over the last
    dim) and the per-row ``rrms``. Same parameters and ``state_dict`` keys."""

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True, device=None, dtype=None,
                 **quant_options):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:  # a None parameter, as timm's (a plain `self.weight = None` attribute would block it)
            self.register_parameter("weight", None)
        self._init_mesa(quant_options, device)

    # the timm.layers class this converts (from_module checks it); RmsNormFp32 overrides
    _timm_name = "RmsNorm"
    # compute in float32 and return the input's dtype (timm's RmsNormFp32)
    float32_compute = False

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "RmsNorm":
        """timm's class, or torch's ``nn.RMSNorm`` (its forward is the same ``F.rms_norm`` call;
        its ``eps=None`` is the compute dtype's machine epsilon, as ATen's)."""
        import timm.layers

        torch_rms = (nn.RMSNorm,) if cls._timm_name == "RmsNorm" and hasattr(nn, "RMSNorm") else ()
        # (a Mesa layer of this class only, not a subclass: SimpleNorm2d is a RmsNorm2d computing
        # another function)
        mesa_self = (cls,) if type(stock) is cls else ()
        check_stock(stock, (getattr(timm.layers, cls._timm_name),) + mesa_self + torch_rms)
        w = stock.weight
        new = cls(stock.normalized_shape, eps=stock.eps, elementwise_affine=w is not None, device="meta",
                  dtype=w.dtype if w is not None else None, **inherit_options(stock, quant_options))
        new.weight = w
        copy_estimates(stock, new, w.device if w is not None else stock_device(stock, device))
        return new.train(stock.training)

    def forward(self, x):
        weight, dtype = self.weight, x.dtype
        if self.float32_compute:  # timm's RmsNormFp32: the same ops on float32 copies
            x, weight = x.float(), weight.float() if weight is not None else None
        if not self._mesa_active(x, weight):
            out = timm_rms_norm(x, self.normalized_shape, weight, self.eps)
        else:
            # (torch's nn.RMSNorm: eps None is the machine epsilon of rms_norm's compute dtype)
            eps = self.eps if self.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
            fused = self.quantizer.fused_layer_args(x) if _OP else None
            if fused is not None:  # eager, a channel format: the layer with a C++ autograd node
                out = torch.ops.mesa.rms_norm_train(x, list(self.normalized_shape), weight, eps, *fused,
                                                    self.quantizer.options.row_scale)
            else:
                out = _RmsNormFn.apply(x, self.normalized_shape, weight, eps, self.quantizer)
        return out.to(dtype) if self.float32_compute else out

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, affine={self.elementwise_affine}, {self._mesa_repr()}"


class RmsNormFp32(RmsNorm):
    """timm's ``RmsNormFp32`` (DeepSeek's ViT): :class:`RmsNorm` computed on float32 copies of
    the input and weight, returned in the input's dtype, as timm does."""

    _timm_name = "RmsNormFp32"
    float32_compute = True
