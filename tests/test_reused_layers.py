"""A module that one forward calls twice: its Mesa layers take per-sample ranges (patch/reuse.py).

One running range per quantizer averages the two calls' inputs, and the larger ones were
clamped (RegionViT's attention: a LayerNorm weight gradient at cosine 0.43). These tests
check the switch (found in the first training forward, made at the start of the next), the
gradients it gives, the one warning, activation checkpointing around it, and that the watch
lasts until the switch and no longer.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mesa_train.patch import patch_model
from mesa_train.patch.reuse import _start, keep_running_ranges, probe_reuse

from timm_zoo import build, example


class TwiceCalled(nn.Module):
    """One ``blk`` run on the input, then on a 30x larger copy of its output (the second
    call's Linear inputs lie far beyond the first call's range)."""

    def __init__(self, checkpointed=False):
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)
        self.checkpointed = checkpointed

    def run(self, x):
        if self.checkpointed:  # (non-reentrant: its recomputation must save what the forward saved)
            return checkpoint(self.blk, x, use_reentrant=False)
        return self.blk(x)

    def forward(self, x):
        return self.head(self.run(30 * self.run(x)))


class CalledOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.b = nn.Sequential(nn.Linear(32, 32), nn.GELU())

    def forward(self, x):
        return self.b(30 * self.a(x))


def _grads(model, x, steps=1):
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        out = model(x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _worst_cosine(got, want):
    return min(F.cosine_similarity(got[n].flatten().double(), want[n].flatten().double(), dim=0).item()
               for n in want)


def _watched(m):
    return any(h is _start for h in m._forward_pre_hooks.values())


def _estimators(model):
    return {n: m.quant_options.estimator for n, m in model.named_modules() if hasattr(m, "quant_options")}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_module_called_twice_takes_per_sample_ranges_from_the_second_step(checkpointed):
    torch.manual_seed(0)
    stock, x = TwiceCalled(checkpointed).train(), torch.randn(64, 32)
    want = _grads(copy.deepcopy(stock), x, steps=2)  # (no optimizer: every step's weights are the same)
    patched = patch_model(copy.deepcopy(stock), ops=["linear"])
    said = (r"blk \(Sequential, 2 calls\).*from the next training step their 1 Mesa layer\(s\) use "
            "estimator='per_sample'")
    with pytest.warns(UserWarning, match=said):
        _grads(patched, x, steps=1)
    # (the first step keeps its running ranges: a checkpoint recomputes its segments in backward)
    assert patched.blk[0].quant_options.estimator == "running" and _watched(patched)
    got = _grads(patched, x, steps=2)  # (steps 2 and 3, the switch at the start of step 2)
    assert patched.blk[0].quant_options.estimator == "per_sample"
    assert patched.blk[0].quantizer.options.estimator == "per_sample"
    assert patched.head.quant_options.estimator == "running" and not _watched(patched)
    assert _worst_cosine(got, want) > 0.999


def test_the_running_range_clamps_the_second_call_without_the_switch():
    """What the switch prevents, measured on the same model (keeps the test above honest)."""
    torch.manual_seed(0)
    stock, x = TwiceCalled().train(), torch.randn(64, 32)
    want = _grads(copy.deepcopy(stock), x, steps=3)
    patched = patch_model(copy.deepcopy(stock), ops=["linear"])
    keep_running_ranges(patched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _grads(patched, x, steps=3)
    assert set(_estimators(patched).values()) == {"running"}
    assert _worst_cosine(got, want) < 0.99  # one running range: the second call's inputs clamped


def test_layers_called_once_keep_running_ranges_and_nothing_is_said():
    torch.manual_seed(0)
    model = patch_model(CalledOnce().train())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(8, 32)).sum().backward()
    assert set(_estimators(model).values()) == {"running"}
    assert not _watched(model)  # the watch ends with the first training forward


def test_the_watch_waits_for_a_training_forward_with_gradients():
    torch.manual_seed(0)
    model = patch_model(TwiceCalled(), ops=["gelu"])
    x = torch.randn(8, 32)
    model.eval()(x)
    with torch.no_grad():
        model.train()(x)
    assert _watched(model) and model.blk[1].quant_options.estimator == "running"
    with pytest.warns(UserWarning, match="ran more than once"):
        model(x)
    model.eval()(x)  # (an evaluation between the steps switches nothing)
    assert _watched(model) and model.blk[1].quant_options.estimator == "running"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.train()(x).sum().backward()  # said once
    assert not _watched(model) and model.blk[1].quant_options.estimator == "per_sample"


def test_a_forward_that_raises_keeps_the_watch_for_the_next_one():
    torch.manual_seed(0)
    model = patch_model(TwiceCalled(), ops=["gelu"])
    with pytest.raises(RuntimeError):
        model(torch.randn(8, 31))
    assert not any(len(m._forward_pre_hooks) for m in model.modules() if m is not model)  # (counters gone)
    assert _watched(model)
    with pytest.warns(UserWarning, match="ran more than once"):
        model(torch.randn(8, 32))


class Interrupted(nn.Module):
    def forward(self, x):
        raise KeyboardInterrupt  # (Ctrl-C: torch's always-call hooks run for Exception only)


def test_an_interrupted_forward_leaves_no_session_behind():
    torch.manual_seed(0)
    model = patch_model(nn.Sequential(nn.Linear(32, 32), nn.GELU(), Interrupted()), ops=["gelu"])
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(8, 32))
    model[2] = nn.Identity()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stale session's counts are not this forward's: nothing reused
        model(torch.randn(8, 32))
    assert model[1].quant_options.estimator == "running" and not _watched(model)
    other = patch_model(TwiceCalled(), ops=["gelu"])
    with pytest.warns(UserWarning, match="ran more than once"):  # (another model is watched as usual)
        other(torch.randn(8, 32))


def test_a_deep_copy_watches_on_its_own():
    """ModelEmaV3 deep-copies the model: the copy's watch must not remove the original's hooks."""
    torch.manual_seed(0)
    model = patch_model(TwiceCalled(), ops=["gelu"])
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning):
        twin(torch.randn(8, 32))
    twin(torch.randn(8, 32))
    assert not _watched(twin) and twin.blk[1].quant_options.estimator == "per_sample"
    assert _watched(model) and model.blk[1].quant_options.estimator == "running"


def test_patching_again_and_patching_parts_first_give_one_watch():
    torch.manual_seed(0)
    model = TwiceCalled()
    patch_model(model.blk, ops=["gelu"])  # a part on its own: a call of it is one forward of it
    patch_model(model, ops=["linear"])
    patch_model(model, ops=["linear"])
    assert sum(h is _start for h in model._forward_pre_hooks.values()) == 1
    with pytest.warns(UserWarning) as said:
        model(torch.randn(8, 32))
    assert len([w for w in said if "ran more than once" in str(w.message)]) == 1
    model(torch.randn(8, 32))
    assert not _watched(model) and not _watched(model.blk)
    assert model.blk[0].quant_options.estimator == model.blk[1].quant_options.estimator == "per_sample"
    assert model.head.quant_options.estimator == "running"


def test_learned_thresholds_are_left_as_they_are():
    torch.manual_seed(0)
    model = patch_model(TwiceCalled(), ops=["gelu"], estimator="learned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(8, 32))
    assert model.blk[1].quant_options.estimator == "learned"


def test_keep_running_ranges_cancels_a_switch_found_already():
    torch.manual_seed(0)
    model = patch_model(TwiceCalled(), ops=["gelu"])
    with pytest.warns(UserWarning, match="keep_running_ranges"):
        model(torch.randn(8, 32))
    keep_running_ranges(model)
    model(torch.randn(8, 32))
    assert model.blk[1].quant_options.estimator == "running" and not _watched(model)


def test_a_plan_watches_the_whole_model():
    from mesa_train.plan import OTHER, Plan

    torch.manual_seed(0)
    model = TwiceCalled()
    patch_model(model, plan=Plan(layers={OTHER: ("linear",)}))
    assert _watched(model)
    with pytest.warns(UserWarning, match=r"blk \(Sequential, 2 calls\)"):
        model(torch.randn(8, 32))
    model(torch.randn(8, 32))
    assert not _watched(model) and not _watched(model.blk)
    assert model.blk[0].quant_options.estimator == "per_sample"


def test_timm_coat_shared_position_encodings_take_per_sample_ranges():
    """CoaT's serial blocks share one convolutional position encoding per stage (``cpe1``,
    ``crpe1``), called by each block."""
    model = patch_model(build("coat_lite_tiny")).train()
    with pytest.warns(UserWarning, match=r"cpe1 \(ConvPosEnc, 2 calls\)"):
        model(example("coat_lite_tiny"))
    model(example("coat_lite_tiny"))
    assert model.cpe1.proj.quant_options.estimator == "per_sample"
    assert model.serial_blocks1[0].mlp.fc1.quant_options.estimator == "running"


def test_mvitv2_rel_pos_einsum_called_for_rel_h_and_rel_w_is_not_reuse():
    """patch_model's own einsum child takes the same q twice (rel_h, then rel_w): one input,
    nothing to say, running ranges kept."""
    model = patch_model(build("mvitv2_tiny")).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(example("mvitv2_tiny"))
    assert model.stages[0].blocks[0].attn.mesa_einsum.quant_options.estimator == "running"


@pytest.mark.parametrize("part_first", [False, True], ids=["model", "attention_patched_first"])
def test_the_watched_forward_saves_what_later_ones_do_under_activation_checkpointing(part_first):
    """The hooks read no argument, so a patched ViT block still runs norm + qkv as one op in
    the watched forward: checkpointing's recomputation (no hooks then) saves the same tensors
    (it raised CheckpointError when the hooks turned the fused path off). Also when the
    attention was patched on its own first and holds a watch of its own."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2).train()
    if part_first:
        patch_model(model.blocks[0].attn)
    patch_model(model)
    model.set_grad_checkpointing(True)
    for _ in range(2):
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert not _watched(model)


