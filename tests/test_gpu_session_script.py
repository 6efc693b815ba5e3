"""scripts/gpu_session.sh (the lent GPU machine's one command) fails fast and clearly where
it cannot run (a step name it does not know, a deadline that is not a number, no CUDA device
for the given Python), and spends its one device call in priority order within DEADLINE
(checked with a stand-in Python that reports a GPU and only pretends to run the steps)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path, cwd=REPO, **env):
    full = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path), **env}
    return subprocess.run(["bash", str(cwd / "scripts" / "gpu_session.sh")], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_an_unknown_step_names_the_valid_ones(tmp_path):
    proc = _run(tmp_path, STEPS="tests bogus")
    assert proc.returncode == 2
    valid = ("host cppwrapper tests kernels kernels-base kernels-grid ncu ncu-grid grids modern graphs fused speed "
             "table1 traceable")
    assert f"unknown step 'bogus'; valid: {valid}" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing installed, built or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_no_gpu_is_a_one_line_error(tmp_path):
    proc = _run(tmp_path, STEPS="tests")
    assert proc.returncode == 1
    assert "no CUDA device visible" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_a_deadline_that_is_not_a_number_is_a_one_line_error(tmp_path):
    proc = _run(tmp_path, DEADLINE="9m")
    assert proc.returncode == 2
    assert proc.stdout.strip() == "gpu_session.sh: DEADLINE='9m' is not a number of seconds"


# A stand-in for the GPU image's python3: answers the script's device queries as an H100
# would, loads "the carried build", and spends STEP_SECONDS on each step's command instead of
# running it (each call is logged, so the test sees which steps ran with which arguments).
FAKE_PY = r"""#!/usr/bin/env bash
echo "${MESA_ROW_FINISH:+MESA_ROW_FINISH=$MESA_ROW_FINISH }$*" >> "$FAKE_LOG"
case "$*" in
  *get_device_capability*) echo 9.0 ;;
  *get_device_name*) echo "Fake H100" ;;
  *torch.__version__*) echo 2.11.0 ;;
  "-c import xdist") [ -n "${FAKE_XDIST:-}" ] ;;
  -c*) echo "mesa backend: extension CUDA: extension" ;;
  -m\ pip*) exit 0 ;;
  # the kernel table: this tree's into results/kernels/, an older build's (--variant NAME
  # --out-dir DIR) into DIR, as the benchmark names them
  "-m mesa_train.quant.benchmark")
    sleep "$STEP_SECONDS"; mkdir -p results/kernels; echo "| case |" > results/kernels/Fake-H100.md ;;
  "-m mesa_train.quant.benchmark --variant "*)
    sleep "$STEP_SECONDS"; set -- $*; echo "| case |" > "$6/Fake-H100.$4.md" ;;
  *) sleep "$STEP_SECONDS"; mkdir -p results/modern; echo "$*" > results/modern/fake.md ;;
esac
"""


@pytest.fixture
def fake_checkout(tmp_path):
    """The script in a scratch checkout with a carried build and a stand-in python3."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "gpu_session.sh")
    shutil.copy(SCRIPT.with_name("sources_sha.sh"), root / "scripts" / "sources_sha.sh")
    (root / "mesa_train").mkdir()
    (root / "csrc" / "cuda").mkdir(parents=True)
    (root / "csrc" / "ops.cpp").write_text("// ops\n")
    (root / "csrc" / "cuda" / "quant_cuda.cu").write_text("// kernels\n")
    (root / "setup.py").write_text("# build\n")
    (root / ".gpubuild").mkdir()
    (root / ".gpubuild" / "_C.abi3.so").write_bytes(b"")
    # what make gpu-prebuild records: the sources the build was made from
    sources = b"".join((root / p).read_bytes() for p in ("csrc/cuda/quant_cuda.cu", "csrc/ops.cpp", "setup.py"))
    (root / ".gpubuild" / "sources.sha256").write_text(hashlib.sha256(sources).hexdigest() + "\n")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    return root, fake, out


