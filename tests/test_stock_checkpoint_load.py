"""A patched model's own ``load_state_dict`` takes a stock checkpoint (patch/checkpoint.py,
``accept_stock_checkpoints``): users and timm's ``load_checkpoint`` call it, not our
``load_stock_checkpoint``. Before, a strict load raised torch's list of missing
``quantizer.*`` keys. A checkpoint with some Mesa entries is still loaded as given."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

from mesa_train.patch import load_stock_checkpoint, mesa_state_keys, patch_model
from mesa_train.patch.checkpoint import _complete_stock_checkpoint

from test_patch_helpers import build, inputs


def _trained_patched(seed=0):
    """A patched tiny DeiT whose estimates have seen a batch (initialized, alpha/beta set)."""
    patched = patch_model(build("deit", fused=False, seed=seed))
    patched(inputs("deit")).sum().backward()
    return patched


def _estimates(model):
    keys = mesa_state_keys(model)
    return {k: v.clone() for k, v in model.state_dict().items() if k in keys}


def test_plain_load_state_dict_equals_load_stock_checkpoint():
    source = build("deit", fused=False, seed=3)  # the stock model whose weights are loaded
    a, b = _trained_patched(), _trained_patched()
    with pytest.warns(UserWarning, match=r"without Mesa estimates .* start their estimates from the next batch"):
        result = a.load_state_dict(source.state_dict())  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    load_stock_checkpoint(b, source.state_dict())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # the weights arrived, and every estimate restarts (initialized False, alpha = beta = 0)
    assert torch.equal(sa["head.weight"], source.state_dict()["head.weight"])
    inits = [v for k, v in _estimates(a).items() if k.endswith(".initialized")]
    assert inits and not any(bool(v.any()) for v in inits)


def test_the_warning_names_the_line_that_loaded():
    patched = _trained_patched()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched.load_state_dict(build("deit", fused=False).state_dict())
    assert len(caught) == 1 and caught[0].filename == __file__


@pytest.mark.parametrize("wrap", ["container", "compile"])
def test_under_a_wrapper_prefix(wrap):
    """DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes: the hook sees its prefix."""
    source = build("deit", fused=False, seed=3)
    patched = _trained_patched()
    if wrap == "container":
        outer, prefix = nn.Sequential(patched), "0."
    else:
        outer, prefix = torch.compile(patched), "_orig_mod."
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        outer.load_state_dict({prefix + k: v for k, v in source.state_dict().items()})
    assert not any(bool(v.any()) for k, v in _estimates(patched).items() if k.endswith(".initialized"))


def test_a_patched_checkpoint_missing_estimates_is_still_an_error():
    """Only a checkpoint with no Mesa entry at all is taken for a stock one: a patched
    checkpoint with a quantizer's entries missing fails strictly, as before."""
    patched = _trained_patched()
    sd = patched.state_dict()
    dropped = [k for k in sd if k.startswith("blocks.0.attn.qkv.quantizer.")]
    assert dropped
    for k in dropped:
        del sd[k]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*blocks\.0\.attn\.qkv\.quantizer"):
        patched.load_state_dict(sd)


def test_a_non_strict_load_restarts_the_estimates_too():
    """``strict=False`` (fine-tuning from stock weights without the head): torch does not tell
    the hooks, and new weights want new estimates anyway; no Mesa key is listed missing."""
    patched = _trained_patched()
    sd = {k: v for k, v in build("deit", fused=False, seed=3).state_dict().items() if not k.startswith("head.")}
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        result = patched.load_state_dict(sd, strict=False)
    assert sorted(result.missing_keys) == ["head.bias", "head.weight"]
    assert not any(bool(v.any()) for k, v in _estimates(patched).items() if k.endswith(".initialized"))


def test_a_partial_load_leaves_the_estimates_as_they_are():
    """A head alone (``strict=False``) is no stock checkpoint: the trained estimates stay, rng
    counters too, and torch lists them missing as every key the load lacks."""
    patched = _trained_patched()
    before = _estimates(patched)
    head = {k: v for k, v in build("deit", fused=False, seed=3).state_dict().items() if k.startswith("head.")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = patched.load_state_dict(head, strict=False)
    assert {k for k in before if not k.endswith(".rng")} <= set(result.missing_keys)  # (rng: optional, older files)
    for k, v in _estimates(patched).items():
        assert torch.equal(v, before[k]), k


def test_half_of_a_small_model_is_no_stock_checkpoint():
    """Two of four weights (a conv + GELU + conv model's head): more than half is the rule."""
    model = patch_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.Conv2d(8, 4, 1)))
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    before = _estimates(model)
    head = {k: v for k, v in model.state_dict().items() if k.startswith("2.") and "quantizer" not in k}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(head, strict=False)
    for k, v in _estimates(model).items():
        assert torch.equal(v, before[k]), k


