"""Start-up checks of a composed training config, and the few values derived from it.

Everything a user can mistype is checked here, before a model is built or a file is
written, and all problems are reported together with the valid choices.
"""
from __future__ import annotations

import difflib
import functools
import glob
import math
import os
from collections.abc import Sequence
from typing import Any

from mesa_train.compile_scope import SCOPES as COMPILE_SCOPES
from mesa_train.models import MODEL_NAMES, is_known_model
from mesa_train.patch import MODULE_SETS, OPS
from mesa_train.patch.cancellation import CANCELLING_BN
from mesa_train.patch.block import NORM_LINEAR_COPIES
from mesa_train.patch.mlp import MLP_COPIES
from mesa_train.patch.duplicates import DUPLICATES
from mesa_train.plan import Budget, PlanError
from mesa_train.quant.compile_kernels import CHOICES as COMPILE_KERNELS

# Valid names, as documented in docs/DESIGN.md (mesa_train.patch).
# the library's own lists (one source of truth: a new op is valid here the day it lands)
MESA_OPS = tuple(OPS) + ("all",)
MESA_MODULES = tuple(MODULE_SETS) + ("all",)
MESA_ESTIMATORS = ("running", "per_sample", "learned", "delayed")
MESA_BITS = (8, 4, 2)
MESA_SCALES = ("linear", "pow2")
MESA_LAYOUTS = ("channel", "patch4x4")
MESA_ROUNDINGS = ("stochastic", "nearest")
AMP_MODES = ("auto", "bf16", "fp16", "none")
NONFINITE_MODES = ("stop", "skip")
# torch.compile modes (trainer.compile_mode); the first two capture CUDA graphs
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")
COMPILE_MODES = ("default", *CUDA_GRAPH_COMPILE_MODES, "max-autotune-no-cudagraphs")
# timm.scheduler.create_scheduler_v2's names
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "plateau", "poly", "constant", "rsqrt")
DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("ddp", "fsdp")
DATASETS = ("cifar100", "imagenet", "digits", "synthetic")


