"""The C++ fast path of the Mesa GELU, Softmax, Linear, LayerNorm, MatMul, Conv2d and fused attention
(``mesa::gelu_train``, ``mesa::softmax_train``, ..., csrc/layers_autograd.cpp; ``mesa::sdpa_train``,
csrc/sdpa_autograd.cpp: the whole layer with a C++ autograd node)
is bitwise the Python Function path: outputs, the saved 8-bit copy and its statistics, the
estimate and rounding-counter buffers afterwards, gradients, and the bytes kept."""
from __future__ import annotations


import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model
from kernel_marks import DEVICES, DTYPES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

OPTIONS = [dict(), dict(estimator="per_sample"), dict(estimator="delayed"), dict(symmetric=True),
           dict(rounding="nearest"), dict(num_groups=3), dict(estimator="delayed", symmetric=True, rounding="nearest")]
# the channel variant formats (mesa.bits=4|2, scale=pow2) the C++ ops take
VARIANT_OPTIONS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
                   dict(bits=4, estimator="per_sample", rounding="nearest", num_groups=3)]


def _layer(kind, options):
    torch.manual_seed(0)
    if kind == "gelu":
        return mnn.GELU(**options), (8, 5, 12)
    if kind == "gelu_tanh":
        return mnn.GELU(approximate="tanh", **options), (3, 7, 2, 6)
    return mnn.Softmax(-1, **options), (2, 3, 5, 5)


def _run(layer, x, g, fused: bool, monkeypatch):
    """Two training steps (estimates initialised, then updated); returns everything observable."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    out = []
    for step in range(2):
        xi = (x * (step + 1)).detach().requires_grad_()
        with SavedTensorMeter() as meter:
            y = layer(xi)
        saved = meter.activation_bytes
        y.backward(g)
        out += [y.detach(), xi.grad, torch.tensor(saved)]
    out += [b.clone() for b in layer.quantizer.buffers()]
    return out


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "softmax"])
def test_fused_layer_is_bitwise_the_python_function(kind, dtype, options, monkeypatch):
    layer_a, shape = _layer(kind, options)
    layer_b, _ = _layer(kind, options)
    layer_b.quantizer.rng.copy_(layer_a.quantizer.rng)  # the same rounding key (keys differ per construction)
    x = (torch.randn(shape) * 2).to(dtype)
    g = torch.randn(shape).to(dtype)
    got = _run(layer_a, x, g, True, monkeypatch)
    want = _run(layer_b, x, g, False, monkeypatch)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("options", [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
                                     dict(bits=4, estimator="per_sample", rounding="nearest", num_groups=3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh"])
def test_fused_gelu_takes_the_variant_formats_bitwise_the_python_function(kind, dtype, options, monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::gelu_train keeps quantize_bits' packed codes and its
    backward is dequantize_bits + ATen's gelu_backward (the 8-bit one-op backward reads 8-bit
    codes): the Python Function's bits, on the C++ op each step (a 4-D input: its NHWC view)."""
    layer_a, shape = _layer(kind, options)
    layer_b, _ = _layer(kind, options)
    layer_b.quantizer.rng.copy_(layer_a.quantizer.rng)
    x = (torch.randn(shape) * 2).to(dtype)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(shape).to(dtype)
    calls = count_calls(monkeypatch, "gelu_train")
    got = _run(layer_a, x, g, True, monkeypatch)
    assert calls == [1, 1]
    want = _run(layer_b, x, g, False, monkeypatch)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("options", VARIANT_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", [((2, 3, 5, 5), -1), ((4, 7), -1), ((2, 3, 5, 5), 2)], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_softmax_takes_the_variant_formats_bitwise_the_python_function(device, shape, dim, dtype, options,
                                                                             monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::softmax_train keeps quantize_bits' packed codes of the
    map, and its backward dequantizes them, renormalises the rows and calls ATen's softmax
    backward (the one-op backward reads 8-bit codes): the Python Function's outputs,
    gradients, bytes kept and buffers, on the C++ op each step."""
    def layer():
        sm = mnn.Softmax(dim, device=device, **options)
        sm.quantizer.rng.copy_(torch.tensor([77, 0]))
        return sm
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2).to(device, dtype)
    g = torch.randn(shape).to(device, dtype)
    calls = count_calls(monkeypatch, "softmax_train")
    got = _run(layer(), x, g, True, monkeypatch)
    assert calls == [1, 1]
    want = _run(layer(), x, g, False, monkeypatch)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


def test_format_code_names_the_formats_matmul_train_takes():
    """A shared copy's format as mesa::matmul_train takes it (layer_op_code's format part);
    patch4x4 codes have none (the MatMul keeps its Python Function for them)."""
    assert quantizer_mod.format_code(None) == 0
    assert quantizer_mod.format_code(("bits", 4, False, (2, 3))) == 16
    assert quantizer_mod.format_code(("bits", 2, True, (2, 3))) == 8 + 64
    with pytest.raises(ValueError, match="only the default format and channel-group formats"):
        quantizer_mod.format_code(("patch4x4", 2, False, (1, 1, 4, 4)))


def test_softmax_copy_and_sharing_match(monkeypatch):
    """forward_with_copy hands the same codes to attn @ v on both paths; an unused output
    (only the copy reaches the loss) gives no gradient, as in the Python Function."""
    x = torch.randn(2, 3, 5, 5)
    res = []
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        torch.manual_seed(0)
        sm, mm = mnn.Softmax(-1, num_groups=3), mnn.MatMul(num_groups=3)
        for i, q in enumerate((sm.quantizer, mm.quantizer_a, mm.quantizer_b)):
            q.rng.copy_(torch.tensor([1000 + i, 0]))
        xi = x.clone().requires_grad_()
        v = torch.randn(2, 3, 5, 4, requires_grad=True)
        y, copy = sm.forward_with_copy(xi)
        out = mm(y, v, shared_a=copy)
        out.sum().backward()
        res.append((copy.q, copy.alpha, copy.beta, out.detach(), xi.grad, v.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    y, copy = mnn.Softmax(-1).forward_with_copy(torch.randn(2, 4, requires_grad=True))
    assert not copy.q.requires_grad and not copy.alpha.requires_grad


def test_the_fast_path_is_used_in_eager_training_only(monkeypatch):
    calls = count_calls(monkeypatch, "gelu_train")
    layer = mnn.GELU()
    layer(torch.randn(4, 6, requires_grad=True)).sum().backward()
    assert calls == [1]
    layer.eval()
    layer(torch.randn(4, 6, requires_grad=True))
    layer.train()
    mnn.GELU(bits=4, estimator="learned")(torch.randn(4, 6, requires_grad=True)).sum().backward()  # Python path
    assert calls == [1]


def _linear_run(fused, monkeypatch, dtype, bias, row_scale, x_grad, w_grad, autocast, shape, options=None):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = mnn.Linear(12, 6, bias=bias, dtype=dtype, **{"num_groups": 3, "row_scale": row_scale, **(options or {})})
    layer.quantizer.rng.copy_(torch.tensor([77, 0]))
    layer.weight.requires_grad_(w_grad)
    out = []
    for step in range(2):
        x = (torch.randn(shape) * (step + 1)).to(dtype)
        x[..., 0, :] *= 1e-4  # a row far below the others: row scales act
        x.requires_grad_(x_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = layer(x)
        y = torch.relu_(y)  # in place after the layer: allowed, as after a stock Linear
        y.sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    out += [p.grad for p in layer.parameters()] + [b.clone() for b in layer.quantizer.buffers()]
    return out


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("bias,row_scale", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("x_grad,w_grad", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("shape", [(4, 5, 12), (7, 12)], ids=str)
def test_fused_linear_is_bitwise_the_python_function(dtype, autocast, bias, row_scale, x_grad, w_grad, shape,
                                                     monkeypatch):
    got = _linear_run(True, monkeypatch, dtype, bias, row_scale, x_grad, w_grad, autocast, shape)
    want = _linear_run(False, monkeypatch, dtype, bias, row_scale, x_grad, w_grad, autocast, shape)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("row_scale", [True, False])
@pytest.mark.parametrize("options", [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
                                     dict(bits=4, estimator="per_sample", rounding="nearest", num_groups=2)], ids=str)
def test_fused_linear_takes_the_variant_formats_bitwise_the_python_function(dtype, autocast, row_scale, options,
                                                                            monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::linear_train keeps quantize_bits' packed codes of the
    input, its small rows scaled by 2**k first (ActivationQuantizer._compress's order) and
    unscaled after dequantize_bits: the Python Function's bits, on the C++ op each step."""
    args = (dtype, True, row_scale, True, True, autocast, (4, 5, 12), options)
    assert_op_path_is_the_python_path(monkeypatch, "linear_train", _linear_run, *args)