def test_a_stock_checkpoint_in_a_non_default_format():
    """The format record (bits=4) is the model's own in the fresh entries."""
    source = build("deit", fused=False, seed=3)
    patched = patch_model(build("deit", fused=False), bits=4)
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        patched.load_state_dict(source.state_dict())
    patched(inputs("deit")).sum().backward()


def test_a_patched_checkpoint_keeps_its_estimates():
    trained = _trained_patched()
    other = patch_model(build("deit", fused=False, seed=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stock-checkpoint warning for a patched one
        other.load_state_dict(trained.state_dict())
    want, got = _estimates(trained), _estimates(other)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_a_stock_model_is_left_alone_and_repatching_keeps_one_hook():
    stock = build("deit", fused=False)
    assert not _hooked(stock)
    patched = patch_model(copy.deepcopy(stock), ops=["gelu"])
    patch_model(patched, ops=["softmax"])  # again: still one hook, on the root
    assert _hooked(patched) == [""]


def test_a_plan_hooks_the_whole_model_only():
    """A plan patches block by block; each block's hook gives way to the root's, so a
    checkpoint is judged stock or patched as a whole."""
    import mesa_train
    from mesa_train.plan import find_units

    model = build("deit", fused=False)
    layers = {u.name: list(u.ops) for u in find_units(copy.deepcopy(model))}
    mesa_train.patch_model(model, plan={"format": "mesa-train-plan/1", "layers": layers})
    assert _hooked(model) == [""]
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        model.load_state_dict(build("deit", fused=False, seed=3).state_dict())


def _hooked(model):
    return [n for n, m in model.named_modules()
            if any(getattr(h, "hook", None) is _complete_stock_checkpoint
                   for h in m._load_state_dict_pre_hooks.values())]


def test_timm_load_checkpoint(tmp_path):
    """timm's own loader (``strict=True``) on a patched model, from a stock model's file."""
    from timm.models import load_checkpoint

    source = build("deit", fused=False, seed=3)
    path = tmp_path / "stock.pth"
    torch.save({"state_dict": source.state_dict()}, path)
    patched = _trained_patched()
    with pytest.warns(UserWarning, match="without Mesa estimates"):
        load_checkpoint(patched, str(path))
    patched.eval()
    source.eval()
    x = inputs("deit")
    with torch.no_grad():
        assert torch.equal(patched(x), source(x))


def test_a_load_started_at_a_part_takes_a_stock_checkpoint_of_that_part():
    """A stock backbone's weights into a patched detector's backbone (here: one block of a
    patched DeiT): before session 82 only the root had the hook, and this strict load raised
    torch's list of missing ``quantizer.*`` keys. The part's estimates restart; the rest stay."""
    source = build("deit", fused=False, seed=3)
    patched = _trained_patched()
    before = _estimates(patched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = patched.blocks[0].load_state_dict(source.blocks[0].state_dict())  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert len(caught) == 1 and "without Mesa estimates" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert torch.equal(patched.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    for k, v in _estimates(patched).items():
        if k.startswith("blocks.0."):
            assert not k.endswith(".initialized") or not v.any(), k  # restarted
        else:
            assert torch.equal(v, before[k]), k  # untouched


def test_a_whole_model_load_warns_once_and_a_part_s_partial_load_is_left_alone():
    patched = _trained_patched()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched.load_state_dict(build("deit", fused=False, seed=3).state_dict())
    assert len(caught) == 1  # the root's hook; the parts' hooks see a prefix and stand aside
    patched = _trained_patched()
    before = _estimates(patched)
    qkv_only = {k: v for k, v in build("deit", fused=False, seed=3).blocks[0].state_dict().items()
                if k.startswith("attn.qkv.")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched.blocks[0].load_state_dict(qkv_only, strict=False)  # 2 of the block's weights: partial
    for k, v in _estimates(patched).items():
        assert torch.equal(v, before[k]), k


def test_repatching_keeps_one_part_hook_per_part():
    from mesa_train.patch.checkpoint import _complete_stock_part

    patched = patch_model(build("deit", fused=False), ops=["gelu"])
    patch_model(patched, ops=["softmax"])
    for name, m in patched.named_modules():
        n = sum(getattr(h, "hook", None) is _complete_stock_part for h in m._load_state_dict_pre_hooks.values())
        assert n <= 1, name
    assert sum(getattr(h, "hook", None) is _complete_stock_part
               for h in patched.blocks[0]._load_state_dict_pre_hooks.values()) == 1
