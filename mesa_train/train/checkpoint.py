"""Checkpoints: atomic writes, clear errors on bad files, RNG state capture.

A checkpoint is one ``torch.save`` dict::

    format, version      "mesa-train-checkpoint", 1
    model                state_dict, Mesa running estimates (alpha/beta buffers) included
    optimizer, scheduler, scaler, ema      state_dicts (None when unused)
    state                TrainState as a dict: epoch, batch_in_epoch, step, best_top1
    rng                  one entry per rank: python, numpy, torch, cuda generator states
    config               the resolved config (plain dict)
    metrics              the last evaluation

Files are written to a temporary file in the same directory, fsync-ed, then moved over the
old one with ``os.replace``: a crash mid-write leaves the previous checkpoint intact.
Loading uses ``torch.load(weights_only=True)`` (no arbitrary code from a file).
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np
import torch

from mesa_train.nn.quantizer import STATE_BUFFERS
from mesa_train.patch.checkpoint import is_mesa_key, stock_to_patched_state_dict, upgrade_state_dict

FORMAT = "mesa-train-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or does not fit the current model/config."""


# ------------------------------------------------------------------------ RNG states


def rng_state() -> dict:
    """This process's python, numpy, torch (CPU) and CUDA generator states."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ----------------------------------------------------------------------- save / load


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _WriteRecorder:
    """A file wrapper that remembers the ``OSError`` of a failed write: torch.save turns
    it into "enforce fail at inline_container.cc", which hides "no space left on device"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name):
        return getattr(self.f, name)


