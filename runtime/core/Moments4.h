//===- Moments4.h - AdamW's moments in 4 bits, the reference ---*- C++ -*-===//
//
// optimizer-state-dtype=4bit (fsdp.adamw_update with `state_block` B and
// `state_bits = 4`): each moment of a shard of n elements is stored as n
// four-bit codes, two a byte (element 2i in the low nibble of byte i, 2i+1
// in the high one), the ceil(n / 2) bytes zero-padded to a multiple of 4,
// then one f32 scale per block of B elements (shapes::packedStateBytes):
// about half a byte an element where f32 takes 4 and 8-bit codes 1. The
// maps are those of torchao's AdamW4bit (after Li et al. 2023, "Memory
// Efficient Optimizers with 4-bit States"), relative to the block's
// largest magnitude a (the scale s = a):
//   - exp_avg: the signed dynamic-exponent map, 16 levels
//     {0, +-0.0055, +-0.0325, +-0.0775, +-0.2125, +-0.4375, +-0.6625,
//     +-0.8875, 1} (bitsandbytes' create_dynamic_map(signed, 3 exponent
//     bits, 4 bits)): a value far below its block's largest keeps its
//     decade; code c is the c-th level in increasing order (7 is zero);
//   - exp_avg_sq: its square root (as our 8-bit codes keep it) on a
//     geometric map without zero, levels 2^(-(15 - c) / 2): from 2^-7.5
//     (about 0.0055) to 1 in steps of sqrt(2), so a root's relative error
//     is at most about 17% over 7.5 binades (15 of v), and a root below
//     the smallest level reads as it, never 0 (the paper's zero-point
//     problem: a zero second moment makes the step m / eps). torchao's
//     linear map of v without zero (levels (c + 1) / 16 of v) floors v
//     at a sixteenth of its block's largest, so a small-gradient element
//     steps up to 4x too short: on the small GPT's 200 text steps its
//     window means lagged f32's by 1.0-3.2%, this map's by -0.4-1.8%
//     (docs/BENCHMARKS.md).
// A value x of a block of largest magnitude a is coded as the level
// nearest to y = x * (1 / a) (each a correctly rounded f32 operation; a
// tie takes the lower level): exactly, by comparing y with f32 decision
// points (midM, midV); a code decodes as level x s. A block of zeros,
// or of largest magnitude below 2^-100, stores s = 0 and the zero code
// (exp_avg 7, exp_avg_sq 0): it decodes to zeros. A block holding a NaN or
// an infinity stores a NaN scale: it decodes to NaN, a diverged moment
// stays visible. Every step is a pure function of the block, so the CPU,
// the GPU and any block-aligned sharding store the same bytes.
// Header-only, host and device.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_MOMENTS4_H
#define FSDP_RUNTIME_CORE_MOMENTS4_H

#include "runtime/core/Moments8.h" // bitsOf, blockAmax, quantizable, kMaxBlock

#include <cstdint>
#include <cstring>

