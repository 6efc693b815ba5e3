// Shared declarations and scalar math of the mesa quantization kernels.
//
// The arithmetic here is the contract of docs/DESIGN.md ("Exact arithmetic"): every
// operation is a separately rounded fp32 operation (no FMA contraction, no fast-math), so
// the CPU kernels, the CUDA kernels and mesa_train/quant/reference.py agree bit for bit.
// On the device the `__f*_rn` intrinsics make that explicit (they are never contracted);
// on the host the build passes -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

// fp32 / fp16 / bf16 only (no double instantiations: shorter builds).
#define MESA_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                          \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

#if defined(__CUDACC__)
#define MESA_HD __host__ __device__ __forceinline__
#else
#define MESA_HD inline
#endif

namespace mesa {

// ----------------------------------------------------------------------------- fp32 ops
MESA_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MESA_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MESA_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MESA_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// NaN-propagating min / max (fminf/fmaxf would drop NaN). `acc` is the accumulator.
MESA_HD float nan_min(float acc, float v) { return ((v < acc) | (v != v)) ? v : acc; }
MESA_HD float nan_max(float acc, float v) { return ((v > acc) | (v != v)) ? v : acc; }

// Canonical bits (DESIGN.md, "Canonical bits"): every float32 that group_minmax,
// update_estimates and observe return or store is canonical, so min/max reductions are
// order-independent and every device writes the same bits: any NaN becomes 0x7FC00000
// (whatever its payload or sign; GPU arithmetic would give 0x7FFFFFFF), any zero +0.0.
constexpr uint32_t kCanonicalNaNBits = 0x7FC00000u;
MESA_HD float canonical(float v) {
#if defined(__CUDA_ARCH__)
  const float nan = __uint_as_float(kCanonicalNaNBits);
#else
  const float nan = std::numeric_limits<float>::quiet_NaN();  // 0x7FC00000 on IEEE hosts
#endif
  return v != v ? nan : (v == 0.0f ? 0.0f : v);
}

// ----------------------------------------------------------------------------- RNG hash
MESA_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// u in [0, 1) for flat element index i (DESIGN.md, "Stochastic rounding"): one lowbias32 of
// a Weyl step, pair * 0x9E3779B9 + key, gives the uniforms of a pair of elements (pair = the
// index's low word >> 1): its low 16 bits the even element's, its high 16 bits the odd one's,
// u = those 16 bits times 2^-16. The key is a hash of the seed and the index's high word,
// constant over every 2^32 consecutive indices (a pair never straddles two), so kernels
// compute it once per launch (32-bit indices) or per run, and each element costs half a
// lowbias32. Why pairs: the hash was most of the stochastic quantize's extra work over
// round-to-nearest (session 35, H200: 41 against 31 us on DeiT-S's attention map); 16 bits
// lose nothing the sum keeps, since v + u is rounded to float32, whose step is 2^-16 for
// v in [128, 256) (the former 24 bits were rounded away there). Why the Weyl step: a single
// lowbias32 of pair ^ key leaves visible structure between neighbours (tests/
// test_rounding_hash.py); the odd multiplier spreads neighbouring pairs over all 32 bits
// first, as SplitMix does. seed_lo = uint32(seed), seed_hi = uint32(seed >> 32).
MESA_HD uint32_t hash_key(uint32_t seed_lo, uint32_t seed_hi, uint32_t index_hi) {
  return lowbias32(seed_lo ^ lowbias32(seed_hi ^ index_hi * 0x9E3779B9u));
}

// The hash of the pair holding index_lo (both of its elements read their halves of it).
MESA_HD uint32_t pair_hash(uint32_t index_lo, uint32_t key) { return lowbias32((index_lo >> 1) * 0x9E3779B9u + key); }

// The element's 16 bits of its pair's hash: the low half for an even index, the high for an odd.
MESA_HD uint32_t pair_half(uint32_t h, uint32_t index_lo) { return (h >> ((index_lo & 1u) << 4)) & 0xFFFFu; }

// u * 2^16 = those 16 bits, an integer below 2^16, exact as a float (the signed conversion
// vectorises on SSE2/AVX2, which have no unsigned->float vector conversion). The CUDA
// quantize makes the same float without the conversion unit (quant_cuda.cu, half_units)
// and adds u to v as one fused multiply-add of the units by 2^-16, whose product is exact,
// so the sum is rounded once, as v + u is.
constexpr float kUniformUnit = 1.52587890625e-05f;  // 2^-16 (u = units times it, exact)
MESA_HD float uniform_units_keyed(uint32_t index_lo, uint32_t key) {
  return static_cast<float>(static_cast<int32_t>(pair_half(pair_hash(index_lo, key), index_lo)));
}
MESA_HD float uniform_keyed(uint32_t index_lo, uint32_t key) {
  return uniform_units_keyed(index_lo, key) * kUniformUnit;
}

MESA_HD float hash_uniform_units(uint64_t i, uint32_t seed_lo, uint32_t seed_hi) {
  return uniform_units_keyed(static_cast<uint32_t>(i),
                             hash_key(seed_lo, seed_hi, static_cast<uint32_t>(i >> 32)));
}
MESA_HD float hash_uniform(uint64_t i, uint32_t seed_lo, uint32_t seed_hi) {
  return hash_uniform_units(i, seed_lo, seed_hi) * kUniformUnit;
}

// Seed step of mesa::observe (DESIGN.md, "Seed step"): rng = [key, counter] (uint32 each)
// -> the quantize seed [seed_lo, seed_hi]; the caller then advances counter by one (mod 2^32).
MESA_HD void seed_step(uint32_t key, uint32_t counter, uint32_t& seed_lo, uint32_t& seed_hi) {
  const uint32_t k = lowbias32(key);
  seed_lo = lowbias32(counter ^ k);
  seed_hi = lowbias32(seed_lo ^ k ^ 0x68E31DA4u);
}

// ----------------------------------------------------------------------------- LayerNorm backward
// mesa::layer_norm_backward's fixed summation order (DESIGN.md, "LayerNorm backward from the
// codes"; mesa_train.quant.reference.LN_*): the column sums run over chunks of kLnChunkRows
// rows (one warp's, in row order), then blocks of kLnBlockChunks chunks (one CUDA block's, in
// chunk order), then one torch.sum over the blocks' partials. Rows of at most kLnMaxCols.
constexpr int kLnChunkRows = 8;  // (4 until 2026-11-27: twice the blocks, two waves on an H100, twice the partials)
constexpr int kLnBlockChunks = 8;
constexpr int kLnBlockRows = kLnChunkRows * kLnBlockChunks;
constexpr int kLnMaxCols = 1024;

// ----------------------------------------------------------------------------- quant math
// inv = alpha > 1e-12 ? 255 / alpha : 0  (a NaN alpha also gives 0)
MESA_HD float inv_scale(float alpha) { return alpha > 1e-12f ? f_div(255.0f, alpha) : 0.0f; }
// step = alpha / 255
MESA_HD float dequant_step(float alpha) { return f_div(alpha, 255.0f); }

// the exact GELU in float32: ATen's CUDA formula (GeluCUDAKernelImpl, approximate="none"),
// x * 0.5 * (1 + erf(x / sqrt(2))), every operation rounded separately (no FMA contraction)
MESA_HD float gelu_value(float x) {
  const float kAlpha = static_cast<float>(M_SQRT1_2);
  return f_mul(f_mul(x, 0.5f), f_add(1.0f, erff(f_mul(x, kAlpha))));
}

// gelu_value(x) (the same bits) and the factor of d/dx of the exact GELU, sharing their erff.
// gelu_grad(g, x) is ATen's CUDA formula (GeluBackwardCUDAKernelImpl, approximate="none") in
// float32 with every operation rounded separately (no FMA contraction); g enters it only in the
// last multiply, so gelu_grad(g, x) = g * factor bit for bit: the CUDA epilogues tabulate the
// factor of each code's value (DESIGN.md, "GELU from a table of codes").
MESA_HD void gelu_value_and_factor(float x, float& value, float& factor) {
  const float kBeta = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
  const float kAlpha = static_cast<float>(M_SQRT1_2);
  const float e = f_add(1.0f, erff(f_mul(x, kAlpha)));
  value = f_mul(f_mul(x, 0.5f), e);
  const float cdf = f_mul(0.5f, e);
  const float pdf = f_mul(expf(f_mul(f_mul(-0.5f, x), x)), kBeta);
  factor = f_add(cdf, f_mul(x, pdf));
}
// (the value unused: nvcc drops its multiplies)
MESA_HD float gelu_grad_factor(float x) {
  float value, factor;
  gelu_value_and_factor(x, value, factor);
  return factor;
}
MESA_HD float gelu_grad(float g, float x) { return f_mul(g, gelu_grad_factor(x)); }

// gelu_value(x) and gelu_grad(g, x) at once: GELU + Linear's backward needs both at every
// element of h (mesa::gelu_value_and_grad)
MESA_HD void gelu_value_and_grad(float g, float x, float& value, float& grad) {
  float factor;
  gelu_value_and_factor(x, value, factor);
  grad = f_mul(g, factor);
}

// q = NaN -> 0, else clamp(round(v), 0, 255) with v = (x - beta) * inv and
// round = floor(v + u) (stochastic) or rint (nearest, half to even).
// Clamping before rounding is equivalent (rint/floor are monotone, the bounds are
// integers) and lets the rounding be an exact, vectorisable float trick:
//   c in [0, 255]: (c + 2^23) - 2^23 == rint(c), and int(c) == floor(c).
template <bool STOCHASTIC>
MESA_HD uint8_t quantize_value(float x, float beta, float inv, float u) {
  float v = f_mul(f_sub(x, beta), inv);
  if (STOCHASTIC) v = f_add(v, u);
  v = v > 0.0f ? v : 0.0f;  // NaN -> 0 (comparison with NaN is false)
  v = v < 255.0f ? v : 255.0f;
  if (!STOCHASTIC) v = f_sub(f_add(v, 8388608.0f), 8388608.0f);
  return static_cast<uint8_t>(static_cast<int>(v));
}

// xhat = q * step + beta, as two rounded operations; q a code's value (0 .. 255, as the CUDA
// kernels convert their codes: quant_cuda.cu, byte_value)
MESA_HD float dequantize_code_value(float q, float step, float beta) { return f_add(f_mul(q, step), beta); }
MESA_HD float dequantize_value(uint8_t q, float step, float beta) {
  return dequantize_code_value(static_cast<float>(q), step, beta);
}

// ----------------------------------------------------------------------------- bit widths
// Quantizer variants (DESIGN.md, "Variants"): bits in {8, 4, 2}, L = 2^bits - 1 levels
// above 0, and the optional power-of-two step (ALT). With bits = 8 and pow2 = false these
// are exactly inv_scale / dequant_step above.
MESA_HD uint32_t f32_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  __builtin_memcpy(&b, &v, 4);
  return b;
#endif
}
MESA_HD float bits_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  __builtin_memcpy(&v, &b, 4);
  return v;
