#!/usr/bin/env bash
# No GPU needed: the layer and model suites under the GPU image's PyTorch (.venv-gpu: torch
# 2.11, what `make gpu-prebuild` builds against), with the extension built for that image
# (.gpubuild/, which has the CPU kernels too), on this machine's CPU. A difference between
# torch versions shows up here instead of in the GPU session's minutes: session 48 found Mesa's
# GroupNorm handing torch 2.11's native_group_norm a strided input, which that version refuses
# (Mesa SHViT failed there; torch 2.14 takes it).
# Usage: bash scripts/gpu_torch_check.sh [pytest args]   (make gpu-torch-check)
#   default: the C++ layer ops against their Python Functions, the generic attention, the nn
#   layers and the timm models (MESA_TIMM_SWEEP=1 adds the 94-family sweep)
# Needs: make gpu-prebuild (the build must match the sources), and pytest, torchvision and the
# carried wheels in .venv-gpu (installed here from the registry and .whl/ when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-.venv-gpu}
case "$VENV" in /*) PY="$VENV/bin/python" ;; *) PY="$(pwd)/$VENV/bin/python" ;; esac  # (used after a cd)
[ -x "$PY" ] || { echo "gpu_torch_check: no $VENV (make gpu-prebuild first)"; exit 1; }
[ -f .gpubuild/_C.abi3.so ] || { echo "gpu_torch_check: no .gpubuild/_C.abi3.so (make gpu-prebuild first)"; exit 1; }
if [ "$(cat .gpubuild/sources.sha256 2>/dev/null)" != "$(bash scripts/sources_sha.sh)" ]; then
  echo "gpu_torch_check: .gpubuild/ was built from other sources than csrc/ now holds (make gpu-prebuild again)"
  exit 1
fi
# the test dependencies the build venv lacks: torchvision matching its torch, the carried wheels
if ! "$PY" -c "import pytest, torchvision, timm, omegaconf" 2>/dev/null; then
  tv=$("$PY" -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.0')")
  "$PY" -m pip install -q pytest "torchvision==$tv" .whl/*.whl
fi
# a copy of the tracked tree with the prebuilt extension in it (the checkout's own _C stays)
tree=$(mktemp -d /tmp/mesa-gpu-torch-check.XXXXXX)
trap 'rm -rf "$tree"' EXIT
git ls-files -z | xargs -0 tar -cf - | tar -x -C "$tree"
cp .gpubuild/_C.abi3.so "$tree/mesa_train/"
cd "$tree"
# (the tests that run a script in a subprocess import mesa_train from this copy, as an installed
# checkout would: .venv-gpu has no mesa_train of its own)
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, mesa_train.quant as Q; print('torch', torch.__version__, '| extension:', Q.BACKEND)"
if [ $# -eq 0 ]; then
  set -- tests/test_convnet_autograd.py tests/test_scale_autograd.py tests/test_layers_autograd.py \
    tests/test_patch_generic.py tests/test_nn_layers.py tests/test_nn_hard_activations.py \
    tests/test_bn_cancellation.py tests/test_squeeze_excite.py tests/test_scale_branch.py tests/test_timm_models.py
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