namespace fsdp::moments4 {

/// exp_avg's zero code (the eighth level of the signed map).
constexpr uint32_t kZeroM = 7;

/// exp_avg's level of code c < 16 (torchao's signed 4-bit map, in f32).
FSDP_HD constexpr float levelM(uint32_t c) {
  switch (c) {
  case 0:
    return -0.8875f;
  case 1:
    return -0.6625f;
  case 2:
    return -0.4375f;
  case 3:
    return -0.2125f;
  case 4:
    return -0.0775f;
  case 5:
    return -0.0325f;
  case 6:
    return -0.0055f;
  case 7:
    return 0.0f;
  case 8:
    return 0.0055f;
  case 9:
    return 0.0325f;
  case 10:
    return 0.0775f;
  case 11:
    return 0.2125f;
  case 12:
    return 0.4375f;
  case 13:
    return 0.6625f;
  case 14:
    return 0.8875f;
  default:
    return 1.0f;
  }
}
/// 2^-k for 0 <= k < 127 (exact), at compile time.
FSDP_HD constexpr float pow2Neg(int k) {
  float x = 1.0f;
  for (int i = 0; i < k; ++i)
    x *= 0.5f;
  return x;
}
/// sqrt(2) in f32 (rounded to nearest).
constexpr float kSqrt2 = 0x1.6a09e6p0f;
/// exp_avg_sq's root's level of code c < 16: 2^(-(15 - c) / 2), a
/// power of two where c is odd, sqrt(2) (f32) times one where even; an
/// exact product either way.
FSDP_HD inline float levelV(uint32_t c) {
  return ((c & 1u) ? 1.0f : kSqrt2) * moments8::floatOf((127u - ((16u - c) >> 1)) << 23);
}

/// The decision points between levels i and i + 1: the largest f32 at
/// most their exact midpoint (which takes one bit more than f32), so that
/// for every f32 y, y > midM(i) exactly when y is nearer level i + 1 (a
/// tie, where the midpoint is an f32, to level i). As hex literals, each
/// the exact midpoint rounded down (exp_avg_sq's roots': two mantissas
/// times powers of two, as its levels).
FSDP_HD constexpr float midM(uint32_t i) {
  switch (i) {
  case 0:
    return -0x1.8ccccep-1f;
  case 1:
    return -0x1.19999ap-1f;
  case 2:
    return -0x1.4ccccep-2f;
  case 3:
    return -0x1.28f5c4p-3f;
  case 4:
    return -0x1.c28f5cp-5f;
  case 5:
    return -0x1.374bc6p-6f;
  case 6:
    return -0x1.6872b0p-9f;
  case 7:
    return 0x1.6872b0p-9f;
  case 8:
    return 0x1.374bc6p-6f;
  case 9:
    return 0x1.c28f5cp-5f;
  case 10:
    return 0x1.28f5c2p-3f;
  case 11:
    return 0x1.4cccccp-2f;
  case 12:
    return 0x1.19999ap-1f;
  case 13:
    return 0x1.8cccccp-1f;
  default:
    return 0x1.e33332p-1f;
  }
}
FSDP_HD constexpr float midV(uint32_t i) {
  return ((i & 1u) ? 0x1.3504f2p0f : 0x1.b504f2p0f) * pow2Neg(8 - (int)((i + 1) >> 1));
}

/// The code of y (x times its block's 1 / a): how many midpoints lie
/// below it, so the nearest level, a tie to the lower one. Written out so
/// that each compare is against a constant (a vectorizable sum of masks
/// on the CPU, selects on the GPU).
FSDP_HD inline uint32_t encodeM(float y) {
  return (uint32_t)(y > midM(0)) + (y > midM(1)) + (y > midM(2)) + (y > midM(3)) + (y > midM(4)) +
         (y > midM(5)) + (y > midM(6)) + (y > midM(7)) + (y > midM(8)) + (y > midM(9)) +
         (y > midM(10)) + (y > midM(11)) + (y > midM(12)) + (y > midM(13)) + (y > midM(14));
}
FSDP_HD inline uint32_t encodeV(float y) {
  return (uint32_t)(y > midV(0)) + (y > midV(1)) + (y > midV(2)) + (y > midV(3)) + (y > midV(4)) +
         (y > midV(5)) + (y > midV(6)) + (y > midV(7)) + (y > midV(8)) + (y > midV(9)) +
         (y > midV(10)) + (y > midV(11)) + (y > midV(12)) + (y > midV(13)) + (y > midV(14));
}

/// A block's scale s and the factor inv its values are coded by, from its
/// largest magnitude a (moments8::blockAmax): s = a, inv = 1 / a where a
/// block is quantizable (moments8::quantizable); else inv = 0 and s = 0
/// (below 2^-100: zeros) or NaN (a NaN or an infinity).
FSDP_HD inline void blockScale(float a, float &s, float &inv) {
  const bool q = moments8::quantizable(a);
  const bool bad = !(a <= 3.4028234663852886e38f); // NaN or infinite
  s = q ? a : (bad ? moments8::floatOf(0x7fc00000u) : 0.0f);
  inv = q ? 1.0f / a : 0.0f;
}

/// Byte offset of the scales in a packed shard of n elements.
FSDP_HD inline int64_t scalesOffset(int64_t n) { return ((n + 1) / 2 + 3) / 4 * 4; }

/// The block size of a packed 4-bit shard of n elements in `bytes` bytes
/// (the powers of two in [32, 4096]), or 0 when no block gives that size.
inline int64_t blockOfPacked(int64_t n, int64_t bytes) {
  for (int64_t block = 32; block <= 4096; block *= 2)
    if (scalesOffset(n) + 4 * ((n + block - 1) / block) == bytes)
      return block;
  return 0;
}

/// The 4-bit code of element i of `codes` (a packed shard's code bytes).
FSDP_HD inline uint32_t codeAt(const uint8_t *codes, int64_t i) {
  return (codes[i >> 1] >> ((i & 1) * 4)) & 15u;
}

/// The value of every code (host): exp_avg's, exp_avg_sq's root's.
/// And of every byte: its two codes' levels (low nibble first), so that
/// a block decodes a byte, two elements, at a time.
struct DecodeTables {
  float m[16], root[16];
  float pairM[256][2], pairRoot[256][2];
};
inline const DecodeTables &decodeTables() {
  static const DecodeTables tables = [] {
    DecodeTables t;
    for (uint32_t c = 0; c < 16; ++c) {
      t.m[c] = levelM(c);
      t.root[c] = levelV(c);
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (uint32_t h = 0; h < 2; ++h) {
        t.pairM[b][h] = levelM((b >> (4 * h)) & 15u);
        t.pairRoot[b][h] = levelV((b >> (4 * h)) & 15u);
      }
    return t;
  }();
  return tables;
}

#ifndef __CUDACC__ // (host code)
/// One block of `len` values x (exp_avg's, or with `root` exp_avg_sq's
/// roots) coded into `codes` (a nibble an element; the block starts at
/// an even element, so at a byte: `codes` is its first byte); returns the
/// block's scale. What the update stores for its new moments (host).
inline float encodeBlock(const float *x, int64_t len, bool root, uint8_t *codes) {
  float s, inv;
  blockScale(moments8::blockAmax([&](int64_t i) { return x[i]; }, len), s, inv);
  uint8_t c[moments8::kMaxBlock + 1];
  if (inv == 0) {
    for (int64_t i = 0; i < len; ++i)
      c[i] = root ? 0 : (uint8_t)kZeroM;
  } else if (root) {
    for (int64_t i = 0; i < len; ++i)
      c[i] = (uint8_t)encodeV(x[i] * inv);
  } else {
    for (int64_t i = 0; i < len; ++i)
      c[i] = (uint8_t)encodeM(x[i] * inv);
  }
  c[len] = 0; // an odd last block's high nibble
  for (int64_t i = 0; i < len; i += 2)
    codes[i / 2] = (uint8_t)(c[i] | (c[i + 1] << 4));
  return s;
}

/// f32 moments encoded into a packed shard of n elements in blocks of
/// `block` (even, at most kMaxBlock): exp_avg's values, or (`root`)
/// exp_avg_sq's, whose roots are encoded. The bytes the update would
/// store for these moments. Host.
inline void encodeShard(const float *x, int64_t n, int64_t block, bool root, uint8_t *q) {
  float roots[moments8::kMaxBlock];
  for (int64_t o = 0; o < n; o += block) {
    const int64_t len = n - o < block ? n - o : block;
    const float *in = x + o;
    if (root) {
      for (int64_t i = 0; i < len; ++i)
        roots[i] = std::sqrt(x[o + i]);
      in = roots;
    }
    const float s = encodeBlock(in, len, root, q + o / 2);
    std::memcpy(q + scalesOffset(n) + 4 * (o / block), &s, 4);
  }
  for (int64_t i = (n + 1) / 2; i < scalesOffset(n); ++i)
    q[i] = 0; // the codes' padding
}
#endif

/// Codes [first, first + n) of a packed shard in blocks of `block`
/// decoded into f32 (exp_avg_sq, `root`: each root squared, as the update
/// reads it): `codes` points at the byte holding code `first` (byte
/// first / 2 of the shard's codes; its high nibble where first is odd),
/// `scales` at the f32 scale of code first's block (unaligned bytes).
/// Host.
inline void decodeRange(const uint8_t *codes, const uint8_t *scales, int64_t first, int64_t n,
                        int64_t block, bool root, float *out) {
  const DecodeTables &t = decodeTables();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = first + i;
    float s;
    std::memcpy(&s, scales + 4 * (e / block - first / block), 4);
    const uint32_t c = codeAt(codes, (first & 1) + i);
    if (root) {
      const float r = t.root[c] * s;
      out[i] = r * r;
    } else {
      out[i] = t.m[c] * s;
    }
  }
}

/// A packed shard of n elements decoded into f32 (decodeRange of all of it).
inline void decodeShard(const uint8_t *q, int64_t n, int64_t block, bool root, float *out) {
  decodeRange(q, q + scalesOffset(n), 0, n, block, root, out);
}

} // namespace fsdp::moments4

#endif // FSDP_RUNTIME_CORE_MOMENTS4_H
