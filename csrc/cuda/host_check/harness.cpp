// Run with csrc/cuda/host_check/run.sh (see there).
// Host emulation of the CUDA kernels of csrc/cuda/quant_cuda.cu (device code extracted
// verbatim into extracted.inc by extract.py):
// * quantize / dequantize: sequential over (block, thread), every byte against the naive
//   DESIGN.md index math and the scalar math of mesa_common.h;
// * observe / group_minmax (the single-launch last-block kernel): the blocks of a launch
//   in a random order, each block's threads as std::threads with a barrier for
//   __syncthreads(_and); shared and global atomics under a mutex; against a sequential pass
//   (naive per-group min/max, canonical bits, then the sequential estimate step of
//   update_estimates_cpu), bit for bit; the workspace must be all zero after every launch
//   (the last block resets it) and is reused by the next launch;
// * update_estimates: one block, against the same sequential step;
// * quantize_bits / dequantize_bits (bits 8/4/2, linear and pow2 steps): sequential over
//   (block, thread), every packed byte against the naive packing of the scalar math.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "mesa_common.h"

// ------------------------------------------------------------------ CUDA shims
struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx;
Dim3 blockIdx, blockDim{256, 1, 1}, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline unsigned __ldcg(const unsigned* p) { return *p; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return uint32_t((uint64_t(a) * b) >> 32); }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

static std::unique_ptr<std::barrier<>> g_bbar;
static std::mutex g_atomic_mu;
static std::atomic<long> g_atomics{0};
inline void __syncthreads() { g_bbar->arrive_and_wait(); }
// __syncthreads_and: barrier, vote, barrier, read, barrier, reset (the next vote starts with
// a barrier, so the reset is seen by every thread before anyone votes again).
static std::atomic<int> g_vote{1};
inline int __syncthreads_and(int pred) {
  g_bbar->arrive_and_wait();
  if (!pred) g_vote.store(0);
  g_bbar->arrive_and_wait();
  const int r = g_vote.load();
  g_bbar->arrive_and_wait();
  if (threadIdx.x == 0) g_vote.store(1);
  return r;
}
inline unsigned atomicMax(uint32_t* p, uint32_t v) {  // shared and global memory alike
  std::lock_guard<std::mutex> g(g_atomic_mu);
  g_atomics++;
  const unsigned o = *p;
  if (v > o) *p = v;
  return o;
}
inline unsigned atomicAdd(uint32_t* p, uint32_t v) {
  std::lock_guard<std::mutex> g(g_atomic_mu);
  const unsigned o = *p;
  *p = o + v;
  return o;
}

namespace mesa {
namespace {
#include "extracted.inc"
}  // namespace
}  // namespace mesa

using namespace mesa;

// ------------------------------------------------------------------ launch emulation
static std::mt19937_64 rng(12345);
static long g_bits_checks = 0;

// one thread per CUDA thread of the block
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
// blocks in a random order (any block may be the last to finish), threads concurrent
template <typename F>
void launch_simt(unsigned grid, unsigned threads, F f) {
  gridDim = {grid, 1, 1};
  blockDim = {threads, 1, 1};
  g_bbar.reset(new std::barrier<>(threads));
  std::vector<unsigned> order(grid);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  for (unsigned bx : order) {
    blockIdx = {bx, 0, 0};
    std::vector<std::thread> ths;
    for (unsigned t = 0; t < threads; ++t)
      ths.emplace_back([t, &f] {
        threadIdx = {t, 0, 0};
        f();
      });
    for (auto& th : ths) th.join();
  }
}

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

bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }
bool same_bits(float a, float b) { return __float_as_uint(a) == __float_as_uint(b); }

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

