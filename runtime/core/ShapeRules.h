//===- ShapeRules.h - the shape algebra of the dialect and the plan -*- C++ -*-===//
//
// NumPy broadcasting, matmul's dimensions and result shape, reductions'
// shapes, and a shape's name in messages: one definition, read by the
// dialect's verifiers and autodiff (dialects/fsdp/Shapes.h wraps it for
// llvm::ArrayRef) and by the runtime's load-time checks (OpRules.cpp), so
// a plan the compiler accepts is checked at load by the same rules. Free
// of LLVM (the runtime never links it): templates over any shape type
// with size() and operator[] (llvm::ArrayRef, llvm::SmallVector,
// std::vector).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_SHAPERULES_H
#define FSDP_RUNTIME_CORE_SHAPERULES_H

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::shapes {

/// NumPy broadcast of two shapes into `out`; false when they are
/// incompatible (two sizes differ and neither is 1).
template <typename A, typename B>
bool broadcast(const A &a, const B &b, std::vector<int64_t> &out) {
  const size_t na = a.size(), nb = b.size(), rank = std::max(na, nb);
  out.assign(rank, 1);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - na ? 1 : a[i - (rank - na)];
    int64_t db = i < rank - nb ? 1 : b[i - (rank - nb)];
    if (da != db && da != 1 && db != 1)
      return false;
    out[i] = da == 1 ? db : da;
  }
  return true;
}

/// A matmul's dimensions: op(lhs) [batch,] m x k times op(rhs) [batch,]
/// k x n, op transposing the last two dimensions where asked.
struct Matmul {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool batched = false; ///< rank-3 operands (the result has the batch)
  std::vector<int64_t> result() const {
    std::vector<int64_t> r;
    if (batched)
      r.push_back(batch);
    r.push_back(m);
    r.push_back(n);
    return r;
  }
};

/// The dimensions of lhs x rhs, or false with `why` set: operands of equal
/// rank 2 or 3, equal batch sizes, contracting sizes that agree.
template <typename A, typename B>
bool matmul(const A &lhs, const B &rhs, bool transposeLhs, bool transposeRhs, Matmul &d,
            std::string &why) {
  const size_t r = lhs.size();
  if (r != rhs.size() || (r != 2 && r != 3)) {
    why = "expected operands of equal rank 2 or 3, found ranks " + std::to_string(r) + " and " +
          std::to_string(rhs.size());
    return false;
  }
  d.batched = r == 3;
  d.batch = d.batched ? lhs[0] : 1;
  if (d.batched && lhs[0] != rhs[0]) {
    why = "expected equal batch sizes, found " + std::to_string(lhs[0]) + " and " +
          std::to_string(rhs[0]);
    return false;
  }
  d.m = transposeLhs ? lhs[r - 1] : lhs[r - 2];
  d.k = transposeLhs ? lhs[r - 2] : lhs[r - 1];
  const int64_t kr = transposeRhs ? rhs[r - 1] : rhs[r - 2];
  d.n = transposeRhs ? rhs[r - 2] : rhs[r - 1];
  if (d.k != kr) {
    why = "expected contracting sizes to agree, found " + std::to_string(d.k) + " (lhs) and " +
          std::to_string(kr) + " (rhs)";
    return false;
  }
  return true;
}

/// `shape` without `dims` (valid and distinct).
template <typename S, typename D> std::vector<int64_t> reduced(const S &shape, const D &dims) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < shape.size(); ++i)
    if (std::find(dims.begin(), dims.end(), (int64_t)i) == dims.end())
      out.push_back(shape[i]);
  return out;
}

/// `shape` with each of `dims` set to 1 (a reduction's keep-dims form).
template <typename S, typename D> std::vector<int64_t> kept(const S &shape, const D &dims) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  for (int64_t d : dims)
    out[d] = 1;
  return out;
}

/// How many elements a reduction over `dims` folds into each result
/// element (reduce_mean's divisor).
template <typename S, typename D> int64_t reducedCount(const S &shape, const D &dims) {
  int64_t count = 1;
  for (int64_t d : dims)
    count *= shape[d];
  return count;
}

/// ceil(n / block) for n >= 0, block > 0, without the overflow of
/// n + block - 1 (a plan's `block` may be any positive integer).
inline int64_t quantizedBlocks(int64_t n, int64_t block) { return n / block + (n % block != 0); }

/// Bytes of one quantized shard (fsdp.quantize, ZeRO++'s qwZ): `n` int8
/// values padded to a multiple of 4, then one f32 scale per `block`
/// values (the last block may be shorter). 0 < n <= 2^40, block > 0.
inline int64_t quantizedBytes(int64_t n, int64_t block) {
  return (n + 3) / 4 * 4 + 4 * quantizedBlocks(n, block);
}

/// Bytes of a packed optimizer-state shard (optimizer-state-dtype=8bit
/// or 4bit: runtime/core/Moments8.h, Moments4.h): `n` codes of `bits`
/// (8 or 4: two a byte) padded to a multiple of 4 bytes, then one f32
/// scale per `block` elements. 8 bits: quantizedBytes's layout.
inline int64_t packedStateBytes(int64_t n, int64_t block, int64_t bits) {
  return bits == 4 ? ((n + 1) / 2 + 3) / 4 * 4 + 4 * quantizedBlocks(n, block)
                   : quantizedBytes(n, block);
}

/// "4x8" (or "scalar") for messages.
template <typename S> std::string name(const S &shape) {
  if (shape.size() == 0)
    return "scalar";
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? "x" : "") + std::to_string(shape[i]);
  return s;
}

} // namespace fsdp::shapes

#endif // FSDP_RUNTIME_CORE_SHAPERULES_H
