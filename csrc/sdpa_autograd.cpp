// Eager fast path of the Mesa fused attention (mesa_train/nn/sdpa.py, ScaledDotProductAttention):
// the whole layer (compression of q, k, v, the stock scaled_dot_product_attention, backward by
// recomputation from the 8-bit copies) as one op, mesa::sdpa_train, whose autograd node is C++.
//
// Why: the Python path (three ActivationQuantizer.compress calls, then the autograd.Function
// _MesaSDPA with its Python backward) cost about 105 us of host time per call on CPU, three
// times the stock call's, the most of any Mesa layer (results/overhead/). This op mirrors that
// path op for op: the same mesa::observe / quantize per operand (per-head groups, sdpa.py's
// _group_dim), the same mask arithmetic (build_window_mask, built with grad mode on so that the
// backend choice is the stock call's), the same at::scaled_dot_product_attention call, and a
// backward that dequantizes, re-enters the forward's autocast state, recomputes the attention
// with grad mode on and runs autograd through it. Outputs, codes, estimates and gradients are
// therefore bitwise the Python Function's (tests/test_layers_autograd.py). The layer calls it
// only in eager mode, with a channel format (the paper's 8-bit one or a variant: packed
// codes read back by dequantize_codes) and dropout_p == 0 (a dropout mask would have to be
// replayed from a captured RNG state: the Python Function does that); everything else
// (learned thresholds) keeps _MesaSDPA. Shared pieces (op handles, Quantizer, compress):
// layers_common.h.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include "layers_common.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// mesa_train.nn.sdpa._group_dim: the head dim of a (..., heads, L, E) operand, the channel
// (last) dim of a 3-D one
int64_t head_group_dim(const at::Tensor& x) { return x.dim() >= 4 ? x.dim() - 3 : x.dim() - 1; }

// mesa_train.nn.sdpa.build_window_mask: attn_mask plus the (nW, N, N) window mask repeated
// over the batch (window w of image b is batch row b * nW + w), for the operand shape of q.
std::optional<at::Tensor> window_mask_sum(const std::optional<at::Tensor>& attn_mask,
                                          const std::optional<at::Tensor>& window_mask, const at::Tensor& q) {
  if (!window_mask.has_value()) return attn_mask;
  const int64_t heads = q.dim() >= 4 ? q.size(-3) : 1;
  const int64_t num_win = window_mask->size(0), N = window_mask->size(-1);
  at::Tensor m = window_mask->view({1, num_win, 1, N, N})
                     .expand({q.size(0) / num_win, -1, heads, -1, -1})
                     .reshape({-1, heads, N, N});
  if (!attn_mask.has_value()) return m;
  return *attn_mask + m;
}

// The attention itself: the arguments the Python path hands F.scaled_dot_product_attention
// (dropout_p 0 on this path, enable_gqa left at its default).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, bool is_causal, std::optional<double> scale) {
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale);
}

// The gradients of the recomputed attention `out` with respect to the wanted inputs by calling
// its backward node directly, where that node is the whole graph back to them: out is its
// output, each of its valid next edges leads to a wanted input's accumulator (one backend
// node: flash, memory-efficient or cuDNN attention, the CPU flash kernel, when no padding,
// cast or mask arithmetic requiring grad sits in between), no outer graph task limits which
// outputs a node computes (an outer torch.autograd.grad / backward(inputs=...) does: its
// exec_info would tell this node, which it does not know, to compute nothing) and anomaly mode
// is off (the engine's NaN check of each node's outputs). The call is the nested engine run's,
// node for node: the same apply on the same gradient with grad mode off, then the engine's
// validate_outputs; what it skips is the run itself (a GraphTask, the walk that fills its
// exec_info, the ready queue, the input buffers): the SDPA layer's Mesa-added host time 54 -> 44
// us a call on CPU (results/overhead/cpu-vs-2ae6e99.md). nullopt: the caller runs autograd::grad.
std::optional<variable_list> grads_by_node(const at::Tensor& out, const std::array<at::Tensor, 4>& inputs,
                                           const std::array<bool, 4>& need, const at::Tensor& grad) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info != nullptr && !exec_info->empty()) return std::nullopt;
  if (torch::autograd::AnomalyMode::is_enabled()) return std::nullopt;
  const auto& fn = out.grad_fn();  // (a shared_ptr in torch 2.11, an intrusive_ptr in 2.14)
  if (!fn) return std::nullopt;
  // each wanted input's accumulator, and the node's output (its next edge) that reaches it
  std::array<torch::autograd::Node*, 4> acc{};
  for (size_t i = 0; i < 4; ++i)
    if (need[i]) acc[i] = torch::autograd::impl::try_get_grad_accumulator(inputs[i]).get();
  std::array<int64_t, 4> edge_of{-1, -1, -1, -1};
  for (size_t j = 0; j < fn->num_outputs(); ++j) {
    const torch::autograd::Edge& e = fn->next_edge(j);
    if (!e.is_valid()) continue;
    const auto hit = std::find(acc.begin(), acc.end(), e.function.get());  // (a valid edge's is not null)
    if (hit == acc.end()) return std::nullopt;  // an edge into more graph: the engine walks it
    edge_of[hit - acc.begin()] = static_cast<int64_t>(j);
  }
  for (size_t i = 0; i < 4; ++i)
    if (need[i] && edge_of[i] < 0) return std::nullopt;
  variable_list grads_in(fn->num_inputs());
  grads_in.at(out.output_nr()) = grad;
  variable_list got;
  {
    at::AutoGradMode grad_off(false);  // the engine runs a node with grad mode = create_graph (false)
    got = (*fn)(std::move(grads_in));
  }
  torch::autograd::validate_outputs(fn->next_edges(), got, [](const std::string& msg) {
    return "mesa: ScaledDotProductAttention backward: " + msg;
  });
  variable_list result;
  for (size_t i = 0; i < 4; ++i) {
    if (!need[i]) continue;
    if (!got[edge_of[i]].defined()) return std::nullopt;  // (autograd::grad raises its own error)
    result.push_back(got[edge_of[i]]);
  }
  return result;
}

