// Eager fast path of the Mesa layer scales (mesa_train/nn/layerscale.py, _ScaleFn): x * gamma
// with a learnable gamma, keeping x in 8 bits for gamma's gradient, as one op whose autograd
// node is C++ (as layers_autograd.cpp does for the transformer layers). The layers that use
// it: LayerScale (DeiT3, CaiT, EVA, BEiT ...), LayerScale2d (ConvNeXt-style NCHW), MetaFormer's
// Scale, ChannelScale (a block's inline gamma_1 * y, cosine attention's logit scale) and
// ChannelGate (squeeze-excite's x * gate: EfficientNet, MobileNetV3), several per block.
//
// Why: the Python Function cost about 100 us of host time per call. The op does what the
// Function does, op for op (the same aten kernels and mesa::compress / dequantize), so outputs,
// codes, estimates and gradients are bitwise the Python path's (tests/test_scale_autograd.py).
// The layers call it only in eager mode with a channel format (8-bit, or a variant: make_quantizer).
//
// ResMLP's Affine (torch.addcmul(beta, alpha, x), _AffineFn: two a block, 25 Python Functions a
// step in ResMLP-12 in the session-56 survey) is the same layer with a bias: mesa::affine_train,
// the per-channel codes of x and the same gradients, plus beta's (sum(g)).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "layers_common.h"

#include <vector>

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// layerscale._broadcast_dim: the dim of x that a broadcast gamma of 2+ dims varies along last
// (its groups: the heads of a (heads, 1, 1) logit scale, the channels of a squeeze-excite gate
// (N, C, 1, 1) or, channels last, (N, 1, 1, C)); dim 1 if none varies.
int64_t broadcast_dim(const at::Tensor& x, const at::Tensor& gamma) {
  int64_t last = -1;
  for (int64_t i = 0; i < gamma.dim(); ++i)
    if (gamma.size(i) > 1) last = i;
  return last >= 0 ? x.dim() - gamma.dim() + last : 1;
}

// x's codes with channel groups over its last dim, small rows scaled (rowscale.compress_rows),
// for a per-channel gamma's gradient
struct RowCodes {
  at::Tensor q, alpha, beta, k;
  int64_t dim = 0, groups = 0;
};

RowCodes keep_rows(AutogradContext* ctx, const at::Tensor& x, c10::ScalarType out_dtype, bool row_scale,
                   Quantizer& qz) {
  RowCodes c;
  c.dim = x.dim() - 1;
  std::tie(c.q, c.alpha, c.beta, c.groups, c.k) = compress_rows(x, out_dtype, 1, row_scale, qz);
  save_code_format(ctx, qz, x.sizes());
  return c;
}

struct ScaleTrain : public torch::autograd::Function<ScaleTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gamma, Quantizer qz,
                            bool row_scale) {
    at::Tensor out = x * gamma;
    at::Tensor q, alpha, beta, k;
    int64_t dim = 0, G = 0;
    bool nhwc = false;
    if (gamma.requires_grad()) {  // the copy of x serves gamma's gradient only
      if (gamma.dim() <= 1) {  // per channel (last dim): channel groups, small rows scaled
        RowCodes c = keep_rows(ctx, x, out.scalar_type(), row_scale, qz);
        q = c.q, alpha = c.alpha, beta = c.beta, k = c.k, dim = c.dim, G = c.groups;
      } else {  // per head or per (sample, channel): groups along the dim gamma varies along
        const NhwcView v = nhwc_view(x, broadcast_dim(x, gamma));
        std::tie(q, alpha, beta, G) = compress(v.x, v.dim, qz);
        save_code_format(ctx, qz, v.x.sizes());
        dim = v.dim;
        nhwc = v.permuted;
      }
    }
    ctx->save_for_backward({q, alpha, beta, x.requires_grad() ? gamma : at::Tensor(), k});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["nhwc"] = nhwc;
    ctx->saved_data["cdt"] = out.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["g_dtype"] = gamma.scalar_type();
    ctx->saved_data["g_shape"] = gamma.sizes();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("layer scale");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const at::Tensor g = grads[0].to(cdt);
    at::Tensor gx, gg;
    if (ctx->needs_input_grad(0)) gx = (g * saved[3].to(cdt)).to(ctx->saved_data["x_dtype"].toScalarType());
    if (ctx->needs_input_grad(1)) {
      const auto g_shape = ctx->saved_data["g_shape"].toIntVector();
      const at::Tensor xh = from_nhwc(decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(),
                                                       ctx->saved_data["groups"].toInt(), cdt, saved[4]),
                                      ctx->saved_data["nhwc"].toBool());
      gg = g_shape.size() <= 1 ? (g * xh).reshape({-1, xh.size(-1)}).sum(0).reshape(g_shape)
                               : (g * xh).sum_to_size(g_shape);
      gg = gg.to(ctx->saved_data["g_dtype"].toScalarType());
    }
    return {gx, gg, at::Tensor(), at::Tensor()};
  }
};