class ConfigError(ValueError):
    """A config value that cannot work; the message says which and what is valid."""


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def is_int(value) -> bool:
    """An integer and not a bool (``True`` is an ``int`` to Python: ``trainer.epochs=true``
    trained one epoch)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bool_errors(cfg, keys) -> list[str]:
    """One line for each of ``keys`` (dotted) whose value in ``cfg`` is set but not true or false:
    YAML's words reach OmegaConf as strings, and ``trainer.overwrite=no`` was truthy (it deleted
    the run it was meant to keep)."""
    from omegaconf import OmegaConf

    errors = []
    for key in keys:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not isinstance(value, bool):
            errors.append(f"{key}={value!r} must be true or false")
    return errors


@functools.lru_cache(maxsize=None)
def bool_settings() -> tuple[str, ...]:
    """The settings whose value is true or false in an option file of their group (each must
    stay true or false), and ``model.fused_attn`` (null: timm's default). The files are read
    once a process (validate runs for every run, evaluation and sweep job)."""
    from omegaconf import OmegaConf

    keys = {"model.fused_attn"}
    for group in SETTING_GROUPS:
        for path in glob.glob(os.path.join(_CONFIG_DIR, group, "*.yaml")):
            tree = OmegaConf.to_container(OmegaConf.load(path)) or {}
            flat = _leaf_values({k: v for k, v in tree.items() if k != "defaults"})
            keys.update(f"{group}.{k}" for k, v in flat.items() if isinstance(v, bool))
    return tuple(sorted(keys))


def validate(cfg) -> None:
    """Raise ``ConfigError`` listing every invalid value of ``cfg``."""
    errors: list[str] = []
    # (those mesa and fsdp flags are checked with their group below)
    errors += bool_errors(cfg, [k for k in bool_settings() if k not in _CHECKED_BOOLS])
    _check_model(cfg, errors)
    _choice(errors, "data.name", cfg.data.name, DATASETS)
    _check_data(cfg.data, errors)
    _check_optim(cfg.optim, errors)
    _check_mesa(cfg.mesa, errors)
    _check_trainer(cfg.trainer, errors)
    _check_wandb(cfg, errors)
    _check_strategy(cfg, errors)
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


# Groups whose every setting is in their option files: a key there that is in none of them is
# a typo that Hydra lets through when given with '+' ('+mesa.decya=0.5', '+model.pretrained_pth=x'
# would be ignored: a fine-tune from random weights). The known keys of a group with several
# options (model, data, optim, logger) are those of all its files: another option's key is a
# setting, if not this option's. Top level: the run name and the groups.
# (Checked for a new run only: an older checkpoint's config may hold a setting since removed.)
_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
SETTING_GROUPS = ("trainer", "mesa", "model", "data", "optim", "logger")
_CHECKED_BOOLS = ("mesa.enabled", "mesa.row_scale", "mesa.symmetric", "trainer.fsdp.reshard_after_forward",
                  "trainer.fsdp.cpu_offload")
TOP_LEVEL = ("name", *SETTING_GROUPS)


def _leaf_keys(tree, prefix: str = "") -> list[str]:
    return list(_leaf_values(tree, prefix))


def _leaf_values(tree, prefix: str = "") -> dict:
    """``{dotted key: value}`` of ``tree``'s leaves (an empty dict is a leaf)."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in _leaf_values(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _group_settings(group: str) -> tuple[set[str], str] | None:
    """The leaf keys of every option file of ``group`` and where they are written (None: a
    package installed without its configs, nothing to compare)."""
    from omegaconf import OmegaConf

    files = sorted(glob.glob(os.path.join(_CONFIG_DIR, group, "*.yaml")))
    if not files:
        return None
    known = set()
    for path in files:
        tree = OmegaConf.to_container(OmegaConf.load(path))
        known.update(_leaf_keys({k: v for k, v in (tree or {}).items() if k != "defaults"}))
    where = f"configs/{group}/{os.path.basename(files[0])}" if len(files) == 1 else f"configs/{group}/*.yaml"
    return known, where


def group_errors(group: str, values) -> list[str]:
    """One line for each key of ``values`` (a group's settings as given) that no option file of
    ``group`` has, naming the close ones."""
    settings = _group_settings(group)
    if settings is None:
        return []
    known, where = settings
    errors = []
    for key in _leaf_keys(values):
        # (a known key, inside one whose default is null or {} (a dict given to it), or a dict of them)
        if key not in known and not any(key.startswith(k + ".") or k.startswith(key + ".") for k in known):
            close = difflib.get_close_matches(key, sorted(known), n=3)
            errors.append(f"{group}.{key} is not a setting" + (f" (close: {', '.join(close)})" if close else "")
                          + f"; all: {where}")
    return errors


def key_tree(key: str) -> dict:
    """``{"a": {"b": None}}`` of the dotted ``key`` "a.b"."""
    head, _, rest = key.partition(".")
    return {head: key_tree(rest) if rest else None}


def refuses_new_key(key: str) -> bool:
    """Whether ``check_known_settings`` refuses the dotted ``key`` added with '+' (``+mesa.bitz=4``,
    ``+epochs=3``); a key inside a setting whose default is null or {} passes (``+model.kwargs.foo=1``).
    (hydra_cli advises '+' for a key the config lacks only where it would pass.)"""
    group, _, rest = key.partition(".")
    if group not in SETTING_GROUPS:
        return group not in TOP_LEVEL
    return bool(rest) and bool(group_errors(group, key_tree(rest)))


def check_known_settings(cfg) -> None:
    """Raise ``ConfigError`` for a key of a setting group (``trainer.*``, ``model.*``, ...) that
    no option file of the group has, or a top-level key that is no group, naming the close ones."""
    from omegaconf import OmegaConf

    errors = []
    for key in cfg:
        if key not in TOP_LEVEL:
            close = difflib.get_close_matches(str(key), TOP_LEVEL, n=3)
            errors.append(f"{key} is not a setting" + (f" (close: {', '.join(close)})" if close else "")
                          + f"; top-level keys: {', '.join(TOP_LEVEL)}")
    for group in SETTING_GROUPS:
        if group in cfg:
            errors += group_errors(group, OmegaConf.to_container(cfg[group], resolve=False))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _choice(errors: list[str], path: str, value, valid) -> None:
    if value not in valid:
        errors.append(f"{path}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")


def _check_mesa(m, errors: list[str]) -> None:
    """``mesa.*``: names, option values, then their combinations (QuantOptions), and the plan."""
    if not isinstance(m.enabled, bool):
        errors.append(f"mesa.enabled={m.enabled!r} must be true or false")
    ops, modules = _as_list(m.ops), _as_list(m.modules)
    bad_ops = [o for o in ops if o not in MESA_OPS]
    if not ops:  # (nothing to compress: say so, not "unknown ops []")
        errors.append(f"mesa.ops is empty; name at least one (valid ops: {', '.join(MESA_OPS)}), "
                      "or train stock with mesa.enabled=false")
    elif bad_ops:
        errors.append(f"mesa.ops={ops} has unknown ops {bad_ops}; valid ops: {', '.join(MESA_OPS)}")
    bad_modules = [x for x in modules if x not in MESA_MODULES]
    if not modules:
        errors.append(f"mesa.modules is empty; name at least one (valid modules: {', '.join(MESA_MODULES)}), "
                      "or train stock with mesa.enabled=false")
    elif bad_modules:
        errors.append(
            f"mesa.modules={modules} has unknown modules {bad_modules}; "
            f"valid modules: {', '.join(MESA_MODULES)}"
        )
    _choice(errors, "mesa.estimator", m.estimator, MESA_ESTIMATORS)
    _choice(errors, "mesa.rounding", m.rounding, MESA_ROUNDINGS)
    if m.get("bits", 8) not in MESA_BITS or isinstance(m.get("bits", 8), bool):
        errors.append(f"mesa.bits={m.get('bits')!r} is not valid; choose one of: {', '.join(map(str, MESA_BITS))}")
    _choice(errors, "mesa.scale", m.get("scale", "linear"), MESA_SCALES)
    _choice(errors, "mesa.layout", m.get("layout", "channel"), MESA_LAYOUTS)
    _choice(errors, "mesa.compile_kernels", m.get("compile_kernels", "auto"), COMPILE_KERNELS)
    _choice(errors, "mesa.cancelling_bn", m.get("cancelling_bn", "stock"), CANCELLING_BN)
    _choice(errors, "mesa.mlp", m.get("mlp", "shared"), MLP_COPIES)
    _choice(errors, "mesa.norm_linear", m.get("norm_linear", "shared"), NORM_LINEAR_COPIES)
    _choice(errors, "mesa.duplicates", m.get("duplicates", "skip"), DUPLICATES)
    if m.get("layout", "channel") == "patch4x4" and [o for o in ops if o != "conv"]:
        errors.append(f"mesa.layout=patch4x4 applies to conv activations only: it needs mesa.ops=[conv], got {ops}")
    if not errors:
        from mesa_train.nn.quantizer import QuantOptions

        try:  # combinations (e.g. estimator=learned with symmetric=true)
            QuantOptions(estimator=m.estimator, symmetric=m.symmetric, bits=m.get("bits", 8),
                         scale=m.get("scale", "linear"), layout=m.get("layout", "channel"),
                         clip_horizon=m.get("clip_horizon", 1.0))
        except ValueError as e:
            errors.append(f"mesa: {e}")
    if not isinstance(m.get("row_scale", True), bool):
        errors.append(f"mesa.row_scale={m.row_scale!r} must be true or false")
    if not isinstance(m.symmetric, bool):
        errors.append(f"mesa.symmetric={m.symmetric!r} must be true or false")
    if not (is_number(m.decay) and 0.0 <= m.decay < 1.0):
        errors.append(f"mesa.decay={m.decay!r} must be a number in [0, 1)")
    if m.num_groups is not None and not (is_int(m.num_groups) and m.num_groups >= 1):
        errors.append(f"mesa.num_groups={m.num_groups!r} must be null (one per head) or an integer >= 1")
    _check_plan(m, errors)


def _check_trainer(t, errors: list[str]) -> None:
    """``trainer.*``: choices, counts, limits, compile scope and mode."""
    _choice(errors, "trainer.amp", t.amp, AMP_MODES)
    _choice(errors, "trainer.device", t.device, DEVICES)
    for key in ("epochs", "batch_size", "grad_accum", "eval_every"):
        value = t[key]
        if not (is_int(value) and value >= 1):
            errors.append(f"trainer.{key}={value!r} must be an integer >= 1")
    for key, meaning in (("checkpoint_every", "0: only at the end of each epoch"),
                         ("log_every", "0: no steps.csv rows"), ("num_workers", "0: load in the main process")):
        value = t.get(key, 0)
        if not (is_int(value) and value >= 0):
            errors.append(f"trainer.{key}={value!r} must be an integer >= 0 ({meaning})")
    if t.max_steps is not None and not (is_int(t.max_steps) and t.max_steps >= 1):
        errors.append(f"trainer.max_steps={t.max_steps!r} must be null or an integer >= 1")
    if t.clip_grad is not None and not (is_number(t.clip_grad) and t.clip_grad > 0):
        errors.append(f"trainer.clip_grad={t.clip_grad!r} must be null or a positive number")
    _choice(errors, "trainer.nonfinite", t.get("nonfinite", "stop"), NONFINITE_MODES)
    _check_compile_mode(t, errors)
    skips = t.get("max_nonfinite_skips", 1)
    if not (is_int(skips) and skips >= 1):
        errors.append(f"trainer.max_nonfinite_skips={skips!r} must be an integer >= 1")
    seed = t.get("seed", 0)
    # (each rank seeds with seed + rank; NumPy's generator takes 0 <= seed < 2**32)
    if not (is_int(seed) and 0 <= seed < 2**31):
        errors.append(f"trainer.seed={seed!r} must be an integer from 0 to 2**31 - 1")


def _check_compile_mode(t, errors: list[str]) -> None:
    """``trainer.compile_scope`` and ``trainer.compile_mode``: a scope of mesa_train/compile_scope.py
    and a torch.compile mode, each only with ``trainer.compile=true``; the
    CUDA-graph modes need one micro-batch per step (the next micro-batch's backward replays
    the graph over the memory the gradients of the last one live in)."""
    scope = t.get("compile_scope", "model")
    if scope not in COMPILE_SCOPES:
        errors.append(f"trainer.compile_scope={scope!r} is not valid; choose one of: {', '.join(COMPILE_SCOPES)}")
    elif scope != "model" and not t.get("compile"):
        errors.append(f"trainer.compile_scope={scope} needs trainer.compile=true")
    mode = t.get("compile_mode", "default")
    if mode not in COMPILE_MODES:
        errors.append(f"trainer.compile_mode={mode!r} is not valid; choose one of: {', '.join(COMPILE_MODES)}")
    elif mode != "default" and not t.get("compile"):
        errors.append(f"trainer.compile_mode={mode} needs trainer.compile=true")
    elif mode in CUDA_GRAPH_COMPILE_MODES and isinstance(t.grad_accum, int) and t.grad_accum > 1:
        errors.append(f"trainer.compile_mode={mode} captures CUDA graphs and cannot accumulate gradients over "
                      f"micro-batches (trainer.grad_accum={t.grad_accum}); use trainer.grad_accum=1 or "
                      "trainer.compile_mode=default")


def _check_strategy(cfg, errors: list[str]) -> None:
    """``trainer.strategy`` and the ``trainer.fsdp`` options (see mesa_train/train/fsdp.py)."""
    t = cfg.trainer
    strategy = t.get("strategy", "ddp")
    if strategy not in STRATEGIES:
        errors.append(f"trainer.strategy={strategy!r} is not valid; choose one of: {', '.join(STRATEGIES)}")
        return
    fsdp = t.get("fsdp") or {}
    for key in ("reshard_after_forward", "cpu_offload"):
        if not isinstance(fsdp.get(key, False), bool):
            errors.append(f"trainer.fsdp.{key}={fsdp.get(key)!r} must be true or false")
    if strategy != "fsdp":
        return
    if cfg.optim.get("ema"):
        errors.append("optim.ema=true is not supported with trainer.strategy=fsdp (the EMA copy would not be "
                      "sharded); use trainer.strategy=ddp or optim.ema=false")
    if t.get("compile") and t.get("compile_scope", "model") != "blocks":
        # one graph over the sharded model is untested; each block compiled inside its FSDP
        # unit is torchtitan's layout (tests/test_compile_scope.py, test_train_fsdp_single.py)
        errors.append("trainer.compile=true with trainer.strategy=fsdp needs trainer.compile_scope=blocks "
                      "(each block compiled inside its FSDP unit); or use trainer.strategy=ddp or "
                      "trainer.compile=false")
    elif t.get("compile") and t.get("compile_mode", "default") in CUDA_GRAPH_COMPILE_MODES:
        # FSDP2 all-gathers each block's weights into fresh memory every step (and frees it
        # after), while a CUDA graph replays fixed addresses: it would re-record every step
        errors.append(f"trainer.compile_mode={t.compile_mode} captures CUDA graphs, which "
                      "trainer.strategy=fsdp does not support: FSDP2 gathers each block's weights into new "
                      "memory every step; use trainer.compile_mode=default or trainer.strategy=ddp")
    if fsdp.get("cpu_offload") is True and t.device == "cpu":
        errors.append("trainer.fsdp.cpu_offload=true needs a GPU (the model already lives in host memory with "
                      "trainer.device=cpu)")


def close_model_names(name: str) -> str:
    """`` (close: ...)`` naming the timm models ``name`` is likely a typo of
    (``convnext_attto``: convnext_atto), or "" where none is close."""
    import timm

    names = [*MODEL_NAMES, *timm.list_models()]
    if name in names:  # (model=vgg16: a timm name, which the hint model.name=vgg16 already gives)
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.8)
    return f" (close: {', '.join(close)})" if close else ""


