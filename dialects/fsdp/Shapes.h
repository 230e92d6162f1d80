//===- Shapes.h - shape rules shared by verifiers and passes ----*- C++ -*-===//
//
// The shape algebra of the dialect in one place: NumPy broadcasting, matmul
// result shapes, reductions. Verifiers use it to check ops; autodiff uses it
// to build the types of gradient ops.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_DIALECTS_FSDP_SHAPES_H
#define FSDP_DIALECTS_FSDP_SHAPES_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include <cstdint>
#include <optional>
#include <string>

namespace mlir::fsdp {

/// NumPy broadcast of two shapes, or nullopt when they are incompatible.
std::optional<llvm::SmallVector<int64_t>>
broadcastShapes(llvm::ArrayRef<int64_t> a, llvm::ArrayRef<int64_t> b);

/// True when `from` broadcasts to exactly `to`.
bool isBroadcastableTo(llvm::ArrayRef<int64_t> from, llvm::ArrayRef<int64_t> to);

/// The result shape of matmul, or nullopt with `why` set.
std::optional<llvm::SmallVector<int64_t>>
matmulShape(llvm::ArrayRef<int64_t> lhs, llvm::ArrayRef<int64_t> rhs,
            bool transposeLhs, bool transposeRhs, std::string &why);

/// Shape after dropping `dims` (which must be valid and distinct).
llvm::SmallVector<int64_t> reducedShape(llvm::ArrayRef<int64_t> shape,
                                        llvm::ArrayRef<int64_t> dims);

/// `shape` with each of `dims` set to 1 (keep-dims form of a reduction).
llvm::SmallVector<int64_t> keptShape(llvm::ArrayRef<int64_t> shape,
                                     llvm::ArrayRef<int64_t> dims);

/// "4x8" for diagnostics.
std::string shapeStr(llvm::ArrayRef<int64_t> shape);

} // namespace mlir::fsdp

#endif // FSDP_DIALECTS_FSDP_SHAPES_H
