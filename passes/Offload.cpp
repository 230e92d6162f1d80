//===- Offload.cpp - optimizer offload to the host ------------------------===//
//
// fsdp-offload: ZeRO-Offload. The master shard of every trainable sharded
// unit and its optimizer state move to host memory, the unit's update runs
// on the host, and copies join the two sides (see Passes.td).
//
// Placement. A value is on the host when it is
// - a read (fsdp.get_unit / get_state) of offloaded storage,
// - the result of fsdp.to_host or of an op marked fsdp.on_host,
// - an alias (view, reshape, shard_view, wait) of a host value;
// everything else is on the device. The pass walks @train_step once:
// a host op gets a to_host copy of each device operand (one per value,
// reused by later host ops: the learning rate is copied once), and a
// device instruction gets a to_device copy of each host operand right
// before it (one per reading op: the gathered-again shard of the backward
// pass is copied again, so nothing on the device outlives its use). Then
// each gradient's copy moves up to where the gradient is final (step 3).
//
//===----------------------------------------------------------------------===//

#include "passes/MemoryPlan.h"
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/StringSet.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPOFFLOAD
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

/// Ops that only name memory another value owns (no instruction).
bool isAliasOp(Operation *op) {
  return isa<ViewOp, ReshapeOp, ShardViewOp, WaitOp, MicrobatchOp>(op);
}

