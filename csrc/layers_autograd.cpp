// Eager fast path of the Mesa GELU, Softmax, Linear, LayerNorm, MatMul and Conv2d layers: the whole layer (stock forward,
// compression, backward from the 8-bit copy) as one op whose autograd node is C++.
//
// Why: a Python torch.autograd.Function costs about 100 us of host time per layer and step
// (Function.apply, ctx bookkeeping, the Python backward), several times the time of the
// kernels themselves on small tensors (results/overhead/). These ops do exactly what the
// Python Functions in mesa_train/nn/gelu.py, softmax.py, linear.py, layernorm.py, matmul.py and conv.py do, op for op (the same aten
// kernels and mesa::observe / quantize / dequantize), so outputs, codes, estimates and
// gradients are bitwise the Python path's (tests/test_layers_autograd.py). The Python
// layers call them only in eager mode with a channel format (8-bit, or a variant:
// layers_common.h, make_quantizer); under torch.compile and for the other formats
// (patch4x4, learned thresholds) they keep their Python Functions.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "layers_common.h"
#include "mesa_common.h"
#include "scale_link.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// ----------------------------------------------------------------------------- GELU
struct GeluTrain : public torch::autograd::Function<GeluTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Quantizer qz, std::string approximate) {
    at::Tensor y = at::gelu(x, approximate);  // exactly nn.GELU.forward
    const NhwcView v = nhwc_view(x, group_dim(x));
    auto [q, alpha, beta, G] = compress(v.x, v.dim, qz);
    save_code_format(ctx, qz, v.x.sizes());
    ctx->save_for_backward({q, alpha, beta});
    ctx->saved_data["nhwc"] = v.permuted;
    ctx->saved_data["dim"] = v.dim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["y_dtype"] = y.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("GELU");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["y_dtype"].toScalarType();
    const bool nhwc = ctx->saved_data["nhwc"].toBool();
    const int64_t dim = ctx->saved_data["dim"].toInt(), groups = ctx->saved_data["groups"].toInt();
    const auto approximate = ctx->saved_data["approximate"].toStringRef();
    at::Tensor gx;
    if (approximate == "none" && !variant_codes(ctx)) {  // one op from the 8-bit codes (gelu.py)
      gx = from_nhwc(gelu_backward_op().call(to_nhwc(grads[0].to(cdt), nhwc), saved[0], saved[1], saved[2], dim,
                                             groups, std::nullopt),
                     nhwc);
    } else {
      at::Tensor xh = from_nhwc(decompress_saved(ctx, saved, dim, groups, cdt), nhwc);
      gx = at::gelu_backward(grads[0].to(cdt), xh, approximate);
    }
    return {gx.to(ctx->saved_data["x_dtype"].toScalarType()), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gelu_train(const at::Tensor& x, at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized,
                      at::Tensor& rng, int64_t num_groups, double decay, int64_t estimator, bool symmetric,
                      bool stochastic, c10::string_view approximate) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::gelu_train");
  return GeluTrain::apply(x, qz, std::string(approximate));
}

// ----------------------------------------------------------------------------- Softmax
// torch.finfo(dtype).tiny: the smallest positive normal number
double smallest_normal(c10::ScalarType t) {
  switch (t) {
    case at::kDouble: return std::numeric_limits<double>::min();
    case at::kHalf: return 6.103515625e-05;  // 2**-14
    default: return std::numeric_limits<float>::min();  // float32 and bfloat16: 2**-126
  }
}

// Outputs (y, q, alpha, beta): the codes and statistics are outputs too, so that the
// attention's `attn @ v` can keep them instead of quantizing y again (Softmax.forward_with_copy).
// out_dtype: y returned cast to it, the cast autocast's `attn @ v` would make, made inside the
// node and before the compression (the copy is the map the product consumes, half the bytes
// to read): the gradient arrives in that dtype and backward is one op with no cast around it
// (mesa_train/nn/softmax.py, _SoftmaxFn). Backward dequantizes through the softmax's dtype.
struct SoftmaxTrain : public torch::autograd::Function<SoftmaxTrain> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t softmax_dim, Quantizer qz,
                               std::optional<at::ScalarType> out_dtype) {
    at::Tensor y = at::softmax(x, softmax_dim);  // exactly nn.Softmax.forward (dim resolved)
    const at::ScalarType y_dtype = y.scalar_type();
    if (out_dtype.has_value() && *out_dtype != y_dtype) y = y.to(*out_dtype);
    auto [q, alpha, beta, G] = compress(y, group_dim(y), qz);
    ctx->save_for_backward({q, alpha, beta});
    save_code_format(ctx, qz, y.sizes());
    ctx->saved_data["dim"] = group_dim(y);
    ctx->saved_data["groups"] = G;
    ctx->saved_data["softmax_dim"] = softmax_dim;
    ctx->saved_data["y_dtype"] = y_dtype;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->mark_non_differentiable({q, alpha, beta});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for those three outputs
    return {y, q, alpha, beta};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Softmax");
    const at::Tensor none;
    if (!grads[0].defined()) return {none, none, none, none};  // y did not reach the loss
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto ydt = ctx->saved_data["y_dtype"].toScalarType(), xdt = ctx->saved_data["x_dtype"].toScalarType();
    const int64_t gdim = ctx->saved_data["dim"].toInt(), groups = ctx->saved_data["groups"].toInt();
    const int64_t sdim = ctx->saved_data["softmax_dim"].toInt(), last = saved[0].dim() - 1;
    const at::Tensor& g = grads[0];
    // one op where every row has one (alpha, beta) and the codes are the default 8-bit format's
    // (mesa_train/nn/softmax.py: fused_backward, _fused_backward); a half g with a float32 map
    // (autocast) goes in as it is, the result in x's dtype (g's, or float32 logits: Swin's):
    // the op's y_dtype / out_dtype stand for the casts around it
    if (sdim == last && gdim != last && !variant_codes(ctx)) {
      const auto gdt = g.scalar_type();
      if ((ydt == gdt || ydt == at::kFloat) && (xdt == gdt || (xdt == at::kFloat && ydt == at::kFloat)))
        return {softmax_backward_op().call(g, saved[0], saved[1], saved[2], gdim, groups, ydt, xdt), none, none,
                none};
      at::Tensor gx = softmax_backward_op().call(g.to(ydt), saved[0], saved[1], saved[2], gdim, groups, std::nullopt,
                                                 std::nullopt);
      return {gx.to(xdt), none, none, none};
    }
    at::Tensor yh = decompress_saved(ctx, saved, gdim, groups, ydt);
    // each row rescaled to sum to 1 (mesa_train/nn/softmax.py: keeps the exactly-zero stock
    // gradient of a bias added to a whole row); an all-zero row stays 0 (0 / tiny)
    yh = yh / yh.sum({sdim}, true).clamp_min(smallest_normal(ydt));
    at::Tensor gx = at::_softmax_backward_data(g.to(ydt), yh, sdim, ydt);
    return {gx.to(xdt), none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> softmax_train(
    const at::Tensor& x, int64_t softmax_dim, at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized,
    at::Tensor& rng, int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
    std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(!out_dtype.has_value() || at::isFloatingType(*out_dtype), "mesa: softmax_train: out_dtype ",
                    *out_dtype, " is not a floating dtype; valid: None, torch.float32, torch.bfloat16, torch.float16");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::softmax_train");
  auto out = apply_forgetting_marks<SoftmaxTrain>(x, softmax_dim, qz, out_dtype);
  return {out[0], out[1], out[2], out[3]};
}

// ----------------------------------------------------------------------------- Linear
// x made contiguous once for its ops (each would copy a strided x), then compressed along
// dim, with its row exponents over the last row_dims dims when max_k > 0 (k undefined
// otherwise): observe_rows (the exponents and the statistics, one pass over x for channel
// groups) + quantize, or for the delayed estimator row_exponents + quantize_observe (the
// exponents must exist before its single pass quantizes). The C++ layers and mesa::compress
// share it: the same kernels in the same order. row_mean / row_rstd (a LayerNorm's, float32,
// or undefined): x is compressed as x_hat = (x - mean) * rstd, which the two kernels compute
// themselves (on CUDA x_hat never reaches memory), also without row scales (max_k = 0: every
// k is 0, so the statistics and codes are observe's and quantize's; k is not returned); the
// delayed estimator compresses a float32 copy of x_hat (normalized_rows: the same values).
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, at::Tensor> compress_with_rows(
    const at::Tensor& x_in, int64_t dim, Quantizer& qz, int64_t row_dims, int64_t max_k,
    const at::Tensor& row_mean = at::Tensor(), const at::Tensor& row_rstd = at::Tensor()) {
  const bool norm = row_mean.defined();
  if (qz.code_bits != 0) {  // a variant format: rowscale.compress_normalized / ActivationQuantizer._compress's
    // order: the normalised copy, its row exponents, the scaled copy, then observe + quantize_bits
    const at::Tensor xn = norm ? normalized_rows(x_in, row_mean, row_rstd) : x_in;
    at::Tensor k;
    if (max_k > 0) k = row_exponents_op().call(xn, row_dims, max_k);
    const at::Tensor x = k.defined() ? xn * at::exp2(k.to(xn.scalar_type())) : xn;  // reference.scale_rows
    auto [q, alpha, beta, G] = compress(x, dim, qz);
    return {q, alpha, beta, G, k};
  }
  if ((max_k > 0 || norm) && qz.estimator != kDelayed) {
    const at::Tensor x = x_in.contiguous();
    const int64_t G = capped_groups(qz, x.size(dim));
    const auto mean = norm ? std::optional<at::Tensor>(row_mean) : std::nullopt;
    const auto rstd = norm ? std::optional<at::Tensor>(row_rstd) : std::nullopt;
    auto [alpha, beta, seed, k] =
        observe_rows_op().call(x, qz.alpha_est, qz.beta_est, qz.initialized, qz.rng, dim, G, qz.decay,
                               qz.estimator == kPerSample, qz.symmetric, row_dims, max_k, mean, rstd);
    at::Tensor q = quantize_op().call(x, alpha, beta, dim, G, qz.stochastic, seed, k, mean, rstd);
    return {q, alpha, beta, G, max_k > 0 ? k : at::Tensor()};
  }
  // (without row exponents compress copies x only where the kernels cannot read it in place)
  const at::Tensor x = norm ? normalized_rows(x_in, row_mean, row_rstd) : max_k > 0 ? x_in.contiguous() : x_in;
  at::Tensor k;
  if (max_k > 0) k = row_exponents_op().call(x, row_dims, max_k);
  auto [q, alpha, beta, G] = compress(x, dim, qz, k.defined() ? std::optional<at::Tensor>(k) : std::nullopt);
  return {q, alpha, beta, G, k};
}

// mesa_train.nn.rowscale.compress_rows: x compressed with channel groups over its last dim,
// its rows far below the others scaled by 2**k when row_scale is on (k undefined otherwise):
// compress_with_rows (observe_rows + quantize, or row_exponents + quantize_observe for the
// delayed estimator); the kernels scale the rows themselves (no scaled copy).
// `other` is the layer's other dtype (max_exponent: 14 with float16 involved).
// (In mesa::layers, declared in layers_common.h: scale_autograd.cpp's layer calls it too.)
}  // namespace
namespace layers {
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, at::Tensor> compress_rows(
    const at::Tensor& x, c10::ScalarType other, int64_t row_dims, bool row_scale, Quantizer& qz) {
  const bool half = x.scalar_type() == at::kHalf || other == at::kHalf;
  return compress_with_rows(x, x.dim() - 1, qz, row_dims, row_scale ? (half ? 14 : 64) : 0);
}
}  // namespace layers
namespace {

// ----------------------------------------------------------------------------- compress
// mesa::compress: ActivationQuantizer.compress (default format) as one op, for the Python
// Functions (variants aside) in eager and under torch.compile. Why one op: Inductor hands
// each opaque op its own copy of an input it has not written to memory yet (a clone of a
// strided q/k/v, LayerNorm's x_hat), so row_exponents, observe and quantize, three
// consumers of x, meant up to three copies; as one op, x has one consumer and one copy.
// Eager it is one dispatch instead of two or three. max_k = 0: no row scales (the fourth
// output is then an empty int8 tensor). row_mean / row_rstd (a LayerNorm's float32 statistics,
// both or neither): x is compressed as x_hat = (x - mean) * rstd, computed by the kernels
// (compress_with_rows), so that a traced LayerNorm need not write x_hat for the op to read
// (mesa_train/nn/layernorm.py; under torch.compile Inductor wrote it in float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> compress_op(
    const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est, const at::Tensor& initialized,
    const at::Tensor& rng, int64_t dim, int64_t num_groups, double decay, int64_t estimator, bool symmetric,
    bool stochastic, int64_t row_dims, int64_t max_k, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd) {
  TORCH_CHECK(estimator == kRunning || estimator == kPerSample || estimator == kDelayed,
              "mesa::compress: estimator must be 0 (running), 1 (per_sample) or 2 (delayed), got ", estimator);
  const bool has_mean = row_mean.has_value() && row_mean->defined();
  const bool has_rstd = row_rstd.has_value() && row_rstd->defined();
  TORCH_CHECK_VALUE(has_mean == has_rstd, "mesa: compress: row_mean and row_rstd go together (LayerNorm's per-row "
                    "mean and rstd); got only ", has_mean ? "row_mean" : "row_rstd");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::compress");
  auto [q, alpha, beta, G, k] = compress_with_rows(x, dim, qz, row_dims, max_k, has_mean ? *row_mean : at::Tensor(),
                                                   has_rstd ? *row_rstd : at::Tensor());
  return {q, alpha, beta, k.defined() ? k : at::empty({0}, x.options().dtype(at::kChar))};
}

// mesa_train.nn.linear.not_a_view: F.linear's 3-D output is a view of addmm's; autograd
// forbids in-place use of a custom op's view output, which a stock Linear allows.
at::Tensor not_a_view(const at::Tensor& out) {
  if (!out.is_view()) return out;
  return out.is_contiguous() ? at::_unsafe_view(out, out.sizes()) : out.clone();
}

// F.linear's dtypes for its backward (LinearTrain, GeluLinearTrain): the compute dtype (the
// output's), the parameters' and whether a bias was tracked
void save_linear_dtypes(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  ctx->saved_data["cdt"] = out.scalar_type();
  ctx->saved_data["w_dtype"] = weight.scalar_type();
  ctx->saved_data["has_bias"] = bias.has_value();
  ctx->saved_data["b_dtype"] = bias.has_value() ? bias->scalar_type() : out.scalar_type();
}

// F.linear's gradients from its output's (mesa_train.nn.linear.linear_grads): gx in x_dtype
// (need_x), gw from the input that input() rebuilds in the compute dtype (need_w), gb where a
// bias was tracked at bias_index (needs_input_grad counts the tensors Function::apply
// tracked: no bias index without a bias; -1: no bias gradient from this call)
template <typename Input>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_grads(AutogradContext* ctx, const at::Tensor& grad,
                                                           const at::Tensor& weight, c10::ScalarType x_dtype,
                                                           bool need_x, bool need_w, int64_t bias_index,
                                                           Input input) {
  const auto cdt = ctx->saved_data["cdt"].toScalarType();
  at::Tensor g = grad.to(cdt), gx, gw, gb;
  if (need_x) gx = g.matmul(weight.to(cdt)).to(x_dtype);
  at::Tensor g2 = g.reshape({-1, g.size(-1)});
  if (need_w) {
    at::Tensor x = input();
    gw = g2.t().matmul(x.reshape({-1, x.size(-1)})).to(ctx->saved_data["w_dtype"].toScalarType());
  }
  if (bias_index >= 0 && ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(bias_index))
    gb = g2.sum(0).to(ctx->saved_data["b_dtype"].toScalarType());
  return {gx, gw, gb};
}

// A parallel layer's codes of the same input (input_copy.py): [q, alpha, beta, k] (k empty
// without row scales), or none
struct SharedRows {
  at::Tensor q, alpha, beta, k;
};

std::optional<SharedRows> shared_rows(at::TensorList t, const char* op) {
  if (t.empty()) return std::nullopt;
  TORCH_CHECK_VALUE(t.size() == 4, op, ": a shared copy is [q, alpha, beta, k], got ", t.size(), " tensors");
  return SharedRows{t[0], t[1], t[2], t[3].numel() ? t[3] : at::Tensor()};
}

// shared: the codes another Mesa Linear made of this very input (parallel projections of one
// tensor keep one copy: nn/input_copy.py), saved here instead of compressing again; otherwise
// the codes made here are returned beside the output for the next one (empty where none were made).
struct LinearTrain : public torch::autograd::Function<LinearTrain> {
  // (bias optional, not an undefined Tensor: Function::apply tracks only present tensors)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, Quantizer qz, bool row_scale,
                               std::optional<SharedRows> shared) {
    const at::Tensor xc = autocast_input(x);  // (under autocast: half the bytes to compress)
    at::Tensor out = at::linear(xc, weight, bias);
    at::Tensor q, alpha, beta, k;
    int64_t G = 0;
    const bool made_here = weight.requires_grad() && !shared.has_value();
    if (made_here) {  // the input copy serves the weight gradient only
      std::tie(q, alpha, beta, G, k) = compress_rows(xc, out.scalar_type(), 1, row_scale, qz);
    } else if (weight.requires_grad()) {  // (the producer's options, dtypes and autocast are this call's)
      q = shared->q, alpha = shared->alpha, beta = shared->beta, k = shared->k;
      G = capped_groups(qz, xc.size(-1));
    }
    if (weight.requires_grad()) save_code_format(ctx, qz, xc.sizes());
    ctx->save_for_backward({q, alpha, beta, x.requires_grad() ? weight : at::Tensor(), k});
    ctx->saved_data["dim"] = x.dim() - 1;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    save_linear_dtypes(ctx, out, weight, bias);
    if (!made_here) {
      q = no_codes(x), alpha = no_codes(x), beta = no_codes(x), k = no_codes(x);
    } else if (!k.defined()) {
      k = no_codes(x);
    }
    ctx->mark_non_differentiable({q, alpha, beta, k});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the codes
    return {not_a_view(out), q, alpha, beta, k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Linear");
    if (!grads[0].defined()) return variable_list(6);  // (materialize off: the output took no gradient)
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    auto [gx, gw, gb] = linear_grads(
        ctx, grads[0], saved[3], ctx->saved_data["x_dtype"].toScalarType(), ctx->needs_input_grad(0),
        ctx->needs_input_grad(1), 2, [&] {
          return decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(), ctx->saved_data["groups"].toInt(),
                                  ctx->saved_data["cdt"].toScalarType(), saved[4]);
        });
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_train(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, at::Tensor& alpha_est,
    at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng, int64_t num_groups, double decay,
    int64_t estimator, bool symmetric, bool stochastic, bool row_scale, at::TensorList shared_x) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::linear_train");
  const variable_list r = apply_forgetting_marks<LinearTrain>(x, weight, present(bias), qz, row_scale,
                                                               shared_rows(shared_x, "mesa::linear_train"));
  return {r[0], r[1], r[2], r[3], r[4]};
}

// ----------------------------------------------------------------------------- GELU + fc2
// mesa_train/nn/gelu_linear.py: fc2(gelu(h)) of a timm Mlp keeping one 8-bit copy, of h
// (compressed as a Linear input: last-dim groups, row scales), for both backward passes;
// fc2's input gelu(h) is recomputed from it in backward.
struct GeluLinearTrain : public torch::autograd::Function<GeluLinearTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, Quantizer qz, std::string approximate,
                            bool row_scale) {
    const at::Tensor y = at::gelu(h, approximate);  // exactly the stock act
    const at::Tensor yc = autocast_input(y);        // the cast at::linear would make under autocast
    at::Tensor out = at::linear(yc, weight, bias);  // exactly the stock fc2
    const bool need_h = h.requires_grad(), need_w = weight.requires_grad();
    at::Tensor q, alpha, beta, k;
    int64_t G = 0;
    if (need_h || need_w) {
      std::tie(q, alpha, beta, G, k) = compress_rows(h, out.scalar_type(), 1, row_scale, qz);
      save_code_format(ctx, qz, h.sizes());
    }
    ctx->save_for_backward({q, alpha, beta, need_h ? weight : at::Tensor(), k});
    ctx->saved_data["dim"] = h.dim() - 1;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["h_dtype"] = h.scalar_type();
    ctx->saved_data["yc_dtype"] = yc.scalar_type();
    save_linear_dtypes(ctx, out, weight, bias);
    return not_a_view(out);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("GELU + Linear");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto hdt = ctx->saved_data["h_dtype"].toScalarType();
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const int64_t dim = ctx->saved_data["dim"].toInt(), groups = ctx->saved_data["groups"].toInt();
    const std::optional<at::Tensor> k = saved[4].defined() ? std::optional<at::Tensor>(saved[4]) : std::nullopt;
    // the exact GELU from 8-bit codes: each backward pass one op from h's codes (on CUDA the
    // dequantized h never reaches memory; Python twin: _GeluLinearFn.backward); the tanh form
    // and the variant formats dequantize h once
    const bool exact = approximate == "none" && !variant_codes(ctx);
    if (exact && saved[0].defined() && ctx->needs_input_grad(0) && ctx->needs_input_grad(1)) {
      // fc2's input gradient gy first (in h's dtype, as stock casts it), then ONE read of h's
      // codes gives both fc2's input gelu(h) (for its weight gradient) and the GELU's gradient
      // (mesa::gelu_value_and_grad: the bits of dequantize_gelu and gelu_backward)
      auto [gy, unused_w, gb] = linear_grads(ctx, grads[0], saved[3], hdt, true, false, 2, [] { return at::Tensor(); });
      auto [y, gh] = gelu_value_and_grad_op().call(gy, saved[0], saved[1], saved[2], dim, groups, k);
      auto [unused_x, gw, unused_b] = linear_grads(ctx, grads[0], saved[3], hdt, false, true, -1, [&] {
        return y.to(ctx->saved_data["yc_dtype"].toScalarType()).to(ctx->saved_data["cdt"].toScalarType());
      });
      return {gh, gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
    }
    at::Tensor hh;
    if (saved[0].defined() && !exact) hh = decompress_saved(ctx, saved, dim, groups, hdt, saved[4]);
    // fc2's backward, its input recomputed in the stock dtypes (gelu in h's, then the cast);
    // its input gradient comes back in h's dtype, as stock casts it
    auto [gy, gw, gb] = linear_grads(ctx, grads[0], saved[3], hdt, ctx->needs_input_grad(0),
                                     ctx->needs_input_grad(1), 2, [&] {
                                       const at::Tensor y = exact ? dequantize_gelu_op().call(saved[0], saved[1],
                                                                                               saved[2], dim, groups,
                                                                                               hdt, k)
                                                                  : at::gelu(hh, approximate);
                                       return y.to(ctx->saved_data["yc_dtype"].toScalarType())
                                           .to(ctx->saved_data["cdt"].toScalarType());
                                     });
    at::Tensor gh;
    if (gy.defined())
      gh = exact ? gelu_backward_op().call(gy, saved[0], saved[1], saved[2], dim, groups, k)
                 : at::gelu_backward(gy, hh, approximate);
    return {gh, gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gelu_linear_train(const at::Tensor& h, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                             int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
                             c10::string_view approximate, bool row_scale) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::gelu_linear_train");
  return GeluLinearTrain::apply(h, weight, present(bias), qz,
                                std::string(approximate), row_scale);
}

// ----------------------------------------------------------------------------- LayerNorm
// mesa_train/nn/layernorm.py: keeps the normalised input x_hat (8-bit, row scales) and the
// per-row rstd; backward through ATen's fused LayerNorm backward fed x_hat / rstd with mean 0
// and the row's rstd.
at::Tensor autocast_fp32(const at::Tensor& t) {
  if (!t.defined() || !(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16)) return t;
  return t.to(at::kFloat);
}

// layernorm.pack_rstd: (r16, scale), rstd as float16 r16 = fp16(rstd / scale) with a float32
// power of two `scale` (0-d) that puts the largest row at [2**14, 2**15) (no host sync)
std::pair<at::Tensor, at::Tensor> pack_rstd(const at::Tensor& rstd) {
  const at::Tensor r = rstd.to(at::kFloat);
  const at::Tensor e = std::get<1>(at::frexp(r.amax()));  // amax = m * 2**e, m in [0.5, 1)
  const at::Tensor scale = at::exp2((e - 15).clamp(-120, 120).to(at::kFloat));
  return {(r / scale).to(at::kHalf), scale};
}

// The stock LayerNorm's output, its x_hat compressed: (out, q, alpha, beta, rstd, k,
// rstd_scale) for save_for_backward (with the weight; rstd_scale last, where saved_rstd reads
// it), dtypes in ctx->saved_data as "ln_*".
// At 4 or 2 bits rstd is kept as float16 times one power of two, rstd_scale (pack_rstd),
// else as it is with rstd_scale undefined. Shared by LayerNormTrain and LayerNormLinearTrain
// (Python twin: layer_norm_forward).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& normalized_shape, const at::Tensor& w,
    const at::Tensor& b, double eps, Quantizer& qz, bool row_scale) {
  // CUDA's autocast runs layer_norm in float32 ("fp32" policy); CPU's has no such rule
  const auto dev = x.device().type();
  const bool cast = (dev == at::kCUDA || dev == at::kXPU) && at::autocast::is_autocast_enabled(dev);
  at::Tensor xc = cast ? autocast_fp32(x) : x, wc = cast ? autocast_fp32(w) : w, bc = cast ? autocast_fp32(b) : b;
  at::Tensor out, mean, rstd;
  {
    NoAutocast no_autocast;
    auto res = at::native_layer_norm(xc, normalized_shape, wc.defined() ? std::optional<at::Tensor>(wc) : std::nullopt,
                                     bc.defined() ? std::optional<at::Tensor>(bc) : std::nullopt, eps);
    out = std::get<0>(res);
    mean = std::get<1>(res);
    rstd = std::get<2>(res);
  }
  const auto mdt = at::promote_types(xc.scalar_type(), at::kFloat);
  const int64_t row_dims = static_cast<int64_t>(normalized_shape.size());
  // x_hat = (x - mean) * rstd in float32 with ATen's statistics, computed by the kernels that
  // compress it (DESIGN.md, "LayerNorm's x_hat inside the kernels"); float32 x_hat: row
  // scales up to 2**64 (max_exponent)
  auto [q, alpha, beta, G, k] = compress_with_rows(xc, xc.dim() - 1, qz, row_dims, row_scale ? 64 : 0,
                                                   mean.to(at::kFloat), rstd.to(at::kFloat));
  ctx->saved_data["groups"] = G;
  ctx->saved_data["dim"] = xc.dim() - 1;
  ctx->saved_data["ln_x_dtype"] = x.scalar_type();
  ctx->saved_data["mdt"] = mdt;
  ctx->saved_data["normalized_shape"] = normalized_shape;
  ctx->saved_data["ln_has_weight"] = w.defined();
  ctx->saved_data["ln_has_bias"] = b.defined();
  ctx->saved_data["ln_w_dtype"] = w.defined() ? w.scalar_type() : mdt;
  ctx->saved_data["ln_b_dtype"] = b.defined() ? b.scalar_type() : mdt;
  save_code_format(ctx, qz, xc.sizes());
  if (qz.code_bits == 2 || qz.code_bits == 4) {
    auto [r16, scale] = pack_rstd(rstd);
    ctx->saved_data["rstd_dtype"] = rstd.scalar_type();
    return {out, q, alpha, beta, r16, k, scale};
  }
  return {out, q, alpha, beta, rstd, k, at::Tensor()};
}

// Whether a LayerNorm's backward runs as mesa::layer_norm_backward (the default format's
// codes, float32 math, one normalised dim of at most kLnMaxCols; Python twin:
// ln_backward_from_codes in mesa_train/nn/layernorm.py). Else ATen's fused backward on the
// dequantized input.
bool ln_backward_from_codes(AutogradContext* ctx) {
  const auto normalized_shape = ctx->saved_data["normalized_shape"].toIntVector();
  return !variant_codes(ctx) && ctx->saved_data["mdt"].toScalarType() == at::kFloat &&
         normalized_shape.size() == 1 && normalized_shape[0] <= kLnMaxCols;
}

// The saved rstd (saved[3]), unpacked where layer_norm_forward kept it as float16 and a scale
// ("rstd_dtype" set; the scale saved last by both nodes; layernorm.unpack_rstd)
at::Tensor saved_rstd(AutogradContext* ctx, const variable_list& saved) {
  const auto dtype = ctx->saved_data.find("rstd_dtype");
  if (dtype == ctx->saved_data.end()) return saved[3];
  return (saved[3].to(at::kFloat) * saved.back()).to(dtype->second.toScalarType());
}

// The LayerNorm's (gx, gw, gb) from its output's gradient dy and what layer_norm_forward
// saved (saved: q, alpha, beta, rstd, weight, k; Python twin: layer_norm_grads): one
// mesa::layer_norm_backward where ln_backward_from_codes allows, else ATen's fused LayerNorm
// backward fed x_hat / rstd with mean 0 and the row's rstd.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_grads(AutogradContext* ctx, const variable_list& saved,
                                                               const at::Tensor& dy, bool need_x, bool need_w,
                                                               bool need_b) {
  const auto mdt = ctx->saved_data["mdt"].toScalarType();
  need_w = need_w && ctx->saved_data["ln_has_weight"].toBool();
  need_b = need_b && ctx->saved_data["ln_has_bias"].toBool();
  const auto normalized_shape = ctx->saved_data["normalized_shape"].toIntVector();
  at::Tensor gx, gw, gb;
  const auto cast_grads = [&](const at::Tensor& dx, const at::Tensor& dw, const at::Tensor& db) {
    if (need_x) gx = dx.to(ctx->saved_data["ln_x_dtype"].toScalarType());
    if (need_w) gw = dw.to(ctx->saved_data["ln_w_dtype"].toScalarType());
    if (need_b) gb = db.to(ctx->saved_data["ln_b_dtype"].toScalarType());
  };
  if (ln_backward_from_codes(ctx)) {
    // all three from the codes in one op: no dequantized copy, no cast of dy (DESIGN.md,
    // "LayerNorm backward from the codes")
    const at::Tensor &k = saved[5], &w = saved[4];
    auto [dx, dparams] = layer_norm_backward_op().call(
        dy, saved[0], saved[1], saved[2], ctx->saved_data["groups"].toInt(), saved[3].to(at::kFloat),
        w.defined() ? std::optional<at::Tensor>(w.to(at::kFloat)) : std::nullopt,
        k.defined() ? std::optional<at::Tensor>(k) : std::nullopt);
    cast_grads(dx, dparams.select(0, 0), dparams.select(0, 1));  // (rows of one tensor: views)
    return {gx, gw, gb};
  }
  const at::Tensor rstd = saved_rstd(ctx, saved).to(mdt);
  // x - mean, i.e. x_hat / rstd, from the codes in one kernel (row_mul: 1 / rstd per row),
  // so that ATen's backward, fed it with mean 0 and the real rstd, takes back x_hat and
  // returns dx with rstd applied: no pass over dx after it (DESIGN.md, "LayerNorm's x_hat
  // inside the kernels"); a variant format's codes: the same as ops (decompress_saved)
  const at::Tensor k = saved[5];
  const int64_t dim = ctx->saved_data["dim"].toInt(), groups = ctx->saved_data["groups"].toInt();
  at::Tensor xs = decompress_saved(ctx, saved, dim, groups, mdt, k, at::reciprocal(rstd.to(at::kFloat)));
  std::optional<at::Tensor> w;
  if (saved[4].defined()) w = saved[4].to(mdt);
  std::optional<at::Tensor> bias_stub;  // only its presence matters
  if (need_b) bias_stub = rstd.new_empty(normalized_shape);
  auto [dx, dw, db] = at::native_layer_norm_backward(dy.to(mdt), xs, normalized_shape, at::zeros_like(rstd), rstd, w,
                                                     bias_stub, {need_x, need_w, need_b});
  cast_grads(dx, dw, db);
  return {gx, gw, gb};
}

