// What the eager fast-path layers (layers_autograd.cpp, sdpa_autograd.cpp, convnet_autograd.cpp,
// scale_autograd.cpp) share: the
// registered quantization ops looked up once, the quantizer state as the Python
// ActivationQuantizer passes it, and compress() (ActivationQuantizer.compress, default
// format) built on them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/tensor.h>  // CopySlices (forget_forward_marks)

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "mesa_common.h"

namespace mesa {
namespace layers {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// (the signatures the kernels are registered with: mutated buffers as const references too)
using ObserveFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, int64_t, int64_t, double, bool,
                                                                 bool, const std::optional<at::Tensor>&);
using QuantizeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool,
                              const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&);
using DequantizeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                c10::ScalarType, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using RowExponentsFn = at::Tensor(const at::Tensor&, int64_t, int64_t);
using ObserveRowsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
    double, bool, bool, int64_t, int64_t, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

// The registered ops, looked up once (through the dispatcher: CPU or CUDA kernel).
inline const c10::TypedOperatorHandle<ObserveFn>& observe_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mesa::observe", "").typed<ObserveFn>();
  return op;
}
inline const c10::TypedOperatorHandle<QuantizeFn>& quantize_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mesa::quantize", "").typed<QuantizeFn>();
  return op;
}
inline const c10::TypedOperatorHandle<DequantizeFn>& dequantize_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::dequantize", "").typed<DequantizeFn>();
  return op;
}
// mesa::dequantize through the dispatcher, its optional arguments defaulted (none given)
inline at::Tensor call_dequantize(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                                  int64_t groups, c10::ScalarType dtype,
                                  const std::optional<at::Tensor>& row_exp = std::nullopt,
                                  const std::optional<at::Tensor>& row_mul = std::nullopt,
                                  const std::optional<at::Tensor>& col_scale = std::nullopt,
                                  const std::optional<at::Tensor>& col_shift = std::nullopt) {
  return dequantize_op().call(q, alpha, beta, dim, groups, dtype, row_exp, row_mul, col_scale, col_shift);
}
// the variant formats' ops (DESIGN.md, "Variants"): packed 8/4/2-bit codes, linear or power-of-two steps
using QuantizeBitsFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                                  bool, bool, const at::Tensor&);
using DequantizeBitsFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::IntArrayRef,
                                    int64_t, int64_t, int64_t, bool, c10::ScalarType);
inline const c10::TypedOperatorHandle<QuantizeBitsFn>& quantize_bits_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::quantize_bits", "").typed<QuantizeBitsFn>();
  return op;
}
inline const c10::TypedOperatorHandle<DequantizeBitsFn>& dequantize_bits_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::dequantize_bits", "").typed<DequantizeBitsFn>();
  return op;
}
inline const c10::TypedOperatorHandle<RowExponentsFn>& row_exponents_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::row_exponents", "").typed<RowExponentsFn>();
  return op;
}
inline const c10::TypedOperatorHandle<ObserveRowsFn>& observe_rows_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::observe_rows", "").typed<ObserveRowsFn>();
  return op;
}

// softmax_backward: (g, q, alpha, beta, dim, num_groups, y_dtype, out_dtype) -> gx
using SoftmaxBackwardFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t, int64_t, std::optional<at::ScalarType>, std::optional<at::ScalarType>);
// ... gelu_backward's, with the codes' optional row exponents
using GeluBackwardFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  int64_t, int64_t, const std::optional<at::Tensor>&);
inline const c10::TypedOperatorHandle<GeluBackwardFn>& gelu_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::gelu_backward", "").typed<GeluBackwardFn>();
  return op;
}
// gelu_value_and_grad: (g, q, alpha, beta, dim, num_groups, row_exp) -> (gelu of the values, gx)
using GeluValueAndGradFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, int64_t, int64_t,
                                                              const std::optional<at::Tensor>&);
