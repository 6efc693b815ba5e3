"""``mesa::layer_norm_backward``: a LayerNorm's three gradients from its 8-bit ``x_hat`` codes.

Pins the op's exact definition (DESIGN.md, "LayerNorm backward from the codes"; the reference,
``mesa_train.quant.reference.layer_norm_backward``) across its implementations, bit for bit:
the CPU kernel and (on a GPU) the CUDA kernel. The reference itself is checked against the
LayerNorm backward in float64 and against ATen's ``native_layer_norm_backward`` on the
dequantized input (what the layers called before), and a summation order other than the
defined one fails. Then the layers: both paths (C++ node, Python Function) call the op where
it applies and keep the former path where it does not.
"""
from __future__ import annotations

import pytest
import torch

import mesa_train.nn as mnn
import mesa_train.quant as Q
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.quant import reference as R
from kernel_marks import DTYPES
from op_recorder import OpRecorder
from bit_patterns import bit_pattern, same_bits_nan_aside

# widths: under one lane pass, partial passes, DeiT-S, the widest the op takes
WIDTHS = (1, 31, 33, 48, 384, 1024)


def _case(shape, G, per_sample, dtype, *, weight=True, row_exp=False, specials=False, seed=0):
    """(g, q, alpha, beta, G, rstd, weight, k) for a LayerNorm over the last dim of ``shape``."""
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    G = min(G, D)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    S = shape[0] if per_sample else 1
    alpha = torch.rand(S, G, generator=gen) * 6
    beta = -torch.rand(S, G, generator=gen) * 3
    g = torch.randn(shape, generator=gen)
    if specials:
        flat = g.view(-1)
        flat[::17] = float("nan")
        flat[5::23] = float("inf")
        flat[7::29] = -float("inf")
        flat[11::31] = -0.0
    rstd = torch.rand(shape[:-1] + (1,), generator=gen) * 4 + 0.1
    w = torch.randn(D, generator=gen) if weight else None
    k = torch.randint(0, 5, shape[:-1] + (1,), dtype=torch.int8, generator=gen) if row_exp else None
    return g.to(dtype), q, alpha, beta, G, rstd, w, k


# ----------------------------------------------------------------------------- the CPU kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", WIDTHS)
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per-sample"])
def test_cpu_kernel_is_bitwise_the_reference(dtype, D, per_sample):
    # 70 rows: two blocks of 32 and a partial third, a partial last chunk
    args = _case((2, 35, D), 6, per_sample, dtype, weight=D % 2 == 0, row_exp=D > 32)
    got = torch.ops.mesa.layer_norm_backward(*args)
    want = R.layer_norm_backward(*args)
    for a, b in zip(got, want):
        assert same_bits_nan_aside(a, b)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 1, 40), (2, 3, 4, 48)], ids=str)
def test_cpu_kernel_other_shapes(shape):
    args = _case(shape, 3, False, torch.bfloat16, row_exp=True)
    for a, b in zip(torch.ops.mesa.layer_norm_backward(*args), R.layer_norm_backward(*args)):
        assert same_bits_nan_aside(a, b)


def test_nan_inf_in_g():
    args = _case((3, 50, 64), 4, False, torch.float32, specials=True)
    got = torch.ops.mesa.layer_norm_backward(*args)
    want = R.layer_norm_backward(*args)
    assert got[0].isnan().any() and got[1].isnan().any()
    for a, b in zip(got, want):
        assert same_bits_nan_aside(a, b)


def test_empty_and_non_contiguous():
    g, q, alpha, beta, G, rstd, w, k = _case((0, 5, 16), 2, False, torch.float32)
    dx, dparams = torch.ops.mesa.layer_norm_backward(g, q, alpha, beta, G, rstd, w, k)
    assert dx.shape == (0, 5, 16) and torch.equal(dparams, torch.zeros(2, 16))
    g, q, alpha, beta, G, rstd, w, k = _case((40, 6, 24), 2, False, torch.float32)
    gt = g.transpose(0, 1).contiguous().transpose(0, 1)  # strided, same values
    assert not gt.is_contiguous()
    for a, b in zip(torch.ops.mesa.layer_norm_backward(gt, q, alpha, beta, G, rstd, w, k),
                    R.layer_norm_backward(g, q, alpha, beta, G, rstd, w, k)):
        assert same_bits_nan_aside(a, b)


