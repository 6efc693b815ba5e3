"""trainer.strategy=fsdp in one process (a one-rank group): config refusals, the sharded
checkpoint and its conversion to one file and back, evaluation of either."""
import os

import pytest
import torch
import torch.distributed as dist

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train import checkpoint as ckpt_lib
from mesa_train.train.config import ConfigError, validate
from mesa_train.train.convert import convert, main as convert_main
from mesa_train.train.runner import fit, resume_path

FSDP = TINY_MODELS["deit"] + FAST_TRAINER + ["mesa.enabled=true", "trainer.strategy=fsdp"]


@pytest.mark.parametrize("override, message", [
    (["trainer.strategy=zero3"], "trainer.strategy='zero3' is not valid; choose one of: ddp, fsdp"),
    (["trainer.strategy=fsdp", "optim.ema=true"], "optim.ema=true is not supported with trainer.strategy=fsdp"),
    (["trainer.strategy=fsdp", "trainer.compile=true"],
     "trainer.compile=true with trainer.strategy=fsdp needs trainer.compile_scope=blocks"),
    (["trainer.strategy=fsdp", "trainer.compile=true", "trainer.compile_scope=blocks",
      "trainer.compile_mode=reduce-overhead"],
     "trainer.compile_mode=reduce-overhead captures CUDA graphs, which trainer.strategy=fsdp does not support"),
    (["trainer.strategy=fsdp", "trainer.device=cpu", "trainer.fsdp.cpu_offload=true"],
     "trainer.fsdp.cpu_offload=true needs a GPU"),
    (["trainer.fsdp.reshard_after_forward=maybe"], "trainer.fsdp.reshard_after_forward='maybe' must be true or false"),
])
def test_bad_strategy_settings_are_one_line_errors(compose_train, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate(compose_train(TINY_MODELS["deit"] + override))


def test_resume_path_must_match_the_strategy(compose_train, tmp_path):
    (tmp_path / "a.dcp").mkdir()
    (tmp_path / "b.pt").write_bytes(b"x")
    with pytest.raises(ckpt_lib.CheckpointError, match="python -m mesa_train.train.convert .*b.pt .*b.dcp"):
        resume_path(compose_train(FSDP + [f"trainer.resume={tmp_path / 'b.pt'}"]), str(tmp_path))
    with pytest.raises(ckpt_lib.CheckpointError, match="resume it with trainer.strategy=fsdp"):
        resume_path(compose_train(TINY_MODELS["deit"] + [f"trainer.resume={tmp_path / 'a.dcp'}"]), str(tmp_path))


def _tensors_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_one_process_sharded_checkpoint_converts_both_ways(compose_train, tmp_path, capsys):
    from mesa_train.train.evaluation import evaluate_checkpoint

    run = tmp_path / "run"
    summary = fit(compose_train(FSDP), str(run))
    assert not dist.is_initialized()  # the one-rank group the run made is gone
    assert summary["step"] == 2 and summary["strategy"] == "fsdp"
    last = run / "checkpoints" / "last.dcp"
    assert sorted(os.listdir(last)) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert os.path.isdir(run / "checkpoints" / "best.dcp") and not os.path.exists(run / "checkpoints" / "last.pt")
    again = fit(compose_train(FSDP), str(run))  # resume=auto finds last.dcp at max_steps
    assert again["step"] == 2 and again["top1"] == summary["top1"]
    # a crash between save_sharded's two renames leaves last.dcp.old only: resume takes it
    os.replace(last, str(last) + ".old")
    assert resume_path(compose_train(FSDP), str(run)) == str(last) + ".old"
    os.replace(str(last) + ".old", last)

    assert convert_main([str(last), str(tmp_path / "one.pt")]) == 0
    assert "sharded -> single file" in capsys.readouterr().out
    one = ckpt_lib.load_checkpoint(str(tmp_path / "one.pt"))
    assert one["config"]["trainer"]["strategy"] == "ddp" and one["state"]["step"] == 2
    assert any(k.endswith("quantizer.beta") for k in one["model"]) and len(one["optimizer"]["state"]) > 0
    convert(str(tmp_path / "one.pt"), str(tmp_path / "back.dcp"))
    convert(str(tmp_path / "back.dcp"), str(tmp_path / "two.pt"))
    two = ckpt_lib.load_checkpoint(str(tmp_path / "two.pt"))
    assert _tensors_equal(one["model"], two["model"])
    assert all(_tensors_equal(one["optimizer"]["state"][i], two["optimizer"]["state"][i])
               for i in one["optimizer"]["state"])
    assert one["scheduler"] == two["scheduler"] and one["rng"][0]["python"] == two["rng"][0]["python"]

    from mesa_train.train.errors import RunDirError

    with pytest.raises(RunDirError, match="checkpoints/last.dcp"):  # a fresh start never replaces it ...
        fit(compose_train(FSDP + ["trainer.resume=null"]), str(run))
    with pytest.raises(RunDirError, match="checkpoints/last.dcp"):  # ... nor resumes it under DDP
        fit(compose_train(FSDP[:-1]), str(run))

    from_file = evaluate_checkpoint(str(tmp_path / "one.pt"), device="cpu", num_workers=0)
    from_dcp = evaluate_checkpoint(str(last), device="cpu", num_workers=0)
    assert from_file["loss"] == from_dcp["loss"] and from_file["top1"] == summary["top1"]


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert convert_main([str(tmp_path / "missing.dcp"), str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: no such checkpoint: {tmp_path / 'missing.dcp'}"
    (tmp_path / "junk.dcp").mkdir()
    assert convert_main([str(tmp_path / "junk.dcp"), str(tmp_path / "x.pt")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err


def test_checkpoints_from_before_the_strategy_setting_still_resume(compose_train):
    cfg = ckpt_lib.to_plain(compose_train(TINY_MODELS["deit"]))
    old = {**cfg, "trainer": {k: v for k, v in cfg["trainer"].items() if k not in ("strategy", "fsdp")}}
    assert ckpt_lib.changed_settings(old, cfg) == []
    fsdp = ckpt_lib.to_plain(compose_train(TINY_MODELS["deit"] + ["trainer.strategy=fsdp"]))
    assert ckpt_lib.changed_settings(old, fsdp) == ["trainer.strategy: 'ddp' -> 'fsdp'"]


def test_blocks_of_each_family_and_mixed_precision_from_amp(compose_train):
    from mesa_train.train import distributed as dist_utils
    from mesa_train.train.fsdp import apply_fsdp, transformer_blocks
    from mesa_train.train.model import build

    counts = {}
    for family in ("deit", "swin", "pvt"):
        model = build(compose_train(TINY_MODELS[family] + ["mesa.enabled=true"]), 10)
        counts[family] = [type(b).__name__ for b in transformer_blocks(model)]
    # (patched: the blocks' Mesa subclasses, patch/block.py)
    assert counts == {"deit": ["MesaViTBlock"] * 2, "swin": ["MesaSwinBlock"] * 2, "pvt": ["MesaPvtV2Block"] * 4}

    own = dist_utils.init_single_process_group()
    try:
        model = build(compose_train(TINY_MODELS["deit"] + ["mesa.enabled=true"]), 10)
        apply_fsdp(model, param_dtype=torch.bfloat16)  # what trainer.amp=bf16 gives
        seen = []
        model.blocks[0].mlp.fc1.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 3, 32, 32)).float().sum().backward()
        assert seen == [torch.bfloat16]  # gathered for compute in bf16 ...
        assert all(p.dtype == torch.float32 for p in model.parameters())  # ... sharded masters stay fp32
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        q = model.blocks[0].mlp.fc1.quantizer
        assert q.alpha.dtype == torch.float32 and bool(q.initialized)  # Mesa estimates untouched by it
    finally:
        if own:
            dist_utils.cleanup()


def test_fsdp_trains_with_blocks_compiled(compose_train, tmp_path, aot_eager_compile):
    """trainer.strategy=fsdp with trainer.compile=true trainer.compile_scope=blocks: each block
    compiled in place inside its FSDP unit (as torchtitan does), one graph for the identical
    blocks, no graph break (fullgraph), and the sharded checkpoint written as without compile.
    torch.compile runs with backend aot_eager here (traced like Inductor, no code generation)."""
    calls = aot_eager_compile
    run = tmp_path / "run"
    summary = fit(compose_train(FSDP + ["trainer.compile=true", "trainer.compile_scope=blocks"]), str(run))
    assert summary["step"] == 2 and summary["strategy"] == "fsdp"
    assert len(calls) >= 2 and all(c["fullgraph"] for c in calls)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert sorted(os.listdir(run / "checkpoints" / "last.dcp")) == [".metadata", "__0_0.distcp", "meta.pt"]

