"""Generic attention (functional calls intercepted while a patched module runs), gated MLPs,
new activations/norms in real timm models, and describe()'s measured coverage (issue 10)."""
import copy

import pytest
import torch

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import describe, patch_model
from mesa_train.patch.core import mesa_layer_op
from mesa_train.patch.coverage import coverage

from timm_zoo import build, example

# (model, the module types that must now hold Mesa attention children)
GENERIC = {
    "eva02_tiny_patch14_224": "EvaAttention",       # rope, SwiGLU, fused sdpa
    "beit_base_patch16_224": "Attention",            # relative position bias table
    "cait_xxs24_224": "TalkingHeadAttn",             # explicit q @ k^T, softmax, @ v
    "xcit_nano_12_p16_224": "XCA",                   # cross-covariance attention
}


def _saved(model, x):
    with SavedTensorMeter(model) as meter:
        torch.manual_seed(0)
        out = model(x)
    return out, meter.activation_bytes


@pytest.mark.parametrize("name", list(GENERIC))
def test_generic_attention_compressed_and_bitwise(name):
    stock = build(name)
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    owners = [m for m in patched.modules() if type(m).__name__ == GENERIC[name]]
    assert owners and all(any(c in m._modules for c in ("mesa_sdpa", "mesa_qk")) for m in owners)
    x = example(name)
    ref, stock_bytes = _saved(stock, x)
    out, mesa_bytes = _saved(patched, x)
    assert torch.equal(ref, out)
    # the attention maps / q, k, v are no longer kept in full precision
    assert mesa_bytes < 0.45 * stock_bytes, (mesa_bytes, stock_bytes)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in patched.parameters() if p.grad is not None)
    patched.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), patched(x))


class TokenMixer(torch.nn.Module):
    """A user's single-head attention under a name no rule knows (SHViT's ``SHSA``, iFormer's
    ``SHMA``): found by its forward's softmax and matmuls."""

    def __init__(self, c=16):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj((q @ k.transpose(-2, -1)).softmax(dim=-1) @ v)


