"""Mesa ``LayerNorm``: exact forward; saves the 8-bit *normalised* input plus per-row rstd.

What is kept for backward (DESIGN.md, "Layers"): ``x_hat = (x - mean) * rstd`` as uint8
(channel groups over the last dim, running estimates like every other layer) and the
per-row ``rstd`` (one float per row). The per-row ``mean`` is not needed after forward.
``x_hat`` is float32 ``(x - mean) * rstd`` with ``native_layer_norm``'s statistics
(``reference.normalize_rows``); the C++ layer has the compression kernels compute it from
``x`` (never written on CUDA; DESIGN.md, "LayerNorm's x_hat inside the kernels"), this
Function makes it as a transient tensor. Backward, with
``gw = grad_out * weight`` and means over the normalised dims (one ``mesa::layer_norm_backward``
from the codes where :func:`ln_backward_from_codes` allows; else ATen's fused
``native_layer_norm_backward`` on ``x_hat / rstd``, dequantized so in one kernel, with mean 0
and the row's ``rstd``)::

    dx      = rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat))
    dweight = sum_rows(grad_out * x_hat)
    dbias   = sum_rows(grad_out)

Why ``x_hat`` and not the input (the paper's / issue's "int8 input plus mean/rstd"): the
8-bit grid of a channel group is shared by all rows, but rebuilding ``(x - mean) * rstd``
from a quantized *input* multiplies a row's rounding error by that row's ``rstd``. A row
with much less spread than the others (DeiT's class token before the first attention,
~20x smaller std at init) then gets a huge relative error, and the LayerNorm weight
gradients of the first DeiT blocks only reach cosine ~0.97 vs exact. Every row of
``x_hat`` has unit variance, so all rows use the grid equally well (cosine >= 0.999 there).
Same memory as before, minus the mean (one float per row).

At ``bits`` 4 and 2 (DESIGN.md, "Variants") ``rstd`` is kept as float16 times one power of two
per call (:func:`pack_rstd`): 2 bytes per row instead of 4, so that codes plus per-row data
still shrink with the bit width where rows are short (PVT-v2's 32-channel stage 1: 0.32x ->
0.28x of 8-bit at 2 bits). Relative error of ``rstd`` <= 2**-11 (float16 rounding), i.e. of
``dx`` per row; the parameter gradients do not use it. 8 bits keep float32 (the paper's
format, unchanged).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.quant import traceable
from mesa_train.quant.compile_kernels import traced_row_sums
from mesa_train.quant.reference import LN_MAX_COLS

from .first_order import first_order
from ._common import (DropActChildren, MesaLayer, adopt_parameters, check_stock, inherit_options, load,
                      no_autocast, save)
from .rowscale import compress_normalized, decompress_rows, max_exponent

__all__ = ["LayerNorm", "LayerNorm2d", "LayerNorm2dFp32", "LayerNormAct2d", "LayerNormFp32",
           "layer_norm_forward", "layer_norm_grads"]

# Device types whose autocast runs layer_norm in float32 ("fp32" cast policy). On CPU
# layer_norm is not in any autocast list and runs in the input dtype. The layer tests check
# bit equality with F.layer_norm under autocast on CPU and (when present) CUDA.
_FP32_POLICY = ("cuda", "xpu")


def _autocast_fp32(t):
    if t is None or not (t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16)):
        return t
    return t.float()


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Backward (and ``x_hat``) arithmetic: at least float32, like ATen's LayerNorm kernels."""
    return torch.promote_types(dtype, torch.float32)


