//===- Quantize.h - ZeRO++'s block-wise int8 weights, the reference -*- C++ -*-===//
//
// The one definition of fsdp.quantize / fsdp.dequantize's arithmetic
// (fsdp-shard's weight-quantization=int8, ZeRO++'s qwZ): the CPU kernels
// run it, the CUDA kernels are tested against it. A part of n values is
// n int8 values, zero-padded to a multiple of 4 bytes, then one f32 scale
// per block of `block` values (shapes::quantizedBytes in ShapeRules.h).
// A block's scale is its largest magnitude / 127 and a value is
// round-half-even(x / scale) in [-127, 127] (symmetric: -128 unused), the
// arithmetic PyTorch's torch.round / clamp do in f32, so an oracle there
// reproduces it bit for bit. A block holding a NaN or an infinity gets a
// scale that is not finite and every value 0, so it dequantizes to NaN:
// a diverged parameter stays visible instead of turning into zeros.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_QUANTIZE_H
#define FSDP_RUNTIME_CORE_QUANTIZE_H

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fsdp::quant {

/// Bytes of a part's int8 values: n padded to 4 (the scales after them
/// stay 4-byte aligned).
inline int64_t valueBytes(int64_t n) { return (n + 3) / 4 * 4; }

/// A block's scale from its values (read through `at(i)`, i < n): the
/// largest magnitude / 127; NaN where a value is NaN, infinite where one
/// is infinite.
template <typename At> float blockScale(At at, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float a = std::fabs(at(i));
    if (!(a <= m)) // a larger value, or a NaN (kept: NaN compares false)
      m = a;
  }
  return m / 127.0f;
}

/// One value at `scale`: 0 where the scale is 0 or not finite.
inline int8_t quantizeValue(float x, float scale) {
  if (!(scale > 0.0f) || !std::isfinite(scale))
    return 0;
  float q = std::nearbyint(x / scale); // the default rounding mode: half to even
  q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
  return (int8_t)q;
}

/// Blocks [b0, b1) of a part of n values `x` into `out`, the part's
/// valueBytes(n) + 4 x blocks bytes (the padding written with the last
/// block).
inline void quantizeBlocks(const float *x, int64_t n, int64_t block, uint8_t *out, int64_t b0,
                           int64_t b1) {
  const int64_t sOff = valueBytes(n);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, len = n - lo < block ? n - lo : block;
    const float s = blockScale([&](int64_t i) { return x[lo + i]; }, len);
    for (int64_t i = 0; i < len; ++i)
      out[lo + i] = (uint8_t)quantizeValue(x[lo + i], s);
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

/// Value i of a quantized part of n values (f32): one value of
/// dequantizeBlocks, for checks.
inline float dequantizeValue(const uint8_t *part, int64_t n, int64_t block, int64_t i) {
  float s;
  std::memcpy(&s, part + valueBytes(n) + 4 * (i / block), 4);
  return (float)(int8_t)part[i] * s;
}

} // namespace fsdp::quant

#endif // FSDP_RUNTIME_CORE_QUANTIZE_H
