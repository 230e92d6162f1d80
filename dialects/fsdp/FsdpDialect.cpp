//===- FsdpDialect.cpp - the fsdp dialect ---------------------------------===//

#include "dialects/fsdp/FsdpOps.h"

using namespace mlir;
using namespace mlir::fsdp;

#include "dialects/fsdp/FsdpDialect.cpp.inc"

void FsdpDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/fsdp/FsdpOps.cpp.inc"
      >();
}
