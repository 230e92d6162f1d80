//===- Init.cpp - deterministic parameter initialization ------------------===//

#include "runtime/core/Init.h"

#include <cmath>

namespace fsdp {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t hashName(const std::string &s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

double uniform01(uint64_t key, uint64_t counter) {
  uint64_t r = mix64(key ^ mix64(counter));
  return (double)(r >> 11) * 0x1.0p-53;
}

double standardNormal(uint64_t key, uint64_t counter) {
  double u1 = uniform01(key, 2 * counter), u2 = uniform01(key, 2 * counter + 1);
  if (u1 < 1e-300)
    u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

float initValue(const Param &p, uint64_t seed, int64_t i) {
  uint64_t key = mix64(seed) ^ hashName(p.name);
  if (p.init == "zeros")
    return 0.0f;
  if (p.init == "ones")
    return 1.0f;
  if (p.init == "uniform")
    return (float)((2 * uniform01(key, i) - 1) * p.scale);
  return (float)(standardNormal(key, i) * p.scale);
}

void initParam(const Param &p, uint64_t seed, int64_t first, int64_t count,
               float *out) {
  for (int64_t i = 0; i < count; ++i)
    out[i] = initValue(p, seed, first + i);
}

} // namespace fsdp
