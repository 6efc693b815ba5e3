#!/usr/bin/env bash
# One command for a lent GPU machine (its own PyTorch, no registry access): install the
# pure-Python packages carried as wheels in .whl/ (made here by `make gpu-wheels`), take the
# extension built here for that image by `make gpu-prebuild` (.gpubuild/; else build it there
# for this GPU's architecture only), then run the steps in priority order, each clipped to
# the time left before DEADLINE, so that one device call does the most it can:
#
#   host       the host preset's CUDA-graph rows (DeiT-S compiled, stock and Mesa, per block with
#              the traced compression and as one graph) with profile=true: compiled Mesa's GPU
#              time without the host's launch cost (H200, session 35: 0.72x as one graph)
#   cppwrapper the host preset's Inductor C++ wrapper pair (the longest compiles, so a step of
#              its own, into results/host-cpp-wrapper/) with profile=true
#   tests      the CUDA-marked tests (every kernel bitwise against the reference, the layers,
#              opcheck, CUDA-graph capture), over TEST_WORKERS processes when the image has
#              pytest-xdist
#   kernels    python -m mesa_train.quant.benchmark: each kernel's bandwidth against clone(),
#              and whether each row's ops gave the reference's results on that shape (column
#              "reference": the kernels changed without a GPU are checked before anything else)
#   kernels-base  the same table with an older build of the extension in this one's place
#              (.gpubuild-base/, make gpu-prebuild-base; this tree's Python; --no-check: its
#              codes predate this tree's reference), then both tables side
#              by side (scripts/compare_kernel_tables.py): the kernel changes made without a GPU,
#              measured on one GPU minutes apart; skipped without .gpubuild-base/
#   kernels-grid  the same table with MESA_ROW_FINISH=grid (the row passes' finish as a launch of
#              its own; each row still checked against the reference), side by side with the
#              kernels step's table of this call, then the row passes' CUDA tests under it
#   ncu        python scripts/ncu_kernels.py: Nsight Compute's counters (throughput, occupancy,
#              warp stalls) of the kernels holding Mesa's GPU time, into results/ncu/
#              (NCU_OPS, NCU_CASES: regexes over the kernel table's ops and cases)
#   ncu-grid   the same under MESA_ROW_FINISH=grid, into results/ncu/<device>.row-finish-grid.md
#   grids      the same table under the other grid policies of the quantize / dequantize launches
#              (--grid full, --grid resident: MESA_CUDA_GRID), then the CUDA test that each policy
#              gives the reference's codes: which grid the kernels should launch by default
#   modern     the DeiT-S rows of the modern preset (bf16: explicit and fused attention, eager
#              and compiled; issue 9's target table) with profile=true
#   graphs     the graphs preset: the eager DeiT-S steps (explicit and fused attention) captured
#              whole in one CUDA graph and replayed, beside the plain eager pairs, with
#              profile=true (its pace table): the eager ratios without the host
#   fused      the speed preset's fused-attention eager rows (stock, the sdpa set, sdpa alone,
#              the set without sdpa): which layers hold the fused Mesa step (H100: 52 ms a step
#              against 32.5 ms of GPU time), by host_ms_median; no profile (about a minute)
#   speed      the speed preset (one Mesa knob at a time) with profile=true
#   table1     the DeiT-S rows of table1 (fp16), with profile=true
#   traceable  the speed preset's traceable-compile rows (per block; the slowest compiles) on their own
#
# A session is lent 15 minutes of device time, the machine's start included, and one command
# runs at most 10 minutes. So: `make gpu-wheels gpu-prebuild` here, then ONE device call,
#
#   bash scripts/gpu_session.sh   # run(timeout_s=600, carry=[".whl", ".gpubuild", ".gpubuild-base"])
#
# whose default STEPS ("kernels kernels-base ncu host tests modern fused speed cppwrapper") end by DEADLINE (540 s) with the results
# packed; then give the machine back. A later call with time left: STEPS=speed, STEPS=table1...
#   TESTS="tests/test_x.py" STEPS=tests ...  # a few tests again, after a fix
# Session 64 (H200, 2026-12-04) split the 15 minutes into two calls of about five minutes, each
# with a ~90 s start: `STEPS="kernels tests" DEADLINE=345 TESTS_LIMIT=250` (2,814 of the 2,866
# CUDA tests at 12 workers), then, after fixing what it found here, `STEPS="kernels tests modern"
# DEADLINE=300` with TESTS= the failed and the unreached files (results/gpu-session/README.md).
#
# Everything a step writes (results/, and each step's log in results/gpu-session/) is packed
# into $OUT/results.tgz after every step, so a call stopped at its limit still brings back
# what the finished steps wrote; `tar xzf results.tgz` in the checkout puts it in place.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# (kernels before modern: the kernel table takes about 20 s, and the modern step, whose
# profile ran past the deadline on the H100 on 2026-11-26, then cannot crowd it out; the
# modern table's "Host or GPU" section says what its timed steps waited on without a profile)
# (kernels and ncu first since session 35: the host preset's first run on the H200, 274 s for
# 4 rows and the profile, found compiled Mesa under CUDA graphs GPU-bound at 0.72x, 10.1 ms of
# mesa:: kernels a step, so the kernels' counters come first (about a minute or two), then the
# host preset, whose new per-block CUDA-graph rows, the traced compression among them, are its
# first group. The CUDA tests passed there, 1168 and one flaky case since fixed, before their
# limit. `grids` (run once: results/kernels/NVIDIA-H200.grid-*.md) is no longer a default step;
# cppwrapper last: its stock compile alone outlasted 93 s there)
# (kernels-base right after kernels, session 38: three sessions of kernel changes made without a
# GPU, timed against the build before them on the same GPU in the same call)
STEPS=${STEPS:-"kernels kernels-base ncu host tests modern fused speed cppwrapper"}
VALID_STEPS="host cppwrapper tests kernels kernels-base kernels-grid ncu ncu-grid grids modern graphs fused speed table1 traceable"
DEADLINE=${DEADLINE:-540}  # seconds from the start of this script; the device tool's limit is 600
MIN_STEP=${MIN_STEP:-45}   # a step with less time than this left is skipped, not started
GRACE=${GRACE:-15}         # seconds a step gets after its interrupt (SIGINT) before it is killed
for s in $STEPS; do  # a typo fails here, before minutes of install and build
  case " $VALID_STEPS " in *" $s "*) ;; *) echo "gpu_session.sh: unknown step '$s'; valid: $VALID_STEPS"; exit 2 ;; esac
