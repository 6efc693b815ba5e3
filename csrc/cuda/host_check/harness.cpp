// Run with csrc/cuda/host_check/run.sh (see there).
// Host emulation of the CUDA kernels of csrc/cuda/quant_cuda.cu (device code extracted
// verbatim into extracted.inc by extract.py). Each kernel runs on the CPU and every output
// bit is compared with a naive sequential computation written here from DESIGN.md /
// mesa_train/quant/reference.py (only the scalar helpers of mesa_common.h are shared:
// quantize_value, dequantize_value, hash_uniform, canonical, estimate_step, ...; the CPU
// tests pin those against the reference):
// * quantize / dequantize: sequential over (block, thread); vector (16-element), scalar and
//   64-bit index paths; without and with row exponents (KRows: int8 k per row of 1 or 2
//   trailing dims, k in [0, 126] ([0, 14] for float16), rows that straddle 16-element
//   steps): quantize sees x * 2**k rounded to the dtype, dequantize returns y rounded to the
//   dtype, times 2**-k, rounded again (scale_rows / unscale_rows);
// * observe / group_minmax (the single-launch last-block kernel): the blocks of a launch
//   in a random order, each block's threads as fibers (one OS thread) with a barrier for
//   __syncthreads(_and); shared and global atomics; against a sequential pass
//   (naive per-group min/max of the (row-scaled) values, canonical bits, then the sequential
//   estimate step of update_estimates_cpu), bit for bit; the workspace must be all zero
//   after every launch (the last block resets it) and is reused by the next launch;
// * quantize_observe (estimator "delayed"): the fused block-cooperative launch followed by
//   the skip-flagged quantize launch, for a first batch (= observe + quantize) and for
//   initialized estimates (codes from the estimates before the batch, which are then
//   updated with its min/max), with and without row exponents; codes, estimates, used
//   (alpha, beta), initialized, counter / seed, the ws[1] flag, each launch writing only
//   what it should, and the reset workspace;
// * delayed_observe (observe_kernel's MODE_DELAYED): the same launch emulation, against the
//   estimates from before the launch (its outputs), the sequential step, the counter + 1;
//   seed_of_kernel (one thread) against seed_step, its rng untouched;
// * update_estimates (and estimate_and_seed's seed step): one block, against the same
//   sequential step;
// * quantize_bits / dequantize_bits (bits 8/4/2, linear and pow2 steps): sequential over
//   (block, thread), every packed byte against the naive packing of the scalar math;
// * softmax_backward (one warp per row, the same exchange; rows looping over the warps of a
//   small grid, 32- and 64-bit indices, L in {1, 31, 32, 33, 197}, all-zero rows, g with
//   NaN / inf) against the sequential definition (32 strided lane sums, xor butterfly);
// * row_absmax (one warp per row; __shfl_xor_sync emulated by a per-warp exchange buffer
//   and barrier, all 32 lanes as fibers) on the vector and scalar paths, rows with NaN /
//   inf / zero / subnormal values; its last block's k against clamp(floor(log2(mean / r)), 0,
//   max_k) of the naive max |x| r per row and their row_max_mean (0 for a zero, infinite or
//   NaN ratio).
// * strided inputs (mesa_common.h): quantize, observe / group_minmax and quantize_observe read x
//   laid out as a strided view (four dims nested in a random memory order, NaN between the rows)
//   where it lies, through the layout strided_rows gives the ops; the same checks, bit for bit;
// * observe_rows: the row pass (the flat one on aligned whole-chunk segments, 1, 2 and 4 chunks
//   a lane, further rounds, idle lanes, 32- and 64-bit indices, small grids; the warp-a-row one
//   on the rest) against the naive per-segment min / max; each pass's last block (blocks in a
//   random order) against k from row_max_mean of the naive max |x| and the cells of rows with
//   k != 0 times 2**k rounded to the dtype; the flat pass fused (shared statistics) its group
//   totals, estimate step and seed step against the sequential step over those cells; the
//   workspace zero again; block_row_max_mean against the sequential row_max_mean.
// * gelu_value_and_grad (dequantize with both GELU epilogues at once): each output the bits of
//   its own op's epilogue;
// * layer_norm_backward (one block per 64 rows, a warp per chunk of 8, the same exchange; every
//   columns-per-lane instantiation, statistics shared and per sample, in shared memory or
//   not, with and without weight and row exponents, g with NaN / inf) against the sequential
//   definition: dx and both partial column sums bit for bit.
// The last line lists how many cases each kernel family checked.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "mesa_common.h"

// ------------------------------------------------------------------ CUDA shims
struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
Dim3 threadIdx;  // the running fiber's (FiberPool sets it before resuming one)
Dim3 blockIdx, blockDim{256, 1, 1}, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline unsigned __ldcg(const unsigned* p) { return *p; }
inline float __ldcg(const float* p) { return *p; }
inline uint4 __ldcg(const uint4* p) { return *p; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return uint32_t((uint64_t(a) * b) >> 32); }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }  // one rounding
// PRMT's default mode: byte n of the result is byte (s >> 4n) & 7 of the 8 bytes {x, y}
// (x bytes 0-3, y bytes 4-7)
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t xy = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= uint32_t((xy >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// A barrier among fibers (FiberPool below): the last to arrive releases the others and goes on.
struct FiberBarrier {
  unsigned parties = 0, count = 0;
  uint64_t generation = 0;
};
void fiber_arrive_and_wait(FiberBarrier& b);
static FiberBarrier g_bbar;  // the running block's threads
static std::atomic<long> g_atomics{0};
inline void __syncthreads() { fiber_arrive_and_wait(g_bbar); }
// __syncthreads_and: barrier, vote, barrier, read, barrier, reset (the next vote starts with
// a barrier, so the reset is seen by every thread before anyone votes again).
static std::atomic<int> g_vote{1};
inline int __syncthreads_and(int pred) {
  fiber_arrive_and_wait(g_bbar);
  if (!pred) g_vote.store(0);
  fiber_arrive_and_wait(g_bbar);
  const int r = g_vote.load();
  fiber_arrive_and_wait(g_bbar);
  if (threadIdx.x == 0) g_vote.store(1);
  return r;
}
// Atomics as plain read-modify-writes: the fibers share one OS thread and switch only at a
// barrier, so no other CUDA thread runs inside one.
inline unsigned atomicMax(uint32_t* p, uint32_t v) {  // shared and global memory alike
  g_atomics++;
  const unsigned o = *p;
  if (v > o) *p = v;
  return o;
}
inline unsigned atomicAdd(uint32_t* p, uint32_t v) {
  const unsigned o = *p;
  *p = o + v;
  return o;
}
// __shfl_xor_sync over a full warp: every lane publishes its value, waits for the other 31,
// reads lane ^ lane_mask's, and waits again before anyone may publish the next value (the
// lanes run one after another, so without the second barrier a lane run first could overwrite
// a value another has yet to read). A partial mask or a lane that skips the call would be a
// kernel bug the emulation refuses (abort; FiberPool names a barrier nobody else reaches).
struct WarpExchange {
  FiberBarrier bar;
  uint32_t val[32];
};
static std::vector<WarpExchange> g_warps;  // one per warp of the running block
inline uint32_t __shfl_xor_sync(uint32_t mask, uint32_t v, int lane_mask) {
  if (mask != 0xFFFFFFFFu || threadIdx.x / 32 >= g_warps.size()) abort();
  WarpExchange& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  w.val[lane] = v;
  fiber_arrive_and_wait(w.bar);
  const uint32_t r = w.val[lane ^ unsigned(lane_mask)];
  fiber_arrive_and_wait(w.bar);
  return r;
}

inline float __shfl_xor_sync(uint32_t mask, float v, int lane_mask) {  // the device's float overload
  return __uint_as_float(__shfl_xor_sync(mask, __float_as_uint(v), lane_mask));
}

namespace mesa {
namespace {
using std::isfinite;  // the device's math functions (row_k)
using std::max;
using std::min;
#include "extracted.inc"
}  // namespace
}  // namespace mesa

using namespace mesa;

// ------------------------------------------------------------------ launch emulation
static std::mt19937_64 rng(12345);
static std::map<std::string, long> g_checked;  // cases per kernel family (the summary line)

// one thread at a time over (block, thread): kernels without barriers or warp operations
template <typename F>
void launch_seq(unsigned grid, unsigned threads, F f) {
  gridDim = {grid, 1, 1};
  blockDim = {threads, 1, 1};
  for (unsigned bx = 0; bx < grid; ++bx) {
    blockIdx = {bx, 0, 0};
    for (unsigned t = 0; t < threads; ++t) {
      threadIdx = {t, 0, 0};
      f();
    }
  }
}

// A block's CUDA threads as fibers (ucontext), all on this one OS thread: a fiber runs until it
// waits at a barrier (__syncthreads, a warp shuffle) or returns, then the next one runs, in an
// order shuffled per block (its own generator: the cases drawn from rng stay the same). Until
// 2026-11-29 each CUDA thread was an OS thread of a pool on std::barrier: 256 threads on 2
// cores waking each other through futexes at every barrier. `run.sh 10 quick`, compile
// included, the old tree's and this one's one after the other on an idle 2-core VM: 126 s
// (32 s of it system time) against 106 s (5 s); the threads slowed most when the cores were
// shared (230 s beside another job, 187 s in CI). Here a barrier costs each fiber about two
// user-space context switches. A kernel whose lanes skip a barrier or a shuffle leaves every fiber
// waiting: the scheduler says so and aborts (the threads hung until run.sh's timeout).
static uint64_t g_fiber_progress = 0;  // arrivals and returns: a round without any is a deadlock

class FiberPool {
 public:
  static constexpr size_t kStackBytes = 256 * 1024;

  explicit FiberPool(unsigned n) : fibers_(n), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    for (auto& f : fibers_) {
      void* m = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        perror("emulation: mmap of a fiber stack");
        abort();
      }
      mprotect(m, page_, PROT_NONE);  // a guard page: a stack overflow faults instead of corrupting
      f.stack = static_cast<char*>(m);
    }
  }

  void run_block(unsigned threads, const std::function<void()>& f) {
    if (threads > fibers_.size()) abort();
    job_ = &f;
    std::vector<unsigned> order(threads);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), order_rng_);
    for (unsigned id = 0; id < threads; ++id) {
      Fiber& fb = fibers_[id];
      getcontext(&fb.ctx);
      fb.ctx.uc_stack.ss_sp = fb.stack + page_;
      fb.ctx.uc_stack.ss_size = kStackBytes;
      fb.ctx.uc_link = &scheduler_;  // a returning fiber resumes the swapcontext below
      makecontext(&fb.ctx, &FiberPool::entry, 0);
      fb.done = false;
    }
    for (unsigned left = threads; left > 0;) {
      const uint64_t progress = g_fiber_progress;
      for (unsigned id : order) {
        if (fibers_[id].done) continue;
        current_ = id;
        threadIdx = {id, 0, 0};
        swapcontext(&scheduler_, &fibers_[id].ctx);
        if (fibers_[id].done) --left;
      }
      if (left > 0 && g_fiber_progress == progress) {
        fprintf(stderr, "emulation: block %u: %u threads wait at a barrier or shuffle the others never reach\n",
                blockIdx.x, left);
        abort();
      }
    }
  }

  // from a fiber: back to the scheduler, which resumes it in its next round
  void yield() { swapcontext(&fibers_[current_].ctx, &scheduler_); }

 private:
  struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;
    bool done = true;
  };
  static void entry();
  std::vector<Fiber> fibers_;
  size_t page_;
  ucontext_t scheduler_;
  unsigned current_ = 0;
  const std::function<void()>* job_ = nullptr;
  std::mt19937 order_rng_{2026};
};

FiberPool& fiber_pool() {
  static FiberPool pool(kThreads);
  return pool;
}

void FiberPool::entry() {
  FiberPool& p = fiber_pool();
  (*p.job_)();
  p.fibers_[p.current_].done = true;
  ++g_fiber_progress;
}

void fiber_arrive_and_wait(FiberBarrier& b) {
  const uint64_t generation = b.generation;
  ++g_fiber_progress;
  if (++b.count == b.parties) {  // the last to arrive: release the others, go on
    b.count = 0;
    ++b.generation;
    return;
  }
  while (b.generation == generation) fiber_pool().yield();
}

// blocks in a random order (any block may be the last to finish), threads as fibers
template <typename F>
void launch_simt(unsigned grid, unsigned threads, F f) {
  gridDim = {grid, 1, 1};
  blockDim = {threads, 1, 1};
  g_bbar = FiberBarrier{threads};
  g_warps = std::vector<WarpExchange>(threads / 32);  // full warps only (shuffles need all 32 lanes)
  for (auto& w : g_warps) w.bar = FiberBarrier{32};
  std::vector<unsigned> order(grid);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  const std::function<void()> job(f);
  for (unsigned bx : order) {
    blockIdx = {bx, 0, 0};
    fiber_pool().run_block(threads, job);
  }
}

// ------------------------------------------------------------------ layouts and data
Layout make_layout_h(const std::vector<int64_t>& shape, int64_t dim, int64_t G, int64_t S) {
  Layout L;
  L.dim = dim;
  L.D = shape[dim];
  L.G = G;
  L.numel = 1;
  for (auto v : shape) L.numel *= v;
  for (int64_t k = 0; k < dim; ++k) L.outer *= shape[k];
  for (size_t k = dim + 1; k < shape.size(); ++k) L.inner *= shape[k];
  L.S = S;
  L.dim0_per_sample = (S > 1 && dim == 0);
  L.s_eff = (S > 1 && dim > 0) ? S : 1;
  L.outer_per_s = L.s_eff > 0 ? L.outer / L.s_eff : 0;
  return L;
}

// naive (DESIGN.md) parameter index of element i
int64_t param_index(const Layout& L, int64_t i) {
  const int64_t d = (i / L.inner) % L.D;
  const int64_t s = L.S == 1 ? 0 : i / (L.numel / L.S);  // per-sample: i // (numel // S)
  return s * L.G + (d * L.G) / L.D;
}

bool same_bits(float a, float b) { return __float_as_uint(a) == __float_as_uint(b); }
// identical storage bits, or both NaN (a GPU's NaN payloads differ from the host's)
template <typename T>
bool same_value(T a, T b) {
  const float fa = static_cast<float>(a), fb = static_cast<float>(b);
  if (std::isnan(fa) || std::isnan(fb)) return std::isnan(fa) && std::isnan(fb);
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
T* alloc(size_t n, size_t offset_elems) {  // 256-byte aligned + offset
  void* p = aligned_alloc(256, ((n + offset_elems + 64) * sizeof(T) + 255) / 256 * 256 + 256);
  return reinterpret_cast<T*>(p) + offset_elems;
}

template <typename scalar_t>
void fill(scalar_t* x, int64_t n, bool specials) {
  std::normal_distribution<float> nd(0.5f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 199);
  for (int64_t i = 0; i < n; ++i) {
    float v = nd(rng);
    if (specials) {
      const int r = pick(rng);
      if (r == 0) v = __uint_as_float(0x7FC00001u);  // NaN with a payload
      else if (r == 1) v = INFINITY;
      else if (r == 2) v = -INFINITY;
      else if (r == 3) v = -0.0f;
      else if (r == 4) v = 0.0f;
      else if (r == 5) v = __uint_as_float(0xFFC00000u);  // negative NaN
    }
    x[i] = static_cast<scalar_t>(v);
  }
}

// ------------------------------------------------------------------ strided inputs
// x laid out as a strided view: four dims, the last a multiple of 16 elements and contiguous,
// the other three nested in a random memory order with padding between them, filled with NaN
// (an element read from outside the view shows in every result). `rows`: the layout as
// strided_rows gives it to the ops (nullopt: this x has no strided twin, e.g. the padding
// drawn was all zero and the dims collapsed to a contiguous tensor).
template <typename scalar_t>
struct StridedX {
  scalar_t* data = nullptr;
  std::optional<StridedRows> rows;
  StridedX() = default;
  StridedX(const StridedX&) = delete;
  ~StridedX() { free(data); }
};

template <typename scalar_t>
void make_strided(StridedX<scalar_t>& sx, const scalar_t* x, int64_t numel) {
  if (numel == 0 || numel % 16 != 0) return;
  auto divisor = [](int64_t n) {
    std::vector<int64_t> ds;
    for (int64_t d = 1; d <= n; ++d)
      if (n % d == 0) ds.push_back(d);
    return ds[rng() % ds.size()];
  };
  int64_t n[4], st[4];
  n[3] = 16 * divisor(numel / 16);
  n[2] = divisor(numel / n[3]);
  n[1] = divisor(numel / (n[3] * n[2]));
  n[0] = numel / (n[3] * n[2] * n[1]);
  int order[3] = {0, 1, 2};  // memory nesting of the outer dims, innermost first
  std::shuffle(order, order + 3, rng);
  st[3] = 1;
  int64_t span = n[3];
  for (int d : order) {
    st[d] = (span + 15) / 16 * 16 + 16 * int64_t(rng() % 3);
    span = st[d] * n[d];
  }
  sx.rows = strided_rows(at::IntArrayRef(n, 4), at::IntArrayRef(st, 4));
  if (!sx.rows.has_value()) return;
  sx.data = alloc<scalar_t>(span, 0);
  for (int64_t j = 0; j < span; ++j) sx.data[j] = static_cast<scalar_t>(NAN);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t c3 = i % n[3], r = i / n[3];
    sx.data[(r / (n[2] * n[1])) * st[0] + (r / n[2] % n[1]) * st[1] + (r % n[2]) * st[2] + c3] = x[i];
  }
}

