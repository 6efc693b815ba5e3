// code_moments.h. Why: the Mesa BatchNorm's backward re-standardises the dequantized x_hat with
// its own per-channel moments (batchnorm.bn_backward). ATen's batch_norm_update_stats on the
// float32 x_hat was the largest cost Mesa added to a ResNet-50 NCHW step on the CPU (13.4 ms of
// about 50, 64x64, batch 16): its NCHW loop is slow on short planes. The codes hold the same
// information in a quarter of the bytes, and integer sums are exact in any order: the result
// does not depend on the thread count, and a constant channel gets variance 0 exactly (its
// re-standardisation factor is then 1, as with the float statistics).
//
// Two stages: the int64 sums of q and q^2 per index d (a loop on the CPU for contiguous codes;
// ATen reductions elsewhere, the same integers), then one float64 formula on the (D,) sums,
// the same ATen ops on every device:
//   m = S1 / n, v = S2 / n - m^2 (codes; exact to float64 rounding, 0 for a constant index),
//   mean = step * m + beta, var = step^2 * v, step = alpha / 255 (float32, as dequantize).
#include "code_moments.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "mesa_common.h"

namespace mesa {
namespace {

constexpr int64_t kGrain = 65536;  // codes per parallel task
constexpr int64_t kSpan = 65536;   // codes a uint32 pair of sums takes without overflow (65536 * 255^2 < 2^32)
constexpr int64_t kLongRun = 64;   // planes this long are summed run by run; shorter ones as columns of rows

// a += sum of p[0..n), b += sum of p[k]^2 (uint32 within spans of kSpan: vectorised)
inline void run_sums(const uint8_t* __restrict__ p, int64_t n, int64_t& a, int64_t& b) {
  for (int64_t k0 = 0; k0 < n; k0 += kSpan) {
    const int64_t k1 = std::min(n, k0 + kSpan);
    uint32_t sa = 0, sb = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const uint32_t v = p[k];
      sa += v;
      sb += v * v;
    }
    a += sa;
    b += sb;
  }
}

// rows of W codes: s1[w] += sum over rows [r0, r1) of q[r, w], s2 likewise of q^2 (uint32:
// at most kSpan rows; widened and vectorised by the compiler)
inline void row_sums(const uint8_t* __restrict__ q, int64_t r0, int64_t r1, int64_t W, uint32_t* __restrict__ s1,
                     uint32_t* __restrict__ s2) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * W;
    for (int64_t w = 0; w < W; ++w) {
      const uint32_t v = row[w];
      s1[w] += v;
      s2[w] += v * v;
    }
  }
}

// the int64 (2, D) sums of the contiguous codes viewed (outer, D, inner)
at::Tensor code_sums_cpu(const at::Tensor& q, int64_t outer, int64_t D, int64_t inner) {
  at::Tensor sums = at::zeros({2, D}, q.options().dtype(at::kLong));
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  int64_t* s1 = sums.mutable_data_ptr<int64_t>();
  int64_t* s2 = s1 + D;
  if (inner >= kLongRun) {  // (n, c) planes: each task owns whole indices d, no partial sums
    at::parallel_for(0, D, std::max<int64_t>(1, kGrain / std::max<int64_t>(outer * inner, 1)),
                     [&](int64_t d0, int64_t d1) {
                       for (int64_t d = d0; d < d1; ++d) {
                         int64_t a = 0, b = 0;
                         for (int64_t o = 0; o < outer; ++o) run_sums(qp + (o * D + d) * inner, inner, a, b);
                         s1[d] = a;
                         s2[d] = b;
                       }
                     });
    return sums;
  }
  // Short planes or none (channels-last, (N, C), 2x2 maps): rows of W = D * inner codes, each
  // task summing a block of rows per column; the blocks' sums are then added, and each d's
  // `inner` columns (integers: the same whatever the split)
  const int64_t W = D * inner;
  const int64_t rows_per_task = std::clamp<int64_t>(kGrain / W, 1, kSpan);
  const int64_t tasks = (outer + rows_per_task - 1) / rows_per_task;
  std::vector<uint32_t> partial(static_cast<size_t>(tasks * 2 * W), 0);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint32_t* p1 = partial.data() + t * 2 * W;
      row_sums(qp, t * rows_per_task, std::min(outer, (t + 1) * rows_per_task), W, p1, p1 + W);
    }
  });
  for (int64_t t = 0; t < tasks; ++t) {
    const uint32_t* p1 = partial.data() + t * 2 * W;
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t k = d * inner; k < (d + 1) * inner; ++k) {
        s1[d] += p1[k];
        s2[d] += p1[W + k];
      }
    }
  }
  return sums;
}

