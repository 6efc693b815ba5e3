// Eager fast path of the Mesa Einsum of two operands (mesa_train/nn/einsum.py, _EinsumFn:
// MViTv2's relative positions, einsum("byhwc,hkc->byhwk", q, rel_h) and the same with rel_w, and
// SAM's explicit attention path) as one op whose autograd node is C++, as layers_autograd.cpp
// does for the matmul.
//
// Why: the session-57 survey (scripts/layer_path_survey.py) found it the last Mesa layer of
// MViTv2 still on a Python Function, 20 times a step. The op runs the aten ops and compressions
// of that Function in its order: the stock einsum (autocast applying inside it, as in the stock
// call), each operand kept as 8-bit codes with groups along dim 1 (or a variant format's), or as
// it is where it is under half the size of the other (a position table); backward is the
// contraction's closed form, two einsums, in the forward's autocast state. Outputs, codes,
// estimates and gradients are bitwise the Python Function's (tests/test_amax_einsum_autograd.py).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <set>
#include <string>
#include <vector>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// The subscripts (a, b, out) of a two-operand einsum whose gradients are einsums of the same
// letters (einsum.contraction): an explicit output, no "...", no letter repeated within a
// term, each operand's letters all in the other operand or the output. Empty: any other.
std::vector<std::string> contraction(c10::string_view equation) {
  std::string eq;
  for (const char c : equation)
    if (c != ' ') eq.push_back(c);
  const auto arrow = eq.find("->");
  const auto comma = eq.find(',');
  const auto npos = std::string::npos;
  if (eq.find("...") != npos || arrow == npos || eq.find("->", arrow + 1) != npos || comma == npos || comma > arrow ||
      eq.find(',', comma + 1) != npos)
    return {};
  std::vector<std::string> terms{eq.substr(0, comma), eq.substr(comma + 1, arrow - comma - 1), eq.substr(arrow + 2)};
  for (const auto& t : terms)
    if (std::set<char>(t.begin(), t.end()).size() != t.size()) return {};
  const auto covered = [](const std::string& t, const std::string& u, const std::string& v) {
    for (const char c : t)
      if (u.find(c) == std::string::npos && v.find(c) == std::string::npos) return false;
    return true;
  };
  if (!covered(terms[0], terms[1], terms[2]) || !covered(terms[1], terms[0], terms[2])) return {};
  return terms;
}

// Groups along dim 1 of an operand of 3 dims or more, its last dim otherwise (einsum._group_dim)
int64_t operand_group_dim(const at::Tensor& x) { return x.dim() >= 3 ? 1 : x.dim() - 1; }

// One operand as kept: its codes (compress_operand), or itself (a position table); nothing
// where the other operand's gradient is not asked for
struct Kept {
  OperandCodes codes;
  at::Tensor raw;
};

Kept keep(const at::Tensor& x, const at::Tensor& other, Quantizer& qz) {
  Kept k;
  if (!other.requires_grad()) return k;  // (grad mode is off here: ask the inputs)
  if (2 * x.numel() < other.numel()) {    // a position table: kept as it is
    k.raw = x;
  } else {
    k.codes = compress_operand(x, operand_group_dim(x), qz);
  }
  return k;
}

