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
from mesa_train.patch import patch_model

sys.path.insert(0, str(Path(__file__).parent))
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


@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "chw", "bf16"])
def test_bitwise_stock_and_keeps_nothing(config, layout):
    stock = nn.AvgPool2d(**CONFIGS[config])
    mesa = AvgPool2d.from_module(stock)
    x = torch.randn(2, 5, 9, 8, generator=torch.Generator().manual_seed(0))
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "chw":
        x = x[0]
    elif layout == "bf16":
        x = x.bfloat16()
    g = torch.randn(stock(x).shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    ys, gs, kept_stock = _run(stock, x, g)
    ym, gm, kept_mesa = _run(mesa, x, g)
    assert torch.equal(ys, ym) and ys.stride() == ym.stride()
    assert torch.equal(gs, gm) and gs.stride() == gm.stride()
    assert kept_stock >= x.numel() * x.element_size()  # stock keeps its input: the saving is real
    assert kept_mesa == 0


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