// ------------------------------------------------------------------ quantize / dequantize
template <typename scalar_t, typename IdxT, int V>
int check_quant(const Layout& L, const scalar_t* x, const float* alpha, const float* beta, int sms, uint64_t seed) {
  int errs = 0;
  const int64_t seedv[4] = {int64_t(seed & 0xFFFFFFFFu), -1, int64_t(seed >> 32), -1};  // stride 2
  const uint32_t slo = uint32_t(seed), shi = uint32_t(seed >> 32);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  const unsigned grid = grid_for(L.numel / V + 1, sms);
  for (int st = 0; st < 2; ++st) {
    uint8_t* q = alloc<uint8_t>(L.numel, 0);
    memset(q, 0xAB, L.numel + 1);
    if (st)
      launch_seq(grid, kThreads, [&] {
        quantize_kernel<scalar_t, IdxT, V, true>(x, q, alpha, beta, k, IdxT(L.numel), seedv, 2);
      });
    else
      launch_seq(grid, kThreads, [&] {
        quantize_kernel<scalar_t, IdxT, V, false>(x, q, alpha, beta, k, IdxT(L.numel), seedv, 2);
      });
    for (int64_t i = 0; i < L.numel; ++i) {
      const int64_t p = param_index(L, i);
      const float u = st ? hash_uniform(uint64_t(i), slo, shi) : 0.0f;
      const uint8_t e = st ? quantize_value<true>(float(x[i]), beta[p], inv_scale(alpha[p]), u)
                           : quantize_value<false>(float(x[i]), beta[p], inv_scale(alpha[p]), u);
      if (q[i] != e && errs++ < 5) fprintf(stderr, "quantize mismatch i=%ld got %d exp %d\n", (long)i, q[i], e);
    }
    if (q[L.numel] != 0xAB) { fprintf(stderr, "quantize wrote past the end\n"); ++errs; }
    free(q);
  }
  uint8_t* q = alloc<uint8_t>(L.numel, 0);
  for (int64_t i = 0; i < L.numel; ++i) q[i] = uint8_t(rng());
  scalar_t* y = alloc<scalar_t>(L.numel + 1, 0);
  y[L.numel] = scalar_t(1024.0f);
  launch_seq(grid, kThreads, [&] { dequantize_kernel<scalar_t, IdxT, V>(q, y, alpha, beta, k, IdxT(L.numel)); });
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    const scalar_t e = static_cast<scalar_t>(dequantize_value(q[i], dequant_step(alpha[p]), beta[p]));
    if (!same(float(y[i]), float(e)) && errs++ < 5)
      fprintf(stderr, "dequantize mismatch i=%ld got %g exp %g\n", (long)i, float(y[i]), float(e));
  }
  if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize wrote past the end\n"); ++errs; }
  free(q);
  free(y);
  return errs;
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
    if (!same(float(y[i]), float(e)) && errs++ < 5)
      fprintf(stderr, "dequantize_bits<%d,%d> mismatch i=%ld got %g exp %g\n", BITS, int(pow2), (long)i, float(y[i]),
              float(e));
  }
  if (float(y[L.numel]) != 1024.0f) { fprintf(stderr, "dequantize_bits wrote past the end\n"); ++errs; }
  free(q);
  free(y);
  g_bits_checks++;
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

