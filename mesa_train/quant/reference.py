"""Pure-PyTorch reference of the ``mesa`` quantization ops (see ``docs/DESIGN.md``).

This module is the executable specification: the C++/CUDA kernels in ``csrc/`` must
produce exactly the same bytes (nearest *and* stochastic rounding, same seed, same
device). It is also the fallback implementation when ``mesa_train._C`` cannot be loaded.

Conventions (DESIGN.md, "Quantization ops"):

* ``x`` is split into ``G`` contiguous groups along ``dim`` (size ``D``); index ``d``
  belongs to group ``(d * G) // D``.
* Statistics are ``(S, G)`` float32 with ``S = 1`` (shared) or ``S = x.shape[0]``
  (per sample). Element ``i`` of the contiguous tensor has sample ``i // (numel // S)``.
* Non-contiguous inputs are made contiguous first (transient copy).
* Canonical bits: every float32 that ``group_minmax``, ``update_estimates`` and
  ``observe`` return or store is canonical (any NaN is 0x7FC00000, any zero +0.0), so the
  results do not depend on reduction order or on the input's NaN payloads / zero signs.
* Arithmetic is fp32, every operation a separate (correctly rounded) torch op, so nothing
  can be contracted into an FMA. Divisions use tensor/tensor operands on purpose: PyTorch
  turns ``tensor / python_scalar`` into a multiplication by the reciprocal on CUDA and
  ``scalar / tensor`` into ``reciprocal() * scalar`` everywhere, neither of which is exact.

Everything here validates its inputs and raises ``ValueError`` with a clear message.
"""
from __future__ import annotations

import torch

__all__ = [
    "group_minmax",
    "quantize",
    "dequantize",
    "uniform_from_hash",
    "hash_key",
    "lowbias32",
    "group_index",
    "normalize_dim",
    "check_quantize_args",
    "check_dequantize_args",
    "check_estimate_args",
    "update_estimates",
    "observe",
    "seed_step",
    "seed_of",
    "delayed_observe",
    "seed_tensor",
    "canonical",
    "check_seed",
    "check_observe_args",
    "QUANT_DTYPES",
    "BITS",
    "levels",
    "pow2_ceil",
    "step_and_inv",
    "packed_bytes",
    "pack_codes",
    "unpack_codes",
    "check_bits",
    "quantize_bits",
    "dequantize_bits",
    "lane_sum",
    "check_softmax_backward_args",
    "check_gelu_backward_args",
    "gelu_backward",
    "dequantize_gelu",
    "softmax_backward",
    "softmax_backward_from_y",
    "softmax_dtypes",
    "layer_norm_backward",
    "layer_norm_backward_from_xh",
    "gelu_value_and_grad",
    "check_layer_norm_backward_args",
    "ln_column_partials",
]

BITS = (8, 4, 2)  # supported code widths (DESIGN.md, "Variants")

QUANT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_M32 = 0xFFFFFFFF
_EPS = 1e-12  # alpha <= _EPS (as float32) counts as a constant group
_HASH_CHUNK = 1 << 22
_SEED_STEP_MIX = 0x68E31DA4
_CANONICAL_NAN_BITS = 0x7FC00000


# ----------------------------------------------------------------------------- validation
def normalize_dim(x: torch.Tensor, dim: int) -> int:
    """Return ``dim`` in ``[0, x.dim())`` or raise ``ValueError``."""
    nd = x.dim()
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"dim must be an int, got {type(dim).__name__}")
    if nd == 0:
        raise ValueError("mesa quantization ops need a tensor with at least one dimension")
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} out of range for a {nd}-d tensor of shape {tuple(x.shape)}")
    return dim % nd


def _check_groups(x: torch.Tensor, dim: int, num_groups: int) -> None:
    D = x.shape[dim]
    if not isinstance(num_groups, int) or isinstance(num_groups, bool):
        raise ValueError(f"num_groups must be an int, got {type(num_groups).__name__}")
    # D == 0 only happens for empty tensors; any positive group count is accepted then.
    if num_groups < 1 or (D > 0 and num_groups > D):
        raise ValueError(
            f"num_groups={num_groups} must be in [1, {D}] (size of dim {dim} of shape {tuple(x.shape)})"
        )


def _check_params(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, num_groups: int) -> int:
    """Validate alpha/beta, return S (1 or x.shape[0])."""
    for name, p in (("alpha", alpha), ("beta", beta)):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{name} must be a tensor")
        if p.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {p.dtype}")
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but the input is on {x.device}")
    if alpha.dim() != 2 or alpha.shape != beta.shape:
        raise ValueError(
            f"alpha and beta must both have shape (S, {num_groups}); got {tuple(alpha.shape)} and {tuple(beta.shape)}"
        )
    S, G = alpha.shape
    if G != num_groups or S not in (1, x.shape[0]):
        raise ValueError(
            f"alpha/beta shape {tuple(alpha.shape)} invalid: expected (S, {num_groups}) with "
            f"S in {{1, {x.shape[0]}}} (shared or per-sample statistics)"
        )
    return S


def check_quantize_args(x, alpha, beta, dim, num_groups) -> tuple[int, int]:
    """Validate quantize's arguments; return (normalized dim, S)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError("x must be a tensor")
    if x.dtype not in QUANT_DTYPES:
        raise ValueError(f"quantize supports float32, float16 and bfloat16 inputs, got {x.dtype}")
    dim = normalize_dim(x, dim)
    _check_groups(x, dim, num_groups)
    return dim, _check_params(x, alpha, beta, num_groups)


def check_dequantize_args(q, alpha, beta, dim, num_groups, dtype) -> tuple[int, int]:
    """Validate dequantize's arguments; return (normalized dim, S)."""
    if not isinstance(q, torch.Tensor):
        raise ValueError("q must be a tensor")
    if q.dtype != torch.uint8:
        raise ValueError(f"dequantize expects a uint8 tensor, got {q.dtype}")
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dequantize can produce float32, float16 or bfloat16, got {dtype}")
    dim = normalize_dim(q, dim)
    _check_groups(q, dim, num_groups)
    return dim, _check_params(q, alpha, beta, num_groups)


def check_minmax_args(x, dim, num_groups) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError("x must be a tensor")
    if x.dtype not in QUANT_DTYPES:
        raise ValueError(f"group_minmax supports float32, float16 and bfloat16 inputs, got {x.dtype}")
    dim = normalize_dim(x, dim)
    _check_groups(x, dim, num_groups)
    return dim


def check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample) -> int:
    """Validate update_estimates' arguments; return G."""
    for name, t in (("min", mn), ("max", mx), ("alpha_est", alpha_est), ("beta_est", beta_est),
                    ("initialized", initialized)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update_estimates: {name} must be a tensor")
    if mn.dtype != torch.float32 or mx.dtype != torch.float32 or mn.dim() != 2 or mn.shape != mx.shape:
        raise ValueError(
            "update_estimates: min and max must be float32 (S, G) tensors of one shape, got "
            f"{mn.dtype}{tuple(mn.shape)} and {mx.dtype}{tuple(mx.shape)}"
        )
    if not per_sample and mn.shape[0] != 1:
        raise ValueError(f"update_estimates: shared statistics must have shape (1, G), got {tuple(mn.shape)}")
    G = mn.shape[1]
    for name, t in (("alpha_est", alpha_est), ("beta_est", beta_est)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.shape[0] < G:
            raise ValueError(
                f"update_estimates: {name} must be a contiguous float32 (G_buf,) tensor with G_buf >= {G}, "
                f"got {t.dtype}{tuple(t.shape)}"
            )
    if initialized.dtype != torch.bool or initialized.numel() != 1:
        raise ValueError(
            f"update_estimates: initialized must be a one-element bool tensor, got "
            f"{initialized.dtype}{tuple(initialized.shape)}"
        )
    for t in (mx, alpha_est, beta_est, initialized):
        if t.device != mn.device:
            raise ValueError(f"update_estimates: all tensors must be on {mn.device}, got one on {t.device}")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"update_estimates: decay must be a number in [0, 1), got {decay!r}")
    return G


def check_seed(seed, x: torch.Tensor, what: str) -> None:
    """An int64 ``(2,)`` tensor on ``x``'s device (quantize's seed, observe's rng)."""
    if not isinstance(seed, torch.Tensor):
        raise ValueError(f"{what} must be an int64 tensor of shape (2,), got {type(seed).__name__}")
    if seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
        raise ValueError(f"{what} must be an int64 tensor of shape (2,), got {seed.dtype}{tuple(seed.shape)}")
    if seed.device != x.device:
        raise ValueError(f"{what} is on {seed.device} but the input is on {x.device}")


def check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample) -> int:
    """Validate observe's arguments; return the normalized dim."""
    if not isinstance(x, torch.Tensor):
        raise ValueError("x must be a tensor")
    if x.dtype not in QUANT_DTYPES:
        raise ValueError(f"observe supports float32, float16 and bfloat16 inputs, got {x.dtype}")
    dim = normalize_dim(x, dim)
    _check_groups(x, dim, num_groups)
    for name, t in (("alpha_est", alpha_est), ("beta_est", beta_est)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() \
                or t.shape[0] < num_groups:
            got = f"{t.dtype}{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"observe: {name} must be a contiguous float32 (G_buf,) tensor with G_buf >= {num_groups}, got {got}"
            )
    if not isinstance(initialized, torch.Tensor) or initialized.dtype != torch.bool or initialized.numel() != 1:
        raise ValueError("observe: initialized must be a one-element bool tensor")
    for t in (alpha_est, beta_est, initialized):
        if t.device != x.device:
            raise ValueError(f"observe: all tensors must be on {x.device}, got one on {t.device}")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"observe: decay must be a number in [0, 1), got {decay!r}")
    check_seed(rng, x, "observe: rng ([key, counter])")
    return dim


