"""Mesa ``Conv1d`` (mesa_train/nn/conv.py): the stock forward bit for bit, 8-bit input kept,
gradients those of the convolution at the dequantized input (exactly: checked against
``convolution_backward`` on the same codes), and the input gradient bitwise stock's (it needs
only the weight)."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import Conv1d
from mesa_train.nn.quantizer import decompress
from mesa_train.patch import patch_model

sys.path.insert(0, str(Path(__file__).parent))
from timm_zoo import build, example  # noqa: E402

CONFIGS = {
    "k3-pad": dict(in_channels=8, out_channels=6, kernel_size=3, padding=1),
    "depthwise-stride": dict(in_channels=8, out_channels=8, kernel_size=5, stride=2, padding=2, groups=8),
    "same-dilated": dict(in_channels=8, out_channels=4, kernel_size=3, padding="same", dilation=2, bias=False),
    "reflect": dict(in_channels=8, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_forward_bitwise_gradients_at_the_codes(config, batched):
    torch.manual_seed(0)
    stock = nn.Conv1d(**CONFIGS[config])
    mesa = Conv1d.from_module(copy.deepcopy(stock), num_groups=4)
    before = copy.deepcopy(mesa)  # the quantizer state the call starts from
    x = torch.randn(3, 8, 17) if batched else torch.randn(8, 17)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, ym = stock(xs), mesa(xm)
    assert torch.equal(ys, ym)
    g = torch.randn_like(ys)
    ys.backward(g)
    ym.backward(g)
    assert torch.equal(xs.grad, xm.grad)
    # the weight gradient is stock's backward at the dequantized input the layer kept
    xh = decompress(before.quantizer.compress(x, x.dim() - 2), x.dtype).requires_grad_()
    ref = nn.Conv1d(**CONFIGS[config])
    ref.load_state_dict(stock.state_dict())
    ref(xh).backward(g)
    torch.testing.assert_close(mesa.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    if stock.bias is not None:
        assert torch.equal(mesa.bias.grad, stock.bias.grad)
    assert torch.nn.functional.cosine_similarity(mesa.weight.grad.flatten(), stock.weight.grad.flatten(), 0) > 0.999


def test_keeps_int8_input_and_stock_when_off():
    stock = nn.Conv1d(16, 16, 3, padding=1)
    mesa = Conv1d.from_module(copy.deepcopy(stock))
    x = torch.randn(4, 16, 64, requires_grad=True)
    with SavedTensorMeter(stock) as m_stock:
        stock(x)
    with SavedTensorMeter(mesa) as m_mesa:
        mesa(x)
    assert m_mesa.activation_bytes < 0.3 * m_stock.activation_bytes
    assert m_stock.activation_bytes >= x.nbytes
    with torch.no_grad():
        assert torch.equal(stock(x), mesa.eval()(x))


def test_patch_model_converts_efficientvim_conv1d():
    stock = build("efficientvim_m1")
    patched = patch_model(copy.deepcopy(stock), ops=["conv"])
    convs = [m for m in patched.modules() if isinstance(m, nn.Conv1d)]
    assert convs and all(type(m) is Conv1d for m in convs)
    x = example("efficientvim_m1")
    torch.manual_seed(0)
    ys = stock(x)
    torch.manual_seed(0)
    assert torch.equal(ys, patched(x))


def test_patch4x4_layout_leaves_1d_convs_on_channels():
    """``layout='patch4x4'`` tiles 2-D feature maps: a model with both kinds of conv patches
    (the 1-D ones keep channel groups) instead of failing."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(2), nn.Conv1d(8, 8, 3, padding=1))
    patched = patch_model(model, ops=["conv"], layout="patch4x4")
    assert patched[0].quant_options.layout == "patch4x4"
    assert type(patched[2]) is Conv1d and patched[2].quant_options.layout == "channel"
    patched(torch.randn(2, 3, 8, 8)).sum().backward()
