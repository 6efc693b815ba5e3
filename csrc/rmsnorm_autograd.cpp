// Eager fast path of the Mesa RmsNorm (mesa_train/nn/rmsnorm.py, _RmsNormFn) as one op whose
// autograd node is C++, as layers_autograd.cpp does for the other norms. Forward: torch's
// rms_norm, which is what timm's RmsNorm calls (timm.layers.norm.rms_norm is
// torch.nn.functional.rms_norm; the layer takes this op only then), and beside it
// x_hat = x * rrms in float32 at least, kept in 8 bits (or a variant) with channel groups over
// the last dim, its small rows scaled by 2**k when row_scale is on (layers::compress_rows), and
// the per-row rrms. Backward, with gw = grad_out * weight and means over the normalised dims:
//     dx = rrms * (gw - x_hat * mean(gw * x_hat)),    dweight = sum_rows(grad_out * x_hat)
// Op for op the Python Function, so outputs, codes, estimates and gradients are bitwise its
// (tests/test_rmsnorm_autograd.py). Why: 15 RmsNorms a step in Gemma-4's ViT, 8 in ViT-XP, 6 in
// DeepSeek's ViT ran Python Functions (the session-59 zoo survey, DESIGN.md).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "layers_common.h"

#include <optional>
#include <vector>

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// the normalised dims, last first (rmsnorm._dims)
std::vector<int64_t> normalised_dims(int64_t nd) {
  std::vector<int64_t> dims;
  for (int64_t d = -1; d >= -nd; --d) dims.push_back(d);
  return dims;
}

struct RmsNormTrain : public torch::autograd::Function<RmsNormTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> normalized_shape,
                            const std::optional<at::Tensor>& weight, double eps, Quantizer qz, bool row_scale) {
    at::Tensor out = at::rms_norm(x, normalized_shape, weight, eps);  // exactly timm's RmsNorm.forward
    const int64_t nd = static_cast<int64_t>(normalized_shape.size());
    const auto mdt = at::promote_types(x.scalar_type(), at::kFloat);  // (torch.rms_norm's opmath)
    at::Tensor x_hat, rrms;
    {
      NoAutocast no_autocast;  // (rmsnorm._normalised)
      const at::Tensor xm = x.to(mdt);
      rrms = at::rsqrt(xm.pow(2).mean(normalised_dims(nd), true).add(eps));
      x_hat = xm * rrms;
    }
    auto [q, alpha, beta, G, k] = compress_rows(x_hat, x_hat.scalar_type(), nd, row_scale, qz);
    save_code_format(ctx, qz, x_hat.sizes());
    ctx->save_for_backward({q, alpha, beta, rrms, weight.has_value() ? *weight : at::Tensor(), k});
    ctx->saved_data["nd"] = nd;
    ctx->saved_data["dim"] = x_hat.dim() - 1;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["mdt"] = mdt;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["has_weight"] = weight.has_value();
    ctx->saved_data["w_dtype"] = weight.has_value() ? weight->scalar_type() : mdt;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("RmsNorm");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &rrms = saved[3], &weight = saved[4], &k = saved[5];
    const auto mdt = ctx->saved_data["mdt"].toScalarType();
    const auto dims = normalised_dims(ctx->saved_data["nd"].toInt());
    // (needs_input_grad counts the tensors apply tracked: x, then the weight if present)
    const bool has_w = ctx->saved_data["has_weight"].toBool();
    const bool need_x = ctx->needs_input_grad(0), need_w = has_w && ctx->needs_input_grad(1);
    const at::Tensor xh =
        decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(), ctx->saved_data["groups"].toInt(), mdt, k);
    const at::Tensor g = grads[0].to(mdt);
    const at::Tensor gw = has_w ? g * weight.to(mdt) : g;
    at::Tensor dx, dweight;
    if (need_x) {
      dx = (rrms.to(mdt) * (gw - xh * (gw * xh).mean(dims, true))).to(ctx->saved_data["x_dtype"].toScalarType());
    }
    if (need_w) {
      std::vector<int64_t> rows_by_weight{-1};
      for (const int64_t s : weight.sizes()) rows_by_weight.push_back(s);
      dweight = (g * xh).reshape(rows_by_weight).sum(0).to(ctx->saved_data["w_dtype"].toScalarType());
    }
    return {dx, at::Tensor(), dweight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_train(const at::Tensor& x, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                          double eps, at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized,
                          at::Tensor& rng, int64_t num_groups, double decay, int64_t estimator, bool symmetric,
                          bool stochastic, bool row_scale) {
  const int64_t nd = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(nd >= 1 && x.dim() >= nd && x.sizes().slice(x.dim() - nd).equals(normalized_shape),
                    "mesa: rms_norm_train: x's last dims ", x.sizes(), " must be normalized_shape ",
                    normalized_shape);
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::rms_norm_train");
  return RmsNormTrain::apply(x, normalized_shape.vec(), present(weight), eps, qz, row_scale);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // The quantizer's buffers are mutated (estimates, rounding counter), as by mesa::observe.
  m.def(
      "rms_norm_train(Tensor x, int[] normalized_shape, Tensor? weight, float eps, Tensor(a!) alpha_est, "
      "Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, int num_groups, float decay, int estimator, "
      "bool symmetric, bool stochastic, bool row_scale) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("rms_norm_train", &mesa::rms_norm_train); }