def pack_rstd(rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r16, scale)``: ``rstd`` as float16 ``r16 = fp16(rstd / scale)`` and a float32 power of
    two ``scale`` (0-d) that puts the largest row at ``[2**14, 2**15)``: every row within
    ``2**29`` of the largest is a normal float16 (relative rounding error <= 2**-11); rows
    ``2**39`` below it would flush to zero. No host sync. :func:`unpack_rstd` inverts it (the
    scaling by a power of two is exact both ways)."""
    r = rstd.float()
    _, e = torch.frexp(r.amax())  # amax = m * 2**e, m in [0.5, 1); NaN / inf rows: e = 0
    scale = torch.exp2((e - 15).clamp(-120, 120).float())
    return (r / scale).to(torch.float16), scale


def unpack_rstd(r16: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (r16.float() * scale).to(dtype)


def layer_norm_forward(ctx, x, normalized_shape, weight, bias, eps, quantizer):
    """The stock LayerNorm's output and what its backward needs: ``(out, packed, extra)`` to
    ``save(ctx, [packed], *extra)`` (``extra``: rstd (or its float16 form), weight, row
    exponents[, rstd's scale]); dtypes on ``ctx`` as ``ln_*``. Shared by this layer's Function
    and the LayerNorm + Linear one (``layernorm_linear.py``)."""
    dev = x.device.type
    cast = dev in _FP32_POLICY and torch.is_autocast_enabled(dev)
    xc, wc, bc = (_autocast_fp32(t) for t in (x, weight, bias)) if cast else (x, weight, bias)
    with no_autocast(dev):
        # F.layer_norm == native_layer_norm(...)[0]; this also gives mean and rstd
        out, mean, rstd = torch.native_layer_norm(xc, normalized_shape, wc, bc, eps)
        mdt = _math_dtype(xc.dtype)
    # the normalised input x_hat = (x - mean) * rstd in float32 with the very statistics the
    # stock backward would use (DESIGN.md, "LayerNorm's x_hat inside the kernels"), computed
    # by the compression's kernels from x, mean and rstd as the C++ layer does (never
    # written; under torch.compile with the ops, Inductor wrote it in float32 for them to
    # read), or traced / for the variant formats a transient normalised copy (which Inductor
    # fuses when traced): only its uint8 codes are kept. Rows whose variance is far below eps
    # (DeiT3's class token) have x_hat ~ 1e-3, below the group's 8-bit step: scaled by 2**k
    # first (rowscale.py)
    packed, k = compress_normalized(quantizer, xc, mean, rstd, len(normalized_shape), max_exponent(mdt))
    ctx.ln_x_dtype, ctx.mdt = x.dtype, mdt
    ctx.normalized_shape = tuple(normalized_shape)
    ctx.ln_w_dtype = weight.dtype if weight is not None else None
    ctx.ln_b_dtype = bias.dtype if bias is not None else None
    # the weight (a parameter: no activation memory) also when only dweight is needed:
    # ATen's backward takes dweight's shape from it (an input that needs no gradient,
    # e.g. behind a frozen stem, failed here before)
    ctx.rstd_dtype = rstd.dtype
    if quantizer.options.bits < 8:  # float16 rstd (module doc)
        r16, scale = pack_rstd(rstd)
        return out, packed, (r16, weight, k, scale)
    return out, packed, (rstd, weight, k)


def ln_backward_from_codes(ctx, packed) -> bool:
    """Whether the backward is ``mesa::layer_norm_backward`` (DESIGN.md, "LayerNorm backward from
    the codes"; its traced form only where the compression is traced as PyTorch under
    ``torch.compile`` without the extension, ``compile_kernels.traced_row_sums``): the paper's
    8-bit format, float32 math, one normalised dim of at most ``LN_MAX_COLS``. C++ twin:
    ``ln_backward_from_codes`` in ``csrc/layers_autograd.cpp``."""
    return (packed.fmt is None and ctx.mdt == torch.float32 and len(ctx.normalized_shape) == 1
            and ctx.normalized_shape[0] <= LN_MAX_COLS)


def layer_norm_grads(ctx, g, packed, extra, need_x, need_w, need_b):
    """``(gx, gw, gb)`` of the LayerNorm from its output's gradient ``g`` and what
    :func:`layer_norm_forward` saved (``extra`` as it returned it; None where not needed)."""
    rstd, weight, k, *scale = extra
    if scale:
        rstd = unpack_rstd(rstd, scale[0], ctx.rstd_dtype)
    mdt = ctx.mdt
    need_w = need_w and ctx.ln_w_dtype is not None
    need_b = need_b and ctx.ln_b_dtype is not None
    gx = gw = gb = None
    if ln_backward_from_codes(ctx, packed):  # (8 bits: never the float16 rstd of `scale`)
        # all three from the codes in one op: no dequantized copy, no cast of g
        fn = traceable.layer_norm_backward if traced_row_sums(g) else torch.ops.mesa.layer_norm_backward
        with no_autocast(g.device.type):
            dx, dparams = fn(g, packed.q, packed.alpha, packed.beta, packed.num_groups, rstd.float(),
                             weight.float() if weight is not None else None, k)
        dw, db = dparams[0], dparams[1]  # ((2, D): both column sums from one reduction)
        return (dx.to(ctx.ln_x_dtype) if need_x else None, dw.to(ctx.ln_w_dtype) if need_w else None,
                db.to(ctx.ln_b_dtype) if need_b else None)
    with no_autocast(g.device.type):
        rstd = rstd.to(mdt)
        # x - mean (= x_hat / rstd) from the codes: dequantize's row_mul, in its kernel
        xs = decompress_rows(packed, mdt, k, torch.reciprocal(rstd.float()))
        # ATen's fused LayerNorm backward fed x - mean with mean 0 and the row's rstd: its
        # internal (x - mean) * rstd is x_hat again (within an ulp of float32), and it
        # returns rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat)) and both parameter
        # gradients in one call: no pass over dx after it. Replaces ~14 eager passes.
        w = weight.to(mdt) if weight is not None else None
        bias_stub = rstd.new_empty(ctx.normalized_shape) if need_b else None  # only its presence matters
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g.to(mdt), xs, list(ctx.normalized_shape), torch.zeros_like(rstd), rstd, w, bias_stub,
            [need_x, need_w, need_b])
        if need_x:
            gx = dx.to(ctx.ln_x_dtype)
        if need_w:
            gw = dw.to(ctx.ln_w_dtype)
        if need_b:
            gb = db.to(ctx.ln_b_dtype)
    return gx, gw, gb


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, quantizer):
        out, packed, extra = layer_norm_forward(ctx, x, normalized_shape, weight, bias, eps, quantizer)
        save(ctx, [packed], *extra)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), extra = load(ctx)
        need = ctx.needs_input_grad  # (x, normalized_shape, weight, bias, eps, quantizer)
        gx, gw, gb = layer_norm_grads(ctx, g, packed, extra, need[0], need[2], need[3])
        return gx, None, gw, gb, None, None


class LayerNorm(MesaLayer, nn.LayerNorm):
    """``torch.nn.LayerNorm`` that keeps, for backward, its normalised input ``(x - mean) *
    rstd`` in 8 bits (channel groups over the last dim) and the per-row ``rstd``."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None,
                 **quant_options):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.LayerNorm, *, device=None, **quant_options) -> "LayerNorm":
        """``device``: where the estimates go when ``stock`` has no parameters
        (``elementwise_affine=False``); default: the device of ``stock``'s parameters or
        buffers, else CPU (the estimates then follow the first input's device)."""
        check_stock(stock, nn.LayerNorm)
        ref = stock.weight if stock.weight is not None else None
        new = cls(stock.normalized_shape, eps=stock.eps, elementwise_affine=stock.elementwise_affine,
                  bias=stock.bias is not None, device="meta",
                  dtype=ref.dtype if ref is not None else None, **inherit_options(stock, quant_options))
        return adopt_parameters(stock, new, device)

    def forward(self, input):
        return self._norm(input, self.weight, self.bias)

    def _norm(self, input, weight, bias):
        """The norm of ``input`` with these parameters (the module's, or their float32 copies:
        :class:`LayerNormFp32`)."""
        if not self._mesa_active(input, weight, bias):
            return F.layer_norm(input, self.normalized_shape, weight, bias, self.eps)  # (nn.LayerNorm.forward)
        fused = self.quantizer.fused_layer_args(input)
        if fused is not None:  # eager, a channel format: the layer with a C++ autograd node
            return torch.ops.mesa.layer_norm_train(input, list(self.normalized_shape), weight, bias,
                                                   self.eps, *fused, self.quantizer.options.row_scale)
        return _LayerNormFn.apply(input, self.normalized_shape, weight, bias, self.eps, self.quantizer)

    def extra_repr(self) -> str:
        return f"{nn.LayerNorm.extra_repr(self)}, {self._mesa_repr()}"


