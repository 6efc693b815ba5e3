// Eager fast path of the convnet layers: the Mesa BatchNorm (mesa_train/nn/batchnorm.py,
// _BatchNormFn), GroupNorm (groupnorm.py, _GroupNormFn), ReLU (relu.py, _ReLUFn), Hardtanh /
// ReLU6 / Hardsigmoid (clamp_activations.py, _ClampMaskFn) and SiLU / QuickGELU / Hardswish
// (activations.py, _ElementwiseFn, _HardswishFn) and MaxPool2d (maxpool.py, _MaxPool2dFn), each as
// one op whose autograd node is C++, as layers_autograd.cpp does for the transformer layers.
//
// Why: as Python Functions they added 50-150 us of host time per layer and step to stock's
// 25-45 us (results/overhead/cpu-convnet.md): Function.apply, the ctx bookkeeping and the
// small ops issued from Python (BatchNorm: some 14). Every block of a convnet has several.
// Each op runs the aten kernels and mesa::compress / dequantize its Python Function runs, in
// the same order (the 1-bit masks: bitmask.cpp's loops on the CPU, and backward stock's own
// kernel or a select from the bits in place of unpack + where, the same values), so outputs,
// codes, masks, estimates, running statistics and gradients are bitwise the Python path's
// (tests/test_convnet_autograd.py, test_bitmask_loops.py). The layers call them only in
// eager mode with a channel format, 8-bit or a variant (layers_common.h, make_quantizer; the
// norms: a weight, and BatchNorm a bias); otherwise they keep their Python Functions.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/accumulate.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "bitmask.h"
#include "code_moments.h"
#include "hardswish_grad.h"
#include "layers_common.h"
#include "maxpool_index.h"
#include "scale_link.h"
#include "standardise.h"

#include <optional>
#include <vector>

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// a per-channel (C,) tensor shaped to broadcast over `like` (N, C, ...): batchnorm._per_channel
at::Tensor per_channel(const at::Tensor& t, const at::Tensor& like) {
  std::vector<int64_t> shape(like.dim(), 1);
  shape[1] = -1;
  return t.view(shape);
}

// What a norm's node keeps beside its codes and statistics: the quantizer's group count, eps,
// the compute dtype and the dtypes its gradients go back in (the norms are affine here).
void save_norm_meta(AutogradContext* ctx, int64_t quant_groups, double eps, c10::ScalarType mdt, const at::Tensor& x,
                    const at::Tensor& weight, const at::Tensor& bias) {
  ctx->saved_data["quant_groups"] = quant_groups;
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["mdt"] = mdt;
  ctx->saved_data["x_dtype"] = x.scalar_type();
  ctx->saved_data["w_dtype"] = weight.scalar_type();
  ctx->saved_data["b_dtype"] = bias.scalar_type();
}

// The factor that standardises the dequantized x_hat again, from its own variance `var` per
// channel (BatchNorm) or per (sample, group) (GroupNorm), to the exact x_hat's mean square
// 1 - eps * invstd^2 (batchnorm.bn_backward says why); 1 where var is 0; at least
// batchnorm.RESTANDARDISE_FLOOR (backward divides by it: a channel of variance far below eps).
constexpr double kRestandardiseFloor = 1e-6;
at::Tensor exact_mean_square(const at::Tensor& invstd, double eps) {
  return at::rsub(invstd.square().mul(eps), 1).clamp_min(0);
}
at::Tensor restandardise(const at::Tensor& var, const at::Tensor& invstd, double eps) {
  return at::where(var.gt(0), exact_mean_square(invstd, eps).div(var).sqrt().clamp_min(kRestandardiseFloor),
                   at::ones_like(var));
}

