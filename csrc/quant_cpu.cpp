// CPU kernels of torch.ops.mesa.{group_minmax, quantize, dequantize, update_estimates}.
//
// * Inputs are made contiguous first (a transient copy for non-contiguous inputs).
// * Parallel over the cores with at::parallel_for (OpenMP backend); every element is
//   touched once per op (one pass).
// * Per-group parameters are expanded once per call into small per-(sample, d) tables
//   (inv = 255/alpha or step = alpha/255, and beta), so the hot loops are a table lookup
//   plus the scalar math of mesa_common.h. The index math follows DESIGN.md: the tensor is
//   viewed as (outer, D, inner) and walked in runs that share the same d (inner > 1) or
//   that walk d with stride 1 (inner == 1, channels last); nothing is permuted.
// * Each run is handed to a small non-template "run kernel" (plain contiguous k loop,
//   per-run constants hoisted, restrict pointers) that the auto-vectoriser handles. On
//   x86-64 with GCC/Clang those run kernels are compiled three times (function
//   multi-versioning, `target_clones("arch=x86-64-v4", "avx2", "default")`): the baseline
//   SSE2 build still runs everywhere, AVX2 machines get 8-wide code, notably the 32-bit
//   multiplies of the lowbias32 hash (vpmulld; SSE2 has no 32-bit vector multiply), and
//   AVX-512 machines (x86-64-v4: F, BW, CD, DQ, VL) 16-wide code: on a 2-core AMD EPYC with
//   AVX-512, stochastic quantize of a (544, 384) fp32 tensor went from 0.92 to 0.50 ns per
//   element, nearest from 0.35 to 0.18 (one thread; `clone()` is 0.12-0.14). Only the ISA
//   changes: the build keeps -ffp-contract=off, so no version contracts a multiply-add into
//   an FMA, and all three produce the same bytes as the reference (the bitwise tests run
//   whichever version the test machine dispatches to). fp16/bf16 conversions are done with the branch-free integer /
//   float formulas of cpu_element_io.h (bit-identical to c10's scalar conversions) so they vectorise too.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_element_io.h"
#include "mesa_common.h"

namespace mesa {
namespace {

using namespace element_io;  // NOLINT: the storage types and their conversions

constexpr int64_t kGrain = 32768;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ----------------------------------------------------------------------------- run kernels
// The stochastic-rounding uniforms of a run, a block at a time, one hash a pair of elements
// (mesa_common.h, pair_hash / pair_half): the loop over pairs writes each hash's low half to
// u[2j] and its high half to u[2j + 1] (the compiler vectorises it, interleaving the halves),
// and element k of the block reads u[k + (lo0 & 1)]. Measured on this AMD EPYC (a standalone
// loop of 2^20 float32 elements, one thread): 6% faster than hashing each element with
// AVX-512, 2% with AVX2; hashing the pair again for each element (uniform_keyed) was 10% slower.
constexpr int64_t kUniformBlock = 256;
// u * 2^16 of the n <= kUniformBlock elements from flat index low word lo0 (constant key),
// written from u[0]: returns where element 0's is (0 or 1). u holds kUniformBlock + 2 floats.
MESA_ALWAYS_INLINE int64_t uniform_units_block(uint32_t lo0, uint32_t key, int64_t n, float* __restrict__ u) {
  const uint32_t odd = lo0 & 1u;
  const int64_t pairs = (n + odd + 1) / 2;
  const uint32_t p0 = lo0 >> 1;
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t h = lowbias32((p0 + static_cast<uint32_t>(j)) * 0x9E3779B9u + key);  // pair_hash
    u[2 * j] = static_cast<float>(static_cast<int32_t>(h & 0xFFFFu));
    u[2 * j + 1] = static_cast<float>(static_cast<int32_t>(h >> 16));
  }
  return odd;
}

// One run of n contiguous elements. TABLE: per-element parameters inv[k], beta[k]
// (inner == 1); else one (inv, beta) pair for the run. Stochastic runs never cross a 2^32
// boundary of the flat index, so the hash input is derived from lo0 + k (uint32) and the
// hash key (hash_key of the seed and the index's high word) is constant. vmax: the top code
// (levels_of(bits): 255 for quantize, quantize_value's; 15 or 3 for quantize_bits).
template <typename T, bool STOCH, bool TABLE>
MESA_ALWAYS_INLINE void quant_run_body(const T* __restrict__ x, uint8_t* __restrict__ q, int64_t n,
                                       const float* __restrict__ inv, const float* __restrict__ beta,
                                       uint32_t lo0, uint32_t key, float vmax) {
  if (STOCH) {
    float ub[kUniformBlock + 2];
    for (int64_t k0 = 0; k0 < n; k0 += kUniformBlock) {
      const int64_t m = std::min(kUniformBlock, n - k0);
      const float* u = ub + uniform_units_block(lo0 + static_cast<uint32_t>(k0), key, m, ub);
      const T* xb = x + k0;
      uint8_t* qb = q + k0;
      if (TABLE) {
        for (int64_t k = 0; k < m; ++k)
          qb[k] = quantize_value_levels<true>(to_f(xb[k]), beta[k0 + k], inv[k0 + k], u[k] * kUniformUnit, vmax);
      } else {
        const float iv = inv[0], bv = beta[0];
        for (int64_t k = 0; k < m; ++k)
          qb[k] = quantize_value_levels<true>(to_f(xb[k]), bv, iv, u[k] * kUniformUnit, vmax);
      }
    }
  } else if (TABLE) {
    for (int64_t k = 0; k < n; ++k) q[k] = quantize_value_levels<false>(to_f(x[k]), beta[k], inv[k], 0.0f, vmax);
  } else {
    const float iv = inv[0], bv = beta[0];
    for (int64_t k = 0; k < n; ++k) q[k] = quantize_value_levels<false>(to_f(x[k]), bv, iv, 0.0f, vmax);
  }
}

template <typename T, bool TABLE>
MESA_ALWAYS_INLINE void dequant_run_body(const uint8_t* __restrict__ q, T* __restrict__ y, int64_t n,
                                         const float* __restrict__ step, const float* __restrict__ beta) {
  if (TABLE) {
    for (int64_t k = 0; k < n; ++k) from_f(dequantize_value(q[k], step[k], beta[k]), y[k]);
  } else {
    const float sv = step[0], bv = beta[0];
    for (int64_t k = 0; k < n; ++k) from_f(dequantize_value(q[k], sv, bv), y[k]);
  }
}

// inner == 1: per-element accumulators mn[k], mx[k].
template <typename T>
MESA_ALWAYS_INLINE void minmax_table_body(const T* __restrict__ x, int64_t n, float* __restrict__ mn,
                                          float* __restrict__ mx) {
  for (int64_t k = 0; k < n; ++k) {
    const float v = to_f(x[k]);
    mn[k] = nan_min(mn[k], v);
    mx[k] = nan_max(mx[k], v);
  }
}

// inner > 1: reduce the run into *mn, *mx. kLanes independent accumulators (vectorisable,
// no single dependency chain); min/max are order-independent and NaN propagates through
// every lane.
template <typename T>
MESA_ALWAYS_INLINE void minmax_reduce_body(const T* __restrict__ x, int64_t n, float* __restrict__ mn,
                                           float* __restrict__ mx) {
  constexpr int kLanes = 16;
  if (n < kLanes) {  // a short run (a small H x W left unflattened): no lanes to set up and merge
    float amin = *mn, bmax = *mx;
    for (int64_t k = 0; k < n; ++k) {
      const float v = to_f(x[k]);
      amin = nan_min(amin, v);
      bmax = nan_max(bmax, v);
    }
    *mn = amin;
    *mx = bmax;
    return;
  }
  float a[kLanes], b[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    a[l] = kInf;
    b[l] = -kInf;
  }
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    // keep the lane loop a loop: fully unrolled, it is left to the SLP vectoriser, which
    // does not if-convert the NaN-aware selects (scalar branches, measured 4x slower)
    MESA_NO_UNROLL
    for (int l = 0; l < kLanes; ++l) {
      const float v = to_f(x[k + l]);
      a[l] = nan_min(a[l], v);
      b[l] = nan_max(b[l], v);
    }
  }
  float amin = *mn, bmax = *mx;
  for (; k < n; ++k) {
    const float v = to_f(x[k]);
    amin = nan_min(amin, v);
    bmax = nan_max(bmax, v);
  }
  for (int l = 0; l < kLanes; ++l) {
    amin = nan_min(amin, a[l]);
    bmax = nan_max(bmax, b[l]);
  }
  *mn = amin;
  *mx = bmax;
}

// Non-template, multi-versioned entry points (one per storage type and variant).
#define MESA_QUANT_RUN(NAME, T, STOCH, TABLE)                                                          \
  MESA_CLONES void NAME(const T* __restrict__ x, uint8_t* __restrict__ q, int64_t n,                   \
                        const float* __restrict__ inv, const float* __restrict__ beta, uint32_t lo0,   \
                        uint32_t key, float vmax) {                                                    \
    quant_run_body<T, STOCH, TABLE>(x, q, n, inv, beta, lo0, key, vmax);                               \
  }
#define MESA_DEQUANT_RUN(NAME, T, TABLE)                                                          \
  MESA_CLONES void NAME(const uint8_t* __restrict__ q, T* __restrict__ y, int64_t n,              \
                        const float* __restrict__ step, const float* __restrict__ beta) {         \
    dequant_run_body<T, TABLE>(q, y, n, step, beta);                                              \
  }
#define MESA_MINMAX_RUN(NAME, T, BODY)                                                                   \
  MESA_CLONES void NAME(const T* __restrict__ x, int64_t n, float* __restrict__ mn, float* __restrict__ mx) { \
    BODY<T>(x, n, mn, mx);                                                                               \
  }

