"""Mesa ``RmsNorm2d`` / ``RmsNormAct2d`` (timm's NCHW RMS norms: MobileNetV5, Gemma 3n's vision
tower; the ``Fp32`` forms): the forward is timm's own function (``rms_norm2d``, or
``fast_rms_norm2d`` where the stock module took the fast path), so the output is stock's in
bits and dtype; backward needs the 8-bit normalised input ``x_hat = x * rrms`` (channel groups
over dim 1, as a conv's input) and the per-pixel ``rrms`` (SimpleNorm: the centred form and
the per-pixel mean, see ``_Norm2dFn``). With ``gw = grad_out * weight`` and
means over the channels::

    dx      = rrms * (gw - x_hat * mean_c(gw * x_hat))
    dweight = sum_{n,h,w}(grad_out * x_hat)

Stock autograd keeps ``x``, ``x^2``'s mean, ``rrms`` and ``x * rrms`` (two full-size tensors;
under autocast also the bf16 copy): in ``mobilenetv5_300m`` 81% of what a patched model still
kept. ``x_hat`` (SimpleNorm: the centred ``c_hat``) has unit RMS per pixel, so one range per
channel group fits every pixel (no row scales). The Python Function runs in eager and compiled
training alike (no C++ op). timm's 1-D ``SimpleNorm`` (over the last dim) takes the same
Function over the trailing dims.
"""
from __future__ import annotations

import torch
from timm.layers.fast_norm import fast_rms_norm2d, fast_simple_norm, rms_norm2d, simple_norm

from .first_order import first_order
from ._common import DropActChildren, from_nhwc, load, nhwc_view, no_autocast, save
from .quantizer import decompress
from .rmsnorm import RmsNorm

__all__ = ["RmsNorm2d", "RmsNormAct2d", "RmsNorm2dFp32", "RmsNormAct2dFp32", "SimpleNorm", "SimpleNormFp32",
           "SimpleNorm2d", "SimpleNorm2dFp32"]


