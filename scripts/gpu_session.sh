#!/usr/bin/env bash
# One command for a lent GPU machine (its own PyTorch, no registry access): install the
# pure-Python packages carried as wheels in .whl/ (made here by `make gpu-wheels`), build
# the extension for this GPU's architecture only, then run, in priority order and each
# bounded in time: the CUDA tests, the kernel bandwidth benchmark, the DeiT-S rows of
# table1 and modern (eager and compiled) with profile=true, then the speed preset's knobs
# (its traceable-compile rows, the slowest to compile, as a step of their own).
# Results land in results/ (named after the GPU) and, when $OUT is set (the device tool),
# also in $OUT.
#
#   bash scripts/gpu_session.sh            # everything: up to 35 minutes of step limits
#   STEPS="tests kernels" bash scripts/gpu_session.sh    # the device tool allows 10 minutes a
#   STEPS="table1 modern" bash scripts/gpu_session.sh    # command: run it as these four calls
#   STEPS=speed bash scripts/gpu_session.sh              # (each under 10 minutes on an H100)
#   STEPS=traceable bash scripts/gpu_session.sh
#   TESTS="tests/test_x.py" TESTS_LIMIT=120 STEPS=tests ...  # a few tests again, after a fix
#
# results/ is packed into $OUT after every step, so a call stopped at its limit still brings
# back what the finished steps wrote. Rehearsed on CPU under the image's torch (2.11): builds
# (CPU and sm_90) and the CPU suite pass there (see the compat211 commits).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
STEPS=${STEPS:-"tests kernels table1 modern speed traceable"}
VALID_STEPS="tests kernels table1 modern speed traceable"
for s in $STEPS; do  # a typo fails here, before minutes of install and build
  case " $VALID_STEPS " in *" $s "*) ;; *) echo "gpu_session.sh: unknown step '$s'; valid: $VALID_STEPS"; exit 2 ;; esac
done
LOG_DIR=${OUT:-results/gpu-session}
mkdir -p "$LOG_DIR"

pack() {  # what comes back through the device tool ($OUT keeps at most 8 files, 2 folders deep)
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/results.tgz" results && echo "results/ packed into \$OUT/results.tgz"
  fi
}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, pack, never stop the session
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]}"
  pack
}

# 0. a CUDA device for $PY (checked first: nothing is installed or built without one)
ARCH=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null) || { echo "gpu_session.sh: no CUDA device visible to $PY (this script is for the lent GPU machine)"; exit 1; }
echo "GPU: $($PY -c 'import torch; print(torch.cuda.get_device_name())'), arch $ARCH, torch $($PY -c 'import torch; print(torch.__version__)')"

# 1. packages this image lacks (pure Python, carried as wheels)
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# 2. the extension, for this GPU only (one arch: minutes instead of three archs' worth)
# A build carried from an earlier call of this session (the machine went back between calls;
# .gpubuild/ holds the .so the first call left in $OUT) is reused when it loads with CUDA kernels.
if ls .gpubuild/_C*.so >/dev/null 2>&1; then
  cp .gpubuild/_C*.so mesa_train/
  $PY -c 'import sys, mesa_train.quant as q; sys.exit(q.CUDA_BACKEND != "extension")' \
    && echo "reusing the carried build .gpubuild/$(cd .gpubuild && ls _C*.so)" \
    || { echo "the carried build does not load with CUDA kernels: rebuilding"; rm -f mesa_train/_C*.so; }
fi
if ! ls mesa_train/_C*.so >/dev/null 2>&1; then
  t0=$SECONDS
  TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=${MAX_JOBS:-16} $PY setup.py -q build_ext --inplace > "$LOG_DIR/build.log" 2>&1 \
    || { tail -30 "$LOG_DIR/build.log"; exit 1; }
  echo "built the extension for sm_${ARCH/./} in $((SECONDS - t0)) s"
  # for a later call: copy it into .gpubuild/ and carry it (without -g's symbols it fits $OUT's 16 MiB)
  [ -n "${OUT:-}" ] && for so in mesa_train/_C*.so; do strip --strip-debug -o "$OUT/$(basename $so)" "$so"; done
fi
$PY -c 'import mesa_train.quant as q; print("mesa backend:", q.BACKEND, "CUDA:", q.CUDA_BACKEND)'

# 3. the work, most important first
for s in $STEPS; do
  case $s in
    tests)   step cuda-tests ${TESTS_LIMIT:-320} $PY -m pytest -q -m cuda -p no:cacheprovider --durations=10 ${TESTS:-tests} ;;
    kernels) step kernel-bandwidth 120 $PY -m mesa_train.quant.benchmark ;;
    table1)  step table1-deit-s 150 $PY -m mesa_train.bench preset=table1 only=DeiT-S profile=true progress=false ;;
    # skip=traceable: that row's compile alone outlasts a 10-minute call (compile_kernels.py)
    modern)  step modern-deit-s ${MODERN_LIMIT:-420} $PY -m mesa_train.bench preset=modern only=DeiT-S skip=traceable profile=true progress=false ;;
    # one knob at a time (row scales, rounding, delayed estimates, ops vs traceable, CUDA graphs):
    # where the time goes; the traceable rows (the slowest compiles, not yet timed on a GPU) are
    # a step of their own, into their own folder, so a time limit there costs the others nothing
    speed)   step speed-deit-s ${SPEED_LIMIT:-480} $PY -m mesa_train.bench preset=speed skip=traceable profile=true progress=false ;;
    traceable) step speed-traceable ${TRACEABLE_LIMIT:-480} $PY -m mesa_train.bench preset=speed only=traceable profile=true progress=false output_dir=results/speed-traceable ;;
  esac
done

