"""The Mesa RmsNorm's C++ layer op (``mesa::rms_norm_train``, csrc/rmsnorm_autograd.cpp) is bitwise
its Python Function (``rmsnorm._RmsNormFn``): outputs, input and weight gradients, the bytes kept
and the quantizer's buffers, over two training steps; and where it must not run."""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn import rmsnorm
from mesa_train.patch import patch_model
from kernel_marks import DEVICES, cpu_uniform
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not rmsnorm._OP, reason="needs the compiled extension and timm's torch rms_norm")

# (input shape, normalized_shape): tokens; two normalised dims
SHAPES = {"tokens": ((2, 5, 8), (8,)), "two-dims": ((2, 3, 4, 8), (4, 8))}
OPTIONS = [dict(), dict(row_scale=False), dict(estimator="per_sample", symmetric=True, rounding="nearest"),
           dict(estimator="delayed"), dict(bits=4), dict(bits=2, scale="pow2")]


def _run(fused, monkeypatch, device, shape, dtype, autocast, options, grads, affine=True, cls=mnn.RmsNorm):
    """Two training steps of a Mesa RmsNorm (``dtype`` None: float32 under bf16 autocast);
    ``grads``: whether x and the weight want a gradient."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x_shape, normalized_shape = SHAPES[shape]
    layer = cls(normalized_shape, elementwise_affine=affine, device=device, dtype=dtype, **options)
    if affine:
        with torch.no_grad():
            layer.weight.copy_(cpu_uniform(layer.weight.shape, 0.5, 1.5, seed=0))
        layer.weight.requires_grad_(grads[1])
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    out = []
    for step in range(2):
        x = torch.randn(x_shape, generator=torch.Generator().manual_seed(step)) * (step + 1)
        x[0, 0] *= 1e-4  # a small row: row scales at work where they are on
        x = x.to(device, dtype or torch.float32).requires_grad_(grads[0])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype is None), SavedTensorMeter() as meter:
            y = layer(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out + [p.grad for p in layer.parameters()] + [b.clone() for b in layer.quantizer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None], ids=["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_op_is_bitwise_the_python_function(device, dtype, shape, options, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "rms_norm_train", _run, device, shape, dtype, dtype is None,
                                      options, (True, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grads,affine", [((False, True), True), ((True, False), True), ((True, None), False)],
                         ids=["frozen-x", "frozen-weight", "no-weight"])
def test_op_which_gradients_and_no_weight(device, grads, affine, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "rms_norm_train", _run, device, "tokens", torch.float32, False, {},
                                      grads, affine)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_compute_variant_takes_the_op(device, monkeypatch):
    """timm's RmsNormFp32 (DeepSeek's ViT): float32 copies of a bf16 input and weight in, bf16 out."""
    assert_op_path_is_the_python_path(monkeypatch, "rms_norm_train", _run, device, "tokens", torch.bfloat16, False,
                                      {}, (True, True), True, mnn.RmsNormFp32)


def test_op_runs_only_where_it_may(monkeypatch):
    """Eager training with a channel format: the op; learned thresholds: the Python Function; eval
    and no gradient: stock. A wrong shape is the op's one-line error."""
    calls = count_calls(monkeypatch, "rms_norm_train")
    x = torch.randn(2, 5, 8, requires_grad=True)
    mnn.RmsNorm(8)(x).sum().backward()
    mnn.RmsNorm(8, bits=4)(x).sum().backward()
    assert calls == [1, 1]
    mnn.RmsNorm(8, bits=4, estimator="learned")(x).sum().backward()
    mnn.RmsNorm(8).eval()(x)
    with torch.no_grad():
        mnn.RmsNorm(8)(x)
    assert calls == [1, 1]
    norm = mnn.RmsNorm(8)
    with pytest.raises(ValueError, match=r"mesa: rms_norm_train: x's last dims .* must be normalized_shape"):
        torch.ops.mesa.rms_norm_train(x[..., :4], [8], None, 1e-6, *norm.quantizer.fused_layer_args(x), True)


def test_second_derivative_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(mnn.RmsNorm(8)(x).pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("name", ["vit_base_patch16_xp_224", "gemma4_vit_167m", "deepseek_vit_412m"])
def test_patched_models_run_every_rmsnorm_on_the_op(name, monkeypatch):
    """ViT-XP, Gemma-4's and DeepSeek's ViTs patched, two training steps with drop-path on: the
    same outputs, gradients and buffers on the op as on the Python Function, every RmsNorm on
    the op."""
    model = patch_model(build(name, drop=True))
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "rms_norm_train",
                                      mnn.RmsNorm)
