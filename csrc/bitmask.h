// The 1-bit masks of the Mesa ReLU, clamps, Hardswish and Amax (relu.pack_bits / unpack_bits):
// a boolean per element, 8 per byte (little-endian bits), flat, in NCHW order, or for a
// channels-last tensor in its own memory order (its NHWC view: unpacked channels-last again, so
// the gradients keep stock's layout). Used by convnet_autograd.cpp.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace mesa {

// The bytes of a boolean mask, and whether it was channels-last (unpack_bits' channels_last)
std::pair<at::Tensor, bool> pack_bits(const at::Tensor& mask);

// Which comparison pack_compare packs: t > lo, t < hi, or lo < t < hi (the scalars rounded to
// t's dtype first, as ATen's gt / lt with a Python number)
enum class Compare { kGreater, kLess, kInside };

// pack_bits(the comparison's boolean tensor), the same bytes and flag: on the CPU for a
// contiguous or channels-last floating t one pass that writes only the bytes
std::pair<at::Tensor, bool> pack_compare(const at::Tensor& t, Compare cmp, double lo, double hi);

// Each element's bit in place: 0 or 2**bit (uint8), nonzero where the mask was set, in `shape`
// (channels-last where the mask was)
at::Tensor unpack_bit_bytes(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

// The boolean mask back, in `shape` (channels-last where it was)
at::Tensor unpack_bits(const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

// g where the mask is set, else 0: stock ReLU's backward threshold_backward(g, mask bytes, 0),
// the same values and layout; on the CPU, for a floating g laid out as the mask was, one pass
// from the bits
at::Tensor masked_grad(const at::Tensor& g, const at::Tensor& packed, at::IntArrayRef shape, bool channels_last);

}  // namespace mesa