def _check_one_per_row(t: torch.Tensor, x: torch.Tensor, what: str, names: str, each: str, x_name: str = "x",
                       x_label: str = "x") -> None:
    """``t``'s shape is ``x.shape[:-n] + (1,) * n`` for an ``n >= 1``: one entry per row of the
    last ``n`` dims (its trailing size-1 dims are taken as the row dims)."""
    shape = tuple(t.shape)
    n = 0
    while n < len(shape) and shape[len(shape) - 1 - n] == 1:
        n += 1
    if len(shape) != x.dim() or n < 1 or shape[:x.dim() - n] != tuple(x.shape[:x.dim() - n]):
        raise ValueError(f"{what}: {names} must have shape {x_name}.shape[:-n] + (1,) * n (one {each}per row of the "
                         f"last n >= 1 dims); got {shape} for {x_label} of shape {tuple(x.shape)}")


def _check_row_tensor(t, x: torch.Tensor, what: str, name: str, dtype: torch.dtype, a_dtype: str,
                      x_is_on: str = "the input is on") -> None:
    """``t`` a tensor of ``dtype`` (``a_dtype``: its name with the article, "an int8") on
    ``x``'s device: the checks every per-row argument of the ops shares."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} must be {a_dtype} tensor, got {got}")
    if t.device != x.device:
        raise ValueError(f"{what}: {name} is on {t.device} but {x_is_on} {x.device}")


def check_row_exp(row_exp, x: torch.Tensor, what: str) -> None:
    """``None``, or int8 row exponents on ``x``'s device of shape ``x.shape[:-n] + (1,) * n``
    for an ``n >= 1`` (one per row of the last ``n`` dims). Values are not read (no host sync):
    they must lie in ``[0, 126]``, ``[0, 14]`` with float16 involved (:func:`row_exponents`)."""
    if row_exp is None:
        return
    _check_row_tensor(row_exp, x, what, "row_exp", torch.int8, "an int8")
    _check_one_per_row(row_exp, x, what, "row_exp", "exponent ")


def check_row_norm(row_mean, row_rstd, x: torch.Tensor, what: str) -> None:
    """Both ``None``, or both float32 on ``x``'s device, of one shape ``x.shape[:-n] + (1,) * n``
    (one mean and one rstd per row of the last ``n`` dims, as ``native_layer_norm`` returns
    them), with ``x`` float32, float16 or bfloat16."""
    if row_mean is None and row_rstd is None:
        return
    if row_mean is None or row_rstd is None:
        raise ValueError(f"{what}: row_mean and row_rstd go together (LayerNorm's per-row mean and rstd); got only "
                         f"{'row_rstd' if row_mean is None else 'row_mean'}")
    for name, t in (("row_mean", row_mean), ("row_rstd", row_rstd)):
        _check_row_tensor(t, x, what, name, torch.float32, "a float32")
    if x.dtype not in QUANT_DTYPES:
        raise ValueError(f"{what}: with row_mean / row_rstd the input must be float32, float16 or bfloat16, "
                         f"got {x.dtype}")
    if row_mean.shape != row_rstd.shape:
        raise ValueError(f"{what}: row_mean and row_rstd must have one shape, got {tuple(row_mean.shape)} and "
                         f"{tuple(row_rstd.shape)}")
    _check_one_per_row(row_mean, x, what, "row_mean and row_rstd", "")


def normalize_rows(x: torch.Tensor, row_mean: torch.Tensor | None, row_rstd: torch.Tensor | None) -> torch.Tensor:
    """``(x - mean) * rstd`` per row in float32, each operation rounded once (no fused
    multiply-add): a LayerNorm's normalised input ``x_hat`` as the ops' ``row_mean`` /
    ``row_rstd`` take it (DESIGN.md, "LayerNorm's x_hat inside the kernels"). ``x`` itself
    when both are ``None``. (A float64 ``x``, which the ops refuse, is normalised in float64.)"""
    if row_mean is None:
        return x
    mdt = torch.promote_types(x.dtype, torch.float32)
    return (x.to(mdt) - row_mean.to(mdt)) * row_rstd.to(mdt)


def check_row_mul(row_mul, q: torch.Tensor, what: str) -> None:
    """``None``, or a float32 tensor on ``q``'s device of shape ``q.shape[:-n] + (1,) * n`` (one
    factor per row of the last ``n`` dims): dequantize's ``row_mul``."""
    if row_mul is None:
        return
    _check_row_tensor(row_mul, q, what, "row_mul", torch.float32, "a float32", "the codes are on")
    _check_one_per_row(row_mul, q, what, "row_mul", "factor ", "q", "codes")


def check_cols(col_scale, col_shift, q: torch.Tensor, what: str) -> bool:
    """Each ``None``, or a float32 tensor on ``q``'s device of shape ``(q.shape[-1],)`` (one value
    per column of the last dim): dequantize's ``col_scale`` / ``col_shift``. Returns whether
    either is given."""
    for name, t in (("col_scale", col_scale), ("col_shift", col_shift)):
        if t is None:
            continue
        _check_row_tensor(t, q, what, name, torch.float32, "a float32", "the codes are on")
        if q.dim() < 1 or t.shape != (q.shape[-1],):
            raise ValueError(f"{what}: {name} must have shape (C,) with C = q.shape[-1] (one value per column of the "
                             f"last dim); got {tuple(t.shape)} for codes of shape {tuple(q.shape)}")
    return col_scale is not None or col_shift is not None


def affine_cols(y: torch.Tensor, col_scale: torch.Tensor | None, col_shift: torch.Tensor | None) -> torch.Tensor:
    """float32 ``y * col_scale + col_shift`` per column of the last dim, a multiply, then an add
    (each rounded: never one fused op): dequantize's column epilogue, a LayerNorm's output
    ``x_hat * gamma + beta`` from its normalised input (DESIGN.md, "LayerNorm + Linear: one copy")."""
    if col_scale is not None:
        y = y * col_scale
    if col_shift is not None:
        y = y + col_shift
    return y


def multiply_rows(y: torch.Tensor, row_mul: torch.Tensor | None) -> torch.Tensor:
    """``y * row_mul`` per row, computed in float32 and rounded to ``y``'s dtype: dequantize's
    ``row_mul`` on its output (after the row exponents). A LayerNorm's backward passes
    ``1 / rstd``, so that ATen's backward gets ``x - mean`` back with the real ``rstd`` (DESIGN.md,
    "LayerNorm's x_hat inside the kernels")."""
    if row_mul is None:
        return y
    return (y.to(torch.float32) * row_mul).to(y.dtype)


def check_row_exponents_args(x, row_dims, max_k) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in QUANT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"row_exponents supports float32, float16 and bfloat16 inputs, got {got}")
    if isinstance(row_dims, bool) or not isinstance(row_dims, int) or not 1 <= row_dims <= x.dim():
        raise ValueError(f"row_exponents: row_dims must be in [1, {x.dim()}] for a {x.dim()}-d tensor, "
                         f"got {row_dims!r}")
    if isinstance(max_k, bool) or not isinstance(max_k, int) or not 0 <= max_k <= 126:
        raise ValueError(f"row_exponents: max_k must be in [0, 126], got {max_k!r}")


