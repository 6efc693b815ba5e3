"""8-bit group quantization ops (``torch.ops.mesa.*``) and their Python wrappers.

Loading order:

1. ``mesa_train._C`` (the compiled C++/CUDA extension) is imported; its
   ``TORCH_LIBRARY(mesa, m)`` defines the ops with CPU (and CUDA) kernels.
   ``BACKEND == "extension"``.
2. If it cannot be loaded (not built, ABI mismatch, ...) or ``MESA_DISABLE_EXTENSION=1``,
   the same ops are defined from Python with ``mesa_train.quant.reference`` as the CPU and
   CUDA implementation, and one ``warnings.warn`` says so. ``BACKEND == "reference"``.

Either way the ops get fake (meta) implementations here, so ``torch.compile`` traces them,
and an Autograd fallthrough, so no output ever requires grad (they are statistics and
storage formats, not differentiable functions).

The public wrappers validate their arguments (``ValueError``), normalise negative ``dim``
and make non-contiguous inputs contiguous (a transient copy, see DESIGN.md). Contract:
``docs/DESIGN.md``, section "Quantization ops".
"""
from __future__ import annotations

import os
import warnings

import torch

from . import reference
from .reference import (
    check_dequantize_args,
    check_estimate_args,
    check_minmax_args,
    check_observe_args,
    check_quantize_args,
    check_row_exp,
    check_seed,
    seed_tensor,
)

__all__ = [
    "quantize_bits",
    "dequantize_bits",
    "group_minmax",
    "quantize",
    "dequantize",
    "row_exponents",
    "update_estimates",
    "observe",
    "observe_rows",
    "quantize_observe",
    "estimate_and_seed",
    "delayed_observe",
    "seed_of",
    "softmax_backward",
    "gelu_backward",
    "dequantize_gelu",
    "layer_norm_backward",
    "gelu_value_and_grad",
    "rng_state",
    "seed_tensor",
    "BACKEND",
    "CUDA_BACKEND",
    "CUDA_REFERENCE_OPS",
    "reference",
    "extension_error",
]

_SCHEMAS = {
    "group_minmax": "group_minmax(Tensor x, int dim, int num_groups, bool per_sample) -> (Tensor min, Tensor max)",
    "quantize": (
        "quantize(Tensor x, Tensor alpha, Tensor beta, int dim, int num_groups, bool stochastic, Tensor seed, "
        "Tensor? row_exp=None, Tensor? row_mean=None, Tensor? row_rstd=None) -> Tensor"
    ),
    "dequantize": (
        "dequantize(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, ScalarType dtype, "
        "Tensor? row_exp=None, Tensor? row_mul=None, Tensor? col_scale=None, Tensor? col_shift=None) -> Tensor"
    ),
    "row_exponents": "row_exponents(Tensor x, int row_dims, int max_k) -> Tensor",
    "update_estimates": (
        "update_estimates(Tensor min, Tensor max, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
        "float decay, bool per_sample, bool symmetric, bool valid) -> (Tensor alpha, Tensor beta)"
    ),
    "observe": (
        "observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
        "int dim, int num_groups, float decay, bool per_sample, bool symmetric, Tensor? row_exp=None) -> "
        "(Tensor alpha, Tensor beta, Tensor seed)"
    ),
    "observe_rows": (
        "observe_rows(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
        "int dim, int num_groups, float decay, bool per_sample, bool symmetric, int row_dims, int max_k, "
        "Tensor? row_mean=None, Tensor? row_rstd=None) -> (Tensor alpha, Tensor beta, Tensor seed, Tensor row_exp)"
    ),
    "quantize_observe": (
        "quantize_observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
        "Tensor(d!) rng, int dim, int num_groups, float decay, bool symmetric, bool stochastic, "
        "Tensor? row_exp=None) -> (Tensor q, Tensor alpha, Tensor beta)"
    ),
    "estimate_and_seed": (
        "estimate_and_seed(Tensor min, Tensor max, Tensor(a!) alpha_est, Tensor(b!) beta_est, "
        "Tensor(c!) initialized, Tensor(d!) rng, float decay, bool per_sample, bool symmetric, bool valid) -> "
        "(Tensor alpha, Tensor beta, Tensor seed)"
    ),
    "seed_of": "seed_of(Tensor rng) -> Tensor",
    "delayed_observe": (
        "delayed_observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
        "Tensor(d!) rng, int dim, int num_groups, float decay, bool symmetric) -> (Tensor alpha, Tensor beta)"
    ),
    "quantize_bits": (
        "quantize_bits(Tensor x, Tensor alpha, Tensor beta, int dim, int num_groups, int bits, bool pow2, "
        "bool stochastic, Tensor seed) -> Tensor"
    ),
    "dequantize_bits": (
        "dequantize_bits(Tensor q, Tensor alpha, Tensor beta, int[] shape, int dim, int num_groups, int bits, "
        "bool pow2, ScalarType dtype) -> Tensor"
    ),
    "softmax_backward": (
        "softmax_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
        "ScalarType? y_dtype=None, ScalarType? out_dtype=None) -> Tensor"
    ),
    "gelu_backward": (
        "gelu_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
        "Tensor? row_exp=None) -> Tensor"
    ),
    "dequantize_gelu": (
        "dequantize_gelu(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, ScalarType dtype, "
        "Tensor? row_exp=None) -> Tensor"
    ),
    "gelu_value_and_grad": (
        "gelu_value_and_grad(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
        "Tensor? row_exp=None) -> (Tensor value, Tensor dx)"
    ),
    "layer_norm_backward": (
        "layer_norm_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int num_groups, Tensor rstd, "
        "Tensor? weight=None, Tensor? row_exp=None) -> (Tensor dx, Tensor dparams)"
    ),
    "code_moments": "code_moments(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups) -> (Tensor mean, "
                    "Tensor var)",
    # the compiled one calls the registered ops above (csrc/layers_autograd.cpp)
    "compress": (
        "compress(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
        "int dim, int num_groups, float decay, int estimator, bool symmetric, bool stochastic, int row_dims, "
        "int max_k, Tensor? row_mean=None, Tensor? row_rstd=None) -> (Tensor q, Tensor alpha, Tensor beta, "
        "Tensor row_exp)"
    ),
}
# Ops that take x in any layout under Inductor (csrc/ops.cpp says why): the min/max cells
_TAGS = {name: (torch.Tag.flexible_layout,) for name in ("group_minmax", "observe", "delayed_observe")}
# The core ops: a build with CUDA kernels has these (CUDA_BACKEND == "extension"). The
# variants' ops (quantize_bits / dequantize_bits) have CUDA kernels too since issue 12's
# second part; a build from before serves them on CUDA from the reference (CUDA_REFERENCE_OPS).
_CUDA_KERNEL_OPS = ("group_minmax", "quantize", "dequantize", "update_estimates", "observe", "row_exponents",
                    "quantize_observe", "delayed_observe", "seed_of")