def _default_file_mode() -> int:
    """0666 minus the umask: what ``open()`` would create (mkstemp uses 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_file(fd: int, write) -> None:
    """``write(f)`` into ``fd``, flushed, fsync-ed and closed. A failed write surfaces as
    the ``OSError`` of the file system (ENOSPC, EDQUOT, EIO ...), whatever torch made of it."""
    raw = os.fdopen(fd, "wb")
    f = _WriteRecorder(raw)
    try:
        write(f)
        f.flush()
        os.fsync(raw.fileno())
    except (RuntimeError, OSError) as err:
        cause = f.error if f.error is not None else err
        if not isinstance(cause, OSError):
            raise
        raise OSError(cause.errno, cause.strerror) from err
    finally:
        try:
            raw.close()
        except OSError:  # the buffered rest could not be written either: already reported
            pass


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        try:
            _write_file(fd, write)
        except OSError as err:
            raise OSError(err.errno, err.strerror, folder) from err.__cause__
        os.chmod(tmp, _default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def save_checkpoint(payload: dict, path: str) -> None:
    """Write ``payload`` (plus the format tag) to ``path`` atomically."""
    data = {"format": FORMAT, "version": VERSION, **payload}
    _atomic_write(path, lambda f: torch.save(data, f))


def copy_checkpoint(src: str, dst: str) -> None:
    """Atomically copy a written checkpoint (best.pt -> last.pt)."""
    with open(src, "rb") as source:
        _atomic_write(dst, lambda f: shutil.copyfileobj(source, f, 16 << 20))


def load_failure(err: Exception) -> str:
    """torch.load's error in one line. An unpickling failure under weights_only is said
    without torch's text, which advises loading with weights_only=False: running whatever code
    the file holds, never the remedy for a file that is not a mesa-train checkpoint."""
    if isinstance(err, pickle.UnpicklingError):
        return "UnpicklingError: it holds more than tensors and plain data, or is not a pickle at all"
    first = (str(err).strip().splitlines() or [""])[0]
    # (torch's zip errors go on for sentences of advice; the first says what is wrong, whole)
    first = first.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {first[:200]}"


# how the error of a file torch cannot read begins (runner's advice tells it from a refused one)
UNREADABLE = "cannot read checkpoint"


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint written by ``save_checkpoint``; ``CheckpointError`` otherwise."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, garbage bytes, pickle errors ...
        raise CheckpointError(
            f"{UNREADABLE} {path}: the file is corrupt or truncated, or not a "
            f"torch checkpoint ({load_failure(err)})"
        ) from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a mesa-train checkpoint (no '{FORMAT}' tag)")
    if int(ckpt.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {ckpt['version']}, newer than this code's {VERSION}; "
            "update mesa-train"
        )
    for key in ("model", "config", "state"):
        if key not in ckpt:
            raise CheckpointError(f"{path} is incomplete: it has no '{key}' entry")
    return ckpt


# ----------------------------------------------------------------------- compatibility

# Config values that change the model's parameters or buffers: a checkpoint only fits a
# model built with the same ones.
_MODEL_KEYS = ("name", "img_size", "depth", "embed_dim", "num_heads", "kwargs")
_MESA_KEYS = ("enabled", "ops", "modules", "num_groups")


def check_compatible(saved_cfg: dict, cfg: dict, path: str) -> None:
    """Raise ``CheckpointError`` naming every model/Mesa setting that differs."""
    diffs = []
    for group, keys in (("model", _MODEL_KEYS), ("mesa", _MESA_KEYS)):
        for key in keys:
            old = (saved_cfg.get(group) or {}).get(key)
            new = (cfg.get(group) or {}).get(key)
            if old != new:
                diffs.append(f"{group}.{key}: checkpoint {old!r}, now {new!r}")
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} does not fit the current config:\n  - " + "\n  - ".join(diffs)
            + "\nuse the checkpoint's settings, or start the new model in another run directory "
            "(hydra.run.dir=...)"
        )


# Settings a resumed run may change: they do not enter the arithmetic of training (where
# and how fast it runs, logging, stopping point). Everything else must match the checkpoint:
# the optimizer, scheduler and sampler state saved in it were built from those values.
RESUME_MAY_CHANGE = (
    "name", "logger", "model.pretrained_path", "data.root", "data.download", "data.verify_md5",
    "data.skip_corrupt",
    "trainer.max_steps", "trainer.device", "trainer.fsdp", "trainer.num_workers", "trainer.pin_memory",
    "trainer.progress", "trainer.log_every", "trainer.checkpoint_every", "trainer.eval_every",
    "trainer.resume", "trainer.overwrite", "trainer.compile", "trainer.compile_mode", "trainer.compile_scope",
    "trainer.channels_last",
    "trainer.grad_checkpointing", "trainer.nonfinite", "trainer.max_nonfinite_skips",
    "mesa.compile_kernels",  # the same bits either way (mesa_train/quant/compile_kernels.py)
)


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


# Settings added after checkpoints were already being written (configs/ history from the first
# commit, 2026-11-21): one that a checkpoint does not have was this value then, the behaviour
# of the code that wrote it (so older runs still resume, and a changed default is named: an old
# run resumes with mesa.mlp=separate, as it trained; a review found every key but the first
# missing, so no run from before 2026-11-25 could resume)
ADDED_SETTINGS = {
    "trainer.strategy": "ddp",
    "mesa.row_scale": True,  # (2026-11-23: the library's default before the key)
    "mesa.scale": "linear", "mesa.bits": 8, "mesa.layout": "channel",  # (2026-11-23: the variants)
    "mesa.plan": None, "mesa.budget": None, "mesa.budget_gb": None,  # (2026-11-23: the planner)
    "mesa.cancelling_bn": "stock",  # (2026-11-24: patch_model's default when the key came)
    "mesa.clip_horizon": 1,  # (2026-11-24)
    "mesa.mlp": "separate", "mesa.norm_linear": "separate",  # (2026-11-25: the shared copies came)
    "mesa.duplicates": "keep",  # (2026-12-07: patch/duplicates.py; an older run resumes with mesa.duplicates=keep)
    "optim.layer_decay": None,  # (2026-11-23)
}


def changed_settings(saved_cfg: dict, cfg: dict) -> list[str]:
    """``key: checkpoint -> now`` for every setting that differs and may not change on
    resume (see ``RESUME_MAY_CHANGE``)."""
    old, new = _flatten(saved_cfg or {}), _flatten(cfg or {})
    for key, value in ADDED_SETTINGS.items():
        old.setdefault(key, value)

    def allowed(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in RESUME_MAY_CHANGE)

    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if not allowed(k) and old.get(k) != new.get(k)]


def check_same_classes(ckpt: dict, num_classes: int, classes, data_root, path: str, what: str) -> None:
    """The data's classes are the checkpoint's: the same count (else its head does not fit, which
    read as another model) and, where both name them, the same names in the same order (class
    folders renamed or reordered trained or scored the wrong labels without a word). ``what``:
    the refused action ("resume", "evaluate")."""
    where = f" (data.root={data_root})" if data_root else ""
    saved_n = ckpt.get("num_classes")
    if saved_n is not None and int(saved_n) != int(num_classes):
        raise CheckpointError(f"cannot {what} {path}: it was trained on {saved_n} classes, the data{where} has "
                              f"{num_classes}; use the data it was trained on (model.pretrained_path starts a new "
                              "run from its weights with another head)")
    saved = ckpt.get("classes")
    if saved and classes and list(saved) != list(classes):
        diff = [f"{i}: {a!r} -> {b!r}" for i, (a, b) in enumerate(zip(saved, classes)) if a != b]
        raise CheckpointError(f"cannot {what} {path}: the data's classes{where} differ from the ones it was trained "
                              f"on (label: checkpoint -> data: {', '.join(diff[:5])}"
                              f"{', ...' if len(diff) > 5 else ''}); the labels would not mean the same")


def pretrained_from(path: str) -> str:
    """How to start a new run from the weights of checkpoint ``path``: model.pretrained_path
    takes a file, so a sharded (FSDP) checkpoint is made one first."""
    if not os.path.isdir(path):
        return f"model.pretrained_path={path}"
    single = path.rstrip("/").removesuffix(".dcp") + ".pt"
    return (f"model.pretrained_path={single} (a file: make it with python -m mesa_train.train.convert {path} "
            f"{single})")


def check_same_settings(saved_cfg: dict, cfg: dict, path: str) -> None:
    """Resuming keeps the checkpoint's hyper-parameters: refuse, listing the changes."""
    changes = changed_settings(saved_cfg, cfg)
    if changes:
        raise CheckpointError(
            f"cannot resume from {path} with changed settings (its optimizer, schedule and data order "
            "follow the old ones):\n  - " + "\n  - ".join(changes)
            + "\nrestore them to continue this run, or start a new run directory from these weights "
            f"with {pretrained_from(path)}"
        )


