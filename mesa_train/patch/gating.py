"""Mesa forwards for the elementwise gating products that three timm families compute inline,
installed by class swap like the squeeze-excite blocks (``squeeze_excite.py``). Each forward is
timm's line for line but for the marked products, which run through
:class:`mesa_train.nn.GatedActivation` children (op ``glu``: 8-bit operands) where stock keeps
both operands in full precision; ``tests/test_gating_swaps.py`` pins them to timm's source.

* gMLP's ``SpatialGatingUnit``: ``u * v.transpose(-1, -2)`` (``mesa_gate``, a plain product).
* MambaOut's ``GatedConvBlock``: ``self.act(g) * torch.cat((i, c), dim=-1)`` (``mesa_gate``,
  running the block's own ``act``, which is then not converted on its own: stock keeps ``g``,
  ``act(g)`` and the concatenation, this ``g`` and the concatenation in 8 bits).
* StarNet's ``Block`` (the "star operation"): ``self.act(x1) * x2`` (``mesa_gate``, a plain
  product of the activation's output and ``x2``; the ``ReLU6`` stays a child, converted on its
  own to its 1-bit mask: stock keeps ``x1``, ``act(x1)`` and ``x2``, this a mask and two 8-bit
  operands).
* CoaT's ``ConvRelPosEnc``: ``q_img * conv_v_img`` (``mesa_gate``, a plain product, per-head
  groups; ``q_img`` is a slice of ``q``, so stock kept all of ``q``).
* GhostNetV2's ``GhostModuleV2`` and GhostNetV3's ``GhostModuleV3`` (its ``shortcut`` mode): the
  ghost features times their upsampled DFC-attention gate,
  ``out[:, :out_chs] * F.interpolate(self.gate_fn(res), ...)`` (``mesa_gate``, a plain product,
  one group per channel; the slice keeps all of ``out`` alive in stock; session 78).
* FocalNet's ``FocalModulation``: ``q * self.h(ctx_all)`` (``mesa_gate``) and each level's
  ``ctx * gates[:, l:l + 1]`` plus the global ``ctx_global * gates[:, focal_level:]``
  (``mesa_focal_gates``, one child per product: each keeps its own running estimates, the
  levels' ranges differ). ``q`` and the gate slices are views of ``self.f``'s output, so a
  stock product keeps that whole ``2 * dim + focal_level + 1``-channel tensor alive; here
  nothing keeps it.

The convs, norms, linears and activations inside these modules are converted (or not) by the
ordinary leaf conversion; the children receive exactly the tensors stock multiplies, so the
forward is bitwise stock's.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from timm.layers import _assert
from timm.models.coat import ConvRelPosEnc as _ConvRelPosEnc
from timm.models.focalnet import FocalModulation as _FocalModulation
from timm.models.ghostnet import GhostModuleV2 as _GhostModuleV2, GhostModuleV3 as _GhostModuleV3
from timm.models.mambaout import GatedConvBlock as _GatedConvBlock
from timm.models.mlp_mixer import SpatialGatingUnit as _SpatialGatingUnit
from timm.models.starnet import Block as _StarBlock
from torch import nn

from mesa_train.nn.activations import GatedActivation

__all__ = ["GATING_CLASSES", "STOCK_GATING_CLASSES", "GATING_CHILD"]

GATING_CHILD = "mesa_gate"


class MesaSpatialGatingUnit(_SpatialGatingUnit):
    """gMLP's spatial gating unit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = x.chunk(2, dim=-1)
        v = self.norm(v)
        v = self.proj(v.transpose(-1, -2))
        return self.mesa_gate(u, v.transpose(-1, -2))  # stock: u * v.transpose(-1, -2)


