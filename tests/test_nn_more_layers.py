"""Mesa layers added for timm models beyond DeiT/Swin/PVT (issue 10): BatchNorm2d, RmsNorm,
QuickGELU, SiLU, GatedActivation (SwiGLU / GLU), and the power-of-two row scales."""
import copy
import warnings

import pytest
import torch
from torch import nn

import mesa_train.nn as mn
from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.quantizer import assign_rng_keys


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _run(module, *inputs, grad):
    xs = [x.clone().requires_grad_() for x in inputs]
    with SavedTensorMeter(module) as meter:
        y = module(*xs)
    y.backward(grad)
    params = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return y.detach(), [x.grad for x in xs], params, meter.activation_bytes


def _compare(stock, mesa, *inputs, min_cos=0.999):
    # rounding keys from the quantizers' names, as patch_model gives them: a layer built by
    # from_module is keyed by how many quantizers the process built before, so its one
    # stochastic draw (and this cosine) depended on which tests ran first
    assign_rng_keys(mesa)
    torch.manual_seed(0)
    grad = torch.randn_like(copy.deepcopy(stock)(*inputs))  # a copy: BatchNorm stats move
    ref = _run(stock, *inputs, grad=grad)
    got = _run(mesa, *inputs, grad=grad)
    assert torch.equal(ref[0], got[0]), "forward differs from stock"
    for a, b in zip(ref[1] + ref[2], got[1] + got[2]):
        assert _cos(a, b) >= min_cos
    assert got[3] < ref[3], f"saved {got[3]} bytes, stock {ref[3]}"
    mesa.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(stock(*inputs), mesa(*inputs))


@pytest.mark.parametrize("affine,track,momentum", [(True, True, 0.1), (False, True, None), (True, False, 0.1)])
def test_batchnorm2d(affine, track, momentum):
    """Channels five decades apart (a depthwise conv in front): per-channel groups of the
    normalised input keep every channel's gradient."""
    torch.manual_seed(0)
    stock = nn.BatchNorm2d(6, affine=affine, track_running_stats=track, momentum=momentum)
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.BatchNorm2d.from_module(copy.deepcopy(stock))
    assert mesa.quantizer.options.num_groups == 6
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-3, 2, 6).view(1, 6, 1, 1) + 3
    _compare(stock, mesa, x)
    if track:
        assert torch.equal(stock.running_mean, mesa.running_mean) and torch.equal(stock.running_var, mesa.running_var)
        assert stock.num_batches_tracked == mesa.num_batches_tracked


@pytest.mark.parametrize("shape", [(64, 6), (8, 6, 9)])
@pytest.mark.parametrize("affine,track,momentum", [(True, True, 0.1), (False, True, None), (True, False, 0.1)])
def test_batchnorm1d(affine, track, momentum, shape):
    """``(N, C)`` (LeViT's ``Linear -> BatchNorm1d`` on all tokens) and ``(N, C, L)``: the same
    per-channel 8-bit normalised input as BatchNorm2d's, channels five decades apart."""
    torch.manual_seed(0)
    stock = nn.BatchNorm1d(6, affine=affine, track_running_stats=track, momentum=momentum)
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.BatchNorm1d.from_module(copy.deepcopy(stock))
    assert mesa.quantizer.options.num_groups == 6
    x = torch.randn(*shape) * torch.logspace(-3, 2, 6).view((1, 6) + (1,) * (len(shape) - 2)) + 3
    _compare(stock, mesa, x)
    if track:
        assert torch.equal(stock.running_mean, mesa.running_mean) and torch.equal(stock.running_var, mesa.running_var)
    with pytest.raises(TypeError, match="BatchNorm1d"):
        mn.BatchNorm1d.from_module(nn.BatchNorm2d(6))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        mesa.train()(torch.randn(2, 6, 3, 3, requires_grad=True))


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU, None])
def test_batchnorm_act2d(act):
    """timm's ``BatchNormAct2d``: the Mesa BatchNorm then its own drop / act children, the
    same bits forward and the same state_dict keys (plus the quantizer's)."""
    from timm.layers import BatchNormAct2d as TimmBatchNormAct2d

    torch.manual_seed(0)
    stock = TimmBatchNormAct2d(6, act_layer=act, apply_act=act is not None)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.BatchNormAct2d.from_module(copy.deepcopy(stock))
    assert type(mesa.act) is type(stock.act) and mesa.quantizer.options.num_groups == 6
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-3, 2, 6).view(1, 6, 1, 1) + 3
    _compare(stock, mesa, x)
    assert torch.equal(stock.running_mean, mesa.running_mean) and torch.equal(stock.running_var, mesa.running_var)
    with pytest.raises(TypeError, match="BatchNormAct2d"):
        mn.BatchNormAct2d.from_module(nn.BatchNorm2d(6))


@pytest.mark.parametrize("act", [nn.GELU, None])
def test_layernorm_act2d(act):
    """timm's ``LayerNormAct2d`` (ViTamin's stem): the Mesa LayerNorm2d, then its drop / act."""
    from timm.layers import LayerNormAct2d as TimmLayerNormAct2d

    torch.manual_seed(0)
    stock = TimmLayerNormAct2d(6, act_layer=act, apply_act=act is not None)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.LayerNormAct2d.from_module(copy.deepcopy(stock))
    assert type(mesa.act) is type(stock.act)
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 6, 5, 5) + 3)
    with pytest.raises(TypeError, match="LayerNormAct2d"):
        mn.LayerNormAct2d.from_module(nn.LayerNorm(6))


