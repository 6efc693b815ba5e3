// Eager fast path of the Mesa Normalize, F.normalize(x, 2, dim, eps) of cosine attention's q and
// k (mesa_train/nn/normalize.py, _NormalizeFn: XCiT, SwinV2, EdgeNeXt's transposed attention),
// as one op whose autograd node is C++, as gated_autograd.cpp does for the gated products.
//
// Why: in the session-56 survey of timm families it ran a Python Function 24 times a step in
// XCiT and 6 in EdgeNeXt, each about 100 us of host time. The op runs the aten ops and the
// compression the Python Function runs, in the same order, so outputs, codes, estimates and
// gradients are bitwise its own (tests/test_normalize_autograd.py). It keeps y = x / n in the
// quantizer's format (group_dim: per-head groups of a 4-D tensor) and the per-row divisor n:
//   dx = (g - y * sum(g * y)) / n  where n > eps,  g / n  where the norm was clamped.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

struct NormalizeTrain : public torch::autograd::Function<NormalizeTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, double eps, Quantizer qz) {
    // the ops of F.normalize itself (same bits; Tensor.norm(2.0, dim) is linalg.vector_norm),
    // with the divisor kept for backward
    const std::vector<int64_t> dims{dim};
    const at::Tensor n = at::linalg_vector_norm(x, 2.0, dims, true).clamp_min(eps);
    at::Tensor y = x / n.expand_as(x);
    at::Tensor q, alpha, beta;
    int64_t G = 0;
    const int64_t gdim = group_dim(y);
    std::tie(q, alpha, beta, G) = compress(y, gdim, qz);  // (as the Python Function: always)
    save_code_format(ctx, qz, y.sizes());
    ctx->save_for_backward({q, alpha, beta, n});
    ctx->saved_data["gdim"] = gdim;
    ctx->saved_data["groups"] = G;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["cdt"] = y.scalar_type();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("Normalize");
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto cdt = ctx->saved_data["cdt"].toScalarType();
    const at::Tensor g = grads[0].to(cdt);
    const at::Tensor& n = saved[3];
    const at::Tensor yh =
        decompress_saved(ctx, saved, ctx->saved_data["gdim"].toInt(), ctx->saved_data["groups"].toInt(), cdt);
    const at::Tensor radial = yh * (g * yh).sum(ctx->saved_data["dim"].toInt(), true);
    const at::Tensor gx = at::where(n > ctx->saved_data["eps"].toDouble(), g - radial, g) / n;
    return {gx.to(ctx->saved_data["x_dtype"].toScalarType()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor normalize_train(const at::Tensor& x, int64_t dim, double eps, at::TensorList state, int64_t num_groups,
                           double decay, int64_t estimator, bool symmetric, bool stochastic) {
  TORCH_CHECK_VALUE(x.dim() > 0, "mesa::normalize_train: x must have at least one dim, got a 0-d tensor");
  TORCH_CHECK_INDEX(dim >= -x.dim() && dim < x.dim(), "mesa::normalize_train: dim must be in [", -x.dim(), ", ",
                    x.dim() - 1, "] for a ", x.dim(), "-d x, got ", dim);
  return NormalizeTrain::apply(
      x, dim, eps,
      quantizer_from_list(state, num_groups, decay, estimator, symmetric, stochastic, "mesa::normalize_train"));
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // F.normalize(x, 2, dim, eps); state [alpha_est, beta_est, initialized, rng] updated as by
  // mesa::observe
  m.def(
      "normalize_train(Tensor x, int dim, float eps, Tensor(a!)[] state, int num_groups, float decay, "
      "int estimator, bool symmetric, bool stochastic) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("normalize_train", &mesa::normalize_train); }
