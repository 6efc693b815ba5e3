// Eager fast path of the Mesa AvgPool2d (mesa_train/nn/avgpool.py, _AvgPool2dFn: PoolFormer's and
// EfficientFormer's token mixer, CoAtNet's and MaxViT's pooled shortcuts, timm's AvgPool2dSame)
// as one op whose autograd node is C++, as convnet_autograd.cpp does for the max pool.
//
// Why: it keeps nothing, so its whole cost is host time, and the Python Function was most of it
// (about 50 us a call on CPU, results/overhead/cpu-paths.md); the session-57 survey
// (scripts/layer_path_survey.py) found it 12 times a step in PoolFormer-S12 and 14 in
// EfficientFormer. The op runs ATen's avg_pool2d and keeps only what avg_pool2d_backward reads
// of the input (its sizes, dtype, device and suggested memory format); backward hands that
// kernel an uninitialised tensor of that shape. Output and gradient are bitwise the Python
// Function's and stock's (tests/test_nn_avgpool.py).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>

namespace mesa {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AvgPool2dTrain : public torch::autograd::Function<AvgPool2dTrain> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
                            std::optional<int64_t> divisor_override) {
    at::Tensor out = at::avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override);
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["ceil_mode"] = ceil_mode;
    ctx->saved_data["count_include_pad"] = count_include_pad;
    ctx->saved_data["divisor_override"] = divisor_override;
    // what the backward kernel reads of the input (the layout it gives the gradient: ATen's own
    // suggest_memory_format, as its meta function)
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["dtype"] = x.scalar_type();
    ctx->saved_data["device"] = x.device();
    ctx->saved_data["channels_last"] = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // (no check_first_order: the pool is linear and nothing kept is lossy, so under
    // create_graph=True avg_pool2d_backward is recorded and differentiates as stock's does)
    const auto fmt =
        ctx->saved_data["channels_last"].toBool() ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const at::Tensor x_like =  // never read, only its sizes
        at::empty(ctx->saved_data["shape"].toIntVector(),
                  at::TensorOptions().dtype(ctx->saved_data["dtype"].toScalarType()).device(
                      ctx->saved_data["device"].toDevice()),
                  fmt);
    at::Tensor gx = at::avg_pool2d_backward(
        grads[0], x_like, ctx->saved_data["kernel"].toIntVector(), ctx->saved_data["stride"].toIntVector(),
        ctx->saved_data["padding"].toIntVector(), ctx->saved_data["ceil_mode"].toBool(),
        ctx->saved_data["count_include_pad"].toBool(), ctx->saved_data["divisor_override"].toOptional<int64_t>());
    const at::Tensor none;
    return {gx, none, none, none, none, none, none};
  }
};

at::Tensor avg_pool2d_train(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
                            std::optional<int64_t> divisor_override) {
  for (const auto& [name, arg] :
       {std::pair{"kernel_size", kernel}, std::pair{"stride", stride}, std::pair{"padding", padding}}) {
    TORCH_CHECK_VALUE(arg.size() == 2, "mesa: avg_pool2d_train: ", name, " must have 2 values, got ", arg);
  }
  return AvgPool2dTrain::apply(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override);
}

}  // namespace
}  // namespace mesa

TORCH_LIBRARY_FRAGMENT(mesa, m) {
  // F.avg_pool2d with int[2] arguments (the stride given: mesa_train.nn.maxpool.pool_args)
  m.def(
      "avg_pool2d_train(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, bool ceil_mode, "
      "bool count_include_pad, int? divisor_override) -> Tensor");
}

// (see layers_autograd.cpp: one kernel for every backend, the node built here)
TORCH_LIBRARY_IMPL(mesa, Autograd, m) { m.impl("avg_pool2d_train", &mesa::avg_pool2d_train); }
