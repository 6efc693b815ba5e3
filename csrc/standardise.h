// x_hat = (x - mean) * invstd of the Mesa norms (convnet_autograd.cpp: BatchNorm per channel,
// GroupNorm per (sample, group)), in the compute dtype, before it is compressed.
#pragma once

#include <ATen/ATen.h>

namespace mesa {

// (x.to(mdt) - mean) * invstd, each op rounded in mdt (the statistics' dtype: float32, or
// float64 for a float64 x), in x's layout: the Python Functions' two ATen ops, the same bits.
// mean and invstd are shaped to broadcast over x per (sample, channel): (1, C, 1, ...) or
// (N, C, 1, ...). On the CPU, for a contiguous or channels-last x, one pass.
at::Tensor standardise(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd);

}  // namespace mesa
