"""torch's transformer layers built with a string activation (``activation="gelu"``) hold the
function itself; patch_model gives them the stock module in its place, which the leaf
conversion compresses (patch/torch_transformer.py). Before, the MLP's activation stayed
uncompressed and unreported. Also: any other module holding ``F.gelu`` / ``F.relu`` as an
attribute called only with the input (``self.act = F.gelu``, then ``self.act(x)``) gets the same
swap; other calls of a function attribute are reported as not reached."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import patch_model, stock_to_patched_state_dict


def _encoder(activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 128, dropout=0.1, activation=activation, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()


def _decoder(activation):
    torch.manual_seed(0)
    return nn.TransformerDecoderLayer(32, 4, 128, dropout=0.1, activation=activation, batch_first=True).train()


def _run(model, *inputs):
    torch.manual_seed(5)  # (dropout on: the same masks)
    with SavedTensorMeter() as meter:
        out = model(*inputs)
    return out, meter.activation_bytes


@pytest.mark.parametrize("activation,mesa_cls", [("gelu", mnn.GELU), ("relu", mnn.ReLU)])
def test_string_activation_is_compressed_as_the_module_form(activation, mesa_cls):
    stock = _encoder(activation)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unreached, nothing stock
        mesa = patch_model(copy.deepcopy(stock))
    module_form = patch_model(_encoder(nn.GELU() if activation == "gelu" else nn.ReLU()))
    assert all(type(layer.activation) is mesa_cls for layer in mesa.layers)
    x = torch.randn(2, 9, 32)
    want, stock_bytes = _run(stock, x)
    got, mesa_bytes = _run(mesa, x)
    assert torch.equal(got, want)  # the same bits, dropout on
    assert mesa_bytes == _run(module_form, x)[1] < 0.5 * stock_bytes
    # a stock checkpoint still loads (the new child holds only Mesa's own buffers)
    mesa.load_state_dict(stock_to_patched_state_dict(stock.state_dict(), mesa))


def test_decoder_layer_and_ops_without_the_activation():
    stock = _decoder("gelu")
    mesa = patch_model(copy.deepcopy(stock))
    assert type(mesa.activation) is mnn.GELU
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    assert torch.equal(_run(mesa, x, memory)[0], _run(stock, x, memory)[0])
    untouched = patch_model(_decoder("gelu"), ops=["linear"])  # (gelu not asked for: the function stays)
    assert untouched.activation is F.gelu


class _Held(nn.Module):
    """A module holding ``F.gelu`` as an attribute (vit-pytorch's CCT: ``self.activation = F.gelu``)."""

    def __init__(self, approximate=None):
        super().__init__()
        self.fc, self.act, self.out, self.approximate = nn.Linear(8, 32), F.gelu, nn.Linear(32, 8), approximate

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class _HeldWithKeyword(_Held):
    def forward(self, x):
        return self.out(self.act(self.fc(x), approximate="tanh"))


def test_a_function_attribute_called_with_the_input_alone_is_compressed():
    """``self.act = F.gelu`` called only as ``self.act(x)``: the stock module in its place, then
    compressed by the leaf conversion; the forward bitwise stock's."""
    torch.manual_seed(0)
    stock = _Held().train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (it was reported: gelu not reached)
        patch_model(mesa)
    assert isinstance(mesa.act, mnn.GELU)
    x = torch.randn(4, 8)
    (want, stock_bytes), (got, mesa_bytes) = _run(stock, x), _run(mesa, x)
    assert torch.equal(got, want) and mesa_bytes < stock_bytes
    got.sum().backward()
    assert mesa.act.quantizer.initialized


def test_other_function_attribute_calls_are_reported():
    """A call with a keyword (``approximate=``) would not fit the module's ``forward(input)``:
    the function stays, reported as not reached."""
    with pytest.warns(UserWarning, match=r"functional ops not reached .*<root> \(_HeldWithKeyword: gelu\)"):
        model = patch_model(_HeldWithKeyword())
    assert model.act is F.gelu