#define MESA_RUN_KERNELS(SUF, T)                          \
  MESA_QUANT_RUN(quant_sr_tab_##SUF, T, true, true)       \
  MESA_QUANT_RUN(quant_sr_one_##SUF, T, true, false)      \
  MESA_QUANT_RUN(quant_rn_tab_##SUF, T, false, true)      \
  MESA_QUANT_RUN(quant_rn_one_##SUF, T, false, false)     \
  MESA_DEQUANT_RUN(dequant_tab_##SUF, T, true)            \
  MESA_DEQUANT_RUN(dequant_one_##SUF, T, false)           \
  MESA_MINMAX_RUN(minmax_tab_##SUF, T, minmax_table_body) \
  MESA_MINMAX_RUN(minmax_red_##SUF, T, minmax_reduce_body)

MESA_RUN_KERNELS(f32, float)
MESA_RUN_KERNELS(f16, uint16_t)
MESA_RUN_KERNELS(bf16, Bf16Bits)

// ----------------------------------------------------------------------------- row |x| max
// The largest |x| of a run as its storage bits with the sign cleared: for non-negative values
// the bit patterns order like the values, and every NaN pattern lies above +inf, so the
// integer max is max|x| (a NaN pattern when the run holds a NaN). Integer max reductions
// vectorise; a float max with a NaN flag does not without fast-math (0.8 ns per element
// before, in the row scales of every Mesa Linear / LayerNorm).
MESA_ALWAYS_INLINE uint32_t storage_bits(float v) { return f_bits(v); }
MESA_ALWAYS_INLINE uint32_t storage_bits(uint16_t v) { return v; }
MESA_ALWAYS_INLINE uint32_t storage_bits(Bf16Bits v) { return v.x; }

template <typename T, uint32_t kAbsMask>
MESA_ALWAYS_INLINE uint32_t absmax_bits_body(const T* __restrict__ x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = storage_bits(x[i]) & kAbsMask;
    m = b > m ? b : m;
  }
  return m;
}
MESA_CLONES uint32_t absmax_bits_f32(const float* __restrict__ x, int64_t n) {
  return absmax_bits_body<float, 0x7FFFFFFFu>(x, n);
}
MESA_CLONES uint32_t absmax_bits_f16(const uint16_t* __restrict__ x, int64_t n) {
  return absmax_bits_body<uint16_t, 0x7FFFu>(x, n);
}
MESA_CLONES uint32_t absmax_bits_bf16(const Bf16Bits* __restrict__ x, int64_t n) {
  return absmax_bits_body<Bf16Bits, 0x7FFFu>(x, n);
}
// the row's max|x| as a float (a quiet NaN for a row with a NaN; exact: the conversions are)
MESA_ALWAYS_INLINE float absmax_row(const float* x, int64_t n) {
  const uint32_t m = absmax_bits_f32(x, n);
  return m > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : bits_f(m);
}
MESA_ALWAYS_INLINE float absmax_row(const uint16_t* x, int64_t n) {
  const uint32_t m = absmax_bits_f16(x, n);
  return m > 0x7C00u ? std::numeric_limits<float>::quiet_NaN() : to_f(static_cast<uint16_t>(m));
}
MESA_ALWAYS_INLINE float absmax_row(const Bf16Bits* x, int64_t n) {
  const uint32_t m = absmax_bits_bf16(x, n);
  return m > 0x7F80u ? std::numeric_limits<float>::quiet_NaN() : to_f(Bf16Bits{static_cast<uint16_t>(m)});
}

// observe_rows' pass over one row of D elements whose G groups are contiguous segments of it:
// its max|x| into *r (as absmax_row) and each segment's min into c[g], max into c[G + g]. The
// float bits map to order-preserving uint32 with NaN above everything (the CUDA kernels'
// min/max encoding), so all three are integer max reductions, which vectorise (the NaN-aware
// float selects of minmax_reduce_body cost ~30 ns per short segment: 5x the two-op path).
MESA_ALWAYS_INLINE float unord_bits(uint32_t e) { return bits_f((e & 0x80000000u) ? (e & 0x7FFFFFFFu) : ~e); }
template <typename T>
MESA_ALWAYS_INLINE void row_cells_body(const T* __restrict__ x, int64_t D, int64_t G, float* __restrict__ c,
                                       float* __restrict__ r) {
  uint32_t am = 0;
  for (int64_t g = 0; g < G; ++g) {
    // o = the order-preserving map (b ^ 0x80000000 for b >= 0, ~b below); a positive NaN maps
    // above +inf (max), a negative one below -inf (min of ~o): NaNs are caught by the
    // segment's max|x| instead, so the loop is five integer ops and three max
    uint32_t emx = 0, emn = 0, sa = 0;
    for (int64_t j = group_begin(g, G, D), e = group_begin(g + 1, G, D); j < e; ++j) {
      const uint32_t b = f_bits(to_f(x[j]));
      const uint32_t a = b & 0x7FFFFFFFu;
      const uint32_t o = b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
      sa = a > sa ? a : sa;
      emx = o > emx ? o : emx;
      emn = ~o > emn ? ~o : emn;
    }
    // (a segment is never empty: G <= D)
    const bool nan = sa > 0x7F800000u;
    c[g] = nan ? std::numeric_limits<float>::quiet_NaN() : unord_bits(~emn);
    c[G + g] = nan ? std::numeric_limits<float>::quiet_NaN() : unord_bits(emx);
    am = sa > am ? sa : am;
  }
  *r = am > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : bits_f(am);
}
#define MESA_ROW_CELLS(SUF, T)                                                                               \
  MESA_CLONES void row_cells_##SUF(const T* __restrict__ x, int64_t D, int64_t G, float* __restrict__ c,  \
                                   float* __restrict__ r) {                                                \
    row_cells_body<T>(x, D, G, c, r);                                                                      \
  }                                                                                                        \
  MESA_ALWAYS_INLINE void row_cells(const T* x, int64_t D, int64_t G, float* c, float* r) {                \
    row_cells_##SUF(x, D, G, c, r);                                                                        \
  }
MESA_ROW_CELLS(f32, float)
MESA_ROW_CELLS(f16, uint16_t)
MESA_ROW_CELLS(bf16, Bf16Bits)

template <typename T> struct Runs;
#define MESA_RUNS(SUF, T)                                                                          \
  template <> struct Runs<T> {                                                                     \
    static void quant(bool stoch, bool table, const T* x, uint8_t* q, int64_t n, const float* inv, \
                      const float* beta, uint32_t lo0, uint32_t key, float vmax) {                 \
      if (stoch) {                                                                                 \
        if (table) quant_sr_tab_##SUF(x, q, n, inv, beta, lo0, key, vmax);                         \
        else quant_sr_one_##SUF(x, q, n, inv, beta, lo0, key, vmax);                               \
      } else {                                                                                     \
        if (table) quant_rn_tab_##SUF(x, q, n, inv, beta, lo0, key, vmax);                         \
        else quant_rn_one_##SUF(x, q, n, inv, beta, lo0, key, vmax);                               \
      }                                                                                            \
    }                                                                                              \
    static void dequant(bool table, const uint8_t* q, T* y, int64_t n, const float* step,          \
                        const float* beta) {                                                       \
      if (table) dequant_tab_##SUF(q, y, n, step, beta);                                           \
      else dequant_one_##SUF(q, y, n, step, beta);                                                 \
    }                                                                                              \
    static void minmax(bool table, const T* x, int64_t n, float* mn, float* mx) {                  \
      if (table) minmax_tab_##SUF(x, n, mn, mx);                                                   \
      else minmax_red_##SUF(x, n, mn, mx);                                                         \
    }                                                                                              \
  };
MESA_RUNS(f32, float)
MESA_RUNS(f16, uint16_t)
MESA_RUNS(bf16, Bf16Bits)

template <typename scalar_t>
using storage_t = typename StorageOf<scalar_t>::type;
template <typename scalar_t>
const storage_t<scalar_t>* as_storage(const scalar_t* p) {
  return reinterpret_cast<const storage_t<scalar_t>*>(p);
}
template <typename scalar_t>
storage_t<scalar_t>* as_storage(scalar_t* p) {
  return reinterpret_cast<storage_t<scalar_t>*>(p);
}

// Per-(s_eff, d) tables of f(alpha) and beta.
template <typename F>
void build_tables(const Layout& L, const at::Tensor& alpha, const at::Tensor& beta, F f,
                  std::vector<float>& t_scale, std::vector<float>& t_beta) {
  const at::Tensor a = alpha.contiguous(), b = beta.contiguous();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  t_scale.resize(L.s_eff * L.D);
  t_beta.resize(L.s_eff * L.D);
  for (int64_t s = 0; s < L.s_eff; ++s) {
    for (int64_t d = 0; d < L.D; ++d) {
      const int64_t src = L.S == 1 ? 0 : (L.dim0_per_sample ? d : s);
      const int64_t k = src * L.G + group_of(d, L.G, L.D);
      t_scale[s * L.D + d] = f(ap[k]);
      t_beta[s * L.D + d] = bp[k];
    }
  }
}

// Short runs. A group dim that is not last with few elements after it (an NCHW activation
// grouped over its channels with a small H x W: ResNet-50's last stages at 64x64 have 2x2 and
// 4x4) walks in runs of `inner` elements, one call and one (scale, offset) setup each: observe
// took 30x and quantize 10x the time of the same tensor laid out NHWC. Such a layout is walked
// as (outer, D * inner, 1) instead, with per-element tables (each (s, d) entry repeated inner
// times): the same flat indices (so the same stochastic-rounding hash inputs) and the same
// per-element parameters, so the same codes, values and statistics; only the loop changes.
// Shared statistics only (s_eff == 1), and D * inner bounded (kMaxFlatCodes): the kernels
// read tables that long. The min/max passes keep per-element accumulators as long as a row of
// the walk; shared_minmax splits a row longer than kStatsBlock into column blocks (at most
// kStatsBlock each), so that each task's accumulators stay in cache (2 x 64 KB) and no task
// keeps partial ones; and a row of kColumnBlocks or more too, where that still gives every
// thread a block of kMinBlock columns: with partials, the (16, 240, 8, 8) layout (rows of
// 15360) took 3x its channels-last time to observe on 2 threads, most of it filling and
// merging 8 chunks' partial rows.
// Short rows. A row of the walk (D elements, inner == 1) shorter than kTileRun is one call too:
// a channels-last activation with few channels (NHWC 32 x 32 x 32, viewed as (N*H*W, 32)) or
// narrow tokens (DeiT-tiny's 192) took 2.7x the time of the same tensor in NCHW to quantize.
// Such a walk takes m = kTileRun / D rows as one (the tables tiled m times): the same flat
// indices and per-element parameters again, so the same codes, values and statistics.
constexpr int64_t kShortRun = 256;  // (inner below: flattened; 15 x 15 and smaller)
constexpr int64_t kTileRun = 1024;  // (rows below: tiled; tables of 4 KB each)
constexpr int64_t kMaxFlatCodes = int64_t{1} << 17;
constexpr int64_t kStatsBlock = int64_t{1} << 14;
constexpr int64_t kColumnBlocks = 4096;
constexpr int64_t kMinBlock = 1024;

Layout walk_layout(const Layout& L) {
  if (L.s_eff != 1) return L;
  Layout W = L;
  if (L.inner > 1 && L.inner < kShortRun && L.D * L.inner <= kMaxFlatCodes) {  // flatten the inner dims
    W.D = L.D * L.inner;
    W.inner = 1;
  }
  if (W.inner == 1 && W.D < kTileRun) W.D *= kTileRun / W.D;  // tile short rows
  return W;
}

// The (s, d) tables of L for the walk layout W (walk_layout(L)): entry k of W's is L's entry
// (k / L.inner) % L.D (each repeated L.inner times where W flattened the inner dims, the whole
// row repeated where it tiled rows), else as they are.
void expand_tables(const Layout& L, const Layout& W, std::vector<float>& t) {
  if (W.D == L.D) return;
  std::vector<float> e(W.D);
  const int64_t row = L.D * L.inner;  // (W.D is a multiple of it)
  for (int64_t d = 0; d < L.D; ++d) std::fill_n(e.begin() + d * L.inner, L.inner, t[d]);
  for (int64_t k = row; k < W.D; k += row) std::copy_n(e.begin(), row, e.begin() + k);
  t.swap(e);
}

// Folds W's per-position statistics (W.D of them, walk_layout(L)) into L's per-d ones, in
// place in the first L.D entries: the tiled rows first, then each d's run of L.inner.
// (Any order: min / max are canonicalised after.)
void fold_walk_statistics(const Layout& L, const Layout& W, std::vector<float>& mn, std::vector<float>& mx) {
  if (W.D == L.D) return;
  const int64_t row = L.D * L.inner;  // one row of L, flattened
  for (int64_t r = row; r < W.D; r += row) {
    for (int64_t k = 0; k < row; ++k) {
      mn[k] = nan_min(mn[k], mn[r + k]);
      mx[k] = nan_max(mx[k], mx[r + k]);
    }
  }
  for (int64_t d = 0; d < L.D; ++d) {  // (in place: d * inner >= d)
    float a = mn[d * L.inner], b = mx[d * L.inner];
    for (int64_t j = 1; j < L.inner; ++j) {
      a = nan_min(a, mn[d * L.inner + j]);
      b = nan_max(b, mx[d * L.inner + j]);
    }
    mn[d] = a;
    mx[d] = b;
  }
}

// The walk layout of L (walk_layout(L)) with build_tables' tables for it: the one
// place the kernels that walk L derive both, so the tables always match the walk.
template <typename F>
Layout walk_tables(const Layout& L, const at::Tensor& alpha, const at::Tensor& beta, F f,
                   std::vector<float>& t_scale, std::vector<float>& t_beta) {
  const Layout W = walk_layout(L);
  build_tables(L, alpha, beta, f, t_scale, t_beta);
  expand_tables(L, W, t_scale);
  expand_tables(L, W, t_beta);
  return W;
}

// Walks [begin, end) in runs of constant (s, d) (inner > 1) or of consecutive d
// (inner == 1). body(i, n, s, d) handles elements i .. i+n-1. The position is derived
// with divisions once, then advanced incrementally (runs can be short, e.g. D = 192).
template <typename Body>
inline void walk(const Layout& L, int64_t begin, int64_t end, Body body) {
  const int64_t inner = L.inner, D = L.D;
  int64_t i = begin;
  const int64_t row = i / inner;
  int64_t j = i - row * inner;  // position inside the current run of `inner`
  int64_t d = row % D;
  const int64_t o = row / D;
  int64_t s = L.s_eff > 1 ? o / L.outer_per_s : 0;
  int64_t o_in_s = o - s * L.outer_per_s;
  while (i < end) {
    const int64_t n = inner == 1 ? std::min(D - d, end - i) : std::min(inner - j, end - i);
    body(i, n, s, d);
    i += n;
    if (inner == 1) {
      d += n;
    } else if ((j += n) == inner) {
      j = 0;
      ++d;
    }
    if (d == D) {
      d = 0;
      if (++o_in_s == L.outer_per_s && L.s_eff > 1) {
        o_in_s = 0;
        ++s;
      }
    }
  }
}

// ----------------------------------------------------------------------------- quantize
// Quantizes the run of n elements at flat index i (constant (s, d) or consecutive d, see walk)
// into out[0 .. n) (out: where element i's code goes), codes 0 .. vmax.
template <typename T>
inline void quantize_run(const T* x, uint8_t* out, const Layout& L, int64_t i, int64_t n, int64_t s, int64_t d,
                         bool stoch, const float* tinv, const float* tbeta, uint32_t slo, uint32_t shi,
                         float vmax = levels_of(8)) {
  const bool table = L.inner == 1;
  const float* iv = tinv + s * L.D + d;
  const float* bv = tbeta + s * L.D + d;
  // split the run where the low 32 bits of the flat index wrap (hash input, see above)
  int64_t k = 0;
  while (k < n) {
    const uint64_t idx = static_cast<uint64_t>(i + k);
    const int64_t to_wrap = static_cast<int64_t>((uint64_t{1} << 32) - (idx & 0xFFFFFFFFu));
    const int64_t m = std::min(n - k, to_wrap);
    const uint32_t key = hash_key(slo, shi, static_cast<uint32_t>(idx >> 32));
    const int64_t off = table ? k : 0;
    Runs<T>::quant(stoch, table, x + i + k, out + k, m, iv + off, bv + off, static_cast<uint32_t>(idx), key, vmax);
    k += m;
  }
}

template <typename scalar_t>
void quantize_kernel(const scalar_t* x_, uint8_t* q, const Layout& L, bool stoch, const float* tinv,
                     const float* tbeta, uint32_t slo, uint32_t shi) {
  using T = storage_t<scalar_t>;
  const T* x = as_storage(x_);
  at::parallel_for(0, L.numel, kGrain, [&](int64_t begin, int64_t end) {
    walk(L, begin, end, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      quantize_run(x, q + i, L, i, n, s, d, stoch, tinv, tbeta, slo, shi);
    });
  });
}

// [lo, hi] of an int64 (2,) seed tensor (uint32 each: the low 32 bits of each entry)
void read_seed(const at::Tensor& seed, uint32_t& lo, uint32_t& hi) {
  const int64_t* p = seed.const_data_ptr<int64_t>();
  const int64_t st = seed.stride(0);
  lo = static_cast<uint32_t>(p[0]);
  hi = static_cast<uint32_t>(p[st]);
}

// ----------------------------------------------------------------------------- row scales
// Whether every row exponent is 0 (rows of ordinary spread: the common case; one byte per
// row to read, on the CPU).
bool all_rows_unscaled(const at::Tensor& k) {
  const at::Tensor kc = k.contiguous();
  const int8_t* kp = kc.const_data_ptr<int8_t>();
  for (int64_t i = 0, n = kc.numel(); i < n; ++i)
    if (kp[i] != 0) return false;
  return true;
}

// x with its rows scaled by 2**k in x's dtype (the definition of the ops' row_exp, as
// mesa_train.nn.rowscale.scale_rows computes it); x itself without row exponents or when
// every k is 0 (x * 1 is x, bit for bit). On the CPU a scaled transient copy costs one pass
// at most, and only for batches with a small row; the CUDA kernels scale in registers.
at::Tensor rows_scaled(const at::Tensor& x, const std::optional<at::Tensor>& row_exp, int64_t row_len) {
  if (row_len == 0 || all_rows_unscaled(*row_exp)) return x;
  return x.mul(row_exp->to(x.scalar_type()).exp2());
}

// y * 2**-k in place, rounded to y's dtype (mesa_train.nn.rowscale.unscale_rows).
void unscale_rows_inplace(at::Tensor& y, const std::optional<at::Tensor>& row_exp, int64_t row_len) {
  if (row_len == 0 || all_rows_unscaled(*row_exp)) return;
  y.mul_(row_exp->to(y.scalar_type()).neg_().exp2());
}

at::Tensor quantize_cpu(const at::Tensor& x_in, const at::Tensor& alpha, const at::Tensor& beta,
                        int64_t dim, int64_t num_groups, bool stochastic, const at::Tensor& seed,
                        const std::optional<at::Tensor>& row_exp, const std::optional<at::Tensor>& row_mean,
                        const std::optional<at::Tensor>& row_rstd) {
  const Layout L = check_quantize(x_in, alpha, beta, dim, num_groups, seed);
  const int64_t row_len = check_row_exp("quantize", x_in.sizes(), x_in.device(), row_exp);
  check_row_norm("quantize", x_in, row_mean, row_rstd);
  // (x_hat as its own float32 copy: the CPU kernels take no row_mean / row_rstd themselves)
  const at::Tensor x = rows_scaled(normalized_rows(x_in, row_mean, row_rstd), row_exp, row_len).contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (L.numel == 0) return q;
  std::vector<float> tinv, tbeta;
  const Layout W = walk_tables(L, alpha, beta, [](float a) { return inv_scale(a); }, tinv, tbeta);
  uint32_t slo, shi;
  read_seed(seed, slo, shi);
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_quantize_cpu", [&] {
    quantize_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), q.mutable_data_ptr<uint8_t>(), W, stochastic,
                              tinv.data(), tbeta.data(), slo, shi);
  });
  return q;
}

// ----------------------------------------------------------------------------- dequantize
template <typename scalar_t>
void dequantize_kernel(const uint8_t* q, scalar_t* y_, const Layout& L, const float* tstep,
                       const float* tbeta) {
  using T = storage_t<scalar_t>;
  T* y = as_storage(y_);
  const bool table = L.inner == 1;
  at::parallel_for(0, L.numel, kGrain, [&](int64_t begin, int64_t end) {
    walk(L, begin, end, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      Runs<T>::dequant(table, q + i, y + i, n, tstep + s * L.D + d, tbeta + s * L.D + d);
    });
  });
}

