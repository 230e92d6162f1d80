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
//    through a chain of forward reshapes, after whose last forward read
//    some forward compute still runs (else the backward reads it at once).
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
  return isa<GetParamOp, GetStateOp, GetUnitOp, MicrobatchOp, ViewOp, ShardViewOp, ReshapeOp,
             WaitOp, AllGatherOp, AllToAllOp, ReduceScatterOp, AllReduceOp, ToHostOp, ToDeviceOp,
             FillOp>(op) ||
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
    if (mode == "false")
      return;
    if (mode != "true") {
      mlir::emitError(module.getLoc())
          << "fsdp-offload-activations: offload-activations='" << mode.getValue()
          << "' must be true or false"
          << (mode == "auto" ? " (auto needs memory-budget: the schedule search decides)"
                             : "");
      return signalPassFailure();
    }
    func::FuncOp step = getTrainStep(module, "fsdp-autodiff");
    if (!step)
      return signalPassFailure();
    Block &body = step.getBody().front();
    // Run once: its copies would look like backward readers to a second run.
    if (llvm::any_of(body, [](Operation &op) { return isa<ToHostOp, ToDeviceOp>(op); })) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload-activations: @train_step already has host copies: run it "
             "once, before fsdp-offload";
      return signalPassFailure();
    }
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

    // A saved value is worth a copy only if forward compute runs after its
    // last forward read: otherwise the backward pass reads it at once (the
    // logits: cross_entropy is the forward's last op, cross_entropy_grad
    // the backward's first), the copy out would be waited for and the copy
    // back issued right there, and the device would hold it all along.
    auto computeFollows = [&](Value v) {
      Operation *last = v.getDefiningOp();
      SmallVector<Value> work{v};
      while (!work.empty()) {
        Value x = work.pop_back_val();
        for (Operation *user : x.getUsers())
          if (forward.contains(user)) {
            if (last->isBeforeInBlock(user))
              last = user;
            if (isa<ReshapeOp>(user))
              work.push_back(user->getResult(0));
          }
      }
      // The loss's scalar tail (fsdp-grad-accum's sum and 1/K scale of
      // the micro-batch losses, marked fsdp.accum) is no compute to hide
      // behind: after the last micro-batch's loss the backward begins.
      for (Operation *op = last->getNextNode(); op && forward.contains(op);
           op = op->getNextNode())
        if (!isNotActivation(op) && !op->hasAttr(kAccumAttrName))
          return true;
      return false;
    };

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
        auto t = dyn_cast<RankedTensorType>(r.getType());
        if (!batch.contains(r) || !t || !isa<FloatType>(t.getElementType()) ||
            bytesOf(t) < minBytes)
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
        if (s.readers.empty() || !computeFollows(r))
          continue;
        saved.push_back(std::move(s));
      }
    }

    // --- 3. Copies. ------------------------------------------------------
    OpBuilder b(&getContext());
    UnitAttr async = overlap ? b.getUnitAttr() : UnitAttr();
    struct Copy {
      ToHostOp toHost;
      ToDeviceOp toDevice;
      Operation *first;  ///< the first non-forward reader
      Operation *ready;  ///< to_device's wait (async), or to_device
    };
    SmallVector<Copy> copies;
    for (Saved &s : saved) {
      Operation *def = s.value.getDefiningOp();
      // The first reader in program order.
      Operation *first = s.readers.front().use->getOwner();
      for (Reader &r : s.readers)
        if (r.use->getOwner()->isBeforeInBlock(first))
          first = r.use->getOwner();
      b.setInsertionPointAfter(def);
      auto toHost = b.create<ToHostOp>(def->getLoc(), s.value.getType(), s.value);
      b.setInsertionPoint(first);
      auto toDevice = b.create<ToDeviceOp>(def->getLoc(), s.value.getType(), toHost);
      Value ready = toDevice;
      if (async) {
        toHost->setAttr("async", async);
        toDevice->setAttr("async", async);
        ready = b.create<WaitOp>(def->getLoc(), toDevice);
      }
      Operation *readyOp = ready.getDefiningOp();
      // Reshape chains rebuilt on the copy, once per distinct chain end.
      DenseMap<Value, Value> rebuilt{{s.value, ready}};
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
      copies.push_back({toHost, toDevice, first, readyOp});
      ++numOffloaded;
    }
    if (!async)
      return;

    // --- 4. Overlap (the copies run on the device's copy stream). -------
    // Device -> host: copy k is waited for right before copy k + D is
    // issued, or before the first non-forward op after it if sooner
    // (the forward pass ends there); until its wait the activation's
    // device buffer stays (the memory plan keeps an async op's input
    // live to its wait). D = 2: two copies overlap the forward compute.
    constexpr size_t kInFlight = 2;
    auto isForwardOrCopy = [&](Operation *op) {
      return forward.contains(op) || isa<ToHostOp, WaitOp>(op);
    };
    SmallVector<WaitOp> hostWaits;
    for (auto [k, c] : llvm::enumerate(copies)) {
      Operation *at = c.toHost->getNextNode();
      while (at && at != body.getTerminator() && isForwardOrCopy(at))
        at = at->getNextNode();
      if (k + kInFlight < copies.size()) {
        Operation *next = copies[k + kInFlight].toHost;
        if (!at || next->isBeforeInBlock(at))
          at = next;
      }
      b.setInsertionPoint(at);
      auto w = b.create<WaitOp>(c.toHost->getLoc(), c.toHost);
      c.toDevice->setOperand(0, w);
      hostWaits.push_back(w);
    }
    // Host -> device, in the order the backward pass reads them: copy j
    // is issued right after the wait of copy j - 1, where the backward
    // starts reading j - 1 (so it runs under that compute), and waited
    // for right before its own first read; never before its device ->
    // host copy's wait.
    SmallVector<size_t> order(copies.size());
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    llvm::stable_sort(order, [&](size_t x, size_t y) {
      return copies[x].first->isBeforeInBlock(copies[y].first);
    });
    for (size_t j = 1; j < order.size(); ++j) {
      Copy &c = copies[order[j]];
      Operation *earlier = copies[order[j - 1]].ready;
      if (hostWaits[order[j]]->isBeforeInBlock(earlier) &&
          earlier->isBeforeInBlock(c.toDevice))
        c.toDevice->moveAfter(earlier);
    }
  }
};

} // namespace
