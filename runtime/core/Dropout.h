//===- Dropout.h - the dropout mask, a pure function -------------*- C++ -*-===//
//
// fsdp.dropout keeps element g (its global index, DropoutOp in the
// dialect) of step `step` in a run seeded `seed` when the top 24 bits of
//   h = mix64(key + (g + 1) * 0x9E3779B97F4A7C15)   (splitmix64's stream)
//   key = mix64(mix64(seed ^ mix64(0xD20Fu + step)) + (id + 1) * 0xBF58476D1CE4E5B9)
// are >= round(p * 2^24), and scales kept elements by 1 / (1 - p). Nothing
// depends on the device, the rank layout or the order of evaluation, so
// the CPU, the GPU, N ranks, recomputation and the VJP (the same dropout
// of the gradient) all see the same mask, and test/e2e/dropout.py
// reproduces it in PyTorch for the oracle. Header-only, host and device.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_DROPOUT_H
#define FSDP_RUNTIME_CORE_DROPOUT_H

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define FSDP_HD __host__ __device__
#else
#define FSDP_HD
#endif

namespace fsdp {

/// What a dropout instruction needs from the step running it.
struct DropoutContext {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t dataRank = 0; ///< the rank's index among those splitting the batch
  bool training = true; ///< false: dropout is the identity (evaluation)
};

FSDP_HD inline uint64_t dropoutMix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The per-(seed, step, op) key.
FSDP_HD inline uint64_t dropoutKey(uint64_t seed, int64_t step, int64_t id) {
  uint64_t s = dropoutMix(seed ^ dropoutMix(0xD20FULL + (uint64_t)step));
  return dropoutMix(s + ((uint64_t)id + 1) * 0xBF58476D1CE4E5B9ULL);
}

/// Elements whose 24-bit draw is below this are dropped.
inline uint32_t dropoutThreshold(double p) {
  return (uint32_t)std::llround(p * 16777216.0);
}

FSDP_HD inline bool dropoutKeep(uint64_t key, uint64_t g, uint32_t threshold) {
  return (uint32_t)(dropoutMix(key + (g + 1) * 0x9E3779B97F4A7C15ULL) >> 40) >= threshold;
}

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_DROPOUT_H