class LayerNorm2d(LayerNorm):
    """timm's ``LayerNorm2d`` (ConvNeXt, EfficientViT, ...: the channels of an NCHW tensor
    normalised by permuting them last, ``F.layer_norm``, and permuting back) with the Mesa
    ``LayerNorm``'s 8-bit ``x_hat``, which is kept in the permuted (N, H, W, C) layout: its
    channel groups and rows are the normalised dims, as for any LayerNorm."""

    def forward(self, input):
        return super().forward(input.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class LayerNormFp32(LayerNorm):
    """timm's ``LayerNormFp32`` (``norm_layer="layernormfp32"``): the Mesa :class:`LayerNorm` on
    float32 copies of the input and parameters, returned in the input's dtype, as timm's; its
    ``x_hat`` is kept as the LayerNorm's (not shared with a Linear after it)."""

    _timm_name = "LayerNormFp32"

    @classmethod
    def from_module(cls, stock: nn.LayerNorm, *, device=None, **quant_options) -> "LayerNormFp32":
        import timm.layers

        # (a Mesa layer of this very class, not a subclass: LayerNorm2dFp32 permutes first)
        check_stock(stock, (getattr(timm.layers, cls._timm_name),) + ((cls,) if type(stock) is cls else ()))
        return super().from_module(stock, device=device, **quant_options)

    def forward(self, input):
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return self._norm(input.float(), weight, bias).to(input.dtype)


class LayerNorm2dFp32(LayerNormFp32):
    """timm's ``LayerNorm2dFp32``: :class:`LayerNormFp32` over the channels of an NCHW tensor
    (permuted last, as :class:`LayerNorm2d`)."""

    _timm_name = "LayerNorm2dFp32"

    def forward(self, input):
        return super().forward(input.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class LayerNormAct2d(DropActChildren, LayerNorm2d):
    """timm's ``LayerNormAct2d`` (ViTamin's and the hybrids' conv stems): the Mesa
    :class:`LayerNorm2d`, then its own ``drop`` and ``act`` children, converted on their own.
    Same parameters and ``state_dict`` keys as timm's."""

    _timm_name = "LayerNormAct2d"

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, drop: nn.Module = None,
                 act: nn.Module = None, device=None, dtype=None, **quant_options):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype, **quant_options)
        self._set_drop_act(drop, act)
