"""The 1-bit masks of the C++ mask layers (csrc/bitmask.cpp): on the CPU, for a tensor in the
mask's memory order, one loop packs the comparison into bits (``pack_compare``) and one loop
selects the gradient from them (``masked_grad``); ATen ops elsewhere. Both must give the bytes
and gradients of the Python Function path (``relu.pack_bits``, ``where(mask, g, 0)``) bit for
bit: every floating dtype; contiguous, channels-last and strided inputs; a gradient in the
mask's layout (the loop) or another (ATen); sizes over one parallel task with a partial last
byte; NaN, infinities, signed zeros and the comparison's edges in x, NaN payloads and -0.0 in g
(which the select must pass through untouched, and replace by +0 where the mask is clear).
Hardswish's gradient is arithmetic on g and the dequantized x (csrc/hardswish_grad.cpp): the
same bits wherever it is a number and NaN where the Python ops give NaN, whose payload ATen's
vectorized clamp writes as the CPU's vector instructions have it (all ones for bfloat16 on
AVX2), which no portable loop reproduces."""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.nn import quantizer as quantizer_mod
from bit_patterns import bit_pattern, same_bits_nan_aside
from kernel_marks import DEVICES

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

_WORD = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}

# (3, 5, 67, 41): 41205 elements, more than one parallel task of 4096 bytes (32768 elements)
# and 41205 % 8 = 5, a partial last byte; (2, 3, 1, 1) both contiguous and channels-last
SHAPES = [(3, 5, 67, 41), (2, 3, 1, 1), (7, 3)]
LAYOUTS = ["contiguous", "channels_last", "strided"]
LAYERS = {"relu": lambda: mnn.ReLU(), "relu_inplace": lambda: mnn.ReLU(inplace=True),
          # edges not representable in bf16 / fp16: compared in float, as ATen's hardtanh_backward does
          "hardtanh": lambda: mnn.Hardtanh(-0.1, 0.7), "relu6_inplace": lambda: mnn.ReLU6(inplace=True),
          "hardsigmoid": lambda: mnn.Hardsigmoid(), "hardswish": lambda: mnn.Hardswish()}
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0, -3.0, 6.0, 0.7, -0.1]


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    if t.dim() != 4 or layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    wide = torch.cat([t, t], dim=-1)  # a slice of a wider tensor: neither layout
    return wide[..., : t.shape[-1]]


