//===- MemoryPlan.cpp - buffers, liveness and arena offsets ---------------===//
//
// Algorithm.
// 1. Storage: every fsdp.param gets one buffer; parameters are packed in
//    unit order (a unit is the `unit` name of a parameter, "root" when it has
//    none), so that a unit's parameters are one contiguous flat range — the
//    range fsdp-shard later gathers and scatters with one collective.
//    Optimizer state mirrors that layout; step inputs follow.
// 2. Values: fsdp.get_param / get_state name storage and get no buffer; an
//    optimizer update whose result is written back to the parameter (or
//    state) it read is planned in place. Every other result gets a buffer
//    live from its defining instruction to its last use; the loss and the
//    published gradients stay live to the end of the step.
// 3. Placement: persistent storage at the bottom of the arena; transient
//    buffers sorted by size (largest first) and each put at the lowest
//    aligned offset where it overlaps no already placed buffer whose live
//    range intersects its own (greedy-by-size, as TFLite's planner).
//
//===----------------------------------------------------------------------===//

#include "passes/MemoryPlan.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::fsdp;

StringRef mlir::fsdp::bufKindName(BufKind k) {
  switch (k) {
  case BufKind::Param:
    return "param";
  case BufKind::State:
    return "state";
  case BufKind::Input:
    return "input";
  case BufKind::Grad:
    return "grad";
  case BufKind::Activation:
    return "activation";
  case BufKind::Temp:
    return "temp";
  }
  return "temp";
}

/// The update op and operand index whose in-place result is written back to
/// symbol `sym`, if `v` is such a result.
static bool isInPlaceUpdate(Value v, FlatSymbolRefAttr sym) {
  Operation *def = v.getDefiningOp();
  if (!def || !isa<SgdUpdateOp, SgdMomentumUpdateOp, AdamwUpdateOp>(def))
    return false;
  unsigned idx = cast<OpResult>(v).getResultNumber();
  // Result k of an update replaces the storage read by operand k' where
  // new_param <- param (operand 0), new state i <- its state operand.
  Value src;
  if (idx == 0)
    src = def->getOperand(0);
  else if (auto a = dyn_cast<AdamwUpdateOp>(def))
    src = idx == 1 ? a.getExpAvg() : a.getExpAvgSq();
  else if (auto s = dyn_cast<SgdMomentumUpdateOp>(def))
    src = s.getBuffer();
  Operation *srcDef = src ? src.getDefiningOp() : nullptr;
  if (auto g = dyn_cast_or_null<GetParamOp>(srcDef))
    return g.getNameAttr() == sym;
  if (auto g = dyn_cast_or_null<GetStateOp>(srcDef))
    return g.getNameAttr() == sym;
  return false;
}

bool mlir::fsdp::isStorageAlias(Operation *op) {
  if (isa<GetParamOp, GetStateOp, SetGradOp>(op))
    return true;
  if (auto s = dyn_cast<SetParamOp>(op))
    return isInPlaceUpdate(s.getValue(), s.getNameAttr());
  if (auto s = dyn_cast<SetStateOp>(op))
    return isInPlaceUpdate(s.getValue(), s.getNameAttr());
  return false;
}

std::string mlir::fsdp::formatBytes(int64_t bytes) {
  std::string s;
  llvm::raw_string_ostream os(s);
  double v = bytes;
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0)
    os << bytes << " B";
  else
    os << llvm::format("%.2f %s", v, units[u]);
  return os.str();
}

static int64_t alignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int64_t byteSize(RankedTensorType t) {
  int64_t bits = t.getElementTypeBitWidth();
  return t.getNumElements() * (bits / 8);
}