class MesaGatedConvBlock(_GatedConvBlock):
    """MambaOut's gated CNN block."""

    def forward(self, x):
        shortcut = x  # [B, H, W, C]
        x = self.norm(x)
        x = self.fc1(x)
        g, i, c = torch.split(x, self.split_indices, dim=-1)
        c = c.permute(0, 3, 1, 2)  # [B, H, W, C] -> [B, C, H, W]
        c = self.conv(c)
        c = c.permute(0, 2, 3, 1)  # [B, C, H, W] -> [B, H, W, C]
        x = self.fc2(self.mesa_gate(g, torch.cat((i, c), dim=-1)))  # stock: self.act(g) * torch.cat(...)
        x = self.ls(x)
        x = self.drop_path(x)
        return x + shortcut


class MesaStarBlock(_StarBlock):
    """StarNet's block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        x = self.dwconv(x)
        x1, x2 = self.f1(x), self.f2(x)
        x = self.mesa_gate(self.act(x1), x2)  # stock: self.act(x1) * x2
        x = self.dwconv2(self.g(x))
        x = residual + self.drop_path(x)
        return x


class MesaConvRelPosEnc(_ConvRelPosEnc):
    """CoaT's convolutional relative position encoding."""

    def forward(self, q, v, size: Tuple[int, int]):
        B, num_heads, N, C = q.shape
        H, W = size
        _assert(N == 1 + H * W, '')

        # Convolutional relative position encoding.
        q_img = q[:, :, 1:, :]  # [B, h, H*W, Ch]
        v_img = v[:, :, 1:, :]  # [B, h, H*W, Ch]

        v_img = v_img.transpose(-1, -2).reshape(B, num_heads * C, H, W)
        v_img_list = torch.split(v_img, self.channel_splits, dim=1)  # Split according to channels
        conv_v_img_list = []
        for i, conv in enumerate(self.conv_list):
            conv_v_img_list.append(conv(v_img_list[i]))
        conv_v_img = torch.cat(conv_v_img_list, dim=1)
        conv_v_img = conv_v_img.reshape(B, num_heads, C, H * W).transpose(-1, -2)

        EV_hat = self.mesa_gate(q_img, conv_v_img)  # stock: q_img * conv_v_img
        EV_hat = F.pad(EV_hat, (0, 0, 1, 0, 0, 0))  # [B, h, N, Ch].
        return EV_hat


class MesaFocalModulation(_FocalModulation):
    """FocalNet's focal modulation."""

    def forward(self, x):
        # pre linear projection
        x = self.f(x)
        q, ctx, gates = torch.split(x, self.input_split, 1)

        # context aggregation
        ctx_all = 0
        for l, focal_layer in enumerate(self.focal_layers):
            ctx = focal_layer(ctx)
            ctx_all = ctx_all + self.mesa_focal_gates[l](ctx, gates[:, l:l + 1])  # stock: ctx * gates[...]
        ctx_global = self.act(ctx.mean((2, 3), keepdim=True))
        # stock: ctx_global * gates[:, self.focal_level:]
        ctx_all = ctx_all + self.mesa_focal_gates[self.focal_level](ctx_global, gates[:, self.focal_level:])

        # normalize context
        if self.normalize_modulator:
            ctx_all = ctx_all / (self.focal_level + 1)

        # focal modulation
        x_out = self.mesa_gate(q, self.h(ctx_all))  # stock: q * self.h(ctx_all)
        x_out = self.norm(x_out)

        # post linear projection
        x_out = self.proj(x_out)
        x_out = self.proj_drop(x_out)
        return x_out


def _product(device, options: dict, channels=None) -> GatedActivation:
    """``a * b`` keeping 8-bit ``a`` and ``b`` (``GatedActivation`` with no activation), one
    quantization group per channel unless ``num_groups`` was given: FocalNet's context levels
    and modulator have channels of very different ranges (one group for all left the gradients
    of the norms before them at cosine 0.9990 against stock, per channel 0.9997; zoo size, four
    seeds). gMLP too, as the squeeze-excite gates: its statistics cost 0.2% of the saved bytes at
    224 px."""
    if channels:
        options = {"num_groups": int(channels), **options}
    return GatedActivation(nn.Identity(), device=device, **options)


