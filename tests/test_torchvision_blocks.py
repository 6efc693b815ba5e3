"""torchvision's GoogLeNet / Inception-v3 ``BasicConv2d`` (a functional ``F.relu`` after the
BatchNorm: its output kept whole, 27% of GoogLeNet's stock bytes, reported) gets a Mesa ReLU
child; MaxViT's einsum attention gets Mesa children by class swap (patch/torchvision_attention.py:
it was reported and kept whole, 0.107 of maxvit_t's stock bytes)."""
import copy
import warnings

import pytest
import torch
import torchvision

from mesa_train.patch import describe, patch_model
from mesa_train.patch.coverage import coverage

from test_patch_helpers import step_and_compare


@pytest.mark.parametrize("name, size", [("googlenet", 64), ("inception_v3", 75)])
def test_basic_conv_relu_is_a_mesa_relu_and_the_forward_is_stock(name, size):
    torch.manual_seed(0)
    stock = getattr(torchvision.models, name)(num_classes=10, aux_logits=False, init_weights=True).train()
    for m in stock.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # (a dropout mask is kept as is)
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (each BasicConv2d was reported: relu not reached)
        patch_model(mesa)
    x = torch.randn(2, 3, size, size)
    step_and_compare(stock, mesa, x)
    report = coverage(mesa, x)
    # (Inception's blocks keep their functional max-pool indices: not this test's subject)
    assert "BasicConv2d" not in {r[1] for r in report.rows if r[0] != "compressed"}, report


# stock line -> Mesa line (patch/torchvision_attention.py)
MAXVIT_SWAPS = {
    'dot_prod = torch.einsum("B G H I D, B G H J D -> B G H I J", q, k)':
        'dot_prod = self.mesa_qk("B G H I D, B G H J D -> B G H I J", q, k)',
    "dot_prod = F.softmax(dot_prod + pos_bias, dim=-1)": "dot_prod = self.mesa_softmax(dot_prod + pos_bias)",
    'out = torch.einsum("B G H I J, B G H J D -> B G H I D", dot_prod, v)':
        'out = self.mesa_av("B G H I J, B G H J D -> B G H I D", dot_prod, v)',
}


def test_maxvit_attention_forward_is_torchvisions_source_but_the_core():
    """A torchvision release that changes the attention fails here (then update the swap)."""
    from torchvision.models.maxvit import RelativePositionalMultiHeadAttention

    from mesa_train.patch.torchvision_attention import MesaMaxVitAttention
    from source_lines import code_lines

    stock = code_lines(RelativePositionalMultiHeadAttention.forward)
    assert all(line in stock for line in MAXVIT_SWAPS)
    assert code_lines(MesaMaxVitAttention.forward) == [MAXVIT_SWAPS.get(ln, ln) for ln in stock]


def _maxvit():
    torch.manual_seed(0)
    return torchvision.models.MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[16, 32],
                                     block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.2,
                                     num_classes=10).train()


def test_maxvit_attention_is_compressed_and_the_forward_is_stock():
    from mesa_train.patch.torchvision_attention import MesaMaxVitAttention

    stock = _maxvit()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (it was reported: matmul/softmax not reached)
        patch_model(mesa)
    attns = [m for m in mesa.modules() if type(m) is MesaMaxVitAttention]
    assert attns
    x = torch.randn(2, 3, 32, 32)
    # (stochastic depth on: the same draws; MBConv's pre_norm bias feeds a conv and a BatchNorm: zero)
    step_and_compare(stock, mesa, x, rounding_noise=1e-4)
    for m in attns:
        assert m.mesa_qk.quantizer_a.initialized and m.mesa_softmax.quantizer.initialized
        assert m.mesa_av.quantizer_b.initialized
    report = coverage(mesa, x)
    kept = {r[1]: r[3] for r in report.rows if r[0] != "compressed"}
    # (what stays: the relative-position index its bias gather saves, a buffer)
    assert kept.get("MesaMaxVitAttention", 0) < 0.01 * report.stock_total, report


@pytest.mark.parametrize("steps, softmax", [([["matmul"]], False), ([["softmax"], ["matmul"]], True),
                                            ([["matmul"], ["softmax"]], True)])
def test_maxvit_attention_takes_only_the_ops_asked_for(steps, softmax):
    """``matmul``: the Einsum children, the softmax stock; ``softmax`` alone swaps nothing (a
    Mesa copy beside the stock product's full map only adds bytes: reported) but is remembered
    for a later ``matmul`` call; a swapped module takes ``softmax`` later."""
    import mesa_train.nn as mnn
    from mesa_train.memory import SavedTensorMeter

    stock = _maxvit()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (softmax alone: reported as not reached)
        for ops in steps:
            patch_model(mesa, ops=ops)
    attn = next(m for m in mesa.modules() if hasattr(m, "mesa_qk"))
    assert isinstance(attn.mesa_qk, mnn.Einsum) and isinstance(attn.mesa_softmax, mnn.Softmax) == softmax
    x = torch.randn(2, 3, 32, 32)
    step_and_compare(stock, mesa, x, rounding_noise=1e-4)
    sizes = []
    for m in (stock, mesa):
        with SavedTensorMeter(m) as meter:
            m(x)
        sizes.append(meter.activation_bytes)
    assert sizes[1] < sizes[0]


def test_maxvit_softmax_alone_is_not_swapped():
    stock = _maxvit()
    with pytest.warns(UserWarning, match=r"RelativePositionalMultiHeadAttention: softmax"):
        patch_model(stock, ops=["softmax"])
    assert not [n for n, _ in stock.named_modules() if n.endswith(("mesa_qk", "mesa_av", "mesa_softmax"))]


def test_maxvit_softmax_asked_for_first_keeps_its_options():
    """Per-op settings: the softmax's options are those of the call that asked for it."""
    mesa = _maxvit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch_model(mesa, ops=["softmax"], decay=0.5)
    patch_model(mesa, ops=["matmul"])
    attn = next(m for m in mesa.modules() if hasattr(m, "mesa_qk"))
    assert attn.mesa_softmax.quant_options.decay == 0.5 and attn.mesa_qk.quant_options.decay == 0.9
    assert attn.mesa_softmax.quant_options.num_groups == attn.n_heads
    assert "_mesa_pending_softmax" not in attn.__dict__
    # the first call's report of the softmax as not reached is dropped: it is compressed now
    assert "not reached" not in describe(mesa).lower()
