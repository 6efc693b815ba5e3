"""The CUDA kernels of csrc/cuda/quant_cuda.cu, run on the host (``csrc/cuda/host_check``).

``run.sh`` extracts the device code verbatim, shims CUDA (threads, barriers, atomics, warp
shuffles) and compares every output bit of every kernel with a naive sequential computation
(see the header of ``harness.cpp``). Without a GPU it is the only place the kernels run, so
this test keeps it compiling and passing: a kernel signature change that the harness does not
follow, or a kernel that stops matching its definition, fails here. It needs g++ with C++20,
``<ucontext.h>`` (the CUDA threads run as fibers) and torch's headers (found through
``sys.executable``), not the built extension.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_CHECK = REPO / "csrc" / "cuda" / "host_check"
CU = REPO / "csrc" / "cuda" / "quant_cuda.cu"
# quick mode (each fixed layout once) + 10 random layouts: about 50 s to compile and 60 s to
# run on 2 cores; the full run (run.sh with no arguments) takes minutes
CASES = "10"
# every kernel family the harness must have exercised (names of its CHECKED line)
FAMILIES = (
    "quantize", "quantize_rows", "dequantize", "dequantize_rows", "quantize_bits",
    "group_minmax", "observe", "observe_rows", "row_cells_flat_cpl1", "row_cells_flat_cpl2",
    "row_cells_flat_cpl4", "row_cells_flat_u32", "row_cells_flat_u64", "row_cells_flat_rounds",
    "row_cells_flat_idle_lanes", "row_cells_flat_cpl1_norm", "row_cells", "row_cells_norm",
    # the flat pass's last block: fused (the group totals from a chunk's partials and from a
    # chunk's scaled cells, the estimate and seed steps) and not (per-sample statistics); a
    # block's mean of the row maxima
    "row_cells_flat_fused", "row_cells_flat_unfused", "row_cells_flat_fused_estimates",
    "row_cells_flat_fused_clean_chunk", "row_cells_flat_fused_dirty_chunk", "row_mean",
    "quantize_observe_first", "quantize_observe_init", "quantize_observe_first_rows", "quantize_observe_init_rows",
    "update_estimates", "estimate_and_seed", "delayed_observe", "seed_of", "row_absmax", "row_absmax_vec", "row_k",
    "softmax_backward", "softmax_backward_64", "softmax_backward_map32", "softmax_backward_out32",
    "layer_norm_backward", "gelu_value_and_grad", "gelu_value_and_grad_rows",
    # the GELU epilogues from a table of the codes' values (with row exponents: rows of k = 0 from it)
    "gelu_backward_table", "gelu_backward_table_rows", "dequantize_gelu_table", "dequantize_gelu_table_rows",
    "gelu_value_and_grad_table", "gelu_value_and_grad_table_rows",
    # the column epilogue with its tables staged in shared memory
    "dequantize_cols_staged", "dequantize_cols_staged_rows",
)
KERNELS = ("quantize_kernel", "dequantize_kernel", "quantize_bits_kernel", "dequantize_bits_kernel", "observe_kernel",
           "quantize_observe_kernel", "update_estimates_kernel", "row_absmax_kernel", "row_cells_kernel",
           "row_cells_flat_kernel", "row_cells_finish", "block_row_max_mean",
           "softmax_backward_kernel", "layer_norm_backward_kernel")


def _no_cxx20_ucontext(tmp_path) -> str | None:
    """Why the harness cannot be built here (None: it can)."""
    if shutil.which("g++") is None:
        return "g++ not found"
    probe = tmp_path / "probe.cpp"
    probe.write_text("#include <ucontext.h>\n#include <version>\nstatic void f() {}\n"
                     "int main() { ucontext_t c; getcontext(&c); makecontext(&c, f, 0); }\n")
    proc = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", str(probe)], capture_output=True,
                          text=True)
    return None if proc.returncode == 0 else f"g++ lacks -std=c++20 or <ucontext.h>: {proc.stderr.strip()[:200]}"


def test_extract_takes_every_kernel_and_no_host_glue():
    """The extraction alone (no compiler needed): every kernel is in, the ATen glue is out
    (extract.py fails on a moved section boundary)."""
    proc = subprocess.run([sys.executable, str(HOST_CHECK / "extract.py"), str(CU)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in KERNELS:
        assert re.search(rf"\b{name}\(", proc.stdout), name
    for glue in ("at::Tensor", "OptionalCUDAGuard", "<<<", "make_krows(", "sm_count()", "softmax_backward_cuda("):
        assert glue not in proc.stdout, glue


@pytest.mark.slow
def test_cuda_kernels_match_their_definition_on_the_host(tmp_path):
    reason = _no_cxx20_ucontext(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable, "HOST_CHECK_TIMEOUT": "300"}
    proc = subprocess.run(["bash", str(HOST_CHECK / "run.sh"), CASES, "quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    lines = proc.stdout.splitlines()
    assert lines and lines[-1] == "ALL OK", tail
    checked = next((ln for ln in lines if ln.startswith("CHECKED ")), None)
    assert checked is not None, tail
    counts = {k: int(v) for k, v in (item.split("=") for item in checked.split()[1:])}
    missing = [f for f in FAMILIES if counts.get(f, 0) == 0]
    assert not missing, f"kernel families never exercised: {missing}\n{checked}"