// The gradients in the dtypes of x, weight and bias, each where wanted (else undefined).
variable_list norm_grads(AutogradContext* ctx, const at::Tensor& gx, const at::Tensor& dw, const at::Tensor& db,
                         bool need_x, bool need_w, bool need_b) {
  const at::Tensor none;
  return {need_x ? gx.to(ctx->saved_data["x_dtype"].toScalarType()) : none,
          need_w ? dw.to(ctx->saved_data["w_dtype"].toScalarType()) : none,
          need_b && db.defined() ? db.to(ctx->saved_data["b_dtype"].toScalarType()) : none};
}

// ----------------------------------------------------------------------------- BatchNorm
// Keeps x_hat = (x - mean) * invstd in 8 bits (groups along the channel dim; a channels-last
// x_hat through its NHWC view, batchnorm.bn_forward) and the per-channel invstd; backward
// re-standardises the dequantized x_hat per channel and runs ATen's batch-norm backward on it
// (batchnorm.bn_backward says why). Fed by a scale branch's conv (scale_link.h), it also hands
// that conv coef = gamma * dgamma * (1 - mean(x_hat^2)) and the input gradient it returns.
// offer_x (mesa::batch_norm_train_offer: RepVGG's / MobileOne's identity BatchNorm, whose input
// the block's convs take next, nn/input_copy.py): the outputs are (y, q, alpha_x, beta_x), the
// x_hat codes read as codes of x itself. With one group per channel the default format's
// x_hat = q * alpha / 255 + beta is, per channel, x = q * (alpha / invstd) / 255 + (beta /
// invstd + mean): the same codes, each group's range and offset in x's units. Empty where
// that does not hold (a variant format, groups spanning channels, a layout of x_hat's codes
// that is not x's): the convs then compress x themselves.
// x_q, x_alpha, x_beta (mesa::batch_norm_train_take: FastViT's RepMixer normalises x again after
// its mixer's identity BatchNorm offered x's codes): the reverse, x's codes read as x_hat's,
// alpha = alpha_x * invstd and beta = (beta_x - mean) * invstd, kept instead of compressing
// x_hat again where they fit (codes_of_x_fit).
struct BatchNormTrain : public torch::autograd::Function<BatchNormTrain> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var, double momentum, double eps, Quantizer qz,
                               bool offer_x, const std::optional<at::Tensor>& x_q,
                               const std::optional<at::Tensor>& x_alpha, const std::optional<at::Tensor>& x_beta) {
    // exactly what F.batch_norm runs (torch.batch_norm -> _batch_norm_impl_index), which also
    // hands back the batch mean and invstd it normalised with
    auto [out, mean, invstd, reserve, impl] = at::_batch_norm_impl_index(
        x, weight, bias, running_mean, running_var, true, momentum, eps, at::globalContext().userEnabledCuDNN());
    const auto mdt = at::promote_types(x.scalar_type(), at::kFloat);
    at::Tensor x_hat;
    {
      NoAutocast no_autocast;
      x_hat = standardise(x, per_channel(mean.to(mdt), x), per_channel(invstd.to(mdt), x));
    }
    const NhwcView v = nhwc_view(x_hat, 1);
    at::Tensor q, alpha, beta;
    int64_t G = 0;
    if (x_q.has_value() && codes_of_x_fit(*x_q, *x_alpha, *x_beta, x, v, qz)) {
      q = *x_q;
      G = x.size(1);
      alpha = x_alpha->mul(invstd.to(x_alpha->scalar_type()));
      beta = x_beta->sub(mean.to(x_beta->scalar_type())).mul(invstd.to(x_beta->scalar_type()));
    } else {
      std::tie(q, alpha, beta, G) = compress(v.x, v.dim, qz);
    }
    save_code_format(ctx, qz, v.x.sizes());
    // (batchnorm.code_moments: the default format's codes)
    if (qz.code_bits == 0 && q.device().is_cpu() && mdt == at::kFloat && alpha.size(0) == 1) {
      auto [xh_mean, xh_var] = code_moments(q, alpha, beta, v.dim, G);
      ctx->save_for_backward({q, alpha, beta, invstd, weight, xh_mean, xh_var});
    } else {
      ctx->save_for_backward({q, alpha, beta, invstd, weight});
    }
    save_norm_meta(ctx, G, eps, mdt, x, weight, bias);
    ctx->saved_data["nhwc"] = v.permuted;
    if (auto link = scale_link_of(x)) ctx->saved_data["scale_link"] = scale_link_capsule(link);
    if (!offer_x) return {out};
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the codes (backward: an undefined g)
    if (qz.code_bits != 0 || G != x.size(1) || nhwc_view(x, 1).permuted != v.permuted) {
      const at::Tensor q0 = no_codes(x), alpha0 = no_codes(x), beta0 = no_codes(x);
      ctx->mark_non_differentiable({q0, alpha0, beta0});
      return {out, q0, alpha0, beta0};
    }
    const at::Tensor alpha_x = alpha.div(invstd.to(alpha.scalar_type()));
    const at::Tensor beta_x = beta.div(invstd.to(beta.scalar_type())).add(mean.to(beta.scalar_type()));
    ctx->mark_non_differentiable({q, alpha_x, beta_x});
    return {out, q, alpha_x, beta_x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("BatchNorm");
    if (!grads[0].defined()) return variable_list(12);  // (offer_x: materialize off, y took no gradient)
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &invstd = saved[3], &weight = saved[4];
    const auto mdt = ctx->saved_data["mdt"].toScalarType();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
    const bool nhwc = ctx->saved_data["nhwc"].toBool();
    // (batchnorm._BatchNormFn: the link only where x's gradient is asked for)
    const auto link_it = ctx->saved_data.find("scale_link");
    const auto link = link_it != ctx->saved_data.end() && need_x ? scale_link_from(link_it->second)
                                                                 : c10::intrusive_ptr<ScaleLinkState>();
    const at::Tensor xh =
        from_nhwc(decompress_saved(ctx, saved, nhwc ? 3 : 1, ctx->saved_data["quant_groups"].toInt(), mdt), nhwc);
    // the per-channel moments: forward's from the codes, else the BatchNorm statistics kernel
    // (batchnorm.code_moments)
    auto [xh_mean, var] = saved.size() == 7 ? std::tuple{saved[5], saved[6]}
                                            : at::batch_norm_update_stats(xh, std::nullopt, std::nullopt, 0.0);
    const at::Tensor invstd_m = invstd.to(mdt);
    const at::Tensor s = restandardise(var, invstd_m, eps);
    // dx's per-channel invstd / s rides in the weight (batchnorm.bn_backward)
    const at::Tensor w = weight.to(mdt);
    auto [dx, dw, db] = at::native_batch_norm_backward(grads[0].to(mdt), xh, w * (invstd_m / s), std::nullopt,
                                                        std::nullopt, xh_mean, s, true, eps,
                                                        {need_x, need_w || link, need_b});
    variable_list out = norm_grads(ctx, dx, dw, db, need_x, need_w, need_b);
    if (link) {  // the conv in front takes its weight gradient from here (batchnorm.bn_backward's coef)
      link->coef = w.mul(dw).mul(at::rsub(exact_mean_square(invstd_m, eps), 1));
      link->gx = out[0];
    }
    out.resize(12);  // (one per argument of forward)
    return out;
  }

  // Whether x's codes (batch_norm_train_take) can be x_hat's: the default format with one group
  // per channel (each group a channel, whose range and offset invstd and mean map), of x_hat's
  // shape on its device, and in x_hat's order: a conv leaves codes in x's own (NCHW or NHWC,
  // nhwc_view), and x_hat can be channels-last where a strided x is not (empty_like); the shape
  // alone cannot tell them apart where C == H == W (the review's find: dweight 177% off)
  static bool codes_of_x_fit(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x,
                             const NhwcView& v, const Quantizer& qz) {
    const int64_t C = v.x.size(v.dim);
    return qz.code_bits == 0 && q.scalar_type() == at::kByte && q.sizes() == v.x.sizes() &&
           nhwc_view(x, 1).permuted == v.permuted && q.device() == v.x.device() && alpha.dim() == 2 &&
           alpha.size(1) == C && beta.sizes() == alpha.sizes() && capped_groups(qz, C) == C;
  }
};