// What a kernel reads: x itself (contiguous), or its strided twin and that layout
template <typename scalar_t>
const scalar_t* input_of(const scalar_t* x, const StridedX<scalar_t>* sx) { return sx ? sx->data : x; }
template <typename IdxT, typename scalar_t>
KStrides<IdxT> strides_of(const StridedX<scalar_t>* sx) {
  return sx ? make_kstrides<IdxT>(sx->rows) : KStrides<IdxT>{};
}
template <typename scalar_t>
const char* strided_tag(const StridedX<scalar_t>* sx) { return sx ? "_strided" : ""; }

// ------------------------------------------------------------------ row exponents (row_exp)
// One int8 k per row of the last `dims` dims (rows of `len` elements), as row_exponents
// produces and quantize / dequantize / observe take.
struct RowExp {
  std::vector<int8_t> k;
  int64_t len = 0;
  // quantize's row_mean / row_rstd (a LayerNorm's statistics; empty: none), per row of len
  std::vector<float> mean, rstd;
  // dequantize's row_mul (empty: none), per row of len
  std::vector<float> mul;
};

// the largest k of check_row_exp: 2**k and 2**-k stay normal in the dtype
template <typename scalar_t>
constexpr int max_row_k() {
  return std::is_same_v<scalar_t, c10::Half> ? 14 : 126;
}

// Rows of 1 or 2 trailing dims; k = 0 often (ordinary rows), the largest k often, else
// anything in between.
template <typename scalar_t>
RowExp random_rows(const std::vector<int64_t>& shape) {
  RowExp re;
  const size_t dims = (shape.size() >= 2 && rng() % 2) ? 2 : 1;
  re.len = 1;
  for (size_t d = shape.size() - dims; d < shape.size(); ++d) re.len *= shape[d];
  int64_t numel = 1;
  for (auto v : shape) numel *= v;
  if (numel == 0) return RowExp{};  // no rows to scale: the ops pass no exponents
  const int top = max_row_k<scalar_t>();
  re.k.resize(numel / re.len);
  for (auto& k : re.k) {
    const int pick = rng() % 8;
    k = static_cast<int8_t>(pick < 3 ? 0 : pick == 3 ? top : pick == 4 ? 1 : int(rng() % (top + 1)));
  }
  if (!re.k.empty()) re.k[rng() % re.k.size()] = static_cast<int8_t>(top);
  return re;
}

// Rows far below the grid, as row_exponents would find them: half the scaled rows shrunk by
// about 2**-k (subnormal in the dtype for large k), so x * 2**k lands near the typical range
// instead of overflowing.
template <typename scalar_t>
void shrink_rows(scalar_t* x, const RowExp& re) {
  for (size_t r = 0; r < re.k.size(); ++r) {
    if (re.k[r] == 0 || rng() % 2) continue;
    const int s = std::max(0, int(re.k[r]) + int(rng() % 5) - 2);
    for (int64_t i = int64_t(r) * re.len; i < int64_t(r + 1) * re.len; ++i)
      x[i] = static_cast<scalar_t>(std::ldexp(static_cast<float>(x[i]), -s));
  }
}

// The kernels' view of the exponents (what make_krows builds from the tensor)
template <typename IdxT>
KRows<IdxT> krows_of(const RowExp* re) {
  KRows<IdxT> r;
  if (re != nullptr && re->len > 0) {
    if (!re->k.empty()) r.k = re->k.data();
    if (!re->mean.empty()) {
      r.mean = re->mean.data();
      r.rstd = re->rstd.data();
    }
    if (!re->mul.empty()) r.mul = re->mul.data();
    r.div_len = DivT<IdxT>(static_cast<IdxT>(re->len));
  }
  return r;
}

// scale_rows: x * exp2(k) in x's dtype. The exact product (a power of two times a value of the
// dtype) is what ldexp gives in float (overflow: inf), rounded once to the dtype.
template <typename scalar_t>
float scale_row_value(scalar_t x, int k) {
  return static_cast<float>(static_cast<scalar_t>(std::ldexp(static_cast<float>(x), k)));
}
// unscale_rows after dequantize: y rounded to the output dtype, then y * exp2(-k) in that
// dtype (ldexp rounds the product once, also into float's subnormals, as the multiply does).
template <typename scalar_t>
scalar_t unscale_row_value(float y, int k) {
  return static_cast<scalar_t>(std::ldexp(static_cast<float>(static_cast<scalar_t>(y)), -k));
}

// normalize_rows: (x - mean) * rstd in float32, each operation rounded once
float normalized_value(float x, float mean, float rstd) { return (x - mean) * rstd; }

// What quantize / observe see of element i: x[i], or x[i] scaled by its row's 2**k; with a
// LayerNorm's statistics (quantize): x_hat of x[i], then times 2**k rounded to float32 (ldexp
// rounds the exact product once, as the multiply does)
template <typename scalar_t>
std::vector<float> seen_values(const scalar_t* x, int64_t n, const RowExp* re) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    if (re == nullptr) {
      v[i] = static_cast<float>(x[i]);
    } else if (re->mean.empty()) {
      v[i] = scale_row_value(x[i], re->k[i / re->len]);
    } else {
      const int64_t r = i / re->len;
      v[i] = normalized_value(static_cast<float>(x[i]), re->mean[r], re->rstd[r]);
      if (!re->k.empty()) v[i] = std::ldexp(v[i], re->k[r]);
    }
  }
  return v;
}

const char* rows_tag(const RowExp* re) {
  if (re == nullptr) return "";
  if (!re->mul.empty()) return re->k.empty() ? "_mul" : "_rows_mul";
  return re->mean.empty() ? "_rows" : re->k.empty() ? "_norm" : "_rows_norm";
}

// A LayerNorm's statistics for re's rows of x: each row's mean and 1 / sqrt(var + 1e-5) (the
// values matter little: the kernels apply whatever they are given), now and then a NaN rstd
// or a zero mean
template <typename scalar_t>
void add_row_norm(RowExp& re, const scalar_t* x, int64_t numel) {
  const int64_t rows = numel / re.len;
  re.mean.assign(rows, 0.0f);
  re.rstd.assign(rows, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0, s2 = 0.0;
    for (int64_t j = 0; j < re.len; ++j) {
      const double v = static_cast<float>(x[r * re.len + j]);
      s += v;
      s2 += v * v;
    }
    const double m = s / double(re.len), var = std::max(0.0, s2 / double(re.len) - m * m);
    const int pick = rng() % 12;
    re.mean[r] = pick == 0 ? 0.0f : static_cast<float>(m);
    re.rstd[r] = pick == 1 ? NAN : static_cast<float>(1.0 / std::sqrt(var + 1e-5));
  }
}

// ------------------------------------------------------------------ quantize / dequantize
// The naive codes (DESIGN.md): element i quantized with its parameter p's (alpha, beta),
// u = hash_uniform of its flat index (stochastic) or nearest rounding.
std::vector<uint8_t> naive_codes(const Layout& L, const std::vector<float>& xs, const float* alpha,
                                 const float* beta, bool stoch, uint32_t slo, uint32_t shi) {
  std::vector<uint8_t> q(L.numel);
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    const float u = stoch ? hash_uniform(uint64_t(i), slo, shi) : 0.0f;
    q[i] = stoch ? quantize_value<true>(xs[i], beta[p], inv_scale(alpha[p]), u)
                 : quantize_value<false>(xs[i], beta[p], inv_scale(alpha[p]), u);
  }
  return q;
}

int count_code_mismatches(const char* what, const uint8_t* got, const std::vector<uint8_t>& want) {
  int errs = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i] && errs++ < 5) fprintf(stderr, "%s mismatch i=%zu got %d exp %d\n", what, i, got[i], want[i]);
  return errs;
}

template <typename scalar_t, typename IdxT, int V, bool STOCH>
void run_quantize(const Layout& L, const scalar_t* x, uint8_t* q, const float* alpha, const float* beta, int sms,
                  const int64_t* seed, int64_t seed_stride, const RowExp* re, const uint32_t* skip,
                  const StridedX<scalar_t>* sx = nullptr) {
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const KRows<IdxT> rows = krows_of<IdxT>(re);
  const KStrides<IdxT> in = strides_of<IdxT>(sx);
  launch_seq(grid_for(L.numel / V + 1, sms), kThreads, [&] {
    quantize_kernel<scalar_t, IdxT, V, STOCH>(input_of(x, sx), q, alpha, beta, k, IdxT(L.numel), seed, seed_stride,
                                              rows, skip, in);
  });
}

template <typename scalar_t, typename IdxT, int V>
int check_quantize(const Layout& L, const scalar_t* x, const float* alpha, const float* beta, int sms,
                   uint64_t seed, const RowExp* re, const StridedX<scalar_t>* sx = nullptr) {
  int errs = 0;
  const int64_t seedv[4] = {int64_t(seed & 0xFFFFFFFFu), -1, int64_t(seed >> 32), -1};  // stride 2
  const std::vector<float> xs = seen_values(x, L.numel, re);
  for (int st = 0; st < 2; ++st) {
    uint8_t* q = alloc<uint8_t>(L.numel, 0);
    memset(q, 0xAB, L.numel + 1);
    if (st) run_quantize<scalar_t, IdxT, V, true>(L, x, q, alpha, beta, sms, seedv, 2, re, nullptr, sx);
    else run_quantize<scalar_t, IdxT, V, false>(L, x, q, alpha, beta, sms, seedv, 2, re, nullptr, sx);
    errs += count_code_mismatches("quantize", q, naive_codes(L, xs, alpha, beta, st, uint32_t(seed), uint32_t(seed >> 32)));
    if (q[L.numel] != 0xAB) { fprintf(stderr, "quantize wrote past the end\n"); ++errs; }
    free(q);
  }
  g_checked[std::string("quantize") + rows_tag(re) + strided_tag(sx)]++;
  return errs;
}

// dequantize from random codes: y = dequantize_value in the dtype, or with row exponents that
// value rounded to the dtype, times 2**-k, rounded again (unscale_rows)
template <typename scalar_t, typename IdxT, int V>
int check_dequantize(const Layout& L, const float* alpha, const float* beta, int sms, const RowExp* re) {
  int errs = 0;
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  for (int64_t i = 0; i < L.numel; ++i) q[i] = uint8_t(rng());
  scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
  y[L.numel] = scalar_t(1024.0f);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const KRows<IdxT> rows = krows_of<IdxT>(re);
  launch_seq(grid_for(L.numel / V + 1, sms), kThreads,
             [&] { dequantize_kernel<scalar_t, IdxT, V>(q, StoreValues<scalar_t>{y}, alpha, beta, k, IdxT(L.numel),
                                                         rows); });
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    const float v = dequantize_value(q[i], dequant_step(alpha[p]), beta[p]);
    scalar_t e = re != nullptr && !re->k.empty() ? unscale_row_value<scalar_t>(v, re->k[i / re->len])
                                                 : static_cast<scalar_t>(v);
    // row_mul: the stored value times the row's factor in float32, rounded to scalar_t
    if (re != nullptr && !re->mul.empty()) e = static_cast<scalar_t>(static_cast<float>(e) * re->mul[i / re->len]);
    if (!same_value(y[i], e) && errs++ < 5)
      fprintf(stderr, "dequantize%s mismatch i=%ld got %g exp %g\n", rows_tag(re), (long)i, float(y[i]), float(e));
  }
  if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize wrote past the end\n"); ++errs; }
  free(q);
  free(y);
  g_checked[std::string("dequantize") + rows_tag(re)]++;
  return errs;
}

// Blocks of a dequantize launch with a block table (the GELU table, the staged column tables):
// 1 to 4, as the op's resident grid holds few enough that each thread loops over several steps
unsigned table_grid(int64_t steps, int sms) {
  return std::min<unsigned>(unsigned(grid_for(steps, sms)), 1u + unsigned(rng() % 4));
}

// dequantize with col_scale / col_shift (dequantize_kernel run with float math and the
// StoreAffineCols epilogue): the float32 value dequantize would return (row exponents and
// row_mul included), times scale[c], plus shift[c], rounded to the dtype; c = i % C for a C
// that need not divide the length or the vector step (scale only, shift only, both)
template <typename scalar_t, typename IdxT, int V>
int check_dequantize_cols(const Layout& L, const float* alpha, const float* beta, int sms, const RowExp* re) {
  int errs = 0;
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  for (int64_t i = 0; i < L.numel; ++i) q[i] = uint8_t(rng());
  // half the cases a multiple of the vector step, whose 16-byte steps take the float4 column
  // fetch (vec_cols, as dequantize_cuda sets it)
  // (one in four of those DeiT-S's 384: 24 segments, every rotation of the staged tables)
  const int64_t C = rng() % 2 ? (rng() % 4 ? 16 * (1 + int64_t(rng() % 6)) : 384) : 1 + int64_t(rng() % 70);
  std::normal_distribution<float> nd;
  std::vector<float> sc(C), sh(C);
  for (int64_t c = 0; c < C; ++c) {
    sc[c] = nd(rng) * 3;
    sh[c] = nd(rng);
  }
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const KRows<IdxT> rows = krows_of<IdxT>(re);
  const bool vec_cols = C % kVec == 0 && aligned16(sc.data()) && aligned16(sh.data());
  // the tables staged in shared memory (block_table 1, as the op launches the float4 fetch) every
  // other case: blocks as fibers (the staging ends with a barrier), table_grid's few of them
  const bool staged = V == kVec && vec_cols && C <= kColsTableMax && rng() % 2;
  for (int which = 0; which < 3; ++which) {  // both, scale only, shift only
    const float* s = which == 2 ? nullptr : sc.data();
    const float* t = which == 1 ? nullptr : sh.data();
    scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
    y[L.numel] = scalar_t(1024.0f);
    const StoreAffineCols<scalar_t> out{y, s, t, C, vec_cols};
    if (staged) {
      const unsigned grid = table_grid(L.numel / V + 1, sms);
      launch_simt(grid, kThreads, [&] {
        dequantize_kernel<float, IdxT, V>(q, out, alpha, beta, k, IdxT(L.numel), rows, 1);
      });
    } else {
      launch_seq(grid_for(L.numel / V + 1, sms), kThreads, [&] {
        dequantize_kernel<float, IdxT, V>(q, out, alpha, beta, k, IdxT(L.numel), rows);
      });
    }
    for (int64_t i = 0; i < L.numel; ++i) {
      const int64_t p = param_index(L, i);
      float v = dequantize_value(q[i], dequant_step(alpha[p]), beta[p]);
      if (re != nullptr && !re->k.empty()) v = unscale_row_value<float>(v, re->k[i / re->len]);
      if (re != nullptr && !re->mul.empty()) v = v * re->mul[i / re->len];
      if (s != nullptr) v = v * s[i % C];
      if (t != nullptr) v = v + t[i % C];
      const scalar_t e = static_cast<scalar_t>(v);
      if (!same_value(y[i], e) && errs++ < 5)
        fprintf(stderr, "dequantize cols%s mismatch i=%ld C=%ld got %g exp %g\n", rows_tag(re), (long)i, (long)C,
                float(y[i]), float(e));
    }
    if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize cols wrote past the end\n"); ++errs; }
    free(y);
  }
  free(q);
  g_checked[std::string(C % kVec == 0 && V == kVec ? (staged ? "dequantize_cols_staged" : "dequantize_cols_vec")
                                                    : "dequantize_cols") +
            rows_tag(re)]++;
  return errs;
}

// gelu_backward (dequantize_kernel with the StoreGeluGrad epilogue) from random codes and g:
// dx = gelu_grad(g, the dequantized value rounded to the dtype), rounded to the dtype; and
// gelu_grad itself against the exact GELU derivative in double (within 8 float ulps of the
// result's scale: erff / expf are not correctly rounded)
// the value dequantize stores for element i (in scalar_t, as float): dequantize_value, or
// with row exponents that value rounded to the dtype, times 2**-k, rounded again
template <typename scalar_t>
float stored_value(const Layout& L, const uint8_t* q, const float* alpha, const float* beta, int64_t i,
                   const RowExp* re) {
  const int64_t p = param_index(L, i);
  const float v = dequantize_value(q[i], dequant_step(alpha[p]), beta[p]);
  return static_cast<float>(re != nullptr && !re->k.empty() ? unscale_row_value<scalar_t>(v, re->k[i / re->len])
                                                            : static_cast<scalar_t>(v));
}