@pytest.mark.parametrize("affine,fast,amp,channels_last", [(True, False, False, False), (False, False, False, False),
                                                         (True, True, False, False), (True, False, True, False),
                                                         (True, True, True, True)],
                         ids=["affine", "no_affine", "fast_norm", "autocast", "fast_autocast_channels_last"])
def test_rms_norm2d(affine, fast, amp, channels_last):
    """timm's NCHW RMS norm (MobileNetV5): timm's own function for the output (its fast path
    where the stock module took it: under autocast it casts to bf16 first), the 8-bit x_hat
    with channel groups and the per-pixel rrms for backward."""
    from timm.layers import RmsNorm2d as TimmRmsNorm2d

    torch.manual_seed(0)
    stock = TimmRmsNorm2d(6, affine=affine)
    stock._fast_norm = fast
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5)
    mesa = mn.RmsNorm2d.from_module(copy.deepcopy(stock))
    assert mesa._fast_norm == fast
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-1, 1, 6).view(1, 6, 1, 1) + 0.5
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        _compare(stock, mesa, x, min_cos=0.99 if amp else 0.999)
    with pytest.raises(TypeError, match="RmsNorm2d"):
        mn.RmsNorm2d.from_module(nn.LayerNorm(6))


@pytest.mark.parametrize("act", [False, True], ids=["norm", "norm_act"])
def test_rms_norm2d_fp32_forms_compute_in_float32_and_return_the_inputs_dtype(act):
    """timm's ``RmsNorm2dFp32`` / ``RmsNormAct2dFp32`` (``norm_layer="rmsnorm2dfp32"``): float32
    copies in, the input's dtype out, bit for bit; a bf16 model's norm keeps 8-bit codes."""
    from timm.layers import RmsNorm2dFp32 as TimmFp32, RmsNormAct2dFp32 as TimmActFp32

    torch.manual_seed(0)
    stock = (TimmActFp32(6, act_layer=nn.GELU) if act else TimmFp32(6)).bfloat16()
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = (mn.RmsNormAct2dFp32 if act else mn.RmsNorm2dFp32).from_module(copy.deepcopy(stock))
    x = torch.randn(4, 6, 5, 5).bfloat16()
    assert stock(x).dtype == torch.bfloat16
    _compare(stock, mesa, x, min_cos=0.99)


def test_scaled_std_conv2d_compresses_when_only_its_gain_trains():
    """A gain-only fine-tune of an NFNet's stem (the image needs no gradient, weight and bias
    frozen): the gain's gradient still needs the input, kept in 8 bits (it ran stock, a review
    found: the layer asked only the weight and bias whether a gradient was wanted)."""
    from timm.layers import ScaledStdConv2d as TimmScaled

    torch.manual_seed(0)
    stock = TimmScaled(3, 8, 3)
    stock.weight.requires_grad_(False), stock.bias.requires_grad_(False)
    mesa = mn.ScaledStdConv2d.from_module(copy.deepcopy(stock))
    x = torch.randn(4, 3, 9, 9)  # (no gradient wanted)
    grads, saved = [], []
    for layer in (stock, mesa):
        with SavedTensorMeter(layer) as meter:
            y = layer(x)
        grads.append(torch.autograd.grad(y.square().sum(), layer.gain)[0])
        saved.append(meter.activation_bytes)
    assert saved[1] < saved[0] / 2, saved
    assert torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), 0) > 0.999


@pytest.mark.parametrize("channels,pad_mode,channels_last,amp", [
    (6, "reflect", False, False), (None, "reflect", False, False), (6, "constant", True, False),
    (6, "reflect", True, True)],
                         ids=["reflect", "expanded_filter", "constant_channels_last", "autocast_channels_last"])
def test_blur_pool2d_keeps_nothing_of_its_input(channels, pad_mode, channels_last, amp):
    """timm's anti-aliasing BlurPool2d (TResNet): a fixed depthwise filter, so the input gradient
    needs only the filter and the input's shape; stock kept the whole padded input. The forward
    is timm's calls, bit for bit; the input gradient equals stock's."""
    from timm.layers import BlurPool2d as TimmBlurPool2d

    from mesa_train.memory import SavedTensorMeter

    stock = TimmBlurPool2d(channels, filt_size=3, stride=2, pad_mode=pad_mode)
    mesa = mn.BlurPool2d.from_module(stock)
    assert mesa.filt is stock.filt and mesa.stride == 2 and mesa.pad_mode == pad_mode
    x = torch.randn(2, 6, 9, 9)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    head = torch.randn(2, 6, 5, 5)
    outs = []
    for layer in (stock, mesa):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), SavedTensorMeter() as meter:
            y = layer(xi)
        (gx,) = torch.autograd.grad(y, xi, head.to(y.dtype))
        outs.append((y, gx, meter.activation_bytes))
    (y0, g0, b0), (y1, g1, b1) = outs
    assert torch.equal(y0, y1) and y0.dtype == y1.dtype and g1.dtype == g0.dtype == x.dtype
    assert torch.equal(g0, g1), (g0 - g1).abs().max()
    assert g1.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert b0 > 0 and b1 <= 6 * 9 * 4, (b0, b1)  # (the filter at most)