done
for v in DEADLINE MIN_STEP GRACE; do
  case ${!v} in ''|*[!0-9]*) echo "gpu_session.sh: $v='${!v}' is not a number of seconds"; exit 2 ;; esac
done
[ "$MIN_STEP" -ge 1 ] || { echo "gpu_session.sh: MIN_STEP must be at least 1 (timeout 0 would mean no limit)"; exit 2; }
LOG_DIR=results/gpu-session

pack() {  # what comes back through the device tool ($OUT keeps at most 8 files, 2 folders deep)
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/results.tgz" results && echo "results/ packed into \$OUT/results.tgz"
  fi
}

left() { echo $((DEADLINE - SECONDS)); }
# (a table newer than this was written by this call; a second early for filesystems whose clock
# ticks coarser than the first step's start)
STARTED=$(mktemp) && touch -d "1 second ago" "$STARTED"

step() {  # step NAME SECONDS COMMAND...: run within min(SECONDS, time left), log, pack
  local name=$1 limit=$2; shift 2
  local remain; remain=$(left)
  local avail=$((remain - GRACE))  # the step's interrupt, kill and packing fit before DEADLINE
  if [ "$avail" -lt "$MIN_STEP" ]; then
    echo "=== $name skipped: ${remain}s left before DEADLINE=${DEADLINE}s (needs $((MIN_STEP + GRACE))s)"
    return
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  echo "=== $name (limit ${limit}s, ${remain}s left): $*"
  local t0=$SECONDS
  # SIGINT first: pytest then prints its summary of what ran, the bench's finally blocks run
  # (table and profile files are rewritten after every row); killed GRACE s later if still there
  timeout -s INT -k "$GRACE" "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]} after $((SECONDS - t0))s"
  pack
}

# whether the mesa_train in directory $1 imports with the extension's CUDA kernels
loads_cuda_kernels() {
  (cd "$1" && $PY -c 'import sys, mesa_train.quant as q; sys.exit(q.CUDA_BACKEND != "extension")')
}

# 0. a CUDA device for $PY (checked first: nothing is installed or built without one)
ARCH=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null) || { echo "gpu_session.sh: no CUDA device visible to $PY (this script is for the lent GPU machine)"; exit 1; }
mkdir -p "$LOG_DIR"
echo "GPU: $($PY -c 'import torch; print(torch.cuda.get_device_name())'), arch $ARCH, torch $($PY -c 'import torch; print(torch.__version__)'), deadline ${DEADLINE}s"

# 1. packages this image lacks (pure Python, carried as wheels)
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# 2. the extension: the one built here for this image (make gpu-prebuild) when it was built from
# these very sources (.gpubuild/sources.sha256: a build from older sources could lack an op, or
# carry an op's older schema) and loads with CUDA kernels; else built now for this GPU only
# (one arch: about a minute on 16 cores)
if ls .gpubuild/_C*.so >/dev/null 2>&1 && [ "$(cat .gpubuild/sources.sha256 2>/dev/null)" != "$(bash scripts/sources_sha.sh)" ]; then
  echo "the carried build .gpubuild/ is not from these sources (sources.sha256): rebuilding"
