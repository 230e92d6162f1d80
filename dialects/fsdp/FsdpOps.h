//===- FsdpOps.h - the fsdp dialect and its operations ----------*- C++ -*-===//
//
// Declares the fsdp dialect and the ops generated from FsdpOps.td.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_DIALECTS_FSDP_FSDPOPS_H
#define FSDP_DIALECTS_FSDP_FSDPOPS_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/fsdp/FsdpDialect.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/fsdp/FsdpAttrs.h.inc"

#define GET_OP_CLASSES
#include "dialects/fsdp/FsdpOps.h.inc"

namespace mlir::fsdp {
/// Name of the unit attribute that marks the model function.
constexpr llvm::StringLiteral kModelAttrName = "fsdp.model";
/// Name of the function argument attribute that gives an input its role
/// ("input", "target", "lr", "step").
constexpr llvm::StringLiteral kRoleAttrName = "fsdp.role";
/// The module attribute (a MeshAttr) fsdp-shard records the mesh in.
constexpr llvm::StringLiteral kMeshAttrName = "fsdp.mesh";
/// The mesh of the module holding `op` (or `op` itself); null before
/// fsdp-shard ran.
MeshAttr getMesh(Operation *op);
} // namespace mlir::fsdp

#endif // FSDP_DIALECTS_FSDP_FSDPOPS_H