at::Tensor dequantize_cpu(const at::Tensor& q_in, const at::Tensor& alpha, const at::Tensor& beta,
                          int64_t dim, int64_t num_groups, at::ScalarType dtype,
                          const std::optional<at::Tensor>& row_exp, const std::optional<at::Tensor>& row_mul,
                          const std::optional<at::Tensor>& col_scale, const std::optional<at::Tensor>& col_shift) {
  const Layout L = check_dequantize(q_in, alpha, beta, dim, num_groups, dtype);
  const int64_t row_len = check_row_exp("dequantize", q_in.sizes(), q_in.device(), row_exp);
  check_row_mul("dequantize", q_in, row_mul);
  if (check_cols("dequantize", q_in, col_scale, col_shift)) {  // the definition itself, in place
    at::Tensor y = dequantize_cpu(q_in, alpha, beta, dim, num_groups, at::kFloat, row_exp, row_mul, std::nullopt,
                                  std::nullopt);
    affine_cols_inplace(y, col_scale, col_shift);
    return dtype == at::kFloat ? y : y.to(dtype);
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor y = at::empty(q.sizes(), q.options().dtype(dtype));
  if (L.numel == 0) return y;
  std::vector<float> tstep, tbeta;
  const Layout W = walk_tables(L, alpha, beta, [](float a) { return dequant_step(a); }, tstep, tbeta);
  MESA_DISPATCH_FLOAT_TYPES(dtype, "mesa_dequantize_cpu", [&] {
    dequantize_kernel<scalar_t>(q.const_data_ptr<uint8_t>(), y.mutable_data_ptr<scalar_t>(), W, tstep.data(),
                                tbeta.data());
  });
  unscale_rows_inplace(y, row_exp, row_len);
  multiply_rows_inplace(y, row_mul);
  return y;
}

// ----------------------------------------------------------------------------- minmax
// Accumulates per-d min/max of [begin, end) into mn[0..D), mx[0..D) (all of one sample).
template <typename T>
void minmax_range(const T* x, const Layout& L, int64_t begin, int64_t end, float* mn, float* mx) {
  const bool table = L.inner == 1;
  walk(L, begin, end, [&](int64_t i, int64_t n, int64_t /*s*/, int64_t d) {
    Runs<T>::minmax(table, x + i, n, mn + d, mx + d);
  });
}

// (D,) per-d statistics of one sample -> row `out_row` of the (S, G) outputs.
void reduce_groups(const Layout& L, const float* dmn, const float* dmx, float* omn, float* omx) {
  for (int64_t d = 0; d < L.D; ++d) {
    const int64_t k = L.dim0_per_sample ? d * L.G + group_of(d, L.G, L.D) : group_of(d, L.G, L.D);
    omn[k] = nan_min(omn[k], dmn[d]);
    omx[k] = nan_max(omx[k], dmx[d]);
  }
}

// Canonical bits of every returned / stored statistic (mesa_common.h, `canonical`).
void canonicalize(at::Tensor& t) {
  float* p = t.mutable_data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = canonical(p[i]);
}

// Shared statistics (or per sample over dim 0) of a contiguous x into the (S, G) outputs
// pmn / pmx. The walk is W, L's or its flattened or tiled walk_layout(L) (the caller's, so that
// `before` and its tables agree): `before(i, n, s, d)` runs on each run first, d in W
// (quantize_observe: the run's codes, so that the run is read from memory once and from cache
// the second time). Two ways to split the work:
// * a row of W (D elements, inner == 1) longer than kStatsBlock, or of kColumnBlocks or more
//   with a block of kMinBlock columns or more for every thread: column blocks, each a task
//   that walks its columns down every row with its own accumulators, final when it ends (no
//   partials). ResNet-50's NCHW 512 x 8 x 8 and 2048 x 7 x 7 layouts, flattened: the chunked
//   walk below kept a whole row of accumulators per chunk, out of cache (2048 x 7 x 7: 1.3x
//   slower than not flattening), and not flattening walks runs of 49-64 elements, each with a
//   16-lane setup and reduction (3x the NHWC layout's time);
// * otherwise chunks of the flat index, each with per-d partial min/max, then a reduction.
template <typename T, typename Before>
void shared_minmax(const T* xp, const Layout& L, const Layout& W, float* pmn, float* pmx, Before before) {
  const int64_t D = W.D;
  const bool table = W.inner == 1;
  const int64_t nthreads = at::get_num_threads();
  std::vector<float> part_mn, part_mx;
  if (table && (D > kStatsBlock || (D >= kColumnBlocks && D >= kMinBlock * nthreads))) {
    part_mn.assign(D, kInf);
    part_mx.assign(D, -kInf);
    const int64_t rows = L.numel / D;
    // (at least one block a thread, of 1024 columns or more)
    const int64_t block = std::clamp<int64_t>((D + nthreads - 1) / nthreads, kMinBlock, kStatsBlock);
    at::parallel_for(0, (D + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t d0 = b * block, n = std::min(D, d0 + block) - d0;
        for (int64_t r = 0; r < rows; ++r) {
          before(r * D + d0, n, int64_t{0}, d0);
          Runs<T>::minmax(true, xp + r * D + d0, n, part_mn.data() + d0, part_mx.data() + d0);
        }
      }
    });
  } else {
    const int64_t nchunks =
        std::max<int64_t>(1, std::min<int64_t>((L.numel + kGrain - 1) / kGrain, 4 * nthreads));
    part_mn.assign(nchunks * D, kInf);
    part_mx.assign(nchunks * D, -kInf);
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = L.numel * c / nchunks, e = L.numel * (c + 1) / nchunks;
        float* mn = part_mn.data() + c * D;
        float* mx = part_mx.data() + c * D;
        walk(W, b, e, [&](int64_t i, int64_t n, int64_t /*s*/, int64_t d) {
          before(i, n, int64_t{0}, d);
          Runs<T>::minmax(table, xp + i, n, mn + d, mx + d);
        });
      }
    });
    for (int64_t c = 1; c < nchunks; ++c) {
      for (int64_t d = 0; d < D; ++d) {
        part_mn[d] = nan_min(part_mn[d], part_mn[c * D + d]);
        part_mx[d] = nan_max(part_mx[d], part_mx[c * D + d]);
      }
    }
  }
  fold_walk_statistics(L, W, part_mn, part_mx);
  reduce_groups(L, part_mn.data(), part_mx.data(), pmn, pmx);
}

