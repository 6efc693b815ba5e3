"""How a run ends badly: the exception types of the pipeline and their one-line messages.

``describe(err)`` turns an exception into ``(exit code, message)`` for the entry points
(train.py, evaluate.py): user errors and environment problems get one readable line and no
traceback; anything else is a bug and returns ``None`` (the caller lets it propagate).

Exit codes: 2 bad config/data/checkpoint/run directory, 3 non-finite loss or gradient,
1 environment (disk full, read-only directory), 130 Ctrl-C (SIGINT), 143 SIGTERM.
"""
from __future__ import annotations

import errno
import re


class RunDirError(RuntimeError):
    """The run directory is in use by another run, or holds a run this one would overwrite."""


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient; nothing after it was checkpointed."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after writing ``last.pt``."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


# errno -> the words users know
_OS_ERRORS = {
    errno.ENOSPC: "no space left on {path}",
    errno.EDQUOT: "disk quota exceeded on {path}",
    errno.EROFS: "cannot write to {path}: read-only file system",
    errno.EACCES: "cannot write to {path}: permission denied",
    errno.EPERM: "cannot write to {path}: operation not permitted",
    errno.ENOTDIR: "cannot write to {path}: a part of the path is a file",
    errno.EEXIST: "cannot write to {path}: a file is in the way of that folder",
}


def unwrap_worker_message(text: str) -> str:
    """A DataLoader worker's exception comes back as 'Caught X in DataLoader worker ...
    Original Traceback ...'; keep only the original message."""
    if text.startswith("Caught ") and "Original Traceback" in text:
        match = re.search(r"\n(?:[\w.]+\.)?(?:DataError|ConfigError|CheckpointError): (.*)\Z", text, re.S)
        if match:
            return match.group(1).strip()
    return text


# the words of a collective whose other end is gone: gloo (a plain RuntimeError naming its transport),
# NCCL (a DistBackendError: "remote process exited", ncclRemoteError) and the store (a DistError).
# Only these: a rank's own NCCL or CUDA error, a rendezvous or watchdog timeout keep their whole text
_LOST_PEER = re.compile(r"closed by peer|reset by peer|Broken pipe|remote process exited|ncclRemoteError", re.I)


def lost_peer(err: BaseException) -> str | None:
    """The gist of a collective that failed because another rank of the run died or was stopped
    (its own error is what matters), or None."""
    import torch.distributed as dist

    text = str(err)
    if not _LOST_PEER.search(text) or not (isinstance(err, dist.DistError) or "gloo" in text):
        return None
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip())  # gloo's "[.../pair.cc:561] " source location
    return text.split(". ")[0].splitlines()[0] if text else type(err).__name__


def describe(err: BaseException) -> tuple[int, str] | None:
    """``(exit code, message)`` for an expected failure, ``None`` for a bug."""
    from mesa_train.train.checkpoint import CheckpointError
    from mesa_train.train.config import ConfigError
    from mesa_train.train.data import DataError

    if isinstance(err, Interrupted):
        return err.exit_code, str(err)
    if isinstance(err, KeyboardInterrupt):
        return 130, "interrupted (Ctrl-C) before training started or while stopping; nothing was saved"
    if isinstance(err, NonFiniteError):
        return 3, str(err)
    if isinstance(err, (ConfigError, DataError, CheckpointError, RunDirError)):
        return 2, unwrap_worker_message(str(err))
    peer = lost_peer(err)
    if peer is not None:  # (said by every rank it reaches: the one that failed says why)
        return 1, (f"lost contact with another process of this run ({peer}): it failed or was stopped, and "
                   f"its own error is printed above or in its log; or the network between them failed")
    if isinstance(err, OSError) and err.errno in _OS_ERRORS:
        path = err.filename or "the run directory"
        return 1, _OS_ERRORS[err.errno].format(path=path)
    return None


def one_line(err: BaseException) -> str:
    """The message of ``describe`` or, for a bug, ``Type: first line`` (sweep summaries)."""
    described = describe(err)
    if described is not None:
        return described[1]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
