#!/usr/bin/env bash
# Host-only emulation of the CUDA kernels (no GPU): extracts the device code of
# csrc/cuda/quant_cuda.cu verbatim and runs it on the CPU: quantize / dequantize
# sequentially over (block, thread); the single-launch observe / group_minmax kernel with
# its blocks in a random order and one std::thread per CUDA thread (barriers for
# __syncthreads), checking the last-block estimate update, the seed step and the
# workspace reset; update_estimates in one emulated block. Every result is compared bit
# for bit with a sequential pass over many layouts.
# Usage: csrc/cuda/host_check/run.sh [random cases, default 150]
# (PYTHON: an interpreter with torch, for its headers; default .venv/bin/python)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
PY=${PYTHON:-$repo/.venv/bin/python}
[ -x "$PY" ] || PY=python3
TI=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$here/extract.py" "$repo/csrc/cuda/quant_cuda.cu" > "$tmp/extracted.inc"
g++ -std=c++20 -O2 -ffp-contract=off -pthread -I"$tmp" -I"$repo/csrc" -I"$TI" -I"$TI/torch/csrc/api/include" \
    "$here/harness.cpp" -o "$tmp/harness"
"$tmp/harness" "${1:-150}"
