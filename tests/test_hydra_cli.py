"""Command-line mistakes before Hydra runs (mesa_train/hydra_cli.py): an unknown config option,
a key that is not a setting, an override that does not parse, each one line naming the valid
choices, exit status 2, and no run directory made. Before, Hydra printed 5-15 lines (its
search path, a stack-trace hint) with exit status 1 after making the directory."""
import sys

import pytest

from conftest import REPO
from mesa_train.hydra_cli import override_error

CONFIGS = str(REPO / "configs")
MODELS = "deit_b, deit_s, deit_ti, pvt_v2_b0, pvt_v2_b1, pvt_v2_b2, swin_b, swin_l, swin_s, swin_ti"


@pytest.mark.parametrize("args, expected", [
    (["model=bogus"], f"model=bogus: no such option in configs/model; valid: {MODELS}; "
                      "or any timm model by name: model.name=bogus"),
    (["data=imagenett"], "data=imagenett: no such option in configs/data (close: imagenet); "
                         "valid: cifar100, digits, imagenet, synthetic"),
    (["trainer.epochz=3"], "trainer.epochz=3: trainer has no setting 'epochz' (close: epochs)"),
    # a key train.py's groups do not have: '+' is refused too (the run's check_known_settings), so
    # not advised; the close names, or the valid keys where none is close
    (["mesa.bitz=4"], "mesa.bitz=4: mesa has no setting 'bitz' (close: bits)"),
    (["trainer.fsdp.xx=1"], "trainer.fsdp.xx=1: trainer.fsdp has no setting 'xx'; valid: reshard_after_forward, "
                            "cpu_offload"),
    (["epochs=3"], "epochs=3: the config has no setting 'epochs'; valid: name, model, data, mesa, optim, trainer, "
                   "logger"),
    # (a key of model.kwargs, {} by default: '+' adds it)
    (["model.kwargs.foo=1"], "model.kwargs.foo=1: model.kwargs has no setting 'foo'; a new key needs "
                             "+model.kwargs.foo=..."),
    # a group the config lacks: its close name, not Hydra's "Could not override 'dta.root'"
    (["dta.root=x"], "dta.root=x: the config has no group or setting 'dta' (close: data)"),
    # a preset typed as a timm model's name: the close timm names
    (["model=convnext_attto"], f"model=convnext_attto: no such option in configs/model; valid: {MODELS}; or any "
                               "timm model by name: model.name=convnext_attto (close: convnext_atto, convnextv2_atto, "
                               "convnext_atto_rms)"),
    (["mesa.ops=[gelu"], "cannot read the override 'mesa.ops=[gelu': no viable alternative at input '[gelu'"),
    # a path with '=' (a sweep job's folder): how to quote it (a list typed wrong above gets no such advice)
    (["trainer.resume=/runs/ops=[gelu],x/last.pt"],
     "cannot read the override 'trainer.resume=/runs/ops=[gelu],x/last.pt': mismatched input '=' expecting <EOF>; "
     "a value with = , [ ] ( ) { } or spaces is quoted: trainer.resume='/runs/ops=[gelu],x/last.pt' (in a shell: "
     "\"trainer.resume='/runs/ops=[gelu],x/last.pt'\")"),
    # (a quote in it: quoting with ' would not read either; no advice)
    (["data.root=/data/it's=x"], "cannot read the override \"data.root=/data/it's=x\": LexerNoViableAltException: "
                                 "data.root=/data/it's=x; ^"),
    # a sweep: each option of a config group's sweep, the rest at its first value
    (["-m", "model=deit_s,bogus2", "mesa.decay=0,0.9"], f"model=bogus2: no such option in configs/model; "
                                                         f"valid: {MODELS}; or any timm model by name: "
                                                         "model.name=bogus2"),
    (["mesa.decay=0,0.9"], "mesa.decay=0,0.9: several values sweep only with -m (--multirun); a list is written "
                           "mesa.decay=[...], a text with a comma quoted: mesa.decay='...'"),
    (["-m", "mesa.decayy=0,0.9"], "mesa.decayy=0,0.9: mesa has no setting 'decayy' (close: decay)"),
])
def test_a_mistake_is_one_line_naming_the_valid_choices(args, expected):
    assert override_error(CONFIGS, "train", args) == expected


@pytest.mark.parametrize("key", ["mesa.bitz", "epochs", "dta.root", "trainer.fsdp.xx", "model.kwargs.foo",
                                 "model.pretrained_pth"])
def test_plus_is_advised_only_where_the_run_takes_the_key(compose_train, key):
    """'+mesa.bitz=4', advised for mesa.bitz=4, was then refused ("mesa.bitz is not a setting")."""
    from mesa_train.train.config import ConfigError, check_known_settings

    advised = "a new key needs +" in override_error(CONFIGS, "train", [f"{key}=1"])
    try:
        check_known_settings(compose_train([f"+{key}=1"]))
        taken = True
    except ConfigError:
        taken = False
    assert advised == taken


# evaluate.py: the model and its Mesa layout are the checkpoint's ('+model.img_size=64', advised by
# Hydra, was then refused: "model is not a setting of evaluate.py")
EVAL_KEYS = "checkpoint, ema, output, data, trainer"


