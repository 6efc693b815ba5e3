"""torchvision's GoogLeNet / Inception-v3 ``BasicConv2d`` (a functional ``F.relu`` after the
BatchNorm: its output kept whole, 27% of GoogLeNet's stock bytes, reported) gets a Mesa ReLU
child; MaxViT's einsum attention, which nothing routes, is reported instead of getting Mesa
children that never ran (its softmax's codes only added bytes beside the einsum's copy)."""
import copy
import warnings

import pytest
import torch
import torchvision

from mesa_train.patch import patch_model
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


def test_einsum_only_attention_is_reported_not_half_patched():
    torch.manual_seed(0)
    model = torchvision.models.maxvit_t(num_classes=10)
    with pytest.warns(UserWarning, match=r"attn_layer.1 \(RelativePositionalMultiHeadAttention: matmul/softmax\)"):
        patch_model(model)
    assert not [n for n, _ in model.named_modules() if n.endswith(("mesa_qk", "mesa_av", "mesa_softmax"))]
