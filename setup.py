"""Builds the `mesa_train._C` extension: CPU kernels always, CUDA kernels when a CUDA
toolkit (nvcc) is found. No GPU needs to be visible at build time."""
import glob
import os
import shutil

from setuptools import setup

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

# Common training GPUs (A100, A10/3090, H100). Users can override with the env var.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.6;9.0")

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))

with_cuda = os.environ.get("MESA_NO_CUDA", "0") != "1" and CUDA_HOME is not None and (
    shutil.which("nvcc") is not None or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
)

extra_compile_args = {"cxx": ["-O3", "-fopenmp", "-DPy_LIMITED_API=0x03090000"]}
extra_link_args = ["-fopenmp"]
if with_cuda:
    extra_compile_args["nvcc"] = ["-O3", "-DMESA_WITH_CUDA"]  # no fast-math: bytes must match the reference
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
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
