"""The C++ fast path of the convnet layers (``mesa::batch_norm_train``, ``group_norm_train``, ``mask_train``,
``elementwise_train``; csrc/convnet_autograd.cpp:
the whole layer with a C++ autograd node) is bitwise the Python Function path: outputs, input and
parameter gradients, BatchNorm's running statistics, the estimate and rounding-counter buffers afterwards,
and the bytes kept. Also where it must not run (and the Python Function does)."""
from __future__ import annotations

import copy

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model
from kernel_marks import DEVICES, cpu_uniform
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example
from bit_patterns import assert_all_same_bits

_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")


# ----------------------------------------------------------------------------- BatchNorm
BN_OPTIONS = [dict(), dict(estimator="per_sample"), dict(estimator="delayed"), dict(symmetric=True),
              dict(rounding="nearest"), dict(num_groups=2)]
# the variant formats the C++ ops take (channel groups, min/max ranges; csrc/layers_common.h, make_quantizer)
VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
            dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2)]
BN_SHAPES = {"2d": (2, 4, 5, 3), "channels_last": (2, 4, 5, 3), "1d_ncl": (3, 4, 7), "1d_nc": (6, 4)}
BN_MODULES = {"2d": mnn.BatchNorm2d, "channels_last": mnn.BatchNorm2d, "1d_ncl": mnn.BatchNorm1d,
              "1d_nc": mnn.BatchNorm1d}


