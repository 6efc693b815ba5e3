"""torchvision's Swin (V1 and V2): its attention is a module-level function,
``shifted_window_attention(x, self.qkv.weight, ...)``, which the scan of the attention's
forward did not follow, so the attention was neither compressed nor reported (swin_t kept
0.51x of stock bytes, its attention whole). The generic attention now follows functions of the
module's own file: q @ k^T, softmax, @ v and both projections are Mesa layers, the forward
stays bitwise stock's with dropout and stochastic depth on."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

from mesa_train.nn.quantizer import ActivationQuantizer
from mesa_train.patch import patch_model
from mesa_train.patch.coverage import coverage


def _swin(v2: bool, drop: float = 0.1):
    extra = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2) if v2 else {}
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
                           stochastic_depth_prob=drop, dropout=drop, attention_dropout=drop, num_classes=10, **extra)


def _step(model, x):
    torch.manual_seed(3)
    out = model(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("v2", [False, True], ids=["swin", "swin_v2"])
def test_torchvision_swin_attention_is_compressed_and_forward_is_stock(v2):
    torch.manual_seed(0)
    stock = _swin(v2).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(mesa)
    attn = mesa.features[1][0].attn
    assert {"mesa_qk", "mesa_av", "mesa_softmax"} <= set(attn._modules), list(attn._modules)
    x = torch.randn(2, 3, 32, 32)
    want, want_grads = _step(stock, x)
    got, got_grads = _step(mesa, x)
    assert torch.equal(got, want)
    assert attn.mesa_softmax.quantizer.initialized and attn.qkv.quantizer.initialized
    # every Mesa layer ran (Swin V1 had mesa_norm_q / mesa_norm_k for V2's cosine branch)
    idle = [n for n, q in mesa.named_modules() if isinstance(q, ActivationQuantizer) and not q.initialized]
    assert not idle, idle
    assert ("mesa_norm_q" in attn._modules) == v2
    for n, g in want_grads.items():
        cos = F.cosine_similarity(got_grads[n].flatten().double(), g.flatten().double(), dim=0)
        assert cos > 0.99, (n, float(cos))


def test_torchvision_swin_keeps_no_attention_whole():
    model = _swin(False, drop=0.0)  # (a dropout mask is kept as is)
    patch_model(model)
    report = coverage(model, torch.randn(2, 3, 32, 32))
    # (was 0.51x of stock, ShiftedWindowAttention's 0.33x of it kept whole; left now: the int64
    # index of the relative-position table lookup, 2 KiB per attention whatever the batch)
    assert report.uncovered_bytes < 0.02 * report.stock_total and report.ratio < 0.3, report
