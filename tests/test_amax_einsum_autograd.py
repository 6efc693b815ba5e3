"""The C++ layer ops of the last two Mesa layers that ran Python Functions in eager training:
``mesa::amax_train`` (csrc/amax_autograd.cpp; Hiera's and squeeze-excite's ``x.amax(...)``:
``amax._AmaxFn``) and ``mesa::einsum_train`` (csrc/einsum_autograd.cpp; MViTv2's and SAM's
relative-position einsums: ``einsum._EinsumFn``). The same outputs, gradients, bytes kept,
estimates and seeds, bit for bit, in every format the ops take; and where the Python Functions
still run."""
from __future__ import annotations

import pytest
import torch
from timm.layers.squeeze_excite import SEModule

import mesa_train.nn as mnn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model

from kernel_marks import DEVICES
from op_calls import assert_op_path_is_the_python_path, assert_patched_model_takes_the_op, count_calls
from timm_zoo import build, example

pytestmark = pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# ----------------------------------------------------------------------------- Amax
# (x shape, dim, keepdim): Hiera's query pooling, squeeze-excite's spatial max, a channel max,
# negative and repeated dims, every dim (dim=()), and a channels-last map (its mask packed in
# NHWC order, the gradient channels-last as stock's)
AMAX_CASES = {
    "hiera-q-pool": ((2, 4, 4, 16, 8), 3, False),
    "se-spatial": ((4, 3, 5, 6), (2, 3), True),
    "channel": ((4, 6, 5, 5), 1, True),
    "negative-dims": ((3, 4, 5), (-1, 0, 2), False),
    "all": ((3, 4), (), False),
    "channels-last": ((2, 6, 5, 3), (2, 3), False),
    "scalar": ((), (), False),
}


def _amax_input(case: str, step: int, device, dtype) -> torch.Tensor:
    shape = AMAX_CASES[case][0]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(step)).round(decimals=1)
    if x.dim():
        x[..., 0] = x[..., -1]  # ties: the gradient is shared between them
        x.view(-1)[1] = float("nan") if step else x.view(-1)[1]  # a NaN maximum on the second step
    x = x.to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if case == "channels-last" else x


