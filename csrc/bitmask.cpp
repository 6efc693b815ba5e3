// bitmask.h. Two implementations with the same bytes and values:
// * ATen ops (any device, any layout): the comparison as a boolean tensor, shifted and summed
//   8 at a time; unpacked with a bitwise and, fed to threshold_backward;
// * the CPU, for a tensor whose memory order is the mask's (contiguous, or channels-last for a
//   channels-last mask): one pass each way, from the values to the bits and from the bits and g
//   to the gradient.
// Why the CPU loops: the ATen form wrote a byte per element three times over (comparison,
// shift, sum) and once more backward (bitwise and); a Mesa ReLU (fwd + bwd) took 2.3-3.1x
// stock's time on ResNet's activations (results/overhead/README.md, session 51).
#include "bitmask.h"

#include "cpu_element_io.h"
#include "layers_common.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace mesa {
namespace {

constexpr int64_t kGrainBytes = 4096;  // mask bytes (8 elements each) per parallel task

using layers::is_channels_last;
using layers::is_cpu_floating;
using namespace element_io;  // NOLINT: the storage types and their conversions

constexpr int64_t kRun = 256;  // elements per run of the pack loop: a predicate byte each, on the stack

// 8 predicate bytes (0 or 1, element k's at byte k) as the mask byte sum over k of b_k << k: as a
// little-endian uint64 times 0x0102040810204080, whose top byte that is (the partial products
// b_k 2^(8k + 7j + 7) are distinct powers of two: nothing carries)
MESA_ALWAYS_INLINE uint8_t gather_bits(const uint8_t* flags) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;
  std::memcpy(&v, flags, 8);
  return static_cast<uint8_t>((v * 0x0102040810204080ull) >> 56);
#else
  uint8_t byte = 0;
  for (int k = 0; k < 8; ++k) byte |= static_cast<uint8_t>(flags[k] << k);
  return byte;
#endif
}

// One mask of x, or two (bytes_b not null): bytes[b] = sum over k < 8 of pred(x[8 b + k]) << k,
// the last byte's missing elements 0. A run's predicates go to a byte buffer first (a plain loop
// the compiler vectorises), then 8 at a time into their byte: shifting each predicate into its
// byte as it was computed took 0.34 ms for 1 M floats, ATen's x > 0 alone 0.38 (2 threads).
// Two masks share the run: x is read once.
template <typename T, typename PredA, typename PredB>
void pack_loop(const T* __restrict__ x, int64_t n, uint8_t* __restrict__ bytes_a, PredA pred_a,
               uint8_t* __restrict__ bytes_b, PredB pred_b) {
  at::parallel_for(0, (n + kRun - 1) / kRun, kGrainBytes * 8 / kRun, [&](int64_t r0, int64_t r1) {
    alignas(8) uint8_t flags[kRun];
    const auto gather = [&flags](int64_t len, uint8_t* bytes) {
      const int64_t padded = (len + 7) / 8 * 8;
      for (int64_t i = len; i < padded; ++i) flags[i] = 0;
      for (int64_t b = 0; b < padded / 8; ++b) bytes[b] = gather_bits(flags + 8 * b);
    };
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i0 = r * kRun, len = std::min(kRun, n - i0);
      const T* xr = x + i0;
      for (int64_t i = 0; i < len; ++i) flags[i] = pred_a(xr[i]);
      gather(len, bytes_a + i0 / 8);
      if (bytes_b == nullptr) continue;
      for (int64_t i = 0; i < len; ++i) flags[i] = pred_b(xr[i]);
      gather(len, bytes_b + i0 / 8);
    }
  });
}

// fn(pointer to t's elements as their storage type: float, uint16_t (half), Bf16Bits, double)
template <typename Fn>
void with_storage(const at::Tensor& t, Fn fn) {
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kFloat:
      return fn(static_cast<const float*>(p));
    case at::kHalf:
      return fn(static_cast<const uint16_t*>(p));
    case at::kBFloat16:
      return fn(static_cast<const Bf16Bits*>(p));
    default:  // (double: is_cpu_floating)
      return fn(static_cast<const double*>(p));
  }
}