// naive per-(s, g) min / max, canonical (what group_minmax returns)
template <typename scalar_t>
void seq_minmax(const Layout& L, const scalar_t* x, std::vector<float>& mn, std::vector<float>& mx) {
  mn.assign(L.S * L.G, INFINITY);
  mx.assign(L.S * L.G, -INFINITY);
  for (int64_t i = 0; i < L.numel; ++i) {
    const int64_t p = param_index(L, i);
    mn[p] = nan_min(mn[p], float(x[i]));
    mx[p] = nan_max(mx[p], float(x[i]));
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

static int g_ran = 0, g_skipped = 0;

// observe_kernel in both modes, two launches sharing one workspace (the second reuses what
// the first's last block reset), against the sequential pass.
template <typename scalar_t, typename IdxT, int V>
int check_observe(const Layout& L, const scalar_t* x, int sms, bool symmetric, bool per_sample) {
  const ObserveConfig c = observe_config(L, V, sms);
  if (c.blocks > 48 || c.blocks * c.threads * 1.0 * std::max<int64_t>(1, L.numel / 100000) > 48 * 256) {
    g_skipped++;  // SIMT emulation too slow
    return 0;
  }
  g_ran++;
  const int64_t S = L.S, G = L.G, P = S * G;
  std::vector<uint32_t> ws(kWsHeader + 2 * std::max<int64_t>(P, 1), 0u);
  const KLayout<IdxT> k = make_klayout<IdxT>(L);
  int errs = 0;
  auto ws_clean = [&](const char* what) {
    for (uint32_t w : ws)
      if (w != 0u) {
        fprintf(stderr, "%s: workspace not reset\n", what);
        return 1;
      }
    return 0;
  };
  std::vector<float> emn, emx;
  seq_minmax(L, x, emn, emx);
  // MODE_MINMAX (group_minmax)
  {
    std::vector<float> omn(P, 7.0f), omx(P, 7.0f);
    launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
      observe_kernel<scalar_t, IdxT, V, MODE_MINMAX>(x, k, IdxT(L.numel), IdxT(c.chunk), S, ws.data(),
                                                    EstimateArgs{}, SeedArgs{}, omn.data(), omx.data());
    });
    for (int64_t p = 0; p < P; ++p)
      if ((!same_bits(omn[p], emn[p]) || !same_bits(omx[p], emx[p])) && errs++ < 5)
        fprintf(stderr, "minmax mismatch p=%ld got (%g,%g) exp (%g,%g)\n", (long)p, omn[p], omx[p], emn[p], emx[p]);
    errs += ws_clean("minmax");
  }
  // MODE_OBSERVE: twice (before and after initialisation), same workspace
  std::normal_distribution<float> nd;
  std::vector<float> est_a(G + 2), est_b(G + 2);
  for (auto& v : est_a) v = std::fabs(nd(rng));
  for (auto& v : est_b) v = nd(rng);
  bool init = rng() % 2;
  int64_t rngbuf[2] = {int64_t(rng() & 0xFFFFFFFFu), int64_t(rng() % 2 ? 0xFFFFFFFFu : rng() & 0xFFFFFFFFu)};
  for (int call = 0; call < 2; ++call) {
    const float lam = 0.9f, oml = static_cast<float>(1.0 - 0.9);
    const SeqEstimate want = seq_estimates(emn, emx, S, G, est_a, est_b, init, lam, oml, per_sample, symmetric,
                                           L.numel > 0);
    std::vector<float> oa(P, 7.0f), ob(P, 7.0f);
    bool kinit = init;
    int64_t seed_out[2] = {-1, -1};
    const uint32_t key = uint32_t(rngbuf[0]), counter = uint32_t(rngbuf[1]);
    const EstimateArgs est{est_a.data(), est_b.data(), &kinit, lam, oml, per_sample, symmetric, L.numel > 0,
                           oa.data(), ob.data()};
    const SeedArgs sd{rngbuf, 1, seed_out};
    launch_simt(unsigned(c.blocks), unsigned(c.threads), [&] {
      observe_kernel<scalar_t, IdxT, V, MODE_OBSERVE>(x, k, IdxT(L.numel), IdxT(c.chunk), S, ws.data(), est, sd,
                                                     nullptr, nullptr);
    });
    const int64_t nout = per_sample ? P : G;
    const bool ok = vec_same_bits(want.out_a, oa.data(), nout) && vec_same_bits(want.out_b, ob.data(), nout) &&
                    vec_same_bits(want.est_a, est_a.data(), G + 2) && vec_same_bits(want.est_b, est_b.data(), G + 2) &&
                    kinit == want.init;
    uint32_t lo, hi;
    seed_step(key, counter, lo, hi);
    const bool seed_ok = seed_out[0] == int64_t(lo) && seed_out[1] == int64_t(hi) && rngbuf[0] == int64_t(key) &&
                         rngbuf[1] == int64_t(uint32_t(counter + 1u));
    if ((!ok || !seed_ok) && errs++ < 5)
      fprintf(stderr, "observe mismatch (call %d): estimates %s, seed %s\n", call, ok ? "ok" : "DIFFER",
              seed_ok ? "ok" : "DIFFER");
    errs += ws_clean("observe");
    init = kinit;
  }
  return errs;
}

