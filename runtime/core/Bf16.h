//===- Bf16.h - bf16 <-> f32 for runtime code outside the kernels -*- C++ -*-===//
//
// The one definition of bf16 and f16 rounding (to nearest even, NaN kept), header-
// only: the communicator sums bf16 buffers without linking the CPU kernels,
// and cpu::floatToBf16 / cpu::bf16ToFloat forward here.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_BF16_H
#define FSDP_RUNTIME_CORE_BF16_H

#include "runtime/core/PlanSchema.h"

#include <cstdint>
#include <cstring>

namespace fsdp {

inline uint16_t roundToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) // NaN stays NaN
    return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

inline float widenBf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// IEEE binary16 (f16), round to nearest even (subnormals, overflow to
/// inf, NaN kept).
inline uint16_t roundToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t mant = x & 0x007fffff;
  int32_t exp = (int32_t)((x >> 23) & 0xff);
  if (exp == 0xff)
    return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
  exp = exp - 127 + 15;
  if (exp >= 0x1f)
    return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10)
      return (uint16_t)sign;
    mant |= 0x00800000;
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1)))
      ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1)))
    ++half;
  return (uint16_t)half;
}


inline float widenHalf(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000 | (mant << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// f32 values to `n` elements of parameter storage dtype `t` (f32, bf16
/// or f16; [Note: parameter storage dtypes] in Executor.cpp) at `dst`,
/// rounded to nearest even. `dst` and `src` do not overlap.
inline void narrowParams(DType t, const float *src, int64_t n, void *dst) {
  if (t == DType::F32) {
    std::memcpy(dst, src, (size_t)n * 4);
    return;
  }
  auto *out = static_cast<uint16_t *>(dst);
  for (int64_t i = 0; i < n; ++i)
    out[i] = t == DType::BF16 ? roundToBf16(src[i]) : roundToHalf(src[i]);
}

/// `n` elements of parameter storage dtype `t` at `src` to f32 (exact);
/// `dst` and `src` do not overlap.
inline void widenParams(DType t, const void *src, int64_t n, float *dst) {
  if (t == DType::F32) {
    std::memcpy(dst, src, (size_t)n * 4);
    return;
  }
  const auto *in = static_cast<const uint16_t *>(src);
  for (int64_t i = 0; i < n; ++i)
    dst[i] = t == DType::BF16 ? widenBf16(in[i]) : widenHalf(in[i]);
}

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_BF16_H
