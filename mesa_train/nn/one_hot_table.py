"""Mesa ``OneHotTable``: ``one_hot(positions) @ table``, keeping the integer positions.

Gemma 4's vision encoder looks its 2-D position embeddings up as a matmul of a float one-hot
matrix ``(B, 2, N, P)`` (``P = position_embedding_size``, 10240) with the table ``(2, P, D)``;
stock autograd keeps that one-hot matrix for the table's gradient: ``P`` floats per token and
axis, the largest tensor a stock step of that model keeps. This runs the same matmul (the
forward is stock's bit for bit) and keeps only the positions; the table's gradient is an
``index_add`` of the output gradient's rows (the same sums as ``one_hot^T @ g``, in another
order). In eager training the layer is one op with a C++ autograd node
(``mesa::one_hot_table_train``, csrc/one_hot_table_autograd.cpp: the same ops, the same bits,
less host time); under ``torch.compile`` the Python Function below runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .first_order import first_order
from . import quantizer as quantizer_mod
from ._common import MesaLayer

__all__ = ["OneHotTable", "one_hot_lookup"]


def one_hot_lookup(positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Stock Gemma 4's lookup: ``(B, N, axes)`` positions, ``(axes, P, D)`` table -> ``(B, axes, N, D)``.
    A float one-hot ``(B, axes, N, P)`` matmul with the table, kept as stock writes it (the layer's
    forward must be stock's bit for bit)."""
    one_hot = F.one_hot(positions, num_classes=table.shape[1]).permute(0, 2, 1, 3).to(table)
    return one_hot @ table


class _OneHotTableFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, positions, table):
        out = one_hot_lookup(positions, table)  # stock's own matmul
        ctx.save_for_backward(positions)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (positions,) = ctx.saved_tensors
        axes, size, dim = ctx.table_shape
        # row j * P + p of the flattened table gets every g[b, j, n] whose positions[b, n, j] is p
        rows = positions + torch.arange(axes, device=positions.device) * size  # (B, N, axes)
        flat = g.to(ctx.table_dtype).permute(0, 2, 1, 3).reshape(-1, dim)  # (B * N * axes, D)
        grad = torch.zeros(axes * size, dim, dtype=ctx.table_dtype, device=g.device)
        grad.index_add_(0, rows.reshape(-1), flat)
        return None, grad.view(ctx.table_shape)


class OneHotTable(MesaLayer, nn.Module):
    """``forward(positions, table)``: ``one_hot_lookup(positions, table)`` for ``positions``
    ``(B, N, axes)`` and ``table`` ``(axes, P, D)``, keeping only the positions for backward."""

    _quantizer_names = ()

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        if not self._mesa_active(table):
            return one_hot_lookup(positions, table)
        if quantizer_mod.fused_layers_on():
            # eager: the layer with a C++ autograd node (csrc/one_hot_table_autograd.cpp), the same bits
            return torch.ops.mesa.one_hot_table_train(positions, table)
        return _OneHotTableFn.apply(positions, table)

    def extra_repr(self) -> str:
        return self._mesa_repr()
