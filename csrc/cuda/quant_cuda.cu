// CUDA kernels of torch.ops.mesa.{group_minmax, quantize, dequantize, update_estimates}.
//
// * One pass over the data per op, grid-stride loops, 16-byte vectorised loads/stores
//   when the pointers are aligned (scalar fallback otherwise), 32-bit index math with
//   multiply-shift division whenever numel < 2^31 (64-bit otherwise).
// * Everything runs on the current CUDA stream; nothing synchronises with the host
//   (temporaries come from the caching allocator, no .item(), no cudaMemcpy to host).
// * Exact arithmetic from mesa_common.h: __fadd_rn/__fmul_rn/__fdiv_rn (never contracted
//   into FMA) plus --fmad=false, so the bytes equal the reference's and the CPU kernel's.
// * group_minmax: stage 1 reduces per (sample, d) into an order-preserving uint32 encoding
//   of floats with atomicMin/atomicMax (after a warp-level reduction whenever a warp's
//   elements share one d); stage 2 folds d into groups. NaN propagates (it is encoded as the
//   extreme value of each buffer).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <atomic>
#include <limits>

#include "../mesa_common.h"

namespace mesa {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// ----------------------------------------------------------------------------- division
// n / d for n < 2^31 by a runtime-constant d in [1, 2^31) (round-up multiply-shift).
struct FastDiv32 {
  uint32_t d = 1, m = 1, s = 0;
  FastDiv32() = default;
  explicit FastDiv32(uint32_t div) : d(div) {
    for (s = 0; s < 32; ++s)
      if ((uint64_t(1) << s) >= div) break;
    const uint64_t one = 1;
    m = static_cast<uint32_t>(((one << 32) * ((one << s) - div)) / div + 1);
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

struct Div64 {
  uint64_t d = 1;
  Div64() = default;
  explicit Div64(uint64_t div) : d(div) {}
  __device__ __forceinline__ uint64_t operator()(uint64_t n) const { return n / d; }
};

template <typename IdxT>
using DivT = typename std::conditional<std::is_same<IdxT, uint32_t>::value, FastDiv32, Div64>::type;

// Layout in kernel-friendly form.
template <typename IdxT>
struct KLayout {
  IdxT inner, D, outer_per_s;
  bool multi_s;  // s_eff > 1
  DivT<IdxT> div_inner, div_D, div_ops;
};

template <typename IdxT>
KLayout<IdxT> make_klayout(const Layout& L) {
  KLayout<IdxT> k;
  k.inner = static_cast<IdxT>(L.inner);
  k.D = static_cast<IdxT>(L.D);
  k.outer_per_s = static_cast<IdxT>(std::max<int64_t>(L.outer_per_s, 1));
  k.multi_s = L.s_eff > 1;
  k.div_inner = DivT<IdxT>(static_cast<IdxT>(L.inner));
  k.div_D = DivT<IdxT>(static_cast<IdxT>(L.D));
  k.div_ops = DivT<IdxT>(k.outer_per_s);
  return k;
}

// Walks consecutive elements, keeping the (per-sample, d) table index up to date with
// increments instead of divisions.
template <typename IdxT>
struct Cursor {
  IdxT j, d, o_in_s, s;
  __device__ __forceinline__ Cursor(const KLayout<IdxT>& k, IdxT i) {
    const IdxT row = k.div_inner(i);
    j = i - row * k.inner;
    const IdxT o = k.div_D(row);
    d = row - o * k.D;
    if (k.multi_s) {
      s = k.div_ops(o);
      o_in_s = o - s * k.outer_per_s;
    } else {
      s = 0;
      o_in_s = 0;
    }
  }
  __device__ __forceinline__ IdxT table(const KLayout<IdxT>& k) const { return s * k.D + d; }
  __device__ __forceinline__ void advance(const KLayout<IdxT>& k) {
    if (++j == k.inner) {
      j = 0;
      if (++d == k.D) {
        d = 0;
        if (k.multi_s && ++o_in_s == k.outer_per_s) {
          o_in_s = 0;
          ++s;
        }
      }
    }
  }
};

// Streaming multiprocessors of the current device (cached; a host-side attribute query,
// no synchronisation). Only c10/cuda headers are used: ATen/cuda/CUDAContext.h needs the
// cuSPARSE/cuBLAS headers, which minimal CUDA toolkits lack.
int sm_count() {
  static std::atomic<int> cache[64] = {};  // atomic: ops may be called from several threads
  const int dev = c10::cuda::current_device();
  if (dev < 0 || dev >= 64) return 108;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (n <= 0) n = 108;
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

int grid_for(int64_t work) {
  const int sms = sm_count();
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 32)));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ----------------------------------------------------------------------------- tables
// Per-(s_eff, d) tables: scale (inv = 255/alpha or step = alpha/255) and beta.
__global__ void build_tables_kernel(const float* __restrict__ alpha, const float* __restrict__ beta,
                                    float* __restrict__ tscale, float* __restrict__ tbeta, int64_t n,
                                    int64_t D, int64_t G, int64_t S, bool dim0_per_sample, bool inverse) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t s = idx / D, d = idx - s * D;
  const int64_t src = S == 1 ? 0 : (dim0_per_sample ? d : s);
  const int64_t k = src * G + (d * G) / D;
  const float a = alpha[k];
  tscale[idx] = inverse ? inv_scale(a) : dequant_step(a);
  tbeta[idx] = beta[k];
}

at::Tensor build_tables(const Layout& L, const at::Tensor& alpha, const at::Tensor& beta, bool inverse,
                        cudaStream_t stream) {
  const int64_t n = L.s_eff * L.D;
  at::Tensor t = at::empty({2, n}, alpha.options());
  const at::Tensor a = alpha.contiguous(), b = beta.contiguous();
  build_tables_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      a.const_data_ptr<float>(), b.const_data_ptr<float>(), t.mutable_data_ptr<float>(),
      t.mutable_data_ptr<float>() + n, n, L.D, L.G, L.S, L.dim0_per_sample, inverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return t;
}

// ----------------------------------------------------------------------------- quantize
template <typename scalar_t, typename IdxT, int VEC, bool STOCH>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const scalar_t* __restrict__ x, uint8_t* __restrict__ q, const float* __restrict__ tinv,
                const float* __restrict__ tbeta, const KLayout<IdxT> k, const IdxT numel,
                const int64_t* __restrict__ seed, const int64_t seed_stride) {
  // the seed lives on the device (written by observe): no host sync
  const uint32_t slo = STOCH ? static_cast<uint32_t>(__ldg(seed)) : 0u;
  const uint32_t shi = STOCH ? static_cast<uint32_t>(__ldg(seed + seed_stride)) : 0u;
  const IdxT nvec = numel / VEC;
  const IdxT stride = IdxT(gridDim.x) * blockDim.x;
  const IdxT gid = IdxT(blockIdx.x) * blockDim.x + threadIdx.x;
  for (IdxT v = gid; v < nvec; v += stride) {
    const IdxT i0 = v * VEC;
    const Vec<scalar_t, VEC> xv = *reinterpret_cast<const Vec<scalar_t, VEC>*>(x + i0);
    Vec<uint8_t, VEC> out;
    Cursor<IdxT> c(k, i0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const IdxT t = c.table(k);
      const float u = STOCH ? hash_uniform(static_cast<uint64_t>(i0) + e, slo, shi) : 0.0f;
      out.v[e] = quantize_value<STOCH>(static_cast<float>(xv.v[e]), __ldg(tbeta + t), __ldg(tinv + t), u);
      c.advance(k);
    }
    *reinterpret_cast<Vec<uint8_t, VEC>*>(q + i0) = out;
  }
  if (VEC > 1) {  // tail (< VEC elements)
    const IdxT i = nvec * VEC + gid;
    if (i < numel) {
      Cursor<IdxT> c(k, i);
      const IdxT t = c.table(k);
      const float u = STOCH ? hash_uniform(static_cast<uint64_t>(i), slo, shi) : 0.0f;
      q[i] = quantize_value<STOCH>(static_cast<float>(x[i]), __ldg(tbeta + t), __ldg(tinv + t), u);
    }
  }
}

