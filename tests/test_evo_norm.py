"""Mesa EvoNorm (B0/B1/B2, S0/S0a/S1/S1a/S2/S2a) and FRN (TLU, Act) layers (nn/evo_norm.py):
the forward is stock's bit for bit, the running variance is updated once, gradients are close to
stock's, and the layer keeps far fewer bytes. Before, ``patch_model`` left them stock without a
word (``resnetv2_50d_frn`` 0.79x, ``*_evos`` 0.84-0.86x of stock's bytes in the census)."""
import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import evo_norm as evo
from timm.layers import filter_response_norm as frn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.evo_norm import EVO_NORM_CLASSES
from mesa_train.patch import OPS, mesa_state_keys, patch_model

C = 16
_GROUPED = dict(groups=4)
# (stock class, constructor kwargs); apply_act=False / no tau: the affine map alone
CASES = [
    (evo.EvoNorm2dB0, {}), (evo.EvoNorm2dB0, dict(apply_act=False)), (evo.EvoNorm2dB1, {}), (evo.EvoNorm2dB2, {}),
    (evo.EvoNorm2dS0, _GROUPED), (evo.EvoNorm2dS0, dict(apply_act=False, **_GROUPED)), (evo.EvoNorm2dS0a, _GROUPED),
    (evo.EvoNorm2dS1, _GROUPED), (evo.EvoNorm2dS1a, _GROUPED), (evo.EvoNorm2dS2, _GROUPED),
    (evo.EvoNorm2dS2a, _GROUPED), (frn.FilterResponseNormTlu2d, {}),
    (frn.FilterResponseNormTlu2d, dict(apply_act=False)), (frn.FilterResponseNormAct2d, {}),
]
IDS = [f"{cls.__name__}{'-' + '-'.join(f'{k}={v}' for k, v in kw.items()) if kw else ''}" for cls, kw in CASES]


def _stock(cls, kw, seed=0):
    torch.manual_seed(seed)
    layer = cls(C, **kw).train()
    with torch.no_grad():  # off their initial values (weight 1, bias 0, v 1, tau 0): every term matters
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def _input(seed=1, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, C, 6, 5, generator=g) * 2 + 0.5
    return x.to(memory_format=torch.channels_last) if channels_last else x


def _run(layer, x):
    """Output, the parameters' and the input's gradients, the buffers after backward, saved bytes."""
    x = x.clone().requires_grad_(True)
    with SavedTensorMeter(layer) as meter:
        y = layer(x)
    g = torch.Generator().manual_seed(7)
    y.backward(torch.randn(y.shape, generator=g).to(memory_format=torch.contiguous_format))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["input"] = x.grad.clone()
    return y.detach(), grads, {n: b.clone() for n, b in layer.named_buffers() if "quantizer" not in n}, \
        meter.activation_bytes


def _cosines(a, b):
    return {n: F.cosine_similarity(a[n].flatten().double(), b[n].flatten().double(), 0).item() for n in a}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_forward_is_stock_and_gradients_are_close(cls, kw, rounding):
    stock = _stock(cls, kw)
    mesa = EVO_NORM_CLASSES[cls].from_module(copy.deepcopy(stock), rounding=rounding)
    assert isinstance(mesa, cls) and isinstance(mesa, mnn.MesaLayer)
    x = _input()
    y0, g0, b0, bytes0 = _run(stock, x)
    y1, g1, b1, bytes1 = _run(mesa, x)
    assert torch.equal(y0, y1)
    for name in b0:  # the B variants' running_var: updated by the forward once, not by the re-run
        assert torch.equal(b0[name], b1[name]), name
    assert g0.keys() == g1.keys()
    cos = _cosines(g0, g1)
    assert min(cos.values()) > (0.999 if rounding == "nearest" else 0.995), cos
    assert bytes1 < 0.6 * bytes0, (bytes1, bytes0)


@pytest.mark.parametrize("cls,kw", [c for c in CASES if c[0] in (evo.EvoNorm2dS0, evo.EvoNorm2dB0,
                                                                  frn.FilterResponseNormTlu2d)],
                         ids=["S0", "S0-noact", "B0", "B0-noact", "TLU", "TLU-notau"])
def test_channels_last_and_eval(cls, kw):
    """A channels-last input keeps its layout in the input gradient (the codes are taken through
    the NHWC view); in eval mode and without gradients the layer is stock, bit for bit."""
    stock = _stock(cls, kw)
    mesa = EVO_NORM_CLASSES[cls].from_module(copy.deepcopy(stock), rounding="nearest")
    x = _input(channels_last=True)
    y0, g0, _, _ = _run(stock, x)
    y1, g1, _, _ = _run(mesa, x)
    assert torch.equal(y0, y1)
    assert g1["input"].is_contiguous(memory_format=torch.channels_last) == \
        g0["input"].is_contiguous(memory_format=torch.channels_last)
    assert min(_cosines(g0, g1).values()) > 0.999
    stock.eval()
    mesa.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), mesa(x))


