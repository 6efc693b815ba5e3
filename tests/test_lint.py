"""pyflakes' findings over the project's Python (flake8 with the F codes, `.flake8`): an unused
import or variable, an undefined name, an f-string without a placeholder. Each is a defect a
reader cannot see and the tests do not catch (an import kept for nothing, a name a rarely run
branch lacks); `# noqa: F401` marks the imports kept for their side effect (op registration).
And lines of at most 120 characters (E501), the project's width."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PATHS = ("mesa_train", "scripts", "tests", "csrc", "train.py", "evaluate.py", "setup.py")


def test_no_pyflakes_findings():
    run = subprocess.run([sys.executable, "-m", "flake8", *PATHS], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"flake8 (F codes) found:\n{run.stdout}{run.stderr}"


def test_the_check_can_fail(tmp_path):
    """The same command on a file with an unused import and an undefined name reports both."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n\n\nLONG = " + repr("x" * 120) + "\n")
    run = subprocess.run([sys.executable, "-m", "flake8", "--config", str(REPO / ".flake8"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "F401" in run.stdout and "F821" in run.stdout and "E501" in run.stdout, run.stdout + run.stderr