// (S, G) min / max of x (validated layout L); canonical.
std::tuple<at::Tensor, at::Tensor> group_minmax_impl(const at::Tensor& x_in, const Layout& L) {
  const at::Tensor x = x_in.contiguous();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor omn = at::full({L.S, L.G}, kInf, fopts);
  at::Tensor omx = at::full({L.S, L.G}, -kInf, fopts);
  if (L.numel == 0) return {omn, omx};
  float* pmn = omn.mutable_data_ptr<float>();
  float* pmx = omx.mutable_data_ptr<float>();
  const int64_t D = L.D;

  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_group_minmax_cpu", [&] {
    const storage_t<scalar_t>* xp = as_storage(x.const_data_ptr<scalar_t>());
    if (L.s_eff > 1) {
      // per sample (dim > 0): samples are contiguous blocks; one task per sample, no partials
      const int64_t per_s = L.numel / L.s_eff;
      at::parallel_for(0, L.s_eff, std::max<int64_t>(1, kGrain / std::max<int64_t>(per_s, 1)),
                       [&](int64_t s0, int64_t s1) {
        std::vector<float> dmn(D), dmx(D);
        for (int64_t s = s0; s < s1; ++s) {
          std::fill(dmn.begin(), dmn.end(), kInf);
          std::fill(dmx.begin(), dmx.end(), -kInf);
          minmax_range(xp, L, s * per_s, (s + 1) * per_s, dmn.data(), dmx.data());
          reduce_groups(L, dmn.data(), dmx.data(), pmn + s * L.G, pmx + s * L.G);
        }
      });
    } else {
      shared_minmax(xp, L, walk_layout(L), pmn, pmx, [](int64_t, int64_t, int64_t, int64_t) {});
    }
  });
  canonicalize(omn);
  canonicalize(omx);
  return {omn, omx};
}

std::tuple<at::Tensor, at::Tensor> group_minmax_cpu(const at::Tensor& x, int64_t dim, int64_t num_groups,
                                                    bool per_sample) {
  return group_minmax_impl(x, check_minmax(x, dim, num_groups, per_sample));
}

// The estimate step on validated arguments (G groups).
std::tuple<at::Tensor, at::Tensor> update_estimates_impl(const at::Tensor& mn_in, const at::Tensor& mx_in,
                                                         const at::Tensor& alpha_est, const at::Tensor& beta_est,
                                                         const at::Tensor& initialized, double decay, bool per_sample,
                                                         bool symmetric, bool valid, int64_t G) {
  const at::Tensor mn = mn_in.contiguous(), mx = mx_in.contiguous();
  const int64_t S = mn.size(0);
  at::Tensor out_a = at::empty({S, G}, mn.options()), out_b = at::empty({S, G}, mn.options());
  const float* pmn = mn.const_data_ptr<float>();
  const float* pmx = mx.const_data_ptr<float>();
  float* est_a = alpha_est.mutable_data_ptr<float>();
  float* est_b = beta_est.mutable_data_ptr<float>();
  float* oa = out_a.mutable_data_ptr<float>();
  float* ob = out_b.mutable_data_ptr<float>();
  bool* init_p = initialized.mutable_data_ptr<bool>();
  const bool init = *init_p;
  // (float) decay and (float)(1 - decay): what torch does with a Python float scalar
  const float lam = static_cast<float>(decay), oml = static_cast<float>(1.0 - decay);
  std::vector<float> ra(G), rb(G);
  bool finite = valid;
  for (int64_t g = 0; g < G; ++g) {
    batch_range(pmn, pmx, S, G, g, per_sample, symmetric, ra[g], rb[g]);
    finite = finite && is_finite(ra[g]) && is_finite(rb[g]);
  }
  for (int64_t g = 0; g < G; ++g) {
    float used_a, used_b;
    estimate_step(est_a[g], ra[g], init, finite, lam, oml, used_a, est_a[g]);
    estimate_step(est_b[g], rb[g], init, finite, lam, oml, used_b, est_b[g]);
    if (!per_sample) {
      oa[g] = used_a;
      ob[g] = used_b;
    }
  }
  if (per_sample) {
    for (int64_t i = 0; i < S * G; ++i) {
      group_range(pmn[i], pmx[i], symmetric, oa[i], ob[i]);
      oa[i] = canonical(oa[i]);
      ob[i] = canonical(ob[i]);
    }
  }
  *init_p = init || finite;
  return {out_a, out_b};
}