#endif
}
// The smallest power of two >= r for a normal, finite r (sign kept); r itself when it is a
// power of two, zero, subnormal, inf or NaN. Pure bit arithmetic: exact everywhere.
MESA_HD float pow2_ceil(float r) {
  const uint32_t b = f32_bits(r);
  const uint32_t e = b & 0x7F800000u, m = b & 0x007FFFFFu;
  if (m == 0u || e == 0u || e == 0x7F800000u) return r;
  return bits_f32((b & 0xFF800000u) + 0x00800000u);
}
MESA_HD float levels_of(int bits) { return static_cast<float>((1 << bits) - 1); }
// step = alpha / L, or pow2_ceil(alpha / L) with a power-of-two step
MESA_HD float dequant_step_bits(float alpha, int bits, bool pow2) {
  const float r = f_div(alpha, levels_of(bits));
  return pow2 ? pow2_ceil(r) : r;
}
// inv = alpha > 1e-12 ? L / alpha (or 1 / step with a power-of-two step) : 0
MESA_HD float inv_scale_bits(float alpha, int bits, bool pow2) {
  if (!(alpha > 1e-12f)) return 0.0f;
  return pow2 ? f_div(1.0f, dequant_step_bits(alpha, bits, true)) : f_div(levels_of(bits), alpha);
}
// quantize_value with the top code vmax = L instead of 255.
template <bool STOCHASTIC>
MESA_HD uint8_t quantize_value_levels(float x, float beta, float inv, float u, float vmax) {
  float v = f_mul(f_sub(x, beta), inv);
  if (STOCHASTIC) v = f_add(v, u);
  v = v > 0.0f ? v : 0.0f;
  v = v < vmax ? v : vmax;
  if (!STOCHASTIC) v = f_sub(f_add(v, 8388608.0f), 8388608.0f);
  return static_cast<uint8_t>(static_cast<int>(v));
}