struct OffloadPass : mlir::fsdp::impl::FsdpOffloadBase<OffloadPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (nvmeUnits >= 0 && !nvme) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: nvme-units=" << nvmeUnits.getValue()
          << " keeps part of the optimizer state on disk: it needs nvme (offload-nvme=true)";
      return signalPassFailure();
    }
    if (nvmeParams && !nvme) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: nvme-params puts the master shards in the swap file with the "
             "optimizer state: it needs nvme (offload-nvme=true)";
      return signalPassFailure();
    }
    if (mode == "none") {
      if (nvme) {
        mlir::emitError(module.getLoc())
            << "fsdp-offload: nvme keeps the offloaded optimizer state in a swap file: it "
               "needs offload=optimizer or all";
        return signalPassFailure();
      }
      return;
    }
    if (mode != "optimizer" && mode != "all") {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: offload='" << mode.getValue() << "' must be none, optimizer or all"
          << (mode == "auto" ? " (auto needs memory-budget: the schedule search decides)" : "");
      return signalPassFailure();
    }
    if (nextStep && !overlap) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: next-step joins the async host updates in the next step: "
             "it needs overlap";
      return signalPassFailure();
    }
    if (nvme && (nvmeInFlight < 1 || nvmeInFlight > 8)) {
      mlir::emitError(module.getLoc()) << "fsdp-offload: nvme-in-flight=" << nvmeInFlight.getValue()
                                       << " must be 1 to 8 (the async updates in flight at once)";
      return signalPassFailure();
    }
    if (nvme && nvmeReadAhead > 8) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: nvme-read-ahead=" << nvmeReadAhead.getValue()
          << " must be 0 to 8 (the updates on disk ahead of its own each update's state is "
             "read)";
      return signalPassFailure();
    }
    if (prefetch && (prefetchDepth < 1 || prefetchDepth > 8)) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: prefetch-depth=" << prefetchDepth.getValue()
          << " must be 1 to 8 (the copies to the device in flight at once)";
      return signalPassFailure();
    }
    if (nvme && nextStep && warnings)
      // Correct, but the host arena keeps every update's operands through
      // the step (next-step), the staging copies included: nvme then saves
      // no host memory and adds the file's traffic.
      mlir::emitWarning(module.getLoc())
          << "fsdp-offload: with next-step every update's staging copy of its state is live "
             "through the whole step, so nvme saves no host memory here (it still trains the "
             "same)";
    func::FuncOp step = getTrainStep(module, "fsdp-autodiff and fsdp-shard");
    if (!step)
      return signalPassFailure();

    // 1. Which storage moves: trainable units whose shard is their storage
    // and, with `all`, every frozen unit's storage (its shard at stage 3,
    // else the whole unit): read only, it is copied to the device before
    // each use like a trainable shard, and has no update.
    llvm::StringSet<> host;
    int64_t units = 0, trainable = 0;
    for (UnitOp u : module.getOps<UnitOp>()) {
      ++units;
      bool frozenToo = mode == "all" && u.getFrozen();
      if (!frozenToo && (!u.getSharded() || u.getFrozen()))
        continue;
      u.setOffloaded(true);
      host.insert(u.getSymName());
      trainable += !u.getFrozen();
    }
    if (!trainable) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: offload=optimizer needs trainable units with "
             "sharded storage ("
          << units
          << " unit(s), none sharded and trainable): use stage=3, or stage "
             "1/2 on more than one shard with fsdp-shard's offload=optimizer";
      return signalPassFailure();
    }
    // With nvme, how many units' state goes to the swap file (step 7).
    llvm::SmallVector<StringRef> trainableUnits;
    for (UnitOp u : module.getOps<UnitOp>())
      if (u.getOffloaded() && !u.getFrozen())
        trainableUnits.push_back(u.getSymName());
    const int64_t diskUnits = nvmeUnits < 0 ? int64_t(trainableUnits.size()) : int64_t(nvmeUnits);
    if (nvme && (diskUnits < 1 || diskUnits > int64_t(trainableUnits.size()))) {
      mlir::emitError(module.getLoc())
          << "fsdp-offload: nvme-units=" << nvmeUnits.getValue() << " must be 1 to "
          << trainableUnits.size()
          << " (the offloaded trainable units whose state goes to the swap file), or -1 for all";
      return signalPassFailure();
    }
    for (StateOp s : module.getOps<StateOp>())
      if (host.contains(s.getParam()))
        host.insert(s.getSymName());

    // 2. Walk the step in order, placing every value.
    Block &body = step.getBody().front();
    llvm::DenseSet<Value> onHost;
    llvm::DenseMap<Value, Value> hostCopy; // device value -> its to_host
    SmallVector<ToHostOp> gradCopies;
    SmallVector<ToDeviceOp> storageCopies; // the copies this run placed
    OpBuilder b(&getContext());
    auto isUpdate = [](Operation *op) {
      return isa<AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambNormsOp, LambUpdateOp>(op);
    };
    for (Operation &opRef : llvm::make_early_inc_range(body)) {
      Operation *op = &opRef;
      if (FlatSymbolRefAttr sym =
              op->getNumResults() == 1 ? storageRead(op->getResult(0)) : nullptr) {
        if (host.contains(sym.getValue()))
          onHost.insert(op->getResult(0));
        continue;
      }
      // Copies already placed (the memory-budget search runs this pass on
      // its candidates, the pipeline once more on the one it chose).
      if (isa<ToHostOp>(op)) {
        onHost.insert(op->getResult(0));
        continue;
      }
      if (isa<ToDeviceOp>(op))
        continue;
      if (isAliasOp(op)) {
        if (onHost.contains(op->getOperand(0)))
          for (Value r : op->getResults())
            onHost.insert(r);
        continue;
      }
      if (isa<SetUnitOp, SetStateOp, SetParamOp, SetGradOp, func::ReturnOp>(op))
        continue; // write-backs are checked by fsdp-plan-memory
      bool hostOp = isUpdate(op) && onHost.contains(op->getOperand(0));
      if (hostOp) {
        op->setAttr(kOnHostAttrName, b.getUnitAttr());
        for (OpOperand &use : op->getOpOperands()) {
          Value v = use.get();
          if (onHost.contains(v))
            continue;
          Value &copy = hostCopy[v];
          if (!copy) {
            b.setInsertionPoint(op);
            copy = b.create<ToHostOp>(op->getLoc(), v.getType(), v);
            onHost.insert(copy);
            ++numCopies;
            if (use.getOperandNumber() == 1) // the gradient
              gradCopies.push_back(copy.getDefiningOp<ToHostOp>());
          }
          use.set(copy);
        }
        for (Value r : op->getResults())
          onHost.insert(r);
        continue;
      }
      // A device instruction: a copy of each host operand, just before it.
      llvm::DenseMap<Value, Value> copies;
      for (OpOperand &use : op->getOpOperands()) {
        Value v = use.get();
        if (!onHost.contains(v))
          continue;
        Value &copy = copies[v];
        if (!copy) {
          b.setInsertionPoint(op);
          copy = b.create<ToDeviceOp>(op->getLoc(), v.getType(), v);
          storageCopies.push_back(copy.getDefiningOp<ToDeviceOp>());
          ++numCopies;
        }
        use.set(copy);
      }
    }

    // 3. Gradients leave the device as soon as they are final (ZeRO-
    // Offload copies each bucket during the backward pass), when nothing
    // else on the device reads them: the copy moves up to right after the
    // gradient's definition. A gradient the schedule waits for only at its
    // update (an async reduce-scatter or all-reduce) is waited for right
    // before the next collective of its kind is issued instead: by then a
    // unit's backward ran since it was issued, and its packed input and
    // its shard are freed there rather than at the end of the step.
    for (ToHostOp copy : gradCopies) {
      Value g = copy.getInput();
      Operation *def = g.getDefiningOp();
      if (!def || !g.hasOneUse())
        continue;
      if (auto wait = dyn_cast<WaitOp>(def)) {
        Operation *c = wait.getInput().getDefiningOp();
        if (!c)
          continue;
        auto group = c->getAttr("group");
        for (Operation *next = c->getNextNode(); next && next != wait;
             next = next->getNextNode())
          if (next->getName() == c->getName() && next->getAttr("group") == group) {
            wait->moveBefore(next);
            break;
          }
      }
      copy->moveAfter(def);
    }

    // 4. Overlap: each update runs beside the rest of the step.
    if (overlap)
      overlapUpdates(body);
    // 5. Next step: the updates run on beside the next step's forward.
    if (nextStep)
      carryUpdates(module, body);
    // 6. Prefetch: the copies to the device run ahead on the copy stream.
    if (prefetch)
      prefetchCopies(body, storageCopies);
    // 7. ZeRO-Infinity: the state of the first `diskUnits` units the step
    // updates (all by default; the first have the most of the backward
    // pass left to hide their swaps behind) lives in the swap file, each
    // update reading and writing it through a staging buffer
    // (fsdp-plan-memory). Their order: that of their updates, now that
    // these have moved up to where their gradients are final.
    if (nvme)
      placeOnDisk(module, body, trainableUnits, diskUnits);
  }

  void placeOnDisk(ModuleOp module, Block &body, ArrayRef<StringRef> trainableUnits,
                   int64_t diskUnits) {
    llvm::StringSet<> trainable, seen, onDisk;
    for (StringRef u : trainableUnits)
      trainable.insert(u);
    // The unit an update writes: its new parameters' write-back, through
    // the update's wait.
    auto unitOf = [&](Operation *update) -> StringRef {
      for (Operation *u : update->getResult(0).getUsers()) {
        if (isa<WaitOp>(u))
          for (Operation *w : u->getUsers())
            if (isa<SetUnitOp>(w))
              return storageWrite(w).first;
        if (isa<SetUnitOp>(u))
          return storageWrite(u).first;
      }
      return StringRef();
    };
    SmallVector<StringRef> order;
    for (Operation &op : body)
      if (isa<AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambUpdateOp>(op))
        if (StringRef sym = unitOf(&op); trainable.contains(sym) && seen.insert(sym).second)
          order.push_back(sym);
    for (StringRef u : trainableUnits) // (any not written back: last)
      if (seen.insert(u).second)
        order.push_back(u);
    for (StringRef u : ArrayRef<StringRef>(order).take_front(diskUnits))
      onDisk.insert(u);
    for (StateOp s : module.getOps<StateOp>())
      if (onDisk.contains(s.getParam()))
        s->setAttr(kNvmeAttrName, UnitAttr::get(&getContext()));
    // ZeRO-Infinity's offload_param: those units' master shards too, and
    // every offloaded frozen unit's storage (read only: its copies to the
    // device are its only readers).
    if (nvmeParams)
      for (UnitOp u : module.getOps<UnitOp>())
        if (u.getOffloaded() && (onDisk.contains(u.getSymName()) || u.getFrozen()))
          u->setAttr(kNvmeAttrName, UnitAttr::get(&getContext()));
    // Where each read starts (fsdp-plan-memory places it).
    module->setAttr(kNvmeReadAheadAttrName,
                    IntegerAttr::get(IntegerType::get(&getContext(), 64), nvmeReadAhead));
  }

  /// The storage symbol `v` reads, through views of it.
  static FlatSymbolRefAttr readsSymbol(Value v) {
    while (Operation *d = v.getDefiningOp()) {
      if (!isa<ViewOp, ShardViewOp, ReshapeOp>(d))
        break;
      v = d->getOperand(0);
    }
    return storageRead(v);
  }

  /// Ops an update may take along when it moves up: storage reads, views
  /// of them, and copies to the host of what is defined earlier.
  static bool isMovable(Operation *op) {
    return isa<GetUnitOp, GetStateOp, GetParamOp, ViewOp, ShardViewOp, ReshapeOp, ToHostOp>(op);
  }

  /// Widens `after` to the latest op in `body` that `v` needs before it:
  /// its definition, or for a movable one what that needs in turn.
  static void needs(Value v, Block &body, Operation *&after) {
    Operation *d = v.getDefiningOp();
    if (!d || d->getBlock() != &body)
      return;
    if (isMovable(d)) {
      for (Value o : d->getOperands())
        needs(o, body, after);
      return;
    }
    if (!after || after->isBeforeInBlock(d))
      after = d;
  }

  /// Moves the movable definitions `op` reads (operands first) right
  /// before it where they come after it.
  static void bringBefore(Operation *op, Block &body) {
    for (Value v : op->getOperands()) {
      Operation *d = v.getDefiningOp();
      if (!d || d->getBlock() != &body || !isMovable(d) || d->isBeforeInBlock(op))
        continue;
      d->moveBefore(op);
      bringBefore(d, body);
    }
  }

  /// Moves update `op` up to right after the latest of its operands'
  /// definitions and of the ops that still read the storage it overwrites
  /// in place (first in the block if none), with the movable definitions
  /// it reads.
  static void hoist(Operation *op, Block &body) {
    // The symbols it writes back in place.
    llvm::SmallDenseSet<StringRef> written = writtenBy(op);
    Operation *after = nullptr;
    for (Value v : op->getOperands())
      needs(v, body, after);
    // Nothing between its new place and its old one may read what it
    // overwrites.
    moveUp(op, body, after, [&](Operation *o) {
      return llvm::any_of(o->getOperands(), [&](Value v) {
        FlatSymbolRefAttr sym = readsSymbol(v);
        return sym && written.contains(sym.getValue());
      });
    });
  }

  /// Moves `op` up to right after `after` (the top of `body` if null), or
  /// only to right after the latest op between the two that `stops`, with
  /// the movable definitions it reads.
  static void moveUp(Operation *op, Block &body, Operation *after,
                     llvm::function_ref<bool(Operation *)> stops) {
    for (Operation *o = op->getPrevNode(); o && o != after; o = o->getPrevNode())
      if (stops(o)) {
        after = o;
        break;
      }
    if (!after)
      op->moveBefore(&body.front());
    else if (after->isBeforeInBlock(op))
      op->moveAfter(after);
    bringBefore(op, body);
  }

  /// Step 4: each host update (not LAMB's norms: the device reads them at
  /// once) moves up to right after the latest of its operands' definitions
  /// and of the ops that still read the storage it overwrites in place, is
  /// marked async, and is waited for right before the next async update
  /// (the last one before the terminator). With nvme, right before the one
  /// after the next: two updates in flight, so the next one's state is read
  /// from the swap file while this one runs and is written back ([Note:
  /// swap pipeline] in runtime/core/Executor.cpp; a waited-for update would
  /// leave the drive idle during every update and the host thread idle
  /// during every swap), at the cost of one more update's staging buffers
  /// and gradient copy in the host arena.
  void overlapUpdates(Block &body) {
    SmallVector<Operation *> updates;
    for (Operation &op : body)
      if (op.hasAttr(kOnHostAttrName) && !op.hasAttr("async") &&
          isa<AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambUpdateOp>(op))
        updates.push_back(&op);
    if (updates.empty())
      return;
    OpBuilder b(&getContext());
    for (Operation *op : updates) {
      hoist(op, body);
      op->setAttr("async", b.getUnitAttr());
      ++numAsync;
    }
    // Joins: in program order, each before the next async update (with
    // nvme the one after it) or the first instruction reading one of its
    // results (write-backs are no instruction), the last before the
    // terminator.
    llvm::sort(updates, [](Operation *a, Operation *b) { return a->isBeforeInBlock(b); });
    const size_t inFlight = nvme ? nvmeInFlight : 1;
    for (size_t k = 0; k < updates.size(); ++k) {
      Operation *op = updates[k];
      Operation *before =
          k + inFlight < updates.size() ? updates[k + inFlight] : body.getTerminator();
      for (Value r : op->getResults())
        for (Operation *u : r.getUsers()) {
          if (storageWrite(u).second || u->getBlock() != &body)
            continue;
          if (u->isBeforeInBlock(before))
            before = u;
        }
      b.setInsertionPoint(before);
      Value p = op->getResult(0);
      auto wait = b.create<WaitOp>(op->getLoc(), p.getType(), p);
      p.replaceUsesWithIf(wait.getResult(), [&](OpOperand &use) {
        Operation *u = use.getOwner();
        return u != wait && u->getBlock() == &body && wait->isBeforeInBlock(u);
      });
    }
  }

  /// Step 5: an async update whose results only the write-backs read (and
  /// whose storage nothing after it in the step reads) is joined in the
  /// next step instead: its wait becomes `fsdp.wait {carried}` on a read
  /// of its unit's storage, right before the first op of the step that
  /// reads storage it writes or defines one of its operands. What a
  /// previous run of the pass carried has no in-step wait and stays.
  void carryUpdates(ModuleOp module, Block &body) {
    SmallVector<std::pair<Operation *, Operation *>> carried; // update, its join
    SmallVector<Operation *> updates;
    for (Operation &op : body)
      if (op.hasAttr(kOnHostAttrName) && op.hasAttr("async"))
        updates.push_back(&op);
    OpBuilder b(&getContext());
    for (Operation *op : updates) {
      Value p = op->getResult(0);
      SmallVector<WaitOp> waits;
      llvm::SmallDenseSet<StringRef> written;
      StringRef unit;
      bool onlyWriteBacks = true;
      for (Value r : op->getResults())
        for (Operation *u : r.getUsers()) {
          auto wait = dyn_cast<WaitOp>(u);
          if (wait && r == p) {
            waits.push_back(wait);
            for (Operation *w : wait->getUsers())
              onlyWriteBacks &= storageWrite(w).second != nullptr;
            continue;
          }
          auto [sym, v] = storageWrite(u);
          onlyWriteBacks &= v != nullptr;
          if (v)
            written.insert(sym);
          if (v && r == p)
            unit = sym;
        }
      for (WaitOp w : waits)
        for (Operation *u : w->getUsers())
          if (auto [sym, v] = storageWrite(u); v) {
            written.insert(sym);
            unit = sym;
          }
      if (waits.empty() || !onlyWriteBacks || unit.empty() || !module.lookupSymbol<UnitOp>(unit))
        continue;
      // Nothing after it in the step may read what it writes.
      auto readsWritten = [&](Operation *o) {
        return llvm::any_of(o->getOperands(), [&](Value v) {
          FlatSymbolRefAttr sym = readsSymbol(v);
          return sym && written.contains(sym.getValue());
        });
      };
      bool readAfter = false;
      for (Operation *o = op->getNextNode(); o && !readAfter; o = o->getNextNode())
        readAfter = !isa<WaitOp>(o) && !storageWrite(o).second && readsWritten(o);
      if (readAfter)
        continue;
      // Where the next step needs it done: the first op reading what it
      // writes or defining one of its operands (it reads its unit itself).
      llvm::SmallPtrSet<Operation *, 8> defs;
      for (Value v : op->getOperands())
        if (Operation *d = v.getDefiningOp())
          defs.insert(d);
      Operation *at = op;
      for (Operation &o : body) {
        if (&o == op || defs.contains(&o) || readsWritten(&o)) {
          at = &o;
          break;
        }
      }
      for (WaitOp w : waits) {
        w.getResult().replaceAllUsesWith(p);
        w.erase();
      }
      b.setInsertionPoint(at);
      auto read =
          b.create<GetUnitOp>(op->getLoc(), module.lookupSymbol<UnitOp>(unit).getStorageType(),
                              FlatSymbolRefAttr::get(&getContext(), unit));
      auto join = b.create<WaitOp>(op->getLoc(), read.getType(), read);
      join->setAttr("carried", b.getUnitAttr());
      carried.push_back({op, join});
      ++numCarried;
    }
    // The host stream runs the updates in issue order: those the next step
    // needs first go first. Updates ready at one point (all of them after
    // clipping's coefficient) would otherwise keep the backward pass's
    // order, and the forward's first unit would wait for every update.
    // Each moves up to where its operands are ready, the one needed last
    // first, so that the one needed first ends up ahead of the others.
    llvm::sort(carried, [](const auto &x, const auto &y) {
      return y.second->isBeforeInBlock(x.second);
    });
    for (auto [op, join] : carried)
      hoist(op, body);
  }

  /// The storage symbols whose values update `op`'s results are written
  /// back to (directly, or through a wait on them).
  static llvm::SmallDenseSet<StringRef> writtenBy(Operation *op) {
    llvm::SmallDenseSet<StringRef> written;
    for (Value r : op->getResults())
      for (Operation *u : r.getUsers()) {
        if (auto [sym, v] = storageWrite(u); v)
          written.insert(sym);
        if (isa<WaitOp>(u))
          for (Operation *w : u->getUsers())
            if (auto [sym, v] = storageWrite(w); v)
              written.insert(sym);
      }
    return written;
  }

  /// Whether `o` writes storage `sym` or bounds a write of it: a write-
  /// back, a host update writing it (async, it writes from its issue to
  /// its wait), that update's wait, or a carried wait on a read of it (the
  /// previous step's update is joined there).
  static bool boundsWriteOf(Operation *o, StringRef sym) {
    if (auto [s, v] = storageWrite(o); v && s == sym)
      return true;
    if (auto wait = dyn_cast<WaitOp>(o)) {
      Value in = wait.getInput();
      FlatSymbolRefAttr r = readsSymbol(in);
      if (o->hasAttr("carried") && r && r.getValue() == sym)
        return true;
      Operation *d = in.getDefiningOp();
      return d && d->hasAttr(kOnHostAttrName) && writtenBy(d).contains(sym);
    }
    return o->hasAttr(kOnHostAttrName) && writtenBy(o).contains(sym);
  }

  /// Step 6: every copy of offloaded storage this run placed (each right
  /// before the device op reading it) is marked async: the runtime runs it
  /// on the copy stream (DMA beside compute and the collectives), and an
  /// `fsdp.wait` right before its reader joins it (or before an update
  /// writing its storage, if one comes first). In program order, each
  /// is issued right after the previous copy's wait, where the previous
  /// copy's reader starts (one copy in flight ahead of the one read:
  /// FSDP's prefetch, for the host-to-device leg), the first at the top
  /// of the step; never above a definition it reads (the storage read and
  /// its views go along) nor above anything that writes its storage or
  /// joins a write of it (an update, its wait, a carried wait), so it
  /// copies the values the copy in place would have. The memory plan keeps
  /// its device buffer from the issue: one more copy is live on the device.
  ///
  /// A carried wait right before a copy of its unit's storage (nothing but
  /// storage reads between) goes with the copy and joins the copy stream
  /// instead of compute (`copy_stream`): the copy waits for the previous
  /// step's update, compute only for the copy, at its wait. That holds if
  /// every other instruction touching the update's buffers is a later copy
  /// of them (the copy stream runs in order), a host op (the host stream
  /// too), or comes before the copy's new place or after its wait
  /// (copyStreamJoinHolds).
  void prefetchCopies(Block &body, ArrayRef<ToDeviceOp> copies) {
    OpBuilder b(&getContext());
    // The carried waits, by the unit they join.
    llvm::DenseMap<StringRef, WaitOp> carriedOn;
    for (Operation &o : body)
      if (auto w = dyn_cast<WaitOp>(o); w && w->hasAttr("carried"))
        if (FlatSymbolRefAttr r = readsSymbol(w.getInput()))
          carriedOn[r.getValue()] = w;
    // The update each carried wait joins (moving ops keeps them).
    llvm::DenseMap<Operation *, Operation *> updates;
    if (!carriedOn.empty())
      if (auto joins = carriedJoins(cast<func::FuncOp>(body.getParentOp())); succeeded(joins))
        updates = std::move(*joins);
    SmallVector<Operation *> waits; // the waits placed, in program order
    Operation *lastCopy = nullptr;  // the copy placed before this one
    for (ToDeviceOp copy : copies) {
      Operation *reader = nullptr;
      for (Operation *u : copy->getUsers())
        if (u->getBlock() == &body && (!reader || u->isBeforeInBlock(reader)))
          reader = u;
      FlatSymbolRefAttr sym = readsSymbol(copy.getInput());
      if (!reader || !sym)
        continue;
      // Joined before its reader, or before a write of its storage that
      // comes first (an update overlap placed right after the copy: it may
      // not write what the copy still reads).
      Operation *join = reader;
      for (Operation *o = copy->getNextNode(); o && o != reader; o = o->getNextNode())
        if (boundsWriteOf(o, sym.getValue())) {
          join = o;
          break;
        }
      b.setInsertionPoint(join);
      auto wait = b.create<WaitOp>(copy.getLoc(), copy.getType(), copy.getResult());
      copy.getResult().replaceAllUsesExcept(wait.getResult(), wait);
      copy->setAttr("async", b.getUnitAttr());
      ++numPrefetched;
      // Issued where the copy `prefetch-depth` copies back is joined (its
      // reader starts), so that many are in flight while it is read. (A
      // reader of two copies waits for both right before it: where that
      // join comes after this copy, the copy stays where it is.) Never above
      // the copy before it: the copy stream runs in issue order, and the
      // one read first goes first.
      Operation *previous =
          waits.size() >= prefetchDepth ? waits[waits.size() - prefetchDepth] : nullptr;
      Operation *after =
          !previous || previous->isBeforeInBlock(copy) ? previous : copy->getPrevNode();
      if (lastCopy && lastCopy->isBeforeInBlock(copy) &&
          (!after || after->isBeforeInBlock(lastCopy)))
        after = lastCopy;
      needs(copy.getInput(), body, after);
      WaitOp carried = carriedOn.lookup(sym.getValue());
      if (carried &&
          !copyStreamJoinHolds(carried, updates.lookup(carried), copy,
                               after ? after->getNextNode() : &body.front(), wait, copies))
        carried = nullptr;
      moveUp(copy, body, after,
             [&](Operation *o) { return o != carried && boundsWriteOf(o, sym.getValue()); });
      if (carried) {
        carried->moveBefore(copy);
        bringBefore(carried, body);
        carried->setAttr("copy_stream", b.getUnitAttr());
        carriedOn.erase(sym.getValue());
        ++numCopyStreamJoins;
      }
      waits.push_back(wait);
      lastCopy = copy;
    }
  }

  /// Whether carried wait `carried`, which joins `update` (null: not
  /// known), may join on the copy stream right before `copy` (a copy of its
  /// unit's storage, joined at `wait`), both moving up to `from` at most: it comes before the copy
  /// with only storage reads between, and from `from` to `wait` every instruction that defines an
  /// operand of the update it joins, or reads or writes storage that update writes, is a copy of
  /// that storage to the device (async: the copy stream, after the join) or a host op (the host
  /// stream, after the update).
  static bool copyStreamJoinHolds(WaitOp carried, Operation *update, ToDeviceOp copy,
                                  Operation *from, WaitOp wait, ArrayRef<ToDeviceOp> copies) {
    if (!update || !carried->isBeforeInBlock(copy))
      return false;
    for (Operation *o = carried->getNextNode(); o != copy.getOperation(); o = o->getNextNode())
      if (!isStorageAlias(o))
        return false;
    llvm::SmallDenseSet<StringRef> written = writtenBy(update);
    llvm::SmallPtrSet<Operation *, 8> defs;
    for (Value v : update->getOperands())
      if (Operation *d = v.getDefiningOp())
        defs.insert(d);
    auto touches = [&](Operation *o) {
      if (defs.contains(o))
        return true;
      if (auto [sym, v] = storageWrite(o); v && written.contains(sym))
        return true;
      return llvm::any_of(o->getOperands(), [&](Value v) {
        FlatSymbolRefAttr sym = readsSymbol(v);
        return sym && written.contains(sym.getValue());
      });
    };
    for (Operation *o = from; o && o != wait.getOperation(); o = o->getNextNode()) {
      if (o == copy.getOperation() || isStorageAlias(o) || isa<WaitOp>(o) ||
          o->hasAttr(kOnHostAttrName))
        continue;
      // (A copy this run placed is made async in its turn.)
      if (auto c = dyn_cast<ToDeviceOp>(o);
          c && (o->hasAttr("async") || llvm::is_contained(copies, c)))
        continue;
      if (touches(o))
        return false;
    }
    return true;
  }
};

} // namespace