extension_error: BaseException | None = None  # why the extension was not used, if it was not


def _load_extension() -> bool:
    global extension_error
    if os.environ.get("MESA_DISABLE_EXTENSION", "0") == "1":
        extension_error = RuntimeError("disabled by MESA_DISABLE_EXTENSION=1")
        return False
    try:
        from mesa_train import _C  # noqa: F401  (registers torch.ops.mesa.*)
    except Exception as e:  # ImportError, OSError (undefined symbol), ...
        extension_error = e
        return False
    if not hasattr(torch.ops.mesa, "quantize"):
        extension_error = RuntimeError("mesa_train._C loaded but did not register torch.ops.mesa")
        return False
    return True


def _ops_defined() -> bool:
    try:
        torch.ops.mesa.quantize.default  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _ref_minmax(x, dim, num_groups, per_sample):
    return reference.group_minmax(x, dim, num_groups, per_sample)


def _ref_quantize(x, alpha, beta, dim, num_groups, stochastic, seed, row_exp=None, row_mean=None, row_rstd=None):
    return reference.quantize(x, alpha, beta, dim, num_groups, stochastic, seed, row_exp, row_mean, row_rstd)


def _ref_dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp=None, row_mul=None, col_scale=None,
                    col_shift=None):
    return reference.dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp, row_mul, col_scale, col_shift)


def _ref_row_exponents(x, row_dims, max_k):
    return reference.row_exponents(x, row_dims, max_k)


def _ref_update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid):
    return reference.update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid)


def _ref_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric,
                 row_exp=None):
    return reference.observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric,
                             row_exp)


def _ref_observe_rows(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric,
                      row_dims, max_k, row_mean=None, row_rstd=None):
    return reference.observe_rows(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample,
                                  symmetric, row_dims, max_k, row_mean, row_rstd)


def _ref_quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric, stochastic,
                          row_exp=None):
    return reference.quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric,
                                      stochastic, row_exp)


def _ref_estimate_and_seed(mn, mx, alpha_est, beta_est, initialized, rng, decay, per_sample, symmetric, valid):
    return reference.estimate_and_seed(mn, mx, alpha_est, beta_est, initialized, rng, decay, per_sample, symmetric,
                                       valid)


def _ref_delayed_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric):
    return reference.delayed_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric)


def _ref_seed_of(rng):
    check_seed(rng, rng, "seed_of: rng ([key, counter])")
    return reference.seed_of(rng)


def _ref_quantize_bits(x, alpha, beta, dim, num_groups, bits, pow2, stochastic, seed):
    return reference.quantize_bits(x, alpha, beta, dim, num_groups, bits, pow2, stochastic, seed)


def _ref_dequantize_bits(q, alpha, beta, shape, dim, num_groups, bits, pow2, dtype):
    return reference.dequantize_bits(q, alpha, beta, shape, dim, num_groups, bits, pow2, dtype)


def _ref_softmax_backward(g, q, alpha, beta, dim, num_groups, y_dtype=None, out_dtype=None):
    return reference.softmax_backward(g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype)


def _ref_gelu_backward(g, q, alpha, beta, dim, num_groups, row_exp=None):
    return reference.gelu_backward(g, q, alpha, beta, dim, num_groups, row_exp)