// ----------------------------------------------------------------------------- estimates
// One group's step of the running estimates (DESIGN.md, "Running estimates"); the kernels
// of mesa::update_estimates run it once per group, on the CPU and in one CUDA block.

// false for +-inf and NaN (inf - inf and NaN - NaN are NaN); no <cmath> needed on the device
MESA_HD bool is_finite(float v) { return f_sub(v, v) == 0.0f; }
MESA_HD float abs_f(float v) { return v < 0.0f ? -v : v; }  // NaN stays NaN

// (alpha, beta) = (max - min, min), or symmetric (2m, -m) with m = max(|min|, |max|).
// Not canonicalised here: callers canonicalise what they return or store.
MESA_HD void group_range(float mn, float mx, bool symmetric, float& alpha, float& beta) {
  if (symmetric) {
    const float m = nan_max(abs_f(mn), abs_f(mx));
    alpha = f_mul(m, 2.0f);
    beta = -m;
  } else {
    alpha = f_sub(mx, mn);
    beta = mn;
  }
}

// The batch range of group g that feeds the estimates: the (1, G) statistics, or with
// per-sample statistics (S, G) their min / max over the samples (+-inf when S == 0).
// Host only (the CUDA kernels reduce the encoded statistics in parallel instead).
inline void batch_range(const float* mn, const float* mx, int64_t S, int64_t G, int64_t g, bool per_sample,
                         bool symmetric, float& alpha, float& beta) {
  float lo, hi;
  if (per_sample) {
    lo = std::numeric_limits<float>::infinity();
    hi = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) {
      lo = nan_min(lo, mn[s * G + g]);
      hi = nan_max(hi, mx[s * G + g]);
    }
  } else {
    lo = mn[g];
    hi = mx[g];
  }
  group_range(lo, hi, symmetric, alpha, beta);
}

