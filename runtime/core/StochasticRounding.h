//===- StochasticRounding.h - f32 -> bf16, unbiased, a pure function -*- C++ -*-===//
//
// `fsdp.cast {stochastic, key = K}` (fsdp-mixed-precision's
// stochastic-rounding=true: the master parameters' cast to bf16 before
// their all-gather, llm.c's stochastic_rounding) rounds element g (its index
// in unit K's flat parameters: the shard's offset plus its own index) of
// step `step` in a run seeded `seed` so that the expected bf16 value is the
// f32 value:
//   b = the f32 bits, low = b & 0xFFFF,
//   r = the top 16 bits of mix64(k + (g + 1) * 0x9E3779B97F4A7C15),
//   k = dropoutKey(seed, step, kRoundingIdBase + K)   (Dropout.h's stream),
//   bf16 = (b >> 16) + (r < low)      (NaN: a quiet NaN, as to nearest)
// so the magnitude rounds up with probability low / 2^16. Nothing depends
// on the device, the rank layout or how often the unit is gathered in a
// step, so the CPU, the GPU, N ranks (each rounding its own shard) and the
// backward pass's second gather see the same bf16 parameters, and a
// resumed run draws what the uninterrupted one drew. Header-only, host
// and device.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_STOCHASTICROUNDING_H
#define FSDP_RUNTIME_CORE_STOCHASTICROUNDING_H

#include "runtime/core/Dropout.h"

#include <cstdint>
#include <cstring>

namespace fsdp {

/// Rounding keys live above every dropout id (the compiler numbers those
/// from 0), so no dropout mask shares a stream with a rounding.
constexpr uint64_t kRoundingIdBase = uint64_t(1) << 62;

FSDP_HD inline uint64_t stochasticRoundingKey(uint64_t seed, int64_t step, int64_t unit) {
  return dropoutKey(seed, step, (int64_t)(kRoundingIdBase + (uint64_t)unit));
}

/// The stream of a bf16 AdamW update's stochastic moment writes
/// (`fsdp.adamw_update {stochastic, key = K}`, state-dtype=bf16): unit K at
/// `step`. These ids lie above the parameter casts' (kRoundingIdBase + K),
/// so no two streams meet.
constexpr uint64_t kStateRoundingIdBase = kRoundingIdBase | (uint64_t(1) << 61);
FSDP_HD inline uint64_t stateRoundingKey(uint64_t seed, int64_t step, int64_t unit) {
  return dropoutKey(seed, step, (int64_t)(kStateRoundingIdBase + (uint64_t)unit));
}

/// x's bf16 bits rounded up in magnitude when the 16-bit draw r is below
/// the bits rounding drops (probability low / 2^16); NaN stays NaN.
FSDP_HD inline uint16_t bf16WithDraw(float x, uint32_t r) {
  uint32_t b;
#ifdef __CUDA_ARCH__
  b = __float_as_uint(x);
#else
  std::memcpy(&b, &x, 4);
#endif
  if ((b & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b >> 16) + (r < (b & 0xFFFFu) ? 1u : 0u));
}

/// Element g's two new moments m, v rounded stochastically with one mix:
/// its top 16 bits draw for m, the next 16 for v (half the hashing of two
/// draws; the bits of a 64-bit mix are independent for this purpose).
FSDP_HD inline void roundMomentsToBf16Stochastic(float m, float v, uint64_t key, uint64_t g,
                                                 uint16_t &bm, uint16_t &bv) {
  uint64_t r = dropoutMix(key + (g + 1) * 0x9E3779B97F4A7C15ULL);
  bm = bf16WithDraw(m, (uint32_t)(r >> 48));
  bv = bf16WithDraw(v, (uint32_t)(r >> 32) & 0xFFFFu);
}

/// The bf16 bits of x rounded stochastically with element g's draw.
FSDP_HD inline uint16_t roundToBf16Stochastic(float x, uint64_t key, uint64_t g) {
  return bf16WithDraw(x, (uint32_t)(dropoutMix(key + (g + 1) * 0x9E3779B97F4A7C15ULL) >> 48));
}

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_STOCHASTICROUNDING_H