// A value as ATen's backward kernels compare it: float for float, half and bfloat16 (exactly:
// cpu_element_io.h's branch-free conversions, so the predicate loop vectorises), double for double
MESA_ALWAYS_INLINE double compared(double v) { return v; }
template <typename T>
MESA_ALWAYS_INLINE float compared(T v) {
  return to_f(v);
}

// The CPU packs' shared start: the bytes of one mask of t, and body(x, l, h) with t's elements as
// their storage type and the bounds rounded to the type they are compared in (float for float,
// half and bfloat16, as ATen's backward kernels take them)
at::Tensor mask_bytes(const at::Tensor& t) { return at::empty({(t.numel() + 7) / 8}, t.options().dtype(at::kByte)); }
template <typename Body>
void with_compared_bounds(const at::Tensor& t, double lo, double hi, Body body) {
  with_storage(t, [&](const auto* x) {
    using acc_t = decltype(compared(*x));
    body(x, static_cast<acc_t>(lo), static_cast<acc_t>(hi));
  });
}

// out[i] = g[i] where bit i is set, else +0 (as threshold_backward writes), for the elements of
// bytes [b0, b1), on the values' bits (word_t: an unsigned integer of their size): g AND all
// ones or all zeros. Branch-free, each byte loaded once and its 8 elements in a fixed-length
// loop: with a branch per element (a random mask) it took 2.1 ms for 1 M floats, stock's
// threshold_backward 0.6 ms (2 threads).
template <typename word_t>
void select_loop(const word_t* __restrict__ g, const uint8_t* __restrict__ bits, word_t* __restrict__ out,
                 int64_t b0, int64_t b1, int64_t n) {
  const auto keep = [](uint8_t m, int k) { return static_cast<word_t>(0) - static_cast<word_t>((m >> k) & 1); };
  const int64_t full_end = std::min(b1, n / 8);
  for (int64_t b = b0; b < full_end; ++b) {
    const uint8_t m = bits[b];
    const word_t* gb = g + b * 8;
    word_t* ob = out + b * 8;
    for (int k = 0; k < 8; ++k) ob[k] = gb[k] & keep(m, k);
  }
  for (int64_t i = std::max(b0, full_end) * 8; i < std::min(b1 * 8, n); ++i) {  // (the last, partial byte)
    out[i] = g[i] & keep(bits[i >> 3], static_cast<int>(i & 7));
  }
}

template <typename word_t>
void select(const at::Tensor& g, const at::Tensor& packed, at::Tensor& out) {
  const int64_t n = g.numel();
  const auto* gp = static_cast<const word_t*>(g.const_data_ptr());
  const uint8_t* bits = packed.const_data_ptr<uint8_t>();
  auto* op = static_cast<word_t*>(out.mutable_data_ptr());
  at::parallel_for(0, (n + 7) / 8, kGrainBytes,
                   [&](int64_t b0, int64_t b1) { select_loop(gp, bits, op, b0, b1, n); });
}

// Whether v, as ATen's backward kernels take a bound (float for a half or bfloat16 t), is a value
// of t's dtype: then ATen's gt / lt with the number (which round it to t's dtype) compare as
// those kernels do; else a bound between two of the dtype's values is compared in float
bool exact_in_dtype(at::ScalarType dt, double v) {
  const float f = static_cast<float>(v);
  if (dt == at::kHalf) return static_cast<float>(static_cast<c10::Half>(f)) == f;
  if (dt == at::kBFloat16) return static_cast<float>(static_cast<c10::BFloat16>(f)) == f;
  return true;  // (float: the number rounded to float, as the kernels take it; double: exact)
}

