"""Mesa ``einsum`` of two operands: the stock forward, 8-bit copies of the large operand(s).

MViTv2's relative positions (``cal_rel_pos_type``: ``einsum("byhwc,hkc->byhwk", q, rel_h)`` and
the same with ``rel_w``) and SAM's explicit attention path contract the queries with small
position tables; stock autograd keeps both operands, the queries in full precision (MViTv2:
28% of what it still kept). This layer keeps an operand as 8-bit codes (groups along dim 1,
the heads of a ``(B, heads, ...)`` tensor) unless it is under half the size of the other one
(a position table, derived from parameters: kept as it is, it costs little and its partner's
gradient stays exact in it).

Backward is the contraction's own closed form, two einsums (``dA = einsum("C,B->A", g, B)``),
in the forward's autocast state: traceable, so ``torch.compile`` runs the same steps as eager.
Each operand is kept only where the other one's gradient is asked for. In eager training the
layer is one op with a C++ autograd node (``mesa::einsum_train``, csrc/einsum_autograd.cpp: the
same ops in the same order, the same bits, less host time); under ``torch.compile``, with
learned thresholds or patch4x4, and for a 0-d operand, the Python Function below runs.
That form holds when no operand repeats a letter, there is no ``...``, and each operand's letters
all appear in the other operand or the output; any other equation runs the stock einsum.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .first_order import first_order
from ._common import MesaLayer, autocast_state, load, no_autocast, save
from .quantizer import decompress

__all__ = ["Einsum"]


def contraction(equation: str) -> Optional[Tuple[str, str, str]]:
    """``(a, b, out)`` subscripts of a two-operand einsum whose gradients are einsums of the
    same letters, else None (see the module docstring)."""
    eq = equation.replace(" ", "")
    if "..." in eq or eq.count("->") != 1:
        return None
    inputs, out = eq.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    if not (set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out)):
        return None
    return a, b, out


def _group_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else x.dim() - 1


class _EinsumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, equation, spec, quantizers, a, b, tables=True):
        out = torch.einsum(equation, a, b)
        packs, raws = [], []
        # each operand is read by the other's gradient only: kept where that one is asked for
        for x, other, quantizer, read in ((a, b, quantizers[0], ctx.needs_input_grad[4]),
                                          (b, a, quantizers[1], ctx.needs_input_grad[3])):
            small = tables and 2 * x.numel() < other.numel()  # a position table: kept as it is
            packs.append(quantizer.compress(x.detach(), _group_dim(x)) if read and not small else None)
            raws.append(x.detach() if read and small else None)
        save(ctx, packs, *raws)
        ctx.spec, ctx.dtypes = spec, (a.dtype, b.dtype)
        device_type = out.device.type
        ctx.autocast = (device_type,) + autocast_state(device_type)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        packs, raws = load(ctx)
        need = ctx.needs_input_grad
        a, b = [raw if raw is not None else decompress(p, dt) if p is not None else None
                for p, raw, dt in zip(packs, raws, ctx.dtypes)]
        sa, sb, sc = ctx.spec
        device_type, enabled, dtype = ctx.autocast
        ga = gb = None
        with no_autocast(device_type), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if need[3]:
                ga = torch.einsum(f"{sc},{sb}->{sa}", g, b).to(ctx.dtypes[0])
            if need[4]:
                gb = torch.einsum(f"{sc},{sa}->{sb}", g, a).to(ctx.dtypes[1])
        return None, None, None, ga, gb, None


class Einsum(MesaLayer, nn.Module):
    """``torch.einsum(equation, a, b)`` keeping 8-bit copies of the large operand(s) for
    backward; parameter-free, ``num_groups`` groups along dim 1. ``patch_model`` routes MViTv2's
    and SAM's relative-position einsums here (op ``matmul``, ``patch/generic_attention.py``)."""

    _quantizer_names = ("quantizer_a", "quantizer_b")

    def __init__(self, *, tables: bool = True, device=None, **quant_options):
        """``tables=False``: no operand is taken for a position table, both are kept 8-bit (an
        attention's ``attn . v``, whose ``v`` is under half the map's size when the tokens
        outnumber twice the head width)."""
        super().__init__()
        self.tables = tables
        self._init_mesa(quant_options, device)

    def forward(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        spec = contraction(equation)
        if (spec is None or not self._mesa_active(a, b)
                or not (a.is_floating_point() and b.is_floating_point())):
            return torch.einsum(equation, a, b)
        if a.dim() and b.dim() and self.tables:  # (the C++ op keeps a small operand as it is)
            fused_a, fused_b = self.quantizer_a.fused_state_args(a), self.quantizer_b.fused_state_args(b)
            if fused_a is not None and fused_b is not None:
                # eager: the layer with a C++ autograd node (csrc/einsum_autograd.cpp), the same bits
                return torch.ops.mesa.einsum_train(equation, a, b, *fused_a, *fused_b)
        return _EinsumFn.apply(equation, spec, (self.quantizer_a, self.quantizer_b), a, b, self.tables)

    def extra_repr(self) -> str:
        return self._mesa_repr()
