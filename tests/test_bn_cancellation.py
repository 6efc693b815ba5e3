"""BatchNorms whose gradients are scale-invariance cancellations stay stock
(``mesa_train/patch/cancellation.py``, DESIGN.md "Scale-invariance cancellations")."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mesa_train.nn as mn
from mesa_train.patch import patch_model
from mesa_train.patch.cancellation import cancellation_batchnorms


class PatchMerge(nn.Module):
    """EfficientViT-M's PatchMerging core: 1x1 conv + BN -> ReLU -> depthwise conv + BN."""

    def __init__(self, c=8, h=16):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h))
        self.act = nn.ReLU()
        self.conv2 = nn.Sequential(nn.Conv2d(h, h, 3, 2, 1, groups=h, bias=False), nn.BatchNorm2d(h))
        self.conv3 = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))
        self.gelu = nn.GELU()
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = self.conv2(self.act(self.conv1(x)))
        x = self.conv3(self.gelu(x))  # GELU: not homogeneous, conv2.bn is not a start
        return self.head(x.mean((2, 3)))


class Basic(nn.Module):
    """ResNet basic block: full convs between the BatchNorms (no per-channel invariance)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.head(torch.relu(y + x).mean((2, 3)))


def test_found_structurally():
    assert cancellation_batchnorms(PatchMerge()) == {"conv1.1", "conv2.1"}
    assert cancellation_batchnorms(Basic()) == set()


def test_branch_on_shapes_traced_loop_not():
    class Branchy(PatchMerge):  # TinyViT-style: a branch on the input's shape (taken as False)
        def forward(self, x):
            B, C, H, W = x.shape
            if H % 7:
                x = torch.nn.functional.pad(x, (0, 1, 0, 1))
            return super().forward(x)

    class Loopy(PatchMerge):
        def forward(self, x):
            for _ in range(x.shape[0]):  # a Python loop over a traced size: untraceable
                x = x + 0
            return super().forward(x)

    assert cancellation_batchnorms(Branchy()) == {"conv1.1", "conv2.1"}
    assert cancellation_batchnorms(Loopy()) == set()


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _grads(model, x, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    out = model(x.to(dtype))
    g = torch.Generator().manual_seed(3)
    (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def test_kept_stock_and_gradient_exact():
    torch.manual_seed(0)
    stock = PatchMerge().train()
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    patched = patch_model(copy.deepcopy(stock))
    assert type(patched.conv1[1]) is nn.BatchNorm2d and type(patched.conv2[1]) is nn.BatchNorm2d
    assert isinstance(patched.conv3[1], mn.BatchNorm2d)
    assert patched._mesa_patch_info["stock_batchnorm"] == ("conv1.1", "conv2.1")
    torch.manual_seed(0)
    assert torch.equal(stock(x), patched(x))
    exact, got = _grads(stock, x, torch.float64), _grads(patched, x)
    assert _cos(exact["conv1.1.weight"], got["conv1.1.weight"]) > 0.99

    from mesa_train.patch import describe

    text = describe(patched)
    assert "BatchNorms kept stock" in text and "conv1.1, conv2.1" in text, text  # coverage says so

    compressed = patch_model(copy.deepcopy(stock), cancelling_bn="compress")
    assert "BatchNorms kept stock" not in describe(compressed)
    assert isinstance(compressed.conv1[1], mn.BatchNorm2d) and isinstance(compressed.conv2[1], mn.BatchNorm2d)
    with pytest.raises(ValueError, match="cancelling_bn"):
        patch_model(copy.deepcopy(stock), cancelling_bn="nope")


class GroupNormConvAttention(nn.Module):
    """LowFormer / CPUBone's attention input: an affine GroupNorm(1, C), then a depthwise conv
    and a BatchNorm (its output scales with each GroupNorm channel's weight and bias, and the
    BatchNorm undoes it), then a channel-mixing 1x1 conv."""

    def __init__(self, c=8, affine=True):
        super().__init__()
        self.norm = nn.GroupNorm(1, c, affine=affine)
        self.proj = nn.Sequential(nn.Conv2d(c, c, 3, 2, 1, groups=c, bias=False), nn.BatchNorm2d(c))
        self.pwise = nn.Conv2d(c, 2 * c, 1, bias=False)
        self.head = nn.Linear(2 * c, 5)

    def forward(self, x):
        return self.head(self.pwise(self.proj(self.norm(x))).mean((2, 3)))


def test_affine_group_norm_starts_a_path():
    assert cancellation_batchnorms(GroupNormConvAttention()) == {"norm", "proj.1"}
    assert cancellation_batchnorms(GroupNormConvAttention(affine=False)) == set()  # no weight to cancel
    torch.manual_seed(0)
    stock = GroupNormConvAttention().train()  # bias 0: the exact weight gradient is BatchNorm's eps term
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    exact = _grads(stock, x, torch.float64)
    kept = patch_model(copy.deepcopy(stock))
    assert type(kept.proj[1]) is nn.BatchNorm2d and type(kept.norm) is nn.GroupNorm
    assert kept._mesa_patch_info["stock_batchnorm"] == ("norm", "proj.1")
    assert _cos(exact["norm.weight"], _grads(kept, x)["norm.weight"]) > 0.999
    compressed = patch_model(copy.deepcopy(stock), cancelling_bn="compress")  # what the rule prevents
    assert isinstance(compressed.norm, mn.GroupNorm)
    assert _cos(exact["norm.weight"], _grads(compressed, x)["norm.weight"]) < 0.9


class PooledKeys(nn.Module):
    """NextViT's attention input: a BatchNorm2d whose tokens feed a query Linear and, pooled
    (AvgPool1d), a BatchNorm1d before the key Linear (the end of one branch: kept stock too)."""

    def __init__(self, c=8):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(c)
        self.q, self.k = nn.Linear(c, c), nn.Linear(c, c)
        self.sr, self.norm = nn.AvgPool1d(4, 4), nn.BatchNorm1d(c)
        self.head = nn.Linear(c, 5)
        with torch.no_grad():
            self.q.weight.mul_(0.01)  # the keys' branch carries most of the gradient reaching norm1

    def forward(self, x):
        t = self.norm1(x).flatten(2).transpose(1, 2)  # (B, N, C)
        q = self.q(t)
        k = self.k(self.norm(self.sr(t.transpose(1, 2))).transpose(1, 2))
        attn = (q @ k.transpose(1, 2)).softmax(-1)
        return self.head((attn @ k).mean(1))


def test_branch_into_a_batchnorm1d_keeps_the_start_stock():
    assert cancellation_batchnorms(PooledKeys()) == {"norm1", "norm"}
    torch.manual_seed(0)
    stock = PooledKeys().train()
    x = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    exact = _grads(stock, x, torch.float64)
    kept = patch_model(copy.deepcopy(stock))
    assert type(kept.norm1) is nn.BatchNorm2d and kept._mesa_patch_info["stock_batchnorm"] == ("norm", "norm1")
    assert type(kept.norm) is nn.BatchNorm1d
    assert _cos(exact["norm1.weight"], _grads(kept, x)["norm1.weight"]) > 0.999
    compressed = patch_model(copy.deepcopy(stock), cancelling_bn="compress")
    assert isinstance(compressed.norm1, mn.BatchNorm2d)
    assert _cos(exact["norm1.weight"], _grads(compressed, x)["norm1.weight"]) < 0.99


def test_batchnorm_act_is_one_node():
    """timm's BatchNormAct2d (children drop / act) ends a path as a normalisation; with a
    non-homogeneous activation inside it starts none."""
    from timm.layers import BatchNormAct2d

    class M(nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.bn1 = nn.BatchNorm2d(c)
            self.dw = nn.Conv2d(c, c, 3, 1, 1, groups=c)
            self.bn2 = BatchNormAct2d(c, act_layer=nn.SiLU)
            self.dw2 = nn.Conv2d(c, c, 3, 1, 1, groups=c)
            self.bn3 = nn.BatchNorm2d(c)

        def forward(self, x):
            return self.bn3(self.dw2(self.bn2(self.dw(torch.relu(self.bn1(x))))))

    assert cancellation_batchnorms(M()) == {"bn1", "bn2"}


def test_config_cancelling_bn_reaches_patch_model(compose_train):
    from omegaconf import OmegaConf

    from mesa_train.train.config import ConfigError, mesa_options, validate

    cfg = compose_train(["mesa.cancelling_bn=compress"])
    assert mesa_options(cfg)["cancelling_bn"] == "compress"
    OmegaConf.update(cfg, "mesa.cancelling_bn", "keep")
    with pytest.raises(ConfigError, match=r"mesa.cancelling_bn='keep' is not valid; choose one of: stock, compress"):
        validate(cfg)


def test_relu6_passes_the_invariance():
    """MobileNetV2: ``BatchNormAct2d(act=ReLU6) -> depthwise conv -> BatchNorm``. ReLU6 is
    homogeneous below its cap, where nearly all values are: the first BatchNorm's weight
    gradient is a near-cancellation (cosine -0.1 compressed, in mobilenetv2_050)."""
    from timm.layers import BatchNormAct2d

    class M(nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.bn1 = BatchNormAct2d(c, act_layer=nn.ReLU6)
            self.dw = nn.Conv2d(c, c, 3, 1, 1, groups=c)
            self.bn2 = nn.BatchNorm2d(c)
            self.act = nn.ReLU6()
            self.dw2 = nn.Conv2d(c, c, 3, 1, 1, groups=c)
            self.bn3 = nn.BatchNorm2d(c)

        def forward(self, x):
            return self.bn3(self.dw2(self.act(self.bn2(self.dw(self.bn1(x))))))

    assert cancellation_batchnorms(M()) == {"bn1", "bn2", "bn3"}


class ResidualInto(nn.Module):
    """``BN -> ReLU -> y + other -> depthwise conv + BN``, ``other`` (the second summand) one of:
    ``same``, a depthwise conv of ``y`` (rescaled with it: exact invariance); ``norm``, a residual
    branch through a normalisation (``y + conv(bn(y))``, TinyViT / InceptionNeXt); ``sibling``, a
    BatchNorm of the block input beside the first (MobileOne's branch sums); ``constant``, 1.0."""

    def __init__(self, other, c=8):
        super().__init__()
        self.other = other
        self.bn, self.side = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
        self.dwm = nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False)
        self.mix = nn.Conv2d(c, c, 1, bias=False)
        self.dw = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), nn.BatchNorm2d(c))
        self.head = nn.Linear(c, 5)

    def summand(self, x, y):
        if self.other == "same":
            return self.dwm(y)
        if self.other == "norm":
            return self.mix(self.side(y))
        if self.other == "sibling":
            return self.side(x)
        return 1.0

    def forward(self, x):
        y = torch.relu(self.bn(x))
        return self.head(torch.relu(self.dw(y + self.summand(x, y))).mean((2, 3)))