inline const c10::TypedOperatorHandle<GeluValueAndGradFn>& gelu_value_and_grad_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::gelu_value_and_grad", "").typed<GeluValueAndGradFn>();
  return op;
}
// layer_norm_backward: (g, q, alpha, beta, num_groups, rstd, weight, row_exp) -> (dx, dparams:
// (2, D), dweight then dbias)
using LayerNormBackwardFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
inline const c10::TypedOperatorHandle<LayerNormBackwardFn>& layer_norm_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::layer_norm_backward", "").typed<LayerNormBackwardFn>();
  return op;
}
// dequantize_gelu: (q, alpha, beta, dim, num_groups, dtype, row_exp) -> gelu of the values
using DequantizeGeluFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                    c10::ScalarType, const std::optional<at::Tensor>&);
inline const c10::TypedOperatorHandle<DequantizeGeluFn>& dequantize_gelu_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::dequantize_gelu", "").typed<DequantizeGeluFn>();
  return op;
}
inline const c10::TypedOperatorHandle<SoftmaxBackwardFn>& softmax_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::softmax_backward", "").typed<SoftmaxBackwardFn>();
  return op;
}

// The quantizer's state and options, as the Python ActivationQuantizer.compress passes them.
// estimator: mesa_train.nn.quantizer.ESTIMATOR_CODES (the default-format estimators).
// code_bits: 0 for the default format (mesa::quantize's 8-bit codes); 8, 4 or 2 for a variant
// format's packed codes (mesa::quantize_bits, linear or with pow2 power-of-two steps).
enum Estimator : int64_t { kRunning = 0, kPerSample = 1, kDelayed = 2 };
struct Quantizer {
  at::Tensor alpha_est, beta_est, initialized, rng;
  int64_t num_groups;
  double decay;
  int64_t estimator;
  bool symmetric, stochastic;
  int64_t code_bits = 0;
  bool pow2 = false;
};

// The layer ops, which read their codes back by dequantizing them, also take a variant format
// (DESIGN.md, "Variant formats in the C++ ops"; mesa::compress, the Python Functions' one-op
// compression of the default format, checks for the estimator's code alone). The Python layers
// pass it inside `estimator` (mesa_train.nn.quantizer.layer_op_code): the estimator's code plus
// kFormatBits * bits plus kFormatPow2 for power-of-two steps; the default format is the
// estimator's code alone. One int, not two more arguments: every layer op's schema and the
// Python tuple spliced into each call (ActivationQuantizer.fused_layer_args) stay as they are.
constexpr int64_t kFormatBits = 4, kFormatPow2 = 64;

// A format's part of such a code, kFormatBits * bits + kFormatPow2 * pow2 (0: the default
// format): its bits and pow2, and whether it names a format (bits 8, 4 or 2, pow2 only with them).
struct CodeFormat {
  int64_t bits;
  bool pow2, valid;
};
inline CodeFormat decode_format(int64_t part) {
  const int64_t bits = part % kFormatPow2 / kFormatBits;
  const bool pow2 = part / kFormatPow2 == 1;
  const bool valid = part >= 0 && part < 2 * kFormatPow2 && part % kFormatBits == 0 &&
                     (bits == 0 || bits == 8 || bits == 4 || bits == 2) && (bits != 0 || !pow2);
  return {bits, pow2, valid};
}

inline Quantizer make_quantizer(const at::Tensor& alpha_est, const at::Tensor& beta_est,
                                const at::Tensor& initialized, const at::Tensor& rng, int64_t num_groups,
                                double decay, int64_t code, bool symmetric, bool stochastic, const char* op) {
  const int64_t estimator = code % kFormatBits;
  const CodeFormat format = decode_format(code - estimator);
  TORCH_CHECK_VALUE(code >= 0 && estimator <= kDelayed && format.valid, op, ": estimator code ", code,
                    " is not valid: 0 (running), 1 (per_sample) or 2 (delayed), plus a variant format's ",
                    kFormatBits, " * bits (8, 4 or 2) + ", kFormatPow2,
                    " * pow2 (mesa_train.nn.quantizer.layer_op_code)");
  TORCH_CHECK_VALUE(format.bits == 0 || estimator != kDelayed, op,
                    ": the delayed estimator takes the default 8-bit format only (estimator code ", code, ")");
  return Quantizer{alpha_est, beta_est, initialized, rng, num_groups, decay, estimator, symmetric, stochastic,
                   format.bits, format.pow2};
}