at::Tensor batch_norm_train(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, double momentum, double eps,
                            at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                            int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() >= 2, "mesa: batch_norm_train: x must be (N, C, ...), got ", x.dim(), " dims");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::batch_norm_train");
  return BatchNormTrain::apply(x, weight, bias, present(running_mean), present(running_var), momentum, eps, qz,
                               false, std::nullopt, std::nullopt, std::nullopt)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_offer(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps, at::Tensor& alpha_est,
    at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng, int64_t num_groups, double decay,
    int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() == 4, "mesa: batch_norm_train_offer: x must be (N, C, H, W), got ", x.dim(), " dims");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::batch_norm_train_offer");
  const variable_list r = apply_forgetting_marks<BatchNormTrain>(x, weight, bias, present(running_mean),
                                                                 present(running_var), momentum, eps, qz, true,
                                                                 std::nullopt, std::nullopt, std::nullopt);
  return {r[0], r[1], r[2], r[3]};
}

at::Tensor batch_norm_train_take(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const std::optional<at::Tensor>& running_mean,
                                 const std::optional<at::Tensor>& running_var, double momentum, double eps,
                                 const at::Tensor& x_q, const at::Tensor& x_alpha, const at::Tensor& x_beta,
                                 at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                                 int64_t num_groups, double decay, int64_t estimator, bool symmetric,
                                 bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() == 4, "mesa: batch_norm_train_take: x must be (N, C, H, W), got ", x.dim(), " dims");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::batch_norm_train_take");
  return BatchNormTrain::apply(x, weight, bias, present(running_mean), present(running_var), momentum, eps, qz,
                               false, std::optional<at::Tensor>(x_q), std::optional<at::Tensor>(x_alpha),
                               std::optional<at::Tensor>(x_beta))[0];
}

