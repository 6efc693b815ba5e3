"""The Hydra entry points' first step: command-line mistakes caught before Hydra runs, as one
line that names the valid choices. (Imported by the commands only, never by the library.)

Hydra reports an unknown config option (``model=bogus``), a key that is not a setting
(``trainer.epochz=3``) or an override it cannot parse (``'mesa.ops=[gelu'``) in five to fifteen
lines (its config search path, a stack-trace hint) with exit status 1, and only after it has
made the run directory. ``override_error`` composes the command line's config first, with
Hydra's own compose API and grammar, and turns the failure into one line:

    error: model=bogus: no such option in configs/model; valid: deit_b, deit_s, deit_ti, ...
    error: trainer.epochz=3: trainer has no setting 'epochz' (close: epochs)
    error: dta.root=x: the config has no group or setting 'dta' (close: data)

A new key is advised with '+' (``+model.kwargs.foo=...``) only where the command takes it:
train.py and evaluate.py refuse a key no option file of its group has (the valid keys are
named instead), and evaluate.py says that the model and Mesa settings are the checkpoint's.

Entry points (train.py, evaluate.py, ``python -m mesa_train.bench`` and its accuracy,
gradients and plan commands) call ``exit_on_bad_overrides`` first: exit status 2, no run
directory. In a sweep (``-m``), every option of a config group's sweep is checked, and the
rest is composed with each sweep's first value. What it does not understand (Hydra's flags
other than -m/--multirun, ``glob(...)`` sweeps) it leaves to Hydra.
"""
from __future__ import annotations

import difflib
import functools
import os
import re
import sys
import tempfile
from typing import NamedTuple

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override, RangeSweep
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

# the flags that keep the command's config what its overrides say (others: Hydra's to handle)
_RUN_FLAGS = {"-m", "--multirun", "-r", "--run"}
# Hydra's error text that is advice about Hydra itself, not about the mistake
_NOISE = re.compile(r"^(Config search path|\s*provider=|\s*full_key:|\s*object_type=|Set the environment variable"
                    r"|See https?://)")

# what else a group's value can be (train.py's model group: its files are presets of timm models)
_GROUP_HINTS = {"model": "; or any timm model by name: model.name={option}{close}"}


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip() and not _NOISE.match(line)]
    return "; ".join(lines)


def _close(name: str, choices) -> str:
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=3)
    return f" (close: {', '.join(close)})" if close else ""


def _first_job(parsed: list[Override], config_dir: str) -> tuple[list[str], list[list[str]]] | None:
    """The first job's overrides (each sweep at its first value) and, per value of each config
    group's choice sweep, that job's overrides (the other sweeps at their first values); None
    where a sweep is of a kind this check does not expand (glob)."""
    first, group_sweeps = [], []
    for ov in parsed:
        if ov.is_hydra_override():
            continue  # (hydra.run.dir=..., hydra/launcher=...: Hydra's own settings)
        if ov.is_sweep_override():
            if not isinstance(ov.value(), (ChoiceSweep, RangeSweep)):
                return None
            values = list(ov.sweep_string_iterator())
            if not values:
                return None
            first.append(f"{ov.get_key_element()}={values[0]}")
            if os.path.isdir(os.path.join(config_dir, ov.key_or_group)):
                group_sweeps.append((len(first) - 1, ov, values[1:]))
        else:
            first.append(ov.input_line)
    jobs = []
    for position, ov, rest in group_sweeps:
        for value in rest:
            job = list(first)
            job[position] = f"{ov.get_key_element()}={value}"
            jobs.append(job)
    return first, jobs


def _not_a_setting(message: str, cfg: DictConfig | None, config_name: str) -> str | None:
    """Hydra's "Could not override 'a.b'" (a key the config lacks) as the first part of it the
    config lacks ('dta' of dta.root, where Hydra named the whole key), its close names, and '+'
    where the command would take the key added with it (else the valid keys, where none is close)."""
    match = re.search(r"Could not override '([^']+)'", message)
    if match is None:
        return None
    key = match.group(1)
    from_checkpoint = _checkpoint_setting(config_name, key)
    if from_checkpoint is not None:
        return from_checkpoint
    parts, node = key.split("."), cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            break
        node = node[part]
    else:
        return None
    where = ".".join(parts[:depth]) or "the config"
    kind = "group or setting" if depth == 0 and len(parts) > 1 else "setting"
    said, close = f"{where} has no {kind} {part!r}", _close(part, node.keys())
    if _refuses_new_key(config_name, key):  # ('+' then refused too: advising it sent the user in a circle)
        return said + (close or f"; valid: {', '.join(map(str, node.keys()))}")
    return f"{said}{close}; a new key needs +{key}=..."


