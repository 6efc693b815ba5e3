// What the CPU loops share: function multi-versioning of their run kernels (MESA_CLONES) and
// the element I/O of the storage types as raw bits, whose fp16 / bf16 conversions are the
// branch-free formulas of c10's scalar ones (bit-identical) so that loops over them vectorise.
// Used by quant_cpu.cpp (the quantizer's kernels) and hardswish_grad.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "mesa_common.h"

// Function multi-versioning of the run kernels (x86-64, GCC >= 6 / Clang >= 14, ELF with
// ifunc). -DMESA_NO_TARGET_CLONES (setup.py: MESA_NO_TARGET_CLONES=1) builds the baseline
// version only, e.g. to test it on an AVX2 machine.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__) && \
    !defined(_WIN32) && !defined(MESA_NO_TARGET_CLONES) && defined(__has_attribute)
#if __has_attribute(target_clones) && (defined(__clang__) ? (__clang_major__ >= 14) : (__GNUC__ >= 6))
#if defined(__clang__) ? (__clang_major__ >= 14) : (__GNUC__ >= 11)  // x86-64-v4: GCC 11, Clang 12
#define MESA_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MESA_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#endif
#ifndef MESA_CLONES
#define MESA_CLONES
#endif
#if defined(__GNUC__) || defined(__clang__)
#define MESA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MESA_ALWAYS_INLINE inline
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define MESA_NO_UNROLL _Pragma("GCC unroll 1")
#elif defined(__clang__)
#define MESA_NO_UNROLL _Pragma("clang loop unroll(disable)")
#else
#define MESA_NO_UNROLL
#endif

namespace mesa {
namespace element_io {

// ----------------------------------------------------------------------------- element I/O
// Storage types as raw bits: float, uint16_t (fp16), Bf16Bits (bf16).
struct Bf16Bits {
  uint16_t x;
};
template <typename scalar_t> struct StorageOf { using type = scalar_t; };
template <> struct StorageOf<c10::Half> { using type = uint16_t; };
template <> struct StorageOf<c10::BFloat16> { using type = Bf16Bits; };
static_assert(sizeof(c10::Half) == 2 && sizeof(c10::BFloat16) == 2, "16-bit storage");

MESA_ALWAYS_INLINE float bits_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
MESA_ALWAYS_INLINE uint32_t f_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

MESA_ALWAYS_INLINE float to_f(float v) { return v; }
// bf16 -> fp32: exact (bits << 16), as c10::BFloat16::operator float.
MESA_ALWAYS_INLINE float to_f(Bf16Bits v) { return bits_f(static_cast<uint32_t>(v.x) << 16); }
// fp16 -> fp32: exact, the branch-free formula of c10::detail::fp16_ieee_to_fp32_value.
MESA_ALWAYS_INLINE float to_f(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = f_mul(bits_f((two_w >> 4) + (0xE0u << 23)), 0x1.0p-112f);
  const float denormalized = f_sub(bits_f((two_w >> 17) | (126u << 23)), 0.5f);
  const uint32_t r = two_w < (1u << 27) ? f_bits(denormalized) : f_bits(normalized);
  return bits_f(sign | r);
}

MESA_ALWAYS_INLINE void from_f(float v, float& out) { out = v; }
// fp32 -> bf16: round to nearest even, NaN -> 0x7FC0 (c10::detail::round_to_nearest_even).
MESA_ALWAYS_INLINE void from_f(float v, Bf16Bits& out) {
  const uint32_t u = f_bits(v);
  const uint32_t r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  out.x = static_cast<uint16_t>(v != v ? 0x7FC0u : r);
}
// fp32 -> fp16: round to nearest even, the branch-free formula of
// c10::detail::fp16_ieee_from_fp32_value (NaN -> 0x7E00 | sign).
MESA_ALWAYS_INLINE void from_f(float v, uint16_t& out) {
  const float base0 = f_mul(f_mul(std::fabs(v), 0x1.0p+112f), 0x1.0p-110f);
  const uint32_t w = f_bits(v);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float base = f_add(bits_f((bias >> 1) + 0x07800000u), base0);
  const uint32_t bits = f_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  out = static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// v rounded to the storage type T and back: the value mesa::dequantize returns in T, or
// a row-scaled element in x's dtype (observe_rows)
MESA_ALWAYS_INLINE float through(float v, const float*) { return v; }
template <typename T>
MESA_ALWAYS_INLINE float through(float v, const T*) {
  T t;
  from_f(v, t);
  return to_f(t);
}

}  // namespace element_io
}  // namespace mesa