// ----------------------------------------------------------------------------- GroupNorm
// groupnorm._GroupNormFn: x_hat per (sample, group) in 8 bits (groups along the channel dim)
// and the per-(sample, group) rstd; backward re-standardises the dequantized x_hat per
// (sample, group) and runs ATen's group-norm backward on it.
at::Tensor grouped(const at::Tensor& t, int64_t groups) { return t.reshape({t.size(0), groups, -1}); }

// groupnorm._per_channel: a per-(sample, group) (N, G) tensor as (N, C, 1, ...), broadcasting
// over `like` in its own layout
at::Tensor per_sample_channel(const at::Tensor& t, int64_t groups, const at::Tensor& like) {
  std::vector<int64_t> shape(like.dim(), 1);
  shape[0] = like.size(0);
  shape[1] = like.size(1);
  return t.repeat_interleave(like.size(1) / groups, 1).view(shape);
}

// groupnorm._group_norm_format: the layout torch.group_norm makes its input contiguous in
at::MemoryFormat group_norm_format(const at::Tensor& x) {
  return x.is_cpu() ? x.suggest_memory_format() : at::MemoryFormat::Contiguous;
}

struct GroupNormTrain : public torch::autograd::Function<GroupNormTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, int64_t groups, double eps, Quantizer qz) {
    const int64_t n = x_in.size(0), c = x_in.size(1), hxw = c10::multiply_integers(x_in.sizes().slice(2));
    // what F.group_norm runs (torch.group_norm -> native_group_norm, which also hands back the
    // per-(sample, group) mean and rstd it normalised with), x made contiguous first as
    // torch.group_norm does (torch 2.11's CPU kernel refuses a strided x, CUDA's a channels-last one)
    const auto fmt = group_norm_format(x_in);
    const at::Tensor x = x_in.contiguous(fmt);
    auto [out, mean, rstd] = at::native_group_norm(x, weight, bias, n, c, hxw, groups, eps);
    const auto mdt = at::promote_types(x.scalar_type(), at::kFloat);
    at::Tensor x_hat;
    {
      NoAutocast no_autocast;
      x_hat = standardise(x, per_sample_channel(mean.to(mdt), groups, x), per_sample_channel(rstd.to(mdt), groups, x));
    }
    const NhwcView v = nhwc_view(x_hat, 1);
    auto [q, alpha, beta, G] = compress(v.x, v.dim, qz);
    save_code_format(ctx, qz, v.x.sizes());
    ctx->save_for_backward({q, alpha, beta, rstd, weight});
    // (no bias: timm's GroupNorm1NoBias, PoolFormerV2's norms; its dtype then is never read)
    save_norm_meta(ctx, G, eps, mdt, x, weight, bias.has_value() ? *bias : weight);
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["nhwc"] = v.permuted;
    ctx->saved_data["fmt"] = static_cast<int64_t>(fmt);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("GroupNorm");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &rstd = saved[3], &weight = saved[4];
    const auto mdt = ctx->saved_data["mdt"].toScalarType();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    // (needs_input_grad counts the tensors apply tracked: no index 2 without a bias)
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    const bool nhwc = ctx->saved_data["nhwc"].toBool();
    const auto fmt = static_cast<at::MemoryFormat>(ctx->saved_data["fmt"].toInt());
    const int64_t quant_groups = ctx->saved_data["quant_groups"].toInt();
    const at::Tensor xh =
        from_nhwc(decompress_saved(ctx, saved, nhwc ? 3 : 1, quant_groups, mdt), nhwc).contiguous(fmt);
    const int64_t n = xh.size(0), c = xh.size(1), hxw = c10::multiply_integers(xh.sizes().slice(2));
    auto [var, xh_mean] = at::var_mean(grouped(xh, groups), at::IntArrayRef{-1}, /*correction=*/0, false);
    const at::Tensor rstd_m = rstd.to(mdt);
    const at::Tensor s = restandardise(var, rstd_m, eps);  // per (sample, group)
    auto [dx, dw, db] = at::native_group_norm_backward(grads[0].to(mdt).contiguous(fmt), xh, xh_mean, s,
                                                       weight.to(mdt), n, c, hxw, groups, {need_x, need_w, need_b});
    variable_list out = norm_grads(ctx, need_x ? dx * per_sample_channel(rstd_m / s, groups, dx) : dx, dw, db, need_x,
                                   need_w, need_b);
    out.resize(6);  // (one per argument of forward)
    return out;
  }
};

