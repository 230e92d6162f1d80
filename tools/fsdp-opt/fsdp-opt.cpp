//===- fsdp-opt.cpp - the fsdp compiler driver ----------------------------===//
//
// An mlir-opt style driver: parses a model in the fsdp dialect, runs passes
// or the whole pipeline (--fsdp-pipeline), and prints IR or, with the
// pipeline's plan output, writes a plan file for fsdp-run.
//
//===----------------------------------------------------------------------===//

#include "compiler/InputChecks.h"
#include "compiler/Pipeline.h"
#include "dialects/fsdp/FsdpOps.h"
#include "passes/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/raw_ostream.h"

#include <cstring>

/// Checks the input files named on the command line (arguments that are
/// not options or the value of -o); stdin is not pre-scanned.
static bool inputsNestSanely(int argc, char **argv) {
  for (int i = 1; i < argc; ++i) {
    llvm::StringRef a = argv[i];
    if (a.starts_with("-") || (i > 1 && llvm::StringRef(argv[i - 1]) == "-o"))
      continue;
    auto buf = llvm::MemoryBuffer::getFile(a);
    if (!buf)
      continue; // MlirOptMain reports unreadable files itself
    int line, col;
    int depth = mlir::fsdp::nestingDepth((*buf)->getBuffer(), mlir::fsdp::kMaxNesting, line, col);
    if (depth > mlir::fsdp::kMaxNesting) {
      llvm::errs() << a << ":" << line << ":" << col << ": error: nesting "
                   << depth << " levels deep (at most " << mlir::fsdp::kMaxNesting
                   << " accepted)\n";
      return false;
    }
  }
  return true;
}

int main(int argc, char **argv) {
  if (!inputsNestSanely(argc, argv))
    return 1;
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
