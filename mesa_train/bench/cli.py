"""Argument checks the bench's small commands share (``mesa_train.bench.overhead``,
``sdpa_backward_op``, ``pace``): a bad number or an output path that cannot be written is one
line and exit 2, found before minutes of timing rather than after them."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """``error: <message>`` on stderr, exit 2 (a usage error, as argparse's own)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def positive_int(text: str) -> int:
    """argparse ``type=``: a whole number of at least 1 (timed passes, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def folder_write_problem(folder: str) -> str | None:
    """Why files cannot be written into ``folder`` (made first when missing), or None: a probe
    file is written and removed, which also catches a read-only mount or a full disk that
    ``os.access`` reports as writable. The bench runner's output_dir and the commands'
    ``--output`` both go through here."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        return f"cannot make the folder {folder} ({err.strerror or type(err).__name__})"
    probe = os.path.join(folder, f".write-check-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        return f"cannot write into {folder} ({err.strerror or type(err).__name__})"
    return None


def check_output(path: str | None, option: str = "--output") -> None:
    """``fail`` unless ``path`` (a file to write; None: none) can be written: not a folder,
    and its folder (made when missing) takes a file."""
    if path is None:
        return
    if os.path.isdir(path):
        fail(f"{option} {path} is a folder; give a file name (e.g. {os.path.join(path, 'table.md')})")
    problem = folder_write_problem(os.path.dirname(os.path.abspath(path)))
    if problem is not None:
        fail(f"{option} {path}: {problem}")
