"""The C++ layer ops of the two parameterised pointwise layers, against the Python Functions they
replace in eager training: ``mesa::star_relu_train`` (csrc/star_relu_autograd.cpp; MetaFormer's
``StarReLU``, ``scale * relu(x) ** 2 + bias``: ``star_relu._StarReLUFn``) and
``mesa::affine_train`` (csrc/scale_autograd.cpp; ResMLP's ``Affine``, ``addcmul(beta, alpha, x)``:
``layerscale._AffineFn``). The same outputs, gradients, bytes kept, estimates and seeds, bit for
bit, in every format the ops take; and where the Python Functions still run."""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

from kernel_marks import DEVICES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

OPS = {"star_relu": "star_relu_train", "affine": "affine_train"}
# x shapes: tokens; MetaFormer's (B, H, W, C) maps (4-D: groups along dim 1, as the Python
# Function's group_dim_4d); an NCHW map and its channels-last copy (the NHWC view's codes);
# Affine's x of fewer dims than alpha's (1, 1, C) (a gradient summed back by autograd)
SHAPES = {"tokens": (3, 7, 6), "bhwc": (2, 5, 3, 6), "nchw": (2, 6, 5, 3), "channels_last": (2, 6, 5, 3),
          "rows": (7, 6), "small_rows": (3, 7, 6)}
LAYER_SHAPES = {"star_relu": ["tokens", "bhwc", "nchw", "channels_last"],
                "affine": ["tokens", "bhwc", "rows", "small_rows"]}
CASES = [(layer, shape) for layer, shapes in LAYER_SHAPES.items() for shape in shapes]
# dtype: of x and the parameters alike, or x in bfloat16 with float32 parameters (mixed)
DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
          "mixed": (torch.bfloat16, torch.float32)}
VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2", row_scale=False),
            dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2)]


def _layer(name: str, channels: int, device, dtype, options) -> torch.nn.Module:
    """The layer with parameters away from their defaults (scale 1, bias 0 would hide a swap)."""
    if name == "star_relu":
        layer = mnn.StarReLU(scale_value=0.8, bias_value=-0.1, **options)
    else:
        layer = mnn.Affine(channels, **options)
        with torch.no_grad():
            layer.alpha.copy_(torch.linspace(0.5, 1.5, channels).view(1, 1, -1))
            layer.beta.copy_(torch.linspace(-0.2, 0.3, channels).view(1, 1, -1))
    return layer.to(device, dtype)


def _input(shape_name: str, seed: int, device, dtype) -> torch.Tensor:
    x = torch.randn(SHAPES[shape_name], generator=torch.Generator().manual_seed(seed)) * 2 + 0.3 * seed
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 3.0])  # signed zeros (relu's edge) and a round value
    if shape_name == "small_rows":  # rows far below the others: Affine's power-of-two row scales
        x[0, :3] *= 1e-6
    x = x.to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if shape_name == "channels_last" else x


def _run(fused, monkeypatch, device, name, shape_name, dtypes, options, needs=(True, True)):
    """Two training steps of one layer: outputs, the gradients asked for (x's; the parameters'
    or ``None`` when frozen), the bytes kept, then the buffers (estimates, seeds)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x_dtype, p_dtype = DTYPES[dtypes]
    layer = _layer(name, SHAPES[shape_name][-1], device, p_dtype, options)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    for p in layer.parameters():
        p.requires_grad_(needs[1])
    out = []
    for step in range(2):
        layer.zero_grad(set_to_none=True)
        x = _input(shape_name, step, device, x_dtype).requires_grad_(needs[0])
        with SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)] + [p.grad for p in layer.parameters()]
    return out + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("name,shape_name", CASES, ids=str)
def test_fused_layer_is_bitwise_the_python_function(name, shape_name, dtypes, device, monkeypatch):
    """The default 8-bit format: every input layout each layer meets, float32, bfloat16 and
    bfloat16 activations with float32 parameters."""
    assert_op_path_is_the_python_path(monkeypatch, OPS[name], _run, device, name, shape_name, dtypes, {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", VARIANTS, ids=str)
@pytest.mark.parametrize("name,shape_name", [("star_relu", "tokens"), ("star_relu", "channels_last"),
                                             ("affine", "small_rows")], ids=str)
def test_fused_layer_takes_the_variant_formats_bitwise(name, shape_name, options, device, monkeypatch):
    """mesa.bits=4|2, scale=pow2, per-sample symmetric nearest: quantize_bits' packed codes read
    back with dequantize_bits (Affine's rows scaled first where row_scale is on), the Python
    Function's bits."""
    assert_op_path_is_the_python_path(monkeypatch, OPS[name], _run, device, name, shape_name, "float32", options)


@pytest.mark.parametrize("options", [{}, dict(estimator="delayed"), dict(row_scale=False)], ids=str)
@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["params-frozen", "input-frozen"])
@pytest.mark.parametrize("name", list(OPS))
def test_fused_layer_keeps_only_what_the_asked_gradients_read(name, needs, options, monkeypatch):
    """Frozen parameters or a frozen input: the gradients asked for and the bytes kept are the
    Python Function's (Affine keeps x only for alpha's gradient; StarReLU keeps relu(x) for
    either)."""
    assert_op_path_is_the_python_path(monkeypatch, OPS[name], _run, "cpu", name, "tokens", "float32", options,
                                      needs)
    affine = mnn.Affine(6)
    affine.alpha.requires_grad_(False)
    with SavedTensorMeter() as meter:
        affine(torch.randn(4, 6, requires_grad=True))
    assert meter.activation_bytes == 0  # alpha frozen: dx = g * alpha, dbeta = sum(g) keep nothing of x
    with SavedTensorMeter() as meter:
        mnn.StarReLU()(torch.randn(4, 8, requires_grad=True))
    assert meter.activation_bytes == 4 * 8 + 2 * 4  # relu(x)'s 8-bit codes and one group's (alpha, beta)


