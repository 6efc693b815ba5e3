// CPU kernels of torch.ops.mesa.{group_minmax, quantize, dequantize}.
//
// * Inputs are made contiguous first (a transient copy for non-contiguous inputs).
// * Parallel over the cores with at::parallel_for (OpenMP backend); every element is
//   touched once per op (one pass).
// * Per-group parameters are expanded once per call into small per-(sample, d) tables
//   (inv = 255/alpha or step = alpha/255, and beta), so the hot loops are a table lookup
//   plus the scalar math of mesa_common.h. The index math follows DESIGN.md: the tensor is
//   viewed as (outer, D, inner) and walked in runs that share the same d (inner > 1) or
//   that walk d with stride 1 (inner == 1, channels last); nothing is permuted.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "mesa_common.h"

namespace mesa {
namespace {

constexpr int64_t kGrain = 32768;
constexpr float kInf = std::numeric_limits<float>::infinity();

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

// Walks [begin, end) in runs of constant (s, d) (inner > 1) or of consecutive d
// (inner == 1). body(i, n, s, d) handles elements i .. i+n-1.
template <typename Body>
inline void walk(const Layout& L, int64_t begin, int64_t end, Body body) {
  const int64_t inner = L.inner, D = L.D;
  const int64_t per_s = L.outer_per_s * D * inner;
  int64_t i = begin;
  while (i < end) {
    const int64_t row = i / inner;
    const int64_t d = row % D;
    const int64_t s = L.s_eff > 1 ? i / per_s : 0;
    const int64_t n = inner == 1 ? std::min(D - d, end - i) : std::min(inner - (i - row * inner), end - i);
    body(i, n, s, d);
    i += n;
  }
}

// ----------------------------------------------------------------------------- quantize
template <typename scalar_t, bool STOCH>
void quantize_kernel(const scalar_t* __restrict__ x, uint8_t* __restrict__ q, const Layout& L,
                     const float* tinv, const float* tbeta, uint32_t slo, uint32_t shi) {
  at::parallel_for(0, L.numel, kGrain, [&](int64_t begin, int64_t end) {
    walk(L, begin, end, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      const scalar_t* xp = x + i;
      uint8_t* qp = q + i;
      if (L.inner == 1) {
        const float* iv = tinv + s * L.D + d;
        const float* bv = tbeta + s * L.D + d;
        for (int64_t k = 0; k < n; ++k) {
          const float u = STOCH ? hash_uniform(static_cast<uint64_t>(i + k), slo, shi) : 0.0f;
          qp[k] = quantize_value<STOCH>(static_cast<float>(xp[k]), bv[k], iv[k], u);
        }
      } else {
        const float iv = tinv[s * L.D + d], bv = tbeta[s * L.D + d];
        for (int64_t k = 0; k < n; ++k) {
          const float u = STOCH ? hash_uniform(static_cast<uint64_t>(i + k), slo, shi) : 0.0f;
          qp[k] = quantize_value<STOCH>(static_cast<float>(xp[k]), bv, iv, u);
        }
      }
    });
  });
}

at::Tensor quantize_cpu(const at::Tensor& x_in, const at::Tensor& alpha, const at::Tensor& beta,
                        int64_t dim, int64_t num_groups, bool stochastic, int64_t seed) {
  const Layout L = check_quantize(x_in, alpha, beta, dim, num_groups);
  const at::Tensor x = x_in.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (L.numel == 0) return q;
  std::vector<float> tinv, tbeta;
  build_tables(L, alpha, beta, [](float a) { return inv_scale(a); }, tinv, tbeta);
  const uint64_t useed = static_cast<uint64_t>(seed);
  const uint32_t slo = static_cast<uint32_t>(useed), shi = static_cast<uint32_t>(useed >> 32);
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_quantize_cpu", [&] {
    if (stochastic)
      quantize_kernel<scalar_t, true>(x.const_data_ptr<scalar_t>(), q.mutable_data_ptr<uint8_t>(), L,
                                      tinv.data(), tbeta.data(), slo, shi);
    else
      quantize_kernel<scalar_t, false>(x.const_data_ptr<scalar_t>(), q.mutable_data_ptr<uint8_t>(), L,
                                       tinv.data(), tbeta.data(), slo, shi);
  });
  return q;
}

// ----------------------------------------------------------------------------- dequantize
template <typename scalar_t>
void dequantize_kernel(const uint8_t* __restrict__ q, scalar_t* __restrict__ y, const Layout& L,
                       const float* tstep, const float* tbeta) {
  at::parallel_for(0, L.numel, kGrain, [&](int64_t begin, int64_t end) {
    walk(L, begin, end, [&](int64_t i, int64_t n, int64_t s, int64_t d) {
      const uint8_t* qp = q + i;
      scalar_t* yp = y + i;
      if (L.inner == 1) {
        const float* sv = tstep + s * L.D + d;
        const float* bv = tbeta + s * L.D + d;
        for (int64_t k = 0; k < n; ++k) yp[k] = static_cast<scalar_t>(dequantize_value(qp[k], sv[k], bv[k]));
      } else {
        const float sv = tstep[s * L.D + d], bv = tbeta[s * L.D + d];
        for (int64_t k = 0; k < n; ++k) yp[k] = static_cast<scalar_t>(dequantize_value(qp[k], sv, bv));
      }
    });
  });
}