at::Tensor group_norm_train(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            int64_t groups, double eps, at::Tensor& alpha_est, at::Tensor& beta_est,
                            at::Tensor& initialized, at::Tensor& rng, int64_t num_groups, double decay,
                            int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() >= 2, "mesa: group_norm_train: x must be (N, C, ...), got ", x.dim(), " dims");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::group_norm_train");
  return GroupNormTrain::apply(x, weight, present(bias), groups, eps, qz);
}

// ----------------------------------------------------------------------------- ReLU, Hardtanh, Hardsigmoid
// One 1-bit mask kept, no quantizer: the ReLU's !(y <= 0) (relu.py, _ReLUFn); for the clamps
// (clamp_activations.py, _ClampMaskFn: Hardtanh, ReLU6, Hardsigmoid) whether x was inside the
// open interval (lo, hi) where the derivative is not zero, taken before an in-place op
// overwrites x. In place: x itself is the output, marked dirty, as the Python Functions do.
enum class Masked : int64_t { kRelu = 0, kHardtanh = 1, kHardsigmoid = 2 };

struct MaskTrain : public torch::autograd::Function<MaskTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t kind, double lo, double hi,
                            bool inplace) {
    const auto k = static_cast<Masked>(kind);
    at::Tensor& xm = const_cast<at::Tensor&>(x);
    std::pair<at::Tensor, bool> packed;  // (the clamps: whether x is inside (lo, hi), before the op)
    if (k != Masked::kRelu) packed = pack_compare(x, Compare::kInside, lo, hi);
    at::Tensor y;  // exactly the stock module's forward
    if (k == Masked::kRelu) y = inplace ? at::relu_(xm) : at::relu(x);
    if (k == Masked::kHardtanh) y = inplace ? at::hardtanh_(xm, lo, hi) : at::hardtanh(x, lo, hi);
    if (k == Masked::kHardsigmoid) y = inplace ? at::hardsigmoid_(xm) : at::hardsigmoid(x);
    if (inplace) {
      ctx->mark_dirty({x});
      y = x;
    }
    if (k == Masked::kRelu) packed = pack_compare(y, Compare::kGreaterOrNaN, 0, 0);
    const auto& [bits, channels_last] = packed;
    ctx->save_for_backward({bits});
    ctx->saved_data["cl"] = channels_last;
    ctx->saved_data["shape"] = y.sizes();
    ctx->saved_data["kind"] = kind;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("activation");
    const auto saved = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const bool channels_last = ctx->saved_data["cl"].toBool();
    const at::Tensor none;
    if (static_cast<Masked>(ctx->saved_data["kind"].toInt()) == Masked::kHardsigmoid) {
      // ATen's own kernel (its g * 1/6 rounding), on 0 inside and 3 (outside) elsewhere
      const at::Tensor bytes = unpack_bit_bytes(saved[0], shape, channels_last);  // (nonzero where set)
      return {at::hardsigmoid_backward(grads[0], bytes.eq(0).to(grads[0].scalar_type()).mul(3)), none, none, none,
              none};
    }
    // stock ReLU's own backward, threshold_backward(g, y, 0) (0 where y <= 0, else g: a NaN's g
    // passes), with the mask for y: the Python Functions' bits (their where(mask, g, 0)); one pass
    // from the bits on the CPU (bitmask.cpp), two kernels elsewhere where unpacking to a boolean
    // and masked_fill took six
    return {masked_grad(grads[0], saved[0], shape, channels_last), none, none, none, none};
  }
};