template <typename scalar_t>
int run_case(const std::vector<int64_t>& shape, int64_t dim, int64_t G, bool per_sample, int sms, bool specials,
             bool do_observe) {
  const int64_t S = per_sample ? shape[0] : 1;
  const Layout L = make_layout_h(shape, dim, G, S);
  const size_t off = 1 + rng() % (16 / sizeof(scalar_t) - 1);
  scalar_t* xa = alloc<scalar_t>(L.numel, 0);    // aligned: 16-element path
  scalar_t* xu = alloc<scalar_t>(L.numel, off);  // offset data_ptr: scalar path
  fill(xa, L.numel, specials);
  memcpy(xu, xa, L.numel * sizeof(scalar_t));
  std::vector<float> alpha(S * G), beta(S * G);
  std::uniform_real_distribution<float> ua(0.0f, 8.0f), ub(-5.0f, 2.0f);
  for (int64_t k = 0; k < S * G; ++k) {
    alpha[k] = (rng() % 17 == 0) ? 0.0f : ua(rng);
    beta[k] = ub(rng);
  }
  if (specials && S * G > 1) { alpha[0] = NAN; beta[S * G - 1] = NAN; }
  const uint64_t seed = rng();
  int e = 0;
  e += check_quant<scalar_t, uint32_t, kVec>(L, xa, alpha.data(), beta.data(), sms, seed);
  e += check_quant<scalar_t, uint32_t, 1>(L, xu, alpha.data(), beta.data(), sms, seed);
  e += check_quant<scalar_t, uint64_t, 1>(L, xu, alpha.data(), beta.data(), sms, seed);
  e += check_bits_all<scalar_t, 8>(L, xa, xu, alpha.data(), beta.data(), sms, seed);
  e += check_bits_all<scalar_t, 4>(L, xa, xu, alpha.data(), beta.data(), sms, seed);
  e += check_bits_all<scalar_t, 2>(L, xa, xu, alpha.data(), beta.data(), sms, seed);
  if (do_observe) {
    const bool sym = rng() % 2;
    e += check_observe<scalar_t, uint32_t, kVec>(L, xa, sms, sym, per_sample);
    e += check_observe<scalar_t, uint32_t, 1>(L, xu, sms, sym, per_sample);
    if (rng() % 4 == 0) e += check_observe<scalar_t, uint64_t, 1>(L, xu, sms, sym, per_sample);
  }
  if (e) {
    fprintf(stderr, "FAIL shape=(");
    for (auto v : shape) fprintf(stderr, "%ld,", (long)v);
    fprintf(stderr, ") dim=%ld G=%ld ps=%d sms=%d sizeof=%zu\n", (long)dim, (long)G, per_sample, sms,
            sizeof(scalar_t));
  }
  free(xa);
  free(xu - off);
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

// update_estimates_kernel (one block, SIMT) against the sequential step.
int estimates_check() {
  int errs = 0, cases = 0;
  std::mt19937 r(7);
  for (int64_t G : {1, 3, 255, 256, 257, 1000, 1500})
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
        launch_simt(1, kThreads, [&] { update_estimates_kernel(mn.data(), mx.data(), S, G, est); });
        const bool ok = vec_same_bits(want.est_a, ka.data(), G) && vec_same_bits(want.est_b, kb.data(), G) &&
                        vec_same_bits(want.out_a, koa.data(), out_n) && vec_same_bits(want.out_b, kob.data(), out_n) &&
                        kinit == want.init;
        if (!ok && errs < 5) printf("update_estimates mismatch: G=%ld S=%ld flags=%d\n", long(G), long(S), flags);
        errs += !ok;
        ++cases;
      }
  printf("update_estimates errors: %d (%d cases)\n", errs, cases);
  return errs;
}

int main(int argc, char** argv) {
  const int ncases = argc > 1 ? atoi(argv[1]) : 150;
  int errs = fastdiv_check();
  printf("fastdiv errors: %d\n", errs);
  errs += estimates_check();
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
  errs += pe;

  // fixed layouts of tests/test_kernels.py and tests/test_observe.py + targeted ones
  struct C { std::vector<int64_t> s; int64_t dim, G; };
  std::vector<C> fixed = {
      {{2, 9, 24}, 2, 3},     {{2, 3, 7, 7}, 1, 3},    {{2, 4, 5, 6}, 1, 2},   {{3, 10, 4, 5}, 1, 4},
      {{2, 7, 13}, 2, 5},     {{5, 6}, 0, 3},          {{11}, 0, 4},           {{3, 5, 7, 11}, 2, 7},
      {{3, 5, 7, 11}, 2, 1},  {{1, 1, 1}, 2, 1},       {{4, 6, 97, 97}, 1, 6}, {{8, 197, 384}, 2, 6},
      {{8, 197, 192}, 2, 3},  {{2, 3, 600, 50}, 1, 2}, {{2, 5, 300}, 1, 5},    {{3, 2, 5000}, 1, 2},
      {{7000, 3}, 1, 3},      {{40, 25}, 1, 5},        {{64, 64}, 1, 4},       {{7, 3000}, 0, 7},
      {{2, 2, 1030}, 2, 3},   {{1, 4097}, 1, 7},       {{40, 3, 3}, 0, 7},     {{16, 197, 96}, 2, 6},
      {{3, 1500}, 1, 1500},   {{2000, 2}, 0, 2},       {{0, 8}, 1, 2},         {{3, 0, 4}, 1, 2},
  };
  int fe = 0;
  for (const auto& c : fixed)
    for (int ps = 0; ps < 2; ++ps)
      for (int sms : {132, 3, 1}) {
        fe += run_case<float>(c.s, c.dim, c.G, ps, sms, true, true);
        fe += run_case<c10::Half>(c.s, c.dim, c.G, ps, sms, true, sms != 132);
        fe += run_case<c10::BFloat16>(c.s, c.dim, c.G, ps, sms, true, sms != 132);
      }
  printf("fixed-layout errors: %d\n", fe);
  errs += fe;

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
  errs += re;
  printf("quantize_bits / dequantize_bits checks: %ld\n", g_bits_checks);
  printf("observe SIMT runs: %d, skipped (too many blocks): %d; atomics: %ld\n", g_ran, g_skipped, g_atomics.load());
  printf(errs ? "FAILED\n" : "ALL OK\n");
  return errs ? 1 : 0;
}
