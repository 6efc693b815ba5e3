"""Mesa ``Linear``: exact forward, saves the 8-bit input (plus the weight, a parameter) and one
int8 power-of-two exponent per row (``rowscale.py``: rows far smaller than the rest). In eager
training, parallel Linear layers handed the same tensor (separate q / k / v projections) keep one
copy of it between them (``input_copy.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from . import input_copy
from ._common import (MesaLayer, adopt_parameters, autocast_input, autocast_state, check_stock, device_type,
                      inherit_options, load, no_autocast, save)
from .rowscale import compress_rows, decompress_rows, max_exponent

__all__ = ["Linear", "copy_signature", "linear_grads", "not_a_view", "save_linear_dtypes"]


def not_a_view(out: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on a 3-D+ input with a bias is ``addmm(...).view(...)``: a *view*. Autograd
    forbids modifying a custom Function's view output in place (``ReLU(inplace=True)``,
    ``x.add_(pos_embed)`` after the layer), which a stock Linear allows. ``_unsafe_view``
    gives the same memory, bitwise, without the view relation (what ``torch.matmul`` itself
    returns for folded batch dims)."""
    # (Tensor._is_view cannot be traced: under torch.compile take the unconditional form,
    # an _unsafe_view of a tensor that is not a view is that tensor's memory all the same)
    if not torch.compiler.is_compiling() and not out._is_view():
        return out
    return torch.ops.aten._unsafe_view(out, out.shape) if out.is_contiguous() else out.clone()


def save_linear_dtypes(ctx, out, weight, bias) -> None:
    """What :func:`linear_grads` reads from ``ctx``: the compute dtype (the output's), the
    parameters' dtypes and the weight's shape (C++ twin: ``save_linear_dtypes``)."""
    ctx.cdt, ctx.w_dtype = out.dtype, weight.dtype
    ctx.b_dtype = bias.dtype if bias is not None else None
    ctx.in_features, ctx.out_features = weight.shape[1], weight.shape[0]


def linear_grads(ctx, g, weight, x_dtype, need_x, need_w, need_b, input_of):
    """``(gx, gw, gb)`` of ``F.linear(x, weight, bias)`` from its output's gradient ``g`` (None
    where not needed): ``gx`` in ``x_dtype``, ``gw`` from the input as ``input_of()`` rebuilds
    it in the compute dtype (called only then); ``ctx`` as :func:`save_linear_dtypes` left
    it. C++ twin: ``linear_grads`` in
    csrc/layers_autograd.cpp."""
    gx = gw = gb = None
    g = g.to(ctx.cdt)
    if need_x:
        gx = g.matmul(weight.to(ctx.cdt)).to(x_dtype)
    g2 = g.reshape(-1, ctx.out_features)
    if need_w:
        gw = g2.t().matmul(input_of().reshape(-1, ctx.in_features)).to(ctx.w_dtype)  # one GEMM over all tokens
    if need_b:
        gb = g2.sum(0).to(ctx.b_dtype)
    return gx, gw, gb


def copy_signature(path: str, quantizer, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """What two Linear layers given the same ``x`` must agree on to keep one copy of it
    (``input_copy.py``): the path, the options, and what decides the compressed tensor and its
    row scales: autocast (its cast of ``x``) and the weight's dtype (the output's)."""
    return (path, quantizer.options, weight.dtype, autocast_state(device_type(x)))


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizer):
        xc = autocast_input(x)  # under autocast: the cast F.linear would make (half the bytes to compress)
        out = F.linear(xc, weight, bias)  # exactly nn.Linear.forward (autocast applies here)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed = k = None
        if need_w:
            # (learned thresholds learn from their own codes: those layers keep their own)
            signature = (copy_signature("function", quantizer, x, weight)
                         if quantizer.options.estimator != "learned" and input_copy.may_share(x) else None)
            # rows far smaller than the others (DeiT3's class token) scaled by 2**k first
            packed, k = input_copy.take_or_make(
                x, signature, quantizer, lambda: compress_rows(quantizer, xc, 1, max_exponent(xc.dtype, out.dtype)))
        ctx.x_dtype = x.dtype
        save_linear_dtypes(ctx, out, weight, bias)
        save(ctx, [packed], weight if need_x else None, k)
        return not_a_view(out)

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (weight, k) = load(ctx)
        with no_autocast(g.device.type):
            gx, gw, gb = linear_grads(ctx, g, weight, ctx.x_dtype, *ctx.needs_input_grad[:3],
                                      lambda: decompress_rows(packed, ctx.cdt, k))
        return gx, gw, gb, None


_OWN = object()  # Linear.forward's default: the layer's own bias


class Linear(MesaLayer, nn.Linear):
    """``torch.nn.Linear`` whose saved input is 8-bit (channel groups over the last dim)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, **quant_options):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Linear, **quant_options) -> "Linear":
        check_stock(stock, nn.Linear)
        new = cls(stock.in_features, stock.out_features, bias=stock.bias is not None, device="meta",
                  dtype=stock.weight.dtype, **inherit_options(stock, quant_options))
        return adopt_parameters(stock, new)

    def forward(self, input, *, call_bias=_OWN):
        """``call_bias``: a bias given at call time instead of ``self.bias`` (BEiT's and
        SwinV2's ``F.linear(x, self.qkv.weight, cat(q_bias, 0, v_bias))``, routed here by the
        generic attention so that the qkv input is compressed and attributed to this layer)."""
        # (each read once: a read is nn.Module.__getattr__, a slow path)
        weight, bias = self.weight, self.bias if call_bias is _OWN else call_bias
        if not self._mesa_active(input, weight, bias):
            return F.linear(input, weight, bias)
        return _compressed_linear(self.quantizer, input, weight, bias)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self._mesa_repr()}"


def _compressed_linear(quantizer, input, weight, bias):
    fused = quantizer.fused_layer_args(input)
    if fused is None:
        return _LinearFn.apply(input, weight, bias, quantizer)
    # eager, a channel format: the layer with a C++ autograd node; the input's codes are made
    # once for the parallel layers given the same tensor (input_copy.py: separate q / k / v
    # projections of one normed input), taken where another left them, else left for the next
    signature = (copy_signature("op", quantizer, input, weight)
                 if weight.requires_grad and input_copy.may_share(input) else None)
    shared = input_copy.take(input, signature, quantizer) if signature is not None else None
    out, q, alpha, beta, k = torch.ops.mesa.linear_train(input, weight, bias, *fused, quantizer.options.row_scale,
                                                         () if shared is None else shared)
    if signature is not None and q.numel():  # (made here, not taken: empty when shared)
        input_copy.offer(input, signature, (q, alpha, beta, k))
    return out


class LinearOf(MesaLayer, nn.Module):
    """``F.linear(input, weight, bias)`` with the weight and bias given at call time, its input
    saved in 8 bits as :class:`Linear` saves it: a projection whose parameters belong to the
    module that calls it (``nn.MultiheadAttention``'s packed ``in_proj_weight``), so that its
    ``state_dict`` keys stay the stock ones."""

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, input, weight, bias=None):
        if not self._mesa_active(input, weight, bias):
            return F.linear(input, weight, bias)
        return _compressed_linear(self.quantizer, input, weight, bias)

    def extra_repr(self) -> str:
        return self._mesa_repr()

