"""QuantOptions validation and ActivationQuantizer running estimates."""
from __future__ import annotations

import warnings

import pytest
import torch

import mesa_train.nn as mn
from mesa_train.nn import ActivationQuantizer, QuantOptions, decompress

warnings.filterwarnings("ignore", message=".*compiled extension.*")


def test_options_validation():
    o = QuantOptions()
    assert (o.num_groups, o.decay, o.estimator, o.symmetric, o.rounding, o.enabled) == \
        (1, 0.9, "running", False, "stochastic", True)
    for bad in ({"num_groups": 0}, {"num_groups": 1.5}, {"num_groups": True}, {"decay": 1.0}, {"decay": -0.1},
                {"symmetric": 1}, {"enabled": "yes"}):
        with pytest.raises(ValueError):
            QuantOptions(**bad)
    with pytest.raises(ValueError, match="running.*per_sample"):
        QuantOptions(estimator="ema")
    with pytest.raises(ValueError, match="stochastic.*nearest"):
        QuantOptions(rounding="floor")
    with pytest.raises(ValueError, match="valid options.*num_groups"):
        QuantOptions.from_kwargs(groups=2)
    assert QuantOptions(decay=0).decay == 0.0
    assert o.replace(num_groups=3).num_groups == 3


def test_buffers_state_dict_round_trip_and_dtype():
    m = mn.Linear(8, 4, num_groups=2)
    names = dict(m.named_buffers())
    assert set(names) == {"quantizer.alpha", "quantizer.beta", "quantizer.initialized", "quantizer.rng"}
    assert all(not n.startswith("quantizer") for n, _ in m.named_parameters())
    assert names["quantizer.alpha"].shape == (2,) and names["quantizer.initialized"].dtype == torch.bool
    m(torch.randn(5, 8, requires_grad=True)).sum().backward()
    assert bool(m.quantizer.initialized)
    sd = m.state_dict()
    m2 = mn.Linear(8, 4, num_groups=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the same groups: nothing to say)
        m2.load_state_dict(sd)
    for k in ("alpha", "beta", "initialized"):
        assert torch.equal(getattr(m2.quantizer, k), getattr(m.quantizer, k))
    # the rounding counter is state (resume continues the seed sequence); the key belongs
    # to the module's position and is kept
    assert m.quantizer.rng[1] == 1 and m2.quantizer.rng[1] == 1  # one compressed call
    assert m2.quantizer.rng[0] != m.quantizer.rng[0]
    # half() keeps the estimates in float32
    m2.half()
    assert m2.weight.dtype == torch.float16 and m2.quantizer.alpha.dtype == torch.float32
    assert torch.equal(m2.quantizer.alpha, m.quantizer.alpha)
    # a checkpoint made with another group count loads (buffers resized)
    # (said: a user's explicit num_groups was replaced without a word)
    m3 = mn.Linear(8, 4, num_groups=4)
    with pytest.warns(UserWarning, match="saved with another num_groups: the layers now use the checkpoint's"):
        m3.load_state_dict(sd)
    assert m3.quantizer.alpha.shape == (2,) and m3.quantizer.options.num_groups == 2


