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

#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/raw_ostream.h"

#include <cstring>

/// MLIR's parser recurses once per nesting level of an attribute or type,
/// so a hostile file ([[[[...]]]] 100000 deep) overflows the stack. Real
/// models nest a few levels; deeper than this is rejected before parsing.
constexpr int kMaxNesting = 512;

/// Deepest ([{< nesting of MLIR text outside strings and comments, and the
/// line and column where it first exceeds `limit`.
static int nestingDepth(llvm::StringRef text, int limit, int &line, int &col) {
  int depth = 0, worst = 0;
  line = 1, col = 1;
  int curLine = 1, curCol = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    ++curCol;
    if (c == '\n') {
      ++curLine;
      curCol = 0;
      continue;
    }
    if (inString) {
      if (c == '\\')
        ++i, ++curCol;
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i + 1 < text.size() && text[i + 1] != '\n')
        ++i;
    } else if (std::strchr("([{<", c)) {
      if (++depth > worst) {
        worst = depth;
        if (worst == limit + 1)
          line = curLine, col = curCol;
      }
    } else if (std::strchr(")]}", c) || (c == '>' && (i == 0 || text[i - 1] != '-'))) {
      depth = depth > 0 ? depth - 1 : 0;
    }
  }
  return worst;
}

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
    int depth = nestingDepth((*buf)->getBuffer(), kMaxNesting, line, col);
    if (depth > kMaxNesting) {
      llvm::errs() << a << ":" << line << ":" << col << ": error: nesting "
                   << depth << " levels deep (at most " << kMaxNesting
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