def test_steps_run_in_order_and_stop_at_the_deadline(fake_checkout, tmp_path):
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="2", DEADLINE="5", MIN_STEP="2",
                GRACE="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reusing the carried build .gpubuild/_C.abi3.so" in proc.stdout
    calls = log.read_text().splitlines()
    ran = [c for c in calls if c.startswith("-m pytest") or c.startswith("-m mesa_train")]
    # the kernel table first, then ncu's counters; the host preset, the tests, modern's DeiT-S
    # rows, the fused rows, speed and the C++ wrapper rows find less than MIN_STEP left
    assert ran[0].startswith("-m mesa_train.quant.benchmark")
    assert "scripts/ncu_kernels.py" in calls
    assert len(ran) == 1, ran
    for later in ("host-deit-s", "cuda-tests", "modern-deit-s", "speed-fused", "speed-deit-s", "host-cpp-wrapper"):
        assert f"=== {later} skipped:" in proc.stdout
    # what the steps wrote, and their logs, come back in one archive
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert "results/gpu-session/kernel-bandwidth.log" in names and "results/gpu-session/ncu-kernels.log" in names
    assert not (out / "_C.abi3.so").exists()  # nothing was built, so nothing is sent back


def test_a_step_is_clipped_to_the_time_left(fake_checkout, tmp_path):
    root, fake, out = fake_checkout
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(tmp_path / "calls.log"), STEP_SECONDS="0", DEADLINE="100",
                MIN_STEP="1", GRACE="10", STEPS="modern", MODERN_LIMIT="900")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    limits = [int(m) for m in re.findall(r"=== modern-deit-s \(limit (\d+)s", proc.stdout)]
    assert len(limits) == 1 and 80 <= limits[0] <= 90, proc.stdout  # DEADLINE less GRACE, less start-up


def test_the_cuda_tests_spread_over_workers_where_the_image_has_xdist(fake_checkout, tmp_path):
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), FAKE_XDIST="1", STEP_SECONDS="0", STEPS="tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (pytest_call,) = [c for c in log.read_text().splitlines() if c.startswith("-m pytest")]
    assert " -n 12 " in pytest_call and pytest_call.endswith(" tests")
    # the changed kernels' tests first, each an existing file (a limit cuts the rest)
    files = pytest_call.split(" -n 12 ", 1)[1].split()[:-1]
    assert files[:3] == ["tests/test_kernels.py", "tests/test_row_max_mean.py", "tests/test_row_scale_kernels.py"]
    assert len(files) == len(set(files)) == 9
    assert all((Path(__file__).parent.parent / f).is_file() for f in files), files


def test_a_carried_build_from_other_sources_is_rebuilt(fake_checkout, tmp_path):
    """A build made before a source change could lack an op or carry an op's older schema:
    the script builds anew, and sends back the build with the hash of its sources."""
    root, fake, out = fake_checkout
    (root / "csrc" / "ops.cpp").write_text("// ops, changed since the prebuild\n")
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="kernels")
    assert "is not from these sources (sources.sha256): rebuilding" in proc.stdout, proc.stdout
    assert "reusing the carried build" not in proc.stdout
    assert any(c.startswith("setup.py -q build_ext --inplace") for c in log.read_text().splitlines())


def test_the_grids_step_runs_each_policy_then_its_test(fake_checkout, tmp_path):
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="grids")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [c for c in log.read_text().splitlines() if c.startswith("-m pytest") or c.startswith("-m mesa_train")]
    assert ran == ["-m mesa_train.quant.benchmark --grid full", "-m mesa_train.quant.benchmark --grid resident",
                   "-m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_kernels_cuda_extra.py -k grid"]