at::Tensor mask_train(const at::Tensor& x, int64_t kind, double lo, double hi) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "mesa: mask_train: kind must be 0 (relu), 1 (hardtanh) or 2 ",
                    "(hardsigmoid), got ", kind);
  return MaskTrain::apply(x, kind, lo, hi, false);
}
at::Tensor& mask_train_(at::Tensor& x, int64_t kind, double lo, double hi) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "mesa: mask_train_: kind must be 0 (relu), 1 (hardtanh) or 2 ",
                    "(hardsigmoid), got ", kind);
  apply_forgetting_marks<MaskTrain>(x, kind, lo, hi, true);  // (returns x itself, its history rebased on the node)
  return x;
}

// ----------------------------------------------------------------------------- SiLU, QuickGELU, Hardswish
// y = f(x) keeping a compressed x (channel groups, the NHWC view of a channels-last x); Hardswish also
// keeps which side of -3 and 3 each element is on (two 1-bit masks: activations._HardswishFn)
enum class Elementwise : int64_t { kSilu = 0, kQuickGelu = 1, kHardswish = 2 };

at::Tensor quick_gelu(const at::Tensor& x) { return x * at::sigmoid(x * 1.702); }  // activations.quick_gelu

struct ElementwiseTrain : public torch::autograd::Function<ElementwiseTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t kind, Quantizer qz) {
    const auto k = static_cast<Elementwise>(kind);
    at::Tensor y = k == Elementwise::kSilu ? at::silu(x) : k == Elementwise::kQuickGelu ? quick_gelu(x)
                                                                                         : at::hardswish(x);
    const NhwcView v = nhwc_view(x, group_dim(x));
    auto [q, alpha, beta, G] = compress(v.x, v.dim, qz);
    save_code_format(ctx, qz, v.x.sizes());
    if (k == Elementwise::kHardswish) {  // hardswish_backward's own comparisons (torch 2.14: -3 gets 0, 3 gets g)
      const auto [below, above, channels_last] = pack_outside(x, -3, 3);
      ctx->save_for_backward({q, alpha, beta, below, above});
      ctx->saved_data["cl"] = channels_last;  // (both masks': x's)
    } else {
      ctx->save_for_backward({q, alpha, beta});
    }
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["nhwc"] = v.permuted;
    ctx->saved_data["dim"] = v.dim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["y_dtype"] = y.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("activation");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto k = static_cast<Elementwise>(ctx->saved_data["kind"].toInt());
    const auto cdt = ctx->saved_data["y_dtype"].toScalarType();
    const at::Tensor xh = from_nhwc(decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(),
                                                     ctx->saved_data["groups"].toInt(), cdt),
                                    ctx->saved_data["nhwc"].toBool());
    const at::Tensor g = grads[0].to(cdt);
    at::Tensor gx;
    if (k == Elementwise::kSilu) {
      gx = at::silu_backward(g, xh);
    } else if (k == Elementwise::kQuickGelu) {
      gx = g * quick_gelu_grad(xh);
    } else {  // stock's arithmetic on the masks and xh (hardswish_grad.h)
      gx = hardswish_masked_grad(g, xh, saved[3], saved[4], ctx->saved_data["shape"].toIntVector(),
                                 ctx->saved_data["cl"].toBool());
    }
    return {gx.to(ctx->saved_data["x_dtype"].toScalarType()), at::Tensor(), at::Tensor()};
  }
};

