// Eager fast path of the gated product act(a) * b (mesa_train/nn/activations.py, _GatedFn):
// the SwiGLU / GEGLU MLPs (act SiLU or GELU: EVA-02, MambaOut) and the plain products a * b
// (act Identity, patch/gating.py: gMLP, FocalNet, StarNet, CoaT) as one op whose autograd node
// is C++, as convnet_autograd.cpp does for the one-input activations.
//
// Why: in a survey of 42 timm families (session 56: the backward graph's node names after one
// patched forward) this was the Mesa layer most often left on a Python Function in eager
// training: 48 a step in FocalNet-T, 30 in gMLP-Ti, 18 in MambaOut-femto, 15 in StarNet-S1,
// 12 in EVA-02-Ti. The op runs the aten ops and the compressions the Python Function runs, in
// the same order, so outputs, codes, estimates and gradients are bitwise its own
// (tests/test_gated_autograd.py). The layer calls it for the activations that Function
// differentiates in closed form (activations._act_vjp), in eager mode with a channel format;
// any other activation module keeps the Python Function (autograd through the module).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// the activations the op evaluates (mesa_train.nn.activations._GATED_ACTS)
enum class GateAct : int64_t { kIdentity = 0, kSilu, kGelu, kGeluTanh, kSigmoid, kTanh, kQuickGelu, kCount };

at::Tensor activation(const at::Tensor& x, GateAct act) {
  switch (act) {
    case GateAct::kIdentity: return x;
    case GateAct::kSilu: return at::silu(x);
    case GateAct::kGelu: return at::gelu(x);
    case GateAct::kGeluTanh: return at::gelu(x, "tanh");
    case GateAct::kSigmoid: return at::sigmoid(x);
    case GateAct::kTanh: return at::tanh(x);
    default: return x * at::sigmoid(x * 1.702);  // activations.quick_gelu
  }
}

// g * act'(x), with h = act(x) (activations._act_vjp's closed forms, the same ops)
at::Tensor activation_vjp(GateAct act, const at::Tensor& g, const at::Tensor& x, const at::Tensor& h) {
  switch (act) {
    case GateAct::kIdentity: return g;
    case GateAct::kSilu: return at::silu_backward(g, x);
    case GateAct::kGelu: return at::gelu_backward(g, x);
    case GateAct::kGeluTanh: return at::gelu_backward(g, x, "tanh");
    case GateAct::kSigmoid: return at::sigmoid_backward(g, h);
    case GateAct::kTanh: return at::tanh_backward(g, h);
    default: return g * quick_gelu_grad(x);
  }
}

struct GatedTrain : public torch::autograd::Function<GatedTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, int64_t act,
                            bool gate_last, Quantizer qa, Quantizer qb) {
    const auto k = static_cast<GateAct>(act);
    const at::Tensor h = activation(a, k);
    at::Tensor y = gate_last ? b * h : h * b;
    // b's gradient needs act(a), a's needs a and b (grad mode is off here: ask the inputs)
    OperandCodes ca, cb;
    if (a.requires_grad() || b.requires_grad()) ca = compress_operand(a, group_dim(a), qa);
    if (a.requires_grad()) cb = compress_operand(b, group_dim(b), qb);
    ctx->save_for_backward({ca.q, ca.alpha, ca.beta, cb.q, cb.alpha, cb.beta});
    ctx->saved_data["a_layout"] = ca.layout;
    ctx->saved_data["b_layout"] = cb.layout;
    ctx->saved_data["a_shape"] = a.sizes();
    ctx->saved_data["b_shape"] = b.sizes();
    ctx->saved_data["act"] = act;
    ctx->saved_data["cdt"] = y.scalar_type();
    ctx->saved_data["a_dtype"] = a.scalar_type();
    ctx->saved_data["b_dtype"] = b.scalar_type();
    return y;
  }

  // Gradients in the operands' broadcast shape: autograd sums each to its operand's shape.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("gated activation");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto k = static_cast<GateAct>(ctx->saved_data["act"].toInt());
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const bool need_a = ctx->needs_input_grad(0), need_b = ctx->needs_input_grad(1);
    const at::Tensor g = grads[0].to(cdt);
    const at::Tensor ah = dequantize_operand(saved, 0, ctx->saved_data["a_layout"].toIntVector(),
                                             ctx->saved_data["a_shape"].toIntVector(), cdt);
    // the activation again at the dequantized gate, where a gradient reads it
    const bool reads_h = need_b || k == GateAct::kSigmoid || k == GateAct::kTanh;
    const at::Tensor h = reads_h ? activation(ah, k) : at::Tensor();
    at::Tensor ga, gb;
    if (need_b) gb = (g * h).to(ctx->saved_data["b_dtype"].toScalarType());
    if (need_a) {
      const at::Tensor bh =
          dequantize_operand(saved, 3, ctx->saved_data["b_layout"].toIntVector(),
                             ctx->saved_data["b_shape"].toIntVector(), cdt);
      ga = activation_vjp(k, g * bh, ah, h).to(ctx->saved_data["a_dtype"].toScalarType());
    }
    return {ga, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated_train(const at::Tensor& a, const at::Tensor& b, int64_t act, bool gate_last, at::TensorList state_a,
                       int64_t num_groups_a, double decay_a, int64_t estimator_a, bool symmetric_a, bool stochastic_a,
                       at::TensorList state_b, int64_t num_groups_b, double decay_b, int64_t estimator_b,
                       bool symmetric_b, bool stochastic_b) {
  TORCH_CHECK_VALUE(act >= 0 && act < static_cast<int64_t>(GateAct::kCount), "mesa::gated_train: act must be 0 ",
                    "(identity), 1 (silu), 2 (gelu), 3 (gelu tanh), 4 (sigmoid), 5 (tanh) or 6 (quick_gelu), got ",
                    act);
  TORCH_CHECK_VALUE(a.dim() > 0 && b.dim() > 0, "mesa::gated_train: the operands must have at least one dim, got ",
                    a.dim(), "-d and ", b.dim(), "-d");
  return GatedTrain::apply(
      a, b, act, gate_last,
      quantizer_from_list(state_a, num_groups_a, decay_a, estimator_a, symmetric_a, stochastic_a, "mesa::gated_train"),
      quantizer_from_list(state_b, num_groups_b, decay_b, estimator_b, symmetric_b, stochastic_b, "mesa::gated_train"));
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // act(a) * b (gate_last: b * act(a)); act: 0 identity, 1 silu, 2 gelu, 3 gelu tanh,
  // 4 sigmoid, 5 tanh, 6 quick_gelu (x * sigmoid(1.702 x)); each state [alpha_est, beta_est,
  // initialized, rng] updated as by mesa::observe
  m.def(
      "gated_train(Tensor a, Tensor b, int act, bool gate_last, Tensor(a!)[] state_a, int num_groups_a, "
      "float decay_a, int estimator_a, bool symmetric_a, bool stochastic_a, Tensor(b!)[] state_b, "
      "int num_groups_b, float decay_b, int estimator_b, bool symmetric_b, bool stochastic_b) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("gated_train", &mesa::gated_train); }
