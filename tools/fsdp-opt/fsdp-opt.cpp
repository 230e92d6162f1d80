//===- fsdp-opt.cpp - the fsdp compiler driver ----------------------------===//
//
// An mlir-opt style driver: parses a model in the fsdp dialect, runs passes
// or the whole pipeline (--fsdp-pipeline), and prints IR or, with the
// pipeline's plan output, writes a plan file for fsdp-run.
//
//===----------------------------------------------------------------------===//

#include "compiler/Pipeline.h"
#include "dialects/fsdp/FsdpOps.h"
#include "passes/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<mlir::fsdp::FsdpDialect, mlir::func::FuncDialect>();
  mlir::fsdp::registerFsdpPasses();
  mlir::fsdp::registerFsdpPipeline();
  mlir::registerCanonicalizerPass();
  mlir::registerCSEPass();
  mlir::registerSymbolDCEPass();
  return mlir::asMainReturnCode(mlir::MlirOptMain(
      argc, argv, "fsdp compiler: model -> sharded training plan\n", registry));
}