// A GELU epilogue's launch as the op makes it: on the 32-bit vector path with at most
// kGeluTableParams parameters, every other call with the table of codes (blocks as fibers: the
// table's fill ends with a barrier; table_grid's few blocks, so threads loop), else
// without one (one thread at a time). Returns the family's tag: "_table" or "".
template <typename scalar_t, typename IdxT, int V, typename Out>
const char* launch_gelu_epilogue(const Layout& L, const uint8_t* q, const Out& out, const float* alpha,
                                 const float* beta, int sms, const RowExp* re) {
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const int params = static_cast<int>(L.S * L.G);
  if constexpr (V == kVec && sizeof(IdxT) == 4) {
    if (params <= kGeluTableParams && rng() % 2) {
      const unsigned grid = table_grid(L.numel / V + 1, sms);
      launch_simt(grid, kThreads, [&] {
        dequantize_kernel<scalar_t, IdxT, V>(q, out, alpha, beta, k, IdxT(L.numel), krows_of<IdxT>(re), params);
      });
      return "_table";
    }
  }
  launch_seq(grid_for(L.numel / V + 1, sms), kThreads, [&] {
    dequantize_kernel<scalar_t, IdxT, V>(q, out, alpha, beta, k, IdxT(L.numel), krows_of<IdxT>(re));
  });
  return "";
}

template <typename scalar_t, typename IdxT, int V>
int check_gelu_backward(const Layout& L, const float* alpha, const float* beta, int sms, const RowExp* re) {
  int errs = 0;
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  scalar_t* g = alloc<scalar_t>(L.numel, 0);
  scalar_t* dx = alloc<scalar_t>(L.numel + 1, 0);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < L.numel; ++i) {
    q[i] = uint8_t(rng());
    g[i] = static_cast<scalar_t>(nd(rng));
  }
  dx[L.numel] = scalar_t(1024.0f);
  const char* table =
      launch_gelu_epilogue<scalar_t, IdxT, V>(L, q, StoreGeluGrad<scalar_t>{g, dx}, alpha, beta, sms, re);
  for (int64_t i = 0; i < L.numel; ++i) {
    const float x = stored_value<scalar_t>(L, q, alpha, beta, i, re);
    const float gi = static_cast<float>(g[i]);
    const scalar_t e = static_cast<scalar_t>(gelu_grad(gi, x));
    if (!same_value(dx[i], e) && errs++ < 5)
      fprintf(stderr, "gelu_backward mismatch i=%ld got %g exp %g\n", (long)i, float(dx[i]), float(e));
    if (std::isfinite(x)) {
      const double xd = x, exact = double(gi) * (0.5 * (1.0 + std::erf(xd * M_SQRT1_2)) +
                                                 xd * std::exp(-0.5 * xd * xd) * M_2_SQRTPI * M_SQRT1_2 * 0.5);
      const double scale = std::fabs(double(gi)) * (1.0 + std::fabs(xd));
      if (std::fabs(double(gelu_grad(gi, x)) - exact) > 8 * 0x1p-24 * scale + 1e-37 && errs++ < 5)
        fprintf(stderr, "gelu_grad(%g, %g) = %.9g, exact %.9g\n", gi, x, gelu_grad(gi, x), exact);
    }
  }
  if (float(dx[L.numel]) != 1024.0f) { fprintf(stderr, "gelu_backward wrote past the end\n"); ++errs; }
  free(q);
  free(g);
  free(dx);
  g_checked[std::string("gelu_backward") + table + rows_tag(re)]++;
  return errs;
}

// dequantize_gelu (dequantize_kernel with the StoreGelu epilogue): y = gelu_value(the value
// dequantize stores), rounded to the dtype; and gelu_value itself against the exact GELU in
// double (within 8 float ulps of |x|: erff is not correctly rounded)
template <typename scalar_t, typename IdxT, int V>
int check_dequantize_gelu(const Layout& L, const float* alpha, const float* beta, int sms, const RowExp* re) {
  int errs = 0;
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  for (int64_t i = 0; i < L.numel; ++i) q[i] = uint8_t(rng());
  scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
  y[L.numel] = scalar_t(1024.0f);
  const char* table = launch_gelu_epilogue<scalar_t, IdxT, V>(L, q, StoreGelu<scalar_t>{y}, alpha, beta, sms, re);
  for (int64_t i = 0; i < L.numel; ++i) {
    const float x = stored_value<scalar_t>(L, q, alpha, beta, i, re);
    const scalar_t e = static_cast<scalar_t>(gelu_value(x));
    if (!same_value(y[i], e) && errs++ < 5)
      fprintf(stderr, "dequantize_gelu%s mismatch i=%ld got %g exp %g\n", rows_tag(re), (long)i, float(y[i]),
              float(e));
    if (std::isfinite(x)) {
      const double xd = x, exact = 0.5 * xd * (1.0 + std::erf(xd * M_SQRT1_2));
      if (std::fabs(double(gelu_value(x)) - exact) > 8 * 0x1p-24 * std::fabs(xd) + 1e-37 && errs++ < 5)
        fprintf(stderr, "gelu_value(%g) = %.9g, exact %.9g\n", x, gelu_value(x), exact);
    }
  }
  if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize_gelu wrote past the end\n"); ++errs; }
  free(q);
  free(y);
  g_checked[std::string("dequantize_gelu") + table + rows_tag(re)]++;
  return errs;
}

// gelu_value_and_grad (dequantize_kernel with the StoreGeluValueAndGrad epilogue): y and dx
// each the bits of its own op (gelu_value and gelu_grad of the value dequantize stores), so the
// shared erff changes nothing
template <typename scalar_t, typename IdxT, int V>
int check_gelu_value_and_grad(const Layout& L, const float* alpha, const float* beta, int sms, const RowExp* re) {
  int errs = 0;
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  scalar_t* g = alloc<scalar_t>(L.numel, 0);
  scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
  scalar_t* dx = alloc<scalar_t>(L.numel + 1, 0);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < L.numel; ++i) {
    q[i] = uint8_t(rng());
    g[i] = static_cast<scalar_t>(nd(rng));
  }
  y[L.numel] = dx[L.numel] = scalar_t(1024.0f);
  const char* table =
      launch_gelu_epilogue<scalar_t, IdxT, V>(L, q, StoreGeluValueAndGrad<scalar_t>{g, y, dx}, alpha, beta, sms, re);
  for (int64_t i = 0; i < L.numel; ++i) {
    const float x = stored_value<scalar_t>(L, q, alpha, beta, i, re);
    const scalar_t ey = static_cast<scalar_t>(gelu_value(x));
    const scalar_t ed = static_cast<scalar_t>(gelu_grad(static_cast<float>(g[i]), x));
    if ((!same_value(y[i], ey) || !same_value(dx[i], ed)) && errs++ < 5)
      fprintf(stderr, "gelu_value_and_grad%s mismatch i=%ld got (%g, %g) exp (%g, %g)\n", rows_tag(re), (long)i,
              float(y[i]), float(dx[i]), float(ey), float(ed));
  }
  if (float(y[L.numel]) != 1024.0f || float(dx[L.numel]) != 1024.0f) {
    fprintf(stderr, "gelu_value_and_grad wrote past the end\n");
    ++errs;
  }
  free(q);
  free(g);
  free(y);
  free(dx);
  g_checked[std::string("gelu_value_and_grad") + table + rows_tag(re)]++;
  return errs;
}

template <typename scalar_t, typename IdxT, int V>
int check_quant(const Layout& L, const scalar_t* x, const float* alpha, const float* beta, int sms, uint64_t seed,
                const RowExp* re) {
  return check_quantize<scalar_t, IdxT, V>(L, x, alpha, beta, sms, seed, re) +
         check_dequantize<scalar_t, IdxT, V>(L, alpha, beta, sms, re) +
         check_dequantize_cols<scalar_t, IdxT, V>(L, alpha, beta, sms, re) +
         check_gelu_backward<scalar_t, IdxT, V>(L, alpha, beta, sms, re) +
         check_dequantize_gelu<scalar_t, IdxT, V>(L, alpha, beta, sms, re) +
         check_gelu_value_and_grad<scalar_t, IdxT, V>(L, alpha, beta, sms, re);
}

// ------------------------------------------------------------------ quantize_bits / dequantize_bits
// Every byte of the packed codes against the naive DESIGN.md math (element i: byte i / PER,
// bits (i % PER) * BITS, zero padding), both roundings, both step rules; dequantize_bits
// from random bytes (unused high bits of the last byte set too: they must be ignored).
template <typename scalar_t, typename IdxT, int BITS, bool VEC>
int check_quant_bits(const Layout& L, const scalar_t* x, const float* alpha, const float* beta, int sms,
                     uint64_t seed, bool pow2) {
  int errs = 0;
  constexpr int PER = 8 / BITS;
  const int64_t nbytes = (L.numel + PER - 1) / PER;
  const int64_t seedv[4] = {int64_t(seed & 0xFFFFFFFFu), -1, int64_t(seed >> 32), -1};  // stride 2
  const uint32_t slo = uint32_t(seed), shi = uint32_t(seed >> 32);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const unsigned grid = grid_for(bits_steps<BITS, VEC>(L.numel), sms);
  const float vmax = levels_of(BITS);
  for (int st = 0; st < 2; ++st) {
    uint8_t* q = alloc<uint8_t>(nbytes, 0);
    memset(q, 0xAB, nbytes + 1);
    if (st)
      launch_seq(grid, kThreads, [&] {
        quantize_bits_kernel<scalar_t, IdxT, BITS, VEC, true>(x, q, alpha, beta, k, IdxT(L.numel), pow2, seedv, 2);
      });
    else
      launch_seq(grid, kThreads, [&] {
        quantize_bits_kernel<scalar_t, IdxT, BITS, VEC, false>(x, q, alpha, beta, k, IdxT(L.numel), pow2, seedv, 2);
      });
    std::vector<uint8_t> want(nbytes, 0);
    for (int64_t i = 0; i < L.numel; ++i) {
      const int64_t p = param_index(L, i);
      const float inv = inv_scale_bits(alpha[p], BITS, pow2);
      const float u = st ? hash_uniform(uint64_t(i), slo, shi) : 0.0f;
      const uint8_t c = st ? quantize_value_levels<true>(float(x[i]), beta[p], inv, u, vmax)
                           : quantize_value_levels<false>(float(x[i]), beta[p], inv, u, vmax);
      want[i / PER] |= uint8_t(c << ((i % PER) * BITS));
    }
    for (int64_t b = 0; b < nbytes; ++b)
      if (q[b] != want[b] && errs++ < 5)
        fprintf(stderr, "quantize_bits<%d,%d> mismatch byte=%ld got %d exp %d\n", BITS, int(pow2), (long)b, q[b],
                want[b]);
    if (q[nbytes] != 0xAB) { fprintf(stderr, "quantize_bits wrote past the end\n"); ++errs; }
    free(q);
  }
  uint8_t* q = alloc<uint8_t>(nbytes, 0);
  for (int64_t b = 0; b < nbytes; ++b) q[b] = uint8_t(rng());
  scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
  y[L.numel] = scalar_t(1024.0f);
  launch_seq(grid, kThreads, [&] {
    dequantize_bits_kernel<scalar_t, IdxT, BITS, VEC>(q, y, alpha, beta, k, IdxT(L.numel), pow2);
  });
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    const uint8_t c = uint8_t((q[i / PER] >> ((i % PER) * BITS)) & ((1u << BITS) - 1u));
    const scalar_t e = static_cast<scalar_t>(dequantize_value(c, dequant_step_bits(alpha[p], BITS, pow2), beta[p]));
    if (!same_value(y[i], e) && errs++ < 5)
      fprintf(stderr, "dequantize_bits<%d,%d> mismatch i=%ld got %g exp %g\n", BITS, int(pow2), (long)i, float(y[i]),
              float(e));
  }
  if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize_bits wrote past the end\n"); ++errs; }
  free(q);
  free(y);
  g_checked["quantize_bits"]++;
  return errs;
}

template <typename scalar_t, int BITS>
int check_bits_all(const Layout& L, const scalar_t* xa, const scalar_t* xu, const float* alpha, const float* beta,
                   int sms, uint64_t seed) {
  int e = 0;
  for (int pow2 = 0; pow2 < 2; ++pow2) {
    e += check_quant_bits<scalar_t, uint32_t, BITS, true>(L, xa, alpha, beta, sms, seed, pow2);
    e += check_quant_bits<scalar_t, uint32_t, BITS, false>(L, xu, alpha, beta, sms, seed, pow2);
    e += check_quant_bits<scalar_t, uint64_t, BITS, false>(L, xu, alpha, beta, sms, seed, pow2);
  }
  return e;
}

// ------------------------------------------------------------------ sequential observe
struct SeqEstimate {
  std::vector<float> out_a, out_b, est_a, est_b;
  bool init;
};

// naive per-(s, g) min / max of the values the kernel sees, canonical (what group_minmax returns)
void seq_minmax(const Layout& L, const std::vector<float>& xs, std::vector<float>& mn, std::vector<float>& mx) {
  mn.assign(L.S * L.G, INFINITY);
  mx.assign(L.S * L.G, -INFINITY);
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    mn[p] = nan_min(mn[p], xs[i]);
    mx[p] = nan_max(mx[p], xs[i]);
  }
  for (auto& v : mn) v = canonical(v);
  for (auto& v : mx) v = canonical(v);
}

// the sequential estimate step of update_estimates_cpu
SeqEstimate seq_estimates(const std::vector<float>& mn, const std::vector<float>& mx, int64_t S, int64_t G,
                          std::vector<float> est_a, std::vector<float> est_b, bool init, float lam, float oml,
                          bool per_sample, bool symmetric, bool valid) {
  SeqEstimate r{std::vector<float>(S * G), std::vector<float>(S * G), est_a, est_b, init};
  std::vector<float> ra(G), rb(G);
  bool finite = valid;
  for (int64_t g = 0; g < G; ++g) {
    batch_range(mn.data(), mx.data(), S, G, g, per_sample, symmetric, ra[g], rb[g]);
    finite = finite && is_finite(ra[g]) && is_finite(rb[g]);
  }
  for (int64_t g = 0; g < G; ++g) {
    float ua, ub;
    estimate_step(est_a[g], ra[g], init, finite, lam, oml, ua, r.est_a[g]);
    estimate_step(est_b[g], rb[g], init, finite, lam, oml, ub, r.est_b[g]);
    if (!per_sample) r.out_a[g] = ua, r.out_b[g] = ub;
  }
  if (per_sample)
    for (int64_t i = 0; i < S * G; ++i) {
      group_range(mn[i], mx[i], symmetric, r.out_a[i], r.out_b[i]);
      r.out_a[i] = canonical(r.out_a[i]);
      r.out_b[i] = canonical(r.out_b[i]);
    }
  r.init = init || finite;
  return r;
}

bool vec_same_bits(const std::vector<float>& a, const float* b, size_t n) {
  return a.size() >= n && std::memcmp(a.data(), b, n * sizeof(float)) == 0;
}

// The rng state and what the seed step must leave: seed = seed_step(key, counter), counter + 1
struct RngCase {
  int64_t buf[2];
  uint32_t key, counter;
  explicit RngCase(std::mt19937_64& r) {
    key = uint32_t(r());
    counter = r() % 2 ? 0xFFFFFFFFu : uint32_t(r());  // the counter's wrap-around too
    buf[0] = key;
    buf[1] = counter;
  }
  bool stepped(const int64_t* seed_out) const {
    uint32_t lo, hi;
    seed_step(key, counter, lo, hi);
    return seed_out[0] == int64_t(lo) && seed_out[1] == int64_t(hi) && buf[0] == int64_t(key) &&
           buf[1] == int64_t(uint32_t(counter + 1u));
  }
};

static int g_skipped = 0;

// The SIMT emulation costs a pool round trip per block: layouts with many blocks are left to
// the sequential kernels' checks.
bool simt_affordable(const ObserveConfig& c, int64_t numel) {
  if (c.blocks > 48 || c.blocks * c.threads * 1.0 * std::max<int64_t>(1, numel / 100000) > 48 * 256) {
    g_skipped++;
    return false;
  }
  return true;
}

// every workspace word zero but `except` (the last block resets the rest for the next launch)
int ws_clean(const std::vector<uint32_t>& ws, const char* what, int64_t except = -1) {
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i] != 0u && int64_t(i) != except) {
      fprintf(stderr, "%s: workspace word %zu not reset (%u)\n", what, i, ws[i]);
      return 1;
    }
  return 0;
}

// observe_kernel in MODE_MINMAX (group_minmax: no row exponents, as the op) against the naive min/max
template <typename scalar_t, typename IdxT, int V>
int check_group_minmax(const Layout& L, const scalar_t* x, const ObserveConfig& c, std::vector<uint32_t>& ws,
                       const StridedX<scalar_t>* sx) {
  const int64_t P = L.S * L.G;
  std::vector<float> emn, emx;
  seq_minmax(L, seen_values(x, L.numel, nullptr), emn, emx);
  std::vector<float> omn(P, 7.0f), omx(P, 7.0f);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
    observe_kernel<scalar_t, IdxT, V, MODE_MINMAX>(input_of(x, sx), k, IdxT(L.numel), IdxT(c.chunk), L.S, ws.data(),
                                                  EstimateArgs{}, SeedArgs{}, omn.data(), omx.data(), KRows<IdxT>{},
                                                  strides_of<IdxT>(sx));
  });
  int errs = 0;
  for (int64_t p = 0; p < P; ++p)
    if ((!same_bits(omn[p], emn[p]) || !same_bits(omx[p], emx[p])) && errs++ < 5)
      fprintf(stderr, "minmax mismatch p=%ld got (%g,%g) exp (%g,%g)\n", (long)p, omn[p], omx[p], emn[p], emx[p]);
  g_checked[std::string("group_minmax") + strided_tag(sx)]++;
  return errs + ws_clean(ws, "minmax");
}