// The format of codes handed from one op to another (matmul_train's shared copies), as the
// Python layer names it (mesa_train.nn.quantizer.format_code): 0 for the default format, else
// kFormatBits * bits (8, 4 or 2) + kFormatPow2 * pow2, i.e. layer_op_code without the estimator.
inline CodeFormat shared_format(int64_t code, const char* op) {
  const CodeFormat format = decode_format(code);
  TORCH_CHECK_VALUE(format.valid, op, ": shared copy format ", code,
                    " is not valid: 0 (the default 8-bit format) or ", kFormatBits, " * bits (8, 4 or 2) + ",
                    kFormatPow2, " * pow2 (mesa_train.nn.quantizer.format_code)");
  return format;
}

using QuantizeObserveFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
    double, bool, bool, const std::optional<at::Tensor>&);
inline const c10::TypedOperatorHandle<QuantizeObserveFn>& quantize_observe_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mesa::quantize_observe", "").typed<QuantizeObserveFn>();
  return op;
}

// A quantizer's buffers passed as one list [alpha_est, beta_est, initialized, rng] (the ops
// that take several quantizers: matmul_train, sdpa_train), with its options.
inline Quantizer quantizer_from_list(at::TensorList state, int64_t num_groups, double decay, int64_t estimator,
                                     bool symmetric, bool stochastic, const char* op) {
  TORCH_CHECK(state.size() == 4, op, ": a quantizer state is [alpha_est, beta_est, initialized, rng], got ",
              state.size(), " tensors");
  return make_quantizer(state[0], state[1], state[2], state[3], num_groups, decay, estimator, symmetric, stochastic,
                        op);
}

// The groups of a compression along a dim of size D: at most one per channel
// (mesa_train.quant.reference.capped_groups).
inline int64_t capped_groups(const Quantizer& qz, int64_t D) {
  return qz.num_groups <= D ? qz.num_groups : std::max<int64_t>(1, D);
}

// ActivationQuantizer.compress (default format): groups along `dim` (num_groups capped at
// the dim's size), one contiguous copy when needed (none for the strided views the CUDA
// kernels read in place, as timm's q, k, v: mesa_common.h, "strided inputs"), then observe +
// quantize, or with the delayed estimator quantize_observe (one pass); row_exp: the rows'
// power-of-two scales, applied inside the kernels (mesa_train.nn.rowscale). Returns
// (q, alpha, beta, G).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> compress(
    const at::Tensor& x_in, int64_t dim, Quantizer& qz, const std::optional<at::Tensor>& row_exp = std::nullopt) {
  const int64_t G = capped_groups(qz, x_in.size(dim));
  if (qz.code_bits != 0) {  // a variant format: ActivationQuantizer._compress_variant (no row scales here)
    TORCH_CHECK(!row_exp.has_value(), "mesa: compress: row scales take the default 8-bit format only");
    const at::Tensor x = x_in.contiguous();
    auto [alpha, beta, seed] = observe_op().call(x, qz.alpha_est, qz.beta_est, qz.initialized, qz.rng, dim, G,
                                                 qz.decay, qz.estimator == kPerSample, qz.symmetric, std::nullopt);
    at::Tensor q = quantize_bits_op().call(x, alpha, beta, dim, G, qz.code_bits, qz.pow2, qz.stochastic, seed);
    return {q, alpha, beta, G};
  }
  const at::Tensor x = reads_in_place(x_in) ? x_in : x_in.contiguous();
  if (qz.estimator == kDelayed) {
    auto [q, alpha, beta] = quantize_observe_op().call(x, qz.alpha_est, qz.beta_est, qz.initialized, qz.rng, dim, G,
                                                       qz.decay, qz.symmetric, qz.stochastic, row_exp);
    return {q, alpha, beta, G};
  }
  auto [alpha, beta, seed] = observe_op().call(x, qz.alpha_est, qz.beta_est, qz.initialized, qz.rng, dim, G,
                                               qz.decay, qz.estimator == kPerSample, qz.symmetric, row_exp);
  at::Tensor q = quantize_op().call(x, alpha, beta, dim, G, qz.stochastic, seed, row_exp, std::nullopt, std::nullopt);
  return {q, alpha, beta, G};
}

// One operand's codes with groups along `dim`, as quantizer.compress(t, dim) makes them (the
// ops with several compressed operands: gated_train, einsum_train, sdpa_train), and their layout
// {dim, groups, bits, pow2}, saved beside them for dequantize_operand; all undefined / 0 when
// the operand is not kept.
struct OperandCodes {
  at::Tensor q, alpha, beta;
  std::vector<int64_t> layout{0, 0, 0, 0};
};
inline OperandCodes compress_operand(const at::Tensor& t, int64_t dim, Quantizer& qz) {
  OperandCodes c;
  int64_t groups = 0;
  std::tie(c.q, c.alpha, c.beta, groups) = compress(t, dim, qz);
  c.layout = {dim, groups, qz.code_bits, qz.pow2};
  return c;
}