def test_both_column_sums_are_one_reduction():
    """dparams is (2, D): dweight then dbias, the rows of one sum over (2, blocks, D) partials
    (one reduction launch on a GPU; two outputs could not share it), and the public wrapper
    still returns (dx, dweight, dbias)."""
    args = _case((3, 40, 64), 4, False, torch.float32)
    dx, dparams = torch.ops.mesa.layer_norm_backward(*args)
    assert dparams.shape == (2, 64) and dparams.is_contiguous()
    dx3, dw, db = Q.layer_norm_backward(*args)
    assert same_bits_nan_aside(dx3, dx) and same_bits_nan_aside(dw, dparams[0]) and same_bits_nan_aside(db, dparams[1])
    g, q, alpha, beta, G, rstd, w, k = args
    xh = R.dequantize(q, alpha, beta, 2, G, torch.float32, k).view(-1, 64)
    partials = torch.stack((R.ln_column_partials(g.view(-1, 64) * xh), R.ln_column_partials(g.view(-1, 64))))
    assert same_bits_nan_aside(dparams, partials.sum(1))


def test_opcheck():
    args = _case((2, 9, 40), 4, True, torch.float32, row_exp=True)
    torch.library.opcheck(torch.ops.mesa.layer_norm_backward.default, args)


# ----------------------------------------------------------------------------- the definition
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("row_exp", [False, True], ids=["", "row-exp"])
def test_reference_is_the_layer_norm_backward(weight, row_exp):
    """Against the LayerNorm backward in float64 at the dequantized x_hat: dx = rstd * (gw -
    mean(gw) - x_hat * mean(gw * x_hat)), dweight = sum g * x_hat, dbias = sum g."""
    g, q, alpha, beta, G, rstd, w, k = _case((4, 50, 96), 6, False, torch.float32, weight=weight, row_exp=row_exp)
    dx, (dw, db) = R.layer_norm_backward(g, q, alpha, beta, G, rstd, w, k)
    xh = R.dequantize(q, alpha, beta, 2, G, torch.float32, k).double()
    g64 = g.double()
    gw = g64 * w.double() if weight else g64
    want = rstd.double() * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True))
    torch.testing.assert_close(dx.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), (g64 * xh).sum((0, 1)), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(db.double(), g64.sum((0, 1)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_close_to_aten_on_the_dequantized_input(dtype):
    """What the layers called before: dequantize (x - mean as x_hat / rstd) and ATen's
    native_layer_norm_backward with mean 0. Float rounding apart, the same gradients."""
    g, q, alpha, beta, G, rstd, w, k = _case((3, 40, 384), 6, False, dtype, row_exp=True)
    got = Q.layer_norm_backward(g, q, alpha, beta, G, rstd, w, k)
    xs = R.dequantize(q, alpha, beta, 2, G, torch.float32, k, torch.reciprocal(rstd))
    want = torch.ops.aten.native_layer_norm_backward(g.float(), xs, [384], torch.zeros_like(rstd), rstd, w, w,
                                                     [True, True, True])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_order_of_the_column_sums_matters():
    """The chunk / block order is part of the definition: summing the columns in plain row
    order gives other bits on a case built for it (so a kernel that drifts from the order fails
    the bitwise tests above)."""
    g, q, alpha, beta, G, rstd, w, k = _case((1, 300, 64), 4, False, torch.float32, seed=3)
    g = g * torch.logspace(-6, 6, 300).view(1, 300, 1)  # rows of very different magnitudes
    _, (dw, db) = R.layer_norm_backward(g, q, alpha, beta, G, rstd, w, k)
    xh = R.dequantize(q, alpha, beta, 2, G, torch.float32, k).view(300, 64)
    acc_w = torch.zeros(64)
    acc_b = torch.zeros(64)
    for r in range(300):  # plain sequential row order
        acc_w = acc_w + g.view(300, 64)[r] * xh[r]
        acc_b = acc_b + g.view(300, 64)[r]
    assert not (torch.equal(bit_pattern(acc_w), bit_pattern(dw)) and torch.equal(bit_pattern(acc_b), bit_pattern(db)))
    torch.testing.assert_close(dw, acc_w, rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", WIDTHS)
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per-sample"])
def test_cuda_op_is_the_reference(dtype, D, per_sample):
    """dx bit for bit the CPU reference's (lane sums and elementwise float32 only); the column
    sums bit for bit the reference run on the GPU (its last step, a torch.sum over the
    partials, is the device's own reduction) and close to the CPU's."""
    args = _case((2, 35, D), 6, per_sample, dtype, weight=D % 2 == 0, row_exp=D > 32, specials=D == 48)
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = [t.cpu() for t in torch.ops.mesa.layer_norm_backward(*cuda)]
    want_cpu = R.layer_norm_backward(*args)
    want_gpu = [t.cpu() for t in R.layer_norm_backward(*cuda)]
    assert same_bits_nan_aside(got[0], want_cpu[0])
    for a, b, c in zip(got[1:], want_gpu[1:], want_cpu[1:]):
        assert same_bits_nan_aside(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-4, equal_nan=True)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [Q.layer_norm_backward, torch.ops.mesa.layer_norm_backward], ids=["wrapper", "op"])
@pytest.mark.parametrize("change,match", [
    (dict(g=lambda g: g.double()), "g must be float32, float16 or bfloat16"),
    (dict(q=lambda q: q.to(torch.int8)), "uint8 codes"),
    (dict(g=lambda g: g[..., :-1]), "g has shape"),
    (dict(G=9), "num_groups=9 must be in \\[1, 8\\]"),
    (dict(rstd=lambda r: r[:1]), "rstd must hold one value per row"),
    (dict(rstd=lambda r: r.double()), "rstd must be a float32 tensor"),
    (dict(w=lambda w: w[:-1]), "weight must be None or a float32 \\(8,\\) tensor"),
    (dict(k=lambda k: k.to(torch.int32)), "row_exp must be"),
])
def test_one_line_errors(fn, change, match):
    g, q, alpha, beta, G, rstd, w, k = _case((2, 5, 8), 2, False, torch.float32, row_exp=True)
    args = dict(g=g, q=q, alpha=alpha, beta=beta, G=G, rstd=rstd, w=w, k=k)
    for key, v in change.items():
        args[key] = v(args[key]) if callable(v) else v
    with pytest.raises(ValueError, match=match) as e:
        fn(args["g"], args["q"], args["alpha"], args["beta"], args["G"], args["rstd"], args["w"], args["k"])
    assert "\n" not in str(e.value).strip()


@pytest.mark.parametrize("fn", [Q.layer_norm_backward, torch.ops.mesa.layer_norm_backward], ids=["wrapper", "op"])
def test_rows_wider_than_the_op_takes(fn):
    g, q, alpha, beta, G, rstd, w, k = _case((2, 1025), 4, False, torch.float32)
    with pytest.raises(ValueError, match="rows of 1025 elements; valid: at most 1024"):
        fn(g, q, alpha, beta, G, rstd, w, k)


# ----------------------------------------------------------------------------- the layers
def _backward_ops(layer, x):
    layer(x.clone().requires_grad_()).sum().backward()  # estimates
    xs = x.clone().requires_grad_()
    y = layer(xs)
    with OpRecorder() as rec:
        y.backward(torch.ones_like(y))
    return rec.ops


@pytest.mark.parametrize("python_path", [False, True], ids=["cpp-node", "python"])
@pytest.mark.parametrize("width,uses_op", [(64, True), (1024, True), (1040, False)])
def test_layer_uses_the_op_where_it_applies(python_path, width, uses_op, monkeypatch):
    """Both layer paths run the op for one normalised dim of at most 1024; wider rows keep
    dequantize + ATen's backward, with gradients close to the op's."""
    if python_path:
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    torch.manual_seed(0)
    layer = mnn.LayerNorm.from_module(torch.nn.LayerNorm(width))
    ops = _backward_ops(layer, torch.randn(3, 7, width))
    assert ("mesa.layer_norm_backward" in ops) == uses_op, ops
    assert ("aten.native_layer_norm_backward" in ops) == (not uses_op), ops


def test_layer_gradients_match_the_former_path(monkeypatch):
    """The op against the former path (dequantize + native_layer_norm_backward) on the same
    codes: one forward, its backward run twice (the second with the op's width limit at 0)."""
    import mesa_train.nn.layernorm as ln_mod

    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)  # the Python Function: its gate is patchable
    torch.manual_seed(0)
    stock = torch.nn.LayerNorm(96)
    with torch.no_grad():
        stock.weight.normal_()
        stock.bias.normal_()
    layer = mnn.LayerNorm.from_module(stock)
    x = torch.randn(4, 33, 96, requires_grad=True)
    loss = layer(x).mul(torch.linspace(-1, 1, 96)).sum()
    inputs = (x, layer.weight, layer.bias)
    new = torch.autograd.grad(loss, inputs, retain_graph=True)
    monkeypatch.setattr(ln_mod, "LN_MAX_COLS", 0)
    old = torch.autograd.grad(loss, inputs)
    for a, b in zip(new, old):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_traced_form_is_the_reference(dtype):
    """What ``compile_kernels=traceable`` runs (tensor ops only): the op's bits in eager and under
    aot_eager (Inductor may fuse it into other roundings)."""
    from mesa_train.quant import traceable

    args = _case((2, 35, 100), 5, True, dtype, row_exp=True, specials=dtype == torch.float32)
    want = R.layer_norm_backward(*args)
    for fn in (traceable.layer_norm_backward, torch.compile(traceable.layer_norm_backward, backend="aot_eager",
                                                            fullgraph=True)):
        for a, b in zip(fn(*args), want):
            assert same_bits_nan_aside(a, b)
