//===- Passes.h - the fsdp compiler's passes --------------------*- C++ -*-===//
//
// Declarations generated from Passes.td, and their registration.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_PASSES_H
#define FSDP_PASSES_PASSES_H

#include "dialects/fsdp/FsdpOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

namespace mlir::fsdp {

#define GEN_PASS_DECL
#include "passes/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "passes/Passes.h.inc"

/// Name of the function fsdp-autodiff creates.
constexpr llvm::StringLiteral kTrainStepName = "train_step";

/// The @train_step of `module`; when there is none, reports on the module
/// which passes must run first (`prerequisites`) and returns null.
inline func::FuncOp getTrainStep(ModuleOp module, llvm::StringRef prerequisites) {
  auto step = module.lookupSymbol<func::FuncOp>(kTrainStepName);
  if (!step)
    mlir::emitError(module.getLoc()) << "no @" << kTrainStepName << ": run "
                       << prerequisites << " first";
  return step;
}

} // namespace mlir::fsdp

#endif // FSDP_PASSES_PASSES_H