template <typename scalar_t, typename IdxT, int VEC, bool STOCH>
void launch_quantize(const at::Tensor& x, at::Tensor& q, const at::Tensor& tables, const Layout& L,
                     const at::Tensor& seed, cudaStream_t stream) {
  const int64_t n = L.s_eff * L.D;
  const float* tinv = tables.const_data_ptr<float>();
  quantize_kernel<scalar_t, IdxT, VEC, STOCH><<<grid_for(L.numel / VEC + VEC), kThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), q.mutable_data_ptr<uint8_t>(), tinv, tinv + n, make_klayout<IdxT>(L),
      static_cast<IdxT>(L.numel), seed.const_data_ptr<int64_t>(), seed.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor quantize_cuda(const at::Tensor& x_in, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                         int64_t num_groups, bool stochastic, const at::Tensor& seed) {
  const Layout L = check_quantize(x_in, alpha, beta, dim, num_groups, seed);
  const c10::cuda::OptionalCUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (L.numel == 0) return q;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor tables = build_tables(L, alpha, beta, /*inverse=*/true, stream);
  const bool small = L.numel < (int64_t(1) << 31);
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_quantize_cuda", [&] {
    constexpr int V = 16 / sizeof(scalar_t);
    const bool vec = aligned(x.const_data_ptr(), 16) && aligned(q.const_data_ptr(), V);
    if (small && vec) {
      if (stochastic) launch_quantize<scalar_t, uint32_t, V, true>(x, q, tables, L, seed, stream);
      else launch_quantize<scalar_t, uint32_t, V, false>(x, q, tables, L, seed, stream);
    } else if (small) {
      if (stochastic) launch_quantize<scalar_t, uint32_t, 1, true>(x, q, tables, L, seed, stream);
      else launch_quantize<scalar_t, uint32_t, 1, false>(x, q, tables, L, seed, stream);
    } else {
      if (stochastic) launch_quantize<scalar_t, uint64_t, 1, true>(x, q, tables, L, seed, stream);
      else launch_quantize<scalar_t, uint64_t, 1, false>(x, q, tables, L, seed, stream);
    }
  });
  return q;
}

