//===- Schedule.cpp - overlap collectives with compute --------------------===//
//
// fsdp-schedule. Algorithm: (1) every collective becomes `async` and an
// fsdp.wait is inserted right before the first op that reads its result
// (all reads go through the wait; a collective nobody reads is waited for
// before the return, so nothing is in flight when the step ends). (2) With
// prefetch, the parameter all-gathers are visited in program order and
// each is moved (with the storage read that feeds it) to just after the
// wait of the one `depth` before it: while unit k computes, unit k+1 is on
// the wire, in forward and in backward (where it moves past unit k's
// reduce-scatter). Gathers keep their order among themselves and no
// backward gather moves above the loss it follows; every rank runs the
// same program, so the cross-rank order of collectives is identical.
// (3) Waits move up to bound what is in flight: `depth` gathers and one
// other collective (one collective without prefetch); with hierarchical
// qgZ, whose node exchange's tail moves down first (to the next unit's
// node exchange, so the node level travels behind that unit's backward),
// a tail's cross-node exchange also stays in flight behind the next node
// exchange. (4) With node-comm-stream, the node group's collectives are
// marked to run on the second comm stream ([Note: node comm stream]).
// `unit-prefetch-depth` gives some units' gathers their own depth in step
// (2), one for both passes or one for the forward pass's gathers and one
// for the backward pass's (FSDP2 sets a module's forward and backward
// prefetch apart), and step (3) bounds each gather by the first later one
// issued after its wait.
// `backward-prefetch` (FSDP1's BackwardPrefetch) sets where step (2) puts
// the backward pass's gathers: `pre` as above (BACKWARD_PRE: unit k-1
// travels while unit k's gradients are computed, both gathered at once),
// `post` just after the last read of the parameters `depth` gathers back
// (BACKWARD_POST: unit k-1 is gathered once unit k's parameters are dead,
// into their memory, so the backward holds `depth` units instead of
// `depth` + 1, for less overlap), `none` where they are read (the forward
// still prefetches).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/SmallPtrSet.h"

#include <algorithm>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPSCHEDULE
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

