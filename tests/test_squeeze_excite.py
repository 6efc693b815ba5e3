"""Squeeze-excite: the Mesa ``ChannelGate`` (``x * s`` keeping 8-bit ``x``, one group per
channel) and the swapped timm blocks (``patch/squeeze_excite.py``)."""
import copy
import inspect
import warnings

import pytest
import torch
from torch import nn
from timm.layers.eca import CecaModule, EcaModule
from timm.layers.global_context import GlobalContext
from timm.layers.selective_kernel import SelectiveKernel
from timm.layers.split_attn import SplitAttn
from timm.models.hgnet import EseModule
from timm.models.senet import SEModule as LegacySEModule
from torchvision.ops.misc import SqueezeExcitation as TorchvisionSE

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.quantizer import assign_rng_keys
from mesa_train.patch import patch_model
from mesa_train.patch.squeeze_excite import SE_CLASSES


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _metered(stock, patched, x, seed=None):
    """``(stock's output, patched's, stock's saved activation bytes, patched's)``, each forward
    from the same ``seed`` when given (the same dropout masks)."""
    out = []
    for model in (stock, patched):
        if seed is not None:
            torch.manual_seed(seed)
        with SavedTensorMeter(model) as meter:
            y = model(x)
        out.append((y, meter.activation_bytes))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _run(gate, x, s, g):
    x, s = x.clone().requires_grad_(), s.clone().requires_grad_()
    with SavedTensorMeter(gate if isinstance(gate, nn.Module) else nn.Module()) as meter:
        y = gate(x, s)
    y.backward(g)
    return y.detach(), x.grad, s.grad, meter.activation_bytes


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nhwc_tensor"])
def test_channel_gate(layout):
    """Channels three decades apart: per-channel groups keep every gate's gradient; ``dx``
    is stock's bit for bit (the gate is kept as it is)."""
    torch.manual_seed(0)
    c = 12
    x = torch.randn(4, c, 7, 7) * torch.logspace(-2, 1, c).view(1, c, 1, 1)
    s = torch.rand(4, c, 1, 1)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "nhwc_tensor":  # timm's SqueezeExciteCl: (N, H, W, C)
        x, s = x.permute(0, 2, 3, 1).contiguous(), s.permute(0, 2, 3, 1).contiguous()
    g = torch.randn_like(x * s)
    ref = _run(lambda a, b: a * b, x, s, g)
    gate = mn.ChannelGate(num_groups=c)
    # keyed by name as patch_model keys its quantizers: an unkeyed one draws its rounding by how
    # many quantizers the process built before, so the worst channel (0.9990-0.9998 over draws
    # with the gate along the last dim) depended on test order
    assign_rng_keys(gate)
    got = _run(gate, x, s, g)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert got[0].stride() == ref[0].stride() and got[1].stride() == ref[1].stride()
    assert _cos(ref[2], got[2]) > 0.9995
    last = layout == "nhwc_tensor"  # the gate along the last dim
    worst = min(_cos(ref[2][..., i], got[2][..., i]) if last else _cos(ref[2][:, i], got[2][:, i]) for i in range(c))
    assert worst > 0.999  # the smallest channel too
    assert got[3] < 0.3 * x.numel() * 4 + s.numel() * 4 * 2


def test_channel_gate_without_gate_gradient_keeps_nothing_of_x():
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    s = torch.rand(2, 4, 1, 1)  # a constant gate: no codes of x needed
    gate = mn.ChannelGate(num_groups=4)
    with SavedTensorMeter(gate) as meter:
        y = gate(x, s)
    assert meter.activation_bytes == s.numel() * 4
    y.sum().backward()
    assert torch.equal(x.grad, s.expand_as(x))


@pytest.mark.parametrize("stock_cls", list(SE_CLASSES), ids=lambda c: c.__name__)
def test_mesa_forward_is_the_stock_source_but_the_product(stock_cls):
    """Each swapped forward is timm's (torchvision's), line for line, but ``x * self.gate(x_se)``
    (``scale * input``): a release that changes one of them fails here (then update
    ``patch/squeeze_excite.py``)."""
    def lines(fn):
        src = inspect.getsource(fn)
        body = [ln.split("#")[0].rstrip() for ln in src.splitlines()[1:]]
        return [ln for ln in body if ln.strip() and not ln.strip().startswith(('"""', "'''"))]

    stock = lines(stock_cls.forward)
    mesa = lines(SE_CLASSES[stock_cls].forward)
    if stock_cls is TorchvisionSE:  # (two lines: the scale, then the product)
        assert [ln.strip() for ln in stock] == ["scale = self._scale(input)", "return scale * input"]
        assert [ln.strip() for ln in mesa if not ln.strip().startswith('"')] == [
            "return self.mesa_gate(input, self._scale(input))"]
        return
    products = _PRODUCT_LINES.get(stock_cls, _SE_PRODUCT_LINE)
    stock = [ln.strip() for ln in stock]
    mesa = [ln.strip() for ln in mesa if not ln.strip().startswith('"')]
    assert set(products) <= set(stock), "the product line moved: update patch/squeeze_excite.py"
    assert [products.get(ln, ln) for ln in stock] == mesa