// ----------------------------------------------------------------------------- dequantize
template <typename scalar_t, typename IdxT, int VEC>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t* __restrict__ q, scalar_t* __restrict__ y, const float* __restrict__ tstep,
                  const float* __restrict__ tbeta, const KLayout<IdxT> k, const IdxT numel) {
  const IdxT nvec = numel / VEC;
  const IdxT stride = IdxT(gridDim.x) * blockDim.x;
  const IdxT gid = IdxT(blockIdx.x) * blockDim.x + threadIdx.x;
  for (IdxT v = gid; v < nvec; v += stride) {
    const IdxT i0 = v * VEC;
    const Vec<uint8_t, VEC> qv = *reinterpret_cast<const Vec<uint8_t, VEC>*>(q + i0);
    Vec<scalar_t, VEC> out;
    Cursor<IdxT> c(k, i0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const IdxT t = c.table(k);
      out.v[e] = static_cast<scalar_t>(dequantize_value(qv.v[e], __ldg(tstep + t), __ldg(tbeta + t)));
      c.advance(k);
    }
    *reinterpret_cast<Vec<scalar_t, VEC>*>(y + i0) = out;
  }
  if (VEC > 1) {
    const IdxT i = nvec * VEC + gid;
    if (i < numel) {
      Cursor<IdxT> c(k, i);
      const IdxT t = c.table(k);
      y[i] = static_cast<scalar_t>(dequantize_value(q[i], __ldg(tstep + t), __ldg(tbeta + t)));
    }
  }
}

template <typename scalar_t, typename IdxT, int VEC>
void launch_dequantize(const at::Tensor& q, at::Tensor& y, const at::Tensor& tables, const Layout& L,
                       cudaStream_t stream) {
  const int64_t n = L.s_eff * L.D;
  const float* tstep = tables.const_data_ptr<float>();
  dequantize_kernel<scalar_t, IdxT, VEC><<<grid_for(L.numel / VEC + VEC), kThreads, 0, stream>>>(
      q.const_data_ptr<uint8_t>(), y.mutable_data_ptr<scalar_t>(), tstep, tstep + n, make_klayout<IdxT>(L),
      static_cast<IdxT>(L.numel));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor dequantize_cuda(const at::Tensor& q_in, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                           int64_t num_groups, at::ScalarType dtype) {
  const Layout L = check_dequantize(q_in, alpha, beta, dim, num_groups, dtype);
  const c10::cuda::OptionalCUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  at::Tensor y = at::empty(q.sizes(), q.options().dtype(dtype));
  if (L.numel == 0) return y;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor tables = build_tables(L, alpha, beta, /*inverse=*/false, stream);
  const bool small = L.numel < (int64_t(1) << 31);
  MESA_DISPATCH_FLOAT_TYPES(dtype, "mesa_dequantize_cuda", [&] {
    constexpr int V = 16 / sizeof(scalar_t);
    const bool vec = aligned(q.const_data_ptr(), V) && aligned(y.const_data_ptr(), 16);
    if (small && vec) launch_dequantize<scalar_t, uint32_t, V>(q, y, tables, L, stream);
    else if (small) launch_dequantize<scalar_t, uint32_t, 1>(q, y, tables, L, stream);
    else launch_dequantize<scalar_t, uint64_t, 1>(q, y, tables, L, stream);
  });
  return y;
}

// ----------------------------------------------------------------------------- minmax
// Order-preserving float <-> uint32 maps. NaN maps to the extreme of each buffer so that
// atomicMin / atomicMax propagate it; both extremes decode to a NaN.
__device__ __forceinline__ uint32_t ord(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ uint32_t enc_min(float f) { return f != f ? 0u : ord(f); }
__device__ __forceinline__ uint32_t enc_max(float f) { return f != f ? 0xFFFFFFFFu : ord(f); }
__device__ __forceinline__ float dec(uint32_t e) {
  return __uint_as_float((e & 0x80000000u) ? (e & 0x7FFFFFFFu) : ~e);
}
constexpr uint32_t kEncPosInf = 0xFF800000u;  // ord(+inf): initial min
constexpr uint32_t kEncNegInf = 0x007FFFFFu;  // ord(-inf): initial max

__global__ void minmax_init_kernel(uint32_t* __restrict__ buf, int64_t n) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx < n) {
    buf[idx] = kEncPosInf;
    buf[n + idx] = kEncNegInf;
  }
}

