"""Mesa ``MatMul(a, b, addend=m)``: ``torch.baddbmm(m, a, b)`` bit for bit (what
``nn.MultiheadAttention``'s explicit path computes with a mask), the operands kept 8-bit, the
gradients of ``a``, ``b`` and a learned ``m`` close to the stock op's, eager, under autocast
and compiled."""
import copy

import pytest
import torch

import mesa_train.nn as mnn

SHAPES = {"full": (6, 5, 7), "per_row_broadcast": (1, 5, 7), "per_key": (6, 1, 7)}


def _operands(addend_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 5, 8, generator=g).requires_grad_()
    b = torch.randn(6, 7, 8, generator=g).requires_grad_()  # (k; the product takes k^T, a view)
    m = torch.randn(addend_shape, generator=g).requires_grad_()
    return a, b, m


def _grads(fn, a, k, m):
    out = fn(a, k.transpose(-2, -1), m)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    return (out,) + torch.autograd.grad((out * w).sum(), (a, k, m))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matmul_with_addend_is_baddbmm(shape):
    layer = mnn.MatMul()
    a, b, m = _operands(SHAPES[shape])
    got = _grads(lambda a, b, m: layer(a, b, addend=m), a, b, m)
    want = _grads(lambda a, b, m: torch.baddbmm(m, a, b), a, b, m)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.shape == w.shape and torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.99
    assert layer.last_saved == ("int8", "int8") and layer.quantizer_a.initialized


def test_under_bf16_autocast_it_is_the_autocast_baddbmm():
    layer = mnn.MatMul()
    a, b, m = _operands(SHAPES["full"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda a, b, m: layer(a, b, addend=m), a, b, m)
        want = _grads(lambda a, b, m: torch.baddbmm(m, a, b), a, b, m)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])
    assert all(g.dtype == w.dtype == torch.float32 for g, w in zip(got[1:], want[1:]))


def test_compiled_matches_eager():
    layer = mnn.MatMul()
    twin = copy.deepcopy(layer)  # (the same estimates and rounding stream: the same codes)
    a, b, m = _operands(SHAPES["per_key"])
    want = _grads(lambda a, b, m: layer(a, b, addend=m), a, b, m)
    compiled = torch.compile(lambda a, b, m: twin(a, b, addend=m), backend="aot_eager", fullgraph=True)
    got = _grads(compiled, a, b, m)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w)
