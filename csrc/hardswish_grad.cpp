// hardswish_grad.h. The ATen form is about ten passes over the activation (conversions, a
// division, an addition, a clamp, a multiplication, two unpacks of a mask to bytes and to
// booleans, two selections): a Mesa Hardswish's backward took 17 ms of its 19 ms forward and
// backward on a (16, 64, 32, 32) float32 activation where stock's both took 0.7 ms (2 threads,
// session 52). On the CPU one loop reads g, xh and each mask byte once and writes the gradient
// once, with the same roundings (no contraction: setup.py builds with -ffp-contract=off).
#include "hardswish_grad.h"

#include "bitmask.h"
#include "cpu_element_io.h"
#include "layers_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mesa {
namespace {

using namespace element_io;  // NOLINT: the storage types and their conversions

constexpr int64_t kGrain = 32768;  // elements per parallel task

// the ATen ops of activations._HardswishFn.backward: the slope in float for Half and BFloat16
// (the opmath of ATen's hardswish_backward), the selections in xh's layout (not masked_fill,
// whose out-of-place result is NCHW)
at::Tensor aten_grad(const at::Tensor& g, const at::Tensor& xh, const at::Tensor& below, const at::Tensor& above,
                     at::IntArrayRef shape, bool channels_last) {
  const at::Tensor xf = xh.to(at::promote_types(xh.scalar_type(), at::kFloat));
  const at::Tensor inside = g.to(xf.scalar_type()).mul(xf.div(3).add(0.5).clamp(-0.5, 1.5)).to(g.scalar_type());
  const at::Tensor is_below = unpack_bits(below, shape, channels_last);
  const at::Tensor is_above = unpack_bits(above, shape, channels_last);
  return at::where(is_below, 0, at::where(is_above, g, inside));
}

// Each element's gradient, as the ATen ops compute it (in float; the result rounded once to the
// storage type T), in runs of at most kRun elements that start at a whole mask byte. First each
// element's side (1 at or below -3, 2 at or above 3, else 0) goes from the bits into a byte
// buffer, then the arithmetic is a plain loop over contiguous elements, which the compiler
// vectorises (a byte's bits read per element kept it scalar: 4.3 ms for a (16, 64, 32, 32)
// float32 activation, 7.7 ms bfloat16). The same bits as the ATen ops wherever the result is a
// number; a NaN's payload is not reproduced (ATen's vectorized clamp and conversions write NaN
// bits that depend on the CPU's vector instructions: all ones for bfloat16 on AVX2).
constexpr int64_t kRun = 256;

// The storage type's bits as a plain arithmetic type, for the final selection: a select of
// Bf16Bits structs kept the bfloat16 loop scalar (3.5 ms where float32 took 0.8)
template <typename T> struct RawOf { using type = T; };
template <> struct RawOf<Bf16Bits> { using type = uint16_t; };

template <typename T>
MESA_ALWAYS_INLINE void grad_run_impl(const T* __restrict__ g, const T* __restrict__ xh,
                                      const uint8_t* __restrict__ below, const uint8_t* __restrict__ above,
                                      T* __restrict__ out, int64_t n) {
  using Raw = typename RawOf<T>::type;
  static_assert(sizeof(Raw) == sizeof(T), "raw bits of the storage type");
  uint8_t side[kRun];
  for (int64_t i = 0; i < n; ++i) {
    const int shift = static_cast<int>(i & 7);
    side[i] = static_cast<uint8_t>(((below[i >> 3] >> shift) & 1) | (((above[i >> 3] >> shift) & 1) << 1));
  }
  const auto* g_raw = reinterpret_cast<const Raw*>(g);
  auto* out_raw = reinterpret_cast<Raw*>(out);
  for (int64_t i = 0; i < n; ++i) {
    const float lifted = f_add(f_div(to_f(xh[i]), 3.0f), 0.5f);
    const float slope = lifted != lifted ? lifted : std::min(std::max(lifted, -0.5f), 1.5f);
    T inside;
    from_f(f_mul(to_f(g[i]), slope), inside);
    Raw inside_raw;
    std::memcpy(&inside_raw, &inside, sizeof(Raw));
    // +0 at or below -3 (all bits clear in each storage type), g itself at or above 3
    out_raw[i] = side[i] == 1 ? Raw(0) : side[i] == 2 ? g_raw[i] : inside_raw;
  }
}

#define MESA_HARDSWISH_GRAD_RUN(NAME, T)                                                                        \
  MESA_CLONES void NAME(const T* __restrict__ g, const T* __restrict__ xh, const uint8_t* __restrict__ below, \
                        const uint8_t* __restrict__ above, T* __restrict__ out, int64_t n) {                   \
    grad_run_impl(g, xh, below, above, out, n);                                                                \
  }
MESA_HARDSWISH_GRAD_RUN(grad_run_f32, float)
MESA_HARDSWISH_GRAD_RUN(grad_run_f16, uint16_t)
MESA_HARDSWISH_GRAD_RUN(grad_run_bf16, Bf16Bits)
#undef MESA_HARDSWISH_GRAD_RUN

template <typename T>
void grad_loop(const at::Tensor& g, const at::Tensor& xh, const at::Tensor& below, const at::Tensor& above,
               at::Tensor& out, void (*run)(const T*, const T*, const uint8_t*, const uint8_t*, T*, int64_t)) {
  const int64_t n = g.numel();
  const auto* gp = static_cast<const T*>(g.const_data_ptr());
  const auto* xp = static_cast<const T*>(xh.const_data_ptr());
  const uint8_t* lo = below.const_data_ptr<uint8_t>();
  const uint8_t* hi = above.const_data_ptr<uint8_t>();
  auto* op = static_cast<T*>(out.mutable_data_ptr());
  at::parallel_for(0, (n + kRun - 1) / kRun, kGrain / kRun, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i0 = r * kRun;
      run(gp + i0, xp + i0, lo + i0 / 8, hi + i0 / 8, op + i0, std::min(kRun, n - i0));
    }
  });
}

}  // namespace

at::Tensor hardswish_masked_grad(const at::Tensor& g, const at::Tensor& xh, const at::Tensor& below,
                                 const at::Tensor& above, at::IntArrayRef shape, bool channels_last) {
  const auto dt = g.scalar_type();
  const bool loop = layers::is_cpu_floating(g) && dt != at::kDouble && dt == xh.scalar_type() &&
                    below.device().is_cpu() && above.device().is_cpu() && g.sizes() == shape &&
                    xh.sizes() == shape && in_mask_order(g, channels_last) && in_mask_order(xh, channels_last);
  if (!loop) return aten_grad(g, xh, below, above, shape, channels_last);
  at::Tensor out = at::empty_like(xh);  // (xh's strides: the masks' memory order)
  if (dt == at::kFloat) {
    grad_loop<float>(g, xh, below, above, out, grad_run_f32);
  } else if (dt == at::kHalf) {
    grad_loop<uint16_t>(g, xh, below, above, out, grad_run_f16);
  } else {
    grad_loop<Bf16Bits>(g, xh, below, above, out, grad_run_bf16);
  }
  return out;
}

}  // namespace mesa