def test_the_tlu_side_masks_matter():
    """Without the exact side of max(z, tau), every z within a rounding step of tau may take the
    other branch: at timm's initial values (tau 0: half the elements on each side) the input
    gradient read cosine 0.996 from the re-run alone; with the masks, stock's side everywhere."""
    torch.manual_seed(0)
    stock = frn.FilterResponseNormTlu2d(32).train()
    mesa = mnn.FilterResponseNormTlu2d.from_module(copy.deepcopy(stock), rounding="nearest")
    x = torch.randn(8, 32, 12, 12)
    grads = []
    for layer in (stock, mesa):
        xi = x.clone().requires_grad_(True)
        layer(xi).sum().backward()
        grads.append({"input": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    cos = _cosines(*grads)
    assert cos["input"] > 0.9999 and min(cos.values()) > 0.9999, cos


def test_bf16_autocast_forward_is_stock():
    stock = _stock(evo.EvoNorm2dS0, _GROUPED)
    mesa = mnn.EvoNorm2dS0.from_module(copy.deepcopy(stock))
    x = _input()
    outs = []
    for layer in (stock, mesa):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi.to(torch.bfloat16))
        y.float().sum().backward()
        outs.append((y.detach(), xi.grad))
    assert outs[0][0].dtype == outs[1][0].dtype and torch.equal(outs[0][0], outs[1][0])
    assert F.cosine_similarity(outs[0][1].flatten(), outs[1][1].flatten(), 0) > 0.99


def test_a_subclass_with_its_own_forward_is_refused():
    class Mine(evo.EvoNorm2dS0):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="expected an instance of timm.layers.evo_norm.EvoNorm2dS0"):
        mnn.EvoNorm2dS0.from_module(Mine(C, **_GROUPED))
    with pytest.raises(TypeError):
        mnn.EvoNorm2dS0.from_module(evo.EvoNorm2dS0a(C, **_GROUPED))  # (another formula)


MODELS = ["resnetv2_50d_evos", "resnetv2_50d_frn", "regnetz_b16_evos"]


@pytest.mark.parametrize("name", MODELS)
def test_timm_models(name):
    """patch_model converts every EvoNorm / FRN of the model; the train-mode forward is stock's,
    the gradients close, the saved bytes a fraction of what they were with the norms stock, and
    the state dict the stock one plus the quantizers' (a stock checkpoint loads)."""
    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=5).train()
    n_norms = sum(type(m) in EVO_NORM_CLASSES for m in stock.modules())
    assert n_norms > 10
    patched = patch_model(copy.deepcopy(stock))
    converted = [m for m in patched.modules() if isinstance(m, tuple(EVO_NORM_CLASSES.values()))]
    assert len(converted) == n_norms
    assert not any(type(m) in EVO_NORM_CLASSES for m in patched.modules())
    without = patch_model(copy.deepcopy(stock), ops=[o for o in OPS if o != "evonorm"])  # (their own op)
    assert sum(type(m) in EVO_NORM_CLASSES for m in without.modules()) == n_norms
    x = torch.randn(2, 3, 64, 64)
    results = []
    for m in (stock, patched, without):
        torch.manual_seed(1)
        with SavedTensorMeter(m) as meter:
            y = m(x)
        y.sum().backward()
        results.append((y.detach(), {n: p.grad for n, p in m.named_parameters()}, meter.activation_bytes))
    assert torch.equal(results[0][0], results[1][0])
    cos = {n: F.cosine_similarity(results[0][1][n].flatten(), results[1][1][n].flatten(), 0).item()
           for n in results[0][1] if results[0][1][n].norm() > 0}
    assert min(cos.values()) > 0.99, sorted(cos.items(), key=lambda kv: kv[1])[:3]
    assert results[1][2] < 0.5 * results[2][2], (results[1][2], results[2][2])
    assert set(patched.state_dict()) == set(stock.state_dict()) | mesa_state_keys(patched)
    fresh = timm.create_model(name, num_classes=5)
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        patch_model(fresh).load_state_dict(stock.state_dict())