def _ref_dequantize_gelu(q, alpha, beta, dim, num_groups, dtype, row_exp=None):
    return reference.dequantize_gelu(q, alpha, beta, dim, num_groups, dtype, row_exp)


def _ref_gelu_value_and_grad(g, q, alpha, beta, dim, num_groups, row_exp=None):
    return reference.gelu_value_and_grad(g, q, alpha, beta, dim, num_groups, row_exp)


def _ref_layer_norm_backward(g, q, alpha, beta, num_groups, rstd, weight=None, row_exp=None):
    return reference.layer_norm_backward(g, q, alpha, beta, num_groups, rstd, weight, row_exp)


def _ref_compress(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, estimator, symmetric, stochastic,
                  row_dims, max_k, row_mean=None, row_rstd=None):
    return reference.compress(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, estimator, symmetric,
                              stochastic, row_dims, max_k, row_mean, row_rstd)


def _ref_code_moments(q, alpha, beta, dim, num_groups):
    return reference.code_moments(q, alpha, beta, dim, num_groups)


_REF_IMPLS = {
    "code_moments": _ref_code_moments,
    "compress": _ref_compress,
    "quantize_bits": _ref_quantize_bits,
    "dequantize_bits": _ref_dequantize_bits,
    "group_minmax": _ref_minmax,
    "quantize": _ref_quantize,
    "dequantize": _ref_dequantize,
    "row_exponents": _ref_row_exponents,
    "update_estimates": _ref_update_estimates,
    "observe": _ref_observe,
    "observe_rows": _ref_observe_rows,
    "quantize_observe": _ref_quantize_observe,
    "estimate_and_seed": _ref_estimate_and_seed,
    "delayed_observe": _ref_delayed_observe,
    "seed_of": _ref_seed_of,
    "softmax_backward": _ref_softmax_backward,
    "gelu_backward": _ref_gelu_backward,
    "dequantize_gelu": _ref_dequantize_gelu,
    "layer_norm_backward": _ref_layer_norm_backward,
    "gelu_value_and_grad": _ref_gelu_value_and_grad,
}

# Which implementation serves CUDA tensors: "extension", or "reference" for a CPU-only
# build of the extension (MESA_NO_CUDA=1, or built without nvcc) or the Python fallback.
CUDA_BACKEND = "reference"
# The ops whose CUDA tensors the pure-PyTorch reference serves (no CUDA kernel in the build).
CUDA_REFERENCE_OPS: tuple = tuple(_SCHEMAS)
_libs: list = []  # the Library objects own their registrations: keep them alive


def _serve_from_reference(kind: str, names, keys) -> None:
    """Register the reference as the ``keys`` kernels of ``names`` (defining the ops too,
    unless ``kind`` is ``"IMPL"``)."""
    lib = torch.library.Library("mesa", kind)
    for name in names:
        if kind != "IMPL":
            lib.define(_SCHEMAS[name], tags=_TAGS.get(name, ()))
        for key in keys:
            lib.impl(name, _REF_IMPLS[name], key)
    _libs.append(lib)


if _load_extension():
    BACKEND = "extension"
    _missing = [n for n in _SCHEMAS if not hasattr(torch.ops.mesa, n)]
    if _missing:
        # A build from older sources (the package was updated without re-running the
        # install): serve the ops it lacks from the reference rather than failing.
        warnings.warn(
            f"mesa_train: the compiled extension predates ops {_missing}; they use the pure-PyTorch "
            "reference (rebuild with `make install` or `pip install --no-build-isolation -e .`).",
            RuntimeWarning,
            stacklevel=2,
        )
        _serve_from_reference("FRAGMENT", _missing, ("CPU", "CUDA"))
    _no_cuda = [n for n in _SCHEMAS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"mesa::{n}", "CUDA")]
    CUDA_REFERENCE_OPS = tuple(_no_cuda)
    if not [n for n in _no_cuda if n in _CUDA_KERNEL_OPS]:
        CUDA_BACKEND = "extension"
        if _no_cuda:  # a build that predates some CUDA kernels: the reference serves those ops
            _serve_from_reference("IMPL", _no_cuda, ("CUDA",))
            if torch.cuda.is_available():  # (e.g. softmax_backward: every attention map's backward)
                warnings.warn(
                    f"mesa_train: the extension's CUDA kernels predate ops {_no_cuda}; on CUDA tensors they use "
                    "the pure-PyTorch reference (same results, slower; rebuild with `make install`).",
                    RuntimeWarning,
                    stacklevel=2,
                )
    else:
        # CPU-only build: CUDA tensors still work, through the reference.
        _serve_from_reference("IMPL", _no_cuda, ("CUDA",))
        if torch.cuda.is_available():
            warnings.warn(
                "mesa_train: the extension was built without CUDA kernels; CUDA tensors use the "
                "pure-PyTorch reference implementation (rebuild with nvcc for speed).",
                RuntimeWarning,
                stacklevel=2,
            )
elif _ops_defined():
    # Only possible if the module is re-imported in one process (e.g. importlib.reload):
    # the Python definitions from the first import are still registered.
    BACKEND = "reference"
