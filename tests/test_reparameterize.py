"""timm's inference-time reparameterization (``timm.utils.model.reparameterize_model``: each
RepVGG / MobileOne / FastViT branch set folded into one conv) on a Mesa-patched model gives the
patched model's own eval outputs, as it does on a stock one. FastViT's ``RepMixer`` folds its
layer scale only where ``isinstance(layer_scale, LayerScale2d)`` (fastvit's class): the Mesa layer
was no such instance and the folded model was off by 3e-2."""
import copy

import pytest
import timm
import torch
from timm.utils.model import reparameterize_model

import mesa_train


@pytest.mark.parametrize("name, ops", [("fastvit_t8", ["all"]), ("fastvit_t8", ["layerscale"]),
                                       ("mobileone_s0", ["all"]), ("repvit_m0_9", ["all"])])
def test_a_patched_model_reparameterizes_to_its_own_outputs(name, ops):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10)
    mesa_train.patch_model(model, ops=ops)
    model.train()
    model(torch.randn(2, 3, 64, 64)).sum().backward()  # (estimates and BN statistics not at their start)
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        folded = reparameterize_model(copy.deepcopy(model))(x)
    torch.testing.assert_close(folded, expected, rtol=1e-4, atol=1e-5)