# the lines of a stock forward that the Mesa one writes through mesa_gate (the same products)
_SE_PRODUCT_LINE = {"return x * self.gate(x_se)": "return self.mesa_gate(x, self.gate(x_se))"}
_PRODUCT_LINES = {
    EcaModule: {"return x * y.expand_as(x)": "return self.mesa_gate(x, y)"},
    CecaModule: {"return x * y.expand_as(x)": "return self.mesa_gate(x, y)"},
    LegacySEModule: {"return module_input * x": "return self.mesa_gate(module_input, x)"},
    EseModule: {"return torch.mul(identity, x)": "return self.mesa_gate(identity, x)"},
    GlobalContext: {"x = x * self.gate(mlp_x)": "x = self.mesa_gate(x, self.gate(mlp_x))"},
    SelectiveKernel: {"x = x * x_attn": "x = self.mesa_gate(x.flatten(1, 2), x_attn.flatten(1, 2)).view(x.shape)"},
    SplitAttn: {"out = (x * x_attn.reshape((B, self.radix, RC // self.radix, 1, 1))).sum(dim=1)":
                "out = self.mesa_gate(x.flatten(1, 2), x_attn).view(x.shape).sum(dim=1)",
                "out = x * x_attn": "out = self.mesa_gate(x, x_attn)"},
}


def _se_net(se_cls):
    from timm.layers.squeeze_excite import SqueezeExciteCl

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, padding=1)
            self.act = nn.SiLU()
            self.se = se_cls(16, 4) if se_cls in (TorchvisionSE, LegacySEModule) else se_cls(16)
            if se_cls is GlobalContext:
                # 8 channels in its MLP, not 16 / 8 = 2: a LayerNorm over 2 channels makes its
                # output the sign of their difference, and the gradient an eps term, whose
                # norm Mesa's 8-bit LayerNorm input cut by 30% (cosine 0.998, float32 stock 1.0)
                self.se = se_cls(16, rd_ratio=1 / 2)
            self.head = nn.Linear(16, 5)

        def forward(self, x):
            h = self.act(self.conv(x))
            if isinstance(self.se, SqueezeExciteCl):
                return self.head(self.se(h.permute(0, 2, 3, 1)).mean((1, 2)))
            return self.head(self.se(h).mean((2, 3)))

    return Net()


@pytest.mark.parametrize("stock_cls", list(SE_CLASSES), ids=lambda c: c.__name__)
def test_patch_model_swaps_squeeze_excite(stock_cls):
    torch.manual_seed(0)
    stock = _se_net(stock_cls)
    x = torch.randn(4, 3, 8, 8)
    patched = patch_model(copy.deepcopy(stock))
    assert type(patched.se) is SE_CLASSES[stock_cls]
    gate = patched.se.mesa_gate
    paths = 2 if stock_cls in (SelectiveKernel, SplitAttn) else 1  # (stacked paths: a group per path and channel)
    assert isinstance(gate, mn.ChannelGate) and gate.quantizer.options.num_groups == 16 * paths
    assert type(patch_model(copy.deepcopy(stock), ops=["conv"]).se) is stock_cls  # "se" not asked for
    extra = {k for k in patched.state_dict() if k.startswith("se.mesa_gate.")}
    assert set(patched.state_dict()) - extra >= set(stock.state_dict()) and extra
    ref, got = stock(x), patched(x)
    assert torch.equal(ref, got)
    ref.square().sum().backward(), got.square().sum().backward()
    grads = dict(patched.named_parameters())
    for name, p in stock.named_parameters():
        if name == "se.conv_attn.bias":  # (exactly zero, a softmax is shift invariant: both read rounding noise)
            continue
        assert _cos(p.grad, grads[name].grad) > 0.999, name
    with SavedTensorMeter(stock) as a:
        stock(x)
    with SavedTensorMeter(patched) as b:
        patched(x)
    # (GlobalContext keeps three 8-bit copies of x: conv_attn's, the pooling's (the generic
    # capture's q.k) and the gate's, where stock keeps one fp32 x for the pooling and the gate)
    assert b.activation_bytes < (0.55 if stock_cls is GlobalContext else 0.5) * a.activation_bytes
    patched.eval()
    stock.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), patched(x))