// The gradients `need` asks for (of q, k, v, attn_mask: `inputs`, each requiring grad when
// wanted) by recomputing the attention with grad mode on and running autograd through it: the
// exact gradient of attention at the inputs, softmax statistics included. The caller sets the
// forward's autocast state (AutocastScope). Shared by SdpaTrain's backward and the compiled
// backward's op (sdpa_recompute_backward below).
variable_list grads_by_recompute(const std::array<at::Tensor, 4>& inputs, const std::array<bool, 4>& need,
                                 const std::optional<at::Tensor>& window_mask, bool is_causal,
                                 std::optional<double> scale, const at::Tensor& grad_out) {
  variable_list wanted;
  for (size_t i = 0; i < 4; ++i)
    if (need[i]) wanted.push_back(inputs[i]);
  if (wanted.empty()) return {};
  at::AutoGradMode grad_on(true);
  std::optional<at::Tensor> attn_mask;
  if (inputs[3].defined()) attn_mask = inputs[3];
  at::Tensor out =
      attention(inputs[0], inputs[1], inputs[2], window_mask_sum(attn_mask, window_mask, inputs[0]), is_causal, scale);
  const at::Tensor grad = grad_out.to(out.scalar_type());
  if (auto direct = grads_by_node(out, inputs, need, grad)) return std::move(*direct);
  return torch::autograd::grad({out}, wanted, {grad});
}

// Saved tensors: codes, alpha, beta of q, k and v (in that order), then the two masks.
constexpr size_t kAttnMask = 9, kWindowMask = 10;
// forward's arguments: q, k, v, attn_mask, window_mask, is_causal, scale, three quantizers
constexpr size_t kForwardArgs = 10;