def _refuses_new_key(config_name: str, key: str) -> bool:
    """Whether the command of ``config_name`` refuses ``+key=...`` itself, once Hydra composed
    it: train.py (and the demo) and evaluate.py a key no option file of its group has, or a
    top-level key not theirs; the other commands' configs take a new key."""
    if config_name == "train":
        from mesa_train.train.config import refuses_new_key
    elif config_name == "eval":
        from mesa_train.train.evaluation import refuses_new_key
    elif config_name == "plan":
        from mesa_train.plan.__main__ import refuses_new_key
    else:
        return False
    return refuses_new_key(key)


def _checkpoint_setting(config_name: str, key: str) -> str | None:
    """Why ``key`` is no setting of evaluate.py where the checkpoint holds it (model.*, mesa.*), or None."""
    if config_name != "eval":
        return None
    from mesa_train.train.evaluation import checkpoint_setting

    return checkpoint_setting(key)


def _missing_option(err: Exception) -> tuple[str, str] | None:
    """(group, option) of Hydra's "Could not find 'group/option'", or None."""
    match = re.search(r"Could not find '([^']+)/([^'/]+)'", str(err))
    return (match.group(1), match.group(2)) if match else None


def _describe(err: Exception, config_dir: str, config_name: str, base: DictConfig | None) -> str:
    missing = _missing_option(err)
    if isinstance(err, MissingConfigException) and err.options and missing is not None:
        group, option = missing
        parts = os.path.normpath(config_dir).split(os.sep)
        # (from the project's configs/ on: configs/bench/preset, not a long absolute path)
        start = len(parts) - 1 - parts[::-1].index("configs") if "configs" in parts else len(parts) - 1
        folder = "/".join(parts[start:] + [group])
        hint = _GROUP_HINTS.get(group, "").format(option=option, close=_close_model(group, option))
        return f"no such option in {folder}{_close(option, err.options)}; valid: {', '.join(err.options)}{hint}"
    text = str(err)
    return _not_a_setting(text, base, config_name) or _one_line(text)


def _close_model(group: str, option: str) -> str:
    """The timm models close to a model option that is no preset (model=convnext_attto: a typo of
    convnext_atto, which model.name= takes), or ""."""
    if group != "model":
        return ""
    from mesa_train.train.config import close_model_names

    return close_model_names(option)


def override_error(config_dir: str, config_name: str, args: list[str]) -> str | None:
    """Why Hydra would refuse ``args`` (a command line's arguments) for ``config_name`` in
    ``config_dir``, in one line, or None (accepted, or a form left to Hydra)."""
    if any(a.startswith("-") and a not in _RUN_FLAGS for a in args):
        return None  # (--cfg job, -cn NAME, --help ...: Hydra's)
    overrides = [a for a in args if not a.startswith("-")]
    parser = OverridesParser.create()
    parsed = []
    for arg in overrides:
        try:
            parsed += parser.parse_overrides([arg])
        except OverrideParseException as err:
            # (a path with '=' or brackets, e.g. a sweep job's folder: quoting reads it as one text;
            # not said for a list typed wrong, mesa.ops=[gelu, which quoting would make a text)
            key, _, value = arg.partition("=")
            path_like = ("=" in value or "/" in value or " " in value) and not set("'\"") & set(value)
            hint = (f"; a value with = , [ ] ( ) {{ }} or spaces is quoted: {key}='{value}' (in a shell: "
                    f"\"{key}='{value}'\")" if path_like else "")
            return f"cannot read the override {arg!r}: {_one_line(err)}{hint}"
    multirun = any(a in ("-m", "--multirun") for a in args)
    for ov in parsed:
        if ov.is_sweep_override() and not multirun and not ov.is_hydra_override():
            return (f"{ov.input_line}: several values sweep only with -m (--multirun); a list is written "
                    f"{ov.get_key_element()}=[...], a text with a comma quoted: {ov.get_key_element()}='...'")
    jobs = _first_job(parsed, config_dir)
    if jobs is None:
        return None
    first, others = jobs
    config_dir = os.path.abspath(config_dir)
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="override_check"):
        for job in [first] + others:
            try:
                compose(config_name, overrides=job)
            except (HydraException, OmegaConfBaseException) as err:
                missing = _missing_option(err)
                # (the option itself where one is missing: model=bogus of model=deit_s,bogus)
                culprit = "=".join(missing) if missing else _culprit(err, overrides)
                described = _describe(err, config_dir, config_name, _plain_config(config_name))
                return f"{culprit}: {described}" if culprit else described
    return None


def _plain_config(config_name: str) -> DictConfig | None:
    """The config without overrides (for a missing key's close names; composed only when one is
    reported, not on every launch), or None where it does not compose itself."""
    try:
        return compose(config_name)
    except (HydraException, OmegaConfBaseException):
        return None


def _culprit(err: Exception, overrides: list[str]) -> str | None:
    """The override (as the command line gave it) the error is about, where its text names it."""
    text = str(err)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if f"'{key}'" in text or f"'{key}/" in text:
            return override
    return None


