//===- Init.h - deterministic parameter initialization ----------*- C++ -*-===//
//
// Element i of parameter P is a pure function of (seed, P's name, i): a
// counter-based generator, so a rank initializes its shard without the rest
// of the tensor and every world size starts from the same weights.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_INIT_H
#define FSDP_RUNTIME_CORE_INIT_H

#include "runtime/core/Plan.h"

#include <cstdint>
#include <string>

namespace fsdp {

/// 64-bit mix (splitmix64 finalizer).
uint64_t mix64(uint64_t x);
/// FNV-1a of a string: the per-tensor stream id.
uint64_t hashName(const std::string &s);
/// A uniform double in [0, 1) for (key, counter).
double uniform01(uint64_t key, uint64_t counter);
/// A standard normal for (key, counter) (Box-Muller on two uniforms).
double standardNormal(uint64_t key, uint64_t counter);

/// The initial value of element `i` of `p`.
float initValue(const Param &p, uint64_t seed, int64_t i);

/// Fills `count` elements of `p` starting at element `first`.
void initParam(const Param &p, uint64_t seed, int64_t first, int64_t count,
               float *out);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_INIT_H
