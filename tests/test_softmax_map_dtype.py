"""The attention map handed to ``attn @ v`` in the matmul's dtype (issue 9, the ops path).

Under CUDA autocast the softmax runs in float32 and ``attn @ v`` in bf16 / f16: the stock
model writes a float32 map and autocast casts it; backward casts the map's bf16 gradient up to
float32 and the float32 gradient of the logits down again, two passes over the map each way
that a compiled step cannot fuse into Mesa's opaque ``mesa::softmax_backward``. The patched
attention asks the Mesa Softmax for its output in the matmul's dtype (the same cast, made
inside the layer, after the compression); its gradient then arrives in that dtype and backward
is the one op with ``y_dtype=float32`` (no cast around it), bit for bit the former result.

CUDA autocast's float32 softmax is emulated on the CPU (``cuda_autocast_softmax``, registered
at the dispatcher, so the C++ layer op sees it too); Swin's logits are float32 under plain CPU
autocast already (the float32 relative-position bias).
"""
from __future__ import annotations

import copy

import pytest
import torch

import mesa_train.nn as mnn
import mesa_train.patch.attention as attention_mod
from mesa_train.nn import quantizer as quantizer_mod
from mesa_train.patch import patch_model
from mesa_train.quant import reference as R
from cuda_autocast_softmax import cuda_autocast_softmax
from graph_capture import recording_backend
from op_recorder import OpRecorder
from test_patch_helpers import build, grads, inputs, loss_of

HALF = (torch.bfloat16, torch.float16)
# relative error of a parameter's gradient against the former path's (float32 copies of the map)
REL_BOUND = 1e-2
# metadata ops: not passes over the map
_METADATA = {"aten.detach", "aten.view", "aten.alias", "aten._unsafe_view", "aten.empty", "aten.empty_strided"}


def _passes(ops: list[str]) -> list[str]:
    return [o for o in ops if o not in _METADATA]


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-node", "python-function"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_hands_the_map_over_cast_and_backward_is_one_op(dtype, fused, monkeypatch):
    """``forward_with_copy(x, out_dtype)`` under (emulated) CUDA autocast: the float32 map cast
    to ``out_dtype`` (what autocast's matmul makes of it), its copy that cast map's (a twin
    quantizer compressing it gives the same codes), and backward ``mesa.softmax_backward``
    alone, equal bit for bit to the op on ``g`` cast up with the result cast down; the former
    path (the map returned in float32, cast outside) adds those two casts."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    layer, twin, former = (mnn.Softmax(-1, num_groups=3) for _ in range(3))
    twin.quantizer.rng.copy_(layer.quantizer.rng)  # the same rounding key
    x = (torch.randn(2, 3, 17, 197) * 3).to(dtype)
    g = torch.randn(x.shape).to(dtype)
    with cuda_autocast_softmax(), torch.autocast("cpu", dtype=dtype):
        for step in range(2):  # (the second with initialised estimates)
            xi = (x * (step + 1)).requires_grad_()
            y, packed = layer.forward_with_copy(xi, dtype)
            with OpRecorder() as rec:
                y.backward(g)
            y32 = torch.softmax(x * (step + 1), -1)
            assert y32.dtype == torch.float32  # the emulated CUDA autocast softmax
            want = twin.quantizer.compress(y32.to(dtype), 1)
            xf = (x * (step + 1)).requires_grad_()
            y_former = former.forward_with_copy(xf)[0].to(dtype)
            with OpRecorder() as rec_former:
                y_former.backward(g)
    assert y.dtype == dtype and torch.equal(y, y32.to(dtype))
    assert torch.equal(packed.q, want.q) and torch.equal(packed.alpha, want.alpha)
    gx_want = R.softmax_backward(g.float(), want.q, want.alpha, want.beta, 1, 3).to(dtype)
    assert xi.grad.dtype == dtype and torch.equal(xi.grad, gx_want)
    assert _passes(rec.ops) == ["mesa.softmax_backward"], rec.ops
    former_ops = _passes(rec_former.ops)
    assert former_ops.count("aten._to_copy") == 2 and "mesa.softmax_backward" in former_ops, former_ops


def test_autocast_dtype_for():
    from mesa_train.nn.softmax import autocast_dtype_for

    t = torch.randn(2, 3)
    assert autocast_dtype_for(t) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype_for(t) == torch.bfloat16
        assert autocast_dtype_for(t.double()) is None  # autocast leaves float64 alone
        assert autocast_dtype_for(torch.empty(2, 3, device="meta")) is None  # no autocast there


def test_out_dtype_without_compression_is_the_cast():
    layer = mnn.Softmax(-1).eval()
    x = torch.randn(2, 3, 4, 5)
    y, packed = layer.forward_with_copy(x, torch.bfloat16)
    assert packed is None and torch.equal(y, x.softmax(-1).to(torch.bfloat16))


@pytest.mark.skipif(not quantizer_mod._FUSED_LAYERS, reason="needs the compiled extension")
def test_cpp_layer_op_rejects_a_non_float_out_dtype():
    layer = mnn.Softmax(-1, num_groups=1)
    with pytest.raises(ValueError, match="out_dtype .* is not a floating dtype; valid: None") as e:
        layer.forward_with_copy(torch.randn(2, 3, 4, 5, requires_grad=True), torch.int32)
    assert "\n" not in str(e.value)


def _step(model, x, dtype, emulate: bool):
    """One forward + backward under autocast on x's device (CUDA autocast's float32 softmax
    emulated on the CPU with ``emulate``); the backward's op names."""
    ctx = cuda_autocast_softmax() if emulate else _nothing()
    with ctx, torch.autocast(x.device.type, dtype=dtype):
        out = model(x)
    loss = loss_of(out.cpu()) if out.device.type != "cpu" else loss_of(out)  # (loss_of's weights: CPU)
    with OpRecorder() as rec:
        loss.backward()
    return out, rec.ops


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _map_casts(ops: list[str]) -> int:
    return ops.count("aten._to_copy")


