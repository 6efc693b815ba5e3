"""The C++ fast path of the Mesa layer scales (``mesa::scale_train``, csrc/scale_autograd.cpp: ``x * gamma``
with a C++ autograd node) is bitwise the Python ``_ScaleFn``: outputs, both gradients, the estimate and
rounding-counter buffers afterwards, and the bytes kept; for every form the layers take (a per-channel
gamma with row scales, an NCHW layer scale, channels-last inputs, a per-head logit scale, a squeeze-excite
gate) and where it must not run."""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from kernel_marks import DEVICES
from op_calls import count_calls
from bit_patterns import assert_all_same_bits

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

# form: (x shape, gamma shape, channels-last x)
FORMS = {
    "layerscale": ((2, 7, 6), (6,), False),              # LayerScale: tokens, gamma per channel (last dim)
    "small_rows": ((2, 7, 6), (6,), False),             # ... with rows far below the others (row scales)
    "nchw": ((2, 6, 5, 3), (1, 6, 1, 1), False),        # LayerScale2d
    "nchw_channels_last": ((2, 6, 5, 3), (1, 6, 1, 1), True),
    "metaformer": ((2, 6, 5, 3), (6, 1, 1), False),     # MetaFormer's Scale (dim, 1, 1)
    "logit_scale": ((2, 3, 5, 5), (3, 1, 1), False),    # cosine attention's per-head scale
    "se_gate": ((2, 6, 5, 3), (2, 6, 1, 1), False),     # squeeze-excite x * gate(x)
    "se_gate_channels_last": ((2, 6, 5, 3), (2, 6, 1, 1), True),
}


def _run(fused, monkeypatch, device, form, dtype, autocast, options, grads):
    """Two training steps of ``ChannelScale`` (``x * gamma``, the Function every layer-scale form
    runs) on ``form``; ``gamma`` a leaf (a parameter) or, for the gates, computed from x."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x_shape, g_shape, channels_last = FORMS[form]
    layer = mnn.ChannelScale(num_groups=x_shape[1] if len(g_shape) > 1 else 3, device=device, **options)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    gen = torch.Generator().manual_seed(0)
    gamma0 = (torch.rand(g_shape, generator=gen) + 0.5).to(device, dtype)
    out = []
    for step in range(2):
        x = torch.randn(x_shape, generator=gen) * (step + 1)
        if form == "small_rows":
            x[0, :3] *= 1e-6
        x = x.to(device, dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(grads[0])
        gamma = gamma0.clone().requires_grad_(grads[1])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = layer(x, gamma)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, gamma.grad, torch.tensor(meter.activation_bytes)]
    return out + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)], ids=str)
@pytest.mark.parametrize("form", list(FORMS))
def test_fused_scale_is_bitwise_the_python_function(device, dtype, autocast, form, monkeypatch):
    args = (device, form, dtype, autocast, {}, (True, True))
    assert_all_same_bits(_run(True, monkeypatch, *args), _run(False, monkeypatch, *args))


@pytest.mark.parametrize("options", [dict(row_scale=False), dict(estimator="per_sample"), dict(estimator="delayed"),
                                     dict(symmetric=True), dict(rounding="nearest")], ids=str)
@pytest.mark.parametrize("grads", [(True, True), (False, True), (True, False)], ids=str)
@pytest.mark.parametrize("form", ["small_rows", "se_gate"])
def test_fused_scale_options_and_gradients(form, options, grads, monkeypatch):
    args = ("cpu", form, torch.float32, False, options, grads)
    assert_all_same_bits(_run(True, monkeypatch, *args), _run(False, monkeypatch, *args))


def test_the_layer_scales_take_the_fused_op_in_eager_training_only(monkeypatch):
    calls = count_calls(monkeypatch, "scale_train")
    x = torch.randn(2, 6, 5, 3, requires_grad=True)
    mnn.LayerScale(3)(x).sum().backward()
    mnn.LayerScale2d(6)(x).sum().backward()
    mnn.ChannelScale()(x, torch.rand(1, 6, 1, 1, requires_grad=True)).sum().backward()
    assert calls == [1, 1, 1]
    mnn.LayerScale(3).eval()(x).sum().backward()
    mnn.LayerScale(3, bits=4, estimator="learned")(x).sum().backward()  # learned thresholds: the Python Function
    assert calls == [1, 1, 1]
    mnn.LayerScale(3, bits=4)(x).sum().backward()  # a channel variant format: the C++ op
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", [dict(bits=4), dict(bits=2, scale="pow2"),
                                     dict(bits=8, scale="pow2", row_scale=False),
                                     dict(bits=4, estimator="per_sample", rounding="nearest")], ids=str)
@pytest.mark.parametrize("form", ["small_rows", "nchw_channels_last", "logit_scale", "se_gate"])
def test_fused_scale_takes_the_variant_formats_bitwise_the_python_function(form, options, dtype, monkeypatch):
    """mesa.bits=4|2, scale=pow2: the packed codes of quantize_bits (the rows scaled first,
    as ActivationQuantizer._compress does, and unscaled after dequantize_bits), the same bits
    as _ScaleFn, on the C++ op each step."""
    args = ("cpu", form, dtype, False, options, (True, True))
    calls = count_calls(monkeypatch, "scale_train")
    got = _run(True, monkeypatch, *args)
    assert calls == [1, 1]
    assert_all_same_bits(got, _run(False, monkeypatch, *args))


def test_fused_scale_higher_order_gradients_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = torch.randn(2, 5, 6, requires_grad=True)
    layer = mnn.LayerScale(6)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