// torch.addcmul(beta, alpha, x), alpha and beta of shape (1, 1, C): x kept as ScaleTrain keeps it
// for a per-channel gamma (its gradient summed to alpha's shape, as _AffineFn sums it)
struct AffineTrain : public torch::autograd::Function<AffineTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& alpha,
                            const at::Tensor& beta, Quantizer qz, bool row_scale) {
    at::Tensor out = at::addcmul(beta, alpha, x);  // exactly timm's Affine.forward
    RowCodes c;
    if (alpha.requires_grad()) c = keep_rows(ctx, x, out.scalar_type(), row_scale, qz);
    ctx->save_for_backward({c.q, c.alpha, c.beta, x.requires_grad() ? alpha : at::Tensor(), c.k});
    ctx->saved_data["dim"] = c.dim;
    ctx->saved_data["groups"] = c.groups;
    ctx->saved_data["cdt"] = out.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["a_shape"] = alpha.sizes();
    ctx->saved_data["a_dtype"] = alpha.scalar_type();
    ctx->saved_data["b_shape"] = beta.sizes();
    ctx->saved_data["b_dtype"] = beta.scalar_type();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Affine");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const at::Tensor g = grads[0].to(cdt);
    at::Tensor gx, ga, gb;
    // addcmul's tensor2 gradient: grad * (tensor1 * value), value 1
    if (ctx->needs_input_grad(0)) gx = (g * saved[3].to(cdt)).to(ctx->saved_data["x_dtype"].toScalarType());
    if (ctx->needs_input_grad(1)) {
      const at::Tensor xh = decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(),
                                             ctx->saved_data["groups"].toInt(), cdt, saved[4]);
      ga = (g * xh).sum_to_size(ctx->saved_data["a_shape"].toIntVector());
      ga = ga.to(ctx->saved_data["a_dtype"].toScalarType());
    }
    if (ctx->needs_input_grad(2)) {
      gb = g.sum_to_size(ctx->saved_data["b_shape"].toIntVector()).to(ctx->saved_data["b_dtype"].toScalarType());
    }
    return {gx, ga, gb, at::Tensor(), at::Tensor()};
  }
};

at::Tensor scale_train(const at::Tensor& x, const at::Tensor& gamma, at::Tensor& alpha_est, at::Tensor& beta_est,
                       at::Tensor& initialized, at::Tensor& rng, int64_t num_groups, double decay, int64_t estimator,
                       bool symmetric, bool stochastic, bool row_scale) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::scale_train");
  return ScaleTrain::apply(x, gamma, qz, row_scale);
}

at::Tensor affine_train(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, at::TensorList state,
                        int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
                        bool row_scale) {
  TORCH_CHECK_VALUE(x.dim() > 0 && alpha.dim() > 0 && alpha.size(-1) == x.size(-1) && alpha.numel() == x.size(-1),
                    "mesa::affine_train: alpha must hold one value per channel of x's last dim, got alpha of shape ",
                    alpha.sizes(), " for x of shape ", x.sizes());
  return AffineTrain::apply(
      x, alpha, beta,
      quantizer_from_list(state, num_groups, decay, estimator, symmetric, stochastic, "mesa::affine_train"), row_scale);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // The quantizer's buffers are mutated (estimates, rounding counter), as by mesa::observe.
  m.def(
      "scale_train(Tensor x, Tensor gamma, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, bool stochastic, "
      "bool row_scale) -> Tensor");
  // torch.addcmul(beta, alpha, x) (ResMLP's Affine); state [alpha_est, beta_est, initialized,
  // rng] updated as by mesa::observe
  m.def(
      "affine_train(Tensor x, Tensor alpha, Tensor beta, Tensor(a!)[] state, int num_groups, float decay, "
      "int estimator, bool symmetric, bool stochastic, bool row_scale) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) {
  m.impl("scale_train", &mesa::scale_train);
  m.impl("affine_train", &mesa::affine_train);
}