// the same sums with ATen reductions (any device, any layout)
at::Tensor code_sums_aten(const at::Tensor& q, int64_t outer, int64_t D, int64_t inner) {
  const at::Tensor v = q.reshape({outer, D, inner}).to(at::kLong);
  const std::array<int64_t, 2> dims{0, 2};  // (a braced list: ambiguous for sum in torch 2.11)
  return at::stack({v.sum(dims), v.mul(v).sum(dims)});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> code_moments(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                                                int64_t dim, int64_t num_groups) {
  const Layout L = check_dequantize(q, alpha, beta, dim, num_groups, at::kFloat);
  TORCH_CHECK_VALUE(L.S == 1, "mesa: code_moments: alpha and beta must be shared by all samples, shape (1, ",
                    num_groups, "), got ", alpha.sizes(), " (a per-sample estimator: use the dequantized values)");
  TORCH_CHECK_VALUE(L.numel > 0, "mesa: code_moments: the codes are empty (no moments)");
  const double n = static_cast<double>(L.numel / L.D);
  if (!q.device().is_cpu()) {  // ATen reductions and the formula as tensor ops
    const at::Tensor sums = code_sums_aten(q, L.outer, L.D, L.inner);
    const at::Tensor m = sums[0].to(at::kDouble).div(n);
    const at::Tensor v = sums[1].to(at::kDouble).div(n).sub(m.square()).clamp_min(0);
    // each index's group (group_of), its float32 step and offset
    const at::Tensor group = at::arange(L.D, q.options().dtype(at::kLong)).mul(L.G).div(L.D, "floor");
    const at::Tensor step = alpha.select(0, 0).div(255.0f).index_select(0, group).to(at::kDouble);
    const at::Tensor offset = beta.select(0, 0).index_select(0, group).to(at::kDouble);
    return {step.mul(m).add(offset).to(at::kFloat), step.square().mul(v).to(at::kFloat)};
  }
  // the same formula, op for op, as a loop (a dozen tiny ATen ops cost 100 us, more than the sums)
  const at::Tensor sums = q.is_contiguous() ? code_sums_cpu(q, L.outer, L.D, L.inner)
                                            : code_sums_aten(q, L.outer, L.D, L.inner);
  const at::Tensor a = alpha.contiguous(), b = beta.contiguous();
  at::Tensor mean = at::empty({L.D}, alpha.options()), var = at::empty({L.D}, alpha.options());
  const int64_t* s1 = sums.const_data_ptr<int64_t>();
  const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>();
  float *mp = mean.mutable_data_ptr<float>(), *vp = var.mutable_data_ptr<float>();
  for (int64_t d = 0; d < L.D; ++d) {
    const int64_t g = group_of(d, L.G, L.D);
    const double step = static_cast<double>(ap[g] / 255.0f), offset = static_cast<double>(bp[g]);
    const double m = static_cast<double>(s1[d]) / n;
    const double v = std::max(static_cast<double>(s1[L.D + d]) / n - m * m, 0.0);
    mp[d] = static_cast<float>(step * m + offset);
    vp[d] = static_cast<float>(step * step * v);
  }
  return {mean, var};
}

}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // (code_moments.h) the moments the Mesa BatchNorm's backward re-standardises x_hat with
  m.def("code_moments(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups) -> (Tensor mean, Tensor var)");
}

TORCH_LIBRARY_IMPL(mesa, CPU, m) { m.impl("code_moments", &mesa::code_moments); }
TORCH_LIBRARY_IMPL(mesa, CUDA, m) { m.impl("code_moments", &mesa::code_moments); }