def _norm_run(fused, monkeypatch, layer, device, shape, channels_last, dtype, grads):
    """Two training steps of the norm ``layer`` (estimates initialised, then updated; a
    BatchNorm's running statistics updated twice); ``dtype``: None runs under bf16 autocast."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    if layer.weight is not None:
        with torch.no_grad():  # not the initial ones and zeros
            layer.weight.copy_(cpu_uniform(layer.weight.shape, 0.5, 1.5, seed=0))
            if layer.bias is not None:
                layer.bias.copy_(cpu_uniform(layer.bias.shape, -0.5, 0.5, seed=1))
        layer.weight.requires_grad_(grads[1])
        if layer.bias is not None:
            layer.bias.requires_grad_(grads[2])
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    out = []
    for step in range(2):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step)) * (step + 1) + 3
        x = x.to(device, dtype or torch.float32)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(grads[0])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype is None), SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out + [p.grad for p in layer.parameters()] + [b.clone() for b in layer.buffers()]


def _bn_run(fused, monkeypatch, device, layout, dtype, autocast, options, grads, bn_kwargs):
    layer = BN_MODULES[layout](4, device=device, dtype=None if autocast else dtype, **bn_kwargs, **options)
    return _norm_run(fused, monkeypatch, layer, device, BN_SHAPES[layout], layout == "channels_last",
                     None if autocast else dtype, grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("layout", list(BN_SHAPES))
@pytest.mark.parametrize("options", BN_OPTIONS, ids=str)
def test_fused_batchnorm_is_bitwise_the_python_function(device, dtype, autocast, layout, options, monkeypatch):
    if dtype is torch.float16 and device == "cpu" and options:
        pytest.skip("float16 on CPU: the default options suffice")
    args = (device, layout, dtype, autocast, options, (True, True, True), {})
    assert_all_same_bits(_bn_run(True, monkeypatch, *args), _bn_run(False, monkeypatch, *args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grads", [(False, True, True), (True, False, False), (True, True, False),
                                   (False, False, True)], ids=str)
@pytest.mark.parametrize("bn_kwargs", [dict(), dict(momentum=None), dict(track_running_stats=False)], ids=str)
def test_fused_batchnorm_gradients_and_running_statistics(device, grads, bn_kwargs, monkeypatch):
    """Which gradients are wanted, the cumulative average (momentum None) and no running statistics."""
    args = (device, "2d", torch.float32, False, {}, grads, bn_kwargs)
    assert_all_same_bits(_bn_run(True, monkeypatch, *args), _bn_run(False, monkeypatch, *args))


def test_fused_batchnorm_runs_only_where_it_may(monkeypatch):
    """The C++ op in eager training with a channel format (8-bit or a variant) and an affine
    BatchNorm, a linked 1x1 depthwise conv in front included (conv.ScaleLink between the two
    C++ nodes, csrc/scale_link.h; tests/test_scale_branch.py); the Python Function for a
    non-affine one and learned thresholds; stock in eval."""
    calls = count_calls(monkeypatch, "batch_norm_train")
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    mnn.BatchNorm2d(4)(x).sum().backward()
    mnn.BatchNorm1d(4)(x.flatten(2)).sum().backward()
    mnn.BatchNorm2d(4, bits=4)(x).sum().backward()
    assert calls == [1, 1, 1]
    mnn.BatchNorm2d(4, affine=False)(x).sum().backward()
    mnn.BatchNorm2d(4, bits=4, estimator="learned")(x).sum().backward()
    mnn.BatchNorm2d(4).eval()(x).sum().backward()
    assert calls == [1, 1, 1]
    stock = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1, groups=4, bias=False), torch.nn.BatchNorm2d(4))
    patch_model(stock)(x).sum().backward()
    assert calls == [1, 1, 1, 1]


def test_fused_batchnorm_higher_order_gradients_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    bn = mnn.BatchNorm2d(4)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(bn(x).pow(2).sum(), x, create_graph=True)


# ----------------------------------------------------------------------------- GroupNorm
GN_SHAPES = {"2d": (2, 4, 5, 3), "channels_last": (2, 4, 5, 3), "ncl": (3, 4, 7), "nc": (6, 4)}


def _gn_run(fused, monkeypatch, device, layout, groups, dtype, autocast, options, grads, bias=True):
    layer = mnn.GroupNorm(groups, 4, device=device, dtype=None if autocast else dtype, quant_options=options)
    if not bias:  # as timm's GroupNorm1NoBias (PoolFormerV2) has it
        layer.bias = None
    return _norm_run(fused, monkeypatch, layer, device, GN_SHAPES[layout], layout == "channels_last",
                     None if autocast else dtype, grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("layout", list(GN_SHAPES))
@pytest.mark.parametrize("groups", [1, 2])
def test_fused_groupnorm_is_bitwise_the_python_function(device, dtype, autocast, layout, groups, monkeypatch):
    args = (device, layout, groups, dtype, autocast, {}, (True, True, True))
    assert_all_same_bits(_gn_run(True, monkeypatch, *args), _gn_run(False, monkeypatch, *args))


@pytest.mark.parametrize("options", BN_OPTIONS[1:], ids=str)
@pytest.mark.parametrize("grads", [(True, True, True), (False, True, True), (True, False, False),
                                   (False, False, True)], ids=str)
def test_fused_groupnorm_options_and_gradients(options, grads, monkeypatch):
    args = ("cpu", "2d", 2, torch.float32, False, options, grads)
    assert_all_same_bits(_gn_run(True, monkeypatch, *args), _gn_run(False, monkeypatch, *args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("layout", ["2d", "channels_last", "ncl"])
@pytest.mark.parametrize("grads", [(True, True), (False, True), (True, False)], ids=str)
def test_fused_groupnorm_without_bias_is_bitwise_the_python_function(device, dtype, autocast, layout, grads,
                                                                     monkeypatch):
    """A weight and no bias (timm's GroupNorm1NoBias: PoolFormerV2's 24 norms a step in the S12)."""
    if device == "cpu" and layout == "channels_last" and not grads[0] and _TORCH < (2, 14):
        # (stock nn.GroupNorm too: torch 2.11's CPU native_group_norm_backward crashes on a
        # channels-last input whose gradient is not asked for; torch 2.14 does not)
        pytest.skip("torch 2.11's CPU group-norm backward segfaults on a channels-last input without its gradient")
    args = (device, layout, 1, dtype, autocast, {}, (*grads, False), False)
    assert_op_path_is_the_python_path(monkeypatch, "group_norm_train", _gn_run, *args)


def test_poolformerv2_runs_every_groupnorm_on_the_op(monkeypatch):
    """PoolFormerV2 patched, two training steps with drop-path on: the same outputs, gradients and
    buffers on the op as on the Python Function, every GroupNorm (none has a bias) on the op."""
    model = patch_model(build("poolformerv2_s12", drop=True))
    norms = [m for m in model.modules() if isinstance(m, mnn.GroupNorm)]
    assert norms and all(m.bias is None for m in norms)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example("poolformerv2_s12", seed=step),
                                      "group_norm_train", mnn.GroupNorm)


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_groupnorm_takes_a_strided_input_as_stock_does(fused, channels_last, monkeypatch):
    """A channel slice (SHViT normalises part of its channels): torch.group_norm makes it contiguous
    before native_group_norm, whose CPU kernel in torch 2.11 (the GPU image's) refused it; both
    Mesa paths now do the same. Forward bitwise stock's, gradients close, either path."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    base = torch.randn(2, 8, 5, 3)
    base = (base.contiguous(memory_format=torch.channels_last) if channels_last else base).requires_grad_()
    x = base[:, :4]
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    torch.manual_seed(0)
    stock = torch.nn.GroupNorm(2, 4)
    mesa = mnn.GroupNorm.from_module(copy.deepcopy(stock))
    y_stock = stock(x)
    w = torch.linspace(-1, 2, y_stock.numel()).view(y_stock.shape)  # (a plain sum of squares has no gradient)
    (g_stock,) = torch.autograd.grad((y_stock * w).sum(), base)
    y = mesa(x)
    (g,) = torch.autograd.grad((y * w).sum(), base)
    assert torch.equal(y, y_stock)
    assert torch.nn.functional.cosine_similarity(g.flatten(), g_stock.flatten(), dim=0) > 0.999


def test_fused_groupnorm_runs_only_where_it_may(monkeypatch):
    calls = count_calls(monkeypatch, "group_norm_train")
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    mnn.GroupNorm(2, 4)(x).sum().backward()
    mnn.GroupNorm(2, 4, bits=4)(x).sum().backward()
    no_bias = mnn.GroupNorm(2, 4)
    no_bias.bias = None
    no_bias(x).sum().backward()
    assert calls == [1, 1, 1]
    mnn.GroupNorm(2, 4, affine=False)(x).sum().backward()
    mnn.GroupNorm(2, 4, bits=4, estimator="learned")(x).sum().backward()
    mnn.GroupNorm(2, 4).eval()(x).sum().backward()
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_fused_norms_are_bitwise_the_python_function_over_several_tasks(norm, channels_last, dtype, monkeypatch):
    """(4, 6, 37, 41), 36408 elements: the CPU loop that standardises x (csrc/standardise.cpp)
    splits it into two parallel tasks, of whole (sample, channel) planes or of positions (the
    small shapes above fit in one)."""
    def run(fused):
        layer = mnn.BatchNorm2d(6, dtype=dtype) if norm == "batch" else mnn.GroupNorm(3, 6, dtype=dtype)
        return _norm_run(fused, monkeypatch, layer, "cpu", (4, 6, 37, 41), channels_last, dtype, (True, True, True))

    assert_all_same_bits(run(True), run(False))


# ----------------------------------------------------------------------------- ReLU, SiLU, QuickGELU, Hardswish
MASKED = {"relu": lambda: mnn.ReLU(), "relu_inplace": lambda: mnn.ReLU(inplace=True),
          "relu6": lambda: mnn.ReLU6(), "relu6_inplace": lambda: mnn.ReLU6(inplace=True),
          "hardtanh": lambda: mnn.Hardtanh(-0.5, 2.0), "hardsigmoid": lambda: mnn.Hardsigmoid(),
          "hardsigmoid_inplace": lambda: mnn.Hardsigmoid(inplace=True)}


def _activation(kind, options):
    if kind in MASKED:
        return MASKED[kind]()
    return {"silu": mnn.SiLU, "quick_gelu": mnn.QuickGELU, "hardswish": mnn.Hardswish}[kind](**options)


ACT_SHAPES = {"4d": (2, 4, 5, 3), "channels_last": (2, 4, 5, 3), "3d": (3, 7, 6), "odd": (3, 5)}


def _activation_run(fused, monkeypatch, device, kind, layout, dtype, autocast, options):
    """Two training steps; for the in-place ReLU the input is a non-leaf it overwrites."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = _activation(kind, options)
    quantizers = [b for b in layer.buffers()]
    if hasattr(layer, "quantizer"):
        layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    out = []
    for step in range(2):
        # values on both sides of -3 and 3, and exact zeros and +-3 (the masks' edges)
        x0 = torch.randn(ACT_SHAPES[layout], generator=torch.Generator().manual_seed(step)) * 3
        x0.view(-1)[:4] = torch.tensor([0.0, 3.0, -3.0, -0.0])
        x0 = x0.to(device, dtype)
        if layout == "channels_last":
            x0 = x0.contiguous(memory_format=torch.channels_last)
        leaf = x0.requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            x = leaf * 1 if kind.endswith("_inplace") else leaf
            y = layer(x)
        if kind.endswith("_inplace"):
            assert y is x
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), leaf.grad, torch.tensor(meter.activation_bytes)]
    return out + [b.clone() for b in quantizers]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("layout", list(ACT_SHAPES))
@pytest.mark.parametrize("kind", list(MASKED) + ["silu", "quick_gelu", "hardswish"])
def test_fused_activation_is_bitwise_the_python_function(device, dtype, autocast, layout, kind, monkeypatch):
    args = (device, kind, layout, dtype, autocast, {})
    assert_all_same_bits(_activation_run(True, monkeypatch, *args), _activation_run(False, monkeypatch, *args))


@pytest.mark.parametrize("options", BN_OPTIONS[1:], ids=str)
@pytest.mark.parametrize("kind", ["silu", "quick_gelu", "hardswish"])
def test_fused_activation_options_are_bitwise_the_python_function(kind, options, monkeypatch):
    args = ("cpu", kind, "4d", torch.float32, False, options)
    assert_all_same_bits(_activation_run(True, monkeypatch, *args), _activation_run(False, monkeypatch, *args))


@pytest.mark.parametrize("kind", ["relu", "relu6", "hardsigmoid", "silu", "quick_gelu", "hardswish"])
def test_fused_activation_runs_only_in_eager_training(kind, monkeypatch):
    op = "mask_train" if kind in MASKED else "elementwise_train"
    calls = count_calls(monkeypatch, op)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    _activation(kind, {})(x).sum().backward()
    assert calls == [1]
    _activation(kind, {}).eval()(x).sum().backward()
    _activation(kind, {})(x.detach())
    if kind not in MASKED:  # (a mask has no format)
        _activation(kind, dict(bits=4, estimator="learned"))(x).sum().backward()  # learned: the Python Function
        assert calls == [1]
        _activation(kind, dict(bits=4))(x).sum().backward()  # a variant format: the C++ op
        assert calls == [1, 1]
    assert calls == [1] * len(calls) and len(calls) == (1 if kind in MASKED else 2)


@pytest.mark.parametrize("kind", ["relu", "hardsigmoid", "hardswish"])
def test_fused_activation_higher_order_gradients_are_a_clear_error(kind, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(_activation(kind, {})(x).pow(2).sum(), x, create_graph=True)


def test_fused_inplace_relu_on_a_leaf_is_refused_as_stock_does(monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    leaf = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        torch.nn.ReLU(inplace=True)(leaf)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        mnn.ReLU(inplace=True)(leaf)


# ----------------------------------------------------------------------------- the variant formats
VARIANT_LAYERS = {"batchnorm": lambda o: mnn.BatchNorm2d(4, **o), "batchnorm1d": lambda o: mnn.BatchNorm1d(4, **o),
                  "groupnorm": lambda o: mnn.GroupNorm(2, 4, quant_options=o),
                  "silu": lambda o: mnn.SiLU(**o), "quick_gelu": lambda o: mnn.QuickGELU(**o),
                  "hardswish": lambda o: mnn.Hardswish(**o)}
VARIANT_OPS = {"batchnorm": "batch_norm_train", "batchnorm1d": "batch_norm_train", "groupnorm": "group_norm_train",
               "silu": "elementwise_train", "quick_gelu": "elementwise_train", "hardswish": "elementwise_train"}


def _variant_run(fused, monkeypatch, device, name, options, layout, dtype):
    """Two training steps of one layer in a variant format; the first input holds NaN-free edge
    values (0, +-3, -0); returns outputs, gradients, the bytes kept and the buffers after."""
    calls = count_calls(monkeypatch, VARIANT_OPS[name])
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = VARIANT_LAYERS[name](options).to(device, dtype)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    shape = {"nchw": (2, 4, 5, 3), "channels_last": (2, 4, 5, 3), "3d": (3, 4, 7)}[layout]
    out = []
    for step in range(2):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step)) * 3 + step
        x.view(-1)[:4] = torch.tensor([0.0, 3.0, -3.0, -0.0])
        x = x.to(device, dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        with SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    assert len(calls) == (2 if fused else 0)  # the C++ op ran where asked, and only there
    return out + [p.grad for p in layer.parameters()] + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", VARIANTS, ids=str)
@pytest.mark.parametrize("name,layout", [(name, layout) for name in VARIANT_LAYERS
                                         for layout in ("nchw", "channels_last", "3d")
                                         if (name == "batchnorm1d") == (layout == "3d") or name != "batchnorm"
                                         and name != "batchnorm1d"])
def test_fused_layers_take_the_variant_formats_bitwise_the_python_function(name, layout, options, dtype, device,
                                                                           monkeypatch):
    """mesa.bits=4|2 and scale=pow2: the BatchNorm, GroupNorm and elementwise C++ ops keep
    mesa::quantize_bits' packed codes and read them back with dequantize_bits, the same bits as
    the Python Functions (a channels-last input through its NHWC view on both paths); also
    the bytes kept (4 or 2 bits a value)."""
    args = (device, name, options, layout, dtype)
    got, want = _variant_run(True, monkeypatch, *args), _variant_run(False, monkeypatch, *args)
    assert_all_same_bits(got, want)


def test_the_layer_ops_name_the_formats_they_take(monkeypatch):
    """A variant code where an op keeps 8-bit codes only (mesa::compress), a code no format
    has and a shared copy's format no format has (matmul_train): one clear error each (the
    Python layers never pass them: ActivationQuantizer.fused_layer_args, format_code)."""
    q = mnn.Softmax(-1, bits=4).quantizer
    state = (q.alpha, q.beta, q.initialized, q.rng, 1, 0.9)
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=r"mesa::compress: estimator must be 0 \(running\), 1 \(per_sample\) or 2"):
        torch.ops.mesa.compress(x, q.alpha, q.beta, q.initialized, q.rng, 1, 1, 0.9,
                                quantizer_mod.layer_op_code(q.options), False, True, 0, 0)
    no_operand = ([], 0, 0.0, 0, False, False)
    for bad in (1, 4 * 3, 64, 128):  # an estimator's code; 3 bits; pow2 without bits; past the last flag
        with pytest.raises(ValueError, match=rf"shared copy format {bad} is not valid"):
            torch.ops.mesa.matmul_train(x, x.t(), [], 0, 0, [], 0, 0, *no_operand, *no_operand, bad, 0)
    for bad in (3, 4 * 3, 64, 200):  # estimator 3; 3 bits; pow2 without bits; past the last flag
        with pytest.raises(ValueError, match=rf"estimator code {bad} is not valid"):
            torch.ops.mesa.elementwise_train(x, 0, *state, bad, False, True)
    with pytest.raises(ValueError, match=r"the delayed estimator takes the default 8-bit format only"):
        torch.ops.mesa.elementwise_train(x, 0, *state, 2 + 4 * 2, False, True)
