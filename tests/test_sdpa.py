"""Mesa fused attention (``mesa_train.nn.sdpa``): exact forward, int8 q/k/v, consistent backward."""
import pytest
import torch
import torch.nn.functional as F

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn.sdpa import ScaledDotProductAttention, build_window_mask

B, H, N, D = 8, 4, 16, 8


def _inputs(seed=0, dtype=torch.float32, mask=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    bias = (torch.randn(1, H, N, N, generator=g) * 0.5).to(dtype).requires_grad_() if mask else None
    wm = None
    if mask == "window":
        wm = torch.zeros(4, N, N, dtype=dtype)
        wm[1, :, : N // 2] = -100.0  # Swin's shifted-window mask values
        wm[3, N // 2:, :] = -100.0
    return q, k, v, bias, wm


def _run(fn, q, k, v, bias, wm, seed=5):
    out = fn(q, k, v, bias, wm)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    return out, torch.autograd.grad(out, leaves, g)


def _stock(q, k, v, bias, wm, **kw):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=build_window_mask(bias, wm, q.shape[0], q.shape[1]), **kw)


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


@pytest.mark.parametrize("mask", [None, "bias", "window"])
def test_forward_bitwise_and_grads_close(mask):
    m = ScaledDotProductAttention(num_groups=H).train()
    args = _inputs(mask=mask)
    out, grads = _run(lambda q, k, v, b, w: m(q, k, v, attn_mask=b, window_mask=w), *args)
    ref, ref_grads = _run(_stock, *args)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert _cos(g, r) >= 0.999, _cos(g, r)


def test_causal_and_bool_mask():
    m = ScaledDotProductAttention(num_groups=H).train()
    q, k, v, _, _ = _inputs()
    out, grads = _run(lambda q, k, v, b, w: m(q, k, v, is_causal=True), q, k, v, None, None)
    ref, ref_grads = _run(lambda q, k, v, b, w: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          q, k, v, None, None)
    assert torch.equal(out, ref)
    assert all(_cos(a, b) >= 0.999 for a, b in zip(grads, ref_grads))
    keep = torch.rand(N, N, generator=torch.Generator().manual_seed(3)) > 0.3
    keep |= torch.eye(N, dtype=torch.bool)
    out, grads = _run(lambda q, k, v, b, w: m(q, k, v, attn_mask=keep), q, k, v, None, None)
    ref, ref_grads = _run(lambda q, k, v, b, w: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                          q, k, v, None, None)
    assert torch.equal(out, ref)
    assert all(_cos(a, b) >= 0.999 for a, b in zip(grads, ref_grads))


def test_backward_is_exact_gradient_at_the_dequantized_inputs():
    """With q, k, v exactly representable in 8 bits (each head: 256 levels spanning its
    min..max), dequantization is lossless up to fp32 rounding, so the Mesa gradients must be
    the exact fused-attention gradients: the recomputed softmax statistics (lse) belong to
    the same q, k the gradients use."""
    g = torch.Generator().manual_seed(0)
    lv = lambda: (torch.randint(0, 256, (B, H, N, D), generator=g).float() / 255.0 * 2.0 - 1.0)  # noqa: E731
    qkv = []
    for _ in range(3):
        t = lv()
        t[:, :, 0, 0], t[:, :, 0, 1] = -1.0, 1.0  # every head spans exactly [-1, 1]
        qkv.append(t.requires_grad_())
    m = ScaledDotProductAttention(num_groups=H, rounding="nearest").train()
    out, grads = _run(lambda q, k, v, b, w: m(q, k, v), *qkv, None, None)
    ref, ref_grads = _run(_stock, *qkv, None, None)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_disabled_and_eval_are_stock():
    args = _inputs(mask="window")
    ref, ref_grads = _run(_stock, *args)
    for m in (ScaledDotProductAttention(num_groups=H, enabled=False).train(),
              ScaledDotProductAttention(num_groups=H).eval()):
        out, grads = _run(lambda q, k, v, b, w: m(q, k, v, attn_mask=b, window_mask=w), *args)
        assert torch.equal(out, ref)
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b)
    assert not bool(m.q_quantizer.initialized)  # eval never touches the estimates


def test_bf16_autocast():
    m = ScaledDotProductAttention(num_groups=H).train()
    args = _inputs(mask="bias")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(lambda q, k, v, b, w: m(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=b.bfloat16()),
                          *args)
        ref, ref_grads = _run(lambda q, k, v, b, w: _stock(q.bfloat16(), k.bfloat16(), v.bfloat16(), b.bfloat16(), w),
                              *args)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and _cos(a, b) >= 0.99


@pytest.mark.parametrize("shape,mask_shape", [((2, 4, 16, 32), (1, 4, 16, 16)), ((2, 4, 49, 32), (1, 4, 49, 49))])
def test_bf16_autocast_float32_bias_that_requires_grad(shape, mask_shape):
    """MaxViT / CoAtNet: bf16 q, k, v and a float32 relative-position bias derived from a
    parameter. Autocast casts the mask; in the stock call the cast requires grad (math kernel),
    inside the Mesa forward it did not (the fused CPU kernel: other bits). Now equal."""
    torch.manual_seed(0)
    q, k, v = [torch.randn(*shape, requires_grad=True) for _ in range(3)]
    table = torch.randn(*mask_shape, requires_grad=True)
    m = ScaledDotProductAttention().train()
    outs, grads = [], []
    for fn in (F.scaled_dot_product_attention, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=table * 1.0)
        out.float().square().sum().backward()
        outs.append(out)
        grads.append(table.grad.clone())
        table.grad = None
    assert outs[0].dtype == outs[1].dtype and torch.equal(outs[0], outs[1])
    cos = (grads[0].double() * grads[1].double()).sum() / (grads[0].double().norm() * grads[1].double().norm())
    assert cos > 0.99


def test_dropout_replays_the_mask():
    m = ScaledDotProductAttention(num_groups=H).train()
    args = _inputs()
    torch.manual_seed(11)
    out, grads = _run(lambda q, k, v, b, w: m(q, k, v, dropout_p=0.3), *args)
    # same RNG stream for the stock call: Mesa draws nothing from torch's generator (its
    # rounding seeds are device-side), so the same seed gives the same dropout mask
    torch.manual_seed(11)
    ref, ref_grads = _run(lambda q, k, v, b, w: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3), *args)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert _cos(a, b) >= 0.999


def test_saves_int8_qkv_only():
    m = ScaledDotProductAttention(num_groups=H).train()
    q, k, v, bias, wm = _inputs(mask="window")
    with SavedTensorMeter() as meter:
        m(q, k, v, attn_mask=bias, window_mask=wm)
    with SavedTensorMeter() as stock:
        _stock(q, k, v, bias, wm)
    n = B * H * N * D
    stats = 3 * 2 * H * 4  # (1, G) float32 alpha and beta per operand
    masks = bias.numel() * 4 + wm.numel() * 4
    assert meter.activation_bytes == 3 * n + stats + masks
    print(f"\nsdpa saved bytes: mesa {meter.activation_bytes:,} vs stock {stock.activation_bytes:,} "
          f"({meter.activation_bytes / stock.activation_bytes:.1%})")
    assert meter.activation_bytes < stock.activation_bytes