struct LayerNormTrain : public torch::autograd::Function<LayerNormTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> normalized_shape,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps, Quantizer qz, bool row_scale) {
    const at::Tensor w = weight.has_value() ? *weight : at::Tensor(), b = bias.has_value() ? *bias : at::Tensor();
    auto [out, q, alpha, beta, rstd, k, rstd_scale] =
        layer_norm_forward(ctx, x, normalized_shape, w, b, eps, qz, row_scale);
    // the weight whenever there is one (a parameter: no activation memory): ATen's backward
    // takes dweight's shape from it even when x needs no gradient
    ctx->save_for_backward({q, alpha, beta, rstd, w, k, rstd_scale});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("LayerNorm");
    NoAutocast no_autocast;
    // needs_input_grad indexes the tensors apply tracked: x, then weight and bias if present
    const bool has_w = ctx->saved_data["ln_has_weight"].toBool(), has_b = ctx->saved_data["ln_has_bias"].toBool();
    auto [gx, gw, gb] = layer_norm_grads(ctx, ctx->get_saved_variables(), grads[0], ctx->needs_input_grad(0),
                                         has_w && ctx->needs_input_grad(1),
                                         has_b && ctx->needs_input_grad(has_w ? 2 : 1));
    return {gx, at::Tensor(), gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_train(const at::Tensor& x, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, at::Tensor& alpha_est,
                            at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng, int64_t num_groups,
                            double decay, int64_t estimator, bool symmetric, bool stochastic, bool row_scale) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::layer_norm_train");
  return LayerNormTrain::apply(x, normalized_shape.vec(), present(weight), present(bias), eps, qz, row_scale);
}

// ----------------------------------------------------------------------------- LayerNorm + Linear
// mesa_train/nn/layernorm_linear.py: fc(norm(x)) keeping one 8-bit copy, the norm's x_hat, for
// both backward passes; the Linear's input x_hat * gamma + beta is rebuilt from it in backward.
// The Linear's input x_hat * gamma + beta rebuilt from the norm's codes (saved: q, alpha, beta,
// rstd, gamma, k, beta_ln, ...) in the stock dtypes: the math dtype (float32, or float64 for a
// float64 norm), then the norm's output dtype, autocast's cast and the Linear's compute dtype
// (Python twin: rebuild_norm_output). With float32 math and a gamma or beta: one dequantize
// whose column epilogue applies them and rounds once, to the first dtype of that chain that
// is not float32 (the casts before it are exact): 3 bytes an element for bf16 where the
// dequantize, multiply, add and cast moved 27.
at::Tensor rebuild_norm_output(AutogradContext* ctx, const variable_list& saved) {
  const auto mdt = ctx->saved_data["mdt"].toScalarType();
  const int64_t dim = ctx->saved_data["dim"].toInt(), groups = ctx->saved_data["groups"].toInt();
  const c10::ScalarType casts[3] = {ctx->saved_data["y_dtype"].toScalarType(),
                                    ctx->saved_data["yc_dtype"].toScalarType(), ctx->saved_data["cdt"].toScalarType()};
  const at::Tensor &w = saved[4], &b = saved[6], &k = saved[5];
  at::Tensor y;
  int j = 0;
  if (mdt == at::kFloat && (w.defined() || b.defined())) {
    while (j < 3 && casts[j] == at::kFloat) ++j;
    const auto dt = j < 3 ? casts[j] : at::kFloat;
    const at::Tensor w32 = w.defined() ? w.to(at::kFloat) : at::Tensor();
    const at::Tensor b32 = b.defined() ? b.to(at::kFloat) : at::Tensor();
    y = decompress_saved(ctx, saved, dim, groups, dt, k, at::Tensor(), w32, b32);
  } else {  // the definition: a multiply, then an add, in the math dtype
    y = decompress_saved(ctx, saved, dim, groups, mdt, k);
    if (w.defined()) y = y * w.to(mdt);
    if (b.defined()) y = y + b.to(mdt);
  }
  for (; j < 3; ++j) y = y.to(casts[j]);  // from the dtype the epilogue rounded to: the rest of the chain
  return y;
}

struct LayerNormLinearTrain : public torch::autograd::Function<LayerNormLinearTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> normalized_shape,
                            const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
                            double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias, Quantizer qz,
                            bool row_scale) {
    const at::Tensor lw = ln_weight.has_value() ? *ln_weight : at::Tensor();
    const at::Tensor lb = ln_bias.has_value() ? *ln_bias : at::Tensor();
    // exactly the stock norm (its autocast policy included), then exactly the stock Linear
    auto [y, q, alpha, beta, rstd, k, rstd_scale] =
        layer_norm_forward(ctx, x, normalized_shape, lw, lb, eps, qz, row_scale);
    const at::Tensor yc = autocast_input(y);
    at::Tensor out = at::linear(yc, weight, bias);
    ctx->save_for_backward({q, alpha, beta, rstd, lw, k, lb, weight, rstd_scale});
    ctx->saved_data["y_dtype"] = y.scalar_type();
    ctx->saved_data["yc_dtype"] = yc.scalar_type();
    save_linear_dtypes(ctx, out, weight, bias);
    return not_a_view(out);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("LayerNorm + Linear");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    // needs_input_grad indexes the tensors apply tracked: x, the norm's weight and bias if
    // present, the Linear's weight, its bias if present
    int64_t i = 1;
    const bool has_lw = ctx->saved_data["ln_has_weight"].toBool(), has_lb = ctx->saved_data["ln_has_bias"].toBool();
    const bool need_lw = has_lw && ctx->needs_input_grad(i);
    i += has_lw;
    const bool need_lb = has_lb && ctx->needs_input_grad(i);
    i += has_lb;
    const bool need_x = ctx->needs_input_grad(0);
    // the Linear's backward, its input rebuilt from the norm's codes in the stock dtypes (the
    // norm's output dtype, then autocast's cast); its input gradient comes back in the
    // norm's output dtype, as stock casts it (Python twin: rebuild_norm_output), or in its
    // compute dtype where layer_norm_backward reads it (its float32 of it is the cast's,
    // exactly: one pass fewer)
    const bool from_codes = ln_backward_from_codes(ctx);
    const auto ydt = ctx->saved_data[from_codes ? "cdt" : "y_dtype"].toScalarType();
    auto [gy, gw, gb] = linear_grads(ctx, grads[0], saved[7], ydt, need_x || need_lw || need_lb,
                                     ctx->needs_input_grad(i), i + 1, [&] { return rebuild_norm_output(ctx, saved); });
    at::Tensor gx, glw, glb;
    if (gy.defined()) std::tie(gx, glw, glb) = layer_norm_grads(ctx, saved, gy, need_x, need_lw, need_lb);
    return {gx, at::Tensor(), glw, glb, at::Tensor(), gw, gb, at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_linear_train(const at::Tensor& x, at::IntArrayRef normalized_shape,
                                   const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
                                   double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                   at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                                   int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
                                   bool row_scale) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::layer_norm_linear_train");
  return LayerNormLinearTrain::apply(x, normalized_shape.vec(), present(ln_weight), present(ln_bias), eps, weight,
                                     present(bias), qz, row_scale);
}

// ----------------------------------------------------------------------------- MatMul
// mesa_train/nn/matmul.py: `a @ b` exactly; each operand the other's gradient needs is kept
// as (in this order) a producer's shared copy (attn @ v: the Softmax's codes), its own copy
// (a quantizer given), or the operand as the stock matmul keeps it. Codes of the default
// 8-bit format or a variant (bits != 0: packed codes of the operand's shape).
struct Codes {  // a Packed: a producer's shared copy, or the one compress() made here
  at::Tensor q, alpha, beta;
  int64_t dim = 0, groups = 0, bits = 0;
  bool pow2 = false;
};

// mesa_train.nn.matmul._full_copy (eager): the compute dtype, compact when t views a
// bigger storage (as the stock batched matmul keeps it)
at::Tensor full_copy(const at::Tensor& t, c10::ScalarType dt) {
  if (t.scalar_type() != dt) return t.to(dt);
  if (t.storage().nbytes() > static_cast<size_t>(t.numel()) * t.element_size())
    return t.is_contiguous() ? t.clone() : t.contiguous();
  return t;
}

// What one operand keeps: codes or a full tensor, or nothing.
struct Kept {
  Codes codes;
  at::Tensor full;
};

Kept keep_operand(const at::Tensor& t, bool needed, const std::optional<Codes>& shared, std::optional<Quantizer>& qz,
                  c10::ScalarType cdt) {
  Kept k;
  if (!needed) return k;
  if (shared.has_value()) {
    k.codes = *shared;
  } else if (qz.has_value()) {
    Codes& c = k.codes;
    c.dim = group_dim(t);
    std::tie(c.q, c.alpha, c.beta, c.groups) = compress(t, c.dim, *qz);
    c.bits = qz->code_bits, c.pow2 = qz->pow2;
  } else {
    k.full = full_copy(t, cdt);
  }
  return k;
}

// mesa_train.nn.matmul.batched_operands: the contiguous copy the stock batched matmul would
// make of an operand (its reshape to (batch, n, m) cannot view it), made once before the
// product so that the compression finds it contiguous; bitwise the same product.
at::Tensor batch_copy(const at::Tensor& t) {
  // (the batch size spelled out: -1 is ambiguous for an empty n or m)
  const int64_t batch = c10::multiply_integers(t.sizes().slice(0, t.dim() - 2));
  const at::Tensor t3 = t.reshape({batch, t.size(-2), t.size(-1)});
  return t3.is_alias_of(t) ? t : t3.view(t.sizes());
}

bool same_batch(at::IntArrayRef a, at::IntArrayRef b) {
  return a.size() >= 3 && b.size() >= 3 && a.slice(0, a.size() - 2) == b.slice(0, b.size() - 2);
}

at::Tensor as_batch_copy(const at::Tensor& t) {
  if (autocast_casts(t)) return t;  // autocast's cast makes the copy
  return batch_copy(t);
}

std::pair<at::Tensor, at::Tensor> batched_operands(const at::Tensor& a, const at::Tensor& b) {
  if (!same_batch(a.sizes(), b.sizes())) return {a, b};
  return {as_batch_copy(a), as_batch_copy(b)};
}

struct MatMulTrain : public torch::autograd::Function<MatMulTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a_in, const at::Tensor& b_in,
                            std::optional<Codes> shared_a, std::optional<Codes> shared_b,
                            std::optional<Quantizer> qa, std::optional<Quantizer> qb) {
    const auto [a, b] = batched_operands(a_in, b_in);  // its copies serve the compression too
    at::Tensor out = at::matmul(a, b);  // autocast applies here, exactly like the stock `a @ b`
    const auto cdt = out.scalar_type();
    // the gradient of a needs b and vice versa
    // (the copies are made with grad mode off: ask the inputs what needs a gradient)
    const Kept ka = keep_operand(a, b_in.requires_grad(), shared_a, qa, cdt);
    const Kept kb = keep_operand(b, a_in.requires_grad(), shared_b, qb, cdt);
    const Codes &ca = ka.codes, &cb = kb.codes;
    ctx->save_for_backward({ca.q, ca.alpha, ca.beta, ka.full, cb.q, cb.alpha, cb.beta, kb.full});
    ctx->saved_data["a_layout"] = std::vector<int64_t>{ca.dim, ca.groups, ca.bits, ca.pow2};
    ctx->saved_data["b_layout"] = std::vector<int64_t>{cb.dim, cb.groups, cb.bits, cb.pow2};
    ctx->saved_data["a_shape"] = a.sizes().vec();
    ctx->saved_data["b_shape"] = b.sizes().vec();
    ctx->saved_data["cdt"] = cdt;
    ctx->saved_data["a_dtype"] = a.scalar_type();
    ctx->saved_data["b_dtype"] = b.scalar_type();
    return out;
  }

  // the operand (of `shape`) back in the compute dtype: dequantized codes (layout: dim,
  // groups, bits, pow2), or the kept tensor
  static at::Tensor restore(const variable_list& saved, size_t first, const std::vector<int64_t>& layout,
                            at::IntArrayRef shape, c10::ScalarType cdt) {
    if (saved[first].defined())
      return dequantize_codes(saved[first], saved[first + 1], saved[first + 2], layout[0], layout[1], cdt, layout[2],
                              layout[3] != 0, shape);
    return saved[first + 3].to(cdt);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("MatMul");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const auto a_shape = ctx->saved_data["a_shape"].toIntVector();
    const auto b_shape = ctx->saved_data["b_shape"].toIntVector();
    at::Tensor g = grads[0].to(cdt), ga, gb;
    // g feeds up to two products: copy it once where each would (the stock matmul's
    // backward gets its own reshape's contiguous copy once, too)
    if (same_batch(a_shape, b_shape)) g = batch_copy(g);
    if (a_shape.size() == 1 && b_shape.size() == 1) {
      g = g.reshape({1, 1});  // a dot product: g is 0-dim (as _MatMulFn's backward)
    } else if (a_shape.size() == 1) {
      g = g.unsqueeze(-2);
    } else if (b_shape.size() == 1) {
      g = g.unsqueeze(-1);
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor bh = restore(saved, 4, ctx->saved_data["b_layout"].toIntVector(), b_shape, cdt);
      if (b_shape.size() == 1) bh = bh.unsqueeze(-1);
      ga = g.matmul(bh.transpose(-1, -2));
      std::vector<int64_t> a2 = a_shape;
      if (a_shape.size() == 1) a2.insert(a2.begin(), 1);
      ga = ga.sum_to_size(a2).reshape(a_shape).to(ctx->saved_data["a_dtype"].toScalarType());
    }
    if (ctx->needs_input_grad(1)) {
      at::Tensor ah = restore(saved, 0, ctx->saved_data["a_layout"].toIntVector(), a_shape, cdt);
      if (a_shape.size() == 1) ah = ah.unsqueeze(0);
      gb = ah.transpose(-1, -2).matmul(g);
      std::vector<int64_t> b2 = b_shape;
      if (b_shape.size() == 1) b2.push_back(1);
      gb = gb.sum_to_size(b2).reshape(b_shape).to(ctx->saved_data["b_dtype"].toScalarType());
    }
    return {ga, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A Packed passed as [q, alpha, beta] (empty: none) with its format (shared_format)
std::optional<Codes> shared_copy(at::TensorList t, int64_t dim, int64_t groups, int64_t format) {
  const CodeFormat f = shared_format(format, "mesa::matmul_train");
  if (t.empty()) return std::nullopt;
  TORCH_CHECK(t.size() == 3, "mesa::matmul_train: a shared copy is [q, alpha, beta], got ", t.size(), " tensors");
  return Codes{t[0], t[1], t[2], dim, groups, f.bits, f.pow2};
}

// A quantizer's buffers passed as [alpha_est, beta_est, initialized, rng] (empty: none)
std::optional<Quantizer> quantizer(at::TensorList t, int64_t num_groups, double decay, int64_t estimator,
                                   bool symmetric, bool stochastic) {
  if (t.empty()) return std::nullopt;
  return quantizer_from_list(t, num_groups, decay, estimator, symmetric, stochastic, "mesa::matmul_train");
}

at::Tensor matmul_train(const at::Tensor& a, const at::Tensor& b, at::TensorList shared_a, int64_t shared_a_dim,
                        int64_t shared_a_groups, at::TensorList shared_b, int64_t shared_b_dim, int64_t shared_b_groups,
                        at::TensorList state_a, int64_t num_groups_a, double decay_a, int64_t estimator_a,
                        bool symmetric_a, bool stochastic_a, at::TensorList state_b, int64_t num_groups_b,
                        double decay_b, int64_t estimator_b, bool symmetric_b, bool stochastic_b,
                        int64_t shared_a_format, int64_t shared_b_format) {
  return MatMulTrain::apply(a, b, shared_copy(shared_a, shared_a_dim, shared_a_groups, shared_a_format),
                            shared_copy(shared_b, shared_b_dim, shared_b_groups, shared_b_format),
                            quantizer(state_a, num_groups_a, decay_a, estimator_a, symmetric_a, stochastic_a),
                            quantizer(state_b, num_groups_b, decay_b, estimator_b, symmetric_b, stochastic_b));
}

// ----------------------------------------------------------------------------- Conv2d
// mesa_train/nn/conv.py (zeros padding given as numbers): the stock F.conv2d forward, the
// input kept 8-bit (or in a variant format) with channel groups over dim 1 (only when the
// weight needs a gradient), backward through ATen's convolution_backward fed the dequantized
// input. scale_link: a scale branch's 1x1 depthwise conv whose BatchNorm runs its C++ op too
// (scale_link.h): the weight gradient from that BatchNorm's backward where it hands one over.
// A 3-d weight is the Mesa Conv1d (mesa::conv1d_train; the Python Function is the same one).
// shared: the codes another Mesa conv made of this very input (conv.py, input_copy.py: parallel
// branches on one tensor keep one copy), saved here instead of compressing again; otherwise the
// codes made here are returned beside y, for the next branch (empty where none were made).
struct Conv2dTrain : public torch::autograd::Function<Conv2dTrain> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, std::vector<int64_t> stride,
                               std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                               Quantizer qz, bool scale_link, std::optional<Codes> shared) {
    const int64_t spatial = weight.dim() - 2;  // 2: Conv2d, 1: Conv1d
    // exactly nn.Conv2d.forward / nn.Conv1d.forward
    at::Tensor y = spatial == 1 ? at::conv1d(x, weight, bias, stride, padding, dilation, groups)
                                : at::conv2d(x, weight, bias, stride, padding, dilation, groups);
    at::Tensor q, alpha, beta;
    int64_t G = 0;
    // a channels-last input kept in its own layout: backward hands convolution_backward a
    // channels-last input, so the input gradient is stock's, layout and bits
    const NhwcView v = nhwc_view(x, x.dim() - spatial - 1);
    const bool made_here = weight.requires_grad() && !shared.has_value();
    if (made_here) {
      std::tie(q, alpha, beta, G) = compress(v.x, v.dim, qz);
    } else if (weight.requires_grad()) {  // (the producer's options are this quantizer's: same format)
      q = shared->q, alpha = shared->alpha, beta = shared->beta, G = capped_groups(qz, v.x.size(v.dim));
    }
    if (weight.requires_grad()) save_code_format(ctx, qz, v.x.sizes());
    ctx->save_for_backward({q, alpha, beta, weight});
    ctx->saved_data["channels_last"] = is_channels_last(x);
    ctx->saved_data["dim"] = v.dim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["x_shape"] = x.sizes().vec();
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["conv_groups"] = groups;
    ctx->saved_data["cdt"] = y.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["w_dtype"] = weight.scalar_type();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["b_dtype"] = bias.has_value() ? bias->scalar_type() : y.scalar_type();
    // a scale branch's hand-over (scale_link.h): its BatchNorm finds it through y's grad_fn
    if (scale_link) ctx->saved_data["scale_link"] = scale_link_capsule(c10::make_intrusive<ScaleLinkState>());
    if (!made_here) q = no_codes(x), alpha = no_codes(x), beta = no_codes(x);
    ctx->mark_non_differentiable({q, alpha, beta});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the codes
    return {y, q, alpha, beta};
  }

  // The linked BatchNorm's coef where it applies (conv._Conv2dFn.backward): the state holds
  // coef and the gradient that BatchNorm returned is the one received here; the state is
  // cleared either way (its tensors die with this backward, as the Python link's do).
  static at::Tensor linked_coef(AutogradContext* ctx, const at::Tensor& g, bool need_w) {
    const auto it = ctx->saved_data.find("scale_link");
    if (it == ctx->saved_data.end()) return at::Tensor();
    const auto link = scale_link_from(it->second);
    at::Tensor coef;
    if (link->coef.defined() && link->gx.defined() && need_w &&
        g.unsafeGetTensorImpl() == link->gx.unsafeGetTensorImpl()) {
      coef = link->coef;
    }
    link->coef.reset();
    link->gx.reset();
    return coef;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Conv2d");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const bool has_b = ctx->saved_data["has_bias"].toBool();
    // (needs_input_grad counts the tensors apply tracked: no index 2 without a bias)
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = has_b && ctx->needs_input_grad(2);
    const at::Tensor coef = linked_coef(ctx, grads[0], need_w);
    const size_t num_inputs = 10;  // x, weight, bias, stride, padding, dilation, groups, qz, scale_link, shared
    if (!grads[0].defined()) return variable_list(num_inputs);  // (materialize off: y took no gradient)
    at::Tensor g = grads[0].to(cdt), w = saved[3].to(cdt), xh;
    const bool channels_last = ctx->saved_data["channels_last"].toBool();
    if (saved[0].defined()) {
      xh = from_nhwc(decompress_saved(ctx, saved, ctx->saved_data["dim"].toInt(),
                                      ctx->saved_data["groups"].toInt(), cdt),
                     channels_last);
    } else {  // only the input gradient is needed: the values of x do not matter, its layout does
      xh = at::empty(ctx->saved_data["x_shape"].toIntVector(),
                     g.options().memory_format(channels_last ? at::MemoryFormat::ChannelsLast
                                                             : at::MemoryFormat::Contiguous));
    }
    const int64_t spatial = w.dim() - 2;
    const bool unbatched = xh.dim() == spatial + 1;
    if (unbatched) xh = xh.unsqueeze(0), g = g.unsqueeze(0);
    std::optional<std::vector<int64_t>> bias_sizes;
    if (need_b) bias_sizes = std::vector<int64_t>{w.size(0)};
    auto [gx, gw, gb] = at::convolution_backward(
        g, xh, w, bias_sizes.has_value() ? at::OptionalIntArrayRef(*bias_sizes) : at::OptionalIntArrayRef(),
        ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        ctx->saved_data["dilation"].toIntVector(), false, std::vector<int64_t>(spatial, 0),
        ctx->saved_data["conv_groups"].toInt(),
        {need_x, need_w, need_b});
    if (unbatched && gx.defined()) gx = gx.squeeze(0);
    if (coef.defined() && gw.defined()) {  // coef / w where w != 0, the 8-bit input's gradient elsewhere
      const at::Tensor nz = w.ne(0);
      gw = at::where(nz, coef.to(cdt).view_as(w).div(at::where(nz, w, at::ones_like(w))), gw);
    }
    at::Tensor rx = need_x && gx.defined() ? gx.to(ctx->saved_data["x_dtype"].toScalarType()) : at::Tensor();
    at::Tensor rw = need_w && gw.defined() ? gw.to(ctx->saved_data["w_dtype"].toScalarType()) : at::Tensor();
    at::Tensor rb = need_b && gb.defined() ? gb.to(ctx->saved_data["b_dtype"].toScalarType()) : at::Tensor();
    variable_list out(num_inputs);
    out[0] = rx, out[1] = rw, out[2] = rb;
    return out;
  }
};