def test_s1_act_stays_stock_inside_the_norm():
    """EvoNorm S1/S2 apply their ``act`` (SiLU) to x inside the norm: it is not converted on
    its own (the norm's 8-bit x covers it); FRN-Act's act, applied to the output, is."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, C, 3), evo.EvoNorm2dS1(C, **_GROUPED),
                                torch.nn.Conv2d(C, C, 3), frn.FilterResponseNormAct2d(C))
    patch_model(model)
    assert isinstance(model[1], mnn.EvoNorm2dS1) and type(model[1].act) is torch.nn.SiLU
    assert isinstance(model[3], mnn.FilterResponseNormAct2d) and isinstance(model[3].act, mnn.ReLU)
    x = torch.randn(2, 3, 12, 12)
    model(x).sum().backward()  # (runs: the act inside is called by both runs of the norm)


def test_under_compile_the_norms_run_stock_in_one_graph():
    """Dynamo does not trace the re-run's autograd.grad: under torch.compile the layers take the
    stock forward, traced (one graph, no break at each norm)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, C, 3), evo.EvoNorm2dS0(C, **_GROUPED),
                                torch.nn.Conv2d(C, C, 3), frn.FilterResponseNormTlu2d(C),
                                torch.nn.Conv2d(C, C, 3), evo.EvoNorm2dB0(C)).train()
    patch_model(model)
    assert isinstance(model[1], mnn.EvoNorm2dS0) and isinstance(model[5], mnn.EvoNorm2dB0)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(torch.randn(2, 3, 12, 12, requires_grad=True))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons


def test_tlu_ties_split_the_gradient_as_torch_maximum():
    """z == tau (an all-zero sample-channel at timm's initial bias 0, tau 0): torch.maximum gives
    half the gradient to each side. tau's gradient is the masks and g alone, so it equals
    stock's to summation order, ties included."""
    torch.manual_seed(0)
    stock = frn.FilterResponseNormTlu2d(8).train()
    mesa = mnn.FilterResponseNormTlu2d.from_module(copy.deepcopy(stock))
    x = torch.randn(4, 8, 6, 6)
    x[0, 0] = 0
    x[2, 5] = 0
    g = torch.rand(4, 8, 6, 6) + 0.5  # (one sign: a tie's half is not cancelled by the other ties)
    taus = []
    for layer in (stock, mesa):
        layer(x.clone().requires_grad_(True)).backward(g)
        taus.append(layer.tau.grad)
    torch.testing.assert_close(taus[1], taus[0], rtol=1e-6, atol=1e-5)


def _grads_of(model, x, g, params=None):
    """Input and parameter gradients of ``(model(x) * g).sum()``; with ``params`` through
    ``torch.func.functional_call`` (the gradients of those tensors)."""
    xi = x.clone().requires_grad_(True)
    y = torch.func.functional_call(model, params, (xi,)) if params is not None else model(xi)
    (y * g).sum().backward()
    out = {"input": xi.grad}
    out.update({n: t.grad for n, t in (params.items() if params is not None else model.named_parameters())})
    return out


@pytest.mark.parametrize("cls,kw", [c for c in CASES if c[0] in (evo.EvoNorm2dS0, evo.EvoNorm2dB0,
                                                                  frn.FilterResponseNormTlu2d)][::2],
                         ids=["S0", "B0", "TLU"])
def test_functional_call_gradients_reach_the_given_tensors(cls, kw):
    """Under ``torch.func.functional_call`` the forward reads the given tensors: the backward's
    re-run must too (it read the module's own, and the given tensors got no gradient)."""
    stock = torch.nn.Sequential(_stock(cls, kw))
    mesa = patch_model(copy.deepcopy(stock), rounding="nearest")
    assert isinstance(mesa[0], mnn.MesaLayer)
    x, g = _input(), torch.randn(4, C, 6, 5)
    grads = []
    for model in (stock, mesa):
        params = {n: (p.detach() * 1.5 + 0.2).requires_grad_(True) for n, p in model.named_parameters()}
        grads.append(_grads_of(model, x, g, params))
    assert all(v is not None for v in grads[1].values()), grads[1]
    assert min(_cosines(*grads).values()) > 0.999


