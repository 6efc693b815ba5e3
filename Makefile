# mesa-train: one Makefile for setup, tests, the demo, benchmarks and the Docker image.
# Everything runs inside .venv in the repository root, created by `make install`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: help install test gpu-results gpu-session gpu-wheels gpu-prebuild gpu-prebuild-base gpu-torch-check demo bench docker-build clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	$(PYTHON) -m venv $(VENV)
	# torch first: the extension build compiles against it (--no-build-isolation below).
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1 "setuptools>=69" wheel ninja pybind11 numpy
	$(PIP) install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project (builds the C++/CUDA extension) with dev extras

test: $(STAMP)  ## run the test suite (installs first when .venv is missing)
	@# --durations: the slowest tests in the log, to watch CI's 90-minute limit
	$(PY) -m pytest -q --durations=25 tests

gpu-session:  ## on a lent GPU machine (own torch, no registry): scripts/gpu_session.sh (make gpu-wheels gpu-prebuild here first)
	bash scripts/gpu_session.sh

gpu-results: $(STAMP)  ## on a GPU machine: CUDA tests, kernel bandwidth and the presets table1, table7-9, table13-14, modern and speed into results/
	$(PY) -m pytest -q -m cuda tests
	$(PY) -m mesa_train.quant.benchmark
	@# table1 and modern also write <device>.profile.md: where Mesa's extra time goes
	for preset in table1 modern speed; do \
		$(PY) -m mesa_train.bench preset=$$preset profile=true || exit 1; \
	done
	for preset in table7 table8 table13 table14 table9; do \
		$(PY) -m mesa_train.bench preset=$$preset || exit 1; \
	done

