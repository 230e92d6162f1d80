//===- Moments8.h - AdamW's moments in 8 bits, the reference ---*- C++ -*-===//
//
// optimizer-state-dtype=8bit (fsdp.adamw_update with `state_block` B):
// each moment of a shard of n elements is stored as n one-byte codes,
// zero-padded to a multiple of 4 bytes, then one f32 scale per block of B
// elements (the qwZ part's layout: shapes::quantizedBytes(n, B)), about a
// byte an element where f32 takes 4. As bitsandbytes' and torchao's 8-bit
// optimizers do, a block's codes are relative to its largest magnitude, so
// every block keeps its own range; the codes are small floats rather than
// a linear grid, so a block keeps values far below its largest (the
// second moment spans many decades within a block):
//   - exp_avg: a sign bit and E4M3 (4 exponent bits, 3 mantissa bits);
//   - exp_avg_sq: its square root, in E4M4 (no sign). The update takes
//     the square root anyway (AdamW's denominator), and the root halves
//     the decades the code must span: 19 binades of the root are 38 of v.
// A magnitude code c of k mantissa bits (e = c >> k, f = its low k bits)
// is the value f x 2^(-6-k) for e = 0 (subnormal) and
// 2^(e-7) x (1 + f / 2^k) otherwise; the largest, c = 2^(4+k) - 1, is
// kMax(k) = (2 - 2^-k) x 2^8 (480 for E4M3, 496 for E4M4). A block of
// largest magnitude a (over its f32 values) stores the scale s = a / kMax
// and the code of each value x is the magnitude |x| x (kMax / a) rounded
// to the nearest code (ties to even: IEEE's rounding at the code's
// precision), clamped to kMax; a value decodes as code value x s. A block
// of zeros (or of largest magnitude below 2^-100) stores s = a and codes 0,
// so it decodes to zeros; a block holding a NaN or an infinity stores
// that scale (NaN, or infinite) and codes 0, so it decodes to NaN: a
// diverged moment stays visible. Every step is a correctly rounded f32
// operation, a pure function of the block, so the CPU, the GPU and any
// block-aligned sharding store the same bytes. Header-only, host and
// device.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_MOMENTS8_H
#define FSDP_RUNTIME_CORE_MOMENTS8_H

