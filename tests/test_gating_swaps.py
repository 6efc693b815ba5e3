"""The gating products of gMLP, MambaOut and FocalNet through ``GatedActivation`` children
(``patch/gating.py``): the swapped forwards are timm's but the products, and on the zoo models
the train forward stays bitwise stock's, the gradients close, and the full-precision operands
stock keeps are gone."""
import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.quantizer import assign_rng_keys
from mesa_train.patch import OPS, patch_model
from mesa_train.patch.coverage import coverage
from mesa_train.patch.gating import GATING_CLASSES
from timm.models.coat import ConvRelPosEnc
from timm.models.focalnet import FocalModulation
from timm.models.ghostnet import GhostModuleV2, GhostModuleV3
from timm.models.mambaout import GatedConvBlock
from timm.models.mlp_mixer import SpatialGatingUnit
from timm.models.starnet import Block as StarBlock

from source_lines import code_lines
from timm_zoo import build, example

# stock line -> Mesa line: the products, each of which must occur in timm's forward
PRODUCTS = {
    SpatialGatingUnit: {"return u * v.transpose(-1, -2)": "return self.mesa_gate(u, v.transpose(-1, -2))"},
    GatedConvBlock: {"x = self.fc2(self.act(g) * torch.cat((i, c), dim=-1))":
                     "x = self.fc2(self.mesa_gate(g, torch.cat((i, c), dim=-1)))"},
    FocalModulation: {
        "ctx_all = ctx_all + ctx * gates[:, l:l + 1]":
            "ctx_all = ctx_all + self.mesa_focal_gates[l](ctx, gates[:, l:l + 1])",
        "ctx_all = ctx_all + ctx_global * gates[:, self.focal_level:]":
            "ctx_all = ctx_all + self.mesa_focal_gates[self.focal_level](ctx_global, gates[:, self.focal_level:])",
        "x_out = q * self.h(ctx_all)": "x_out = self.mesa_gate(q, self.h(ctx_all))"},
    StarBlock: {"x = self.act(x1) * x2": "x = self.mesa_gate(self.act(x1), x2)"},
    ConvRelPosEnc: {"EV_hat = q_img * conv_v_img": "EV_hat = self.mesa_gate(q_img, conv_v_img)"},
    GhostModuleV2: {"return out[:, :self.out_chs, :, :] * F.interpolate(":
                    "return self.mesa_gate(out[:, :self.out_chs, :, :], F.interpolate(",
                    "self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest')":
                    "self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest'))"},
    GhostModuleV3: {"return out[:,:self.out_chs,:,:] * F.interpolate(":
                    "return self.mesa_gate(out[:,:self.out_chs,:,:], F.interpolate(",
                    "self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest')":
                    "self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest'))"},
}
MODELS = {"gmlp_s16_224": SpatialGatingUnit, "mambaout_femto": GatedConvBlock, "focalnet_tiny_srf": FocalModulation,
          "starnet_s1": StarBlock, "coat_lite_tiny": ConvRelPosEnc}
NO_GLU = tuple(o for o in OPS if o != "glu")  # everything but these swaps
# what a patched model may still keep in full precision: StarNet's BatchNorms after a cancelling
# scale (patch/cancellation.py) and its head (timm's Linear subclass, reported by patch_model)
# (CoaT's softmax over the tokens, dim 2, has been routed since session 47: nothing left there)
LEFT_BY_DESIGN = {"starnet_s1": {"BatchNorm2d", "Linear"}}
COSINE_MIN = 0.999
# fc2's weight gradient (gMLP, MambaOut) is set by fc2's own 8-bit input, the product's output, not by
# the swap: 0.9989-0.9991 over build seeds with and without it
FC2_WEIGHT_MIN = 0.998
# CoaT's position-encoding convs: set by their own 8-bit input (v), 0.9972-0.9978 with and without the swap
CRPE_CONV_MIN = 0.997
# saved bytes with the swaps over without them (zoo size, batch 2); measured 0.555, 0.484, 0.622,
# 0.535, 0.642
BYTES_MAX = {"gmlp_s16_224": 0.6, "mambaout_femto": 0.52, "focalnet_tiny_srf": 0.66, "starnet_s1": 0.58,
             "coat_lite_tiny": 0.68}