def _unit_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    shape = getattr(module.norm, "normalized_shape", None)  # (dim // 2,): the channels of u and v
    return {GATING_CHILD: _product(device, options, shape[-1] if shape else None)}


def _block_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    # the block's own act, run inside the child (stock's module object: the same forward). Its
    # operands are (B, H, W, C): 4-D, grouped along dim 1 (H), so no per-channel groups here
    return {GATING_CHILD: GatedActivation(module.act, device=device, **options)}


def _star_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    # NCHW operands, channels mlp_ratio * dim: one group per channel, as the other products
    return {GATING_CHILD: _product(device, options, module.f1.conv.out_channels)}


def _crpe_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    # (B, heads, N, Ch) operands: one group per head
    return {GATING_CHILD: _product(device, options, sum(module.head_splits))}


def _modulation_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    # a gate slice (B, 1, H, W) has one channel: its quantizer uses one group (capped)
    levels = nn.ModuleList(_product(device, options, module.dim) for _ in range(module.focal_level + 1))
    return {GATING_CHILD: _product(device, options, module.dim), "mesa_focal_gates": levels}


class MesaGhostModuleV2(_GhostModuleV2):
    """GhostNetV2's ghost module with its DFC attention: the kept half of the ghost features
    times the upsampled sigmoid gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = self.short_conv(F.avg_pool2d(x, kernel_size=2, stride=2))
        x1 = self.primary_conv(x)
        x2 = self.cheap_operation(x1)
        out = torch.cat([x1, x2], dim=1)
        return self.mesa_gate(out[:, :self.out_chs, :, :], F.interpolate(
            self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest'))


class MesaGhostModuleV3(_GhostModuleV3):
    """GhostNetV3's ghost module: in its ``shortcut`` mode the same gate as V2's."""

    def forward(self, x):
        if self.infer_mode:
            x1 = self.primary_conv(x)
            x2 = self.cheap_operation(x1)
        else:
            x1 = 0
            for primary_rpr_conv in self.primary_rpr_conv:
                x1 += primary_rpr_conv(x)
            x1 = self.primary_activation(x1)

            x2 = self.cheap_rpr_scale(x1) + self.cheap_rpr_skip(x1)
            for cheap_rpr_conv in self.cheap_rpr_conv:
                x2 += cheap_rpr_conv(x1)
            x2 = self.cheap_activation(x2)

        out = torch.cat([x1,x2], dim=1)
        if self.mode not in ['shortcut']:
            return out
        else:
            res = self.short_conv(F.avg_pool2d(x, kernel_size=2, stride=2))
            return self.mesa_gate(out[:,:self.out_chs,:,:], F.interpolate(
                self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest'))


def _ghost_children(module: nn.Module, device, options: dict) -> Dict[str, nn.Module]:
    # NCHW operands, the module's output channels: one group per channel
    return {GATING_CHILD: _product(device, options, module.out_chs)}


# stock class -> (op, Mesa class, children(module, device, options) -> {name: Mesa layer}):
# swapped, the children added (patch/core.py, _swap_classes)
GATING_CLASSES = {_SpatialGatingUnit: ("glu", MesaSpatialGatingUnit, _unit_children),
                  _GatedConvBlock: ("glu", MesaGatedConvBlock, _block_children),
                  _FocalModulation: ("glu", MesaFocalModulation, _modulation_children),
                  _StarBlock: ("glu", MesaStarBlock, _star_children),
                  _ConvRelPosEnc: ("glu", MesaConvRelPosEnc, _crpe_children),
                  _GhostModuleV2: ("glu", MesaGhostModuleV2, _ghost_children),
                  _GhostModuleV3: ("glu", MesaGhostModuleV3, _ghost_children)}
STOCK_GATING_CLASSES = {mesa: stock for stock, (_, mesa, _) in GATING_CLASSES.items()}
