"""The C++ layer ops of the last two Mesa layers that ran Python Functions in eager training (the
session-59 zoo survey: Gemma 4's vision encoder): ``mesa::clamp_train`` (csrc/clamp_autograd.cpp;
its clamped projections, ``torch.clamp(x, lo, hi)`` with buffer bounds: ``clamp_activations._ClampFn``)
and ``mesa::one_hot_table_train`` (csrc/one_hot_table_autograd.cpp; its position embeddings,
``one_hot(positions) @ table``: ``one_hot_table._OneHotTableFn``). The same outputs, gradients and
bytes kept, bit for bit, as the Python Functions and stock; the patched Gemma 4 takes both ops on
every call, and no Mesa node of it is a Python Function any more."""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import clamp_activations, quantizer as quantizer_mod
from mesa_train.patch import patch_model

from conftest import load_script
from kernel_marks import DEVICES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op

pytestmark = [pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension"),
              # (Gemma 4's rotary table and pooler matmuls stay stock: patch_model says so)
              pytest.mark.filterwarnings("ignore:mesa_train.patch_model. functional ops not reached")]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# ----------------------------------------------------------------------------- Clamp
# (x shape, bound shape): Gemma 4's token projections (0-dim buffer bounds), bounds broadcast
# along the channels, and a channels-last map (its masks packed in NHWC order, the gradient
# channels-last as stock's)
CLAMP_CASES = {
    "tokens": ((2, 7, 16), ()),
    "per-channel": ((3, 5, 16), (16,)),
    "channels-last": ((2, 6, 5, 3), ()),
}


def _clamp_inputs(case: str, step: int, device, dtype, ties: bool = True):
    """x with a NaN and elements outside both bounds; ``ties``: two elements on a bound (g / 2
    under a torch that splits ties, else g), else none (the op's CPU backward then takes its one
    pass from the bits): the elements on a bound as the comparison sees it (a bf16 x against the
    bound rounded to bf16) set to 0."""
    shape, bound_shape = CLAMP_CASES[case]
    g = torch.Generator().manual_seed(step)
    x = (torch.randn(shape, generator=g) * 2).round(decimals=1)
    lo = torch.full(bound_shape, -1.5) - 0.1 * step
    hi = torch.full(bound_shape, 2.0)
    x.view(-1)[:4] = torch.tensor([-1.5 - 0.1 * step, 2.0, float("nan"), 0.0])  # ties and a NaN
    x = x.to(device, dtype)
    lo, hi = lo.to(device), hi.to(device)
    if not ties:
        x = torch.where((x == lo) | (x == hi), 0, x)
    if case == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, lo, hi