struct SdpaTrain : public torch::autograd::Function<SdpaTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& window_mask,
                            bool is_causal, std::optional<double> scale, Quantizer qz_q, Quantizer qz_k,
                            Quantizer qz_v) {
    // 1. the compressed copies (8-bit, or a variant format's packed codes), in the Python
    // module's order (it compresses before Function.apply)
    std::vector<at::Tensor> saved;
    std::vector<int64_t> layout;  // (dim, groups, bits, pow2) per operand
    const std::array<std::pair<const at::Tensor*, Quantizer*>, 3> operands{
        {{&q, &qz_q}, {&k, &qz_k}, {&v, &qz_v}}};
    for (const auto& [x, qz] : operands) {
      const OperandCodes c = compress_operand(*x, head_group_dim(*x), *qz);
      saved.insert(saved.end(), {c.q, c.alpha, c.beta});
      layout.insert(layout.end(), c.layout.begin(), c.layout.end());
    }
    // 2. the stock call. The combined mask is built with grad mode on, as in _MesaSDPA.forward:
    // it requires grad exactly when the stock call's would (attn_mask does), and whether it does
    // decides the backend, so the output is bitwise the stock one. Nothing flows back through it.
    std::optional<at::Tensor> mask;
    {
      at::AutoGradMode grad_on(true);
      mask = window_mask_sum(attn_mask, window_mask, q);
    }
    at::Tensor out = attention(q, k, v, mask, is_causal, scale);

    // 3. for backward: the codes, the two small masks as given (not their batch-sized sum), and
    // what the recomputation needs to run as the forward did (dtypes, options, autocast state)
    saved.push_back(attn_mask.value_or(at::Tensor()));
    saved.push_back(window_mask.value_or(at::Tensor()));
    ctx->save_for_backward(saved);
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(q.scalar_type()),
                                                     static_cast<int64_t>(k.scalar_type()),
                                                     static_cast<int64_t>(v.scalar_type())};
    ctx->saved_data["shapes"] = std::vector<std::vector<int64_t>>{q.sizes().vec(), k.sizes().vec(), v.sizes().vec()};
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    save_autocast_state(ctx, q.device().type());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("ScaledDotProductAttention");
    const auto saved = ctx->get_saved_variables();
    const auto layout = ctx->saved_data["layout"].toIntVector();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const at::Tensor& attn_mask_in = saved[kAttnMask];
    std::optional<at::Tensor> window_mask;
    if (saved[kWindowMask].defined()) window_mask = saved[kWindowMask];
    // needs_input_grad indexes the tensors apply tracked: q, k, v, then attn_mask if given
    const bool mask_grad = attn_mask_in.defined() && ctx->needs_input_grad(3) && attn_mask_in.is_floating_point();
    const std::array<bool, 4> need{ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2),
                                   mask_grad};

    // 1. the inputs again: dequantized q, k, v (in their input dtypes) and the mask, each
    // requiring grad when its gradient is wanted
    std::array<at::Tensor, 4> inputs;
    const auto shapes = ctx->saved_data["shapes"].to<std::vector<std::vector<int64_t>>>();
    for (size_t i = 0; i < 3; ++i) {
      inputs[i] = dequantize_operand(saved, 3 * i, at::IntArrayRef(layout).slice(4 * i, 4), shapes[i],
                                     static_cast<c10::ScalarType>(dtypes[i]));
      inputs[i].requires_grad_(need[i]);
    }
    if (attn_mask_in.defined()) inputs[3] = attn_mask_in.detach().requires_grad_(mask_grad);

    // 2. the attention recomputed at the dequantized inputs, as the forward ran it (grad mode
    // on, the forward's autocast state), and autograd through it
    variable_list got;
    {
      AutocastScope autocast(ctx);
      got = grads_by_recompute(inputs, need, window_mask, ctx->saved_data["is_causal"].toBool(),
                               ctx->saved_data["scale"].toOptional<double>(), grads[0]);
    }

    // 3. one gradient per forward argument (q, k, v, attn_mask; none for the rest)
    variable_list result(kForwardArgs);
    for (size_t i = 0, j = 0; i < 4; ++i)
      if (need[i]) result[i] = got[j++];
    return result;
  }
};

at::Tensor sdpa_train(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& window_mask,
                      bool is_causal, std::optional<double> scale, at::TensorList state_q, int64_t num_groups_q,
                      double decay_q, int64_t estimator_q, bool symmetric_q, bool stochastic_q, at::TensorList state_k,
                      int64_t num_groups_k, double decay_k, int64_t estimator_k, bool symmetric_k, bool stochastic_k,
                      at::TensorList state_v, int64_t num_groups_v, double decay_v, int64_t estimator_v,
                      bool symmetric_v, bool stochastic_v) {
  constexpr const char* op = "mesa::sdpa_train";
  return SdpaTrain::apply(
      q, k, v, present(attn_mask), present(window_mask), is_causal, scale,
      quantizer_from_list(state_q, num_groups_q, decay_q, estimator_q, symmetric_q, stochastic_q, op),
      quantizer_from_list(state_k, num_groups_k, decay_k, estimator_k, symmetric_k, stochastic_k, op),
      quantizer_from_list(state_v, num_groups_v, decay_v, estimator_v, symmetric_v, stochastic_v, op));
}