def _layernorm_run(fused, monkeypatch, dtype, affine, bias, row_scale, x_grad, w_grad, shape, normalized,
                   cls=mnn.LayerNorm, options=None):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = cls(normalized, elementwise_affine=affine, bias=bias, dtype=dtype,
                **{"num_groups": 2, "row_scale": row_scale, **(options or {})})
    layer.quantizer.rng.copy_(torch.tensor([91, 0]))
    if affine:
        layer.weight.requires_grad_(w_grad)
        with torch.no_grad():
            layer.weight.add_(torch.randn(layer.weight.shape).to(dtype))
    out = []
    for step in range(2):
        x = (torch.randn(shape) * (step + 1) + 3).to(dtype)
        x[0] = 5 + 1e-5 * torch.randn(shape[1:]).to(dtype)  # a row of tiny variance: row scales act
        x.requires_grad_(x_grad)
        with SavedTensorMeter() as meter:
            y = layer(x)
        (y * torch.linspace(-1, 2, y.numel()).view(y.shape).to(dtype)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    out += [p.grad for p in layer.parameters()] + [b.clone() for b in layer.quantizer.buffers()]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine,bias,row_scale", [(True, True, True), (True, False, True), (False, False, True),
                                                   (True, True, False)])
@pytest.mark.parametrize("x_grad,w_grad", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("shape,normalized", [((6, 5, 8), (8,)), ((6, 4, 8), (4, 8))], ids=str)
def test_fused_layernorm_is_bitwise_the_python_function(dtype, affine, bias, row_scale, x_grad, w_grad, shape,
                                                        normalized, monkeypatch):
    if not (x_grad or (affine and w_grad)):
        pytest.skip("nothing needs a gradient")
    args = (dtype, affine, bias, row_scale, x_grad, w_grad, shape, normalized)
    got, want = _layernorm_run(True, monkeypatch, *args), _layernorm_run(False, monkeypatch, *args)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine,bias,row_scale", [(True, True, True), (False, False, True), (True, True, False)])
@pytest.mark.parametrize("shape,normalized,cls", [((6, 5, 8), (8,), mnn.LayerNorm), ((6, 4, 8), (4, 8), mnn.LayerNorm),
                                                  ((3, 8, 2, 5), (8,), mnn.LayerNorm2d)], ids=str)
@pytest.mark.parametrize("options", [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
                                     dict(bits=4, estimator="per_sample", rounding="nearest", num_groups=3)], ids=str)
def test_fused_layernorm_takes_the_variant_formats_bitwise_the_python_function(dtype, affine, bias, row_scale, shape,
                                                                               normalized, cls, options, monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::layer_norm_train keeps quantize_bits' packed codes of
    x_hat (normalised, its tiny-variance row scaled by 2**k first) and, at 4 or 2 bits, rstd
    as float16 and one power of two (layernorm.pack_rstd); backward dequantizes x_hat / rstd
    with ops (decompress_saved) for ATen's LayerNorm backward: the Python Function's bits
    and bytes kept, on the C++ op each step."""
    args = (dtype, affine, bias, row_scale, True, True, shape, normalized, cls, options)
    assert_op_path_is_the_python_path(monkeypatch, "layer_norm_train", _layernorm_run, *args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_scale", [True, False])
def test_fused_layernorm2d_is_bitwise_the_python_function(dtype, row_scale, monkeypatch):
    """timm's LayerNorm2d (ConvNeXt): the C++ layer and the Function on the permuted,
    non-contiguous (N, H, W, C) view of an NCHW input."""
    args = (dtype, True, True, row_scale, True, True, (3, 8, 2, 5), (8,), mnn.LayerNorm2d)
    got, want = _layernorm_run(True, monkeypatch, *args), _layernorm_run(False, monkeypatch, *args)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


def _matmul_run(fused, monkeypatch, dtype, autocast, operands, a_grad, b_grad, a_shape, b_shape, b_view,
                options=None, device="cpu"):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = mnn.MatMul(operands=operands, **(dict(num_groups=2) | (options or {})))
    for i, q in enumerate(layer.quantizers()):
        q.rng.copy_(torch.tensor([300 + i, 0]))
    out = []
    for step in range(2):
        a = (torch.randn(a_shape) * (step + 1)).to(device, dtype).requires_grad_(a_grad)
        if b_view:  # b a strided view of a bigger tensor (v of a fused qkv): kept as a compact copy
            b = torch.randn(b_shape[:-1] + (3 * b_shape[-1],)).to(device, dtype)[..., 1::3]
        else:
            b = torch.randn(b_shape).to(device, dtype)
        b.requires_grad_(b_grad)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = layer(a, b)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), a.grad, b.grad, torch.tensor(meter.activation_bytes)]
        out.append(torch.tensor([hash(k) for k in layer.last_saved]))
    out += [bf.clone() for bf in layer.buffers()]
    return out


MATMUL_SHAPES = [((2, 3, 5, 4), (2, 3, 4, 6)), ((4, 5, 6), (4, 6, 3)), ((5, 6), (6, 3)), ((6,), (6, 3)),
                 ((4, 5, 6), (6,)), ((4, 5, 6), (6, 3)), ((6,), (6,))]


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("operands", [("a", "b"), ("a",), ("b",), ()], ids=str)
@pytest.mark.parametrize("a_grad,b_grad", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES, ids=str)
def test_fused_matmul_is_bitwise_the_python_function(dtype, autocast, operands, a_grad, b_grad, a_shape, b_shape,
                                                     monkeypatch):
    b_view = operands in [(), ("a",)] and len(b_shape) > 1
    args = (dtype, autocast, operands, a_grad, b_grad, a_shape, b_shape, b_view)
    got, want = _matmul_run(True, monkeypatch, *args), _matmul_run(False, monkeypatch, *args)
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), i


@pytest.mark.parametrize("options", VARIANT_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("operands", [("a", "b"), ("a",)], ids=str)
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_matmul_takes_the_variant_formats_bitwise_the_python_function(device, dtype, autocast, operands,
                                                                            a_shape, b_shape, options, monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::matmul_train keeps quantize_bits' packed codes of its
    operands and reads them back with dequantize_bits: the Python Function's outputs,
    gradients, bytes kept and buffers, on the C++ op each step."""
    b_view = operands == ("a",) and len(b_shape) > 1
    args = (dtype, autocast, operands, True, True, a_shape, b_shape, b_view, options, device)
    assert_op_path_is_the_python_path(monkeypatch, "matmul_train", _matmul_run, *args)


@pytest.mark.parametrize("options", [dict()] + VARIANT_OPTIONS[:2], ids=str)
@pytest.mark.parametrize("implicit", [False, True], ids=["forward_with_copy", "sharing cache"])
@pytest.mark.parametrize("operands", [("a", "b"), ()], ids=str)
def test_fused_matmul_keeps_the_softmax_copy(implicit, operands, options, monkeypatch):
    """attn @ v with the Softmax's 8-bit map (or its packed codes in a variant format, whose
    format goes with them): handed over explicitly or found in the sharing cache, the C++
    MatMul keeps that copy (no second quantization of the map), bitwise the Python path, and
    stores the map once."""
    res = []
    calls = count_calls(monkeypatch, "matmul_train")
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        torch.manual_seed(0)
        sm = mnn.Softmax(-1, **(dict(num_groups=3) | options))
        mm = mnn.MatMul(operands=operands, **(dict(num_groups=3) | options))
        for i, q in enumerate(sm.quantizers() + mm.quantizers()):
            q.rng.copy_(torch.tensor([2000 + i, 0]))
        x = torch.randn(2, 3, 5, 5, requires_grad=True)
        v = torch.randn(2, 3, 5, 4, requires_grad=True)
        with SavedTensorMeter() as meter:
            if implicit:
                out = mm(sm(x), v)
            else:
                y, copy = sm.forward_with_copy(x)
                out = mm(y, v, shared_a=copy)
        out.sum().backward()
        res.append([out.detach(), x.grad, v.grad, torch.tensor(meter.activation_bytes)]
                   + [b.clone() for b in mm.buffers()])
        assert mm.last_saved[0] == "shared", mm.last_saved
    assert calls == [1]  # the C++ op in the fused run only
    for i, (a, b) in enumerate(zip(*res, strict=True)):
        assert torch.equal(a, b), i
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)


def test_fused_matmul_runs_only_in_eager_training_with_a_channel_format(monkeypatch):
    calls = count_calls(monkeypatch, "matmul_train")
    a, b = torch.randn(2, 4, 5, requires_grad=True), torch.randn(2, 5, 3, requires_grad=True)
    mnn.MatMul()(a, b).sum().backward()
    mnn.MatMul(bits=4)(a, b).sum().backward()  # a channel variant format: the C++ op too
    assert calls == [1, 1]
    mnn.MatMul(operands=())(a, b).sum().backward()  # nothing compressed or shared: the stock op
    mnn.MatMul(bits=4, estimator="learned")(a, b).sum().backward()  # learned thresholds: the Python Function
    mnn.MatMul().eval()(a, b)
    assert calls == [1, 1]


def _conv_run(fused, monkeypatch, dtype, autocast, conv_kwargs, bias, x_grad, w_grad, unbatched, cls=mnn.Conv2d):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = cls(4, 6 if conv_kwargs.get("groups", 1) != 4 else 4, bias=bias, dtype=dtype, num_groups=2, **conv_kwargs)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    layer.weight.requires_grad_(w_grad)
    spatial = (9, 9) if cls is mnn.Conv2d else (9,)
    out = []
    for step in range(2):
        x = (torch.randn((4, *spatial) if unbatched else (2, 4, *spatial)) * (step + 1)).to(dtype)
        x.requires_grad_(x_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel()).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    out += [p.grad for p in layer.parameters()] + [b.clone() for b in layer.quantizer.buffers()]
    return out


CONVS = [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=1),
         dict(kernel_size=3, padding=2, dilation=2), dict(kernel_size=3, padding=1, groups=4),
         dict(kernel_size=(1, 3), padding=(0, 1), groups=2)]


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("conv_kwargs", CONVS, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_grad,w_grad", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("unbatched", [False, True])
def test_fused_conv2d_is_bitwise_the_python_function(dtype, autocast, conv_kwargs, bias, x_grad, w_grad, unbatched,
                                                     monkeypatch):
    args = (dtype, autocast, conv_kwargs, bias, x_grad, w_grad, unbatched)
    got, want = _conv_run(True, monkeypatch, *args), _conv_run(False, monkeypatch, *args)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i


# string padding ('valid', an odd 'same': ConvMixer's depthwise convs) handed to the op as numbers,
# and the Conv1d op (mesa::conv1d_train: EfficientViM's token convs, CoaT's, ECA's)
STRING_PADDING_AND_1D = [(mnn.Conv2d, dict(kernel_size=3, padding="same")),
                         (mnn.Conv2d, dict(kernel_size=3, padding="same", dilation=2, groups=4)),
                         (mnn.Conv2d, dict(kernel_size=(1, 5), padding="same", groups=2)),
                         (mnn.Conv2d, dict(kernel_size=3, stride=2, padding="valid")),
                         (mnn.Conv1d, dict(kernel_size=1)), (mnn.Conv1d, dict(kernel_size=3, padding=1, groups=2)),
                         (mnn.Conv1d, dict(kernel_size=3, stride=2)),
                         (mnn.Conv1d, dict(kernel_size=5, padding="same", dilation=2, groups=4))]


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("cls,conv_kwargs", STRING_PADDING_AND_1D, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_grad,w_grad", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("unbatched", [False, True])
def test_fused_conv_string_padding_and_conv1d_bitwise_the_python_function(dtype, autocast, cls, conv_kwargs, bias,
                                                                          x_grad, w_grad, unbatched, monkeypatch):
    op = "conv2d_train" if cls is mnn.Conv2d else "conv1d_train"
    args = (dtype, autocast, conv_kwargs, bias, x_grad, w_grad, unbatched, cls)
    assert_op_path_is_the_python_path(monkeypatch, op, lambda fused, mp: _conv_run(fused, mp, *args))


@pytest.mark.parametrize("name,op,layer", [("convmixer_768_32", "conv2d_train", mnn.Conv2d),
                                           ("efficientvim_m1", "conv1d_train", mnn.Conv1d),
                                           ("coat_tiny", "conv1d_train", mnn.Conv1d)], ids=str)
def test_patched_models_run_every_conv_on_the_op(name, op, layer, monkeypatch):
    """ConvMixer's 'same' depthwise convs, EfficientViM's and CoaT's Conv1d: two training steps
    with drop-path on give the same outputs, gradients and buffers on the op as on the Python
    Function, every such conv on the op."""
    model = patch_model(build(name, drop=True))
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), op, layer)