#include "runtime/core/Dropout.h" // FSDP_HD

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fsdp::moments8 {

/// Mantissa bits: exp_avg's codes (with a sign bit) and exp_avg_sq's root's.
constexpr int kMantM = 3, kMantV = 4;

FSDP_HD inline uint32_t bitsOf(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}
FSDP_HD inline float floatOf(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

/// The largest code value of k mantissa bits: (2 - 2^-k) x 2^8.
FSDP_HD constexpr float maxValue(int k) { return 256.0f * (2.0f - 1.0f / (float)(1 << k)); }

/// The value of magnitude code c (k mantissa bits), exact in f32.
FSDP_HD inline float codeValue(uint32_t c, int k) {
  const uint32_t e = c >> k, f = c & ((1u << k) - 1u);
  // e = 0: f x 2^(-6-k), f < 2^k (a power-of-two scaling: exact)
  const float sub = (float)f * floatOf((uint32_t)(127 - 6 - k) << 23);
  const float norm = floatOf(((e + 120u) << 23) | (f << (23 - k)));
  return e == 0 ? sub : norm;
}

/// The code of magnitude y >= 0 (finite; at most about kMax): y rounded to
/// the nearest code value, ties to even, clamped to the largest code.
/// Below 2^-6 (the codes' subnormals) by IEEE's own rounding of
/// y x 2^(6+k) to an integer (add and subtract 1.5 x 2^23); above, by
/// rounding y's f32 mantissa to k bits on its bit pattern (a carry moves
/// the exponent up, as it should) and re-biasing the exponent (127 -> 7).
FSDP_HD inline uint32_t encodeMagnitude(float y, int k) {
  // (in int32: every pattern here is below 2^31, and SSE2 compares signed
  // lanes only, so the CPU's loop vectorizes)
  const float magic = 12582912.0f; // 1.5 x 2^23
  const float scaled = y * floatOf((uint32_t)(127 + 6 + k) << 23);
  const int32_t sub = (int32_t)bitsOf(scaled + magic) - (int32_t)bitsOf(magic);
  const int32_t b = (int32_t)bitsOf(y);
  const int32_t rounded = (b + ((1 << (22 - k)) - 1) + ((b >> (23 - k)) & 1)) >> (23 - k);
  const int32_t norm = rounded - (120 << k);
  // y < 2^-6 (y >= 0: as its pattern) picks sub, else norm; then the
  // largest code at most. As masks: GCC's vectorizer took the selects for
  // control flow and left the loop scalar.
  const int32_t low = -(int32_t)(b < 0x3c800000);
  const int32_t c = (sub & low) | (norm & ~low);
  const int32_t top = (16 << k) - 1;
  const int32_t over = -(int32_t)(c > top);
  return (uint32_t)((top & over) | (c & ~over));
}

/// A block's largest magnitude over `at(i)`, i < n: NaN where a value is
/// NaN, infinite where one is infinite (as the bit patterns order).
template <typename At> FSDP_HD inline float blockAmax(At at, int64_t n) {
  int32_t m = 0; // (signed: the patterns are below 2^31; SSE2 compares signed lanes)
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = (int32_t)(bitsOf(at(i)) & 0x7fffffffu);
    m = b > m ? b : m;
  }
  return m > 0x7f800000 ? floatOf(0x7fc00000u) : floatOf((uint32_t)m);
}

/// Whether a block of largest magnitude a has codes to compute: finite
/// and at least 2^-100 (so kMax / a is finite). Else every code is 0 and
/// the scale is a itself: a block below 2^-100 decodes to zeros, one with
/// a NaN or an infinity to NaN.
FSDP_HD inline bool quantizable(float a) {
  return a >= 7.888609052210118e-31f && a <= 3.4028234663852886e38f;
}

/// A block's scale and the reciprocal its codes are computed with, for
/// the codes of k mantissa bits: s = a / kMax, inv = kMax / a (inv 0 and
/// s = a where the block is not quantizable).
FSDP_HD inline void blockScale(float a, int k, float &s, float &inv) {
  const bool q = quantizable(a);
  s = q ? a / maxValue(k) : a;
  inv = q ? maxValue(k) / a : 0.0f;
}

/// exp_avg's code of x, by the block's inv = kMax(3) / a.
FSDP_HD inline uint8_t encodeM(float x, float inv) {
  const uint32_t sign = (bitsOf(x) >> 24) & 0x80u;
  return (uint8_t)(sign | encodeMagnitude(floatOf(bitsOf(x) & 0x7fffffffu) * inv, kMantM));
}
/// exp_avg's value of code c in a block of scale s.
FSDP_HD inline float decodeM(uint8_t c, float s) {
  const float v = codeValue(c & 0x7fu, kMantM) * s;
  return (c & 0x80u) ? -v : v;
}
/// exp_avg_sq's root's code of r >= 0, by the block's inv = kMax(4) / a.
FSDP_HD inline uint8_t encodeV(float r, float inv) {
  return (uint8_t)encodeMagnitude(r * inv, kMantV);
}
/// exp_avg_sq's root's value of code c in a block of scale s (the moment
/// is its square, rounded once).
FSDP_HD inline float decodeRoot(uint8_t c, float s) { return codeValue(c, kMantV) * s; }

/// The value of every code (host): exp_avg's with its sign, exp_avg_sq's
/// root's, so that a decode is a load and a multiply (the same product as
/// decodeM's and decodeRoot's: a negated value times a scale is the
/// negated product).
struct DecodeTables {
  float m[256], root[256];
};
inline const DecodeTables &decodeTables() {
  static const DecodeTables tables = [] {
    DecodeTables t;
    for (uint32_t c = 0; c < 256; ++c) {
      const float v = codeValue(c & 0x7fu, kMantM);
      t.m[c] = (c & 0x80u) ? -v : v;
      t.root[c] = codeValue(c, kMantV);
    }
    return t;
  }();
  return tables;
}

/// Byte offset of the scales in a packed shard of n elements.
FSDP_HD inline int64_t scalesOffset(int64_t n) { return (n + 3) / 4 * 4; }

/// The block size of a packed shard of n elements in `bytes` bytes (the
/// powers of two in [32, 4096]), or 0 when no block gives that size.
inline int64_t blockOfPacked(int64_t n, int64_t bytes) {
  for (int64_t block = 32; block <= 4096; block *= 2)
    if (scalesOffset(n) + 4 * ((n + block - 1) / block) == bytes)
      return block;
  return 0;
}

#ifndef __CUDACC__ // (host code; nvcc would not take the lambda of a host function)
/// One block of `len` values x (exp_avg's, or exp_avg_sq's roots: k =
/// kMantM or kMantV) encoded into `codes`; returns the block's scale. What
/// the update stores for its new moments (host).
inline float encodeBlock(const float *x, int64_t len, int k, uint8_t *codes) {
  float s, inv;
  blockScale(blockAmax([&](int64_t i) { return x[i]; }, len), k, s, inv);
  if (inv == 0) {
    std::memset(codes, 0, (size_t)len);
    return s;
  }
  if (k == kMantM) {
    for (int64_t i = 0; i < len; ++i)
      codes[i] = encodeM(x[i], inv);
  } else {
    for (int64_t i = 0; i < len; ++i)
      codes[i] = encodeV(x[i], inv);
  }
  return s;
}

/// The largest block a packed shard may have (the verifier's bound).
constexpr int64_t kMaxBlock = 4096;

/// f32 moments encoded into a packed shard of n elements in blocks of
/// `block` (at most kMaxBlock): exp_avg's values, or (`root`) exp_avg_sq's,
/// whose roots are encoded. The bytes the update would store for these
/// moments; decodeShard's inverse to half a code step. Host.
inline void encodeShard(const float *x, int64_t n, int64_t block, bool root, uint8_t *q) {
  float roots[kMaxBlock];
  for (int64_t o = 0; o < n; o += block) {
    const int64_t len = n - o < block ? n - o : block;
    const float *in = x + o;
    if (root) {
      for (int64_t i = 0; i < len; ++i)
        roots[i] = std::sqrt(x[o + i]);
      in = roots;
    }
    const float s = encodeBlock(in, len, root ? kMantV : kMantM, q + o);
    std::memcpy(q + scalesOffset(n) + 4 * (o / block), &s, 4);
  }
  for (int64_t i = n; i < scalesOffset(n); ++i)
    q[i] = 0; // the codes' padding
}
#endif

/// Codes [first, first + n) of a packed shard in blocks of `block`
/// decoded into f32 (exp_avg_sq, `root`: each root squared, as the update
/// reads it): `codes` points at code `first`, `scales` at the f32 scale of
/// its block (unaligned bytes). A block at a time, by the tables (the same
/// products as decodeM's and decodeRoot's). Host.
inline void decodeRange(const uint8_t *codes, const uint8_t *scales, int64_t first, int64_t n,
                        int64_t block, bool root, float *out) {
  const DecodeTables &t = decodeTables();
  for (int64_t i = 0; i < n;) {
    const int64_t b = (first + i) / block;
    const int64_t len = n - i < (b + 1) * block - (first + i) ? n - i : (b + 1) * block - first - i;
    float s;
    std::memcpy(&s, scales + 4 * (b - first / block), 4);
    if (root) {
      for (int64_t k = 0; k < len; ++k) {
        const float r = t.root[codes[i + k]] * s;
        out[i + k] = r * r;
      }
    } else {
      for (int64_t k = 0; k < len; ++k)
        out[i + k] = t.m[codes[i + k]] * s;
    }
    i += len;
  }
}

/// A packed shard of n elements decoded into f32 (decodeRange of all of it).
inline void decodeShard(const uint8_t *q, int64_t n, int64_t block, bool root, float *out) {
  decodeRange(q, q + scalesOffset(n), 0, n, block, root, out);
}

} // namespace fsdp::moments8

#endif // FSDP_RUNTIME_CORE_MOMENTS8_H