def test_python_function_runs_where_the_op_cannot(monkeypatch):
    """Learned thresholds keep the Python Functions; so does an Affine whose x broadcasts along
    the channels (the op takes one x channel per alpha); eval and disabled layers run stock."""
    calls = {op: count_calls(monkeypatch, op) for op in OPS.values()}
    x = torch.randn(3, 6, requires_grad=True)
    for layer, fn in ((mnn.StarReLU(bits=4, estimator="learned"), "_StarReLUFnBackward"),
                      (mnn.Affine(6, bits=4, estimator="learned"), "_AffineFnBackward")):
        y = layer(x)
        assert y.grad_fn.name() == fn
        y.sum().backward()
    y = mnn.Affine(6)(x[:, :1])
    assert y.grad_fn.name() == "_AffineFnBackward" and y.shape == (1, 3, 6)
    for layer in (mnn.StarReLU(), mnn.Affine(6)):
        layer.eval()(x)
        mnn.StarReLU(enabled=False)(x)
    assert calls == {"star_relu_train": [], "affine_train": []}
    assert "StarReluTrain" in mnn.StarReLU(bits=2)(x).grad_fn.name()
    assert "AffineTrain" in mnn.Affine(6, bits=2)(x).grad_fn.name()
    assert calls == {"star_relu_train": [1], "affine_train": [1]}


def test_fused_layers_refuse_higher_order_gradients(monkeypatch):
    x = torch.randn(2, 5, 6, requires_grad=True)
    for layer in (mnn.StarReLU(), mnn.Affine(6)):
        with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
            torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)


def test_the_ops_name_their_valid_arguments():
    """Bad arguments from a direct call: one clear error each (the layers never pass them)."""
    q = mnn.StarReLU().quantizer
    state = ([q.alpha, q.beta, q.initialized, q.rng], 1, 0.9, 0, False, True)
    x, p = torch.randn(4, 6), torch.ones(1)
    with pytest.raises(ValueError, match=r"star_relu_train: x must have at least one dim, got a 0-d tensor"):
        torch.ops.mesa.star_relu_train(torch.tensor(2.0), p, p, *state)
    with pytest.raises(ValueError, match=r"estimator code 3 is not valid"):
        torch.ops.mesa.star_relu_train(x, p, p, *state[:3], 3, *state[4:])
    with pytest.raises(RuntimeError, match=r"a quantizer state is \[alpha_est, beta_est, initialized, rng\], got 2"):
        torch.ops.mesa.star_relu_train(x, p, p, [q.alpha, q.beta], *state[1:])
    with pytest.raises(ValueError, match=r"alpha must hold one value per channel of x's last dim, got alpha of "
                                         r"shape \[1, 1, 5\] for x of shape \[4, 6\]"):
        torch.ops.mesa.affine_train(x, torch.ones(1, 1, 5), torch.ones(1, 1, 5), *state, True)


# the timm families whose patched models hold StarReLU (MetaFormer) or Affine (ResMLP) layers
MODELS = {"caformer_s18": "star_relu_train", "convformer_s18": "star_relu_train", "resmlp_12_224": "affine_train"}


@pytest.mark.parametrize("name,options", [(name, {}) for name in MODELS] + [
    ("convformer_s18", dict(bits=4)), ("resmlp_12_224", dict(bits=4))], ids=str)
def test_patched_models_run_every_layer_on_the_op_bitwise_the_python_function(name, options, monkeypatch):
    """The timm call sites (CAFormer's and ConvFormer's MLP and separable-conv StarReLUs,
    ResMLP's two Affines a block): two training steps with dropout and drop-path on give the
    same outputs, parameter gradients and buffers on both paths, every layer on the op."""
    layer_type = mnn.StarReLU if MODELS[name] == "star_relu_train" else mnn.Affine
    model = patch_model(build(name, drop=True), **options)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), MODELS[name],
                                      layer_type)
