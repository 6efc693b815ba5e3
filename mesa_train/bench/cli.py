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


def check_output(path: str | None, option: str = "--output") -> None:
    """``fail`` unless ``path`` (a file to write; None: none) can be written: not a folder,
    its folder a folder that exists or can be made, and writable."""
    if path is None:
        return
    if os.path.isdir(path):
        fail(f"{option} {path} is a folder; give a file name (e.g. {os.path.join(path, 'table.md')})")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        fail(f"{option} {path}: cannot make its folder {folder} ({err.strerror or type(err).__name__})")
    if not os.access(folder, os.W_OK):
        fail(f"{option} {path}: its folder {folder} is not writable")