bool isCollective(Operation *op) {
  return isa<AllGatherOp, AllToAllOp, ReduceScatterOp, AllReduceOp>(op);
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

    // Hierarchical qgZ: the node exchange's tail (its average, the
    // requantization, the cross-node exchange and its own average, with
    // HSDP's replica all-reduce) moves down to just before the next
    // gradient exchange is issued or its result is read, so that the node
    // all-to-all travels behind the compute in between (the next unit's
    // backward) instead of being waited for at once. With prefetch only:
    // without it one collective is in flight and nothing would overlap;
    // overlap-node-exchange=false keeps the tail where fsdp-shard put it.
    // [Note: node comm stream] (runtime/core/Device.h): the node group's
    // exchanges on a comm stream of their own, so a unit's node exchange
    // does not queue behind the previous unit's cross-node one.
    if (nodeCommStream)
      for (Operation *c : collectives)
        if (auto g = c->getAttrOfType<StringAttr>("group"); g && g.getValue() == "node")
          c->setAttr("stream", StringAttr::get(&getContext(), "node"));

    llvm::SmallPtrSet<Operation *, 16> tailExchanges;
    if (prefetch && prefetchDepth > 0 && overlapNodeExchange && deferNodeTails(body, tailExchanges))
      llvm::sort(collectives, [](Operation *a, Operation *b) { return a->isBeforeInBlock(b); });

    // qgZ's all-to-all is read by the dequantize that sums what arrived:
    // that sum moves down to its first reader (where the reduce-scatter's
    // result would first be read), so that the all-to-all's wait is placed
    // as a reduce-scatter's would be and the exchange runs behind the
    // compute in between; once the waits are placed it moves back up to
    // right after its wait (the received bytes, a whole unit's in int8,
    // are freed there, not held to the update).
    SmallVector<Operation *> summed;
    for (Operation *c : collectives)
      if (isa<AllToAllOp>(c) && c->hasOneUse())
        if (auto dq = dyn_cast<DequantizeOp>(*c->user_begin()); dq && dq.getReduce()) {
          Operation *first = body.getTerminator();
          for (Operation *user : dq->getUsers())
            if (Operation *u = body.findAncestorOpInBlock(*user); u && u->isBeforeInBlock(first))
              first = u;
          dq->moveBefore(first);
          summed.push_back(dq);
        }
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
    DenseMap<Attribute, std::pair<int64_t, int64_t>> unitDepth;
    if (failed(parseUnitDepths(collectives, depth, unitDepth)))
      return signalPassFailure();
    if (!llvm::is_contained({"pre", "post", "none"}, backwardPrefetch.getValue())) {
      mlir::emitError(module.getLoc())
          << "backward-prefetch='" << backwardPrefetch
          << "': expected pre (FSDP's BACKWARD_PRE), post (BACKWARD_POST) or none";
      return signalPassFailure();
    }
    // Where each micro-batch's forward pass ends: its loss (before the
    // all-reduce of it that fsdp-shard appends).
    SmallVector<Operation *> losses = stepLossOps(body);
    // The prefetch chain (the parameter gathers in order) and each one's
    // depth.
    SmallVector<Operation *> chain;
    SmallVector<int64_t> chainDepth;
    DenseMap<Operation *, size_t> chainIndex;
    if (depth > 0)
      hoistGathers(body, collectives, waitOf, depth, unitDepth, losses, chain, chainDepth);
    llvm::SmallPtrSet<Operation *, 16> chained(chain.begin(), chain.end());
    for (size_t i = 0; i < chain.size(); ++i)
      chainIndex[chain[i]] = i;
    // In flight at once. Without prefetch: one collective (the
    // smallest-memory schedule). With prefetch: `depth` parameter
    // all-gathers plus one other collective (a reduce-scatter or an
    // all-reduce), as FSDP2 keeps a unit's reduce-scatter running while the
    // next unit's backward computes. Each wait moves up to before the
    // collective of its class that would exceed that, if that is issued
    // first. This bounds memory: a reduce-scatter's whole-unit gradient
    // buffer is freed before the next unit's is sent (what makes ZeRO-2
    // save memory).
    // A deferred tail's exchanges (hierarchical qgZ's cross-node
    // all-to-all, HSDP's replica all-reduce after it) stay in flight while
    // the next unit's node all-to-all is issued behind them: the levels of
    // neighbouring units pipeline. The next tail's exchange bounds them.
    auto sameClass = [&](Operation *a, Operation *b) {
      if (tailExchanges.contains(a) && isNodeExchange(b))
        return false;
      return depth == 0 || chained.contains(a) == chained.contains(b);
    };
    // A gather's bound is the first later gather of the chain issued
    // after its wait (gather j, of depth d_j, follows the wait of gather
    // j - d_j): `depth` gathers on where every depth is the same.
    for (size_t i = 0; i + 1 < collectives.size(); ++i) {
      Operation *next = nullptr;
      if (auto it = chainIndex.find(collectives[i]); it != chainIndex.end()) {
        size_t ci = it->second;
        for (size_t cj = ci + 1; cj < chain.size() && !next; ++cj)
          if (int64_t(cj) - chainDepth[cj] >= int64_t(ci))
            next = chain[cj];
      } else {
        for (size_t j = i + 1; j < collectives.size() && !next; ++j)
          if (sameClass(collectives[i], collectives[j]))
            next = collectives[j];
      }
      if (!next)
        continue;
      WaitOp wait = waitOf[collectives[i]];
      if (next->isBeforeInBlock(wait)) {
        // The next collective may read this one's result (e.g. an
        // all-reduce of a reduced value): the wait must stay before it.
        wait->moveBefore(next);
      }
    }
    for (Operation *dq : summed)
      dq->moveAfter(dq->getOperand(0).getDefiningOp());
  }

  /// Moves each hierarchical qgZ tail down (see runOnOperation); true if
  /// any moved. A tail is the run of ops right after a node all-to-all
  /// that starts with the dequantize reading it and goes on while each op
  /// is a (de)quantize, all-to-all or all-reduce reading the tail: the
  /// node average, the requantization, the cross-node all-to-all, its
  /// average and an HSDP replica all-reduce. It moves to before the first
  /// later gradient exchange (any collective but a parameter all-gather,
  /// which prefetch moves on its own) or reader of the tail, whichever
  /// comes first (the return if neither).
  static bool deferNodeTails(Block &body, llvm::SmallPtrSetImpl<Operation *> &exchanges) {
    SmallVector<Operation *> nodeHops;
    for (Operation &op : body)
      if (isNodeExchange(&op))
        nodeHops.push_back(&op);
    bool moved = false;
    for (Operation *hop : nodeHops) {
      if (!hop->hasOneUse())
        continue;
      SmallVector<Operation *> tail;
      llvm::SmallPtrSet<Operation *, 8> inTail;
      auto readsTail = [&](Operation *op) {
        return llvm::any_of(op->getOperands(), [&](Value v) {
          Operation *def = v.getDefiningOp();
          return def && (def == hop || inTail.contains(def));
        });
      };
      for (Operation *op = hop->getNextNode(); op && !op->hasTrait<OpTrait::IsTerminator>();
           op = op->getNextNode()) {
        if (!isa<DequantizeOp, QuantizeOp, AllToAllOp, AllReduceOp>(op) || !readsTail(op))
          break;
        if (tail.empty() && !isa<DequantizeOp>(op))
          break;
        tail.push_back(op);
        inTail.insert(op);
      }
      if (tail.empty())
        continue;
      Operation *target = tail.back()->getNextNode();
      while (!target->hasTrait<OpTrait::IsTerminator>() &&
             !(isCollective(target) && !isa<AllGatherOp>(target)))
        target = target->getNextNode();
      for (Operation *op : tail)
        for (Operation *user : op->getUsers())
          if (Operation *u = body.findAncestorOpInBlock(*user);
              u && !inTail.contains(u) && u->isBeforeInBlock(target))
            target = u;
      if (target == tail.back()->getNextNode())
        continue;
      for (Operation *op : tail) {
        op->moveBefore(target);
        if (isCollective(op))
          exchanges.insert(op);
      }
      moved = true;
    }
    return moved;
  }

  /// The last op of `body` that reads `v` or a view of it (the gathered
  /// parameters' last use: their buffer is free after it).
  static Operation *lastReader(Block &body, Value v) {
    Operation *last = nullptr;
    SmallVector<Value> work{v};
    while (!work.empty()) {
      Value cur = work.pop_back_val();
      for (Operation *user : cur.getUsers()) {
        if (isa<ViewOp, ReshapeOp, ShardViewOp, WaitOp, DequantizeOp>(user)) {
          work.append(user->result_begin(), user->result_end());
          continue;
        }
        Operation *u = body.findAncestorOpInBlock(*user);
        if (u && (!last || last->isBeforeInBlock(u)))
          last = u;
      }
    }
    return last;
  }

  /// unit-prefetch-depth's entries into `out`, keyed by the units'
  /// symbol references: UNIT=D (forward and backward) or UNIT=F/B (F for
  /// the forward pass's gathers, B for the backward pass's: its gradients'
  /// and recomputation's). Each unit must have a parameter gather among
  /// `collectives`, each depth be >= 0, and prefetch be on.
  LogicalResult parseUnitDepths(ArrayRef<Operation *> collectives, int64_t depth,
                                DenseMap<Attribute, std::pair<int64_t, int64_t>> &out) {
    if (unitPrefetchDepth.empty())
      return success();
    Location loc = getOperation().getLoc();
    if (depth == 0)
      return mlir::emitError(loc) << "unit-prefetch-depth needs prefetch (prefetch-depth > 0)";
    llvm::StringMap<Attribute> gathered;
    for (Operation *c : collectives) {
      if (GetUnitOp read = gatheredUnitRead(c))
        gathered[read.getName()] = read.getNameAttr();
    }
    for (const std::string &entry : unitPrefetchDepth) {
      auto [unit, value] = StringRef(entry).rsplit('=');
      auto [fwd, bwd] = value.split('/');
      int64_t f = -1, b = -1;
      bool bad = unit.empty() || fwd.getAsInteger(10, f) || f < 0;
      if (!bad && value.contains('/'))
        bad = bwd.getAsInteger(10, b) || b < 0;
      else
        b = f;
      if (bad)
        return mlir::emitError(loc)
               << "unit-prefetch-depth entry '" << entry
               << "': expected UNIT=D, or UNIT=F/B (forward / backward), with depths >= 0";
      auto it = gathered.find(unit);
      if (it == gathered.end())
        return mlir::emitError(loc) << "unit-prefetch-depth: unit '" << unit
                                    << "' has no parameter all-gather in @train_step";
      if (!out.try_emplace(it->second, f, b).second)
        return mlir::emitError(loc) << "unit-prefetch-depth: unit '" << unit << "' given twice";
    }
    return success();
  }

  void hoistGathers(Block &body, ArrayRef<Operation *> collectives,
                    DenseMap<Operation *, WaitOp> &waitOf, int64_t depth,
                    const DenseMap<Attribute, std::pair<int64_t, int64_t>> &unitDepth,
                    ArrayRef<Operation *> losses, SmallVectorImpl<Operation *> &chainOut,
                    SmallVectorImpl<int64_t> &chainDepth) {
    // Prefetch (FSDP's forward prefetch and BACKWARD_PRE): the parameter
    // all-gathers (those reading unit storage) form one chain in program
    // order, forward and backward. Each moves up to just after the wait of
    // the gather `depth` before it (the first gather's wait for the first
    // `depth`), past compute and past other collectives: in the backward
    // pass unit k-1's gather is issued before unit k's reduce-scatter,
    // so it travels while unit k's gradients are computed. Every rank runs
    // this same program, so the collectives' order is still the same on
    // every rank; gathers keep their order among themselves.
    // The backward pass's gathers: their own depth in unit-prefetch-depth,
    // and BACKWARD_POST's or none's place.
    llvm::SmallPtrSet<Operation *, 16> backward = backwardGathers(body, losses);
    SmallVector<Operation *> waits; // the chain's waits, in order
    Operation *prevGather = nullptr;
    for (Operation *c : collectives) {
      SmallVector<Operation *, 2> chain;
      GetUnitOp read = gatheredUnitRead(c, &chain);
      if (!read)
        continue;
      auto gather = cast<AllGatherOp>(c);
      // unit-prefetch-depth's for this direction, else prefetch-depth (0:
      // where read).
      auto own = unitDepth.find(read.getNameAttr());
      int64_t d = own == unitDepth.end() ? depth
                  : backward.contains(c) ? own->second.second
                                         : own->second.first;
      chainOut.push_back(c);
      chainDepth.push_back(d);
      Operation *anchor = waits.empty() || d == 0
                              ? nullptr
                              : waits[waits.size() >= size_t(d) ? waits.size() - d : 0];
      if (backwardPrefetch != "pre" && backward.contains(c)) {
        if (backwardPrefetch == "none") {
          anchor = nullptr; // gathered where it is read
        } else if (anchor) {
          // BACKWARD_POST: once the parameters of the gather `d` back
          // are dead (never above its wait: anchor is that wait). Where
          // they outlive this gather's reads (kept for the next
          // micro-batch: reshard-after-backward=false) nothing is freed
          // by waiting, and it stays BACKWARD_PRE's.
          Operation *dead = lastReader(body, cast<WaitOp>(anchor).getResult());
          if (dead && anchor->isBeforeInBlock(dead) && dead->isBeforeInBlock(read))
            anchor = dead;
        }
      }
      // Never above the chain's previous gather (gathers keep their order).
      if (anchor && prevGather && anchor->isBeforeInBlock(prevGather))
        anchor = prevGather;
      // Never above the loss its backward pass follows: the first
      // backward gather is issued once the forward pass is done (FSDP2
      // issues it in the root's pre-backward hook), not during the last
      // unit's forward, where it would be held across the loss and the
      // logits (the step's peak for a language model).
      if (anchor)
        for (Operation *loss : losses)
          if (loss->getBlock() == read->getBlock() && anchor->isBeforeInBlock(loss) &&
              loss->isBeforeInBlock(read))
            anchor = loss;
      // Never above a write of the unit's storage (the optimizer's).
      if (anchor)
        for (Operation *op = anchor->getNextNode(); op && op != read;
             op = op->getNextNode())
          if (auto set = dyn_cast<SetUnitOp>(op))
            if (set.getNameAttr() == read.getNameAttr())
              anchor = op;
      if (anchor && anchor->isBeforeInBlock(read)) {
        read->moveAfter(anchor);
        Operation *last = read;
        for (Operation *op : chain) {
          op->moveAfter(last);
          last = op;
        }
        gather->moveAfter(last);
      }
      waits.push_back(waitOf[c]);
      prevGather = gather;
    }
  }
};

} // namespace

