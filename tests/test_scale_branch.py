"""A 1x1 depthwise conv straight into a train-mode BatchNorm (RepVGG / MobileOne scale branch):
the conv takes its weight gradient from the BatchNorm (``mesa_train.nn.conv.ScaleLink``).

Its exact weight gradient is zero but for the BatchNorm's eps (scale invariance); from the
8-bit conv input it was noise (FastViT cosine 0.37, RepViT -0.27)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import describe, patch_model
from bit_patterns import assert_all_same_bits
from kernel_marks import DEVICES
from op_calls import assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example


class ConvNorm(nn.Sequential):  # RepViT's ConvNorm: Sequential(conv, bn)
    def __init__(self, c, stride=1):
        super().__init__()
        self.add_module("c", nn.Conv2d(c, c, 1, stride, 0, groups=c, bias=False))
        self.add_module("bn", nn.BatchNorm2d(c))


class Branches(nn.Module):
    def __init__(self, c=8, stride=1, extra_use=False):
        super().__init__()
        self.scale = ConvNorm(c, stride)
        self.conv = nn.Conv2d(c, c, 3, stride, 1, groups=c)
        self.extra_use = extra_use
        self.seen = []

    def forward(self, x):
        if self.extra_use:  # the conv output also goes elsewhere: no cancellation, no link use
            h = self.scale.c.register_forward_hook(lambda m, i, o: self.seen.append(o))
        y = self.scale(x) + self.conv(x)
        if self.extra_use:
            h.remove()
            y = y + self.seen.pop().square().mean()
        return y


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _grads(model, x, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    g = torch.Generator().manual_seed(3)
    out = model(x.to(dtype))
    (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = Branches(**kw).train()
    with torch.no_grad():
        m.scale.c.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_scale_conv_weight_gradient_matches_exact(stride, rounding):
    stock = _model(stride=stride)
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock), rounding=rounding)
    assert patched.scale.c.__dict__.get("_mesa_scale_bn") is patched.scale.bn
    torch.manual_seed(0)
    assert torch.equal(stock(x), patched(x))
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    name = "scale.c.weight"
    assert exact[name].norm() < 1e-3 * max(g.norm() for g in exact.values())  # a cancellation indeed
    assert _cos(exact[name], got[name]) > 0.999
    for n in exact:
        assert _cos(exact[n], got[n]) > 0.99, n


@pytest.mark.parametrize("op", ["conv", "batchnorm"])
def test_a_scale_branch_is_converted_as_a_pair_or_not_at_all(op):
    """The scale conv's weight gradient is a cancellation only the link gets right: an 8-bit
    input under a stock BatchNorm, or a Mesa BatchNorm's 8-bit x_hat above a stock conv, swamps
    it. With one of the two ops asked, the pair stays stock (the conv's weight gradient is
    stock's bit for bit; with ``conv`` the block's 3x3 conv is converted), its half waiting; the
    second call, asking for the other op, converts and links both: the one-call model's
    gradients bit for bit."""
    stock = _model()
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    if op == "conv":
        once = patch_model(copy.deepcopy(stock), ops=[op])
    else:  # (the block's one BatchNorm is the pair's: the warning says why nothing is compressed)
        with pytest.warns(UserWarning, match=r"nothing is compressed; 1 scale-branch layers \(scale.bn\) wait"):
            once = patch_model(copy.deepcopy(stock), ops=[op])
    assert type(once.scale.c) is nn.Conv2d and type(once.scale.bn) is nn.BatchNorm2d
    if op == "conv":
        assert isinstance(once.conv, mnn.Conv2d)
    waiting = "scale.c" if op == "conv" else "scale.bn"
    assert f"until a call asks for their pair's other op (conv / batchnorm): 1: {waiting}" in describe(once)
    torch.manual_seed(0)
    want = _grads(stock, x)["scale.c.weight"]
    torch.manual_seed(0)
    assert torch.equal(want, _grads(once, x)["scale.c.weight"])

    twice = patch_model(once, ops=["batchnorm" if op == "conv" else "conv"])
    assert isinstance(twice.scale.c, mnn.Conv2d) and isinstance(twice.scale.bn, mnn.BatchNorm2d)
    assert twice.scale.c.__dict__.get("_mesa_scale_bn") is twice.scale.bn
    assert "until a call asks" not in describe(twice)
    _assert_pair_as_one_call(stock, twice, x)


def _assert_pair_as_one_call(stock, patched, x):
    """The scale pair's gradients of ``patched`` are those of ``stock`` patched in one call, bit
    for bit."""
    torch.manual_seed(0)
    want = _grads(patch_model(copy.deepcopy(stock)), x)
    torch.manual_seed(0)
    got = _grads(patched, x)
    for n in ("scale.c.weight", "scale.bn.weight", "scale.bn.bias"):
        assert torch.equal(want[n], got[n]), n


def test_a_waiting_half_keeps_the_options_of_its_own_call():
    """``ops=["conv"], bits=4`` then ``ops=["batchnorm"]``: the scale conv is converted with 4 bits
    (its call's), its BatchNorm with the default 8; a later call asking for conv again replaces
    the options it waits with. A BatchNorm outside the asked module set is not converted, so its
    conv goes on waiting."""
    model = patch_model(_model(), ops=["conv"], bits=4)
    patch_model(model, ops=["conv"], bits=2)
    patch_model(model, ops=["batchnorm"])
    assert model.scale.c.quant_options.bits == 2 and model.conv.quant_options.bits == 2
    assert model.scale.bn.quant_options.bits == 8
    assert model.scale.c.__dict__.get("_mesa_scale_bn") is model.scale.bn
    held = patch_model(_model(), ops=["conv"])  # (all of this model is module set "other")
    patch_model(held, ops=["batchnorm"], modules=["msa"])
    assert type(held.scale.c) is nn.Conv2d and type(held.scale.bn) is nn.BatchNorm2d
    assert "_mesa_pair_waiting" in held.scale.c.__dict__
    patch_model(held, ops=["batchnorm"], modules=["other"])
    assert held.scale.c.__dict__.get("_mesa_scale_bn") is held.scale.bn


def test_a_pair_an_earlier_call_left_half_converted_is_linked():
    """A scale conv already Mesa beside a stock BatchNorm (a model patched before pairs were
    kept whole): the call converting the BatchNorm links the two, and the pair's gradients are
    the one-call model's bit for bit (the 3x3 conv, converted by hand here, draws other
    rounding noise)."""
    stock = _model()
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    half = copy.deepcopy(stock)
    half.scale.c = mnn.Conv2d.from_module(half.scale.c)
    half.conv = mnn.Conv2d.from_module(half.conv)
    twice = patch_model(half, ops=["batchnorm"])
    assert twice.scale.c.__dict__.get("_mesa_scale_bn") is twice.scale.bn
    _assert_pair_as_one_call(stock, twice, x)


def test_unlinked_without_the_pattern_and_state_dict_unchanged():
    stock = _model()
    patched = patch_model(copy.deepcopy(stock))
    assert {k for k in patched.state_dict() if ".quantizer." not in k} == set(stock.state_dict())
    assert patched.conv.__dict__.get("_mesa_scale_bn") is None  # 3x3: not a scale branch


def test_other_consumer_uses_the_conv_input():
    """The conv output also feeds something else: its gradient is not the BatchNorm's, the
    closed form would be wrong; the 8-bit input is used (compared with the link removed)."""
    stock = _model(extra_use=True)
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    linked = patch_model(copy.deepcopy(stock), rounding="nearest")
    unlinked = copy.deepcopy(linked)
    del unlinked.scale.c.__dict__["_mesa_scale_bn"]
    a, b = _grads(linked, x), _grads(unlinked, x)
    assert torch.equal(a["scale.c.weight"], b["scale.c.weight"])
    exact = _grads(stock, x, torch.float64)
    assert _cos(exact["scale.c.weight"], a["scale.c.weight"]) > 0.999  # no cancellation now


def test_zero_weight_channel_falls_back_to_the_conv_input():
    stock = _model()
    with torch.no_grad():
        stock.scale.c.weight[3] = 0.0
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    gw = got["scale.c.weight"].flatten()
    assert torch.isfinite(gw).all()
    # channel 3: x_hat is 0, nothing to reconstruct x from; the 8-bit input's gradient
    assert ((gw[3] - exact["scale.c.weight"].flatten()[3]).abs()
            < 0.05 * exact["scale.c.weight"].flatten()[3].abs() + 1e-6)


def test_link_never_left_on_the_module():
    """A BatchNorm that does not compress (here: disabled) still drops the conv's hand-over,
    so nothing unpicklable stays on the model."""
    import io

    stock = _model()
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock))
    patched.scale.bn.set_quant_options(enabled=False)
    out = patched(x)
    assert "_mesa_scale_pending" not in patched.scale.bn.__dict__
    torch.save(patched, io.BytesIO())
    out.sum().backward()
    assert torch.isfinite(patched.scale.c.weight.grad).all()


# ----------------------------------------------------------------------------- the C++ layer ops
# In eager training, where both layers take their C++ ops (mesa::conv2d_train with scale_link,
# mesa::batch_norm_train), the hand-over goes between their C++ nodes (csrc/scale_link.h), bitwise
# the Python Functions' (conv._Conv2dFn and batchnorm._BatchNormFn with a ScaleLink).
PAIR_OPTIONS = [dict(), dict(rounding="nearest"), dict(estimator="per_sample", symmetric=True),
                dict(bits=4), dict(bits=2, scale="pow2")]


def _pair_run(fused, monkeypatch, model, device, dtype, autocast, grads, channels_last):
    """Two training steps of the patched ``ConvNorm`` ``model``, on the C++ ops (``fused``) or on
    the Python Functions; ``grads``: which of x, the conv weight, the BatchNorm weight and bias
    want a gradient. Everything observable, ``None`` for a gradient not asked for."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    model = copy.deepcopy(model).to(device, None if autocast else dtype)
    model.c.weight.requires_grad_(grads[1])
    model.bn.weight.requires_grad_(grads[2])
    model.bn.bias.requires_grad_(grads[3])
    out = []
    for step in range(2):
        x = torch.randn(4, 8, 6, 5, generator=torch.Generator().manual_seed(step)) * (step + 1) + 1
        x = x.to(device, torch.float32 if autocast else dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(grads[0])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter() as meter:
            y = model(x)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out + [p.grad for p in model.parameters()] + [b.clone() for b in model.buffers()]


def _linked_conv_norm(stride=1, **options):
    torch.manual_seed(0)
    stock = ConvNorm(8, stride).train()
    with torch.no_grad():
        stock.c.weight.uniform_(0.5, 1.5)
        stock.c.weight[5] = 0.0  # a channel whose gradient comes from the 8-bit input
        stock.bn.weight.uniform_(0.5, 1.5)
        stock.bn.bias.uniform_(-0.5, 0.5)
    patched = patch_model(stock, **options)
    assert patched.c.__dict__.get("_mesa_scale_bn") is patched.bn
    return patched


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("options", PAIR_OPTIONS, ids=str)
@pytest.mark.parametrize("stride,channels_last", [(1, False), (2, True)], ids=["s1", "s2-channels_last"])
def test_linked_pair_on_the_ops_is_bitwise_the_python_functions(device, dtype, autocast, options, stride,
                                                                channels_last, monkeypatch):
    model = _linked_conv_norm(stride, **options)
    conv_calls = count_calls(monkeypatch, "conv2d_train")
    bn_calls = count_calls(monkeypatch, "batch_norm_train")
    args = (model, device, dtype, autocast, (True, True, True, True), channels_last)
    got = _pair_run(True, monkeypatch, *args)
    assert conv_calls == bn_calls == [1, 1]
    assert_all_same_bits(got, _pair_run(False, monkeypatch, *args))
    assert conv_calls == bn_calls == [1, 1]  # (the Python Functions ran the second time)


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grads", [(False, True, True, True), (True, True, False, False), (False, True, False, True),
                                   (True, False, True, True)], ids=str)