FailureOr<MemoryPlan> mlir::fsdp::planMemory(ModuleOp module,
                                             func::FuncOp step,
                                             int64_t alignment) {
  MemoryPlan plan;
  if (!step.getBody().hasOneBlock())
    return step.emitError() << "expected a single-block @train_step";
  Block &body = step.getBody().front();

  // --- 1. Persistent storage, packed per unit. ---------------------------
  llvm::StringMap<int64_t> unitIndex;
  SmallVector<SmallVector<ParamOp>> unitParams;
  for (ParamOp p : module.getOps<ParamOp>()) {
    StringRef unit = p.getUnit() ? *p.getUnit() : StringRef("root");
    auto [it, inserted] = unitIndex.try_emplace(unit, plan.units.size());
    if (inserted) {
      plan.units.push_back({unit.str(), 0});
      unitParams.emplace_back();
    }
    unitParams[it->second].push_back(p);
  }
  int64_t cursor = 0;
  auto addBuffer = [&](PlannedBuffer b) {
    plan.buffers.push_back(std::move(b));
    return (int64_t)plan.buffers.size() - 1;
  };
  for (auto [u, params] : llvm::enumerate(unitParams)) {
    cursor = alignUp(cursor, alignment);
    for (ParamOp p : params) {
      PlannedBuffer b;
      b.name = p.getSymName().str();
      b.type = p.getTensorType();
      b.kind = BufKind::Param;
      b.persistent = true;
      b.bytes = byteSize(b.type);
      b.offset = cursor;
      cursor += b.bytes;
      int64_t id = addBuffer(b);
      plan.symbolBuffer[p.getSymName()] = id;
      plan.params.push_back({p, id, (int64_t)u, plan.units[u].flatNumel});
      plan.units[u].flatNumel += b.type.getNumElements();
    }
  }
  // State in the order of the parameters it shadows, so that it mirrors the
  // unit layout.
  llvm::StringMap<SmallVector<StateOp>> statesOf;
  for (StateOp s : module.getOps<StateOp>())
    statesOf[s.getParam()].push_back(s);
  for (auto &params : unitParams) {
    cursor = alignUp(cursor, alignment);
    for (ParamOp p : params)
      for (StateOp s : statesOf.lookup(p.getSymName())) {
        PlannedBuffer b;
        b.name = s.getSymName().str();
        b.type = cast<RankedTensorType>(s.getType());
        b.kind = BufKind::State;
        b.persistent = true;
        b.bytes = byteSize(b.type);
        b.offset = cursor;
        cursor += b.bytes;
        plan.symbolBuffer[s.getSymName()] = addBuffer(b);
      }
  }
  for (BlockArgument arg : body.getArguments()) {
    auto t = dyn_cast<RankedTensorType>(arg.getType());
    if (!t)
      return step.emitError() << "argument #" << arg.getArgNumber()
                              << " is not a ranked tensor";
    cursor = alignUp(cursor, alignment);
    PlannedBuffer b;
    b.name = "arg" + std::to_string(arg.getArgNumber());
    b.type = t;
    b.kind = BufKind::Input;
    b.persistent = true;
    b.bytes = byteSize(t);
    b.offset = cursor;
    cursor += b.bytes;
    plan.valueBuffer[arg] = addBuffer(b);
  }
  int64_t persistentEnd = alignUp(cursor, alignment);

  // --- 2. Instructions and transient values. ------------------------------
  auto ret = dyn_cast<func::ReturnOp>(body.getTerminator());
  if (!ret || ret.getNumOperands() != 1)
    return step.emitError() << "expected @train_step to return the loss";
  Operation *lossDef = ret.getOperand(0).getDefiningOp();
  int64_t forwardEnd = -1;
  for (Operation &op : body.without_terminator()) {
    if (isStorageAlias(&op))
      continue;
    if (&op == lossDef)
      forwardEnd = plan.numInstructions;
    plan.instrIndex[&op] = plan.numInstructions++;
  }
  int64_t end = plan.numInstructions; // "live to the end of the step"

  // Values that carry gradients (for the breakdown only).
  DenseSet<Value> gradValues;
  std::function<void(Value)> markGrad = [&](Value v) {
    if (!gradValues.insert(v).second)
      return;
    if (auto mul = v.getDefiningOp<MulOp>()) // clipping: g * coef
      markGrad(mul.getLhs());
  };
  for (Operation &op : body) {
    if (auto s = dyn_cast<SetGradOp>(op))
      markGrad(s.getValue());
    else if (auto a = dyn_cast<AdamwUpdateOp>(op))
      markGrad(a.getGrad());
    else if (auto s = dyn_cast<SgdUpdateOp>(op))
      markGrad(s.getGrad());
    else if (auto s = dyn_cast<SgdMomentumUpdateOp>(op))
      markGrad(s.getGrad());
  }

  SmallVector<int64_t> transient;
  for (Operation &op : body.without_terminator()) {
    if (auto g = dyn_cast<GetParamOp>(op)) {
      plan.valueBuffer[g.getResult()] = plan.symbolBuffer.lookup(g.getName());
      continue;
    }
    if (auto g = dyn_cast<GetStateOp>(op)) {
      plan.valueBuffer[g.getResult()] = plan.symbolBuffer.lookup(g.getName());
      continue;
    }
    if (op.getNumResults() == 0)
      continue;
    int64_t idx = plan.instrIndex.lookup(&op);
    for (Value r : op.getResults()) {
      // In place when written back to the storage it replaces.
      int64_t inPlace = -1;
      for (Operation *user : r.getUsers()) {
        FlatSymbolRefAttr sym;
        if (auto s = dyn_cast<SetParamOp>(user))
          sym = s.getNameAttr();
        else if (auto s = dyn_cast<SetStateOp>(user))
          sym = s.getNameAttr();
        if (sym && isInPlaceUpdate(r, sym))
          inPlace = plan.symbolBuffer.lookup(sym.getValue());
      }
      if (inPlace >= 0) {
        plan.valueBuffer[r] = inPlace;
        continue;
      }
      auto t = dyn_cast<RankedTensorType>(r.getType());
      if (!t)
        return op.emitOpError() << "result is not a ranked tensor";
      PlannedBuffer b;
      b.type = t;
      b.bytes = byteSize(t);
      b.first = idx;
      b.last = idx;
      for (Operation *user : r.getUsers()) {
        if (isa<func::ReturnOp, SetGradOp>(user))
          b.last = end;
        else
          b.last = std::max(b.last, plan.instrIndex.lookup(user));
      }
      if (gradValues.contains(r))
        b.kind = BufKind::Grad;
      else if (forwardEnd >= 0 && idx <= forwardEnd && b.last > forwardEnd)
        b.kind = BufKind::Activation;
      else
        b.kind = BufKind::Temp;
      b.name = (op.getName().stripDialect() + "." + std::to_string(idx)).str();
      if (op.getNumResults() > 1)
        b.name += "." + std::to_string(cast<OpResult>(r).getResultNumber());
      int64_t id = addBuffer(b);
      plan.valueBuffer[r] = id;
      transient.push_back(id);
    }
  }

  // --- 3. Greedy-by-size placement of transient buffers. ------------------
  std::stable_sort(transient.begin(), transient.end(), [&](int64_t a, int64_t b) {
    const auto &x = plan.buffers[a], &y = plan.buffers[b];
    if (x.bytes != y.bytes)
      return x.bytes > y.bytes;
    return x.first < y.first;
  });
  std::vector<int64_t> placed;
  int64_t arena = persistentEnd;
  for (int64_t id : transient) {
    PlannedBuffer &b = plan.buffers[id];
    // Conflicting intervals [offset, offset + bytes), sorted by offset.
    SmallVector<std::pair<int64_t, int64_t>> busy;
    for (int64_t o : placed) {
      const PlannedBuffer &p = plan.buffers[o];
      if (p.first <= b.last && b.first <= p.last)
        busy.push_back({p.offset, p.offset + p.bytes});
    }
    llvm::sort(busy);
    int64_t off = persistentEnd;
    for (auto [lo, hi] : busy) {
      if (off + b.bytes <= lo)
        break;
      off = std::max(off, alignUp(hi, alignment));
    }
    b.offset = off;
    arena = std::max(arena, off + b.bytes);
    placed.push_back(id);
  }
  plan.arenaBytes = std::max(arena, cursor);

  // Persistent buffers are live throughout.
  for (PlannedBuffer &b : plan.buffers)
    if (b.persistent) {
      b.first = -1;
      b.last = end;
    }

  // --- Peak live bytes and its breakdown. --------------------------------
  for (const PlannedBuffer &b : plan.buffers)
    plan.totalByKind[(int)b.kind] += b.bytes;
  std::vector<int64_t> live(std::max<int64_t>(end, 1), 0);
  for (const PlannedBuffer &b : plan.buffers)
    for (int64_t i = std::max<int64_t>(b.first, 0);
         i <= std::min<int64_t>(b.last, end - 1); ++i)
      live[i] += b.bytes;
  for (int64_t i = 0; i < (int64_t)live.size(); ++i)
    if (live[i] > plan.peakLive) {
      plan.peakLive = live[i];
      plan.peakInstr = i;
    }
  for (const PlannedBuffer &b : plan.buffers)
    if (b.first <= plan.peakInstr && plan.peakInstr <= b.last)
      plan.peakByKind[(int)b.kind] += b.bytes;
  return plan;
}
