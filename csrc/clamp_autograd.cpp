// Eager fast path of the Mesa Clamp (mesa_train/nn/clamp_activations.py, _ClampFn: torch.clamp(x,
// lo, hi) with tensor bounds that take no gradient, Gemma 4's clamped projections) as one op
// whose autograd node is C++, as convnet_autograd.cpp does for the clamps with number bounds.
//
// Why: the session-59 zoo survey found it one of the last two Mesa layers on a Python Function
// (Gemma 4's vision encoder, 28 a step: an input and an output clamp on every projection). The op
// runs the aten ops of that Function in its order: the stock clamp, then the 1-bit masks
// (bitmask.h, relu.pack_bits' bytes) of clamp_masks: where stock's gradient passes g and, under
// a torch that splits ties (split_ties: the Python side's probe of the running torch,
// STOCK_CLAMP_SPLITS_TIES; 2.14 does, 2.11 does not), where it halves it; in backward
// where(passes, g, where(ties, g * 0.5, 0)). Output and gradient are bitwise the Python
// Function's and the running torch's stock's (tests/test_clamp_table_autograd.py). The backward
// is linear in g and its masks exact, so under create_graph=True its ops are recorded and
// differentiate as stock's clamp backward does.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "bitmask.h"
#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

struct ClampTrain : public torch::autograd::Function<ClampTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                            bool split_ties) {
    at::Tensor y = at::clamp(x, lo, hi);
    // (on the CPU, for number bounds: one pass over x for both masks, bitmask.cpp; ties
    // undefined where the torch has none)
    auto [passes, ties, channels_last] = pack_clamp(x, lo, hi, split_ties);
    ctx->save_for_backward({passes, ties});
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["channels_last"] = channels_last;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const bool channels_last = ctx->saved_data["channels_last"].toBool();
    const at::Tensor& g = grads[0];
    const bool has_ties = saved[1].defined();
    // No element on a bound (the usual case: a tie needs x equal to a bound; none at all under a
    // torch without ties), on the CPU and not recorded for a second derivative (masked_grad's
    // loop is not differentiable): where(passes, g, 0), the same values and layout, as the ReLU's
    // one pass from the bits (bitmask.h). The check reads n / 8 bytes; a host sync only where the
    // data is on the host anyway.
    if (g.is_cpu() && !at::GradMode::is_enabled() && (!has_ties || !saved[1].any().item<bool>())) {
      return {masked_grad(g, saved[0], shape, channels_last), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor passes = unpack_bits(saved[0], shape, channels_last);
    if (!has_ties) return {at::where(passes, g, 0), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor ties = unpack_bits(saved[1], shape, channels_last);
    return {at::where(passes, g, at::where(ties, g * 0.5, 0)), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor clamp_train(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi, bool split_ties) {
  TORCH_CHECK_VALUE(!lo.requires_grad() && !hi.requires_grad(),
                    "mesa::clamp_train: the bounds take no gradient (buffers); run torch.clamp for learned bounds");
  return ClampTrain::apply(x, lo, hi, split_ties);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // torch.clamp(x, lo, hi) with bounds that take no gradient, keeping 1-bit masks of stock's
  // gradient under the running torch's rule (split_ties: whether it gives a tie g / 2)
  m.def("clamp_train(Tensor x, Tensor lo, Tensor hi, bool split_ties) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("clamp_train", &mesa::clamp_train); }
