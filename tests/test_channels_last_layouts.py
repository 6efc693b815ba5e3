"""A convnet trained channels-last keeps stock's memory layouts through Mesa's backward: every
backward kernel (convolution, batch norm, ReLU's threshold, SiLU, ...) sees its inputs and
writes its output in the layout it does in the stock model. A Mesa layer that hands back an NCHW
gradient where stock's is channels-last sends the layers before it down ATen's mixed-layout
paths (ResNet-50's BatchNorm backward ran 10x slower than stock's on CPU: the ReLU's mask came
back NCHW), and costs a copy on a GPU. Both paths: the C++ layer ops and the Python Functions."""
from __future__ import annotations

import collections
import copy

import pytest
import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model


def _layout(t) -> str:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return "-"
    if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return "channels_last"
    return "nchw" if t.is_contiguous() else f"strides {t.stride()}"


# the heavy backward kernels both models run, whose layout decides their speed (the masked
# layers' own backward is other kernels in Mesa: threshold_backward or where for a Hardtanh; their
# gradients' layout is what the kernels before them see)
_KERNELS = ("convolution_backward", "native_batch_norm_backward", "native_group_norm_backward",
            "max_pool2d_with_indices_backward", "silu_backward")


class _BackwardLayouts(TorchDispatchMode):
    """Per backward kernel of ``_KERNELS``: the layouts of its gradient and input arguments and of
    its first output."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in _KERNELS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen[(name, _layout(args[0]), _layout(args[1]), _layout(first))] += 1
        return out


def _layouts(model: nn.Module, x: torch.Tensor):
    model.train()
    loss = model(x).float().square().mean()
    with _BackwardLayouts() as rec:
        loss.backward()
    return rec.seen, x.grad


def _convnet() -> nn.Module:
    """Each Mesa convnet layer once (and ReLU in place, as timm's blocks use it)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.Hardswish(),
        nn.Conv2d(8, 8, 1), nn.GroupNorm(2, 8), nn.ReLU6(),
        nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.SiLU(),
        nn.Conv2d(8, 8, 1), nn.Hardsigmoid(), nn.Conv2d(8, 8, 1), nn.Hardtanh(-1.0, 1.0), nn.MaxPool2d(2),
        nn.Conv2d(8, 4, 1))


@pytest.mark.parametrize("fused", [True, False], ids=["cpp_ops", "python_functions"])
@pytest.mark.parametrize("model_name", ["convnet", "resnet18", "mobilenetv3_small_050"])
def test_backward_keeps_stocks_layouts_channels_last(model_name, fused, monkeypatch):
    if fused and not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    torch.manual_seed(0)
    stock = _convnet() if model_name == "convnet" else timm.create_model(model_name, num_classes=4)
    stock = stock.to(memory_format=torch.channels_last)
    mesa = patch_model(copy.deepcopy(stock))
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    want, want_gx = _layouts(stock, x.clone().requires_grad_())
    got, got_gx = _layouts(mesa, x.clone().requires_grad_())
    assert want.total() > 10 and got == want
    assert got_gx.stride() == want_gx.stride()


@pytest.mark.parametrize("fused", [True, False], ids=["cpp_ops", "python_functions"])
@pytest.mark.parametrize("layer", ["relu", "relu6", "hardtanh", "hardsigmoid", "hardswish",
                                   "batchnorm", "groupnorm"])
def test_a_channels_last_gradient_comes_back_channels_last(layer, fused, monkeypatch):
    """One layer, its input and upstream gradient channels-last: the input's gradient has stock's
    strides, and for the lossless masked layers stock's bits. (``autograd.grad``: a leaf's
    ``.grad`` is made to follow the leaf's strides whatever the layer returned.)"""
    if fused and not quantizer_mod._FUSED_LAYERS:
        pytest.skip("needs the compiled extension")
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    stock = {"relu": nn.ReLU(), "relu6": nn.ReLU6(),
             "hardtanh": nn.Hardtanh(-0.5, 0.5), "hardsigmoid": nn.Hardsigmoid(), "hardswish": nn.Hardswish(),
             "batchnorm": nn.BatchNorm2d(6), "groupnorm": nn.GroupNorm(3, 6)}[layer]
    mesa = patch_model(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(mesa) is not type(stock)
    gen = torch.Generator().manual_seed(1)
    x0 = (torch.randn(2, 6, 5, 7, generator=gen) * 4).contiguous(memory_format=torch.channels_last)
    g = torch.randn(2, 6, 5, 7, generator=gen).contiguous(memory_format=torch.channels_last)
    x = x0.clone().requires_grad_()
    want, got = (torch.autograd.grad(m.train()(x), x, g)[0] for m in (stock, mesa))
    assert got.stride() == want.stride()
    if layer not in ("hardswish", "batchnorm", "groupnorm"):  # (8-bit inputs: close, not equal)
        assert torch.equal(got, want)


def test_group_norm_takes_its_input_in_torch_group_norms_layout():
    """``torch.group_norm`` hands ``native_group_norm`` its input contiguous in the suggested
    format on CPU and plain contiguous elsewhere (the CUDA kernel refuses a channels-last one);
    the Mesa GroupNorm does the same (``meta`` stands in for a GPU here)."""
    from mesa_train.nn.groupnorm import _group_norm_format

    x = torch.empty(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    assert _group_norm_format(x) == torch.channels_last
    assert _group_norm_format(torch.empty(2, 4, 3, 3)) == torch.contiguous_format
    assert _group_norm_format(x.to("meta")) == torch.contiguous_format
