//===- Init.cpp - deterministic parameter initialization ------------------===//

#include "runtime/core/Init.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

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

namespace {
enum class InitKind { Zeros, Ones, Uniform, Normal };

InitKind kindOf(const Param &p) {
  if (p.init == "zeros")
    return InitKind::Zeros;
  if (p.init == "ones")
    return InitKind::Ones;
  return p.init == "uniform" ? InitKind::Uniform : InitKind::Normal;
}

uint64_t keyOf(const Param &p, uint64_t seed) { return mix64(seed) ^ hashName(p.name); }

float valueAt(InitKind kind, uint64_t key, double scale, int64_t i) {
  switch (kind) {
  case InitKind::Zeros:
    return 0.0f;
  case InitKind::Ones:
    return 1.0f;
  case InitKind::Uniform:
    return (float)((2 * uniform01(key, i) - 1) * scale);
  case InitKind::Normal:
    break;
  }
  return (float)(standardNormal(key, i) * scale);
}
} // namespace

float initValue(const Param &p, uint64_t seed, int64_t i) {
  return valueAt(kindOf(p), keyOf(p, seed), p.scale, i);
}

void initParam(const Param &p, uint64_t seed, int64_t first, int64_t count,
               float *out) {
  // The kind and the tensor's key once per call, not per element (the
  // name's hash per element made a 0.95B-parameter model's init take
  // over a minute). Each value is a pure function of (key, index), so the
  // elements are split over threads for large tensors: the same bits
  // whatever the split or the thread count.
  InitKind kind = kindOf(p);
  uint64_t key = keyOf(p, seed);
  double scale = p.scale;
  auto fill = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      out[i] = valueAt(kind, key, scale, first + i);
  };
  constexpr int64_t kGrain = 1 << 20;
  int64_t threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()),
                                      count / kGrain);
  if (threads <= 1 || kind == InitKind::Zeros || kind == InitKind::Ones) {
    fill(0, count);
    return;
  }
  std::vector<std::thread> pool;
  int64_t per = (count + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back(fill, t * per, std::min(count, (t + 1) * per));
  fill(0, std::min(count, per));
  for (std::thread &th : pool)
    th.join();
}

} // namespace fsdp