// observe_kernel in MODE_OBSERVE, twice (before and after initialisation), sharing the workspace
// the group_minmax launch reset, against the sequential pass over the (row-scaled) values.
template <typename scalar_t, typename IdxT, int V>
int check_observe_mode(const Layout& L, const scalar_t* x, const ObserveConfig& c, std::vector<uint32_t>& ws,
                       bool symmetric, bool per_sample, const RowExp* re, const StridedX<scalar_t>* sx) {
  const int64_t S = L.S, G = L.G, P = S * G;
  std::vector<float> emn, emx;
  seq_minmax(L, seen_values(x, L.numel, re), emn, emx);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const KRows<IdxT> rows = krows_of<IdxT>(re);
  std::normal_distribution<float> nd;
  std::vector<float> est_a(G + 2), est_b(G + 2);
  for (auto& v : est_a) v = std::fabs(nd(rng));
  for (auto& v : est_b) v = nd(rng);
  bool init = rng() % 2;
  int errs = 0;
  for (int call = 0; call < 2; ++call) {
    const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
    const SeqEstimate want = seq_estimates(emn, emx, S, G, est_a, est_b, init, lam, oml, per_sample, symmetric,
                                           L.numel > 0);
    std::vector<float> oa(P, 7.0f), ob(P, 7.0f);
    bool kinit = init;
    int64_t seed_out[2] = {-1, -1};
    RngCase rc(rng);
    const EstimateArgs est{est_a.data(), est_b.data(), &kinit, lam, oml, per_sample, symmetric, L.numel > 0,
                           oa.data(), ob.data()};
    const SeedArgs sd{rc.buf, 1, seed_out};
    launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
      observe_kernel<scalar_t, IdxT, V, MODE_OBSERVE>(input_of(x, sx), k, IdxT(L.numel), IdxT(c.chunk), S, ws.data(),
                                                     est, sd, nullptr, nullptr, rows, strides_of<IdxT>(sx));
    });
    const int64_t nout = per_sample ? P : G;
    const bool ok = vec_same_bits(want.out_a, oa.data(), nout) && vec_same_bits(want.out_b, ob.data(), nout) &&
                    vec_same_bits(want.est_a, est_a.data(), G + 2) && vec_same_bits(want.est_b, est_b.data(), G + 2) &&
                    kinit == want.init;
    const bool seed_ok = rc.stepped(seed_out);
    if ((!ok || !seed_ok) && errs++ < 5)
      fprintf(stderr, "observe%s mismatch (call %d): estimates %s, seed %s\n", rows_tag(re), call, ok ? "ok" : "DIFFER",
              seed_ok ? "ok" : "DIFFER");
    errs += ws_clean(ws, "observe");
    init = kinit;
  }
  g_checked[std::string("observe") + rows_tag(re) + strided_tag(sx)]++;
  return errs;
}

// observe_kernel in MODE_DELAYED (delayed_observe: shared statistics, no row exponents, as the
// op), against the definition: (1, G) copies of the estimates from before the launch, the
// sequential estimate step over the batch's min/max, the counter advanced by one and no seed
// written. The copies' buffer has one more entry, which must stay untouched.
template <typename scalar_t, typename IdxT, int V>
int check_delayed_observe(const Layout& L, const scalar_t* x, const ObserveConfig& c, std::vector<uint32_t>& ws,
                          bool symmetric, const StridedX<scalar_t>* sx) {
  const int64_t G = L.G;
  std::vector<float> emn, emx;
  seq_minmax(L, seen_values(x, L.numel, nullptr), emn, emx);
  std::normal_distribution<float> nd;
  std::vector<float> est_a(G + 2), est_b(G + 2);
  for (auto& v : est_a) v = std::fabs(nd(rng));
  for (auto& v : est_b) v = nd(rng);
  bool init = rng() % 2;
  const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
  const SeqEstimate want = seq_estimates(emn, emx, 1, G, est_a, est_b, init, lam, oml, false, symmetric,
                                         L.numel > 0);
  const std::vector<float> before_a(est_a.begin(), est_a.begin() + G), before_b(est_b.begin(), est_b.begin() + G);
  std::vector<float> oa(G + 1, 7.0f), ob(G + 1, 7.0f);
  RngCase rc(rng);
  const EstimateArgs est{est_a.data(), est_b.data(), &init, lam, oml, false, symmetric, L.numel > 0, nullptr, nullptr};
  const SeedArgs sd{rc.buf, 1, nullptr};
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
    observe_kernel<scalar_t, IdxT, V, MODE_DELAYED>(input_of(x, sx), k, IdxT(L.numel), IdxT(c.chunk), 1, ws.data(),
                                                   est, sd, oa.data(), ob.data(), KRows<IdxT>{},
                                                   strides_of<IdxT>(sx));
  });
  const bool used_ok = vec_same_bits(before_a, oa.data(), G) && vec_same_bits(before_b, ob.data(), G) &&
                       same_bits(oa[G], 7.0f) && same_bits(ob[G], 7.0f);
  const bool est_ok = vec_same_bits(want.est_a, est_a.data(), G + 2) &&
                      vec_same_bits(want.est_b, est_b.data(), G + 2) && init == want.init;
  const bool rng_ok = rc.buf[0] == int64_t(rc.key) && rc.buf[1] == int64_t(uint32_t(rc.counter + 1u));
  int errs = 0;
  if (!used_ok || !est_ok || !rng_ok) {
    fprintf(stderr, "delayed_observe mismatch: used %s, estimates %s, counter %s\n", used_ok ? "ok" : "DIFFER",
            est_ok ? "ok" : "DIFFER", rng_ok ? "ok" : "DIFFERS");
    ++errs;
  }
  g_checked[std::string("delayed_observe") + strided_tag(sx)]++;
  return errs + ws_clean(ws, "delayed_observe");
}

// seed_of_kernel: the seed step's seed, the rng (strided as a column of a (2, 2) buffer) unchanged
int check_seed_of() {
  RngCase rc(rng);
  int64_t buf[4] = {rc.buf[0], -1, rc.buf[1], -1};
  int64_t out[2] = {-1, -1};
  seed_of_kernel(buf, 2, out);
  uint32_t lo, hi;
  seed_step(rc.key, rc.counter, lo, hi);
  g_checked["seed_of"]++;
  const bool ok = out[0] == int64_t(lo) && out[1] == int64_t(hi) && buf[0] == int64_t(rc.key) && buf[1] == -1 &&
                  buf[2] == int64_t(rc.counter) && buf[3] == -1;
  if (!ok) fprintf(stderr, "seed_of mismatch: got (%ld, %ld)\n", (long)out[0], (long)out[1]);
  return ok ? 0 : 1;
}

template <typename scalar_t, typename IdxT, int V>
int check_observe(const Layout& L, const scalar_t* x, int sms, bool symmetric, bool per_sample, const RowExp* re,
                  const StridedX<scalar_t>* sx = nullptr) {
  // 1 to 8 resident blocks an SM (the op asks the occupancy API; it was 8 for every kernel)
  const ObserveConfig c = observe_config(L, V, sms, 1 + int(rng() % 8));
  if (!simt_affordable(c, L.numel)) return 0;
  std::vector<uint32_t> ws(kWsHeader + 2 * std::max<int64_t>(L.S * L.G, 1), 0u);
  int errs = check_group_minmax<scalar_t, IdxT, V>(L, x, c, ws, sx) +
             check_observe_mode<scalar_t, IdxT, V>(L, x, c, ws, symmetric, per_sample, re, sx);
  if (!per_sample && L.S == 1) errs += check_delayed_observe<scalar_t, IdxT, V>(L, x, c, ws, symmetric, sx);
  return errs + check_seed_of();
}

// ------------------------------------------------------------------ quantize_observe
// One quantize_observe call as the op issues it: the fused launch (SIMT), then quantize with
// the skip flag ws + 1, the used (alpha, beta) and the seed the fused launch wrote. The second
// launch writes into its own buffer q2 here so that each launch's writes are checked: the
// codes are q's (fused) with initialized estimates, q2's (quantize) otherwise, and the other
// buffer must be untouched.
struct QoState {
  std::vector<float> est_a, est_b;  // G + 2 entries: the kernel must not touch the last two
  bool init;
};

struct QoResult {
  std::vector<uint8_t> q, q2;
  std::vector<float> used_a, used_b;  // G + 1 entries: the last one must stay untouched
  int64_t seed_out[2] = {-1, -1};
};

template <typename scalar_t, typename IdxT, int V, bool STOCH>
QoResult run_quantize_observe(const Layout& L, const scalar_t* x, const ObserveConfig& c, std::vector<uint32_t>& ws,
                              QoState& st, RngCase& rc, bool symmetric, int sms, const RowExp* re,
                              const std::vector<uint8_t>& untouched, const StridedX<scalar_t>* sx) {
  const int64_t G = L.G;
  QoResult r{untouched, untouched, std::vector<float>(G + 1, 7.0f), std::vector<float>(G + 1, 7.0f)};
  uint8_t* q = alloc<uint8_t>(L.numel, 0);  // 16-byte aligned: the vector path stores 16 codes
  uint8_t* q2 = alloc<uint8_t>(L.numel, 0);
  memcpy(q, untouched.data(), L.numel);
  memcpy(q2, untouched.data(), L.numel);
  const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
  const EstimateArgs est{st.est_a.data(), st.est_b.data(), &st.init, lam, oml, false, symmetric, true,
                         nullptr, nullptr};
  const SeedArgs sd{rc.buf, 1, r.seed_out};
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const KRows<IdxT> rows = krows_of<IdxT>(re);
  launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
    quantize_observe_kernel<scalar_t, IdxT, V, STOCH>(input_of(x, sx), q, k, IdxT(L.numel), IdxT(c.chunk), ws.data(),
                                                     est, sd, r.used_a.data(), r.used_b.data(), rows,
                                                     strides_of<IdxT>(sx));
  });
  run_quantize<scalar_t, IdxT, V, STOCH>(L, x, q2, r.used_a.data(), r.used_b.data(), sms, r.seed_out, 1, re,
                                         ws.data() + 1, sx);
  memcpy(r.q.data(), q, L.numel);
  memcpy(r.q2.data(), q2, L.numel);
  free(q);
  free(q2);
  return r;
}

// The definition (reference.quantize_observe): with initialized estimates, codes from the
// estimates before the batch and the seed step's seed, then the running step with the batch's
// min/max; without, observe (the running step: its outputs are the used range) + quantize.
struct QoWant {
  std::vector<uint8_t> codes;
  std::vector<float> used_a, used_b;
  SeqEstimate next;
};

QoWant naive_quantize_observe(const Layout& L, const std::vector<float>& xs, const QoState& st, const RngCase& rc,
                              bool symmetric, bool stoch) {
  const int64_t G = L.G;
  std::vector<float> emn, emx;
  seq_minmax(L, xs, emn, emx);
  QoWant w;
  w.next = seq_estimates(emn, emx, 1, G, st.est_a, st.est_b, st.init, 0.9f, static_cast<float>(1.0 - 0.9), false,
                         symmetric, true);
  w.used_a = st.init ? std::vector<float>(st.est_a.begin(), st.est_a.begin() + G) : w.next.out_a;
  w.used_b = st.init ? std::vector<float>(st.est_b.begin(), st.est_b.begin() + G) : w.next.out_b;
  uint32_t lo, hi;
  seed_step(rc.key, rc.counter, lo, hi);
  w.codes = naive_codes(L, xs, w.used_a.data(), w.used_b.data(), stoch, lo, hi);
  return w;
}

int compare_quantize_observe(const Layout& L, const QoWant& w, const QoResult& r, const QoState& st_after,
                             const RngCase& rc, bool init, const std::vector<uint8_t>& untouched,
                             const std::vector<uint32_t>& ws, const char* tag) {
  const int64_t G = L.G;
  int errs = count_code_mismatches(tag, (init ? r.q : r.q2).data(), w.codes);
  if ((init ? r.q2 : r.q) != untouched) {
    fprintf(stderr, "%s: the %s launch wrote codes it must not (initialized=%d)\n", tag, init ? "quantize" : "fused",
            int(init));
    ++errs;
  }
  const bool used_ok = vec_same_bits(w.used_a, r.used_a.data(), G) && vec_same_bits(w.used_b, r.used_b.data(), G) &&
                       same_bits(r.used_a[G], 7.0f) && same_bits(r.used_b[G], 7.0f);
  const bool est_ok = vec_same_bits(w.next.est_a, st_after.est_a.data(), G + 2) &&
                      vec_same_bits(w.next.est_b, st_after.est_b.data(), G + 2) && st_after.init == w.next.init;
  const bool seed_ok = rc.stepped(r.seed_out);
  const bool flag_ok = ws[1] == (init ? 1u : 0u);
  if (!used_ok || !est_ok || !seed_ok || !flag_ok) {
    fprintf(stderr, "%s (initialized=%d): used %s, estimates %s, seed %s, ws[1] %s\n", tag, int(init),
            used_ok ? "ok" : "DIFFER", est_ok ? "ok" : "DIFFER", seed_ok ? "ok" : "DIFFER", flag_ok ? "ok" : "DIFFERS");
    ++errs;
  }
  return errs + ws_clean(ws, tag, 1);
}

// Two calls sharing one workspace: a first batch and initialized estimates, in a random order
// (so ws[1] flips both ways).
template <typename scalar_t, typename IdxT, int V, bool STOCH>
int check_quantize_observe(const Layout& L, const scalar_t* x, int sms, bool symmetric, const RowExp* re,
                           const StridedX<scalar_t>* sx) {
  // 1 to 8 resident blocks an SM (the op asks the occupancy API; it was 8 for every kernel)
  const ObserveConfig c = observe_config(L, V, sms, 1 + int(rng() % 8));
  if (L.numel == 0 || !simt_affordable(c, L.numel)) return 0;  // (numel 0: the op calls observe)
  const int64_t G = L.G;
  const std::vector<float> xs = seen_values(x, L.numel, re);
  std::vector<uint32_t> ws(kWsHeader + 2 * std::max<int64_t>(G, 1), 0u);
  std::normal_distribution<float> nd;
  QoState st{std::vector<float>(G + 2), std::vector<float>(G + 2), false};
  for (auto& v : st.est_a) v = std::fabs(nd(rng)) * 4.0f;
  for (auto& v : st.est_b) v = nd(rng);
  const bool first_init = rng() % 2;
  int errs = 0;
  for (int call = 0; call < 2; ++call) {
    st.init = call == 0 ? first_init : !first_init;
    RngCase rc(rng);
    std::vector<uint8_t> untouched(L.numel);
    for (auto& b : untouched) b = uint8_t(rng());
    const QoWant w = naive_quantize_observe(L, xs, st, rc, symmetric, STOCH);
    const bool init = st.init;
    const QoResult r = run_quantize_observe<scalar_t, IdxT, V, STOCH>(L, x, c, ws, st, rc, symmetric, sms, re,
                                                                      untouched, sx);
    const std::string tag =
        std::string("quantize_observe") + (init ? "_init" : "_first") + rows_tag(re) + strided_tag(sx);
    errs += compare_quantize_observe(L, w, r, st, rc, init, untouched, ws, tag.c_str());
    g_checked[tag]++;
  }
  return errs;
}

template <typename scalar_t, typename IdxT, int V>
int check_quantize_observe_any(const Layout& L, const scalar_t* x, int sms, bool symmetric, const RowExp* re,
                               const StridedX<scalar_t>* sx = nullptr) {
  return rng() % 2 ? check_quantize_observe<scalar_t, IdxT, V, true>(L, x, sms, symmetric, re, sx)
                   : check_quantize_observe<scalar_t, IdxT, V, false>(L, x, sms, symmetric, re, sx);
}

// ------------------------------------------------------------------ one layout, every kernel
template <typename scalar_t>
struct CaseData {
  Layout L;
  RowExp re;
  scalar_t* xa = nullptr;  // 256-byte aligned: the 16-element paths
  scalar_t* xu = nullptr;  // data_ptr offset by a few elements: the scalar paths
  size_t off = 0;
  std::vector<float> alpha, beta;
  uint64_t seed = 0;
  StridedX<scalar_t> sx;  // xa laid out as a strided view (sx.rows: none when it has no twin)
  const RowExp* rows() const { return re.len > 0 ? &re : nullptr; }
  const StridedX<scalar_t>* strided() const { return sx.rows.has_value() ? &sx : nullptr; }
  ~CaseData() {
    free(xa);
    free(xu - off);
  }
};

