"""Drop-in Mesa layers: exact forward, 8-bit activations saved for backward.

Also (issue 10): ``BatchNorm2d`` and ``BatchNorm1d`` (per-channel 8-bit normalised input), ``QuickGELU`` (CLIP),
``SiLU``, ``Hardswish``, ``RmsNorm`` (timm's) and ``GatedActivation`` (``act(gate) * x`` of SwiGLU / GLU
MLPs); ``Linear`` / ``LayerNorm`` / ``RmsNorm`` add one int8 power-of-two exponent per row
(``rowscale.py``) so rows far smaller than the rest keep their gradient.

Each layer subclasses its ``torch.nn`` twin (``MatMul`` has none), takes the twin's
constructor arguments plus keyword-only quantization options (:class:`QuantOptions`:
``num_groups``, ``decay``, ``estimator``, ``symmetric``, ``rounding``, ``enabled``) and has
``from_module(stock, **quant_options)`` keeping weights, ``eps``, dtype and device. In eval
mode, with ``enabled=False`` or when no gradient is needed, the stock forward runs.

Estimates live in ``ActivationQuantizer`` submodules: ``<layer>.quantizer`` (``Linear``,
``Conv2d``, ``LayerNorm``, ``GELU``, ``Softmax``) and ``<layer>.quantizer_a`` /
``<layer>.quantizer_b`` (``MatMul``, for the ``operands`` it compresses itself); ``ReLU``,
``ReLU6``, ``Hardtanh`` and ``Hardsigmoid`` have none (they save a 1-bit mask).
``LayerNorm`` keeps its *normalised* input ``(x - mean) * rstd`` in 8 bits plus per-row
rstd (more accurate than the input, same memory; see ``docs/DESIGN.md``). Parameter-free
layers take ``from_module(stock, *, device=None, ...)``.
"""
from .activations import GatedActivation, Hardswish, Mish, QuickGELU, SiLU
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNormAct2d
from .clamp_activations import Clamp, Hardsigmoid, Hardtanh, ReLU6
from .elu import CELU, ELU, SELU
from .hard_mish import HardMish
from .star_relu import StarReLU
from .groupnorm import GroupNorm, GroupNormAct
from .conv import Conv1d, Conv2d
from .einsum import Einsum
from .amax import Amax
from .avgpool import AvgPool2d, AvgPool2dSame
from .gelu import GELU
from .gated_softmax import GatedPositionalSoftmax
from .grn import GlobalResponseNorm
from .evo_norm import (EvoNorm2dB0, EvoNorm2dB1, EvoNorm2dB2, EvoNorm2dS0, EvoNorm2dS0a, EvoNorm2dS1,
                       EvoNorm2dS1a, EvoNorm2dS2, EvoNorm2dS2a, FilterResponseNormAct2d, FilterResponseNormTlu2d)
from .layernorm import LayerNorm, LayerNorm2d, LayerNorm2dFp32, LayerNormAct2d, LayerNormFp32
from .layerscale import Affine, ChannelGate, ChannelScale, LayerScale, LayerScale2d, Scale
from .linear import Linear, LinearOf
from .matmul import MatMul
from .maxpool import MaxPool2d
from .normalize import Normalize
from .one_hot_table import OneHotTable
from .quantizer import ActivationQuantizer, Packed, QuantOptions, decompress
from .relu import LeakyReLU, PReLU, ReLU
from .blur_pool import BlurPool2d
from .same_padding import Conv2dSame, MaxPool2dSame
from .rmsnorm import RmsNorm, RmsNormFp32
from .rmsnorm2d import (RmsNorm2d, RmsNorm2dFp32, RmsNormAct2d, RmsNormAct2dFp32, SimpleNorm, SimpleNorm2d,
                        SimpleNorm2dFp32, SimpleNormFp32)
from .softmax import Softmax
from .std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame
from ._common import MesaLayer
from .tracing import MesaTracingError, register_fx_leaf

register_fx_leaf(MesaLayer)  # timm's FX feature extraction keeps Mesa layers as nodes (tracing.py)

LAYERS = (Linear, GELU, LayerNorm, Softmax, MatMul, Conv2d, ReLU, BatchNorm2d, QuickGELU, SiLU, StarReLU, RmsNorm,
          GatedActivation, LayerScale, ChannelScale, Normalize, GlobalResponseNorm, BatchNorm1d, Hardswish,
          Hardsigmoid, Hardtanh, ReLU6, ChannelGate, MaxPool2d, Clamp, OneHotTable, Conv2dSame, MaxPool2dSame,
          AvgPool2d, AvgPool2dSame, LayerScale2d, Conv1d, Amax, Affine, Einsum, GatedPositionalSoftmax)

__all__ = [
    "ActivationQuantizer", "Packed", "MesaTracingError", "QuantOptions", "decompress", "MesaLayer", "LAYERS",
    "Linear", "LinearOf", "GELU", "LayerNorm", "LayerNorm2d", "LayerNormAct2d", "LayerNormFp32",
    "LayerNorm2dFp32", "Softmax", "MatMul", "Conv2d", "ReLU",
    "LeakyReLU", "PReLU", "ELU", "CELU", "SELU", "Mish", "HardMish",
    "BatchNorm2d", "BatchNorm1d", "BatchNormAct2d", "GroupNorm", "QuickGELU", "SiLU", "Hardswish", "Hardsigmoid",
    "Hardtanh", "ReLU6", "ChannelGate", "MaxPool2d", "GroupNormAct", "StdConv2d", "StdConv2dSame", "ScaledStdConv2d",
    "ScaledStdConv2dSame", "BlurPool2d", "Clamp",
    "OneHotTable", "Conv2dSame", "MaxPool2dSame", "AvgPool2d", "AvgPool2dSame",
    "LayerScale2d", "Conv1d", "Amax", "Affine", "Einsum", "GatedPositionalSoftmax",
    "StarReLU", "RmsNorm", "RmsNormFp32", "RmsNorm2d", "RmsNormAct2d",
    "RmsNorm2dFp32", "RmsNormAct2dFp32", "SimpleNorm", "SimpleNormFp32", "SimpleNorm2d", "SimpleNorm2dFp32",
    "GatedActivation", "LayerScale", "ChannelScale", "Scale", "Normalize", "GlobalResponseNorm",
    "EvoNorm2dB0", "EvoNorm2dB1", "EvoNorm2dB2", "EvoNorm2dS0", "EvoNorm2dS0a", "EvoNorm2dS1", "EvoNorm2dS1a",
    "EvoNorm2dS2", "EvoNorm2dS2a", "FilterResponseNormTlu2d", "FilterResponseNormAct2d",
]
from .sdpa import QueryBias, ScaledDotProductAttention  # noqa: E402,F401  (issue 3: Mesa fused attention, nn/sdpa.py)
