// Eager fast path of MetaFormer's StarReLU, scale * relu(x) ** 2 + bias (mesa_train/nn/star_relu.py,
// _StarReLUFn: ConvFormer, CAFormer, PoolFormerV2, two a block), as one op whose autograd node
// is C++, as gated_autograd.cpp does for the gated products.
//
// Why: after the gated products (session 56) this was the Mesa layer left on a Python Function
// most often in the session-56 survey of timm families: 24 a step in CAFormer-S18, each about
// 100 us of host time. The op runs the aten ops and the compression the Python Function runs,
// in the same order, so outputs, codes, estimates and gradients are bitwise its own
// (tests/test_star_relu_autograd.py). Backward needs only r = relu(x), kept in the quantizer's
// format (channel groups; a channels-last map through its NHWC view):
//   dx = g * scale * 2 * r,  dscale = sum(g * r * r),  dbias = sum(g).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

struct StarReluTrain : public torch::autograd::Function<StarReluTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& scale,
                            const at::Tensor& bias, Quantizer qz) {
    const at::Tensor r = at::relu(x);
    at::Tensor y = scale * at::pow(r, 2) + bias;  // timm's expression, the same ops in the same order
    at::Tensor q, alpha, beta;
    int64_t dim = 0, G = 0;
    bool nhwc = false;
    if (x.requires_grad() || scale.requires_grad()) {  // (grad mode is off here: ask the inputs)
      const NhwcView v = nhwc_view(r, group_dim(r));
      std::tie(q, alpha, beta, G) = compress(v.x, v.dim, qz);
      save_code_format(ctx, qz, v.x.sizes());
      dim = v.dim;
      nhwc = v.permuted;
    }
    ctx->save_for_backward({q, alpha, beta, x.requires_grad() ? scale : at::Tensor()});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["nhwc"] = nhwc;
    ctx->saved_data["cdt"] = y.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["scale_shape"] = scale.sizes();
    ctx->saved_data["scale_dtype"] = scale.scalar_type();
    ctx->saved_data["bias_shape"] = bias.sizes();
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("StarReLU");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const at::Tensor g = grads[0].to(cdt);
    at::Tensor gx, gs, gb;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) {
      const at::Tensor r = from_nhwc(
          decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(), ctx->saved_data["groups"].toInt(), cdt),
          ctx->saved_data["nhwc"].toBool());
      if (ctx->needs_input_grad(0)) gx = (g * saved[3].to(cdt) * 2 * r).to(ctx->saved_data["x_dtype"].toScalarType());
      if (ctx->needs_input_grad(1)) {
        gs = (g * r * r).sum_to_size(ctx->saved_data["scale_shape"].toIntVector());
        gs = gs.to(ctx->saved_data["scale_dtype"].toScalarType());
      }
    }
    if (ctx->needs_input_grad(2)) {
      gb = g.sum_to_size(ctx->saved_data["bias_shape"].toIntVector()).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {gx, gs, gb, at::Tensor()};
  }
};

at::Tensor star_relu_train(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& bias, at::TensorList state,
                           int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() > 0, "mesa::star_relu_train: x must have at least one dim, got a 0-d tensor");
  return StarReluTrain::apply(
      x, scale, bias,
      quantizer_from_list(state, num_groups, decay, estimator, symmetric, stochastic, "mesa::star_relu_train"));
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // scale * relu(x) ** 2 + bias; state [alpha_est, beta_est, initialized, rng] updated as by
  // mesa::observe
  m.def(
      "star_relu_train(Tensor x, Tensor scale, Tensor bias, Tensor(a!)[] state, int num_groups, float decay, "
      "int estimator, bool symmetric, bool stochastic) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("star_relu_train", &mesa::star_relu_train); }
