#!/usr/bin/env bash
# Host-only emulation of the CUDA kernels (no GPU): extracts the kernels of
# csrc/cuda/quant_cuda.cu verbatim, runs them sequentially (quantize, dequantize, tables)
# or one std::thread per CUDA thread (group_minmax: barriers for __syncthreads and warp
# shuffles, divergent shuffles reported) over many layouts, and compares every byte with
# the DESIGN.md index math. Usage: csrc/cuda/host_check/run.sh [random cases, default 150]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
TI=$("$repo/.venv/bin/python" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
tmp=$(mktemp -d)
python3 "$here/extract.py" "$repo/csrc/cuda/quant_cuda.cu" > "$tmp/extracted.inc"
g++ -std=c++20 -O2 -ffp-contract=off -pthread -I"$tmp" -I"$repo/csrc" -I"$TI" -I"$TI/torch/csrc/api/include" \
    "$here/harness.cpp" -o "$tmp/harness"
"$tmp/harness" "${1:-150}"