// What decompress_saved needs to read back codes compress() made of a tensor of `shape` with
// `qz`: nothing for the default format, the packed codes' bits, steps and shape for a variant.
inline void save_code_format(AutogradContext* ctx, const Quantizer& qz, at::IntArrayRef shape) {
  if (qz.code_bits == 0) return;
  ctx->saved_data["code_bits"] = qz.code_bits;
  ctx->saved_data["code_pow2"] = qz.pow2;
  ctx->saved_data["code_shape"] = shape;
}

// Whether the codes a node saved are a variant format's (save_code_format).
inline bool variant_codes(AutogradContext* ctx) { return ctx->saved_data.count("code_bits") != 0; }

// Codes (q, alpha, beta) of a tensor of `shape` back in dtype `dt`: mesa::dequantize for the
// default format (bits 0), else mesa::dequantize_bits (the packed codes of `bits` bits,
// power-of-two steps if pow2).
inline at::Tensor dequantize_codes(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                                   int64_t groups, c10::ScalarType dt, int64_t bits, bool pow2, at::IntArrayRef shape) {
  if (bits == 0) return call_dequantize(q, alpha, beta, dim, groups, dt);
  return dequantize_bits_op().call(q, alpha, beta, shape, dim, groups, bits, pow2, dt);
}

// An operand's codes saved as saved[first..first+2] with compress_operand's layout (its four
// values), back in dtype `dt` (a tensor of `shape`)
inline at::Tensor dequantize_operand(const variable_list& saved, size_t first, at::IntArrayRef layout,
                                     at::IntArrayRef shape, c10::ScalarType dt) {
  return dequantize_codes(saved[first], saved[first + 1], saved[first + 2], layout[0], layout[1], dt, layout[2],
                          layout[3] != 0, shape);
}

// The saved codes (q, alpha, beta: saved[0..2]) back in dtype `dt`, with what mesa::dequantize
// can apply inside its kernel: rows unscaled by 2**-k, times row_mul (float32), or the column
// epilogue y * col_scale + col_shift before one rounding to dt (each undefined: not applied).
// For a variant format (save_code_format): mesa::dequantize_bits, then the same as ops, in the
// order and dtypes of mesa_train.nn.quantizer.decompress.
inline at::Tensor decompress_saved(AutogradContext* ctx, const variable_list& saved, int64_t dim, int64_t groups,
                                   c10::ScalarType dt, const at::Tensor& k = at::Tensor(),
                                   const at::Tensor& row_mul = at::Tensor(), const at::Tensor& col_scale = at::Tensor(),
                                   const at::Tensor& col_shift = at::Tensor()) {
  const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  const auto bits = ctx->saved_data.find("code_bits");
  if (bits == ctx->saved_data.end()) {
    return call_dequantize(saved[0], saved[1], saved[2], dim, groups, dt, opt(k), opt(row_mul), opt(col_scale),
                           opt(col_shift));
  }
  if (col_scale.defined() || col_shift.defined()) {  // (reference.affine_cols)
    at::Tensor y = decompress_saved(ctx, saved, dim, groups, at::kFloat, k, row_mul);
    if (col_scale.defined()) y = y * col_scale;
    if (col_shift.defined()) y = y + col_shift;
    return y.to(dt);
  }
  at::Tensor y = dequantize_codes(saved[0], saved[1], saved[2], dim, groups, dt, bits->second.toInt(),
                                  ctx->saved_data["code_pow2"].toBool(), ctx->saved_data["code_shape"].toIntVector());
  if (k.defined()) y = y * at::exp2(k.to(dt).neg());                 // (reference.unscale_rows)
  if (row_mul.defined()) y = (y.to(at::kFloat) * row_mul).to(dt);  // (reference.multiply_rows)
  return y;
}