def test_patch_model_converts_timms_blur_pool2d_and_it_compiles():
    from timm.layers import BlurPool2d as TimmBlurPool2d

    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), TimmBlurPool2d(8), nn.Conv2d(8, 4, 1)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (it was reported: functional conv not reached)
        mesa = patch_model(copy.deepcopy(stock))
    assert type(mesa[2]) is mn.BlurPool2d
    x = torch.randn(2, 3, 11, 11)
    compiled = torch.compile(mesa, backend="aot_eager", fullgraph=True)
    assert torch.equal(stock(x), mesa(x)) and torch.equal(compiled(x), mesa(x))
    compiled(x).square().sum().backward()
    assert mesa[0].weight.grad is not None
    # (nothing quantized: a layout the convs take is fine here too; a review found patch4x4 refused)
    spatial = patch_model(copy.deepcopy(stock), ops=["conv"], layout="patch4x4", bits=2)
    assert type(spatial[2]) is mn.BlurPool2d and torch.equal(spatial(x), stock(x))


@pytest.mark.parametrize("fp32,fast,amp", [(False, False, False), (False, True, True), (True, False, False)],
                         ids=["plain", "fast_autocast", "fp32_form"])
def test_simple_norm2d(fp32, fast, amp):
    """timm's SimpleNorm2d (ConvNeXt's *_rms variants: x / std_c(x) * weight, torch.var's unbiased
    variance over the channels of the channels-last view): timm's calls for the output, bit for
    bit; the 8-bit x_hat and per-pixel 1/std for backward, with the variance's mean path."""
    from timm.layers import SimpleNorm2d as TimmSimple, SimpleNorm2dFp32 as TimmSimpleFp32

    torch.manual_seed(0)
    stock = TimmSimpleFp32(6) if fp32 else TimmSimple(6)
    stock._fast_norm = fast
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = (mn.SimpleNorm2dFp32 if fp32 else mn.SimpleNorm2d).from_module(copy.deepcopy(stock))
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-1, 1, 6).view(1, 6, 1, 1) + 0.5
    if fp32:
        stock, mesa, x = stock.bfloat16(), mesa.bfloat16(), x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        _compare(stock, mesa, x, min_cos=0.99 if (amp or fp32) else 0.999)


def test_simple_norm2d_input_gradient_where_the_mean_outweighs_the_spread():
    """SimpleNorm leaves each pixel's mean in its output: 8-bit codes of x / std itself lost the
    input gradient where |mean| >> std (a review measured cosine 0.96 at 30 std, 0.68 at 100),
    since backward takes the mean off again. The centred codes plus a per-pixel mean keep it;
    a pixel of no spread at all (every channel equal) keeps its exact zero term."""
    from timm.layers import SimpleNorm2d as TimmSimple

    torch.manual_seed(0)
    stock = TimmSimple(32)
    mesa = mn.SimpleNorm2d.from_module(copy.deepcopy(stock))
    _compare(stock, mesa, torch.randn(2, 32, 8, 8) + 100 * torch.randn(2, 1, 8, 8), min_cos=0.999)
    x = torch.randn(2, 32, 8, 8)
    x[:, :, :2] = 0.7  # (no spread: the gradient 1/sqrt(eps) times stock's there)
    stock = TimmSimple(32)  # (fresh: _compare left the first pair in eval, gradients accumulated)
    _compare(stock, mn.SimpleNorm2d.from_module(copy.deepcopy(stock)), x, min_cos=0.999)
    with pytest.raises(TypeError, match="RmsNorm2d"):  # (a SimpleNorm2d is not an RmsNorm2d's stock)
        mn.RmsNorm2d.from_module(mesa)


@pytest.mark.parametrize("shape,fp32,fast,amp", [
    ((4, 7, 6), False, False, False), ((2, 3, 4, 6), False, True, True), ((4, 7, 6), True, False, False),
    ((5, 6), False, False, False)], ids=["tokens", "nhwc_fast_autocast", "fp32_form", "pooled_head"])
def test_simple_norm_over_the_last_dim(shape, fp32, fast, amp):
    """timm's 1-D SimpleNorm (x / std(x) * weight over the last dim: ConvNeXt *_rms heads, blocks
    with conv_mlp=False, models built with norm_layer="simplenorm"; ran stock silently before):
    timm's call for the output, bit for bit; 8-bit centred codes, channel groups over the last
    dim, the mean's path in backward; the same where each row's mean outweighs its spread."""
    from timm.layers import SimpleNorm as TimmSimple, SimpleNormFp32 as TimmSimpleFp32

    torch.manual_seed(0)
    c = shape[-1]
    stock = TimmSimpleFp32(c) if fp32 else TimmSimple(c)
    stock._fast_norm = fast
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = (mn.SimpleNormFp32 if fp32 else mn.SimpleNorm).from_module(copy.deepcopy(stock))
    x = torch.randn(shape) * torch.logspace(-1, 1, c) + 0.5
    if fp32:
        stock, mesa, x = stock.bfloat16(), mesa.bfloat16(), x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        _compare(stock, mesa, x, min_cos=0.99 if (amp or fp32) else 0.999)
    if not (fp32 or amp):
        stock = TimmSimple(32)
        far = torch.randn(4, 9, 32) + 100 * torch.randn(4, 9, 1)
        _compare(stock, mn.SimpleNorm.from_module(copy.deepcopy(stock)), far, min_cos=0.999)
    with pytest.raises(TypeError, match="SimpleNorm2d"):  # (a 1-D SimpleNorm is not a SimpleNorm2d's stock)
        mn.SimpleNorm2d.from_module(mesa)


