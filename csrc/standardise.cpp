// standardise.h. The ATen form is a subtraction then a multiplication, each a pass over the
// activation and a temporary of its size: 11.6 ms of a ResNet-50 step (64x64, batch 16, 2
// threads), 53 BatchNorms (results/cpu-timm, session 50). On the CPU one loop reads x once
// and writes x_hat once, with the same two roundings per element (no contraction: setup.py
// builds with -ffp-contract=off).
#include "standardise.h"

#include "layers_common.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace mesa {
namespace {

constexpr int64_t kGrain = 32768;  // elements per parallel task

// out[k] = (x[k] - m) * s for a plane (n, c) of a contiguous x
template <typename scalar_t, typename acc_t>
void plane_run(const scalar_t* __restrict__ x, acc_t* __restrict__ out, int64_t n, acc_t m, acc_t s) {
  for (int64_t k = 0; k < n; ++k) out[k] = (static_cast<acc_t>(x[k]) - m) * s;
}

// out[c] = (x[c] - m[c]) * s[c] for one position's channels of a channels-last x
template <typename scalar_t, typename acc_t>
void position_run(const scalar_t* __restrict__ x, acc_t* __restrict__ out, int64_t channels,
                  const acc_t* __restrict__ m, const acc_t* __restrict__ s) {
  for (int64_t c = 0; c < channels; ++c) out[c] = (static_cast<acc_t>(x[c]) - m[c]) * s[c];
}

// the (N, C) table of a statistic shaped to broadcast over x per (sample, channel)
at::Tensor per_sample_channel_table(const at::Tensor& stat, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  shape[1] = x.size(1);
  return stat.expand(shape).reshape({x.size(0), x.size(1)}).contiguous();
}

bool loop_applies(const at::Tensor& x, const at::Tensor& stat, bool channels_last) {
  const bool accumulator_stats = stat.scalar_type() == at::promote_types(x.scalar_type(), at::kFloat);
  return layers::is_cpu_floating(x) && x.dim() >= 2 && accumulator_stats && (channels_last || x.is_contiguous());
}

}  // namespace

at::Tensor standardise(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd) {
  const bool channels_last = layers::is_channels_last(x);
  if (!loop_applies(x, mean, channels_last)) return (x.to(mean.scalar_type()) - mean) * invstd;
  const at::Tensor m_table = per_sample_channel_table(mean, x), s_table = per_sample_channel_table(invstd, x);
  at::Tensor out = at::empty_like(x, x.options().dtype(mean.scalar_type()));  // (x's strides)
  const int64_t samples = x.size(0), channels = x.size(1), inner = x.numel() / (samples * channels);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mesa_standardise", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;  // (loop_applies: mdt)
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const acc_t* mp = m_table.const_data_ptr<acc_t>();
    const acc_t* sp = s_table.const_data_ptr<acc_t>();
    acc_t* op = out.mutable_data_ptr<acc_t>();
    if (!channels_last) {  // planes (n, c) of `inner` elements
      at::parallel_for(0, samples * channels, std::max<int64_t>(1, kGrain / std::max<int64_t>(inner, 1)),
                       [&](int64_t p0, int64_t p1) {
                         for (int64_t p = p0; p < p1; ++p) {
                           plane_run(xp + p * inner, op + p * inner, inner, mp[p], sp[p]);
                         }
                       });
    } else {  // positions (n, h, w) of `channels` elements
      at::parallel_for(0, samples * inner, std::max<int64_t>(1, kGrain / channels), [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t row = (q / inner) * channels;  // (sample n's statistics)
          position_run(xp + q * channels, op + q * channels, channels, mp + row, sp + row);
        }
      });
    }
  });
  return out;
}

}  // namespace mesa