else:
    BACKEND = "reference"
    warnings.warn(
        f"mesa_train: the compiled extension mesa_train._C could not be loaded ({extension_error}); "
        "using the pure-PyTorch reference implementation of torch.ops.mesa.* (slower, same results).",
        RuntimeWarning,
        stacklevel=2,
    )
    _serve_from_reference("DEF", list(_SCHEMAS), ("CPU", "CUDA"))


# ----------------------------------------------------------------------------- fake impls
def _fake_minmax(x, dim, num_groups, per_sample):
    check_minmax_args(x, dim, num_groups)
    S = x.shape[0] if per_sample else 1
    return (
        x.new_empty((S, num_groups), dtype=torch.float32),
        x.new_empty((S, num_groups), dtype=torch.float32),
    )


def _fake_quantize(x, alpha, beta, dim, num_groups, stochastic, seed, row_exp=None, row_mean=None, row_rstd=None):
    check_quantize_args(x, alpha, beta, dim, num_groups)
    check_seed(seed, x, "quantize: seed ([lo, hi])")
    check_row_exp(row_exp, x, "quantize")
    reference.check_row_norm(row_mean, row_rstd, x, "quantize")
    return x.new_empty(x.shape, dtype=torch.uint8)


def _fake_dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp=None, row_mul=None, col_scale=None,
                     col_shift=None):
    _check_dequantize_all(q, alpha, beta, dim, num_groups, dtype, row_exp, row_mul, col_scale, col_shift)
    return q.new_empty(q.shape, dtype=dtype)


def _check_dequantize_all(q, alpha, beta, dim, num_groups, dtype, row_exp, row_mul, col_scale, col_shift) -> int:
    """Every check of dequantize's arguments (the op's fake and its Python wrapper); the dim."""
    dim, _ = check_dequantize_args(q, alpha, beta, dim, num_groups, dtype)
    check_row_exp(row_exp, q, "dequantize")
    reference.check_row_mul(row_mul, q, "dequantize")
    reference.check_cols(col_scale, col_shift, q, "dequantize")
    return dim


def _fake_row_exponents(x, row_dims, max_k):
    reference.check_row_exponents_args(x, row_dims, max_k)
    return x.new_empty(reference.row_shape(x, row_dims), dtype=torch.int8)


def _fake_update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid):
    check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample)
    return mn.new_empty(mn.shape), mn.new_empty(mn.shape)


def _fake_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric,
                  row_exp=None):
    check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample)
    check_row_exp(row_exp, x, "observe")
    S = x.shape[0] if per_sample else 1
    return (
        x.new_empty((S, num_groups), dtype=torch.float32),
        x.new_empty((S, num_groups), dtype=torch.float32),
        rng.new_empty((2,)),
    )


def _fake_observe_rows(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric,
                       row_dims, max_k, row_mean=None, row_rstd=None):
    alpha, beta, seed = _fake_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample,
                                      symmetric)
    reference.check_row_norm(row_mean, row_rstd, x, "observe_rows")
    return alpha, beta, seed, _fake_row_exponents(x, row_dims, max_k)


def _fake_quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric, stochastic,
                           row_exp=None):
    check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    check_row_exp(row_exp, x, "quantize_observe")
    return (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((1, num_groups), dtype=torch.float32),
            x.new_empty((1, num_groups), dtype=torch.float32))


def _fake_estimate_and_seed(mn, mx, alpha_est, beta_est, initialized, rng, decay, per_sample, symmetric, valid):
    check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample)
    check_seed(rng, mn, "estimate_and_seed: rng ([key, counter])")
    return mn.new_empty(mn.shape), mn.new_empty(mn.shape), rng.new_empty((2,))


def _fake_delayed_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, symmetric):
    check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    return (x.new_empty((1, num_groups), dtype=torch.float32), x.new_empty((1, num_groups), dtype=torch.float32))


def _fake_seed_of(rng):
    check_seed(rng, rng, "seed_of: rng ([key, counter])")
    return rng.new_empty((2,))


def _fake_quantize_bits(x, alpha, beta, dim, num_groups, bits, pow2, stochastic, seed):
    reference.check_bits(bits)
    check_quantize_args(x, alpha, beta, dim, num_groups)
    check_seed(seed, x, "quantize_bits: seed ([lo, hi])")
    return x.new_empty((reference.packed_bytes(x.numel(), bits),), dtype=torch.uint8)


def _fake_code_moments(q, alpha, beta, dim, num_groups):
    dim = reference.check_code_moments_args(q, alpha, beta, dim, num_groups)
    return alpha.new_empty((q.shape[dim],)), alpha.new_empty((q.shape[dim],))


def _fake_dequantize_bits(q, alpha, beta, shape, dim, num_groups, bits, pow2, dtype):
    shape, _ = reference.check_dequantize_bits_args(q, alpha, beta, shape, dim, num_groups, bits, dtype)
    return q.new_empty(shape, dtype=dtype)


def _fake_softmax_backward(g, q, alpha, beta, dim, num_groups, y_dtype=None, out_dtype=None):
    reference.check_softmax_backward_args(g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype)
    return q.new_empty(q.shape, dtype=reference.softmax_dtypes(g, y_dtype, out_dtype)[1])