# Pure-Python packages the lent GPU machine's image lacks (it has torch, timm is carried for
# the pinned version); scripts/gpu_session.sh installs them there with --no-index.
GPU_WHEELS := hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 timm==1.0.31 expecttest==0.3.0
gpu-wheels:  ## download the wheels scripts/gpu_session.sh needs on a GPU machine into .whl/ (git-ignored)
	mkdir -p .whl
	@# antlr4-python3-runtime 4.9.3 exists only as an sdist: build its (pure-Python) wheel here
	$(PYTHON) -m pip wheel -q --no-deps -w .whl $(GPU_WHEELS)
	rm -f .whl/*.tar.gz

# The lent GPU machine's image runs torch 2.11.0+cu130 on H100/H200 (sm_90); PyPI's torch
# 2.11.0 is the same CUDA 13.0 build. The extension built here against it, for sm_90 only,
# is carried in .gpubuild/ (scripts/gpu_session.sh loads it when it has CUDA kernels, else
# builds there): a device call's minutes go to measuring instead of compiling.
GPU_TORCH ?= 2.11.0
GPU_ARCH ?= 9.0
GPU_VENV ?= .venv-gpu
GPU_BUILD_TMP := /tmp/mesa-gpubuild
$(GPU_VENV)/.installed:
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q torch==$(GPU_TORCH) "setuptools>=69" wheel ninja pybind11 numpy
	touch $@

gpu-prebuild: $(GPU_VENV)/.installed  ## build the extension here for the GPU image (torch 2.11, sm_90) into .gpubuild/
	@command -v nvcc >/dev/null || { echo "gpu-prebuild: nvcc not found (the CUDA kernels need it)"; exit 1; }
	rm -rf $(GPU_BUILD_TMP) && mkdir -p .gpubuild $(GPU_BUILD_TMP)
	@# what it is built from, taken before the build: scripts/gpu_session.sh reuses the build only
	@# for the same sources, so an edit made while it compiles must not be recorded as built
	rm -f .gpubuild/sources.sha256 && bash scripts/sources_sha.sh > $(GPU_BUILD_TMP)/sources.sha256
	TORCH_CUDA_ARCH_LIST=$(GPU_ARCH) MAX_JOBS=$$(nproc) $(GPU_VENV)/bin/python setup.py -q build_ext \
		--build-lib $(GPU_BUILD_TMP)/lib --build-temp $(GPU_BUILD_TMP)/tmp
	strip --strip-debug -o .gpubuild/_C.abi3.so $(GPU_BUILD_TMP)/lib/mesa_train/_C.abi3.so
	@bash scripts/sources_sha.sh | cmp -s - $(GPU_BUILD_TMP)/sources.sha256 || \
		{ echo "gpu-prebuild: csrc/ or setup.py changed while it built; run it again"; exit 1; }
	cp $(GPU_BUILD_TMP)/sources.sha256 .gpubuild/sources.sha256
	@ls -l .gpubuild/_C.abi3.so .gpubuild/sources.sha256

gpu-torch-check:  ## no GPU: the layer and model suites under the GPU image's torch (.venv-gpu) with .gpubuild/, on the CPU
	bash scripts/gpu_torch_check.sh

# An older build of the extension for the GPU session's kernels-base step: timed right after this
# tree's, with this tree's Python, so the kernel table's change is measured on one GPU minutes
# apart (scripts/compare_kernel_tables.py). BASE: the commit before the kernel changes no GPU has
# timed (42cbf3f: before the pair hash, the flat row pass and observe's two steps in flight).
# Its op schemas (csrc/ops.cpp) must be this tree's: the Python calls the ops as they are now.
BASE ?= 42cbf3f
GPU_BASE_TREE := /tmp/mesa-gpubuild-base-tree
gpu-prebuild-base: $(GPU_VENV)/.installed  ## build the extension of BASE (an older commit) into .gpubuild-base/ for gpu_session.sh's kernels-base step
	@command -v nvcc >/dev/null || { echo "gpu-prebuild-base: nvcc not found (the CUDA kernels need it)"; exit 1; }
	@git rev-parse --verify -q "$(BASE)^{commit}" >/dev/null || { echo "gpu-prebuild-base: BASE=$(BASE) is not a commit"; exit 1; }
	@git diff --quiet "$(BASE)" HEAD -- csrc/ops.cpp || { echo "gpu-prebuild-base: csrc/ops.cpp (the op schemas) differs between BASE=$(BASE) and HEAD; this tree's Python could call ops that build lacks"; exit 1; }
	rm -rf $(GPU_BUILD_TMP)-base $(GPU_BASE_TREE) && mkdir -p $(GPU_BASE_TREE) .gpubuild-base
	git archive "$(BASE)" csrc setup.py mesa_train pyproject.toml README.md | tar -x -C $(GPU_BASE_TREE)
	cd $(GPU_BASE_TREE) && TORCH_CUDA_ARCH_LIST=$(GPU_ARCH) MAX_JOBS=$$(nproc) $(abspath $(GPU_VENV))/bin/python setup.py -q \
		build_ext --build-lib $(GPU_BUILD_TMP)-base/lib --build-temp $(GPU_BUILD_TMP)-base/tmp
	strip --strip-debug -o .gpubuild-base/_C.abi3.so $(GPU_BUILD_TMP)-base/lib/mesa_train/_C.abi3.so
	git rev-parse --short "$(BASE)" > .gpubuild-base/rev
	@ls -l .gpubuild-base/_C.abi3.so .gpubuild-base/rev

demo: $(STAMP)  ## train a small DeiT on the embedded digits data, stock vs Mesa, on CPU
	$(PY) -m mesa_train.demo

bench: $(STAMP)  ## run the default benchmark preset (see configs/bench)
	$(PY) -m mesa_train.bench

docker-build:  ## build the CUDA Docker image (needs a Docker engine)
	docker build -f docker/Dockerfile -t mesa-train:latest .

clean:  ## remove build outputs (keeps .venv; the next install rebuilds the extension)
	rm -rf build *.egg-info mesa_train/*.so $(STAMP)
