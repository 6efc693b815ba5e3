"""Parallel Mesa convs given one tensor keep one compressed copy of it (``nn/input_copy.py``):
RepVGG / MobileOne branches, Inception branch heads, ResNet ``conv1`` + ``downsample``.

Each check fails on the code before: every conv kept its own 8-bit copy."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import input_copy, sharing
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model
from op_calls import assert_patched_model_takes_the_op

PATHS = [pytest.param(True, id="cpp", marks=pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS,
                                                                reason="needs the compiled extension")),
         pytest.param(False, id="python")]


class Branches(nn.Module):
    """RepVGG's block: a 3x3 and a 1x1 conv on one input (and a third on it where ``three``),
    optionally with an in-place change of the input between them."""

    def __init__(self, c=8, three=False, modify_between=False):
        super().__init__()
        self.kxk = nn.Conv2d(c, c, 3, 1, 1)
        self.one = nn.Conv2d(c, c, 1)
        self.third = nn.Conv2d(c, c, 3, 1, 1, groups=c) if three else None
        self.modify_between = modify_between

    def forward(self, x):
        x = x * 1.0  # (an intermediate, as a block input is: x must want a gradient)
        y = self.kxk(x)
        if self.modify_between:
            x.mul_(2.0)
        y = y + self.one(x)
        if self.third is not None:
            y = y + self.third(x)
        return y


def _saved(model, x):
    with SavedTensorMeter() as meter:
        model(x).sum().backward()
    return meter


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("fused", PATHS)
def test_parallel_convs_keep_one_copy(monkeypatch, fused):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    torch.manual_seed(0)
    stock = Branches(three=True)
    mesa = patch_model(copy.deepcopy(stock), ops=["conv"])
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    shared = _saved(mesa, x)
    with sharing.disabled():
        apart = _saved(copy.deepcopy(mesa), x)
    per_copy = x.numel()  # one byte per element
    # three convs, one copy of x instead of three: two copies fewer (their statistics too)
    assert apart.activation_bytes - shared.activation_bytes >= 2 * per_copy
    assert shared.activation_bytes < 1.5 * per_copy
    # the forward is stock's, bit for bit; each weight gradient is the 8-bit input's
    torch.testing.assert_close(mesa(x), stock(x), rtol=0, atol=0)
    stock(x).sum().backward()
    for (name, p), q in zip(mesa.named_parameters(), stock.parameters()):
        assert _cos(p.grad, q.grad) > 0.999, name


@pytest.mark.parametrize("switch", [input_copy.disabled, sharing.disabled])
def test_the_off_switches_hold_in_their_own_thread_only(switch):
    """``input_copy.disabled()`` and ``sharing.disabled()`` turn sharing off in the thread that
    enters them, nested, and back on at the exit; another thread, running meanwhile, still
    shares (the switches are thread-local counters with class defaults: an unset thread reads 0)."""
    import threading

    x = torch.randn(2, 3, requires_grad=True) * 1
    seen = {}

    def other_thread():
        seen["other"] = input_copy.may_share(x)

    assert input_copy.may_share(x)
    with switch():
        with switch():
            assert not input_copy.may_share(x)
        assert not input_copy.may_share(x)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == {"other": True}
    assert input_copy.may_share(x)
    assert not input_copy.may_share(torch.randn(2, 3, requires_grad=True))  # a leaf never


def test_the_branches_read_the_same_codes(monkeypatch):
    torch.manual_seed(0)
    mesa = patch_model(Branches(three=True), ops=["conv"])
    seen = []
    real = input_copy.take

    def spy(x, signature, quantizer):
        got = real(x, signature, quantizer)
        seen.append(got)
        return got

    monkeypatch.setattr(input_copy, "take", spy)
    mesa(torch.randn(2, 8, 8, 8, requires_grad=True)).sum().backward()
    assert seen[0] is None and seen[1] is not None and seen[2] is seen[1]
    # describe says where the consumers' inputs are kept (not "uninitialized")
    from mesa_train.patch import describe
    rows = {line.split()[0]: line for line in describe(mesa).splitlines() if line.startswith(("kxk", "one", "third"))}
    assert "initialized" in rows["kxk"] and "parallel layer's copy" not in rows["kxk"]
    for name in ("one", "third"):
        assert "input from a parallel layer's copy" in rows[name] and "uninitialized" not in rows[name], rows[name]


def test_a_changed_input_is_compressed_again():
    torch.manual_seed(0)
    mesa = patch_model(Branches(modify_between=True), ops=["conv"])
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    changed = _saved(mesa, x)
    with sharing.disabled():
        apart = _saved(copy.deepcopy(mesa), x)
    assert changed.activation_bytes == apart.activation_bytes


def test_convs_compressing_differently_keep_their_own():
    torch.manual_seed(0)
    model = Branches()
    mesa = patch_model(copy.deepcopy(model), ops=["conv"])
    mesa.one = mnn.Conv2d.from_module(model.one, bits=4)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    mixed = _saved(mesa, x)
    with sharing.disabled():
        apart = _saved(copy.deepcopy(mesa), x)
    assert mixed.activation_bytes == apart.activation_bytes


class Parallel(nn.Module):
    """Two convs on the module's own input (no intermediate inside)."""

    def __init__(self, c=8):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, 1, 1)
        self.b = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_a_leaf_hands_no_codes_on():
    """A batch reused for several steps or given to two models: each conv compresses it, every
    step (codes carried over would repeat one step's rounding noise; the quantizer would never
    take a batch)."""
    torch.manual_seed(0)
    first = patch_model(Parallel(), ops=["conv"])
    second = copy.deepcopy(first)
    x = torch.randn(2, 8, 8, 8)
    for model in (first, second):
        model(x).sum().backward()
        assert bool(model.a.quantizer.initialized) and bool(model.b.quantizer.initialized)
    assert getattr(x, input_copy.ATTRIBUTE, None) is None
    # the same input with gradients (an intermediate): shared
    shared = patch_model(Parallel(), ops=["conv"])
    shared(x.requires_grad_() * 1.0).sum().backward()
    assert bool(shared.a.quantizer.initialized) != bool(shared.b.quantizer.initialized)


