"""torchvision's ConvNeXt: its ``CNBlock`` multiplies by a ``(C, 1, 1)`` ``layer_scale`` inline
and its ``LayerNorm2d`` (an ``nn.LayerNorm`` subclass with its own permuting forward) had no
rule: the branch output was kept whole, unreported, and the norms kept in full (reported).
convnext_tiny kept 0.33x of stock bytes, now 0.25x; the forward is bitwise stock's."""
import copy
import warnings

import torch
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

from mesa_train.patch import patch_model
from mesa_train.patch.coverage import coverage

from test_patch_helpers import step_and_compare


def _convnext(drop: float = 0.1):
    torch.manual_seed(0)
    model = ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 1)], stochastic_depth_prob=drop,
                     layer_scale=0.5, num_classes=10)  # (at 1e-6 every block gradient is a cancellation)
    return model.train()


def test_layer_scale_and_norms_are_compressed_and_the_forward_is_stock():
    stock = _convnext()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (LayerNorm2d was reported as not reached)
        patch_model(mesa)
    block = mesa.features[1][0]
    assert "mesa_scale_layer_scale" in block._modules and hasattr(mesa.features[0][1], "quantizer")
    step_and_compare(stock, mesa, torch.randn(4, 3, 32, 32))  # (stochastic depth on)
    assert block.mesa_scale_layer_scale.quantizer.initialized


def test_nothing_but_stochastic_depth_is_kept_whole():
    model = patch_model(_convnext(drop=0.0))
    report = coverage(model, torch.randn(2, 3, 32, 32))
    assert not [r for r in report.rows if r[0] != "compressed" and r[3] > 0], report
