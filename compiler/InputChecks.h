//===- InputChecks.h - checks on model text before MLIR parses it -*- C++ -*-===//
//
// What fsdp-opt rejects before handing a file to MLIR's parser, shared with
// the compiler's fuzz harness (fuzz/mlir_fuzzer.cpp) so that both accept
// exactly the same inputs.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_COMPILER_INPUTCHECKS_H
#define FSDP_COMPILER_INPUTCHECKS_H

#include "llvm/ADT/StringRef.h"

#include <cstring>

namespace mlir::fsdp {

/// MLIR's parser recurses once per nesting level of an attribute or type,
/// so a hostile file ([[[[...]]]] 100000 deep) overflows the stack. Real
/// models nest a few levels; deeper than this is rejected before parsing.
constexpr int kMaxNesting = 512;

/// Deepest ([{< nesting of MLIR text outside strings and comments, and the
/// line and column where it first exceeds `limit`.
inline int nestingDepth(llvm::StringRef text, int limit, int &line, int &col) {
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

} // namespace mlir::fsdp

#endif // FSDP_COMPILER_INPUTCHECKS_H