@pytest.mark.parametrize("args, expected", [
    (["model.img_size=64"], "model.img_size=64: evaluate.py takes the model and Mesa settings from the checkpoint; "
                            f"valid keys: {EVAL_KEYS}"),
    (["model.name=deit_s"], "model.name=deit_s: evaluate.py takes the model and Mesa settings from the checkpoint; "
                            f"valid keys: {EVAL_KEYS}"),
    (["mesa.bits=4"], "mesa.bits=4: evaluate.py takes the model and Mesa settings from the checkpoint; "
                      f"valid keys: {EVAL_KEYS}"),
    (["data.rooot=x"], "data.rooot=x: data has no setting 'rooot' (close: root)"),
    (["optim.lr=0.1"], f"optim.lr=0.1: the config has no group or setting 'optim'; valid: {EVAL_KEYS}"),
])
def test_evaluate_says_what_comes_from_the_checkpoint(args, expected):
    assert override_error(CONFIGS, "eval", ["checkpoint=x.pt", *args]) == expected


@pytest.mark.parametrize("args", [
    [], ["model=deit_s", "trainer.epochs=2", "mesa.ops=[gelu,softmax]"], ["+model.kwargs.foo=1"],
    ["~trainer.checkpoint_every"], ["-m", "model=deit_ti,deit_s", "mesa.decay=0,0.9", "trainer.epochs=range(1,3)"],
    ["hydra.run.dir=/tmp/x", "hydra/job_logging=default"],  # (Hydra's own settings: Hydra's to check)
    ["trainer.epochs=abc"],  # (a bad value is config.validate's, with its own line)
    ["--cfg", "job", "model=bogus"],  # (a flag other than -m: Hydra's)
    ["-m", "model=glob(deit_*)"],  # (a glob sweep: Hydra's)
])
def test_what_hydra_accepts_or_handles_itself_passes(args):
    assert override_error(CONFIGS, "train", args) is None


def test_each_command_exits_2_with_one_line_and_no_run_directory(tmp_path, run_cli):
    commands = [
        ([sys.executable, str(REPO / "train.py"), "model=bogus"], "error: model=bogus: no such option"),
        ([sys.executable, str(REPO / "evaluate.py"), "checkpointt=x.pt"],
         "error: checkpointt=x.pt: the config has no setting 'checkpointt' (close: checkpoint)"),
        ([sys.executable, str(REPO / "evaluate.py"), "checkpoint=x.pt", "model.img_size=64"],
         "error: model.img_size=64: evaluate.py takes the model and Mesa settings from the checkpoint; valid keys: "),
        ([sys.executable, str(REPO / "train.py"), "dta.root=x"],
         "error: dta.root=x: the config has no group or setting 'dta' (close: data)\n"),
        ([sys.executable, "-m", "mesa_train.bench", "preset=cpu-quik"],
         "mesa_train.bench: error: preset=cpu-quik: no such option in configs/bench/preset (close: cpu-quick"),
        ([sys.executable, "-m", "mesa_train.plan", "budgett=0.5"],
         "mesa_train.plan: error: budgett=0.5: the config has no setting 'budgett' (close: budget"),
    ]
    for args, expected in commands:
        result = run_cli(args, cwd=tmp_path, PYTHONPATH=str(REPO))
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (Hydra made outputs/<date>/<time> first)


def test_a_null_model_name_is_refused_in_a_line_not_a_traceback(tmp_path, run_cli):
    """model.name=null passed Hydra and failed in is_known_model (AttributeError: 'NoneType' object
    has no attribute 'split', Hydra's traceback, exit 1); now a config error like any other value's."""
    result = run_cli([sys.executable, str(REPO / "train.py"), "model.name=null"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "  - model.name=None must be a model name: a short name (deit_ti" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "AttributeError" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (Hydra's run directory, made first, removed)


def test_under_torchrun_one_rank_says_a_mistake_every_rank_makes(tmp_path, run_cli):
    """Each rank printed the same line (twice for 2 processes, run together at times); rank 0
    alone says a mistake of the command line or the config, every rank exits 2."""
    for rank, said in (("0", True), ("1", False)):
        result = run_cli([sys.executable, str(REPO / "train.py"), "model=bogus"], cwd=tmp_path, RANK=rank,
                         WORLD_SIZE="2")
        assert result.returncode == 2, result.stderr[-2000:]
        assert (result.stderr.startswith("error: model=bogus") if said else result.stderr == ""), result.stderr
    # (RANK set outside torchrun, by some other launcher, with no WORLD_SIZE: the line is said)
    result = run_cli([sys.executable, str(REPO / "train.py"), "model=bogus"], cwd=tmp_path, RANK="3")
    assert result.returncode == 2 and result.stderr.startswith("error: model=bogus"), result.stderr
    result = run_cli([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(REPO / "train.py"),
                      "trainer.epochs=abc", "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path,
                     timeout=300)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if "trainer.epochs='abc' must be an integer" in line]
    assert len(said) == 1, result.stderr[-3000:]


def test_a_run_refused_at_start_up_leaves_no_directory_it_made(tmp_path, run_cli):
    """A bad value passes Hydra and is refused by the run's checks: the run directory Hydra made
    (outputs/<date>/<time>, empty: .hydra/ is written after the checks) is removed with the
    folders it made; a folder that existed before, even empty, stays."""
    (tmp_path / "outputs" / "2026-01-01" / "old").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    for extra in ([], ["hydra.run.dir=mine"]):
        result = run_cli([sys.executable, str(REPO / "train.py"), "trainer.epochs=abc", *extra], cwd=tmp_path)
        assert result.returncode == 2 and "trainer.epochs='abc' must be an integer >= 1" in result.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "mine", "outputs", "outputs/2026-01-01", "outputs/2026-01-01/old"]
