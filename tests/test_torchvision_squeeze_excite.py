"""torchvision's ``SqueezeExcitation`` (its EfficientNet, MobileNetV3, RegNetY, MaxViT): the
final ``scale * input`` kept the whole input feature map, neither compressed nor reported
(efficientnet_b0 0.33x of stock bytes, 0.10x of it there). Its class is swapped as timm's
squeeze-excite blocks are: the product through a ``ChannelGate`` (8-bit input, a group per
channel), the forward bitwise stock's."""
import copy

import torch
import torchvision
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from mesa_train.patch import patch_model
from mesa_train.patch.coverage import coverage

from test_patch_helpers import step_and_compare


def _net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(), SqueezeExcitation(16, 4),
                         nn.Conv2d(16, 8, 3, padding=1), nn.Hardswish(),
                         SqueezeExcitation(8, 2, nn.ReLU, nn.Hardsigmoid),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def test_the_gate_product_is_compressed_and_the_forward_is_stock():
    torch.manual_seed(0)
    stock = _net().train()
    mesa = patch_model(copy.deepcopy(stock))
    assert type(mesa[2]).__name__ == "MesaTorchvisionSqueezeExcitation"
    x = torch.randn(4, 3, 16, 16)
    step_and_compare(stock, mesa, x)
    assert mesa[2].mesa_gate.quantizer.initialized and mesa[5].mesa_gate.quantizer.initialized
    report = coverage(mesa, x)
    assert "SqueezeExcitation" not in {r[1] for r in report.rows if r[0] != "compressed"}, report


def test_torchvision_efficientnet_keeps_no_gate_input_whole():
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(num_classes=10)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # (a dropout mask is kept as is)
    stock = copy.deepcopy(model)
    patch_model(model)
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(1)
    want = stock(x)
    torch.manual_seed(1)
    assert torch.equal(model(x), want)  # (stochastic depth on)
    report = coverage(model, x)
    left = {r[1]: r[3] for r in report.rows if r[0] != "compressed"}
    assert "SqueezeExcitation" not in left and report.ratio < 0.31, report  # (0.37x before, at this size)