@pytest.mark.parametrize("other, kept", [("same", {"bn", "dw.1"}), ("norm", {"bn", "side", "dw.1"}),
                                         ("sibling", set()), ("constant", set())])
def test_add_passes_only_summands_from_the_start(other, kept):
    """An add rescales with the start only where every summand does: a sibling branch or a constant
    summand stops the path, so ``bn`` is compressed (its exact weight gradient is no cancellation)."""
    assert cancellation_batchnorms(ResidualInto(other)) == kept
    torch.manual_seed(0)
    model = ResidualInto(other).train().double()
    out = model(torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).sum()
    weight, bias = torch.autograd.grad(loss, [model.bn.weight, model.bn.bias])
    if other == "same":  # the premise: an exact invariance, zero weight gradient but for eps (0.001)
        assert weight.norm() < 1e-2 * bias.norm()
    elif other in ("sibling", "constant"):  # none: as large as the bias gradient (0.5, 0.8)
        assert weight.norm() > 0.1 * bias.norm()


class BranchSum(nn.Module):
    """MobileOne / RepVGG's block: identity BN + kxk conv + BN + 1x1 depthwise conv + BN of one input,
    summed, ReLU, then a depthwise conv + BN (where each branch's path used to end)."""

    def __init__(self, c=8):
        super().__init__()
        self.identity = nn.BatchNorm2d(c)
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))
        self.scale = nn.Sequential(nn.Conv2d(c, c, 1, groups=c, bias=False), nn.BatchNorm2d(c))
        self.dw = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), nn.BatchNorm2d(c))
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        y = torch.relu(self.identity(x) + self.kxk(x) + self.scale(x))
        return self.head(self.dw(y).mean((2, 3)))