std::tuple<at::Tensor, at::Tensor> update_estimates_cpu(const at::Tensor& mn, const at::Tensor& mx,
                                                        const at::Tensor& alpha_est, const at::Tensor& beta_est,
                                                        const at::Tensor& initialized, double decay, bool per_sample,
                                                        bool symmetric, bool valid) {
  const int64_t G = check_update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample);
  return update_estimates_impl(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid, G);
}

// The seed the seed step draws from rng = [key, counter] as it stands: [seed_lo, seed_hi].
static at::Tensor seed_from(const at::Tensor& rng) {
  const int64_t* r = rng.const_data_ptr<int64_t>();
  uint32_t lo, hi;
  seed_step(static_cast<uint32_t>(r[0]), static_cast<uint32_t>(r[rng.stride(0)]), lo, hi);
  at::Tensor seed = at::empty({2}, rng.options());
  seed.mutable_data_ptr<int64_t>()[0] = lo;
  seed.mutable_data_ptr<int64_t>()[1] = hi;
  return seed;
}

// The seed step (DESIGN.md, "Seed step"): a fresh [seed_lo, seed_hi] from rng = [key,
// counter], whose counter advances by one (mod 2^32) in place.
at::Tensor seed_step_cpu(const at::Tensor& rng) {
  at::Tensor seed = seed_from(rng);
  int64_t& counter = rng.mutable_data_ptr<int64_t>()[rng.stride(0)];
  counter = static_cast<int64_t>(static_cast<uint32_t>(counter) + 1u);
  return seed;
}

// seed_of: the seed step's seed, rng unchanged.
at::Tensor seed_of_cpu(const at::Tensor& rng) {
  check_seed_tensor("seed_of: rng ([key, counter])", rng, rng.device());
  return seed_from(rng);
}

// estimate_and_seed = update_estimates + the seed step (observe without the min/max pass).
std::tuple<at::Tensor, at::Tensor, at::Tensor> estimate_and_seed_cpu(
    const at::Tensor& mn, const at::Tensor& mx, const at::Tensor& alpha_est, const at::Tensor& beta_est,
    const at::Tensor& initialized, const at::Tensor& rng, double decay, bool per_sample, bool symmetric, bool valid) {
  const int64_t G = check_estimate_and_seed(mn, mx, alpha_est, beta_est, initialized, rng, decay, per_sample);
  auto [alpha, beta] =
      update_estimates_impl(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric, valid, G);
  return {alpha, beta, seed_step_cpu(rng)};
}

// observe = group_minmax + update_estimates(valid = numel > 0) + the seed step.
std::tuple<at::Tensor, at::Tensor, at::Tensor> observe_cpu(const at::Tensor& x, const at::Tensor& alpha_est,
                                                           const at::Tensor& beta_est, const at::Tensor& initialized,
                                                           const at::Tensor& rng, int64_t dim, int64_t num_groups,
                                                           double decay, bool per_sample, bool symmetric,
                                                           const std::optional<at::Tensor>& row_exp) {
  const Layout L = check_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample);
  const int64_t row_len = check_row_exp("observe", x.sizes(), x.device(), row_exp);
  const auto [mn, mx] = group_minmax_impl(rows_scaled(x, row_exp, row_len), L);
  auto [alpha, beta] = update_estimates_impl(mn, mx, alpha_est, beta_est, initialized, decay, per_sample, symmetric,
                                             L.numel > 0, L.G);
  return {alpha, beta, seed_step_cpu(rng)};
}

// delayed_observe: quantize_observe's second half with initialized estimates (the traced
// delayed compression codes x itself): (1, G) copies of the estimates as they stand, then
// observe's update of them from x's min/max and the counter's advance (its seed unused).
std::tuple<at::Tensor, at::Tensor> delayed_observe_cpu(const at::Tensor& x, const at::Tensor& alpha_est,
                                                       const at::Tensor& beta_est, const at::Tensor& initialized,
                                                       const at::Tensor& rng, int64_t dim, int64_t num_groups,
                                                       double decay, bool symmetric) {
  const Layout L = check_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, false);
  const at::Tensor alpha = alpha_est.narrow(0, 0, L.G).clone().view({1, L.G});
  const at::Tensor beta = beta_est.narrow(0, 0, L.G).clone().view({1, L.G});
  observe_cpu(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, false, symmetric, std::nullopt);
  return {alpha, beta};
}

// quantize_observe (estimator "delayed", DESIGN.md "Delayed estimates"): with initialized
// estimates, quantize with them as they stand, then observe this batch for the next one, in
// one walk over x (each run quantized, then reduced while in cache; the CUDA kernel reads x
// once too); without (the first batch), observe + quantize, as the running estimator.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_observe_cpu(
    const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est, const at::Tensor& initialized,
    const at::Tensor& rng, int64_t dim, int64_t num_groups, double decay, bool symmetric, bool stochastic,
    const std::optional<at::Tensor>& row_exp) {
  const Layout L = check_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, false);
  const int64_t row_len = check_row_exp("quantize_observe", x.sizes(), x.device(), row_exp);
  const at::Tensor xs = rows_scaled(x, row_exp, row_len);
  if (!*initialized.const_data_ptr<bool>()) {
    auto [alpha, beta, seed] = observe_cpu(xs, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, false,
                                           symmetric, std::nullopt);
    return {quantize_cpu(xs, alpha, beta, dim, num_groups, stochastic, seed, std::nullopt, std::nullopt,
                         std::nullopt), alpha, beta};
  }
  const at::Tensor alpha = alpha_est.narrow(0, 0, L.G).clone().view({1, L.G});
  const at::Tensor beta = beta_est.narrow(0, 0, L.G).clone().view({1, L.G});
  const at::Tensor seed = seed_step_cpu(rng);
  // one walk over x: each run is quantized, then folded into the min/max while in cache
  const at::Tensor xc = xs.contiguous();
  at::Tensor q = at::empty(xc.sizes(), xc.options().dtype(at::kByte));
  const auto fopts = xc.options().dtype(at::kFloat);
  at::Tensor mn = at::full({1, L.G}, kInf, fopts), mx = at::full({1, L.G}, -kInf, fopts);
  if (L.numel > 0) {
    std::vector<float> tinv, tbeta;  // (shared_minmax walks W: d below is W's)
    const Layout W = walk_tables(L, alpha, beta, [](float a) { return inv_scale(a); }, tinv, tbeta);
    uint32_t slo, shi;
    read_seed(seed, slo, shi);
    uint8_t* qp = q.mutable_data_ptr<uint8_t>();
    MESA_DISPATCH_FLOAT_TYPES(xc.scalar_type(), "mesa_quantize_observe_cpu", [&] {
      const storage_t<scalar_t>* xp = as_storage(xc.const_data_ptr<scalar_t>());
      shared_minmax(xp, L, W, mn.mutable_data_ptr<float>(), mx.mutable_data_ptr<float>(),
                    [&](int64_t i, int64_t n, int64_t s, int64_t d) {
                      quantize_run(xp, qp + i, W, i, n, s, d, stochastic, tinv.data(), tbeta.data(), slo, shi);
                    });
    });
    canonicalize(mn);
    canonicalize(mx);
  }
  update_estimates_impl(mn, mx, alpha_est, beta_est, initialized, decay, false, symmetric, L.numel > 0, L.G);
  return {q, alpha, beta};
}

// ----------------------------------------------------------------------------- bit widths
// quantize_bits / dequantize_bits (DESIGN.md, "Variants"): the codes of one parallel task
// (a range of whole output bytes) are computed into a task-local buffer with quantize's walk
// (walk_tables: NCHW activations with small planes flattened, short rows tiled), then packed
// 8/bits per byte, little end first. bits = 8 writes in place. The runs are quantize's
// (quantize_run, with the top code 2^bits - 1); packing and unpacking take whole bytes with a
// fixed count of codes each (a copy of the run kernel that was not multi-versioned, and a
// division of each element's index by 8/bits, took 5-18x the 8-bit ops' time).
// n codes (< 2^bits each) -> ceil(n / kPer) bytes, code k of a byte at bits k * (8 / kPer);
// a partial last byte is zero-padded.
template <int kPer>
MESA_ALWAYS_INLINE void pack_codes_body(const uint8_t* __restrict__ c, int64_t n, uint8_t* __restrict__ out) {
  constexpr int kBits = 8 / kPer;
  const int64_t full = n / kPer;
  for (int64_t b = 0; b < full; ++b) {
    uint32_t v = 0;
    for (int k = 0; k < kPer; ++k) v |= static_cast<uint32_t>(c[b * kPer + k]) << (k * kBits);
    out[b] = static_cast<uint8_t>(v);
  }
  if (full * kPer < n) {
    uint32_t v = 0;
    for (int64_t i = full * kPer; i < n; ++i) v |= static_cast<uint32_t>(c[i]) << ((i - full * kPer) * kBits);
    out[full] = static_cast<uint8_t>(v);
  }
}
// The n codes of ceil(n / kPer) packed bytes.
template <int kPer>
MESA_ALWAYS_INLINE void unpack_codes_body(const uint8_t* __restrict__ p, int64_t n, uint8_t* __restrict__ c) {
  constexpr int kBits = 8 / kPer;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int64_t full = n / kPer;
  for (int64_t b = 0; b < full; ++b) {
    const uint32_t v = p[b];
    for (int k = 0; k < kPer; ++k) c[b * kPer + k] = static_cast<uint8_t>((v >> (k * kBits)) & kMask);
  }
  for (int64_t i = full * kPer; i < n; ++i)
    c[i] = static_cast<uint8_t>((p[full] >> ((i - full * kPer) * kBits)) & kMask);
}
MESA_CLONES void pack_codes_2(const uint8_t* __restrict__ c, int64_t n, uint8_t* __restrict__ out) {
  pack_codes_body<2>(c, n, out);
}
MESA_CLONES void pack_codes_4(const uint8_t* __restrict__ c, int64_t n, uint8_t* __restrict__ out) {
  pack_codes_body<4>(c, n, out);
}
MESA_CLONES void unpack_codes_2(const uint8_t* __restrict__ p, int64_t n, uint8_t* __restrict__ c) {
  unpack_codes_body<2>(p, n, c);
}
MESA_CLONES void unpack_codes_4(const uint8_t* __restrict__ p, int64_t n, uint8_t* __restrict__ c) {
  unpack_codes_body<4>(p, n, c);
}
// bits 4 or 2 (8 stores the codes as they are)
void pack_codes(const uint8_t* c, int64_t n, int64_t bits, uint8_t* out) {
  if (bits == 4) pack_codes_2(c, n, out);
  else pack_codes_4(c, n, out);
}
void unpack_codes(const uint8_t* p, int64_t n, int64_t bits, uint8_t* c) {
  if (bits == 4) unpack_codes_2(p, n, c);
  else unpack_codes_4(p, n, c);
}