GetUnitOp mlir::fsdp::gatheredUnitRead(Operation *op, SmallVectorImpl<Operation *> *chain) {
  SmallVector<Operation *, 2> own;
  auto gather = dyn_cast<AllGatherOp>(op);
  if (!gather)
    return GetUnitOp();
  Value v = gather.getInput();
  while (Operation *def = v.getDefiningOp()) {
    if (auto read = dyn_cast<GetUnitOp>(def)) {
      if (chain)
        chain->assign(own.rbegin(), own.rend());
      return read;
    }
    if (!isa<CastOp, QuantizeOp>(def) || !def->hasOneUse())
      break;
    own.push_back(def);
    v = def->getOperand(0);
  }
  return GetUnitOp();
}

SmallVector<Operation *> mlir::fsdp::stepLossOps(Block &body) {
  // The step's first result is the loss: fsdp-shard's all-reduce of it
  // (through fsdp-schedule's wait) of fsdp-grad-accum's sum of terms.
  SmallVector<Operation *> losses;
  Operation *ret = body.getTerminator();
  if (!ret->getNumOperands())
    return losses;
  Value loss = ret->getOperand(0);
  if (auto w = loss.getDefiningOp<WaitOp>())
    loss = w.getInput();
  if (auto ar = loss.getDefiningOp<AllReduceOp>())
    loss = ar.getInput();
  for (Value term : accumTerms(loss))
    if (Operation *def = term.getDefiningOp())
      if (Operation *op = body.findAncestorOpInBlock(*def))
        losses.push_back(op);
  return losses;
}

