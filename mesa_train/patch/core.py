"""``patch_model``: turn an unmodified timm model into a Mesa model, in place.

See :func:`patch_model` for the rules. The work is two passes over the model:

1. **Attention modules** of known timm classes (ViT/DeiT ``timm.layers.Attention``, Swin
   ``WindowAttention``, PVT-v2 ``Attention``) get a Mesa forward by switching the
   instance's class to a subclass from :mod:`mesa_train.patch.attention`, plus the core
   children (``qk_matmul``, ``softmax``, ``av_matmul`` or ``sdpa``) built with per-head
   groups.
2. **Leaf modules** (``_leaf_rules``: ``nn.Linear``, ``nn.GELU``, ``nn.LayerNorm`` incl. timm's
   ``LayerNorm``, ``LayerNorm2d`` and ``LayerNormAct2d``, ``nn.Conv2d``, ``nn.Conv1d``, ``nn.BatchNorm2d`` and
   timm's ``BatchNormAct2d``, ``nn.BatchNorm1d``, ``nn.GroupNorm`` and timm's ``GroupNormAct``,
   ``nn.ReLU`` / ``ReLU6`` / ``Hardtanh`` / ``Hardswish`` / ``Hardsigmoid``, ``nn.MaxPool2d``,
   ``nn.AvgPool2d``, timm's ``StdConv2d`` (and ``Same``, ``ScaledStdConv2d``), ``Conv2dSame``,
   ``MaxPool2dSame`` and ``AvgPool2dSame``,
   ``nn.Softmax``, timm's norms
   and activations, and a subclass of any of them that defines only its constructor) in the
   selected module sets are replaced by the Mesa layer built with ``from_module`` (weights
   are the same ``Parameter`` objects; ``eps``, dtype and device kept), with channel groups =
   the head count of the block (see :mod:`mesa_train.patch.rules`).

Any other module whose forward computes one of the requested ops functionally (``@``,
``.softmax()``, ``F.scaled_dot_product_attention``, ``F.gelu``, ...) is reported: one
``UserWarning`` per call, and in :func:`mesa_train.patch.describe`.
"""
from __future__ import annotations

import types
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from timm.layers import BatchNormAct2d, LayerNorm as TimmLayerNorm, LayerNorm2d as TimmLayerNorm2d
from timm.layers import GroupNorm as TimmGroupNorm, GroupNorm1 as TimmGroupNorm1, GroupNormAct as TimmGroupNormAct
from timm.layers import LayerNormAct2d as TimmLayerNormAct2d
from timm.layers import ScaledStdConv2d as TimmScaledStdConv2d, ScaledStdConv2dSame as TimmScaledStdConv2dSame
from timm.layers import StdConv2d as TimmStdConv2d, StdConv2dSame as TimmStdConv2dSame
from timm.layers import BlurPool2d as TimmBlurPool2d, Conv2dSame as TimmConv2dSame
from timm.layers.pool2d_same import AvgPool2dSame as TimmAvgPool2dSame, MaxPool2dSame as TimmMaxPool2dSame
from timm.layers import LayerScale as TimmLayerScale, RmsNorm as TimmRmsNorm, RmsNormFp32 as TimmRmsNormFp32
from timm.layers import RmsNorm2d as TimmRmsNorm2d, RmsNormAct2d as TimmRmsNormAct2d
from timm.layers import RmsNorm2dFp32 as TimmRmsNorm2dFp32, RmsNormAct2dFp32 as TimmRmsNormAct2dFp32
from timm.layers import SimpleNorm2d as TimmSimpleNorm2d, SimpleNorm2dFp32 as TimmSimpleNorm2dFp32
from timm.layers import SimpleNorm as TimmSimpleNorm, SimpleNormFp32 as TimmSimpleNormFp32
from timm.layers import LayerNormFp32 as TimmLayerNormFp32, LayerNorm2dFp32 as TimmLayerNorm2dFp32
from timm.layers.activations import HardMish as TimmHardMish, PReLU as TimmPReLU
from timm.layers.activations_me import HardMishMe as TimmHardMishMe
from timm.layers import LayerScale2d as TimmLayerScale2d
from timm.models.fastvit import LayerScale2d as FastVitLayerScale2d
from timm.models.swiftformer import LayerScale2d as SwiftFormerLayerScale2d
from timm.models.mlp_mixer import Affine as ResMlpAffine
from timm.layers import Linear as TimmLinear
from timm.models.mvitv2 import MultiScaleAttention as MvitAttention
from timm.models.vision_transformer_sam import Attention as SamAttention
from timm.layers.activations import GELU as TimmGELU, GELUTanh as TimmGELUTanh, QuickGELU as TimmQuickGELU
from timm.layers.grn import GlobalResponseNorm as TimmGRN
from timm.models.metaformer import Scale as TimmMetaFormerScale, StarReLU as TimmStarReLU
from torch import nn
from torchvision.models.convnext import LayerNorm2d as TorchvisionLayerNorm2d

import mesa_train.nn as mnn
from mesa_train.models import unwrap_module
from mesa_train.nn._common import stock_device
from mesa_train.nn.evo_norm import EVO_NORM_CLASSES
from mesa_train.nn.evo_norm import acts_inside as evo_norm_acts_inside
from mesa_train.nn.quantizer import QuantOptions, assign_rng_keys
from mesa_train.nn.sdpa import ScaledDotProductAttention

from .attention import ATTENTION_CLASSES, PlainMatMul, PlainSoftmax, STOCK_ATTENTION_CLASSES, STOCK_FUSED_ATTR
from .skip_marks import undo_skips_around
from .cancellation import CANCELLING_BN, cancellation_batchnorms
from .checkpoint import accept_stock_checkpoints, declare_key_upgrades
from .recompute import make_recomputed
from .replace import hand_over_children, replace_child
from .reuse import RANGE_ESTIMATORS, calls_repeat_one_input, watch_reuse
from .functional_calls import routable_sites
from .generic_attention import (AMAX_CHILD, CORE_REPEATS_ATTR, EINSUM_CHILD, EINSUM_CORE, PassThroughMatMul,
                                install as install_generic, install_calls, install_cosine, install_linear,
                                install_routed, install_scales)
from .identity_norm import mark_identity_norms
from .scale_branch import WAITING_ATTR, convs_of_kept_norms, halves_to_wait, link_scale_branches, waiting_halves
from .gamma_act import GAMMA_ACT_CHILD, MesaGammaAct, STOCK_GAMMA_ACT, gamma_act_layer
from .convnext import SCALE_CHILD as CONVNEXT_SCALE_CHILD, SCALED_BLOCK_CLASSES, STOCK_SCALED_BLOCK_CLASSES
from .mlp import (MLP_CLASSES, MLP_COPIES, NORM_MLP_CLASSES, NORM_ONLY_MLP_CLASSES, SHARED_MLP_CLASSES,
                  STOCK_MLP_CLASSES, STOCK_SHARED_MLP_CLASSES)
from .block import BLOCK_CLASSES, NORM_LINEAR_COPIES, STOCK_BLOCK_CLASSES
from .squeeze_excite import SE_CHILD, SE_CLASSES, STOCK_SE_CLASSES, gate_channels, stock_position_softmax, swaps
from .gemma4 import GEMMA4_CLASSES, STOCK_GEMMA4_CLASSES
from .gating import GATING_CLASSES, STOCK_GATING_CLASSES
from .sam import swap_sam_attention
from . import convit as convit_patch
from . import torchvision_attention as maxvit_patch
from . import mha as mha_patch
from .torch_transformer import activations_as_modules
from .torchvision_blocks import STOCK_TORCHVISION_CLASSES, TORCHVISION_CLASSES
from .rules import (FUNCTIONAL_OPS, MODULE_SETS, ModuleInfo, classify, count_functional_calls, function_attributes,
                    is_position_table_mlp, linear_call_weights, matmul_kinds, product_order, core_in_loop,
                    scan_functional_ops, scan_inline_scales)

__all__ = ["patch_model", "OPS", "MODULE_SETS", "ATTENTION_OPS", "mesa_layer_op", "PATCH_INFO_ATTR"]

OPS = ("linear", "matmul", "softmax", "gelu", "layernorm", "conv", "relu", "sdpa",
       "batchnorm", "silu", "rmsnorm", "glu", "layerscale", "normalize", "grn", "groupnorm", "hardswish", "se",
       "maxpool", "avgpool", "evonorm")
ATTENTION_OPS = ("matmul", "softmax", "sdpa")
# attentions whose forward calls module-level functions that contract the queries with position
# tables by torch.einsum (MViTv2's cal_rel_pos_type, SAM's get_decomposed_rel_pos_bias)
_EINSUM_ATTENTION = (MvitAttention, SamAttention)
PATCH_INFO_ATTR = "_mesa_patch_info"