template <typename scalar_t>
void make_case(CaseData<scalar_t>& c, const std::vector<int64_t>& shape, int64_t dim, int64_t G, bool per_sample,
               bool specials) {
  const int64_t S = per_sample ? shape[0] : 1;
  c.L = make_layout_h(shape, dim, G, S);
  c.re = random_rows<scalar_t>(shape);
  c.off = 1 + rng() % (16 / sizeof(scalar_t) - 1);
  c.xa = alloc<scalar_t>(c.L.numel, 0);
  c.xu = alloc<scalar_t>(c.L.numel, c.off);
  fill(c.xa, c.L.numel, specials);
  shrink_rows(c.xa, c.re);
  memcpy(c.xu, c.xa, c.L.numel * sizeof(scalar_t));
  make_strided(c.sx, c.xa, c.L.numel);
  c.alpha.resize(S * G);
  c.beta.resize(S * G);
  std::uniform_real_distribution<float> ua(0.0f, 8.0f), ub(-5.0f, 2.0f);
  for (int64_t k = 0; k < S * G; ++k) {
    c.alpha[k] = (rng() % 17 == 0) ? 0.0f : ua(rng);
    c.beta[k] = ub(rng);
  }
  if (specials && S * G > 1) { c.alpha[0] = NAN; c.beta[S * G - 1] = NAN; }
  c.seed = rng();
}

// quantize / dequantize on the vector, scalar and 64-bit index paths
template <typename scalar_t>
int check_quant_paths(const CaseData<scalar_t>& c, int sms, const RowExp* re) {
  const float *a = c.alpha.data(), *b = c.beta.data();
  return check_quant<scalar_t, uint32_t, kVec>(c.L, c.xa, a, b, sms, c.seed, re) +
         check_quant<scalar_t, uint32_t, 1>(c.L, c.xu, a, b, sms, c.seed, re) +
         check_quant<scalar_t, uint64_t, 1>(c.L, c.xu, a, b, sms, c.seed, re);
}

// quantize / dequantize without and with row exponents, and the bit widths
template <typename scalar_t>
int check_elementwise(const CaseData<scalar_t>& c, int sms) {
  const float *a = c.alpha.data(), *b = c.beta.data();
  int e = check_quant_paths(c, sms, nullptr);
  if (c.rows() != nullptr) e += check_quant_paths(c, sms, c.rows());
  if (const StridedX<scalar_t>* sx = c.strided()) {  // quantize reading x in place (the flat index for the rows)
    for (const RowExp* re : {static_cast<const RowExp*>(nullptr), c.rows()}) {
      e += check_quantize<scalar_t, uint32_t, kVec>(c.L, c.xa, a, b, sms, c.seed, re, sx) +
           check_quantize<scalar_t, uint32_t, 1>(c.L, c.xa, a, b, sms, c.seed, re, sx) +
           check_quantize<scalar_t, uint64_t, 1>(c.L, c.xa, a, b, sms, c.seed, re, sx);
      if (re == nullptr && c.rows() == nullptr) break;
    }
  }
  if (c.rows() != nullptr) {  // quantize with a LayerNorm's statistics, with and without row exponents
    RowExp rn = *c.rows();
    add_row_norm(rn, c.xa, c.L.numel);
    for (int with_k = 0; with_k < 2; ++with_k) {
      if (!with_k) rn.k.clear();
      else rn.k = c.rows()->k;
      e += check_quantize<scalar_t, uint32_t, kVec>(c.L, c.xa, a, b, sms, c.seed, &rn) +
           check_quantize<scalar_t, uint32_t, 1>(c.L, c.xu, a, b, sms, c.seed, &rn) +
           check_quantize<scalar_t, uint64_t, 1>(c.L, c.xu, a, b, sms, c.seed, &rn);
    }
    // dequantize with row_mul (LayerNorm's 1 / rstd; some rows NaN, inf, 0, subnormal), with
    // and without row exponents
    RowExp rm = *c.rows();
    rm.mul.resize(rm.k.size());
    std::uniform_real_distribution<float> um(-12.0f, 12.0f);
    for (auto& f : rm.mul) {
      const int pick = rng() % 16;
      f = pick == 0 ? NAN : pick == 1 ? INFINITY : pick == 2 ? 0.0f : pick == 3 ? 1e-40f : std::exp2(um(rng));
    }
    for (int with_k = 0; with_k < 2; ++with_k) {
      if (!with_k) rm.k.clear();
      else rm.k = c.rows()->k;
      e += check_dequantize<scalar_t, uint32_t, kVec>(c.L, a, b, sms, &rm) +
           check_dequantize<scalar_t, uint32_t, 1>(c.L, a, b, sms, &rm) +
           check_dequantize<scalar_t, uint64_t, 1>(c.L, a, b, sms, &rm);
      // and the column epilogue after them (LayerNorm + Linear's rebuild takes row_exp only;
      // the op allows both)
      e += check_dequantize_cols<scalar_t, uint32_t, kVec>(c.L, a, b, sms, &rm) +
           check_dequantize_cols<scalar_t, uint32_t, 1>(c.L, a, b, sms, &rm) +
           check_dequantize_cols<scalar_t, uint64_t, 1>(c.L, a, b, sms, &rm);
    }
  }
  e += check_bits_all<scalar_t, 8>(c.L, c.xa, c.xu, a, b, sms, c.seed);
  e += check_bits_all<scalar_t, 4>(c.L, c.xa, c.xu, a, b, sms, c.seed);
  e += check_bits_all<scalar_t, 2>(c.L, c.xa, c.xu, a, b, sms, c.seed);
  return e;
}

// observe / group_minmax and quantize_observe (shared statistics of the same layout), each
// with or without the row exponents at random, on the vector, scalar and (sometimes) 64-bit paths
template <typename scalar_t>
int check_cooperative(const CaseData<scalar_t>& c, const std::vector<int64_t>& shape, int64_t dim, bool per_sample,
                      int sms) {
  const bool sym = rng() % 2;
  auto pick_rows = [&] { return rng() % 2 ? c.rows() : nullptr; };
  const Layout L1 = make_layout_h(shape, dim, c.L.G, 1);
  int e = 0;
  e += check_observe<scalar_t, uint32_t, kVec>(c.L, c.xa, sms, sym, per_sample, pick_rows());
  e += check_observe<scalar_t, uint32_t, 1>(c.L, c.xu, sms, sym, per_sample, pick_rows());
  e += check_quantize_observe_any<scalar_t, uint32_t, kVec>(L1, c.xa, sms, sym, pick_rows());
  e += check_quantize_observe_any<scalar_t, uint32_t, 1>(L1, c.xu, sms, sym, pick_rows());
  if (rng() % 4 == 0) {
    e += check_observe<scalar_t, uint64_t, 1>(c.L, c.xu, sms, sym, per_sample, pick_rows());
    e += check_quantize_observe_any<scalar_t, uint64_t, 1>(L1, c.xu, sms, sym, pick_rows());
  }
  if (const StridedX<scalar_t>* sx = c.strided()) {  // reading x in place
    e += check_observe<scalar_t, uint32_t, kVec>(c.L, c.xa, sms, sym, per_sample, pick_rows(), sx);
    e += check_observe<scalar_t, uint32_t, 1>(c.L, c.xa, sms, sym, per_sample, pick_rows(), sx);
    e += check_quantize_observe_any<scalar_t, uint32_t, kVec>(L1, c.xa, sms, sym, pick_rows(), sx);
  }
  return e;
}

template <typename scalar_t>
int run_case(const std::vector<int64_t>& shape, int64_t dim, int64_t G, bool per_sample, int sms, bool specials,
             bool do_observe) {
  CaseData<scalar_t> c;
  make_case(c, shape, dim, G, per_sample, specials);
  int e = check_elementwise(c, sms);
  if (do_observe) e += check_cooperative(c, shape, dim, per_sample, sms);
  if (e) {
    fprintf(stderr, "FAIL shape=(");
    for (auto v : shape) fprintf(stderr, "%ld,", (long)v);
    fprintf(stderr, ") dim=%ld G=%ld ps=%d sms=%d sizeof=%zu row_len=%ld\n", (long)dim, (long)G, per_sample, sms,
            sizeof(scalar_t), (long)c.re.len);
  }
  return e;
}

// ------------------------------------------------------------------ index math
int fastdiv_check() {
  int errs = 0;
  std::vector<uint32_t> divs = {1, 2, 3, 5, 7, 197, 384, 1000, 38809, 65535, 65536, 65537, (1u << 30) - 1, 1u << 30,
                                (1u << 30) + 1, (1u << 31) - 1};
  for (int k = 0; k < 3000; ++k) divs.push_back(1 + rng() % ((1u << 31) - 1));
  for (int k = 0; k < 3000; ++k) divs.push_back(1 + rng() % 100000);
  for (uint32_t d : divs) {
    FastDiv32 f(d);
    auto chk = [&](uint32_t n) {
      if (f(n) != n / d && errs++ < 5) fprintf(stderr, "FastDiv32 %u / %u = %u\n", n, d, f(n));
    };
    for (uint32_t n = 0; n < 2000; ++n) chk(n);
    for (uint32_t n = (1u << 31) - 2000; n < (1u << 31); ++n) chk(n);
    for (uint64_t q = 1; q * d < (1ull << 31) && q < 5000; q = q * 3 + 1) {
      chk(uint32_t(q * d - 1));
      chk(uint32_t(q * d));
      if (q * d + 1 < (1ull << 31)) chk(uint32_t(q * d + 1));
    }
    for (int r = 0; r < 2000; ++r) chk(uint32_t(rng() % (1u << 31)));
  }
  return errs;
}

// param_of at large indices (near 2^31 for the 32-bit path, > 2^32 for 64-bit) vs the
// naive math, and one_param (one fetch per 16 elements) never true for a mixed window.
template <typename IdxT>
int param_check(const std::vector<int64_t>& shape, int64_t dim, int64_t G, int64_t S) {
  const Layout L = make_layout_h(shape, dim, G, S);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  int errs = 0;
  for (int r = 0; r < 4000; ++r) {
    const int64_t i0 = r < 2000 ? int64_t(rng() % L.numel) : L.numel - 1 - int64_t(rng() % 100000 % L.numel);
    const IdxT p0 = param_of(k, IdxT(i0));
    if (int64_t(p0) != param_index(L, i0) && errs++ < 5) fprintf(stderr, "param_of mismatch i=%ld\n", (long)i0);
    if (i0 + kVec <= L.numel && one_param<IdxT, kVec>(k, IdxT(i0), p0))
      for (int e = 1; e < kVec; ++e)
        if (param_index(L, i0 + e) != int64_t(p0) && errs++ < 5)
          fprintf(stderr, "one_param wrong at i0=%ld\n", (long)i0);
  }
  return errs;
}

// exhaustive one_param property on small layouts (the min_run argument)
int one_param_check() {
  int errs = 0;
  for (int t = 0; t < 3000; ++t) {
    const int nd = 1 + rng() % 3;
    std::vector<int64_t> shape(nd);
    for (auto& v : shape) v = 1 + rng() % 40;
    const int64_t dim = rng() % nd;
    const int64_t G = 1 + rng() % shape[dim];
    const int64_t S = rng() % 2 ? shape[0] : 1;
    const Layout L = make_layout_h(shape, dim, G, S);
    const KLayout<uint32_t> k = make_klayout<uint32_t>(L);
    for (int64_t i0 = 0; i0 + kVec <= L.numel; ++i0) {
      const uint32_t p0 = param_of(k, uint32_t(i0));
      if (!one_param<uint32_t, kVec>(k, uint32_t(i0), p0)) continue;
      for (int e = 1; e < kVec; ++e)
        if (param_index(L, i0 + e) != int64_t(p0) && errs++ < 5)
          fprintf(stderr, "one_param wrong: numel=%ld i0=%ld\n", (long)L.numel, (long)i0);
    }
  }
  return errs;
}

// update_estimates_kernel (one block, SIMT) against the sequential step; with a seed
// (estimate_and_seed) also the seed step.
int estimates_check(bool quick) {
  int errs = 0, cases = 0;
  std::mt19937 r(7);
  // one block of 256 threads: G below, at and above a block's width, and above kSlots
  const std::vector<int64_t> groups = quick ? std::vector<int64_t>{3, 257, 1500}
                                            : std::vector<int64_t>{1, 3, 255, 256, 257, 1000, 1500};
  for (int64_t G : groups)
    for (int64_t S : {1, 4, 0})
      for (int flags = 0; flags < 64; ++flags) {
        const bool per_sample = flags & 1, symmetric = flags & 2, init = flags & 4, valid = flags & 8,
                   special = flags & 16, zeros = flags & 32;
        if (!per_sample && S != 1) continue;
        std::normal_distribution<float> nd;
        std::vector<float> mn(S * G), mx(S * G), ea(G), eb(G);
        for (int64_t i = 0; i < S * G; ++i) {
          mn[i] = zeros ? (r() % 2 ? -0.0f : 0.0f) : nd(r);
          mx[i] = zeros ? (r() % 2 ? -0.0f : 0.0f) : mn[i] + std::fabs(nd(r));
        }
        for (int64_t g = 0; g < G; ++g) {
          ea[g] = std::fabs(nd(r));
          eb[g] = zeros ? -0.0f : nd(r);
        }
        if (special && S * G > 0) mn[r() % (S * G)] = __uint_as_float(0x7FC00001u);
        const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
        // the kernel sees raw floats; the sequential pass canonical ones (group_minmax's output)
        std::vector<float> cmn = mn, cmx = mx;
        for (auto& v : cmn) v = canonical(v);
        for (auto& v : cmx) v = canonical(v);
        const SeqEstimate want = seq_estimates(cmn, cmx, S, G, ea, eb, init, lam, oml, per_sample, symmetric, valid);
        std::vector<float> ka = ea, kb = eb;
        const int64_t out_n = per_sample ? S * G : G;
        std::vector<float> koa(out_n, -7.f), kob(out_n, -7.f);
        bool kinit = init;
        const EstimateArgs est{ka.data(), kb.data(), &kinit, lam, oml, per_sample, symmetric, valid, koa.data(),
                               kob.data()};
        const bool seeded = r() % 2;  // estimate_and_seed: thread 0 also runs the seed step
        RngCase rc(rng);
        int64_t seed_out[2] = {-1, -1};
        const SeedArgs sd = seeded ? SeedArgs{rc.buf, 1, seed_out} : SeedArgs{};
        launch_simt(1, kThreads, [&] { update_estimates_kernel(mn.data(), mx.data(), S, G, est, sd); });
        const bool seed_ok = seeded ? rc.stepped(seed_out)
                                    : seed_out[0] == -1 && rc.buf[1] == int64_t(rc.counter);
        const bool ok = vec_same_bits(want.est_a, ka.data(), G) && vec_same_bits(want.est_b, kb.data(), G) &&
                        vec_same_bits(want.out_a, koa.data(), out_n) && vec_same_bits(want.out_b, kob.data(), out_n) &&
                        kinit == want.init && seed_ok;
        if (!ok && errs < 5)
          printf("update_estimates mismatch: G=%ld S=%ld flags=%d seeded=%d\n", long(G), long(S), flags, int(seeded));
        errs += !ok;
        ++cases;
        g_checked[seeded ? "estimate_and_seed" : "update_estimates"]++;
      }
  printf("update_estimates errors: %d (%d cases)\n", errs, cases);
  return errs;
}

// ------------------------------------------------------------------ row_exponents
// Rows whose magnitudes spread over many octaves (so k covers its range), and special rows:
// a NaN, an infinity, all zeros of either sign, subnormal values only (in the dtype).
template <typename scalar_t>
void fill_rows(scalar_t* x, int64_t rows, int64_t len) {
  constexpr bool half = std::is_same_v<scalar_t, c10::Half>;
  constexpr int lo = half ? -20 : -60, hi = half ? 8 : 20;
  constexpr int sub = half ? -20 : -130;  // inside the subnormal range: 2**-24 (half), 2**-133 (bf16) up
  std::normal_distribution<float> nd;
  // (over 1,000 rows no NaN or inf row: one in ten rows has one, so a large batch would almost
  // surely make the mean NaN or inf and every k 0, and the finish's walks would go unchecked)
  const bool specials = rows <= 1000;
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* xr = x + r * len;
    const int kind = specials ? int(rng() % 10) : 2 + int(rng() % 8);
    const int e = kind == 3 ? sub : lo + int(rng() % (hi - lo + 1));
    for (int64_t j = 0; j < len; ++j)
      xr[j] = static_cast<scalar_t>(kind == 2 ? (rng() % 2 ? -0.0f : 0.0f) : std::ldexp(nd(rng), e));
    const int64_t at = rng() % len;
    if (kind == 0) xr[at] = static_cast<scalar_t>(__uint_as_float(rng() % 2 ? 0x7FC00001u : 0xFFC00000u));
    if (kind == 1) xr[at] = static_cast<scalar_t>(rng() % 2 ? INFINITY : -INFINITY);
  }
}

// max |x| of a row as float (NaN when the row has one), from the values
template <typename scalar_t>
float naive_absmax(const scalar_t* xr, int64_t len) {
  float m = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const float v = static_cast<float>(xr[j]);
    if (std::isnan(v)) return NAN;
    m = std::max(m, std::fabs(v));
  }
  return m;
}

// k = floor(log2(mean / r)) clamped to [0, max_k]: the binary exponent of the (correctly
// rounded) ratio; 0 when the ratio is 0, inf or NaN (a zero row, an all-zero or NaN batch)
int naive_row_k(float mean, float r, int max_k) {
  const float ratio = mean / r;
  if (!std::isfinite(ratio) || ratio == 0.0f) return 0;
  return std::clamp(std::ilogb(ratio), 0, max_k);
}