elif ls .gpubuild/_C*.so >/dev/null 2>&1; then
  cp .gpubuild/_C*.so mesa_train/
  loads_cuda_kernels . \
    && echo "reusing the carried build .gpubuild/$(cd .gpubuild && ls _C*.so)" \
    || { echo "the carried build does not load with CUDA kernels: rebuilding"; rm -f mesa_train/_C*.so; }
fi
if ! ls mesa_train/_C*.so >/dev/null 2>&1; then
  t0=$SECONDS
  TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=${MAX_JOBS:-16} $PY setup.py -q build_ext --inplace > "$LOG_DIR/build.log" 2>&1 \
    || { tail -30 "$LOG_DIR/build.log"; pack; exit 1; }
  echo "built the extension for sm_${ARCH/./} in $((SECONDS - t0)) s"
  # for a later call: copy both into .gpubuild/ and carry it (without -g's symbols it fits $OUT's 16 MiB)
  if [ -n "${OUT:-}" ]; then
    for so in mesa_train/_C*.so; do strip --strip-debug -o "$OUT/$(basename $so)" "$so"; done
    bash scripts/sources_sha.sh > "$OUT/sources.sha256"
  fi
fi
$PY -c 'import mesa_train.quant as q; print("mesa backend:", q.BACKEND, "CUDA:", q.CUDA_BACKEND)'

# The kernels-base step: the kernel table with the older build in .gpubuild-base/ loaded in place
# of this tree's (a copy of mesa_train/ with that .so, run from its own directory so that it is
# the mesa_train imported), written as <device>.base-<rev>.md, then set beside this call's table.
kernels_base() {
  if ! ls .gpubuild-base/_C*.so >/dev/null 2>&1; then
    echo "=== kernel-bandwidth-base skipped: no .gpubuild-base/ (make gpu-prebuild-base, then carry it)"
    return
  fi
  local variant="base-$(cat .gpubuild-base/rev 2>/dev/null || echo unknown)" shadow=/tmp/mesa-base
  rm -rf "$shadow" && mkdir -p "$shadow" && cp -r mesa_train "$shadow/" && rm -f "$shadow"/mesa_train/_C*.so
  cp .gpubuild-base/_C*.so "$shadow/mesa_train/"
  if ! loads_cuda_kernels "$shadow"; then
    echo "=== kernel-bandwidth-base skipped: .gpubuild-base/ does not load with CUDA kernels here"
    return
  fi
  step kernel-bandwidth-base 120 bash -c 'cd "$1" && shift && exec "$@"' _ "$shadow" \
    $PY -m mesa_train.quant.benchmark --variant "$variant" --out-dir "$PWD/results/kernels" --no-check
  compare_with_default "$variant" variant-first
  pack
}

