"""The command line: bad overrides fail cleanly, a 2-job sweep writes its summary, and
torchrun with 2 CPU processes (gloo) shares one run directory."""
import csv
import glob
import json
import os
import subprocess
import sys

from conftest import FAST_TRAINER, REPO, TINY_MODELS, cli_env

TRAIN = str(REPO / "train.py")


def test_bad_overrides_exit_nonzero_with_a_clear_message(tmp_path):
    cases = {
        # (hydra_cli: one line, before Hydra, which listed the options in 15 lines)
        "unknown_model": (["model=vgg16"], "error: model=vgg16: no such option in configs/model; valid: deit_b, "
                                           "deit_s, deit_ti, pvt_v2_b0, pvt_v2_b1, pvt_v2_b2, swin_b, swin_l, swin_s, "
                                           "swin_ti; or any timm model by name: model.name=vgg16\n"),
        "unknown_op": (["mesa.ops=[gelu,bogus]"], "valid ops: linear, matmul, softmax"),
        "missing_data": (["data=cifar100", f"data.root={tmp_path / 'no_data'}"],
                         "cifar-100-python/{train,test,meta}"),
    }
    procs = {}
    for name, (overrides, _) in cases.items():  # in parallel: each pays the import cost
        args = [sys.executable, TRAIN, f"hydra.run.dir={tmp_path / name}", *FAST_TRAINER, *overrides]
        procs[name] = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    for name, (_, needle) in cases.items():
        out, err = procs[name].communicate(timeout=240)
        print(f"--- {name} ---\n{err[-600:]}")
        assert procs[name].returncode != 0, f"{name}: exit code 0\n{out}\n{err}"
        assert needle in out + err, f"{name}: message without {needle!r}:\n{out}\n{err}"
        assert "Traceback" not in err, f"{name}: traceback instead of a message:\n{err}"
        assert not glob.glob(str(tmp_path / name / "**" / "*.pt"), recursive=True), f"{name} wrote a checkpoint"


def test_sweep_writes_a_summary_of_all_jobs(tmp_path, run_cli):
    sweep = tmp_path / "sweep"
    result = run_cli([sys.executable, TRAIN, "-m", f"hydra.sweep.dir={sweep}", *TINY_MODELS["deit"],
                      *FAST_TRAINER, "mesa.enabled=false,true"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert [r["overrides"] for r in rows] == ["mesa.enabled=False", "mesa.enabled=True"]  # what varies
    assert all(r["status"] == "stopped at max_steps=2" and float(r["top1"]) >= 0 for r in rows)
    assert int(rows[1]["saved_bytes"]) < int(rows[0]["saved_bytes"])  # Mesa saves memory
    table = (sweep / "summary.md").read_text()
    assert table.startswith("Overrides of every job: `model=deit_ti") and "| job | overrides |" in table


def test_torchrun_two_cpu_processes_share_one_run_dir(tmp_path, run_cli):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result = run_cli([torchrun, "--standalone", "--nproc_per_node=2", TRAIN, *TINY_MODELS["deit"],
                      *FAST_TRAINER, "trainer.log_every=1"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = glob.glob(str(tmp_path / "outputs" / "*" / "*"))
    assert len(run_dirs) == 1, run_dirs  # Hydra did not make one directory per rank
    run_dir = run_dirs[0]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["world_size"] == 2 and summary["batch_size_total"] == 8 and summary["step"] == 2
    assert summary["buffers_consistent"] is True  # Mesa estimates identical on both ranks
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "last.pt"))
    ckpt_rngs = __import__("torch").load(os.path.join(run_dir, "checkpoints", "last.pt"), weights_only=True)["rng"]
    assert len(ckpt_rngs) == 2  # every rank's RNG state, for an exact resume
    steps = list(csv.DictReader(open(os.path.join(run_dir, "steps.csv"))))
    assert [r["step"] for r in steps] == ["1", "2"]  # only rank 0 logs
    assert open(os.path.join(run_dir, "train.log")).read().count("run directory:") == 1


def test_under_torchrun_a_rank_says_its_own_failure(tmp_path, run_cli):
    """A corrupt image read by one rank's shard only: that rank says it, prefixed with its rank
    when it is not rank 0, once and in one line (rank 0 alone says a config mistake; this
    failure rank 0 never saw was silenced by that rule at first)."""
    from conftest import write_image_folder

    data = write_image_folder(tmp_path / "data")
    (data / "train" / "cat" / "0.jpg").write_bytes(b"not an image")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result = run_cli([torchrun, "--standalone", "--nproc_per_node=2", TRAIN, *TINY_MODELS["deit"], *FAST_TRAINER,
                      "data=imagenet", f"data.root={data}", "data.num_classes=null", "data.train_size=null",
                      "data.val_size=null", "trainer.max_steps=null", "trainer.epochs=1", "trainer.batch_size=2",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if "cannot read image" in line]
    assert len(said) == 1, result.stderr[-3000:]
    assert said[0].startswith(("error: cannot read image", "[rank 1] error: cannot read image")), said
    assert "0.jpg" in said[0]
    # (the other rank, when its collective fails before torchrun stops it, says so in one line)
    assert "Error executing job" not in result.stderr and "RuntimeError: [" not in result.stderr, \
        result.stderr[-3000:]
