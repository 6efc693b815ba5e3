"""Mesa ``MaxPool2d`` (mesa_train/nn/maxpool.py): the stock forward bit for bit, the stock
input gradient bit for bit (overlapping windows and ties included), and one uint8 window-local
argmax saved per output element instead of the input plus int64 indices."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.nn.maxpool import MaxPool2d
from kernel_marks import CUDA
from op_calls import count_calls

CONFIGS = {
    "resnet_stem": dict(kernel_size=3, stride=2, padding=1),
    "hiera_qpool": dict(kernel_size=2, stride=2),
    "k3s1p1": dict(kernel_size=3, stride=1, padding=1),
    "rect_dilated": dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    "dilated": dict(kernel_size=3, stride=(2, 1), padding=1, dilation=(2, 3)),
    "ceil_mode": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "stride_none": dict(kernel_size=2, stride=None),
    "window_256": dict(kernel_size=16, stride=5, padding=3),  # local indices up to 255
}
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
LAYOUTS = ["contiguous", "channels_last", "3d", "one_channel_cl"]
# the two paths of a training forward: the Python Function, and eager's C++ op (mesa::max_pool2d_train)
PATHS = [pytest.param(False, id="python"),
         pytest.param(True, id="cpp", marks=pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS,
                                                                 reason="needs the compiled extension"))]


@pytest.fixture(params=PATHS)
def fused(request, monkeypatch):
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", request.param)
    return request.param


def _input(layout: str, ties: bool, dtype, seed=0) -> torch.Tensor:
    """Odd sizes (11 x 17): ceil_mode's last window hangs over the edge."""
    g = torch.Generator().manual_seed(seed)
    shape = {"3d": (3, 11, 17), "one_channel_cl": (2, 1, 11, 17)}.get(layout, (2, 3, 11, 17))
    # ties: values in {0, 1, 2}, so most windows hold several equal maxima
    if ties:
        x = torch.randint(0, 3, shape, generator=g).to(dtype)
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x.to(memory_format=torch.channels_last) if layout in ("channels_last", "one_channel_cl") else x


def _saved(module, x) -> list:
    """Every tensor a forward saves for backward, as (dtype, shape) (its own pass: only the
    innermost saved-tensor hooks see a tensor, so not nested in the meter's)."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.clone().requires_grad_())
    return saved


def _run(module, x, g):
    xi = x.clone().requires_grad_()
    with SavedTensorMeter() as meter:
        y = module(xi)
    y.backward(g)
    return y.detach(), xi.grad, meter.activation_bytes, _saved(module, x)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} vs stock {b.stride()}"
    assert torch.equal(a, b), what


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_bitwise_stock_and_one_byte_per_output(config, dtype, layout, ties, fused):
    stock = nn.MaxPool2d(**CONFIGS[config])
    mesa = MaxPool2d.from_module(stock)
    x = _input(layout, ties, dtype)
    out_shape = stock(x).shape
    for g in (torch.randn(out_shape, dtype=torch.float64).to(dtype),  # contiguous gradient
              torch.randn_like(stock(x))):  # a gradient in the output's own layout
        y_ref, gx_ref, bytes_ref, saved_ref = _run(stock, x, g)
        y, gx, nbytes, saved = _run(mesa, x, g)
        _assert_same(y, y_ref, "forward")
        _assert_same(gx, gx_ref, "input gradient")
        # exactly one tensor saved: the uint8 local argmax, one byte per output element
        assert saved == [(torch.uint8, tuple(y.shape))], saved
        assert nbytes == y.numel()
        # stock keeps the input and the int64 indices
        assert bytes_ref == x.numel() * x.element_size() + y.numel() * 8, saved_ref
        assert nbytes * (8 + x.element_size()) <= bytes_ref


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", ["resnet_stem", "dilated", "ceil_mode", "window_256"])
def test_cuda_bitwise_stock(config, dtype, layout, ties, device, fused):
    """ATen's CUDA kernels (and the index arithmetic on the GPU), both paths."""
    stock = nn.MaxPool2d(**CONFIGS[config])
    mesa = MaxPool2d.from_module(stock)
    x = _input(layout, ties, dtype).to(device)
    g = torch.randn_like(stock(x))
    (y_ref, gx_ref, _, _), (y, gx, nbytes, saved) = _run(stock, x, g), _run(mesa, x, g)
    _assert_same(y, y_ref, "forward")
    _assert_same(gx, gx_ref, "input gradient")
    assert saved == [(torch.uint8, tuple(y.shape))] and nbytes == y.numel()