def _run_clamp(fused, monkeypatch, device, case, dtype, ties=True):
    """Two calls: outputs, gradients (strides included) and the bytes kept."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    out = []
    for step in range(2):
        x, lo, hi = _clamp_inputs(case, step, device, DTYPES[dtype], ties)
        x.requires_grad_()
        with SavedTensorMeter() as meter:
            y = mnn.Clamp()(x, lo, hi)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "no-ties"])
@pytest.mark.parametrize("case", list(CLAMP_CASES))
def test_clamp_op_is_bitwise_the_python_function(case, ties, dtype, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "clamp_train", _run_clamp, device, case, dtype, ties)


def _clamp_bytes(numel: int, split_ties: bool) -> int:
    """The bytes the Clamp keeps: two masks (passes, ties), or one under a rule without ties."""
    return (2 if split_ties else 1) * ((numel + 7) // 8)


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "no-ties"])
@pytest.mark.parametrize("case", list(CLAMP_CASES))
def test_clamp_op_is_bitwise_stock_and_keeps_a_bit_a_mask(case, ties):
    """The op against the running torch's torch.clamp itself, strides included: 2.14 gives a tie
    g / 2 and a NaN g; 2.11 a tie g and a NaN 0 (pytorch PR 191142)."""
    x, lo, hi = _clamp_inputs(case, 1, "cpu", torch.float32, ties)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = torch.clamp(xs, lo, hi)
    with SavedTensorMeter() as meter:
        ym = mnn.Clamp()(xm, lo, hi)
    assert "ClampTrain" in ym.grad_fn.name()
    g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(2))
    ys.backward(g)
    ym.backward(g)
    assert torch.equal(ys.nan_to_num(), ym.nan_to_num()) and torch.equal(ys.isnan(), ym.isnan())
    assert torch.equal(xs.grad, xm.grad) and xs.grad.stride() == xm.grad.stride()
    flat_g, flat_x = g.permute(0, 2, 3, 1).reshape(-1) if x.dim() == 4 else g.reshape(-1), xm.grad.reshape(-1)
    if x.dim() < 4 and ties:  # the first elements: a tie with lo, with hi, a NaN, inside
        split = clamp_activations.STOCK_CLAMP_SPLITS_TIES
        tie, nan = (flat_g[:2] / 2, flat_g[2]) if split else (flat_g[:2], 0)
        assert torch.equal(flat_x[:2], tie) and flat_x[2] == nan and flat_x[3] == flat_g[3]
    if not ties:  # (none on a bound: the op's one-pass backward on the CPU)
        assert not ((x == lo) | (x == hi)).any()
    assert meter.activation_bytes == _clamp_bytes(x.numel(), clamp_activations.STOCK_CLAMP_SPLITS_TIES)


# Every order of x, lo and hi, with infinities and NaNs (8 ** 3 triples): lo == hi, lo > hi and
# NaN bounds are where the rules of 2.11 and 2.14 part, and where a mask built only for lo < hi
# went wrong (x == lo == hi: stock g, it gave g / 2)
_GRID = (float("-inf"), -2.0, -1.0, 0.0, 1.0, 2.0, float("inf"), float("nan"))


def _clamp_grid(dtype):
    """x, lo, hi: every triple of _GRID, element-wise (x's order: x fastest)."""
    v = torch.tensor(_GRID)
    lo, hi, x = (t.reshape(-1) for t in torch.meshgrid(v, v, v, indexing="ij"))
    return x.to(dtype), lo, hi


def _clamp_grads(fn, x, lo, hi, g):
    leaf = x.clone().requires_grad_()
    fn(leaf, lo, hi).backward(g)
    return leaf.grad


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fused", [True, False], ids=["op", "python"])
def test_clamp_is_stocks_gradient_for_every_order_of_x_and_the_bounds(fused, dtype, monkeypatch):
    """The running torch's stock on the grid: element-wise bounds (the ATen masks) and, for each
    (lo, hi) pair, number bounds (on the CPU the op's one-pass pack), both paths."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x, lo, hi = _clamp_grid(DTYPES[dtype])
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.dtype)
    assert torch.equal(_clamp_grads(mnn.Clamp(), x, lo, hi, g), _clamp_grads(torch.clamp, x, lo, hi, g))
    n = len(_GRID)
    for k in range(0, x.numel(), n):  # (x runs over the grid for one number pair)
        xs, gs, bounds = x[k:k + n], g[k:k + n], (lo[k].clone(), hi[k].clone())
        got, want = _clamp_grads(mnn.Clamp(), xs, *bounds, gs), _clamp_grads(torch.clamp, xs, *bounds, gs)
        assert torch.equal(got, want), f"lo={bounds[0].item()} hi={bounds[1].item()}: {got} vs stock {want}"


@pytest.mark.parametrize("fused", [True, False], ids=["op", "python"])
def test_clamp_splits_a_tie_of_bounds_that_round_to_one_value(fused, monkeypatch):
    """A bf16 x against float bounds 1.0 < 1.001, both bf16(1.0) as the comparison sees them: x
    = 1.0 meets both, and whether the tie splits is asked of the bounds (lo < hi), as stock does."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    x = torch.tensor([0.5, 1.0, 1.5, float("nan")], dtype=torch.bfloat16)
    lo, hi = torch.tensor(1.0), torch.tensor(1.001)
    g = torch.ones(4, dtype=torch.bfloat16)
    assert torch.equal(_clamp_grads(mnn.Clamp(), x, lo, hi, g), _clamp_grads(torch.clamp, x, lo, hi, g))


@pytest.mark.parametrize("split_ties", [True, False], ids=["2.14-rule", "2.11-rule"])
@pytest.mark.parametrize("fused", [True, False], ids=["op", "python"])
def test_clamp_builds_either_torchs_rule(split_ties, fused, monkeypatch):
    """Both rules on any torch (the running one's is also checked against stock above), on the
    grid, both paths, against the rules as measured: torch 2.11 gives g where lo <= x <= hi
    (a NaN anywhere: 0); 2.14 zero where x < lo or x > hi, g / 2 on a bound of lo < hi, else g
    (inside, a NaN, x == lo == hi). One mask kept under the first, two under the second."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    monkeypatch.setattr(clamp_activations, "STOCK_CLAMP_SPLITS_TIES", split_ties)
    x, lo, hi = _clamp_grid(torch.float32)
    g = torch.ones_like(x)
    if split_ties:
        tie = ((x == lo) | (x == hi)) & (lo < hi)
        want = torch.where((x < lo) | (x > hi), 0.0, torch.where(tie, 0.5, 1.0))
    else:
        want = ((x >= lo) & (x <= hi)).float()
    n = len(_GRID)
    for k in (None, *range(0, x.numel(), n)):  # element-wise bounds, then each number pair
        part = slice(None) if k is None else slice(k, k + n)
        bounds = (lo, hi) if k is None else (lo[k].clone(), hi[k].clone())
        with SavedTensorMeter() as meter:
            leaf = x[part].clone().requires_grad_()
            y = mnn.Clamp()(leaf, *bounds)
        y.backward(g[part])
        assert torch.equal(leaf.grad, want[part]), f"bounds {bounds}"
        assert meter.activation_bytes == _clamp_bytes(leaf.numel(), split_ties)


def test_clamp_op_refuses_learned_bounds_in_one_line():
    x = torch.randn(4, 5, requires_grad=True)
    lo = torch.tensor(-1.0, requires_grad=True)
    with pytest.raises(ValueError, match="bounds take no gradient"):
        torch.ops.mesa.clamp_train(x, lo, torch.tensor(1.0), True)
    # the layer itself runs stock's clamp there, which differentiates the bounds
    y = mnn.Clamp()(x, lo, torch.tensor(1.0))
    y.sum().backward()
    assert lo.grad is not None


# ----------------------------------------------------------------------------- OneHotTable
# (batch, tokens, table size P, width D, distinct): Gemma 4's two axes. On the CPU positions
# repeat (as a grid's coordinates do), and index_add sums each row in one order on both paths;
# CUDA's index_add adds with atomics, in no fixed order, so its cases use each row once
TABLE_CASES = {"grid": (3, 7, 5, 16, False), "distinct": (2, 6, 40, 8, True)}


def _table_inputs(case: str, step: int, device, dtype):
    batch, tokens, size, dim, distinct = TABLE_CASES[case]
    g = torch.Generator().manual_seed(20 + step)
    if distinct:
        positions = torch.stack([torch.randperm(size, generator=g)[:batch * tokens] for _ in range(2)], -1)
        positions = positions.view(batch, tokens, 2)
    else:
        positions = torch.randint(0, size, (batch, tokens, 2), generator=g)
    table = torch.randn(2, size, dim, generator=g).to(device, dtype)
    return positions.to(device), table


def _run_table(fused, monkeypatch, device, case, dtype, autocast=False):
    """Two calls: outputs, the table's gradients and the bytes kept."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    out = []
    for step in range(2):
        positions, table = _table_inputs(case, step, device, DTYPES[dtype])
        table.requires_grad_()
        with SavedTensorMeter() as meter, torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = mnn.OneHotTable()(positions, table)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), table.grad, torch.tensor(meter.activation_bytes)]
    return out