# casts saved per attention block: DeiT's logits are bf16 (q @ k^T), so its softmax gradient
# goes out in bf16 too (both casts go); Swin's are float32 (q @ k^T plus the float32
# relative-position bias), its gradient goes out in float32 (out_dtype) and the cast of g up
# goes (its cast down for q @ k^T is stock's own)
@pytest.mark.parametrize("fused", [True, False], ids=["cpp-nodes", "python-functions"])
@pytest.mark.parametrize("family,device,saved", [
    ("deit", "cpu", 2), ("swin", "cpu", 1),
    pytest.param("deit", "cuda", 2, marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU visible")]),
], ids=["deit-emulated-cuda-autocast", "swin", "deit-cuda"])
def test_patched_attention_forward_is_stock_and_backward_drops_the_map_casts(family, device, saved, fused,
                                                                              monkeypatch):
    """A patched model (explicit attention, all ops) under autocast: the output equals the
    stock model's bit for bit, the gradients stay close to those of the former path (the map
    handed over in float32 and compressed in float32: ``autocast_dtype_for`` answering None;
    the 8-bit copy of the bf16-rounded map differs from it in a few codes), and its backward
    has ``saved`` casts fewer per attention block."""
    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)
    dtype = torch.bfloat16
    emulate = family == "deit" and device == "cpu"  # (real CUDA autocast on the GPU)
    stock = build(family, fused=False).to(device)
    handed = patch_model(copy.deepcopy(stock), ops=("all",), attention="explicit")
    former = copy.deepcopy(handed)
    x = inputs(family).to(device)
    out_stock, _ = _step(stock, x, dtype, emulate)
    out, ops = _step(handed, x, dtype, emulate)
    with monkeypatch.context() as m:
        m.setattr(attention_mod, "autocast_dtype_for", lambda t: None)
        out_former, ops_former = _step(former, x, dtype, emulate)
    assert torch.equal(out, out_stock) and torch.equal(out, out_former)
    g, g_former = grads(handed), grads(former)
    assert g.keys() == g_former.keys() and g
    for n in g:
        err = ((g[n] - g_former[n]).norm() / g_former[n].norm().clamp_min(1e-30)).item()
        assert err < REL_BOUND, (n, err)
    blocks = sum(isinstance(mod, mnn.Softmax) for mod in handed.modules())
    assert blocks >= 2
    assert _map_casts(ops_former) - _map_casts(ops) == saved * blocks, (_map_casts(ops_former), _map_casts(ops))


def test_compiled_step_equals_eager_with_the_map_handed_over():
    """torch.compile (aot_eager, fullgraph) of the patched DeiT under the emulated CUDA
    autocast: the output and gradients equal eager Mesa's bit for bit, and the backward
    graph calls ``mesa.softmax_backward`` with ``y_dtype`` float32."""
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    model = patch_model(build("deit", fused=False), ops=("all",), attention="explicit")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = inputs("deit")
    out, _ = _step(compiled, x, torch.bfloat16, emulate=True)
    out_eager, _ = _step(eager, x, torch.bfloat16, emulate=True)
    assert torch.equal(out, out_eager)
    g, g_eager = grads(model), grads(eager)
    for n in g_eager:
        assert torch.equal(g[n], g_eager[n]), n
    backward = "\n".join(gm.code for gm in graphs["backward"])
    assert "mesa.softmax_backward.default" in backward and "torch.float32)" in backward, backward
