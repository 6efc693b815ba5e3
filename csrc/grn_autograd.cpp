// Eager fast path of the Mesa GlobalResponseNorm (mesa_train/nn/grn.py, _GrnFn: ConvNeXt-V2's MLP,
// fc1, GELU, GRN, fc2) as one op whose autograd node is C++, as gated_autograd.cpp does for the
// gated products.
//
// Why: in the session-56 survey of timm families it ran a Python Function 12 times a step in
// ConvNeXt-V2, each well over 100 us of host time (its backward is a dozen ops). The op runs the
// aten ops and the compression the Python Function runs, in the same order, so outputs, codes,
// estimates and gradients are bitwise its own (tests/test_grn_autograd.py). It keeps x in the
// quantizer's format (channel groups) where x's or weight's gradient is asked for, and the
// per-(sample, channel) norms x_g and their channel mean d exactly; grn.py's module doc derives
// the backward.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

struct GrnTrain : public torch::autograd::Function<GrnTrain> {
  // grn._grn_forward: timm's GlobalResponseNorm.forward, call for call
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, std::vector<int64_t> spatial, int64_t channel,
                            std::vector<int64_t> wb_shape, Quantizer qz) {
    const at::Tensor x_g = at::linalg_vector_norm(x, at::Scalar(int64_t{2}), spatial, true);
    const at::Tensor d = x_g.mean({channel}, true) + eps;
    const at::Tensor x_n = x_g / d;
    at::Tensor out = x + at::addcmul(bias.view(wb_shape), weight.view(wb_shape), x * x_n);
    at::Tensor q, alpha, beta;
    int64_t G = 0;
    const int64_t cdim = ((channel % x.dim()) + x.dim()) % x.dim();  // (Python's channel_dim % x.dim())
    if (x.requires_grad() || weight.requires_grad()) {
      std::tie(q, alpha, beta, G) = compress(x, cdim, qz);
      save_code_format(ctx, qz, x.sizes());
    }
    ctx->save_for_backward({q, alpha, beta, x_g, d, weight});
    ctx->saved_data["cdim"] = cdim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["spatial"] = spatial;
    ctx->saved_data["channel"] = channel;
    ctx->saved_data["wb_shape"] = wb_shape;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["w_dtype"] = weight.scalar_type();
    ctx->saved_data["b_dtype"] = bias.scalar_type();
    return out;
  }

  // in float32, each gradient cast to its input's dtype (_GrnFn.backward, op for op)
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("GlobalResponseNorm");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const at::Tensor g = grads[0].to(at::kFloat);
    const int64_t cdim = ctx->saved_data["cdim"].toInt();
    std::vector<int64_t> rows;  // every dim but the channel's
    for (int64_t i = 0; i < g.dim(); ++i)
      if (i != cdim) rows.push_back(i);
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(2)) gb = g.sum(rows).to(ctx->saved_data["b_dtype"].toScalarType());
    if (need_x || need_w) {
      const at::Tensor xh = decompress_saved(ctx, saved, cdim, ctx->saved_data["groups"].toInt(), at::kFloat);
      const at::Tensor x_g = saved[3].to(at::kFloat), d = saved[4].to(at::kFloat);
      const at::Tensor w = saved[5].to(at::kFloat).view(ctx->saved_data["wb_shape"].toIntVector());
      const at::Tensor x_n = x_g / d;
      if (need_w) gw = (g * xh * x_n).sum(rows).to(ctx->saved_data["w_dtype"].toScalarType());
      if (need_x) {
        const at::Tensor t = (g * w * xh).sum(ctx->saved_data["spatial"].toIntVector(), true);
        const at::Tensor dx_g = t / d - (t * x_g).mean({ctx->saved_data["channel"].toInt()}, true) / (d * d);
        const at::Tensor per_x = at::where(x_g > 0, dx_g / x_g, at::zeros_like(x_g));
        gx = (g + w * x_n * g + per_x * xh).to(ctx->saved_data["x_dtype"].toScalarType());
      }
    }
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor grn_train(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
                     at::IntArrayRef spatial_dims, int64_t channel_dim, at::IntArrayRef wb_shape, at::TensorList state,
                     int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() == 4 && (channel_dim == 1 || channel_dim == -1),
                    "mesa::grn_train: x must be 4-d (NCHW, or NHWC) with channel_dim 1 or -1, got a ", x.dim(),
                    "-d x and channel_dim ", channel_dim);
  return GrnTrain::apply(
      x, weight, bias, eps, spatial_dims.vec(), channel_dim, wb_shape.vec(),
      quantizer_from_list(state, num_groups, decay, estimator, symmetric, stochastic, "mesa::grn_train"));
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // timm's GlobalResponseNorm: x + bias + weight * (x * x_g / (mean_c(x_g) + eps)), x_g the 2-norm
  // over spatial_dims; state [alpha_est, beta_est, initialized, rng] updated as by mesa::observe
  m.def(
      "grn_train(Tensor x, Tensor weight, Tensor bias, float eps, int[] spatial_dims, int channel_dim, "
      "int[] wb_shape, Tensor(a!)[] state, int num_groups, float decay, int estimator, bool symmetric, "
      "bool stochastic) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("grn_train", &mesa::grn_train); }
