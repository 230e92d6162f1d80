//===- OffloadActivations.cpp - saved activations in host memory ----------===//
//
// fsdp-offload-activations: the activations the forward pass saves for the
// backward pass wait in the host arena (see Passes.td).
//
// Algorithm.
// 1. Forward ops: the ops the returned loss depends on (its backward slice
//    in @train_step's block). Batch-dependent values: the arguments whose
//    fsdp.role is input or target, and every result of a forward op with
//    a batch-dependent operand (program order).
// 2. A saved activation is a batch-dependent result of a forward compute
//    op (not a storage read, view, reshape, collective, wait, copy or
//    host op) of at least min-bytes, read by a non-forward op directly or
//    through a chain of forward reshapes.
// 3. Rewrite, per saved activation v: `to_host v` right after v's
//    definition; one `to_device` right before the first non-forward reader
//    (of v or of a reshape of it), which every non-forward reader then
//    reads, through a clone of its reshape chain built on the copy where
//    it read a reshape. Forward readers keep reading v, so v's device
//    buffer dies at its last forward read (or the to_host copy).
//
// Why after the schedule and the fusion: the positions are final, so "the
// first backward read" is the one the runtime executes; fsdp-offload (the
// optimizer's) already treats to_host results as host values and skips
// to_device copies, so the two compose in either order.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPOFFLOADACTIVATIONS
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

/// Ops whose results are not activations of their own: storage reads and
/// names of other memory, communication, copies, constants.
bool isNotActivation(Operation *op) {
  return isa<GetParamOp, GetStateOp, GetUnitOp, MicrobatchOp, ViewOp, ShardViewOp,
             ReshapeOp, WaitOp, AllGatherOp, ReduceScatterOp, AllReduceOp, ToHostOp,
             ToDeviceOp, FillOp>(op) ||
         op->hasAttr(kOnHostAttrName);
}

int64_t bytesOf(Type t) {
  auto rt = dyn_cast<RankedTensorType>(t);
  if (!rt || !rt.hasStaticShape())
    return 0;
  return rt.getNumElements() * std::max<int64_t>(1, rt.getElementTypeBitWidth() / 8);
}

struct OffloadActivationsPass
    : mlir::fsdp::impl::FsdpOffloadActivationsBase<OffloadActivationsPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    func::FuncOp step = getTrainStep(module, "fsdp-autodiff");
    if (!step)
      return signalPassFailure();
    Block &body = step.getBody().front();
    auto ret = cast<func::ReturnOp>(body.getTerminator());
    if (ret.getNumOperands() == 0)
      return;

    // --- 1. Forward ops and batch-dependent values. ----------------------
    DenseSet<Operation *> forward;
    SmallVector<Operation *> work;
    if (Operation *d = ret.getOperand(0).getDefiningOp())
      work.push_back(d);
    while (!work.empty()) {
      Operation *op = work.pop_back_val();
      if (op->getBlock() != &body || !forward.insert(op).second)
        continue;
      for (Value v : op->getOperands())
        if (Operation *d = v.getDefiningOp())
          work.push_back(d);
    }
    DenseSet<Value> batch;
    for (BlockArgument arg : step.getArguments())
      if (auto r = step.getArgAttrOfType<StringAttr>(arg.getArgNumber(), kRoleAttrName);
          r && (r.getValue() == "input" || r.getValue() == "target"))
        batch.insert(arg);
    for (Operation &op : body)
      if (forward.contains(&op) &&
          llvm::any_of(op.getOperands(), [&](Value v) { return batch.contains(v); }))
        for (Value r : op.getResults())
          batch.insert(r);

    // --- 2. Saved activations and their non-forward readers. -------------
    // A reader is an operand slot; `chain` the forward reshapes between v
    // and it, outermost last.
    struct Reader {
      OpOperand *use;
      SmallVector<ReshapeOp> chain;
    };
    struct Saved {
      Value value;
      SmallVector<Reader> readers;
    };
    SmallVector<Saved> saved;
    for (Operation &op : body) {
      if (!forward.contains(&op) || isNotActivation(&op))
        continue;
      for (Value r : op.getResults()) {
        if (!batch.contains(r) || bytesOf(r.getType()) < minBytes)
          continue;
        Saved s{r, {}};
        std::function<void(Value, SmallVector<ReshapeOp> &)> collect =
            [&](Value v, SmallVector<ReshapeOp> &chain) {
              for (OpOperand &use : v.getUses()) {
                Operation *user = use.getOwner();
                if (forward.contains(user)) {
                  if (auto rs = dyn_cast<ReshapeOp>(user)) {
                    chain.push_back(rs);
                    collect(rs.getResult(), chain);
                    chain.pop_back();
                  }
                  continue;
                }
                s.readers.push_back({&use, chain});
              }
            };
        SmallVector<ReshapeOp> chain;
        collect(r, chain);
        if (!s.readers.empty())
          saved.push_back(std::move(s));
      }
    }

    // --- 3. Copies. ------------------------------------------------------
    OpBuilder b(&getContext());
    for (Saved &s : saved) {
      Operation *def = s.value.getDefiningOp();
      // The first reader in program order.
      Operation *first = s.readers.front().use->getOwner();
      for (Reader &r : s.readers)
        if (r.use->getOwner()->isBeforeInBlock(first))
          first = r.use->getOwner();
      if (!def->isBeforeInBlock(first))
        continue; // (a reader before the definition cannot happen in SSA)
      b.setInsertionPointAfter(def);
      Value host = b.create<ToHostOp>(def->getLoc(), s.value.getType(), s.value);
      b.setInsertionPoint(first);
      Value dev = b.create<ToDeviceOp>(def->getLoc(), s.value.getType(), host);
      // Reshape chains rebuilt on the copy, once per distinct chain end.
      DenseMap<Value, Value> rebuilt{{s.value, dev}};
      for (Reader &r : s.readers) {
        Value cur = s.value;
        for (ReshapeOp rs : r.chain) {
          Value &clone = rebuilt[rs.getResult()];
          if (!clone) {
            IRMapping map;
            map.map(cur, rebuilt.lookup(cur));
            b.setInsertionPoint(first);
            clone = b.clone(*rs, map)->getResult(0);
          }
          cur = rs.getResult();
        }
        r.use->set(rebuilt.lookup(cur));
      }
      ++numOffloaded;
    }
  }
};

} // namespace
