"""Activations and pooling a module's forward calls functionally (``F.relu(self.conv1(x))``,
``F.max_pool2d``, ``F.avg_pool2d``, ``F.gelu``, ``F.silu``, ``F.leaky_relu``: hand-written
CNNs, torchvision's Inception-v3) go through a Mesa child per call site
(patch/functional_calls.py). Before, ReLU and GELU calls were reported as not reached and SiLU
and pooling calls not even reported; all kept their tensors whole (``F.leaky_relu`` was
reported until 2026-12-06). Checks: nothing reported, the forward bitwise stock's with dropout
on, gradients close to exact, fewer bytes, each child run; in-place calls overwrite their
input as stock's do; pooling with indices and calls past the counted sites run stock, ReLU6
stays reported; ``torch.compile(fullgraph=True)`` agrees with eager."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.quantizer import ActivationQuantizer
from mesa_train.patch import patch_model


class HandWrittenNet(nn.Module):
    """The functional style of many users' CNNs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.gelu(self.conv2(x)), 3, 1, 1)
        y = self.conv3(x)
        F.relu(y, inplace=True)  # (the result unused: y itself is overwritten)
        x = F.max_pool2d(F.silu(y) + x.relu(), kernel_size=2, stride=2)
        x = F.dropout(torch.flatten(x, 1), 0.2, self.training)
        return self.fc2(torch.relu(self.fc1(x)))


SITES = {"relu": 4, "gelu": 1, "silu": 1, "maxpool": 2, "avgpool": 1}


def _step(model, x, seed=3):
    torch.manual_seed(seed)  # (dropout on: the same masks)
    with SavedTensorMeter() as meter:
        out = model(x)
    (out.double() * torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)).sum(
    ).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}, meter.activation_bytes


