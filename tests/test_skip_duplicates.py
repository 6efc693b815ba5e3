"""``skip_duplicated``: Mesa layers whose every copy another module keeps in full anyway (a conv
after a stock ReLU with ``ops=["conv"]``) go stock where that lowers the measured bytes; the
forward stays stock's, their gradients become stock's, and a switch that would keep more (a
stock layer's own autocast cast) is undone."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import describe, patch_model
from mesa_train.patch import duplicates as duplicates_mod
from mesa_train.patch.coverage import coverage, measured_copies
from mesa_train.nn import MatMul
from mesa_train.patch.duplicates import LEFT_STOCK_ATTR, full_operand_duplicates, left_stock_duplicates, skip_duplicated


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1)).train()


def _x(*shape):
    return torch.randn(*(shape or (2, 3, 16, 16)), generator=torch.Generator().manual_seed(1))


def _grads(model, x):
    torch.manual_seed(3)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class ParallelConvs(nn.Module):
    """Two convs read a stock ReLU's output; the second takes the first's copy (nn/input_copy.py),
    so it keeps no bytes of its own, and only both going stock removes the copy."""

    def __init__(self):
        super().__init__()
        self.pre, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        h = self.act(self.pre(x))
        return self.a(h) + self.b(h)


class ScaledLinear(nn.Module):
    """A stock ReLU keeps its fp32 output, the Linear's input. Under bf16 autocast the stock
    Linear keeps its own bf16 cast of it (2 bytes an element), Mesa's 8-bit codes 1."""

    def __init__(self):
        super().__init__()
        self.scale, self.act, self.fc = nn.Parameter(torch.ones(64)), nn.ReLU(), nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(self.act(x * self.scale))


