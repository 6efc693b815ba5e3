"""Mesa forwards for timm's attention modules, installed by swapping the instance's class.

``patch_model`` turns a timm attention module into a Mesa one *in place* by setting
``module.__class__`` to a subclass defined here (``MesaViTAttention`` for
``timm.layers.Attention``, ``MesaWindowAttention`` for Swin's ``WindowAttention``,
``MesaPvtV2Attention`` for ``timm.models.pvt_v2.Attention``). The subclass overrides
``forward`` only: parameters, buffers, hyper-parameters and every child module stay where
they are (the Linear/LayerNorm/Conv2d children are swapped for Mesa layers separately, by
the ordinary leaf conversion), so ``isinstance`` checks, ``state_dict`` keys and pickling
keep working. No timm model file is copied.

Each patched forward is the stock forward line for line, except that the attention core
``softmax(q @ k^T * scale + bias) @ v`` goes through child modules:

``qk_matmul``  ``q @ k^T``  (Mesa ``MatMul``: both operands int8, per-head groups)
``softmax``    softmax over the last dim (Mesa ``Softmax``: int8 output only, per head)
``av_matmul``  ``attn @ v`` (Mesa ``MatMul``, int8 ``v``; the map it keeps is ``softmax``'s own
               int8 copy, shared through ``mesa_train.nn.sharing``, or the full map a stock
               softmax keeps anyway, so it is stored once (``core._matmul_operands``). With
               ``softmax`` but not ``matmul`` requested it is ``MatMul(operands=())``: the
               shared int8 map, ``v`` kept as the stock matmul keeps it)
``sdpa``       fused attention (Mesa ``ScaledDotProductAttention``: int8 q, k, v)

Which path runs is ``module.mesa_attn_path``:

* ``"explicit"``: the three explicit ops above (chosen when ``matmul`` or ``softmax`` is
  patched; an op not requested is a plain stock op, e.g. ``a @ b``). The output equals the
  stock module's *explicit* path (``fused_attn=False``) bit for bit.
* ``"fused"``: ``sdpa`` (chosen when ``sdpa`` is patched but neither ``matmul`` nor
  ``softmax``). The output equals the stock *fused* path (``fused_attn=True``) bit for bit.
* ``"stock"``: the module's own forward (its ``fused_attn`` flag decides), nothing in the
  attention core is compressed (the qkv/proj linears still may be).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn as nn

from mesa_train.nn.layernorm_linear import can_fuse_norm, layernorm_linear
from mesa_train.nn.matmul import MatMul as MesaMatMul
from mesa_train.nn.softmax import Softmax as MesaSoftmax
from mesa_train.nn.softmax import autocast_dtype_for
from timm.layers import Attention as _TimmAttention
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.pvt_v2 import Attention as _PvtAttention
from timm.models.swin_transformer import WindowAttention as _SwinWindowAttention

__all__ = [
    "PlainMatMul",
    "PlainSoftmax",
    "MesaViTAttention",
    "MesaWindowAttention",
    "MesaPvtV2Attention",
    "ATTENTION_CLASSES",
    "STOCK_ATTENTION_CLASSES",
    "STOCK_FUSED_ATTR",
    "attention_as_built",
]

# the fused_attn flag a timm attention had before patch_model first chose its path (in __dict__)
STOCK_FUSED_ATTR = "_mesa_stock_fused_attn"


@contextlib.contextmanager
def attention_as_built(root: nn.Module):
    """Each patched attention under ``root`` on its own forward with the ``fused_attn`` flag it
    had before patching, then back: the stock model as the user built it, for the stock figures
    (``coverage``, training's ``stock ~``). A fused timm attention patched onto the explicit path
    (``ops=["gelu", "softmax"]``) keeps an N x N map there; stock, fused, keeps none: against the
    explicit stock deit_tiny's Mesa read 0.729x where it keeps 0.864x of the stock it replaces,
    and ``ops=["softmax"]`` alone 0.882x where it keeps 1.046x."""
    changed = []
    for m in root.modules():
        if STOCK_FUSED_ATTR in m.__dict__ and getattr(m, "mesa_attn_path", "stock") != "stock":
            changed.append((m, m.mesa_attn_path, m.fused_attn))
            m.mesa_attn_path, m.fused_attn = "stock", m.__dict__[STOCK_FUSED_ATTR]
    try:
        yield
    finally:
        for m, path, fused in changed:
            m.mesa_attn_path, m.fused_attn = path, fused


class PlainMatMul(nn.Module):
    """``a @ b`` as a module: the stand-in for an attention matmul that is not compressed."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class PlainSoftmax(nn.Module):
    """``x.softmax(dim)`` as a module: the stand-in for a softmax that is not compressed
    (bitwise the same as ``torch.nn.Softmax`` and ``Tensor.softmax``)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def _dropout_p(module: nn.Module) -> float:
    return module.attn_drop.p if module.training else 0.0


def _returns_input(drop: nn.Module) -> bool:
    """Whether ``drop`` (an attention-dropout child) returns its input unchanged: a plain
    ``nn.Dropout`` with ``p == 0`` or in eval mode, or an ``nn.Identity``, without hooks."""
    drops_nothing = type(drop) is nn.Identity or (type(drop) is nn.Dropout and (drop.p == 0 or not drop.training))
    return drops_nothing and not (drop._forward_hooks or drop._forward_pre_hooks)


def _explicit_core(module, q, k, v, bias_fn=None):
    """``softmax(q*scale @ k^T (+ bias)) @ v`` through the module's core children, with the
    exact arithmetic order of timm's explicit paths."""
    q = q * module.scale
    attn = module.qk_matmul(q, k.transpose(-2, -1))
    if bias_fn is not None:
        attn = bias_fn(attn)
    if (isinstance(module.softmax, MesaSoftmax) and isinstance(module.av_matmul, MesaMatMul)
            and not isinstance(attn, torch.fx.Proxy)):  # (fx: module calls stay leaf nodes)
        # hand the softmax's 8-bit copy of the map to `attn @ v` explicitly (stored once;
        # unlike the eager-only sharing cache this also holds under torch.compile)
        # With a dropout that drops nothing, the map goes straight into `attn @ v`: the
        # softmax hands it over in the dtype autocast's matmul would cast it to (the same
        # cast, made inside the layer), so that backward needs no cast of the map either
        # way (CUDA autocast: a float32 softmax, a bf16 product; nn/softmax.py)
        passes = _returns_input(module.attn_drop)
        probs, copy = module.softmax(attn, with_copy=True, out_dtype=autocast_dtype_for(attn) if passes else None)
        attn = module.attn_drop(probs)
        # the copy is the map's only when no dropout was applied. Not just `attn is probs`:
        # Dynamo in torch 2.11 (fixed by 2.14) gives the output of a p=0 dropout a new
        # identity, and `attn @ v` then silently kept the full float map for its backward
        # (compiled gradients 1e-4..1e-3 off eager Mesa's, and the map stored twice)
        shared = attn is probs or passes
        return module.av_matmul(attn, v, shared_a=copy if shared else None)
    attn = module.softmax(attn)
    attn = module.attn_drop(attn)
    return module.av_matmul(attn, v)


class MesaViTAttention(_TimmAttention):
    """``timm.layers.Attention`` (ViT/DeiT) with the Mesa attention core.

    Supports everything the stock forward does: ``qk_norm``, ``scale_norm``, ``gated``,
    ``attn_mask`` (bool or additive) and ``is_causal``."""

    mesa_attn_path: str = "stock"

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        pre_norm: Optional[nn.Module] = None,
    ) -> torch.Tensor:
        """``pre_norm``: ``x`` is the block's input before its norm (``patch/block.py``), and
        ``qkv(pre_norm(x))`` keeps one 8-bit copy where it can (``can_fuse_norm``)."""
        path, qkv_layer = self.mesa_attn_path, self.qkv  # (qkv read once: nn.Module.__getattr__ is slow)
        if pre_norm is not None and (path == "stock" or self.gate is not None
                                     or not can_fuse_norm(pre_norm, qkv_layer, x)):
            x, pre_norm = pre_norm(x), None  # the stock order: the norm, then this module
        if path == "stock":
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = layernorm_linear(x, pre_norm, qkv_layer) if pre_norm is not None else qkv_layer(x)
        qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        if path == "fused":
            x = self.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=_dropout_p(self), is_causal=is_causal)
        else:
            def bias_fn(attn):
                return maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))

            x = _explicit_core(self, q, k, v, bias_fn if (attn_mask is not None or is_causal) else None)

        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class MesaWindowAttention(_SwinWindowAttention):
    """Swin ``WindowAttention`` with the Mesa attention core: per-head groups within
    windows (tensors are ``(num_windows*B, heads, N, N)``, groups over dim 1), the relative
    position bias added after ``q @ k^T`` and the shifted-window mask after that, exactly as
    timm does. The fused path gives the Mesa sdpa op the bias and the ``(nW, N, N)`` window
    mask separately, so backward keeps the small parts instead of the full
    ``(num_windows*B, heads, N, N)`` mask."""

    mesa_attn_path: str = "stock"

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        path = self.mesa_attn_path
        if path == "stock":
            return super().forward(x, mask=mask)
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        if path == "fused":
            x = self.sdpa(
                q, k, v,
                attn_mask=self._get_rel_pos_bias(),
                dropout_p=_dropout_p(self),
                window_mask=mask,
            )
        else:
            num_heads = self.num_heads

            def bias_fn(attn):
                attn = attn + self._get_rel_pos_bias()
                if mask is not None:
                    num_win = mask.shape[0]
                    attn = attn.view(-1, num_win, num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
                    attn = attn.view(-1, num_heads, N, N)
                return attn

            x = _explicit_core(self, q, k, v, bias_fn)

        x = x.transpose(1, 2).reshape(B_, N, -1)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class MesaPvtV2Attention(_PvtAttention):
    """PVT-v2 ``Attention`` with the Mesa attention core (timm has no PVT v1: the paper's
    PVT-Ti is approximated by ``pvt_v2_b1``, which has the same size). Queries come from all ``N``
    tokens, keys and values from the spatially reduced map (``sr`` conv + ``norm``, or the
    pooled ``linear`` variant), so ``q @ k^T`` is ``(B, heads, N, N/R^2)``. The ``sr``
    conv, its norm and the ``act`` of the linear variant are ordinary children: they are
    converted by the leaf conversion and belong to the MSA module set."""

    mesa_attn_path: str = "stock"

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        path = self.mesa_attn_path
        if path == "stock":
            return super().forward(x, feat_size)
        B, N, C = x.shape
        H, W = feat_size
        q = self.q(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)

        if self.pool is not None:
            x = x.permute(0, 2, 1).reshape(B, C, H, W)
            x = self.sr(self.pool(x)).reshape(B, C, -1).permute(0, 2, 1)
            x = self.norm(x)
            x = self.act(x)
            kv = self.kv(x).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            if self.sr is not None:
                x = x.permute(0, 2, 1).reshape(B, C, H, W)
                x = self.sr(x).reshape(B, C, -1).permute(0, 2, 1)
                x = self.norm(x)
            kv = self.kv(x).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)

        if path == "fused":
            x = self.sdpa(q, k, v, dropout_p=_dropout_p(self))
        else:
            x = _explicit_core(self, q, k, v)

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


# stock class -> Mesa subclass. Only exact types are swapped (a user subclass may have its
# own forward; it is reported as unreached instead).
ATTENTION_CLASSES = {
    _TimmAttention: MesaViTAttention,
    _SwinWindowAttention: MesaWindowAttention,
    _PvtAttention: MesaPvtV2Attention,
}
STOCK_ATTENTION_CLASSES = {v: k for k, v in ATTENTION_CLASSES.items()}