// used: the value this batch is quantized with (shared statistics); stored: the buffer's
// next value. ema = lam * old + (1 - lam) * r as three rounded fp32 operations. A
// non-finite batch keeps existing estimates and never updates them. Both canonical.
MESA_HD void estimate_step(float old, float r, bool init, bool finite, float lam, float one_minus_lam,
                           float& used, float& stored) {
  const float ema = init ? f_add(f_mul(old, lam), f_mul(r, one_minus_lam)) : r;
  used = canonical((!finite && init) ? old : ema);
  stored = finite ? used : canonical(old);
}

// ----------------------------------------------------------------------------- strided inputs
// The q, k, v that timm's attention unbinds from one (B, N, 3, H, E) qkv tensor are strided
// views (B, H, N, E): rows of E contiguous elements 3 * H * E apart. Copying each to a
// contiguous tensor before observe and quantize cost ~30 us a tensor on an H100, 36 copies a
// DeiT-S step (1.1 ms). The CUDA kernels that read x (observe, group_minmax, quantize,
// quantize_observe) read such x where it lies instead: element i (its index in x's row-major
// order, which the statistics, the hash and the codes use, so the results are bit for bit
// those of the contiguous copy) is at offset c0 + c1 * s1 + c2 * s2 + c3 * s3 of x's data,
// (c3, c2, c1, c0) its index in x viewed as the four dims below.
struct StridedRows {
  int64_t sizes[4];    // size-1 dims dropped, dims contiguous in each other merged, 1s in front
  int64_t strides[4];  // in elements; strides[3] == 1
};