def _leaf_rules():
    """[(stock type, op, Mesa class)]: exact-type matches only (a subclass may have its own
    forward, e.g. timm's ``LayerNormFp32``; it is reported instead)."""
    return {
        TimmGELU: ("gelu", _TimmGELU),
        TimmGELUTanh: ("gelu", _TimmGELUTanh),
        nn.BatchNorm2d: ("batchnorm", mnn.BatchNorm2d),
        nn.BatchNorm1d: ("batchnorm", mnn.BatchNorm1d),
        BatchNormAct2d: ("batchnorm", mnn.BatchNormAct2d),
        nn.SiLU: ("silu", mnn.SiLU),
        nn.Mish: ("silu", mnn.Mish),  # (timm's act_layer="mish")
        nn.ELU: ("relu", mnn.ELU),  # (the ELU family: 8-bit input and a 1-bit side mask)
        nn.CELU: ("relu", mnn.CELU),
        nn.SELU: ("relu", mnn.SELU),
        nn.PReLU: ("relu", mnn.PReLU),  # (1-bit mask and 8-bit input)
        TimmPReLU: ("relu", mnn.PReLU),  # (act_layer="prelu": the same F.prelu call, an inplace argument ignored)
        TimmQuickGELU: ("gelu", mnn.QuickGELU),
        TimmRmsNorm: ("rmsnorm", mnn.RmsNorm),
        TimmRmsNormFp32: ("rmsnorm", mnn.RmsNormFp32),
        TimmRmsNorm2d: ("rmsnorm", mnn.RmsNorm2d),  # (MobileNetV5's NCHW norms)
        TimmRmsNormAct2d: ("rmsnorm", mnn.RmsNormAct2d),
        TimmRmsNorm2dFp32: ("rmsnorm", mnn.RmsNorm2dFp32),
        TimmRmsNormAct2dFp32: ("rmsnorm", mnn.RmsNormAct2dFp32),
        TimmSimpleNorm2d: ("rmsnorm", mnn.SimpleNorm2d),  # (ConvNeXt's *_rms variants: x / std_c(x))
        TimmSimpleNorm2dFp32: ("rmsnorm", mnn.SimpleNorm2dFp32),
        TimmSimpleNorm: ("rmsnorm", mnn.SimpleNorm),  # (their heads; norm_layer="simplenorm" models)
        TimmSimpleNormFp32: ("rmsnorm", mnn.SimpleNormFp32),
        nn.RMSNorm: ("rmsnorm", mnn.RmsNorm),  # (the same F.rms_norm call as timm's)
        nn.Linear: ("linear", mnn.Linear),
        TimmLinear: ("linear", mnn.Linear),  # F.linear outside TorchScript: nn.Linear's forward
        nn.GELU: ("gelu", mnn.GELU),
        nn.LayerNorm: ("layernorm", mnn.LayerNorm),
        TimmLayerNorm: ("layernorm", mnn.LayerNorm),
        TimmLayerNorm2d: ("layernorm", mnn.LayerNorm2d),
        TimmLayerNormFp32: ("layernorm", mnn.LayerNormFp32),  # (norm_layer="layernormfp32")
        TimmLayerNorm2dFp32: ("layernorm", mnn.LayerNorm2dFp32),
        TorchvisionLayerNorm2d: ("layernorm", mnn.LayerNorm2d),  # (the same permute, F.layer_norm, permute)
        TimmLayerNormAct2d: ("layernorm", mnn.LayerNormAct2d),
        nn.Conv2d: ("conv", mnn.Conv2d),
        nn.Conv1d: ("conv", mnn.Conv1d),
        nn.ReLU: ("relu", mnn.ReLU),
        nn.ReLU6: ("relu", mnn.ReLU6),
        nn.LeakyReLU: ("relu", mnn.LeakyReLU),  # (TResNet; a 1-bit mask of x > 0)
        nn.Hardtanh: ("relu", mnn.Hardtanh),
        nn.Hardswish: ("hardswish", mnn.Hardswish),
        nn.Hardsigmoid: ("hardswish", mnn.Hardsigmoid),
        TimmHardMish: ("hardswish", mnn.HardMish),  # (act_layer="hard_mish", timm exportable or scriptable)
        TimmHardMishMe: ("hardswish", mnn.HardMish),  # (act_layer="hard_mish" by default)
        nn.MaxPool2d: ("maxpool", mnn.MaxPool2d),
        TimmMaxPool2dSame: ("maxpool", mnn.MaxPool2dSame),
        nn.AvgPool2d: ("avgpool", mnn.AvgPool2d),
        TimmAvgPool2dSame: ("avgpool", mnn.AvgPool2dSame),
        TimmConv2dSame: ("conv", mnn.Conv2dSame),
        TimmStarReLU: ("relu", mnn.StarReLU),
        nn.Softmax: ("softmax", mnn.Softmax),
        TimmLayerScale: ("layerscale", mnn.LayerScale),
        TimmLayerScale2d: ("layerscale", mnn.LayerScale2d),
        FastVitLayerScale2d: ("layerscale", _FastVitLayerScale2d),
        SwiftFormerLayerScale2d: ("layerscale", mnn.LayerScale2d),
        ResMlpAffine: ("layerscale", mnn.Affine),
        TimmMetaFormerScale: ("layerscale", mnn.Scale),
        TimmGRN: ("grn", mnn.GlobalResponseNorm),
        nn.GroupNorm: ("groupnorm", mnn.GroupNorm),
        TimmGroupNorm1: ("groupnorm", mnn.GroupNorm),
        TimmGroupNorm: ("groupnorm", mnn.GroupNorm),  # (norm_layer="groupnorm": ResNet *_gn; the same F.group_norm)
        TimmGroupNormAct: ("groupnorm", mnn.GroupNormAct),
        TimmStdConv2d: ("conv", mnn.StdConv2d),
        TimmStdConv2dSame: ("conv", mnn.StdConv2dSame),
        TimmScaledStdConv2d: ("conv", mnn.ScaledStdConv2d),
        TimmScaledStdConv2dSame: ("conv", mnn.ScaledStdConv2dSame),
        TimmBlurPool2d: ("conv", mnn.BlurPool2d),  # (a fixed depthwise filter: nothing of x kept)
        # EvoNorm B/S, FRN: 8-bit input, the stock forward re-run in backward (nn/evo_norm.py); their
        # own op, since the re-run costs step time (ops without it: stock and fast, GroupNorm compressed)
        **{stock: ("evonorm", mesa) for stock, mesa in EVO_NORM_CLASSES.items()},
    }


class _FastVitLayerScale2d(mnn.LayerScale2d, FastVitLayerScale2d):
    """Mesa's ``LayerScale2d`` that is still a FastViT ``LayerScale2d``: timm's
    ``RepMixer.reparameterize`` folds ``gamma`` into the inference conv only where
    ``isinstance(self.layer_scale, LayerScale2d)``; a plain Mesa layer took the other branch and
    the reparameterized model's outputs were off by 3e-2 without a word."""

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options) -> "_FastVitLayerScale2d":
        new = mnn.LayerScale2d.from_module.__func__(mnn.LayerScale2d, stock, device=device, **quant_options)
        new.__class__ = cls  # (FastViT's own __init__ never runs: the Mesa layer holds the same gamma)
        return new


class _TimmGELU:
    """timm's own ``GELU`` module (``F.gelu(x)``, used by SwinV2's MLP) -> Mesa ``GELU``."""

    approximate = "none"

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        return mnn.GELU(approximate=cls.approximate, device=device, **quant_options).train(stock.training)


class _TimmGELUTanh(_TimmGELU):
    approximate = "tanh"


def mesa_layer_op(module: nn.Module) -> Optional[str]:
    """The op name of a Mesa layer (``linear``, ..., ``sdpa``), else None."""
    for cls, op in ((mnn.Linear, "linear"), (mnn.GELU, "gelu"), (mnn.QuickGELU, "gelu"),
                    (mnn.LayerNorm, "layernorm"), (mnn.Conv2d, "conv"), (mnn.Conv1d, "conv"), (mnn.ReLU, "relu"),
                    (mnn.BlurPool2d, "conv"),
                    (mnn.StarReLU, "relu"), (mnn.LeakyReLU, "relu"), (mnn.ELU, "relu"), (mnn.CELU, "relu"),
                    (mnn.SELU, "relu"), (mnn.PReLU, "relu"), (mnn.Mish, "silu"),
                    (mnn.ReLU6, "relu"), (mnn.Hardtanh, "relu"), (mnn.Hardswish, "hardswish"),
                    (mnn.Hardsigmoid, "hardswish"), (mnn.HardMish, "hardswish"),
                    (mnn.Softmax, "softmax"), (mnn.GatedPositionalSoftmax, "softmax"), (mnn.MatMul, "matmul"),
                    (ScaledDotProductAttention, "sdpa"),
                    (mnn.BatchNorm2d, "batchnorm"), (mnn.BatchNorm1d, "batchnorm"), (mnn.SiLU, "silu"),
                    (mnn.RmsNorm, "rmsnorm"),
                    (mnn.GatedActivation, "glu"), (mnn.ChannelGate, "se"),  # (a ChannelScale: first)
                    (mnn.LayerScale, "layerscale"), (mnn.LayerScale2d, "layerscale"), (mnn.Affine, "layerscale"),
                    (mnn.ChannelScale, "layerscale"), (mnn.Scale, "layerscale"), (mnn.Normalize, "normalize"),
                    (mnn.GlobalResponseNorm, "grn"), (mnn.GroupNorm, "groupnorm"),
                    (mnn.MaxPool2d, "maxpool"), (mnn.Amax, "maxpool"),
                    (mnn.Einsum, "matmul"), (mnn.AvgPool2d, "avgpool"),
                    (mnn.Clamp, "linear"), (mnn.OneHotTable, "linear"), (mnn.LinearOf, "linear"),
                    (tuple(EVO_NORM_CLASSES.values()), "evonorm")):
        if isinstance(module, cls):
            return op
    return None