def test_branch_sum_is_compressed_and_its_scale_branch_linked():
    """Before, the add passed every path on: all four BatchNorms stayed stock, and the scale
    branch's BatchNorm kept stock left its conv unlinked."""
    assert cancellation_batchnorms(BranchSum()) == set()
    patched = patch_model(BranchSum().train())
    assert patched._mesa_patch_info["stock_batchnorm"] == ()
    assert all(isinstance(m, mn.BatchNorm2d) for m in (patched.identity, patched.kxk[1], patched.scale[1]))
    assert patched.scale[0].__dict__.get("_mesa_scale_bn") is patched.scale[1]


def test_mobileone_keeps_no_batchnorm_stock():
    """timm MobileOne-S0 (226 BatchNorms, all in branch sums): 222 were kept stock, 1.16x stock's
    saved bytes; compressed, 0.68 here (0.48 at batch 8, 64 px)."""
    import timm

    from mesa_train.memory import SavedTensorMeter

    torch.manual_seed(0)
    stock = timm.create_model("mobileone_s0", num_classes=10).train()
    patched = patch_model(copy.deepcopy(stock))
    assert patched._mesa_patch_info["stock_batchnorm"] == ()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with SavedTensorMeter(stock) as m0:
        stock(x)
    with SavedTensorMeter(patched) as m1:
        patched(x)
    assert m1.activation_bytes < 0.75 * m0.activation_bytes