// rowscale.compress_rows (defined in layers_autograd.cpp): x compressed with channel groups
// over its last dim, its rows far below the others scaled by 2**k when row_scale is on (k
// undefined otherwise; `other`: the layer's other dtype, float16 caps k at 14); read back by
// decompress_saved with k.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, at::Tensor> compress_rows(
    const at::Tensor& x, c10::ScalarType other, int64_t row_dims, bool row_scale, Quantizer& qz);

// A Mesa backward is not differentiable: it uses the 8-bit copy, a constant, where the stock
// backward uses the input. With create_graph=True (grad mode on during backward) the
// gradients it returned used to carry no graph through that copy, i.e. higher-order
// gradients came back silently wrong; the Python Functions (@once_differentiable) refuse
// them too. One line, with the way out.
inline void check_first_order(const char* layer) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "mesa: higher-order gradients (backward with create_graph=True) ",
              "through a Mesa ", layer, " are not supported: its backward uses the saved 8-bit copy, not a ",
              "differentiable graph. Run that part of the model stock (enabled=False, or unpatched) for them.");
}

// An empty tensor: an autograd node's outputs must be defined, and empty codes say "none made here"
inline at::Tensor no_codes(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kByte)); }

// Compiled autograd (torch._dynamo.compiled_autograd: torch._dynamo.config.compiled_autograd,
// torchtitan's option) refuses a C++ node whose context still lists non-differentiable outputs
// or dirty inputs: an internal assert in CppNode::compiled_args, a crash in the user's backward.
// Function::apply reads both sets once, when it wraps the outputs, and never again, so the node
// forgets them as soon as apply returns: eager autograd is unchanged, and a backward through the
// node compiles (tests/test_compiled_autograd.py; the layers reach it only from a forward run
// outside compiled autograd's context, quantizer.fused_layers_on). `output`: an output of the
// node (for a mark_dirty node, the input it overwrote), whose grad_fn it is where the call was
// recorded; for an in-place call on a view the node is the `fn` of the base's CopySlices.
template <class Node>
void forget_forward_marks(const at::Tensor& output) {
  torch::autograd::Node* node = output.grad_fn().get();
  if (!dynamic_cast<torch::autograd::CppNode<Node>*>(node) && output.is_view()) {
    if (auto* slices = dynamic_cast<torch::autograd::CopySlices*>(output._base().grad_fn().get())) {
      node = slices->fn.get();
    }
  }
  if (auto* cpp = dynamic_cast<torch::autograd::CppNode<Node>*>(node)) {
    cpp->ctx_.mark_non_differentiable({});
    cpp->ctx_.mark_dirty({});
  }
}

inline const at::Tensor& first_output(const at::Tensor& out) { return out; }
inline const at::Tensor& first_output(const torch::autograd::variable_list& out) { return out[0]; }

// Node::apply(args...) for the nodes that mark outputs non-differentiable or inputs dirty, the
// marks forgotten once it returns (forget_forward_marks, on the first output)
template <class Node, class... Args>
auto apply_forgetting_marks(Args&&... args) {
  auto out = Node::apply(std::forward<Args>(args)...);
  forget_forward_marks<Node>(first_output(out));
  return out;
}

// Backward computes in explicit dtypes with autocast off (mesa_train.nn._common.no_autocast).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// A forward's autocast state of its device (sdpa.py's and einsum.py's autocast_state), saved for
// a backward that re-enters it (AutocastScope(ctx))
inline void save_autocast_state(AutogradContext* ctx, at::DeviceType dev) {
  const bool available = at::autocast::is_autocast_available(dev);
  ctx->saved_data["device"] = static_cast<int64_t>(dev);
  ctx->saved_data["autocast"] = available && at::autocast::is_autocast_enabled(dev);
  ctx->saved_data["autocast_dtype"] = available ? at::autocast::get_autocast_dtype(dev) : at::kFloat;
}

