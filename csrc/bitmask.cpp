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

#include "layers_common.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstdint>

namespace mesa {
namespace {

constexpr int64_t kGrainBytes = 4096;  // mask bytes (8 elements each) per parallel task

using layers::is_channels_last;

// Whether t's memory order is the order of a mask packed with this channels_last flag
bool in_mask_order(const at::Tensor& t, bool channels_last) {
  return channels_last ? t.is_contiguous(at::MemoryFormat::ChannelsLast) : t.is_contiguous();
}

bool loops_apply(const at::Tensor& t) {
  const auto dt = t.scalar_type();
  return t.device().is_cpu() && t.numel() > 0 &&
         (dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16);
}

// bytes[b] = sum over k < 8 of pred(x[8 b + k]) << k, the last byte's missing elements 0
template <typename scalar_t, typename Pred>
void pack_loop(const scalar_t* __restrict__ x, uint8_t* __restrict__ bytes, int64_t n, Pred pred) {
  const int64_t full = n / 8;
  at::parallel_for(0, full, kGrainBytes, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const scalar_t* p = x + b * 8;
      uint8_t byte = 0;
      for (int k = 0; k < 8; ++k) byte |= static_cast<uint8_t>(pred(p[k])) << k;
      bytes[b] = byte;
    }
  });
  if (n % 8) {
    uint8_t byte = 0;
    for (int64_t k = 0; k < n % 8; ++k) byte |= static_cast<uint8_t>(pred(x[full * 8 + k])) << k;
    bytes[full] = byte;
  }
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

at::Tensor compare_aten(const at::Tensor& t, Compare cmp, double lo, double hi) {
  switch (cmp) {
    case Compare::kGreater:
      return t.gt(lo);
    case Compare::kLess:
      return t.lt(hi);
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
  if (!loops_apply(t) || !in_mask_order(t, channels_last)) return pack_bits(compare_aten(t, cmp, lo, hi));
  const int64_t n = t.numel();
  at::Tensor bytes = at::empty({(n + 7) / 8}, t.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "mesa_pack_compare", [&] {
    const scalar_t* x = t.const_data_ptr<scalar_t>();
    uint8_t* out = bytes.mutable_data_ptr<uint8_t>();
    // compared in scalar_t (Half / BFloat16 through float, exactly), NaN on neither side
    const scalar_t l = static_cast<scalar_t>(lo), h = static_cast<scalar_t>(hi);
    if (cmp == Compare::kGreater) {
      pack_loop(x, out, n, [l](scalar_t v) { return v > l; });
    } else if (cmp == Compare::kLess) {
      pack_loop(x, out, n, [h](scalar_t v) { return v < h; });
    } else {
      pack_loop(x, out, n, [l, h](scalar_t v) { return (v > l) & (v < h); });
    }
  });
  return {bytes, channels_last};
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
  if (!loops_apply(g) || !packed.device().is_cpu() || g.sizes() != shape || !in_mask_order(g, channels_last)) {
    return at::threshold_backward(g, unpack_bit_bytes(packed, shape, channels_last), 0);
  }
  at::Tensor gx = at::empty_like(g);  // (g's strides: the mask's memory order)
  switch (g.element_size()) {  // (a floating dtype of 2, 4 or 8 bytes: loops_apply)
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