@pytest.mark.parametrize("two_d", [False, True], ids=["tokens", "nchw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_fp32_forms_compute_in_float32_and_return_the_inputs_dtype(two_d, dtype):
    """timm's LayerNormFp32 / LayerNorm2dFp32 (norm_layer="layernormfp32": their own forward, so
    they were reported as not reached and kept whole): F.layer_norm on float32 copies, the
    input's dtype out, stock's bits; the Mesa LayerNorm's 8-bit x_hat for backward."""
    from timm.layers import LayerNorm2dFp32 as Timm2d, LayerNormFp32 as Timm1d

    torch.manual_seed(0)
    stock = (Timm2d if two_d else Timm1d)(6)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-0.5, 0.5)
    mesa = (mn.LayerNorm2dFp32 if two_d else mn.LayerNormFp32).from_module(copy.deepcopy(stock))
    x = torch.randn((4, 6, 5, 5) if two_d else (4, 7, 6)) + 0.5
    stock, mesa, x = stock.to(dtype), mesa.to(dtype), x.to(dtype)
    assert mesa(x).dtype == dtype
    _compare(stock, mesa, x, min_cos=0.999 if dtype == torch.float32 else 0.99)
    with pytest.raises(TypeError, match="LayerNormFp32"):  # (a 2-D form is not the 1-D one's stock)
        mn.LayerNormFp32.from_module(mn.LayerNorm2dFp32(6))


@pytest.mark.parametrize("norm_layer,mesa_cls,ratio", [("simplenorm", "SimpleNorm", 0.4),
                                                       ("layernormfp32", "LayerNormFp32", 0.3)])
def test_patch_model_converts_the_norms_of_a_vit_built_with_a_norm_layer_string(norm_layer, mesa_cls, ratio):
    """A timm ViT built with norm_layer="simplenorm" / "layernormfp32" (every block's norms and
    the final norm timm's SimpleNorm / LayerNormFp32; the first ran stock without a word, the
    second was reported): converted, nothing reported, the train forward stock's bits with
    drop-path on, fewer bytes, eager and compiled (fullgraph, forward and backward)."""
    import timm

    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                              norm_layer=norm_layer, drop_path_rate=0.1).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing reported unreached)
        patch_model(mesa)
    cls = getattr(mn, mesa_cls)
    assert type(mesa.blocks[0].norm1) is cls and type(mesa.norm) is cls
    x = torch.randn(2, 3, 32, 32)
    with SavedTensorMeter() as stock_meter:
        torch.manual_seed(1)
        want = stock(x)
    with SavedTensorMeter() as meter:
        torch.manual_seed(1)
        got = mesa(x)
    assert torch.equal(got, want)
    assert meter.activation_bytes < ratio * stock_meter.activation_bytes, (meter.activation_bytes,
                                                                           stock_meter.activation_bytes)
    compiled = torch.compile(mesa, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    out = compiled(x)
    out.square().sum().backward()
    assert torch.equal(out, want) and all(p.grad is not None for p in mesa.parameters())


def test_rms_norm_act2d_keeps_its_drop_and_act_children():
    from timm.layers import RmsNormAct2d as TimmRmsNormAct2d

    torch.manual_seed(0)
    stock = TimmRmsNormAct2d(6, act_layer=nn.GELU)
    mesa = mn.RmsNormAct2d.from_module(copy.deepcopy(stock))
    assert type(mesa.act) is nn.GELU and [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == \
        list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 6, 5, 5))
    with pytest.raises(TypeError, match="RmsNormAct2d"):
        mn.RmsNormAct2d.from_module(mn.RmsNorm2d(6))


def test_patch_model_converts_timms_rms_norm2d_layers_and_they_compile():
    """MobileNetV5's norms as patch_model finds them (the act converted on its own): the train
    forward stock's bits, eager and under torch.compile (fullgraph, forward and backward)."""
    from timm.layers import RmsNorm2d as TimmRmsNorm2d, RmsNormAct2d as TimmRmsNormAct2d

    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3), TimmRmsNormAct2d(8, act_layer=nn.GELU), nn.Conv2d(8, 8, 1),
                          TimmRmsNorm2d(8)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing reported unreached)
        mesa = patch_model(copy.deepcopy(stock))
    assert [type(m) for m in mesa] == [mn.Conv2d, mn.RmsNormAct2d, mn.Conv2d, mn.RmsNorm2d]
    assert type(mesa[1].act) is mn.GELU
    x = torch.randn(2, 3, 9, 9)
    want = stock(x)
    assert torch.equal(mesa(x), want)
    compiled = torch.compile(mesa, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    assert torch.equal(out, want) and all(p.grad is not None for p in mesa.parameters())


@pytest.mark.parametrize("same", [False, True])
def test_scaled_std_conv2d(same):
    """timm's NFNet convs: the learned gain inside the standardization, the same parameter, its
    gradient close to stock's; timm's forward bit for bit."""
    from timm.layers import ScaledStdConv2d as TimmScaled, ScaledStdConv2dSame as TimmScaledSame

    torch.manual_seed(0)
    stock = TimmScaledSame(6, 8, 3, stride=2, gamma=1.7) if same else TimmScaled(6, 8, 3, stride=2, gamma=1.7)
    with torch.no_grad():
        stock.gain.uniform_(0.5, 1.5)
    mesa = (mn.ScaledStdConv2dSame if same else mn.ScaledStdConv2d).from_module(copy.deepcopy(stock))
    assert mesa.scale == stock.scale and mesa.same_pad == getattr(stock, "same_pad", False)
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 6, 9, 9))
    with pytest.raises(TypeError, match="ScaledStdConv2d"):
        mn.ScaledStdConv2d.from_module(nn.Conv2d(6, 8, 3))