def _fake_gelu_backward(g, q, alpha, beta, dim, num_groups, row_exp=None):
    reference.check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_backward")
    return q.new_empty(q.shape, dtype=g.dtype)


def _fake_dequantize_gelu(q, alpha, beta, dim, num_groups, dtype, row_exp=None):
    check_dequantize_args(q, alpha, beta, dim, num_groups, dtype)
    check_row_exp(row_exp, q, "dequantize_gelu")
    return q.new_empty(q.shape, dtype=dtype)


def _fake_gelu_value_and_grad(g, q, alpha, beta, dim, num_groups, row_exp=None):
    reference.check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_value_and_grad")
    return q.new_empty(q.shape, dtype=g.dtype), q.new_empty(q.shape, dtype=g.dtype)


def _fake_layer_norm_backward(g, q, alpha, beta, num_groups, rstd, weight=None, row_exp=None):
    reference.check_layer_norm_backward_args(g, q, alpha, beta, num_groups, rstd, weight, row_exp)
    D = q.shape[-1]
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty((2, D), dtype=torch.float32)


def _fake_compress(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, estimator, symmetric,
                   stochastic, row_dims, max_k, row_mean=None, row_rstd=None):
    reference.check_estimator_code(estimator)
    reference.check_row_norm(row_mean, row_rstd, x, "compress")
    G = reference.capped_groups(num_groups, x.shape[dim])
    k = _fake_row_exponents(x, row_dims, max_k) if max_k > 0 else x.new_empty((0,), dtype=torch.int8)
    if estimator == 2:
        q, alpha, beta = _fake_quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, G, decay, symmetric,
                                                stochastic)
    else:
        alpha, beta, _ = _fake_observe(x, alpha_est, beta_est, initialized, rng, dim, G, decay, estimator == 1,
                                       symmetric)
        q = x.new_empty(x.shape, dtype=torch.uint8)
    return q, alpha, beta, k


def _register_python_side() -> None:
    # Guard against double registration when the module is reloaded in one process.
    if getattr(torch.ops.mesa, "_mesa_python_side_registered", False):
        return
    torch.library.register_fake("mesa::group_minmax")(_fake_minmax)
    torch.library.register_fake("mesa::quantize")(_fake_quantize)
    torch.library.register_fake("mesa::dequantize")(_fake_dequantize)
    torch.library.register_fake("mesa::row_exponents")(_fake_row_exponents)
    torch.library.register_fake("mesa::update_estimates")(_fake_update_estimates)
    torch.library.register_fake("mesa::observe")(_fake_observe)
    torch.library.register_fake("mesa::observe_rows")(_fake_observe_rows)
    torch.library.register_fake("mesa::quantize_observe")(_fake_quantize_observe)
    torch.library.register_fake("mesa::estimate_and_seed")(_fake_estimate_and_seed)
    torch.library.register_fake("mesa::delayed_observe")(_fake_delayed_observe)
    torch.library.register_fake("mesa::seed_of")(_fake_seed_of)
    torch.library.register_fake("mesa::quantize_bits")(_fake_quantize_bits)
    torch.library.register_fake("mesa::dequantize_bits")(_fake_dequantize_bits)
    torch.library.register_fake("mesa::softmax_backward")(_fake_softmax_backward)
    torch.library.register_fake("mesa::gelu_backward")(_fake_gelu_backward)
    torch.library.register_fake("mesa::dequantize_gelu")(_fake_dequantize_gelu)
    torch.library.register_fake("mesa::layer_norm_backward")(_fake_layer_norm_backward)
    torch.library.register_fake("mesa::gelu_value_and_grad")(_fake_gelu_value_and_grad)
    torch.library.register_fake("mesa::compress")(_fake_compress)
    torch.library.register_fake("mesa::code_moments")(_fake_code_moments)

    # Non-differentiable outputs: the ops never carry gradients (uint8 codes, statistics,
    # and a reconstruction that the layers use inside their own backward). A fallthrough
    # at the Autograd key goes straight to the kernel, whose outputs then never require
    # grad; unlike a Python register_autograd formula it costs nothing per call (that
    # wrapper was ~30 us of Python per op call, four calls per compressed activation).
    lib = torch.library.Library("mesa", "IMPL")
    for name in _SCHEMAS:
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    _libs.append(lib)
    torch.ops.mesa._mesa_python_side_registered = True


_register_python_side()


# ----------------------------------------------------------------------------- wrappers
def rng_state(key: int, counter: int = 0, device=None) -> torch.Tensor:
    """A fresh ``observe`` rng: int64 ``(2,)`` ``[key, counter]``, each taken modulo 2**32."""
    return torch.tensor([int(key) & 0xFFFFFFFF, int(counter) & 0xFFFFFFFF], dtype=torch.int64, device=device)