// `with torch.autocast(device_type, dtype=..., enabled=...)` as a Python backward enters it
// (sdpa.py's recomputation, einsum.py's two products): the forward's autocast state of the
// device, the nesting counter (the cast cache is dropped when the outermost autocast region
// ends), all restored on exit.
class AutocastScope {
 public:
  // the state save_autocast_state saved
  explicit AutocastScope(AutogradContext* ctx)
      : AutocastScope(static_cast<at::DeviceType>(ctx->saved_data["device"].toInt()),
                      ctx->saved_data["autocast"].toBool(), ctx->saved_data["autocast_dtype"].toScalarType()) {}
  AutocastScope(at::DeviceType device, bool enabled, at::ScalarType dtype)
      : device_(device), active_(at::autocast::is_autocast_available(device)) {
    if (!active_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(device);
    prev_dtype_ = at::autocast::get_autocast_dtype(device);
    at::autocast::set_autocast_enabled(device, enabled);
    if (enabled) at::autocast::set_autocast_dtype(device, dtype);  // (disabled: Python keeps the current one)
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, prev_enabled_);
    at::autocast::set_autocast_dtype(device_, prev_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType device_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

// Whether autocast casts x before a matmul / linear (a floating x other than float64 and the
// autocast dtype, autocast on), and x as so cast (mesa_train.nn._common.autocast_casts /
// autocast_input): the tensor stock's linear multiplies and its backward keeps, so the one to
// compress (the cast is made once, here instead of inside at::linear)
inline bool autocast_casts(const at::Tensor& x) {
  const auto dev = x.device().type();
  return x.is_floating_point() && x.scalar_type() != at::kDouble && at::autocast::is_autocast_available(dev) &&
         at::autocast::is_autocast_enabled(dev) && x.scalar_type() != at::autocast::get_autocast_dtype(dev);
}
inline at::Tensor autocast_input(const at::Tensor& x) {
  return autocast_casts(x) ? x.to(at::autocast::get_autocast_dtype(x.device().type())) : x;
}

// Per-head groups (dim 1) for 4-D tensors, channel groups (last dim) otherwise
// (mesa_train.nn._common.group_dim_4d).
inline int64_t group_dim(const at::Tensor& t) { return t.dim() == 4 ? 1 : t.dim() - 1; }

// mesa_train.nn._common.nhwc_view / from_nhwc: a channels-last 4-D x grouped over dim 1 is
// compressed as its NHWC view x.permute(0, 2, 3, 1) grouped over dim 3 (same groups and
// statistics, no copy to NCHW); backward permutes the dequantized view back, a channels-last
// tensor as stock's backward sees (DESIGN.md, "Channels-last inputs")
inline bool is_channels_last(const at::Tensor& x) {
  return x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
}

// Whether the CPU loops of bitmask.cpp and standardise.cpp handle t: a non-empty CPU tensor of a
// floating dtype their dispatch instantiates (float, double, half, bfloat16); the ATen forms
// handle the rest (other devices, empty tensors)
inline bool is_cpu_floating(const at::Tensor& t) {
  const auto dt = t.scalar_type();
  return t.device().is_cpu() && t.numel() > 0 &&
         (dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16);
}
struct NhwcView {
  at::Tensor x;
  int64_t dim;
  bool permuted;
};
inline NhwcView nhwc_view(const at::Tensor& x, int64_t dim) {
  if (dim == 1 && is_channels_last(x)) return {x.permute({0, 2, 3, 1}), 3, true};
  return {x, dim, false};
}
inline at::Tensor from_nhwc(const at::Tensor& xh, bool permuted) {
  return permuted ? xh.permute({0, 3, 1, 2}) : xh;
}
// a gradient of the NCHW tensor in the layout of its NHWC codes (a view)
inline at::Tensor to_nhwc(const at::Tensor& g, bool permuted) { return permuted ? g.permute({0, 2, 3, 1}) : g; }

// An optional tensor that is present and defined, else nullopt: what each layer op hands
// Function::apply for an optional input. apply tracks only present tensors, so an undefined one
// passed through would shift needs_input_grad's indices.
inline std::optional<at::Tensor> present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t : std::optional<at::Tensor>();
}

// QuickGELU's derivative s * (1 + 1.702 x (1 - s)), s = sigmoid(1.702 x), in x's dtype and
// computed in at least float32 (in Half 1.702 x overflows past |x| ~ 38.5k, and inf * 0 was
// NaN): activations._quick_gelu_grad, the same ops
inline at::Tensor quick_gelu_grad(const at::Tensor& x) {
  const at::Tensor xf = x.to(at::promote_types(x.scalar_type(), at::kFloat));
  const at::Tensor s = at::sigmoid(xf * 1.702);
  return (s * ((xf * 1.702) * at::rsub(s, 1)).add(1)).to(x.scalar_type());
}

}  // namespace layers
}  // namespace mesa
