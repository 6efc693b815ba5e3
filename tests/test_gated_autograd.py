"""``mesa::gated_train`` (csrc/gated_autograd.cpp): the gated product ``act(a) * b`` of SwiGLU /
GEGLU MLPs and the plain products of gMLP, FocalNet, StarNet, CoaT and MambaOut as one C++ layer
op, against the Python Function it replaces in eager training (``activations._GatedFn``): the
same outputs, gradients, bytes kept, estimates and seeds, bit for bit; and where the Python
Function still runs."""
from __future__ import annotations

import pytest
import torch
from timm.layers.activations import QuickGELU as TimmQuickGELU
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

from kernel_marks import DEVICES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

ACTS = {"identity": nn.Identity, "silu": nn.SiLU, "silu_inplace": lambda: nn.SiLU(inplace=True), "gelu": nn.GELU,
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "sigmoid": nn.Sigmoid, "tanh": nn.Tanh,
        "quick_gelu": TimmQuickGELU}
# (a, b) shapes: tokens; FocalNet's per-channel-map gate broadcasting over b's channels; a
# channels-last pair (the codes of an NCHW copy, as the Python Function keeps)
SHAPES = {"tokens": ((3, 7, 8), (3, 7, 8)), "broadcast": ((2, 6, 5, 5), (2, 1, 5, 5)),
          "channels_last": ((2, 6, 5, 3), (2, 6, 5, 3))}
# the timm families whose patched models hold GatedActivation layers (patch/gating.py, patch/mlp.py)
GATED_MODELS = ["eva02_tiny_patch14_224", "focalnet_tiny_srf", "mambaout_femto", "gmlp_s16_224", "starnet_s1",
                "coat_lite_tiny"]
VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
            dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2)]


def _operand(shape, seed, device, dtype, layout):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2 + seed
    t.view(-1)[:3] = torch.tensor([0.0, -0.0, 3.0])  # signed zeros and a round value through the codes
    t = t.to(device, dtype)
    return t.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else t


def _run(fused, monkeypatch, device, act, shapes, dtype, options, gate_last=False, needs=(True, True)):
    """Two training steps of one GatedActivation: outputs, the gradients asked for (``None``
    for the other), the bytes kept, then the buffers (estimates, seeds)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    layer = mnn.GatedActivation(ACTS[act](), gate_last=gate_last, **options).to(device)
    for q in (layer.quantizer_a, layer.quantizer_b):
        q.rng.copy_(torch.tensor([55, 0]))
    out = []
    for step in range(2):
        a, b = (_operand(s, 2 * step + i, device, dtype, shapes) for i, s in enumerate(SHAPES[shapes]))
        a.requires_grad_(needs[0])
        b.requires_grad_(needs[1])
        with SavedTensorMeter() as meter:
            y = layer(a, b)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), a.grad, b.grad, torch.tensor(meter.activation_bytes)]
    return out + [buf.clone() for buf in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("act", list(ACTS))
def test_fused_gated_product_is_bitwise_the_python_function(act, shapes, dtype, device, monkeypatch):
    """Every activation the op evaluates (SiLU(inplace=True): out of place, the same values),
    tokens, FocalNet's broadcasting gate (autograd sums each gradient to its operand's shape)
    and a channels-last pair, float32 and bfloat16, the default 8-bit format."""
    assert_op_path_is_the_python_path(monkeypatch, "gated_train", _run, device, act, shapes, dtype, {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", VARIANTS, ids=str)
@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("act", ["identity", "silu"])
def test_fused_gated_product_takes_the_variant_formats_bitwise(act, shapes, options, device, monkeypatch):
    """mesa.bits=4|2, scale=pow2, per-sample estimates: quantize_bits' packed codes, read back
    with dequantize_bits, the Python Function's bits (and 4 or 2 bits a value kept)."""
    assert_op_path_is_the_python_path(monkeypatch, "gated_train", _run, device, act, shapes, torch.float32, options)


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["gate-only", "value-only"])
@pytest.mark.parametrize("act,gate_last", [("sigmoid", True), ("gelu", False), ("identity", True)])
def test_fused_gated_product_keeps_only_what_the_asked_gradients_read(act, gate_last, needs, monkeypatch):
    """A frozen operand: b's codes only where a's gradient is asked for (b's reads act(a) alone),
    a's wherever either is; the bytes kept say so on both paths (``_run`` returns them)."""
    assert_op_path_is_the_python_path(monkeypatch, "gated_train", _run, "cpu", act, "tokens", torch.float32, {},
                                      gate_last, needs)
    with SavedTensorMeter() as meter:
        mnn.GatedActivation(nn.SiLU())(torch.randn(4, 8), torch.randn(4, 8, requires_grad=True))
    assert meter.activation_bytes == 4 * 8 + 2 * 4  # a's 8-bit codes and one group's (alpha, beta)


