"""``mesa::softmax_backward``: the backward of a Mesa Softmax over the last dim in one op.

Pins the op's exact definition (DESIGN.md, "Fused softmax backward"; the reference,
``mesa_train.quant.reference.softmax_backward``) across its implementations, bit for bit:
the CPU kernel, the traced form that ``torch.compile`` sees with traceable kernels, and (on a
GPU) the CUDA kernel; the reference itself against a scalar Python reading of the definition.
Then the layer: the gradient stays close to the former formula (dequantize, renormalise,
``_softmax_backward_data``), rows of the gradient sum to ~0, and the layouts the op does not
cover keep the former path.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mesa_train.nn as mnn
import mesa_train.quant as Q
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn.quantizer import decompress
from mesa_train.quant import reference as R
from mesa_train.quant import traceable
from kernel_marks import DTYPES, needs_ext
from op_recorder import OpRecorder
from bit_patterns import same_bits_nan_aside

LENGTHS = (1, 31, 32, 33, 197)


def _case(shape, dim, G, per_sample, dtype, *, zero_rows=True, specials=False, seed=0):
    """Codes, (S, G) parameters and g for a softmax map of ``shape`` (groups along ``dim``)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    S = shape[0] if per_sample else 1
    alpha = torch.rand(S, G, generator=gen) * 0.02
    beta = torch.rand(S, G, generator=gen) * 1e-3
    if zero_rows:  # all-zero codes with beta 0: y = 0, the row sum clamps to FLT_MIN
        beta[:, 0] = 0.0
        rows = q.view(-1, shape[-1])
        rows[:: 3] = 0
    g = torch.randn(shape, generator=gen)
    if specials:
        flat = g.view(-1)
        flat[:: 17] = float("nan")
        flat[5:: 23] = float("inf")
        flat[7:: 29] = -float("inf")
        flat[11:: 31] = -0.0
    return g.to(dtype), q, alpha, beta


# ----------------------------------------------------------------------------- CPU kernel
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("G,per_sample", [(1, False), (2, True), (4, False), (4, True)])
def test_cpu_kernel_is_bitwise_the_reference(dtype, L, G, per_sample):
    g, q, alpha, beta = _case((3, 4, 5, L), 1, G, per_sample, dtype)
    got = torch.ops.mesa.softmax_backward(g, q, alpha, beta, 1, G)
    want = R.softmax_backward(g, q, alpha, beta, 1, G)
    assert got.dtype == dtype and got.shape == q.shape
    assert same_bits_nan_aside(got, want)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,G,per_sample", [
    ((6, 3, 33), 0, 3, False),       # group dim 0, shared statistics
    ((6, 3, 33), 0, 2, True),        # group dim 0 with per-sample statistics: the sample is d
    ((2, 3, 4, 5, 31), 2, 2, True),  # a group dim between other dims
    ((2, 3, 0, 7), 1, 3, False),     # empty
])
def test_cpu_kernel_other_layouts(dtype, shape, dim, G, per_sample):
    g, q, alpha, beta = _case(shape, dim, G, per_sample, dtype)
    got = torch.ops.mesa.softmax_backward(g, q, alpha, beta, dim, G)
    want = R.softmax_backward(g, q, alpha, beta, dim, G)
    assert same_bits_nan_aside(got, want)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_in_g_and_zero_rows(dtype):
    g, q, alpha, beta = _case((2, 3, 6, 197), 1, 3, True, dtype, specials=True)
    got = torch.ops.mesa.softmax_backward(g, q, alpha, beta, 1, 3)
    want = R.softmax_backward(g, q, alpha, beta, 1, 3)
    assert same_bits_nan_aside(got, want)
    assert got.isnan().any()  # the NaN rows came through
    # a row of zero codes with beta 0 has y = 0: its gradient is 0 (0 / FLT_MIN), not NaN
    g, q, alpha, beta = _case((2, 3, 6, 197), 1, 3, True, dtype)
    got = torch.ops.mesa.softmax_backward(g, q, alpha, beta, 1, 3)
    head = torch.arange(2 * 3 * 6) // 6 % 3  # group 0 is head 0, whose beta _case sets to 0
    zero = (q.view(-1, 197) == 0).all(1) & (head == 0)
    assert zero.any() and (got.view(-1, 197)[zero] == 0).all()
    assert got.view(-1, 197)[~zero].ne(0).any(1).all()


