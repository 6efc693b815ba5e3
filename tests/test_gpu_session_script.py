"""scripts/gpu_session.sh (the lent GPU machine's one command) fails fast and clearly where
it cannot run: a step name it does not know, or no CUDA device for the given Python."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path, **env):
    full = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_an_unknown_step_names_the_valid_ones(tmp_path):
    proc = _run(tmp_path, STEPS="tests bogus")
    assert proc.returncode == 2
    assert "unknown step 'bogus'; valid: tests kernels table1 modern speed traceable" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing installed, built or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_no_gpu_is_a_one_line_error(tmp_path):
    proc = _run(tmp_path, STEPS="tests")
    assert proc.returncode == 1
    assert "no CUDA device visible" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
