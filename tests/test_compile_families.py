"""torch.compile of timm families beyond DeiT / Swin / PVT-v2 (scripts/compile_sweep.py found
them failing): each block compiled on its own, ``fullgraph=True``, backend ``aot_eager``,
against eager Mesa on the zoo sizes of tests/test_timm_models.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mesa_train.compile_scope import compile_model
from mesa_train.nn import input_copy
from mesa_train.patch import patch_model

from timm_zoo import build, example


def _step(model, x):
    out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach()


def _compiled_and_eager(name, **options):
    """(compiled per block, eager copy, stock) of the zoo's ``name`` after one training step each,
    and the compiled forward's output equality with eager Mesa's."""
    torch.manual_seed(0)
    stock = build(name)
    x = example(name)
    model = patch_model(copy.deepcopy(stock), ops=("all",), **options)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compile_model(model, "blocks", backend="aot_eager")
    # compiled graphs keep each parallel layer's own copy: so do the eager twin and what of the
    # model runs eager around its compiled blocks (a stem, here)
    with input_copy.disabled():
        out = _step(model, x)
        assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
        assert torch.equal(out, _step(eager, x))
    _step(stock, x)
    return model, eager, stock


@pytest.mark.parametrize("name", ["mobilenetv3_small_050", "ghostnet_050"])
def test_inplace_relu_compiles(name):
    """An in-place Mesa ReLU returns its dirty input object itself (Dynamo refused the
    Function: "mark_dirty input not returned"); gradients bit for bit eager Mesa's."""
    model, eager, _ = _compiled_and_eager(name)
    want = dict(eager.named_parameters())
    assert all(torch.equal(p.grad, want[n].grad) for n, p in model.named_parameters())


@pytest.mark.parametrize("name", ["fastvit_t8", "repvit_m1"])
def test_scale_branches_compile_bitwise_eager_mesa(name):
    """A 1x1 depthwise conv normalised by a BatchNorm (RepVGG / MobileOne scale branch) hands
    its weight gradient over through a Python link in eager mode, which a traced Function may
    not mutate ("HOP: Unsafe side effect"). Under compile the pair runs as one Function
    (``batchnorm._ScaleBranchFn``) with the same hand-over inside its backward: gradients bit
    for bit eager Mesa's (until session 47 the branch ran stock under compile, kept its inputs
    in full precision, and its conv weights were 0.07-0.4 off stock's by other layers' noise)."""
    model, eager, _ = _compiled_and_eager(name)
    assert [n for n, m in model.named_modules() if m.__dict__.get("_mesa_scale_bn") is not None]
    want = dict(eager.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n].grad), n


def test_scale_branch_compiled_keeps_what_eager_keeps():
    """The pair keeps the conv's 8-bit input and the BatchNorm's 8-bit x_hat compiled as eager
    (compiled whole, aot_eager: ``mesa_train.memory_compiled``); it kept both inputs in full
    precision before (FastViT 1.35x of eager's bytes, this test failed at 1.35)."""
    from mesa_train.memory_compiled import compiled_saved_bytes
    from mesa_train.patch.report import measure_saved_bytes

    stock, x = build("fastvit_t8"), example("fastvit_t8")
    model = patch_model(copy.deepcopy(stock))
    twin = copy.deepcopy(model)
    with input_copy.disabled():  # (compiled graphs keep each parallel layer's own copy)
        eager = measure_saved_bytes(model, x).activation_bytes
    torch._dynamo.reset()
    # (the min-cut partitioner recomputes a few cheap ops, and keeps two per-channel vectors a
    # BatchNorm where eager keeps three, invstd and x_hat's code moments: 1.9% less)
    assert 0.97 * eager <= compiled_saved_bytes(twin, x) <= eager


def test_logits_modified_in_place_compile():
    """MViTv2 adds its relative positions into the attention logits in place; under compile the
    generic attention hands it a new tensor, not the traced Function's output (a view of a
    multi-output node to Dynamo: "Observed exception"). Bit for bit eager Mesa."""
    model, eager, _ = _compiled_and_eager("mvitv2_tiny")
    want = dict(eager.named_parameters())
    assert all(torch.equal(p.grad, want[n].grad) for n, p in model.named_parameters())


def test_relu_mask_of_a_channels_last_tensor_compiles():
    """PoolFormerV2's StarReLU under compile: its ReLU mask is packed from a contiguous uint8
    copy, not a reshape that was traced as a view of a tensor whose runtime strides differ
    ("view size is not compatible"). With round-to-nearest (stochastic rounding hashes the
    element index of channels-last tensors in another order eager and compiled) the gradients
    are eager Mesa's up to float32 rounding."""
    model, eager, _ = _compiled_and_eager("poolformerv2_s12", rounding="nearest")
    want = dict(eager.named_parameters())
    scale = max(p.grad.abs().max().item() for p in want.values())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n].grad, rtol=1e-4, atol=1e-6 * scale)


def test_sweep_script_writes_its_table_and_names_the_valid_models(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    script = str(root / "scripts" / "compile_sweep.py")
    out = tmp_path / "sweep.md"
    proc = subprocess.run([sys.executable, script, "vit_tiny_patch16_224", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, _, row = out.read_text().splitlines()
    assert header.startswith("| model | blocks | graphs | breaks | forward | gradients | stock gradients |")
    assert row.startswith("| vit_tiny_patch16_224 | 2 | 1 | 0 | equal | equal | equal |")
    bad = subprocess.run([sys.executable, script, "no_such_model"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "unknown model(s) no_such_model; valid: vit_tiny_patch16_224" in bad.stdout