@pytest.mark.parametrize("name,most", [("ecaresnet26t", 0.30), ("resnet50_gn", 0.32), ("skresnet18", 0.27),
                                       ("resnest14d", 0.29), ("legacy_seresnet18", 0.30), ("hgnet_tiny", 0.27)])
def test_timm_models_with_channel_gates_or_timm_group_norm(name, most):
    """The channel gates of ECA (``x * y.expand_as(x)``: eca* ResNets, NFNets), Selective Kernel,
    ResNeSt's split attention, legacy SENet and HGNet's ``EseModule`` (session 82), and timm's own
    ``GroupNorm`` (a subclass with its own forward: ResNet *_gn) kept their full input, the gates
    without a word. 64 px, stock's bytes before -> after: ecaresnet26t 0.40x -> 0.28x, resnet50_gn
    0.67x -> 0.30x, skresnet18 0.35x -> 0.24x, resnest14d 0.35x -> 0.26x, legacy_seresnet18 0.36x
    -> 0.28x, hgnet_tiny 0.307x -> 0.256x."""
    import timm

    torch.manual_seed(0)
    stock = timm.create_model(name, num_classes=5).train()
    patched = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing reported unreached but ResNeSt's (B, C, 1, 1) softmax)
        warnings.filterwarnings("ignore", message=r".*\(RadixSoftmax: softmax\)")
        patch_model(patched)
    x = torch.randn(2, 3, 64, 64)
    want, got, a, b = _metered(stock, patched, x, seed=1)  # (the same dropout masks: legacy SENet's head)
    assert torch.equal(got, want)
    assert b < most * a
    want.square().sum().backward(), got.square().sum().backward()
    grads = dict(patched.named_parameters())
    for n, p in stock.named_parameters():  # (zero_init_last: a block's branch has no gradient yet)
        assert _cos(p.grad, grads[n].grad) > _cosine_floor(name, n) if p.grad.any() else not grads[n].grad.any(), n


def _cosine_floor(model: str, parameter: str) -> float:
    """HGNet's first two aggregations (a ConvBNAct, then the ESE gate, before the next stage's
    depthwise conv + BatchNorm) are near scale-invariance cancellations: the BatchNorm's weight and
    the gate's conv bias have gradients 50-100x below the stem's, which 8-bit noise shifts (cosines
    0.92 / 0.94 with the gate swapped, 0.92 / 0.96 before it, against float64; float32 stock reads
    1.0000). The gate is not positively homogeneous, so ``patch/cancellation.py`` does not pass it."""
    first_two = parameter.startswith(("stages.0.", "stages.1.")) and ".aggregation." in parameter
    return 0.9 if model == "hgnet_tiny" and first_two else 0.99


@pytest.mark.parametrize("act_type,inplace", [("gelu", False), ("gelu_tanh", False), ("relu", True), ("silu", True),
                                              ("quick_gelu", False)])
def test_nfnet_gamma_act_runs_its_activation_through_a_mesa_layer(act_type, inplace):
    """NFNet's GammaAct (act_fn(x).mul_(gamma): every activation of dm_nfnet_*) kept the
    activation's full input without a word; now a Mesa child runs the act (``quick_gelu``: not in
    the table, stays stock). Nothing reported unreached; stock's bits eager and compiled."""

    from timm.models.nfnet import GammaAct

    from mesa_train.patch.gamma_act import MesaGammaAct

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), GammaAct(act_type, gamma=1.7, inplace=inplace),
                          nn.Conv2d(8, 4, 3, padding=1)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched = patch_model(copy.deepcopy(stock))
    swapped = act_type != "quick_gelu"
    assert (type(patched[1]) is MesaGammaAct) == swapped and (type(patched[1]) is GammaAct) != swapped
    x = torch.randn(2, 3, 8, 8)
    want, got, a, b = _metered(stock, patched, x)
    assert torch.equal(got, want)
    if swapped:
        assert b < 0.5 * a
    want.square().sum().backward(), got.square().sum().backward()
    for (n, p), q in zip(stock.named_parameters(), patched.parameters()):
        assert _cos(p.grad, q.grad) > 0.999, n
    compiled = torch.compile(copy.deepcopy(patched), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), patched(x))


