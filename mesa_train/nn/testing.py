"""Small reference blocks built from stock or Mesa layers (tests, benchmarks, examples).

``TinyBlock(dim, heads, mesa=True)`` is a pre-norm transformer block written with module
calls only (``LayerNorm -> Linear qkv -> MatMul -> Softmax -> MatMul -> Linear proj``, then
``LayerNorm -> Linear -> GELU -> Linear``), so the stock and Mesa versions differ only in
which layers they use. Mesa layers get per-head groups (``num_groups=heads``).
"""
from __future__ import annotations

import torch
from torch import nn

from . import GELU, LayerNorm, Linear, MatMul, Softmax

__all__ = ["StockMatMul", "TinyBlock"]


class StockMatMul(nn.Module):
    """``a @ b`` as a module (the stock twin of :class:`mesa_train.nn.MatMul`)."""

    def forward(self, a, b):
        return torch.matmul(a, b)


class TinyBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, mlp_ratio: int = 4, mesa: bool = True, **quant_options):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        if mesa:
            opts = {"num_groups": heads, **quant_options}
            ln, lin, mm, sm, act = (lambda *a: LayerNorm(*a, **opts)), (lambda *a: Linear(*a, **opts)), \
                (lambda: MatMul(**opts)), (lambda: Softmax(-1, **opts)), (lambda: GELU(**opts))
        else:
            ln, lin, mm, sm, act = nn.LayerNorm, nn.Linear, StockMatMul, (lambda: nn.Softmax(-1)), nn.GELU
        self.norm1 = ln(dim)
        self.qkv = lin(dim, 3 * dim)
        self.qk = mm()
        self.softmax = sm()
        self.av = mm()
        self.proj = lin(dim, dim)
        self.norm2 = ln(dim)
        self.fc1 = lin(dim, mlp_ratio * dim)
        self.act = act()
        self.fc2 = lin(mlp_ratio * dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        H = self.heads
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = self.qk(q * self.scale, k.transpose(-2, -1))
        if isinstance(self.softmax, Softmax):  # hand the map's 8-bit copy to attn @ v (also compiled)
            attn, copy = self.softmax(scores, with_copy=True)
            o = self.av(attn, v, shared_a=copy)
        else:
            o = self.av(self.softmax(scores), v)
        o = o.transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(o)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))
