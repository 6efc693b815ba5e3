"""Who owns a run directory, and what a new run may do to an existing one.

* ``RunDirLock``: a run holds an exclusive ``flock`` on ``<run dir>/.lock`` while it runs;
  the file names the owner (pid, host, start time) and is removed when the run ends. A
  second run on the same directory refuses with that owner. The kernel drops the lock when
  the owner dies (even on ``kill -9``), so a lock file left by a killed run never blocks
  a later one.
* ``existing_run``: the artifacts a previous run left (checkpoints, logs, summary). A fresh
  start (no checkpoint to resume) refuses to replace them unless ``trainer.overwrite=true``.
* ``clean_stale_temporaries``: ``.last.pt.*.tmp`` files left by a kill mid-write.
* ``record_config``: the ``.hydra/`` files, written only once a run is accepted (Hydra's
  own copy is off: ``hydra.output_subdir: null``), so a run rejected at start-up leaves an
  existing directory as it was.
* ``remove_if_left_empty``: and a new one it made is removed (train.py, evaluate.py).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import time

from mesa_train.train.errors import RunDirError
from mesa_train.train.logfile import drop_replaced_log

LOCK_NAME = ".lock"
# Files a training run writes; their presence means "a run lived here".
ARTIFACTS = ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.csv", "metrics.jsonl", "steps.csv",
             "summary.json",
             # sharded checkpoints (trainer.strategy=fsdp) are directories
             "checkpoints/last.dcp", "checkpoints/best.dcp", "checkpoints/last.dcp.old")


class RunDirLock:
    """Exclusive ownership of a run directory (see the module docstring)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        existed_dir = os.path.isdir(self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as err:
                if not existed_dir:
                    _remove_empty(self.run_dir)
                raise OSError(err.errno, err.strerror, self.run_dir) from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise RunDirError(
                    f"run directory {os.path.abspath(self.run_dir)} is in use by {owner}; wait for that run "
                    "to end, or choose another directory (hydra.run.dir=...)"
                ) from None
            # The owner removes the file when it ends; a lock taken on a file that was just
            # removed protects nothing: try again on the new file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        except OSError as err:  # (a full disk: no empty .lock left behind, the folder named)
            self.release()
            if not existed_dir:
                _remove_empty(self.run_dir)
            raise OSError(err.errno, err.strerror, self.run_dir) from err

    def release(self) -> None:
        """Drop the lock and remove the lock file (nothing is left behind, and a run
        rejected at start-up leaves the directory as it was)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _read_owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process"
    return f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')})"


def _remove_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass


def existing_run(run_dir: str) -> list[str]:
    """The artifacts of an earlier run in ``run_dir`` (relative paths)."""
    return [name for name in ARTIFACTS if os.path.exists(os.path.join(run_dir, name))]


def refuse_or_clear(run_dir: str, overwrite: bool, resume: str | None = None) -> None:
    """A fresh start in ``run_dir`` (or a resume from ``resume``, a checkpoint outside it):
    refuse when it holds an earlier run's files, unless ``overwrite`` (then they are removed, so
    no old best.pt or log row survives)."""
    found = existing_run(run_dir)
    if not found:
        return
    if not overwrite and resume is not None:
        raise RunDirError(
            f"run directory {os.path.abspath(run_dir)} already holds a run ({', '.join(found)}), and "
            f"trainer.resume={resume} is a checkpoint from elsewhere: resuming it here would mix the two runs' "
            "logs and best.pt. Choose another directory (hydra.run.dir=...), continue this directory's own run "
            "with trainer.resume=auto, or replace it with trainer.overwrite=true"
        )
    if not overwrite:
        # (a sharded run relaunched without its strategy finds no last.pt: say what it needs)
        sharded = os.path.isdir(os.path.join(run_dir, "checkpoints", "last.dcp"))
        how = ("trainer.strategy=fsdp (it holds a sharded checkpoint, checkpoints/last.dcp)" if sharded else
               "trainer.resume=auto (it needs checkpoints/last.pt)")
        raise RunDirError(
            f"run directory {os.path.abspath(run_dir)} already holds a run ({', '.join(found)}) and this one "
            f"would start from scratch over it. Continue it with {how}, choose another directory "
            "(hydra.run.dir=...), or replace it with trainer.overwrite=true"
        )
    for name in found:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    drop_replaced_log(run_dir)


def clean_stale_temporaries(checkpoint_dir: str) -> list[str]:
    """Remove ``.<name>.*.tmp`` files of interrupted checkpoint writes (the directory is
    owned by this run, so no write is in progress). Returns the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(checkpoint_dir, ".*.pt.*.tmp")):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    # sharded checkpoints: .last.dcp.tmp/ (a save in progress) and best.dcp's copy
    for path in glob.glob(os.path.join(checkpoint_dir, ".*.dcp.tmp")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def record_config(run_dir: str, cfg) -> None:
    """Write ``.hydra/{config,hydra,overrides}.yaml`` as Hydra would, when running under
    Hydra (a no-op for in-process callers such as the demo and the tests)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    folder = os.path.join(run_dir, ".hydra")
    os.makedirs(folder, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(folder, "config.yaml"))
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), os.path.join(folder, "hydra.yaml"))
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), os.path.join(folder, "overrides.yaml"))


def refusal_record(run_dir: str) -> str:
    """Where a sweep job refused at start-up over an earlier run's directory records its failure:
    beside the job directories (``<sweep dir>/failed-<job>.json``), since the refused run must
    leave that directory as it was (its ``failed.json`` marked the earlier, finished run failed)."""
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"failed-{os.path.basename(run_dir)}.json")


def remove_file(path: str) -> None:
    """Remove ``path`` if it is there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_failure(run_dir: str, message: str, path: str | None = None, status: str = "failed") -> None:
    """A failed sweep job's record (``failed.json``, or ``path``), read by the sweep summary;
    ``status`` "interrupted" for a job a stop signal ended (its checkpoint resumes it).
    The job's overrides are kept in it too: a job rejected at start-up has no ``.hydra/``."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            overrides = list(HydraConfig.get().overrides.task)
    except ImportError:  # pragma: no cover
        pass
    path = path or os.path.join(run_dir, "failed.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"status": status, "error": message, "overrides": overrides}, f, indent=2)


def remove_if_left_empty(run_dir: str, started: float, before=None) -> None:
    """A run refused at start-up writes nothing (``.hydra/`` and the log file come after the
    checks), but Hydra has made its directory by then: remove it when it is empty, and the
    folders this run made on the way and leaves empty. ``before``: the way to the run directory
    as it stood before Hydra started (``hydra_cli.run_dir_before_hydra``): every empty folder
    below its ``existing`` one on the way to ``run_dir`` goes (``hydra.run.dir=a/b/c`` left
    ``a/b`` behind before), and so does each of its ``made`` ones left empty
    (``hydra.run.dir=x/../y/z`` makes ``x`` too). Without it, or where ``run_dir`` is not below
    its ``existing`` one (the planned directory was another): the run directory when it
    was made after ``started`` (this process's start; a folder made earlier, even empty, stays),
    and in the default layout ``outputs/<date>/`` and ``outputs/`` when left empty and new too.
    Under torchrun every rank tries; an error (another rank was first) is ignored."""
    folder = os.path.abspath(run_dir)
    stop = None if before is None else os.path.abspath(before.existing)
    if stop is not None and (folder == stop or folder.startswith(stop + os.sep)):
        while folder.startswith(stop + os.sep) and _removed_if_empty(folder):
            folder = os.path.dirname(folder)
        for made in reversed(before.made):  # (last made first: a folder's own new ones went before it)
            _removed_if_empty(made)
        return
    # (no such folder, or one not on the way to run_dir: the planned run directory was not this
    # one, and the rule below, which removes only what was made after `started`, applies)
    folders = [run_dir]
    date_folder = os.path.dirname(run_dir)
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", os.path.basename(date_folder)):  # (the default layout's)
        folders += [date_folder] + ([os.path.dirname(date_folder)]
                                    if os.path.basename(os.path.dirname(date_folder)) == "outputs" else [])
    for folder in folders:
        try:
            if os.stat(folder).st_ctime < started - 1 or not _removed_if_empty(folder):
                return
        except OSError:
            return


def _removed_if_empty(folder: str) -> bool:
    try:
        if os.listdir(folder):
            return False
        os.rmdir(folder)
    except OSError:
        return False
    return True
