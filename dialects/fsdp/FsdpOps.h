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

#define GET_OP_CLASSES
#include "dialects/fsdp/FsdpOps.h.inc"

namespace mlir::fsdp {
/// Name of the unit attribute that marks the model function.
constexpr llvm::StringLiteral kModelAttrName = "fsdp.model";
/// Name of the function argument attribute that gives an input its role
/// ("input", "target", "lr", "step").
constexpr llvm::StringLiteral kRoleAttrName = "fsdp.role";
} // namespace mlir::fsdp

#endif // FSDP_DIALECTS_FSDP_FSDPOPS_H