def test_a_parametrization_added_after_patching_gets_its_gradient():
    """patch_model's doc says: apply parametrizations after patching. The weight is then
    computed from ``parametrizations.weight.original``, which must get its gradient."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    stock = torch.nn.Sequential(_stock(evo.EvoNorm2dS0, _GROUPED))
    mesa = patch_model(copy.deepcopy(stock), rounding="nearest")
    for model in (stock, mesa):
        parametrize.register_parametrization(model[0], "weight", Doubled())
    x, g = _input(), torch.randn(4, C, 6, 5)
    grads = [_grads_of(m, x, g) for m in (stock, mesa)]
    assert grads[1]["0.parametrizations.weight.original"] is not None
    assert min(_cosines(*grads).values()) > 0.999


def test_s1_with_a_parametric_act_inside():
    """S1's act is called inside the norm: its parameters (a PReLU's weight) get their gradient."""
    stock = evo.EvoNorm2dS1(C, act_layer=torch.nn.PReLU, **_GROUPED).train()
    mesa = mnn.EvoNorm2dS1.from_module(copy.deepcopy(stock), rounding="nearest")
    x, g = _input(), torch.randn(4, C, 6, 5)
    grads = [_grads_of(m, x, g) for m in (stock, mesa)]
    assert grads[1]["act.weight"] is not None
    assert min(_cosines(*grads).values()) > 0.995  # (PReLU's kink from the 8-bit input: no side mask)


def _saved_bytes(layer, x):
    with SavedTensorMeter(layer) as meter:
        layer(x.clone().requires_grad_(True)).sum().backward()
    layer.zero_grad(set_to_none=True)
    return meter.activation_bytes


def test_hooks_and_pruning():
    """A forward hook on the inside act that changes its output is part of the function: the
    re-run calls it too (skipping it gave input gradients off by 1.37 of 2.74). prune after
    patching (its pre-hook sets self.weight from weight_orig, which a re-run from weight_orig
    misses: weight_orig got no gradient): the layer runs stock, gradients bitwise stock's; on
    the inside act's weight the act's own pre-hook runs in the re-run."""
    from torch.nn.utils import prune

    x, g = _input(), torch.randn(4, C, 6, 5)
    stock = evo.EvoNorm2dS1(C, act_layer=torch.nn.PReLU, **_GROUPED).train()
    mesa = mnn.EvoNorm2dS1.from_module(copy.deepcopy(stock), rounding="nearest")
    compressed = _saved_bytes(mesa, x)
    for layer in (stock, mesa):
        layer.act.register_forward_hook(lambda m, i, o: o * 2)
        prune.l1_unstructured(layer.act, "weight", amount=0.5)
    grads = [_grads_of(m, x, g) for m in (stock, mesa)]
    assert grads[1]["act.weight_orig"] is not None
    assert min(_cosines(*grads).values()) > 0.995
    assert _saved_bytes(mesa, x) == compressed  # (still compressed)
    stock = _stock(evo.EvoNorm2dS0, _GROUPED)
    mesa = mnn.EvoNorm2dS0.from_module(copy.deepcopy(stock))
    for layer in (stock, mesa):
        prune.l1_unstructured(layer, "weight", amount=0.25)
    grads = [_grads_of(m, x, g) for m in (stock, mesa)]
    assert grads[1]["weight_orig"] is not None
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_tensor_under_two_names_gets_both_shares():
    """A bias tied to the weight (or one tensor given for both to functional_call): the re-run
    substitutes both names, so the gradient is the sum of both uses, as stock's."""
    stock = _stock(evo.EvoNorm2dS0, _GROUPED)
    stock.bias = stock.weight
    mesa = mnn.EvoNorm2dS0.from_module(copy.deepcopy(stock), rounding="nearest")
    assert mesa.bias is mesa.weight
    x, g = _input(), torch.randn(4, C, 6, 5)
    grads = [_grads_of(m, x, g) for m in (stock, mesa)]
    assert min(_cosines(*grads).values()) > 0.999
    untied = torch.nn.Sequential(_stock(evo.EvoNorm2dS0, _GROUPED))
    both = [untied, patch_model(copy.deepcopy(untied), rounding="nearest")]
    grads, shared = [], torch.rand(C) + 0.5
    for model in both:
        t = shared.clone().requires_grad_(True)
        params = {"0.weight": t, "0.bias": t, "0.v": torch.ones(C, requires_grad=True)}
        grads.append(_grads_of(model, x, g, params))
    assert min(_cosines(*grads).values()) > 0.999


def test_higher_order_gradients_are_refused_in_one_line():
    """A gradient penalty through the layer: its backward is not differentiable (it re-runs from
    the 8-bit copy), and create_graph=True lost the second-order term without a word."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, C, 1), evo.EvoNorm2dS0(C, **_GROUPED)).train()
    patch_model(model, ops=["evonorm"])
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    out = model(x).sum()
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\) through "
                                           r"a Mesa EvoNorm2dS0 are not supported"):
        torch.autograd.grad(out, x, create_graph=True)


def test_eval_between_forward_and_backward_keeps_the_forward_branch():
    """B0's forward in train mode divides by the batch variance; a model.eval() before backward
    must not turn the re-run to the running variance."""
    stock = _stock(evo.EvoNorm2dB0, {})
    mesa = mnn.EvoNorm2dB0.from_module(copy.deepcopy(stock), rounding="nearest")
    x, g = _input(), torch.randn(4, C, 6, 5)
    grads = []
    for layer in (stock, mesa):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        layer.eval()
        (y * g).sum().backward()
        grads.append({"input": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
        assert not layer.training
    assert min(_cosines(*grads).values()) > 0.999