// A conv's shared copy passed as [q, alpha, beta] (empty: none)
std::optional<Codes> shared_input(at::TensorList t, const char* op) {
  if (t.empty()) return std::nullopt;
  TORCH_CHECK_VALUE(t.size() == 3, op, ": a shared copy is [q, alpha, beta], got ", t.size(), " tensors");
  return Codes{t[0], t[1], t[2]};
}

// (y, q, alpha, beta) of Conv2dTrain::apply, its node rid of the marks compiled autograd refuses
template <class... Args>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_outputs(Args&&... args) {
  const variable_list v = apply_forgetting_marks<Conv2dTrain>(std::forward<Args>(args)...);
  return {v[0], v[1], v[2], v[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv2d_train(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                        int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
                        bool scale_link, at::TensorList shared_x) {
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::conv2d_train");
  return conv_outputs(x, weight, present(bias), stride.vec(), padding.vec(), dilation.vec(), groups, qz, scale_link,
                      shared_input(shared_x, "mesa::conv2d_train"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv1d_train(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        at::Tensor& alpha_est, at::Tensor& beta_est, at::Tensor& initialized, at::Tensor& rng,
                        int64_t num_groups, double decay, int64_t estimator, bool symmetric, bool stochastic,
                        at::TensorList shared_x) {
  TORCH_CHECK_VALUE(weight.dim() == 3, "mesa: conv1d_train: weight must be (out, in / groups, k), got ", weight.dim(),
                    " dims");
  Quantizer qz = make_quantizer(alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric,
                                stochastic, "mesa::conv1d_train");
  return conv_outputs(x, weight, present(bias), stride.vec(), padding.vec(), dilation.vec(), groups, qz, false,
                      shared_input(shared_x, "mesa::conv1d_train"));
}

}  // namespace

c10::intrusive_ptr<ScaleLinkState> scale_link_of(const at::Tensor& y) {
  const auto* node = dynamic_cast<torch::autograd::CppNode<Conv2dTrain>*>(y.grad_fn().get());
  if (node == nullptr || y.output_nr() != 0) return {};
  const auto it = node->ctx_.saved_data.find("scale_link");
  return it == node->ctx_.saved_data.end() ? c10::intrusive_ptr<ScaleLinkState>() : scale_link_from(it->second);
}

}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // The quantizer's buffers are mutated (estimates, rounding counter), as by mesa::observe.
  m.def(
      "gelu_train(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
      "int num_groups, float decay, int estimator, bool symmetric, bool stochastic, str approximate) -> Tensor");
  m.def(
      "softmax_train(Tensor x, int softmax_dim, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, bool stochastic, "
      "ScalarType? out_dtype=None) -> (Tensor y, Tensor q, Tensor alpha, Tensor beta)");
  m.def(
      "linear_train(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) alpha_est, Tensor(b!) beta_est, "
      "Tensor(c!) initialized, Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, "
      "bool stochastic, bool row_scale, Tensor[] shared_x) -> (Tensor y, Tensor q, Tensor alpha, Tensor beta, "
      "Tensor k)");
  m.def(
      "gelu_linear_train(Tensor h, Tensor weight, Tensor? bias, Tensor(a!) alpha_est, Tensor(b!) beta_est, "
      "Tensor(c!) initialized, Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, "
      "bool stochastic, str approximate, bool row_scale) -> Tensor");
  m.def(
      "layer_norm_train(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, int num_groups, "
      "float decay, int estimator, bool symmetric, bool stochastic, bool row_scale) -> Tensor");
  m.def(
      "layer_norm_linear_train(Tensor x, int[] normalized_shape, Tensor? ln_weight, Tensor? ln_bias, float eps, "
      "Tensor weight, Tensor? bias, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int num_groups, float decay, int estimator, bool symmetric, bool stochastic, "
      "bool row_scale) -> Tensor");
  // shared_*: a producer's copy [q, alpha, beta] (or []), shared_*_format its format (0: the
  // default 8-bit one; shared_format); state_*: the operand's quantizer buffers
  // [alpha_est, beta_est, initialized, rng] (or [], no quantizer)
  m.def(
      "matmul_train(Tensor a, Tensor b, Tensor[] shared_a, int shared_a_dim, int shared_a_groups, "
      "Tensor[] shared_b, int shared_b_dim, int shared_b_groups, Tensor(a!)[] state_a, int num_groups_a, "
      "float decay_a, int estimator_a, bool symmetric_a, bool stochastic_a, Tensor(b!)[] state_b, "
      "int num_groups_b, float decay_b, int estimator_b, bool symmetric_b, bool stochastic_b, "
      "int shared_a_format=0, int shared_b_format=0) -> Tensor");
  m.def(
      "conv2d_train(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups, "
      "Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, int num_groups, "
      "float decay, int estimator, bool symmetric, bool stochastic, bool scale_link, Tensor[] shared_x) "
      "-> (Tensor y, Tensor q, Tensor alpha, Tensor beta)");
  m.def(
      "conv1d_train(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups, "
      "Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, int num_groups, "
      "float decay, int estimator, bool symmetric, bool stochastic, Tensor[] shared_x) "
      "-> (Tensor y, Tensor q, Tensor alpha, Tensor beta)");
  // estimator: 0 running, 1 per_sample, 2 delayed; max_k > 0: power-of-two row scales over the
  // last row_dims dims (mesa::row_exponents), returned as the fourth output (else empty)
  m.def(
      "compress(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
      "int dim, int num_groups, float decay, int estimator, bool symmetric, bool stochastic, int row_dims, "
      "int max_k, Tensor? row_mean=None, Tensor? row_rstd=None) -> (Tensor q, Tensor alpha, Tensor beta, "
      "Tensor row_exp)");
}

// mesa::compress calls the registered ops, whatever kernels serve them: the same function
// for both backends (and a graph node of its own under torch.compile, with the fake in
// mesa_train/quant/__init__.py)
TORCH_LIBRARY_IMPL(mesa, CPU, m) { m.impl("compress", &mesa::compress_op); }
TORCH_LIBRARY_IMPL(mesa, CUDA, m) { m.impl("compress", &mesa::compress_op); }

// One kernel for every backend: the autograd node is built here and the work dispatches
// to the CPU or CUDA kernels of the ops it calls. (Without grad mode, Function::apply
// records nothing: the same code serves inference.)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) {
  m.impl("gelu_train", &mesa::gelu_train);
  m.impl("softmax_train", &mesa::softmax_train);
  m.impl("linear_train", &mesa::linear_train);
  m.impl("gelu_linear_train", &mesa::gelu_linear_train);
  m.impl("layer_norm_train", &mesa::layer_norm_train);
  m.impl("layer_norm_linear_train", &mesa::layer_norm_linear_train);
  m.impl("matmul_train", &mesa::matmul_train);
  m.impl("conv2d_train", &mesa::conv2d_train);
  m.impl("conv1d_train", &mesa::conv1d_train);
}