def _inputs(shape, dtype, device, x_layout, g_layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 4
    g = torch.randn(shape, generator=gen)
    n = min(len(SPECIALS), x.numel())
    x.view(-1)[:n] = torch.tensor(SPECIALS[:n])
    x.view(-1)[-n:] = torch.tensor(SPECIALS[:n])  # (also in the last, partial byte)
    g.view(-1)[: 2 * n : 2] = -0.0
    g.view(-1)[1 : 2 * n : 2] = float("nan")
    x, g = x.to(device, dtype), g.to(device, dtype)
    if dtype is not torch.float64:  # a NaN payload other than the default one
        word = g.view(_WORD[dtype])
        word.view(-1)[1] = word.view(-1)[1] | 1
    return _laid_out(x, x_layout), _laid_out(g, g_layout)


def _run(fused, monkeypatch, kind, x, g):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    leaf = x.clone(memory_format=torch.preserve_format).requires_grad_()
    inp = leaf * 1 if kind.endswith("_inplace") else leaf  # (an in-place layer overwrites a non-leaf)
    y = layer(inp)
    (gx,) = torch.autograd.grad(y, leaf, g)
    return y.detach(), gx


def _assert_same_bits(a, b, any_nan_payload=False):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    if any_nan_payload:  # NaN in the same places, the same bits elsewhere
        assert same_bits_nan_aside(a, b)
    else:
        assert torch.equal(bit_pattern(a), bit_pattern(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(_WORD), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("x_layout", LAYOUTS)
@pytest.mark.parametrize("g_same_layout", [True, False], ids=["g-in-mask-layout", "g-other-layout"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_mask_loops_are_bitwise_the_python_function(device, dtype, shape, x_layout, g_same_layout, kind,
                                                    monkeypatch):
    if len(shape) != 4 and (x_layout != "contiguous" or not g_same_layout):
        pytest.skip("layouts are a 4-D matter")
    if kind == "hardswish" and dtype is torch.float64:
        pytest.skip("Hardswish keeps x quantized: float32, float16 and bfloat16 only")
    g_layout = x_layout if g_same_layout else ("contiguous" if x_layout == "channels_last" else "channels_last")
    x, g = _inputs(shape, dtype, device, x_layout, g_layout)
    fused_y, fused_gx = _run(True, monkeypatch, kind, x, g)
    python_y, python_gx = _run(False, monkeypatch, kind, x, g)
    _assert_same_bits(fused_y, python_y)
    _assert_same_bits(fused_gx, python_gx, any_nan_payload=kind == "hardswish")


def test_the_select_keeps_g_where_the_mask_is_set_and_writes_plus_zero_elsewhere(monkeypatch):
    """The loop's own contract, against values worked out here rather than another Mesa path."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 2.0, float("nan"), 5.0, -5.0, 1.0])
    g = torch.tensor([float("nan"), 7.0, 7.0, 7.0, -0.0, 7.0, 3.5, float("nan"), -2.0])
    leaf = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(mnn.ReLU()(leaf), leaf, g)
    # (a NaN input passes its g: threshold_backward's y <= 0 is false there)
    want = torch.tensor([float("nan"), 0.0, 0.0, 0.0, -0.0, 7.0, 3.5, 0.0, -2.0])
    assert torch.equal(gx.view(torch.int32), want.view(torch.int32)), gx


STOCK = {"relu": lambda: torch.nn.ReLU(), "relu_inplace": lambda: torch.nn.ReLU(inplace=True),
         "hardtanh": lambda: torch.nn.Hardtanh(-0.1, 0.7), "relu6_inplace": lambda: torch.nn.ReLU6(inplace=True),
         "hardsigmoid": lambda: torch.nn.Hardsigmoid()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(_WORD), ids=str)
@pytest.mark.parametrize("x_layout", LAYOUTS)
@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python-function"])
@pytest.mark.parametrize("kind", list(STOCK))
def test_mask_layers_give_the_stock_gradient_bit_for_bit(device, dtype, x_layout, fused, kind, monkeypatch):
    """Against stock's own autograd, not another Mesa path: the same output and gradient bits,
    on the edges, infinities and signed zeros, and for the ReLU a NaN input, whose g stock passes
    (threshold_backward: y <= 0 is false) on every device and dtype. The clamps' stock kernels
    disagree with themselves on a NaN (ATen's vectorized CPU loop gives 0, its scalar tail g;
    DESIGN.md), so their inputs here hold none."""
    x, g = _inputs((3, 5, 67, 41), dtype, device, x_layout, x_layout)
    if kind != "relu" and kind != "relu_inplace":
        x = torch.nan_to_num(x, nan=0.25, posinf=float("inf"), neginf=float("-inf"))
    mesa_y, mesa_gx = _run(fused, monkeypatch, kind, x, g)
    stock = STOCK[kind]()
    leaf = x.clone(memory_format=torch.preserve_format).requires_grad_()
    y = stock(leaf * 1 if kind.endswith("_inplace") else leaf)
    (gx,) = torch.autograd.grad(y, leaf, g)
    _assert_same_bits(mesa_y, y.detach())
    # ATen's CUDA hardtanh_backward computes a half or bfloat16 g in float and converts back,
    # and the GPU's conversion writes its canonical NaN (0x7FFF) for any NaN g; Mesa's select
    # passes g's own bits (0x7E00 here). NaN in the same places, every other bit the same (the
    # H200 run of 2026-12-04: these 12 cases failed on the payload alone)
    gpu_nan = kind == "hardtanh" and x.is_cuda and dtype in (torch.float16, torch.bfloat16)
    _assert_same_bits(mesa_gx, gx, any_nan_payload=gpu_nan)
