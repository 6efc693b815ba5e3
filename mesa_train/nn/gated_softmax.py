"""Mesa ``GatedPositionalSoftmax``: ConViT's gated positional attention map (timm's ``GPSA``),
exact forward, one 8-bit map saved for backward.

The stock map is computed from the patch logits ``S`` (``q @ k^T * scale``, per sample), the
relative positions ``R`` (``(1, N, N, 3)``, the same for every sample) and a gate per head::

    P = softmax(S)                         Q = softmax(pos_proj(R expanded to the batch))
    A = (1 - sigmoid(g)) * P + sigmoid(g) * Q
    out = A / A.sum(-1)

Stock autograd keeps ``P``, ``Q``, ``A`` and the reshaped copy of the expanded ``R`` in full
precision: four maps and three quarters of one (convit_tiny at 224 px: 71% of its GPSA's
saved bytes, the zoo's worst attention). This layer keeps ``P`` 8-bit (per-head groups) and
the row sums, and recomputes ``Q`` in backward from ``R`` and ``pos_proj``'s parameters on one
sample (the positional logits are the same for every sample: a ``(1, N, N, 3)`` GEMM). The
backward, in float32 (``out``'s rows renormalised, then the gate, the two softmaxes and
``pos_proj`` by hand)::

    dA = (d_out - rowsum(d_out * out)) / rowsum(A)
    dS = P * ((1 - s) dA - rowsum((1 - s) dA * P))
    dQ = s * sum_batch(dA)  ->  d_pos = Q * (dQ - rowsum(dQ * Q))  ->  pos_proj's dW, db
    dg = s (1 - s) * sum((Q - P) * dA)

The 8-bit map is quantized with its running range also under ``estimator="learned"`` (no
learned clipping of a softmax map: ``nn.Softmax``'s reason).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.quant import traceable
from mesa_train.quant.compile_kernels import traced_as_pytorch

from .first_order import first_order
from ._common import MesaLayer, group_dim_4d, load, no_autocast, save
from .quantizer import decompress

__all__ = ["GatedPositionalSoftmax", "gated_positional_softmax"]


def _positional_logits(rel, weight, bias, batch: int) -> torch.Tensor:
    """``(B, heads, N, N)`` positional logits, as timm computes them (the Linear over the
    batch-expanded table)."""
    return F.linear(rel.expand(batch, -1, -1, -1), weight, bias).permute(0, 3, 1, 2)


def _mix(patch_score, pos_score, gating_param):
    """timm's lines: the gated sum, then each row divided by its sum (in place, as timm does)."""
    gating = gating_param.view(1, -1, 1, 1)
    attn = (1. - torch.sigmoid(gating)) * patch_score + torch.sigmoid(gating) * pos_score
    attn /= attn.sum(dim=-1).unsqueeze(-1)
    return attn


def gated_positional_softmax(patch_logits, rel, weight, bias, gating_param):
    """The stock computation (module doc), op for op."""
    pos_score = _positional_logits(rel, weight, bias, patch_logits.shape[0])
    patch_score = patch_logits.softmax(dim=-1)
    pos_score = pos_score.softmax(dim=-1)
    return _mix(patch_score, pos_score, gating_param)


class _GatedPositionalSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, patch_logits, rel, weight, bias, gating_param, quantizer):
        pos_score = _positional_logits(rel, weight, bias, patch_logits.shape[0])
        patch_score = patch_logits.softmax(dim=-1)
        pos_score = pos_score.softmax(dim=-1)
        gating = gating_param.view(1, -1, 1, 1)
        attn = (1. - torch.sigmoid(gating)) * patch_score + torch.sigmoid(gating) * pos_score
        sums = attn.sum(dim=-1).unsqueeze(-1)
        # (out of place, the same bits as timm's `attn /=`: under torch.compile in torch 2.11 the
        # Function's output divided in place reached the traced backward as zeros)
        attn = attn / sums
        pd = patch_score.detach()
        if traced_as_pytorch(pd) and quantizer.options.estimator != "delayed":
            pd = traceable.stored_here(pd)  # (as the Mesa Softmax: the map stored before both passes read it)
        packed = quantizer.compress(pd, group_dim_4d(pd))
        ctx.dtypes = (patch_logits.dtype, weight.dtype, None if bias is None else bias.dtype, gating_param.dtype)
        ctx.has_bias = bias is not None
        save(ctx, [packed], sums, rel, weight, bias, gating_param)
        return attn

    @staticmethod
    @first_order
    def backward(ctx, g):
        (packed,), (sums, rel, weight, bias, gating_param) = load(ctx)
        f32 = torch.float32
        with no_autocast(g.device.type):
            p = decompress(packed, f32)
            # each dequantized row rescaled to sum to 1, as the exact softmax's rows do (nn/softmax.py)
            p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(f32).tiny)
            q = F.linear(rel.to(f32), weight.to(f32), None if bias is None else bias.to(f32))
            q = q.permute(0, 3, 1, 2).softmax(dim=-1)  # (1, heads, N, N): every sample's positional map
            s = torch.sigmoid(gating_param.to(f32)).view(1, -1, 1, 1)
            sums = sums.to(f32)
            out = ((1. - s) * p + s * q) / sums
            g = g.to(f32)
            da = (g - (g * out).sum(-1, keepdim=True)) / sums
            d_logits = d_weight = d_bias = d_gating = None
            need_logits, _, need_w, need_b, need_g = ctx.needs_input_grad[:5]
            if need_logits:
                dp = (1. - s) * da
                d_logits = (p * (dp - (dp * p).sum(-1, keepdim=True))).to(ctx.dtypes[0])
            if need_g:
                d_gating = ((q - p) * da).sum((0, 2, 3)) * (s * (1. - s)).flatten()
                d_gating = d_gating.view(gating_param.shape).to(ctx.dtypes[3])
            if need_w or need_b:
                dq = s * da.sum(0, keepdim=True)  # (the positional map is the batch's, expanded)
                d_pos = (q * (dq - (dq * q).sum(-1, keepdim=True))).permute(0, 2, 3, 1)  # (1, N, N, heads)
                d_pos = d_pos.reshape(-1, d_pos.shape[-1])
                if need_w:
                    d_weight = d_pos.t().matmul(rel.to(f32).reshape(-1, rel.shape[-1])).to(ctx.dtypes[1])
                if need_b:
                    d_bias = d_pos.sum(0).to(ctx.dtypes[2])
        return d_logits, None, d_weight, d_bias, d_gating, None


class GatedPositionalSoftmax(MesaLayer, nn.Module):
    """ConViT's gated positional attention map with one 8-bit map kept (module doc)."""

    # (a softmax map: quantized with its running range under estimator="learned" too, as
    # nn.Softmax is: learned thresholds clip the few large probabilities attention's gradient rides on)
    _learned_clipping = False

    def __init__(self, *, device=None, **quant_options):
        super().__init__()
        self._init_mesa(quant_options, device)

    def forward(self, patch_logits, rel, weight, bias, gating_param):
        """The map ``(B, heads, N, N)`` from the patch logits ``(B, heads, N, N)``, the
        relative positions ``(1, N, N, 3)``, the positional Linear's parameters and the gate
        parameter ``(heads,)``."""
        if not self._mesa_active(patch_logits, weight, bias, gating_param) or rel.shape[0] != 1:
            return gated_positional_softmax(patch_logits, rel, weight, bias, gating_param)
        return _GatedPositionalSoftmaxFn.apply(patch_logits, rel, weight, bias, gating_param, self.quantizer)

    def extra_repr(self) -> str:
        return self._mesa_repr()