def _with_case(case: str, device) -> object:
    """A (case, device) parameter, keeping a marked device's marks (CUDA)."""
    if isinstance(device, str):
        return pytest.param(case, device, id=f"{case}-{device}")
    return pytest.param(case, *device.values, marks=device.marks, id=f"{case}-{device.values[0]}")


TABLE_PARAMS = [_with_case("grid", "cpu")] + [_with_case("distinct", d) for d in DEVICES]


@pytest.mark.parametrize("case,device", TABLE_PARAMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_hot_table_op_is_bitwise_the_python_function(case, device, dtype, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "one_hot_table_train", _run_table, device, case, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_table_op_under_autocast(device, monkeypatch):
    """Autocast (bfloat16) applies inside the op as in the stock matmul: a bfloat16 output, the
    gradient in the table's float32, bitwise the Python Function's."""
    assert_op_path_is_the_python_path(monkeypatch, "one_hot_table_train", _run_table, device, "distinct",
                                      "float32", True)
    got = _run_table(True, monkeypatch, device, "distinct", "float32", autocast=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32


def test_one_hot_table_op_is_stocks_forward_and_keeps_the_positions():
    positions, table = _table_inputs("grid", 0, "cpu", torch.float32)
    stock_table, table = table.clone().requires_grad_(), table.requires_grad_()
    stock = torch.nn.functional.one_hot(positions, table.shape[1]).permute(0, 2, 1, 3).to(table) @ stock_table
    with SavedTensorMeter() as meter:
        out = mnn.OneHotTable()(positions, table)
    assert "OneHotTableTrain" in out.grad_fn.name() and torch.equal(out, stock)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    stock.backward(g), out.backward(g)
    torch.testing.assert_close(table.grad, stock_table.grad, rtol=1e-6, atol=1e-6)  # the same sums, reordered
    assert meter.activation_bytes == positions.numel() * positions.element_size()


def test_one_hot_table_op_names_bad_shapes_in_one_line():
    with pytest.raises(ValueError, match=r"positions must be \(B, N, axes\) and table \(axes, P, D\)"):
        torch.ops.mesa.one_hot_table_train(torch.zeros(2, 3, 3, dtype=torch.long), torch.randn(2, 5, 4))


# ----------------------------------------------------------------------------- Gemma 4
def _gemma4_with_finite_clamps():
    """The zoo's Gemma 4 ViT, dropout on, its clamps finite (both masks and the ties exercised)."""
    pytest.importorskip("timm.models.gemma4_vit")
    from test_gemma4 import with_finite_clamps
    from timm_zoo import build

    return with_finite_clamps(build("gemma4_vit_167m", drop=True))


@pytest.mark.parametrize("op_name,layer", [("clamp_train", mnn.Clamp), ("one_hot_table_train", mnn.OneHotTable)],
                         ids=["clamp", "one_hot_table"])
def test_patched_gemma4_runs_every_call_on_the_op_bitwise_the_python_function(op_name, layer, monkeypatch):
    """Two training steps with dropout on: the same outputs, gradients and buffers on both
    paths, the op called once per forward of each such layer."""
    from timm_zoo import example

    model = patch_model(_gemma4_with_finite_clamps())
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example("gemma4_vit_167m", seed=step),
                                      op_name, layer)


def test_no_mesa_node_of_the_patched_gemma4_is_a_python_function():
    """The session-59 survey's last Python nodes (ClampFn 28 a step, OneHotTableFn 1) are C++ nodes."""
    from timm_zoo import example

    survey = load_script("layer_path_survey")
    model = patch_model(_gemma4_with_finite_clamps())
    clamp_calls = []
    for m in (m for m in model.modules() if isinstance(m, mnn.Clamp)):
        m.register_forward_pre_hook(lambda *_: clamp_calls.append(1))
    found = survey.mesa_nodes(model, example("gemma4_vit_167m"))
    assert not found["Python"], dict(found["Python"])
    assert found["C++"]["ClampTrain"] == len(clamp_calls) > 0 and found["C++"]["OneHotTableTrain"] == 1


def test_layer_path_ab_switches_the_gemma4_layers_to_their_python_functions(monkeypatch):
    """``scripts/layer_path_ab.py --layers gemma4``: layers with no quantizer are switched too, by
    running them with the C++ layer ops off while the switch is on (what they ran before session 60)."""
    from timm_zoo import example

    ab = load_script("layer_path_ab")
    # (the script replaces fused_layer_args on the class: monkeypatch puts it back after the test)
    monkeypatch.setattr(quantizer_mod.ActivationQuantizer, "fused_layer_args",
                        quantizer_mod.ActivationQuantizer.fused_layer_args)
    survey = load_script("layer_path_survey")
    model = patch_model(_gemma4_with_finite_clamps())
    switch, switched = ab.python_path_switch(model, ab.LAYER_SETS["gemma4"])
    clamps = sum(isinstance(m, mnn.Clamp) for m in model.modules())
    assert switched == clamps + 1
    x = example("gemma4_vit_167m")
    switch[0] = True
    on_python = survey.mesa_nodes(model, x)
    assert set(on_python["Python"]) == {"ClampFn", "OneHotTableFn"} and quantizer_mod._FUSED_LAYERS
    assert on_python["C++"]["LinearTrain"] > 0  # the other layers stay on their C++ ops
    switch[0] = False
    on_ops = survey.mesa_nodes(model, x)
    assert not on_ops["Python"] and on_python["C++"]["LinearTrain"] == on_ops["C++"]["LinearTrain"]
    # each clamped projection clamps twice (input and output): one node a call on either path
    assert on_python["Python"]["ClampFn"] == on_ops["C++"]["ClampTrain"] == 2 * clamps


def test_gemma4_layers_bench_times_each_layer_on_three_paths(monkeypatch, capsys):
    """``scripts/gemma4_layers_bench.py`` (here at toy sizes, one round): a row per layer with
    stock's, the op's and the Python Function's times and both ratios; the C++ layer ops are on
    again after it."""
    bench = load_script("gemma4_layers_bench")
    for name, value in {"BATCH": 2, "TOKENS": 3, "WIDTH": 8, "MLP_WIDTH": 16, "POSITIONS": 12}.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr("sys.argv", ["gemma4_layers_bench.py", "--rounds", "1", "--threads", "1"])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| Clamp", "| OneHotTable"))]
    assert [r.split(" (")[0] for r in rows] == ["| Clamp", "| Clamp", "| OneHotTable"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[1:4]) and all(c.endswith("x") for c in cells[4:])
    assert quantizer_mod._FUSED_LAYERS