def test_overlapping_windows_accumulate_at_the_argmax(fused):
    """Independent of the stock kernel: every output's gradient lands on its window's
    maximum (distinct values, so the argmax is unique), summed where windows overlap; a
    wrong local index (rows and columns swapped, a wrong dilation step) puts it elsewhere."""
    torch.manual_seed(0)
    k, s, p, d = (3, 2), (2, 1), (1, 1), (2, 3)
    x = torch.randperm(2 * 3 * 9 * 13).double().view(2, 3, 9, 13).requires_grad_()  # all distinct
    mesa = MaxPool2d(k, s, p, d)
    y = mesa(x)
    g = torch.rand_like(y) + 1
    y.backward(g)
    want = torch.zeros_like(x)
    xp = torch.nn.functional.pad(x.detach(), (p[1], p[1], p[0], p[0]), value=float("-inf"))
    n_oh, n_ow = y.shape[-2:]
    for oh in range(n_oh):
        for ow in range(n_ow):
            rows = [oh * s[0] + i * d[0] for i in range(k[0])]
            cols = [ow * s[1] + j * d[1] for j in range(k[1])]
            win = xp[:, :, rows][:, :, :, cols].flatten(2)  # (N, C, kH*kW)
            best = win.argmax(-1)
            r = torch.tensor(rows)[best // k[1]] - p[0]
            c = torch.tensor(cols)[best % k[1]] - p[1]
            for n in range(x.shape[0]):
                for ch in range(x.shape[1]):
                    want[n, ch, r[n, ch], c[n, ch]] += g[n, ch, oh, ow]
                    assert y[n, ch, oh, ow] == x[n, ch, r[n, ch], c[n, ch]]
    assert torch.equal(x.grad, want)
    assert (want > 0).sum() < x.numel()  # some elements got no gradient, some several


def test_ties_pick_stock_element(fused):
    """All-equal windows: the gradient goes to the element stock's kernel picks."""
    x = torch.ones(1, 2, 6, 6, requires_grad=True)
    stock_x = x.detach().clone().requires_grad_()
    MaxPool2d(3, 2, 1)(x).sum().backward()
    nn.MaxPool2d(3, 2, 1)(stock_x).sum().backward()
    assert torch.equal(x.grad, stock_x.grad)


def _stock_node(y) -> bool:
    return type(y.grad_fn).__name__.startswith("MaxPool2DWithIndicesBackward")


@pytest.mark.parametrize("case", ["eval", "no_grad", "disabled", "input_no_grad"])
def test_inactive_runs_stock(case):
    x = torch.randn(2, 3, 8, 8, requires_grad=case != "input_no_grad")
    stock = nn.MaxPool2d(3, 2, 1)
    mesa = MaxPool2d.from_module(stock, enabled=case != "disabled")
    if case == "eval":
        stock.eval(), mesa.eval()
    with torch.set_grad_enabled(case != "no_grad"):
        y, y_ref = mesa(x), stock(x)
    assert torch.equal(y, y_ref)
    if case in ("eval", "disabled"):
        assert _stock_node(y)  # the stock autograd node, keeping stock's tensors


def test_return_indices_falls_back_to_stock():
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    stock = nn.MaxPool2d(3, 2, 1, return_indices=True)
    mesa = MaxPool2d.from_module(stock)
    (y, idx), (y_ref, idx_ref) = mesa(x), stock(x)
    assert torch.equal(y, y_ref) and torch.equal(idx, idx_ref) and idx.dtype == torch.int64
    assert _stock_node(y)
    unpool = nn.MaxUnpool2d(3, 2, 1)(y, idx, output_size=x.shape)  # what the indices are for
    assert unpool.shape == x.shape


def test_window_over_256_falls_back_to_stock():
    x = torch.randn(1, 2, 20, 20, requires_grad=True)
    mesa, stock = MaxPool2d(17, 3), nn.MaxPool2d(17, 3)
    y = mesa(x)
    assert _stock_node(y) and torch.equal(y, stock(x))
    assert not _stock_node(MaxPool2d(16, 3)(x))  # 256 elements: the uint8 path


def test_from_module_and_repr():
    stock = nn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), return_indices=False,
                         ceil_mode=True)
    stock.eval()
    mesa = MaxPool2d.from_module(stock, enabled=False)
    for name in ("kernel_size", "stride", "padding", "dilation", "return_indices", "ceil_mode"):
        assert getattr(mesa, name) == getattr(stock, name), name
    assert not mesa.training and mesa.quant_options.enabled is False
    assert list(mesa.state_dict()) == [] and list(mesa.buffers()) == []
    text = repr(mesa)
    assert text.startswith("MaxPool2d(kernel_size=(3, 2), stride=(2, 1)") and "ceil_mode=True" in text
    assert "mesa(" in text
    again = MaxPool2d.from_module(mesa)  # a Mesa stock keeps its options
    assert again.quant_options.enabled is False and again.stride == (2, 1)
    with pytest.raises(TypeError, match=r"torch\.nn\.modules\.pooling\.MaxPool2d"):
        MaxPool2d.from_module(nn.AvgPool2d(2))


