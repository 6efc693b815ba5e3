"""estimator="learned" (DESIGN.md "Learned clipping"): the thresholds stay inside the running
range, the softmax backward stays finite whatever the thresholds, and Adam finds the
analytic optimum of the stated objective ``bias**2 + rounding variance / clip_horizon`` on
Gaussian data (so ``clip_horizon`` does what it says, and 1 is the stored tensor's error)."""
from __future__ import annotations

import math

import pytest
import torch

import mesa_train.nn as mn
from mesa_train.nn.quantizer import ActivationQuantizer, QuantOptions


def _learned(**kw) -> ActivationQuantizer:
    return ActivationQuantizer(QuantOptions(bits=2, estimator="learned", **kw))


def _force_thresholds(qz: ActivationQuantizer, center: float, lo_dist: float, hi_dist: float) -> None:
    """Thresholds ``center - lo_dist`` and ``center + hi_dist`` after a few training steps."""
    with torch.no_grad():
        qz.clip_center.fill_(center)
        qz.clip_log[0].fill_(math.log2(lo_dist))
        qz.clip_log[1].fill_(math.log2(hi_dist))
        qz.clip_steps.fill_(5.0)


def test_more_groups_than_channels_learn_in_the_first_entries():
    """num_groups above the grouped dim's size (a BatchNorm2d of 4 channels asked for 8, as one
    built directly can be): ``min(num_groups, D)`` groups, as for the running estimator, the
    codes and the first entries of the thresholds' buffers bit for bit those of a quantizer
    asked for exactly D groups, the rest untouched (this raised a size mismatch before)."""
    torch.manual_seed(0)
    wide, exact = _learned(num_groups=8), _learned(num_groups=4)
    exact.rng.copy_(wide.rng)  # (the same rounding draws)
    for step in range(3):
        x = torch.randn(2, 4, 5, 5) * torch.tensor([1.0, 3.0, 0.1, 10.0]).view(1, 4, 1, 1)
        got, want = wide.compress(x, 1), exact.compress(x, 1)
        assert torch.equal(got.q, want.q) and torch.equal(got.alpha, want.alpha), step
    for name in ("clip_center", "clip_log", "clip_m", "clip_v"):
        w, e = getattr(wide, name), getattr(exact, name)
        assert torch.equal(w[..., :4], e), name
        assert not w[..., 4:].any(), name
    assert wide.clip_steps.item() == exact.clip_steps.item() == 3


def test_a_batch_norm_with_more_groups_than_channels_trains():
    torch.manual_seed(0)
    bn = mn.BatchNorm2d.from_module(torch.nn.BatchNorm2d(4), num_groups=8, estimator="learned").train()
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    bn(x * 1).sum().backward()
    assert torch.isfinite(x.grad).all() and bn.quantizer.clip_steps.item() == 1


def test_thresholds_are_projected_onto_the_running_range():
    """Thresholds beyond the data's min/max clip nothing and only coarsen the step: the batch is
    quantized with them projected onto the running range (here [0, 1))."""
    qz = _learned()
    x = torch.rand(64, 32)
    qz.compress(x, -1)  # first call: thresholds = the batch's range
    _force_thresholds(qz, 0.5, 2.0, 2.0)  # unprojected: [-1.5, 2.5]
    p = qz.compress(x, -1)
    lo, hi = p.beta.item(), p.beta.item() + p.alpha.item()
    run_lo, run_hi = qz.beta.item(), qz.beta.item() + qz.alpha.item()
    assert lo == pytest.approx(run_lo) and hi == pytest.approx(run_hi), (lo, hi, run_lo, run_hi)
    assert 0.0 <= lo and hi <= 1.0


def test_center_outside_the_running_range_falls_back_to_it():
    qz = _learned()
    x = torch.rand(64, 32)
    qz.compress(x, -1)
    _force_thresholds(qz, 50.0, 0.1, 0.1)  # [49.9, 50.1]: disjoint from the data
    p = qz.compress(x, -1)
    assert p.beta.item() == pytest.approx(qz.beta.item())
    assert p.alpha.item() == pytest.approx(qz.alpha.item())


def test_softmax_backward_finite_with_wide_learned_thresholds():
    """Regression: thresholds far outside [0, 1] (Adam's momentum can carry them there) made
    dequantized softmax rows sum to <= 0, and the backward's row renormalisation divided by
    a clamped tiny sum: infinite gradients, NaN weights after one step."""
    torch.manual_seed(0)
    sm = mn.Softmax(dim=-1, num_groups=1, bits=2, estimator="learned")
    logits = torch.randn(8, 4, 17, 17)
    sm(logits.requires_grad_()).sum().backward()  # first call: thresholds = the batch's range
    _force_thresholds(sm.quantizer, 1.0 / 17, 10.0, 10.0)
    x = torch.randn(8, 4, 17, 17, requires_grad=True)
    y = sm(x)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all()


