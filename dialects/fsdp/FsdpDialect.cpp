//===- FsdpDialect.cpp - the fsdp dialect ---------------------------------===//

#include "dialects/fsdp/FsdpOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::fsdp;

#include "dialects/fsdp/FsdpDialect.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/fsdp/FsdpAttrs.cpp.inc"

void FsdpDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/fsdp/FsdpOps.cpp.inc"
      >();
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/fsdp/FsdpAttrs.cpp.inc"
      >();
}

LogicalResult MeshAttr::verify(function_ref<InFlightDiagnostic()> emitError, int64_t replicas,
                               int64_t shards, int64_t reshard, int64_t node) {
  if (replicas < 1 || shards < 1)
    return emitError() << "mesh needs replicas >= 1 and shards >= 1, found "
                       << replicas << " x " << shards;
  int64_t world;
  if (__builtin_mul_overflow(replicas, shards, &world))
    return emitError() << "mesh " << replicas << " x " << shards
                       << " overflows";
  if (reshard != 0 && (reshard < 2 || reshard >= shards || shards % reshard))
    return emitError() << "mesh reshard group of " << reshard
                       << " ranks: expected 1 < reshard < shards (" << shards
                       << ") and a divisor of it";
  if (node != 0 && (node < 2 || node >= shards || shards % node))
    return emitError() << "mesh node of " << node << " ranks: expected 1 < node < shards ("
                       << shards << ") and a divisor of it";
  return success();
}

MeshAttr mlir::fsdp::getMesh(Operation *op) {
  auto module = isa<ModuleOp>(op) ? cast<ModuleOp>(op)
                                  : op->getParentOfType<ModuleOp>();
  return module ? module->getAttrOfType<MeshAttr>(kMeshAttrName) : MeshAttr();
}