def group_minmax(x: torch.Tensor, dim: int, num_groups: int, per_sample: bool = False):
    """Per-group ``(min, max)`` of ``x`` as float32 ``(S, num_groups)`` tensors.

    ``S = x.shape[0]`` when ``per_sample`` else 1. NaN/inf propagate (callers check
    ``isfinite``).
    """
    dim = check_minmax_args(x, dim, num_groups)
    return torch.ops.mesa.group_minmax(x, dim, num_groups, bool(per_sample))


def quantize(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    dim: int,
    num_groups: int,
    stochastic: bool = True,
    seed: int | torch.Tensor = 0,
    row_exp: torch.Tensor | None = None,
    row_mean: torch.Tensor | None = None,
    row_rstd: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 codes ``clamp(round((x - beta) * 255 / alpha), 0, 255)``, same shape as ``x``.

    ``alpha`` (range) and ``beta`` (min) are float32 ``(S, num_groups)`` with ``S`` in
    ``{1, x.shape[0]}``. ``stochastic`` rounding uses the counter hash of DESIGN.md keyed
    by ``seed`` (same seed, same device -> same bytes); otherwise round half to even.
    ``seed``: an int64 ``(2,)`` tensor ``[lo, hi]`` on ``x``'s device (e.g. from
    :func:`observe`), or a Python int ``s`` meaning ``[s & M, (s >> 32) & M]`` (its low 64
    bits; ``M = 2**32 - 1``). ``row_exp``: int8 power-of-two row scales (see
    :func:`row_exponents`): the codes of ``x * 2**k`` rounded to ``x``'s dtype, computed
    inside the kernel (no scaled copy). ``row_mean`` / ``row_rstd`` (float32, one per row, as
    ``native_layer_norm`` returns them): the codes of ``x_hat = (x - mean) * rstd`` in float32
    (:func:`mesa_train.quant.reference.normalize_rows`), rows then scaled by ``row_exp`` in
    float32; ``x_hat`` never reaches memory on CUDA (a LayerNorm's normalised input).
    """
    dim, _ = check_quantize_args(x, alpha, beta, dim, num_groups)
    if isinstance(seed, torch.Tensor):
        check_seed(seed, x, "quantize: seed ([lo, hi])")
    else:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"quantize: seed must be an int or an int64 (2,) tensor, got {type(seed).__name__}")
        seed = seed_tensor(seed, x.device)
    check_row_exp(row_exp, x, "quantize")
    reference.check_row_norm(row_mean, row_rstd, x, "quantize")
    return torch.ops.mesa.quantize(x, alpha, beta, dim, num_groups, bool(stochastic), seed, row_exp, row_mean,
                                   row_rstd)


def dequantize(
    q: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    dim: int,
    num_groups: int,
    dtype: torch.dtype = torch.float32,
    row_exp: torch.Tensor | None = None,
    row_mul: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    col_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q * (alpha / 255) + beta`` per group, computed in fp32 and returned as ``dtype``;
    with ``row_exp`` then times ``2**-k`` per row, rounded to ``dtype`` (undoes
    :func:`quantize`'s row scales); with ``row_mul`` (float32, one per row) then times it,
    computed in float32 and rounded to ``dtype``, in the same kernel (a LayerNorm's backward:
    ``1 / rstd``). With ``col_scale`` / ``col_shift`` (float32, one per column of the last
    dim): the float32 values times ``col_scale``, then plus ``col_shift``, rounded once to
    ``dtype``, in the same kernel (a LayerNorm's output from its normalised input)."""
    dim = _check_dequantize_all(q, alpha, beta, dim, num_groups, dtype, row_exp, row_mul, col_scale, col_shift)
    return torch.ops.mesa.dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp, row_mul, col_scale, col_shift)


def row_exponents(x: torch.Tensor, row_dims: int = 1, max_k: int = 64) -> torch.Tensor:
    """int8 power-of-two exponents ``k`` per row of the last ``row_dims`` dims, shape
    ``x.shape[:-row_dims] + (1,) * row_dims``: ``clamp(floor(log2(mean_row_absmax /
    row_absmax)), 0, max_k)`` (DESIGN.md, "Rows far below the grid"; ``max_k`` 14 where
    float16 is involved, else up to 126). Feed them to :func:`observe`, :func:`quantize` and
    :func:`dequantize` as ``row_exp``."""
    reference.check_row_exponents_args(x, row_dims, max_k)
    return torch.ops.mesa.row_exponents(x, int(row_dims), int(max_k))


def update_estimates(
    mn: torch.Tensor,
    mx: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    decay: float,
    per_sample: bool = False,
    symmetric: bool = False,
    valid: bool = True,
):
    """One step of the running estimates in one op (one kernel on CUDA); see
    :func:`mesa_train.quant.reference.update_estimates` for the exact semantics.

    Mutates ``alpha_est[:G]``, ``beta_est[:G]`` and ``initialized``; returns fresh float32
    ``(S, G)`` ``(alpha, beta)`` for :func:`quantize`.
    """
    check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample)
    return torch.ops.mesa.update_estimates(
        mn, mx, alpha_est, beta_est, initialized, float(decay), bool(per_sample), bool(symmetric), bool(valid)
    )