at::Tensor elementwise_train(const at::Tensor& x, int64_t kind, at::Tensor& alpha_est, at::Tensor& beta_est,
                             at::Tensor& initialized, at::Tensor& rng, int64_t num_groups, double decay,
                             int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "mesa: elementwise_train: kind must be 0 (silu), 1 (quick_gelu) or 2 ",
                    "(hardswish), got ", kind);
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::elementwise_train");
  return ElementwiseTrain::apply(x, kind, qz);
}

// ----------------------------------------------------------------------------- MaxPool2d
// maxpool._MaxPool2dFn: the stock forward, keeping per output element only which element of
// its window it took (uint8 lh * kW + lw); backward rebuilds ATen's int64 per-plane index from
// it and calls the stock backward kernel, so the gradient is bitwise stock's. The index
// arithmetic (maxpool_index.cpp) is the Python Function's ops on CUDA, one loop on the CPU.
struct MaxPool2dTrain : public torch::autograd::Function<MaxPool2dTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
    const auto [out, idx] = at::max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode);
    ctx->save_for_backward({window_local_index(idx, x.size(-2), x.size(-1), kernel, stride, padding, dilation)});
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["ceil_mode"] = ceil_mode;
    // what the backward kernel reads of the input: sizes, dtype and the layout it gives the gradient
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["dtype"] = x.scalar_type();
    ctx->saved_data["format"] = static_cast<int64_t>(x.suggest_memory_format());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("MaxPool2d");
    const at::Tensor local = ctx->get_saved_variables()[0];
    const auto kernel = ctx->saved_data["kernel"].toIntVector(), stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const at::Tensor idx = global_index(local, shape.back(), kernel, stride, padding, dilation);
    const at::Tensor x_like =  // never read, only its sizes and layout
        at::empty(shape, local.options()
                             .dtype(ctx->saved_data["dtype"].toScalarType())
                             .memory_format(static_cast<at::MemoryFormat>(ctx->saved_data["format"].toInt())));
    const at::Tensor gx = at::max_pool2d_with_indices_backward(grads[0], x_like, kernel, stride, padding, dilation,
                                                               ctx->saved_data["ceil_mode"].toBool(), idx);
    const at::Tensor none;
    return {gx, none, none, none, none, none};
  }
};

