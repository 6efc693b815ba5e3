"""How many ops (kernel launches on a GPU) each Mesa layer adds to the stock layer.

On a GPU every extra eager op is one more kernel launch and one more pass over the
activation, which is where Mesa's throughput goes (issue 5). These tests pin the op
sequence of each layer's forward and backward so that a change which adds passes fails
here rather than silently in a GPU benchmark: a compressed tensor costs exactly
``observe + quantize`` in forward and one ``dequantize`` in backward (or, for a Softmax over the
last dim, one ``softmax_backward`` that replaces the stock backward op too, and likewise
``gelu_backward`` and ``layer_norm_backward``; plus one
``row_exponents`` for the inputs with power-of-two row scales); everything else must be the
stock layer's own ops (LayerNorm included: its x_hat is made inside the compression's kernels
from the row mean and rstd, and its backward is one layer_norm_backward from the codes, so no
extra pass either way).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mesa_train.nn as M
from op_recorder import OpRecorder, compress_ops

# metadata-only ops, allocations and grad accumulation: not passes over data. (No seed draw:
# rounding seeds come from the quantizers' device-side counters inside mesa::observe, so a
# random-number op or a host read (_local_scalar_dense) in a Mesa layer fails these tests.)
NOT_A_PASS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand", "aten.unsqueeze",
    "aten.reshape", "aten.detach", "aten.alias", "aten.permute", "aten.squeeze", "aten.slice",
    "aten.select", "aten.as_strided", "aten.empty", "aten.new_empty", "aten.empty_strided",
    "aten.add_", "aten.ones_like", "aten.promote_types",
    # per-row (not per-element) tensors of LayerNorm's backward: rows floats, not the activation
    # (its zero mean, and 1 / rstd for dequantize's row_mul)
    "aten.zeros_like", "aten.reciprocal",
}
COMPRESS = ["mesa.observe", "mesa.quantize"]
# power-of-two row scales of Linear / LayerNorm (nn/rowscale.py, issue 10: rows far below the
# group's grid): mesa::observe_rows finds the exponents and the statistics in one pass over the
# activation (the row maxima and each row's group min/max; DESIGN.md, "observe_rows"), and
# quantize / dequantize take the exponents as row_exp and scale inside their kernels: still
# two ops forward, one backward, no scaled copy forward, no multiply backward (issue 9: they
# were 13 ATen ops forward and 4 backward, ~12 launches per layer; then row_exponents +
# observe + quantize, three ops and three reads of the activation). The C++ layer ops and the
# Python Functions call the same ops.
COMPRESS_ROWS = ["mesa.observe_rows", "mesa.quantize"]
# (a LayerNorm without row scales too: observe_rows with max_k = 0 takes its mean and rstd)
ROW_SCALED = {"Linear", "LayerNorm", "Linear/python", "LayerNorm/python", "LayerNorm/row_scale=False"}
ROWSCALE_BWD = []


def _fwd_bwd_ops(module, *inputs):
    xs = [x.clone().requires_grad_() for x in inputs]
    module(*xs).sum().backward()  # initialise estimates, lazy state
    with OpRecorder(keep=lambda name: name not in NOT_A_PASS) as rec:
        y = module(*xs)
        n_fwd = len(rec.ops)
        y.backward(torch.ones_like(y))
    return rec.ops[:n_fwd], rec.ops[n_fwd:]


class _MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class _SDPA(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


class _HeadsProduct(nn.Module):
    """A product of heads split from a fused qkv projection, as in timm's ``Attention``:
    ``q @ k^T`` (``which="qk"``) or ``attn @ v`` ("av"), its output back to tokens. The
    operands are views the batched product must copy, and so is its gradient: Mesa's
    compression (or backward) must reuse those copies, not make its own (issue 9: at most
    one contiguous copy per tensor)."""

    def __init__(self, matmul: nn.Module, which: str):
        super().__init__()
        self.matmul, self.which = matmul, which

    def forward(self, attn, qkv):
        B, N, _ = qkv.shape
        q, k, v = qkv.reshape(B, N, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.matmul(q, k.transpose(-2, -1)) if self.which == "qk" else self.matmul(attn, v)
        return out.transpose(1, 2).reshape(B, N, -1)


def _heads_case(which: str) -> tuple:
    return (lambda: _HeadsProduct(_MatMul(), which), lambda s: _HeadsProduct(M.MatMul(), s.which),
            lambda: (torch.randn(2, 2, 9, 9), torch.randn(2, 9, 48)), 2, [], [])


def _channels_last_conv_case() -> tuple:
    """A depthwise conv on a channels-last input (PVT-v2's): compressed as its NHWC view, no
    copy to NCHW."""
    return (lambda: nn.Conv2d(4, 4, 3, groups=4), M.Conv2d.from_module,
            lambda: (torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last),), 1, [], [])


def _x():
    return torch.randn(2, 9, 16)


def _qkv():
    return tuple(torch.randn(2, 2, 9, 8) for _ in range(3))


# fused attention's backward recomputes the attention from the dequantized q, k, v: one
# forward kernel more than stock's backward, nothing else
SDPA_RECOMPUTE = ["aten._scaled_dot_product_flash_attention_for_cpu"]


# (stock module, Mesa converter, inputs, compressed tensors, extra non-Mesa ops fwd / bwd)
CASES = {
    "Linear": (lambda: nn.Linear(16, 8), M.Linear.from_module, lambda: (_x(),), 1, [], ROWSCALE_BWD),
    "GELU": (nn.GELU, M.GELU.from_module, lambda: (_x(),), 1, [], []),
    # a channels-last activation is compressed as its NHWC view: no copy (ConvNeXt in channels_last)
    "GELU/channels_last": (nn.GELU, M.GELU.from_module,
                           lambda: (torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last),), 1, [], []),
    # backward over the last dim: one op (FUSED_BACKWARD)
    "Softmax": (lambda: nn.Softmax(-1), M.Softmax.from_module, lambda: (torch.randn(2, 2, 9, 9),), 1, [], []),
    # over another dim, backward: each dequantized row renormalised to sum 1 (row sum, clamp,
    # divide), then stock's own _softmax_backward_data
    "Softmax/dim2": (lambda: nn.Softmax(2), M.Softmax.from_module, lambda: (torch.randn(2, 2, 9, 9),), 1, [],
                     ["aten.sum", "aten.clamp_min", "aten.div"]),
    "Conv2d": (lambda: nn.Conv2d(4, 4, 3), M.Conv2d.from_module, lambda: (torch.randn(2, 4, 8, 8),), 1, [], []),
    "Conv2d/channels_last": _channels_last_conv_case(),
    # x_hat = (x - mean) * rstd inside observe_rows and quantize (row_mean / row_rstd: no
    # forward pass beyond stock's); backward: one mesa::layer_norm_backward from the codes in
    # place of stock's native_layer_norm_backward
    "LayerNorm": (lambda: nn.LayerNorm(16), M.LayerNorm.from_module, lambda: (_x(),), 1,
                  [], ROWSCALE_BWD),
    "MatMul": (_MatMul, lambda s: M.MatMul(), lambda: (torch.randn(2, 2, 9, 9), torch.randn(2, 2, 9, 8)), 2, [], []),
    "SDPA": (_SDPA, lambda s: M.ScaledDotProductAttention(num_groups=2), _qkv, 3, [], SDPA_RECOMPUTE),
    "MatMul/qk-of-qkv": _heads_case("qk"),
    "MatMul/av-of-qkv": _heads_case("av"),
    # row_scale=False: the compression alone (2 ops forward, 1 backward), nothing else
    "Linear/row_scale=False": (lambda: nn.Linear(16, 8), lambda s: M.Linear.from_module(s, row_scale=False),
                               lambda: (_x(),), 1, [], []),
    "LayerNorm/row_scale=False": (lambda: nn.LayerNorm(16), lambda s: M.LayerNorm.from_module(s, row_scale=False),
                                  lambda: (_x(),), 1, [], []),
}


# The Python Functions (the path of the variant formats, and of torch.compile with the ops):
# the same ops as the C++ layers
PYTHON_PATH_CASES = {
    "Linear/python": (lambda: nn.Linear(16, 8), M.Linear.from_module, lambda: (_x(),), 1, [], ROWSCALE_BWD),
    # x_hat made by the kernels from x, mean and rstd, as the C++ layer's (mesa::compress with
    # row_mean / row_rstd; it made x_hat itself before, sub and mul, which under torch.compile
    # Inductor wrote in float32 for the opaque op to read)
    "LayerNorm/python": (lambda: nn.LayerNorm(16), M.LayerNorm.from_module, lambda: (_x(),), 1, [], ROWSCALE_BWD),
    "MatMul/python": (_MatMul, lambda s: M.MatMul(), lambda: (torch.randn(2, 2, 9, 9), torch.randn(2, 2, 9, 8)), 2,
                      [], []),
    "Conv2d/python": (lambda: nn.Conv2d(4, 4, 3), M.Conv2d.from_module, lambda: (torch.randn(2, 4, 8, 8),), 1, [], []),
    "Conv2d/channels_last/python": _channels_last_conv_case(),
    "Softmax/python": (lambda: nn.Softmax(-1), M.Softmax.from_module, lambda: (torch.randn(2, 2, 9, 9),), 1, [], []),
    "GELU/python": (nn.GELU, M.GELU.from_module, lambda: (_x(),), 1, [], []),
    "GELU/channels_last/python": (nn.GELU, M.GELU.from_module,
                                  lambda: (torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last),), 1, [], []),
    # the tanh form keeps dequantize + stock's gelu_backward
    "GELU/tanh": (lambda: nn.GELU("tanh"), M.GELU.from_module, lambda: (_x(),), 1, [], []),
    "MatMul/qk-of-qkv/python": _heads_case("qk"),
    "MatMul/av-of-qkv/python": _heads_case("av"),
    "SDPA/python": (_SDPA, lambda s: M.ScaledDotProductAttention(num_groups=2), _qkv, 3, [], SDPA_RECOMPUTE),
}


# Layers whose whole backward is one Mesa op reading the codes (instead of dequantize), which
# also takes the place of one stock backward op: a Softmax over the last dim
# (mesa::softmax_backward: dequantize, renormalise and _softmax_backward_data in one pass),
# the exact GELU (mesa::gelu_backward: dequantize and gelu_backward) and the LayerNorm
# (mesa::layer_norm_backward: dequantize and native_layer_norm_backward, its three gradients).
FUSED_BACKWARD = {"LayerNorm": ("mesa.layer_norm_backward", "aten.native_layer_norm_backward"),
                  "LayerNorm/python": ("mesa.layer_norm_backward", "aten.native_layer_norm_backward"),
                  "LayerNorm/row_scale=False": ("mesa.layer_norm_backward", "aten.native_layer_norm_backward"),
                  "Softmax": ("mesa.softmax_backward", "aten._softmax_backward_data"),
                  "Softmax/python": ("mesa.softmax_backward", "aten._softmax_backward_data"),
                  "GELU": ("mesa.gelu_backward", "aten.gelu_backward"),
                  "GELU/channels_last": ("mesa.gelu_backward", "aten.gelu_backward"),
                  "GELU/python": ("mesa.gelu_backward", "aten.gelu_backward"),
                  "GELU/channels_last/python": ("mesa.gelu_backward", "aten.gelu_backward")}


@pytest.mark.parametrize("name", list(CASES) + list(PYTHON_PATH_CASES))
def test_mesa_layer_adds_only_its_compression_ops(name, monkeypatch):
    if name in PYTHON_PATH_CASES:
        from mesa_train.nn import quantizer as quantizer_mod

        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    make_stock, convert, inputs, n_compressed, extra_fwd, extra_bwd = {**CASES, **PYTHON_PATH_CASES}[name]
    torch.manual_seed(0)
    stock = make_stock()
    mesa = convert(stock)
    compress = COMPRESS_ROWS if name in ROW_SCALED else COMPRESS
    assert len(compress) <= 2  # issue 9: at most two ops per compression in forward
    xs = inputs()
    stock_fwd, stock_bwd = _fwd_bwd_ops(stock, *xs)
    mesa_fwd, mesa_bwd = _fwd_bwd_ops(mesa, *xs)

    def mesa_ops(ops):
        return [o for o in ops if o.startswith("mesa.")]

    def aten_ops(ops):
        return sorted(o for o in ops if not o.startswith("mesa."))

    bwd_op, replaced = FUSED_BACKWARD.get(name, ("mesa.dequantize", None))
    if replaced is not None:
        assert replaced in stock_bwd, stock_bwd
        stock_bwd.remove(replaced)
    assert mesa_ops(mesa_fwd) == mesa_ops(extra_fwd) + compress * n_compressed, mesa_fwd
    assert mesa_ops(mesa_bwd) == mesa_ops(extra_bwd) + [bwd_op] * n_compressed, mesa_bwd
    assert aten_ops(mesa_fwd) == sorted(stock_fwd + aten_ops(extra_fwd)), (
        f"forward passes beyond the stock layer's: {mesa_fwd} vs stock {stock_fwd}")
    assert aten_ops(mesa_bwd) == sorted(stock_bwd + aten_ops(extra_bwd)), (
        f"backward passes beyond the stock layer's: {mesa_bwd} vs stock {stock_bwd}")


# ----------------------------------------------------------------------------- torch.compile
def _compiled_forward_ops(module, *inputs) -> list[str]:
    """The ATen / mesa ops of the forward graph torch.compile hands its compiler (after
    AOTAutograd), by target name. (Backward layouts are left to the compiler: MatMul's
    backward copies its incoming gradient itself only in eager.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ops: list[str] = []

    def record(gm, _):
        if ops:
            return make_boxed_func(gm.forward)  # the backward graph
        for n in gm.graph.nodes:
            if n.op == "call_function":  # (an op that mutates its inputs: wrapped, the op first)
                wrapped = str(n.target).startswith("auto_functionalized")
                ops.append(str(n.args[0] if wrapped else n.target))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    xs = [x.clone().requires_grad_() for x in inputs]
    compiled(*xs).sum().backward()
    return ops


@pytest.mark.parametrize("which", ["qk", "av"])
def test_compiled_heads_product_copies_each_operand_once(which):
    """Under torch.compile the Python Function runs: the copy its product makes of a qkv view
    is the one the compression reads (one clone per operand in the forward graph, as in the
    compiled stock one; before, the compression cloned it again and Inductor wrote both)."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 2, 9, 9), torch.randn(2, 9, 48))
    copies = {}
    for label, matmul in (("stock", _MatMul()), ("mesa", M.MatMul())):
        ops = _compiled_forward_ops(_HeadsProduct(matmul, which), *inputs)
        copies[label] = sum(o.startswith("aten.clone") for o in ops)
        if label == "mesa":
            assert any(o.startswith("mesa.compress") for o in ops), ops
    assert copies["mesa"] == copies["stock"], copies


# ----------------------------------------------------------------------------- mesa::compress
@pytest.mark.parametrize("estimator", [0, 1, 2])
@pytest.mark.parametrize("max_k", [0, 64])
@pytest.mark.parametrize("norm", [False, True], ids=["x", "layernorm-x_hat"])
def test_compress_runs_the_ops_the_recorder_counts(estimator, max_k, norm):
    """mesa::compress (one op per compression) calls exactly the ops OpRecorder counts for
    it (op_recorder.compress_ops), read from the profiler's record of its nested calls;
    and its codes equal those ops called one by one. ``norm``: a LayerNorm's row mean and
    rstd given, x_hat computed by the kernels (or the delayed estimator's normalised copy)."""
    from mesa_train.quant import reference as R

    torch.manual_seed(estimator)
    x = torch.randn(4, 6, 16)[:, ::2]  # strided: the op makes it contiguous itself
    _, mean, rstd = torch.native_layer_norm(x, [16], None, None, 1e-5)
    args = (4, 0.9, estimator, False, True, 1, max_k) + ((mean, rstd) if norm else ())
    state = [torch.zeros(4), torch.zeros(4), torch.zeros(1, dtype=torch.bool), torch.tensor([7, 0])]
    torch.ops.mesa.compress(x, *state, 2, *args)  # the delayed estimator's first batch is observe + quantize
    ref_state = [t.clone() for t in state]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = torch.ops.mesa.compress(x, *state, 2, *args)
    passes = ("mesa::", "aten::sub", "aten::mul_")  # (the normalised copy: aten::sub, aten::mul_)
    called = [e.name.replace("::", ".") for e in prof.events()
              if e.cpu_parent is not None and e.cpu_parent.name == "mesa::compress" and e.name.startswith(passes)]
    assert called == compress_ops((x, *state, 2, *args)), called
    want = R.compress(x, *ref_state, 2, *args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for s, r in zip(state, ref_state):
        assert torch.equal(s, r)


@pytest.mark.parametrize("python_path", [False, True], ids=["cpp-node", "python"])
@pytest.mark.parametrize("n,m", [(0, 8), (5, 0), (5, 8)])
def test_heads_product_with_empty_or_strided_operands_equals_stock(n, m, python_path, monkeypatch):
    """The operand copy made before the product (batched_operands) takes every shape the
    stock batched matmul takes, empty rows or columns included (its reshape once asked for
    an ambiguous -1 there)."""
    if python_path:
        from mesa_train.nn import quantizer as quantizer_mod

        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    torch.manual_seed(0)
    a = torch.randn(2, n, 2, m).transpose(1, 2).requires_grad_()  # (2, 2, n, m), heads and batch not one stride
    b = torch.randn(2, 2, m, 9, requires_grad=True)
    out = M.MatMul()(a, b)
    assert torch.equal(out, a.detach() @ b.detach())
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


# ----------------------------------------------------------------------------- LayerNorm + Linear
class _NormLinear(nn.Module):
    """``fc(norm(x))``: stock, or the Mesa pair keeping one copy (nn/layernorm_linear.py)."""

    def __init__(self, mesa: bool):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 8)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()
        self.mesa = mesa
        if mesa:
            self.norm, self.fc = M.LayerNorm.from_module(self.norm), M.Linear.from_module(self.fc)

    def forward(self, x):
        if self.mesa:
            from mesa_train.nn.layernorm_linear import layernorm_linear

            return layernorm_linear(x, self.norm, self.fc)
        return self.fc(self.norm(x))


def _activation_ops(module, x):
    """(op, its first tensor's shape) of one forward and one backward after a warm-up step,
    keeping the ops whose first tensor has the activation's shape (passes over it; a
    parameter's cast is not one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rec(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).replace("::", ".")
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if name not in NOT_A_PASS and first is not None and first.shape == x.shape:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    module(x.clone().requires_grad_()).sum().backward()  # estimates, lazy state
    xs = x.clone().requires_grad_()
    with Rec() as rec:
        y = module(xs)
        n_fwd = len(rec.ops)
        y.backward(torch.ones_like(y))
    return rec.ops[:n_fwd], rec.ops[n_fwd:]


@pytest.mark.parametrize("python_path", [False, True], ids=["cpp-node", "python"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_norm_linear_pair_backward_reads_the_codes_twice_and_stocks_ops(python_path, autocast, monkeypatch):
    """The pair's one copy serves both backward passes, each reading it once: the Linear's input
    ``x_hat * gamma + beta`` (dequantize's column epilogue, rounded once to the Linear's dtype)
    and the norm's gradients (layer_norm_backward, in place of stock's native_layer_norm_backward).
    No multiply, add or cast of the activation beyond the stock pair's (they were four more
    passes, 27 bytes an element in bf16), and under autocast one cast fewer: stock's cast of
    the Linear's input gradient to the norm's float32."""
    if python_path:
        from mesa_train.nn import quantizer as quantizer_mod

        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    x = torch.randn(4, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stock_fwd, stock_bwd = _activation_ops(_NormLinear(mesa=False), x)
        mesa_fwd, mesa_bwd = _activation_ops(_NormLinear(mesa=True), x)
    extra_fwd = list(mesa_fwd)
    for op in stock_fwd:
        extra_fwd.remove(op)
    # (the Python Function too: x_hat made by the compression's kernels, as the LayerNorm/python case)
    assert [o for o in extra_fwd if not o.startswith("mesa.")] == [], mesa_fwd
    # the Linear's input rebuilt by one dequantize; the norm's three gradients by one
    # layer_norm_backward from the same codes, in place of stock's native_layer_norm_backward
    assert [o for o in mesa_bwd if o.startswith("mesa.")] == ["mesa.dequantize", "mesa.layer_norm_backward"], mesa_bwd
    stock_bwd.remove("aten.native_layer_norm_backward")
    if autocast:  # stock casts the Linear's input gradient to the norm's dtype; the op reads it as it is
        stock_bwd.remove("aten._to_copy")
    assert sorted(o for o in mesa_bwd if not o.startswith("mesa.")) == sorted(stock_bwd), (
        f"backward passes over the activation beyond the stock pair's: {mesa_bwd} vs stock {stock_bwd}")


# ----------------------------------------------------------------------------- GELU + Linear
class _GeluLinear(nn.Module):
    """``fc2(gelu(h))``: stock, or the Mesa pair keeping one copy of h (nn/gelu_linear.py)."""

    def __init__(self, mesa: bool):
        super().__init__()
        torch.manual_seed(0)
        self.act, self.fc = nn.GELU(), nn.Linear(16, 8)
        self.mesa = mesa
        if mesa:
            self.act, self.fc = M.GELU.from_module(self.act), M.Linear.from_module(self.fc)

    def forward(self, h):
        if self.mesa:
            from mesa_train.nn.gelu_linear import gelu_linear

            return gelu_linear(h, self.act, self.fc)
        return self.fc(self.act(h))


@pytest.mark.parametrize("python_path", [False, True], ids=["cpp-node", "python"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gelu_linear_backward_reads_the_codes_once_and_writes_no_h(python_path, autocast, monkeypatch):
    """The MLP's one copy of h serves both backward passes from one op reading the codes once:
    fc2's input gelu(h) and the GELU's gradient (with the row exponents) together
    (gelu_value_and_grad), which replaces stock's gelu_backward. Nothing else over the
    activation beyond the stock pair's ops (the dequantized h, written once and read twice, is
    gone, and so is the second read of the codes)."""
    if python_path:
        from mesa_train.nn import quantizer as quantizer_mod

        monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", False)
    x = torch.randn(4, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, stock_bwd = _activation_ops(_GeluLinear(mesa=False), x)
        _, mesa_bwd = _activation_ops(_GeluLinear(mesa=True), x)
    assert [o for o in mesa_bwd if o.startswith("mesa.")] == ["mesa.gelu_value_and_grad"], mesa_bwd
    stock_bwd.remove("aten.gelu_backward")
    if autocast:  # (CPU autocast: h float32, fc2 in bf16: the cast stock made of gelu(h) in forward)
        stock_bwd.append("aten._to_copy")
    assert sorted(o for o in mesa_bwd if not o.startswith("mesa.")) == sorted(stock_bwd), (
        f"backward passes over the activation beyond the stock pair's: {mesa_bwd} vs stock {stock_bwd}")