def _check_model(cfg, errors: list[str]) -> None:
    m = cfg.model
    if not isinstance(m.name, str):  # (model.name=null: is_known_model's name.split failed, a traceback)
        errors.append(f"model.name={m.name!r} must be a model name: a short name ({', '.join(MODEL_NAMES)}) "
                      "or a timm model name (e.g. vit_small_patch16_224)")
    elif not is_known_model(m.name):
        errors.append(
            f"model.name={m.name!r} is neither a short name ({', '.join(MODEL_NAMES)}) nor a timm "
            f"model name (see timm.list_models(), e.g. vit_small_patch16_224){close_model_names(m.name)}"
        )
    if not is_int(m.img_size) or m.img_size < 1:
        errors.append(f"model.img_size={m.img_size!r} must be a positive integer")
    for key in ("depth", "embed_dim", "num_heads"):  # (null: the timm model's own; a list: per stage)
        value = m.get(key)
        values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
        if value is not None and not (values and all(is_int(v) and v >= 1
                                                     for v in values)):
            errors.append(f"model.{key}={value!r} must be null (the model's own) or an integer >= 1 "
                          "(or a list of them, one per stage)")
    heads, width = m.get("num_heads"), m.get("embed_dim")
    if isinstance(heads, int) and isinstance(width, int) and heads >= 1 and width % heads:
        errors.append(f"model.num_heads={heads} does not divide model.embed_dim={width}: "
                      f"every head needs embed_dim / num_heads channels; valid head counts: {head_counts(width)}")
    path = m.get("pretrained_path")
    if path is not None and not os.path.isfile(str(path)):
        errors.append(f"model.pretrained_path={path!r}: no such file")
    _check_model_kwargs(cfg, errors)