// Which finish the next row pass takes: the pass's last block (MESA_ROW_FINISH=block) or, every
// other pass, row_finish_grid_kernel as a launch of its own (=grid): both over every fixed
// layout, as each runs over several dtypes and SM counts
bool next_finish_on_grid() {
  static int turn = 0;
  return turn++ % 2 == 1;
}

// With fin.on_grid, the finish after the pass: row_finish_grid_kernel on the op's grid, its
// blocks in a random order
template <typename scalar_t>
void run_grid_finish(uint32_t* r_bits, uint32_t* ws, int64_t rows, int G, float* cells, CellIndex ci,
                     const RowCellsFinish& fin, bool norm, int sms) {
  if (!fin.on_grid) return;
  launch_simt(unsigned(row_finish_grid_blocks(rows, sms)), kThreads,
              [&] { row_finish_grid_kernel<scalar_t>(r_bits, ws, rows, G, cells, ci, fin, norm); });
  g_checked["row_finish_grid"]++;
}

// row_absmax_kernel on row_exponents_cuda's grid (8 warps = 8 rows per block, at most 16
// blocks per SM; warps stride over the remaining rows, blocks in a random order), its last
// block finding k from row_max_mean of the naive maxima (want: those maxima), the ticket zero
template <typename scalar_t, bool VEC>
int check_row_absmax(const scalar_t* x, int64_t rows, int64_t len, int sms, int max_k, std::vector<float>& want) {
  const unsigned blocks = unsigned(warp_rows_grid(rows, sms));
  std::vector<float> r(rows + 1, 7.0f);
  std::vector<int8_t> k(rows + 1, int8_t(-99));
  std::vector<uint32_t> ws(kWsHeader + 3, 0u);
  RowCellsFinish fin = row_finish(k.data(), max_k, rows);
  fin.on_grid = next_finish_on_grid();
  launch_simt(blocks, kThreads, [&] { row_absmax_kernel<scalar_t, VEC>(x, r.data(), rows, len, ws.data(), fin); });
  run_grid_finish<scalar_t>(reinterpret_cast<uint32_t*>(r.data()), ws.data(), rows, 0, nullptr, CellIndex{}, fin, true,
                            sms);
  want.resize(rows);
  for (int64_t i = 0; i < rows; ++i) want[i] = naive_absmax(x + i * len, len);
  const float mean = row_max_mean(want.data(), rows);
  int errs = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int want_k = naive_row_k(mean, want[i], max_k);
    if (k[i] != want_k && errs++ < 5)
      fprintf(stderr, "row_absmax<%zu,%d> k mismatch row=%ld len=%ld got %d exp %d (r %g, mean %g)\n",
              sizeof(scalar_t), int(VEC), (long)i, (long)len, int(k[i]), want_k, want[i], mean);
  }
  if (!same_bits(r[rows], 7.0f) || k[rows] != -99) { fprintf(stderr, "row_absmax wrote past the end\n"); ++errs; }
  errs += ws_clean(ws, "row_absmax");
  g_checked[VEC ? "row_absmax_vec" : "row_absmax"]++;
  g_checked["row_k"]++;
  return errs;
}

// block_row_max_mean (one block, quads of rows interleaved over its threads, the int64 sum
// reduced as a tree; `top`, the largest row maximum, as a row pass leaves it in ws[kWsRowTop])
// against the sequential row_max_mean of mesa_common.h, bit for bit (NaN: any NaN); on a
// 16-byte-aligned r (quads and the last rows % 4 one at a time) and one row further on (rows
// one at a time). The definition itself is checked against the reference in
// tests/test_row_max_mean.py
int check_row_mean(const std::vector<float>& r_in) {
  int errs = 0;
  for (int shift = 0; shift < 2; ++shift) {
    std::vector<float> buf(r_in.size() + 4);
    float* r = buf.data() + shift;  // (vector storage: 16-byte aligned)
    std::copy(r_in.begin(), r_in.end(), r);
    const int64_t rows = int64_t(r_in.size());
    uint32_t top = 0u;
    for (int64_t i = 0; i < rows; ++i) top = std::max(top, __float_as_uint(r[i]) & 0x7FFFFFFFu);
    float got[2] = {7.0f, 7.0f};
    launch_simt(1, kThreads, [&] {
      const float m = block_row_max_mean(reinterpret_cast<const uint32_t*>(r), rows, top, mean_sum_bits(rows),
                                         1.0 / double(rows));
      if (threadIdx.x == 0) got[0] = m;
    });
    const float want = row_max_mean(r, rows);
    const bool ok = std::isnan(want) ? std::isnan(got[0]) : same_bits(got[0], want);
    g_checked["row_mean"]++;
    if (ok && same_bits(got[1], 7.0f)) continue;
    fprintf(stderr, "row_mean mismatch rows=%ld shift=%d got %a exp %a (or wrote past the end)\n", (long)rows, shift,
            got[0], want);
    ++errs;
  }
  return errs;
}

// row_absmax on the vector path (16-byte aligned rows of whole 16-byte chunks, as the op picks
// it) and the scalar path (an offset pointer), then row_k over the row maxima
template <typename scalar_t>
int check_row_exponents(int64_t rows, int64_t len, int sms) {
  const size_t off = 1 + rng() % (16 / sizeof(scalar_t) - 1);
  scalar_t* xa = alloc<scalar_t>(rows * len, 0);
  scalar_t* xu = alloc<scalar_t>(rows * len, off);
  fill_rows(xa, rows, len);
  memcpy(xu, xa, rows * len * sizeof(scalar_t));
  std::vector<float> r;
  int errs = 0;
  const int top = max_row_k<scalar_t>();
  if ((len * int64_t(sizeof(scalar_t))) % 16 == 0)
    errs += check_row_absmax<scalar_t, true>(xa, rows, len, sms, top, r);
  errs += check_row_absmax<scalar_t, false>(xu, rows, len, sms, int(rng() % (top + 1)), r);
  errs += check_row_mean(r);
  if (errs) fprintf(stderr, "FAIL row_exponents rows=%ld len=%ld sms=%d sizeof=%zu\n", (long)rows, (long)len, sms,
                    sizeof(scalar_t));
  free(xa);
  free(xu - off);
  return errs;
}

int row_exponents_checks(int ncases) {
  int errs = 0;
  // rows of whole vector chunks (8/16/24/64 elements), odd lengths, one element, long rows
  // (several 32-lane passes), rows = 300 on one SM (warps stride over rows), and 4103 rows: the
  // finishing block's walks over quads of rows (kFinishQuads / kFinishKQuads a thread a round:
  // several rounds, a partial one last) and the 3 rows after the last quad
  const std::vector<std::pair<int64_t, int64_t>> fixed = {{1, 1},   {3, 8},    {5, 16},  {9, 24}, {17, 31},
                                                           {8, 64},  {33, 100}, {4, 131}, {2, 1100}, {300, 12},
                                                           {4103, 8}};
  for (const auto& [rows, len] : fixed)
    for (int sms : {1, 132}) {
      errs += check_row_exponents<float>(rows, len, sms);
      errs += check_row_exponents<c10::Half>(rows, len, sms);
      errs += check_row_exponents<c10::BFloat16>(rows, len, sms);
    }
  for (int t = 0; t < ncases; ++t) {
    const int64_t rows = 1 + rng() % 70, len = rng() % 3 == 0 ? 8 * (1 + rng() % 40) : 1 + rng() % 300;
    const int sms = rng() % 2 ? 1 : 1 + rng() % 8;
    switch (rng() % 3) {
      case 0: errs += check_row_exponents<float>(rows, len, sms); break;
      case 1: errs += check_row_exponents<c10::Half>(rows, len, sms); break;
      default: errs += check_row_exponents<c10::BFloat16>(rows, len, sms); break;
    }
  }
  printf("row_exponents errors: %d\n", errs);
  return errs;
}

// ------------------------------------------------------------------ observe_rows
// The row pass (row_cells_flat_kernel or row_cells_kernel, as observe_rows_cuda picks and
// launches it) against the naive per-row max |x| and per-segment min / max (segment g =
// [ceil(g D / G), ceil((g + 1) D / G)); NaN when the segment has one; zeros compared by value:
// observe canonicalises their sign). The flat pass's last block then finishes: k as
// naive_row_k against row_max_mean of the naive maxima, each cell of a row with k != 0 times
// 2**k rounded to scalar_t (float32 with norm), the others untouched, and the workspace (the
// ticket and the row maxima) zero again. The warp-a-row pass's last block finishes the same
// way, never fused (observe follows it).
bool same_stat(float got, float want) { return std::isnan(want) ? std::isnan(got) : got == want; }

// a cell c of a row with exponent k as the kernels scale it
template <typename scalar_t>
float scaled_cell(float c, int k, bool norm) {
  if (k == 0) return c;
  const float v = c * std::ldexp(1.0f, k);
  return norm ? v : static_cast<float>(static_cast<scalar_t>(v));
}

// the flat pass as launch_row_cells_flat runs it: the grid of 1 to 4 resident blocks an SM
// (rounds strided over the warps), 32- or 64-bit indices, with its last block's finish `fin`;
// returns the path's name
template <typename scalar_t>
std::string run_row_cells_flat(const scalar_t* x, int64_t rows, int64_t D, int G, int sms, CellIndex ci,
                               const float* pm, const float* ps, uint32_t* ws, std::vector<float>& cells,
                               const RowCellsFinish& fin) {
  const int64_t S = D / G, chunks = S * int64_t(sizeof(scalar_t)) / 16;
  const RowCellsShape shape = row_cells_shape(chunks);
  const unsigned blocks = unsigned(row_cells_flat_blocks(rows * G, shape, sms, 1 + int(rng() % 4)));
  auto run = [&](auto idx) {
    using IdxT = decltype(idx);
    const DivT<IdxT> div_G(static_cast<IdxT>(G));
    launch_simt(blocks, kThreads, [&] {
      const IdxT segs = IdxT(rows * G), s = IdxT(S), g = IdxT(G);
      const int c = int(chunks), w = shape.W;
      float* cl = cells.data();
      if (shape.cpl == 1) row_cells_flat_kernel<scalar_t, 1, IdxT>(x, ws, cl, segs, s, c, w, g, div_G, pm, ps, ci, fin);
      else if (shape.cpl == 2) row_cells_flat_kernel<scalar_t, 2, IdxT>(x, ws, cl, segs, s, c, w, g, div_G, pm, ps, ci, fin);
      else row_cells_flat_kernel<scalar_t, 4, IdxT>(x, ws, cl, segs, s, c, w, g, div_G, pm, ps, ci, fin);
    });
  };
  static int turn = 0;  // (alternating: both index widths whatever the random draws)
  const bool wide = turn++ % 2 == 1;
  if (wide) run(uint64_t(0));
  else run(uint32_t(0));
  run_grid_finish<scalar_t>(ws + kWsHeader, ws, rows, G, cells.data(), ci, fin, pm != nullptr, sms);
  g_checked[wide ? "row_cells_flat_u64" : "row_cells_flat_u32"]++;
  if (chunks > kRowCellsSlots * shape.W) g_checked["row_cells_flat_rounds"]++;
  if (chunks < shape.W) g_checked["row_cells_flat_idle_lanes"]++;
  g_checked[fin.fused ? "row_cells_flat_fused" : "row_cells_flat_unfused"]++;
  return "row_cells_flat_cpl" + std::to_string(shape.cpl);
}

// The fused finish's outputs (observe's, over the scaled cells) against the sequential
// estimate step over the expected cells' group min / max (both slots, as observe reduces them)
struct FusedCase {
  std::vector<float> est_a, est_b, out_a, out_b;
  bool init = false, symmetric = false;
  int64_t seed_out[2] = {-1, -1};
};

int check_fused_finish(const FusedCase& before, const FusedCase& after, const RngCase& rc,
                       const std::vector<float>& want_cells, int64_t rows, int G, CellIndex ci) {
  std::vector<float> mn(G, INFINITY), mx(G, -INFINITY);
  for (int64_t i = 0; i < rows; ++i)
    for (int g = 0; g < G; ++g)
      for (int slot : {0, 1}) {
        const float v = want_cells[ci.at(i, slot * G + g)];
        mn[g] = nan_min(mn[g], v);
        mx[g] = nan_max(mx[g], v);
      }
  for (auto& v : mn) v = canonical(v);
  for (auto& v : mx) v = canonical(v);
  const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
  const SeqEstimate want = seq_estimates(mn, mx, 1, G, before.est_a, before.est_b, before.init, lam, oml, false,
                                         before.symmetric, true);
  const bool ok = vec_same_bits(want.out_a, after.out_a.data(), G) && vec_same_bits(want.out_b, after.out_b.data(), G) &&
                  vec_same_bits(want.est_a, after.est_a.data(), G + 2) &&
                  vec_same_bits(want.est_b, after.est_b.data(), G + 2) && after.init == want.init;
  const bool seed_ok = rc.stepped(after.seed_out);
  g_checked["row_cells_flat_fused_estimates"]++;
  if (ok && seed_ok) return 0;
  fprintf(stderr, "row_cells_flat fused finish mismatch: estimates %s, seed %s\n", ok ? "ok" : "DIFFER",
          seed_ok ? "ok" : "DIFFER");
  return 1;
}

// norm (a LayerNorm's mean and rstd per row, or nullptr): every element taken as
// normalized_value first, the cells then scaled in float32 (x_hat's dtype)
// slot_major: the cells as observe_rows_cuda lays them out for shared statistics, (2, G, rows);
// else per sample's (rows, 2, G)
// The large fixed case of observe_rows (2,085 rows) is there for the fused totals' walk: over
// this many rows its data, cell layout, max_k and finish are chosen for that, not at random
bool large_row_case(int64_t rows) { return rows > 2000; }