llvm::SmallPtrSet<Operation *, 16> mlir::fsdp::backwardGathers(Block &body,
                                                               ArrayRef<Operation *> losses) {
  // Each op's phase: backward after a loss (the loss itself is forward),
  // forward again from the next micro-batch's first slice.
  llvm::SmallPtrSet<Operation *, 16> lossSet(losses.begin(), losses.end());
  DenseMap<Operation *, bool> inBackward;
  bool backward = false;
  for (Operation &op : body) {
    if (isa<MicrobatchOp>(op))
      backward = false;
    inBackward[&op] = backward;
    if (lossSet.contains(&op))
      backward = true;
  }
  llvm::SmallPtrSet<Operation *, 16> out;
  for (Operation &op : body) {
    if (!gatheredUnitRead(&op))
      continue;
    // The first reader of the gathered value, through fsdp-schedule's wait.
    Operation *first = nullptr;
    SmallVector<Value> work(op.result_begin(), op.result_end());
    while (!work.empty()) {
      Value v = work.pop_back_val();
      for (Operation *user : v.getUsers()) {
        if (isa<WaitOp>(user)) {
          work.append(user->result_begin(), user->result_end());
          continue;
        }
        Operation *u = body.findAncestorOpInBlock(*user);
        if (u && (!first || u->isBeforeInBlock(first)))
          first = u;
      }
    }
    if (first && inBackward.lookup(first))
      out.insert(&op);
  }
  return out;
}
