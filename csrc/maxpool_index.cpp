// maxpool_index.h. Two implementations with the same (integer, exact) results:
// * the CPU, with idx / local contiguous or channels-last: one pass over the output elements,
//   each window origin computed once per output row (contiguous) or position (channels-last);
// * otherwise (CUDA): ATen ops, maxpool._window_local / _global_index op for op.
// Why the CPU loops: the ATen form is 9 ops and 6 passes over the output each way, which made
// the C++ MaxPool2d cost 3x stock's host time on small tensors (results/overhead/README.md).
#include "maxpool_index.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace mesa {
namespace {

constexpr int64_t kGrain = 16384;  // output elements per parallel task

// Which memory walk a CPU loop takes: its planes are (n, c) or (c,) and its rows oh. The ATen
// ops off the CPU, for other layouts, and for planes of 2**31 elements or more (a division's
// operand: Divisor's range).
enum class Walk { kAten, kContiguous, kChannelsLast };

Walk walk_of(const at::Tensor& t, int64_t plane) {
  if (!t.device().is_cpu() || plane >= (int64_t{1} << 31)) return Walk::kAten;
  if (t.is_contiguous()) return Walk::kContiguous;
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return Walk::kChannelsLast;
  return Walk::kAten;
}

// (OH, 1) / (OW,) rows and columns of each output's window origin (negative in the padding)
std::pair<at::Tensor, at::Tensor> window_origins(const at::Tensor& out, at::IntArrayRef stride,
                                                 at::IntArrayRef padding, at::ScalarType dtype) {
  const int64_t oh = out.size(-2), ow = out.size(-1);
  const auto opts = out.options().dtype(dtype);
  return {at::arange(-padding[0], oh * stride[0] - padding[0], stride[0], opts).unsqueeze(-1),
          at::arange(-padding[1], ow * stride[1] - padding[1], stride[1], opts)};
}

// Calls f(i0, n, h0, w0, w_step) for each run of n elements at memory offsets i0.. of t, in
// parallel. The k-th element's window origin is row h0, column w0 + k * w_step (negative in the
// padding): channels-last, a run is one output position's channels (w_step = 0); contiguous, one
// output row (w_step = the column stride).
template <typename F>
void for_runs(Walk walk, const at::Tensor& t, at::IntArrayRef stride, at::IntArrayRef padding, F f) {
  const int64_t oh_n = t.size(-2), ow_n = t.size(-1);
  const int64_t sh = stride[0], sw = stride[1], ph = padding[0], pw = padding[1];
  const bool contiguous = walk == Walk::kContiguous;
  const int64_t run = contiguous ? ow_n : t.size(1);  // a row, or a position's channels
  const int64_t runs = run == 0 ? 0 : t.numel() / run;
  const int64_t w_step = contiguous ? sw : 0;
  at::parallel_for(0, runs, std::max<int64_t>(1, kGrain / std::max<int64_t>(run, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t oh = contiguous ? r % oh_n : (r / ow_n) % oh_n;  // (n, oh, ow, c) in memory
      const int64_t ow = contiguous ? 0 : r % ow_n;
      f(r * run, run, oh * sh - ph, ow * sw - pw, w_step);
    }
  });
}

// floor(v / d) for 0 <= v < 2**31 as a multiply and a shift (Granlund and Montgomery's
// round-up method with N = 31: m = floor(2**(31 + l) / d) + 1, l = ceil(log2 d), m < 2**33, so
// v * m < 2**64). With three 64-bit divisions per element (by W and the dilations) and its
// constants reloaded after every uint8 store, the forward loop took 3.3 ms on ResNet's stem
// pool at batch 8, channels-last (1.6 M outputs; stock's whole pool forward: 2 ms); with
// Divisor and LocalArgs (below) 1.2 ms, 2 threads.
struct Divisor {
  uint64_t m;
  int shift;
  explicit Divisor(int64_t d) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    shift = 31 + l;
    m = (uint64_t{1} << shift) / static_cast<uint64_t>(d) + 1;
  }
  int64_t of(int64_t v) const { return static_cast<int64_t>((static_cast<uint64_t>(v) * m) >> shift); }
};

// What local_run needs of the pool, by value (in registers: the uint8 stores may alias memory)
struct LocalArgs {
  Divisor by_width, by_dh, by_dw;
  int64_t width, kw;
};