@pytest.mark.parametrize("same", [False, True])
def test_std_conv2d(same):
    """timm's weight-standardized convs (BiT, the ViT hybrids' stems): timm's forward bit for
    bit, the 8-bit input in place of stock's, the weight gradient through the standardization."""
    from timm.layers import StdConv2d as TimmStdConv2d, StdConv2dSame as TimmStdConv2dSame

    torch.manual_seed(0)
    stock = TimmStdConv2dSame(6, 8, 3, stride=2) if same else TimmStdConv2d(6, 8, 3, stride=2, bias=True)
    mesa = (mn.StdConv2dSame if same else mn.StdConv2d).from_module(copy.deepcopy(stock))
    assert mesa.eps == stock.eps and mesa.same_pad == getattr(stock, "same_pad", False)
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 6, 9, 9))
    with pytest.raises(TypeError, match="StdConv2d"):
        mn.StdConv2d.from_module(nn.Conv2d(6, 8, 3))


def test_std_conv2d_under_autocast_keeps_the_autocast_copy_of_its_weight():
    """Under bf16 autocast stock's conv keeps autocast's bf16 copy of the standardized weight;
    the Mesa conv keeps the weight it is handed, which was the float32 standardized one (not a
    parameter, so counted): twice stock's copy, and more than stock's bytes in all where the
    weight outweighs the input (resnetv2_50x1_bit at 64 px: 1.82x, now 0.95x)."""
    from timm.layers import StdConv2d as TimmStdConv2d

    torch.manual_seed(0)
    stock = TimmStdConv2d(16, 32, 3)
    mesa = mn.StdConv2d.from_module(copy.deepcopy(stock))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _compare(stock, mesa, torch.randn(2, 16, 5, 5), min_cos=0.99)


@pytest.mark.parametrize("stride,kernel", [(2, 3), (1, 4), (2, 5)])
def test_conv2d_same(stride, kernel):
    """timm's ``Conv2dSame`` (the ``tf_`` EfficientNets): pad by the input's size, then the
    Mesa conv on the padded input; odd sizes pad one side more."""
    from timm.layers import Conv2dSame as TimmConv2dSame

    torch.manual_seed(0)
    stock = TimmConv2dSame(6, 8, kernel, stride=stride, groups=2)
    mesa = mn.Conv2dSame.from_module(copy.deepcopy(stock))
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 6, 9, 9))
    with pytest.raises(TypeError, match="Conv2dSame"):
        mn.Conv2dSame.from_module(nn.Conv2d(6, 8, 3))


@pytest.mark.parametrize("act", [nn.ReLU, None])
def test_group_norm_act(act):
    """timm's ``GroupNormAct``: the Mesa GroupNorm, then its drop / act (BiT, the hybrids' stems)."""
    from timm.layers import GroupNormAct as TimmGroupNormAct

    torch.manual_seed(0)
    stock = TimmGroupNormAct(8, num_groups=4, act_layer=act, apply_act=act is not None, inplace=False)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.GroupNormAct.from_module(copy.deepcopy(stock))
    assert type(mesa.act) is type(stock.act) and mesa.num_groups == 4 and mesa.quantizer.options.num_groups == 8
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(4, 8, 5, 5) + 3)
    with pytest.raises(TypeError, match="GroupNormAct"):
        mn.GroupNormAct.from_module(nn.GroupNorm(4, 8))


def test_patch_model_converts_batchnorm_act_and_its_act():
    """In a ConvNormAct the BatchNormAct2d becomes the Mesa one and its ReLU, converted after
    it in the same pass, lands in the new module (not in the replaced one)."""
    from timm.layers import ConvNormAct

    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = nn.Sequential(ConvNormAct(3, 8, 3), ConvNormAct(8, 8, 3, groups=8), nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(2, 3, 8, 8)
    stock(x)
    patched = patch_model(copy.deepcopy(stock), cancelling_bn="compress")
    for block in patched[:2]:
        assert isinstance(block.bn, mn.BatchNormAct2d) and isinstance(block.bn.act, mn.ReLU)
    torch.manual_seed(1)
    ref = stock(x)
    torch.manual_seed(1)
    assert torch.equal(ref, patched(x))
    with SavedTensorMeter(stock) as a:
        stock(x)
    with SavedTensorMeter(patched) as b:
        patched(x)
    assert b.activation_bytes < 0.5 * a.activation_bytes, (b.activation_bytes, a.activation_bytes)


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_groupnorm(groups):
    """``nn.GroupNorm`` / timm's ``GroupNorm1`` (PoolFormer): the stock bits forward, 8-bit
    ``x_hat`` with per-channel groups, gradients of x, weight and bias."""
    from timm.layers import GroupNorm1

    torch.manual_seed(0)
    stock = GroupNorm1(6) if groups == 1 else nn.GroupNorm(groups, 6)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5), stock.bias.uniform_(-1, 1)
    mesa = mn.GroupNorm.from_module(copy.deepcopy(stock))
    assert mesa.quantizer.options.num_groups == 6 and mesa.num_groups == groups
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-2, 1, 6).view(1, 6, 1, 1) + 3
    _compare(stock, mesa, x)
    stock.train().zero_grad(set_to_none=True)  # a fresh pair: estimates of its own for another input's range
    _compare(stock, mn.GroupNorm.from_module(copy.deepcopy(stock)), torch.randn(3, 6, 10))  # (N, C, L)


