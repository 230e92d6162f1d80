//===- GroupUnits.cpp - auto-wrap policies --------------------------------===//
//
// fsdp-group-units: decides which parameters share an FSDP unit, i.e. are
// gathered and reduce-scattered by one collective. Larger units mean fewer,
// larger collectives (better bandwidth) but more memory held at once;
// the per-layer policy is the usual choice for transformers.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/StringSet.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPGROUPUNITS
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct GroupUnitsPass
    : mlir::fsdp::impl::FsdpGroupUnitsBase<GroupUnitsPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    OpBuilder b(&getContext());
    llvm::StringSet<> units;
    if (layersPerUnit < 1) {
      mlir::emitError(module.getLoc()) << "layers-per-unit must be >= 1";
      return signalPassFailure();
    }
    if (policy == "layer" && layersPerUnit > 1) {
      // Merge K consecutive marked units (in order of first appearance)
      // into one: fewer, larger collectives (a bigger bucket).
      SmallVector<std::string> order;
      llvm::StringMap<int64_t> index;
      for (ParamOp p : module.getOps<ParamOp>())
        if (p.getUnit() && !index.count(*p.getUnit())) {
          index[*p.getUnit()] = order.size();
          order.push_back(p.getUnit()->str());
        }
      auto groupName = [&](int64_t i) {
        int64_t lo = i / layersPerUnit * layersPerUnit;
        int64_t hi = std::min<int64_t>(lo + layersPerUnit, order.size()) - 1;
        return lo == hi ? order[lo] : order[lo] + ".." + order[hi];
      };
      for (ParamOp p : module.getOps<ParamOp>()) {
        if (!p.getUnit()) {
          units.insert("root"); // unmarked: the root unit, as with K = 1
          continue;
        }
        std::string name = groupName(index[*p.getUnit()]);
        p.setUnitAttr(b.getStringAttr(name));
        units.insert(name);
      }
    } else if (policy == "layer") {
      for (ParamOp p : module.getOps<ParamOp>())
        units.insert(p.getUnit() ? *p.getUnit() : StringRef("root"));
    } else if (policy == "none") {
      for (ParamOp p : module.getOps<ParamOp>())
        p.setUnitAttr(b.getStringAttr("root"));
      units.insert("root");
    } else if (policy == "size") {
      if (minUnitNumel <= 0) {
        mlir::emitError(module.getLoc()) << "min-unit-numel must be positive";
        return signalPassFailure();
      }
      int64_t group = 0, filled = 0;
      for (ParamOp p : module.getOps<ParamOp>()) {
        std::string name = "group." + std::to_string(group);
        p.setUnitAttr(b.getStringAttr(name));
        units.insert(name);
        filled += p.getTensorType().getNumElements();
        if (filled >= minUnitNumel) {
          ++group;
          filled = 0;
        }
      }
    } else {
      mlir::emitError(module.getLoc()) << "unknown unit policy '" << policy
                         << "': expected layer, size or none";
      return signalPassFailure();
    }
    numUnits = units.size();
  }
};

} // namespace
