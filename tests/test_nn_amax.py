"""Mesa ``Amax`` (mesa_train/nn/amax.py) and its routing (inline ``x.amax(...)`` in a module's
forward, op ``maxpool``): the stock forward and gradient bit for bit, ties and NaNs included,
and a 1-bit mask kept instead of the input and the result."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from timm.layers.squeeze_excite import SEModule

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import Amax
from mesa_train.patch import patch_model

sys.path.insert(0, str(Path(__file__).parent))
from timm_zoo import build, example  # noqa: E402

CASES = {
    "hiera-q-pool": ((2, 4, 4, 16, 8), 3, False),
    "se-spatial": ((4, 3, 5, 6), (2, 3), True),
    "channel": ((4, 6, 5, 5), 1, True),
    "negative-dims": ((3, 4, 5), (-1, 0), False),
    "all": ((3, 4), (), False),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_stock_with_ties_and_one_bit_kept(case, dtype):
    shape, dim, keepdim = CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).round(decimals=1).to(dtype)
    x[..., 0] = x[..., -1]  # ties: stock shares the gradient between them
    layer = Amax()
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = xs.amax(dim, keepdim)
    with SavedTensorMeter() as meter:
        ym = layer(xm, dim, keepdim)
    assert torch.equal(ys, ym)
    g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ys.backward(g)
    ym.backward(g)
    assert torch.equal(xs.grad, xm.grad)
    assert meter.activation_bytes == (x.numel() + 7) // 8  # one bit an input element


def test_nan_gradient_is_stocks():
    x = torch.tensor([[1.0, float("nan"), 2.0], [3.0, 3.0, 1.0]])
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    xs.amax(1).sum().backward()
    Amax()(xm, 1).sum().backward()
    assert torch.equal(xs.grad.isnan(), xm.grad.isnan())
    assert torch.equal(xs.grad.nan_to_num(), xm.grad.nan_to_num())


def test_stock_when_off_or_not_floating():
    x = torch.randn(3, 4, requires_grad=True)
    with SavedTensorMeter() as meter:
        Amax(enabled=False)(x, 1)
    assert meter.activation_bytes >= x.nbytes  # the stock op: input and result
    assert torch.equal(Amax()(torch.arange(12).view(3, 4), 1), torch.tensor([3, 7, 11]))


def test_hiera_pools_routed_bitwise():
    """Hiera's query pooling (``MaskUnitAttention``) and token pooling (``HieraBlock``) are
    ``.amax`` calls: routed to ``mesa_amax`` children, the forward stays bitwise, and the
    patched model keeps no float tensor of the pooled shapes' inputs any more."""
    stock = build("hiera_tiny_224")
    patched = patch_model(copy.deepcopy(stock), ops=["maxpool"])
    owners = [n for n, m in patched.named_modules() if isinstance(m, Amax)]
    assert any(n.endswith("attn.mesa_amax") for n in owners) and any(not n.endswith("attn.mesa_amax")
                                                                    for n in owners)
    x = example("hiera_tiny_224")
    with SavedTensorMeter(stock) as s_meter:
        ys = stock(x)
    with SavedTensorMeter(patched) as p_meter:
        yp = patched(x)
    assert torch.equal(ys, yp)
    ys.sum().backward()
    yp.sum().backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        assert torch.equal(p.grad, q.grad), name  # only lossless layers: gradients bitwise
    assert p_meter.activation_bytes < 0.8 * s_meter.activation_bytes


@pytest.mark.parametrize("add_maxpool", [True, False])
def test_squeeze_excite_maxpool_routed_only_when_on(add_maxpool):
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), SEModule(8, add_maxpool=add_maxpool))
    patched = patch_model(copy.deepcopy(stock), ops=["maxpool"])
    assert ("mesa_amax" in patched[1]._modules) == add_maxpool
    x = torch.randn(2, 3, 9, 9)
    ys, yp = stock(x), patched(x)
    assert torch.equal(ys, yp)
    ys.square().sum().backward()
    yp.square().sum().backward()
    for p, q in zip(stock.parameters(), patched.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_compiled_hiera_block_matches_eager():
    stock = build("hiera_tiny_224")
    patched = patch_model(copy.deepcopy(stock), ops=["maxpool"])
    x = example("hiera_tiny_224")
    y = patched(x)
    y.sum().backward()
    eager = [p.grad.clone() for p in patched.parameters()]
    patched.zero_grad(set_to_none=True)
    yc = torch.compile(patched, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(y, yc)
    yc.sum().backward()
    for g, p in zip(eager, patched.parameters()):
        assert torch.equal(g, p.grad)