def check_same_world(ckpt: dict, world: int, trainer_cfg, path: str) -> None:
    """Resuming keeps the checkpoint's process count: the global batch is ``batch_size x
    processes x grad_accum``, and the saved schedule (its learning rate was scaled by that
    batch) and data position (batches per rank) follow it. A checkpoint records one RNG state
    per process; one without any (older) is not checked."""
    saved = len(ckpt.get("rng") or [])
    if saved and saved != world:
        per_rank, accum = int(trainer_cfg.batch_size), int(trainer_cfg.grad_accum)
        raise CheckpointError(
            f"cannot resume from {path} with {world} process(es): it was written by {saved} (global batch "
            f"{per_rank * saved * accum} = {per_rank} x {saved} x {accum} accumulation, now "
            f"{per_rank * world * accum}), and its learning-rate schedule and data position follow that batch. "
            f"Resume with {saved} processes in all (torchrun), or start a new run directory from these weights "
            f"with {pretrained_from(path)}")


def check_finite_weights(state_dict: dict, names, source: str) -> None:
    """``CheckpointError`` where a parameter among ``names`` holds NaN or inf: a file written by a
    run that had already diverged would otherwise evaluate to garbage or restart the divergence
    with a misleading cause. Only parameters: a buffer may hold an infinity on purpose."""
    bad = []
    for k in names:
        value = state_dict.get(k)
        if torch.is_tensor(value) and value.is_floating_point():
            not_finite = int((~torch.isfinite(value)).sum())
            if not_finite:
                bad.append((k, not_finite))
    if bad:
        first, count = bad[0]
        more = f" (+{len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise CheckpointError(f"{source} holds non-finite weights: {first} has {count} NaN/inf values{more}; "
                              "the run that wrote it had diverged: use an earlier checkpoint")