# ----------------------------------------------------------------------------- validation
def _as_names(value, what: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise ValueError(f"{what} must be a string or a sequence of strings, got {value!r}") from None
    for n in names:
        if not isinstance(n, str):
            raise ValueError(f"{what} must be strings, got {n!r}")
    return names


def _resolve(value, valid: Sequence[str], what: str) -> Tuple[str, ...]:
    names = _as_names(value, what)
    if not names:
        raise ValueError(f"{what} is empty; valid choices: {', '.join(valid)}, all")
    unknown = [n for n in names if n.lower() not in (*valid, "all")]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; valid choices: {', '.join(valid)}, all")
    lowered = {n.lower() for n in names}
    if "all" in lowered:
        return tuple(valid)
    return tuple(v for v in valid if v in lowered)


def _check_options(quant_options: dict) -> dict:
    # raises ValueError naming the valid options / values
    QuantOptions.from_kwargs(**{k: v for k, v in quant_options.items()})
    return dict(quant_options)


# ----------------------------------------------------------------------------- helpers
_OTHER = ModuleInfo("other", None, None)  # a module outside any block (patch embedding, head, ...)


def _module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters or buffers live (CPU if none): ``stock_device``."""
    return stock_device(module)


def _size_of_grouped_dim(module: nn.Module) -> Optional[int]:
    if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm1d)):
        return module.num_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    if isinstance(module, (TimmMetaFormerScale, mnn.Scale)):
        return module.scale.numel()
    if isinstance(module, tuple(EVO_NORM_CLASSES)):
        return module.weight.shape[0]
    if hasattr(module, "normalized_shape") and not isinstance(module, nn.LayerNorm):  # RmsNorm
        return int(module.normalized_shape[-1])
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.Conv2d):
        return module.in_channels
    if isinstance(module, nn.LayerNorm):
        return int(module.normalized_shape[-1])
    return None


# always one quantization group per channel (unless num_groups is given): norms with per-channel
# statistics or affine maps, and MetaFormer's per-channel scale, whose gradient sums one channel
_PER_CHANNEL = (nn.BatchNorm2d, nn.BatchNorm1d, nn.GroupNorm, TimmMetaFormerScale, mnn.Scale, *EVO_NORM_CLASSES)


def _groups_for(module: Optional[nn.Module], heads: Optional[int], quant_options: dict) -> Optional[int]:
    """Explicit ``num_groups``, else the block's head count, capped at the channel count.
    Per channel instead: BatchNorm, GroupNorm, EvoNorm and FRN always (every channel of ``x_hat``
    has unit variance), MetaFormer's ``Scale`` (each channel's gradient is a sum over that channel:
    one group for all left PoolFormer's last-stage scales at cosine 0.006), and a conv
    outside any block with a head count (CNN stages and hybrids: one group for all channels
    let a depthwise conv's small channels fall below the grid; FastViT / EfficientViT-M
    gradients reached only cosine 0.9)."""
    size = _size_of_grouped_dim(module) if module is not None else None
    g = quant_options.get("num_groups")
    if g is None and size and (isinstance(module, _PER_CHANNEL)
                               or (heads is None and isinstance(module, nn.Conv2d))):
        return size
    if g is None:
        g = heads
    if g is None:
        return None
    return max(1, min(int(g), size)) if size else int(g)


def _options_for(module, heads, quant_options) -> dict:
    opts = dict(quant_options)
    g = _groups_for(module, heads, quant_options)
    if g is not None:
        opts["num_groups"] = g
    return opts


def _earlier_siblings(parents: Dict[int, List[Tuple[nn.Module, str]]], m: nn.Module):
    """For each parent that holds ``m``: its children registered before ``m``, in order."""
    for parent, key in parents.get(id(m), []):
        before = []
        for k, c in parent._modules.items():
            if k == key:
                break
            before.append(c)
        yield before


def _output_width(c: nn.Module, norms: bool = False) -> Optional[int]:
    """A Linear's or conv's output width (a norm's features too, with ``norms``), else None."""
    width = (getattr(c, "out_features", None) or getattr(c, "out_channels", None)
             or (getattr(c, "num_features", None) if norms else None))
    return width if isinstance(width, int) else None


def _preceding_width(parents: Dict[int, List[Tuple[nn.Module, str]]], m: nn.Module) -> Optional[int]:
    """The output width of the layer just before ``m`` among its parent's children (timm's
    ``Mlp``: ``fc1`` -> ``act``; MetaFormer's ``SepConv``: ``pwconv1`` -> ``act1``): one
    quantization group per channel for an activation that cannot know its width. A wrong
    guess only changes the grouping (any count works on any width)."""
    for before in _earlier_siblings(parents, m):
        width = _output_width(before[-1]) if before else None
        if width is not None:
            return width
    return None


def _input_width(parents: Dict[int, List[Tuple[nn.Module, str]]], m: nn.Module) -> Optional[int]:
    """The channel count of ``m``'s input where ``m`` does not record it (ECA): the width of the
    last earlier sibling that has one (a conv's or Linear's output, a norm's features; timm's
    ResNet blocks: ``bn2`` / ``bn3`` before ``se``). A wrong guess only changes the grouping."""
    for before in _earlier_siblings(parents, m):
        width = next((w for w in (_output_width(c, norms=True) for c in reversed(before)) if w is not None), None)
        if width is not None:
            return width
    return None


# ----------------------------------------------------------------------------- attention
def _matmul_operands(attn: nn.Module, name: str) -> Tuple[str, ...]:
    """Operands a Mesa attention matmul quantizes itself. ``q @ k^T``: both. ``attn @ v``:
    only ``v`` when the map reaches it straight from the softmax (no attention dropout):
    that map is then either the Mesa Softmax's shared int8 copy, or the full-precision
    output a stock softmax keeps for its own backward anyway, so an int8 copy of it would
    be a second copy (more bytes than stock, and a noisier gradient for nothing)."""
    drop = getattr(getattr(attn, "attn_drop", None), "p", 0.0)
    return ("b",) if name == "av_matmul" and not drop else ("a", "b")


ATTENTION_PATHS = ("auto", "explicit", "fused")
# ops whose saved activation is a conv feature map: the ones layout="patch4x4" accepts
LAYOUT_OPS = ("conv",)


def _wants_fused(attn: nn.Module, requested: set, attention: str) -> bool:
    """The fused (sdpa) path: asked for, or ``auto`` and the module runs fused already
    (timm's default ``fused_attn=True``; a module patched before keeps its path), so the
    forward stays bitwise the stock one. Needs ``sdpa`` among the requested ops."""
    if "sdpa" not in requested:
        return False
    if not ({"matmul", "softmax"} & requested) or attention == "fused":
        return True
    if attention == "explicit":
        return False
    path = getattr(attn, "mesa_attn_path", None)
    if path in ("explicit", "fused"):
        return path == "fused"
    return bool(getattr(attn, "fused_attn", False))


def _patch_attention(attn: nn.Module, core_ops: Tuple[str, ...], heads: Optional[int], quant_options: dict,
                     attention: str = "auto") -> bool:
    """Give a known timm attention module its Mesa forward and core children; whether this moved
    an attention built fused onto the explicit path (``patch_model`` warns).

    ``core_ops`` (subset of matmul/softmax/sdpa) are added to what was patched before; see
    :func:`_wants_fused` for the path."""
    stock_cls = STOCK_ATTENTION_CLASSES.get(type(attn), type(attn))
    requested = set(getattr(attn, "mesa_core_ops", ())) | set(core_ops)
    if not requested:
        return False
    path_before = getattr(attn, "mesa_attn_path", "stock")
    device = _module_device(attn)
    opts = _options_for(None, heads or getattr(attn, "num_heads", None), quant_options)
    fused = _wants_fused(attn, requested, attention)
    attn.__dict__.setdefault(STOCK_FUSED_ATTR, bool(getattr(attn, "fused_attn", False)))  # (attention_as_built)
    attn.__class__ = ATTENTION_CLASSES[stock_cls]

    if not fused and ("matmul" in requested or "softmax" in requested):
        for name in ("qk_matmul", "av_matmul"):
            cur = getattr(attn, name, None)
            operands = _matmul_operands(attn, name)
            full = isinstance(cur, mnn.MatMul) and cur.operands == operands
            if "matmul" in core_ops and not full:
                # int8 operands (estimates of a share-only av_matmul are kept: it has none)
                stock = cur if isinstance(cur, mnn.MatMul) else None
                setattr(attn, name, mnn.MatMul.from_module(stock, operands=operands, device=device, **opts))
            elif name == "av_matmul" and "softmax" in requested and type(cur) in (type(None), PlainMatMul):
                # softmax without matmul: attn @ v compresses nothing itself but keeps the
                # map through the Mesa Softmax's shared int8 copy (stored once), v as stock
                attn.av_matmul = mnn.MatMul(operands=(), device=device, **opts)
            elif cur is None:
                setattr(attn, name, PlainMatMul())
        cur = getattr(attn, "softmax", None)
        if "softmax" in core_ops and not isinstance(cur, mnn.Softmax):
            # Swin has its own nn.Softmax(dim=-1); ViT/PVT call Tensor.softmax(dim=-1)
            attn.softmax = (mnn.Softmax.from_module(cur, device=device, **opts) if isinstance(cur, nn.Softmax)
                            else mnn.Softmax(dim=-1, device=device, **opts))
        elif cur is None:
            attn.softmax = PlainSoftmax(-1)
        attn.mesa_attn_path = "explicit"
        attn.fused_attn = False
    elif fused:
        if getattr(attn, "sdpa", None) is None:
            attn.sdpa = ScaledDotProductAttention(device=device, **opts)
        attn.mesa_attn_path = "fused"
        attn.fused_attn = True
    # the core ops in effect (sdpa is idle on the explicit path)
    attn.mesa_core_ops = tuple(o for o in ATTENTION_OPS if o in requested
                               and ((o == "sdpa") == (attn.mesa_attn_path == "fused")))
    return attn.__dict__[STOCK_FUSED_ATTR] and path_before != "explicit" and attn.mesa_attn_path == "explicit"


def _attention_like(m: nn.Module) -> bool:
    """A module whose own forward may hold an attention core: not a known timm attention
    (patched by class), not torch's MultiheadAttention, not a Mesa layer; named like an
    attention, carrying a head count, or whose forward calls a softmax and a matmul / sdpa
    (SHViT's ``SHSA``, iFormer's ``SHMA``, EfficientViM's ``HSMSSD``, CSATv2's blocks)."""
    if type(m) in ATTENTION_CLASSES or type(m) in STOCK_ATTENTION_CLASSES or isinstance(m, nn.MultiheadAttention):
        return False
    if isinstance(m, mnn.MesaLayer):
        return False
    cls = type(m).__name__.lower()
    if "attn" in cls or "attention" in cls or "xca" in cls or isinstance(getattr(m, "num_heads", None), int):
        return True
    found = scan_functional_ops(type(m))
    # (a softmax child module counts with a head count: lucidrains' LSA, `self.heads` and
    # `self.attend = nn.Softmax(dim=-1)`; a classifier head with a softmax child is no attention)
    heads = any(isinstance(getattr(m, a, None), int) for a in ("heads", "n_heads", "n_head"))
    softmax = "softmax" in found or (heads and any(isinstance(c, nn.Softmax) for c in m.children()))
    return softmax and ("matmul" in found or "sdpa" in found)


# ----------------------------------------------------------------------------- main entry
def _share_mlp_copies(named, info, set_names, shared: bool, rules) -> None:
    """timm ``Mlp`` with a GELU (``F.gelu``: torch's or timm's, not QuickGELU) and a Linear fc2
    -> :class:`MesaMlp` (``mesa_shared``)."""
    gelus = {t for t, (op, cls) in rules.items() if cls in (mnn.GELU, _TimmGELU, _TimmGELUTanh)} | {mnn.GELU}
    for name, m in named:
        stock_cls = STOCK_SHARED_MLP_CLASSES.get(type(m), type(m))
        if stock_cls not in SHARED_MLP_CLASSES or info.get(name, _OTHER).module_set not in set_names:
            continue
        act, fc2 = getattr(m, "act", None), getattr(m, "fc2", None)
        if type(act) not in gelus or type(fc2) not in (nn.Linear, mnn.Linear):
            continue
        if shared or type(m) is not stock_cls:
            m.__class__ = SHARED_MLP_CLASSES[stock_cls]
            m.mesa_shared = shared


def _share_norm_copies(named, info, set_names, shared: bool) -> None:
    """timm ViT / Swin / PVT-v2 / BEiT / EVA / CaiT / XCiT / ConvNeXt blocks -> ``patch/block.py``'s
    (``mesa_norm_shared``); their timm ``Mlp`` with a Linear fc1 (PVT-v2: ``MlpWithDepthwiseConv``)
    becomes the Mesa one (which takes the norm; no GELU + fc2 sharing) when the ``ffn`` set is
    patched and the MLP step did not swap it."""
    for name, m in named:
        stock_cls = STOCK_BLOCK_CLASSES.get(type(m), type(m))
        if stock_cls not in BLOCK_CLASSES or not (shared or type(m) is not stock_cls):
            continue
        m.__class__ = BLOCK_CLASSES[stock_cls]
        m.mesa_norm_shared = shared
        mlp_set = info.get(f"{name}.mlp" if name else "mlp", _OTHER).module_set
        mlp_m = getattr(m, "mlp", None)
        swaps = {**SHARED_MLP_CLASSES, **NORM_ONLY_MLP_CLASSES}
        if shared and type(mlp_m) in swaps and isinstance(getattr(mlp_m, "fc1", None), nn.Linear) \
                and mlp_set in set_names:
            m.mlp.__class__ = swaps[type(m.mlp)]
            m.mlp.mesa_shared = False  # the MLP step found no GELU + fc2 pair to share, or mlp="separate"
    # an MLP's own norm before fc2 (scale_mlp: EVA-02's SwiGLU): the same choice (patch/mlp.py)
    for name, m in named:
        if type(m) in NORM_MLP_CLASSES and info.get(name, _OTHER).module_set in set_names:
            m.mesa_norm_shared = shared


def _check_dtype(root: nn.Module) -> None:
    """Mesa's kernels take float32, float16 and bfloat16 activations: a float64 model is
    refused here, where the fix is one call, not at its first forward (``observe`` then
    refused the Double input from inside a layer)."""
    name = next((n for n, p in root.named_parameters() if p.dtype == torch.float64), None)
    if name is not None:
        raise ValueError(f"patch_model: the model has float64 parameters (e.g. {name!r}); Mesa compresses float32, "
                         "float16 and bfloat16 activations: patch model.float() (or .half() / .bfloat16())")


def _check_recomputed_weights(root: nn.Module, op_names, set_names) -> None:
    """A layer this call would convert whose weight (or bias) is a plain tensor that a forward
    pre-hook recomputes each call (``torch.nn.utils.prune``: from ``weight_orig``; the hook-based
    ``spectral_norm`` and ``weight_norm``) is refused before anything changes: its conversion
    failed half-way, inside torch, leaving the model half patched. Applying them after patching
    works: the hook goes on with the Mesa layer. Layers the call would leave alone (another op,
    another module set) are not asked about."""
    rules, info = _leaf_rules(), classify(root)
    for name, m in root.named_modules():
        rule = rules.get(type(m)) or _inherited_rule(rules, type(m))
        if rule is None or rule[0] not in op_names or info.get(name, _OTHER).module_set not in set_names:
            continue
        computed = [p for p in ("weight", "bias")
                    if p not in m._parameters and isinstance(m.__dict__.get(p), torch.Tensor)]
        if computed:
            raise ValueError(f"patch_model: {name or 'the model'} ({type(m).__name__}) holds {computed[0]} as a tensor "
                             f"a forward pre-hook recomputes (torch.nn.utils.prune, spectral_norm or weight_norm), not "
                             f"as a parameter; patch the model before applying it, or make it permanent first (e.g. "
                             f"torch.nn.utils.prune.remove(module, {computed[0]!r}))")


def _ddp_wrapper(model: nn.Module) -> Optional[nn.Module]:
    """The DistributedDataParallel wrapper in ``model``'s wrapper chain (``unwrap_model``'s), if any."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.DataParallel):
            model = model.module
        else:
            return None


def _check_wrapper(model: nn.Module, root: nn.Module) -> Optional[set]:
    """DistributedDataParallel records a model's buffers when it is built and broadcasts only
    those: patched inside it, the quantizers' estimates were never synced across ranks, without a
    word. A DDP-wrapped model with no Mesa layer yet is refused; one patched before is accepted
    (patching it again with the same ops changes nothing), and the ids of its buffers are
    returned for :func:`_warn_new_buffers`."""
    if _ddp_wrapper(model) is None:
        return None
    if not any(isinstance(m, mnn.MesaLayer) for m in root.modules()):
        raise ValueError("patch_model: the model is already wrapped in DistributedDataParallel, which syncs only "
                         "the buffers it found when it was built (the quantizers' estimates would differ across "
                         "ranks); patch the model first, then wrap it: DDP(patch_model(model))")
    return {id(b) for b in root.buffers()}


def _warn_new_buffers(root: nn.Module, before: Optional[set]) -> None:
    if before is None:
        return
    added = [n for n, b in root.named_buffers() if id(b) not in before]
    if added:
        warnings.warn(f"mesa_train.patch_model: added {len(added)} buffers (e.g. {added[0]}) to a model "
                      "DistributedDataParallel wraps, which syncs only the buffers it found when built: wrap the "
                      "patched model anew (DDP(ddp.module, ...))", UserWarning, stacklevel=3)


def patch_model(model: nn.Module, ops: Iterable[str] = ("all",), modules: Iterable[str] = ("all",),
                *, attention: str = "auto", plan=None, cancelling_bn: str = "stock", mlp: str = "shared",
                norm_linear: str = "shared", **quant_options) -> nn.Module:
    """Patch ``model`` in place with Mesa compression and return it.

    Args:
        model: a timm model (ViT/DeiT, Swin, PVT-v2 get full support, incl. the attention
            core; any other model gets the generic leaf conversion) or a ``torch.compile``
            wrapper of one, or a DDP wrapper of one patched before wrapping (DDP syncs only
            the buffers it found when built). It may already be on a device or in half
            precision, and may already be patched (patching again adds the newly requested
            ops; explicitly passed options are applied to the layers patched before). Hooks
            on the layers it replaces go on with their Mesa layers; a layer to convert whose
            weight a pre-hook recomputes (``torch.nn.utils.prune``, ``spectral_norm``,
            ``weight_norm``) is refused (apply them after patching).
        ops: any of ``OPS`` (``linear, matmul, softmax, gelu, layernorm, conv, relu, sdpa,
            batchnorm, ..., hardswish, se, maxpool, avgpool, evonorm``) or ``all``. ``matmul``/``softmax``
            compress the explicit attention path (paper setting); ``sdpa`` the fused
            ``F.scaled_dot_product_attention`` (int8 q, k, v kept for backward). Which path a
            timm attention module runs: see ``attention``.
        attention: ``auto`` (default): a module that runs fused attention
            (``fused_attn=True``, timm's ViT default) stays fused when ``sdpa`` is among
            the ops, one that runs the explicit path (``fused_attn=False``, Swin's
            default) is compressed on the explicit path when ``matmul``/``softmax`` are,
            so the forward stays bitwise the stock one; ``explicit``: the explicit path
            whenever ``matmul``/``softmax`` are requested (the paper's attention, forward
            equal to stock ``fused_attn=False``); ``fused``: the fused path whenever
            ``sdpa`` is requested. With only ``sdpa`` the path is fused, with only
            ``matmul``/``softmax`` explicit, whatever ``attention`` says.
        modules: any of ``msa`` (attention branch incl. ``norm1``), ``ffn`` (MLP branch incl.
            ``norm2``), ``other`` (patch embedding, downsampling, stage/final norms, head)
            or ``all``.
        cancelling_bn: ``stock`` (default): a BatchNorm whose output reaches another
            normalisation through per-channel, positively homogeneous ops only (and the
            BatchNorm it reaches; also the BatchNorms after a scalar ``LearnableAffineBlock``)
            stays stock: its gradients are cancellations that its 8-bit ``x_hat`` swamps
            (``patch/cancellation.py``, found on a ``torch.fx`` trace; untraceable models: none).
            ``compress``: compress those too.
        mlp: ``shared`` (default): in timm's ``Mlp`` (``fc1, GELU, fc2``), ``fc2`` takes its
            weight gradient from the GELU's 8-bit copy of its input (recomputing ``gelu``
            in backward) instead of keeping a second copy of the widest activation
            (``nn/gelu_linear.py``; needs ``gelu`` and ``linear`` among the ops).
            ``separate``: each layer keeps its own copy (the paper's layers).
        norm_linear: ``shared`` (default): in timm's ViT ``Block``, ``attn.qkv`` and
            ``mlp.fc1`` (the blocks of Swin, PVT-v2, BEiT, EVA, CaiT, XCiT and ConvNeXt:
            ``mlp.fc1`` where it is a Linear of a plain ``Mlp``) take their weight gradient
            from the 8-bit ``x_hat`` of the LayerNorm before them (``norm1``, ``norm2``;
            rebuilding ``x_hat * gamma + beta`` in backward) instead of keeping a second copy of the same tokens
            (``nn/layernorm_linear.py``, ``patch/block.py``; needs ``layernorm`` and
            ``linear`` among the ops). ``separate``: each layer keeps its own copy.
        plan: a :class:`mesa_train.plan.Plan`, its dict or a plan file path (``python -m
            mesa_train.plan``): patch each layer with the ops the plan gives it instead.
        **quant_options: ``num_groups``, ``decay``, ``estimator``, ``symmetric``,
            ``rounding``, ``enabled``, ``row_scale``, ``bits`` (8, 4, 2), ``scale``
            (``linear``, ``pow2``), ``layout`` (``channel``; ``patch4x4`` with
            ``ops=["conv"]`` only) (see :class:`mesa_train.nn.QuantOptions`). Per-op settings:
            call again with other ops and options (explicit options apply to those ops' layers;
            a scale branch, a 1x1 depthwise conv into a BatchNorm, is converted as a pair: a call
            asking for one of ``conv`` and ``batchnorm`` leaves it stock, its half waiting with
            this call's options, and the call asking for the other converts both:
            ``patch/scale_branch.py``). Without
            ``num_groups``, each layer uses the head count of its block: per head for
            attention tensors, that many channel blocks otherwise (capped at the channel
            count, e.g. 3 for an RGB patch embedding).

    Raises:
        ValueError: unknown op, module set or option name (the message lists the valid
            choices), or an invalid option value.
    """
    # validation first: nothing is changed when an argument is wrong
    root = unwrap_module(model, "patch_model")
    buffers_before = _check_wrapper(model, root)
    if plan is not None:  # per-layer ops from a plan (mesa_train.plan)
        given = {k: v for k, v in (("ops", ops), ("modules", modules), ("cancelling_bn", cancelling_bn),
                                   ("mlp", mlp), ("norm_linear", norm_linear)) if v != _PLAN_FREE_DEFAULTS[k]}
        if given:
            raise ValueError(f"patch_model: plan= gives each layer its ops, so {', '.join(given)} cannot be given "
                             f"with it (got {', '.join(f'{k}={v!r}' for k, v in given.items())}); quantization "
                             "options and attention can")
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"unknown attention {attention!r}; valid choices: {', '.join(ATTENTION_PATHS)}")
        # imported here: mesa_train.plan builds on this module (OPS, patch_model per unit), so
        # a module-level import would be a cycle
        from mesa_train.plan.apply import apply_plan

        return apply_plan(model, plan, attention=attention, **quant_options)
    op_names, set_names, quant_options = check_patch_arguments(ops, modules, quant_options, attention=attention,
                                                               cancelling_bn=cancelling_bn, mlp=mlp,
                                                               norm_linear=norm_linear)
    explicit = dict(quant_options)  # (what this call asked for, applied to layers patched before too)

    _check_dtype(root)
    _check_recomputed_weights(root, op_names, set_names)
    # skip_duplicated's switches measured the model as patched before this call: undone, in the
    # whole model that holds root (skip_marks.py)
    undo_skips_around(root)
    # 0. torch transformer layers built with activation="gelu" hold F.gelu itself: the stock
    # module in its place, for the leaf conversion (patch/torch_transformer.py)
    activations_as_modules(root, op_names)
    keep_stock, kept_names = _stock_batchnorms(root, op_names, cancelling_bn)
    waiting = halves_to_wait(root, op_names)  # (a scale branch is converted as a pair: patch/scale_branch.py)
    t = _Target(root, op_names, set_names, quant_options)

    # 1. attention modules: known timm classes, then any other attention-like module's calls
    patched_attn = _patch_attention_modules(t, attention)
    generic = _patch_other_attention(t, patched_attn)
    # 1b. gated MLPs (SwiGLU, GluMlp); their act is not converted on its own in step 2
    gated_acts = _patch_gated_mlps(t)
    # 1c. plain MLPs (fc1, GELU, fc2): fc2 shares the GELU's copy (mlp="shared"; the choice
    # is made again at every call: patch/mlp.py, MesaMlp)
    if "gelu" in op_names and "linear" in op_names:
        _share_mlp_copies(t.named, t.info, set_names, mlp == "shared", t.rules)
    # 1c'. ViT blocks: qkv and fc1 share the copy of the norm before them, other families' blocks
    # fc1 (norm_linear="shared"; the choice is made again at every call: patch/block.py)
    if "layernorm" in op_names and "linear" in op_names:
        _share_norm_copies(t.named, t.info, set_names, norm_linear == "shared")
    # 1d. inline layer scales (BEiT/CaiT/EVA/XCiT's self.gamma_1 * y, ConvNeXt's gamma)
    if "layerscale" in op_names:
        _patch_inline_scales(t)
    # 1e. squeeze-excite: the x * gate product through a ChannelGate child
    if "se" in op_names:
        _patch_squeeze_excite(t)
    # 1f. class swaps with Mesa children (Gemma 4's clamped Linears and position table; the gating
    # products of gMLP, MambaOut, FocalNet); an act run inside a gating child is not converted in step 2
    gated_acts |= _swap_classes(t)
    # 1f'. NFNet's GammaAct: its activation function through a Mesa layer child
    _patch_gamma_acts(t)
    # 1g. torch's nn.MultiheadAttention: its projections and sdpa through Mesa children
    if {"linear", "sdpa", "matmul", "softmax"} & set(op_names):
        _patch_multihead_attention(t)

    # 2. leaf modules, then the scale branches that feed a BatchNorm (RepVGG / MobileOne); ConViT's
    # pos_proj runs inside its GPSA's gated softmax (patch/convit.py) and stays stock
    gated_acts |= convit_patch.stock_position_linears(root)
    gated_acts |= evo_norm_acts_inside(root)  # (EvoNorm S1/S2 apply theirs to x inside the norm)
    _convert_leaves(t, explicit, gated_acts, keep_stock, waiting)
    if "conv" in op_names or "batchnorm" in op_names:
        # on the whole model whenever either is asked: the halves an earlier call left waiting
        # are converted beside the partners this call converted, and a model patched in two calls
        # (ops=["batchnorm"], then ops=["conv"]) gets its identity-BatchNorm marks from the second
        link_scale_branches(root, t.parents, keep_stock)
        # RepVGG / MobileOne: the identity branch's BatchNorm leaves its copy of the block input
        # for the block's convs (patch/identity_norm.py)
        mark_identity_norms(root)

    # 3. functional ops no rule reaches: recorded, warned about, left stock
    scanned: Dict[str, Tuple[str, ...]] = {}
    unreached = _functional_ops_left(t, generic, scanned)
    _record_patch(root, op_names, set_names, explicit, unreached, kept_names, scanned)
    # rounding seeds keyed by each quantizer's name: the same model patched in any process,
    # in any order, draws the same rounding noise (and none from torch's global generator)
    assign_rng_keys(root)
    # root.load_state_dict(stock checkpoint) completes it with fresh estimates (patch/checkpoint.py)
    accept_stock_checkpoints(root)
    # a layer the first training forward calls twice gets per-sample ranges (patch/reuse.py)
    watch_reuse(root)
    if unreached:
        lines = ", ".join(f"{n} ({type(root.get_submodule(n) if n != '<root>' else root).__name__}: "
                          f"{'/'.join(o)})" for n, o in unreached.items())
        warnings.warn(
            f"mesa_train.patch_model: functional ops not reached (they stay uncompressed): {lines}",
            UserWarning, stacklevel=2)
    rule = t.rules.get(type(root)) or _inherited_rule(t.rules, type(root))
    if rule is not None and rule[0] in op_names and not isinstance(root, mnn.MesaLayer):  # (replaced in its parent)
        warnings.warn(
            f"mesa_train.patch_model: the model is a single {type(root).__name__}, which patch_model would "
            f"replace inside its parent and cannot replace in place: nothing is compressed. Use "
            f"mesa_train.nn.{rule[1].__name__}.from_module(layer), or patch a model holding it",
            UserWarning, stacklevel=2)
    elif not generic and not any(_compresses(m) for m in root.modules()):  # (a user's own model, a wrong set)
        kept = waiting_halves(root, getattr(root, PATCH_INFO_ATTR, {}).get("stock_batchnorm", ()))
        why = (f"; {len(kept)} scale-branch layers ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}) wait "
               "for a call asking for their pair's other op (a 1x1 depthwise conv into a BatchNorm is converted "
               "with both conv and batchnorm)" if kept else "")
        warnings.warn(
            f"mesa_train.patch_model: no layer of {type(root).__name__} matched ops={list(op_names)} "
            f"modules={list(set_names)}: nothing is compressed{why} (describe(model) lists what was patched)",
            UserWarning, stacklevel=2)
    if t.unfused and attention != "explicit":  # (attention="explicit" asks for it: the paper's setting)
        n = len(t.unfused)
        warnings.warn(
            f"mesa_train.patch_model: {n} attention{'s' if n > 1 else ''} built fused ({t.unfused[0]}"
            f"{', ...' if n > 1 else ''}) now run{'' if n > 1 else 's'} the explicit path (ops "
            f"{', '.join(o for o in ('matmul', 'softmax') if o in op_names)} without sdpa), "
            "which keeps an N x N attention map the fused path does not: ops=['softmax'] alone keeps 1.046x of the "
            "fused stock's bytes on deit_tiny at 224 px. Add 'sdpa' to compress the fused path, build the model "
            "with fused_attn=False (the paper's baseline) to compare on the explicit path, or let "
            "skip_duplicated(model, example_input) put them back where that keeps less (training does: "
            "mesa.duplicates=skip)",
            UserWarning, stacklevel=2)
    _warn_new_buffers(root, buffers_before)
    return model


# patch_model's defaults of the arguments a plan decides itself
_PLAN_FREE_DEFAULTS = {"ops": ("all",), "modules": ("all",), "cancelling_bn": "stock", "mlp": "shared",
                       "norm_linear": "shared"}


def _compresses(module: nn.Module) -> bool:
    """A Mesa layer, or an attention module patched onto a compressed path."""
    return mesa_layer_op(module) is not None or getattr(module, "mesa_attn_path", "stock") != "stock"


def check_patch_arguments(ops, modules, quant_options: dict, *, attention: str = "auto",
                          cancelling_bn: str = "stock", mlp: str = "shared", norm_linear: str = "shared"):
    """``patch_model``'s arguments validated (``ValueError`` naming the valid choices):
    ``(op names, module set names, quant options)``. A plan checks every layer's with it
    before it patches any (``mesa_train.plan.apply``)."""
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"unknown attention {attention!r}; valid choices: {', '.join(ATTENTION_PATHS)}")
    op_names = _resolve(ops, OPS, "ops")
    set_names = _resolve(modules, MODULE_SETS, "modules")
    quant_options = _check_options(quant_options)
    _check_layout(quant_options, op_names)
    for value, valid, what in ((cancelling_bn, CANCELLING_BN, "cancelling_bn"), (mlp, MLP_COPIES, "mlp"),
                               (norm_linear, NORM_LINEAR_COPIES, "norm_linear")):
        if value not in valid:
            raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join(valid)}")
    return op_names, set_names, quant_options


# ----------------------------------------------------------------------------- patch_model's passes
class _Target:
    """What one ``patch_model`` call works on: the unwrapped model, its modules as they stood
    before the passes (names, block info, parents) and the request (ops, module sets, options)."""

    def __init__(self, root: nn.Module, op_names: Tuple[str, ...], set_names: Tuple[str, ...], quant_options: dict):
        self.root, self.op_names, self.set_names, self.quant_options = root, op_names, set_names, quant_options
        self.core_ops = tuple(o for o in ATTENTION_OPS if o in op_names)  # the attention cores' ops asked for
        self.info = classify(root)
        self.rules = _leaf_rules()
        # parents of every module (a module may be registered under several names)
        self.parents: Dict[int, List[Tuple[nn.Module, str]]] = {}
        for _, parent in root.named_modules(remove_duplicate=False):
            for key, child in parent._modules.items():
                if child is not None:
                    self.parents.setdefault(id(child), []).append((parent, key))
        self.named = list(root.named_modules())
        self.skip_prefixes: List[str] = []  # children of modules whose forward does not call them
        self.unfused: List[str] = []  # attentions built fused that this call put on the explicit path

    def module_info(self, name: str) -> ModuleInfo:
        return self.info.get(name, _OTHER)

    def skipped(self, name: str) -> bool:
        # (the root's prefix is "": it skips every module but the root itself)
        return any(name.startswith(p) for p in self.skip_prefixes if p or name)

    def options(self, module: Optional[nn.Module], heads: Optional[int]) -> dict:
        return _options_for(module, heads, self.quant_options)


def _check_layout(quant_options: dict, op_names: Tuple[str, ...]) -> None:
    if quant_options.get("layout", "channel") == "channel":
        return
    others = [o for o in op_names if o not in LAYOUT_OPS]
    if others:
        raise ValueError(
            f"layout={quant_options['layout']!r} applies to conv activations (B, C, H, W) only: valid ops for "
            f"it: {list(LAYOUT_OPS)}, got also {others} (their valid layout: 'channel'). Patch them first, "
            f"then e.g. patch_model(model, ops=['conv'], layout='patch4x4', bits=2)")


def _stock_batchnorms(root: nn.Module, op_names, cancelling_bn: str) -> Tuple[Dict[int, str], Tuple[str, ...]]:
    """The BatchNorms left stock (patch/cancellation.py) as ``{id: name}``, and the names of
    those that would otherwise have been compressed."""
    if not (cancelling_bn == "stock" and ("batchnorm" in op_names or "groupnorm" in op_names) and any(
            isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d, nn.GroupNorm))
            and not isinstance(m, (mnn.BatchNorm2d, mnn.BatchNorm1d, mnn.GroupNorm))
            for m in root.modules())):
        return {}, ()
    mods = dict(root.named_modules())
    keep_stock = {id(mods[n]): n for n in cancellation_batchnorms(root) if n in mods}
    rules = _leaf_rules()  # reported: the kept norms a leaf rule would have converted
    kept_names = tuple(n for n in keep_stock.values()
                       if (rules.get(type(mods[n])) or _inherited_rule(rules, type(mods[n]))) is not None)
    keep_stock.update(convs_of_kept_norms(root, keep_stock))
    return keep_stock, kept_names


def _patch_attention_modules(t: _Target, attention: str) -> List[str]:
    """Step 1: known timm attention classes get a Mesa forward and core children; the names
    patched. Also marks what the model's own forward never calls (skip_prefixes)."""
    patched: List[str] = []
    for name, m in t.named:
        mi = t.module_info(name)
        stock_cls = STOCK_ATTENTION_CLASSES.get(type(m), type(m))
        if stock_cls in ATTENTION_CLASSES and mi.module_set in t.set_names and t.core_ops:
            if _patch_attention(m, t.core_ops, mi.heads, t.quant_options, attention):
                t.unfused.append(name)
            patched.append(name)
        elif (type(m) in convit_patch.GPSA_CLASSES and mi.module_set in t.set_names and not t.skipped(name)
              and ("softmax" in t.core_ops or (type(m) is convit_patch.MesaGPSA and "matmul" in t.core_ops))):
            # (swapped for softmax; a swapped one takes matmul later too, as timm's attentions do)
            heads = mi.heads or m.num_heads
            if convit_patch.install(m, "matmul" in t.op_names, _module_device(m), t.options(None, heads)):
                patched.append(name)
        elif (type(m) in maxvit_patch.MAXVIT_ATTENTION_CLASSES and mi.module_set in t.set_names
              and not t.skipped(name)):
            if maxvit_patch.install(m, t.core_ops, _module_device(m), t.quant_options):
                patched.append(name)
        if isinstance(m, nn.MultiheadAttention) or is_position_table_mlp(name, m):
            t.skip_prefixes.append(f"{name}." if name else "")
            if is_position_table_mlp(name, m) and "linear" in t.op_names and mi.module_set in t.set_names:
                make_recomputed(getattr(m, "mlp", None) if type(m).__name__ == "RelPosMlp" else m)
    return patched


def _patch_other_attention(t: _Target, patched_attn: List[str]) -> Dict[str, Tuple[str, ...]]:
    """Step 1a: any other attention's F.scaled_dot_product_attention / q @ k^T, softmax, @ v
    calls are intercepted while it runs (generic_attention.py); ``{name: ops intercepted}``."""
    generic: Dict[str, Tuple[str, ...]] = {}
    if not t.core_ops:
        return generic
    for name, m in t.named:
        if name in patched_attn or t.skipped(name) or not _attention_like(m):
            continue
        mi = t.module_info(name)
        if mi.module_set not in t.set_names:
            continue
        found = scan_functional_ops(type(m), functions=True)  # (torchvision's shifted_window_attention)
        # products by einsum only (lucidrains' vit-pytorch: CaiT, PiT, LeViT, CvT, NesT, CrossViT): the
        # first two batched einsums go to two Einsum children, q.k and attn.v (generic_attention.py)
        # (not a container of attentions, CCT's TransformerClassifier: its own einsum is no core)
        einsum_only = matmul_kinds(type(m), functions=True) == ("einsum",) and not isinstance(m, _EINSUM_ATTENTION)
        # (a mixed core: einsum for q.k and @ for attn.v, or the other way round; which is einsum)
        einsum_role = _mixed_einsum_role(m)
        einsum_core = ((einsum_only or einsum_role is not None)
                       and not any(_attention_like(c) for c in m.modules() if c is not m))
        if (einsum_only or einsum_role is not None) and not (einsum_core and "matmul" in t.core_ops):
            # a Mesa softmax beside an einsum that keeps the map whole only adds its codes: reported
            found = tuple(o for o in found if o not in ("matmul", "softmax"))
        wanted = tuple(o for o in t.core_ops if o in found)
        if stock_position_softmax(m):  # (GlobalContext's pooling weights: small, often saturated)
            wanted = tuple(o for o in wanted if o != "softmax")
            # (a checkpoint patched before session 82 has that softmax's estimates: dropped on load)
            declare_key_upgrades(m, {"mesa_softmax.quantizer.": None})
        if wanted:
            heads = mi.heads or getattr(m, "num_heads", None)
            heads = heads if isinstance(heads, int) else None
            # a core run once per head (EfficientViT-M's cascade): its children serve every head,
            # each call its own input, so they take per-sample ranges (patch/reuse.py)
            repeats = core_in_loop(type(m))
            if repeats:
                object.__setattr__(m, CORE_REPEATS_ATTR, True)
            core_opts = _core_options(heads, t.quant_options, repeats)
            install_generic(m, tuple(o for o in wanted if not (einsum_core and einsum_only and o == "matmul")), heads,
                            _module_device(m), lambda _heads: core_opts, einsum_role=einsum_role)
            wanted += install_cosine(m, t.op_names, found, heads, _module_device(m), core_opts)
            if "matmul" in wanted and isinstance(m, _EINSUM_ATTENTION):
                install_routed(m, EINSUM_CHILD, lambda: calls_repeat_one_input(  # (q with rel_h, then with rel_w)
                    mnn.Einsum(device=_module_device(m), **t.options(None, heads))))
            if "matmul" in wanted and einsum_core:
                for role, child in enumerate(EINSUM_CORE):  # (both operands activations: no position table)
                    if einsum_role is None or role == einsum_role:
                        install_routed(m, child, lambda: mnn.Einsum(tables=False, device=_module_device(m),
                                                                    **core_opts))
            swap_sam_attention(m)  # SAM's decomposed rel-pos bias: kept as its tables (patch/sam.py)
            if "baddbmm" in matmul_kinds(type(m), functions=True):  # (its q @ k^T runs stock: reported)
                wanted = tuple(o for o in wanted if o != "matmul")
            generic[name] = wanted
    return generic


def _core_options(heads, quant_options, repeats: bool) -> dict:
    """The core children's options: per-sample ranges where one child serves every head of a
    cascade (``repeats``) and the estimator is a moving range."""
    opts = _options_for(None, heads, quant_options)
    if repeats and opts.get("estimator", "running") in RANGE_ESTIMATORS:
        opts["estimator"] = "per_sample"
    return opts


def _mixed_einsum_role(m: nn.Module) -> Optional[int]:
    """Which of the two products of a mixed core is the einsum (0: q.k, 1: attn.v): the
    forward makes exactly two batched products in its own code, one ``torch.einsum`` and one
    ``@`` / ``matmul`` (``rules.product_order``); else None."""
    if isinstance(m, _EINSUM_ATTENTION):
        return None
    order = product_order(type(m))
    if order is None or len(order) != 2 or order.count("einsum") != 1 or not set(order) & {"@", "matmul", "bmm"}:
        return None
    return order.index("einsum")


def _patch_gated_mlps(t: _Target) -> set:
    """Step 1b: gated MLPs (SwiGLU, GluMlp) compute act(gate) * x through a GatedActivation
    child; the ids of the acts that run inside one (not converted on their own)."""
    gated_acts = set()
    for name, m in t.named:
        stock_cls = STOCK_MLP_CLASSES.get(type(m), type(m))
        if stock_cls not in MLP_CLASSES:
            continue
        mi = t.module_info(name)
        if "glu" in t.op_names and mi.module_set in t.set_names and getattr(m, "gated", None) is None:
            m.__class__ = MLP_CLASSES[stock_cls]
            m.gated = mnn.GatedActivation(m.act, gate_last=getattr(m, "gate_last", False),
                                            device=_module_device(m), **t.options(None, mi.heads))
        if getattr(m, "gated", None) is not None:
            gated_acts.add(id(m.act))
    return gated_acts


def _patch_squeeze_excite(t: _Target) -> None:
    """Step 1e: timm's squeeze-excite blocks (patch/squeeze_excite.py) compute their final
    ``x * gate`` through a ``mesa_gate`` child, one quantization group per channel."""
    for name, m in t.named:
        stock_cls = STOCK_SE_CLASSES.get(type(m), type(m))
        if stock_cls not in SE_CLASSES or t.skipped(name) or t.module_info(name).module_set not in t.set_names:
            continue
        if SE_CHILD not in m._modules and swaps(m):
            opts = dict(t.quant_options)
            width = gate_channels(m) or _input_width(t.parents, m)
            if width is not None:
                opts.setdefault("num_groups", width)
            m.__class__ = SE_CLASSES[stock_cls]
            m.add_module(SE_CHILD, mnn.ChannelGate(device=_module_device(m), **opts))


def _patch_multihead_attention(t: _Target) -> None:
    """Step 1g: each stock ``nn.MultiheadAttention`` the rules can replicate (patch/mha.py)
    gets the Mesa forward, with projection, sdpa and explicit-core children as the ops ask
    (the key's and value's projections where its parents may call it as cross-attention)."""
    for name, m in t.named:
        if not mha_patch.supported(m) or t.skipped(name) or t.module_info(name).module_set not in t.set_names:
            continue
        device, opts = _module_device(m), t.options(None, m.num_heads)
        linear = "linear" in t.op_names
        roles, weights = mha_patch.call_forms(m, t.parents.get(id(m), []))
        # need_weights=True (where its callers may ask for the weights): the explicit core
        core = "matmul" in t.op_names and "softmax" in t.op_names and weights
        mha_patch.install(
            m, (lambda: mnn.LinearOf(device=device, **opts)) if linear else None,
            (lambda: ScaledDotProductAttention(device=device, **opts)) if "sdpa" in t.op_names else None,
            (lambda out_proj: mnn.Linear.from_module(out_proj, **t.options(out_proj, m.num_heads))) if linear else None,
            (lambda: (mnn.MatMul(device=device, **opts), mnn.Softmax(dim=-1, device=device, **opts),
                      mnn.MatMul(device=device, **opts))) if core else None,
            roles)


_SWAP_CLASSES = {**GEMMA4_CLASSES, **GATING_CLASSES, **TORCHVISION_CLASSES}
_STOCK_SWAP_CLASSES = {**STOCK_GEMMA4_CLASSES, **STOCK_GATING_CLASSES, **STOCK_TORCHVISION_CLASSES}


def _swap_classes(t: _Target) -> set:
    """Step 1f: modules whose Mesa forward calls parameter-free Mesa children (patch/gemma4.py:
    one ``(name, layer class)``; patch/gating.py: a function building them), swapped where their
    op and module set are asked for. Returns the ids of the activations a ``GatedActivation``
    child runs (MambaOut's ``act``), which the leaf conversion must leave stock."""
    inside = set()
    for name, m in t.named:
        stock_cls = _STOCK_SWAP_CLASSES.get(type(m), type(m))
        if stock_cls not in _SWAP_CLASSES or t.skipped(name):
            continue
        op, mesa_cls, children = _SWAP_CLASSES[stock_cls]
        mi = t.module_info(name)
        if op in t.op_names and mi.module_set in t.set_names and type(m) is stock_cls:
            device, opts = _module_device(m), t.options(None, mi.heads)
            if callable(children):
                new = children(m, device, opts)
            else:
                new = {children[0]: children[1](device=device, **opts)}
            m.__class__ = mesa_cls
            for child, layer in new.items():
                m.add_module(child, layer)
        inside.update(id(c.act_fn) for c in m.children() if isinstance(c, mnn.GatedActivation))
    return inside


def _patch_gamma_acts(t: _Target) -> None:
    """Step 1f': NFNet's ``GammaAct`` (``act_fn(x).mul_(gamma)``, patch/gamma_act.py) runs its
    activation through a ``mesa_act`` child where its op and module set are asked for."""
    for name, m in t.named:
        if type(m) is not STOCK_GAMMA_ACT or t.skipped(name):
            continue
        layer = gamma_act_layer(m)
        mi = t.module_info(name)
        if layer is None or layer[0] not in t.op_names or mi.module_set not in t.set_names:
            continue
        m.__class__ = MesaGammaAct
        m.add_module(GAMMA_ACT_CHILD, layer[1](device=_module_device(m), **t.options(None, mi.heads)))


def _per_channel_shape(p: torch.Tensor, m: nn.Module) -> bool:
    """``(C,)`` (channels last) or, outside attentions, ``(C, 1, 1)`` (NCHW: torchvision's ConvNeXt
    ``layer_scale``; in XCiT's and EdgeNeXt's attention a ``(heads, 1, 1)`` temperature scales the
    logits, which stay stock)."""
    return p.dim() == 1 or (p.dim() == 3 and p.shape[1] == p.shape[2] == 1 and not _attention_like(m))


def _patch_inline_scales(t: _Target) -> None:
    """Step 1d: inline layer scale (``self.gamma_1 * y`` in a block's forward, BEiT/CaiT/EVA/XCiT)
    routed to a ChannelScale child while the block runs (generic_attention.install_scales);
    ConvNeXt's ``x.mul(self.gamma.reshape(1, -1, 1, 1))`` by a class swap (patch/convnext.py)."""
    for name, m in t.named:
        if t.skipped(name) or isinstance(m, mnn.MesaLayer):
            continue
        mi = t.module_info(name)
        if mi.module_set not in t.set_names:
            continue
        params = [p for p in scan_inline_scales(type(m))
                  if isinstance(m._parameters.get(p), nn.Parameter) and _per_channel_shape(m._parameters[p], m)]
        if params:
            install_scales(m, params, _module_device(m), t.options(None, mi.heads))
        stock_cls = STOCK_SCALED_BLOCK_CLASSES.get(type(m), type(m))
        if stock_cls in SCALED_BLOCK_CLASSES and m.gamma is not None and CONVNEXT_SCALE_CHILD not in m._modules:
            m.add_module(CONVNEXT_SCALE_CHILD, mnn.ChannelScale(device=_module_device(m),
                                                                  **t.options(None, mi.heads)))
            if type(m) is stock_cls:  # not swapped by step 1c': its norm keeps its own copy
                m.__class__ = SCALED_BLOCK_CLASSES[stock_cls]
                m.mesa_norm_shared = False


# what a subclass may define and still take its base's rule: construction only
_INIT_ONLY = {"__init__", "reset_parameters", "extra_repr"}


def _inherited_rule(rules: dict, cls: type):
    """The rule of ``cls``'s nearest base that has one, when the classes between them define
    no method but construction (timm's ``LayerNorm2dNoBias`` / ``LayerNormNoBias``: bias None,
    eps 1e-6; a user's subclass that only sets defaults): their forward is the base's, and
    ``from_module`` reads what they set (eps, bias, weight). A subclass with any other method
    (its own ``forward``, timm's ``LayerNormFp32``; a helper the forward calls) is not
    converted: it is reported as functional ops not reached."""
    mro = cls.__mro__
    for i, base in enumerate(mro[1:], start=1):
        if base in rules:
            for k in mro[:i]:
                for name, value in vars(k).items():
                    if name not in _INIT_ONLY and isinstance(value, (types.FunctionType, staticmethod, classmethod,
                                                                      property)):
                        return None
            return rules[base]
    return None


def _convert_leaves(t: _Target, explicit: dict, gated_acts: set, keep_stock: Dict[int, str],
                    waiting: Dict[int, str]) -> None:
    """Step 2: each leaf module a rule covers becomes its Mesa layer (``from_module``: the same
    Parameters); a Mesa layer patched before takes this call's explicit options instead. Lists
    the modules again: the attention pass may have added children. A scale-branch half in
    ``waiting`` stays stock and keeps what it would have become (``patch/scale_branch.py``)."""
    converted: Dict[int, nn.Module] = {}
    for name, m in list(t.root.named_modules()):
        if t.skipped(name):
            continue
        if isinstance(m, mnn.MesaLayer):
            op = mesa_layer_op(m)
            if isinstance(m, mnn.MatMul) and not m.operands:
                op = "softmax"  # the share-only attn @ v follows the softmax whose copy it keeps
            if explicit and op in t.op_names:
                owner = name.rsplit(".", 1)[0] if "." in name else ""
                mi = t.info.get(name) or t.info.get(owner) or _OTHER
                if mi.module_set in t.set_names:
                    m.set_quant_options(**explicit)
            continue
        rule = t.rules.get(type(m)) or _inherited_rule(t.rules, type(m))
        if rule is None or id(m) in gated_acts:
            continue
        op, mesa_cls = rule
        if op not in t.op_names or getattr(m, "_fast_norm", False):  # timm fast_norm LayerNorm: other kernel
            continue
        mi = t.info.get(name)
        if mi is None:  # a child the attention pass added (e.g. Swin softmax): owner's info
            mi = t.module_info(name.rsplit(".", 1)[0] if "." in name else "")
        if mi.module_set not in t.set_names or id(m) in converted or id(m) in keep_stock:
            continue
        kw = {}
        if not any(True for _ in m.parameters(recurse=False)):
            # parameter-free layers (GELU, ReLU, Softmax, LayerNorm without affine) cannot
            # know their device: give them the one of the module that holds them
            kw["device"] = _module_device(t.parents.get(id(m), [(t.root, "")])[0][0])
        opts = t.options(m, mi.heads)
        if mesa_cls is mnn.StarReLU and t.quant_options.get("num_groups") is None:
            opts["num_groups"] = _preceding_width(t.parents, m) or opts.get("num_groups", 1)
        earlier = m.__dict__.get(WAITING_ATTR)
        if earlier is not None:  # kept for its pair before: its options, this call's explicit ones over them (as
            opts = {**earlier[1], **explicit}  # a layer converted before takes them)
        if id(m) in waiting:  # (converted by the call that converts its partner; the device then, as here)
            m.__dict__[WAITING_ATTR] = (mesa_cls, opts)
            continue
        new = mesa_cls.from_module(m, **kw, **opts)
        converted[id(m)] = new
        replace_child(t.parents, m, new)
        hand_over_children(t.parents, m, new)


def _functional_ops_left(t: _Target, generic: Dict[str, Tuple[str, ...]],
                         scanned: Dict[str, Tuple[str, ...]]) -> Dict[str, Tuple[str, ...]]:
    """Step 3: requested ops that a selected module's forward computes functionally and no
    rule reached, ``{name: ops}``; ``F.linear(x, self.qkv.weight, bias)`` (BEiT, SwinV2) is
    routed through the converted child instead (and added to ``generic``). ``scanned`` gets
    the functional ops each selected module still computes (none for a handled one)."""
    handled = (tuple(ATTENTION_CLASSES) + tuple(STOCK_ATTENTION_CLASSES) + tuple(t.rules)
               + tuple(STOCK_MLP_CLASSES) + tuple(STOCK_SHARED_MLP_CLASSES) + tuple(STOCK_SCALED_BLOCK_CLASSES)
               + tuple(NORM_ONLY_MLP_CLASSES.values())
               + tuple(GEMMA4_CLASSES) + tuple(STOCK_GEMMA4_CLASSES)
               + tuple(STOCK_BLOCK_CLASSES)
               + (PlainMatMul, PlainSoftmax, PassThroughMatMul, mha_patch.MesaMultiheadAttention, MesaGammaAct))
    unreached: Dict[str, Tuple[str, ...]] = {}
    for name, m in t.root.named_modules():
        if t.skipped(name) or t.module_info(name).module_set not in t.set_names:
            continue
        if type(m) in handled or isinstance(m, mnn.MesaLayer):
            scanned[name or "<root>"] = ()
            continue
        if isinstance(m, nn.MultiheadAttention):  # F.multi_head_attention_forward: all inside
            found = ("linear", "matmul", "softmax", "sdpa")
        else:  # (and the torch functions held as attributes: self.act = F.gelu, then self.act(x))
            found = scan_functional_ops(type(m))
            found += tuple(o for o in function_attributes(m).values() if o not in found)
        if "linear" in found and "linear" in t.op_names and any(
                isinstance(c, mnn.Linear) for c in m._modules.values()):
            install_linear(m)
            # reached where every F.linear call passes a converted child's weight; a call with
            # another weight (a LoRA adapter's F.linear(x, self.lora_A)) runs stock: said
            weights = linear_call_weights(type(m))
            if weights is not None and all(isinstance(m._modules.get(c), mnn.Linear) for c in weights):
                generic[name] = generic.get(name, ()) + ("linear",)
        if getattr(m, "add_maxpool", True) is False:  # timm's squeeze-excite: its amax call switched off
            found = tuple(o for o in found if o != "maxpool")
        if stock_position_softmax(m):  # stock on purpose (squeeze_excite.stock_position_softmax)
            found = tuple(o for o in found if o != "softmax")
        reached = _route_calls(t, name, m, found)
        if reached:
            generic[name] = generic.get(name, ()) + reached
        key = name or "<root>"
        scanned[key] = tuple(o for o in found if o not in generic.get(name, ()))
        hit = tuple(o for o in scanned[key] if o in t.op_names)
        if hit:
            unreached[key] = hit
    return unreached


# op -> every call name the source scan maps to it (an op counts as reached when all are routed)
_CALL_NAMES = {op: tuple(n for n, o in FUNCTIONAL_OPS.items() if o == op) for op in set(FUNCTIONAL_OPS.values())}


def _route_calls(t: _Target, name: str, m: nn.Module, found: Tuple[str, ...]) -> Tuple[str, ...]:
    """Step 3's routes for ``m``'s functional calls through Mesa children; returns the ops all of
    whose calls are routed: inline ``x.amax(...)`` (max pooling as a reduction: Hiera, CBAM-style
    spatial attention) through ``mesa_amax``; ``F.relu`` / ``F.leaky_relu`` / ``F.gelu`` / ``F.silu`` /
    ``F.max_pool2d`` / ``F.avg_pool2d`` through a child per call site (patch/functional_calls.py)."""
    wanted = [o for o in found if o in t.op_names]
    if not wanted:
        return ()
    opts = t.options(None, t.module_info(name).heads)
    reached = []
    amax = "maxpool" in wanted and count_functional_calls(type(m), "amax") > 0
    if amax:
        install_routed(m, AMAX_CHILD, lambda: mnn.Amax(device=_module_device(m), **opts))
    for op in wanted:
        # (None also for an op no kind of call computes: its calls are not all routable)
        sites = routable_sites(type(m), op, tuple(n for n in _CALL_NAMES[op] if n != "amax"))  # (amax: above)
        if sites is None:
            continue
        for kind, n in sites.items():
            if n:
                install_calls(m, kind, n, _module_device(m), opts)
        if any(sites.values()) or (op == "maxpool" and amax):  # (an amax its only max pooling)
            reached.append(op)
    return tuple(reached)


def _record_patch(root: nn.Module, op_names, set_names, explicit: dict, unreached: dict, kept_names,
                  scanned: dict) -> None:
    """What the calls so far patched, on the model (``PATCH_INFO_ATTR``; patch/describe.py,
    checkpoints): this call's request merged into the previous calls'. An op an earlier call
    left unreached is dropped where this call found the module no longer computes it (a class
    swapped since: MaxViT's attention asked for softmax, then matmul)."""
    prev = getattr(root, PATCH_INFO_ATTR, None) or {}
    earlier = {}
    for name, ops in prev.get("unreached", {}).items():
        left = tuple(o for o in ops if o in scanned[name]) if name in scanned else ops
        if left:
            earlier[name] = left
    record = {
        "ops": tuple(o for o in OPS if o in set(op_names) | set(prev.get("ops", ()))),
        "modules": tuple(s for s in MODULE_SETS if s in set(set_names) | set(prev.get("modules", ()))),
        "options": {**prev.get("options", {}), **explicit},
        "unreached": {**earlier, **unreached},
        "stock_batchnorm": tuple(sorted(set(prev.get("stock_batchnorm", ())) | set(kept_names))),
        "calls": prev.get("calls", 0) + 1,
        # each call's ops and explicit options (describe's header: a later call's bits=4 for its
        # ops only must not read as the options of every op)
        "requests": tuple(prev.get("requests", ())) + ((tuple(o for o in OPS if o in set(op_names)), dict(explicit)),),
    }
    object.__setattr__(root, PATCH_INFO_ATTR, record)