def test_a_tensor_detached_in_place_hands_no_codes_on():
    """Truncated backprop through time: the carried state is ``detach_()``-ed after the step (a
    leaf now, the same version): the next step's convs compress it themselves."""
    torch.manual_seed(0)
    model = patch_model(Parallel(), ops=["conv"])
    h = torch.randn(2, 8, 8, 8, requires_grad=True) * 1.0
    model(h).sum().backward()
    assert getattr(h, input_copy.ATTRIBUTE, None) is not None
    h.detach_()
    fresh = patch_model(Parallel(), ops=["conv"])
    fresh(h).sum().backward()
    assert bool(fresh.a.quantizer.initialized) and bool(fresh.b.quantizer.initialized)


def test_the_copy_dies_with_its_tensor():
    torch.manual_seed(0)
    conv = patch_model(Branches(), ops=["conv"]).kxk
    x = torch.randn(2, 8, 8, 8, requires_grad=True) * 1.0
    conv(x).sum().backward()
    assert getattr(x, input_copy.ATTRIBUTE, None) is not None
    with torch.no_grad():  # nothing compressed: nothing left
        y = torch.randn(2, 8, 8, 8)
        conv(y)
    assert getattr(y, input_copy.ATTRIBUTE, None) is None


def test_compiled_convs_keep_their_own_copies():
    # under torch.compile nothing is left on tensors: the traced graph cannot carry it
    torch.manual_seed(0)
    mesa = patch_model(Branches(), ops=["conv"])
    x = torch.randn(2, 8, 8, 8)
    compiled = torch.compile(mesa, backend="eager", fullgraph=True)
    compiled(x).sum().backward()
    assert getattr(x, input_copy.ATTRIBUTE, None) is None
    # a tensor an eager forward left codes on is not read either (tracing its version failed)
    held = torch.randn(2, 8, 8, 8, requires_grad=True) * 1.0
    mesa.kxk(held)
    assert getattr(held, input_copy.ATTRIBUTE, None) is not None
    torch.compile(mesa.one, backend="eager", fullgraph=True)(held).sum().backward()


def test_op_path_is_the_python_path_with_shared_copies(monkeypatch):
    if not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    torch.manual_seed(0)
    mesa = patch_model(Branches(three=True), ops=["conv"])
    assert_patched_model_takes_the_op(monkeypatch, mesa, lambda step: torch.randn(2, 8, 8, 8, requires_grad=True),
                                      "conv2d_train",
                                      mnn.Conv2d)


def _selective():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    return functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: CheckpointPolicy.MUST_SAVE)