@pytest.mark.parametrize("stock_cls", list(GATING_CLASSES), ids=lambda c: c.__name__)
def test_mesa_forward_is_the_stock_source_but_the_products(stock_cls):
    """A timm release that changes one of these forwards fails here (then update patch/gating.py)."""
    stock, mesa = code_lines(stock_cls.forward), code_lines(GATING_CLASSES[stock_cls][1].forward)
    swaps = PRODUCTS[stock_cls]
    assert all(ln in stock for ln in swaps), f"a product line changed in timm's {stock_cls.__name__}.forward"
    assert mesa == [swaps.get(ln, ln) for ln in stock]


def test_plain_product_broadcasts_in_closed_form(monkeypatch):
    """``GatedActivation(nn.Identity())``: ``a * b`` bitwise, with FocalNet's broadcasting
    operands; backward in closed form (no ``torch.autograd.grad``: ``torch.compile`` cannot
    trace that), each gradient in its operand's shape."""
    def no_grad_call(*args, **kwargs):
        raise AssertionError("autograd.grad in a plain product's backward")

    torch.manual_seed(0)
    for a_shape, b_shape in (((2, 6, 5, 5), (2, 1, 5, 5)), ((2, 6, 1, 1), (2, 1, 5, 5)), ((2, 7, 6), (2, 7, 6))):
        a, b = torch.randn(a_shape), torch.rand(b_shape)
        layer = mn.GatedActivation(nn.Identity(), num_groups=a_shape[1])
        assign_rng_keys(layer)
        ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = layer(ga, gb)
        ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
        ref = ref_a * ref_b
        assert torch.equal(y, ref)
        g = torch.randn_like(ref)
        ref.backward(g)
        with monkeypatch.context() as mp:
            mp.setattr(torch.autograd, "grad", no_grad_call)
            y.backward(g)
        for got, want in ((ga.grad, ref_a.grad), (gb.grad, ref_b.grad)):
            assert got.shape == want.shape
            assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999


def _swapped(model, stock_cls):
    return [m for m in model.modules() if isinstance(m, stock_cls)]


def _bytes(model, x):
    with SavedTensorMeter(model) as meter:
        torch.manual_seed(0)
        model(x)
    return meter.activation_bytes


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    den = a.norm() * b.norm()
    return (a @ b / den).item() if den > 0 else float(a.norm() == b.norm())


@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_swapped_bitwise_and_smaller(name):
    stock_cls = MODELS[name]
    mesa_cls = GATING_CLASSES[stock_cls][1]
    x = example(name)

    # the swap: every instance, its products as GatedActivation children; MambaOut's act runs
    # inside its child and stays the stock module
    stock = build(name, drop=True)
    patched = patch_model(copy.deepcopy(stock))
    found = _swapped(patched, stock_cls)
    assert found and all(type(m) is mesa_cls for m in found)
    for m in found:
        gates = [c for c in m.modules() if isinstance(c, mn.GatedActivation)]
        assert gates and all(type(g.act_fn) in (nn.Identity, nn.GELU) for g in gates)
        if stock_cls is GatedConvBlock:
            assert type(m.act) is nn.GELU and m.mesa_gate.act_fn is m.act
    assert all(type(m) is stock_cls for m in _swapped(patch_model(copy.deepcopy(stock), ops=NO_GLU), stock_cls))
    patch_model(patched)  # patching again adds nothing
    assert sum(isinstance(c, mn.GatedActivation) for c in patched.modules()) == sum(
        sum(isinstance(c, mn.GatedActivation) for c in m.modules()) for m in found)

    # train forward, dropout and drop-path on: stock's bits
    torch.manual_seed(5)
    ref = stock(x)
    torch.manual_seed(5)
    assert torch.equal(ref, patched(x))

    # saved bytes: below the patch without the swaps, nothing left in full precision
    stock = build(name)
    without = patch_model(copy.deepcopy(stock), ops=NO_GLU)
    patched = patch_model(copy.deepcopy(stock))
    assert _bytes(patched, x) < BYTES_MAX[name] * _bytes(without, x)
    left = {row[1] for row in coverage(patched, x).rows if row[0] == "left as is"}
    assert left <= LEFT_BY_DESIGN.get(name, set()), left