at::Tensor dequantize_cpu(const at::Tensor& q_in, const at::Tensor& alpha, const at::Tensor& beta,
                          int64_t dim, int64_t num_groups, at::ScalarType dtype) {
  const Layout L = check_dequantize(q_in, alpha, beta, dim, num_groups, dtype);
  const at::Tensor q = q_in.contiguous();
  at::Tensor y = at::empty(q.sizes(), q.options().dtype(dtype));
  if (L.numel == 0) return y;
  std::vector<float> tstep, tbeta;
  build_tables(L, alpha, beta, [](float a) { return dequant_step(a); }, tstep, tbeta);
  MESA_DISPATCH_FLOAT_TYPES(dtype, "mesa_dequantize_cpu", [&] {
    dequantize_kernel<scalar_t>(q.const_data_ptr<uint8_t>(), y.mutable_data_ptr<scalar_t>(), L,
                                tstep.data(), tbeta.data());
  });
  return y;
}

// ----------------------------------------------------------------------------- minmax
// Accumulates per-d min/max of [begin, end) into mn[0..D), mx[0..D) (all of one sample).
template <typename scalar_t>
void minmax_range(const scalar_t* __restrict__ x, const Layout& L, int64_t begin, int64_t end,
                  float* __restrict__ mn, float* __restrict__ mx) {
  walk(L, begin, end, [&](int64_t i, int64_t n, int64_t /*s*/, int64_t d) {
    const scalar_t* xp = x + i;
    if (L.inner == 1) {
      for (int64_t k = 0; k < n; ++k) {
        const float v = static_cast<float>(xp[k]);
        mn[d + k] = nan_min(mn[d + k], v);
        mx[d + k] = nan_max(mx[d + k], v);
      }
    } else {
      // kLanes independent accumulators (vectorisable, no dependency chain); min/max are
      // order-independent and NaN propagates through every lane
      constexpr int kLanes = 8;
      float a[kLanes], b[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        a[l] = kInf;
        b[l] = -kInf;
      }
      int64_t k = 0;
      for (; k + kLanes <= n; k += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(xp[k + l]);
          a[l] = nan_min(a[l], v);
          b[l] = nan_max(b[l], v);
        }
      }
      float amin = mn[d], bmax = mx[d];
      for (; k < n; ++k) {
        const float v = static_cast<float>(xp[k]);
        amin = nan_min(amin, v);
        bmax = nan_max(bmax, v);
      }
      for (int l = 0; l < kLanes; ++l) {
        amin = nan_min(amin, a[l]);
        bmax = nan_max(bmax, b[l]);
      }
      mn[d] = amin;
      mx[d] = bmax;
    }
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

std::tuple<at::Tensor, at::Tensor> group_minmax_cpu(const at::Tensor& x_in, int64_t dim, int64_t num_groups,
                                                    bool per_sample) {
  const Layout L = check_minmax(x_in, dim, num_groups, per_sample);
  const at::Tensor x = x_in.contiguous();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor omn = at::full({L.S, L.G}, kInf, fopts);
  at::Tensor omx = at::full({L.S, L.G}, -kInf, fopts);
  if (L.numel == 0) return {omn, omx};
  float* pmn = omn.mutable_data_ptr<float>();
  float* pmx = omx.mutable_data_ptr<float>();
  const int64_t D = L.D;

  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_group_minmax_cpu", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    if (L.s_eff > 1) {
      // per sample (dim > 0): samples are contiguous blocks; one task per sample, no partials
      const int64_t per_s = L.numel / L.s_eff;
      at::parallel_for(0, L.s_eff, std::max<int64_t>(1, kGrain / std::max<int64_t>(per_s, 1)),
                       [&](int64_t s0, int64_t s1) {
        std::vector<float> dmn(D), dmx(D);
        for (int64_t s = s0; s < s1; ++s) {
          std::fill(dmn.begin(), dmn.end(), kInf);
          std::fill(dmx.begin(), dmx.end(), -kInf);
          minmax_range<scalar_t>(xp, L, s * per_s, (s + 1) * per_s, dmn.data(), dmx.data());
          reduce_groups(L, dmn.data(), dmx.data(), pmn + s * L.G, pmx + s * L.G);
        }
      });
    } else {
      // shared statistics (or per sample over dim 0): per-chunk partials, then a reduction
      const int64_t nthreads = at::get_num_threads();
      const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>((L.numel + kGrain - 1) / kGrain, 4 * nthreads));
      std::vector<float> part_mn(nchunks * D, kInf), part_mx(nchunks * D, -kInf);
      at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = L.numel * c / nchunks, e = L.numel * (c + 1) / nchunks;
          minmax_range<scalar_t>(xp, L, b, e, part_mn.data() + c * D, part_mx.data() + c * D);
        }
      });
      for (int64_t c = 1; c < nchunks; ++c) {
        for (int64_t d = 0; d < D; ++d) {
          part_mn[d] = nan_min(part_mn[d], part_mn[c * D + d]);
          part_mx[d] = nan_max(part_mx[d], part_mx[c * D + d]);
        }
      }
      reduce_groups(L, part_mn.data(), part_mx.data(), pmn, pmx);
    }
  });
  return {omn, omx};
}

}  // namespace

TORCH_LIBRARY_IMPL(mesa, CPU, m) {
  m.impl("group_minmax", &group_minmax_cpu);
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace mesa
