"""Mesa ``einsum`` of two operands: the stock forward, 8-bit copies of the large operand(s).

MViTv2's relative positions (``cal_rel_pos_type``: ``einsum("byhwc,hkc->byhwk", q, rel_h)`` and
the same with ``rel_w``) and SAM's explicit attention path contract the queries with small
position tables; stock autograd keeps both operands, the queries in full precision (MViTv2:
28% of what it still kept). This layer keeps an operand as 8-bit codes (groups along dim 1,
the heads of a ``(B, heads, ...)`` tensor) unless it is under half the size of the other one
(a position table, derived from parameters: kept as it is, it costs little and its partner's
gradient stays exact in it). Backward dequantizes and runs autograd through the same einsum
again, in the forward's autocast state: the exact gradients at the kept operands.

Eager only: ``autograd.grad`` in a backward is not traced, so under ``torch.compile`` the layer
is the stock einsum (no graph break).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ._common import MesaLayer, load, save
from .quantizer import decompress
from .sdpa_backward import autocast_state, grads_through

__all__ = ["Einsum"]


def _group_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else x.dim() - 1


class _EinsumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, equation, quantizers, a, b):
        out = torch.einsum(equation, a, b)
        packs, raws = [], []
        for x, other, quantizer in ((a, b, quantizers[0]), (b, a, quantizers[1])):
            small = 2 * x.numel() < other.numel()  # a position table: kept as it is
            packs.append(None if small else quantizer.compress(x.detach(), _group_dim(x)))
            raws.append(x.detach() if small else None)
        save(ctx, packs, *raws)
        ctx.equation, ctx.dtypes = equation, (a.dtype, b.dtype)
        device_type = out.device.type
        ctx.autocast = (device_type,) + autocast_state(device_type)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        packs, raws = load(ctx)
        operands = [raw if raw is not None else decompress(p, dt) for p, raw, dt in zip(packs, raws, ctx.dtypes)]
        equation = ctx.equation

        def call(a, b):
            return torch.einsum(equation, a, b)

        ga, gb = grads_through(call, operands, ctx.needs_input_grad[2:], g, ctx.autocast)
        return None, None, ga, gb


class Einsum(MesaLayer, nn.Module):
    """``torch.einsum(equation, a, b)`` keeping 8-bit copies of the large operand(s) for
    backward; parameter-free, ``num_groups`` groups along dim 1. ``patch_model`` routes MViTv2's
    and SAM's relative-position einsums here (op ``matmul``, ``patch/generic_attention.py``)."""

    _quantizer_names = ("quantizer_a", "quantizer_b")

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if (not self._mesa_active(a, b) or torch.compiler.is_compiling()
                or not (a.is_floating_point() and b.is_floating_point())):
            return torch.einsum(equation, a, b)
        return _EinsumFn.apply(equation, (self.quantizer_a, self.quantizer_b), a, b)

    def extra_repr(self) -> str:
        return self._mesa_repr()