def observe(
    x: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    dim: int,
    num_groups: int,
    decay: float,
    per_sample: bool = False,
    symmetric: bool = False,
    row_exp: torch.Tensor | None = None,
):
    """``group_minmax`` + ``update_estimates`` + the seed step in one op (one launch on CUDA).

    Returns ``(alpha, beta, seed)``: this batch's float32 ``(S, G)`` parameters for
    :func:`quantize` and a fresh int64 ``(2,)`` seed ``[lo, hi]`` derived on the device from
    ``rng = [key, counter]`` (see :func:`rng_state`), whose counter is advanced in place.
    Same results and buffer updates as ``update_estimates(*group_minmax(x, ...), valid=x.numel() > 0)``;
    ``row_exp``: the statistics of the rows scaled as :func:`quantize` scales them.
    """
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample)
    check_row_exp(row_exp, x, "observe")
    return torch.ops.mesa.observe(
        x, alpha_est, beta_est, initialized, rng, dim, num_groups, float(decay), bool(per_sample), bool(symmetric),
        row_exp,
    )


def observe_rows(
    x: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    dim: int,
    num_groups: int,
    decay: float,
    per_sample: bool = False,
    symmetric: bool = False,
    row_dims: int = 1,
    max_k: int = 64,
    row_mean: torch.Tensor | None = None,
    row_rstd: torch.Tensor | None = None,
):
    """:func:`row_exponents` then :func:`observe` with ``row_exp=k``, as one op that also
    returns ``k``: ``(alpha, beta, seed, k)``. With groups over the last dim and one row dim
    it reads ``x`` once (DESIGN.md, "observe_rows"); the results are bitwise those of the two
    ops. ``row_mean`` / ``row_rstd``: all of it on ``x_hat = (x - mean) * rstd`` in float32,
    as :func:`quantize` takes them (a LayerNorm's normalised input, never in memory on CUDA)."""
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample)
    reference.check_row_exponents_args(x, row_dims, max_k)
    reference.check_row_norm(row_mean, row_rstd, x, "observe_rows")
    return torch.ops.mesa.observe_rows(
        x, alpha_est, beta_est, initialized, rng, dim, num_groups, float(decay), bool(per_sample), bool(symmetric),
        int(row_dims), int(max_k), row_mean, row_rstd,
    )


def quantize_observe(
    x: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    dim: int,
    num_groups: int,
    decay: float,
    symmetric: bool = False,
    stochastic: bool = True,
    row_exp: torch.Tensor | None = None,
):
    """Estimator ``"delayed"``: :func:`quantize` with the running estimates as they stand, then
    the batch's min/max update them, in one pass over ``x`` (on CUDA one pass and a second
    launch that returns at once); the first batch (estimates not initialized) goes through
    :func:`observe` + :func:`quantize` instead, decided on the device (no host sync). See
    :func:`mesa_train.quant.reference.quantize_observe`. Returns ``(q, alpha, beta)``, the
    ``(1, G)`` statistics the codes were made with."""
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    check_row_exp(row_exp, x, "quantize_observe")
    return torch.ops.mesa.quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, float(decay),
                                           bool(symmetric), bool(stochastic), row_exp)


def estimate_and_seed(
    mn: torch.Tensor,
    mx: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    decay: float,
    per_sample: bool = False,
    symmetric: bool = False,
    valid: bool = True,
):
    """:func:`update_estimates` + the seed step in one op (one launch on CUDA): what
    :func:`observe` does after its min/max pass, for callers that computed ``(mn, mx)``
    themselves (the traced compression under ``torch.compile``). Returns ``(alpha, beta, seed)``."""
    check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample)
    check_seed(rng, mn, "estimate_and_seed: rng ([key, counter])")
    return torch.ops.mesa.estimate_and_seed(
        mn, mx, alpha_est, beta_est, initialized, rng, float(decay), bool(per_sample), bool(symmetric), bool(valid)
    )


def seed_of(rng: torch.Tensor) -> torch.Tensor:
    """The int64 ``(2,)`` seed ``[lo, hi]`` that :func:`observe`'s seed step would draw from
    ``rng = [key, counter]`` now, ``rng`` left unchanged (one op, one thread on CUDA)."""
    check_seed(rng, rng, "seed_of: rng ([key, counter])")
    return torch.ops.mesa.seed_of(rng)


def delayed_observe(
    x: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    dim: int,
    num_groups: int,
    decay: float,
    symmetric: bool = False,
):
    """:func:`quantize_observe`'s second half with initialized estimates, in one op (one launch
    on CUDA), for callers that coded ``x`` themselves with the estimate buffers and
    :func:`seed_of` ``(rng)`` (the traced delayed compression): returns ``(1, G)`` copies of
    the estimates as they stand, then ``x``'s min/max update them and the rng counter advances.
    See :func:`mesa_train.quant.reference.delayed_observe`."""
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    return torch.ops.mesa.delayed_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, float(decay),
                                          bool(symmetric))