def test_gradcheck_float64(fused):
    torch.manual_seed(0)
    x = torch.randperm(2 * 2 * 7 * 8).double().div(10).view(2, 2, 7, 8).requires_grad_()  # no ties
    for kwargs in (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(3, 2), stride=(1, 2), dilation=(2, 1),
                                                                      ceil_mode=True)):
        assert torch.autograd.gradcheck(MaxPool2d(**kwargs), (x,), eps=1e-3)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), MaxPool2d(3, 2, 1), nn.Flatten(), nn.Linear(4 * 5 * 5, 2))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_equals_eager(backend):
    """No graph break (fullgraph=True) through Dynamo and AOTAutograd, forward and backward.
    conv -> pool -> linear: aot_eager runs the traced ATen ops, so everything is bitwise
    eager's; Inductor's generated conv / linear code may round differently (close). The pool's
    input gradient is checked bitwise, with both backends, on the pool -> linear tail with a
    leaf input (a tensor hook on the conv output would itself break the graph)."""
    torch._dynamo.reset()
    eager, comp = _net(), _net()
    x = torch.randn(2, 3, 9, 9)
    y_ref = eager(x)
    y_ref.square().sum().backward()
    y = torch.compile(comp, backend=backend, fullgraph=True)(x)
    y.square().sum().backward()
    exact = backend == "aot_eager"
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert same(y, y_ref)
    for (name, p), q in zip(comp.named_parameters(), eager.parameters()):
        assert same(p.grad, q.grad), name

    tail = comp[1:]
    h = eager[0](x).detach().to(memory_format=torch.channels_last)
    ha, hb = h.clone().requires_grad_(), h.clone().requires_grad_()
    tail(ha).square().sum().backward()
    torch.compile(tail, backend=backend, fullgraph=True)(hb).square().sum().backward()
    assert torch.equal(ha.grad, hb.grad)


def test_compile_pool_only_bitwise():
    """The layer alone, compiled with Inductor: output and input gradient bitwise eager's on
    overlapping windows with ties, channels_last; the compiled graph still saves only the
    uint8 local argmax (Inductor lowers *stock* max pooling to int8 window offsets too, so
    the saving over stock is an eager / aot_eager one)."""
    torch._dynamo.reset()
    pool = MaxPool2d(3, 2, 1)
    compiled = torch.compile(pool, fullgraph=True)
    x = torch.randint(0, 4, (2, 3, 11, 9)).float().to(memory_format=torch.channels_last)
    g = torch.randn(2, 3, 6, 5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = pool(xa)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        yb = compiled(xb)
    ya.backward(g), yb.backward(g)
    assert saved == [(torch.uint8, tuple(ya.shape))], saved
    assert torch.equal(ya, yb) and ya.stride() == yb.stride()
    assert torch.equal(xa.grad, xb.grad) and xa.grad.stride() == xb.grad.stride()


def test_patch_model_converts_max_pools():
    """``ops=['maxpool']``: ``nn.MaxPool2d`` (ResNet's stem, Hiera's query pooling) and timm's
    ``MaxPool2dSame`` (TF 'SAME' padding by the input's size, -inf) become the lossless Mesa
    ones; the model's forward and input gradient stay bitwise stock's."""
    import copy

    from timm.layers.pool2d_same import MaxPool2dSame

    from mesa_train.nn.same_padding import MaxPool2dSame as MesaMaxPool2dSame
    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(3, 2, 1), MaxPool2dSame(2, 2),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32, 5))
    patched = patch_model(copy.deepcopy(stock), ops=["maxpool"])
    assert type(patched[1]) is MaxPool2d and type(patched[3]) is MaxPool2d and type(patched[2]) is MesaMaxPool2dSame
    x = torch.randn(2, 3, 15, 15)  # odd: 'SAME' pads one side more
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yp = stock(xs), patched(xp)
    assert torch.equal(ys, yp)
    ys.square().sum().backward(), yp.square().sum().backward()
    assert torch.equal(xs.grad, xp.grad)


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_cpp_op_runs_only_in_eager_training(monkeypatch):
    calls = count_calls(monkeypatch, "max_pool2d_train")
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    MaxPool2d(3, 2, 1)(x).sum().backward()
    assert calls == [1]
    MaxPool2d(3, 2, 1).eval()(x)
    MaxPool2d(3, 2, 1)(x.detach())
    MaxPool2d(3, 2, 1, return_indices=True)(x)
    MaxPool2d(17, 3)(torch.randn(1, 2, 20, 20, requires_grad=True))
    torch.compile(MaxPool2d(3, 2, 1), backend="aot_eager", fullgraph=True)(x).sum().backward()  # the Function
    assert calls == [1]


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_cpp_op_refuses_higher_order_gradients_and_bad_arguments():
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        torch.autograd.grad(MaxPool2d(3, 2, 1)(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(ValueError, match="kernel_size must have 2 values"):
        torch.ops.mesa.max_pool2d_train(x, [3], [2, 2], [1, 1], [1, 1], False)
    with pytest.raises(ValueError, match="at most 256 elements"):
        torch.ops.mesa.max_pool2d_train(x, [17, 17], [2, 2], [1, 1], [1, 1], False)
