"""Builds the `mesa_train._C` extension: CPU kernels always, CUDA kernels when a CUDA
toolkit (nvcc) is found. No GPU needs to be visible at build time."""
import glob
import os
import shutil

from setuptools import setup


def _cuda_home_with_libs():
    """torch derives CUDA_HOME from `which nvcc`; when nvcc is a wrapper script outside the
    toolkit (e.g. /usr/local/bin/nvcc) that gives a prefix without lib64/libcudart.so and
    linking fails. Prefer a real toolkit directory in that case."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists(os.path.join(prefix, "lib64", "libcudart.so")):
        return
    for cand in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if os.path.exists(os.path.join(cand, "bin", "nvcc")) and (
            os.path.exists(os.path.join(cand, "lib64", "libcudart.so"))
            or os.path.exists(os.path.join(cand, "lib", "libcudart.so"))
        ):
            os.environ["CUDA_HOME"] = cand
            return


_cuda_home_with_libs()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

# Common training GPUs (A100, A10/3090, H100). Users can override with the env var.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.6;9.0")

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))

with_cuda = os.environ.get("MESA_NO_CUDA", "0") != "1" and CUDA_HOME is not None and (
    shutil.which("nvcc") is not None or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
)

# -ffp-contract=off: no FMA contraction, so the kernels match the reference bit for bit.
# -fno-trapping-math: lets GCC if-convert (and so vectorise) the clamps / selects of the CPU
# kernels instead of branching around fp ops that could raise an exception flag. It changes
# no results (no fast-math: NaN, inf, signed zeros and rounding are all still honoured);
# it is Clang's default anyway.
extra_compile_args = {"cxx": ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]}
extra_link_args = ["-fopenmp"]
# The CPU run kernels are multi-versioned (baseline x86-64, AVX2 and AVX-512, csrc/quant_cpu.cpp);
# MESA_NO_TARGET_CLONES=1 builds the baseline version only (to test it on an AVX2 host).
if os.environ.get("MESA_NO_TARGET_CLONES", "0") == "1":
    extra_compile_args["cxx"].append("-DMESA_NO_TARGET_CLONES")
if with_cuda:
    # no fast-math and no FMA contraction: the bytes must match the reference
    # --threads: compile the target architectures in parallel (one nvcc job otherwise).
    extra_compile_args["nvcc"] = [
        "-O3",
        "--fmad=false",
        f"--threads={os.environ.get('MESA_NVCC_THREADS', '2')}",
        "-DMESA_WITH_CUDA",
    ]
    extra_compile_args["cxx"].append("-DMESA_WITH_CUDA")
    ext = CUDAExtension(
        "mesa_train._C",
        cpp_sources + cuda_sources,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        py_limited_api=True,
    )
else:
    ext = CppExtension(
        "mesa_train._C",
        cpp_sources,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        py_limited_api=True,
    )

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
