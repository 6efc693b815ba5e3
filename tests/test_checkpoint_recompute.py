"""Activation checkpointing (timm's ``set_grad_checkpointing``, ``torch.utils.checkpoint``):
a checkpointed step updates every quantizer's state once, as the same step without
checkpointing does (``mesa_train/nn/checkpoint_phase.py``).

Before, a non-reentrant checkpoint's recomputation in backward compressed again with the
quantizers' own state: the running estimates took each batch twice (decay 0.81 where 0.9 was
set), the rounding counter advanced by two, learned thresholds took two Adam steps.
"""
import copy

import pytest
import timm
import torch
from torch.utils.checkpoint import checkpoint

import mesa_train
from mesa_train.nn.quantizer import ActivationQuantizer
from mesa_train.nn.checkpoint_phase import recomputing

from kernel_marks import DEVICES


def test_the_recomputation_is_told_apart_on_this_torch():
    """Pins how torch marks a non-reentrant recomputation (its saved-tensor hooks): a torch that
    renames them fails here, instead of updating the state twice again without a word."""
    seen = []

    def segment(x):
        seen.append(recomputing())
        return (x * 2).sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(segment, x, use_reentrant=False).sum().backward()
    checkpoint(segment, x, use_reentrant=True).sum().backward()  # (its first pass runs under no_grad)
    segment(x).sum().backward()
    assert seen == [False, True, False, False, False]


def _vit(**options):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                              drop_rate=0.1, drop_path_rate=0.1)
    mesa_train.patch_model(model, ops=["all"], **options)
    return model.train()


def _state(model):
    return {name: t.clone() for name, t in model.named_buffers() if "quantizer" in name}


def _steps(model, checkpointing: str, steps: int = 2):
    if checkpointing == "timm":
        model.set_grad_checkpointing(True)
    for step in range(steps):
        torch.manual_seed(10 + step)
        x = torch.randn(4, 3, 32, 32)
        if checkpointing == "reentrant":  # (each block its own segment)
            h = model.patch_drop(model.pos_drop(model._pos_embed(model.patch_embed(x))))
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=True)
            out = model.forward_head(model.norm(h))
        else:
            out = model(x)
        model.zero_grad()
        out.square().sum().backward()
    return _state(model), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


@pytest.mark.parametrize("options", [{}, {"estimator": "delayed"}, {"estimator": "learned", "bits": 4},
                                     {"bits": 4}], ids=["running", "delayed", "learned-4bit", "4bit"])
@pytest.mark.parametrize("checkpointing", ["timm", "reentrant"])
def test_a_checkpointed_step_updates_the_state_once(checkpointing, options):
    plain = _vit(**options)
    ckpt = copy.deepcopy(plain)
    want, want_grads = _steps(plain, "none")
    got, got_grads = _steps(ckpt, checkpointing)
    assert want.keys() == got.keys() and len(want) > 20
    moved = [n for n in want if "rng" in n and int(want[n][1]) == 2]
    assert moved, "no quantizer compressed"
    for name in want:
        assert torch.equal(got[name], want[name]), name
    min_cos = 0.999 if options.get("bits", 8) == 8 else 0.99  # (two roundings of 4-bit codes: more noise)
    for name, g in want_grads.items():
        assert _cos(got_grads[name], g) > min_cos, name


def test_the_recomputation_draws_the_seed_its_forward_drew():
    """With the estimates of the forward (per-sample ranges: the batch's own), the recomputed
    codes are the forward's bit for bit, so the checkpointed gradients are the plain ones."""
    plain = _vit(estimator="per_sample")
    ckpt = copy.deepcopy(plain)
    _, want = _steps(plain, "none", steps=1)
    _, got = _steps(ckpt, "timm", steps=1)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_scratch_state_leaves_the_quantizer_alone():
    q = ActivationQuantizer()
    x = torch.randn(4, 8)
    q.compress(x, 1)
    before = {n: t.clone() for n, t in q.named_buffers()}

    def segment(t):
        q.compress(t.detach(), 1)
        return t.sin()

    t = torch.randn(4, 8, requires_grad=True)
    checkpoint(segment, t, use_reentrant=False).sum().backward()  # (forward: one update; recompute: none)
    assert int(q.rng[1]) == int(before["rng"][1]) + 1


def _mlp(device="cpu", **options):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(device)
    return mesa_train.patch_model(net, **options).train()


@pytest.mark.parametrize("device", DEVICES)  # (on a GPU: the scratch state and kept counters on the device)
def test_a_module_called_twice_in_a_segment_draws_each_calls_seed(device):
    """The recomputation used the counter one step back for every call, so both calls of a module
    used twice in a checkpointed segment drew the second call's seed (gradients off by 0.4%)."""
    plain = _mlp(device, estimator="per_sample")
    ckpt = copy.deepcopy(plain)
    x = torch.randn(8, 16, device=device)
    plain(plain(x)).square().sum().backward()
    checkpoint(lambda t: ckpt(ckpt(t)), x, use_reentrant=False).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert _state(plain).keys() == _state(ckpt).keys()
    for name, t in _state(plain).items():
        assert torch.equal(_state(ckpt)[name], t), name


@pytest.mark.parametrize("device", DEVICES)
def test_selective_checkpointing_replays_the_forward(device):
    """torch's selective activation checkpointing (context_fn) replays the forward's ops exactly:
    the scratch copies made in the recomputation failed it ("aten.clone.default encountered
    during backward but not found in storage")."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    for policy in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE):
        plain = _mlp(device)
        ckpt = copy.deepcopy(plain)
        x = torch.randn(8, 16, device=device)
        plain(x).square().sum().backward()
        context = functools.partial(create_selective_checkpoint_contexts, lambda *args, **kwargs: policy)
        checkpoint(ckpt, x, use_reentrant=False, context_fn=context).square().sum().backward()
        for name, t in _state(plain).items():
            assert torch.equal(_state(ckpt)[name], t), name
        for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
            assert _cos(q.grad, p.grad) > 0.999, name


def test_blocks_compiled_on_their_own_inside_checkpointing_are_refused():
    """Each block's compiled graph ran again in the eager recomputation and wrote the state
    (counters 2 where the unchecked run has 1); compiled as one model it is updated once."""
    from mesa_train.compile_scope import compile_model

    model = _vit()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="compile scope 'blocks' with activation checkpointing.*valid choices: "
                                         "compile scope 'model'"):
        compile_model(model, "blocks", backend="aot_eager")
    stock = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5)
    stock.set_grad_checkpointing(True)
    compile_model(stock, "blocks", backend="aot_eager")  # (no Mesa layer: nothing to update twice)