// x's sizes / strides as StridedRows when the kernels read it in place with their 16-element
// (16-byte aligned) steps: at most four dims once collapsed, the last contiguous and a
// multiple of 16 elements (no step crosses a row), every other stride a multiple of 16
// elements (each row 16-byte aligned when x's data is), fewer than 2**31 elements (32-bit
// indices). Contiguous x, or any other layout: nullopt (the callers copy as before).
inline std::optional<StridedRows> strided_rows(at::IntArrayRef sizes, at::IntArrayRef strides) {
  int64_t sz[8], st[8], n = 0, numel = 1;
  if (sizes.size() > 8) return std::nullopt;
  for (size_t d = 0; d < sizes.size(); ++d) {
    numel *= sizes[d];
    if (sizes[d] == 1) continue;
    if (n > 0 && st[n - 1] == strides[d] * sizes[d]) {  // dim d continues the previous one
      sz[n - 1] *= sizes[d];
      st[n - 1] = strides[d];
      continue;
    }
    sz[n] = sizes[d];
    st[n] = strides[d];
    ++n;
  }
  if (numel == 0 || numel >= (int64_t(1) << 31) || n < 2 || n > 4 || st[n - 1] != 1 || sz[n - 1] % 16 != 0)
    return std::nullopt;
  StridedRows r{{1, 1, 1, 1}, {0, 0, 0, 1}};
  for (int64_t d = 0; d < n; ++d) {
    if (d < n - 1 && st[d] % 16 != 0) return std::nullopt;
    r.sizes[4 - n + d] = sz[d];
    r.strides[4 - n + d] = st[d];
  }
  return r;
}

// Whether observe / quantize (compress) read x in place on its device: a non-contiguous CUDA
// tensor of a StridedRows layout. Anything else is made contiguous first (the CPU kernels
// always read contiguous x).
inline bool reads_in_place(const at::Tensor& x) {
  return x.is_cuda() && !x.is_contiguous() && strided_rows(x.sizes(), x.strides()).has_value();
}

// ----------------------------------------------------------------------------- layout
// Contiguous x viewed as (outer, D, inner). Element i: j = i % inner, row = i / inner,
// d = row % D, o = row / D. With per-sample statistics over dim > 0 the sample is
// s = o / outer_per_s (== i / (numel / S)). With per-sample statistics over dim == 0
// the sample *is* d; kernels then use a table indexed by d alone (s_eff = 1).
struct Layout {
  int64_t numel = 0;
  int64_t outer = 1, D = 1, inner = 1;
  int64_t dim = 0;
  int64_t G = 1;
  int64_t S = 1;            // rows of the statistics / parameters (1 or x.shape[0])
  int64_t s_eff = 1;        // rows of the per-(s, d) tables: S when dim > 0, else 1
  int64_t outer_per_s = 1;  // outer / s_eff
  bool dim0_per_sample = false;
};