class Chain(nn.Module):
    """Two parallel convs, then a third on another tensor of the same shape."""

    def __init__(self, c=8):
        super().__init__()
        self.kxk, self.one, self.post = nn.Conv2d(c, c, 3, 1, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        x = x * 1.0
        return self.post((self.kxk(x) + self.one(x)) * 3.0 + 5.0)


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective"])
def test_nothing_is_shared_inside_a_checkpoint(monkeypatch, fused, selective):
    """Both passes of a non-reentrant checkpoint make the same calls: each conv compresses its
    own copy in both. Selective checkpointing that saves every op replays the first pass's ops in
    order: a recomputation that took a copy where the first pass made one handed ``post`` the
    codes of ``x`` (cosine -0.3 against the plain run) or failed on the C++ path. Per-sample
    ranges: the recomputed codes are the first pass's, so the gradients are bitwise those of a
    plain run that shares nothing."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    torch.manual_seed(0)
    plain = patch_model(Chain(), ops=["conv"], estimator="per_sample")
    checked = copy.deepcopy(plain)
    leaf = torch.randn(2, 8, 8, 8, requires_grad=True)
    with sharing.disabled():
        torch.manual_seed(1)
        plain(leaf).square().sum().backward()
    x = leaf * 1.0
    torch.manual_seed(1)
    kwargs = {"context_fn": _selective()} if selective else {}
    y = checkpoint(checked, x, use_reentrant=False, **kwargs)
    assert getattr(x, input_copy.ATTRIBUTE, None) is None  # (nothing left on the segment's input)
    y.square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


# timm's models with parallel convs on one input: fp32 saved bytes over stock's, one train
# forward (stock keeps each shared input once; Mesa kept one 8-bit copy per branch before)
MODELS = {
    # name: (create_model kwargs, image size, bound on Mesa / stock saved bytes)
    "mobileone_s0": (dict(), 64, 0.40),
    "repvgg_a0": (dict(), 64, 0.40),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_branches_share_one_copy(name):
    kwargs, size, bound = MODELS[name]
    torch.manual_seed(0)
    stock = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()
    mesa = patch_model(copy.deepcopy(stock), ops=["all"])
    x = torch.randn(2, 3, size, size)
    base = _saved(stock, x)
    got = _saved(mesa, x)
    with sharing.disabled():
        apart = _saved(copy.deepcopy(mesa), x)
    ratio, before = got.activation_bytes / base.activation_bytes, apart.activation_bytes / base.activation_bytes
    assert ratio < bound < before, (ratio, before)


class SeparateQKV(nn.Module):
    """HF-style attention: separate q / k / v projections of one normed input."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        b, n, d = x.shape
        y = self.norm(x)
        q, k, v = (proj(y).view(b, n, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = (q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5).softmax(-1)
        return x + self.o((attn @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_separate_projections_keep_one_copy(monkeypatch, fused, autocast):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    torch.manual_seed(0)
    stock = SeparateQKV()
    mesa = patch_model(copy.deepcopy(stock), ops=["linear"])
    x = torch.randn(4, 16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        shared = _saved(mesa, x)
        with sharing.disabled():
            apart = _saved(copy.deepcopy(mesa), x)
        out, want = mesa(x), stock(x)
    per_copy = x.numel() * (2 if autocast else 4) // 4  # one byte per element (the cast's, under autocast)
    # q, k and v: one copy of the norm's output instead of three
    assert apart.activation_bytes - shared.activation_bytes >= 2 * per_copy
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # stock's forward, bit for bit
    assert sum(m.quantizer.initialized.item() for m in (mesa.q, mesa.k, mesa.v)) == 1


def test_separate_projections_op_path_is_the_python_path(monkeypatch):
    if not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    torch.manual_seed(0)
    mesa = patch_model(SeparateQKV(), ops=["linear"])
    assert_patched_model_takes_the_op(monkeypatch, mesa, lambda step: torch.randn(2, 8, 32, requires_grad=True),
                                      "linear_train", mnn.Linear)


def test_projections_under_other_autocast_keep_their_own():
    """A Linear under autocast compresses the cast input: one outside it does not share that copy."""
    torch.manual_seed(0)
    model = patch_model(SeparateQKV(), ops=["linear"])
    y = torch.randn(2, 8, 32, requires_grad=True) * 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.q(y).float().sum().backward(retain_graph=True)
    model.k(y).sum().backward()
    assert model.q.quantizer.initialized.item() and model.k.quantizer.initialized.item()
