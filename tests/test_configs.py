"""Every config group option and every experiment preset composes and passes the
start-up checks; config names agree with the code."""

import pytest
from omegaconf import OmegaConf

from conftest import CONFIGS
from mesa_train.models import MODEL_NAMES
from mesa_train.train import config as config_lib

GROUPS = ["model", "data", "mesa", "optim", "trainer", "logger"]


def options(group):
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_groups_are_complete():
    assert set(options("model")) == set(MODEL_NAMES)
    assert set(options("data")) == set(config_lib.DATASETS)
    assert {"deit", "cifar100"} <= set(options("optim"))
    assert {"default", "wandb"} <= set(options("logger"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_group_option_composes(compose_train, group, option):
    cfg = compose_train([f"{group}={option}"])
    config_lib.validate(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    # and the option is the one composed: its own plain values are the group's
    own = OmegaConf.to_container(OmegaConf.load(CONFIGS / group / f"{option}.yaml"), resolve=False)
    for key, value in own.items():
        if key != "defaults" and not (isinstance(value, str) and "${" in value):
            assert plain[group][key] == value, (group, option, key)


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_composes(compose_train, name):
    cfg = compose_train([f"experiment={name}"])
    config_lib.validate(cfg)
    config_lib.check_known_settings(cfg)  # (a preset sets only settings that exist)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["name"] == name  # presets name their runs
    assert cfg.data.name in config_lib.DATASETS
    if name.endswith("_mesa") or "_mesa_" in name:
        assert cfg.mesa.enabled
    if name.endswith("_baseline"):
        assert not cfg.mesa.enabled



def test_a_setting_added_with_plus_must_exist(compose_train):
    """Hydra refuses an unknown key given without '+', but '+mesa.decya=0.5' is added and was
    then ignored: refused for a new run, naming the close setting; dicts given to a setting
    whose default is null (mesa.plan), and every default, pass."""
    config_lib.check_known_settings(compose_train([]))
    cfg = compose_train(["+mesa.decya=0.5", "+trainer.fsdp.cpu_ofload=true", "+trainer.bogus=1"])
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.check_known_settings(cfg)
    lines = str(err.value).splitlines()[1:]
    assert lines == ["  - trainer.fsdp.cpu_ofload is not a setting (close: fsdp.cpu_offload); all: "
                     "configs/trainer/default.yaml",
                     "  - trainer.bogus is not a setting; all: configs/trainer/default.yaml",
                     "  - mesa.decya is not a setting (close: decay); all: configs/mesa/default.yaml"]
    config_lib.check_known_settings(compose_train(["mesa.plan={layers: {}}", "trainer.fsdp={}"]))


def test_every_group_and_the_top_level_refuse_a_setting_that_does_not_exist(compose_train):
    """'+model.pretrained_pth=w.pt' was added and ignored: the run trained from random weights
    while its user thought it fine-tuned. Every setting group is checked against all its option
    files (a key of another option passes), and the top level against the groups; timm's free
    model.kwargs and every option's own keys pass."""
    cfg = compose_train(["+model.pretrained_pth=w.pt", "+optim.lrr=0.5", "+data.rooot=x",
                         "+logger.wandb_projet=x", "+seed=5"])
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.check_known_settings(cfg)
    lines = str(err.value).splitlines()[1:]
    assert lines[0] == "  - seed is not a setting; top-level keys: name, trainer, mesa, model, data, optim, logger"
    assert "  - model.pretrained_pth is not a setting (close: pretrained_path); all: configs/model/*.yaml" in lines
    assert any(line.startswith("  - optim.lrr is not a setting (close: lr") for line in lines)
    assert any(line.startswith("  - data.rooot is not a setting (close: root") for line in lines)
    assert any(line.startswith("  - logger.wandb_projet is not a setting") for line in lines)
    assert len(lines) == 5
    for ok in (["+model.kwargs.patch_size=8", "+model.kwargs.depths=[2,2]"],
               ["data=cifar100", "data.root=x"], ["data=imagenet"], ["logger=wandb"], ["optim=simple"],
               ["model=swin_ti", "+model.kwargs.window_size=4"]):
        config_lib.check_known_settings(compose_train(ok))


def test_paper_experiment_settings(compose_train):
    cfg = compose_train(["experiment=cifar100_deit_ti_mesa"])
    assert cfg.model.name == "deit_ti" and cfg.data.name == "cifar100" and cfg.optim.name == "cifar100"
    assert list(cfg.mesa.ops) == ["all"] and cfg.mesa.decay == 0.9 and cfg.mesa.rounding == "stochastic"
    # 2 GPUs x 128 -> lr 2.5e-4 (paper Sec. 5.2); 8 GPUs x 128 on ImageNet -> 1e-3.
    assert config_lib.learning_rate(cfg, world_size=2) == pytest.approx(2.5e-4)
    cfg = compose_train(["experiment=imagenet_deit_ti_mesa"])
    assert config_lib.learning_rate(cfg, world_size=8) == pytest.approx(1e-3)
    assert compose_train(["experiment=cifar100_deit_ti_mesa_nearest"]).mesa.rounding == "nearest"
    assert compose_train(["experiment=cifar100_deit_ti_mesa_layerwise"]).mesa.num_groups == 1


def test_eval_config_composes(compose_train):
    cfg = compose_train(["checkpoint=x.pt", "data=digits"], config_name="eval")
    assert cfg.checkpoint == "x.pt" and cfg.data.name == "digits"


def test_valid_names_match_the_library():
    from mesa_train.patch import MODULE_SETS, OPS

    assert set(config_lib.MESA_OPS) == set(OPS) | {"all"}
    assert set(config_lib.MESA_MODULES) == set(MODULE_SETS) | {"all"}


INVALID = [
    ("mesa.ops", ["gelu", "foo"], "valid ops: linear"),
    ("trainer.amp", "fp8", "auto, bf16, fp16, none"),
    ("mesa.modules", ["attention"], "valid modules: msa"),
    ("mesa.estimator", "ema", "running, per_sample"),
    ("mesa.rounding", "up", "stochastic, nearest"),
    ("mesa.decay", 1.5, "mesa.decay"),
    ("trainer.device", "tpu", "auto, cpu, cuda"),
    ("trainer.batch_size", 0, "trainer.batch_size"),
    ("model.name", "not_a_model", "deit_ti, deit_s.*timm model name"),
    # checked at start-up since issue 11 (before: a traceback after data and model were built,
    # or silently wrong: checkpoint_every=-1 saved every step, std 0 divided by zero)
    ("data.std", [0.0, 0.0, 0.0], "data.std=.* must be positive"),
    ("trainer.checkpoint_every", -1, "trainer.checkpoint_every=-1 must be an integer >= 0"),
    ("optim.opt", "adamww", "optim.opt='adamww' is not a timm optimizer.*close: adamw"),
    ("optim.sched", "cosin", "optim.sched='cosin' is not valid; choose one of: cosine"),
    ("optim.layer_decay", 1.5, "optim.layer_decay"),
    ("trainer.nonfinite", "ignore", "stop, skip"),
    ("data.val_size", -1, "data.val_size"),
    ("model.pretrained_path", "/no/such/weights.pth", "no such file"),
    # numbers torch would take or refuse only once training had begun (a traceback, a run
    # directory left behind, or a model without blocks)
    ("optim.base_lr", float("nan"), r"optim.base_lr=nan must be a positive number"),
    ("optim.base_lr", "abc", r"optim.base_lr='abc' must be a positive number"),
    ("optim.lr", -0.1, r"optim.lr=-0.1 must be null or a positive number"),
    ("optim.lr", float("inf"), r"optim.lr=inf must be null or a positive number"),
    ("optim.base_batch", 0, r"optim.base_batch=0 must be an integer >= 1"),
    ("optim.weight_decay", "abc", r"optim.weight_decay='abc' must be null or a number >= 0"),
    ("optim.drop_path", 2.0, r"optim.drop_path=2.0 must be null or a number in \[0, 1\)"),
    ("optim.mixup_prob", 1.5, r"optim.mixup_prob=1.5 must be null or a number in \[0, 1\]"),
    ("optim.ema_decay", -1, r"optim.ema_decay=-1 must be null or a number in \[0, 1\]"),
    ("model.depth", 0, r"model.depth=0 must be null \(the model's own\) or an integer >= 1"),
    ("model.num_heads", 0, r"model.num_heads=0 must be null"),
    ("model.embed_dim", 1.5, r"model.embed_dim=1.5 must be null"),
    # (int('abc') failed in the runner with a traceback; 1.5 was taken as 1)
    ("trainer.seed", "abc", r"trainer.seed='abc' must be an integer from 0 to 2\*\*31 - 1"),
    ("trainer.seed", 1.5, r"trainer.seed=1.5 must be an integer"),
    ("trainer.seed", -1, r"trainer.seed=-1 must be an integer"),
    ("mesa.ops", [], r"mesa.ops is empty; name at least one \(valid ops: .*gelu.*\), or train stock"),
    ("mesa.modules", [], r"mesa.modules is empty; name at least one \(valid modules: .*ffn"),
]


def test_invalid_values_name_valid_choices(compose_train):
    base = compose_train([])
    for key, value, needle in INVALID:
        cfg = base.copy()
        OmegaConf.update(cfg, key, value)
        with pytest.raises(config_lib.ConfigError, match=needle):
            config_lib.validate(cfg)
    # several mistakes are reported together
    cfg = base.copy()
    OmegaConf.update(cfg, "mesa.ops", ["foo"])
    OmegaConf.update(cfg, "trainer.amp", "fp8")
    with pytest.raises(config_lib.ConfigError, match="(?s)mesa.ops.*trainer.amp"):
        config_lib.validate(cfg)


@pytest.mark.parametrize("name, said", [
    # a typo of a timm model: its close names (only the short names were listed)
    ("convnext_attto", r"model.name='convnext_attto' is neither a short name .* \(close: convnext_atto, "),
    ("deit_tt", r"model.name='deit_tt' is neither .* \(close: deit_ti\)$"),
    # (null: is_known_model's name.split raised AttributeError, a traceback)
    (None, r"model.name=None must be a model name: a short name \(deit_ti, .*\) or a timm model name"),
])
def test_a_model_name_that_is_no_model_names_the_close_ones(compose_train, name, said):
    cfg = compose_train([])
    OmegaConf.update(cfg, "model.name", name)
    with pytest.raises(config_lib.ConfigError, match=said):
        config_lib.validate(cfg)


def test_per_stage_lists_and_plain_optim_numbers_pass(compose_train):
    config_lib.validate(compose_train(["model=swin_ti", "model.num_heads=[2,2,4,4]", "model.embed_dim=48"]))
    config_lib.validate(compose_train(["optim.lr=0.001", "optim.drop_path=0", "optim.momentum=null",
                                       "optim.base_batch=1"]))
    with pytest.raises(config_lib.ConfigError, match=r"model.num_heads=\[2, 0\] must be null"):
        config_lib.validate(compose_train(["model=swin_ti", "model.num_heads=[2,0]"]))


def test_any_timm_model_and_shape_errors_before_data(compose_train):
    from mesa_train.train.model import check_buildable

    cfg = compose_train(["model.name=vit_small_patch16_224", "model.img_size=32"])
    config_lib.validate(cfg)  # any timm model name is accepted
    check_buildable(cfg)      # on the meta device: no memory, no data
    cfg = compose_train(["model.embed_dim=64", "model.num_heads=5"])
    with pytest.raises(config_lib.ConfigError, match="num_heads=5 does not divide model.embed_dim=64"):
        config_lib.validate(cfg)
    cfg = compose_train(["model.num_heads=5"])  # DeiT-Ti's default width 192
    config_lib.validate(cfg)
    with pytest.raises(config_lib.ConfigError, match="num_heads=5 does not divide the width 192"):
        check_buildable(cfg)
    # an image side that is not a multiple of the patch size: timm's stride-p convolution
    # dropped the last pixels without a word (img_size=30, patch 16: 16 of 30 used)
    cfg = compose_train(["model.name=vit_small_patch16_224", "model.img_size=30"])
    with pytest.raises(config_lib.ConfigError, match=r"model.img_size=30 is not a multiple of the patch size 16: "
                                                     r"the patch embedding would drop the last 14 pixels of each "
                                                     r"image side; use model.img_size=16 or 32"):
        check_buildable(cfg)
    check_buildable(compose_train(["model=pvt_v2_b1", "model.img_size=30"]))  # (overlapping convolutions: no loss)


def test_an_argument_the_model_does_not_take_names_its_setting(compose_train):
    """The error named every override and blamed img_size ('needs model.img_size_kwarg=false')
    whatever was rejected; it names the one argument and the setting that passed it. A model
    that takes no img_size (a CNN) builds without it: model.img_size sizes the images."""
    from mesa_train.train.model import build, check_buildable

    with pytest.raises(config_lib.ConfigError, match=r"^model 'deit_ti' \(deit_tiny_patch16_224\) takes no argument "
                                                     r"'foo': remove model.kwargs.foo$"):
        check_buildable(compose_train(["+model.kwargs.foo=1"]))
    with pytest.raises(config_lib.ConfigError, match=r"takes no argument 'depth', which model.depth passes: set "
                                                     r"model.depth=null; Swin takes one depth per "
                                                     r"stage: '\+model.kwargs.depths=\[2,2,6,2\]'$"):
        check_buildable(compose_train(["model=swin_ti", "model.depth=[1,1,1,1]"]))
    cfg = compose_train(["model.name=resnet18", "model.img_size=32", "mesa.enabled=false"])
    check_buildable(cfg)
    assert type(build(cfg, 10)).__name__ == "ResNet"
    # timm's MetaFormer says it its own way ("unexpected keyword argument(s): ['img_size']")
    check_buildable(compose_train(["model.name=poolformer_s12", "model.img_size=32"]))
    # the per-stage advice is for the models that take per-stage lists only
    with pytest.raises(config_lib.ConfigError, match=r"takes no argument 'depth', which model.depth passes: set "
                                                     r"model.depth=null$"):
        check_buildable(compose_train(["model.name=resnet18", "model.depth=4"]))
    with pytest.raises(config_lib.ConfigError, match="takes no argument 'img_size': remove model.kwargs.img_size"):
        check_buildable(compose_train(["model.name=resnet18", "model.img_size_kwarg=false",
                                       "+model.kwargs.img_size=32"]))


def test_images_the_model_cannot_run_on_are_one_line(compose_train, monkeypatch):
    """A model built for model.img_size that still cannot run on it (LeViT's grid at 30 px), or
    one given in_chans=1 for the RGB images the data gives, failed in the start-up measurement
    with a traceback (exit 1): one line at the start-up checks now, exit 2. A model the meta
    device cannot run is confirmed on a real image before it is refused."""
    from mesa_train.train import model as model_lib

    with pytest.raises(config_lib.ConfigError, match=r"^model 'levit_128s' cannot run on 3x30x30 images "
                                                     r"\(model.img_size=30\): RuntimeError: shape"):
        model_lib.check_buildable(compose_train(["model.name=levit_128s", "model.img_size=30"]))
    with pytest.raises(config_lib.ConfigError, match=r"^model 'resnet18' cannot run on 3x32x32 images .* to have 1 "
                                                     r"channels, but got 3 channels instead$"):
        model_lib.check_buildable(compose_train(["model.name=resnet18", "model.img_size=32",
                                                 "+model.kwargs.in_chans=1"]))
    model_lib.check_buildable(compose_train(["model.name=levit_128s", "model.img_size=32"]))
    with pytest.raises(config_lib.ConfigError, match=r"set model.img_size_kwarg=true to build it for this size$"):
        model_lib.check_buildable(compose_train(["model.img_size=32", "model.img_size_kwarg=false", "model.depth=1"]))
    # a model the meta device cannot run is tried on a real image, and runs: not refused
    monkeypatch.setattr(model_lib, "_runs_on_meta", lambda *args: False)
    model_lib.check_buildable(compose_train(["model.depth=1", "model.img_size=32", "+model.kwargs.patch_size=8"]))


def test_fused_attention_on_a_model_without_attention_is_said(compose_train, caplog):
    """model.fused_attn=false on resnet18 trained without a word; it now warns that the setting
    changes nothing (and says nothing where the model has a timm attention)."""
    from mesa_train.train.model import check_buildable

    with caplog.at_level("WARNING", logger="mesa_train.train"):
        check_buildable(compose_train(["model.name=resnet18", "model.img_size=32", "model.fused_attn=false"]))
        check_buildable(compose_train(["model.depth=1", "model.img_size=32", "+model.kwargs.patch_size=8",
                                       "model.fused_attn=false"]))
    said = [r.getMessage() for r in caplog.records if "fused_attn" in r.getMessage()]
    assert said == ["model.fused_attn=False changes nothing: resnet18 has no timm attention module with a fused "
                    "(sdpa) switch"], said


def test_a_head_count_the_model_cannot_take_names_the_valid_ones(compose_train):
    """model.num_heads=5 got timm's "AssertionError: dim should be divisible by num_heads", and
    on a Swin "TypeError: 'int' object is not subscriptable": now the divisors of the width, or
    the per-stage list the family takes."""
    from mesa_train.train.model import check_buildable

    with pytest.raises(config_lib.ConfigError, match=r"^model.num_heads=5 does not divide the width 192 \(the "
                                                     r"model's\): valid head counts: 1, 2, 3, 4, 6, 8, 12, 16, 24, "
                                                     r"32, 48, 64, 96, 192$"):
        check_buildable(compose_train(["model.num_heads=5"]))
    with pytest.raises(config_lib.ConfigError, match=r"width 40 \(model.embed_dim's\): valid head counts: 1, 2, 4, "
                                                     r"5, 8, 10, 20, 40$"):
        check_buildable(compose_train(["model.num_heads=3", "model.embed_dim=40"]))
    with pytest.raises(config_lib.ConfigError, match=r"^model 'swin_ti' cannot be built with model.num_heads=5 "
                                                     r"\(TypeError: 'int' object is not subscriptable\): set "
                                                     r"model.num_heads=null; Swin takes one head count per stage: "
                                                     r"'\+model.kwargs.num_heads=\[3,6,12,24\]'$"):
        check_buildable(compose_train(["model=swin_ti", "model.num_heads=5"]))
    with pytest.raises(config_lib.ConfigError, match=r"PVT-v2 takes one head count per stage"):
        check_buildable(compose_train(["model=pvt_v2_b0", "model.num_heads=5"]))
    # (a review: the width of +model.kwargs.embed_dim; a per-stage setting blamed only where the error is its)
    with pytest.raises(config_lib.ConfigError, match=r"does not divide the width 100 \(model.kwargs.embed_dim's\): "
                                                     r"valid head counts: 1, 2, 4, 5, 10, 20, 25, 50, 100$"):
        check_buildable(compose_train(["+model.kwargs.embed_dim=100", "model.num_heads=3"]))
    with pytest.raises(config_lib.ConfigError, match=r"cannot be built with these model.\* settings: IndexError"):
        check_buildable(compose_train(["model=pvt_v2_b0", "model.num_heads=2", "+model.kwargs.sr_ratios=[8,4,2]"]))


@pytest.mark.parametrize("data", ["digits", "synthetic"])
def test_a_data_root_the_data_set_does_not_read_is_refused(compose_train, data):
    """data=digits data.root=/my/images trained on the digits without a word."""
    with pytest.raises(config_lib.ConfigError, match=rf"data.root='/my/images' is not read by data={data} .*: drop "
                                                     r"it, or choose the data set in that folder: data=imagenet"):
        config_lib.validate(compose_train([f"data={data}", "data.root=/my/images"]))
    config_lib.validate(compose_train([f"data={data}"]))


def test_wandb_online_without_a_key_is_refused(compose_train, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = compose_train(["logger=wandb", "logger.wandb.mode=online"])
    with pytest.raises(config_lib.ConfigError, match="needs a W&B API key"):
        config_lib.validate(cfg)


def test_run_dir_is_shared_under_torchrun(compose_train, monkeypatch):
    # All ranks resolve hydra.run.dir from rank 0's MESA_RUN_STAMP (see train.py).
    monkeypatch.setenv("MESA_RUN_STAMP", "2030-01-01/00-00-00")
    cfg = compose_train([], return_hydra_config=True)
    assert cfg.hydra.run.dir == "outputs/2030-01-01/00-00-00"
    monkeypatch.delenv("MESA_RUN_STAMP")
    cfg = compose_train([], return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("outputs/") and "MESA" not in cfg.hydra.run.dir


def test_mesa_overrides_with_mesa_off_are_named(compose_train):
    """experiment=digits_deit_baseline turns Mesa off: mesa.* options given beside it do nothing,
    and train.py says so (the run itself is valid: a stock baseline)."""
    overrides = ["experiment=digits_deit_baseline", "mesa.ops=[gelu,softmax]", "++mesa.decay=0.5"]
    cfg = compose_train(overrides)
    assert not cfg.mesa.enabled
    warning = config_lib.ignored_mesa_overrides(cfg, overrides)
    assert warning.startswith("mesa.ops, mesa.decay given but mesa.enabled=false") and "mesa.enabled=true" in warning
    assert config_lib.ignored_mesa_overrides(cfg, ["experiment=digits_deit_baseline", "mesa.enabled=false"]) is None
    on = compose_train(overrides + ["mesa.enabled=true"])
    assert config_lib.ignored_mesa_overrides(on, overrides + ["mesa.enabled=true"]) is None


def test_a_model_kwarg_that_a_named_setting_overrides_is_refused(compose_train):
    """``+model.kwargs.depth=2`` beside ``model.depth=4``: timm would get 4 (the named setting
    wins in train/model.py), so the config says so instead of dropping the 2; the kwargs that
    no named setting passes (Swin's ``depths``, ``num_heads`` under a null model.num_heads) pass."""
    cfg = compose_train(["model.depth=4", "+model.kwargs.depth=2", "optim.drop_path=0.1",
                         "+model.kwargs.drop_path_rate=0.2", "+model.kwargs.num_classes=7"])
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(cfg)
    message = str(err.value)
    assert "model.kwargs.depth=2 conflicts with model.depth=4" in message and "set model.depth" in message
    assert "model.kwargs.drop_path_rate=0.2 conflicts with optim.drop_path=0.1" in message
    assert "model.kwargs.num_classes=7 is never used" in message
    config_lib.validate(compose_train(["model.depth=null", "+model.kwargs.depth=2"]))
    config_lib.validate(compose_train(["model.depth=2", "+model.kwargs.depth=2"]))  # (no conflict)
    config_lib.validate(compose_train(["model=swin_ti", "+model.kwargs.depths=[1,1]", "+model.kwargs.num_heads=[1,2]"]))


def test_the_build_overrides_model_kwargs_with_exactly_the_checked_settings(compose_train):
    """train/model.py's overrides and the config check read one table (``named_model_kwargs``):
    the model.kwargs keys the build replaces by a named setting are exactly the ones the check
    compares, so none is dropped without the error above."""
    from mesa_train.train.model import _overrides

    cfg = compose_train(["model.depth=4", "model.embed_dim=64", "model.num_heads=2", "optim.drop_path=0.1"])
    named = config_lib.named_model_kwargs(cfg)
    assert set(named) == {"depth", "embed_dim", "num_heads", "drop_path_rate", "img_size"}
    candidates = ["depth", "embed_dim", "num_heads", "drop_path_rate", "img_size", "mlp_ratio", "patch_size"]
    OmegaConf.update(cfg, "model.kwargs", {key: 999 for key in candidates}, force_add=True)
    built = _overrides(cfg, num_classes=10, drop_path=cfg.optim.drop_path)
    assert {key for key in candidates if built[key] != 999} == set(named)
    assert {key: built[key] for key in named} == {key: value for key, (_, value) in named.items()}
    assert built["num_classes"] == 10