Layout make_layout(const at::Tensor& x, int64_t dim, int64_t num_groups, int64_t S);

// Argument checks (ValueError on the Python side); return the layout.
Layout check_minmax(const at::Tensor& x, int64_t dim, int64_t num_groups, bool per_sample);
Layout check_quantize(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                      int64_t dim, int64_t num_groups, const at::Tensor& seed);
Layout check_dequantize(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                        int64_t dim, int64_t num_groups, at::ScalarType dtype);
// gelu_backward: g and q of one shape and device, the dequantize layout checks.
Layout check_gelu_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                           const at::Tensor& beta, int64_t dim, int64_t num_groups);
// softmax_backward: g and q of one shape and device, a group dim other than the last, the
// dtypes as softmax_backward_kind takes them.
Layout check_softmax_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                              const at::Tensor& beta, int64_t dim, int64_t num_groups,
                              std::optional<at::ScalarType> y_dtype, std::optional<at::ScalarType> out_dtype);
// softmax_backward's dtypes: the map dequantized through g's dtype (kPlain) or float32
// (y_dtype float32 with a half g), the result in g's dtype or float32 (out_dtype float32 with
// a float32 map). A float32 g is kPlain.
enum class SoftmaxBwdKind { kPlain, kMapFloat, kMapFloatOutFloat };
SoftmaxBwdKind softmax_backward_kind(const at::Tensor& g, std::optional<at::ScalarType> y_dtype,
                                     std::optional<at::ScalarType> out_dtype);
// layer_norm_backward: g and q of one shape and device, groups along the last dim, rows of at
// most kLnMaxCols, rstd / weight / row_exp as the schema says.
Layout check_layer_norm_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                                 const at::Tensor& beta, int64_t num_groups, const at::Tensor& rstd,
                                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& row_exp);
// update_estimates: returns G (the groups of mn / mx).
int64_t check_update_estimates(const at::Tensor& mn, const at::Tensor& mx, const at::Tensor& alpha_est,
                               const at::Tensor& beta_est, const at::Tensor& initialized, double decay,
                               bool per_sample);
// estimate_and_seed: the checks of update_estimates plus the rng; returns G.
int64_t check_estimate_and_seed(const at::Tensor& mn, const at::Tensor& mx, const at::Tensor& alpha_est,
                                const at::Tensor& beta_est, const at::Tensor& initialized, const at::Tensor& rng,
                                double decay, bool per_sample);
// observe: the checks of group_minmax plus the estimate state and rng; returns the layout.
Layout check_observe(const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est,
                     const at::Tensor& initialized, const at::Tensor& rng, int64_t dim, int64_t num_groups,
                     double decay, bool per_sample);
// quantize_bits / dequantize_bits (variants): bits in {8, 4, 2}; bytes of ceil(numel / (8 / bits)).
int64_t packed_bytes(int64_t numel, int64_t bits);
Layout check_quantize_bits(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                           int64_t num_groups, int64_t bits, const at::Tensor& seed);
Layout check_dequantize_bits(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                             at::IntArrayRef shape, int64_t dim, int64_t num_groups, int64_t bits,
                             at::ScalarType dtype);
// int64 (2,) tensor on `device` (quantize's seed, observe's rng)
void check_seed_tensor(const char* what, const at::Tensor& t, const c10::Device& device);

inline int64_t group_of(int64_t d, int64_t G, int64_t D) { return (d * G) / D; }
// the first d of group g (g = G: D), i.e. ceil(g * D / G)
inline int64_t group_begin(int64_t g, int64_t G, int64_t D) { return (g * D + G - 1) / G; }