def test_rmsnorm_with_a_row_far_below_the_others():
    from timm.layers import RmsNorm as TimmRmsNorm

    torch.manual_seed(0)
    stock = TimmRmsNorm(32)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 32)
    x[:, 0] *= 1e-4
    _compare(stock, mn.RmsNorm.from_module(copy.deepcopy(stock)), x)


def test_rmsnorm_without_affine():
    """timm's ``RmsNorm(affine=False)`` (Gemma 4's ViT norms): converted with ``weight`` a None
    parameter, as stock's (a plain ``None`` attribute used to block ``register_parameter``)."""
    from timm.layers import RmsNorm as TimmRmsNorm

    stock = TimmRmsNorm(32, affine=False)
    mesa = mn.RmsNorm.from_module(copy.deepcopy(stock))
    assert mesa.weight is None and "weight" in mesa._parameters
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    x = torch.randn(2, 7, 32)
    x[:, 0] *= 1e-4
    _compare(stock, mesa, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fp32(dtype):
    """timm's ``RmsNormFp32`` (DeepSeek's ViT): float32 arithmetic whatever the input's dtype,
    the input's dtype out; the Mesa layer gives the same bits."""
    from timm.layers import RmsNormFp32 as TimmRmsNormFp32

    torch.manual_seed(0)
    stock = TimmRmsNormFp32(32).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = mn.RmsNormFp32.from_module(copy.deepcopy(stock))
    x = torch.randn(2, 7, 32).to(dtype)
    if dtype == torch.float32:
        _compare(stock, mesa, x)
        return
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, ym = stock(xs), mesa(xm)
    assert ym.dtype == dtype and torch.equal(ys, ym)
    g = torch.randn_like(ys)
    ys.backward(g), ym.backward(g)
    assert _cos(xs.grad, xm.grad) > 0.999 and _cos(stock.weight.grad, mesa.weight.grad) > 0.999
    with pytest.raises(TypeError, match="RmsNormFp32"):
        mn.RmsNormFp32.from_module(nn.LayerNorm(32))


@pytest.mark.parametrize("shape", [(2, 7, 16), (2, 6, 5, 5)])
def test_star_relu(shape):
    """timm's ``StarReLU`` (``scale * relu(x) ** 2 + bias``, MetaFormer): the stock bits
    forward, 8-bit ``relu(x)`` instead of two full-size tensors, gradients of x, scale, bias."""
    from timm.models.metaformer import StarReLU as TimmStarReLU

    torch.manual_seed(0)
    stock = TimmStarReLU(scale_value=0.8944, bias_value=-0.4472)
    mesa = mn.StarReLU.from_module(copy.deepcopy(stock))
    assert [k for k in mesa.state_dict() if not k.startswith("quantizer.")] == list(stock.state_dict())
    _compare(stock, mesa, torch.randn(*shape))
    with pytest.raises(TypeError, match="StarReLU"):
        mn.StarReLU.from_module(nn.ReLU())


@pytest.mark.parametrize("use_nchw", [True, False])
def test_metaformer_scale(use_nchw):
    """MetaFormer's ``Scale`` (``x * scale.view(shape)``): 8-bit ``x`` for the scale's gradient."""
    from timm.models.metaformer import Scale as TimmScale

    torch.manual_seed(0)
    stock = TimmScale(6, init_value=0.5, use_nchw=use_nchw)
    with torch.no_grad():
        stock.scale.uniform_(0.5, 1.5)
    mesa = mn.Scale.from_module(copy.deepcopy(stock))
    assert mesa.shape == stock.shape and list(mesa.state_dict())[0] == "scale"
    _compare(stock, mesa, torch.randn(2, 6, 5, 5) if use_nchw else torch.randn(2, 5, 5, 6))


def test_subclass_with_only_a_constructor_is_converted_as_its_base():
    """timm's ``LayerNorm2dNoBias`` (bias None, eps 1e-6) and a user's defaults-only subclass
    take their base's rule; a subclass with a method of its own does not (its forward may
    not be the base's)."""
    import warnings

    from timm.models.metaformer import LayerNorm2dNoBias

    from mesa_train.patch import patch_model

    class Defaults(nn.LayerNorm):
        def __init__(self, c):
            super().__init__(c, eps=1e-6)

    class OwnHelper(nn.Conv2d):  # nn.Conv2d.forward calls _conv_forward: overriding it changes the layer
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, weight * 2, bias)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm2d, self.conv = LayerNorm2dNoBias(4), OwnHelper(4, 4, 1)
            self.norm = Defaults(4)

        def forward(self, x):
            return self.norm(self.conv(self.norm2d(x)).permute(0, 2, 3, 1))

    stock = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched = patch_model(copy.deepcopy(stock), ops=["layernorm", "conv"])
    assert type(patched.norm2d) is mn.LayerNorm2d and patched.norm2d.bias is None and patched.norm2d.eps == 1e-6
    assert type(patched.norm) is mn.LayerNorm and patched.norm.eps == 1e-6
    assert type(patched.conv) is OwnHelper
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(stock(x), patched(x))