def test_fused_conv2d_only_for_zero_padding_it_can_name(monkeypatch):
    """An even 'same' (one side pads more), other padding modes, the patch4x4 layout and
    learned thresholds keep the Python Function; numbers, 'valid' and an odd 'same' take the
    C++ op."""
    calls = count_calls(monkeypatch, "conv2d_train")
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    mnn.Conv2d(4, 4, 3, padding=1)(x).sum().backward()
    mnn.Conv2d(4, 4, 3, padding="same")(x).sum().backward()
    mnn.Conv2d(4, 4, 3, padding="valid")(x).sum().backward()
    assert calls == [1, 1, 1]
    calls.clear()
    with pytest.warns(UserWarning, match="even kernel lengths"):  # (stock's own warning)
        mnn.Conv2d(4, 4, 4, padding="same")(x).sum().backward()
    mnn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")(x).sum().backward()
    mnn.Conv2d(4, 4, 3, padding=1, layout="patch4x4", bits=2)(x).sum().backward()
    mnn.Conv2d(4, 4, 3, padding=1, bits=4, estimator="learned")(x).sum().backward()
    assert calls == []
    mnn.Conv2d(4, 4, 3, padding=1, bits=4)(x).sum().backward()  # a channel variant format: the C++ op
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("conv_kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=1, groups=2)], ids=str)
@pytest.mark.parametrize("options", [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
                                     dict(bits=4, estimator="per_sample", rounding="nearest", num_groups=2)], ids=str)
def test_fused_conv2d_takes_the_variant_formats_bitwise_the_python_function(dtype, channels_last, conv_kwargs,
                                                                            options, monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::conv2d_train keeps the input as quantize_bits' packed
    codes (a channels-last input through its NHWC view) and reads them back with
    dequantize_bits: outputs, gradients, bytes kept and buffers equal the Python Function's."""
    def run(fused):
        calls = count_calls(monkeypatch, "conv2d_train")
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        torch.manual_seed(0)
        layer = mnn.Conv2d(4, 6, dtype=dtype, **conv_kwargs, **options)
        layer.quantizer.rng.copy_(torch.tensor([55, 0]))
        out = []
        for step in range(2):
            x = (torch.randn(2, 4, 9, 7) * (step + 1)).to(dtype)
            x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            x.requires_grad_()
            with SavedTensorMeter() as meter:
                y = layer(x)
            (y.float() * torch.linspace(-1, 2, y.numel()).view(y.shape)).sum().backward()
            out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
        assert len(calls) == (2 if fused else 0)
        return out + [p.grad for p in layer.parameters()] + [b.clone() for b in layer.quantizer.buffers()]

    got, want = run(True), run(False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), i


def _rows_case(case: str, shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(shape)
    if case == "tiny row":
        x[..., 0, :] *= 1e-4
    elif case == "zero row":
        x[..., 1, :] = 0.0
        x[..., 0, 0] = -0.0
    elif case == "nan row":
        x[..., 1, 3] = float("nan")
    elif case == "inf row":
        x[..., 0, 2] = float("inf")
    elif case == "nan and inf at the row ends":  # the vector loop's tail and first lane
        x[..., 1, -1] = float("nan")
        x[..., 2, 0] = float("-inf")
    elif case == "tiny and zero rows":
        x[..., 0, :] *= 1e-6
        x[..., 1, :] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("case", ["ordinary", "tiny row", "zero row", "nan row", "inf row",
                                  "nan and inf at the row ends", "tiny and zero rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 16), (6, 16), (2, 4, 131)], ids=str)  # 131: vector body + tail
def test_row_exponents_fast_path_is_bitwise_the_python_path(case, dtype, shape, monkeypatch):
    """The C++ layer op's one-pass row maxima (and its skipped 2**0 multiplies) give the
    Python path's row exponents (ATen ops, multiplies always run), codes and gradients,
    also for zero, NaN and inf rows."""
    from mesa_train.nn import rowscale

    runs = []
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        layer = mnn.Linear(shape[-1], 4, num_groups=2, dtype=dtype)
        torch.manual_seed(0)
        layer.reset_parameters()
        layer.quantizer.rng.copy_(torch.tensor([5, 0]))
        x = _rows_case(case, shape, dtype).requires_grad_()
        y = layer(x)
        y.float().sum().backward()
        runs.append([y.detach(), x.grad, layer.weight.grad, layer.bias.grad]
                    + [b.clone() for b in layer.quantizer.buffers()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5)), i
    # and the exponents the Python path saw: nonzero exactly where a row is far below the others
    k = rowscale.row_exponents(_rows_case(case, shape, dtype), 1, rowscale.max_exponent(dtype))
    assert bool(k.any()) == (case in ("tiny row", "tiny and zero rows"))


# ----------------------------------------------------------------------------- SDPA
SDPA_MASKS = ["none", "bias", "frozen bias", "window", "window only", "bool", "causal", "scale"]


def _sdpa_inputs(step, dtype, mask, four_d, grads):
    """q, k, v (non-contiguous leaves, as the heads of a fused qkv are) and the keyword
    arguments of the layer for one mask case; the bias (if any) last."""
    torch.manual_seed(100 + step)
    B, H, N, E = 8, 2, 6, 4
    lead = (B, N, H, E) if four_d else (B, E, N)
    q, k, v = ((torch.randn(lead) * (step + 1)).to(dtype) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, E) or (B, N, E)
    for t, name in zip((q, k, v), ("q", "k", "v")):
        t.requires_grad_(name in grads)
    bias_shape = (1, H, N, N) if four_d else (1, N, N)
    bias = (torch.randn(bias_shape) * 0.5).to(dtype).requires_grad_(mask != "frozen bias" and "mask" in grads)
    kw = {}
    if mask in ("bias", "frozen bias", "window", "scale"):
        kw["attn_mask"] = bias
    if mask in ("window", "window only"):
        wm = torch.zeros(4, N, N, dtype=dtype)
        wm[1, :, : N // 2] = -100.0  # Swin's shifted-window mask values
        wm[3, N // 2:, :] = -100.0
        kw["window_mask"] = wm
    if mask == "bool":
        kw["attn_mask"] = (torch.rand(N, N) > 0.3) | torch.eye(N, dtype=torch.bool)
    if mask == "causal":
        kw["is_causal"] = True
    if mask == "scale":
        kw["scale"] = 0.3
    return q, k, v, kw


def _sdpa_run(fused, monkeypatch, dtype, autocast, mask, four_d, grads, options=None):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    calls = count_calls(monkeypatch, "sdpa_train")
    torch.manual_seed(0)
    layer = mnn.ScaledDotProductAttention(**(dict(num_groups=2) | (options or {})))
    for i, q in enumerate(layer.quantizers()):
        q.rng.copy_(torch.tensor([400 + i, 0]))
    out = []
    for step in range(2):
        q, k, v, kw = _sdpa_inputs(step, dtype, mask, four_d, grads)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = layer(q, k, v, **kw)
        (y.float() * torch.linspace(-1, 2, y.numel()).view(y.shape)).sum().backward()
        m = kw.get("attn_mask")
        out += [y.detach(), q.grad, k.grad, v.grad, m.grad if m is not None and m.is_floating_point() else None,
                torch.tensor(meter.activation_bytes)]
    out += [b.clone() for b in layer.buffers()]
    monkeypatch.undo()
    assert calls == ([1, 1] if fused else []), "the op under test did not run"
    return out


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("mask", SDPA_MASKS)
@pytest.mark.parametrize("four_d", [True, False], ids=["4-D", "3-D"])
@pytest.mark.parametrize("grads", [("q", "k", "v", "mask"), ("k", "v"), ("q",), ("mask",)],
                         ids=lambda g: "+".join(g) + " need grad")
def test_fused_sdpa_is_bitwise_the_python_function(dtype, autocast, mask, four_d, grads, monkeypatch):
    """mesa::sdpa_train (csrc/sdpa_autograd.cpp) against _MesaSDPA: outputs, gradients of q, k,
    v and a float mask, the bytes kept, estimates and rounding counters, over two steps."""
    if grads == ("mask",) and mask not in ("bias", "window", "scale"):
        pytest.skip("no float mask that could require grad")
    if mask in ("window", "window only") and not four_d:
        pytest.skip("Swin's window mask is per head: 4-D operands")
    args = (dtype, autocast, mask, four_d, grads)
    got, want = _sdpa_run(True, monkeypatch, *args), _sdpa_run(False, monkeypatch, *args)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("options", VARIANT_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("mask", ["none", "window", "causal"])
@pytest.mark.parametrize("four_d", [True, False], ids=["4-D", "3-D"])
def test_fused_sdpa_takes_the_variant_formats_bitwise_the_python_function(dtype, autocast, mask, four_d, options,
                                                                          monkeypatch):
    """mesa.bits=4|2, scale=pow2: mesa::sdpa_train keeps q, k, v as quantize_bits' packed
    codes and recomputes the attention from dequantize_bits' values: outputs, gradients, bytes
    kept and buffers equal _MesaSDPA's, on the C++ op each step (_sdpa_run checks)."""
    if mask == "window" and not four_d:
        pytest.skip("Swin's window mask is per head: 4-D operands")
    args = (dtype, autocast, mask, four_d, ("q", "k", "v"), options)
    got, want = _sdpa_run(True, monkeypatch, *args), _sdpa_run(False, monkeypatch, *args)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i


def test_fused_sdpa_runs_only_in_eager_training_without_dropout(monkeypatch):
    """dropout_p > 0 (the RNG-state replay), learned thresholds, eval and a disabled layer keep
    their Python paths; the default layer and a channel variant format in eager training take
    the C++ op."""
    calls = count_calls(monkeypatch, "sdpa_train")
    q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    for layer in (mnn.ScaledDotProductAttention(), mnn.ScaledDotProductAttention(bits=4)):
        y = layer(q, k, v)
        assert "SdpaTrain" in y.grad_fn.name()
        y.sum().backward()
    assert calls == [1, 1]
    for layer, dropout_p in ((mnn.ScaledDotProductAttention(), 0.2),
                             (mnn.ScaledDotProductAttention(bits=4, estimator="learned"), 0.0)):
        y = layer(q, k, v, dropout_p=dropout_p)
        assert y.grad_fn.name() == "_MesaSDPABackward"
        y.sum().backward()
    mnn.ScaledDotProductAttention().eval()(q, k, v)
    mnn.ScaledDotProductAttention(enabled=False)(q, k, v)
    assert calls == [1, 1]


_ENGINE = "autograd::engine::evaluate_function: "  # (the engine's event around each node it runs)


def _sdpa_backward_ways(layer, loss_of, wanted, node: str, ways=("backward", "grad", "anomaly")) -> dict:
    """``{way: (gradients of wanted, events)}`` for each way of running backward from the same
    estimates and rounding: ``backward()``, ``torch.autograd.grad``, ``backward()`` in anomaly
    mode. ``events``: the autograd events of the recomputed attention's backward ``node``, its
    own record and, where the engine ran it, the engine's (``_ENGINE + node``)."""
    from torch.profiler import ProfilerActivity, profile

    start = {n: b.clone() for n, b in layer.state_dict().items()}
    out = {}
    for way in ways:
        layer.load_state_dict(start)
        for t in wanted:
            t.grad = None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = loss_of()
            if way == "grad":
                grads = torch.autograd.grad(loss, wanted)
            else:
                with torch.autograd.set_detect_anomaly(way == "anomaly"):
                    loss.backward()
                grads = [t.grad for t in wanted]
        out[way] = (grads, {e.name for e in prof.events() if e.name.endswith(node)})
    return out


@pytest.mark.parametrize("mask,grads", [(m, ("q", "k", "v")) for m in SDPA_MASKS]
                         + [(m, ("q", "k", "v", "mask")) for m in ("bias", "window", "scale")], ids=str)
def test_fused_sdpa_backward_calls_the_attention_node_directly(mask, grads):
    """mesa::sdpa_train's backward calls the recomputed attention's backend node itself
    (grads_by_node, csrc/sdpa_autograd.cpp) under ``backward()``, and runs the nested engine
    under ``torch.autograd.grad`` (whose exec_info a node outside its graph must not meet), in
    anomaly mode (the engine's NaN check of the node) or where a mask needs a gradient (the math
    backend: more than one node). The gradients are bitwise the same every way."""
    q, k, v, kw = _sdpa_inputs(0, torch.float32, mask, True, grads)
    layer = mnn.ScaledDotProductAttention(num_groups=2)
    weight = torch.linspace(-1, 2, q.numel()).view(q.shape)
    node = "ScaledDotProductFlashAttentionForCpuBackward0"
    got = _sdpa_backward_ways(layer, lambda: (layer(q, k, v, **kw) * weight).sum(),
                              [q, k, v] + ([kw["attn_mask"]] if "mask" in grads else []), node)
    for way, (way_grads, events) in got.items():
        if "mask" not in grads:  # one CPU flash node: called directly under backward() only
            assert events and (_ENGINE + node in events) == (way != "backward"), (way, events)
        else:
            assert not events, events  # (the math backend)
        for a, b in zip(got["backward"][0], way_grads, strict=True):
            assert a is not None and torch.equal(a, b), way


# the CUDA backends the recomputation can take, with the backward node each records
SDPA_CUDA_BACKENDS = {"FLASH_ATTENTION": "ScaledDotProductFlashAttentionBackward0",
                      "EFFICIENT_ATTENTION": "ScaledDotProductEfficientAttentionBackward0",
                      "CUDNN_ATTENTION": "ScaledDotProductCudnnAttentionBackward0"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", sorted(SDPA_CUDA_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_sdpa_backward_calls_the_cuda_attention_node_directly(backend, dtype):
    """On each CUDA backend (DeiT-S's head shape, 64): under ``backward()`` the backward calls the
    backend's node itself (no engine event for it), under ``torch.autograd.grad`` the engine
    runs it, and q, k, v's gradients are bitwise the same (grads_by_node, csrc/sdpa_autograd.cpp)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 6, 197, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    layer = mnn.ScaledDotProductAttention().cuda()
    weight = torch.randn(q.shape, device="cuda", dtype=dtype)
    node = SDPA_CUDA_BACKENDS[backend]
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):  # (the recomputation in backward too)
            got = _sdpa_backward_ways(layer, lambda: (layer(q, k, v) * weight).float().sum(), [q, k, v], node,
                                      ways=("backward", "grad"))
    except RuntimeError as e:  # a backend this GPU or build lacks
        pytest.skip(f"{backend}: {str(e).splitlines()[0]}")
    for way, (way_grads, events) in got.items():
        assert events and (_ENGINE + node in events) == (way == "grad"), (way, events)
        for a, b in zip(got["backward"][0], way_grads, strict=True):
            assert torch.equal(a, b), way


@pytest.mark.parametrize("name", ["deit", "swin", "pvt"])
@pytest.mark.parametrize("ops,options", [(("sdpa",), {}), (("sdpa",), dict(bits=4)), (("all",), dict(bits=4)),
                                         (("matmul", "softmax"), dict(bits=2, scale="pow2"))], ids=str)
def test_fused_attention_in_patched_models_is_bitwise_the_python_function(name, ops, options, monkeypatch):
    """The timm call patterns (DeiT's qkv heads, Swin's relative-position bias plus shifted-window
    mask, PVT-v2's shorter k/v): two training steps of a model patched with the sdpa set, or
    (the explicit attention) every op or the paper's attention ops, give the same outputs,
    parameter gradients and buffers on both paths, also at 4 or 2 bits."""
    import copy

    from test_patch_helpers import build, grads, inputs, loss_of

    explicit = "sdpa" not in ops
    model = patch_model(build(name, fused=not explicit), ops=ops, **options)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        calls = count_calls(monkeypatch, "matmul_train" if explicit else "sdpa_train")
        m = copy.deepcopy(model)
        out = []
        for step in range(2):
            m.zero_grad(set_to_none=True)
            y = m(inputs(name, seed=step))
            loss_of(y).backward()
            out += [y.detach()] + list(grads(m).values())
        runs.append(out + [b.clone() for b in m.buffers()])
        assert bool(calls) == fused
        monkeypatch.undo()
    assert len(runs[0]) == len(runs[1])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("kind", ["linear", "gelu", "layernorm", "softmax", "sdpa"])
def test_higher_order_gradients_are_a_clear_error(kind, monkeypatch):
    """The C++ layer nodes' backward uses the 8-bit copy: with create_graph=True it used to
    return gradients without a graph through that copy (higher-order gradients silently
    wrong). Now a one-line error that says what to do; first-order gradients unchanged."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.randn(2, 4, 6, 8, requires_grad=True)
    layers = {"linear": mnn.Linear(8, 8), "gelu": mnn.GELU(), "layernorm": mnn.LayerNorm(8),
              "softmax": mnn.Softmax(-1)}
    if kind == "sdpa":
        sdpa = mnn.ScaledDotProductAttention(num_groups=4)

        def run():
            return sdpa(x, x * 2, x * 3).pow(2).sum()
    else:
        def run():
            return layers[kind](x).pow(2).sum()
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(run(), x, create_graph=True)
    (g,) = torch.autograd.grad(run(), x)
    assert g.shape == x.shape and torch.isfinite(g).all()


def _channels_last_runs(stock, convert, monkeypatch) -> dict:
    """``{"cpp-node" | "python" | "stock": (y, input grad, weight grad or None)}`` of one step
    on the same channels-last input and output gradient (the Mesa layers with one rounding key)."""
    runs = {}
    for name, fused in (("cpp-node", True), ("python", False), ("stock", None)):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", bool(fused))
        layer = stock if fused is None else convert(stock)
        if fused is not None:
            layer.quantizer.rng.copy_(torch.tensor([55, 0]))
        x = torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(1)).to(
            memory_format=torch.channels_last).requires_grad_()
        y = layer(x)
        y.backward(torch.linspace(-1, 2, y.numel()).view(y.shape).contiguous(memory_format=torch.channels_last))
        weight = getattr(layer, "weight", None)
        runs[name] = (y, x.grad, None if weight is None else weight.grad)
        if weight is not None:
            weight.grad = None
    return runs


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python"])
@pytest.mark.parametrize("conv_kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=3, padding=1, groups=4)],
                         ids=str)
@pytest.mark.parametrize("w_grad", [True, False])
def test_conv2d_channels_last_input_keeps_its_layout(fused, conv_kwargs, w_grad, monkeypatch):
    """A channels-last input (timm's PVT-v2 depthwise conv, a channels_last model) is kept
    as its NHWC view: the input gradient comes back channels-last and bitwise stock's (it
    depends on the weight and the output gradient only), where it came back NCHW and was
    copied downstream; both paths give the same bits."""
    torch.manual_seed(0)
    stock = torch.nn.Conv2d(4, 4, **conv_kwargs).requires_grad_(True)
    stock.weight.requires_grad_(w_grad)
    runs = _channels_last_runs(stock, mnn.Conv2d.from_module, monkeypatch)
    y, gx, gw = runs["cpp-node" if fused else "python"]
    assert torch.equal(y, runs["stock"][0])
    assert gx.stride() == runs["stock"][1].stride() and torch.equal(gx, runs["stock"][1])
    assert gx.is_contiguous(memory_format=torch.channels_last)
    other = runs["python" if fused else "cpp-node"]
    assert torch.equal(gx, other[1]) and (gw is None) == (other[2] is None)
    if w_grad:
        assert torch.equal(gw, other[2])
        assert torch.nn.functional.cosine_similarity(gw.flatten(), runs["stock"][2].flatten(), dim=0) > 0.999


@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_activation_channels_last_input_keeps_its_layout(kind, monkeypatch):
    """A channels-last activation (ConvNeXt trained channels_last) is compressed as its NHWC
    view: its input gradient comes back in stock's layout, and the C++ node (GELU) and the
    Python Function give the same bits."""
    stock = torch.nn.GELU() if kind == "gelu" else torch.nn.SiLU()
    convert = mnn.GELU.from_module if kind == "gelu" else mnn.SiLU.from_module
    runs = _channels_last_runs(stock, convert, monkeypatch)
    for name in ("cpp-node", "python"):
        y, gx, _ = runs[name]
        assert torch.equal(y, runs["stock"][0])
        assert gx.stride() == runs["stock"][1].stride(), name
        cos = torch.nn.functional.cosine_similarity(gx.flatten(), runs["stock"][1].flatten(), dim=0)
        assert cos > 0.999, name
    assert torch.equal(runs["cpp-node"][1], runs["python"][1])


@pytest.mark.parametrize("fused", [True, False])
def test_a_dot_product_has_its_gradients(fused, monkeypatch):
    """1-D @ 1-D (the review's find: both backwards unsqueezed a 0-dim gradient and raised)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    layer = mnn.MatMul(rounding="nearest").train()
    a, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    y = layer(a, b)
    assert torch.equal(y, a.detach() @ b.detach())
    (3 * y).backward()
    torch.testing.assert_close(a.grad, 3 * b.detach(), rtol=0, atol=0.06)  # (3 x half an 8-bit step of randn(64))
    torch.testing.assert_close(b.grad, 3 * a.detach(), rtol=0, atol=0.06)  # (3 x half an 8-bit step of randn(64))