def _run_amax(fused, monkeypatch, device, case, dtype):
    """Two calls: outputs, gradients (strides included) and the bytes kept."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    _, dim, keepdim = AMAX_CASES[case]
    out = []
    for step in range(2):
        x = _amax_input(case, step, device, DTYPES[dtype]).requires_grad_()
        with SavedTensorMeter() as meter:
            y = mnn.Amax()(x, dim, keepdim)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), x.grad, torch.tensor(meter.activation_bytes)]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(AMAX_CASES))
def test_amax_op_is_bitwise_the_python_function(case, dtype, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "amax_train", _run_amax, device, case, dtype)


def test_amax_op_is_bitwise_stock_and_keeps_one_bit_an_element():
    """The op against the stock amax itself (not only the Python Function): ties and NaNs."""
    x = _amax_input("hiera-q-pool", 1, "cpu", torch.float32)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = xs.amax(3)
    with SavedTensorMeter() as meter:
        ym = mnn.Amax()(xm, 3)
    assert "AmaxTrain" in ym.grad_fn.name()
    g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(2))
    ys.backward(g)
    ym.backward(g)
    assert torch.equal(ys.nan_to_num(), ym.nan_to_num()) and torch.equal(ys.isnan(), ym.isnan())
    assert torch.equal(xs.grad.nan_to_num(), xm.grad.nan_to_num()) and torch.equal(xs.grad.isnan(), xm.grad.isnan())
    assert meter.activation_bytes == (x.numel() + 7) // 8


@pytest.mark.parametrize("name,ops", [("hiera_tiny_224", ["maxpool"]), ("hiera_tiny_224", ["all"])], ids=str)
def test_patched_hiera_runs_every_amax_on_the_op(name, ops, monkeypatch):
    """Hiera's query and token pooling, two training steps with drop-path on: the same outputs,
    gradients and buffers on both paths, every Amax on the op."""
    model = patch_model(build(name, drop=True), ops=ops)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "amax_train",
                                      mnn.Amax)


def test_squeeze_excite_max_takes_the_op(monkeypatch):
    torch.manual_seed(0)
    model = patch_model(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), SEModule(8, add_maxpool=True)),
                        ops=["maxpool"])
    example_input = lambda step: torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(step))  # noqa: E731
    assert_patched_model_takes_the_op(monkeypatch, model, example_input, "amax_train", mnn.Amax)


# ----------------------------------------------------------------------------- Einsum
# (equation, a's shape, b's shape): MViTv2's relative positions (b a position table: kept as it
# is), a batched product (both compressed, groups along dim 1), 2-d and 1-d operands (groups
# along the last dim), spaces in the equation
EINSUM_CASES = {
    "mvitv2": ("byhwc,hkc->byhwk", (2, 3, 5, 4, 8), (5, 7, 8)),
    "batched": ("bij,bjk->bik", (4, 5, 6), (4, 6, 3)),
    "rows": ("ij,jk->ik", (7, 6), (6, 5)),
    "vector": ("i,ij->j", (6,), (6, 5)),
    "spaces": ("b h i j , b h j d -> b h i d", (2, 3, 4, 5), (2, 3, 5, 6)),
}
EINSUM_VARIANTS = [dict(bits=4), dict(bits=2, scale="pow2"),
                   dict(bits=4, estimator="per_sample", symmetric=True, rounding="nearest", num_groups=2),
                   dict(estimator="delayed")]


def _einsum_inputs(case: str, step: int, device, dtype, transposed: bool = False):
    _, a_shape, b_shape = EINSUM_CASES[case]
    g = torch.Generator().manual_seed(10 + step)
    a = (torch.randn(a_shape, generator=g) * 2 + 0.1 * step).to(device, dtype)
    b = torch.randn(b_shape, generator=g).to(device, dtype)
    if transposed:  # a strided operand (its compression makes the contiguous copy)
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    return a, b


def _run_einsum(fused, monkeypatch, device, case, dtype, options, needs=(True, True), autocast=False,
                transposed=False):
    """Two training steps of one layer: outputs, the gradients asked for, the bytes kept, then
    both quantizers' buffers (estimates, seeds)."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
    layer = mnn.Einsum(**options).to(device)
    layer.quantizer_a.rng.copy_(torch.tensor([55, 0]))
    layer.quantizer_b.rng.copy_(torch.tensor([77, 0]))
    out = []
    for step in range(2):
        a, b = (t.requires_grad_(n) for t, n in
                zip(_einsum_inputs(case, step, device, DTYPES[dtype], transposed), needs))
        with SavedTensorMeter() as meter, torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = layer(EINSUM_CASES[case][0], a, b)
        (y.float() * torch.linspace(-1, 2, y.numel(), device=device).view(y.shape)).sum().backward()
        out += [y.detach(), a.grad, b.grad, torch.tensor(meter.activation_bytes)]
    return out + [t.clone() for t in layer.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(EINSUM_CASES))