// ----------------------------------------------------------------------------- row scales
// k of a row of max|x| r in a batch whose row maxima average `mean` (row_exponents, on every
// device): k = clamp(e - 1, 0, max_k) with mean / r = m * 2**e, m in [0.5, 1) (frexp), i.e.
// floor(log2(mean / r)); a non-finite or zero ratio (a zero row, an all-zero or NaN batch)
// gives e = 0, i.e. k = 0
MESA_HD int row_k(float mean, float r, int max_k) {
  const float ratio = f_div(mean, r);
  int e = 0;
  if (is_finite(ratio) && ratio != 0.0f) frexpf(ratio, &e);
  const int k = e - 1 < 0 ? 0 : e - 1;
  return k < max_k ? k : max_k;
}

// The mean of the row maxima that row_k measures against (reference.row_max_mean; DESIGN.md,
// "The mean of the row maxima"): an exact int64 sum of the maxima in fixed point below the
// largest, so that every device and every order of summation gives the same bits (ATen's
// float mean has an unspecified order on each device, Inductor's another). In three steps,
// which the CUDA row pass spreads over a block:
//   1. top = the largest r as storage bits (sign cleared: NaN patterns above +inf's); a NaN,
//      an inf or a zero top is the mean itself (row_k then gives k = 0 to every row);
//   2. each r in fixed point: floor(r * 2**(b - e)) with top < 2**e (frexp) and b =
//      kMeanSumBits - bit_length(n), below 2**b, so n of them add up below 2**62 in int64;
//   3. mean = float32((double(sum) * 2**(e - b)) * (1.0 / n)): the reciprocal rounded once on
//      the host (a kernel argument), the scaling exact, one rounding each for the product and
//      the float32.
constexpr int kMeanSumBits = 62;

inline int mean_sum_bits(int64_t n) {
  int len = 0;
  for (uint64_t v = static_cast<uint64_t>(n); v != 0; v >>= 1) ++len;
  return kMeanSumBits - len;
}

// double 2**e for e in [-1022, 1023], from its exponent bits (exact on every device)
MESA_HD double pow2_f64(int e) {
  const uint64_t bits = static_cast<uint64_t>(e + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
#endif
}

MESA_HD bool mean_top_ok(uint32_t top_bits) { return top_bits != 0u && top_bits < 0x7F800000u; }

// e with top < 2**e (frexp's exponent) of a finite top above 0
MESA_HD int mean_top_exponent(uint32_t top_bits) {
  int e = 0;
#if defined(__CUDA_ARCH__)
  frexpf(__uint_as_float(top_bits), &e);
#else
  float top;
  std::memcpy(&top, &top_bits, sizeof top);
  std::frexp(top, &e);
#endif
  return e;
}

// step 2 for one r (< 2**e); `up` = pow2_f64(b - e)
MESA_HD int64_t mean_term(float r, double up) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(floor(__dmul_rn(static_cast<double>(r), up)));
#else
  return static_cast<int64_t>(std::floor(static_cast<double>(r) * up));
#endif
}

// step 3
MESA_HD float mean_of_sum(int64_t sum, int e, int b, double recip_n) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dmul_rn(__dmul_rn(__ll2double_rn(sum), pow2_f64(e - b)), recip_n));
#else
  return static_cast<float>((static_cast<double>(sum) * pow2_f64(e - b)) * recip_n);
#endif
}

// The whole of it over r[0..n), sequentially (the CPU kernels; the host emulation's check)
inline float row_max_mean(const float* r, int64_t n) {
  uint32_t top_bits = 0u;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, r + i, sizeof bits);
    bits &= 0x7FFFFFFFu;
    top_bits = bits > top_bits ? bits : top_bits;
  }
  float top;
  std::memcpy(&top, &top_bits, sizeof top);
  if (!mean_top_ok(top_bits)) return top;
  const int e = mean_top_exponent(top_bits), b = mean_sum_bits(n);
  const double up = pow2_f64(b - e);
  int64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += mean_term(r[i], up);
  return mean_of_sum(sum, e, b, 1.0 / static_cast<double>(n));
}

