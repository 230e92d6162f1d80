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

/// The stream of a bf16 AdamW moment's stochastic writes
/// (`fsdp.adamw_update {stochastic, key = K}`, state-dtype=bf16): moment
/// 0 (exp_avg) or 1 (exp_avg_sq) of unit K at `step`. These ids lie above
/// the parameter casts' (kRoundingIdBase + K), so no two streams meet.
constexpr uint64_t kStateRoundingIdBase = kRoundingIdBase | (uint64_t(1) << 61);
FSDP_HD inline uint64_t stateRoundingKey(uint64_t seed, int64_t step, int64_t unit, int moment) {
  return dropoutKey(seed, step,
                    (int64_t)(kStateRoundingIdBase + 2 * (uint64_t)unit + (uint64_t)moment));
}

/// The bf16 bits of x rounded stochastically with element g's draw.
FSDP_HD inline uint16_t roundToBf16Stochastic(float x, uint64_t key, uint64_t g) {
  uint32_t b;
#ifdef __CUDA_ARCH__
  b = __float_as_uint(x);
#else
  std::memcpy(&b, &x, 4);
#endif
  if ((b & 0x7fffffffu) > 0x7f800000u) // NaN stays NaN
    return (uint16_t)((b >> 16) | 0x40);
  uint32_t r = (uint32_t)(dropoutMix(key + (g + 1) * 0x9E3779B97F4A7C15ULL) >> 48);
  return (uint16_t)((b >> 16) + (r < (b & 0xFFFFu) ? 1u : 0u));
}

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_STOCHASTICROUNDING_H
