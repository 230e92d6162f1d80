//===- Schedule.cpp - overlap collectives with compute --------------------===//
//
// fsdp-schedule. Algorithm: (1) every collective becomes `async` and an
// fsdp.wait is inserted right before the first op that reads its result
// (all reads go through the wait; a collective nobody reads is waited for
// before the return, so nothing is in flight when the step ends). (2) With
// prefetch, the parameter all-gathers are visited in program order and
// each is moved (with the storage read that feeds it) to just after the
// wait of the previous one: while unit k computes, unit k+1 is on the wire.
// The relative order of all collectives is unchanged (a gather only moves
// up past compute, never past another collective), which keeps the
// cross-rank order identical.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/SmallPtrSet.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPSCHEDULE
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

bool isCollective(Operation *op) {
  return isa<AllGatherOp, ReduceScatterOp, AllReduceOp>(op);
}

struct SchedulePass : mlir::fsdp::impl::FsdpScheduleBase<SchedulePass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto step = getTrainStep(module, "fsdp-shard");
    if (!step)
      return signalPassFailure();
    Block &body = step.getBody().front();
    SmallVector<Operation *> collectives;
    for (Operation &op : body)
      if (isCollective(&op) && !op.hasAttr("async"))
        collectives.push_back(&op);

    OpBuilder b(&getContext());
    DenseMap<Operation *, WaitOp> waitOf;
    for (Operation *c : collectives) {
      c->setAttr("async", b.getUnitAttr());
      Value r = c->getResult(0);
      // The first reader in program order.
      Operation *first = body.getTerminator();
      for (Operation *user : r.getUsers()) {
        Operation *u = body.findAncestorOpInBlock(*user);
        if (u->isBeforeInBlock(first))
          first = u;
      }
      b.setInsertionPoint(first);
      auto wait = b.create<WaitOp>(c->getLoc(), r.getType(), r);
      r.replaceAllUsesExcept(wait.getResult(), wait);
      waitOf[c] = wait;
      ++numAsync;
    }
    int64_t depth = prefetch ? prefetchDepth : 0;
    if (depth < 0) {
      mlir::emitError(module.getLoc())
          << "prefetch-depth must be >= 0, found " << depth;
      return signalPassFailure();
    }
    llvm::SmallPtrSet<Operation *, 16> chained;
    if (depth > 0)
      hoistGathers(collectives, waitOf, depth, chained);
    // In flight at once: one collective, or `depth` parameter all-gathers
    // of one prefetch chain. Each wait moves up to before the collective
    // that would exceed that, if that is issued first. The communication
    // thread runs collectives in order anyway, so this costs no overlap,
    // and it bounds memory: a reduce-scatter's whole-unit gradient buffer
    // is freed before the next unit's is sent (what makes ZeRO-2 save
    // memory).
    for (size_t i = 0; i + 1 < collectives.size(); ++i) {
      size_t limit = i + 1;
      if (chained.contains(collectives[i]))
        while (limit < collectives.size() && int64_t(limit - i) < depth &&
               chained.contains(collectives[limit]))
          ++limit;
      if (limit >= collectives.size())
        continue;
      WaitOp wait = waitOf[collectives[i]];
      Operation *next = collectives[limit];
      if (next->isBeforeInBlock(wait)) {
        // The next collective may read this one's result (e.g. an
        // all-reduce of a reduced value): the wait must stay before it.
        wait->moveBefore(next);
      }
    }
  }

  void hoistGathers(ArrayRef<Operation *> collectives,
                    DenseMap<Operation *, WaitOp> &waitOf, int64_t depth,
                    llvm::SmallPtrSetImpl<Operation *> &chained) {
    // Prefetch: move each parameter all-gather (those reading unit storage)
    // up to just after the wait of the all-gather `depth` before it in the
    // same chain (a run of such gathers between other collectives), or of
    // the collective that starts the chain, if that is earlier.
    SmallVector<Operation *> anchors; // the chain's waits, in order
    Operation *prevGather = nullptr;
    for (Operation *c : collectives) {
      auto gather = dyn_cast<AllGatherOp>(c);
      // The unit's shard, read directly or cast to the compute dtype first
      // (fsdp-mixed-precision): the cast moves with the gather.
      Operation *castOp = gather ? gather.getInput().getDefiningOp<CastOp>()
                                 : nullptr;
      Value shard = castOp ? castOp->getOperand(0)
                           : gather ? gather.getInput() : Value();
      if (!gather || !shard.getDefiningOp<GetUnitOp>() ||
          (castOp && !castOp->hasOneUse())) {
        // Other collectives are barriers for the motion: a gather may not
        // move above one (the order of collectives must not change).
        anchors.assign(1, waitOf[c]);
        prevGather = nullptr;
        continue;
      }
      chained.insert(c);
      Operation *prevWait =
          anchors.empty() ? nullptr
                          : anchors[anchors.size() >= size_t(depth)
                                        ? anchors.size() - depth
                                        : 0];
      // Never above the chain's previous gather: the order of collectives
      // must not change.
      if (prevWait && prevGather && prevWait->isBeforeInBlock(prevGather))
        prevWait = prevGather;
      Operation *read = shard.getDefiningOp();
      if (prevWait && prevWait->isBeforeInBlock(read)) {
        read->moveAfter(prevWait);
        if (castOp) {
          castOp->moveAfter(read);
          gather->moveAfter(castOp);
        } else {
          gather->moveAfter(read);
        }
      }
      anchors.push_back(waitOf[c]);
      prevGather = gather;
    }
  }
};

} // namespace
