// mesa::code_moments: the per-index mean and variance, along the grouped dim, of the values
// dequantize would rebuild from 8-bit codes, from the codes themselves (exact integer sums).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace mesa {

// (mean, var) float32 (D,): over every element with index d along `dim` (D of them), the mean
// and the biased variance of q * (alpha / 255) + beta (alpha, beta: (1, G), shared by all
// samples), computed exactly from integer sums of q and q^2 and rounded once. A constant
// index has variance exactly 0.
std::tuple<at::Tensor, at::Tensor> code_moments(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                                                int64_t dim, int64_t num_groups);

}  // namespace mesa