@pytest.mark.parametrize("name,owner", [("shvit_s1", "SHSA"), ("iformer_t", "SHMA"), (None, "TokenMixer")])
def test_attention_found_by_its_forward(name, owner):
    import warnings

    stock = build(name) if name else torch.nn.Sequential(TokenMixer(), TokenMixer()).train()
    x = example(name) if name else torch.randn(2, 7, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "functional ops not reached" warning is left
        patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    owners = [m for m in patched.modules() if type(m).__name__ == owner]
    assert owners and all("mesa_qk" in m._modules or "mesa_sdpa" in m._modules for m in owners)
    torch.manual_seed(0)
    ref = stock(x)
    torch.manual_seed(0)
    assert torch.equal(ref, patched(x))
    assert _mesa_child_calls(patched, x) > 0


def test_generic_attention_saves_less_than_before():
    """EVA saved 0.45x of stock with attention uncovered; now the attention is compressed."""
    stock = build("eva02_tiny_patch14_224")
    x = example("eva02_tiny_patch14_224")
    without = patch_model(copy.deepcopy(stock), ops=("linear", "layernorm", "gelu", "glu", "conv"))
    with_attn = patch_model(copy.deepcopy(stock))
    assert _saved(with_attn, x)[1] < 0.7 * _saved(without, x)[1]


def test_swiglu_and_quickgelu_and_rmsnorm_in_models():
    eva = patch_model(build("eva02_tiny_patch14_224"))
    assert isinstance(eva.blocks[0].mlp.gated, mn.GatedActivation)
    assert not isinstance(eva.blocks[0].mlp.act, mn.MesaLayer)  # runs inside the gated layer
    clip = patch_model(build("vit_base_patch16_clip_quickgelu_224"))
    assert isinstance(clip.blocks[0].mlp.act, mn.QuickGELU)
    xp = patch_model(build("vit_base_patch16_xp_224"))
    assert any(isinstance(m, mn.RmsNorm) for m in xp.modules())
    resnet = patch_model(build("resnet18"))
    assert isinstance(resnet.bn1, mn.BatchNorm2d) and resnet.bn1.quantizer.options.num_groups == 64
    assert resnet.conv1.quantizer.options.num_groups == 3  # per channel without a head count


def test_describe_with_example_input_reports_coverage_and_changes_nothing():
    model = patch_model(build("efficientvit_b0"))  # its linear attention (LiteMLA) stays stock
    x = example("efficientvit_b0")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    text = describe(model, x)
    print("\n" + text)
    assert "x stock" in text and "compressed" in text and "left as is" in text
    assert "left as is  LiteMLA" in text  # what Mesa does not cover is named
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    cov = coverage(model, x)
    assert cov.total == cov.compressed_bytes + cov.uncovered_bytes
    assert 0 < cov.ratio < 1


def _mesa_child_calls(model, x):
    """How many times the attention modules' Mesa children ran in one forward of ``model``."""
    calls = []
    handles = [c.register_forward_hook(lambda *_: calls.append(1))
               for n, c in model.named_modules() if n.rsplit(".", 1)[-1] in ("mesa_sdpa", "mesa_qk", "mesa_av")]
    model(x)
    for h in handles:
        h.remove()
    return len(calls)


def test_generic_capture_is_left_when_the_forward_raises():
    """The capture mode is entered inside the module's forward with a `with`: a forward that
    raises leaves no mode behind to route later, unrelated matmuls to its children."""
    from torch.overrides import _get_current_function_mode_stack

    name = "cait_xxs24_224"
    patched = patch_model(build(name))
    attn = next(m for m in patched.modules() if type(m).__name__ == GENERIC[name])
    tokens = torch.randn(2, 4, attn.proj.in_features, requires_grad=True)
    with pytest.raises(RuntimeError):
        attn(tokens[:, :, :-1])  # the attention itself raises, inside its captured forward
    assert not _get_current_function_mode_stack()
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    assert torch.equal(a @ b, torch.matmul(a, b))  # a plain product, not routed
    assert _mesa_child_calls(patched, example(name)) > 0


def test_generic_capture_survives_deepcopy_and_pickling():
    """The capturing forward is bound to its own module after copy.deepcopy (ModelEmaV3) and a
    whole-model torch.save / torch.load, and the copies compute the same output."""
    import io

    name = "eva02_tiny_patch14_224"
    patched = patch_model(build(name), rounding="nearest")
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    copies = [copy.deepcopy(patched), torch.load(buf, weights_only=False)]
    x = example(name)
    want = patched(x)
    for model in copies:
        owners = [m for m in model.modules() if type(m).__name__ == GENERIC[name]]
        assert owners and all(m.forward.__self__ is m for m in owners)  # bound to the copy, not the original
        assert torch.equal(model(x), want)
        assert _mesa_child_calls(model, x) == _mesa_child_calls(patched, x) > 0


@pytest.mark.parametrize("name", ["starnet_s1", "mobilenetv3_small_050"])
def test_timm_linear_subclass_converted_without_warning(name):
    """timm's ``layers.Linear`` (an ``nn.Linear`` subclass whose forward outside TorchScript is
    ``F.linear(x, self.weight, self.bias)``: StarNet's and MobileNetV3's heads) becomes the Mesa
    ``Linear``: no "functional ops not reached" warning, the forward bitwise stock's."""
    import warnings

    from timm.layers import Linear as TimmLinear

    from mesa_train.nn import Linear as MesaLinear

    stock = build(name)
    heads = [n for n, m in stock.named_modules() if type(m) is TimmLinear]
    assert heads, f"{name} no longer uses timm's Linear: pick another model"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched = patch_model(copy.deepcopy(stock))
    assert all(type(patched.get_submodule(n)) is MesaLinear for n in heads)
    x = example(name)
    assert torch.equal(stock(x), patched(x))


@pytest.mark.parametrize("name,attention", [("vit_tiny_patch16_224", "explicit"), ("coat_lite_tiny", "auto")])
def test_softmax_copy_counted_as_the_softmaxs(name, attention):
    """The attentions hand the softmax's int8 map on to ``attn @ v`` (``with_copy=True``) through
    the module call, so the meter attributes the map to the softmax: ``describe`` used to list
    it under the attention module as "left as is" (CoaT: its whole 4.6%)."""
    model = patch_model(build(name), ops=["softmax", "matmul"], attention=attention)
    x = example(name)
    maps = []
    # (the Mesa forward's maps: coverage's stock forward runs them disabled, or not at all where an
    # attention built fused is measured on its own path)
    hooks = [m.register_forward_hook(lambda m, i, out: maps.append(out[0] if isinstance(out, tuple) else out)
                                     if m.quant_options.enabled else None)
             for m in model.modules() if mesa_layer_op(m) == "softmax"]
    cov = coverage(model, x)
    for h in hooks:
        h.remove()
    softmax_bytes = sum(r[3] for r in cov.rows if r[:2] == ("compressed", "softmax"))
    codes = sum(t.numel() for t in maps)  # one byte per element
    assert codes and codes <= softmax_bytes < 1.1 * codes


class KeysNormalisedFirst(torch.nn.Module):
    """A user's attention that normalises its keys over the heads (a softmax over dim 1) before
    its attention map: the map, the last-dim softmax, is the one routed to ``mesa_softmax``."""

    def __init__(self, c=16, heads=2):
        super().__init__()
        self.num_heads = heads
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        k = torch.nn.functional.softmax(k, dim=1)
        attn = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def test_a_softmax_over_another_dim_before_the_map_leaves_the_map_routed():
    stock = torch.nn.Sequential(KeysNormalisedFirst(), torch.nn.LayerNorm(16)).train()
    patched = patch_model(copy.deepcopy(stock))
    x = torch.randn(2, 5, 16)
    routed = []
    hook = patched[0].mesa_softmax.register_forward_hook(lambda m, i, out: routed.append(out[0]))
    out = patched(x)
    hook.remove()
    assert torch.equal(stock(x), out)
    assert [tuple(t.shape) for t in routed] == [(2, 2, 5, 5)]  # the map, not the (2, 2, 5, 8) keys
