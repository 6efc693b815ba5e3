"""Mesa ``amax``: ``x.amax(dim)`` with a 1-bit mask kept for backward instead of ``x`` and the result.

Max pooling written as a reduction (Hiera's query and token pooling, ``x.view(B, stride, -1,
C).amax(dim=1)``; squeeze-excite's and CBAM's ``x.amax((2, 3))``) keeps, in stock autograd, the
whole input and the result: the gradient goes to the elements equal to the maximum, shared
equally between ties (ATen's ``scale_grad_by_count(grad, result == x, dim)``). That needs only
*which* elements equal the maximum: this layer keeps that mask, 8 elements a byte
(``relu.pack_bits``), and backward computes ATen's formula on it. Lossless: the gradient is
bitwise stock's, ties and NaNs included; the forward is the stock call. In eager training the
layer is one op with a C++ autograd node (``mesa::amax_train``, csrc/amax_autograd.cpp: the same
ops, the same bits, less host time); under ``torch.compile`` the Python Function below runs.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

from . import quantizer as quantizer_mod
from ._common import MesaLayer, load, save
from .relu import pack_bits, unpack_bits

__all__ = ["Amax"]


def _reduced_dims(x: torch.Tensor, dim) -> tuple:
    """``amax``'s ``dim`` argument as sorted non-negative ints (empty: every dim)."""
    if isinstance(dim, int):
        dim = (dim,)
    dims = tuple(d % x.dim() for d in dim) if len(dim) else tuple(range(x.dim()))
    return tuple(sorted(set(dims)))


def _restore(t: torch.Tensor, dims: tuple, keepdim: bool) -> torch.Tensor:
    """A reduced tensor with its reduced dims back as size 1 (ATen's restore_reduced_dims)."""
    if keepdim:
        return t
    for d in dims:  # ascending: each unsqueeze lands where the dim was
        t = t.unsqueeze(d)
    return t


class _AmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dims, keepdim):
        out = torch.amax(x, dims, keepdim)
        mask = x == _restore(out, dims, keepdim)
        bits, ctx.cl = pack_bits(mask)
        ctx.dims, ctx.keepdim, ctx.shape = dims, keepdim, x.shape
        save(ctx, [], bits)
        return out

    @staticmethod
    def backward(ctx, g):
        # not @once_differentiable: the mask is exact and the gradient linear in g, so this
        # backward, recorded under create_graph=True, differentiates as stock's does
        _, (bits,) = load(ctx)
        mask = unpack_bits(bits, ctx.shape, ctx.cl)
        # ATen's amax backward: scale_grad_by_count(restore_reduced_dims(grad), result == self, dim)
        gx = (_restore(g, ctx.dims, ctx.keepdim) / mask.sum(ctx.dims, keepdim=True)) * mask
        return gx, None, None


class Amax(MesaLayer, nn.Module):
    """``torch.amax(x, dim, keepdim)`` keeping a 1-bit mask of the maxima; gradients bitwise
    stock's. Parameter-free; accepts the common quantization options (only ``enabled``
    matters: nothing is quantized). ``patch_model`` routes a module's inline ``x.amax(...)``
    calls here (op ``maxpool``, ``patch/generic_attention.py``)."""

    _quantizer_names = ()

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, x: torch.Tensor, dim: Union[int, Sequence[int]] = (), keepdim: bool = False) -> torch.Tensor:
        if not self._mesa_active(x) or not x.is_floating_point():
            return torch.amax(x, dim, keepdim)
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/amax_autograd.cpp), the same bits
            return torch.ops.mesa.amax_train(x, [dim] if isinstance(dim, int) else list(dim), bool(keepdim))
        return _AmaxFn.apply(x, _reduced_dims(x, dim), bool(keepdim))

    def extra_repr(self) -> str:
        return self._mesa_repr()