// x viewed as (outer, C = D * inner). Thread = one column c per tile; a block covers
// `tiles` consecutive tiles of kThreads columns and a chunk of rows of one sample
// (blockIdx.x = s * blocks_x + column span, blockIdx.y = chunk: grid.y <= 65535 whatever
// the number of samples). Reads are coalesced along c. The result per
// (s, d = c / inner) goes to the encoded buffers with atomics: one per block when the
// block's whole column span has one d (per-head / NCHW layouts: block reduction), one per
// warp when a warp's columns share one d, else one per thread (channels-last layouts).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
minmax_columns_kernel(const scalar_t* __restrict__ x, uint32_t* __restrict__ bmn, uint32_t* __restrict__ bmx,
                      int64_t C, int64_t inner, int64_t D, int64_t rows_per_s, int64_t blocks_x,
                      int64_t rows_per_chunk, int tiles) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t s = int64_t(blockIdx.x) / blocks_x, bx = int64_t(blockIdx.x) - s * blocks_x;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = s * rows_per_s + chunk * rows_per_chunk;
  const int64_t r1 = min(r0 + rows_per_chunk, (s + 1) * rows_per_s);
  if (r0 >= r1) return;  // uniform over the block
  const int64_t span0 = bx * tiles * kThreads;
  const int64_t span1 = min(span0 + int64_t(tiles) * kThreads, C);
  const bool uniform = (span0 / inner) == ((span1 - 1) / inner);  // uniform over the block
  const unsigned lane = threadIdx.x & 31u;
  float bmin = kInf, bmax = -kInf;
  for (int t = 0; t < tiles; ++t) {
    const int64_t c = span0 + int64_t(t) * kThreads + threadIdx.x;
    const bool valid = c < C;
    float mn = kInf, mx = -kInf;
    if (valid) {
      const scalar_t* p = x + r0 * C + c;
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4, p += 4 * C) {
        const float v0 = static_cast<float>(p[0]), v1 = static_cast<float>(p[C]);
        const float v2 = static_cast<float>(p[2 * C]), v3 = static_cast<float>(p[3 * C]);
        mn = nan_min(nan_min(mn, v0), nan_min(v1, nan_min(v2, v3)));
        mx = nan_max(nan_max(mx, v0), nan_max(v1, nan_max(v2, v3)));
      }
      for (; r < r1; ++r, p += C) {
        const float v = static_cast<float>(*p);
        mn = nan_min(mn, v);
        mx = nan_max(mx, v);
      }
    }
    if (uniform) {
      bmin = nan_min(bmin, mn);
      bmax = nan_max(bmax, mx);
      continue;
    }
    const int64_t key = valid ? s * D + c / inner : -1;
    const int64_t key0 = __shfl_sync(0xFFFFFFFFu, key, 0);
    const int64_t key31 = __shfl_sync(0xFFFFFFFFu, key, 31);
    if (key0 >= 0 && key0 == key31) {  // the whole warp shares one (s, d)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        mn = nan_min(mn, __shfl_xor_sync(0xFFFFFFFFu, mn, off));
        mx = nan_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
      }
      if (lane == 0) {
        atomicMin(bmn + key0, enc_min(mn));
        atomicMax(bmx + key0, enc_max(mx));
      }
    } else if (valid) {
      atomicMin(bmn + key, enc_min(mn));
      atomicMax(bmx + key, enc_max(mx));
    }
  }
  if (uniform) {  // block reduction, one atomic pair per block
    __shared__ float smn[kThreads / 32], smx[kThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      bmin = nan_min(bmin, __shfl_xor_sync(0xFFFFFFFFu, bmin, off));
      bmax = nan_max(bmax, __shfl_xor_sync(0xFFFFFFFFu, bmax, off));
    }
    if (lane == 0) {
      smn[threadIdx.x / 32] = bmin;
      smx[threadIdx.x / 32] = bmax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) {
        bmin = nan_min(bmin, smn[w]);
        bmax = nan_max(bmax, smx[w]);
      }
      const int64_t key = s * D + span0 / inner;
      atomicMin(bmn + key, enc_min(bmin));
      atomicMax(bmx + key, enc_max(bmax));
    }
  }
}