// The name Python gives a mask's dtype (the dtypes a non-floating mask can have), for the
// error message of the Python kernel this op replaced
std::string python_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// The compiled backward of the fused attention (mesa_train/nn/sdpa_backward.py): the gradients
// output_mask asks for, of q, k, v (already dequantized by the compiled graph) and attn_mask,
// by SdpaTrain's recomputation, in the forward's autocast state, each contiguous (as the fake
// kernel states). Why C++: its Python kernel (autograd.grad under enable_grad and autocast,
// detach and requires_grad per input) took 316-460 us of host time a call in the H200's profile
// of the compiled fused DeiT-S row (2026-12-04, 12 calls a step), against about 100-160 for
// SdpaTrain's whole node; the Python kernel stays as the fallback of a build without this op.
std::vector<at::Tensor> sdpa_recompute_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                                                const std::optional<at::Tensor>& window_mask, bool is_causal,
                                                std::optional<double> scale, c10::List<bool> output_mask,
                                                bool autocast, std::optional<at::ScalarType> autocast_dtype) {
  constexpr const char* op = "mesa::sdpa_recompute_backward";
  TORCH_CHECK_VALUE(output_mask.size() == 4, op, ": output_mask has one flag per input (q, k, v, attn_mask), got ",
                    output_mask.size());
  const std::array<bool, 4> need{output_mask[0], output_mask[1], output_mask[2], output_mask[3]};
  TORCH_CHECK_VALUE(!need[3] || (attn_mask.has_value() && attn_mask->is_floating_point()), op,
                    ": output_mask asks for the mask's gradient, but attn_mask is ",
                    attn_mask.has_value() ? python_dtype(attn_mask->scalar_type()) : std::string("None"),
                    "; only a floating mask has one");
  // A dispatch mode (PyTorch's opcheck, a FLOP counter, scripts/op_census.py) hands a kernel its
  // call with autograd excluded: lift that, or the recomputation would record no graph
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  std::optional<c10::impl::ForceDispatchKeyGuard> reach_autograd;
  if (tls.excluded_.has(c10::DispatchKey::AutogradFunctionality)) {
    c10::DispatchKeySet excluded = tls.excluded_;
    for (const auto key : {c10::DispatchKey::AutogradFunctionality, c10::DispatchKey::AutogradOther,
                           c10::DispatchKey::AutogradNestedTensor, c10::DispatchKey::ADInplaceOrView})
      excluded = excluded.remove(key);
    reach_autograd.emplace(tls.included_, excluded);
  }
  std::array<at::Tensor, 4> inputs{q.detach().requires_grad_(need[0]), k.detach().requires_grad_(need[1]),
                                   v.detach().requires_grad_(need[2]), at::Tensor()};
  if (attn_mask.has_value()) inputs[3] = attn_mask->detach().requires_grad_(need[3]);
  variable_list got;
  {
    const at::DeviceType dev = q.device().type();
    const bool available = at::autocast::is_autocast_available(dev);
    // (no dtype: torch.autocast's default, the device's current autocast dtype)
    AutocastScope scope(dev, autocast,
                        autocast_dtype.value_or(available ? at::autocast::get_autocast_dtype(dev) : at::kFloat));
    got = grads_by_recompute(inputs, need, window_mask, is_causal, scale, grad_out);
  }
  std::vector<at::Tensor> result;
  result.reserve(got.size());
  for (const at::Tensor& g : got) result.push_back(g.contiguous());
  return result;
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // (mesa_train/nn/sdpa_backward.py registers its fake kernel, and defines the op in Python
  // where the extension lacks it)
  m.def(
      "sdpa_recompute_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? window_mask, bool is_causal, float? scale, bool[] output_mask, bool autocast, "
      "ScalarType? autocast_dtype) -> Tensor[]");
  // state_*: the operand's quantizer buffers [alpha_est, beta_est, initialized, rng], mutated
  // (estimates, rounding counter) as by mesa::observe
  m.def(
      "sdpa_train(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? window_mask, bool is_causal, "
      "float? scale, Tensor(a!)[] state_q, int num_groups_q, float decay_q, int estimator_q, bool symmetric_q, "
      "bool stochastic_q, Tensor(b!)[] state_k, int num_groups_k, float decay_k, int estimator_k, "
      "bool symmetric_k, bool stochastic_k, Tensor(c!)[] state_v, int num_groups_v, float decay_v, "
      "int estimator_v, bool symmetric_v, bool stochastic_v) -> Tensor");
}

// As for the layer ops of layers_autograd.cpp: one kernel for every backend, the work
// dispatching to the CPU or CUDA kernels of the ops it calls.
TORCH_LIBRARY_IMPL(mesa, Autograd, m) {
  m.impl("sdpa_train", &mesa::sdpa_train);
  // the kernel runs autograd itself: the dispatcher must reach it with autograd still on (a
  // fallthrough sets no below-autograd guard); its results carry no graph (a backward)
  m.impl("sdpa_recompute_backward", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(mesa, CompositeExplicitAutograd, m) {
  m.impl("sdpa_recompute_backward", &mesa::sdpa_recompute_backward);
}
