//===- Shapes.cpp - shape rules shared by verifiers and passes ------------===//

#include "dialects/fsdp/Shapes.h"

#include "llvm/ADT/STLExtras.h"

namespace mlir::fsdp {

std::optional<llvm::SmallVector<int64_t>>
broadcastShapes(llvm::ArrayRef<int64_t> a, llvm::ArrayRef<int64_t> b) {
  size_t rank = std::max(a.size(), b.size());
  llvm::SmallVector<int64_t> out(rank, 1);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      return std::nullopt;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

bool isBroadcastableTo(llvm::ArrayRef<int64_t> from,
                       llvm::ArrayRef<int64_t> to) {
  auto b = broadcastShapes(from, to);
  return b && llvm::ArrayRef<int64_t>(*b) == to;
}

std::optional<llvm::SmallVector<int64_t>>
matmulShape(llvm::ArrayRef<int64_t> lhs, llvm::ArrayRef<int64_t> rhs,
            bool transposeLhs, bool transposeRhs, std::string &why) {
  if (lhs.size() != rhs.size() || (lhs.size() != 2 && lhs.size() != 3)) {
    why = "expected operands of equal rank 2 or 3, found ranks " +
          std::to_string(lhs.size()) + " and " + std::to_string(rhs.size());
    return std::nullopt;
  }
  size_t r = lhs.size();
  if (r == 3 && lhs[0] != rhs[0]) {
    why = "expected equal batch sizes, found " + std::to_string(lhs[0]) +
          " and " + std::to_string(rhs[0]);
    return std::nullopt;
  }
  int64_t m = transposeLhs ? lhs[r - 1] : lhs[r - 2];
  int64_t kl = transposeLhs ? lhs[r - 2] : lhs[r - 1];
  int64_t kr = transposeRhs ? rhs[r - 1] : rhs[r - 2];
  int64_t n = transposeRhs ? rhs[r - 2] : rhs[r - 1];
  if (kl != kr) {
    why = "expected contracting sizes to agree, found " + std::to_string(kl) +
          " (lhs) and " + std::to_string(kr) + " (rhs)";
    return std::nullopt;
  }
  llvm::SmallVector<int64_t> out;
  if (r == 3)
    out.push_back(lhs[0]);
  out.push_back(m);
  out.push_back(n);
  return out;
}

llvm::SmallVector<int64_t> reducedShape(llvm::ArrayRef<int64_t> shape,
                                        llvm::ArrayRef<int64_t> dims) {
  llvm::SmallVector<int64_t> out;
  for (auto [i, d] : llvm::enumerate(shape))
    if (!llvm::is_contained(dims, (int64_t)i))
      out.push_back(d);
  return out;
}

llvm::SmallVector<int64_t> keptShape(llvm::ArrayRef<int64_t> shape,
                                     llvm::ArrayRef<int64_t> dims) {
  llvm::SmallVector<int64_t> out(shape.begin(), shape.end());
  for (int64_t d : dims)
    out[d] = 1;
  return out;
}

std::string shapeStr(llvm::ArrayRef<int64_t> shape) {
  if (shape.empty())
    return "scalar";
  std::string s;
  for (auto [i, d] : llvm::enumerate(shape)) {
    if (i)
      s += "x";
    s += std::to_string(d);
  }
  return s;
}

} // namespace mlir::fsdp