// The window-local indices of n outputs: their window origins' row h0, and column w0 + k * w_step
// for the k-th (contiguous: a row's columns, w_step = the stride; channels-last: one position's
// channels, 0). Each ip[k] = h * W + w, h >= h0 and w >= the column: every quotient is floor's.
template <bool kDilated>
void local_run(const int64_t* __restrict__ ip, uint8_t* __restrict__ lp, int64_t n, int64_t h0, int64_t w0,
               int64_t w_step, const LocalArgs a) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t v = ip[k], h = a.by_width.of(v), w = w0 + k * w_step;
    if constexpr (kDilated) {
      lp[k] = static_cast<uint8_t>(a.by_dh.of(h - h0) * a.kw + a.by_dw.of(v - h * a.width - w));
    } else {  // (h - h0) * kW + (v - h * W - w)
      lp[k] = static_cast<uint8_t>(v + h * (a.kw - a.width) - (h0 * a.kw + w));
    }
  }
}

// The inverse of local_run: the k-th of n outputs' window origin is origin + k * w_step (h * W + w).
inline void global_run(const uint8_t* __restrict__ lp, int64_t* __restrict__ ip, int64_t n, int64_t origin,
                       int64_t w_step, const int64_t* __restrict__ offset) {
  for (int64_t k = 0; k < n; ++k) ip[k] = origin + k * w_step + offset[lp[k]];
}

}  // namespace

at::Tensor window_local_index(const at::Tensor& idx, int64_t height, int64_t width, at::IntArrayRef kernel,
                              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const Walk walk = walk_of(idx, height * width);
  if (walk == Walk::kAten) {
    // int32 holds h * W + w for any plane under 2**31 elements: half the bytes of each pass
    const at::Tensor i = height * width < (int64_t{1} << 31) ? idx.to(at::kInt) : idx;
    const auto [h0, w0] = window_origins(idx, stride, padding, i.scalar_type());
    const at::Tensor h = at::div(i, width, "floor");
    at::Tensor local;
    if (dilation[0] == 1 && dilation[1] == 1) {  // idx + h * (kW - W) - (h0 * kW + w0)
      local = at::add(i, h, kernel[1] - width).sub(at::add(w0, h0, kernel[1]));
    } else {
      const at::Tensor lh = at::div(h.sub(h0), dilation[0], "floor");
      const at::Tensor lw = at::div(i.sub(h.mul(width)).sub(w0), dilation[1], "floor");
      local = lh.mul(kernel[1]).add(lw);
    }
    return local.to(at::kByte);
  }
  at::Tensor local = at::empty_like(idx, idx.options().dtype(at::kByte));  // (idx's layout)
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  uint8_t* lp = local.mutable_data_ptr<uint8_t>();
  const LocalArgs args{Divisor(width), Divisor(dilation[0]), Divisor(dilation[1]), width, kernel[1]};
  const bool dilated = dilation[0] != 1 || dilation[1] != 1;
  for_runs(walk, idx, stride, padding, [&](int64_t i0, int64_t n, int64_t h0, int64_t w0, int64_t w_step) {
    if (dilated) {
      local_run<true>(ip + i0, lp + i0, n, h0, w0, w_step, args);
    } else {
      local_run<false>(ip + i0, lp + i0, n, h0, w0, w_step, args);
    }
  });
  return local;
}

at::Tensor global_index(const at::Tensor& local, int64_t width, at::IntArrayRef kernel, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation) {
  const Walk walk = walk_of(local, 0);  // (no division)
  if (walk == Walk::kAten) {
    const auto [h0, w0] = window_origins(local, stride, padding, at::kLong);
    const auto lopts = local.options().dtype(at::kLong);
    const at::Tensor rows = at::arange(0, kernel[0] * dilation[0] * width, dilation[0] * width, lopts);
    const at::Tensor cols = at::arange(0, kernel[1] * dilation[1], dilation[1], lopts);
    const at::Tensor offset = rows.unsqueeze(-1).add(cols).view(-1);
    return at::add(w0, h0, width).add(offset.index({local.to(at::kLong)}));
  }
  // the kH * kW offsets of a window's elements from its origin, h * W + w
  std::vector<int64_t> offset(kernel[0] * kernel[1]);
  for (int64_t lh = 0; lh < kernel[0]; ++lh) {
    for (int64_t lw = 0; lw < kernel[1]; ++lw) {
      offset[lh * kernel[1] + lw] = lh * dilation[0] * width + lw * dilation[1];
    }
  }
  at::Tensor idx = at::empty_like(local, local.options().dtype(at::kLong));
  const uint8_t* lp = local.const_data_ptr<uint8_t>();
  int64_t* ip = idx.mutable_data_ptr<int64_t>();
  for_runs(walk, local, stride, padding, [&](int64_t i0, int64_t n, int64_t h0, int64_t w0, int64_t w_step) {
    global_run(lp + i0, ip + i0, n, h0 * width + w0, w_step, offset.data());
  });
  return idx;
}

}  // namespace mesa