template <typename scalar_t, bool VEC>
int check_row_cells(const scalar_t* x, int64_t rows, int64_t D, int G, int sms, bool slot_major,
                    const RowExp* norm = nullptr) {
  std::vector<float> r(rows + 1, 7.0f), cells(rows * 2 * G + 1, 7.0f);
  std::vector<int8_t> k(rows + 1, int8_t(-99));
  // (over 2,000 rows the largest max_k: most rows then scaled, most chunks dirty, so the fused
  // totals' dirty walk runs in every round of the large case; a random max_k is often 0)
  const int max_k = large_row_case(rows) ? max_row_k<scalar_t>() : int(rng() % (max_row_k<scalar_t>() + 1));
  const CellIndex ci = slot_major ? CellIndex{1, rows} : CellIndex{2 * G, 1};
  const float* pm = norm != nullptr ? norm->mean.data() : nullptr;
  const float* ps = norm != nullptr ? norm->rstd.data() : nullptr;
  // (flat) the op's finish: fused with shared statistics (the slot-major cells), else not
  const bool fused = VEC && slot_major && G <= kSlots;
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk, words = rows + (fused ? chunks * (2 * G + 1) : 0);
  std::vector<uint32_t> ws(kWsHeader + words + 1, 0u);
  ws[kWsHeader + words] = 0xABCD1234u;  // (past what the finish uses)
  FusedCase fc;
  std::normal_distribution<float> nd;
  for (int n = 0; n < G + 2; ++n) fc.est_a.push_back(std::fabs(nd(rng))), fc.est_b.push_back(nd(rng));
  fc.out_a.assign(G, 7.0f);
  fc.out_b.assign(G, 7.0f);
  fc.init = rng() % 2;
  fc.symmetric = rng() % 2;
  const FusedCase before = fc;
  RngCase rc(rng);
  std::string path;
  if constexpr (VEC) {
    uint32_t* part_min = ws.data() + kWsHeader + rows;
    const EstimateArgs est{fc.est_a.data(), fc.est_b.data(), &fc.init, 0.9f, static_cast<float>(1.0 - 0.9), false,
                           fc.symmetric, true, fc.out_a.data(), fc.out_b.data()};
    RowCellsFinish fin = row_finish(k.data(), max_k, rows);
    // (over 2,000 rows each finish on one SM count, not by turn: the large case runs once a
    // count, and the two finishes walk the fused totals with different numbers in flight)
    fin.on_grid = large_row_case(rows) ? sms % 2 == 0 : next_finish_on_grid();
    if (fused) {  // (as observe_rows_cuda sets it up)
      fin.fused = true;
      fin.part_min = part_min;
      fin.part_max = part_min + chunks * G;
      fin.dirty = part_min + 2 * chunks * G;
      fin.chunks = chunks;
      fin.est = est;
      fin.sd = SeedArgs{rc.buf, 1, fc.seed_out};
    }
    path = run_row_cells_flat<scalar_t>(x, rows, D, G, sms, ci, pm, ps, ws.data(), cells, fin);
  } else {
    const unsigned blocks = unsigned(warp_rows_grid(rows, sms));
    RowCellsFinish fin = row_finish(k.data(), max_k, rows);
    fin.on_grid = next_finish_on_grid();
    launch_simt(blocks, kThreads, [&] {
      row_cells_kernel<scalar_t>(x, r.data(), cells.data(), rows, D, G, pm, ps, ci, ws.data(), fin);
    });
    run_grid_finish<scalar_t>(reinterpret_cast<uint32_t*>(r.data()), ws.data(), rows, G, cells.data(), ci, fin,
                              pm != nullptr, sms);
    path = "row_cells";
  }
  // the values the kernel sees, their row maxima, and the k its last block must find
  std::vector<float> xs(rows * D), want_r(rows);
  for (int64_t i = 0; i < rows * D; ++i)
    xs[i] = norm != nullptr ? normalized_value(static_cast<float>(x[i]), pm[i / D], ps[i / D])
                            : static_cast<float>(x[i]);
  for (int64_t i = 0; i < rows; ++i) want_r[i] = naive_absmax(xs.data() + i * D, D);
  const float mean = row_max_mean(want_r.data(), rows);
  int errs = 0;
  std::vector<float> want_cells(cells.size());  // (the cells the flat pass must leave)
  for (int64_t i = 0; i < rows; ++i) {
    const int want_k = naive_row_k(mean, want_r[i], max_k);
    if (!VEC && r[i] != 0.0f && errs++ < 5)  // (zeroed by the finish once read)
      fprintf(stderr, "row_cells left its row maximum row=%ld: %g\n", (long)i, r[i]);
    if (k[i] != want_k && errs++ < 5)
      fprintf(stderr, "%s k mismatch row=%ld got %d exp %d (mean %a, r %a)\n", path.c_str(), (long)i, int(k[i]),
              want_k, mean, want_r[i]);
    for (int g = 0; g < G; ++g) {
      float mn = INFINITY, mx = -INFINITY;
      bool nan = false;
      for (int64_t d = (int64_t(g) * D + G - 1) / G; d < (int64_t(g + 1) * D + G - 1) / G; ++d) {
        const float v = xs[i * D + d];
        nan = nan || std::isnan(v);
        mn = std::min(mn, v);
        mx = std::max(mx, v);
      }
      if (nan) mn = mx = NAN;
      mn = scaled_cell<scalar_t>(mn, want_k, norm != nullptr);
      mx = scaled_cell<scalar_t>(mx, want_k, norm != nullptr);
      want_cells[ci.at(i, g)] = mn;
      want_cells[ci.at(i, G + g)] = mx;
      const float gmn = cells[ci.at(i, g)], gmx = cells[ci.at(i, G + g)];
      if ((!same_stat(gmn, mn) || !same_stat(gmx, mx)) && errs++ < 5)
        fprintf(stderr, "%s<%zu> mismatch row=%ld g=%d/%d D=%ld k=%d got [%g, %g] exp [%g, %g]\n", path.c_str(),
                sizeof(scalar_t), (long)i, g, G, (long)D, want_k, gmn, gmx, mn, mx);
    }
  }
  if (!same_bits(r[rows], 7.0f) || !same_bits(cells[rows * 2 * G], 7.0f) || k[rows] != -99 ||
      ws[kWsHeader + words] != 0xABCD1234u) {
    fprintf(stderr, "%s wrote past the end\n", path.c_str());
    ++errs;
  }
  if (std::any_of(ws.begin(), ws.begin() + kWsHeader + words, [](uint32_t w) { return w != 0u; })) {
    fprintf(stderr, "%s left the workspace non-zero (ticket %u)\n", path.c_str(), ws[0]);
    ++errs;
  }
  if (fused) {
    errs += check_fused_finish(before, fc, rc, want_cells, rows, G, ci);
    // which of the finish's two sources its totals came from: a chunk of rows all with k = 0
    // (the pass's partial totals) and one with a row scaled (its cells)
    for (int64_t c = 0; c < chunks; ++c) {
      bool dirty = false;
      for (int64_t i = c * kRowChunk; i < std::min(rows, (c + 1) * kRowChunk); ++i)
        dirty = dirty || naive_row_k(mean, want_r[i], max_k) != 0;
      g_checked[dirty ? "row_cells_flat_fused_dirty_chunk" : "row_cells_flat_fused_clean_chunk"]++;
    }
  }
  if (!fused && (fc.seed_out[0] != -1 || !vec_same_bits(before.est_a, fc.est_a.data(), G + 2))) {
    fprintf(stderr, "%s (not fused) touched the estimates or the seed\n", path.c_str());
    ++errs;
  }
  g_checked[path + (norm != nullptr ? "_norm" : "")]++;
  g_checked[slot_major ? "row_cells_slot_major" : "row_cells_row_major"]++;
  return errs;
}

// the vector path where the op picks it (aligned rows, segments of whole 16-byte chunks),
// the scalar path always (also from an offset pointer)
template <typename scalar_t>
int check_observe_rows(int64_t rows, int64_t D, int G, int sms) {
  const size_t off = 1 + rng() % (16 / sizeof(scalar_t) - 1);
  scalar_t* xa = alloc<scalar_t>(rows * D, 0);
  scalar_t* xu = alloc<scalar_t>(rows * D, off);
  fill_rows(xa, rows, D);
  // (over 2,000 rows: the slot-major cells, the fused finish, every time, and rows of one scale
  // with a small row in about half the chunks: the fused totals' walk over many rounds of
  // partials, clean and dirty mixed, so that a partial read with another's flag is caught)
  const bool big = large_row_case(rows);
  if (big || rng() % 3 == 0) {
    // rows of one scale, one far below (DeiT3's class token): chunks of rows all with k = 0
    // beside one with a scaled row, the fused finish's two sources of group totals. The rows'
    // second halves are 1/64 of their first, the small row's the other way round, so that scaled
    // it holds the extremes of the groups there (the totals differ from its unscaled cells')
    std::normal_distribution<float> nd;
    std::vector<bool> small(rows, false);
    small[rng() % rows] = true;
    for (int64_t c = 0; big && c * kRowChunk < rows; ++c)
      if (rng() % 2) small[std::min(rows - 1, c * kRowChunk + int64_t(rng() % kRowChunk))] = true;
    for (int64_t i = 0; i < rows * D; ++i) {
      const bool second = i % D >= D / 2;
      const float f = small[i / D] ? (second ? 0x1p-10f : 0x1p-16f) : (second ? 0x1p-6f : 1.0f);
      xa[i] = static_cast<scalar_t>(nd(rng) * f);
    }
  }
  memcpy(xu, xa, rows * D * sizeof(scalar_t));
  int errs = 0;
  RowExp norm;  // a LayerNorm's statistics of the rows
  norm.len = D;
  add_row_norm(norm, xa, rows * D);
  // each call one of the two cell layouts (both are checked over the cases)
  if (D % G == 0 && ((D / G) * int64_t(sizeof(scalar_t))) % 16 == 0) {
    errs += check_row_cells<scalar_t, true>(xa, rows, D, G, sms, big || rng() % 2);
    errs += check_row_cells<scalar_t, true>(xa, rows, D, G, sms, big || rng() % 2, &norm);
  }
  errs += check_row_cells<scalar_t, false>(xu, rows, D, G, sms, rng() % 2);
  errs += check_row_cells<scalar_t, false>(xu, rows, D, G, sms, rng() % 2, &norm);
  if (errs) fprintf(stderr, "FAIL observe_rows rows=%ld D=%ld G=%d sms=%d sizeof=%zu\n", (long)rows, (long)D, G, sms,
                    sizeof(scalar_t));
  free(xa);
  free(xu - off);
  return errs;
}

int observe_rows_checks(int ncases) {
  int errs = 0;
  // DeiT's channel groups (384 / 6, 1536 / 6), one group, a group per element, segments of
  // unequal length (131 / 4, 24 / 5), segments longer than a warp's pass (1100 / 2), rows = 300
  // on one SM (warps stride over rows), more groups than the kernel's table of bounds holds
  // (600 / 300: computed in each pass); for the flat pass, segments of 6 / 3 chunks (144 / 6:
  // idle lanes) and of 60 / 30 (1200 / 5: further rounds, a partial one), 40 DeiT rows, 100 rows of
  // 16 floats a segment (the fused finish: several chunks of 32 rows), 1301 rows (the finish's
  // walks over several rounds of quads of rows, then a last row on its own), 2085 rows of 16
  // groups (the fused totals' walk: 66 chunks * 16 = 1,056 partials, over 4 a thread in flight
  // at 256 threads, so a second round; a last chunk of 5 rows, not a whole number of the dirty
  // walk's rounds of 4; 8 elements a segment: the flat pass, fused, in every dtype)
  const std::vector<std::tuple<int64_t, int64_t, int>> fixed = {
      {5, 384, 6}, {3, 1536, 6}, {4, 16, 1}, {3, 8, 8}, {6, 131, 4}, {7, 24, 5}, {2, 1100, 2}, {300, 64, 4},
      {4, 384, 12}, {3, 96, 3}, {2, 768, 2}, {2, 600, 300}, {3, 144, 6}, {2, 1200, 5}, {40, 384, 6}, {100, 64, 4},
      {1301, 16, 2}, {2085, 128, 16}};
  // (flat-pass sub-warps of 1, 2, 4 and 8 lanes and 1, 2 and 4 chunks a lane across the dtypes)
  // (each layout with one dtype per SM count, rotating: the warp emulation is slow)
  int turn = 0;
  for (const auto& [rows, D, G] : fixed)
    for (int sms : {1, 132}) {
      switch (turn++ % 3) {
        case 0: errs += check_observe_rows<float>(rows, D, G, sms); break;
        case 1: errs += check_observe_rows<c10::Half>(rows, D, G, sms); break;
        default: errs += check_observe_rows<c10::BFloat16>(rows, D, G, sms); break;
      }
    }
  for (int t = 0; t < (ncases + 1) / 2; ++t) {
    const int64_t rows = 1 + rng() % 40, D = rng() % 3 == 0 ? 16 * (1 + rng() % 24) : 1 + rng() % 300;
    const int G = rng() % 2 ? int(1 + rng() % std::min<int64_t>(D, 12)) : int(std::max<int64_t>(1, D / 16));
    const int sms = rng() % 2 ? 1 : 1 + rng() % 8;
    switch (rng() % 3) {
      case 0: errs += check_observe_rows<float>(rows, D, G, sms); break;
      case 1: errs += check_observe_rows<c10::Half>(rows, D, G, sms); break;
      default: errs += check_observe_rows<c10::BFloat16>(rows, D, G, sms); break;
    }
  }
  printf("observe_rows errors: %d\n", errs);
  return errs;
}

// ------------------------------------------------------------------ softmax_backward
// The definition (DESIGN.md, "Fused softmax backward"), sequentially: per row, y in the
// dtype, s = max(lane_sum(y), FLT_MIN), p = y / s, d = lane_sum(g * p), gx = p * (g - d);
// lane_sum: 32 accumulators from +0.0, lane l adding elements l, l + 32, ..., then
// acc[l] + acc[l ^ off] for off = 16, 8, 4, 2, 1, lane 0's value.
float naive_lane_sum(const std::vector<float>& v) {
  float acc[32];
  for (float& a : acc) a = 0.0f;
  for (size_t j = 0; j < v.size(); ++j) acc[j % 32] = acc[j % 32] + v[j];
  for (int off = 16; off > 0; off /= 2) {
    float nxt[32];
    for (int l = 0; l < 32; ++l) nxt[l] = acc[l] + acc[l ^ off];
    memcpy(acc, nxt, sizeof(acc));
  }
  return acc[0];
}

// map_t: the dtype y is rounded through (scalar_t, or float: a float32 map with a half g);
// out_t: the result's (scalar_t, or float with such a map)
template <typename scalar_t, typename map_t, typename out_t>
void naive_softmax_backward(const Layout& L, int64_t n, const scalar_t* g, const uint8_t* q, const float* alpha,
                            const float* beta, std::vector<out_t>& want) {
  want.resize(L.numel);
  for (int64_t i0 = 0; i0 < L.numel; i0 += n) {
    const int64_t p = param_index(L, i0);
    std::vector<float> y(n), gp(n);
    for (int64_t j = 0; j < n; ++j)
      y[j] = static_cast<float>(static_cast<map_t>(q[i0 + j] * (alpha[p] / 255.0f) + beta[p]));
    float s = naive_lane_sum(y);
    if (s < 0x1p-126f) s = 0x1p-126f;
    for (int64_t j = 0; j < n; ++j) y[j] = y[j] / s;
    for (int64_t j = 0; j < n; ++j) gp[j] = static_cast<float>(g[i0 + j]) * y[j];
    const float d = naive_lane_sum(gp);
    for (int64_t j = 0; j < n; ++j) want[i0 + j] = static_cast<out_t>(y[j] * (static_cast<float>(g[i0 + j]) - d));
  }
}

// softmax_backward_kernel on softmax_backward_cuda's grid, 32- or 64-bit indices, against the
// naive definition; rows whose codes are all 0 with beta 0 (the FLT_MIN clamp), and g with
// NaN / inf / -0 in some cases
template <typename scalar_t, typename map_t, typename out_t, typename IdxT>
int check_softmax_backward(const std::vector<int64_t>& shape, int64_t dim, int64_t G, bool per_sample, int sms,
                           bool specials) {
  const int64_t S = per_sample ? shape[0] : 1;
  const Layout L = make_layout_h(shape, dim, G, S);
  const int64_t n = shape.back(), rows = L.numel / n;
  std::vector<float> alpha(S * G), beta(S * G);
  std::uniform_real_distribution<float> ua(0.0f, 0.02f), ub(0.0f, 1e-3f);
  for (int64_t p = 0; p < S * G; ++p) {
    alpha[p] = ua(rng);
    beta[p] = rng() % 3 == 0 ? 0.0f : ub(rng);
  }
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  for (int64_t i = 0; i < L.numel; ++i) q[i] = uint8_t(rng() % 256);
  for (int64_t r = 0; r < rows; ++r)
    if (rng() % 4 == 0) memset(q + r * n, 0, n);  // y = beta: 0 where beta is 0
  scalar_t* g = alloc<scalar_t>(L.numel, 0);
  fill(g, L.numel, specials);
  out_t* out = alloc<out_t>(L.numel + 1, 0);
  out[L.numel] = static_cast<out_t>(7.0f);
  launch_simt(unsigned(warp_rows_grid(rows, sms)), kThreads, [&] {
    softmax_backward_kernel<scalar_t, map_t, out_t, IdxT>(g, q, alpha.data(), beta.data(), out, make_klayout<IdxT>(L),
                                                   IdxT(rows), IdxT(n));
  });
  std::vector<out_t> want;
  naive_softmax_backward<scalar_t, map_t, out_t>(L, n, g, q, alpha.data(), beta.data(), want);
  int errs = 0;
  for (int64_t i = 0; i < L.numel; ++i)
    if (!same_value(out[i], want[i]) && errs++ < 5)
      fprintf(stderr, "softmax_backward<%zu,%zu,%zu,%zu> mismatch i=%ld n=%ld got %g exp %g\n", sizeof(scalar_t),
              sizeof(map_t), sizeof(out_t), sizeof(IdxT), (long)i, (long)n, static_cast<float>(out[i]),
              static_cast<float>(want[i]));
  if (static_cast<float>(out[L.numel]) != 7.0f) { fprintf(stderr, "softmax_backward wrote past the end\n"); ++errs; }
  if (errs) fprintf(stderr, "FAIL softmax_backward rows=%ld n=%ld dim=%ld G=%ld ps=%d sms=%d\n", (long)rows, (long)n,
                    (long)dim, (long)G, int(per_sample), sms);
  g_checked[sizeof(IdxT) == 4 ? "softmax_backward" : "softmax_backward_64"]++;
  if (sizeof(map_t) != sizeof(scalar_t)) g_checked["softmax_backward_map32"]++;
  if (sizeof(out_t) != sizeof(scalar_t)) g_checked["softmax_backward_out32"]++;
  free(q);
  free(g);
  free(out);
  return errs;
}

template <typename scalar_t>
int check_softmax_backward_all(const std::vector<int64_t>& shape, int64_t dim, int64_t G, bool ps, int sms,
                               bool specials) {
  int errs = check_softmax_backward<scalar_t, scalar_t, scalar_t, uint32_t>(shape, dim, G, ps, sms, specials) +
             check_softmax_backward<scalar_t, scalar_t, scalar_t, uint64_t>(shape, dim, G, ps, sms, specials);
  if constexpr (!std::is_same_v<scalar_t, float>) {  // a float32 map with a half g (autocast)
    errs += check_softmax_backward<scalar_t, float, scalar_t, uint32_t>(shape, dim, G, ps, sms, specials) +
            check_softmax_backward<scalar_t, float, scalar_t, uint64_t>(shape, dim, G, ps, sms, specials);
    // ... and a float32 result (float32 logits)
    errs += check_softmax_backward<scalar_t, float, float, uint32_t>(shape, dim, G, ps, sms, specials) +
            check_softmax_backward<scalar_t, float, float, uint64_t>(shape, dim, G, ps, sms, specials);
  }
  return errs;
}