template <typename scalar_t>
void quantize_bits_kernel(const scalar_t* x_, uint8_t* q, const Layout& L, int64_t bits, bool stoch,
                          const float* tinv, const float* tbeta, uint32_t slo, uint32_t shi) {
  using T = storage_t<scalar_t>;
  const T* x = as_storage(x_);
  const int64_t per = 8 / bits;
  const float vmax = levels_of(static_cast<int>(bits));
  const int64_t nbytes = packed_bytes(L.numel, bits);
  at::parallel_for(0, nbytes, std::max<int64_t>(1, kGrain / per), [&](int64_t b0, int64_t b1) {
    const int64_t i0 = b0 * per, i1 = std::min(b1 * per, L.numel);
    std::vector<uint8_t> local(per == 1 ? 0 : i1 - i0);
    uint8_t* codes = per == 1 ? q + i0 : local.data();
    walk(L, i0, i1, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      quantize_run(x, codes + (i - i0), L, i, n, s, d, stoch, tinv, tbeta, slo, shi, vmax);
    });
    if (per > 1) pack_codes(codes, i1 - i0, bits, q + b0);
  });
}

at::Tensor quantize_bits_cpu(const at::Tensor& x_in, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                             int64_t num_groups, int64_t bits, bool pow2, bool stochastic, const at::Tensor& seed) {
  const Layout L = check_quantize_bits(x_in, alpha, beta, dim, num_groups, bits, seed);
  const at::Tensor x = x_in.contiguous();
  at::Tensor q = at::empty({packed_bytes(L.numel, bits)}, x.options().dtype(at::kByte));
  if (L.numel == 0) return q;
  std::vector<float> tinv, tbeta;
  const int b = static_cast<int>(bits);
  const Layout W = walk_tables(L, alpha, beta, [b, pow2](float a) { return inv_scale_bits(a, b, pow2); }, tinv, tbeta);
  uint32_t slo, shi;
  read_seed(seed, slo, shi);
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_quantize_bits_cpu", [&] {
    quantize_bits_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), q.mutable_data_ptr<uint8_t>(), W, bits, stochastic,
                                   tinv.data(), tbeta.data(), slo, shi);
  });
  return q;
}

template <typename scalar_t>
void dequantize_bits_kernel(const uint8_t* q, scalar_t* y_, const Layout& L, int64_t bits, const float* tstep,
                            const float* tbeta) {
  using T = storage_t<scalar_t>;
  T* y = as_storage(y_);
  const bool table = L.inner == 1;
  const int64_t per = 8 / bits;
  const int64_t nbytes = packed_bytes(L.numel, bits);
  at::parallel_for(0, nbytes, std::max<int64_t>(1, kGrain / per), [&](int64_t b0, int64_t b1) {
    const int64_t i0 = b0 * per, i1 = std::min(b1 * per, L.numel);
    std::vector<uint8_t> local(per == 1 ? 0 : i1 - i0);
    const uint8_t* codes = q + i0;
    if (per > 1) {
      unpack_codes(q + b0, i1 - i0, bits, local.data());
      codes = local.data();
    }
    walk(L, i0, i1, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      Runs<T>::dequant(table, codes + (i - i0), y + i, n, tstep + s * L.D + d, tbeta + s * L.D + d);
    });
  });
}

at::Tensor dequantize_bits_cpu(const at::Tensor& q_in, const at::Tensor& alpha, const at::Tensor& beta,
                               at::IntArrayRef shape, int64_t dim, int64_t num_groups, int64_t bits, bool pow2,
                               at::ScalarType dtype) {
  const Layout L = check_dequantize_bits(q_in, alpha, beta, shape, dim, num_groups, bits, dtype);
  const at::Tensor q = q_in.contiguous();
  at::Tensor y = at::empty(shape, q.options().dtype(dtype));
  if (L.numel == 0) return y;
  std::vector<float> tstep, tbeta;
  const int b = static_cast<int>(bits);
  const Layout W =
      walk_tables(L, alpha, beta, [b, pow2](float a) { return dequant_step_bits(a, b, pow2); }, tstep, tbeta);
  MESA_DISPATCH_FLOAT_TYPES(dtype, "mesa_dequantize_bits_cpu", [&] {
    dequantize_bits_kernel<scalar_t>(q.const_data_ptr<uint8_t>(), y.mutable_data_ptr<scalar_t>(), W, bits,
                                     tstep.data(), tbeta.data());
  });
  return y;
}

// Per-row max |x| of a contiguous CPU fp32/fp16/bf16 tensor viewed as (numel / L, L), into
// out (float32, one per row): the value of max(amax, -amin).abs() (a zero row gives +0.0, a
// row with a NaN a NaN); the first pass of row_exponents_cpu.
void row_absmax_cpu(const at::Tensor& x, int64_t L, float* out) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous() && L > 0 && x.numel() % L == 0,
              "row_absmax_cpu: a contiguous CPU tensor of whole rows of ", L, " elements");
  const int64_t rows = x.numel() / L;
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_row_absmax", [&] {
    using S = typename StorageOf<scalar_t>::type;
    const S* p = reinterpret_cast<const S*>(x.const_data_ptr<scalar_t>());
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / L), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[i] = absmax_row(p + i * L, L);
    });
  });
}

// mesa_train.nn.rowscale.row_exponents, bitwise: the row maxima in one vectorised pass
// (row_absmax_cpu), their mean as every device takes it (row_max_mean), then per row row_k
// (mesa_common.h: float division is correctly rounded and frexp is what ATen's frexp calls,
// so every k is the reference's). About 10 small ATen ops fewer per Mesa Linear / LayerNorm and step
// than the Python version (results/overhead/).
at::Tensor row_exponents_cpu(const at::Tensor& x_in, int64_t row_dims, int64_t max_k) {
  const int64_t L = check_row_exponents(x_in, row_dims, max_k);
  std::vector<int64_t> shape = x_in.sizes().vec();
  for (int64_t d = x_in.dim() - row_dims; d < x_in.dim(); ++d) shape[d] = 1;
  at::Tensor k = at::empty(shape, x_in.options().dtype(at::kChar));
  if (x_in.numel() == 0) return k.zero_();  // (rows of length 0: k = 0)
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / L;
  at::Tensor r = at::empty(shape, x.options().dtype(at::kFloat));
  float* rp = r.mutable_data_ptr<float>();
  row_absmax_cpu(x, L, rp);
  const float mean = row_max_mean(rp, rows);  // (mesa_common.h: the bits of every device)
  int8_t* kp = k.mutable_data_ptr<int8_t>();
  for (int64_t i = 0; i < rows; ++i) kp[i] = static_cast<int8_t>(row_k(mean, rp[i], static_cast<int>(max_k)));
  return k;
}

// ----------------------------------------------------------------------------- observe_rows
// row_exponents + observe(row_exp = k), bitwise (DESIGN.md, "observe_rows"). With groups
// and rows over the last dim (rows_as_cells), one pass: per row its max|x| and the min / max
// of each group's segment (the "cells"); k from the row maxima as row_exponents finds it;
// each row's cells times 2**k rounded to x's dtype (scaling by a power of two is monotone,
// so the scaled min of a segment is the min of the scaled elements, NaN and +-0 included
// once canonicalised); then observe's reduction over the cells (their groups and samples are
// x's), folded into the loop that scales them, its estimate step and seed step.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> observe_rows_cpu(
    const at::Tensor& x_in, const at::Tensor& alpha_est, const at::Tensor& beta_est, const at::Tensor& initialized,
    const at::Tensor& rng, int64_t dim, int64_t num_groups, double decay, bool per_sample, bool symmetric,
    int64_t row_dims, int64_t max_k, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd) {
  const Layout L = check_observe_rows(x_in, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample,
                                      row_dims, max_k);
  check_row_norm("observe_rows", x_in, row_mean, row_rstd);
  if (row_mean.has_value() && row_mean->defined()) {
    // x_hat as a float32 copy (the CPU kernels take no row_mean / row_rstd themselves)
    return observe_rows_cpu(normalized_rows(x_in, row_mean, row_rstd), alpha_est, beta_est, initialized, rng, dim,
                            num_groups, decay, per_sample, symmetric, row_dims, max_k, std::nullopt, std::nullopt);
  }
  if (!rows_as_cells(L, x_in.dim(), row_dims)) {
    at::Tensor k = row_exponents_cpu(x_in, row_dims, max_k);
    auto [alpha, beta, seed] =
        observe_cpu(x_in, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample, symmetric, k);
    return {alpha, beta, seed, k};
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t D = L.D, G = L.G, rows = L.numel / D;
  const std::vector<int64_t> kshape = last_dim_rows_shape(x.sizes());
  at::Tensor k = at::empty(kshape, x.options().dtype(at::kChar));
  at::Tensor r = at::empty(kshape, x.options().dtype(at::kFloat));
  at::Tensor cells = at::empty(cells_shape(x.sizes(), G), x.options().dtype(at::kFloat));
  const auto fopts = x.options().dtype(at::kFloat);
  at::Tensor omn = at::full({L.S, G}, kInf, fopts), omx = at::full({L.S, G}, -kInf, fopts);
  float* pmn = omn.mutable_data_ptr<float>();
  float* pmx = omx.mutable_data_ptr<float>();
  float* rp = r.mutable_data_ptr<float>();
  float* cp = cells.mutable_data_ptr<float>();
  int8_t* kp = k.mutable_data_ptr<int8_t>();
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_observe_rows_cpu", [&] {
    using S = storage_t<scalar_t>;
    const S* p = as_storage(x.const_data_ptr<scalar_t>());
    // pass over x: the row's max|x| and its segments' min/max (the row stays in cache)
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / D), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) row_cells(p + i * D, D, G, cp + i * 2 * G, rp + i);
    });
    // k per row as row_exponents finds it; the row's cells times 2**k in x's dtype, folded
    // into the (S, G) min / max (the reduction observe would run over the cells)
    const float mean = row_max_mean(rp, rows);
    const int64_t rows_per_s = rows / L.S;
    for (int64_t i = 0; i < rows; ++i) {
      kp[i] = static_cast<int8_t>(row_k(mean, rp[i], static_cast<int>(max_k)));
      const float f = std::ldexp(1.0f, kp[i]);
      const float* c = cp + i * 2 * G;
      float* smn = pmn + (i / rows_per_s) * G;
      float* smx = pmx + (i / rows_per_s) * G;
      for (int64_t g = 0; g < G; ++g) {
        smn[g] = nan_min(smn[g], kp[i] == 0 ? c[g] : through(f_mul(c[g], f), p));
        smx[g] = nan_max(smx[g], kp[i] == 0 ? c[G + g] : through(f_mul(c[G + g], f), p));
      }
    }
  });
  canonicalize(omn);
  canonicalize(omx);
  auto [alpha, beta] = update_estimates_impl(omn, omx, alpha_est, beta_est, initialized, decay, per_sample, symmetric,
                                             true, G);
  const at::Tensor seed = seed_step_cpu(rng);
  return {alpha, beta, seed, k};
}

}  // namespace