def _estimate_layers(keys, by_layer) -> list:
    """The quantizers (key prefixes) of ``keys`` if every key is a Mesa running estimate
    (``alpha``, ``beta``, ``initialized``, ``rng``) of a quantizer whose whole estimate set is
    there (``by_layer``: prefix -> the entries present), else None: a format record, learned
    thresholds or a lone ``*quantizer*.alpha`` (a user's own quantization-aware module) is no
    estimate that may start afresh."""
    layers = set()
    for k in keys:
        prefix, _, entry = k.rpartition(".")
        if entry not in STATE_BUFFERS or not is_mesa_key(k) or set(STATE_BUFFERS[:3]) - by_layer.get(prefix, set()):
            return None
        layers.add(prefix)
    return sorted(layers)


def _entries(keys) -> dict:
    """``{key prefix (a module's name): the entries under it}`` of state-dict ``keys``."""
    out: dict = {}
    for k in keys:
        prefix, _, entry = k.rpartition(".")
        out.setdefault(prefix, set()).add(entry)
    return out


def _fresh_estimates(model, own, state_dict: dict, missing: list, unexpected: list, path: str, what: str):
    """``(state_dict, missing, unexpected)``: where only Mesa running estimates do not match (a
    layer this version compresses and the writing one did not, or the reverse; a stock
    checkpoint in a patched model), the missing ones fresh and the stale ones dropped, with one
    warning line; otherwise as given (the caller's error names them). ``own``: the model's
    state dict."""
    new, stale = _estimate_layers(missing, _entries(own)), _estimate_layers(unexpected, _entries(state_dict))
    if new is None or stale is None:
        return state_dict, missing, unexpected

    def named(layers):
        return ", ".join(layers[:3]) + (f" (+{len(layers) - 3} more)" if len(layers) > 3 else "")

    said = ([f"{len(new)} Mesa layers of this model have no estimates in it ({named(new)}): they start from the "
             "next batch"] if new else []) + ([f"the estimates of {len(stale)} layers this model does not have "
                                               f"({named(stale)}) are dropped"] if stale else [])
    warnings.warn(f"the {what} weights in {path}: " + "; ".join(said), UserWarning, stacklevel=3)
    dropped = set(unexpected)
    kept = {k: v for k, v in state_dict.items() if k not in dropped}
    return stock_to_patched_state_dict(kept, model), [], []


def load_model_state(model: torch.nn.Module, state_dict: dict, path: str, what: str = "model") -> None:
    """``load_state_dict(strict=True)`` with a readable error on missing/unexpected keys
    or shape mismatches (e.g. a checkpoint of another model), or on non-finite parameters.
    Mesa estimates alone not matching (a layer this version compresses that the writing one
    did not, or the reverse; a stock checkpoint in a patched model) is no error: one warning
    line, and the estimates missing start from the next batch (running statistics, not
    weights). Mesa keys an earlier version wrote elsewhere are moved first
    (``upgrade_state_dict``)."""
    state_dict = upgrade_state_dict(model, state_dict)
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if missing or unexpected:
        state_dict, missing, unexpected = _fresh_estimates(model, own, state_dict, missing, unexpected, path, what)
    shapes = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)}, model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state_dict and hasattr(state_dict[k], "shape") and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        def head(items):
            return ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")

        parts = []
        if missing:
            parts.append(f"missing keys: {head(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {head(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {head(shapes)}")
        raise CheckpointError(
            f"the {what} weights in {path} do not fit the model ({'; '.join(parts)}). "
            "Was it trained with another model or Mesa setting (mesa.enabled/ops/modules)?"
        )
    check_finite_weights(state_dict, [k for k, _ in model.named_parameters()], f"the {what} weights in {path}")
    model.load_state_dict(state_dict, strict=True)


def to_plain(cfg: Any) -> Any:
    """A resolved OmegaConf config (or anything) as plain python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return cfg