@needs_ext
def test_non_contiguous_g():
    g, q, alpha, beta = _case((2, 3, 33, 33), 1, 3, False, torch.float32)
    gt = g.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    assert not gt.is_contiguous()
    got = torch.ops.mesa.softmax_backward(gt, q, alpha, beta, 1, 3)
    assert same_bits_nan_aside(got, R.softmax_backward(g, q, alpha, beta, 1, 3))


# ----------------------------------------------------------------------------- the definition
def _scalar_definition(g, q, alpha, beta, dim, G):
    """The definition element by element with numpy float32 scalars (shared statistics)."""
    f32 = np.float32
    L = q.shape[-1]
    inner = 1
    for s in q.shape[dim + 1:]:
        inner *= s
    D = q.shape[dim]
    out = []
    qf, gf = q.reshape(-1).tolist(), g.float().reshape(-1).tolist()

    def to_dtype(v):
        return float(torch.tensor(float(v), dtype=torch.float32).to(g.dtype).float())

    def lane_sum(v):
        acc = [f32(0.0)] * 32
        for j, x in enumerate(v):
            acc[j % 32] = f32(acc[j % 32] + f32(x))
        for off in (16, 8, 4, 2, 1):
            acc = [f32(acc[lane] + acc[lane ^ off]) for lane in range(32)]
        return acc[0]

    for i0 in range(0, len(qf), L):
        d_idx = (i0 // inner) % D
        grp = d_idx * G // D
        step = f32(f32(alpha[0, grp].item()) / f32(255.0))
        b = f32(beta[0, grp].item())
        y = [f32(to_dtype(f32(f32(qf[i0 + j]) * step) + b)) for j in range(L)]
        s = lane_sum(y)
        s = f32(R._FLT_MIN) if s < f32(R._FLT_MIN) else s
        p = [f32(v / s) for v in y]
        gr = [f32(v) for v in gf[i0:i0 + L]]
        d = lane_sum([f32(a * c) for a, c in zip(gr, p)])
        out += [to_dtype(f32(pj * f32(gj - d))) for pj, gj in zip(p, gr)]
    return torch.tensor(out, dtype=torch.float32).to(g.dtype).view(q.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_the_scalar_definition(dtype):
    g, q, alpha, beta = _case((2, 3, 2, 70), 1, 3, False, dtype)
    want = _scalar_definition(g, q, alpha, beta, 1, 3)
    assert same_bits_nan_aside(R.softmax_backward(g, q, alpha, beta, 1, 3), want)


@pytest.mark.parametrize("L", [0, 1, 31, 32, 33, 70, 197, 384])
def test_lane_sum_is_the_warp_order(L):
    """R.lane_sum (slices, written for the compiler) against a warp's order element by
    element: 32 strided lane sums from +0.0, then the xor butterfly, lane 0; NaN, inf and -0.0
    included, every bit."""
    f32 = np.float32
    torch.manual_seed(L)
    v = torch.randn(9, L) * torch.exp2(torch.randint(-20, 20, (9, L)).float())
    pick = torch.rand(9, L)
    v[pick < 0.03] = float("nan")
    v[(pick > 0.03) & (pick < 0.05)] = float("inf")
    v[(pick > 0.05) & (pick < 0.08)] = -0.0
    got = R.lane_sum(v)
    assert got.shape == (9, 1)
    for r in range(9):
        acc = [f32(0.0)] * 32
        for j, x in enumerate(v[r].tolist()):
            acc[j % 32] = f32(acc[j % 32] + f32(x))
        for off in (16, 8, 4, 2, 1):
            acc = [f32(acc[lane] + acc[lane ^ off]) for lane in range(32)]
        want = torch.tensor([acc[0]], dtype=torch.float32)
        assert torch.equal(got[r].view(torch.int32), want.view(torch.int32)) or (got[r].isnan() & want.isnan()).all()


def test_lane_sum_order_matters():
    """The fixed order is observable: a plain left-to-right sum differs on these rows, so the
    bitwise tests would catch an implementation that sums in another order."""
    v = torch.randn(64, 197) * torch.logspace(-3, 3, 197)
    left_to_right = v.cumsum(1)[:, -1:]
    assert not torch.equal(R.lane_sum(v), left_to_right)


# ----------------------------------------------------------------------------- traced form
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_traced_form_compiles_to_the_same_bits(dtype):
    torch._dynamo.reset()
    fn = torch.compile(traceable.softmax_backward, backend="inductor", fullgraph=True, dynamic=False)
    for L, per_sample in ((197, True), (33, False)):
        g, q, alpha, beta = _case((2, 3, 5, L), 1, 3, per_sample, dtype)
        got = fn(g, q, alpha, beta, 1, 3)
        assert same_bits_nan_aside(got, R.softmax_backward(g, q, alpha, beta, 1, 3)), L
        if dtype != torch.float32:  # a float32 map with a half g (autocast), the result in g's dtype or float32
            got = fn(g, q, alpha, beta, 1, 3, torch.float32)
            assert same_bits_nan_aside(got, R.softmax_backward(g.float(), q, alpha, beta, 1, 3).to(dtype)), L
            got = fn(g, q, alpha, beta, 1, 3, torch.float32, torch.float32)
            assert same_bits_nan_aside(got, R.softmax_backward(g.float(), q, alpha, beta, 1, 3)), L


_EDGES = [0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 7e4, 2.0 ** -14, 0.99 * 2.0 ** -14, 2.0 ** -24,
          2.0 ** -25, 1.01 * 2.0 ** -25, 3 * 2.0 ** -26, 1e-30, float("inf"), -float("inf"), 3.3895e38, 3.4e38]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_round_through_is_the_cast(dtype):
    """The explicit rounding of the traced form (Inductor would drop a cast round trip) is
    exactly the cast, subnormals, ties, overflow and zero signs included."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(200000, generator=gen) * 10.0 ** torch.randint(-9, 6, (200000,), generator=gen).float()
    v = torch.cat([v, torch.tensor(_EDGES), -torch.tensor(_EDGES)])
    v = torch.cat([v, v.to(dtype).float() + v.to(dtype).float().abs() * 2.0 ** -9])  # ties and near ties
    assert same_bits_nan_aside(traceable.round_through(v, dtype), v.to(dtype).float())


def test_traced_form_eager_is_the_reference():
    g, q, alpha, beta = _case((2, 3, 5, 40), 1, 3, True, torch.float16, specials=True)
    want = R.softmax_backward(g, q, alpha, beta, 1, 3)
    assert same_bits_nan_aside(traceable.softmax_backward(g, q, alpha, beta, 1, 3), want)


# ----------------------------------------------------------------------------- float32 map, half g
# Under CUDA autocast the softmax runs in float32 and `attn @ v` in bf16: y_dtype=float32 with
# a half g is the casts around the op (g up, the result down) folded into it, bit for bit.
_FLOAT_MAP_IMPLS = {
    "reference": R.softmax_backward,
    "traced": traceable.softmax_backward,
    "op": lambda *a: torch.ops.mesa.softmax_backward(*a),
}


@pytest.mark.parametrize("impl", list(_FLOAT_MAP_IMPLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("L", [33, 197, 300])
def test_float_map_with_half_g_is_the_casts_around_the_op(impl, dtype, L):
    if impl == "op" and Q.BACKEND != "extension":
        pytest.skip(f"compiled extension not loaded: {Q.extension_error}")
    fn = _FLOAT_MAP_IMPLS[impl]
    for specials in (True, False):
        g, q, alpha, beta = _case((2, 3, 5, L), 1, 3, L % 2 == 1, dtype, specials=specials)
        got = fn(g, q, alpha, beta, 1, 3, torch.float32)
        assert same_bits_nan_aside(got, R.softmax_backward(g.float(), q, alpha, beta, 1, 3).to(dtype)), specials
        # float32 logits (Swin's, with their float32 bias): the result in float32, no cast
        out32 = fn(g, q, alpha, beta, 1, 3, torch.float32, torch.float32)
        assert same_bits_nan_aside(out32, R.softmax_backward(g.float(), q, alpha, beta, 1, 3)), specials
        # y_dtype equal to g's dtype is the default
        want = R.softmax_backward(g, q, alpha, beta, 1, 3)
        assert same_bits_nan_aside(fn(g, q, alpha, beta, 1, 3, dtype), want), specials
    # (and the float32 map is not the half one: the argument is read)
    assert not same_bits_nan_aside(got, R.softmax_backward(g, q, alpha, beta, 1, 3))


def test_opcheck():
    g, q, alpha, beta = _case((2, 3, 4, 33), 1, 3, True, torch.float32)
    torch.library.opcheck(torch.ops.mesa.softmax_backward.default, (g, q, alpha, beta, 1, 3))
    torch.library.opcheck(torch.ops.mesa.softmax_backward.default, (g.bfloat16(), q, alpha, beta, 1, 3, torch.float32))
    torch.library.opcheck(torch.ops.mesa.softmax_backward.default,
                          (g.bfloat16(), q, alpha, beta, 1, 3, torch.float32, torch.float32))


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("float_map", [False, True, "out32"], ids=["map-in-g-dtype", "float32-map", "float32-out"])
def test_cuda_op_is_the_reference(dtype, L, float_map):
    g, q, alpha, beta = _case((4, 6, 50, L), 1, 3, L % 2 == 1, dtype, specials=L == 197)
    y_dtype = torch.float32 if float_map else None
    out_dtype = torch.float32 if float_map == "out32" else None
    got = torch.ops.mesa.softmax_backward(g.cuda(), q.cuda(), alpha.cuda(), beta.cuda(), 1, 3, y_dtype,
                                          out_dtype).cpu()
    want = R.softmax_backward(g, q, alpha, beta, 1, 3, y_dtype, out_dtype)
    assert same_bits_nan_aside(got, want)  # (a GPU's NaN payloads differ from the host's)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [Q.softmax_backward, torch.ops.mesa.softmax_backward], ids=["wrapper", "op"])
@pytest.mark.parametrize("change,match", [
    (dict(g=lambda g: g.double()), "g must be float32, float16 or bfloat16"),
    (dict(q=lambda q: q.to(torch.int8)), "uint8 codes"),
    (dict(g=lambda g: g[..., :-1]), "g has shape"),
    (dict(dim=3), "softmax \\(last\\) dim .*dequantize \\+ torch._softmax_backward_data"),
    (dict(dim=-1), "softmax \\(last\\) dim"),
    (dict(dim=7), "out of range"),
    (dict(alpha=lambda a: a[:, :2]), "alpha"),
    (dict(G=5), "num_groups=5 must be in \\[1, 3\\]"),
    (dict(y_dtype=torch.float64), "y_dtype must be None, g's dtype .* or (torch.)?float32, got"),
    (dict(g=lambda g: g.bfloat16(), y_dtype=torch.float16), "y_dtype must be None"),
    (dict(g=lambda g: g.bfloat16(), out_dtype=torch.float32), "out_dtype must be None, g's dtype .* with y_dtype"),
    (dict(g=lambda g: g.bfloat16(), y_dtype=torch.float32, out_dtype=torch.float16), "out_dtype must be None"),
])
def test_one_line_errors(fn, change, match):
    g, q, alpha, beta = _case((2, 3, 4, 5), 1, 3, False, torch.float32)
    args = dict(g=g, q=q, alpha=alpha, beta=beta, dim=1, G=3, y_dtype=None, out_dtype=None)
    for k, v in change.items():
        args[k] = v(args[k]) if callable(v) else v
    if "alpha" in change:
        args["beta"] = args["alpha"].clone()
    with pytest.raises(ValueError, match=match) as e:
        fn(args["g"], args["q"], args["alpha"], args["beta"], args["dim"], args["G"], args["y_dtype"],
           args["out_dtype"])
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the layer
def _old_formula(packed, g, softmax_dim, dtype):
    """The former backward: dequantize, rows renormalised to sum 1, _softmax_backward_data."""
    yh = decompress(packed, dtype)
    yh = yh / yh.sum(softmax_dim, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return torch._softmax_backward_data(g.to(dtype), yh, softmax_dim, dtype)


def _layer_grad(layer, x, g):
    """The input gradient of one training step, the 8-bit copy it used and backward's ops."""
    xi = x.clone().requires_grad_()
    y, packed = layer.forward_with_copy(xi)
    with OpRecorder() as rec:
        y.backward(g)
    return xi.grad, packed, rec.ops


# relative (Frobenius) error of the new gradient against the former formula's: float32 only
# rounding apart (both compute in float32); bfloat16 / float16: the former formula rounded y,
# the row sums and the quotient to the 16-bit dtype, the op rounds only gx
REL_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python-function"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_gradient_close_to_former_formula(dtype, fused, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    torch.manual_seed(0)
    layer = mnn.Softmax(-1, num_groups=3)
    x = (torch.randn(2, 3, 17, 197) * 3).to(dtype)
    g = torch.randn(x.shape).to(dtype)
    _layer_grad(layer, x, g)  # estimates initialised
    gx, packed, ops = _layer_grad(layer, x, g)
    assert "mesa.softmax_backward" in ops and "mesa.dequantize" not in ops, ops
    old = _old_formula(packed, g, 3, dtype).float()
    rel = ((gx.float() - old).norm() / old.norm()).item()
    assert rel < REL_BOUND[dtype], rel


def test_rows_of_the_gradient_sum_to_zero():
    """A bias added to a whole row of logits gets ~0 gradient, as with the exact map."""
    torch.manual_seed(1)
    layer = mnn.Softmax(-1, num_groups=2)
    x = torch.randn(2, 2, 9, 197) * 4
    g = torch.randn(x.shape)
    _layer_grad(layer, x, g)
    gx, packed, _ = _layer_grad(layer, x, g)
    p = decompress(packed, torch.float32)
    p = p / p.sum(-1, keepdim=True)
    scale = (g * p).abs().sum(-1)  # the magnitude of the row's terms
    assert (gx.sum(-1).abs() <= 1e-5 * scale + 1e-30).all()
    # the bias's gradient, seen through autograd
    b = torch.zeros(2, 2, 9, 1, requires_grad=True)
    y = layer(x + b)
    y.backward(g)
    assert (b.grad.abs().squeeze(-1) <= 1e-5 * scale).all()


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python-function"])
@pytest.mark.parametrize("make,shape,softmax_dim", [
    (lambda: mnn.Softmax(2, num_groups=3), (2, 3, 7, 7), 2),        # softmax dim not the last
    (lambda: mnn.Softmax(-1, num_groups=3), (2, 7, 9), 2),          # 3-D: groups along the last dim
    (lambda: mnn.Softmax(-1, num_groups=3, bits=4), (2, 3, 7, 7), 3),  # a variant format
])
def test_other_layouts_keep_the_former_path(make, shape, softmax_dim, fused, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(shape) * 3
    g = torch.randn(shape)
    _layer_grad(layer, x, g)
    gx, packed, ops = _layer_grad(layer, x, g)
    assert "mesa.softmax_backward" not in ops, ops
    assert torch.equal(gx, _old_formula(packed, g, softmax_dim, torch.float32))


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softmax_dim", [3, 2])
def test_cpp_node_is_bitwise_the_python_function(dtype, softmax_dim, monkeypatch):
    layers = [mnn.Softmax(softmax_dim, num_groups=3) for _ in range(2)]
    layers[1].quantizer.rng.copy_(layers[0].quantizer.rng)  # the same rounding key
    x = (torch.randn(2, 3, 9, 9) * 3).to(dtype)
    g = torch.randn(x.shape).to(dtype)
    grads = []
    for fused, layer in zip((True, False), layers):
        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused)
        for step in range(2):
            xi = (x * (step + 1)).requires_grad_()
            layer(xi).backward(g)
            grads.append(xi.grad)
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[3])


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("mode,extension", [("ops", True), ("traceable", True), ("traceable", False)])
def test_compiled_backward_is_the_op_or_its_traced_form(mode, extension, monkeypatch):
    """mesa::softmax_backward is a node of the backward graph (its fake gives the shapes) with
    the extension, compile_kernels=traceable included (compile_kernels.traced_row_sums: traced,
    its warp-order row sums split into a kernel per sweep on a GPU); without the extension,
    traceable runs its plain-PyTorch form, no mesa op and no ATen softmax backward. Either way
    the gradient is the eager one, bit for bit."""
    from mesa_train import quant
    from mesa_train.quant import compile_kernels

    from graph_capture import recording_backend

    monkeypatch.setattr(compile_kernels, "_mode", mode)
    if not extension:  # (the ops stay registered; only the choice of form reads BACKEND)
        monkeypatch.setattr(quant, "BACKEND", "reference")
    torch._dynamo.reset()
    backend, graphs = recording_backend()

    layers = [mnn.Softmax(-1, num_groups=2) for _ in range(2)]
    layers[1].quantizer.rng.copy_(layers[0].quantizer.rng)
    compiled = torch.compile(layers[1], backend=backend, fullgraph=True)
    x = torch.randn(2, 2, 5, 33) * 3
    g = torch.randn(x.shape)
    grads = []
    for fn in (layers[0], compiled):
        xi = x.clone().requires_grad_()
        fn(xi).backward(g)
        grads.append(xi.grad)
    code = "\n".join(gm.code for gm in graphs["backward"])
    assert "dequantize" not in code and "_softmax_backward_data" not in code, code
    assert ("mesa.softmax_backward" in code) == extension, code
    assert torch.equal(grads[0], grads[1])