def head_counts(width: int) -> str:
    """The head counts a width of ``width`` channels takes (its divisors), as a list to print."""
    return ", ".join(str(d) for d in range(1, width + 1) if width % d == 0)


def named_model_kwargs(cfg) -> dict[str, tuple[str, Any]]:
    """The timm keyword arguments that named settings pass, each as ``key: (setting, value)``
    for the settings that are set: train/model.py builds with these over ``model.kwargs``, and
    ``validate`` refuses a ``model.kwargs`` key that one of them would silently override. (The
    one table both read, so the check cannot drift from the build.)"""
    m = cfg.model
    owners = {"depth": "model.depth", "embed_dim": "model.embed_dim", "num_heads": "model.num_heads",
              "drop_path_rate": "optim.drop_path"}
    if m.get("img_size_kwarg"):
        owners["img_size"] = "model.img_size"
    named = {}
    for key, owner in owners.items():
        group, name = owner.split(".")
        section = cfg.get(group)  # (the plan CLI's config has no optim group)
        value = section.get(name) if section is not None else None
        if value is not None:
            named[key] = (owner, value)
    return named


def _check_model_kwargs(cfg, errors: list[str]) -> None:
    """A ``model.kwargs`` key that a named setting also passes to timm (``named_model_kwargs``,
    where the named one wins): refused where the two differ, instead of the kwargs value being
    dropped without a word (``+model.kwargs.depth=2`` beside an experiment's ``model.depth=4``
    built 4 blocks)."""
    kwargs = cfg.model.get("kwargs") or {}
    if "num_classes" in kwargs:  # (always the data's: data.num_classes, or the data set's own)
        errors.append(f"model.kwargs.num_classes={kwargs['num_classes']!r} is never used: the class count "
                      "comes from data.num_classes (or the data set's own)")
    for key, (owner, named) in named_model_kwargs(cfg).items():
        if key in kwargs and kwargs[key] != named:
            errors.append(f"model.kwargs.{key}={kwargs[key]!r} conflicts with {owner}={named!r}, which timm "
                          f"would get: set {owner} (or null it to use model.kwargs.{key})")