// ----------------------------------------------------------------------------- softmax backward
// mesa::softmax_backward (DESIGN.md, "Fused softmax backward"): one pass over the codes and g
// instead of dequantize, renormalise and _softmax_backward_data. Parallel over rows; both row
// sums use the order of the CUDA kernel's warp (32 lane accumulators, lane l adding elements
// l, l + 32, ..., then the xor butterfly), so the bits equal the CUDA kernel's and the
// reference's (mesa_train.quant.reference.softmax_backward).
constexpr int kLanes = 32;
constexpr float kFltMin = std::numeric_limits<float>::min();

// Lane 0's result of the __shfl_xor_sync butterfly over the 32 lane sums. Lane 0 only needs
// lanes l < off at each step, and for those l ^ off = l + off: a halving tree of 31 adds
// (16-, 8-, ... wide vector adds) instead of the butterfly's 160, the same operands in the
// same order, so the same bits.
MESA_ALWAYS_INLINE float butterfly(float (&acc)[kLanes]) {
  for (int off = kLanes / 2; off > 0; off /= 2)
    for (int l = 0; l < off; ++l) acc[l] = f_add(acc[l], acc[l + off]);
  return acc[0];
}

// The chunks of 32 elements of a row: body(c0, m) for the m <= 32 elements from c0 (lane l
// takes element c0 + l). Full chunks get a constant trip count, which the vectoriser turns
// into straight 16-/8-wide code; the tail keeps a variable one.
template <typename Body>
MESA_ALWAYS_INLINE void for_chunks(int64_t n, Body body) {
  int64_t c0 = 0;
  for (; c0 + kLanes <= n; c0 += kLanes) body(c0, std::integral_constant<int64_t, kLanes>());
  if (c0 < n) body(c0, n - c0);
}