def _bf16(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


def test_convs_after_stock_relus_go_stock_with_stock_forward_and_gradients():
    """The two convs reading a ReLU's output go stock (the first reads the image, kept by
    nobody, and stays compressed); the model then keeps less than stock, where it kept more;
    the forward is stock's bit for bit and the two convs' gradients are stock's."""
    stock = _convnet()
    model = patch_model(copy.deepcopy(stock), ops=["conv"])
    assert coverage(model, _x()).ratio > 1
    result = skip_duplicated(model, _x())
    assert result.layers == {"conv": ["3", "6"]} and not result.kept
    assert result.after < result.before
    assert result.after == measured_copies(model, _x(), copies=False)[0]
    cov = coverage(model, _x())
    assert cov.ratio < 1 and not cov.duplicated
    assert [m.quant_options.enabled for m in (model[0], model[3], model[6])] == [True, False, False]
    assert left_stock_duplicates(model) == ["3", "6"]
    out, grads = _grads(model, _x())
    stock_out, stock_grads = _grads(stock, _x())
    assert torch.equal(out, stock_out)
    for name in ("3.weight", "3.bias", "6.weight", "6.bias"):
        torch.testing.assert_close(grads[name], stock_grads[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(grads["0.weight"], stock_grads["0.weight"])  # (still compressed: noise)
    text = describe(model)
    assert "stock: other modules keep its input in full (skip_duplicated)" in text
    assert "(skip_duplicated): 2: 3, 6" in text


def test_a_second_call_measures_afresh_and_all_ops_have_nothing_to_skip():
    """A second call undoes the first's switches and finds them again (the same figures)."""
    model = patch_model(_convnet(), ops=["conv"])
    first = skip_duplicated(model, _x())
    again = skip_duplicated(model, _x())
    assert (again.layers, again.before, again.after) == (first.layers, first.before, first.after)
    assert left_stock_duplicates(model) == ["3", "6"]
    everything = patch_model(_convnet(), ops=["all"])
    assert skip_duplicated(everything, _x()).count == 0
    assert all(m.quant_options.enabled for m in everything.modules() if hasattr(m, "quant_options"))


def test_a_layer_that_took_a_parallel_layers_copy_goes_stock_with_it():
    """``b`` took ``a``'s copy (no bytes of its own): switching ``a`` alone would leave ``b``
    making the copy; both go, in one try."""
    model = patch_model(ParallelConvs().train(), ops=["conv"])
    layers = measured_copies(model, _x())[1]
    assert layers["b"][0] == 0 and layers["b"][2] == layers["b"][1] > 0  # (own bytes, copied, duplicated)
    result = skip_duplicated(model, _x())
    assert sorted(result.layers["conv"]) == ["a", "b"]
    with SavedTensorMeter(model) as meter:
        model(_x())
    assert meter.per_module.get("a", 0) == 0 and meter.per_module.get("b", 0) == 0  # (the ReLU's output, shared)


def test_a_switch_that_would_keep_more_is_undone():
    """Under bf16 autocast the stock Linear keeps a bf16 cast of the ReLU's fp32 output, more
    than Mesa's codes: the Linear stays compressed, and the summary says why. In fp32 it goes."""
    x = _x(4, 16, 64)
    model = patch_model(ScaledLinear().train(), ops=["linear"])
    result = skip_duplicated(model, x, run=_bf16)
    assert result.count == 0 and result.kept == {"linear": ["fc"]} and result.after == result.before
    assert model.fc.quant_options.enabled and LEFT_STOCK_ATTR not in model.fc.__dict__
    assert "stay compressed, as leaving them stock kept as much or more (linear 1" in result.summary()
    result = skip_duplicated(model, x)
    assert result.layers == {"linear": ["fc"]} and result.after < result.before


@pytest.mark.parametrize("failing_call", [2, 3])
def test_a_failing_measurement_leaves_no_switch_behind(monkeypatch, failing_call):
    """The first try's measurement failing, or the measurement after a round (the review's find:
    the switches kept before it stayed while training said nothing was switched)."""
    model = patch_model(_convnet(), ops=["conv"])
    real, calls = measured_copies, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(duplicates_mod, "measured_copies", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        skip_duplicated(model, _x())
    assert all(m.quant_options.enabled for m in model.modules() if hasattr(m, "quant_options"))
    assert not left_stock_duplicates(model)


def test_measuring_changes_no_buffer_and_no_rng():
    model = patch_model(_convnet(), ops=["conv"])
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    state = torch.random.get_rng_state()
    skip_duplicated(model, _x())
    assert torch.equal(torch.random.get_rng_state(), state)
    for k, b in model.named_buffers():
        assert torch.equal(b, buffers[k]), k


@pytest.mark.parametrize("name,ops", [("resnet18", ["conv"]), ("resnet18", ["conv", "batchnorm"]),
                                      ("mobileone_s0", ["conv"]), ("mobileone_s0", ["conv", "relu"]),
                                      ("mobileone_s0", ["batchnorm"]), ("mobileone_s0", ["conv", "batchnorm"])])
def test_op_subsets_keep_less_and_gradients_no_worse(name, ops):
    """Full timm convnets with op subsets (results/timm/duplicated.md): fewer bytes, the train
    forward stock's, the worst parameter gradient no further from exact, and a linked scale
    branch (MobileOne's ``conv_scale``) never half stock: a stock conv beside its Mesa BatchNorm
    took its weight gradient from the BatchNorm's 8-bit input gradient (cosine -0.89)."""
    import timm
    from test_timm_models import _exact_grads, _loss, _seeded, _worst_cosines

    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=10).train()
    x = _x(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (functional ops not reached: describe's business)
        before = patch_model(copy.deepcopy(stock), ops=ops)
    after = copy.deepcopy(before)
    result = skip_duplicated(after, x)
    assert result.count and result.after < result.before
    modules = dict(after.named_modules())
    for layer in modules.values():
        partner = layer.__dict__.get("_mesa_scale_bn")
        if partner is not None:
            assert layer.quant_options.enabled == partner.quant_options.enabled
    exact = _exact_grads(stock, x)
    worst = {}
    for label, model in (("before", before), ("after", after)):
        out = _seeded(model, x)
        assert torch.equal(out, _seeded(stock, x)), label
        _loss(out).backward()
        worst[label] = _worst_cosines(exact, {n: p.grad for n, p in model.named_parameters()})[0][1]
    assert worst["after"] >= worst["before"] - 1e-4, worst


def _vit(fused: bool, drop: float = 0.0):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4,
                              drop_rate=drop, proj_drop_rate=drop, drop_path_rate=drop).train()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model


def _patched_quietly(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (patch_model's warning on the explicit path: tested elsewhere)
        return patch_model(model, **kwargs)


def test_fused_attentions_go_back_where_the_explicit_path_keeps_more():
    """``ops=["gelu", "softmax"]`` (the README's example) moved timm's fused attentions to the
    explicit path, whose N x N map the fused stock never keeps: they go back on the fused path
    they were built with (fewer bytes, the train forward stock's with dropout on, gradients
    close) and ``describe`` says so. With ``matmul`` the explicit path's 8-bit q, k, v
    keep less than the fused path's full ones and it stays; an attention built explicit (the
    paper's baseline) is never moved."""
    x = _x(2, 3, 32, 32)
    stock = _vit(True, drop=0.1)
    model = _patched_quietly(copy.deepcopy(stock), ops=["gelu", "softmax"])
    before = coverage(model, x).ratio
    result = skip_duplicated(model, x)
    assert result.fused_back == ["blocks.0.attn", "blocks.1.attn"] and not result.count
    assert coverage(model, x).ratio < before
    attns = [m for m in model.modules() if hasattr(m, "mesa_attn_path")]
    assert all(a.mesa_attn_path == "stock" and a.fused_attn for a in attns)
    assert "fused as built" in describe(model) and "put 2 attention(s) back" in result.summary()
    out, grads = _grads(model, x)
    stock_out, stock_grads = _grads(stock, x)
    assert torch.equal(out, stock_out)
    for name, g in grads.items():  # (the GELUs' 8-bit copies stay: close, not equal)
        assert torch.nn.functional.cosine_similarity(g.flatten(), stock_grads[name].flatten(), 0) > 0.99, name
    kept = _patched_quietly(_vit(True), ops=["softmax", "matmul"])
    assert not skip_duplicated(kept, x).fused_back
    assert all(m.mesa_attn_path == "explicit" for m in kept.modules() if hasattr(m, "mesa_attn_path"))
    built_explicit = _patched_quietly(_vit(False), ops=["softmax"])
    assert not skip_duplicated(built_explicit, x).fused_back
    assert all(m.mesa_attn_path == "explicit" for m in built_explicit.modules() if hasattr(m, "mesa_attn_path"))


def test_a_rejected_attention_try_restores_the_explicit_path(monkeypatch):
    """A try whose bytes do not go down (here: measured so) leaves the attentions on the path and
    flag ``patch_model`` gave them, with no mark."""
    x = _x(2, 3, 32, 32)
    model = _patched_quietly(_vit(True), ops=["softmax"])
    real = measured_copies

    def no_gain(root, example_input, run=None, copies=True):
        total, layers, per_module = real(root, example_input, run, copies)
        return (total + 10**9 if not copies else total), layers, per_module

    monkeypatch.setattr(duplicates_mod, "measured_copies", no_gain)
    assert not skip_duplicated(model, x).fused_back
    for m in model.modules():
        if hasattr(m, "mesa_attn_path"):
            assert m.mesa_attn_path == "explicit" and not m.fused_attn
            assert duplicates_mod.FUSED_BACK_ATTR not in m.__dict__


class MixedLinears(nn.Module):
    """Under bf16 autocast ``fc1`` reads ``fc0``'s bf16 output, which its ReLU keeps (stock
    ``fc1`` keeps a reference: switching it saves), while ``fc2`` reads an fp32 product its ReLU
    keeps (stock ``fc2`` keeps its own bf16 cast: switching it costs). One try for both gained
    less than ``fc1`` alone (the review's find): a try that gains less than its layers' own bytes
    is split."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.act0, self.act1 = nn.ReLU(), nn.ReLU()

    def forward(self, x):
        return self.fc1(self.act0(self.fc0(x * self.scale))) + self.fc2(self.act1(x * self.scale))


def test_a_try_that_gains_less_than_its_layers_bytes_is_split():
    x = _x(4, 16, 64)
    model = patch_model(MixedLinears().train(), ops=["linear"])
    result = skip_duplicated(model, x, run=_bf16)
    assert result.layers == {"linear": ["fc1"]} and result.kept == {"linear": ["fc2"]}
    model.fc2.set_quant_options(enabled=False)  # (both: more than fc1 alone)
    assert measured_copies(model, x, _bf16, copies=False)[0] > result.after


def test_a_later_patch_model_call_undoes_the_switches():
    """``ops=["relu"]`` after ``["conv"]``: the ReLUs keep 1-bit masks, no longer the convs'
    inputs, so the convs switched for them are compressed again (the review's find: they stayed
    stock, keeping their inputs in full), and a new call finds what a fresh patch finds."""
    model = patch_model(_convnet(), ops=["conv"])
    skip_duplicated(model, _x())
    patch_model(model, ops=["relu"])
    assert all(m.quant_options.enabled for m in model.modules() if hasattr(m, "quant_options"))
    assert not left_stock_duplicates(model)
    fresh = patch_model(_convnet(), ops=["conv", "relu"])
    assert measured_copies(model, _x(), copies=False)[0] == measured_copies(fresh, _x(), copies=False)[0]
    assert skip_duplicated(model, _x()).layers == skip_duplicated(fresh, _x()).layers


def test_layers_the_user_switched_off_stay_off_and_unmarked():
    """A scale branch's BatchNorm switched off by hand: a try of its pair neither switches it
    back on when undone nor credits itself with it (the review's find)."""
    import timm

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = patch_model(timm.create_model("mobileone_s0", num_classes=10).train(), ops=["conv", "batchnorm"])
    off = [n for n, m in model.named_modules() if m.__dict__.get("_mesa_scale_conv") is not None][:3]
    for name in off:
        model.get_submodule(name).set_quant_options(enabled=False)
    skip_duplicated(model, _x(2, 3, 32, 32))
    for name in off:
        layer = model.get_submodule(name)
        assert not layer.quant_options.enabled and LEFT_STOCK_ATTR not in layer.__dict__, name
    assert not set(off) & set(left_stock_duplicates(model))


def test_patching_a_submodule_or_applying_a_plan_undoes_the_whole_models_switches():
    """The review's find: ``patch_model`` on one block, or a plan's per-unit calls, undid only the
    switches inside what they patched; a sibling's stayed, measured for a model that changed."""
    from mesa_train.plan import Plan

    model = patch_model(_convnet(), ops=["conv"])
    skip_duplicated(model, _x())
    patch_model(model[5], ops=["relu"])  # (the second ReLU alone)
    assert not left_stock_duplicates(model)
    assert all(m.quant_options.enabled for m in model.modules() if hasattr(m, "quant_options"))
    vit = _patched_quietly(_vit(True), ops=["gelu", "softmax"])
    assert skip_duplicated(vit, _x(2, 3, 32, 32)).fused_back == ["blocks.0.attn", "blocks.1.attn"]
    _patched_quietly(vit, plan=Plan(layers={"blocks.0": ("linear",)}))  # (blocks.1 is no unit of it)
    assert not duplicates_mod.fused_back_attentions(vit)
    assert vit.blocks[1].attn.mesa_attn_path == "explicit"


@pytest.mark.parametrize("channels_last", [False, True])
def test_training_start_up_forwards_feed_the_memory_format_training_feeds(channels_last):
    """train.py's start-up forwards (the reuse probe, mesa.duplicates=skip's measurement, the stock
    saved-bytes figure beside kept_for_backward) see images in trainer.channels_last's format, as
    the epochs' batches are: a layout can change what a forward keeps."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from mesa_train.train import runner

    seen = []
    model = patch_model(_convnet(), ops=["conv"])
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    cfg = OmegaConf.create({"model": {"img_size": 8}, "mesa": {"duplicates": "skip"},
                            "trainer": {"channels_last": channels_last, "batch_size": 6}})
    cpu = torch.device("cpu")
    runner._probe_reuse(cfg, model, cpu)
    runner._skip_duplicates(cfg, model, cpu, None, rank=0)
    assert runner._stock_saved_bytes(model, cfg, SimpleNamespace(device=cpu, amp_dtype=None)) > 0
    assert len(seen) >= 4 and set(seen) == {not channels_last}, seen


class PartlyKeptProduct(nn.Module):
    """``a @ b`` where a stock ReLU keeps ``a`` (its output) in full and nothing keeps ``b`` (a
    Linear's output, transposed): only ``a``'s 8-bit copy is a duplicate."""

    def __init__(self):
        super().__init__()
        self.pre, self.act, self.other = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)
        self.mm = MatMul()

    def forward(self, x):
        return self.mm(self.act(self.pre(x)), self.other(x).transpose(-1, -2))


def test_a_matmul_keeps_in_full_only_the_operand_another_module_keeps():
    """The MatMul keeps ``a`` in full (a reference to the ReLU's output) and
    ``b`` 8-bit: fewer bytes by ``a``'s codes, the forward unchanged, ``other``'s weight gradient
    (from ``a``) stock's, ``describe`` names it; a later ``patch_model`` quantizes ``a`` again."""
    torch.manual_seed(0)
    model, x = PartlyKeptProduct().train(), torch.randn(2, 8, 16)
    stock = copy.deepcopy(model)
    stock.mm = nn.Identity()
    stock.forward = lambda t: stock.act(stock.pre(t)) @ stock.other(t).transpose(-1, -2)
    layers = measured_copies(model, x)[1]
    assert layers["mm"][2] < layers["mm"][1] and layers["mm"][5] == frozenset({"a"}), layers
    want, want_grads = _grads(stock, x)
    before_out, before_grads = _grads(model, x)
    result = skip_duplicated(model, x)
    assert result.full_operands == {"mm": ("a",)} and not result.count, result
    assert result.after < result.before and "1 Mesa MatMul" in result.summary()
    assert result.after == measured_copies(model, x, copies=False)[0]
    assert model.mm.last_saved == ("full", "int8")
    model.zero_grad(set_to_none=True)
    out, grads = _grads(model, x)
    assert torch.equal(out, want) and torch.equal(out, before_out)
    torch.testing.assert_close(grads["other.weight"], want_grads["other.weight"], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(before_grads["other.weight"], want_grads["other.weight"], rtol=1e-6, atol=1e-7)
    assert "mm (a)" in describe(model) and "a: full precision, as another module keeps it" in describe(model)
    patch_model(model, ops=["relu"])  # (the ReLU keeps a 1-bit mask from now on: a is nobody's)
    assert not full_operand_duplicates(model) and "_mesa_full_operands" not in model.mm.__dict__
    assert measured_copies(model, x)[1]["mm"][5] == frozenset()


def test_a_matmul_switched_whole_later_is_not_listed_as_keeping_an_operand():
    """Once ``b`` is a duplicate too (``other``'s output through a stock ReLU), the whole MatMul
    goes stock and is listed there only."""
    torch.manual_seed(0)
    model, x = PartlyKeptProduct().train(), torch.randn(2, 8, 16)
    model.other = nn.Sequential(model.other, nn.ReLU())
    result = skip_duplicated(model, x)
    assert result.layers == {"matmul": ["mm"]} and result.full_operands == {}, result
    assert left_stock_duplicates(model) == ["mm"] and not full_operand_duplicates(model)


class TwoProducts(nn.Module):
    """Two MatMuls whose ``a`` other modules keep in full: ``mm1``'s a bf16 ReLU output under
    autocast (kept in full: a reference), ``mm2``'s an fp32 softmax output (kept in full: a new
    bf16 cast, more than its 8-bit codes). ``n2`` sizes ``mm2``'s loss."""

    def __init__(self, n2: int):
        super().__init__()
        self.pre, self.act, self.o1 = nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)
        self.pre2, self.sm, self.o2 = nn.Linear(64, n2), nn.Softmax(-1), nn.Linear(64, n2)
        self.mm1, self.mm2 = MatMul(), MatMul()

    def forward(self, x):
        y1 = self.mm1(self.act(self.pre(x)), self.o1(x).transpose(-1, -2))
        y2 = self.mm2(self.sm(self.pre2(x).float()).transpose(-1, -2), self.o2(x))
        return y1.sum() + y2.sum()


@pytest.mark.parametrize("n2", [16, 256])
def test_the_operand_try_keeps_the_matmuls_that_gain_without_the_ones_that_add(n2):
    """The review's find: one try for both MatMuls kept ``mm2``'s loss beside ``mm1``'s gain (n2=16),
    or lost ``mm1``'s gain to a larger loss (n2=256). ``mm2`` keeps more in full (its own bytes do not
    drop): it is measured apart and left 8-bit."""
    torch.manual_seed(0)
    model, x = TwoProducts(n2).train(), torch.randn(4, 32, 64)
    before = measured_copies(model, x, _bf16, copies=False)[0]
    result = skip_duplicated(model, x, run=_bf16)
    assert result.full_operands == {"mm1": ("a",)}, result.summary()
    assert result.after == measured_copies(model, x, _bf16, copies=False)[0] < before


def test_training_logs_matmuls_keeping_an_operand_in_full(caplog):
    """The start-up line also names an operand switch alone (LambdaNet's only change)."""
    import logging

    from omegaconf import OmegaConf

    from mesa_train.train import runner

    class OnImages(PartlyKeptProduct):
        def forward(self, x):
            return super().forward(x.flatten(1, 2))

    torch.manual_seed(0)
    model = OnImages().train()
    cfg = OmegaConf.create({"model": {"img_size": 16}, "mesa": {"duplicates": "skip"},
                            "trainer": {"channels_last": False, "batch_size": 2}})
    with caplog.at_level(logging.INFO, logger=runner.log.name):
        runner._skip_duplicates(cfg, model, torch.device("cpu"), None, rank=0)
    assert full_operand_duplicates(model) == {"mm": ("a",)}
    assert any("1 Mesa MatMul" in r.getMessage() and "mesa.duplicates=keep" in r.getMessage() for r in caplog.records)


class StockMatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class HeadsProduct(nn.Module):
    """Per-head ``q @ v``: ``v`` is a strided per-head view of a stock ReLU's output (kept in full by
    the ReLU), which the batched product copies compactly; ``q`` is nobody's."""

    def __init__(self):
        super().__init__()
        self.q, self.v, self.act = nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU()
        self.mm = MatMul()

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).reshape(b, n, 4, 4).permute(0, 2, 3, 1)  # (b, heads, 4, n)
        v = self.act(self.v(x)).reshape(b, n, 4, 4).transpose(1, 2)  # (b, heads, n, 4), a strided view
        return self.mm(q, v)


def test_a_strided_operand_kept_in_full_is_a_view_of_the_keepers_tensor():
    """Keeping ``v`` as the product's compact copy would add 4 bytes an element (more than its
    codes); kept as given it adds none: the bytes drop, ``q``'s gradient (from ``v``) is exact."""
    torch.manual_seed(0)
    model, x = HeadsProduct().train(), torch.randn(2, 8, 16)
    exact = copy.deepcopy(model).double()
    exact.mm = StockMatMul()
    want = _grads(exact, x.double())[1]["q.weight"]
    before = measured_copies(model, x, copies=False)[0]
    result = skip_duplicated(model, x)
    assert result.full_operands == {"mm": ("b",)}, result.summary()
    assert result.after < before
    own = measured_copies(model, x)[2]["mm"]  # (q's 8-bit codes and its statistics only)
    assert own <= 2 * 8 * 16 + 64, own  # (a compact fp32 copy of v: 4 x 256 bytes more)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(_grads(model, x)[1]["q.weight"].double(), want, rtol=1e-5, atol=1e-6)


class MutatedAfterProduct(nn.Module):
    """``q @ v`` with ``v`` a strided per-head view of a tensor changed in place after the product
    (``mutate``), or rebuilt out of place (the reference): the product's gradients are the same."""

    def __init__(self):
        super().__init__()
        self.q, self.v, self.mm, self.mutate = nn.Linear(16, 16), nn.Linear(16, 16), MatMul(), True

    def forward(self, x):
        b, n, _ = x.shape
        v0 = self.v(x) * 1.0
        out = self.mm(self.q(x).reshape(b, n, 4, 4).permute(0, 2, 3, 1), v0.reshape(b, n, 4, 4).transpose(1, 2))
        v0 = v0.mul_(3.0) if self.mutate else v0 * 3.0
        return out.flatten(1).sum(1) + v0.sum()


def test_a_compiled_operand_kept_in_full_is_not_the_argument_a_later_in_place_change_reaches():
    """The review's find: a traced Function's saved input is rebuilt from its base, so the kept view
    saw the later ``mul_`` (q's gradient 3x) where eager raises; compiled, the layer keeps its copy."""
    from mesa_train.nn.matmul import FULL_OPERANDS_ATTR

    torch.manual_seed(0)
    model, x = MutatedAfterProduct().train(), torch.randn(2, 8, 16)
    model.mm.__dict__[FULL_OPERANDS_ATTR] = ("b",)
    reference = copy.deepcopy(model)
    reference.mutate = False
    want = torch.autograd.grad(reference(x).square().sum(), reference.q.weight)[0]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x).square().sum(), model.q.weight)[0]
    torch.testing.assert_close(got, want)


def test_a_start_up_measurement_that_fails_trains_as_patched_and_says_why(monkeypatch, caplog):
    """train.py's start-up (and a bench row's, the same helper): a forward that refuses the random
    images leaves every layer compressed, training goes on with one warning, ``describe`` names
    the failure, and a later measurement or patch clears the mark; out of memory goes on."""
    import logging

    from omegaconf import OmegaConf

    from mesa_train.patch import start_up
    from mesa_train.train import runner

    model = patch_model(_convnet(), ops=["conv"])
    real = duplicates_mod.measured_copies

    def refuses(*args, **kwargs):
        raise ValueError("expected 4 channels")

    monkeypatch.setattr(duplicates_mod, "measured_copies", refuses)
    cfg = OmegaConf.create({"model": {"img_size": 8}, "mesa": {"duplicates": "skip"},
                            "trainer": {"channels_last": False, "batch_size": 2}})
    with caplog.at_level(logging.INFO, logger=runner.log.name):
        runner._skip_duplicates(cfg, model, torch.device("cpu"), None, rank=0)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "mesa.duplicates=skip measured nothing" in warned[0].getMessage()
    assert "(expected 4 channels)" in warned[0].getMessage()
    assert all(m.quant_options.enabled for m in model.modules() if hasattr(m, "quant_options"))
    assert "(expected 4 channels)" in start_up.skip_failure(model)
    assert "skip_duplicated at start-up measured nothing" in describe(model)

    monkeypatch.setattr(duplicates_mod, "measured_copies", real)
    assert start_up.skip_duplicated_at_start_up(model, _x()).count == 2 and not start_up.skip_failure(model)
    start_up.skip_duplicated_at_start_up(model, torch.randn(2, 4, 8, 8))  # (the model's own forward refuses it)
    assert start_up.skip_failure(model) and not left_stock_duplicates(model)
    patch_model(model, ops=["conv"])
    assert not start_up.skip_failure(model)

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(duplicates_mod, "measured_copies", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # (a bench row: its status is oom)
        start_up.skip_duplicated_at_start_up(model, _x())
    # training goes on: its batch may be smaller than the two example images (the review's find)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=runner.log.name):
        runner._skip_duplicates(cfg, model, torch.device("cpu"), None, rank=0)
    assert any("its forward of the example input ran out of memory" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