# ---------------------------------------------------------------- the probe before training


class TwiceCalledWithNorm(TwiceCalled):
    """``TwiceCalled`` with a BatchNorm (its running statistics must not move in the probe),
    a dropout (no draw from the generator), a frozen part (its eval flag kept) and, optionally,
    a reentrant checkpoint (its segments run without gradients: the watch misses them)."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.1)
        self.reentrant = reentrant

    def run(self, x):
        if self.reentrant:
            return checkpoint(self.blk, x, use_reentrant=True)
        return self.blk(x)

    def forward(self, x):
        return self.head(self.drop(self.run(30 * self.run(self.bn(x)))))


def test_the_probe_switches_before_the_first_step_and_changes_nothing_else():
    torch.manual_seed(0)
    stock, x = TwiceCalledWithNorm().train(), torch.randn(64, 32)
    patched = patch_model(copy.deepcopy(stock), ops=["linear"])
    patched.bn.eval()  # (frozen: the probe gives each module its own flag back)
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"blk \(Sequential, 2 calls\).*from the first training step"):
        assert probe_reuse(patched, x[:1]) == ["blk.0"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in patched.state_dict().items())
    assert patched.training and not patched.bn.training and patched.blk.training
    assert patched.blk[0].quant_options.estimator == "per_sample" and _watched(patched)
    assert patched.head.quant_options.estimator == "running"
    stock.bn.eval()
    torch.manual_seed(1)  # (the same dropout masks: Mesa draws nothing from the generator)
    want = _grads(stock, x)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (said once, by the probe)
        got = _grads(patched, x)
    assert _worst_cosine(got, want) > 0.999  # the first step too (the watch's is clamped: < 0.99 above)
    assert not _watched(patched)  # (the watch found nothing more in the first training forward)


class ReusedInTrainingOnly(nn.Module):
    """``shared`` reused in every mode, ``aux`` only in training (an auxiliary branch): the
    probe sees the first, the watch of the first training forward the second."""

    def __init__(self):
        super().__init__()
        self.shared, self.aux, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = self.shared(30 * self.shared(x))
        if self.training:
            x = x + self.aux(30 * self.aux(x)).mean()
        return self.head(x)


def test_after_the_probe_the_watch_still_finds_reuse_in_training_only():
    torch.manual_seed(0)
    model = patch_model(ReusedInTrainingOnly().train(), ops=["linear"])
    x = torch.randn(8, 32)
    with pytest.warns(UserWarning, match=r"shared \(Linear, 2 calls\).*from the first training step"):
        assert probe_reuse(model, x[:1]) == ["shared"]
    with pytest.warns(UserWarning, match=r"ran more than once in one forward: aux \(Linear, 2 calls\)\. "):
        _grads(model, x)
    _grads(model, x)
    assert _estimators(model) == {"shared": "per_sample", "aux": "per_sample", "head": "running"}
    # (one eager step first, then the probe: the step's finding is kept for the next)
    model = patch_model(ReusedInTrainingOnly().train(), ops=["linear"])
    with pytest.warns(UserWarning, match="from the next training step"):
        _grads(model, x)
    probe_reuse(model, x[:1])
    _grads(model, x)
    assert _estimators(model) == {"shared": "per_sample", "aux": "per_sample", "head": "running"}


def test_a_part_of_a_patched_model_can_be_probed_and_keep_running_ranges_reaches_it():
    torch.manual_seed(0)
    model = patch_model(nn.Sequential(TwiceCalled(), nn.Linear(4, 2)).train(), ops=["linear"])
    with pytest.warns(UserWarning, match="ran more than once"):
        assert probe_reuse(model[0], torch.randn(1, 32)) == ["blk.0"]
    model = patch_model(nn.Sequential(TwiceCalled(), nn.Linear(4, 2)).train(), ops=["linear"])
    keep_running_ranges(model)
    assert probe_reuse(model[0], torch.randn(1, 32)) == [] and model[0].blk[0].quant_options.estimator == "running"


def test_the_probe_finds_reuse_inside_a_reentrant_checkpoint():
    torch.manual_seed(0)
    model = patch_model(TwiceCalledWithNorm(reentrant=True).train(), ops=["linear"])
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the training watch misses it: the segments run under no_grad
        model(x).sum().backward()
    assert model.blk[0].quant_options.estimator == "running" and not _watched(model)
    model = patch_model(TwiceCalledWithNorm(reentrant=True).train(), ops=["linear"])
    with pytest.warns(UserWarning, match="ran more than once"):
        assert probe_reuse(model, x) == ["blk.0"]


def test_the_probe_under_torch_compile_switches_what_the_watch_cannot():
    """A compiled model's forwards are traced, so the watch never counts: the probe, run before
    compiling, gives the compiled training its per-sample ranges from the first step."""
    torch.manual_seed(0)
    stock, x = TwiceCalled().train(), torch.randn(64, 32)
    want = _grads(copy.deepcopy(stock), x)
    unprobed = torch.compile(patch_model(copy.deepcopy(stock), ops=["linear"]), backend="aot_eager")
    probed = patch_model(copy.deepcopy(stock), ops=["linear"])
    with pytest.warns(UserWarning, match="ran more than once"):
        probe_reuse(probed, x[:1])
    probed = torch.compile(probed, backend="aot_eager")
    torch._dynamo.reset()
    for _ in range(2):
        assert _worst_cosine(_grads(unprobed, x), want) < 0.99  # no switch, step after step
    torch._dynamo.reset()
    assert _worst_cosine(_grads(probed, x), want) > 0.999
    assert probed._orig_mod.blk[0].quant_options.estimator == "per_sample"


def test_a_probe_that_finds_nothing_keeps_the_watch_and_keep_running_ranges_stops_it():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    model = patch_model(CalledOnce().train())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe_reuse(model, x) == []
    assert _watched(model)  # (a module reused in training only is still found by the first step)
    model = patch_model(TwiceCalled().train(), ops=["linear"])
    keep_running_ranges(model)
    assert probe_reuse(model, x) == [] and model.blk[0].quant_options.estimator == "running"


def test_the_training_run_probes_a_compiled_timm_coat(compose_train, tmp_path, aot_eager_compile):
    """trainer.compile=true on CoaT: the runner's probe switches the shared position encodings
    before the compiled steps (the watch alone left them on running ranges)."""
    from conftest import FAST_TRAINER
    from mesa_train.train.runner import fit

    model = ["model=deit_ti", "model.name=coat_lite_tiny", "model.img_size=32",
             "+model.kwargs.embed_dims=[8,16,16,16]", "+model.kwargs.serial_depths=[2,1,1,1]"]
    cfg = compose_train(model + FAST_TRAINER + ["mesa.enabled=true", "trainer.compile=true"])
    with pytest.warns(UserWarning, match=r"cpe1 \(ConvPosEnc, 2 calls\).*from the first training step"):
        summary = fit(cfg, str(tmp_path))
    assert summary["step"] == 2 and aot_eager_compile


def test_the_warning_points_at_the_users_call():
    """Raised from a hook inside torch's Module call, it names the line calling the model (or
    the probe), not torch's module.py."""
    x = torch.randn(2, 32)
    for call in (lambda m: m(x), lambda m: probe_reuse(m, x)):
        model = patch_model(TwiceCalled().train(), ops=["linear"])
        with pytest.warns(UserWarning, match="ran more than once") as said:
            call(model)
        assert [w.filename for w in said] == [__file__]


