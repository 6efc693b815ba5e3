"""SavedTensorMeter: counts saved storages once, separates parameters, per-module figures,
and the saved-bytes target for a small transformer block (Mesa <= 30% of stock, fp32)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.testing import TinyBlock

warnings.filterwarnings("ignore", message=".*compiled extension.*")


def test_counts_a_known_tensor():
    x = torch.randn(10, 7, requires_grad=True)
    with SavedTensorMeter() as m:
        y = x.exp()  # saves its output: 70 float32
    assert m.activation_bytes == 70 * 4 and m.parameter_bytes == 0 and m.total_bytes == 280
    y.sum().backward()


def test_counts_each_storage_once():
    x = torch.randn(8, 8, requires_grad=True)
    with SavedTensorMeter() as m:
        a = x.sin()  # saves x
        b = x.cos()  # saves x again
        c = x[:4].sin()  # saves a view of x
    assert m.activation_bytes == 64 * 4 and m.num_saved == 3 and m.num_storages == 1
    (a + b).sum().backward()
    c.sum().backward()


def test_separates_parameters_views_and_autocast_copies():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorMeter() as m:  # no model given: recognised through grad_fn / type
        y = lin(x)
    assert m.parameter_bytes == 16 * 8 * 4 and m.activation_bytes == 4 * 16 * 4
    with SavedTensorMeter(lin) as m:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
    # bf16 autocast copies of the weight and of x
    assert m.parameter_bytes == 16 * 8 * 2 and m.activation_bytes == 4 * 16 * 2
    y.float().sum().backward()
    w = nn.Parameter(torch.randn(8, 16))
    with SavedTensorMeter() as m:
        z = torch.mm(x, w.t()).sum() + (x * w[0]).sum()
    assert m.parameter_bytes == 8 * 16 * 4 and m.activation_bytes == 4 * 16 * 4
    z.backward()


def test_per_module_summary_and_table():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with SavedTensorMeter(model) as m:
        y = model(x)
    # x (for the first weight's grad), GELU input, second Linear's input
    assert m.per_module == {"0": 3 * 8 * 4, "1": 3 * 16 * 4, "2": 3 * 16 * 4}
    assert m.activation_bytes == sum(m.per_module.values())
    assert "activations" in m.summary() and "2" in m.table()
    y.sum().backward()
    # hooks are removed on exit
    with SavedTensorMeter() as m2:
        model(x.requires_grad_())
    assert m2.per_module == {"<outside>": m2.activation_bytes}


@pytest.mark.parametrize("reentrant", [False, True])
def test_composes_with_checkpointing(reentrant):
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *model.parameters()]
    ref_grads = torch.autograd.grad(model(x).sum(), params)
    with SavedTensorMeter(model) as m:
        y = checkpoint(model, x, use_reentrant=reentrant)
        y.sum().backward()  # recomputation happens inside the meter
    grads = [p.grad for p in params]
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    # inside the checkpointed region nothing is kept; both kinds of checkpoint save their input x
    assert m.activation_bytes == x.numel() * 4


def _block_bytes(mesa: bool, amp: bool):
    torch.manual_seed(0)
    block = TinyBlock(dim=64, heads=4, mesa=mesa)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with SavedTensorMeter(block) as m:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = block(x)
    y.float().sum().backward()
    return m, y


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast_bf16"])
def test_block_saved_bytes(amp):
    stock, y0 = _block_bytes(False, amp)
    mesa, y1 = _block_bytes(True, amp)
    assert torch.equal(y0, y1)
    ratio = mesa.activation_bytes / stock.activation_bytes
    print(f"\nTinyBlock saved activation bytes ({'bf16 autocast' if amp else 'fp32'}): stock "
          f"{stock.activation_bytes}, mesa {mesa.activation_bytes}, ratio {ratio:.3f}")
    if amp:
        assert ratio <= 0.55
    else:
        assert ratio <= 0.30


def test_meter_is_not_pinned_by_a_graph_that_never_ran_backward():
    # A forward measured without backward leaves a graph that keeps its saved-tensor hooks;
    # the meter (and so the model it references) must still be collectable.
    import gc
    import weakref

    layer = torch.nn.Linear(4, 4)
    with SavedTensorMeter(layer) as meter:
        out = layer(torch.randn(2, 4, requires_grad=True))
    ref = weakref.ref(meter)
    del meter
    gc.collect()
    assert ref() is None
    out.sum().backward()  # the graph still works after the meter is gone


def test_a_graph_measured_without_backward_is_freed():
    """exp saves its output; the meter's pack hook once returned that tensor as is, its grad_fn
    the node saving it: a cycle through C++ that gc cannot break, so every forward measured
    without a backward (the planner's, describe's) leaked its activations."""
    import gc
    import weakref

    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.exp()
        loss = y.sum()
    assert meter.activation_bytes == y.numel() * 4
    alive = weakref.ref(y)
    del y, loss
    gc.collect()
    assert alive() is None


def test_the_meter_keeps_gradients():
    x = torch.randn(8, 8, requires_grad=True)
    want = torch.autograd.grad(x.exp().tanh().sum(), x)[0]
    with SavedTensorMeter() as meter:
        got = torch.autograd.grad(x.exp().tanh().sum(), x)[0]
    assert torch.equal(got, want) and meter.activation_bytes == 2 * 8 * 8 * 4  # exp's and tanh's outputs
