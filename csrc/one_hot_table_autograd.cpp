// Eager fast path of the Mesa OneHotTable (mesa_train/nn/one_hot_table.py, _OneHotTableFn: Gemma
// 4's position embeddings, one_hot(positions) @ table) as one op whose autograd node is C++.
//
// Why: the session-59 zoo survey found it the last Mesa layer on a Python Function besides the
// Clamp (Gemma 4's patch embedding, once a step). The op runs the aten ops of that Function in
// its order: the forward is stock's matmul of the float one-hot matrix (B, axes, N, P) with the
// table (axes, P, D), autocast applying inside it as in the stock call; only the integer
// positions (B, N, axes) are kept; the table's gradient is an index_add of the output
// gradient's rows, row j * P + p getting every g[b, j, n] whose positions[b, n, j] is p. Output
// and gradient are bitwise the Python Function's (tests/test_clamp_table_autograd.py).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "layers_common.h"

namespace mesa {
namespace {

using namespace layers;  // (layers_common.h)

struct OneHotTableTrain : public torch::autograd::Function<OneHotTableTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& positions, const at::Tensor& table) {
    const at::Tensor one_hot = at::one_hot(positions, table.size(1)).permute({0, 2, 1, 3}).to(table);
    at::Tensor out = at::matmul(one_hot, table);  // (B, axes, N, P) @ (axes, P, D): stock's own matmul
    ctx->save_for_backward({positions});
    ctx->saved_data["table_shape"] = table.sizes();
    ctx->saved_data["table_dtype"] = table.scalar_type();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("OneHotTable");
    NoAutocast no_autocast;
    const at::Tensor positions = ctx->get_saved_variables()[0];
    const auto shape = ctx->saved_data["table_shape"].toIntVector();
    const auto dtype = ctx->saved_data["table_dtype"].toScalarType();
    const int64_t axes = shape[0], size = shape[1], dim = shape[2];
    const at::Tensor rows = positions + at::arange(axes, positions.options()) * size;  // (B, N, axes)
    const at::Tensor flat = grads[0].to(dtype).permute({0, 2, 1, 3}).reshape({-1, dim});  // (B * N * axes, D)
    at::Tensor grad = at::zeros({axes * size, dim}, grads[0].options().dtype(dtype));
    grad.index_add_(0, rows.reshape(-1), flat);
    return {at::Tensor(), grad.view(shape)};
  }
};

at::Tensor one_hot_table_train(const at::Tensor& positions, const at::Tensor& table) {
  TORCH_CHECK_VALUE(positions.dim() == 3 && table.dim() == 3 && positions.size(2) == table.size(0),
                    "mesa::one_hot_table_train: positions must be (B, N, axes) and table (axes, P, D), got ",
                    positions.sizes(), " and ", table.sizes());
  return OneHotTableTrain::apply(positions, table);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // one_hot(positions, P).permute(0, 2, 1, 3).to(table) @ table, keeping the positions
  m.def("one_hot_table_train(Tensor positions, Tensor table) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("one_hot_table_train", &mesa::one_hot_table_train); }