def test_kernels_grid_times_the_grid_finish_beside_the_default_then_runs_its_tests(fake_checkout, tmp_path):
    """MESA_ROW_FINISH=grid (the row passes' finish as a launch of its own): the kernel table of
    this build under it (each row still checked against the reference), set beside the default
    table of this call (the default first), then the row passes' CUDA tests under it."""
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="kernels kernels-grid")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert (f"MESA_ROW_FINISH=grid -m mesa_train.quant.benchmark --variant row-finish-grid "
            f"--out-dir {root}/results/kernels") in calls, calls
    compare = [c for c in calls if c.startswith("scripts/compare_kernel_tables.py")]
    assert compare == ["scripts/compare_kernel_tables.py results/kernels/Fake-H100.md "
                       "results/kernels/Fake-H100.row-finish-grid.md "
                       "-o results/kernels/Fake-H100.vs-row-finish-grid.md"]
    tests = [c for c in calls if "-m pytest" in c]
    assert len(tests) == 1 and tests[0].startswith("MESA_ROW_FINISH=grid -m pytest -q -m cuda"), tests
    assert "tests/test_row_scale_kernels.py" in tests[0]
    assert "-m mesa_train.quant.benchmark" in calls  # (the default table: no MESA_ROW_FINISH)


def test_ncu_steps_pass_the_selection_and_the_grid_one_its_finish(fake_checkout, tmp_path):
    """NCU_OPS / NCU_CASES reach scripts/ncu_kernels.py (a regex with a "|" and a "$" kept whole);
    ncu-grid runs it under MESA_ROW_FINISH=grid into a report of its own."""
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="ncu ncu-grid",
                NCU_OPS="^(row_exponents|observe_rows)$", NCU_CASES="^(tokens|hidden)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ncu = [c for c in log.read_text().splitlines() if "scripts/ncu_kernels.py" in c]
    select = "--ops ^(row_exponents|observe_rows)$ --cases ^(tokens|hidden)"
    assert ncu == [f"scripts/ncu_kernels.py {select}",
                   f"MESA_ROW_FINISH=grid scripts/ncu_kernels.py --variant row-finish-grid {select}"], ncu
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="ncu")
    assert log.read_text().splitlines()[-1] == "scripts/ncu_kernels.py"  # (no selection: the script's own)


def test_kernels_base_is_skipped_without_an_older_build(fake_checkout, tmp_path):
    root, fake, out = fake_checkout
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="kernels kernels-base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== kernel-bandwidth-base skipped: no .gpubuild-base/ (make gpu-prebuild-base" in proc.stdout
    assert not any("--variant" in c for c in log.read_text().splitlines())


def test_kernels_base_times_the_older_build_and_sets_the_tables_side_by_side(fake_checkout, tmp_path):
    """make gpu-prebuild-base's .gpubuild-base/ (an older commit's extension and its rev): the
    kernel table again with that build loaded in place of this tree's, from a copy of mesa_train/
    run in its own directory, then scripts/compare_kernel_tables.py over the two tables this call
    wrote (a stale committed table is not compared)."""
    root, fake, out = fake_checkout
    (root / ".gpubuild-base").mkdir()
    (root / ".gpubuild-base" / "_C.abi3.so").write_bytes(b"older")
    (root / ".gpubuild-base" / "rev").write_text("abc1234\n")
    log = tmp_path / "calls.log"
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="kernels kernels-base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert f"-m mesa_train.quant.benchmark --variant base-abc1234 --out-dir {root}/results/kernels --no-check" in calls
    # the older build in the copy, this tree's (the carried .gpubuild/) left in place
    assert Path("/tmp/mesa-base/mesa_train/_C.abi3.so").read_bytes() == b"older"
    assert (root / "mesa_train" / "_C.abi3.so").read_bytes() == b""
    compare = [c for c in calls if c.startswith("scripts/compare_kernel_tables.py")]
    assert compare == ["scripts/compare_kernel_tables.py results/kernels/Fake-H100.base-abc1234.md "
                       "results/kernels/Fake-H100.md -o results/kernels/Fake-H100.vs-base-abc1234.md"], calls
    with tarfile.open(out / "results.tgz") as tar:
        assert "results/kernels/Fake-H100.base-abc1234.md" in tar.getnames()
    # this tree's table not written by the call (as a committed one): nothing compared
    os.utime(root / "results" / "kernels" / "Fake-H100.md", (0, 0))
    log.unlink()
    proc = _run(out, cwd=root, PY=str(fake), FAKE_LOG=str(log), STEP_SECONDS="0", STEPS="kernels-base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert any("--variant base-abc1234" in c for c in calls)
    assert not any(c.startswith("scripts/compare_kernel_tables.py") for c in calls), calls
