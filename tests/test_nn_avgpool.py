"""Mesa ``AvgPool2d`` / ``AvgPool2dSame`` (mesa_train/nn/avgpool.py): the stock forward and
gradient bit for bit (strides and memory format included), and nothing kept for backward."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from timm.layers.pool2d_same import AvgPool2dSame as TimmAvgPool2dSame
from torch import nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import AvgPool2d, AvgPool2dSame
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

sys.path.insert(0, str(Path(__file__).parent))
from kernel_marks import DEVICES  # noqa: E402
from op_calls import assert_patched_model_takes_the_op, count_calls  # noqa: E402
from timm_zoo import build, example  # noqa: E402

CONFIGS = {
    "poolformer": dict(kernel_size=3, stride=1, padding=1, count_include_pad=False),
    "k2": dict(kernel_size=2),
    "rect-ceil": dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True),
    "divisor": dict(kernel_size=3, stride=2, divisor_override=5),
}


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    meter = SavedTensorMeter()
    with meter:
        y = layer(x)
    y.backward(g)
    return y, x.grad, meter.activation_bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["op", "python"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "chw", "bf16"])
def test_bitwise_stock_and_keeps_nothing(config, layout, path, device, monkeypatch):
    """Both paths: the C++ layer op (eager; ``mesa::avg_pool2d_train``, called once) and the
    Python Function (``torch.compile``'s, and eager's with the C++ layer ops off); on CUDA the
    backward kernel reads the uninitialised stand-in's layout as the CPU one does."""
    if path == "op" and not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", path == "op")
    calls = count_calls(monkeypatch, "avg_pool2d_train") if path == "op" else []
    stock = nn.AvgPool2d(**CONFIGS[config])
    mesa = AvgPool2d.from_module(stock)
    x = torch.randn(2, 5, 9, 8, generator=torch.Generator().manual_seed(0)).to(device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "chw":
        x = x[0]
    elif layout == "bf16":
        x = x.bfloat16()
    g = torch.randn(stock(x).shape, generator=torch.Generator().manual_seed(1)).to(device, x.dtype)
    ys, gs, kept_stock = _run(stock, x, g)
    ym, gm, kept_mesa = _run(mesa, x, g)
    assert torch.equal(ys, ym) and ys.stride() == ym.stride()
    assert torch.equal(gs, gm) and gs.stride() == gm.stride()
    assert kept_stock >= x.numel() * x.element_size()  # stock keeps its input: the saving is real
    assert kept_mesa == 0
    assert calls == ([1] if path == "op" else [])


def test_same_padding_is_timms():
    torch.manual_seed(0)
    stock = TimmAvgPool2dSame(3, 2)
    mesa = AvgPool2dSame.from_module(stock)
    x = torch.randn(2, 4, 11, 10)  # odd: 'SAME' pads one side more
    g = torch.randn(stock(x).shape)
    ys, gs, _ = _run(stock, x, g)
    ym, gm, kept = _run(mesa, x, g)
    assert torch.equal(ys, ym) and torch.equal(gs, gm)
    assert kept == 0


def test_eval_disabled_and_no_grad_are_stock():
    mesa = AvgPool2d(3, 1, 1, enabled=False)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    with SavedTensorMeter() as meter:
        mesa(x)
    assert meter.activation_bytes > 0  # disabled: the stock layer, which keeps its input
    mesa = AvgPool2d(3, 1, 1).eval()
    with SavedTensorMeter() as meter:
        y = mesa(x)
    assert meter.activation_bytes > 0 and torch.equal(y, nn.AvgPool2d(3, 1, 1)(x))


def test_compiled_matches_eager():
    mesa = AvgPool2d(3, 2, 1, count_include_pad=False)
    x = torch.randn(2, 3, 9, 9)
    g = torch.randn(2, 3, 5, 5)
    y, gx, _ = _run(mesa, x, g)
    compiled = torch.compile(mesa, backend="aot_eager", fullgraph=True)
    xc = x.clone().requires_grad_()
    yc = compiled(xc)
    yc.backward(g)
    assert torch.equal(y, yc) and torch.equal(gx, xc.grad)


def test_patch_model_poolformer_pools_only():
    """``ops=['avgpool']`` on PoolFormer: every token mixer's pool converted, the model's
    forward and every gradient bitwise stock's (the pool is lossless), and less kept."""
    stock = build("poolformer_s12")
    patched = patch_model(copy.deepcopy(stock), ops=["avgpool"])
    pools = [m for m in patched.modules() if isinstance(m, nn.AvgPool2d)]
    assert pools and all(type(m) is AvgPool2d for m in pools)
    x = example("poolformer_s12")
    pool_inputs = []
    hooks = [m.register_forward_hook(lambda m, args, out: pool_inputs.append(args[0].nbytes))
             for m in stock.modules() if isinstance(m, nn.AvgPool2d)]
    with SavedTensorMeter(stock) as s_meter:
        ys = stock(x)
    for h in hooks:
        h.remove()
    with SavedTensorMeter(patched) as p_meter:
        yp = patched(x)
    assert torch.equal(ys, yp)
    ys.square().sum().backward()
    yp.square().sum().backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # exactly the pools' inputs are no longer kept (nothing else keeps them: pool(x) - x)
    assert s_meter.activation_bytes - p_meter.activation_bytes == sum(pool_inputs) > 0


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_patched_poolformer_runs_every_pool_on_the_op_bitwise_the_python_function(monkeypatch):
    """PoolFormerV2's token mixers (``pool(x) - x``): two training steps with drop-path on give
    the same outputs, parameter gradients and buffers on both paths, every pool on the op."""
    name = "poolformerv2_s12"
    model = patch_model(build(name, drop=True))
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "avg_pool2d_train",
                                      AvgPool2d)


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_the_op_names_its_valid_arguments():
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    with pytest.raises(ValueError, match=r"avg_pool2d_train: stride must have 2 values, got \[1, 1, 1\]"):
        torch.ops.mesa.avg_pool2d_train(x, [3, 3], [1, 1, 1], [1, 1], False, True, None)