struct EinsumTrain : public torch::autograd::Function<EinsumTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const std::vector<std::string>& terms, c10::string_view equation, Quantizer qa,
                            Quantizer qb) {
    at::Tensor out = at::einsum(equation, {a, b});
    const Kept ka = keep(a, b, qa), kb = keep(b, a, qb);
    const OperandCodes &ca = ka.codes, &cb = kb.codes;
    ctx->save_for_backward({ca.q, ca.alpha, ca.beta, ka.raw, cb.q, cb.alpha, cb.beta, kb.raw});
    ctx->saved_data["a_layout"] = ca.layout;
    ctx->saved_data["b_layout"] = cb.layout;
    ctx->saved_data["a_shape"] = a.sizes();
    ctx->saved_data["b_shape"] = b.sizes();
    ctx->saved_data["a_dtype"] = a.scalar_type();
    ctx->saved_data["b_dtype"] = b.scalar_type();
    // the gradients' equations: dA = einsum("out,b->a", g, B), dB = einsum("out,a->b", g, A)
    ctx->saved_data["a_grad_eq"] = terms[2] + "," + terms[1] + "->" + terms[0];
    ctx->saved_data["b_grad_eq"] = terms[2] + "," + terms[0] + "->" + terms[1];
    save_autocast_state(ctx, out.device().type());
    return out;
  }

  // the operand kept from saved[first]: the codes dequantized in its dtype, or itself
  static at::Tensor restore(AutogradContext* ctx, const variable_list& saved, size_t first, const std::string& name) {
    if (saved[first + 3].defined()) return saved[first + 3];
    return dequantize_operand(saved, first, ctx->saved_data[name + "_layout"].toIntVector(),
                              ctx->saved_data[name + "_shape"].toIntVector(),
                              ctx->saved_data[name + "_dtype"].toScalarType());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Einsum");
    const auto saved = ctx->get_saved_variables();
    const bool need_a = ctx->needs_input_grad(0), need_b = ctx->needs_input_grad(1);
    const at::Tensor ah = need_b ? restore(ctx, saved, 0, "a") : at::Tensor();
    const at::Tensor bh = need_a ? restore(ctx, saved, 4, "b") : at::Tensor();
    at::Tensor ga, gb;
    {
      // the two products in the forward's autocast state (einsum.py: no_autocast, then
      // torch.autocast as the forward ran)
      AutocastScope autocast(ctx);
      if (need_a)
        ga = at::einsum(ctx->saved_data["a_grad_eq"].toStringRef(), {grads[0], bh})
                 .to(ctx->saved_data["a_dtype"].toScalarType());
      if (need_b)
        gb = at::einsum(ctx->saved_data["b_grad_eq"].toStringRef(), {grads[0], ah})
                 .to(ctx->saved_data["b_dtype"].toScalarType());
    }
    return {ga, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor einsum_train(c10::string_view equation, const at::Tensor& a, const at::Tensor& b, at::TensorList state_a,
                        int64_t num_groups_a, double decay_a, int64_t estimator_a, bool symmetric_a,
                        bool stochastic_a, at::TensorList state_b, int64_t num_groups_b, double decay_b,
                        int64_t estimator_b, bool symmetric_b, bool stochastic_b) {
  constexpr const char* op = "mesa::einsum_train";
  const std::vector<std::string> terms = contraction(equation);
  TORCH_CHECK_VALUE(!terms.empty(), op, ": equation '", equation, "' is not a contraction it takes: two operands, ",
                    "an explicit output ('->'), no '...', no letter repeated within a term, and each operand's ",
                    "letters all in the other operand or the output (mesa_train.nn.einsum.contraction)");
  TORCH_CHECK_VALUE(a.dim() > 0 && b.dim() > 0 && a.is_floating_point() && b.is_floating_point(), op,
                    ": the operands must be floating point with at least one dim, got ", a.scalar_type(), " ",
                    a.dim(), "-d and ", b.scalar_type(), " ", b.dim(), "-d");
  Quantizer qa = quantizer_from_list(state_a, num_groups_a, decay_a, estimator_a, symmetric_a, stochastic_a, op);
  Quantizer qb = quantizer_from_list(state_b, num_groups_b, decay_b, estimator_b, symmetric_b, stochastic_b, op);
  return EinsumTrain::apply(a, b, terms, equation, qa, qb);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // torch.einsum(equation, a, b) keeping each operand's codes (groups along dim 1; a position
  // table under half the other's size: itself); each state [alpha_est, beta_est, initialized,
  // rng] updated as by mesa::observe
  m.def(
      "einsum_train(str equation, Tensor a, Tensor b, Tensor(a!)[] state_a, int num_groups_a, float decay_a, "
      "int estimator_a, bool symmetric_a, bool stochastic_a, Tensor(b!)[] state_b, int num_groups_b, "
      "float decay_b, int estimator_b, bool symmetric_b, bool stochastic_b) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("einsum_train", &mesa::einsum_train); }