int softmax_backward_checks(int ncases) {
  int errs = 0;
  // attention maps (B, H, N, L) with L in {1, 31, 32, 33, 197} (partial, exact and several
  // lane passes), more rows than one SM's warps (warps loop), group dims 0, 1 and 2; rows held
  // in registers up to 32 * kSoftmaxPerLane = 256 elements, the loop form past it (257, 300)
  struct C { std::vector<int64_t> s; int64_t dim, G; };
  const std::vector<C> fixed = {{{2, 3, 4, 1}, 1, 3},   {{2, 3, 5, 31}, 1, 3}, {{3, 2, 7, 32}, 1, 2},
                                {{2, 4, 3, 33}, 1, 2},  {{2, 2, 5, 197}, 1, 2}, {{2, 6, 40, 33}, 1, 6},
                                {{3, 5, 64}, 1, 5},     {{4, 9, 31}, 0, 2},    {{2, 3, 4, 5, 33}, 2, 2},
                                {{2, 2, 3, 256}, 1, 2}, {{2, 2, 3, 257}, 1, 2}, {{2, 3, 300}, 0, 2}};
  int t = 0;
  for (const auto& c : fixed)
    for (int sms : {1, 132}) {
      const bool ps = (t + sms) % 2, sp = t % 3 == 0;
      switch (t++ % 3) {
        case 0: errs += check_softmax_backward_all<float>(c.s, c.dim, c.G, ps, sms, sp); break;
        case 1: errs += check_softmax_backward_all<c10::Half>(c.s, c.dim, c.G, ps, sms, sp); break;
        default: errs += check_softmax_backward_all<c10::BFloat16>(c.s, c.dim, c.G, ps, sms, sp); break;
      }
    }
  for (int k = 0; k < ncases; ++k) {
    const int nd = 2 + rng() % 3;
    std::vector<int64_t> shape(nd);
    for (auto& v : shape) v = 1 + rng() % 9;
    shape.back() = 1 + rng() % 300;  // both forms: in registers up to 256, the loop past it
    const int64_t dim = rng() % (nd - 1), G = 1 + rng() % shape[dim];
    const bool ps = rng() % 2, sp = rng() % 2;
    const int sms = 1 + rng() % 3;
    switch (rng() % 3) {
      case 0: errs += check_softmax_backward_all<float>(shape, dim, G, ps, sms, sp); break;
      case 1: errs += check_softmax_backward_all<c10::Half>(shape, dim, G, ps, sms, sp); break;
      default: errs += check_softmax_backward_all<c10::BFloat16>(shape, dim, G, ps, sms, sp); break;
    }
  }
  printf("softmax_backward errors: %d\n", errs);
  return errs;
}

// ------------------------------------------------------------------ main
int index_checks() {
  int errs = fastdiv_check();
  printf("fastdiv errors: %d\n", errs);
  int pe = one_param_check();
  pe += param_check<uint32_t>({2147483647}, 0, 1, 1);
  pe += param_check<uint32_t>({2147483647 / 16}, 0, 15, 1);
  pe += param_check<uint32_t>({16, 8388607, 16}, 1, 5, 16);
  pe += param_check<uint32_t>({3, 7, 102261125}, 2, 3, 3);
  pe += param_check<uint32_t>({65535, 32767}, 1, 4, 65535);
  pe += param_check<uint32_t>({1000, 2147483}, 0, 9, 1000);
  pe += param_check<uint64_t>({4194308, 1024}, 1, 6, 1);
  pe += param_check<uint64_t>({64, 197, 6, 65537}, 2, 3, 64);
  pe += param_check<uint64_t>({3, 5000000007}, 1, 11, 3);
  printf("param index errors: %d\n", pe);
  return errs + pe;
}

// fixed layouts of tests/test_kernels.py and tests/test_observe.py + targeted ones
// Every layout with each (per-sample, SM count, dtype) combination, or (quick) with one of
// them, cycling through the 18 combinations along the list.
int fixed_layout_checks(bool quick) {
  struct C { std::vector<int64_t> s; int64_t dim, G; };
  const std::vector<C> fixed = {
      {{2, 9, 24}, 2, 3},     {{2, 3, 7, 7}, 1, 3},    {{2, 4, 5, 6}, 1, 2},   {{3, 10, 4, 5}, 1, 4},
      {{2, 7, 13}, 2, 5},     {{5, 6}, 0, 3},          {{11}, 0, 4},           {{3, 5, 7, 11}, 2, 7},
      {{3, 5, 7, 11}, 2, 1},  {{1, 1, 1}, 2, 1},       {{4, 6, 97, 97}, 1, 6}, {{8, 197, 384}, 2, 6},
      {{8, 197, 192}, 2, 3},  {{2, 3, 600, 50}, 1, 2}, {{2, 5, 300}, 1, 5},    {{3, 2, 5000}, 1, 2},
      {{7000, 3}, 1, 3},      {{40, 25}, 1, 5},        {{64, 64}, 1, 4},       {{7, 3000}, 0, 7},
      {{2, 2, 1030}, 2, 3},   {{1, 4097}, 1, 7},       {{40, 3, 3}, 0, 7},     {{16, 197, 96}, 2, 6},
      {{3, 1500}, 1, 1500},   {{2000, 2}, 0, 2},       {{0, 8}, 1, 2},         {{3, 0, 4}, 1, 2},
      // a conv's last stages, per-channel: runs of 49 and 196 elements, so steps of 16 meet two
      // (second_run_at), the first with more channels than observe's shared slots
      {{2, 1100, 7, 7}, 1, 1100}, {{2, 24, 14, 14}, 1, 24},
  };
  constexpr int kSms[3] = {132, 3, 1};
  int fe = 0;
  for (size_t j = 0; j < fixed.size(); ++j)
    for (int combo = 0; combo < 18; ++combo) {
      if (quick && combo != int(j * 7 % 18)) continue;
      const C& c = fixed[j];
      const bool ps = combo % 2;
      const int sms = kSms[combo / 2 % 3], dtype = combo / 6;
      // (the SIMT emulation of 132-SM grids is slow: the full run does them in float32 only)
      const bool coop = quick || sms != 132 || dtype == 0;
      if (dtype == 0) fe += run_case<float>(c.s, c.dim, c.G, ps, sms, true, coop);
      else if (dtype == 1) fe += run_case<c10::Half>(c.s, c.dim, c.G, ps, sms, true, coop);
      else fe += run_case<c10::BFloat16>(c.s, c.dim, c.G, ps, sms, true, coop);
    }
  printf("fixed-layout errors: %d (%s)\n", fe, quick ? "one combination per layout" : "all combinations");
  return fe;
}

int random_layout_checks(int ncases) {
  int re = 0;
  for (int t = 0; t < ncases; ++t) {
    const int nd = 1 + rng() % 4;
    std::vector<int64_t> shape(nd);
    int64_t numel = 1;
    for (auto& v : shape) {
      v = 1 + rng() % (rng() % 3 == 0 ? 300 : 9);
      numel *= v;
    }
    if (numel > 200000) { --t; continue; }
    const int64_t dim = rng() % nd;
    const int64_t G = 1 + rng() % shape[dim];
    const bool ps = rng() % 2;
    const int sms = (rng() % 2) ? 1 + rng() % 4 : 132;
    switch (rng() % 3) {
      case 0: re += run_case<float>(shape, dim, G, ps, sms, rng() % 2, true); break;
      case 1: re += run_case<c10::Half>(shape, dim, G, ps, sms, rng() % 2, true); break;
      default: re += run_case<c10::BFloat16>(shape, dim, G, ps, sms, rng() % 2, true); break;
    }
  }
  printf("random-layout errors: %d (%d cases)\n", re, ncases);
  return re;
}

// ------------------------------------------------------------------ layer_norm_backward
// The definition (DESIGN.md, "LayerNorm backward from the codes"), sequentially: per row,
// x_hat = q * (alpha / 255) + beta (times 2**-k), gw = g * w, m1 = lane_sum(gw) / D,
// m2 = lane_sum(gw * x_hat) / D, dx = rstd * ((gw - m1) - x_hat * m2); per block of 64 rows
// the column sums of g * x_hat and g, each chunk of 8 rows from +0.0 in row order, the
// chunks from +0.0 in order. The kernel's partials are compared (the glue's at::sum is ATen's).
template <typename scalar_t>
void naive_layer_norm_backward(int64_t rows, int64_t D, int64_t G, int64_t S, const scalar_t* g, const uint8_t* q,
                               const float* alpha, const float* beta, const float* w, const float* rstd,
                               const int8_t* k, std::vector<float>& dx, std::vector<float>& pw,
                               std::vector<float>& pb) {
  const int64_t blocks = (rows + 63) / 64;
  dx.assign(rows * D, 0.0f);
  pw.assign(blocks * D, 0.0f);
  pb.assign(blocks * D, 0.0f);
  std::vector<float> cw(D), cb(D);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t ch = 0; ch < 8; ++ch) {
      std::fill(cw.begin(), cw.end(), 0.0f);
      std::fill(cb.begin(), cb.end(), 0.0f);
      for (int64_t r = b * 64 + ch * 8; r < std::min(rows, b * 64 + ch * 8 + 8); ++r) {
        const int64_t s = S > 1 ? r / (rows / S) : 0;
        std::vector<float> xh(D), gv(D), gw(D), gx(D);
        for (int64_t c = 0; c < D; ++c) {
          const int64_t p = s * G + (c * G) / D;
          xh[c] = q[r * D + c] * (alpha[p] / 255.0f) + beta[p];
          if (k != nullptr) xh[c] = xh[c] * std::ldexp(1.0f, -int(k[r]));
          gv[c] = static_cast<float>(g[r * D + c]);
          gw[c] = w != nullptr ? gv[c] * w[c] : gv[c];
          gx[c] = gw[c] * xh[c];
          cw[c] = cw[c] + gv[c] * xh[c];
          cb[c] = cb[c] + gv[c];
        }
        const float m1 = naive_lane_sum(gw) / float(D), m2 = naive_lane_sum(gx) / float(D);
        for (int64_t c = 0; c < D; ++c) dx[r * D + c] = rstd[r] * ((gw[c] - m1) - xh[c] * m2);
      }
      for (int64_t c = 0; c < D; ++c) {
        pw[b * D + c] = pw[b * D + c] + cw[c];
        pb[b * D + c] = pb[b * D + c] + cb[c];
      }
    }
  }
}

// layer_norm_backward_kernel on layer_norm_backward_cuda's grid (one block per 64 rows) for
// every columns-per-lane instantiation, against the naive definition: shared and per-sample
// statistics (tables in shared memory, and per element when S * G > kLnTable), with and
// without weight and row exponents, g with NaN / inf / -0 in some cases
template <typename scalar_t>
int check_layer_norm_backward(int64_t rows, int64_t D, int64_t G, int64_t S, bool has_w, bool has_k, bool specials) {
  std::vector<float> alpha(S * G), beta(S * G), w(D), rstd(rows);
  std::uniform_real_distribution<float> ua(0.0f, 6.0f), ub(-3.0f, 0.0f), ur(0.1f, 4.0f);
  for (int64_t p = 0; p < S * G; ++p) {
    alpha[p] = ua(rng);
    beta[p] = ub(rng);
  }
  for (auto& v : w) v = ub(rng) + 1.5f;
  for (auto& v : rstd) v = ur(rng);
  std::vector<int8_t> k(rows);
  for (auto& v : k) v = int8_t(rng() % 4 == 0 ? rng() % 40 : 0);
  uint8_t* q = alloc<uint8_t>(rows * D, 0);
  for (int64_t i = 0; i < rows * D; ++i) q[i] = uint8_t(rng() % 256);
  scalar_t* g = alloc<scalar_t>(rows * D, 0);
  fill(g, rows * D, specials);
  const int64_t blocks = (rows + kLnBlockRows - 1) / kLnBlockRows;
  std::vector<float> dx(rows * D + 1, 7.0f), pw(blocks * D + 1, 7.0f), pb(blocks * D + 1, 7.0f);
  const float* wp = has_w ? w.data() : nullptr;
  const int8_t* kp = has_k ? k.data() : nullptr;
  const int per = layer_norm_backward_per_lane(D);
  auto go = [&](auto per_tag) {
    constexpr int PER = decltype(per_tag)::value;
    launch_simt(unsigned(blocks), kThreads, [&] {
      layer_norm_backward_kernel<scalar_t, PER>(g, q, alpha.data(), beta.data(), wp, rstd.data(), kp, dx.data(),
                                                pw.data(), pb.data(), rows, int(D), int(G), int(S), rows / S);
    });
  };
  with_layer_norm_per_lane(D, go);
  std::vector<float> wdx, wpw, wpb;
  naive_layer_norm_backward(rows, D, G, S, g, q, alpha.data(), beta.data(), wp, rstd.data(), kp, wdx, wpw, wpb);
  int errs = 0;
  auto cmp = [&](const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    for (size_t i = 0; i < want.size(); ++i)
      if (!same_value(got[i], want[i]) && errs++ < 5)
        fprintf(stderr, "layer_norm_backward<%zu> %s mismatch i=%zu got %g exp %g\n", sizeof(scalar_t), what, i,
                got[i], want[i]);
    if (got[want.size()] != 7.0f) { fprintf(stderr, "layer_norm_backward %s wrote past the end\n", what); ++errs; }
  };
  cmp("dx", dx, wdx);
  cmp("dweight partials", pw, wpw);
  cmp("dbias partials", pb, wpb);
  if (errs) fprintf(stderr, "FAIL layer_norm_backward rows=%ld D=%ld G=%ld S=%ld w=%d k=%d per=%d\n", (long)rows,
                    (long)D, (long)G, (long)S, int(has_w), int(has_k), per);
  g_checked["layer_norm_backward"]++;
  free(q);
  free(g);
  return errs;
}

int layer_norm_backward_checks(int ncases) {
  int errs = 0;
  // rows: fewer than a chunk, a partial block, several blocks; D: every columns-per-lane
  // instantiation (1 .. 1024), partial lane passes; per-sample with S * G above kLnTable
  struct C { int64_t rows, D, G, S; };
  const std::vector<C> fixed = {{3, 1, 1, 1},    {5, 31, 3, 1},    {33, 32, 2, 1},    {70, 48, 6, 2},
                                {40, 100, 4, 4}, {64, 197, 3, 2},  {37, 384, 6, 1},   {9, 500, 5, 3},
                                {12, 768, 12, 2}, {6, 1024, 8, 1}, {66, 33, 33, 33}, {150, 64, 4, 5}};
  int t = 0;
  for (const auto& c : fixed) {
    const bool hw = t % 2 == 0, hk = t % 3 != 1, sp = t % 4 == 0;
    switch (t % 3) {
      case 0: errs += check_layer_norm_backward<float>(c.rows, c.D, c.G, c.S, hw, hk, sp); break;
      case 1: errs += check_layer_norm_backward<c10::Half>(c.rows, c.D, c.G, c.S, hw, hk, sp); break;
      default: errs += check_layer_norm_backward<c10::BFloat16>(c.rows, c.D, c.G, c.S, hw, hk, sp); break;
    }
    ++t;
  }
  for (int i = 0; i < std::max(1, ncases / 10); ++i) {
    const int64_t D = 1 + int64_t(rng() % 1024), G = 1 + int64_t(rng() % std::min<int64_t>(D, 8));
    const int64_t S = 1 + int64_t(rng() % 3), rows = S * (1 + int64_t(rng() % 40));
    switch (rng() % 3) {
      case 0: errs += check_layer_norm_backward<float>(rows, D, G, S, rng() % 2, rng() % 2, rng() % 2); break;
      case 1: errs += check_layer_norm_backward<c10::Half>(rows, D, G, S, rng() % 2, rng() % 2, rng() % 2); break;
      default: errs += check_layer_norm_backward<c10::BFloat16>(rows, D, G, S, rng() % 2, rng() % 2, rng() % 2); break;
    }
  }
  printf("layer_norm_backward errors: %d\n", errs);
  return errs;
}

// One line naming every kernel family with its number of checked cases (tests assert on it)
void print_summary() {
  printf("cooperative launches skipped (too many blocks to emulate): %d; atomics: %ld\n", g_skipped, g_atomics.load());
  printf("CHECKED");
  for (const auto& [name, n] : g_checked) printf(" %s=%ld", name.c_str(), n);
  printf("\n");
}

// a stage's errors, and its time on stderr (where the emulation's time goes)
template <typename F>
int timed(const char* stage, F f) {
  const auto t0 = std::chrono::steady_clock::now();
  const int errs = f();
  fprintf(stderr, "[%s: %.1f s]\n", stage,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return errs;
}

// harness [random cases, default 150] [quick]: quick runs each fixed layout once (one
// dtype / SM count / statistics combination each) and fewer update_estimates shapes
int main(int argc, char** argv) {
  const int ncases = argc > 1 ? atoi(argv[1]) : 150;
  const bool quick = argc > 2 && std::string(argv[2]) == "quick";
  int errs = timed("index math", index_checks);
  errs += timed("update_estimates", [&] { return estimates_check(quick); });
  errs += timed("row_exponents", [&] { return row_exponents_checks(ncases); });
  errs += timed("observe_rows", [&] { return observe_rows_checks(ncases); });
  errs += timed("softmax_backward", [&] { return softmax_backward_checks(ncases); });
  errs += timed("layer_norm_backward", [&] { return layer_norm_backward_checks(ncases); });
  errs += timed("fixed layouts", [&] { return fixed_layout_checks(quick); });
  errs += timed("random layouts", [&] { return random_layout_checks(ncases); });
  print_summary();
  printf(errs ? "FAILED\n" : "ALL OK\n");
  return errs ? 1 : 0;
}