at::Tensor compare_aten(const at::Tensor& input, Compare cmp, double lo, double hi) {
  // ATen's hardtanh_backward compares a half x in float against float(lo): x = half(-0.1) is
  // above -0.1 there, but not above half(-0.1) (only for bounds the dtype lacks: Hardtanh(-0.1, 0.7))
  const bool exact = exact_in_dtype(input.scalar_type(), lo) && exact_in_dtype(input.scalar_type(), hi);
  const at::Tensor t = exact ? input : input.to(at::kFloat);
  switch (cmp) {
    case Compare::kAtMost:
      return t.le(hi);
    case Compare::kAtLeast:
      return t.ge(lo);
    case Compare::kGreaterOrNaN:
      return t.le(lo).logical_not();
    default:
      return at::bitwise_and(t.gt(lo), t.lt(hi));
  }
}

}  // namespace

std::pair<at::Tensor, bool> pack_bits(const at::Tensor& mask) {
  const bool channels_last = is_channels_last(mask);
  const at::Tensor m = channels_last ? mask.permute({0, 2, 3, 1}) : mask;
  // the boolean's own 0/1 bytes, in contiguous order (a copy only for a strided mask)
  at::Tensor flat = (m.is_contiguous() ? m : m.contiguous()).view(at::kByte).view(-1);
  const int64_t pad = (8 - flat.numel() % 8) % 8;
  if (pad) flat = at::cat({flat, at::zeros({pad}, flat.options())});
  const at::Tensor shifts = at::arange(8, flat.options());
  return {at::bitwise_left_shift(flat.view({-1, 8}), shifts).sum({-1}, false, at::kByte), channels_last};
}

std::pair<at::Tensor, bool> pack_compare(const at::Tensor& t, Compare cmp, double lo, double hi) {
  // (the comparison's boolean tensor has t's layout when t is dense: the same flag)
  const bool channels_last = is_channels_last(t);
  if (!is_cpu_floating(t) || !in_mask_order(t, channels_last)) return pack_bits(compare_aten(t, cmp, lo, hi));
  at::Tensor bytes = mask_bytes(t);
  uint8_t* out = bytes.mutable_data_ptr<uint8_t>();
  with_compared_bounds(t, lo, hi, [&](const auto* x, auto l, auto h) {  // (a NaN compares false)
    const auto pack = [&](auto pred) { pack_loop(x, t.numel(), out, pred, nullptr, pred); };
    if (cmp == Compare::kAtMost) {
      pack([h](auto v) { return compared(v) <= h; });
    } else if (cmp == Compare::kAtLeast) {
      pack([l](auto v) { return compared(v) >= l; });
    } else if (cmp == Compare::kGreaterOrNaN) {
      pack([l](auto v) { return !(compared(v) <= l); });
    } else {
      pack([l, h](auto v) { return (compared(v) > l) & (compared(v) < h); });
    }
  });
  return {bytes, channels_last};
}

std::tuple<at::Tensor, at::Tensor, bool> pack_outside(const at::Tensor& t, double lo, double hi) {
  const bool channels_last = is_channels_last(t);
  if (!is_cpu_floating(t) || !in_mask_order(t, channels_last)) {
    auto [below, cl] = pack_compare(t, Compare::kAtMost, 0, lo);
    return {below, pack_compare(t, Compare::kAtLeast, hi, 0).first, cl};
  }
  at::Tensor below = mask_bytes(t), above = mask_bytes(t);
  with_compared_bounds(t, lo, hi, [&](const auto* x, auto l, auto h) {
    pack_loop(x, t.numel(), below.mutable_data_ptr<uint8_t>(), [l](auto v) { return compared(v) <= l; },
              above.mutable_data_ptr<uint8_t>(), [h](auto v) { return compared(v) >= h; });
  });
  return {below, above, channels_last};
}

