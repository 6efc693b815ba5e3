// Eager fast path of the Mesa Amax (mesa_train/nn/amax.py, _AmaxFn: Hiera's query and token
// pooling, x.view(B, stride, -1, C).amax(dim=1); squeeze-excite's and CBAM's x.amax((2, 3))) as
// one op whose autograd node is C++, as convnet_autograd.cpp does for the max pool.
//
// Why: the session-57 survey (scripts/layer_path_survey.py) found it the last Mesa layer of
// Hiera still on a Python Function, 6 times a step. The op runs the aten ops of that Function in
// its order: the stock amax, the 1-bit mask of the maxima (bitmask.h, relu.pack_bits' bytes),
// and in backward ATen's own amax gradient, scale_grad_by_count(restore_reduced_dims(g),
// result == x, dims), on the unpacked mask. Output and gradient are bitwise the Python
// Function's and stock's, ties and NaNs included (tests/test_amax_einsum_autograd.py).
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "bitmask.h"
#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

// amax's dims as sorted, distinct, non-negative ints, every dim where none is given
// (amax._reduced_dims)
std::vector<int64_t> reduced_dims(const at::Tensor& x, at::IntArrayRef dims) {
  std::vector<int64_t> out;
  for (const int64_t d : dims) out.push_back(at::maybe_wrap_dim(d, x.dim()));
  if (dims.empty())
    for (int64_t d = 0; d < x.dim(); ++d) out.push_back(d);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// t with its reduced dims back as size 1 (amax._restore, ATen's restore_reduced_dims): each
// unsqueeze, in ascending order, lands where the dim was
at::Tensor restore(at::Tensor t, const std::vector<int64_t>& dims, bool keepdim) {
  if (keepdim) return t;
  for (const int64_t d : dims) t = t.unsqueeze(d);
  return t;
}

struct AmaxTrain : public torch::autograd::Function<AmaxTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& dims,
                            bool keepdim) {
    at::Tensor out = at::amax(x, dims, keepdim);
    auto [bits, channels_last] = pack_bits(at::eq(x, restore(out, dims, keepdim)));
    ctx->save_for_backward({bits});
    ctx->saved_data["dims"] = dims;
    ctx->saved_data["keepdim"] = keepdim;
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["channels_last"] = channels_last;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // (no check_first_order: the mask is exact and the gradient linear in g, so under
    // create_graph=True these ops are recorded and differentiate as stock's amax backward does)
    NoAutocast no_autocast;
    const auto dims = ctx->saved_data["dims"].toIntVector();
    const at::Tensor mask = unpack_bits(ctx->get_saved_variables()[0], ctx->saved_data["shape"].toIntVector(),
                                        ctx->saved_data["channels_last"].toBool());
    // ATen's amax backward: the gradient shared equally between the elements equal to the maximum
    const at::Tensor g = restore(grads[0], dims, ctx->saved_data["keepdim"].toBool());
    at::Tensor gx = at::div(g, mask.sum(dims, /*keepdim=*/true)) * mask;
    return {gx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor amax_train(const at::Tensor& x, at::IntArrayRef dim, bool keepdim) {
  TORCH_CHECK_VALUE(at::isFloatingType(x.scalar_type()), "mesa::amax_train: x must be floating point, got ",
                    x.scalar_type());
  return AmaxTrain::apply(x, reduced_dims(x, dim), keepdim);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // torch.amax(x, dim, keepdim) keeping a 1-bit mask of the maxima (dim empty: every dim)
  m.def("amax_train(Tensor x, int[] dim, bool keepdim) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("amax_train", &mesa::amax_train); }