# the data sets that read no files: a data.root given with them was trained past without a word
NO_ROOT_DATA = {"digits": "its images ship with scikit-learn", "synthetic": "its images are generated"}


def _check_data(d, errors: list[str]) -> None:
    if d.get("name") in NO_ROOT_DATA and d.get("root") is not None:
        errors.append(f"data.root={d.root!r} is not read by data={d.name} ({NO_ROOT_DATA[d.name]}): drop it, or "
                      "choose the data set in that folder: data=imagenet (class folders) or data=cifar100")
    for key in ("mean", "std"):
        values = list(d.get(key) or [])
        if len(values) != 3 or not all(is_number(v) for v in values):
            errors.append(f"data.{key}={values} must be three numbers (one per RGB channel)")
        elif key == "std" and not all(v > 0 for v in values):
            errors.append(f"data.std={values} must be positive (images are divided by it)")
    for key, low in (("train_size", 1), ("val_size", 0)):
        value = d.get(key)
        if value is not None and not (is_int(value) and value >= low):
            errors.append(f"data.{key}={value!r} must be null (all) or an integer >= {low}")
    if d.get("num_classes") is not None and not (is_int(d.num_classes) and d.num_classes >= 1):
        errors.append(f"data.num_classes={d.num_classes!r} must be null or an integer >= 1")