def _gaussian_objective(a: float, horizon: float, levels: int = 3) -> float:
    """Per-element ``rounding variance / horizon + clipping bias**2`` of N(0, 1) quantized on
    [-a, a] with ``levels`` steps (stochastic rounding's variance averaged over a step: step^2/6)."""
    phi = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    tail = 0.5 * math.erfc(a / math.sqrt(2))  # P(x > a)
    f_in = 1.0 - 2.0 * tail
    step = 2.0 * a / levels
    clip = 2.0 * ((1.0 + a * a) * tail - a * phi)  # 2 E[(x - a)_+^2]
    return f_in * step * step / 6.0 / horizon + clip


def _analytic_optimum(horizon: float) -> float:
    grid = [0.5 + 0.001 * i for i in range(4000)]
    return min(grid, key=lambda a: _gaussian_objective(a, horizon))


@pytest.mark.parametrize("horizon", [1.0, 16.0])
def test_adam_reaches_the_analytic_optimum_on_gaussian_data(horizon):
    torch.manual_seed(0)
    qz = _learned(clip_horizon=horizon, num_groups=1)
    seen = []
    for step in range(400):
        p = qz.compress(torch.randn(256, 256), -1)
        if step >= 300:
            seen.append(((p.alpha + p.beta).item(), -p.beta.item()))
    hi = sum(h for h, _ in seen) / len(seen)
    lo = sum(lo_ for _, lo_ in seen) / len(seen)
    target = _analytic_optimum(horizon)
    assert hi == pytest.approx(target, rel=0.08) and lo == pytest.approx(target, rel=0.08), (lo, hi, target)


def test_longer_horizon_clips_less():
    """The threshold grows with clip_horizon (1 -> 16 -> 256) toward the running range."""
    reached = []
    for horizon in (1.0, 16.0, 256.0):
        torch.manual_seed(0)
        qz = _learned(clip_horizon=horizon, num_groups=1)
        for _ in range(300):
            p = qz.compress(torch.randn(128, 256), -1)
        reached.append(p.alpha.item())
    assert reached[0] < reached[1] < reached[2] <= qz.alpha.item() + 1e-6, reached


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("inf"), float("nan"), "64", True])
def test_bad_clip_horizon_names_the_valid_range(bad):
    with pytest.raises(ValueError, match=r"clip_horizon must be a finite number >= 1"):
        QuantOptions(estimator="learned", clip_horizon=bad)


def test_clip_horizon_needs_the_learned_estimator():
    with pytest.raises(ValueError, match=r"valid estimators for it: 'learned'"):
        QuantOptions(clip_horizon=64)
    assert QuantOptions(estimator="learned", clip_horizon=64).clip_horizon == 64.0
    assert QuantOptions(clip_horizon=1).clip_horizon == 1.0


def test_patch_model_passes_clip_horizon_to_every_quantizer():
    import timm

    import mesa_train

    model = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=4)
    mesa_train.patch_model(model, bits=2, estimator="learned", clip_horizon=64)
    horizons = {m.options.clip_horizon for m in model.modules() if isinstance(m, ActivationQuantizer)}
    assert horizons == {64.0}
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_softmax_keeps_its_running_range():
    """A softmax's few large probabilities carry attention's gradient and its many small ones
    most of each row's mass: estimator="learned" quantizes it with the running range (learned
    thresholds on it alone cost a 4-bit digits DeiT 24 points, 13.5 with only the lower one),
    while other layers clip at their learned thresholds."""
    torch.manual_seed(0)
    sm = mn.Softmax(dim=-1, num_groups=1, bits=2, estimator="learned")
    gelu = mn.GELU(num_groups=1, bits=2, estimator="learned")
    assert not sm.quantizer.clippable and gelu.quantizer.clippable
    assert "not clipped: running range" in repr(sm.quantizer)
    seen = {}
    for name, layer in (("softmax", sm), ("gelu", gelu)):
        for _ in range(100):
            x = torch.randn(16, 4, 17, 17, requires_grad=True) * 3
            layer(x).sum().backward()
        p = layer.quantizer.compress(layer(torch.randn(16, 4, 17, 17) * 3).detach(), -1)
        qz = layer.quantizer
        seen[name] = (p.beta.item(), (p.alpha + p.beta).item(), qz.beta.item(), (qz.alpha + qz.beta).item())
    lo, hi, run_lo, run_hi = seen["softmax"]
    assert (lo, hi) == pytest.approx((run_lo, run_hi))
    lo, hi, run_lo, run_hi = seen["gelu"]
    assert hi < 0.9 * run_hi  # GELU's tail is clipped (2 bits, horizon 1)
    # rebuilding the layer keeps the rule
    assert not mn.Softmax.from_module(sm).quantizer.clippable
