"""torch.compile of a small Mesa block runs forward and backward on CPU.

The Mesa layers are traced with the rest (no graph break: rounding seeds are device-side,
the compression is plain PyTorch under the compiler; see tests/test_compile_fullgraph.py).
The default test uses ``backend="aot_eager"`` (about 6 s on 2 busy cores); the inductor
variant takes about a minute there, so it only runs with ``MESA_SLOW_TESTS=1`` (or when a
GPU is present).
"""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from mesa_train.nn.testing import TinyBlock

warnings.filterwarnings("ignore", message=".*compiled extension.*")

RUN_SLOW = os.environ.get("MESA_SLOW_TESTS") == "1"


def _check(backend, device="cpu"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = TinyBlock(dim=16, heads=2, mlp_ratio=2, mesa=True).to(device)
    stock = TinyBlock(dim=16, heads=2, mlp_ratio=2, mesa=False).to(device)
    stock.load_state_dict(block.state_dict(), strict=False)
    compiled = torch.compile(block, backend=backend)
    x = torch.randn(2, 8, 16, device=device)
    t0 = time.perf_counter()
    for _ in range(2):  # the second call reuses the compiled graphs
        xc = x.clone().requires_grad_()
        y = compiled(xc)
        y.sum().backward()
    elapsed = time.perf_counter() - t0
    xs = x.clone().requires_grad_()
    y0 = stock(xs)
    y0.sum().backward()
    torch.testing.assert_close(y, y0)
    assert (xc.grad - xs.grad).norm() / xs.grad.norm() < 0.05
    for p, p0 in zip(block.parameters(), stock.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all()
    # every quantizer ran (av.quantizer_a is unused: av reuses the Softmax's compressed copy)
    quantizers = [q for n, q in block.named_modules() if n.endswith("quantizer") or n == "qk.quantizer_a"
                  or n.endswith("quantizer_b")]
    assert len(quantizers) == 11 and all(bool(q.initialized) for q in quantizers)
    assert not bool(block.av.quantizer_a.initialized)
    print(f"\ntorch.compile(backend={backend!r}) on {device}: compile + 2 steps {elapsed:.1f} s")


def test_compile_block_aot_eager():
    _check("aot_eager")


@pytest.mark.slow
@pytest.mark.skipif(not RUN_SLOW, reason="inductor compile takes ~1 min on 2 CPU cores; set MESA_SLOW_TESTS=1")
def test_compile_block_inductor_cpu():
    _check("inductor")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compile_block_inductor_cuda():
    _check("inductor", "cuda")
