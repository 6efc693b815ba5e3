"""The command line after issue 11: a sweep survives a failing job and still writes its
summary, Ctrl-C saves and exits 130 with one line, evaluate.py speaks train.py's option
names, and --help lists only what each script takes."""
import csv
import os
import signal
import subprocess
import sys
import time

from conftest import FAST_TRAINER, REPO, TINY_MODELS, cli_env

TRAIN, EVALUATE = str(REPO / "train.py"), str(REPO / "evaluate.py")


def test_sweep_with_a_failing_job_runs_the_rest_and_marks_it(tmp_path, run_cli):
    sweep = tmp_path / "sweep"
    result = run_cli([sys.executable, TRAIN, "-m", f"hydra.sweep.dir={sweep}", *TINY_MODELS["deit"],
                      *FAST_TRAINER, "mesa.decay=1.5,0.5"], cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "1 of 2 jobs failed" in result.stderr
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert [r["overrides"] for r in rows] == ["mesa.decay=1.5", "mesa.decay=0.5"]
    assert rows[0]["status"] == "failed" and "mesa.decay=1.5 must be a number in [0, 1)" in rows[0]["error"]
    assert rows[1]["status"] == "stopped at max_steps=2" and float(rows[1]["top1"]) >= 0
    table = (sweep / "summary.md").read_text()
    assert "| failed |" in table and "mesa.decay=1.5 must be" in table
    assert not (sweep / "0" / "checkpoints").exists()


def test_ctrl_c_saves_last_pt_and_exits_130_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, TRAIN, f"hydra.run.dir={run_dir}", *TINY_MODELS["deit"], *FAST_TRAINER,
            "trainer.max_steps=100000", "data.train_size=4096", "trainer.epochs=1"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    steps = run_dir / "steps.csv"
    deadline = time.time() + 240
    while time.time() < deadline and (not steps.exists() or len(steps.read_text().splitlines()) < 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last_line = err.strip().splitlines()[-1]
    assert (last_line.startswith("error: interrupted at step ")
            and "last.pt; run the same command to resume" in last_line)
    from mesa_train.train.checkpoint import load_checkpoint

    step = load_checkpoint(str(run_dir / "checkpoints" / "last.pt"))["state"]["step"]
    assert f"interrupted at step {step} " in last_line and step >= 2


def test_ctrl_c_in_a_sweep_marks_the_job_interrupted_and_the_table_says_so(tmp_path):
    """The summary showed the interrupted job as failed and read like a whole sweep (its
    'overrides of every job' those of the jobs that had run)."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, TRAIN, "-m", f"hydra.sweep.dir={sweep}", *TINY_MODELS["deit"], *FAST_TRAINER,
            "trainer.max_steps=100000", "data.train_size=4096", "trainer.epochs=1", "mesa.decay=0.9,0.5"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    steps = sweep / "0" / "steps.csv"
    deadline = time.time() + 240
    while time.time() < deadline and (not steps.exists() or len(steps.read_text().splitlines()) < 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "interrupted")], rows
    assert rows[0]["error"].startswith("interrupted at step ")
    table = (sweep / "summary.md").read_text()
    assert table.startswith("**Interrupted**: a stop signal ended the sweep; the jobs after the last row did not run. "
                            f"To go on, run the same command with hydra.sweep.dir={sweep} ")
    assert "Overrides of every job so far: `" in table and "| interrupted |" in table


def test_evaluate_without_checkpoint_and_the_help_texts(tmp_path):
    runs = {
        "no_checkpoint": [sys.executable, EVALUATE, f"hydra.run.dir={tmp_path / 'e'}"],
        "eval_help": [sys.executable, EVALUATE, "--help"],
        "train_help": [sys.executable, TRAIN, "--help"],
    }
    procs = {k: subprocess.Popen(v, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, v in runs.items()}
    results = {k: p.communicate(timeout=240) + (p.returncode,) for k, p in procs.items()}
    out, err, code = results["no_checkpoint"]
    assert code == 2 and err.strip() == ("error: evaluate.py needs checkpoint=PATH (a last.pt or best.pt written by "
                                         "train.py, e.g. outputs/<date>/<time>/checkpoints/best.pt); see python "
                                         "evaluate.py --help")
    out, err, code = results["eval_help"]
    assert code == 0 and "trainer.batch_size" in out and "data.root" in out
    assert "bench" not in out and "mesa:" not in out.split("checkpoint:")[0]
    out, err, code = results["train_help"]
    assert code == 0 and "model       deit_ti" in out and "experiment" in out
    assert "bench" not in out and "preset" not in out


def test_evaluate_cli_uses_trainer_names_and_data_values(tmp_path, run_cli):
    from mesa_train.train.runner import fit

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=TINY_MODELS["deit"] + FAST_TRAINER)
    summary = fit(cfg, str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    eval_dir = tmp_path / "eval"
    result = run_cli([sys.executable, EVALUATE, f"checkpoint={ckpt}", "data.val_size=8", "trainer.num_workers=0",
                      "trainer.device=cpu", "trainer.batch_size=3", f"hydra.run.dir={eval_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    metrics = json.load(open(eval_dir / "eval.json"))
    assert metrics["top1"] == summary["top1"] and metrics["images"] == 8 and metrics["amp"] == "none"
    log_text = (eval_dir / "evaluate.log").read_text()
    assert "evaluating" in log_text and f"top1 {metrics['top1']:.2f}" in log_text
    # a bad trainer value is named with train.py's name
    result = run_cli([sys.executable, EVALUATE, f"checkpoint={ckpt}", "trainer.amp=fp8",
                      f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path)
    assert result.returncode == 2 and "trainer.amp='fp8' is not valid" in result.stderr
    assert "Traceback" not in result.stderr
    assert os.path.exists(ckpt)


def test_rejected_run_leaves_the_run_directory_untouched(tmp_path, run_cli):
    run_dir = tmp_path / "run"
    base = [sys.executable, TRAIN, f"hydra.run.dir={run_dir}", *TINY_MODELS["deit"], *FAST_TRAINER]
    first = run_cli(base, cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "train.log").exists()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = run_cli(base + ["optim.lr=0.5", "trainer.max_steps=4"], cwd=tmp_path, timeout=240)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert "cannot resume from" in second.stderr and "optim.lr: None -> 0.5" in second.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # .hydra/config.yaml, train.log, logs and checkpoints as they were