def test_leaky_relu_passes_the_invariance_and_a_patched_act_still_counts():
    """LeakyReLU is positively homogeneous as ReLU is (TResNet, DarkNet-style nets): BatchNorm ->
    LeakyReLU -> depthwise conv -> BatchNorm is a cancellation path (the first weight gradient
    at cosine -0.02 compressed, a review found). And a model patched for ``relu`` first holds
    Mesa ReLUs, subclasses of nn.ReLU: its BatchNormAct2d still starts a path (cosine 0.34)."""
    from timm.layers import BatchNormAct2d

    def net(act_module, bn_act):
        torch.manual_seed(0)
        first = BatchNormAct2d(8, act_layer=act_module) if bn_act else nn.Sequential(nn.BatchNorm2d(8), act_module())
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), first, nn.Conv2d(8, 8, 3, padding=1, groups=8),
                             nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    assert cancellation_batchnorms(net(nn.LeakyReLU, bn_act=False)) == {"1.0", "3"}
    assert cancellation_batchnorms(net(nn.LeakyReLU, bn_act=True)) == {"1", "3"}
    relu_first = patch_model(net(nn.ReLU, bn_act=True), ops=["relu"])
    assert type(relu_first[1].act) is mn.ReLU and cancellation_batchnorms(relu_first) == {"1", "3"}
    for stock in (net(nn.LeakyReLU, bn_act=True), relu_first):
        mesa = patch_model(copy.deepcopy(stock).train())
        assert type(mesa[1]) is type(stock[1])  # (kept stock)
        x = torch.randn(4, 3, 8, 8)
        want = torch.autograd.grad(stock.train()(x).square().sum(), stock[1].weight)[0]
        got = torch.autograd.grad(mesa(x).square().sum(), mesa[1].weight)[0]
        assert torch.nn.functional.cosine_similarity(got, want, 0) > 0.999
