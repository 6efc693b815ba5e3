#!/usr/bin/env bash
# Host-only emulation of the CUDA kernels (no GPU): extracts the device code of
# csrc/cuda/quant_cuda.cu verbatim (extract.py) and runs every kernel on the CPU
# (harness.cpp), each output bit against a naive sequential computation:
# * quantize / dequantize (vector, scalar and 64-bit index paths; without and with int8 row
#   exponents of 1 or 2 row dims, row_mul, and the col_scale / col_shift epilogue) and
#   quantize_bits / dequantize_bits: sequential over (block, thread);
# * observe / group_minmax, quantize_observe (the fused launch + the skip-flagged quantize
#   launch; first batch and initialized estimates) and update_estimates / estimate_and_seed:
#   blocks in a random order, each CUDA thread a fiber (barriers for __syncthreads),
#   checking the last-block estimate update, the seed step, the ws[1] flag and the reset
#   workspace;
# * row_absmax (warp per row, __shfl_xor_sync across 32 lane threads) and its last block's k;
# * observe_rows: the row pass (flat over whole-chunk segments with atomicMax for max|x|, or
#   warp per row), and each pass's last block (the mean of the row maxima, k, the cells times
#   2**k; the flat pass with shared statistics also the group totals, the estimate and seed
#   steps) and the zeroed workspace; block_row_max_mean.
# The harness's last lines: "CHECKED kernel=cases ..." and "ALL OK" (or "FAILED", exit 1).
# Usage: csrc/cuda/host_check/run.sh [random cases, default 150] [quick]
#   quick: each fixed layout once (one dtype / SM count / statistics combination) instead
#   of all 18 combinations (tests/test_cuda_host_emulation.py): with 10 random cases about
#   57 s to run and 49 s to compile on 2 cores (2026-11-29). -O1: -O2 compiled 17 s longer
#   and ran no faster; neither changes the float arithmetic (no fast-math, no FMA contraction).
# Environment: PYTHON, an interpreter with torch (for its headers; default .venv/bin/python);
# QUANT_CUDA, the .cu file to extract (default csrc/cuda/quant_cuda.cu; mutation checks);
# HOST_CHECK_TIMEOUT, seconds before the harness is killed (a kernel that loops forever; one
# whose lanes skip a barrier or shuffle is named and aborted by the harness; default 1800).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
PY=${PYTHON:-$repo/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cu=${QUANT_CUDA:-$repo/csrc/cuda/quant_cuda.cu}
TI=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" "$here/extract.py" "$cu" > "$tmp/extracted.inc"
g++ -std=c++20 -O1 -ffp-contract=off -I"$tmp" -I"$repo/csrc" -I"$TI" -I"$TI/torch/csrc/api/include" \
    "$here/harness.cpp" -o "$tmp/harness"
timeout "${HOST_CHECK_TIMEOUT:-1800}" "$tmp/harness" "${1:-150}" "${2:-full}"