// One row of n elements with one (step, beta); p: n floats of scratch. M: the map's storage
// type (T, or float for a float32 map with a half g); O: the result's (T, or float).
template <typename T, typename M, typename O = T>
MESA_ALWAYS_INLINE void softmax_bwd_row_body(const uint8_t* __restrict__ q, const T* __restrict__ g,
                                             O* __restrict__ out, int64_t n, float step, float beta,
                                             float* __restrict__ p) {
  // stage 1: y (rounded through the map's dtype, as dequantize returns it) and s = max(sum y, FLT_MIN)
  float acc[kLanes] = {};
  for_chunks(n, [&](int64_t c0, auto m) {
    for (int64_t l = 0; l < int64_t(m); ++l) {
      const float y = through(dequantize_value(q[c0 + l], step, beta), static_cast<const M*>(nullptr));
      p[c0 + l] = y;
      acc[l] = f_add(acc[l], y);
    }
  });
  float s = butterfly(acc);
  s = s < kFltMin ? kFltMin : s;  // NaN stays NaN
  // stage 2: p = y / s (the row renormalised to sum 1) and d = sum g * p
  float gp[kLanes] = {};
  for_chunks(n, [&](int64_t c0, auto m) {
    for (int64_t l = 0; l < int64_t(m); ++l) {
      const float pj = f_div(p[c0 + l], s);
      p[c0 + l] = pj;
      gp[l] = f_add(gp[l], f_mul(to_f(g[c0 + l]), pj));
    }
  });
  const float d = butterfly(gp);
  // stage 3: gx = p * (g - d)
  for (int64_t j = 0; j < n; ++j) from_f(f_mul(p[j], f_sub(to_f(g[j]), d)), out[j]);
}
MESA_CLONES void softmax_bwd_row_f32(const uint8_t* q, const float* g, float* out, int64_t n, float step,
                                     float beta, float* p) {
  softmax_bwd_row_body<float, float>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_f16(const uint8_t* q, const uint16_t* g, uint16_t* out, int64_t n, float step,
                                     float beta, float* p) {
  softmax_bwd_row_body<uint16_t, uint16_t>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_bf16(const uint8_t* q, const Bf16Bits* g, Bf16Bits* out, int64_t n, float step,
                                      float beta, float* p) {
  softmax_bwd_row_body<Bf16Bits, Bf16Bits>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_f16_map32(const uint8_t* q, const uint16_t* g, uint16_t* out, int64_t n,
                                           float step, float beta, float* p) {
  softmax_bwd_row_body<uint16_t, float>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_bf16_map32(const uint8_t* q, const Bf16Bits* g, Bf16Bits* out, int64_t n,
                                            float step, float beta, float* p) {
  softmax_bwd_row_body<Bf16Bits, float>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_f16_out32(const uint8_t* q, const uint16_t* g, float* out, int64_t n, float step,
                                           float beta, float* p) {
  softmax_bwd_row_body<uint16_t, float, float>(q, g, out, n, step, beta, p);
}
MESA_CLONES void softmax_bwd_row_bf16_out32(const uint8_t* q, const Bf16Bits* g, float* out, int64_t n,
                                            float step, float beta, float* p) {
  softmax_bwd_row_body<Bf16Bits, float, float>(q, g, out, n, step, beta, p);
}
// (map_float: the map dequantized through float32; a float32 g's map is float32 either way)
inline void softmax_bwd_row(const uint8_t* q, const float* g, float* o, int64_t n, float st, float b, float* p,
                            bool) {
  softmax_bwd_row_f32(q, g, o, n, st, b, p);
}
inline void softmax_bwd_row(const uint8_t* q, const uint16_t* g, uint16_t* o, int64_t n, float st, float b,
                            float* p, bool map_float) {
  if (map_float) softmax_bwd_row_f16_map32(q, g, o, n, st, b, p);
  else softmax_bwd_row_f16(q, g, o, n, st, b, p);
}
inline void softmax_bwd_row(const uint8_t* q, const Bf16Bits* g, Bf16Bits* o, int64_t n, float st, float b,
                            float* p, bool map_float) {
  if (map_float) softmax_bwd_row_bf16_map32(q, g, o, n, st, b, p);
  else softmax_bwd_row_bf16(q, g, o, n, st, b, p);
}
// (a float32 result: the map float32 too)
inline void softmax_bwd_row(const uint8_t* q, const float* g, float* o, int64_t n, float st, float b, float* p) {
  softmax_bwd_row_f32(q, g, o, n, st, b, p);
}
inline void softmax_bwd_row(const uint8_t* q, const uint16_t* g, float* o, int64_t n, float st, float b, float* p) {
  softmax_bwd_row_f16_out32(q, g, o, n, st, b, p);
}
inline void softmax_bwd_row(const uint8_t* q, const Bf16Bits* g, float* o, int64_t n, float st, float b, float* p) {
  softmax_bwd_row_bf16_out32(q, g, o, n, st, b, p);
}

// The (s, d) table entry of a row's first element: the whole row shares it, as the group dim
// lies before the last dim (inner is a multiple of the row length).
inline int64_t row_table_index(const Layout& L, int64_t first) {
  const int64_t row = first / L.inner;
  const int64_t d = row % L.D, o = row / L.D;
  const int64_t s = L.s_eff > 1 ? o / L.outer_per_s : 0;
  return s * L.D + d;
}

template <typename scalar_t>
void softmax_backward_kernel(const uint8_t* q, const scalar_t* g_, void* out_, const Layout& L, int64_t n,
                             const float* tstep, const float* tbeta, SoftmaxBwdKind kind) {
  using T = storage_t<scalar_t>;
  const T* g = as_storage(g_);
  const int64_t rows = L.numel / n;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / n), [&](int64_t begin, int64_t end) {
    std::vector<float> p(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r * n, t = row_table_index(L, i);
      if (kind == SoftmaxBwdKind::kMapFloatOutFloat) {
        softmax_bwd_row(q + i, g + i, static_cast<float*>(out_) + i, n, tstep[t], tbeta[t], p.data());
      } else {
        softmax_bwd_row(q + i, g + i, static_cast<T*>(out_) + i, n, tstep[t], tbeta[t], p.data(),
                        kind == SoftmaxBwdKind::kMapFloat);
      }
    }
  });
}

at::Tensor softmax_backward_cpu(const at::Tensor& g_in, const at::Tensor& q_in, const at::Tensor& alpha,
                                const at::Tensor& beta, int64_t dim, int64_t num_groups,
                                std::optional<at::ScalarType> y_dtype, std::optional<at::ScalarType> out_dtype) {
  const Layout L = check_softmax_backward(g_in, q_in, alpha, beta, dim, num_groups, y_dtype, out_dtype);
  const SoftmaxBwdKind kind = softmax_backward_kind(g_in, y_dtype, out_dtype);
  const at::Tensor q = q_in.contiguous(), g = g_in.contiguous();
  const auto odt = kind == SoftmaxBwdKind::kMapFloatOutFloat ? at::kFloat : g.scalar_type();
  at::Tensor out = at::empty(q.sizes(), g.options().dtype(odt).memory_format(at::MemoryFormat::Contiguous));
  if (L.numel == 0) return out;
  std::vector<float> tstep, tbeta;
  build_tables(L, alpha, beta, [](float a) { return dequant_step(a); }, tstep, tbeta);
  MESA_DISPATCH_FLOAT_TYPES(g.scalar_type(), "mesa_softmax_backward_cpu", [&] {
    softmax_backward_kernel<scalar_t>(q.const_data_ptr<uint8_t>(), g.const_data_ptr<scalar_t>(),
                                      out.mutable_data_ptr(), L, q.size(-1), tstep.data(), tbeta.data(), kind);
  });
  return out;
}

// ----------------------------------------------------------------------------- LayerNorm backward
// mesa::layer_norm_backward (DESIGN.md, "LayerNorm backward from the codes"): x_hat from the
// codes as dequantize returns it in float32 (row exponents undone), then per block of
// kLnBlockRows rows (parallel over blocks): each row's two sums in the warp's lane order
// (butterfly above) and its dx; the column sums g * x_hat and g per chunk of kLnChunkRows rows
// in row order, added per block in chunk order into the block's partials; the glue sums both
// partials with one at::sum, as the reference does (mesa_train.quant.reference.layer_norm_backward).
template <typename T>
MESA_ALWAYS_INLINE void ln_bwd_block_body(const float* __restrict__ xh, const T* __restrict__ g,
                                          const float* __restrict__ w, const float* __restrict__ rstd,
                                          float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb,
                                          int64_t r0, int64_t r1, int64_t D, float* __restrict__ scratch) {
  float* gw = scratch;          // D: g * weight of the current row
  float* cw = scratch + D;      // D: the chunk's column sums of g * x_hat
  float* cb = scratch + 2 * D;  // D: the chunk's column sums of g
  for (int64_t j = 0; j < D; ++j) pw[j] = pb[j] = 0.0f;
  const float n = static_cast<float>(D);
  for (int64_t c0 = r0; c0 < r1; c0 += kLnChunkRows) {
    for (int64_t j = 0; j < D; ++j) cw[j] = cb[j] = 0.0f;
    for (int64_t r = c0; r < std::min<int64_t>(c0 + kLnChunkRows, r1); ++r) {
      // simple loops, one store stream each, so that they vectorise (one loop storing gw, cw
      // and cb did not: float32 g could alias them); the same operations per element and
      // per accumulator, in the same order
      const float* __restrict__ x = xh + r * D;
      const T* __restrict__ gr = g + r * D;
      if (w != nullptr) {
        for (int64_t j = 0; j < D; ++j) gw[j] = f_mul(to_f(gr[j]), w[j]);
      } else {
        for (int64_t j = 0; j < D; ++j) gw[j] = to_f(gr[j]);
      }
      float a1[kLanes] = {}, a2[kLanes] = {};
      for_chunks(D, [&](int64_t j0, auto m) {
        for (int64_t l = 0; l < int64_t(m); ++l) a1[l] = f_add(a1[l], gw[j0 + l]);
      });
      for_chunks(D, [&](int64_t j0, auto m) {
        for (int64_t l = 0; l < int64_t(m); ++l) a2[l] = f_add(a2[l], f_mul(gw[j0 + l], x[j0 + l]));
      });
      for (int64_t j = 0; j < D; ++j) cw[j] = f_add(cw[j], f_mul(to_f(gr[j]), x[j]));
      for (int64_t j = 0; j < D; ++j) cb[j] = f_add(cb[j], to_f(gr[j]));
      const float m1 = f_div(butterfly(a1), n), m2 = f_div(butterfly(a2), n), rs = rstd[r];
      float* __restrict__ o = dx + r * D;
      for (int64_t j = 0; j < D; ++j) o[j] = f_mul(rs, f_sub(f_sub(gw[j], m1), f_mul(x[j], m2)));
    }
    for (int64_t j = 0; j < D; ++j) {
      pw[j] = f_add(pw[j], cw[j]);
      pb[j] = f_add(pb[j], cb[j]);
    }
  }
}
MESA_CLONES void ln_bwd_block_f32(const float* xh, const float* g, const float* w, const float* rstd, float* dx,
                                  float* pw, float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_body<float>(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}
MESA_CLONES void ln_bwd_block_f16(const float* xh, const uint16_t* g, const float* w, const float* rstd, float* dx,
                                  float* pw, float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_body<uint16_t>(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}
MESA_CLONES void ln_bwd_block_bf16(const float* xh, const Bf16Bits* g, const float* w, const float* rstd, float* dx,
                                   float* pw, float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_body<Bf16Bits>(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}
inline void ln_bwd_block(const float* xh, const float* g, const float* w, const float* rstd, float* dx, float* pw,
                         float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_f32(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}
inline void ln_bwd_block(const float* xh, const uint16_t* g, const float* w, const float* rstd, float* dx, float* pw,
                         float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_f16(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}
inline void ln_bwd_block(const float* xh, const Bf16Bits* g, const float* w, const float* rstd, float* dx, float* pw,
                         float* pb, int64_t r0, int64_t r1, int64_t D, float* scratch) {
  ln_bwd_block_bf16(xh, g, w, rstd, dx, pw, pb, r0, r1, D, scratch);
}

std::tuple<at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& g_in, const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta, int64_t num_groups,
    const at::Tensor& rstd_in, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& row_exp) {
  const Layout L = check_layer_norm_backward(g_in, q, alpha, beta, num_groups, rstd_in, weight, row_exp);
  const int64_t D = L.D, rows = D > 0 ? L.numel / D : 0, blocks = (rows + kLnBlockRows - 1) / kLnBlockRows;
  const auto fopts = q.options().dtype(at::kFloat);
  // x_hat exactly as dequantize returns it in float32 (the reference's first step)
  const at::Tensor xh = dequantize_cpu(q, alpha, beta, L.dim, num_groups, at::kFloat, row_exp, std::nullopt,
                                       std::nullopt, std::nullopt);
  const at::Tensor g = g_in.contiguous(), rstd = rstd_in.contiguous();
  const bool has_w = weight.has_value() && weight->defined();
  const at::Tensor w = has_w ? weight->contiguous() : at::Tensor();
  at::Tensor dx = at::empty(q.sizes(), fopts);
  // dweight's and dbias's partials in one (2, blocks, D) tensor: one sum for both (dparams)
  at::Tensor partials = at::empty({2, blocks, D}, fopts);
  at::Tensor pw = partials.select(0, 0), pb = partials.select(0, 1);
  MESA_DISPATCH_FLOAT_TYPES(g.scalar_type(), "mesa_layer_norm_backward_cpu", [&] {
    using T = storage_t<scalar_t>;
    const T* gp = as_storage(g.const_data_ptr<scalar_t>());
    const float* xp = xh.const_data_ptr<float>();
    const float* wp = has_w ? w.const_data_ptr<float>() : nullptr;
    const float* rp = rstd.const_data_ptr<float>();
    float* dp = dx.mutable_data_ptr<float>();
    float* pwp = pw.mutable_data_ptr<float>();
    float* pbp = pb.mutable_data_ptr<float>();
    at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, D * kLnBlockRows)),
                     [&](int64_t b0, int64_t b1) {
      std::vector<float> scratch(3 * D);
      for (int64_t b = b0; b < b1; ++b) {
        ln_bwd_block(xp, gp, wp, rp, dp, pwp + b * D, pbp + b * D, b * kLnBlockRows,
                     std::min<int64_t>((b + 1) * kLnBlockRows, rows), D, scratch.data());
      }
    });
  });
  return {dx, partials.sum(1)};
}

// mesa::gelu_backward on the CPU: its definition, dequantize then ATen's gelu_backward (the
// bits of the two-op path; ATen's vectorised erf is what makes it fast here, and CPU memory
// traffic is not what a CPU step waits on). The CUDA kernel is the one-pass version.
at::Tensor gelu_backward_cpu(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                             const at::Tensor& beta, int64_t dim, int64_t num_groups,
                             const std::optional<at::Tensor>& row_exp) {
  check_gelu_backward(g, q, alpha, beta, dim, num_groups);
  check_row_exp("gelu_backward", q.sizes(), q.device(), row_exp);
  at::Tensor xh = dequantize_cpu(q, alpha, beta, dim, num_groups, g.scalar_type(), row_exp, std::nullopt,
                                 std::nullopt, std::nullopt);
  // in place into xh (the input is not needed after its own element): one buffer, not two
  return at::gelu_backward_out(xh, g.contiguous(), xh);
}

// mesa::gelu_value_and_grad on the CPU: its definition, one dequantize, then ATen's gelu and
// gelu_backward of it (the bits of dequantize_gelu and gelu_backward; the second in place)
std::tuple<at::Tensor, at::Tensor> gelu_value_and_grad_cpu(const at::Tensor& g, const at::Tensor& q,
                                                           const at::Tensor& alpha, const at::Tensor& beta,
                                                           int64_t dim, int64_t num_groups,
                                                           const std::optional<at::Tensor>& row_exp) {
  check_gelu_backward(g, q, alpha, beta, dim, num_groups);
  check_row_exp("gelu_value_and_grad", q.sizes(), q.device(), row_exp);
  at::Tensor xh = dequantize_cpu(q, alpha, beta, dim, num_groups, g.scalar_type(), row_exp, std::nullopt,
                                 std::nullopt, std::nullopt);
  at::Tensor y = at::gelu(xh);
  return {y, at::gelu_backward_out(xh, g.contiguous(), xh)};
}

// mesa::dequantize_gelu on the CPU: its definition, dequantize then ATen's gelu, in place
at::Tensor dequantize_gelu_cpu(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                               int64_t num_groups, at::ScalarType dtype, const std::optional<at::Tensor>& row_exp) {
  at::Tensor xh = dequantize_cpu(q, alpha, beta, dim, num_groups, dtype, row_exp, std::nullopt, std::nullopt,
                                 std::nullopt);
  return at::gelu_out(xh, xh);  // in place: each element is read before it is written
}

TORCH_LIBRARY_IMPL(mesa, CPU, m) {
  m.impl("gelu_backward", &gelu_backward_cpu);
  m.impl("gelu_value_and_grad", &gelu_value_and_grad_cpu);
  m.impl("dequantize_gelu", &dequantize_gelu_cpu);
  m.impl("softmax_backward", &softmax_backward_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
  m.impl("row_exponents", &row_exponents_cpu);
  m.impl("group_minmax", &group_minmax_cpu);
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("update_estimates", &update_estimates_cpu);
  m.impl("observe", &observe_cpu);
  m.impl("observe_rows", &observe_rows_cpu);
  m.impl("quantize_observe", &quantize_observe_cpu);
  m.impl("estimate_and_seed", &estimate_and_seed_cpu);
  m.impl("delayed_observe", &delayed_observe_cpu);
  m.impl("seed_of", &seed_of_cpu);
  m.impl("quantize_bits", &quantize_bits_cpu);
  m.impl("dequantize_bits", &dequantize_bits_cpu);
}

}  // namespace mesa
