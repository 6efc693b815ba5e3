"""Failures users hit with timm models beyond DeiT/Swin/PVT (issue 10): each test failed on
the code before its fix."""
import copy

import pytest
import torch
import torch.nn as nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import MesaLayer, MesaTracingError
from mesa_train.patch import (load_patched_checkpoint, load_stock_checkpoint, mesa_state_keys,
                              patch_model, patched_to_stock_state_dict)

from test_patch_helpers import build, inputs


@pytest.mark.parametrize("shape", [(2, 3, 8), (2, 3, 4, 8), (6, 8)])
def test_inplace_op_after_mesa_linear(shape):
    """``ReLU(inplace=True)`` / ``x.add_(...)`` right after a Mesa Linear (SwinV2's relative
    position MLP, NaFlexViT's ``x.add_(pos_embed)``): a 3-D+ input made the output a view of
    the custom Function, which autograd refuses to modify in place."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    x = torch.randn(*shape)
    outs, grads = [], []
    for m in (stock, patched):
        y = m(x)  # Linear, then ReLU(inplace=True)
        y.sum().backward()
        z = m[0](x)
        z.add_(1.0)  # NaFlexViT: x.add_(pos_embed) on a Linear's output
        z.sum().backward()
        outs.append(y.detach())
        grads.append(m[0].weight.grad.clone())
    assert torch.equal(outs[0], outs[1])
    cos = torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), 0)
    assert cos > 0.99


class _SharedBlocks(nn.Module):
    """One module registered under two names (CoaT shares a ConvPosEnc between blocks)."""

    def __init__(self):
        super().__init__()
        shared = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.a = nn.Sequential(shared, nn.GELU())
        self.b = nn.Sequential(shared, nn.Conv2d(4, 4, 1))

    def forward(self, x):
        return self.b(self.a(x))


def test_shared_module_alias_keys_round_trip():
    torch.manual_seed(0)
    stock = _SharedBlocks()
    patched = patch_model(copy.deepcopy(stock))
    assert patched.a[0] is patched.b[0] and isinstance(patched.a[0], MesaLayer)
    keys = mesa_state_keys(patched)
    assert "a.0.quantizer.alpha" in keys and "b.0.quantizer.alpha" in keys
    sd = patched.state_dict()
    assert set(sd) == set(stock.state_dict()) | keys
    load_stock_checkpoint(patched, stock.state_dict())  # strict
    fresh = _SharedBlocks()
    load_patched_checkpoint(fresh, sd)  # strict
    fresh.load_state_dict(patched_to_stock_state_dict(sd, patched))  # strict, with the model
    fresh.load_state_dict(patched_to_stock_state_dict(sd))  # strict, by name


def test_coat_strict_round_trip():
    """Strict loads both ways, and the weights arrive: a patched model given another stock
    model's checkpoint computes that model's outputs, and so does a third stock model given
    the patched checkpoint (eval mode: Mesa layers are stock there)."""
    import timm

    def coat(seed):
        torch.manual_seed(seed)
        return timm.create_model("coat_lite_tiny", img_size=32, num_classes=5).eval()

    stock, source, target = coat(0), coat(1), coat(2)
    patched = patch_model(copy.deepcopy(stock)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = source(x)
        assert not torch.equal(patched(x), want)
        load_stock_checkpoint(patched, source.state_dict())
        assert torch.equal(patched(x), want)
        load_patched_checkpoint(target, patched.state_dict())
        assert torch.equal(target(x), want)


def test_fx_feature_extractor_keeps_compression():
    """timm's FX feature extraction used to trace into the Mesa layers and record their
    stock branch: the traced patched model saved exactly the stock bytes."""
    from timm.layers import create_feature_extractor

    stock = build("deit", fused=False)
    patched = patch_model(copy.deepcopy(stock), rounding="nearest")
    x = inputs("deit")
    saved, outs = [], []
    for m in (stock, patched):
        fe = create_feature_extractor(m, {"head": "out"})
        with SavedTensorMeter(fe) as meter:
            outs.append(fe(x)["out"])
        saved.append(meter.activation_bytes)
    assert torch.equal(outs[0], outs[1])
    assert saved[1] < 0.5 * saved[0], saved
    # the Mesa layers are nodes of the graph, not traced through
    assert any(isinstance(m, MesaLayer) for m in fe.modules())


def test_plain_fx_trace_raises_clearly():
    patched = patch_model(build("deit"))
    with pytest.raises(MesaTracingError, match="leaf"):
        torch.fx.symbolic_trace(patched)


def test_fx_tracer_with_mesa_leaves_keeps_compression():
    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, MesaLayer) or super().is_leaf_module(m, qualname)

    stock = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    patched = patch_model(copy.deepcopy(stock))
    gm = torch.fx.GraphModule(patched, Tracer().trace(patched))
    x = torch.randn(5, 8, requires_grad=True)
    with SavedTensorMeter(gm) as traced:
        gm(x).sum().backward()
    with SavedTensorMeter(stock) as ref:
        stock(x).sum().backward()
    assert traced.activation_bytes < ref.activation_bytes


def test_torchscript_raises_clearly():
    stock = build("deit")
    torch.jit.script(stock)  # the stock model scripts
    with pytest.raises(MesaTracingError, match="torch.compile"):
        torch.jit.script(patch_model(stock))


def test_attention_path_auto_keeps_the_stock_default_forward():
    """timm's default (fused) attention stays fused under ops=all, so the forward is bitwise
    the stock default; attention='explicit' gives the paper's explicit path."""
    stock = build("deit")  # timm default: fused_attn=True
    x = inputs("deit")
    auto = patch_model(copy.deepcopy(stock), rounding="nearest")
    assert auto.blocks[0].attn.mesa_attn_path == "fused"
    assert torch.equal(auto(x), stock(x))
    explicit = patch_model(copy.deepcopy(stock), attention="explicit")
    assert explicit.blocks[0].attn.mesa_attn_path == "explicit"
    with pytest.raises(ValueError, match="auto, explicit, fused"):
        patch_model(copy.deepcopy(stock), attention="flash")


def test_a_timm_fx_feature_extractor_is_patched():
    """``timm.create_model(..., features_only=True, feature_cls="fx")`` is a torch.fx
    GraphModule, whose generated forward has ``__module__`` None: the functional-call scan
    raised AttributeError (a review found it). Now it patches: features stock's, less kept."""
    import timm

    torch.manual_seed(0)
    stock = timm.create_model("resnet18", features_only=True, feature_cls="fx", pretrained=False).train()
    mesa = patch_model(copy.deepcopy(stock))
    assert any(isinstance(m, MesaLayer) for m in mesa.modules())
    x = torch.randn(2, 3, 32, 32)
    kept = []
    for model in (stock, mesa):
        torch.manual_seed(1)
        with SavedTensorMeter() as meter:
            feats = model(x)
        kept.append((feats, meter.activation_bytes))
    assert all(torch.equal(a, b) for a, b in zip(kept[0][0], kept[1][0]))
    assert kept[1][1] < kept[0][1] / 2
