"""``mesa::grn_train`` (csrc/grn_autograd.cpp): ConvNeXt-V2's GlobalResponseNorm as one C++ layer
op, against the Python Function it replaces in eager training (``grn._GrnFn``): the same outputs,
gradients, bytes kept, estimates and seeds, bit for bit, in every format the op takes; and where
the Python Function still runs."""
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

# layout: (the layer's channels_last option, x's shape, x in channels-last memory): timm's
# ConvNeXt-V2 MLP (NHWC tensors), the NCHW form, and the NCHW form on a channels-last map
LAYOUTS = {"nhwc": (True, (2, 3, 4, 6), False), "nchw": (False, (2, 6, 3, 4), False),
           "nchw_channels_last": (False, (2, 6, 3, 4), True)}
# dtype: of x and the parameters alike, or x in bfloat16 with float32 parameters (mixed)
DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
          "mixed": (torch.bfloat16, torch.float32)}
VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
            dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2)]


def _layer(layout: str, device, dtype, options) -> mnn.GlobalResponseNorm:
    """Weight and bias away from timm's zeros (zero weight would hide most of the backward)."""
    channels_last, shape, _ = LAYOUTS[layout]
    dim = shape[-1] if channels_last else shape[1]
    layer = mnn.GlobalResponseNorm(dim, channels_last=channels_last, **options)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-0.5, 1.0, dim))
        layer.bias.copy_(torch.linspace(0.2, -0.3, dim))
    return layer.to(device, dtype)


def _input(layout: str, seed: int, device, dtype) -> torch.Tensor:
    channels_last, shape, cl_memory = LAYOUTS[layout]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2 + 0.3 * seed
    if channels_last:
        x[0, :, :, 0] = 0.0  # a channel whose norm is 0 (its x-gradient term is 0, as torch's norm)
    else:
        x[0, 0] = 0.0
    x = x.to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if cl_memory else x


def _run(fused, monkeypatch, device, layout, dtypes, options, needs=(True, True, True)):
    """Two training steps of one GRN: outputs, the gradients asked for (x's, weight's, bias's;
    ``None`` for the others), the bytes kept, then the buffers (estimates, seeds)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x_dtype, p_dtype = DTYPES[dtypes]
    layer = _layer(layout, device, p_dtype, options)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    layer.weight.requires_grad_(needs[1])
    layer.bias.requires_grad_(needs[2])
    out = []
    for step in range(2):
        layer.zero_grad(set_to_none=True)
        x = _input(layout, step, device, x_dtype).requires_grad_(needs[0])
        with SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, layer.weight.grad, layer.bias.grad, torch.tensor(meter.activation_bytes)]
    return out + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_grn_is_bitwise_the_python_function(layout, dtypes, device, monkeypatch):
    """The default 8-bit format, a zero-norm channel among them; both layouts, channels-last
    memory, float32, bfloat16 and bfloat16 activations with float32 parameters."""
    assert_op_path_is_the_python_path(monkeypatch, "grn_train", _run, device, layout, dtypes, {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", VARIANTS, ids=str)
@pytest.mark.parametrize("layout", ["nhwc", "nchw_channels_last"])
def test_fused_grn_takes_the_variant_formats_bitwise(layout, options, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "grn_train", _run, device, layout, "float32", options)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["x-only", "weight-only", "bias-only"])
def test_fused_grn_keeps_only_what_the_asked_gradients_read(needs, monkeypatch):
    """One gradient asked for at a time: the same gradients and bytes kept on both paths (x's
    codes only where x's or weight's gradient is asked for)."""
    assert_op_path_is_the_python_path(monkeypatch, "grn_train", _run, "cpu", "nhwc", "float32", {}, needs)


def test_python_function_runs_where_the_op_cannot(monkeypatch):
    """Learned thresholds keep the Python Function; eval and disabled layers run stock."""
    calls = count_calls(monkeypatch, "grn_train")
    x = torch.randn(2, 3, 4, 6, requires_grad=True)
    y = mnn.GlobalResponseNorm(6, bits=4, estimator="learned")(x)
    assert y.grad_fn.name() == "_GrnFnBackward"
    mnn.GlobalResponseNorm(6).eval()(x)
    mnn.GlobalResponseNorm(6, enabled=False)(x)
    assert calls == []
    y = mnn.GlobalResponseNorm(6, bits=2)(x)
    assert "GrnTrain" in y.grad_fn.name() and calls == [1]


def test_the_op_names_its_valid_arguments():
    layer = mnn.GlobalResponseNorm(6)
    q = layer.quantizer
    state = ([q.alpha, q.beta, q.initialized, q.rng], 1, 0.9, 0, False, True)
    with pytest.raises(ValueError, match=r"grn_train: x must be 4-d \(NCHW, or NHWC\) with channel_dim 1 or -1, "
                                         r"got a 3-d x and channel_dim -1"):
        torch.ops.mesa.grn_train(torch.randn(2, 3, 6), layer.weight, layer.bias, 1e-6, [1], -1, [1, 1, -1], *state)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        x = torch.randn(2, 3, 4, 6, requires_grad=True)
        torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("options", [{}, dict(bits=4)], ids=str)
def test_patched_convnext_v2_runs_every_grn_on_the_op_bitwise_the_python_function(options, monkeypatch):
    """ConvNeXt-V2's MLPs (one GRN a block): two training steps with drop-path on give the same
    outputs, parameter gradients and buffers on both paths, every GRN on the op."""
    name = "convnextv2_atto"
    model = patch_model(build(name, drop=True), **options)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "grn_train",
                                      mnn.GlobalResponseNorm)
