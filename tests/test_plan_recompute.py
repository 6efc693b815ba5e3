"""The planner's ``recompute`` choice: a block checkpointed instead of compressed. Exact
(same forward, same gradients as stock, dropout on), same state_dict keys, less memory;
plans mix it with compression where that is predicted fastest; bad uses are refused."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import mesa_train
from mesa_train.models import build_model
from mesa_train.plan import OTHER, PlanError, allocate, make_batch, predict
from mesa_train.plan.allocate import lowest_bytes
from mesa_train.plan.measure import activation_bytes, gradients
from mesa_train.plan.profile import ItemProfile, Profile
from mesa_train.plan.recompute import is_recomputed
from mesa_train.plan.units import Unit


def tiny():
    torch.manual_seed(0)
    # timm's dropouts on: recomputation must replay the same masks
    return build_model("deit_ti", depth=2, embed_dim=32, num_heads=2, patch_size=8, img_size=32, num_classes=5,
                       fused_attn=False, drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)


def test_a_recomputed_block_is_exact_and_keeps_less(tmp_path):
    batch = make_batch(8, 32, 5, "cpu")
    stock, model = tiny(), tiny()
    mesa_train.patch_model(model, plan={"format": "mesa-train-plan/1", "layers": {"blocks.1": ["recompute"]}})
    assert is_recomputed(model.blocks[1]) and not is_recomputed(model.blocks[0])
    assert list(model.state_dict()) == list(stock.state_dict())
    torch.manual_seed(1)
    g_stock = gradients(stock, batch)
    torch.manual_seed(1)
    g_plan = gradients(model, batch)
    for a, b in zip(g_stock, g_plan):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert activation_bytes(model, batch) < activation_bytes(stock, batch)
    # timm's ModelEmaV3 deep-copies the model: the copy recomputes its own block
    ema = copy.deepcopy(model)
    assert ema.blocks[1].forward.args[0] is ema.blocks[1]


def test_recompute_cannot_be_mixed_or_put_outside_a_block():
    with pytest.raises(PlanError, match=r"layers \['blocks.0'\] both recompute and compress"):
        mesa_train.patch_model(tiny(), plan={"format": "mesa-train-plan/1",
                                             "layers": {"blocks.0": ["gelu", "recompute"]}})
    with pytest.raises(PlanError, match=r"ops these layers do not have.*\(other\): recompute"):
        mesa_train.patch_model(tiny(), plan={"format": "mesa-train-plan/1", "layers": {OTHER: ["recompute"]}})
    with pytest.raises(PlanError, match="valid ops: .*recompute"):
        mesa_train.patch_model(tiny(), plan={"format": "mesa-train-plan/1", "layers": {"blocks.0": ["recomp"]}})


def synthetic(items, recompute):
    """stock 1000 bytes, 1 s; ``recompute``: {unit: (saved, time)} for block units."""
    rows = [ItemProfile(u, op, s, t, g) for u, op, s, t, g in items]
    rows += [ItemProfile(u, "recompute", s, t, 0.0) for u, (s, t) in recompute.items()]
    units = sorted({r.unit for r in rows})
    return Profile("synthetic", "cpu", 1, 1, stock_activation_bytes=1000, stock_step_s=1.0, step_noise=0.0,
                   parameter_bytes=0, stock_peak_bytes=None, items=rows,
                   units=[Unit(u, tuple(op for v, op, *_ in items if v == u), "fp", u, recomputable=u in recompute)
                          for u in units])


def brute_force(profile, allowed):
    """Fastest feasible item set, recompute excluding the same unit's compression items."""
    best = None
    keys = [it.key for it in profile.items]
    for r in range(len(keys) + 1):
        for combo in itertools.combinations(keys, r):
            rec = {u for u, op in combo if op == "recompute"}
            if any(u in rec and op != "recompute" for u, op in combo):
                continue
            p = predict(profile, combo)
            if p.activation_bytes <= allowed and (best is None or p.step_s < best):
                best = p.step_s
    return best


def test_the_allocator_recomputes_where_that_is_cheaper_per_byte():
    # compressing a's linear costs 0.3 s for 300 bytes; recomputing b costs 0.1 s for 450
    prof = synthetic([("a", "linear", 300, 0.30, 1e-3), ("a", "gelu", 100, 0.05, 1e-3),
                      ("b", "linear", 300, 0.30, 1e-3), ("b", "gelu", 100, 0.05, 1e-3)],
                     {"a": (450, 0.10), "b": (450, 0.10)})
    chosen = allocate(prof, 500)
    assert ("a", "recompute") in chosen or ("b", "recompute") in chosen
    for allowed in (950, 800, 600, 500, 300, 150):
        chosen = allocate(prof, allowed)
        assert predict(prof, chosen).activation_bytes <= allowed
        assert not any(op != "recompute" and (u, "recompute") in chosen for u, op in chosen)
        assert predict(prof, chosen).step_s <= brute_force(prof, allowed) + 0.05  # greedy: near the optimum
    # recomputing both blocks and compressing nothing reaches 100 bytes; compression alone 200
    assert lowest_bytes(prof) == pytest.approx(100)
    with pytest.raises(PlanError, match=r"smallest any plan reaches is .*blocks recomputed"):
        allocate(prof, 50)


def test_without_recompute_items_the_allocator_is_unchanged():
    items = [("a", "linear", 300, 0.30, 1e-3), ("a", "gelu", 200, 0.02, 1e-3), ("b", "softmax", 100, 0.01, 1e-3)]
    plain, with_costly = synthetic(items, {}), synthetic(items, {"a": (500, 5.0), "b": (300, 5.0)})
    for allowed in (900, 700, 500):
        assert allocate(plain, allowed) == allocate(with_costly, allowed)  # recompute too slow to be chosen