def test_einsum_op_is_bitwise_the_python_function(case, dtype, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "einsum_train", _run_einsum, device, case, dtype, {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", EINSUM_VARIANTS, ids=str)
def test_einsum_op_takes_the_variant_formats_bitwise(options, device, monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "einsum_train", _run_einsum, device, "batched", "float32",
                                      options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["mvitv2", "batched"])
def test_einsum_op_runs_backward_in_the_forwards_autocast_state(case, device, monkeypatch):
    """Under autocast (bfloat16) the forward's products are bfloat16, and so are backward's,
    run after the autocast region ended: the gradients come back in the operands' float32."""
    assert_op_path_is_the_python_path(monkeypatch, "einsum_train", _run_einsum, device, case, "float32", {},
                                      (True, True), True)
    got = _run_einsum(True, monkeypatch, device, case, "float32", {}, autocast=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32


def test_einsum_op_compresses_a_strided_operand_bitwise(monkeypatch):
    assert_op_path_is_the_python_path(monkeypatch, "einsum_train", _run_einsum, "cpu", "batched", "float32", {},
                                      (True, True), False, True)


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["b-frozen", "a-frozen"])
@pytest.mark.parametrize("case", ["mvitv2", "batched"])
def test_einsum_keeps_only_what_the_asked_gradient_reads(case, needs, monkeypatch):
    """A frozen operand: its own copy is kept (the other's gradient reads it), the other's is
    not; both paths alike."""
    assert_op_path_is_the_python_path(monkeypatch, "einsum_train", _run_einsum, "cpu", case, "float32", {}, needs)
    a, b = _einsum_inputs("batched", 0, "cpu", torch.float32)
    with SavedTensorMeter() as meter:
        mnn.Einsum()("bij,bjk->bik", a.requires_grad_(), b)
    codes = b.numel() + 2 * 4 * b.shape[1]  # b's 8-bit codes and its groups' (alpha, beta), float32
    assert 0 < meter.activation_bytes <= codes


MODELS = {"mvitv2_tiny": {}, "samvit_base_patch16": dict(fused_attn=False)}


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_models_run_every_einsum_on_the_op_bitwise_the_python_function(name, monkeypatch):
    """MViTv2's relative positions and SAM's explicit attention path: two training steps with
    dropout and drop-path on give the same outputs, gradients and buffers, every Einsum on the op."""
    stock = build(name, drop=True)
    for m in stock.modules():
        if hasattr(m, "fused_attn") and MODELS[name]:
            m.fused_attn = MODELS[name]["fused_attn"]
    model = patch_model(stock)
    assert_patched_model_takes_the_op(monkeypatch, model, lambda step: example(name, seed=step), "einsum_train",
                                      mnn.Einsum)


# ----------------------------------------------------------------------------- both
def test_python_functions_run_where_the_ops_cannot(monkeypatch):
    """Learned thresholds and a 0-d operand keep the Einsum's Python Function; eval, disabled
    layers and integer inputs run stock; compiled, both layers trace their Python Functions."""
    a, b = torch.randn(4, 5, 6, requires_grad=True), torch.randn(4, 6, 3, requires_grad=True)

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.amax, self.einsum = mnn.Amax(), mnn.Einsum()

        def forward(self, x, y):
            return self.amax(x, 1).sum() + self.einsum("bij,bjk->bik", x, y).sum()

    traced = []  # every call target of the graphs Dynamo hands the backend

    def recording_backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(Both(), backend=recording_backend, fullgraph=True)(a, b).backward()
    assert traced and not [t for t in traced if "amax_train" in t or "einsum_train" in t]

    calls = {op: count_calls(monkeypatch, op) for op in ("amax_train", "einsum_train")}
    y = mnn.Einsum(bits=4, estimator="learned")("bij,bjk->bik", a, b)
    assert y.grad_fn.name() == "_EinsumFnBackward"
    y.sum().backward()
    y = mnn.Einsum()(",i->i", torch.tensor(2.0, requires_grad=True), torch.randn(5, requires_grad=True))
    assert y.grad_fn.name() == "_EinsumFnBackward"
    mnn.Einsum().eval()("bij,bjk->bik", a, b)
    mnn.Einsum(enabled=False)("bij,bjk->bik", a, b)
    mnn.Amax().eval()(a, 1)
    assert torch.equal(mnn.Amax()(torch.arange(12).view(3, 4), 1), torch.tensor([3, 7, 11]))
    assert calls == {"amax_train": [], "einsum_train": []}
    assert "AmaxTrain" in mnn.Amax()(a, 1).grad_fn.name()
    assert "EinsumTrain" in mnn.Einsum(bits=2)("bij,bjk->bik", a, b).grad_fn.name()
    assert calls == {"amax_train": [1], "einsum_train": [1]}


def test_the_einsum_op_refuses_higher_order_gradients():
    """Its backward reads the 8-bit copy (Amax's, lossless, differentiates: test_higher_order_gradients)."""
    a, b = torch.randn(4, 5, 6, requires_grad=True), torch.randn(4, 6, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(mnn.Einsum()("bij,bjk->bik", a, b).pow(2).sum(), a, create_graph=True)


def test_the_ops_name_their_valid_arguments():
    """Bad arguments from a direct call: one clear error each (the layers never pass them)."""
    q = mnn.Einsum().quantizer_a
    state = ([q.alpha, q.beta, q.initialized, q.rng], 1, 0.9, 0, False, True)
    a, b = torch.randn(4, 5, 6), torch.randn(4, 6, 3)
    for equation in ("...ij,jk->...ik", "bij,bjk", "bii,bjk->bjk", "bij,bjk,bkl->bil", "bij,jk->bk"):
        with pytest.raises(ValueError, match=r"einsum_train: equation '.*' is not a contraction it takes: two "
                                             r"operands, an explicit output"):
            torch.ops.mesa.einsum_train(equation, a, b, *state, *state)
    with pytest.raises(ValueError, match=r"operands must be floating point with at least one dim, got Long 3-d"):
        torch.ops.mesa.einsum_train("bij,bjk->bik", a.long(), b, *state, *state)
    with pytest.raises(RuntimeError, match=r"a quantizer state is \[alpha_est, beta_est, initialized, rng\], got 2"):
        torch.ops.mesa.einsum_train("bij,bjk->bik", a, b, *state, [q.alpha, q.beta], *state[1:])
    with pytest.raises(ValueError, match=r"amax_train: x must be floating point, got Long"):
        torch.ops.mesa.amax_train(a.long(), [1], False)
    with pytest.raises(IndexError, match=r"Dimension out of range"):
        torch.ops.mesa.amax_train(a, [3], False)