def row_shape(x: torch.Tensor, row_dims: int) -> tuple:
    """``x.shape[:-row_dims] + (1,) * row_dims``: one entry per row."""
    return tuple(x.shape[:x.dim() - row_dims]) + (1,) * row_dims


@torch.no_grad()
def row_exponents(x: torch.Tensor, row_dims: int = 1, max_k: int = 64) -> torch.Tensor:
    """int8 ``k = clamp(floor(log2(mean_row_absmax / row_absmax)), 0, max_k)`` per row of the
    last ``row_dims`` dims, shape :func:`row_shape` (``mesa::row_exponents``; DESIGN.md, "Rows
    far below the grid"). Rows of length 0 get ``k = 0``."""
    check_row_exponents_args(x, row_dims, max_k)
    if x.numel() == 0:
        return torch.zeros(row_shape(x, row_dims), dtype=torch.int8, device=x.device)
    # max(amax, -amin), not vector_norm(inf): the same values (exact; NaN propagates; abs()
    # only makes a -0.0 row +0.0) without a temporary. One row dim: aminmax reads x once
    if row_dims == 1:
        mn, mx = torch.aminmax(x, dim=-1, keepdim=True)
    else:
        dims = tuple(range(x.dim() - row_dims, x.dim()))
        mn, mx = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    r = torch.maximum(mx, mn.neg()).abs().to(torch.float32)
    # ratio = m * 2**e with m in [0.5, 1): floor(log2(ratio)) = e - 1. A zero row (ratio inf)
    # or an all-zero batch (nan) gets e = 0, i.e. k = 0.
    _, e = torch.frexp(row_max_mean(r) / r)
    return (e - 1).clamp_(0, max_k).to(torch.int8)


# Bits of each scaled row maximum in row_max_mean's integer sum: the N terms add up below
# 2**62, so that int64 holds the sum exactly (and signed overflow never happens)
_MEAN_SUM_BITS = 62


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """float64 ``2**e`` of an integer tensor ``e`` in [-1022, 1023], exact, built from its
    exponent bits (``torch.exp2`` / ``ldexp`` promise no exactness on every device)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def row_max_mean(r: torch.Tensor) -> torch.Tensor:
    """The mean of the row maxima ``r`` (float32, non-negative or NaN, at least one) that the
    row exponents are measured against, as a float32 0-d tensor with the same bits on every
    device and in any order of summation (DESIGN.md, "The mean of the row maxima"): an
    integer sum, not a float reduction, whose order (ATen's on each device, Inductor's) is
    unspecified. With ``top = max(r)`` finite and above 0, ``top < 2**e`` (``frexp``) and
    ``b = 62 - N.bit_length()``: ``S = sum(floor(r * 2**(b - e)))`` in int64 (each term below
    ``2**b``, so the sum is exact and below ``2**62``), then
    ``float32((float64(S) * 2**(e - b)) * (1.0 / N))`` (the float64 reciprocal of N rounded
    once on the host; every other step exact or one IEEE rounding). Before the float32
    rounding it is within ``2**(2 * N.bit_length() - 61)`` of the exact mean, relatively (the
    truncations lose under ``N * 2**(e - b)``, and the sum is at least ``top >= 2**(e - 1)``):
    ``2**-31`` for DeiT-S's 25,216 token rows, ``2**-19`` for a million rows. ``top`` NaN, inf
    or 0 is returned as it is (the mean ATen would give: NaN, inf, 0), so that every ``k`` is
    0 (:func:`row_exponents`). Under ``torch.compile`` with dynamic shapes ``int(N)``
    specialises on the row count."""
    n = int(r.numel())
    if n == 0:
        raise ValueError("row_max_mean: needs at least one row maximum, got an empty tensor")
    r = r.reshape(-1)
    top = r.amax()
    ok = torch.isfinite(top) & (top > 0)
    _, e = torch.frexp(torch.where(ok, top, 1.0))  # (0 when not ok: the exponents stay in range)
    b = _MEAN_SUM_BITS - n.bit_length()
    terms = torch.floor(torch.where(ok, r, 0.0).double() * pow2_f64(b - e)).long()
    mean = ((terms.sum().double() * pow2_f64(e - b)) * (1.0 / n)).float()
    return torch.where(ok, mean, top)


def scale_rows(x: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """``x * 2**k`` in ``x``'s dtype (exact for powers of two within range): the ops'
    ``row_exp`` on their input. ``2**k`` is exact in ``x``'s dtype for the allowed ``k``, so
    this is bitwise ``torch.ldexp(x, k)`` (which is 15-20x slower on CPU)."""
    return x if k is None else x * torch.exp2(k.to(x.dtype))


def unscale_rows(y: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """``y * 2**-k`` in ``y``'s dtype: the ops' ``row_exp`` on dequantize's output."""
    return y if k is None else y * torch.exp2(k.to(y.dtype).neg())