@pytest.mark.parametrize("kind", ["quick_gelu", "silu"])
def test_activations(kind):
    from timm.layers.activations import QuickGELU as TimmQuickGELU

    stock = TimmQuickGELU() if kind == "quick_gelu" else nn.SiLU()
    mesa = (mn.QuickGELU if kind == "quick_gelu" else mn.SiLU).from_module(stock)
    _compare(stock, mesa, torch.randn(2, 7, 32) * 3)


_ELU_FAMILY = {"elu": lambda: nn.ELU(0.5), "celu": lambda: nn.CELU(2.0), "selu": nn.SELU, "mish": nn.Mish}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(_ELU_FAMILY))
def test_elu_family_and_mish_keep_their_8_bit_input(kind, dtype, channels_last):
    """torch's ELU, CELU, SELU and Mish (timm's act_layer="elu" / "celu" / "selu" / "mish"; they
    ran stock without a word, keeping their full input): stock's output bit for bit, the 8-bit
    input for backward; the ELU family also a 1-bit mask of the side of 0, so the positive side's
    gradient is stock's exactly (SELU's slope jumps 1.05 -> 1.76 there)."""
    torch.manual_seed(0)
    stock = _ELU_FAMILY[kind]()
    mesa = getattr(mn, type(stock).__name__).from_module(stock)
    assert isinstance(mesa, type(stock)) and getattr(mesa, "alpha", None) == getattr(stock, "alpha", None)
    x = (torch.randn(4, 8, 5, 5) * 2).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _compare(stock, mesa, x, min_cos=0.999 if dtype == torch.float32 else 0.99)
    if kind != "mish":
        mesa.train()
        g = torch.randn_like(x)
        xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        stock(xs).backward(g), mesa(xm).backward(g)
        positive = x > 0
        assert torch.equal(xm.grad[positive], xs.grad[positive])
        assert xm.grad.is_contiguous(memory_format=torch.channels_last) == channels_last
    with pytest.raises(TypeError):
        getattr(mn, type(stock).__name__).from_module(nn.GELU())


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_parameters", [1, 8])
def test_prelu_keeps_a_mask_and_its_8_bit_input(num_parameters, dtype, channels_last):
    """torch's PReLU (timm's act_layer="prelu"; it ran stock without a word): stock's output and
    input gradient bit for bit (a 1-bit mask of x > 0 and the weight), the weight's gradient from
    the 8-bit input's negative side; one weight or one per channel (dim 1)."""
    torch.manual_seed(0)
    stock = nn.PReLU(num_parameters, init=0.2)
    with torch.no_grad():
        stock.weight.uniform_(0.05, 0.5)
    mesa = mn.PReLU.from_module(copy.deepcopy(stock))
    assert mesa.weight is not stock.weight and torch.equal(mesa.weight, stock.weight)
    x = (torch.randn(4, 8, 5, 5) * 2).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    stock, mesa = stock.to(dtype), mesa.to(dtype)
    _compare(stock, mesa, x, min_cos=0.999 if dtype == torch.float32 else 0.99)
    mesa.train(), stock.train()
    g = torch.randn_like(x)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(xs).backward(g), mesa(xm).backward(g)
    assert torch.equal(xm.grad, xs.grad)
    assert xm.grad.is_contiguous(memory_format=torch.channels_last) == channels_last
    with pytest.raises(TypeError):
        mn.PReLU.from_module(nn.ReLU())


def _timm_hard_mish(me: bool, inplace: bool = False):
    from timm.layers.activations import HardMish
    from timm.layers.activations_me import HardMishMe

    return (HardMishMe if me else HardMish)(inplace=inplace)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("me", [False, True], ids=["HardMish", "HardMishMe"])
def test_hard_mish_keeps_its_8_bit_input_and_the_side_of_minus_2(me, dtype, channels_last):
    """timm's HardMish / HardMishMe (act_layer="hard_mish"; they ran stock without a word,
    HardMish's graph keeping three full tensors): stock's output bit for bit, the 8-bit input and
    a 1-bit mask of x < -2 for backward, so below -2 the gradient is stock's 0 exactly (the
    derivative jumps from 0 to -1 there) and well above 0 it is stock's g."""
    torch.manual_seed(0)
    stock = _timm_hard_mish(me)
    mesa = mn.HardMish.from_module(stock)
    assert type(mesa) is mn.HardMish and not mesa.inplace
    x = (torch.randn(4, 8, 5, 5) * 2).to(dtype)
    x[0, 0, 0, :3] = torch.tensor([-2.0, 0.0, -1.0])  # (on the jump, on the knee, the minimum)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _compare(stock, mesa, x, min_cos=0.999 if dtype == torch.float32 else 0.99)
    mesa.train()
    g = torch.randn_like(x)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(xs).backward(g), mesa(xm).backward(g)
    assert torch.equal(xm.grad[x < -2], xs.grad[x < -2]) and not xm.grad[x < -2].any()
    at = x == -2  # (HardMishMe: g * -1; HardMish: its clamp's rule at a bound, 0 in torch 2.14)
    assert torch.equal(xm.grad[at] == 0, xs.grad[at] == 0)
    assert torch.equal(xm.grad[x > 1], xs.grad[x > 1])  # (more than a rounding step above the knee)
    assert xm.grad.is_contiguous(memory_format=torch.channels_last) == channels_last


