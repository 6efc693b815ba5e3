// The index arithmetic of the Mesa MaxPool2d (convnet_autograd.cpp, MaxPool2dTrain): ATen's
// per-plane argmax h * W + w <-> the uint8 window-local index lh * kW + lw it keeps instead.
#pragma once

#include <ATen/ATen.h>

namespace mesa {

// The uint8 window-local index of each output element (the layout of idx, the int64 index
// max_pool2d_with_indices returned for an input with `height` x `width` planes).
at::Tensor window_local_index(const at::Tensor& idx, int64_t height, int64_t width, at::IntArrayRef kernel,
                              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation);

// ATen's int64 per-plane index back from window_local_index's (the layout of local).
at::Tensor global_index(const at::Tensor& local, int64_t width, at::IntArrayRef kernel, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation);

}  // namespace mesa