# ----------------------------------------------------------------------------- helpers
def canonical(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` with canonical bits: any NaN -> 0x7FC00000, any zero -> +0.0."""
    nan = torch.tensor(_CANONICAL_NAN_BITS, dtype=torch.int32, device=t.device).view(torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.where(torch.isnan(t), nan, torch.where(t == 0, zero, t))


def seed_tensor(seed, device=None) -> torch.Tensor:
    """int64 ``(2,)`` ``[lo, hi]`` of a Python int seed (its low 64 bits, as the int form had)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return torch.tensor([seed & _M32, seed >> 32], dtype=torch.int64, device=device)


def _seed_words(seed, device):
    """(lo, hi) as ints or as 0-d int64 tensors (a device seed is never read on the host)."""
    if isinstance(seed, torch.Tensor):
        return seed[0] & _M32, seed[1] & _M32
    seed = int(seed)
    return seed & _M32, (seed >> 32) & _M32



def group_index(D: int, G: int, device=None) -> torch.Tensor:
    """int64 ``(D,)``: group of each index ``d`` along the grouped dimension."""
    return torch.div(torch.arange(D, device=device) * G, D, rounding_mode="floor")


def _layout(shape, dim):
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= s
    return outer, shape[dim], inner


def _expand(x: torch.Tensor, params, dim: int, G: int):
    """View contiguous ``x`` and broadcast each ``(S, G)`` param to it (per element)."""
    outer, D, inner = _layout(x.shape, dim)
    S = params[0].shape[0]
    gidx = group_index(D, G, x.device)
    if S == 1:
        xv = x.view(outer, D, inner)
        return xv, [p[0, gidx].view(1, D, 1) for p in params]
    if dim > 0:  # per sample: outer = S * (outer // S)
        xv = x.view(S, outer // S, D, inner)
        return xv, [p[:, gidx].view(S, 1, D, 1) for p in params]
    # dim == 0 and per sample: sample s is exactly index d = s
    xv = x.view(D, inner)
    ar = torch.arange(D, device=x.device)
    return xv, [p[ar, gidx].view(D, 1) for p in params]


_GOLDEN = 0x9E3779B9  # odd: the Weyl step of the hash visits every uint32 once per 2**32 indices


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 ``a`` in [0, 2**32) without int64 overflow."""
    lo = a * (c & 0xFFFF)  # < 2**48
    hi = ((a * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (lo + hi) & _M32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def uniform_from_hash(numel: int, seed, device=None, start: int = 0) -> torch.Tensor:
    """float32 ``u`` in [0, 1) for flat indices ``start .. start+numel`` (DESIGN.md hash).

    ``seed``: a Python int (``lo = seed & M``, ``hi = (seed >> 32) & M``) or an int64
    ``(2,)`` tensor ``[lo, hi]`` (read on its device, no host sync).
    """
    if not isinstance(seed, torch.Tensor):
        seed = int(seed)
    if numel > _HASH_CHUNK:  # bound the int64 temporaries (about 6 x 8 bytes per element)
        out = torch.empty(numel, dtype=torch.float32, device=device)
        for b in range(0, numel, _HASH_CHUNK):
            n = min(_HASH_CHUNK, numel - b)
            out[b : b + n] = uniform_from_hash(n, seed, device, start + b)
        return out
    s_lo, s_hi = _seed_words(seed, device)
    i = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    key = hash_key(s_lo, s_hi, (i >> 32) & _M32)
    lo = i & _M32
    h = lowbias32((_mul32(lo >> 1, _GOLDEN) + key) & _M32)  # the pair's Weyl step, then one lowbias32
    half = (h >> ((lo & 1) << 4)) & 0xFFFF  # even index: the low 16 bits; odd: the high 16
    return half.to(torch.float32) * (2.0**-16)


def hash_key(seed_lo, seed_hi, index_hi: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding hash key (DESIGN.md): ``lowbias32(seed_lo ^ lowbias32(seed_hi ^
    index_hi * 0x9E3779B9))`` on int64 tensors holding uint32 values. Constant over 2**32
    consecutive flat indices (``index_hi`` is the index's high word), so kernels hash it once
    per launch or run and each pair of elements costs one ``lowbias32``."""
    return lowbias32(seed_lo ^ lowbias32(seed_hi ^ _mul32(index_hi, _GOLDEN)))


def _inv_scale(alpha: torch.Tensor) -> torch.Tensor:
    num = torch.full_like(alpha, 255.0)
    return torch.where(alpha > _EPS, num / alpha, torch.zeros_like(alpha))


# ----------------------------------------------------------------------------- ops
def group_minmax(x: torch.Tensor, dim: int, num_groups: int, per_sample: bool = False):
    """Per-group min and max, float32 ``(S, G)``; NaN/inf propagate.

    Groups with no elements (only possible for empty tensors, or per-sample statistics
    over ``dim=0``) get ``min=+inf, max=-inf``.
    """
    dim = check_minmax_args(x, dim, num_groups)
    G = num_groups
    S = x.shape[0] if per_sample else 1
    x = x.contiguous()
    outer, D, inner = _layout(x.shape, dim)
    mn = torch.full((S, G), float("inf"), dtype=torch.float32, device=x.device)
    mx = torch.full((S, G), float("-inf"), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return mn, mx  # +-inf: canonical already
    # per (sample, d) statistics, shape (S, D)
    if S == 1:
        xv = x.view(outer, D, inner)
        dmn = xv.amin(dim=(0, 2)).float().view(1, D)
        dmx = xv.amax(dim=(0, 2)).float().view(1, D)
    elif dim > 0:
        xv = x.view(S, outer // S, D, inner)
        dmn = xv.amin(dim=(1, 3)).float()
        dmx = xv.amax(dim=(1, 3)).float()
    else:
        xv = x.view(D, inner)
        ar = torch.arange(D, device=x.device)
        dmn = torch.full((S, D), float("inf"), dtype=torch.float32, device=x.device)
        dmx = torch.full((S, D), float("-inf"), dtype=torch.float32, device=x.device)
        dmn[ar, ar] = xv.amin(dim=1).float()
        dmx[ar, ar] = xv.amax(dim=1).float()
    # reduce the contiguous d-blocks of each group; pad short groups by repeating their
    # last index (a repeat changes neither min nor max)
    gidx = group_index(D, G, x.device)
    counts = torch.bincount(gidx, minlength=G)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    L = (D + G - 1) // G
    idx = torch.minimum(starts[:, None] + torch.arange(L, device=x.device), ends[:, None] - 1)
    mn = dmn[:, idx].amin(dim=2)
    mx = dmx[:, idx].amax(dim=2)
    return canonical(mn), canonical(mx)


def quantize(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    dim: int,
    num_groups: int,
    stochastic: bool = True,
    seed=0,
    row_exp: torch.Tensor | None = None,
    row_mean: torch.Tensor | None = None,
    row_rstd: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 codes, same shape as ``x``, contiguous (DESIGN.md exact arithmetic).

    ``seed``: an int64 ``(2,)`` tensor ``[lo, hi]`` on ``x``'s device (the op's schema) or
    a Python int (same bytes as ``seed_tensor(seed)``). ``row_exp``: the codes of
    :func:`scale_rows` ``(x, row_exp)``. ``row_mean`` / ``row_rstd``: the codes of
    :func:`normalize_rows` ``(x, row_mean, row_rstd)`` (float32; then its rows scaled).
    """
    dim, _ = check_quantize_args(x, alpha, beta, dim, num_groups)
    if isinstance(seed, torch.Tensor):
        check_seed(seed, x, "quantize: seed ([lo, hi])")
    check_row_exp(row_exp, x, "quantize")
    check_row_norm(row_mean, row_rstd, x, "quantize")
    x = scale_rows(normalize_rows(x, row_mean, row_rstd), row_exp).contiguous()
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    alpha = alpha.contiguous()
    beta = beta.contiguous()
    xv, (inv, b) = _expand(x, [_inv_scale(alpha), beta], dim, num_groups)
    v = (xv.to(torch.float32) - b) * inv
    if stochastic:
        u = uniform_from_hash(x.numel(), seed, x.device).view(xv.shape)
        v = torch.floor(v + u)
    else:
        v = torch.round(v)  # round half to even
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v).clamp_(0.0, 255.0)
    return v.to(torch.uint8).view(x.shape)


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
    """``q * (alpha / 255) + beta`` in fp32 (step, product, sum rounded separately), cast to
    ``dtype``; ``row_exp``: then :func:`unscale_rows` (``* 2**-k`` rounded to ``dtype``);
    ``row_mul``: then :func:`multiply_rows`. With ``col_scale`` / ``col_shift``: all that for
    ``dtype`` float32, then :func:`affine_cols`, then rounded to ``dtype``."""
    dim, _ = check_dequantize_args(q, alpha, beta, dim, num_groups, dtype)
    check_row_exp(row_exp, q, "dequantize")
    check_row_mul(row_mul, q, "dequantize")
    if check_cols(col_scale, col_shift, q, "dequantize"):
        y = dequantize(q, alpha, beta, dim, num_groups, torch.float32, row_exp, row_mul)
        return affine_cols(y, col_scale, col_shift).to(dtype)
    if row_mul is not None:
        return multiply_rows(dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp), row_mul)
    if row_exp is not None:
        return unscale_rows(dequantize(q, alpha, beta, dim, num_groups, dtype), row_exp)
    q = q.contiguous()
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    alpha = alpha.contiguous()
    step = alpha / torch.full_like(alpha, 255.0)
    qv, (st, b) = _expand(q, [step, beta.contiguous()], dim, num_groups)
    t = qv.to(torch.float32) * st
    return (t + b).to(dtype).view(q.shape)


def check_code_moments_args(q, alpha, beta, dim: int, num_groups: int) -> int:
    """Validate code_moments' arguments (dequantize's, statistics shared by all samples,
    codes not empty); return the normalized dim."""
    dim, S = check_dequantize_args(q, alpha, beta, dim, num_groups, torch.float32)
    if S != 1:
        raise ValueError(f"code_moments: alpha and beta must be shared by all samples, shape (1, {num_groups}), "
                         f"got {tuple(alpha.shape)} (a per-sample estimator: use the dequantized values)")
    if q.numel() == 0:
        raise ValueError("code_moments: the codes are empty (no moments)")
    return dim


def code_moments(q: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, dim: int,
                 num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mesa::code_moments`` (csrc/code_moments.cpp): float32 ``(D,)`` mean and biased variance,
    per index along ``dim``, of ``q * (alpha / 255) + beta`` (``dequantize``'s values in exact
    arithmetic; ``alpha``, ``beta`` ``(1, G)``), from the int64 sums of the codes and their
    squares, then ``m = S1 / n``, ``v = S2 / n - m^2`` (clamped at 0) in float64, ``mean = step
    * m + beta``, ``var = step^2 * v``, rounded once. A constant index has variance exactly 0
    (S1 / n and S2 / n are then exact). The Mesa BatchNorm's backward re-standardises x_hat
    with these (``nn/batchnorm.py``)."""
    dim = check_code_moments_args(q, alpha, beta, dim, num_groups)
    outer, D, inner = _layout(q.shape, dim)
    v = q.reshape(outer, D, inner).to(torch.int64)
    s1, s2 = v.sum((0, 2)), (v * v).sum((0, 2))
    n = q.numel() // D
    m = s1.to(torch.float64) / n
    var = (s2.to(torch.float64) / n - m.square()).clamp_min(0)
    group = group_index(D, num_groups, q.device)
    step = (alpha[0] / 255.0)[group].to(torch.float64)
    offset = beta[0][group].to(torch.float64)
    return (step * m + offset).to(torch.float32), (step.square() * var).to(torch.float32)


def _range(mn: torch.Tensor, mx: torch.Tensor, symmetric: bool):
    """(alpha, beta): (max - min, min), or symmetric (2m, -m) with m = max(|min|, |max|)."""
    if symmetric:
        m = torch.maximum(mn.abs(), mx.abs())
        return m * 2.0, -m
    return mx - mn, mn.clone()  # clone: an op's outputs never alias its inputs


def update_estimates(
    mn: torch.Tensor,
    mx: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    decay: float,
    per_sample: bool,
    symmetric: bool,
    valid: bool = True,
):
    """One step of the running estimates (DESIGN.md, "Running estimates").

    ``mn, mx``: this batch's ``(S, G)`` statistics (``S = 1`` unless ``per_sample``).
    Updates the first ``G`` entries of ``alpha_est`` / ``beta_est`` and ``initialized`` in
    place and returns fresh ``(S, G)`` ``(alpha, beta)`` to quantize this batch with: the
    updated estimates (shared), or the batch's own per-sample ranges. The estimates follow
    ``lam * old + (1 - lam) * batch`` (the batch's range alone on the first call); a batch
    whose range is not finite, or an empty one (``valid=False``), keeps the old estimates.
    """
    G = check_estimate_args(mn, mx, alpha_est, beta_est, initialized, decay, per_sample)
    if per_sample:
        b_alpha, b_beta = _range(mn, mx, symmetric)  # (S, G), used for this batch
        if mn.shape[0] == 0:
            r_mn = torch.full((1, G), float("inf"), dtype=torch.float32, device=mn.device)
            r_mx = torch.full((1, G), float("-inf"), dtype=torch.float32, device=mn.device)
        else:
            r_mn, r_mx = mn.amin(0, keepdim=True), mx.amax(0, keepdim=True)
    else:
        r_mn, r_mx = mn, mx
    r_alpha, r_beta = _range(r_mn, r_mx, symmetric)
    old_a = alpha_est[:G].view(1, G)
    old_b = beta_est[:G].view(1, G)
    init = initialized.view(())
    finite = torch.isfinite(r_alpha).all() & torch.isfinite(r_beta).all()
    if not valid:
        finite = torch.zeros_like(finite)
    lam = float(decay)
    ema_a = torch.where(init, old_a * lam + r_alpha * (1.0 - lam), r_alpha)
    ema_b = torch.where(init, old_b * lam + r_beta * (1.0 - lam), r_beta)
    keep_old = ~finite & init
    new_a = torch.where(keep_old, old_a, ema_a)
    new_b = torch.where(keep_old, old_b, ema_b)
    new_a, new_b = canonical(new_a), canonical(new_b)
    if not per_sample:
        b_alpha, b_beta = new_a, new_b
    alpha_est[:G].copy_(torch.where(finite, new_a, canonical(old_a)).view(G))
    beta_est[:G].copy_(torch.where(finite, new_b, canonical(old_b)).view(G))
    initialized.copy_((init | finite).view(initialized.shape))
    return canonical(b_alpha).contiguous(), canonical(b_beta).contiguous()


def seed_of(rng: torch.Tensor) -> torch.Tensor:
    """The ``[seed_lo, seed_hi]`` that :func:`seed_step` draws from ``rng = [key, counter]`` as it
    stands, ``rng`` left alone (``mesa::seed_of``: the traced delayed compression codes with it,
    then :func:`delayed_observe` advances the counter). Tensor ops only."""
    key, counter = rng[0] & _M32, rng[1] & _M32
    k = lowbias32(key)
    lo = lowbias32(counter ^ k)
    hi = lowbias32(lo ^ k ^ _SEED_STEP_MIX)
    return torch.stack([lo, hi])


def advance_counter(rng: torch.Tensor) -> None:
    """The seed step's state change: ``rng[1]`` advanced by one modulo 2**32, in place."""
    rng[1:].copy_((((rng[1] & _M32) + 1) & _M32).view(1))


def seed_step(rng: torch.Tensor) -> torch.Tensor:
    """observe's seed step (DESIGN.md): ``rng = [key, counter]`` -> fresh ``[seed_lo, seed_hi]``;
    advances ``rng[1]`` by one modulo 2**32 in place. Tensor ops only (no host sync)."""
    seed = seed_of(rng)
    advance_counter(rng)
    return seed


def estimate_and_seed(mn, mx, alpha_est, beta_est, initialized, rng, decay: float, per_sample: bool,
                      symmetric: bool, valid: bool):
    """:func:`update_estimates` + :func:`seed_step`: ``observe`` without the min/max pass.
    Returns ``(alpha, beta, seed)``."""
    check_seed(rng, mn, "estimate_and_seed: rng ([key, counter])")
    alpha, beta = update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid)
    return alpha, beta, seed_step(rng)


def observe(
    x: torch.Tensor,
    alpha_est: torch.Tensor,
    beta_est: torch.Tensor,
    initialized: torch.Tensor,
    rng: torch.Tensor,
    dim: int,
    num_groups: int,
    decay: float,
    per_sample: bool,
    symmetric: bool,
    row_exp: torch.Tensor | None = None,
):
    """``group_minmax`` + ``update_estimates(valid=x.numel() > 0)`` + :func:`seed_step`.

    Returns ``(alpha, beta, seed)``; mutates the estimate buffers, ``initialized`` and
    ``rng[1]`` in place. ``row_exp``: the statistics of :func:`scale_rows` ``(x, row_exp)``.
    """
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample)
    check_row_exp(row_exp, x, "observe")
    mn, mx = group_minmax(scale_rows(x, row_exp), dim, num_groups, per_sample)
    alpha, beta = update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric,
                                   x.numel() > 0)
    return alpha, beta, seed_step(rng)


def observe_rows(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float,
                 per_sample: bool, symmetric: bool, row_dims: int, max_k: int, row_mean=None, row_rstd=None):
    """``mesa::observe_rows`` (DESIGN.md, "observe_rows"): ``k = row_exponents(x, row_dims,
    max_k)``, then :func:`observe` of ``x`` with ``row_exp=k``. Returns ``(alpha, beta, seed, k)``.
    ``row_mean`` / ``row_rstd``: all of it on :func:`normalize_rows` ``(x, row_mean, row_rstd)``."""
    check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample)
    check_row_norm(row_mean, row_rstd, x, "observe_rows")
    x = normalize_rows(x, row_mean, row_rstd)
    k = row_exponents(x, row_dims, max_k)
    alpha, beta, seed = observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample,
                                symmetric, k)
    return alpha, beta, seed, k


def quantize_observe(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float,
                     symmetric: bool, stochastic: bool, row_exp=None):
    """Estimator ``"delayed"`` (DESIGN.md, "Delayed estimates"). With initialized estimates:
    ``x`` quantized with the running estimates as they stand (``(1, G)`` copies, returned with
    the codes) and the seed step's seed, then this batch's min/max update the estimates
    (``update_estimates``, shared statistics, ``valid = x.numel() > 0``). Without (the first
    batch): :func:`observe` then :func:`quantize`, as the running estimator. Returns
    ``(q, alpha, beta)``."""
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    check_row_exp(row_exp, x, "quantize_observe")
    if not bool(initialized.reshape(-1)[0]):
        alpha, beta, seed = observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False,
                                    symmetric, row_exp)
        return quantize(x, alpha, beta, dim, num_groups, stochastic, seed, row_exp), alpha, beta
    G = num_groups
    q = quantize(x, alpha_est[:G].view(1, G), beta_est[:G].view(1, G), dim, G, stochastic, seed_of(rng), row_exp)
    alpha, beta = delayed_observe(scale_rows(x, row_exp), alpha_est, beta_est, initialized, rng, dim, G, decay,
                                  symmetric)
    return q, alpha, beta


def delayed_observe(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float,
                    symmetric: bool):
    """The second half of :func:`quantize_observe` with initialized estimates, as one op
    (DESIGN.md, "Delayed estimates"): returns ``(1, G)`` copies of the estimates as they stand
    (the ones the batch's codes were made with), then this batch's min/max of ``x`` update them
    (shared statistics, ``valid = x.numel() > 0``) and the rng counter advances by one, as the
    seed step would. The traced delayed compression codes ``x`` itself with the buffers and
    ``seed_of(rng)``, then passes its row segments' min/max here (``mesa::delayed_observe``:
    with ``mesa::seed_of`` two small launches a compression in forward). ``x`` may be those
    cells: the per-group min/max of ``x`` is all it reads."""
    dim = check_observe_args(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, False)
    alpha = alpha_est[:num_groups].clone().view(1, num_groups)
    beta = beta_est[:num_groups].clone().view(1, num_groups)
    mn, mx = group_minmax(x, dim, num_groups, False)
    update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, False, symmetric, x.numel() > 0)
    advance_counter(rng)
    return alpha, beta


# the estimator codes of mesa::compress and the C++ layer ops (csrc/layers_common.h, Estimator)
ESTIMATOR_NAMES = {0: "running", 1: "per_sample", 2: "delayed"}


def check_estimator_code(estimator: int) -> None:
    if estimator not in ESTIMATOR_NAMES:
        raise ValueError(f"compress: estimator must be one of {ESTIMATOR_NAMES} (code: name), got {estimator!r}")


def capped_groups(num_groups: int, size: int) -> int:
    """The groups a compression uses along a dim of ``size``: at most one per channel."""
    return num_groups if num_groups <= size else max(1, size)


def compress(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float, estimator: int,
             symmetric: bool, stochastic: bool, row_dims: int, max_k: int, row_mean=None, row_rstd=None):
    """``mesa::compress`` (DESIGN.md, "One op per compression"): ``x`` made contiguous once,
    then with row exponents (``max_k > 0``) :func:`observe_rows` + :func:`quantize`, or
    :func:`row_exponents` + :func:`quantize_observe` for ``estimator`` 2 (delayed); without,
    :func:`observe` + :func:`quantize` or :func:`quantize_observe`; ``num_groups`` capped at the
    dim's size. With ``row_mean`` / ``row_rstd`` (a LayerNorm's) the compressed tensor is
    ``normalize_rows(x, row_mean, row_rstd)``: :func:`observe_rows` + :func:`quantize` take
    them (also with ``max_k`` 0), the delayed estimator the normalised copy. Returns
    ``(q, alpha, beta, k)`` (``k`` an empty int8 tensor without row exponents)."""
    check_estimator_code(estimator)
    check_row_norm(row_mean, row_rstd, x, "compress")
    x = x.contiguous()
    G = capped_groups(num_groups, x.shape[dim])
    if row_mean is not None and estimator != 2:
        alpha, beta, seed, k = observe_rows(x, alpha_est, beta_est, initialized, rng, dim, G, decay,
                                            estimator == 1, symmetric, row_dims, max_k, row_mean, row_rstd)
        q = quantize(x, alpha, beta, dim, G, stochastic, seed, k, row_mean, row_rstd)
        return q, alpha, beta, (k if max_k > 0 else x.new_empty((0,), dtype=torch.int8))
    x = normalize_rows(x, row_mean, row_rstd)
    k = None
    if estimator == 2:
        k = row_exponents(x, row_dims, max_k) if max_k > 0 else None
        q, alpha, beta = quantize_observe(x, alpha_est, beta_est, initialized, rng, dim, G, decay, symmetric,
                                          stochastic, k)
    else:
        if max_k > 0:
            alpha, beta, seed, k = observe_rows(x, alpha_est, beta_est, initialized, rng, dim, G, decay,
                                                estimator == 1, symmetric, row_dims, max_k)
        else:
            alpha, beta, seed = observe(x, alpha_est, beta_est, initialized, rng, dim, G, decay, estimator == 1,
                                        symmetric)
        q = quantize(x, alpha, beta, dim, G, stochastic, seed, k)
    return q, alpha, beta, (k if k is not None else x.new_empty((0,), dtype=torch.int8))


# ----------------------------------------------------------------------------- variants
# DESIGN.md, "Variants": bits in {8, 4, 2} (L = 2**bits - 1 levels above 0), codes packed
# 8 // bits per byte along the flat index of the contiguous tensor, little end first, the
# last byte zero-padded; optional power-of-two steps (ALT).
def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def levels(bits: int) -> int:
    """Largest code ``L = 2**bits - 1``."""
    return (1 << check_bits(bits)) - 1


def packed_bytes(numel: int, bits: int) -> int:
    per = 8 // check_bits(bits)
    return -(-numel // per)


def pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """float32: the smallest power of two ``>= r`` for normal finite ``r`` (sign kept); ``r``
    itself when it is a power of two, zero, subnormal, inf or NaN (bit arithmetic, exact)."""
    b = r.contiguous().view(torch.int32)
    e = b & 0x7F800000
    m = b & 0x007FFFFF
    up = ((b & -0x800000) + 0x00800000).view(torch.float32)  # -0x800000 == 0xFF800000 as int32
    keep = (m == 0) | (e == 0) | (e == 0x7F800000)
    return torch.where(keep, r, up)


def step_and_inv(alpha: torch.Tensor, bits: int, pow2: bool):
    """``(step, inv)`` per parameter: ``step = alpha / L`` (``pow2``: its :func:`pow2_ceil`),
    ``inv = alpha > 1e-12 ? L / alpha (pow2: 1 / step) : 0``. bits=8, pow2=False: exactly
    :func:`quantize`'s ``255 / alpha`` and :func:`dequantize`'s ``alpha / 255``."""
    lv = torch.full_like(alpha, float(levels(bits)))
    step = alpha / lv
    if pow2:
        step = pow2_ceil(step)
        inv = torch.ones_like(alpha) / step
    else:
        inv = lv / alpha
    return step, torch.where(alpha > _EPS, inv, torch.zeros_like(alpha))


def pack_codes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """1-d uint8 ``(packed_bytes(numel, bits),)`` of codes ``c`` (uint8, each < 2**bits)."""
    per = 8 // check_bits(bits)
    c = c.reshape(-1)
    if per == 1:
        return c.clone()
    n = c.numel()
    nb = -(-n // per)
    full = torch.zeros(nb * per, dtype=torch.int32, device=c.device)
    full[:n] = c.to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=c.device) * bits
    return (full.view(nb, per) << shifts).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_codes(p: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """1-d uint8 codes ``(numel,)`` from :func:`pack_codes`' bytes."""
    per = 8 // check_bits(bits)
    if per == 1:
        return p[:numel]
    shifts = torch.arange(per, dtype=torch.int32, device=p.device) * bits
    c = (p.to(torch.int32).view(-1, 1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:numel].to(torch.uint8)


def quantize_bits(x, alpha, beta, dim: int, num_groups: int, bits: int = 8, pow2: bool = False,
                  stochastic: bool = True, seed=0) -> torch.Tensor:
    """Packed codes (1-d uint8) at ``bits`` per value (DESIGN.md, "Variants")::

        v = (x - beta) * inv;  q = NaN -> 0, else clamp(stochastic ? floor(v + u) : rint(v), 0, L)

    with :func:`step_and_inv`'s ``inv`` and the same hash ``u`` (flat element index) as
    :func:`quantize`. bits=8 and pow2=False: the bytes of :func:`quantize`, flattened.
    """
    check_bits(bits)
    dim, _ = check_quantize_args(x, alpha, beta, dim, num_groups)
    if isinstance(seed, torch.Tensor):
        check_seed(seed, x, "quantize_bits: seed ([lo, hi])")
    x = x.contiguous()
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    _, inv = step_and_inv(alpha.contiguous(), bits, pow2)
    xv, (inv, b) = _expand(x, [inv, beta.contiguous()], dim, num_groups)
    v = (xv.to(torch.float32) - b) * inv
    if stochastic:
        v = torch.floor(v + uniform_from_hash(x.numel(), seed, x.device).view(xv.shape))
    else:
        v = torch.round(v)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v).clamp_(0.0, float(levels(bits)))
    return pack_codes(v.to(torch.uint8), bits)


def check_dequantize_bits_args(q, alpha, beta, shape, dim, num_groups, bits, dtype):
    check_bits(bits)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 1:
        got = f"{q.dtype}{tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"dequantize_bits expects a 1-d uint8 tensor of packed codes, got {got}")
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dequantize_bits can produce float32, float16 or bfloat16, got {dtype}")
    shape = tuple(int(s) for s in shape)
    meta = torch.empty(shape, device="meta")
    dim = normalize_dim(meta, dim)
    _check_groups(meta, dim, num_groups)
    for name, p in (("alpha", alpha), ("beta", beta)):
        if not isinstance(p, torch.Tensor) or p.dtype != torch.float32 or p.device != q.device:
            raise ValueError(f"{name} must be a float32 tensor on {q.device}")
    if alpha.dim() != 2 or alpha.shape != beta.shape or alpha.shape[1] != num_groups \
            or alpha.shape[0] not in (1, shape[0]):
        raise ValueError(f"alpha/beta shapes {tuple(alpha.shape)} and {tuple(beta.shape)} invalid: expected "
                         f"(S, {num_groups}) with S in {{1, {shape[0]}}} (shared or per-sample statistics)")
    need = packed_bytes(meta.numel(), bits)
    if q.shape[0] != need:
        raise ValueError(f"dequantize_bits: {q.shape[0]} bytes of codes, but shape {list(shape)} at {bits} bits "
                         f"needs {need}")
    return shape, dim


def dequantize_bits(q, alpha, beta, shape, dim: int, num_groups: int, bits: int = 8, pow2: bool = False,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``xhat = q * step + beta`` (fp32, two rounded operations) of shape ``shape``, as ``dtype``."""
    shape, dim = check_dequantize_bits_args(q, alpha, beta, shape, dim, num_groups, bits, dtype)
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=q.device)
    c = unpack_codes(q, bits, numel).view(shape)
    step, _ = step_and_inv(alpha.contiguous(), bits, pow2)
    cv, (st, b) = _expand(c, [step, beta.contiguous()], dim, num_groups)
    return ((cv.to(torch.float32) * st) + b).to(dtype).view(shape)


# ----------------------------------------------------------------------------- softmax backward
# mesa::softmax_backward (DESIGN.md, "Fused softmax backward"): the backward of a Mesa Softmax
# over the last dim straight from its 8-bit codes. Sums use one fixed order, the one a CUDA
# warp uses, so that this reference, the CPU kernel, the traced form and the CUDA kernel
# agree bit for bit.
LANES = 32
_FLT_MIN = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, exact in float32


def lane_sum(v: torch.Tensor) -> torch.Tensor:
    """Float32 sums of ``v``'s rows (shape ``(R, L)``) in a warp's order, shape ``(R, 1)``.

    Lane ``l`` starts at +0.0 and adds ``v[l], v[l + 32], ...``; then for ``off`` in 16, 8, 4,
    2, 1 every lane adds lane ``l ^ off``'s value (a butterfly: all lanes end equal), and
    the result is lane 0's. Written as slices, so that a compiler fuses it: the lanes' sums
    over the whole 32-wide chunks, then the last, partial one added to its lanes only (the
    other lanes would add +0.0, which changes nothing: an accumulator that starts at +0.0 is
    never -0.0); of the butterfly only what lane 0's sum depends on, lanes ``l < off`` adding
    lane ``l + off`` (= ``l ^ off``), its own value first as in the kernels. A first form
    padded the rows to a multiple of 32 and flipped the lane halves: under Inductor the pad
    and flip kernels took 0.9-1.1 ms each a DeiT-S step on an H100 (the traced softmax
    backward); the slices give the same bits (tests/test_softmax_backward.py)."""
    R, L = v.shape
    acc = torch.zeros((R, LANES), dtype=torch.float32, device=v.device)
    full = L // LANES
    for c in range(full):  # lane l adds its c-th element: strided, in increasing index
        acc = acc + v[:, c * LANES:(c + 1) * LANES]
    rest = L - full * LANES
    if rest:
        acc = torch.cat([acc[:, :rest] + v[:, full * LANES:], acc[:, rest:]], dim=1)
    for off in (16, 8, 4, 2, 1):
        acc = acc[:, :off] + acc[:, off:2 * off]
    return acc


def _check_codes_backward_args(op: str, g, q, dim) -> int:
    """The arguments of a backward from codes (g of the codes' shape); the normalized dim."""
    if not isinstance(g, torch.Tensor) or not isinstance(q, torch.Tensor):
        raise ValueError(f"{op}: g and q must be tensors")
    if g.dtype not in QUANT_DTYPES:
        raise ValueError(f"{op}: g must be float32, float16 or bfloat16, got {g.dtype}")
    if q.dtype != torch.uint8:
        raise ValueError(f"{op} expects uint8 codes q, got {q.dtype}")
    if g.device != q.device:
        raise ValueError(f"{op}: g is on {g.device} but the codes are on {q.device}")
    if g.shape != q.shape:
        raise ValueError(f"{op}: g has shape {tuple(g.shape)} but the codes have {tuple(q.shape)}")
    return normalize_dim(q, dim)


def check_gelu_backward_args(g, q, alpha, beta, dim, num_groups) -> int:
    """Validate gelu_backward's arguments; return the normalized group dim."""
    dim = _check_codes_backward_args("gelu_backward", g, q, dim)
    _check_groups(q, dim, num_groups)
    _check_params(q, alpha, beta, num_groups)
    return dim


def gelu_backward(g, q, alpha, beta, dim: int, num_groups: int, row_exp: torch.Tensor | None = None) -> torch.Tensor:
    """``mesa::gelu_backward`` (DESIGN.md, "GELU backward from the codes"): the gradient of the
    exact (erf) GELU at the dequantized input, ``aten.gelu_backward(g, dequantize(q, ...,
    g.dtype, row_exp))``. The CPU kernel is this composition (the same bits); the CUDA kernel
    computes it in one pass (float32 formula of ATen's kernel, no FMA contraction: within an
    ulp of the output dtype, not bitwise)."""
    dim = check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_backward")
    xh = dequantize(q, alpha, beta, dim, num_groups, g.dtype, row_exp)
    return torch.ops.aten.gelu_backward.default(g.contiguous(), xh)


# ----------------------------------------------------------------------------- LayerNorm backward
# mesa::layer_norm_backward (DESIGN.md, "LayerNorm backward from the codes"): a LayerNorm's
# three gradients straight from its x_hat codes. Row sums in the warp order of lane_sum;
# column sums (dweight, dbias) in fixed chunks of rows, the order of the CUDA kernel's
# blocks, then one torch.sum over the chunks' partials on the tensors' device.
LN_CHUNK_ROWS = 8  # rows one warp sums in order (a chunk)
LN_BLOCK_CHUNKS = 8  # chunks one block sums in order (a block: LN_CHUNK_ROWS * LN_BLOCK_CHUNKS rows)
LN_MAX_COLS = 1024  # the widest row (LayerNorm width) the op takes: the CUDA kernel keeps rows in registers


def check_layer_norm_backward_args(g, q, alpha, beta, num_groups, rstd, weight, row_exp) -> None:
    """Validate layer_norm_backward's arguments."""
    dim = _check_codes_backward_args("layer_norm_backward", g, q, -1)
    _check_groups(q, dim, num_groups)
    S = _check_params(q, alpha, beta, num_groups)
    if S > 1 and q.dim() < 2:
        raise ValueError("layer_norm_backward: per-sample statistics need codes with a sample dim and a row dim, got "
                         f"shape {tuple(q.shape)}")
    D = q.shape[-1]
    if D > LN_MAX_COLS:
        raise ValueError(f"layer_norm_backward: rows of {D} elements; valid: at most {LN_MAX_COLS} (wider "
                         "LayerNorms use dequantize + aten.native_layer_norm_backward)")
    rows = q.numel() // D if D else 0
    if not isinstance(rstd, torch.Tensor) or rstd.dtype != torch.float32 or rstd.device != q.device:
        got = (rstd.dtype, str(rstd.device)) if isinstance(rstd, torch.Tensor) else type(rstd).__name__
        raise ValueError(f"layer_norm_backward: rstd must be a float32 tensor on {q.device}, got {got}")
    if rstd.numel() != rows:
        raise ValueError(f"layer_norm_backward: rstd must hold one value per row ({rows} rows of {D} for codes of "
                         f"shape {tuple(q.shape)}), got shape {tuple(rstd.shape)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.device != q.device \
                or tuple(weight.shape) != (D,):
            got = (weight.dtype, tuple(weight.shape), str(weight.device)) if isinstance(weight, torch.Tensor) \
                else type(weight).__name__
            raise ValueError(f"layer_norm_backward: weight must be None or a float32 ({D},) tensor on {q.device}, "
                             f"got {got}")
    check_row_exp(row_exp, q, "layer_norm_backward")
    if row_exp is not None and row_exp.numel() != rows:
        raise ValueError(f"layer_norm_backward: row_exp must hold one exponent per row of the last dim ({rows}), "
                         f"got shape {tuple(row_exp.shape)}")


def ln_column_partials(t: torch.Tensor) -> torch.Tensor:
    """``(blocks, D)`` float32 partial column sums of ``t`` (``(rows, D)``): each chunk of
    ``LN_CHUNK_ROWS`` rows summed in row order from +0.0, then each block of
    ``LN_BLOCK_CHUNKS`` chunks summed in chunk order from +0.0 (rows padded with +0.0, which
    changes nothing: an accumulator that starts at +0.0 is never -0.0)."""
    rows, D = t.shape
    per_block = LN_CHUNK_ROWS * LN_BLOCK_CHUNKS
    nb = -(-rows // per_block)
    v = torch.nn.functional.pad(t, (0, 0, 0, nb * per_block - rows)).view(nb, LN_BLOCK_CHUNKS, LN_CHUNK_ROWS, D)
    chunk = torch.zeros((nb, LN_BLOCK_CHUNKS, D), dtype=torch.float32, device=t.device)
    for r in range(LN_CHUNK_ROWS):
        chunk = chunk + v[:, :, r]
    block = torch.zeros((nb, D), dtype=torch.float32, device=t.device)
    for c in range(LN_BLOCK_CHUNKS):
        block = block + chunk[:, c]
    return block


def layer_norm_backward(g, q, alpha, beta, num_groups: int, rstd, weight=None, row_exp=None):
    """``(dx, dparams)`` (``dparams``: ``(2, D)``, dweight then dbias) of a LayerNorm over the
    last dim from its output gradient ``g`` and the codes ``q`` of its normalised input ``x_hat``
    (groups along the last dim, ``row_exp``: their row scales), ``rstd`` per row and ``weight``
    (None: no affine weight), all float32 (DESIGN.md, "LayerNorm backward from the codes"). Every operation a separately
    rounded float32 one::

        xh = dequantize(q, ..., float32, row_exp);  gw = g * weight   (g without a weight)
        m1 = lane_sum(gw) / D;  m2 = lane_sum(gw * xh) / D
        dx = rstd * ((gw - m1) - xh * m2)
        dweight, dbias = sum over chunk partials of g * xh, g (:func:`ln_column_partials`)

    Both column sums are one ``torch.sum`` over dim 1 of their ``(2, blocks, D)`` partials:
    one reduction (one launch on a GPU) whose ``(2, D)`` result is ``dparams``."""
    check_layer_norm_backward_args(g, q, alpha, beta, num_groups, rstd, weight, row_exp)
    return layer_norm_backward_from_xh(dequantize(q, alpha, beta, q.dim() - 1, num_groups, torch.float32, row_exp),
                                       g, rstd, weight)


def layer_norm_backward_from_xh(xh: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor, weight):
    """:func:`layer_norm_backward` from the dequantized ``x_hat`` (float32, row exponents undone),
    tensor ops only: the reference and its traced twin (``traceable.layer_norm_backward``) differ
    only in how they obtain ``xh``."""
    D = xh.shape[-1]
    rows = xh.numel() // D if D else 0
    shape = xh.shape
    xh = xh.reshape(rows, D)
    gf = g.to(torch.float32).reshape(rows, D)
    gw = gf * weight if weight is not None else gf
    n = torch.full((rows, 1), float(D), dtype=torch.float32, device=xh.device)
    m1 = lane_sum(gw) / n
    m2 = lane_sum(gw * xh) / n
    dx = rstd.reshape(rows, 1) * ((gw - m1) - xh * m2)
    return dx.view(shape), torch.stack((ln_column_partials(gf * xh), ln_column_partials(gf))).sum(1)


def gelu_value_and_grad(g, q, alpha, beta, dim: int, num_groups: int, row_exp: torch.Tensor | None = None):
    """``mesa::gelu_value_and_grad``: ``(dequantize_gelu(q, ..., g.dtype, row_exp), gelu_backward(g, q,
    ..., row_exp))``, the exact GELU of the dequantized input and its gradient times ``g``, both
    in ``g``'s dtype, from one read of the codes (GELU + Linear's backward). The CPU kernel is
    this composition; the CUDA kernel one pass (each output the same bits as its own op's)."""
    dim = check_gelu_backward_args(g, q, alpha, beta, dim, num_groups)
    check_row_exp(row_exp, q, "gelu_value_and_grad")
    return (dequantize_gelu(q, alpha, beta, dim, num_groups, g.dtype, row_exp),
            gelu_backward(g, q, alpha, beta, dim, num_groups, row_exp))


def dequantize_gelu(q, alpha, beta, dim: int, num_groups: int, dtype: torch.dtype = torch.float32,
                    row_exp: torch.Tensor | None = None) -> torch.Tensor:
    """``mesa::dequantize_gelu`` (DESIGN.md, "MLP: one copy for GELU and fc2"): the exact (erf)
    GELU of the dequantized input, ``aten.gelu(dequantize(q, ..., dtype, row_exp))``. The CPU
    kernel is this composition (the same bits); the CUDA kernel computes it in one pass
    (ATen's float32 formula, no FMA contraction: within an ulp of the output dtype)."""
    return torch.ops.aten.gelu.default(dequantize(q, alpha, beta, dim, num_groups, dtype, row_exp))


def softmax_dtypes(g, y_dtype=None, out_dtype=None) -> tuple[torch.dtype, torch.dtype]:
    """``(map dtype, result dtype)`` of ``softmax_backward``: the map dequantized through
    ``y_dtype`` (None: g's dtype; or float32: a float32 map whose gradient arrives in g's half
    dtype, CUDA autocast's softmax feeding a bf16 ``attn @ v``), the result in ``out_dtype``
    (None: g's dtype; or float32 with a float32 map: float32 logits, as Swin's with their
    float32 bias). DESIGN.md, "Fused softmax backward"."""
    map_dtype = g.dtype if y_dtype is None or y_dtype == g.dtype else y_dtype
    if map_dtype != g.dtype and map_dtype != torch.float32:
        raise ValueError(f"softmax_backward: y_dtype must be None, g's dtype ({g.dtype}) or torch.float32, "
                         f"got {y_dtype}")
    result = g.dtype if out_dtype is None or out_dtype == g.dtype else out_dtype
    if result != g.dtype and (result != torch.float32 or map_dtype != torch.float32):
        raise ValueError(f"softmax_backward: out_dtype must be None, g's dtype ({g.dtype}) or torch.float32 with "
                         f"y_dtype torch.float32, got {out_dtype}")
    return map_dtype, result


def check_softmax_backward_args(g, q, alpha, beta, dim, num_groups, y_dtype=None, out_dtype=None) -> int:
    """Validate softmax_backward's arguments; return the normalized group dim."""
    dim = _check_codes_backward_args("softmax_backward", g, q, dim)
    softmax_dtypes(g, y_dtype, out_dtype)
    if dim == q.dim() - 1:
        raise ValueError(f"softmax_backward: the group dim {dim} is the softmax (last) dim of shape "
                         f"{tuple(q.shape)}, so a row has several (alpha, beta); valid: a group dim < {dim} "
                         "(else use dequantize + torch._softmax_backward_data)")
    _check_groups(q, dim, num_groups)
    _check_params(q, alpha, beta, num_groups)
    return dim


def softmax_backward(g, q, alpha, beta, dim: int, num_groups: int, y_dtype=None, out_dtype=None) -> torch.Tensor:
    """Gradient of a softmax over the last dim from its codes ``q``, in ``g``'s dtype (or
    ``out_dtype`` float32 with a float32 map: :func:`softmax_dtypes`).

    Per row: ``y = dequantize(q)`` (as :func:`dequantize` returns it in ``y_dtype``, default
    g's dtype, then float32), ``s = max(lane_sum(y), FLT_MIN)`` (NaN stays NaN), ``p = y / s``
    (rows summing to 1: a per-row bias keeps a zero gradient), ``d = lane_sum(g * p)`` and
    ``gx = p * (g - d)``, every operation a separately rounded float32 one. With ``y_dtype``
    float32 and a half g the result is ``softmax_backward(g.float(), ...).to(g.dtype)``, bit
    for bit: the two casts around the op, each a pass over the map, are not needed (with
    ``out_dtype`` float32, ``softmax_backward(g.float(), ...)`` itself)."""
    dim = check_softmax_backward_args(g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype)
    map_dtype, result = softmax_dtypes(g, y_dtype, out_dtype)
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=result, device=q.device)
    y = dequantize(q, alpha, beta, dim, num_groups, map_dtype).to(torch.float32)
    return softmax_backward_from_y(y, g, result)


def softmax_backward_from_y(y: torch.Tensor, g: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """:func:`softmax_backward` from the dequantized map ``y`` (float32, already rounded through
    the map's dtype), tensor ops only: the reference and its traced twin
    (``traceable.softmax_backward``) differ only in how they obtain ``y``."""
    L = y.shape[-1]
    yr = y.reshape(-1, L)
    gf = g.to(torch.float32).reshape(-1, L)
    s = lane_sum(yr)
    s = torch.where(s < torch.full_like(s, _FLT_MIN), torch.full_like(s, _FLT_MIN), s)
    p = yr / s
    d = lane_sum(gf * p)
    return (p * (gf - d)).to(g.dtype if out_dtype is None else out_dtype).view(y.shape)