def _exercised(model):
    """timm's gMLP init zeroes the head, so no gradient reaches the blocks (every block's is 0),
    and sets the spatial gate's proj weights to 1e-6 (``v`` about 1, a gate that gates nothing):
    a random head and gate instead, so that the gradients depend on the product's operands."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and not m.weight.any():
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, SpatialGatingUnit):
                nn.init.normal_(m.proj.weight, std=0.5)
    return model


def _float64_grads(stock, x):
    model = copy.deepcopy(stock).double()
    model.zero_grad(set_to_none=True)
    out = model(x.double())
    g = torch.Generator().manual_seed(123)
    (out * torch.randn(out.shape, generator=g).double()).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_gradients_close(name):
    """Each parameter's gradient against stock fp32's (same seed), cosine >= 0.999."""
    stock = _exercised(build(name))
    patched = patch_model(copy.deepcopy(stock))
    assert type(_swapped(patched, MODELS[name])[0]) is not MODELS[name]
    x = example(name)
    g = torch.Generator().manual_seed(123)
    for model in (stock, patched):
        out = model(x)
        (out * torch.randn(out.shape, generator=g.manual_seed(123))).sum().backward()
    grads = {n: p.grad for n, p in patched.named_parameters()}
    exact = _float64_grads(stock, x)
    scale = max(g.norm().item() for g in exact.values())
    worst = []
    for n, p in stock.named_parameters():
        assert p.grad.any() or n.endswith("bias"), f"{n}: no gradient in stock, nothing to compare"
        if exact[n].norm() < 1e-9 * scale:
            # zero in exact arithmetic (a conv bias before a BatchNorm: StarNet): both runs hold
            # rounding noise there, nothing to compare
            continue
        floor = (FC2_WEIGHT_MIN if n.endswith("fc2.weight") else CRPE_CONV_MIN if ".conv_list." in n
                 else COSINE_MIN)
        c = _cos(p.grad, grads[n])
        if c < floor:
            worst.append((n, round(c, 5)))
    assert not worst, worst


@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_eval_and_disabled_are_stock(name):
    stock = _exercised(build(name))
    x = example(name)
    patched = patch_model(copy.deepcopy(stock))
    with torch.no_grad():
        assert torch.equal(stock.eval()(x), patched.eval()(x))
    stock.train()
    off = patch_model(copy.deepcopy(stock), enabled=False)
    assert type(_swapped(off, MODELS[name])[0]) is GATING_CLASSES[MODELS[name]][1]
    for model in (stock, off):
        model(x).square().sum().backward()
    with SavedTensorMeter(off) as meter_off:
        off(x)
    with SavedTensorMeter(stock) as meter_stock:
        stock(x)
    assert meter_off.activation_bytes == meter_stock.activation_bytes
    grads = dict(off.named_parameters())
    for n, p in stock.named_parameters():
        assert torch.equal(p.grad, grads[n].grad), n


@pytest.mark.parametrize("name,module_cls", [("ghostnetv2_100", GhostModuleV2), ("ghostnetv3_050", GhostModuleV3)])
def test_ghostnet_dfc_gates_through_a_product_child(name, module_cls):
    """GhostNetV2/V3's DFC attention, ``out[:, :out_chs] * F.interpolate(gate_fn(res))``, kept the
    ghost features (the whole concatenation, through the slice) and the upsampled gate whole
    without a word (ghostnetv2_100 at 64 px: 0.55x -> 0.42x of stock's bytes). Stock's bits,
    gradients close."""
    import timm

    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=5).train()
    patched = patch_model(copy.deepcopy(stock))
    gated = [m for m in patched.modules() if isinstance(m, module_cls) and hasattr(m, "mesa_gate")]
    assert gated and all(type(m) is GATING_CLASSES[module_cls][1] for m in gated)
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(1)
    want = stock(x)
    torch.manual_seed(1)
    with SavedTensorMeter(patched) as b:
        got = patched(x)
    assert torch.equal(got, want)
    without = patch_model(copy.deepcopy(stock), ops=NO_GLU)
    torch.manual_seed(1)
    with SavedTensorMeter(without) as c:
        kept = without(x)
    assert b.activation_bytes < 0.9 * c.activation_bytes
    want.square().sum().backward(), got.square().sum().backward(), kept.square().sum().backward()
    # every gradient close to stock's where it is without the swap: a few BatchNorm weights before
    # GhostNetV2's stride-2 blocks are near-cancellations Mesa's noise swamps either way
    # (results/timm/sweep.md, session 78); GhostNetV3's scale-branch convs move with the noise
    # (0.985-0.999, as RepViT's: tests/test_timm_models.py)
    grads, grads_without = dict(patched.named_parameters()), dict(without.named_parameters())
    for n, p in stock.named_parameters():
        if p.grad is not None and p.grad.norm() > 1e-5 and _cos(p.grad, grads_without[n].grad) > 0.99:
            assert _cos(p.grad, grads[n].grad) > 0.98, n
