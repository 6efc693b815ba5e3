// Hardswish's gradient from its two 1-bit masks and the dequantized input xh
// (activations._HardswishFn's backward), stock's hardswish_backward arithmetic:
//   +0 where x <= -3, g where x >= 3, else g * clamp(xh / 3 + 0.5, -0.5, 1.5)
// the last in float for a Half or BFloat16 g (one rounding to g's dtype at the end, as ATen's
// kernel); the clamp gives an element whose rounded xh left [-3, 3] the end's slope. Where xh
// is x (exact codes) that is stock's gradient bit for bit. On the CPU, for g and xh of one
// dtype laid out as the masks were, one pass (the ATen ops' bits, but for a NaN's payload);
// ATen ops elsewhere (the Python Function's, op for op).
#pragma once

#include <ATen/ATen.h>

namespace mesa {

// below / above: the masks' bytes (bitmask.h, pack_outside); shape: x's sizes; channels_last:
// whether the masks were packed channels-last (pack_outside's flag)
at::Tensor hardswish_masked_grad(const at::Tensor& g, const at::Tensor& xh, const at::Tensor& below,
                                 const at::Tensor& above, at::IntArrayRef shape, bool channels_last);

}  // namespace mesa
