"""Mesa layers vs their stock twins: exact forward, close and unbiased gradients, 8-bit saves.

Bounds asserted (8 bits, per-group running estimates from the batch itself):
* forward: bitwise equal to the stock module (same dtype), fp32 and autocast.
* gradients: relative L2 error ``||g_mesa - g_stock|| / ||g_stock|| < GRAD_RTOL`` (0.03)
  for every input and parameter gradient (typical values: 0.005-0.012).
* unbiasedness (per-sample estimates so every value is inside its range): the mean of
  K=64 stochastic-rounding backward passes is at least UNBIASED_GAIN (3x) closer to the
  exact gradient than a single pass (sqrt(64) = 8x for an exactly unbiased estimator; measured
  6-9x for every layer: gradients linear in the saved tensor are exactly unbiased, the others
  (GELU, LayerNorm, Softmax) only carry a second-order bias far below this resolution).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from timm.layers import LayerNorm2d

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.testing import StockMatMul

warnings.filterwarnings("ignore", message=".*compiled extension.*")

GRAD_RTOL = 0.03
UNBIASED_GAIN = 3.0

HAS_CUDA = torch.cuda.is_available()
_cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# (device, autocast dtype or None, dtype of the generated inputs)
MODES = [
    pytest.param("cpu", None, torch.float32, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, torch.float32, id="cpu-autocast_bf16-fp32in"),
    pytest.param("cpu", torch.bfloat16, torch.bfloat16, id="cpu-autocast_bf16-bf16in"),
    pytest.param("cuda", None, torch.float32, id="cuda-fp32", marks=_cuda),
    pytest.param("cuda", torch.float16, torch.float32, id="cuda-autocast_fp16-fp32in", marks=_cuda),
    pytest.param("cuda", torch.float16, torch.float16, id="cuda-autocast_fp16-fp16in", marks=_cuda),
    pytest.param("cuda", torch.bfloat16, torch.bfloat16, id="cuda-autocast_bf16-bf16in", marks=_cuda),
]


def _shape(*s):
    return lambda dt, dev: [torch.randn(*s, device=dev).to(dt)]


# name -> (stock module factory, inputs factory)
CASES = {
    "linear": (lambda: nn.Linear(32, 48), _shape(2, 8, 32)),
    "linear_nobias_2d": (lambda: nn.Linear(32, 16, bias=False), _shape(12, 32)),
    "gelu": (lambda: nn.GELU(), _shape(2, 8, 32)),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), _shape(2, 8, 32)),
    "layernorm": (lambda: nn.LayerNorm(32), _shape(2, 8, 32)),
    "layernorm_noaffine": (lambda: nn.LayerNorm(32, elementwise_affine=False), _shape(2, 8, 32)),
    "layernorm_nobias": (lambda: nn.LayerNorm(32, bias=False, eps=1e-6), _shape(2, 8, 32)),
    # timm's LayerNorm2d (ConvNeXt): channels of NCHW, normalised through a permuted view
    "layernorm2d": (lambda: LayerNorm2d(16), _shape(2, 16, 5, 6)),
    "softmax_4d": (lambda: nn.Softmax(dim=-1), _shape(2, 4, 8, 8)),
    "softmax_3d": (lambda: nn.Softmax(dim=1), _shape(2, 8, 16)),
    "matmul_4d": (StockMatMul, lambda dt, dev: [torch.randn(2, 4, 8, 16, device=dev).to(dt),
                                                 torch.randn(2, 4, 16, 8, device=dev).to(dt).transpose(-1, -2)
                                                 .contiguous().transpose(-1, -2)]),
    "matmul_3d_bcast": (StockMatMul, lambda dt, dev: [torch.randn(2, 8, 16, device=dev).to(dt),
                                                       torch.randn(16, 12, device=dev).to(dt)]),
    "conv2d": (lambda: nn.Conv2d(8, 16, 3, padding=1), _shape(2, 8, 8, 8)),
    "conv2d_strided_groups": (lambda: nn.Conv2d(8, 8, 3, stride=2, groups=2, bias=False), _shape(2, 8, 9, 9)),
    "conv2d_same_reflect": (lambda: nn.Conv2d(4, 8, 3, padding="same", padding_mode="reflect"), _shape(2, 4, 7, 7)),
    # string padding resolved to ints for convolution_backward (ConvMixer's depthwise 'same')
    "conv2d_same_dilated_dw": (lambda: nn.Conv2d(4, 4, 5, padding="same", dilation=2, groups=4), _shape(2, 4, 9, 9)),
    "conv2d_valid": (lambda: nn.Conv2d(4, 8, 3, padding="valid"), _shape(2, 4, 7, 7)),
    "conv2d_same_even": (lambda: nn.Conv2d(4, 8, 4, padding="same"), _shape(2, 4, 7, 7)),  # autograd path
    "relu": (lambda: nn.ReLU(), _shape(2, 8, 32)),
}


def _mesa_from(stock, **opts):
    if isinstance(stock, StockMatMul):
        return mn.MatMul(**opts)
    return getattr(mn, type(stock).__name__).from_module(stock, **opts)


def _groups(name):
    return 1 if name.startswith("relu") else 4


def _pair(name, device, seed=0, **opts):
    torch.manual_seed(seed)
    make_stock, make_inputs = CASES[name]
    stock = make_stock().to(device)
    mesa = _mesa_from(copy.deepcopy(stock), num_groups=_groups(name), **opts)
    return stock, mesa, make_inputs


def _run(module, inputs, g, device, amp):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = module(*xs)
    y.backward(g)
    grads = [x.grad for x in xs] + [p.grad for p in module.parameters()]
    return y, grads


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grad_out(module, inputs, device, amp):
    with torch.no_grad(), torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = module(*inputs)
    return torch.randn_like(y)


@pytest.mark.parametrize("device,amp,in_dtype", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_exact_and_grads_close(name, device, amp, in_dtype):
    stock, mesa, make_inputs = _pair(name, device)
    stock.train(), mesa.train()
    inputs = make_inputs(in_dtype, device)
    g = _grad_out(stock, inputs, device, amp)
    y0, g0 = _run(stock, inputs, g, device, amp)
    y1, g1 = _run(mesa, inputs, g, device, amp)
    assert y1.dtype == y0.dtype
    assert torch.equal(y1, y0), f"{name}: forward differs from stock"
    assert len(g0) == len(g1)
    for a, b in zip(g1, g0):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        assert _rel(a, b) < GRAD_RTOL, f"{name}: relative gradient error {_rel(a, b):.4f}"


# Cases whose stock backward is known not to repeat on CUDA (reflect padding's backward adds
# with atomics): the probe below can see 20 equal runs by chance and then the compared run
# differ, as on an H200 on 2026-11-29 (conv2d_same_reflect, fp32)
NONDETERMINISTIC_CUDA_BACKWARD = {"conv2d_same_reflect"}


def _reproducible_backward(module, inputs, g, device, amp, runs: int = 20) -> bool:
    """Whether ``runs`` stock backward passes give the same gradients bit for bit. On CUDA some
    do not (reflect padding's backward accumulates with atomics: 4 distinct input gradients
    in 20 runs on an H100, and deterministic-algorithms mode does not flag it)."""
    if device != "cuda":
        return True
    first = None
    for _ in range(runs):
        _, grads = _run(copy.deepcopy(module), inputs, g, device, amp)
        if first is None:
            first = grads
        elif not all(torch.equal(a, b) for a, b in zip(grads, first)):
            return False
    return True


@pytest.mark.parametrize("device,amp,in_dtype", MODES[:2] + MODES[3:5])
@pytest.mark.parametrize("name", sorted(CASES))
def test_disabled_and_eval_are_stock(name, device, amp, in_dtype):
    for how in ("disabled", "eval"):
        stock, mesa, make_inputs = _pair(name, device, enabled=(how != "disabled"))
        if how == "eval":
            stock.eval(), mesa.eval()
        inputs = make_inputs(in_dtype, device)
        g = _grad_out(stock, inputs, device, amp)
        with SavedTensorMeter() as stock_meter:
            y0, g0 = _run(stock, inputs, g, device, amp)
        with SavedTensorMeter() as meter:
            xs = [x.detach().clone().requires_grad_() for x in inputs]
            with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
                y1 = mesa(*xs)
        y1.backward(g)
        # what backward keeps is stock's too: no 8-bit copies, nothing else beside
        assert (meter.activation_bytes, meter.num_storages) == (stock_meter.activation_bytes,
                                                                stock_meter.num_storages), (name, how)
        g1 = [x.grad for x in xs] + [p.grad for p in mesa.parameters()]
        assert torch.equal(y0, y1)
        # Bitwise where stock's own backward is reproducible; where it is not (atomics), the
        # same ops agree only to fp32 rounding.
        exact = not (device == "cuda" and name in NONDETERMINISTIC_CUDA_BACKWARD) and \
            _reproducible_backward(stock, inputs, g, device, amp)
        for a, b in zip(g1, g0):
            if exact:
                assert torch.equal(a, b), f"{name} ({how}): gradients are not bitwise stock"
            else:
                torch.testing.assert_close(a, b, msg=f"{name} ({how}): gradients differ from stock")
        for q in getattr(mesa, "quantizers", lambda: [])():
            assert not bool(q.initialized), "estimates must not change when compression is off"


@pytest.mark.parametrize("device,amp,in_dtype", [MODES[0], MODES[1], MODES[3], MODES[4]])
@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_tensors_are_uint8(name, device, amp, in_dtype):
    stock, mesa, make_inputs = _pair(name, device)
    inputs = make_inputs(in_dtype, device)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    xs = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            y = mesa(*xs)
    params = {p.data_ptr() for p in mesa.parameters()}
    big = [t for t in saved if t.data_ptr() not in params and t.numel() >= min(x.numel() for x in xs) // 8]
    assert big, "nothing saved?"
    for t in big:
        assert t.dtype == torch.uint8, f"{name}: saved a {t.dtype} tensor of shape {tuple(t.shape)}"
    with SavedTensorMeter(mesa) as m_mesa:
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            mesa(*[x.detach().requires_grad_() for x in inputs])
    with SavedTensorMeter(stock) as m_stock:
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            stock(*[x.detach().requires_grad_() for x in inputs])
    assert m_mesa.activation_bytes < m_stock.activation_bytes
    if name == "relu":  # 1 bit per element
        assert m_mesa.activation_bytes == math.ceil(inputs[0].numel() / 8)
    y.sum().backward()


def test_relu_bit_packing_and_inplace():
    from mesa_train.nn.relu import pack_bits, unpack_bits

    for n in (1, 7, 8, 9, 100):
        m = torch.rand(n) > 0.5
        p, channels_last = pack_bits(m)
        assert p.dtype == torch.uint8 and p.numel() == math.ceil(n / 8) and not channels_last
        assert torch.equal(unpack_bits(p, m.shape), m)
    # a channels-last mask: packed in its memory order (its NHWC view), unpacked channels-last
    for shape in ((2, 3, 4, 5), (1, 7, 1, 3)):
        m = (torch.rand(shape) > 0.5).contiguous(memory_format=torch.channels_last)
        p, channels_last = pack_bits(m)
        assert channels_last and torch.equal(p, pack_bits(m.permute(0, 2, 3, 1).contiguous())[0])
        back = unpack_bits(p, m.shape, channels_last=True)
        assert torch.equal(back, m) and back.stride() == m.stride()
    x = torch.randn(3, 5, requires_grad=True)
    h0, h1 = x * 1.0, x * 1.0
    y0 = nn.ReLU(inplace=True)(h0)
    y1 = mn.ReLU(inplace=True)(h1)
    assert torch.equal(y0, y1) and y1 is h1
    g = torch.randn(3, 5)
    assert torch.equal(torch.autograd.grad(y0, x, g)[0], torch.autograd.grad(y1, x, g)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inplace,channels_last", [(False, False), (True, False), (True, True)],
                         ids=["out_of_place", "inplace", "inplace_channels_last"])
def test_leaky_relu_is_stock_in_value_and_gradient_with_a_one_bit_mask(inplace, channels_last, dtype):
    """TResNet's LeakyReLU: stock's output and input gradient bit for bit (zeros, NaN and +-inf
    included), one bit kept per element; in place it writes into its input, as stock does."""
    from mesa_train.memory import SavedTensorMeter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=g).to(dtype)
    x.view(-1)[:4] = torch.tensor([0.0, float("nan"), float("inf"), -float("inf")])
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    head = torch.randn(x.shape, generator=g).to(dtype)

    def run(layer):
        xi = x.clone().requires_grad_()
        h = xi * 1.0  # (a non-leaf: in place needs one)
        with SavedTensorMeter() as meter:
            y = layer(h)
        assert (y is h) == inplace
        (gx,) = torch.autograd.grad(y, xi, head)
        return y.detach(), gx, meter.activation_bytes

    y_ref, g_ref, _ = run(nn.LeakyReLU(0.2, inplace=inplace))
    y, gx, saved = run(mn.LeakyReLU.from_module(nn.LeakyReLU(0.2, inplace=inplace)))
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # (NaN's bits too)
    assert torch.equal(y.view(bits), y_ref.view(bits)) and torch.equal(gx.view(bits), g_ref.view(bits))
    assert saved == math.ceil(x.numel() / 8)


def test_patch_model_converts_leaky_relu_and_it_compiles():
    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(0.1, inplace=True), nn.Conv2d(8, 4, 1))
    mesa = patch_model(copy.deepcopy(stock).train())
    assert type(mesa[2]) is mn.LeakyReLU and mesa[2].negative_slope == 0.1 and mesa[2].inplace
    x = torch.randn(2, 3, 9, 9)
    compiled = torch.compile(mesa, backend="aot_eager", fullgraph=True)
    assert torch.equal(stock.train()(x), mesa(x)) and torch.equal(compiled(x), mesa(x))
    compiled(x).sum().backward()


@pytest.mark.parametrize("name", sorted(CASES))
def test_unbiased(name):
    """Mean of K stochastic-rounding backward passes converges to the exact gradient."""
    stock, mesa, make_inputs = _pair(name, "cpu", estimator="per_sample")
    inputs = make_inputs(torch.float32, "cpu")
    g = _grad_out(stock, inputs, "cpu", None)
    _, exact = _run(stock, inputs, g, "cpu", None)
    K = 64
    total = None
    err1 = None
    for k in range(K):
        mesa.zero_grad()
        _, gk = _run(mesa, inputs, g, "cpu", None)
        gk = [t.double() for t in gk]
        total = gk if total is None else [a + b for a, b in zip(total, gk)]
        if k == 0:
            err1 = [_rel(a, b) for a, b in zip(gk, exact)]
    errK = [_rel(a / K, b) for a, b in zip(total, exact)]
    for e1, eK in zip(err1, errK):
        if e1 < 1e-6:  # exact gradient (e.g. Linear's input grad, ReLU)
            assert eK < 1e-6
            continue
        assert eK * UNBIASED_GAIN < e1, f"{name}: K=1 error {e1:.4g}, K={K} error {eK:.4g}"


def test_layer_constructors_and_from_module():
    lin = nn.Linear(8, 4, dtype=torch.float64)
    m = mn.Linear.from_module(lin, num_groups=2, decay=0.5)
    assert m.weight is lin.weight and m.bias is lin.bias and m.weight.dtype == torch.float64
    assert m.quant_options.num_groups == 2 and m.quant_options.decay == 0.5
    assert "num_groups=2" in repr(m) and "decay=0.5" in repr(m)
    ln = nn.LayerNorm(8, eps=1e-3, elementwise_affine=False)
    m = mn.LayerNorm.from_module(ln)
    assert m.eps == 1e-3 and m.weight is None and m.bias is None
    c = nn.Conv2d(3, 6, 5, stride=2, padding=1, dilation=1, groups=3, bias=False, padding_mode="circular")
    m = mn.Conv2d.from_module(c, num_groups=3)
    assert (m.stride, m.padding, m.groups, m.padding_mode) == ((2, 2), (1, 1), 3, "circular")
    assert m.weight is c.weight
    assert mn.GELU.from_module(nn.GELU("tanh")).approximate == "tanh"
    assert mn.Softmax.from_module(nn.Softmax(1)).dim == 1
    assert mn.ReLU.from_module(nn.ReLU(True)).inplace
    # constructors take the twin's arguments plus keyword options
    assert mn.Linear(4, 3, False, num_groups=2).bias is None
    with pytest.raises(ValueError, match="valid options"):
        mn.Linear(4, 3, groups=2)
    with pytest.raises(ValueError, match="estimator"):
        mn.GELU(estimator="max")
    # from_module on a Mesa layer keeps its options and estimates
    m = mn.Linear(8, 4, num_groups=2)
    m(torch.randn(3, 8, requires_grad=True)).sum().backward()
    m2 = mn.Linear.from_module(m, decay=0.5)
    assert m2.quant_options.num_groups == 2 and torch.equal(m2.quantizer.alpha, m.quantizer.alpha)
    # train/eval state carried over
    assert not mn.GELU.from_module(nn.GELU().eval()).training


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_cuda)])
def test_from_module_keeps_device_and_buffers(device):
    lin = nn.Linear(8, 4, device=device)
    m = mn.Linear.from_module(lin, num_groups=2)
    assert m.quantizer.alpha.device.type == device and m.weight.device.type == device
    # parameter-free layers follow their input's device
    act = mn.GELU(num_groups=2)
    act(torch.randn(2, 8, device=device, requires_grad=True)).sum().backward()
    assert act.quantizer.alpha.device.type == device


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def test_layernorm_saves_normalised_values_low_variance_row():
    """LayerNorm keeps uint8 ``x_hat = (x - mean) * rstd`` plus per-row rstd (DESIGN.md).

    Regression for a row with ~20x less spread than the others that also carries most of the
    gradient (DeiT's class token at init): rebuilding ``x_hat`` from an 8-bit *input* (the
    previous scheme, emulated below with the same quantizer) multiplies that row's rounding
    error by its rstd, and the weight gradient drops to cosine ~0.98; with 8-bit ``x_hat``
    it stays >= 0.999 (measured 0.99996)."""
    from mesa_train.nn.quantizer import ActivationQuantizer, decompress

    gen = torch.Generator().manual_seed(3)
    B, N, C = 4, 17, 48
    x = torch.randn(B, N, C, generator=gen) * 0.6 + torch.randn(C, generator=gen) * 0.3
    x[:, 0] = torch.randn(C, generator=gen) * 0.03  # the low-variance row
    g = torch.randn(B, N, C, generator=gen) * 0.05
    g[:, 0] = torch.randn(B, C, generator=gen)  # ... that gets most of the gradient
    stock = nn.LayerNorm(C)
    with torch.no_grad():
        stock.weight.copy_(1 + 0.1 * torch.randn(C, generator=gen))
        stock.bias.copy_(0.1 * torch.randn(C, generator=gen))
    mesa = mn.LayerNorm.from_module(copy.deepcopy(stock), num_groups=4)
    out = {}
    for key, m in (("stock", stock), ("mesa", mesa)):
        xi = x.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = m(xi)
        y.backward(g)
        out[key] = (y, xi.grad, m.weight.grad, m.bias.grad, saved)
    y0, gx0, gw0, gb0, _ = out["stock"]
    y1, gx1, gw1, gb1, saved = out["mesa"]
    assert torch.equal(y0, y1)
    assert _cos(gw1, gw0) >= 0.999 and _cos(gx1, gx0) >= 0.999 and _cos(gb1, gb0) > 0.999999
    # saved: uint8 x_hat (+ its (1, G) stats), rstd (one float per row), the int8 row
    # exponents (one byte per row, nn/rowscale.py), the weight
    acts = [t for t in saved if t is not mesa.weight]
    assert sorted(tuple(t.shape) for t in acts if t.numel() >= B * N) == [(B, N, 1), (B, N, 1), (B, N, C)]
    assert sorted(str(t.dtype) for t in acts if t.shape == (B, N, 1)) == ["torch.float32", "torch.int8"]
    assert [t.dtype for t in acts if t.numel() == B * N * C] == [torch.uint8]
    q = next(t for t in acts if t.dtype == torch.uint8)
    x_hat = torch.nn.functional.layer_norm(x, (C,))
    p_alpha, p_beta = (t for t in acts if t.shape == (1, 4))
    step = (p_alpha / 255).repeat_interleave(C // 4, dim=1).view(C)
    xr = q.float() * step + p_beta.repeat_interleave(C // 4, dim=1).view(C)
    assert ((xr - x_hat).abs() <= step * 1.001 + 1e-6).all()  # the codes are x_hat's, within one step
    # the previous scheme (8-bit input, exact mean/rstd) on the same data
    torch.manual_seed(0)
    xq = decompress(ActivationQuantizer(num_groups=4).compress(x, 2), torch.float32)
    w, b = stock.weight.detach(), stock.bias.detach()
    _, mean, rstd = torch.native_layer_norm(x, [C], w, b, stock.eps)
    _, gw_old, _ = torch.ops.aten.native_layer_norm_backward(g, xq, [C], mean, rstd, w, b, [True, True, True])
    assert _cos(gw_old, gw0) < 0.99, "the regression data no longer exercises the low-variance row"


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=_cuda)])
def test_from_module_device_keyword(device):
    """Parameter-free stock layers cannot tell their device: ``from_module(device=...)``."""
    for stock, cls in ((nn.GELU(), mn.GELU), (nn.Softmax(-1), mn.Softmax),
                       (nn.LayerNorm(8, elementwise_affine=False), mn.LayerNorm)):
        m = cls.from_module(stock, device=device, num_groups=2)
        assert all(b.device.type == device for b in m.buffers()), cls.__name__
        assert cls.from_module(stock).quantizer.alpha.device.type == "cpu"  # default, as before
    assert mn.ReLU.from_module(nn.ReLU(), device=device).quantizers() == []
    m = mn.MatMul.from_module(None, device=device)
    assert m.quantizer_a.alpha.device.type == device and m.quantizer_b.beta.device.type == device
    # a Mesa layer given as stock keeps its estimates' device (they live in a child module)
    g = mn.GELU.from_module(nn.GELU(), device=device)
    assert mn.GELU.from_module(g).quantizer.alpha.device.type == device
    # with parameters, the estimates go where the weight is
    ln = nn.LayerNorm(8, device=device)
    assert mn.LayerNorm.from_module(ln).quantizer.alpha.device.type == device


# ----------------------------------------------------------------------------- MatMul operands
def _mm_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 8, 16, generator=g), torch.randn(2, 3, 16, 8, generator=g)


def _mm_run(module, a, b, gout):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(a, b)
    y.backward(gout)
    return y, a.grad, b.grad, saved


def test_matmul_operands_option():
    with pytest.raises(ValueError, match="operands"):
        mn.MatMul(operands=("a", "c"))
    assert mn.MatMul().operands == ("a", "b") and mn.MatMul(operands="b").operands == ("b",)
    assert [n for n, _ in mn.MatMul(operands=("b",)).named_buffers()] == \
        ["quantizer_b.alpha", "quantizer_b.beta", "quantizer_b.initialized", "quantizer_b.rng"]
    assert list(mn.MatMul(operands=()).buffers()) == [] and "operands=()" in repr(mn.MatMul(operands=()))
    a, b = _mm_inputs()
    gout = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    y0, ga0, gb0, _ = _mm_run(StockMatMul(), a, b, gout)
    for ops, kinds in ((("a", "b"), ("int8", "int8")), (("a",), ("int8", "full")), (("b",), ("full", "int8"))):
        m = mn.MatMul(operands=ops, num_groups=3)
        y, ga, gb, saved = _mm_run(m, a, b, gout)
        assert torch.equal(y, y0) and m.last_saved == kinds
        big = sorted(str(t.dtype) for t in saved if t.numel() >= a.numel())
        assert big == sorted("torch.uint8" if k == "int8" else "torch.float32" for k in kinds), (ops, big)
        # an operand kept in full precision gives the exact gradient of the other one
        if "a" not in ops:
            torch.testing.assert_close(gb, gb0)
        if "b" not in ops:
            torch.testing.assert_close(ga, ga0)
        assert _rel(ga, ga0) < GRAD_RTOL and _rel(gb, gb0) < GRAD_RTOL
    # nothing to compress and nothing shared: the stock op, stock gradients bit for bit
    m = mn.MatMul(operands=(), num_groups=3)
    y, ga, gb, saved = _mm_run(m, a, b, gout)
    assert torch.equal(y, y0) and torch.equal(ga, ga0) and torch.equal(gb, gb0) and m.last_saved == ("full", "full")
    # from_module keeps operands unless told, and matching estimates
    m = mn.MatMul(operands=("b",), num_groups=3)
    _mm_run(m, a, b, gout)
    m2 = mn.MatMul.from_module(m)
    assert m2.operands == ("b",) and torch.equal(m2.quantizer_b.alpha, m.quantizer_b.alpha)
    m3 = mn.MatMul.from_module(m, operands=("a", "b"))
    assert torch.equal(m3.quantizer_b.alpha, m.quantizer_b.alpha) and not bool(m3.quantizer_a.initialized)


def test_matmul_full_operand_saved_like_stock():
    """A full-precision operand is kept the way the stock ``a @ b`` keeps it: a compact
    copy of a view into a bigger tensor (v of a fused qkv), the autocast dtype copy."""
    qkv = torch.randn(2, 8, 3, 2, 4).permute(2, 0, 3, 1, 4).requires_grad_()  # (3, B, H, N, d)
    attn = torch.randn(2, 2, 8, 8).softmax(-1)

    def run(module, amp=False):
        with SavedTensorMeter() as meter:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                v = qkv.unbind(0)[2]
                y = module(attn.requires_grad_(), v)
        y.float().sum().backward()
        return meter.activation_bytes

    for amp in (False, True):
        stock = run(StockMatMul(), amp)
        assert run(mn.MatMul(operands=(), num_groups=2), amp) == stock  # plain stock op
        # b kept in full: the same bytes for it as stock, a as int8 (+ stats)
        n_attn = attn.numel()
        assert run(mn.MatMul(operands=("a",), num_groups=2), amp) == stock - n_attn * (2 if amp else 4) + n_attn + 16
