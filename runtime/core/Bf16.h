//===- Bf16.h - bf16 <-> f32 for runtime code outside the kernels -*- C++ -*-===//
//
// The one definition of bf16 rounding (to nearest even, NaN kept), header-
// only: the communicator sums bf16 buffers without linking the CPU kernels,
// and cpu::floatToBf16 / cpu::bf16ToFloat forward here.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_BF16_H
#define FSDP_RUNTIME_CORE_BF16_H

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

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_BF16_H
