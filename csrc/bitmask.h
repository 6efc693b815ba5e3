// The 1-bit masks of the Mesa ReLU, clamps, Hardswish and Amax (relu.pack_bits / unpack_bits):
// a boolean per element, 8 per byte (little-endian bits), flat, in NCHW order, or for a
// channels-last tensor in its own memory order (its NHWC view: unpacked channels-last again, so
// the gradients keep stock's layout). Used by convnet_autograd.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

namespace mesa {

// The bytes of a boolean mask, and whether it was channels-last (unpack_bits' channels_last)
std::pair<at::Tensor, bool> pack_bits(const at::Tensor& mask);

// Which comparison pack_compare packs: t <= hi, t >= lo, lo < t < hi, or !(t <= lo) (t > lo or a
// NaN: where threshold_backward passes g, the ReLU's mask), compared as ATen's backward kernels
// compare (a Half or BFloat16 t in float, against the scalars rounded to float)
enum class Compare { kAtMost, kAtLeast, kInside, kGreaterOrNaN };

// pack_bits(the comparison's boolean tensor), the same bytes and flag: on the CPU for a
// contiguous or channels-last floating t one pass that writes only the bytes
std::pair<at::Tensor, bool> pack_compare(const at::Tensor& t, Compare cmp, double lo, double hi);

// Hardswish's two masks, t <= lo and t >= hi, as pack_compare's kAtMost and kAtLeast (the same
// bytes and flag), on the CPU in one pass over t: (below, above, channels_last)
std::tuple<at::Tensor, at::Tensor, bool> pack_outside(const at::Tensor& t, double lo, double hi);

// The Mesa Clamp's masks (clamp_autograd.cpp) of torch.clamp(t, lo, hi) with tensor bounds, as
// clamp_activations.clamp_masks builds them for the running torch's rule (split_ties: its
// STOCK_CLAMP_SPLITS_TIES), compared as ATen compares t with the bounds:
// * split_ties: passes = !(t < lo || t > hi || ties) (where stock's gradient is g: inside, a NaN)
//   and ties = (t == lo || t == hi) && lo < hi (where it is g / 2);
// * else passes = lo <= t <= hi, ties undefined (none).
// Each pack_bits' bytes, and the shared flag: (passes, ties, channels_last). On the CPU, for
// number bounds (0-dim) and a floating t in mask order, one pass over t; else the ATen ops
std::tuple<at::Tensor, at::Tensor, bool> pack_clamp(const at::Tensor& t, const at::Tensor& lo, const at::Tensor& hi,
                                                    bool split_ties);

// Each element's bit in place: 0 or 2**bit (uint8), nonzero where the mask was set, in `shape`
// (channels-last where the mask was)
at::Tensor unpack_bit_bytes(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

// The boolean mask back, in `shape` (channels-last where it was)
at::Tensor unpack_bits(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

// Whether t's memory order is the order of a mask packed with this channels_last flag: its
// elements and the mask's bits then run in one order
inline bool in_mask_order(const at::Tensor& t, bool channels_last) {
  return channels_last ? t.is_contiguous(at::MemoryFormat::ChannelsLast) : t.is_contiguous();
}

// g where the mask is set, else 0: stock ReLU's backward threshold_backward(g, mask bytes, 0),
// the same values and layout; on the CPU, for a floating g laid out as the mask was, one pass
// from the bits
at::Tensor masked_grad(const at::Tensor& g, const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

}  // namespace mesa