# Each table of `variant` made in this call (<device>.<variant>.md) beside this call's default
# table (<device>.md), into <device>.vs-<variant>.md: variant-first (an older build: before ->
# after) or default-first (another mode of this build)
compare_with_default() {
  local variant=$1 order=$2 t
  for t in results/kernels/*."$variant".md; do
    local main="${t%."$variant".md}.md"
    [ -f "$main" ] && [ "$main" -nt "$STARTED" ] && [ "$t" -nt "$STARTED" ] || continue
    if [ "$order" = variant-first ]; then set -- "$t" "$main"; else set -- "$main" "$t"; fi
    $PY scripts/compare_kernel_tables.py "$1" "$2" -o "${main%.md}.vs-$variant.md" \
      > "$LOG_DIR/kernel-compare-$variant.log" 2>&1 && echo "=== compared: ${main%.md}.vs-$variant.md"
  done
}

# The row passes' other finish (MESA_ROW_FINISH=grid: a launch of its own after each pass)
# against the default outside a CUDA graph (auto: the pass's last block): the kernel table
# under it, each row's ops checked against the reference, side by side with the default's
# table of this call, then the row passes' CUDA tests under it
kernels_grid() {
  local variant=row-finish-grid
  step kernel-bandwidth-$variant 120 env MESA_ROW_FINISH=grid $PY -m mesa_train.quant.benchmark --variant "$variant" \
    --out-dir "$PWD/results/kernels"
  compare_with_default "$variant" default-first
  step cuda-tests-$variant ${GRID_TESTS_LIMIT:-90} env MESA_ROW_FINISH=grid $PY -m pytest -q -m cuda \
    -p no:cacheprovider -rfE $XDIST tests/test_row_scale_kernels.py tests/test_layernorm_x_hat.py \
    tests/test_row_max_mean.py tests/test_observe.py
}

# 3. the work, most important first
TEST_WORKERS=${TEST_WORKERS:-12}  # (16 cores there; 12 workers ran 2,814 CUDA tests in 250 s in session 64)
XDIST=""
if [ "$TEST_WORKERS" -gt 1 ] && $PY -c 'import xdist' 2>/dev/null; then XDIST="-n $TEST_WORKERS"; fi
BENCH="$PY -m mesa_train.bench progress=false"
# The CUDA tests of the kernels changed since a GPU last ran them (sessions 36-42: the quantize
# grid and pair hash, the flat row pass, observe's two steps, the GELU tables, the col_scale
# stage, the row pass's last block and its mean) first, then the rest (pytest collects each
# file once): the step's limit cut session 35's run at 1168 of its tests
KERNEL_TESTS_FIRST="tests/test_kernels.py tests/test_row_max_mean.py tests/test_row_scale_kernels.py tests/test_observe.py
  tests/test_gelu_backward.py tests/test_dequantize_cols.py tests/test_layernorm_x_hat.py tests/test_estimates.py
  tests/test_canonical_bits.py"
for s in $STEPS; do
  case $s in
    # (the profile runs after every row is measured: the C++ wrapper's compiles go in a step of
    # their own, so that they cannot leave the host step without its profile)
    # (the whole-model default-launch pair left out: measured on the H200 in session 35, host-bound
    # in both rows, so its ratio is the host's; the C++ wrapper pair is the cppwrapper step)
    host)    step host-deit-s ${HOST_LIMIT:-400} $BENCH preset=host "skip=[C++ wrapper,Mesa compiled]" profile=true ;;
    cppwrapper) step host-cpp-wrapper ${CPP_WRAPPER_LIMIT:-240} $BENCH preset=host "only=C++ wrapper" profile=true output_dir=results/host-cpp-wrapper ;;
    tests)   step cuda-tests ${TESTS_LIMIT:-300} $PY -m pytest -q -m cuda -p no:cacheprovider -rfE --durations=10 $XDIST ${TESTS:-$KERNEL_TESTS_FIRST tests} ;;
    kernels) step kernel-bandwidth ${KERNELS_LIMIT:-180} $PY -m mesa_train.quant.benchmark ;;
    kernels-base) kernels_base ;;
    kernels-grid) kernels_grid ;;
    # NCU_OPS / NCU_CASES: regexes over the kernel table's ops and cases (default: the script's)
    ncu)     step ncu-kernels ${NCU_LIMIT:-150} $PY scripts/ncu_kernels.py ${NCU_OPS:+--ops "$NCU_OPS"} ${NCU_CASES:+--cases "$NCU_CASES"} ;;
    # the same counters under the grid finish of the row passes (results/ncu/<device>.row-finish-grid.md)
    ncu-grid) step ncu-kernels-row-finish-grid ${NCU_LIMIT:-150} env MESA_ROW_FINISH=grid $PY scripts/ncu_kernels.py --variant row-finish-grid ${NCU_OPS:+--ops "$NCU_OPS"} ${NCU_CASES:+--cases "$NCU_CASES"} ;;
    grids)   step kernel-grid-full 90 $PY -m mesa_train.quant.benchmark --grid full
             step kernel-grid-resident 90 $PY -m mesa_train.quant.benchmark --grid resident
             step grid-tests 120 $PY -m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_kernels_cuda_extra.py -k grid ;;
    # skip="whole model": the traceable row compiled as one graph outlasts a 10-minute call
    # (compile_kernels.py); the per-block rows compile it in the time of one block
    # (MODERN_SKIP="[whole model,per block]": the eight eager and one-graph rows only, which
    # leaves their profile the time the three per-block rows took, ~40 s on the H200)
    modern)  step modern-deit-s ${MODERN_LIMIT:-330} $BENCH preset=modern only=DeiT-S "skip=${MODERN_SKIP:-whole model}" profile=true ;;
    # the eager DeiT-S steps captured whole in one CUDA graph beside the plain eager ones (the
    # ratio without the host; session 69), with the profile's pace table
    graphs)  step graphs-deit-s ${GRAPHS_LIMIT:-240} $BENCH preset=graphs profile=true ;;
    fused)   step speed-fused ${FUSED_LIMIT:-120} $BENCH preset=speed only=fused output_dir=results/speed-fused ;;
    # (its fused and traceable rows are the fused and traceable steps')
    speed)   step speed-deit-s ${SPEED_LIMIT:-480} $BENCH preset=speed "skip=[traceable,fused]" profile=true ;;
    table1)  step table1-deit-s 150 $BENCH preset=table1 only=DeiT-S profile=true ;;
    traceable) step speed-traceable ${TRACEABLE_LIMIT:-480} $BENCH preset=speed only=traceable profile=true output_dir=results/speed-traceable ;;
  esac
done
echo "gpu_session.sh: done in ${SECONDS}s of DEADLINE=${DEADLINE}s"