// Launch configuration of minmax_columns_kernel (host only, no CUDA calls: testable on
// the host). grid = (blocks_x * s_eff, chunks).
struct MinmaxConfig {
  int64_t C = 1, rows_per_s = 1, blocks_x = 1, chunks = 1, rows_per_chunk = 1;
  int tiles = 1;
};

MinmaxConfig minmax_config(const Layout& L, int sms) {
  MinmaxConfig m;
  m.C = L.D * L.inner;
  m.rows_per_s = L.outer_per_s;
  const int64_t target = int64_t(sms) * 8;  // blocks to aim for
  const int64_t tiles1 = (m.C + kThreads - 1) / kThreads;
  // Several column tiles per block only pays when a block's span can share one d.
  m.tiles = L.inner >= kThreads
      ? static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(16, tiles1 * L.s_eff / target)))
      : 1;
  m.blocks_x = (tiles1 + m.tiles - 1) / m.tiles;
  m.chunks = std::max<int64_t>(1, (target + m.blocks_x * L.s_eff - 1) / (m.blocks_x * L.s_eff));
  m.chunks = std::min<int64_t>(m.chunks, std::max<int64_t>(1, m.rows_per_s / 4));  // >= 4 rows per chunk
  m.chunks = std::min<int64_t>(m.chunks, 65535);
  m.rows_per_chunk = (m.rows_per_s + m.chunks - 1) / m.chunks;
  return m;
}

// (s_eff, D) encoded statistics -> (S, G) float outputs.
__global__ void minmax_finish_kernel(const uint32_t* __restrict__ bmn, const uint32_t* __restrict__ bmx,
                                     float* __restrict__ omn, float* __restrict__ omx, int64_t S, int64_t G,
                                     int64_t D, bool multi_s, bool dim0_per_sample) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= S * G) return;
  const int64_t r = idx / G, g = idx - r * G;
  float mn = std::numeric_limits<float>::infinity(), mx = -std::numeric_limits<float>::infinity();
  if (dim0_per_sample) {  // sample r is index d = r
    if ((r * G) / D == g) {
      mn = dec(bmn[r]);
      mx = dec(bmx[r]);
    }
  } else {
    const int64_t base = multi_s ? r * D : 0;
    const int64_t d0 = (g * D + G - 1) / G, d1 = ((g + 1) * D + G - 1) / G;
    for (int64_t d = d0; d < d1; ++d) {
      mn = nan_min(mn, dec(bmn[base + d]));
      mx = nan_max(mx, dec(bmx[base + d]));
    }
  }
  omn[idx] = mn;
  omx[idx] = mx;
}

