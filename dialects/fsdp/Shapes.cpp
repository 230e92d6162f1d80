//===- Shapes.cpp - shape rules shared by verifiers and passes ------------===//
//
// The rules are runtime/core/ShapeRules.h's, which the runtime's load-time
// checks read too; here they take and return LLVM's shape types.
//
//===----------------------------------------------------------------------===//

#include "dialects/fsdp/Shapes.h"

#include "runtime/core/ShapeRules.h"

namespace mlir::fsdp {

namespace rules = ::fsdp::shapes;

static llvm::SmallVector<int64_t> small(const std::vector<int64_t> &v) {
  return llvm::SmallVector<int64_t>(v.begin(), v.end());
}

std::optional<llvm::SmallVector<int64_t>>
broadcastShapes(llvm::ArrayRef<int64_t> a, llvm::ArrayRef<int64_t> b) {
  std::vector<int64_t> out;
  if (!rules::broadcast(a, b, out))
    return std::nullopt;
  return small(out);
}

bool isBroadcastableTo(llvm::ArrayRef<int64_t> from,
                       llvm::ArrayRef<int64_t> to) {
  auto b = broadcastShapes(from, to);
  return b && llvm::ArrayRef<int64_t>(*b) == to;
}

std::optional<llvm::SmallVector<int64_t>>
matmulShape(llvm::ArrayRef<int64_t> lhs, llvm::ArrayRef<int64_t> rhs,
            bool transposeLhs, bool transposeRhs, std::string &why) {
  rules::Matmul d;
  if (!rules::matmul(lhs, rhs, transposeLhs, transposeRhs, d, why))
    return std::nullopt;
  return small(d.result());
}

llvm::SmallVector<int64_t> reducedShape(llvm::ArrayRef<int64_t> shape,
                                        llvm::ArrayRef<int64_t> dims) {
  return small(rules::reduced(shape, dims));
}

llvm::SmallVector<int64_t> keptShape(llvm::ArrayRef<int64_t> shape,
                                     llvm::ArrayRef<int64_t> dims) {
  return small(rules::kept(shape, dims));
}

std::string shapeStr(llvm::ArrayRef<int64_t> shape) { return rules::name(shape); }

} // namespace mlir::fsdp