std::tuple<at::Tensor, at::Tensor, bool> pack_clamp(const at::Tensor& t, const at::Tensor& lo, const at::Tensor& hi,
                                                    bool split_ties) {
  const bool channels_last = is_channels_last(t);
  const bool numbers = lo.dim() == 0 && hi.dim() == 0 && lo.device().is_cpu() && hi.device().is_cpu();
  if (!numbers || !is_cpu_floating(t) || !in_mask_order(t, channels_last)) {  // (clamp_masks' ops)
    if (!split_ties) {
      auto [passes, cl] = pack_bits(at::bitwise_and(at::ge(t, lo), at::le(t, hi)));
      return {passes, at::Tensor(), cl};
    }
    const at::Tensor ties = at::bitwise_and(at::bitwise_or(at::eq(t, lo), at::eq(t, hi)), at::lt(lo, hi));
    auto [passes, cl] = pack_bits(at::bitwise_not(at::bitwise_or(at::bitwise_or(at::lt(t, lo), at::gt(t, hi)), ties)));
    return {passes, pack_bits(ties).first, cl};
  }
  // a 0-dim bound takes t's dtype in the comparison (type promotion: a dimensioned tensor's dtype
  // wins within a category), so it is compared as its value rounded to that dtype: x = bf16(0.1)
  // is below a float 0.1 but ties bf16(0.1), the bound the comparison sees
  const double l = lo.to(t.scalar_type()).item<double>(), h = hi.to(t.scalar_type()).item<double>();
  at::Tensor passes = mask_bytes(t);
  uint8_t* p = passes.mutable_data_ptr<uint8_t>();
  if (!split_ties) {
    with_compared_bounds(t, l, h, [&](const auto* x, auto lc, auto hc) {
      const auto inside = [lc, hc](auto v) { return (compared(v) >= lc) & (compared(v) <= hc); };
      pack_loop(x, t.numel(), p, inside, nullptr, inside);
    });
    return {passes, at::Tensor(), channels_last};
  }
  at::Tensor ties = mask_bytes(t);
  // (whether the interval is proper is asked of the bounds themselves, as stock's lo < hi is: a
  // bf16 x can meet both of two bounds that round to one bf16 value and still split its tie)
  if (!(lo.item<double>() < hi.item<double>())) {  // lo >= hi or a NaN bound: no ties; g unless x < lo or x > hi
    ties.zero_();
    with_compared_bounds(t, l, h, [&](const auto* x, auto lc, auto hc) {
      const auto kept = [lc, hc](auto v) { return !((compared(v) < lc) | (compared(v) > hc)); };
      pack_loop(x, t.numel(), p, kept, nullptr, kept);
    });
    return {passes, ties, channels_last};
  }
  // lo < hi: g strictly inside or for a NaN x, g / 2 on a bound (either, where the rounded bounds meet)
  with_compared_bounds(t, l, h, [&](const auto* x, auto lc, auto hc) {
    pack_loop(
        x, t.numel(), p, [lc, hc](auto v) { return !((compared(v) <= lc) | (compared(v) >= hc)); },
        ties.mutable_data_ptr<uint8_t>(), [lc, hc](auto v) { return (compared(v) == lc) | (compared(v) == hc); });
  });
  return {passes, ties, channels_last};
}

at::Tensor unpack_bit_bytes(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last) {
  const at::Tensor powers = at::bitwise_left_shift(at::ones({8}, packed.options()), at::arange(8, packed.options()));
  const at::Tensor flat =
      at::bitwise_and(packed.unsqueeze(-1), powers).view(-1).slice(0, 0, c10::multiply_integers(shape));
  if (!channels_last) return flat.view(shape);
  return flat.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2});
}

at::Tensor unpack_bits(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last) {
  return unpack_bit_bytes(packed, shape, channels_last).to(at::kBool);
}

at::Tensor masked_grad(const at::Tensor& g, const at::Tensor& packed, at::IntArrayRef shape, bool channels_last) {
  if (!is_cpu_floating(g) || !packed.device().is_cpu() || g.sizes() != shape || !in_mask_order(g, channels_last)) {
    return at::threshold_backward(g, unpack_bit_bytes(packed, shape, channels_last), 0);
  }
  at::Tensor gx = at::empty_like(g);  // (g's strides: the mask's memory order)
  switch (g.element_size()) {  // (a floating dtype of 2, 4 or 8 bytes: is_cpu_floating)
    case 2:
      select<uint16_t>(g, packed, gx);
      break;
    case 4:
      select<uint32_t>(g, packed, gx);
      break;
    default:
      select<uint64_t>(g, packed, gx);
  }
  return gx;
}

}  // namespace mesa
