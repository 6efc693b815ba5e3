"""``compiled_saved_tensors`` (``mesa_train/memory_compiled.py``): what a compiled training
forward keeps for backward, checked against ``SavedTensorMeter`` on models whose compiled graph
keeps what eager autograd keeps."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mesa_train.memory_compiled import compiled_saved_bytes, compiled_saved_tensors
from mesa_train.patch import patch_model
from mesa_train.patch.report import measure_saved_bytes

sys.path.insert(0, str(Path(__file__).parent))
from timm_zoo import build, example  # noqa: E402


def _eager_bytes(model, x):
    return measure_saved_bytes(model, x).activation_bytes


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)).train()


def test_mlp_keeps_what_eager_autograd_keeps():
    model, x = _mlp(), torch.randn(8, 16)
    out, kept = compiled_saved_tensors(copy.deepcopy(model), x)
    assert torch.allclose(out, model(x), atol=1e-6)
    shapes = sorted(k.shape for k in kept)
    # the first Linear's input, GELU's input, the second Linear's input, LayerNorm's input,
    # mean and rstd (the compiled graph keeps the same ones); no parameter, no output
    assert shapes == sorted([(8, 16), (8, 64), (8, 64), (8, 16), (8, 1), (8, 1)]), shapes
    assert compiled_saved_bytes(copy.deepcopy(model), x) == _eager_bytes(model, x)


def test_frozen_model_keeps_nothing():
    model = _mlp().requires_grad_(False)
    _, kept = compiled_saved_tensors(model, torch.randn(8, 16))
    assert kept == []


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "resnet18"])
def test_zoo_stock_and_patched_match_the_eager_meter(name):
    """Stock and Mesa-patched: compiled keeps the eager bytes (the int8 codes and statistics
    through the Mesa ops' saved outputs), so Mesa's saving holds under compile; the min-cut
    partitioner may recompute a cheap op instead of keeping it (patched ResNet-18, 2 x 32 x 32:
    7% less; of it, two per-channel vectors a BatchNorm where eager keeps three, invstd and
    x_hat's code moments: a sizeable share of so small an input's bytes)."""
    stock, x = build(name), example(name)
    patched = patch_model(copy.deepcopy(stock))
    # (equal under torch 2.14; 2.11's partitioner, the GPU image's, recomputes a little of stock
    # vit_tiny's forward instead: 889 984 against 914 560 bytes, make gpu-torch-check)
    assert 0.95 * _eager_bytes(stock, x) <= compiled_saved_bytes(copy.deepcopy(stock), x) <= _eager_bytes(stock, x)
    eager = _eager_bytes(patched, x)
    assert 0.9 * eager <= compiled_saved_bytes(copy.deepcopy(patched), x) <= eager
    assert compiled_saved_bytes(copy.deepcopy(patched), x) < 0.4 * compiled_saved_bytes(copy.deepcopy(stock), x)
