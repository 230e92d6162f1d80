//===- Quantize.h - ZeRO++'s block-wise int8 weights, the reference -*- C++ -*-===//
//
// The one definition of fsdp.quantize / fsdp.dequantize's arithmetic
// (fsdp-shard's weight-quantization=int8 and gradient-quantization=int8,
// ZeRO++'s qwZ and qgZ): the CPU kernels
// run it, the CUDA kernels are tested against it. A part of n values is
// n int8 values, zero-padded to a multiple of 4 bytes, then one f32 scale
// per block of `block` values (shapes::quantizedBytes in ShapeRules.h).
// Of a block of largest magnitude m, the scale is m / 127 and a value x is
// round-half-even(x x (127 / m)) in [-127, 127] (symmetric: -128 unused),
// dequantized as q x scale: the arithmetic PyTorch's torch.round / clamp
// do in f32, so an oracle there reproduces it bit for bit. A block holding
// a NaN or an infinity gets a scale that is not finite and every value 0,
// so it dequantizes to NaN: a diverged parameter stays visible instead of
// turning into zeros.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_QUANTIZE_H
#define FSDP_RUNTIME_CORE_QUANTIZE_H

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace fsdp::quant {

/// Bytes of a part's int8 values: n padded to 4 (the scales after them
/// stay 4-byte aligned).
inline int64_t valueBytes(int64_t n) { return (n + 3) / 4 * 4; }

/// A block's largest magnitude (its values read through `at(i)`, i < n);
/// NaN where a value is NaN, infinite where one is infinite. Taken over
/// the magnitudes' bit patterns as integers, which order as the values do
/// and put every NaN above infinity: a max the compiler vectorizes
/// (a float max it may not, for NaN's sake).
template <typename At> float blockMax(At at, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = at(i);
    int32_t bits;
    std::memcpy(&bits, &v, 4);
    bits &= 0x7fffffff;
    m = bits > m ? bits : m;
  }
  if (m > 0x7f800000)
    return std::numeric_limits<float>::quiet_NaN();
  float f;
  std::memcpy(&f, &m, 4);
  return f;
}

/// A block's scale (what dequantization multiplies by): max / 127.
template <typename At> float blockScale(At at, int64_t n) { return blockMax(at, n) / 127.0f; }

/// round-half-even(v) for |v| < 2^22, in the default rounding mode: adding
/// and subtracting 1.5 x 2^23 leaves v's integer part rounded to nearest
/// even (the sum has no bits below 1), and it vectorizes where
/// std::nearbyint is a library call (x86-64 before SSE4.1). Not folded:
/// the project builds without -ffast-math.
inline float roundHalfEven(float v) {
  const float magic = 12582912.0f; // 1.5 x 2^23
  return (v + magic) - magic;
}

/// Whether a block of largest magnitude `m` has values to quantize: a
/// block of zeros, or one with a NaN or an infinity, is all zeros.
inline bool quantizable(float m) { return m > 0.0f && std::isfinite(m); }

/// One value of a quantizable block of largest magnitude `m`, by the
/// reciprocal `inv` = 127 / m (a multiply a value, not a divide:
/// bitsandbytes' form): round-half-even(x x inv), clamped to [-127, 127]
/// (|x x inv| <= 127 up to two roundings, within roundHalfEven's range).
/// Computed as roundHalfEven does but without subtracting the magic
/// number back: x x inv + 1.5 x 2^23 holds the rounded integer in its low
/// mantissa bits, so clamping it to magic +- 127 and taking the low byte
/// of its bit pattern is the int8 (two's complement), with no float to
/// integer conversion (which SSE2 has only for 32-bit lanes: the vectorized
/// loop ran at 1.3 ns a value with it, SSE2 being this build's target).
inline uint8_t quantizeValue(float x, float inv) {
  const float magic = 12582912.0f; // 1.5 x 2^23
  float t = x * inv + magic;       // (no FMA: the build contracts nothing)
  t = t > magic + 127.0f ? magic + 127.0f : t < magic - 127.0f ? magic - 127.0f : t;
  uint32_t bits;
  std::memcpy(&bits, &t, 4);
  return (uint8_t)bits;
}