def test_running_estimate_update_rule():
    q = ActivationQuantizer(num_groups=2, decay=0.9)
    x1 = torch.tensor([[0.0, 1.0, 10.0, 12.0], [2.0, -1.0, 11.0, 14.0]])
    p1 = q.compress(x1, dim=1)
    assert torch.equal(p1.alpha, torch.tensor([[3.0, 4.0]])) and torch.equal(p1.beta, torch.tensor([[-1.0, 10.0]]))
    assert torch.equal(q.alpha, torch.tensor([3.0, 4.0])) and bool(q.initialized)
    x2 = x1 * 2
    p2 = q.compress(x2, dim=1)
    exp_a = torch.tensor([3.0, 4.0]) * 0.9 + torch.tensor([6.0, 8.0]) * (1 - 0.9)
    exp_b = torch.tensor([-1.0, 10.0]) * 0.9 + torch.tensor([-2.0, 20.0]) * (1 - 0.9)
    torch.testing.assert_close(q.alpha, exp_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(q.beta, exp_b, rtol=0, atol=1e-6)
    # the tensors used for backward are fresh, not the buffers
    assert p2.alpha.data_ptr() != q.alpha.data_ptr() and p1.alpha.data_ptr() != q.alpha.data_ptr()
    assert torch.equal(p1.alpha, torch.tensor([[3.0, 4.0]]))  # unchanged by the later call


def test_symmetric_per_sample_nearest():
    x = torch.randn(3, 4, 6)
    q = ActivationQuantizer(num_groups=2, symmetric=True, estimator="per_sample", rounding="nearest")
    p = q.compress(x, dim=-1)
    assert p.alpha.shape == (3, 2) and torch.equal(p.beta, -p.alpha / 2)
    xh = decompress(p, torch.float32)
    step = (p.alpha / 255).max()
    assert (xh - x).abs().max() <= step / 2 + 1e-6
    # nearest rounding is deterministic
    assert torch.equal(q.compress(x, dim=-1).q, p.q)


def test_non_finite_batch_leaves_estimates_finite():
    lin = mn.Linear(4, 3, num_groups=2)
    lin(torch.randn(5, 4, requires_grad=True)).sum().backward()
    before = lin.quantizer.alpha.clone(), lin.quantizer.beta.clone()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5, 4)
        x[2, 1] = bad
        lin(x.requires_grad_()).sum().backward()
        assert torch.isfinite(lin.quantizer.alpha).all() and torch.isfinite(lin.quantizer.beta).all()
        assert torch.equal(lin.quantizer.alpha, before[0]) and torch.equal(lin.quantizer.beta, before[1])
    # an uninitialised quantizer stays uninitialised on a non-finite first batch
    q = ActivationQuantizer(num_groups=1)
    q.compress(torch.tensor([[1.0, float("nan")]]), dim=1)
    assert not bool(q.initialized) and torch.isfinite(q.alpha).all()
    q.compress(torch.tensor([[1.0, 3.0]]), dim=1)
    assert bool(q.initialized) and torch.equal(q.alpha, torch.tensor([2.0]))


def test_call_twice_before_backward():
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    lin = mn.Linear.from_module(torch.nn.Linear(16, 8), num_groups=4, rounding="nearest", decay=0.0)
    lin.load_state_dict(ref.state_dict(), strict=False)
    x1 = torch.randn(6, 16)
    x2 = 100 * torch.randn(6, 16)  # very different range: would break a shared-buffer scheme
    y1 = lin(x1.requires_grad_())
    y2 = lin(x2.requires_grad_())
    g = torch.randn(6, 8)
    (y1 * g).sum().backward(retain_graph=True)
    gw1 = lin.weight.grad.clone()
    exact = g.t() @ x1
    assert ((gw1 - exact).norm() / exact.norm()) < 0.01
    lin.weight.grad = None
    (y2 * g).sum().backward()
    exact2 = g.t() @ x2
    assert ((lin.weight.grad - exact2).norm() / exact2.norm()) < 0.01


def test_groups_clamped_to_dimension_size():
    conv = mn.Conv2d(3, 8, 3, num_groups=6)  # a patch embedding: 3 input channels, 6 heads
    conv(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
    assert conv.quantizer.alpha.shape == (6,)
    assert (conv.quantizer.alpha[:3] > 0).all() and (conv.quantizer.alpha[3:] == 0).all()


def test_no_grad_and_no_requires_grad_skip_compression():
    lin = mn.Linear(4, 3)
    with torch.no_grad():
        lin(torch.randn(2, 4))
    lin.weight.requires_grad_(False), lin.bias.requires_grad_(False)
    lin(torch.randn(2, 4))
    assert not bool(lin.quantizer.initialized)
