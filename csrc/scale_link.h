// conv.ScaleLink between the C++ layer ops: a 1x1 depthwise Mesa conv (mesa::conv2d_train,
// scale_link=true; layers_autograd.cpp) whose output goes straight into a train-mode Mesa
// BatchNorm (mesa::batch_norm_train; convnet_autograd.cpp), the "scale branch" of RepVGG /
// MobileOne / FastViT. That BatchNorm makes the conv's exact weight gradient a cancellation
// that 8-bit noise swamps; its backward has the closed form, coef / w (conv.ScaleLink says
// why), and hands it to the conv's backward through this state.
//
// How the two nodes meet: the conv's node keeps the state in its saved_data (a capsule); the
// BatchNorm's forward finds that node as its input's grad_fn (scale_link_of: the input is the
// conv's output itself, not a view or a copy) and keeps the same state. The BatchNorm's
// backward writes coef and the input gradient it returns; the conv's backward uses coef when
// the gradient it receives is that very tensor (the BatchNorm was the output's only
// consumer), as conv._Conv2dFn does with the Python ScaleLink, and clears the state.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

namespace mesa {

struct ScaleLinkState : torch::CustomClassHolder {
  at::Tensor coef;  // per channel: gamma * dgamma * (1 - mean(x_hat^2)), in the BatchNorm's compute dtype
  at::Tensor gx;    // the gradient the BatchNorm's backward returned for the conv output
};

// The state of the conv node that made `y` with scale_link=true (y its output itself), else null.
c10::intrusive_ptr<ScaleLinkState> scale_link_of(const at::Tensor& y);

inline c10::IValue scale_link_capsule(const c10::intrusive_ptr<ScaleLinkState>& state) {
  return c10::IValue::make_capsule(state);
}

inline c10::intrusive_ptr<ScaleLinkState> scale_link_from(const c10::IValue& capsule) {
  return c10::static_intrusive_pointer_cast<ScaleLinkState>(capsule.toCapsule());
}

}  // namespace mesa