std::tuple<at::Tensor, at::Tensor> group_minmax_cuda(const at::Tensor& x_in, int64_t dim, int64_t num_groups,
                                                     bool per_sample) {
  const Layout L = check_minmax(x_in, dim, num_groups, per_sample);
  const c10::cuda::OptionalCUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  auto fopts = x.options().dtype(at::kFloat);
  if (L.numel == 0) {
    return {at::full({L.S, L.G}, std::numeric_limits<float>::infinity(), fopts),
            at::full({L.S, L.G}, -std::numeric_limits<float>::infinity(), fopts)};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t nbuf = L.s_eff * L.D;
  at::Tensor buf = at::empty({2, nbuf}, x.options().dtype(at::kInt));
  uint32_t* bmn = reinterpret_cast<uint32_t*>(buf.mutable_data_ptr<int32_t>());
  uint32_t* bmx = bmn + nbuf;
  minmax_init_kernel<<<(nbuf + kThreads - 1) / kThreads, kThreads, 0, stream>>>(bmn, nbuf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const MinmaxConfig m = minmax_config(L, sm_count());
  // blocks_x * s_eff <= ceil(C / 256) * s_eff <= numel / 256 + s_eff: never near the limit
  TORCH_CHECK(m.blocks_x * L.s_eff < (int64_t(1) << 31), "mesa: group_minmax: tensor too large");
  const dim3 grid(static_cast<unsigned>(m.blocks_x * L.s_eff), static_cast<unsigned>(m.chunks));
  MESA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "mesa_group_minmax_cuda", [&] {
    minmax_columns_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(x.const_data_ptr<scalar_t>(), bmn, bmx, m.C,
                                                                  L.inner, L.D, m.rows_per_s, m.blocks_x,
                                                                  m.rows_per_chunk, m.tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  at::Tensor omn = at::empty({L.S, L.G}, fopts), omx = at::empty({L.S, L.G}, fopts);
  const int64_t nout = L.S * L.G;
  if (nout > 0) {
    minmax_finish_kernel<<<(nout + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        bmn, bmx, omn.mutable_data_ptr<float>(), omx.mutable_data_ptr<float>(), L.S, L.G, L.D, L.s_eff > 1,
        L.dim0_per_sample);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {omn, omx};
}

// The whole running-estimate update in one block (G is small: heads or channel groups).
// Every thread reads `initialized` before the barrier; thread 0 writes it after.
__global__ void update_estimates_kernel(const float* __restrict__ mn, const float* __restrict__ mx,
                                        float* __restrict__ est_a, float* __restrict__ est_b, bool* initialized,
                                        float* __restrict__ out_a, float* __restrict__ out_b, int64_t S, int64_t G,
                                        float lam, float one_minus_lam, bool per_sample, bool symmetric, bool valid) {
  const bool init = *initialized;
  int ok = valid ? 1 : 0;
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    float ra, rb;
    batch_range(mn, mx, S, G, g, per_sample, symmetric, ra, rb);
    ok &= (is_finite(ra) && is_finite(rb)) ? 1 : 0;
  }
  const bool finite = __syncthreads_and(ok) != 0;
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    float ra, rb, used_a, used_b;
    batch_range(mn, mx, S, G, g, per_sample, symmetric, ra, rb);
    estimate_step(est_a[g], ra, init, finite, lam, one_minus_lam, used_a, est_a[g]);
    estimate_step(est_b[g], rb, init, finite, lam, one_minus_lam, used_b, est_b[g]);
    if (per_sample) {
      for (int64_t s = 0; s < S; ++s) group_range(mn[s * G + g], mx[s * G + g], symmetric, out_a[s * G + g], out_b[s * G + g]);
    } else {
      out_a[g] = used_a;
      out_b[g] = used_b;
    }
  }
  if (threadIdx.x == 0) *initialized = init || finite;
}

std::tuple<at::Tensor, at::Tensor> update_estimates_cuda(const at::Tensor& mn_in, const at::Tensor& mx_in,
                                                         const at::Tensor& alpha_est, const at::Tensor& beta_est,
                                                         const at::Tensor& initialized, double decay, bool per_sample,
                                                         bool symmetric, bool valid) {
  const int64_t G = check_update_estimates(mn_in, mx_in, alpha_est, beta_est, initialized, decay, per_sample);
  const c10::cuda::OptionalCUDAGuard guard(mn_in.device());
  const at::Tensor mn = mn_in.contiguous(), mx = mx_in.contiguous();
  const int64_t S = mn.size(0);
  at::Tensor out_a = at::empty({S, G}, mn.options()), out_b = at::empty({S, G}, mn.options());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // (float) decay and (float)(1 - decay): what torch does with a Python float scalar
  update_estimates_kernel<<<1, kThreads, 0, stream>>>(
      mn.const_data_ptr<float>(), mx.const_data_ptr<float>(), alpha_est.mutable_data_ptr<float>(),
      beta_est.mutable_data_ptr<float>(), initialized.mutable_data_ptr<bool>(), out_a.mutable_data_ptr<float>(),
      out_b.mutable_data_ptr<float>(), S, G, static_cast<float>(decay), static_cast<float>(1.0 - decay), per_sample,
      symmetric, valid);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_a, out_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(mesa, CUDA, m) {
  m.impl("group_minmax", &group_minmax_cuda);
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("update_estimates", &update_estimates_cuda);
}

}  // namespace mesa