at::Tensor max_pool2d_train(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  for (const auto& [name, arg] : {std::pair{"kernel_size", kernel}, std::pair{"stride", stride},
                                  std::pair{"padding", padding}, std::pair{"dilation", dilation}}) {
    TORCH_CHECK_VALUE(arg.size() == 2, "mesa: max_pool2d_train: ", name, " must have 2 values, got ", arg);
  }
  TORCH_CHECK_VALUE(kernel[0] * kernel[1] <= 256, "mesa: max_pool2d_train: the window (", kernel,
                    ") must hold at most 256 elements (a uint8 local index); use the stock op");
  return MaxPool2dTrain::apply(x, kernel, stride, padding, dilation, ceil_mode);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // The running statistics are updated in place (momentum: the factor nn.BatchNorm2d hands
  // F.batch_norm), the quantizer's buffers as by mesa::observe.
  m.def(
      "batch_norm_train(Tensor x, Tensor weight, Tensor bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "float momentum, float eps, Tensor(c!) alpha_est, Tensor(d!) beta_est, Tensor(e!) initialized, "
      "Tensor(f!) rng, int num_groups, float decay, int estimator, bool symmetric, bool stochastic) -> Tensor");
  // the same, x's codes returned beside y for the convs that take x next (empty where it has none)
  m.def(
      "batch_norm_train_offer(Tensor x, Tensor weight, Tensor bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, float momentum, float eps, Tensor(c!) alpha_est, Tensor(d!) beta_est, "
      "Tensor(e!) initialized, Tensor(f!) rng, int num_groups, float decay, int estimator, bool symmetric, "
      "bool stochastic) -> (Tensor y, Tensor q, Tensor alpha, Tensor beta)");
  // batch_norm_train keeping x's codes another layer made (x_q, x_alpha, x_beta: the offer's
  // outputs, or a conv's) as x_hat's where they fit, else compressing x_hat itself
  m.def(
      "batch_norm_train_take(Tensor x, Tensor weight, Tensor bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, float momentum, float eps, Tensor x_q, Tensor x_alpha, Tensor x_beta, "
      "Tensor(c!) alpha_est, Tensor(d!) beta_est, Tensor(e!) initialized, Tensor(f!) rng, int num_groups, "
      "float decay, int estimator, bool symmetric, bool stochastic) -> Tensor");
  // groups: the norm's own group count (nn.GroupNorm's num_groups); num_groups: the quantizer's
  m.def(
      "group_norm_train(Tensor x, Tensor weight, Tensor? bias, int groups, float eps, Tensor(a!) alpha_est, "
      "Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, int num_groups, float decay, int estimator, "
      "bool symmetric, bool stochastic) -> Tensor");
  // ReLU (kind 0), Hardtanh / ReLU6 (1: clamped to [lo, hi]), Hardsigmoid (2: lo, hi = -3, 3),
  // keeping a 1-bit mask and no estimates; mask_train_ is the inplace=True module: x itself,
  // overwritten
  m.def("mask_train(Tensor x, int kind, float lo, float hi) -> Tensor");
  m.def("mask_train_(Tensor(a!) x, int kind, float lo, float hi) -> Tensor(a!)");
  // kind: 0 silu, 1 quick_gelu (x * sigmoid(1.702 x)), 2 hardswish
  m.def(
      "elementwise_train(Tensor x, int kind, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, bool stochastic) -> Tensor");
  // nn.MaxPool2d (return_indices=False, a window of at most 256 elements), keeping a uint8
  // window-local index per output element
  m.def("max_pool2d_train(Tensor x, int[2] kernel, int[2] stride, int[2] padding, int[2] dilation, "
        "bool ceil_mode) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) {
  m.impl("batch_norm_train", &mesa::batch_norm_train);
  m.impl("batch_norm_train_offer", &mesa::batch_norm_train_offer);
  m.impl("batch_norm_train_take", &mesa::batch_norm_train_take);
  m.impl("group_norm_train", &mesa::group_norm_train);
  m.impl("mask_train", &mesa::mask_train);
  m.impl("mask_train_", &mesa::mask_train_);
  m.impl("elementwise_train", &mesa::elementwise_train);
  m.impl("max_pool2d_train", &mesa::max_pool2d_train);
}