def test_python_function_runs_where_the_op_cannot(monkeypatch):
    """An activation the op does not evaluate (ReLU6: autograd through the module), one with a
    hook (the op would skip it), a Mesa QuickGELU (a layer of its own), a plain function, learned
    thresholds and eval / disabled layers keep their Python paths; the others take the op."""
    calls = count_calls(monkeypatch, "gated_train")
    a, b = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    hooked = nn.SiLU()
    hooked.register_forward_hook(lambda *_: None)
    for act, options in ((nn.ReLU6(), {}), (hooked, {}), (mnn.QuickGELU(), {}), (torch.nn.functional.silu, {}),
                         (nn.SiLU(), dict(bits=4, estimator="learned"))):
        y = mnn.GatedActivation(act, **options)(a, b)
        assert y.grad_fn.name() == "_GatedFnBackward", act
        y.sum().backward()
    assert calls == []
    mnn.GatedActivation(nn.SiLU()).eval()(a, b)
    mnn.GatedActivation(nn.SiLU(), enabled=False)(a, b)
    assert calls == []
    y = mnn.GatedActivation(nn.SiLU(), bits=2)(a, b)
    assert "GatedTrain" in y.grad_fn.name() and calls == [1]


def test_the_op_names_its_valid_arguments():
    """Bad arguments from a direct call: one clear error each (the layer never passes them)."""
    q = mnn.GatedActivation(nn.SiLU()).quantizer_a
    state = ([q.alpha, q.beta, q.initialized, q.rng], 1, 0.9, 0, False, True)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"act must be 0 \(identity\), 1 \(silu\), .* or 6 \(quick_gelu\), got 7"):
        torch.ops.mesa.gated_train(x, x, 7, False, *state, *state)
    with pytest.raises(ValueError, match=r"the operands must have at least one dim, got 0-d and 2-d"):
        torch.ops.mesa.gated_train(torch.tensor(2.0), x, 0, False, *state, *state)
    with pytest.raises(ValueError, match=r"estimator code 3 is not valid"):
        torch.ops.mesa.gated_train(x, x, 0, False, *state[:3], 3, *state[4:], *state)
    with pytest.raises(RuntimeError, match=r"a quantizer state is \[alpha_est, beta_est, initialized, rng\], got 2"):
        torch.ops.mesa.gated_train(x, x, 0, False, [q.alpha, q.beta], *state[1:], *state)


@pytest.mark.parametrize("name,options", [(name, {}) for name in GATED_MODELS] + [
    (name, dict(bits=4)) for name in ("eva02_tiny_patch14_224", "mambaout_femto", "starnet_s1")], ids=str)
def test_patched_models_run_every_gate_on_the_op_bitwise_the_python_function(name, options, monkeypatch):
    """The timm call sites (EVA-02's SwiGLU, FocalNet's broadcasting gates, MambaOut's GELU gate,
    gMLP's transposed v, StarNet, CoaT): two training steps with dropout and drop-path on give
    the same outputs, parameter gradients and buffers on both paths, every gate on the op."""
    model = patch_model(build(name, drop=True), **options)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "gated_train",
                                      mnn.GatedActivation)