def test_a_resume_through_load_state_dict_takes_the_switch():
    """The switch is written in the layers' state_dict metadata (no tensor entry: the keys
    stay those of the model before the switch): a model patched afresh that loads the checkpoint,
    also through torch.save / torch.load(weights_only=True), runs the next step as the
    uninterrupted model does, bit for bit (it ran on clamped running ranges and warned again);
    a checkpoint from before (no switch) loads into a probed model and the other way round, the
    stock conversion loads into the stock model, and a model that keeps running ranges does not
    take the switch."""
    import io

    from mesa_train.patch.checkpoint import patched_to_stock_state_dict
    from mesa_train.train.checkpoint import load_model_state

    torch.manual_seed(0)
    stock, x = TwiceCalled().train(), torch.randn(3, 16, 32)
    model = patch_model(copy.deepcopy(stock))
    fresh_keys = set(model.state_dict())
    with pytest.warns(UserWarning, match="keep_running_ranges"):
        _grads(model, x[0])
    _grads(model, x[1])
    assert set(model.state_dict()) == fresh_keys  # (timm's ModelEmaV3 pairs state_dicts by position)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state._metadata["blk.0"]["per_sample_by_reuse"] is True
    resumed = patch_model(copy.deepcopy(stock))
    resumed.load_state_dict(state)
    assert _estimators(resumed) == _estimators(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing found again: the layers are per-sample already)
        got = _grads(resumed, x[2])
    want = _grads(model, x[2])
    assert all(torch.equal(got[n], want[n]) for n in want)
    older = patch_model(copy.deepcopy(stock)).state_dict()  # (no switch in it)
    load_model_state(resumed, older, "older.pt")
    load_model_state(patch_model(copy.deepcopy(stock)), state, "new.pt")
    for fresh in (None, patch_model(copy.deepcopy(stock))):
        TwiceCalled().load_state_dict(patched_to_stock_state_dict(state, fresh))
    kept = patch_model(copy.deepcopy(stock))
    keep_running_ranges(kept)
    kept.load_state_dict(state)
    assert kept.blk[0].quant_options.estimator == "running"


def test_an_ema_copy_follows_a_model_whose_reused_layers_switched():
    """timm's ModelEmaV3 pairs the two state_dicts' values by position: a tensor entry added at
    the switch misaligned every later one (a shape error, or silently the wrong averages)."""
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    model = patch_model(TwiceCalled()).train()
    ema = ModelEmaV3(model, decay=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="keep_running_ranges"):
        for _ in range(3):
            loss = model(torch.randn(8, 32)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update(model)
    assert model.blk[0].quant_options.estimator == "per_sample"
    for (n, p), q in zip(model.named_parameters(), ema.module.parameters()):
        assert q.shape == p.shape and not torch.equal(q, p), n  # (an average, of the right tensor)
