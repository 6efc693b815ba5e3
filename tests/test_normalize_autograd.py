"""``mesa::normalize_train`` (csrc/normalize_autograd.cpp): cosine attention's ``F.normalize`` of q
and k (XCiT, SwinV2, EdgeNeXt) as one C++ layer op, against the Python Function it replaces in
eager training (``normalize._NormalizeFn``): the same outputs, gradients, bytes kept, estimates
and seeds, bit for bit, in every format the op takes; and where the Python Function still runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

from bit_patterns import assert_all_same_bits
from kernel_marks import DEVICES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

# (x shape, dim): SwinV2's (B*windows, heads, N, d) along d; XCiT's transposed (B, heads, d, N)
# along N (the same call); 3-D tokens; a 4-D x normalised along a middle dim
CASES = {"heads": ((2, 3, 5, 8), -1), "tokens": ((3, 7, 6), -1), "middle_dim": ((2, 3, 5, 4), 2)}
VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"), dict(bits=8, scale="pow2"),
            dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2)]


def _input(case: str, seed: int, device, dtype) -> torch.Tensor:
    shape, dim = CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2 + 0.3 * seed
    x.select(dim, 0).zero_()  # (nothing special: a zero column)
    x.view(-1)[: shape[-1]] = 0.0  # a zero row along the last dim: its norm clamped to eps
    return x.to(device, dtype)


def _run(fused, monkeypatch, device, case, dtype, options):
    """Two training steps of one Normalize: outputs, x's gradient, the bytes kept, the buffers."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    layer = mnn.Normalize(**options).to(device)
    layer.quantizer.rng.copy_(torch.tensor([55, 0]))
    _, dim = CASES[case]
    out = []
    for step in range(2):
        x = _input(case, step, device, dtype).requires_grad_()
        with SavedTensorMeter() as meter:
            y = layer(x, dim=dim, eps=1e-6)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_normalize_is_bitwise_the_python_function(case, dtype, device, monkeypatch):
    """The default 8-bit format, a clamped row among them; the forward is F.normalize's bits."""
    assert_op_path_is_the_python_path(monkeypatch, "normalize_train", _run, device, case, dtype, {})
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", True)
    x = _input(case, 0, device, dtype).requires_grad_()
    assert_all_same_bits([mnn.Normalize()(x, CASES[case][1]).detach()], [F.normalize(x, dim=CASES[case][1]).detach()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", VARIANTS, ids=str)
def test_fused_normalize_takes_the_variant_formats_bitwise(options, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "normalize_train", _run, device, "heads", torch.float32, options)


def test_python_function_runs_where_the_op_cannot(monkeypatch):
    """Learned thresholds keep the Python Function; eval and disabled layers run stock."""
    calls = count_calls(monkeypatch, "normalize_train")
    x = torch.randn(2, 3, 4, requires_grad=True)
    y = mnn.Normalize(bits=4, estimator="learned")(x)
    assert y.grad_fn.name() == "_NormalizeFnBackward"
    mnn.Normalize().eval()(x)
    mnn.Normalize(enabled=False)(x)
    assert calls == []
    y = mnn.Normalize(bits=2)(x)
    assert "NormalizeTrain" in y.grad_fn.name() and calls == [1]
    with SavedTensorMeter() as meter:
        mnn.Normalize()(x)
    assert meter.activation_bytes == 2 * 3 * 4 + 2 * 4 + 2 * 3 * 4  # y's codes, one group's range, n (fp32)


def test_the_op_names_its_valid_arguments():
    q = mnn.Normalize().quantizer
    state = ([q.alpha, q.beta, q.initialized, q.rng], 1, 0.9, 0, False, True)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"normalize_train: x must have at least one dim, got a 0-d tensor"):
        torch.ops.mesa.normalize_train(torch.tensor(2.0), -1, 1e-12, *state)
    with pytest.raises(IndexError, match=r"normalize_train: dim must be in \[-2, 1\] for a 2-d x, got 2"):
        torch.ops.mesa.normalize_train(x, 2, 1e-12, *state)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        xg = x.clone().requires_grad_()
        torch.autograd.grad(mnn.Normalize()(xg).pow(3).sum(), xg, create_graph=True)


@pytest.mark.parametrize("name,options", [("xcit_nano_12_p16_224", {}), ("swinv2_tiny_window8_256", {}),
                                          ("edgenext_xx_small", {}), ("xcit_nano_12_p16_224", dict(bits=4))], ids=str)
def test_patched_models_run_every_normalize_on_the_op_bitwise_the_python_function(name, options, monkeypatch):
    """The timm call sites (XCiT's cross-covariance attention, SwinV2's cosine attention,
    EdgeNeXt's transposed attention): two training steps with dropout and drop-path on give the
    same outputs, parameter gradients and buffers on both paths, every Normalize on the op."""
    model = patch_model(build(name, drop=True), **options)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "normalize_train",
                                      mnn.Normalize)