def _check_optim(o, errors: list[str]) -> None:
    from timm.optim import list_optimizers

    known = set(list_optimizers())
    name = str(o.opt).lower()
    base = name.split("_", 1)[1] if name.startswith("lookahead_") else name
    if base not in known:
        close = difflib.get_close_matches(base, sorted(known), n=5)
        errors.append(f"optim.opt={o.opt!r} is not a timm optimizer; e.g. adamw, sgd, lamb, lion"
                      + (f" (close: {', '.join(close)})" if close else "")
                      + "; all: timm.optim.list_optimizers()")
    if o.sched not in SCHEDULERS:
        errors.append(f"optim.sched={o.sched!r} is not valid; choose one of: {', '.join(SCHEDULERS)}")
    decay = o.get("layer_decay")
    if decay is not None and not (is_number(decay) and 0 < decay <= 1):
        errors.append(f"optim.layer_decay={decay!r} must be null (off) or a number in (0, 1]")
    for key, ok, rule in _OPTIM_NUMBERS:
        value, nullable = o.get(key), key not in _OPTIM_REQUIRED
        if value is None and nullable:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (number and ok(value)):
            errors.append(f"optim.{key}={value!r} must be {'null or ' if nullable else ''}{rule}")


# optim.* numbers: (key, test on a finite number, the rule as the error states it). Without
# these a NaN learning rate or a drop-path rate of 2 surfaced as torch's traceback, some only
# at the first step, after the run directory was written.
_OPTIM_NUMBERS = (
    ("base_lr", lambda v: v > 0, "a positive number (lr at base_batch images a step)"),
    ("base_batch", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    ("lr", lambda v: v > 0, "a positive number (this learning rate as is)"),
    ("weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("momentum", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("eps", lambda v: v > 0, "a positive number"),
    ("warmup_epochs", lambda v: v >= 0, "a number >= 0 (0: no warmup)"),
    ("warmup_lr", lambda v: v >= 0, "a number >= 0"),
    ("min_lr", lambda v: v >= 0, "a number >= 0"),
    ("smoothing", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("drop_path", lambda v: 0 <= v < 1, "a number in [0, 1) (stochastic depth rate)"),
    ("mixup", lambda v: v >= 0, "a number >= 0 (0: off)"),
    ("cutmix", lambda v: v >= 0, "a number >= 0 (0: off)"),
    ("mixup_prob", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("mixup_switch_prob", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("re_prob", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("re_count", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    ("ema_decay", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
)
# the two the learning rate is computed from; every other one may be null (the library's default)
_OPTIM_REQUIRED = frozenset({"base_lr", "base_batch"})


def _check_wandb(cfg, errors: list[str]) -> None:
    w = cfg.logger.get("wandb") or {}
    if not w.get("enabled") or (w.get("mode") or os.environ.get("WANDB_MODE")) != "online":
        return
    from mesa_train.train.loggers import wandb_has_key

    if not wandb_has_key():
        errors.append("logger.wandb.mode=online needs a W&B API key: set WANDB_API_KEY or run `wandb login` "
                      "(or use logger.wandb.mode=offline and `wandb sync` later)")


def _check_plan(m, errors: list) -> None:
    """``mesa.plan`` (null | auto | a plan file) with its budget (issue 13's planner)."""
    import os

    plan, budget, budget_gb = m.get("plan"), m.get("budget"), m.get("budget_gb")
    if plan is None:
        if budget is not None or budget_gb is not None:
            errors.append("mesa.budget / mesa.budget_gb need mesa.plan=auto (plan at start-up for that budget)")
        return
    if not isinstance(plan, str) or not plan:
        errors.append(f"mesa.plan={plan!r} must be null, auto or the path of a plan file (python -m mesa_train.plan)")
        return
    if plan != "auto":
        if not os.path.isfile(plan):
            errors.append(f"mesa.plan={plan!r}: no such plan file (valid: null, auto, or a file written by "
                          "python -m mesa_train.plan)")
        if budget is not None or budget_gb is not None:
            errors.append("mesa.budget / mesa.budget_gb apply to mesa.plan=auto only, not to a plan file")
        return
    try:  # the planner's own rule: exactly one of the two, and its value
        Budget(fraction=budget, gb=budget_gb).check(prefix="mesa.")
    except PlanError as err:
        errors.append(f"mesa.plan=auto: {err}")


def ignored_mesa_overrides(cfg, overrides) -> str | None:
    """A warning when command-line ``mesa.*`` overrides (Hydra's ``overrides.task``) set Mesa
    options while ``mesa.enabled`` is false (an ``experiment=`` preset's baseline turns it off):
    the run trains the stock model and those options do nothing. None otherwise."""
    if cfg.mesa.enabled:
        return None
    keys = [str(o).split("=", 1)[0].lstrip("+~") for o in overrides]
    given = [k for k in keys if k.startswith("mesa.") and k != "mesa.enabled"]
    if not given:
        return None
    return (f"{', '.join(given)} given but mesa.enabled=false (set by the config or an experiment preset): "
            "this run trains the stock model; add mesa.enabled=true to compress")


def mesa_options(cfg) -> dict:
    """Keyword arguments of ``mesa_train.patch_model`` from the ``mesa`` group
    (null values are left to the library's defaults)."""
    m = cfg.mesa
    opts = {
        "ops": tuple(_as_list(m.ops)),
        "modules": tuple(_as_list(m.modules)),
        "num_groups": m.num_groups,
        "decay": m.decay,
        "estimator": m.estimator,
        "symmetric": m.symmetric,
        "rounding": m.rounding,
        "row_scale": m.get("row_scale"),
        "bits": m.get("bits"),
        "scale": m.get("scale"),
        "layout": m.get("layout"),
        "clip_horizon": m.get("clip_horizon"),
        "cancelling_bn": m.get("cancelling_bn"),
        "mlp": m.get("mlp"),
        "norm_linear": m.get("norm_linear"),
    }
    return {k: v for k, v in opts.items() if v is not None}


def learning_rate(cfg, world_size: int) -> float:
    """``optim.lr`` if set, else the linear scaling rule
    ``base_lr * batch_size * world_size * grad_accum / base_batch``."""
    o = cfg.optim
    if o.lr is not None:
        return float(o.lr)
    total_batch = cfg.trainer.batch_size * world_size * cfg.trainer.grad_accum
    return float(o.base_lr) * total_batch / float(o.base_batch)
