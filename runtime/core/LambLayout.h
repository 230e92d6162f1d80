//===- LambLayout.h - where a LAMB operand lies in its unit -----*- C++ -*-===//
//
// lamb_norms / lamb_update work on a whole FSDP unit's flat parameters or
// one shard of them, and need each element's parameter (the trust ratio
// is per parameter) and whether it takes weight decay. One description
// for the plan check (runtime/core/OpRules.h), the CPU kernels and the
// CUDA kernels. Header-only, no dependency: the kernels' translation
// units (CUDA's included) take it as is.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_LAMBLAYOUT_H
#define FSDP_RUNTIME_CORE_LAMBLAYOUT_H

#include <cstdint>
#include <vector>

namespace fsdp {

/// A LAMB operand of n elements: a whole FSDP unit's flat parameters or
/// one shard of them. Parameter k of the unit holds
/// positions [segments[k], segments[k+1]) of its flat layout (segments[0]
/// = 0, rising strictly, K = segments.size() - 1 >= 1); positions from
/// segments[K] on are padding. Element i of the operand is at position
/// base + i; a position below decayNumel takes weight decay (the unit packs
/// its decayed parameters first; a parameter decays wholly or not at all).
struct LambLayout {
  std::vector<int64_t> segments;
  int64_t base = 0;
  int64_t decayNumel = INT64_MAX;
};
/// A run [begin, end) of operand elements with one parameter (`segment`,
/// -1 for padding) and one weight decay (decay: wd applies).
struct LambPiece {
  int64_t begin, end, segment;
  bool decay;
};
/// The operand's pieces in order, cut at the parameters' bounds and at
/// decayNumel; every element with a position lies in exactly one.
inline std::vector<LambPiece> lambPieces(const LambLayout &l, int64_t n) {
  std::vector<LambPiece> out;
  const int64_t lo = l.base, hi = l.base + n, K = (int64_t)l.segments.size() - 1;
  auto add = [&](int64_t a, int64_t b, int64_t seg) {
    a = a > lo ? a : lo;
    b = b < hi ? b : hi;
    if (a >= b)
      return;
    // decayNumel inside [a, b) only on padding or a malformed layout
    // (the plan check refuses one inside a parameter): cut there too.
    if (l.decayNumel > a && l.decayNumel < b) {
      out.push_back({a - lo, l.decayNumel - lo, seg, true});
      out.push_back({l.decayNumel - lo, b - lo, seg, false});
    } else {
      out.push_back({a - lo, b - lo, seg, a < l.decayNumel});
    }
  };
  for (int64_t k = 0; k < K; ++k)
    add(l.segments[k], l.segments[k + 1], k);
  if (K >= 0)
    add(l.segments[K], hi, -1);
  return out;
}

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_LAMBLAYOUT_H
