"""A Mesa training step adds no host synchronisation on a GPU (``cuda``-marked).

On the H100 (results/gpu-session/README.md) the fused-attention eager row took 52 ms a step
against 32.5 ms of GPU time, while stock's step took 34 ms: a host read inside a Mesa layer
(an ``.item()``, a device-to-host copy, a ``nonzero``) would make the host wait for the GPU at
every layer and the GPU for the host after it. The op-level tests (``test_observe.py``,
``test_kernels.py``) check single ops; this checks a whole patched model's step, eager, bf16
autocast, against the stock model's under ``torch.cuda.set_sync_debug_mode("warn")``: Mesa may
add no synchronising call (each warning names the call and where it came from).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_patch_helpers import OPSETS, build, inputs

from mesa_train.patch import patch_model


def _step(model, x) -> None:
    """Forward and backward of one training step, the loss kept on the device."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def _syncs(model, x) -> list[str]:
    """The synchronising CUDA calls of one step after two warm-up steps (the first step
    initialises the estimates and whatever is created lazily)."""
    for _ in range(2):
        _step(model, x)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(model, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("estimator", ["running", "delayed"])
@pytest.mark.parametrize("opset", list(OPSETS))
def test_eager_train_step_adds_no_host_sync(opset, estimator):
    stock = build("deit", fused=(opset == "sdpa")).cuda()
    mesa = patch_model(copy.deepcopy(stock), ops=OPSETS[opset], estimator=estimator)
    x = inputs("deit").cuda()
    base, got = _syncs(stock, x), _syncs(mesa, x)
    assert len(got) <= len(base), "Mesa's step synchronises where stock's does not:\n" + "\n".join(got)