/// Blocks [b0, b1) of a part of n values `x` into `out`, the part's
/// valueBytes(n) + 4 x blocks bytes (the padding written with the last
/// block). A block's scale is max / 127 (NaN or infinite as its max).
inline void quantizeBlocks(const float *x, int64_t n, int64_t block, uint8_t *out, int64_t b0,
                           int64_t b1) {
  const int64_t sOff = valueBytes(n);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, len = n - lo < block ? n - lo : block;
    const float m = blockMax([&](int64_t i) { return x[lo + i]; }, len);
    if (!quantizable(m)) {
      std::memset(out + lo, 0, (size_t)len);
    } else {
      const float inv = 127.0f / m;
      for (int64_t i = 0; i < len; ++i)
        out[lo + i] = quantizeValue(x[lo + i], inv);
    }
    const float s = m / 127.0f;
    std::memcpy(out + sOff + 4 * b, &s, 4);
  }
  if (b1 * block >= n)
    for (int64_t i = n; i < sOff; ++i)
      out[i] = 0;
}

/// Blocks [b0, b1) of a quantized part of n values: each value's int8
/// times its block's scale, passed to `store(i, value)`.
template <typename Store>
void dequantizeBlocks(const uint8_t *part, int64_t n, int64_t block, int64_t b0, int64_t b1,
                      Store store) {
  const int64_t sOff = valueBytes(n);
  for (int64_t b = b0; b < b1; ++b) {
    float s;
    std::memcpy(&s, part + sOff + 4 * b, 4);
    const int64_t lo = b * block, len = n - lo < block ? n - lo : block;
    for (int64_t i = 0; i < len; ++i)
      store(lo + i, (float)(int8_t)part[lo + i] * s);
  }
}

/// Blocks [b0, b1) of `parts` quantized parts of n values each, one after
/// another (valueBytes(n) + 4 x blocks bytes apart), reduced (ZeRO++'s
/// qgZ, fsdp.dequantize with `reduce`): value i is the f32 sum of the
/// parts' values i, added in part order, divided by `parts` for a mean,
/// passed to `store(i, value)`. Products and sums rounded one at a time
/// (a GPU kernel must not fuse them).
template <typename Store>
void dequantizeSumBlocks(const uint8_t *in, int64_t parts, int64_t n, int64_t block, bool mean,
                         int64_t b0, int64_t b1, Store store) {
  const int64_t sOff = valueBytes(n), blocks = n / block + (n % block != 0);
  const int64_t partBytes = sOff + 4 * blocks;
  constexpr int64_t kChunk = 256;
  float acc[kChunk];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, len = n - lo < block ? n - lo : block;
    for (int64_t c = 0; c < len; c += kChunk) {
      const int64_t k = len - c < kChunk ? len - c : kChunk;
      for (int64_t p = 0; p < parts; ++p) {
        const uint8_t *part = in + p * partBytes;
        float s;
        std::memcpy(&s, part + sOff + 4 * b, 4);
        const uint8_t *q = part + lo + c;
        if (p == 0)
          for (int64_t i = 0; i < k; ++i)
            acc[i] = (float)(int8_t)q[i] * s;
        else
          for (int64_t i = 0; i < k; ++i)
            acc[i] += (float)(int8_t)q[i] * s;
      }
      for (int64_t i = 0; i < k; ++i)
        store(lo + c + i, mean ? acc[i] / (float)parts : acc[i]);
    }
  }
}

/// Value i of a quantized part of n values (f32): one value of
/// dequantizeBlocks, for checks.
inline float dequantizeValue(const uint8_t *part, int64_t n, int64_t block, int64_t i) {
  float s;
  std::memcpy(&s, part + valueBytes(n) + 4 * (i / block), 4);
  return (float)(int8_t)part[i] * s;
}

} // namespace fsdp::quant

#endif // FSDP_RUNTIME_CORE_QUANTIZE_H
