"""scripts/gpu_torch_check.sh (make gpu-torch-check): without its inputs it stops with one line that
says what to run, before copying or installing anything. (Its run itself needs .venv-gpu and
.gpubuild/, made by make gpu-prebuild, which CI does not have.)"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, venv: str, with_build: bool):
    """The script in a scratch copy of what it reads (scripts/, csrc/, setup.py), so the
    checkout's own .gpubuild/ is never touched."""
    work = tmp_path / "tree"
    for name in ("scripts", "csrc"):
        shutil.copytree(ROOT / name, work / name)
    shutil.copy(ROOT / "setup.py", work / "setup.py")
    if with_build:
        (work / ".gpubuild").mkdir()
        (work / ".gpubuild" / "_C.abi3.so").write_bytes(b"")
        (work / ".gpubuild" / "sources.sha256").write_text("built from older sources\n")
    (work / venv / "bin").mkdir(parents=True)
    (work / venv / "bin" / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    env = {**os.environ, "GPU_VENV": venv}
    return subprocess.run(["bash", "scripts/gpu_torch_check.sh"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("with_build,message", [
    (False, "gpu_torch_check: no .gpubuild/_C.abi3.so (make gpu-prebuild first)"),
    (True, "gpu_torch_check: .gpubuild/ was built from other sources than csrc/ now holds (make gpu-prebuild again)"),
])
def test_missing_or_stale_build_is_one_line(tmp_path, with_build, message):
    proc = _run(tmp_path, "venv-gpu", with_build)
    assert proc.returncode == 1
    assert proc.stdout.strip() == message and proc.stderr == ""


def test_missing_venv_is_one_line(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_torch_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GPU_VENV": str(tmp_path / "none")}, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.strip() == f"gpu_torch_check: no {tmp_path / 'none'} (make gpu-prebuild first)"