def test_linked_pair_on_the_ops_which_gradients(device, grads, monkeypatch):
    """A frozen input or BatchNorm parameters; a frozen conv weight (no link: no cancellation
    to avoid)."""
    args = (_linked_conv_norm(), device, torch.float32, False, grads, False)
    assert_all_same_bits(_pair_run(True, monkeypatch, *args), _pair_run(False, monkeypatch, *args))


@pytest.mark.parametrize("fused", [True, False], ids=["ops", "python"])
@pytest.mark.parametrize("bn_options", [dict(), dict(estimator="learned")], ids=["bn-default", "bn-learned"])
def test_weight_gradient_matches_exact_on_either_path(fused, bn_options, monkeypatch):
    """The closed form reaches the conv whichever path each layer takes; a BatchNorm on its
    Python Function (learned thresholds) keeps the conv on its Python Function too (a C++ conv
    node could not be handed over to), and vice versa."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    stock = _model()
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    patched.scale.bn.set_quant_options(**bn_options)
    conv_calls = count_calls(monkeypatch, "conv2d_train")
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    name = "scale.c.weight"
    assert _cos(exact[name], got[name]) > 0.999
    on_ops = fused and quantizer_mod._FUSED_LAYERS and not bn_options
    assert len(conv_calls) == (2 if on_ops else 1 if fused and quantizer_mod._FUSED_LAYERS else 0)


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_op_link_only_for_the_conv_output_itself(monkeypatch):
    """A BatchNorm fed something else than the linked conv's output (here a copy of it) hands
    nothing over: the conv's weight gradient is its 8-bit input's, as with the link removed."""
    class CopyBetween(nn.Module):
        def __init__(self, pair):
            super().__init__()
            self.c, self.bn = pair.c, pair.bn

        def forward(self, x):
            return self.bn(self.c(x).clone())

    model = _linked_conv_norm(rounding="nearest")
    x = torch.randn(4, 8, 6, 5, requires_grad=True)
    copied = CopyBetween(copy.deepcopy(model))
    unlinked = CopyBetween(copy.deepcopy(model))
    del unlinked.c.__dict__["_mesa_scale_bn"]
    for m in (copied, unlinked):
        m(x).square().sum().backward()
    assert torch.equal(copied.c.weight.grad, unlinked.c.weight.grad)
    direct = copy.deepcopy(model)
    direct(x).square().sum().backward()
    assert not torch.equal(direct.c.weight.grad, unlinked.c.weight.grad)


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
@pytest.mark.parametrize("name", ["fastvit_t8", "repvit_m1"])
def test_patched_models_bitwise_on_the_ops(name, monkeypatch):
    """FastViT's and RepViT's scale branches: two training steps with drop-path on give the same
    outputs, gradients and buffers on the C++ ops as on the Python Functions, every BatchNorm
    (the linked ones included) on its op."""
    model = patch_model(build(name, drop=True))
    assert any("_mesa_scale_bn" in m.__dict__ for m in model.modules())
    # (FastViT's identity branches take batch_norm_train_offer: patch/identity_norm.py)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step),
                                      ("batch_norm_train", "batch_norm_train_offer", "batch_norm_train_take"),
                                      (mnn.BatchNorm2d, mnn.BatchNorm1d))


@pytest.mark.parametrize("fused", [True, False], ids=["ops", "python"])
def test_second_backward_with_retain_graph_hands_over_again(fused, monkeypatch):
    """``backward(retain_graph=True)`` twice: the second pass gets the closed form too, the same
    gradients as the first on either path (the Python link used to be dropped after the first
    backward, so the second took the conv's weight gradient from its 8-bit input)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    model = _linked_conv_norm(rounding="nearest")
    x = torch.randn(4, 8, 6, 5, generator=torch.Generator().manual_seed(1))
    loss = (model(x) * torch.linspace(-1, 2, 4 * 8 * 6 * 5).view(4, 8, 6, 5)).sum()
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert_all_same_bits(grads[1], grads[0])


def test_ghostnetv3_scale_branches_linked():
    """GhostNetV3's scale branches are timm ghostnet ``ConvBnAct`` modules (conv, then ``bn1``):
    linked like ``ConvNormAct`` (before, none of the 36 was). The link does not settle their
    gradients at small maps: at batch 8, 64 px the cheap_rpr_scale conv weight cosines against
    exact are median 0.87 -> 0.92, worst -1.0 both ways (the last stage, 2x2 maps)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("ghostnetv3_050", num_classes=5).train()
    patched = patch_model(model)
    branches = [(n, m) for n, m in patched.named_modules()
                if n.endswith(("cheap_rpr_scale", "dw_rpr_scale")) and hasattr(m, "conv")]  # (else Identity)
    assert len(branches) == 36
    for n, m in branches:
        assert m.conv.__dict__.get("_mesa_scale_bn") is m.bn1, n


@pytest.mark.parametrize("first", ["conv", "batchnorm"])
@pytest.mark.parametrize("name", ["fastvit_t8", "repvit_m1"])
def test_two_calls_one_op_each_equal_one_call(name, first):
    """A model patched ``ops=[conv]`` then ``ops=[batchnorm]`` (or the reverse) converts and links
    every scale branch, and trains as one call asking for both: gradients bit for bit, with
    drop-path on (before, every pair stayed stock: FastViT 11, RepViT 23)."""
    stock = build(name, drop=True)
    one = patch_model(copy.deepcopy(stock), ops=["conv", "batchnorm"])
    two = patch_model(copy.deepcopy(stock), ops=[first])
    patch_model(two, ops=["batchnorm" if first == "conv" else "conv"])
    linked = [n for n, m in two.named_modules() if "_mesa_scale_bn" in m.__dict__]
    assert linked and linked == [n for n, m in one.named_modules() if "_mesa_scale_bn" in m.__dict__]
    x = example(name, seed=1)
    grads = []
    for model in (one, two):
        torch.manual_seed(0)
        model(x).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        assert torch.equal(g, grads[1][n]), n


def test_the_link_converts_no_batchnorm_outside_the_asked_modules():
    """A scale conv made Mesa by hand beside a stock ``BatchNormAct2d`` (timm ``ConvNormAct``): a
    call asking for batchnorm in a module set the BatchNorm is not in leaves it stock and
    unlinked (the link used to convert it), and one asking in its set links the two."""
    from timm.layers import BatchNormAct2d, ConvNormAct

    def half():
        torch.manual_seed(0)
        block = nn.Sequential(ConvNormAct(8, 8, 1, groups=8, apply_act=False)).train()
        block[0].conv = mnn.Conv2d.from_module(block[0].conv)
        return block

    outside = patch_model(half(), ops=["batchnorm"], modules=["msa"])
    assert type(outside[0].bn) is BatchNormAct2d and "_mesa_scale_bn" not in outside[0].conv.__dict__
    inside = patch_model(half(), ops=["batchnorm"])
    assert isinstance(inside[0].bn, mnn.BatchNorm2d) and inside[0].conv.__dict__["_mesa_scale_bn"] is inside[0].bn


def test_a_waiting_half_keeps_its_options_through_later_calls():
    """The review's find: a waiting half marked again, or converted by a call asking for both ops,
    took that call's full options (the defaults over ``bits=4``); it takes only the explicit ones
    over its own, as a layer converted before does."""
    m = patch_model(_model(), ops=["conv"], bits=4)
    patch_model(m, ops=["conv"], rounding="nearest")
    patch_model(m, ops=["batchnorm"])
    assert (m.scale.c.quant_options.bits, m.scale.c.quant_options.rounding) == (4, "nearest")
    assert (m.conv.quant_options.bits, m.conv.quant_options.rounding) == (4, "nearest")
    m = patch_model(_model(), ops=["conv"], bits=4)
    patch_model(m, ops=["conv", "batchnorm"])
    assert m.scale.c.quant_options.bits == 4 and m.conv.quant_options.bits == 4
    assert m.scale.c.__dict__.get("_mesa_scale_bn") is m.scale.bn


def test_a_parameter_free_waiting_half_takes_the_model_s_device_then():
    """A BatchNorm without affine waiting for its conv, the model moved since: converted on the
    device the model is on then (the mark stored the device it had)."""
    block = _model()
    block.scale.bn = nn.BatchNorm2d(8, affine=False)
    patch_model(block, ops=["batchnorm"])
    assert type(block.scale.bn) is nn.BatchNorm2d and "_mesa_pair_waiting" in block.scale.bn.__dict__
    block.to("meta")
    patch_model(block, ops=["conv"])
    assert isinstance(block.scale.bn, mnn.BatchNorm2d)
    assert {b.device.type for b in block.scale.bn.buffers()} == {"meta"}


def test_describe_lists_no_pair_the_cancellation_analysis_keeps():
    """mobileone_s1 patched conv, then batchnorm: three scale convs stay stock because their
    BatchNorms are cancellation BatchNorms (listed as such), not for a missing op; describe
    does not list them as waiting (their marks stay: a cancelling_bn="compress" call converts
    them)."""
    import timm

    model = timm.create_model("mobileone_s1", num_classes=4).train()
    patch_model(model, ops=["conv"])
    patch_model(model, ops=["batchnorm"])
    waiting = [n for n, m in model.named_modules() if "_mesa_pair_waiting" in m.__dict__]
    assert waiting
    text = describe(model)
    assert "BatchNorms kept stock" in text and "until a call asks" not in text
    patch_model(model, ops=["batchnorm"], cancelling_bn="compress")
    assert all(isinstance(model.get_submodule(n), mnn.Conv2d) for n in waiting)