@pytest.mark.parametrize("me", [False, True], ids=["HardMish", "HardMishMe"])
def test_hard_mish_in_place_flag_and_eval(me):
    """``inplace`` carried over where timm's module has one (HardMishMe takes the argument and
    keeps none); out of training the layer is timm's function, in place where asked."""
    mesa = mn.HardMish.from_module(_timm_hard_mish(me, inplace=True))
    assert mesa.inplace is (not me)
    x = torch.randn(2, 4, 3, 3) * 3
    want = _timm_hard_mish(me)(x)
    with torch.no_grad():
        mesa.eval()
        assert torch.equal(mesa(x.clone()), want)
    with pytest.raises(TypeError):
        mn.HardMish.from_module(nn.Mish())


@pytest.mark.parametrize("act_layer", ["selu", "mish", "prelu", "hard_mish"])
def test_patch_model_converts_a_vits_act_layer_and_it_compiles(act_layer):
    """A timm ViT built with act_layer="selu" / "mish" / "prelu" / "hard_mish": every MLP's activation converted,
    nothing reported, the train forward stock's bits, gradients close, compiled whole (fullgraph,
    forward and backward) with eager's outputs."""
    import timm

    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                              act_layer=act_layer).train()
    mesa = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing reported unreached)
        patch_model(mesa)
    assert type(mesa.blocks[1].mlp.act) is {"selu": mn.SELU, "mish": mn.Mish, "prelu": mn.PReLU,
                                           "hard_mish": mn.HardMish}[act_layer]
    x = torch.randn(2, 3, 32, 32)
    want = stock(x)
    want.square().sum().backward()
    twin = copy.deepcopy(mesa)
    got = mesa(x)
    got.square().sum().backward()
    assert torch.equal(got, want)
    for (n, p), q in zip(mesa.named_parameters(), stock.parameters()):
        assert _cos(p.grad, q.grad) > 0.99, n
    out = torch.compile(twin, backend="aot_eager", fullgraph=True)(x)
    out.square().sum().backward()
    assert torch.equal(out, want)
    for (n, p), q in zip(twin.named_parameters(), mesa.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


@pytest.mark.parametrize("gate_last", [False, True])
def test_gated_activation(gate_last):
    act = nn.SiLU()

    class Stock(nn.Module):
        def forward(self, a, b):
            return b * act(a) if gate_last else act(a) * b

    _compare(Stock(), mn.GatedActivation(act, gate_last=gate_last), torch.randn(2, 7, 32), torch.randn(2, 7, 32))


def test_linear_row_scales_keep_a_tiny_row():
    """A row ~1e-3 of the others that carries most of the gradient (DeiT3's class token):
    without row scales it falls below its group's 8-bit step (weight-gradient cosine ~0.1)."""
    from mesa_train.nn.rowscale import row_exponents

    torch.manual_seed(0)
    x = torch.randn(4, 17, 64)
    x[:, 0] *= 1e-3
    g = torch.randn(4, 17, 32) * 1e-3
    g[:, 0] = torch.randn(4, 32)
    stock = nn.Linear(64, 32)
    mesa = mn.Linear.from_module(copy.deepcopy(stock))
    grads = []
    for m in (stock, mesa):
        m(x).backward(g)
        grads.append(m.weight.grad)
    assert _cos(grads[0], grads[1]) >= 0.999
    k = row_exponents(x)
    assert (k[:, 0] >= 9).all() and (k[:, 1:] == 0).all()  # only the tiny row is scaled (2**9 ~ 1e3)


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_rms_norm_is_timms_in_bfloat16(autocast, fp32):
    """timm's RmsNorm calls torch's ``rms_norm``, which computes a bf16 input in float32 and
    returns bf16 (with a float32 weight too). The Mesa layer wrote the ops out and returned
    float32 there: Gemma 4 / Qwen3 forwards under bf16 autocast differed from stock."""
    from timm.layers import RmsNorm as TimmRmsNorm, RmsNormFp32 as TimmRmsNormFp32

    torch.manual_seed(0)
    stock = (TimmRmsNormFp32 if fp32 else TimmRmsNorm)(64, eps=1e-6)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    mesa = (mn.RmsNormFp32 if fp32 else mn.RmsNorm).from_module(copy.deepcopy(stock))
    x = (torch.randn(2, 5, 64) * 3).bfloat16()
    outs, grads = [], []
    for m in (stock, mesa):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(leaf)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append(leaf.grad)
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    assert _cos(grads[0], grads[1]) > 0.999