class _Norm2dFn(torch.autograd.Function):
    """``centered=False``: the RMS norm (``r = rsqrt(mean_c(x^2) + eps)``); ``True``: timm's
    SimpleNorm (``r = rsqrt(var_c(x) + eps)``, torch.var's unbiased variance; the output is
    ``x * r``, the mean left in), whose backward adds the mean's path. It keeps the centred
    ``c_hat = (x - mean_c(x)) * r`` in 8 bits and the per-pixel ``m = mean_c(x) * r`` beside
    ``r`` (``x_hat = c_hat + m``): 8-bit codes of ``x_hat`` itself lost ``dx`` where a pixel's
    mean outweighs its spread (a review measured cosine 0.96 at |mean| = 30 std, 0.68 at 100),
    since the backward takes that mean off again::

        dx = r * (gw - c_hat * (sum_c(gw * c_hat) + m * sum_c(gw)) / (C - 1))

    ``nd``: 0 for the NCHW forms (normalised over dim 1, channel groups as a conv's input), else
    the number of trailing dims normalised (timm's 1-D ``SimpleNorm``: a ``(B, N, C)`` or
    ``(B, H, W, C)`` input, channel groups over the last dim; ``C`` above is then the number of
    elements a row normalises)."""

    @staticmethod
    def forward(ctx, x, stock_fn, normalized_shape, weight, eps, quantizer, centered: bool, nd: int = 0):
        out = stock_fn(x, normalized_shape, weight, eps)  # timm's own call: stock's bits and dtype
        dims = (1,) if nd == 0 else tuple(range(-1, -nd - 1, -1))
        with no_autocast(x.device.type):  # (float32 at least, beside the forward's own ops)
            mdt = torch.promote_types(x.dtype, torch.float32)
            xm = x.to(mdt)
            if centered:
                mean = xm.mean(dim=dims, keepdim=True)
                r = torch.rsqrt(xm.var(dim=dims, keepdim=True) + eps)
                kept, m = (xm - mean) * r, mean * r
            else:
                r = torch.rsqrt(xm.pow(2).mean(dim=dims, keepdim=True) + eps)
                kept, m = xm * r, None
            if nd == 0:
                xv, dim, ctx.nhwc = nhwc_view(kept, 1, quantizer.options.channel_layout)
            else:
                xv, dim, ctx.nhwc = kept, kept.dim() - 1, False
            packed = quantizer.compress(xv, dim)
        ctx.mdt, ctx.x_dtype, ctx.eps, ctx.dims = mdt, x.dtype, eps, dims
        ctx.w_dtype = weight.dtype if weight is not None else None
        save(ctx, [packed], r, m, weight)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (r, m, weight) = load(ctx)
        mdt, dims = ctx.mdt, ctx.dims
        gx = gw = None
        with no_autocast(g.device.type):
            kept = from_nhwc(decompress(packed, mdt), ctx.nhwc)  # x_hat, or the centred c_hat
            g = g.to(mdt)
            w = None if weight is None else weight.to(mdt).view(1, -1, 1, 1) if dims == (1,) else weight.to(mdt)
            gwt = g * w if w is not None else g
            if ctx.needs_input_grad[0]:
                if m is not None:
                    # a pixel of no spread (var 0, r = rsqrt(eps)): its c_hat is exactly 0, so its term
                    # is; its codes' rounding noise times a large m is not (cosine 0.55 with it in)
                    flat = r == torch.full((), ctx.eps, dtype=mdt, device=r.device).rsqrt()
                    m_dx = torch.where(flat, 0.0, m)
                    dot = (gwt * kept).sum(dim=dims, keepdim=True) + m_dx * gwt.sum(dim=dims, keepdim=True)
                    along = kept * (dot / (kept.numel() // r.numel() - 1))
                else:
                    along = kept * (gwt * kept).mean(dim=dims, keepdim=True)
                gx = (r * (gwt - along)).to(ctx.x_dtype)
            if weight is not None and ctx.needs_input_grad[3]:
                x_hat = kept + m if m is not None else kept
                gxw = g * x_hat
                gw = (gxw.sum(dim=(0, 2, 3)) if dims == (1,) else gxw.reshape(-1, *weight.shape).sum(0))
                gw = gw.to(ctx.w_dtype)
        return gx, None, None, gw, None, None, None, None


class RmsNorm2d(RmsNorm):
    """timm's ``RmsNorm2d`` keeping its 8-bit normalised input and the per-pixel ``rrms``.
    Same parameters and ``state_dict`` keys (the op is ``rmsnorm``, as for :class:`RmsNorm`)."""

    _timm_name = "RmsNorm2d"
    # timm's functions for the output, (plain, fast); the statistic backward assumes
    _stock_functions = (rms_norm2d, fast_rms_norm2d)
    centered = False
    # normalised over the trailing normalized_shape dims (timm's 1-D SimpleNorm), not over dim 1
    trailing_dims = False
    _fast_norm = False  # (from_module takes the stock module's: timm's choice, made at its build)

    @classmethod
    def from_module(cls, stock, *, device=None, **quant_options) -> "RmsNorm2d":
        new = super().from_module(stock, device=device, **quant_options)
        new._fast_norm = bool(getattr(stock, "_fast_norm", False))
        return new

    def forward(self, x):
        weight, dtype = self.weight, x.dtype
        if self.float32_compute:  # timm's Fp32 forms: rms_norm2d on float32 copies, the input's dtype out
            x, weight = x.float(), weight.float() if weight is not None else None
        stock_fn = self._stock_functions[self._fast_norm and not self.float32_compute]
        if not self._mesa_active(x, weight):
            out = stock_fn(x, self.normalized_shape, weight, self.eps)
        else:
            out = _Norm2dFn.apply(x, stock_fn, self.normalized_shape, weight, self.eps, self.quantizer,
                                  self.centered, len(self.normalized_shape) if self.trailing_dims else 0)
        return out.to(dtype) if self.float32_compute else out


class RmsNormAct2d(DropActChildren, RmsNorm2d):
    """timm's ``RmsNormAct2d`` (MobileNetV5's blocks): the Mesa :class:`RmsNorm2d`, then its own
    ``drop`` and ``act`` children, converted on their own. Same parameters and keys as timm's."""

    _timm_name = "RmsNormAct2d"


class RmsNorm2dFp32(RmsNorm2d):
    """timm's ``RmsNorm2dFp32`` (``norm_layer="rmsnorm2dfp32"``): computed on float32 copies of
    the input and weight, returned in the input's dtype, as timm's."""

    _timm_name = "RmsNorm2dFp32"
    float32_compute = True


class RmsNormAct2dFp32(DropActChildren, RmsNorm2dFp32):
    """timm's ``RmsNormAct2dFp32``: :class:`RmsNorm2dFp32`, then its ``drop`` and ``act``."""

    _timm_name = "RmsNormAct2dFp32"


def _simple_norm2d(x, normalized_shape, weight, eps):
    """timm's ``SimpleNorm2d.forward``: the channels-last view normalised over its last dim."""
    return simple_norm(x.permute(0, 2, 3, 1), normalized_shape, weight, eps).permute(0, 3, 1, 2)


def _fast_simple_norm2d(x, normalized_shape, weight, eps):
    return fast_simple_norm(x.permute(0, 2, 3, 1), normalized_shape, weight, eps).permute(0, 3, 1, 2)


class SimpleNorm2d(RmsNorm2d):
    """timm's ``SimpleNorm2d`` (``x / std_c(x) * weight``: ConvNeXt's ``*_rms`` variants), kept as
    :class:`RmsNorm2d` keeps its input (op ``rmsnorm``), with the variance's backward."""

    _timm_name = "SimpleNorm2d"
    _stock_functions = (_simple_norm2d, _fast_simple_norm2d)
    centered = True


class SimpleNorm2dFp32(SimpleNorm2d):
    """timm's ``SimpleNorm2dFp32``: float32 copies in, the input's dtype out."""

    _timm_name = "SimpleNorm2dFp32"
    float32_compute = True


class SimpleNorm(SimpleNorm2d):
    """timm's 1-D ``SimpleNorm`` (``x / std(x) * weight`` over the last dims: the head norm of
    ConvNeXt's ``*_rms`` variants, their blocks' norm where ``conv_mlp=False``, any timm model
    built with ``norm_layer="simplenorm"``), kept as :class:`SimpleNorm2d` keeps its input, the
    channel groups over the last dim (op ``rmsnorm``)."""

    _timm_name = "SimpleNorm"
    _stock_functions = (simple_norm, fast_simple_norm)
    trailing_dims = True


class SimpleNormFp32(SimpleNorm):
    """timm's ``SimpleNormFp32``: float32 copies in, the input's dtype out."""

    _timm_name = "SimpleNormFp32"
    float32_compute = True
