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
    (tmp_path / "a.dcp" / "meta.pt").write_bytes(b"x")
    (tmp_path / "b.pt").write_bytes(b"x")
    with pytest.raises(ckpt_lib.CheckpointError, match="python -m mesa_train.train.convert .*b.pt .*b.dcp"):
        resume_path(compose_train(FSDP + [f"trainer.resume={tmp_path / 'b.pt'}"]), str(tmp_path))
    with pytest.raises(ckpt_lib.CheckpointError, match="resume it with trainer.strategy=fsdp"):
        resume_path(compose_train(TINY_MODELS["deit"] + [f"trainer.resume={tmp_path / 'a.dcp'}"]), str(tmp_path))


@pytest.mark.parametrize("strategy, inside, named", [
    ("ddp", ["checkpoints/last.pt", "checkpoints/best.pt"], "checkpoints/last.pt"),
    ("fsdp", ["checkpoints/last.dcp/meta.pt"], "checkpoints/last.dcp"),
    ("ddp", ["last.pt"], "last.pt"),
    ("ddp", ["train.log"], None),
])
def test_resume_from_a_folder_that_is_not_a_checkpoint(compose_train, tmp_path, strategy, inside, named):
    """A run directory (or its checkpoints/) given as trainer.resume is not called a sharded
    checkpoint: the error names the checkpoint inside it to resume from instead, if any."""
    run = tmp_path / "run"
    for rel in inside:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b"x")
    cfg = compose_train((FSDP if strategy == "fsdp" else TINY_MODELS["deit"]) + [f"trainer.resume={run}"])
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        resume_path(cfg, str(tmp_path / "new"))
    text = str(err.value)
    assert text.startswith(f"trainer.resume='{run}' is a folder, not a checkpoint") and "\n" not in text
    if named:
        assert text.endswith(f"did you mean trainer.resume={run / named}?")
    else:
        assert "last.pt, or a sharded folder, last.dcp/, with meta.pt inside" in text


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
    with pytest.raises(RunDirError, match="Continue it with trainer.strategy=fsdp"):  # ... nor resumes it
        fit(compose_train(FSDP[:-1]), str(run))  # under DDP (it said to resume=auto, which needs a last.pt)
    with pytest.raises(ckpt_lib.CheckpointError, match=r"model.pretrained_path=.*last.pt \(a file: make it with "
                                                        r"python -m mesa_train.train.convert .*last.dcp"):
        fit(compose_train(FSDP + ["optim.lr=1e-4"]), str(run))  # (a .dcp is no pretrained_path)

    from_file = evaluate_checkpoint(str(tmp_path / "one.pt"), device="cpu", num_workers=0)
    from_dcp = evaluate_checkpoint(str(last), device="cpu", num_workers=0)
    assert from_file["loss"] == from_dcp["loss"] and from_file["top1"] == summary["top1"]


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert convert_main([str(tmp_path / "missing.dcp"), str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: no such checkpoint: {tmp_path / 'missing.dcp'}"
    (tmp_path / "junk.dcp").mkdir()
    assert convert_main([str(tmp_path / "junk.dcp"), str(tmp_path / "x.pt")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("src, dst, message", [
    ("a.dcp", "kept.pt", "kept.pt already exists (a file); convert never writes over a path"),
    ("a.pt", "kept.dcp", "kept.dcp already exists (a directory); convert never writes over a path"),
    ("a.pt", "out.pt", "out.pt: a single-file checkpoint becomes a DCP directory; name it e.g. last.dcp"),
    ("a.dcp", "out.dcp", "out.dcp: a sharded checkpoint becomes one file; name it e.g. last.pt"),
    ("a.pt", "no/such/dir/out.dcp", "no such directory: "),
])
def test_convert_never_writes_over_or_beside_a_checkpoint(tmp_path, capsys, src, dst, message):
    """A destination that exists is refused and left as it was (a checkpoint there would be
    lost), as are a name of the other format and a folder that does not exist (no tree of
    folders made where a typo pointed)."""
    (tmp_path / "a.dcp").mkdir()
    (tmp_path / "a.pt").write_bytes(b"source")
    (tmp_path / "kept.pt").write_bytes(b"an earlier checkpoint")
    (tmp_path / "kept.dcp").mkdir()
    (tmp_path / "kept.dcp" / "meta.pt").write_bytes(b"an earlier checkpoint")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert convert_main([str(tmp_path / src), str(tmp_path / dst)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "kept.pt").read_bytes() == b"an earlier checkpoint"


def test_a_convert_that_runs_out_of_disk_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """DCP wraps a rank's failed write in a CheckpointException of many lines: convert says the
    file system's reason in one line and removes DCP's temporary folder."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from mesa_train.train import convert as convert_mod

    def full_disk(src, dst):
        folder, name = os.path.split(dst)
        os.makedirs(os.path.join(folder, f".{name}.tmp"))
        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), traceback.StackSummary())})

    monkeypatch.setattr(convert_mod, "file_to_sharded", full_disk)
    (tmp_path / "a.pt").write_bytes(b"source")
    assert convert_main([str(tmp_path / "a.pt"), str(tmp_path / "out.dcp")]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'out.dcp'}: No space left on device\n"
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]


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



def test_a_sharded_save_that_runs_out_of_disk_raises_the_os_error(tmp_path, monkeypatch):
    """Under FSDP a full disk inside DCP's save (its CheckpointException, a BaseException that the
    trainer's error handling would not see) comes out as the OSError it wraps, as a .pt save's
    does, with the temporary folder removed and the previous checkpoint kept."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from mesa_train.train import sharded

    def full_disk(state, checkpoint_id):
        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), traceback.StackSummary())})

    monkeypatch.setattr(dcp, "save", full_disk)
    (tmp_path / "last.dcp").mkdir()
    (tmp_path / "last.dcp" / "meta.pt").write_bytes(b"the previous checkpoint")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(OSError, match="No space left on device"):
        sharded.save_sharded(str(tmp_path / "last.dcp"), model, None, {})
    assert sorted(os.listdir(tmp_path)) == ["last.dcp"]
    assert (tmp_path / "last.dcp" / "meta.pt").read_bytes() == b"the previous checkpoint"


def test_damaged_shards_are_a_checkpoint_error(tmp_path):
    """A shard file cut short (a copy interrupted, a disk error) is a one-line CheckpointError
    naming the checkpoint, not DCP's multi-rank traceback."""
    from mesa_train.train import sharded

    torch.manual_seed(0)
    sharded.save_sharded(str(tmp_path / "last.dcp"), torch.nn.Linear(64, 64), None, {})
    shard = next(p for p in (tmp_path / "last.dcp").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        sharded.load_sharded(str(tmp_path / "last.dcp"), torch.nn.Linear(64, 64))
    assert str(tmp_path / "last.dcp") in str(err.value) and "\n" not in str(err.value)
    assert "shards damaged" in str(err.value)