// The optional int8 row exponents k of observe / quantize / dequantize (DESIGN.md, "Rows far
// below the grid"): one per row of x's last dims, i.e. of shape x.shape[:-n] + (1,) * n for
// an n >= 1, on x's device. Returns the row length numel / rows (0: no row exponents or an
// empty x). Values must lie in [0, max] with 2**k and 2**-k normal in every dtype involved
// (row_exponents guarantees it); they are not read here (no host sync).
int64_t check_row_exp(const char* op, at::IntArrayRef x_sizes, const c10::Device& device,
                      const std::optional<at::Tensor>& row_exp);
// The optional row_mean / row_rstd of quantize and observe_rows (DESIGN.md, "LayerNorm's
// x_hat inside the kernels"): both or neither; float32 on x's device, one shape of the form
// x.shape[:-n] + (1,) * n; x of a float dtype. Returns the row length (0: none given or an
// empty x).
int64_t check_row_norm(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& row_mean,
                       const std::optional<at::Tensor>& row_rstd);
// x_hat = (x - mean) * rstd in float32, each operation rounded once (two ATen ops): what the
// kernels take x as when row_mean / row_rstd are given (x itself when they are not). The
// CPU kernels and the CUDA layouts without a fused path run on this copy.
at::Tensor normalized_rows(const at::Tensor& x, const std::optional<at::Tensor>& row_mean,
                           const std::optional<at::Tensor>& row_rstd);
// dequantize's optional row_mul: float32 on q's device, shape q.shape[:-n] + (1,) * n.
// Returns the row length (0: none or empty codes).
int64_t check_row_mul(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& row_mul);
// y times its row's row_mul, computed in float32 and rounded to y's dtype, in place (the CPU
// kernel and the CUDA layouts without the fused path; a no-op without row_mul)
void multiply_rows_inplace(at::Tensor& y, const std::optional<at::Tensor>& row_mul);
// dequantize's optional col_scale / col_shift: each float32 of shape (q.shape[-1],) on q's
// device. Returns whether either is given.
bool check_cols(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& col_scale,
                const std::optional<at::Tensor>& col_shift);
// float32 y times col_scale, then plus col_shift, per column of its last dim, in place (each
// a no-op where absent; the CPU kernel and the CUDA paths without the fused epilogue)
void affine_cols_inplace(at::Tensor& y, const std::optional<at::Tensor>& col_scale,
                         const std::optional<at::Tensor>& col_shift);
// row_exponents(x, row_dims, max_k): the float dtypes, 1 <= row_dims <= x.dim(), 0 <= max_k <= 126;
// returns the row length (the product of the last row_dims sizes).
int64_t check_row_exponents(const at::Tensor& x, int64_t row_dims, int64_t max_k);
// observe_rows: the checks of observe and of row_exponents; returns observe's layout.
Layout check_observe_rows(const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est,
                          const at::Tensor& initialized, const at::Tensor& rng, int64_t dim, int64_t num_groups,
                          double decay, bool per_sample, int64_t row_dims, int64_t max_k);
// Whether observe_rows takes its one-pass path (DESIGN.md, "observe_rows"): a non-empty x of
// at least 2 dims, rows of its last dim (row_dims = 1) and groups over that same dim, so each
// row holds a contiguous segment of every group and no row straddles two samples. Other
// layouts run row_exponents, then observe (two passes, the same results).
bool rows_as_cells(const Layout& L, int64_t ndim, int64_t row_dims);
// The (rows, 2, G) "cells" of that path, shaped x.shape[:-1] + (2, G): per row, the min of
// each group's segment, then the max (float32, in x's dtype's values)
std::vector<int64_t> cells_shape(at::IntArrayRef x_sizes, int64_t G);
// one entry per row of the last dim: x.shape[:-1] + (1,) (the row exponents, the row maxima)
std::vector<int64_t> last_dim_rows_shape(at::IntArrayRef x_sizes);

}  // namespace mesa