def test_global_context_gates_through_mesa_and_pools_through_the_generic_capture():
    """GCNet's ``GlobalContext`` (``attn_layer="gc"``): its ``x * gate`` kept ``x`` in float32
    without a word (session 82: a ``mesa_gate``); its attention pooling stays the generic
    attention capture's (a q.k child; its softmax stock, below). ``gc_efficientnetv2_rw_t``, 64 px, fp32:
    0.439x -> 0.390x of stock's saved bytes. ``"gca"`` (no gate) is not swapped."""
    import timm

    torch.manual_seed(0)
    stock = timm.create_model("gc_efficientnetv2_rw_t", num_classes=5).train()
    patched = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(patched)
    blocks = [m for m in patched.modules() if isinstance(m, GlobalContext)]
    assert blocks and all(type(m) is SE_CLASSES[GlobalContext] for m in blocks)
    assert all(isinstance(m.mesa_gate, mn.ChannelGate) and "mesa_qk" in m._modules for m in blocks)
    want, got, a, b = _metered(stock, patched, torch.randn(2, 3, 64, 64))
    assert torch.equal(got, want)
    assert b < 0.41 * a
    gca = patch_model(GlobalContext(16, fuse_add=True, fuse_scale=False))
    assert type(gca) is GlobalContext and "mesa_gate" not in gca._modules


def test_global_context_s_softmax_over_the_positions_stays_stock():
    """GlobalContext's pooling weights, a softmax over the positions ``(B, 1, H * W)`` (1/C of
    ``x``'s size, often saturated), went through a Mesa Softmax: in 8 bits a saturated map's small
    probabilities round away and ``conv_attn``'s weight gradients were noise. Now stock, and
    nothing is reported unreached. ``gc_efficientnetv2_rw_t``, 64 px, against float64, over the 29
    ``conv_attn.weight`` gradients float32 stock gets right: 13 below cosine 0.5 before (median
    0.974), 1 now (``blocks.3.1``, a near-cancellation; median 1.000); bytes 0.390x either way."""
    import statistics

    import timm

    torch.manual_seed(0)
    stock = timm.create_model("gc_efficientnetv2_rw_t", num_classes=5).train()
    patched = patch_model(copy.deepcopy(stock))
    blocks = [m for m in patched.modules() if isinstance(m, GlobalContext)]
    assert blocks and not any("mesa_softmax" in m._modules for m in blocks)
    x = torch.randn(2, 3, 64, 64)

    def grads(model, inp):
        model(inp).square().sum().backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if n.endswith("conv_attn.weight")}

    exact, fp32, mesa = grads(copy.deepcopy(stock).double(), x.double()), grads(stock, x), grads(patched, x)
    cosines = [_cos(mesa[n], exact[n]) for n in exact if _cos(fp32[n], exact[n]) > 0.999]
    assert len(cosines) > 20
    assert sum(c < 0.5 for c in cosines) <= 2 and statistics.median(cosines) > 0.995


def test_a_checkpoint_with_global_context_s_old_softmax_estimates_loads():
    """Before session 82 the generic capture gave every GlobalContext a ``mesa_softmax``: its
    estimates in a patched checkpoint are dropped on load (``declare_key_upgrades``), by a plain
    strict ``load_state_dict`` and by ``upgrade_state_dict`` (the trainer's key comparison)."""
    from mesa_train.patch.checkpoint import upgrade_state_dict

    torch.manual_seed(0)
    for variant in ({}, dict(fuse_add=True, fuse_scale=False)):  # swapped ("gc") and stock ("gca") classes
        net = nn.Sequential(nn.Conv2d(3, 16, 3), GlobalContext(16, rd_ratio=1 / 2, **variant))
        patched = patch_model(net)
        patched(torch.randn(2, 3, 8, 8)).sum().backward()
        old = dict(patched.state_dict())
        quantizer = patched[1].mesa_qk.quantizer_a.state_dict()
        old.update({f"1.mesa_softmax.quantizer.{k}": v.clone() for k, v in quantizer.items()})
        assert set(upgrade_state_dict(patched, old)) == set(patched.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = patched.load_state_dict(old)  # strict
        assert not result.unexpected_keys and not result.missing_keys