@functools.lru_cache(maxsize=8)  # (asked twice a start: the run directory check, the cleanup's)
def _planned_dir(config_dir: str, config_name: str, args: tuple[str, ...]) -> str | None:
    """The run (or, with -m, sweep) directory Hydra will make for ``args``, or None where this
    cannot tell (flags it leaves to Hydra, Hydra's own settings at fault). Composed with every
    override and the job's name, as Hydra composes it: ``hydra.run.dir=runs/bs${trainer.batch_size}``
    reads the command line's batch size (a sweep's lists: the ``hydra.`` overrides alone).
    ``${now:...}`` reads this moment, so the last folders' names may differ from Hydra's by a
    second; not its parents."""
    if any(a.startswith("-") and a not in _RUN_FLAGS for a in args):
        return None
    multirun = any(a in ("-m", "--multirun") for a in args)
    given = [a for a in args if not a.startswith("-")]
    job = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "app"  # (Hydra's job name: the script's)
    for overrides in (given, [a for a in given if a.startswith("hydra.")]):
        try:
            with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3", job_name=job):
                cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
                return str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir)
        except (HydraException, OmegaConfBaseException):
            continue  # (a sweep's lists do not compose; Hydra says what is wrong with its own settings)
    return None


def run_dir_error(config_dir: str, config_name: str, args: list[str]) -> str | None:
    """Why Hydra could not make the run (or sweep) directory ``args`` lead to, in one line, or
    None: Hydra makes it before the job runs, so a parent that is a file, a read-only file
    system or a folder without write permission surfaced as Hydra's traceback."""
    path = _planned_dir(config_dir, config_name, tuple(args))
    return None if path is None else directory_problem(path, "the run directory")


class RunDirBefore(NamedTuple):
    """The way to the run directory as it stood before Hydra made it (``run_dir_before_hydra``)."""

    existing: str  # the deepest folder that existed on the way (the run directory itself where it did)
    made: tuple  # every folder Hydra's mkdir makes, first made first (side ones of a ".." too)


def run_dir_before_hydra(config_dir: str, config_name: str, args: list[str] | None = None) -> RunDirBefore | None:
    """The run directory Hydra will make for ``args`` (this process's command line by default)
    as the file system has it now, absolute paths, or None where that cannot be told. Call it
    before Hydra starts: the folders it lists are the ones this run makes, which a refused run
    removes again (``rundir.remove_if_left_empty``), however deep ``hydra.run.dir`` is."""
    path = _planned_dir(config_dir, config_name, tuple(sys.argv[1:] if args is None else args))
    if path is None:
        return None
    parent = os.path.abspath(path)
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return RunDirBefore(parent, folders_mkdir_makes(path))


def folders_mkdir_makes(path: str) -> tuple:
    """The folders ``Path(path).mkdir(parents=True)`` (Hydra's) would make now, first made first,
    walked over ``path`` as written: ``x/../y/z`` makes ``x`` as well as ``y`` and ``y/z``, where
    ``os.path.abspath`` drops the ``x``. (``realpath`` resolves a ``..`` after a folder that
    exists as the kernel does, through a link; the new ones are plain folders.)"""
    made, walked = [], os.sep if os.path.isabs(path) else ""
    for part in path.split(os.sep):
        if part in ("", "."):
            continue
        walked = os.path.join(walked, part)
        folder = os.path.realpath(walked)
        if not os.path.isdir(folder) and folder not in made:
            made.append(folder)
    return tuple(made)


def directory_problem(path: str, what: str) -> str | None:
    """Why the folder ``path`` could not be made, in one line naming it as ``what``, or None
    (it is there, or its first existing parent is a folder this process may write to)."""
    path = os.path.abspath(path)
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent == path and os.path.isdir(path):
        return None  # (there already: the run checks what it may write)
    if not os.path.isdir(parent):
        return f"cannot create {what} {path}: {parent} is a file"
    # a real try, not os.access: root passes every permission check, and /proc or /sys still refuse
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mesa-write-check-", dir=parent))
    except OSError as err:
        return (f"cannot create {what} {path}: {parent} is not writable "
                f"({err.strerror or 'read-only or no permission'})")
    return None


def exit_on_bad_overrides(config_dir: str, config_name: str, prefix: str = "error: ") -> None:
    """``override_error`` for this process's command line: printed as ``<prefix><line>`` on
    stderr and exit status 2 (a usage error) when there is one; a run directory Hydra could not
    make (``run_dir_error``): exit status 1, as a write error of the run."""
    problem = override_error(config_dir, config_name, sys.argv[1:])
    if problem is not None:
        _say_once(f"{prefix}{problem}")
        raise SystemExit(2)
    problem = run_dir_error(config_dir, config_name, sys.argv[1:])
    if problem is not None:
        _say_once(f"{prefix}{problem}")
        raise SystemExit(1)


def _say_once(line: str) -> None:
    """``line`` on stderr from one process: under torchrun every rank finds the same mistake."""
    if int(os.environ.get("RANK", "0") or 0) == 0 or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