def _cos(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _same_forward_close_gradients(stock, mesa, x):
    """One step of each: the forward bitwise stock's, each gradient's cosine to stock's > 0.99;
    returns the bytes each kept ``(stock, mesa)``."""
    want, want_grads, stock_bytes = _step(stock, x)
    got, got_grads, mesa_bytes = _step(mesa, x)
    assert torch.equal(got, want)
    for n, g in got_grads.items():
        assert _cos(g, want_grads[n]) > 0.99, n
    return stock_bytes, mesa_bytes


def test_functional_calls_are_compressed_and_the_forward_is_stock():
    torch.manual_seed(0)
    stock = HandWrittenNet().train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported as not reached
        patch_model(mesa)
    for op, sites in SITES.items():
        assert [n for n in mesa._modules if n.startswith(f"mesa_call_{op}_")] == [
            f"mesa_call_{op}_{i}" for i in range(sites)]
    x = torch.randn(4, 3, 16, 16)
    want, want_grads, stock_bytes = _step(stock, x)
    got, got_grads, mesa_bytes = _step(mesa, x)
    assert torch.equal(got, want)
    _, exact, _ = _step(copy.deepcopy(stock).double(), x.double())
    for n, g in got_grads.items():
        assert _cos(g, exact[n]) > 0.99, (n, _cos(g, exact[n]), _cos(want_grads[n], exact[n]))
    assert mesa_bytes < 0.3 * stock_bytes, (mesa_bytes, stock_bytes)
    idle = [n for n, q in mesa.named_modules() if isinstance(q, ActivationQuantizer) and not q.initialized]
    assert not idle, idle


def test_every_child_takes_its_own_site():
    """The n-th call of an op goes to the n-th child, with that call's arguments (a GELU child
    per site keeps that site's estimates)."""
    class TwoGelus(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.gelu(self.fc(x) * 100.0, approximate="tanh") + F.gelu(self.fc(x))

    torch.manual_seed(0)
    stock = TwoGelus()
    mesa = patch_model(copy.deepcopy(stock))
    x = torch.randn(4, 8)
    assert torch.equal(_step(mesa, x)[0], _step(stock, x)[0])
    first, second = mesa.mesa_call_gelu_0.quantizer, mesa.mesa_call_gelu_1.quantizer
    assert first.initialized and second.initialized
    assert first.alpha.abs().max() > 20 * second.alpha.abs().max()  # (the x100 site's range is its own)


def test_in_place_forms_and_calls_past_the_sites():
    class Forms(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            F.silu(y, inplace=True)  # in place: y itself must hold the result
            pooled, idx = F.max_pool2d(y, 2, return_indices=True)
            for _ in range(2):  # a loop: the second call has no counted site
                pooled = F.gelu(pooled)
            return pooled * (idx % 3)

    torch.manual_seed(0)
    stock = Forms()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesa = patch_model(copy.deepcopy(stock))
    _same_forward_close_gradients(stock, mesa, torch.randn(2, 3, 8, 8))
    assert mesa.mesa_call_gelu_0.quantizer.initialized and mesa.mesa_call_silu_0.quantizer.initialized
    assert not hasattr(mesa, "mesa_call_gelu_1")  # (the return_indices pool ran stock: it returned them)


def test_relu6_keeps_the_op_reported():
    class Six(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu6(F.relu(self.fc(x)))

    with pytest.warns(UserWarning, match=r"not reached .*<root> \(Six: relu\)"):
        mesa = patch_model(Six())
    assert not hasattr(mesa, "mesa_call_relu_0")


def test_inline_timms_rms_norm2d_is_reported():
    """A function the patch does not route, called inline: said, not silently kept whole (the
    module, timm's RmsNorm2d, is converted); the F.leaky_relu beside it is routed."""
    from timm.layers.fast_norm import rms_norm2d

    class Inline(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.weight = nn.Conv2d(3, 4, 1), nn.Parameter(torch.ones(4))

        def forward(self, x):
            return rms_norm2d(F.leaky_relu(self.conv(x), 0.1), [4], self.weight, 1e-6)

    with pytest.warns(UserWarning, match=r"not reached .*<root> \(Inline: rmsnorm\)"):
        mesa = patch_model(Inline())
    assert isinstance(mesa.mesa_call_leaky_relu_0, mnn.LeakyReLU)


class LeakyNet(nn.Module):
    """A GAN discriminator's style: F.leaky_relu with its own slopes, in place too, beside F.relu."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        x = F.leaky_relu(self.conv1(x), 0.2)
        y = self.conv2(x)
        F.leaky_relu_(y, 0.1)  # (the result unused: y itself is overwritten)
        x = F.relu(F.leaky_relu(y + x, negative_slope=0.3, inplace=True))
        return self.fc(F.dropout(F.leaky_relu(x).flatten(1), 0.2, self.training))


def test_leaky_relu_calls_take_leaky_children_with_their_slopes():
    """``F.leaky_relu`` / ``F.leaky_relu_`` calls (reported as not reached before, their inputs
    kept whole) go through a Mesa LeakyReLU child per site with the call's slope and in-place
    flag, ``F.relu`` beside them through a ReLU child: forward and gradients bitwise stock's
    (1-bit masks), far fewer bytes, and the same under torch.compile."""
    torch.manual_seed(0)
    stock = LeakyNet().train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported as not reached
        patch_model(mesa, ops=["relu"])
    assert sorted(n for n in mesa._modules if n.startswith("mesa_call_")) == [
        f"mesa_call_leaky_relu_{i}" for i in range(4)] + ["mesa_call_relu_0"]
    x = torch.randn(2, 3, 8, 8)
    want, want_grads, stock_bytes = _step(stock, x)
    got, got_grads, mesa_bytes = _step(mesa, x)
    assert torch.equal(got, want)
    for n, g in got_grads.items():
        assert torch.equal(g, want_grads[n]), n
    # stock keeps each leaky call's float32 input (or output in place); Mesa a bit each
    assert mesa_bytes < stock_bytes - 3 * 2 * 8 * 8 * 8 * 4, (mesa_bytes, stock_bytes)
    twin = copy.deepcopy(mesa)
    got, _, _ = _step(torch.compile(twin, backend="aot_eager", fullgraph=True), x)
    assert torch.equal(got, want)
    for n, p in twin.named_parameters():
        assert torch.equal(p.grad, want_grads[n]), n


def test_ops_not_asked_for_are_left_alone():
    mesa = patch_model(HandWrittenNet(), ops=["conv", "linear"])
    assert not [n for n in mesa._modules if n.startswith("mesa_call_")]


def test_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    model = patch_model(HandWrittenNet().train())
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    want, want_grads, _ = _step(model, x)
    got, _, _ = _step(torch.compile(twin, backend="aot_eager", fullgraph=True), x)
    assert torch.equal(got, want)
    for n, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n])


def test_torchvision_inception_v3_blocks():
    """Inception-v3's blocks pool functionally (``F.avg_pool2d`` in InceptionA/C/E,
    ``F.max_pool2d`` in B/D): the whole model kept 0.367 of stock's bytes before, 0.258 after
    (results/torchvision/coverage.md)."""
    from torchvision.models.inception import InceptionA, InceptionB

    torch.manual_seed(0)
    stock = nn.Sequential(InceptionA(8, pool_features=4), InceptionB(64 + 64 + 96 + 4)).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(mesa)
    assert isinstance(mesa[0].mesa_call_avgpool_0, mnn.AvgPool2d)
    assert isinstance(mesa[1].mesa_call_maxpool_0, mnn.MaxPool2d)
    stock_bytes, mesa_bytes = _same_forward_close_gradients(stock, mesa, torch.randn(2, 8, 11, 11))
    assert mesa_bytes < 0.35 * stock_bytes


def test_a_site_keeps_its_child_and_child_modules_calls_are_not_the_modules():
    """Sites are places in the module's own code: a site in a branch skipped on one step keeps
    its child; a site in a loop runs its one child each time; a call a child module's forward
    makes (a stock nn.GELU of a module set not asked for) is not the parent's."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.mlp = nn.Sequential(nn.Linear(16, 16), nn.GELU())  # (an "ffn" set module)

        def forward(self, x, flag=True):
            if flag:
                x = F.gelu(self.a(x) * 300.0) / 300.0
            for _ in range(3):
                x = F.gelu(self.b(x))
            return self.mlp(x)

    torch.manual_seed(0)
    stock = Net()
    mesa = patch_model(copy.deepcopy(stock), modules=["other"])
    assert type(mesa.mlp[1]) is nn.GELU  # (not asked for)
    assert [n for n in mesa._modules if n.startswith("mesa_call")] == ["mesa_call_gelu_0", "mesa_call_gelu_1"]
    mesa(torch.randn(8, 16), True).sum().backward()
    before = [mesa.get_submodule(f"mesa_call_gelu_{i}").quantizer.alpha.clone() for i in range(2)]
    x = torch.randn(8, 16) * 3
    with SavedTensorMeter() as meter:
        out = mesa(x, False)
    out.sum().backward()
    with SavedTensorMeter() as stock_meter:
        want = stock(x, False)
    assert torch.equal(out, want)
    # the branch's child did not run; the loop's did (it was child 1 on the first step too)
    assert torch.equal(mesa.mesa_call_gelu_0.quantizer.alpha, before[0])
    assert not torch.equal(mesa.mesa_call_gelu_1.quantizer.alpha, before[1])
    # the loop's three calls kept 8-bit copies (3 x 128 bytes and their statistics, against 3 x 512)
    # and the mlp's stock GELU its float32 input (512), as stock does
    assert stock_meter.activation_bytes - meter.activation_bytes >= 3 * 8 * 16 * 3


def test_coverage_credits_the_call_children():
    from mesa_train.patch.coverage import coverage

    torch.manual_seed(0)
    model = patch_model(HandWrittenNet().train())
    ops = {row[1] for row in coverage(model, torch.randn(2, 3, 16, 16)).rows if row[0] == "compressed"}
    assert {"relu", "gelu", "silu", "maxpool"} <= ops, ops


def test_a_model_that_has_run_pickles_with_its_sites():
    """The sites a module has seen are plain values: torch.save of the whole model after a step
    (it failed: code objects do not pickle), and the copy keeps each site's child."""
    import io

    torch.manual_seed(0)
    model = patch_model(HandWrittenNet().train())
    x = torch.randn(2, 3, 16, 16)
    model(x).sum().backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded._mesa_function_sites == model._mesa_function_sites
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    assert torch.equal(loaded(x), want)


def test_a_lora_adapters_functional_linear_beside_a_linear_child_is_reported():
    """A module with a converted Linear child counted its whole ``linear`` op as reached; but
    only ``F.linear`` calls that pass a child's weight are routed through it: a LoRA adapter's
    ``F.linear(x, self.lora_A)`` ran stock without a word. Now said; the base Linear is still
    converted, and a call on the child's weight (BEiT's form) still counts as reached."""
    class LoRALinear(nn.Module):
        def __init__(self, d=16, r=4):
            super().__init__()
            self.base = nn.Linear(d, d)
            self.lora_a, self.lora_b = nn.Parameter(torch.randn(r, d)), nn.Parameter(torch.zeros(d, r))

        def forward(self, x):
            return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)

    class ChildWeight(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.qkv, self.q_bias = nn.Linear(d, d, bias=False), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return F.linear(x, weight=self.qkv.weight, bias=self.q_bias)

    class LocalName(nn.Module):  # (the child's weight through a local name: routed by identity, reached)
        def __init__(self, d=16):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            w = self.fc.weight
            return F.linear(x, w, self.fc.bias)

    with pytest.warns(UserWarning, match=r"not reached .*1 \(LoRALinear: linear\)"):
        mesa = patch_model(nn.Sequential(nn.Linear(16, 16), LoRALinear()))
    assert isinstance(mesa[1].base, mnn.Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(ChildWeight())
        local = patch_model(LocalName())
    local(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert local.fc.quantizer.initialized  # (its F.linear went through the Mesa Linear)