def quantize_bits(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    dim: int,
    num_groups: int,
    bits: int = 8,
    pow2: bool = False,
    stochastic: bool = True,
    seed: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Packed ``bits``-bit codes (1-d uint8, ``ceil(numel * bits / 8)`` bytes) of ``x``
    (DESIGN.md, "Variants"); ``pow2``: power-of-two steps. Same statistics and seeds as
    :func:`quantize`; ``bits=8, pow2=False`` gives :func:`quantize`'s bytes, flattened."""
    reference.check_bits(bits)
    dim, _ = check_quantize_args(x, alpha, beta, dim, num_groups)
    if isinstance(seed, torch.Tensor):
        check_seed(seed, x, "quantize_bits: seed ([lo, hi])")
    else:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"quantize_bits: seed must be an int or an int64 (2,) tensor, got {type(seed).__name__}")
        seed = seed_tensor(seed, x.device)
    return torch.ops.mesa.quantize_bits(x, alpha, beta, dim, num_groups, int(bits), bool(pow2), bool(stochastic), seed)


def dequantize_bits(
    q: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    shape,
    dim: int,
    num_groups: int,
    bits: int = 8,
    pow2: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The tensor of ``shape`` that :func:`quantize_bits`' codes ``q`` stand for, as ``dtype``."""
    shape, dim = reference.check_dequantize_bits_args(q, alpha, beta, shape, dim, num_groups, bits, dtype)
    return torch.ops.mesa.dequantize_bits(q, alpha, beta, list(shape), dim, num_groups, int(bits), bool(pow2), dtype)


def softmax_backward(g: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, dim: int,
                     num_groups: int, y_dtype: torch.dtype | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gradient of a softmax over the last dim from its 8-bit codes ``q`` (groups along ``dim``,
    which must not be the last dim) and the output gradient ``g``, in ``g``'s dtype: one pass
    instead of :func:`dequantize`, a row renormalisation and ``torch._softmax_backward_data``
    (exact definition: :func:`mesa_train.quant.reference.softmax_backward`). ``y_dtype``: the
    map's dtype when it is float32 and g half (autocast), else None; ``out_dtype``: float32
    for float32 logits with such a map, else None."""
    dim = reference.check_softmax_backward_args(g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype)
    return torch.ops.mesa.softmax_backward(g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype)


def gelu_backward(g: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, dim: int,
                  num_groups: int, row_exp: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of the exact (erf) GELU at its dequantized 8-bit input ``q`` (groups along
    ``dim``; ``row_exp``: its row scales), in ``g``'s dtype: ``aten.gelu_backward(g,
    dequantize(q, ..., g.dtype, row_exp))``, one pass on CUDA (DESIGN.md, "GELU backward from
    the codes"; definition: :func:`mesa_train.quant.reference.gelu_backward`)."""
    dim = reference.check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_backward")
    return torch.ops.mesa.gelu_backward(g, q, alpha, beta, dim, num_groups, row_exp)


def gelu_value_and_grad(g: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, dim: int,
                        num_groups: int, row_exp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu(x), g * gelu'(x))`` at the dequantized 8-bit input ``q`` (``x`` rounded to ``g``'s
    dtype, as :func:`dequantize` returns it; ``row_exp``: its row scales), both in ``g``'s
    dtype: :func:`dequantize_gelu` and :func:`gelu_backward` from one read of the codes, one
    pass on CUDA (definition: :func:`mesa_train.quant.reference.gelu_value_and_grad`)."""
    dim = reference.check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_value_and_grad")
    return torch.ops.mesa.gelu_value_and_grad(g, q, alpha, beta, dim, num_groups, row_exp)


def dequantize_gelu(q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, dim: int, num_groups: int,
                    dtype: torch.dtype = torch.float32, row_exp: torch.Tensor | None = None) -> torch.Tensor:
    """The exact (erf) GELU of the dequantized input, ``aten.gelu(dequantize(q, ..., dtype,
    row_exp))``, one pass on CUDA (GELU + Linear's backward recomputes fc2's input from h's
    codes; definition: :func:`mesa_train.quant.reference.dequantize_gelu`)."""
    dim, _ = check_dequantize_args(q, alpha, beta, dim, num_groups, dtype)
    check_row_exp(row_exp, q, "dequantize_gelu")
    return torch.ops.mesa.dequantize_gelu(q, alpha, beta, dim, num_groups, dtype, row_exp)


def layer_norm_backward(g: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, num_groups: int,
                        rstd: torch.Tensor, weight: torch.Tensor | None = None,
                        row_exp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``, float32, of a LayerNorm over the last dim from its output
    gradient ``g`` and the 8-bit codes ``q`` of its normalised input (groups along the last
    dim; ``row_exp``: their row scales), ``rstd`` per row and ``weight`` (None: no affine
    weight): one pass on CUDA instead of dequantize + ``native_layer_norm_backward`` (DESIGN.md,
    "LayerNorm backward from the codes"; definition:
    :func:`mesa_train.quant.reference.layer_norm_backward`). Rows of at most 1024."""
    reference.check_layer_norm_backward_args(g, q, alpha, beta, num_groups, rstd, weight, row_exp)
    dx, dparams = torch.ops.mesa.layer_norm_backward(g, q, alpha, beta, num_groups, rstd, weight, row_exp)
    return dx, dparams[0], dparams[1]  # (the op's (2, D) dparams: rows of one tensor)
