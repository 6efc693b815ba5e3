#!/usr/bin/env bash
# The sha256 of what the extension is built from (csrc/ and setup.py, in a fixed order): make
# gpu-prebuild records it beside the build it carries, and scripts/gpu_session.sh reuses that
# build only when it still matches (a build from older sources could lack an op or carry an
# op's older schema).
set -u
cd "$(dirname "$0")/.."
cat $(ls csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh 2>/dev/null | LC_ALL=C sort) setup.py | sha256sum | cut -d' ' -f1
