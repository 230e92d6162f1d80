//===- MemoryPlan.cpp - buffers, liveness and arena offsets ---------------===//
//
// Algorithm.
// 1. Storage: with fsdp.unit ops (after fsdp-shard) each unit has one
//    persistent buffer (its whole flat parameters, or its shard); without,
//    every fsdp.param gets a buffer, packed in unit order. Optimizer state
//    follows in the same order; step inputs last.
// 2. Aliases: some values are not buffers of their own but windows of
//    another: reads of storage (get_param/get_state/get_unit), fsdp.view,
//    fsdp.shard_view and fsdp.reshape, an optimizer update or all-gather written back to the
//    storage it replaces (in place), an all-reduce of a value nobody else
//    reads (in place), and a gradient whose only use is an fsdp.pack (the
//    op computing it writes straight into the packed buffer, so packing
//    costs no copy and no second gradient buffer).
// 3. Liveness: a buffer lives from the first instruction that defines it or
//    any alias of it to the last instruction reading it or any alias; the
//    loss and published gradients live to the end.
// 4. Placement: persistent storage at the bottom of the arena; transient
//    buffers sorted by size (largest first) and each put at the lowest
//    aligned offset where it overlaps no placed buffer whose live range
//    intersects its own (greedy-by-size, as TFLite's planner).
//
//===----------------------------------------------------------------------===//

#include "passes/MemoryPlan.h"
#include "passes/Passes.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

using namespace mlir;
using namespace mlir::fsdp;

StringRef mlir::fsdp::bufKindName(BufKind k) { return ::fsdp::bufferKindName(k); }

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
  return t.getNumElements() * (t.getElementTypeBitWidth() / 8);
}

static int64_t elemBytes(Value v) {
  return cast<RankedTensorType>(v.getType()).getElementTypeBitWidth() / 8;
}

FlatSymbolRefAttr mlir::fsdp::storageRead(Value v) {
  Operation *d = v.getDefiningOp();
  if (auto g = dyn_cast_or_null<GetParamOp>(d))
    return g.getNameAttr();
  if (auto g = dyn_cast_or_null<GetStateOp>(d))
    return g.getNameAttr();
  if (auto g = dyn_cast_or_null<GetUnitOp>(d))
    return g.getNameAttr();
  return {};
}

std::pair<StringRef, Value> mlir::fsdp::storageWrite(Operation *op) {
  if (auto s = dyn_cast<SetParamOp>(op))
    return {s.getName(), s.getValue()};
  if (auto s = dyn_cast<SetStateOp>(op))
    return {s.getName(), s.getValue()};
  if (auto s = dyn_cast<SetUnitOp>(op))
    return {s.getName(), s.getValue()};
  return {StringRef(), Value()};
}

FailureOr<llvm::DenseMap<Operation *, Operation *>> mlir::fsdp::carriedJoins(func::FuncOp step) {
  llvm::DenseMap<Operation *, Operation *> joins;
  if (!step.getBody().hasOneBlock())
    return joins;
  Block &body = step.getBody().front();
  // The units async host updates write back, and by which update.
  llvm::StringMap<Operation *> updateOf;
  bool any = false;
  for (Operation &op : body) {
    if (op.hasAttr("copy_stream") && !(isa<WaitOp>(op) && op.hasAttr("carried")))
      return op.emitOpError("has copy_stream, which only a carried fsdp.wait may have");
    any |= op.hasAttr("carried");
    if (op.hasAttr(kOnHostAttrName) && op.hasAttr("async") && op.getNumResults() > 0)
      for (Operation *u : op.getResult(0).getUsers())
        if (auto [sym, v] = storageWrite(u); v)
          updateOf.try_emplace(sym, &op);
  }
  if (!any)
    return joins;
  for (Operation &op : body) {
    auto w = dyn_cast<WaitOp>(op);
    if (!w || !w->hasAttr("carried"))
      continue;
    FlatSymbolRefAttr unit = storageRead(w.getInput());
    if (!unit)
      return w.emitOpError("is carried (joined in the next step) but reads no unit");
    auto it = updateOf.find(unit.getValue());
    if (it == updateOf.end())
      return w.emitOpError("is carried (joined in the next step) but no async host update "
                           "writes back @")
             << unit.getValue();
    if (w->hasAttr("copy_stream")) {
      // The copy stream joins it for the copy of the unit right after it.
      Operation *next = w->getNextNode();
      while (next && isStorageAlias(next))
        next = next->getNextNode();
      auto copy = dyn_cast_or_null<ToDeviceOp>(next);
      Value in = copy ? copy.getInput() : Value();
      while (in && isa_and_nonnull<ViewOp, ShardViewOp, ReshapeOp>(in.getDefiningOp()))
        in = in.getDefiningOp()->getOperand(0);
      if (!copy || !copy->hasAttr("async") || storageRead(in) != unit)
        return w.emitOpError("joins on the copy stream (copy_stream) but the next instruction "
                             "is not an async fsdp.to_device of @")
               << unit.getValue();
    }
    joins[&op] = it->second;
  }
  return joins;
}

/// True when `v`, written back to symbol `sym`, can be computed in place in
/// the storage of `sym`: it is an optimizer update result replacing the
/// storage its operand read, or an all-gather into a unit's storage (the
/// stage 1/2 update: nothing reads the old parameters after their shard
/// was updated).
static bool isInPlaceWrite(Value v, FlatSymbolRefAttr sym) {
  if (auto w = v.getDefiningOp<WaitOp>()) // the value of an async collective
    v = w.getInput();
  Operation *def = v.getDefiningOp();
  if (!def)
    return false;
  if (isa<AllGatherOp>(def))
    return true;
  if (!isa<SgdUpdateOp, SgdMomentumUpdateOp, AdamwUpdateOp, LambUpdateOp>(def))
    return false;
  unsigned idx = cast<OpResult>(v).getResultNumber();
  // Result 0 replaces operand 0 (the parameter); result k > 0 replaces the
  // k-th state operand, in operand order.
  Value src;
  if (idx == 0) {
    src = def->getOperand(0);
  } else {
    unsigned seen = 0;
    for (Value o : def->getOperands().drop_front(2))
      if (o.getDefiningOp<GetStateOp>() && ++seen == idx) {
        src = o;
        break;
      }
  }
  return src && storageRead(src) == sym;
}

static FlatSymbolRefAttr writtenSymbol(Operation *op, Value &value) {
  if (auto s = dyn_cast<SetParamOp>(op)) {
    value = s.getValue();
    return s.getNameAttr();
  }
  if (auto s = dyn_cast<SetStateOp>(op)) {
    value = s.getValue();
    return s.getNameAttr();
  }
  if (auto s = dyn_cast<SetUnitOp>(op)) {
    value = s.getValue();
    return s.getNameAttr();
  }
  return {};
}

bool mlir::fsdp::isStorageAlias(Operation *op) {
  if (isa<GetParamOp, GetStateOp, GetUnitOp, SetGradOp, ViewOp, ShardViewOp,
          ReshapeOp, MicrobatchOp>(op))
    return true;
  Value v;
  if (FlatSymbolRefAttr sym = writtenSymbol(op, v))
    return isInPlaceWrite(v, sym);
  return false;
}

/// A copy of this rank's part of a gathered unit for its backward
/// (fsdp-shard's reshard-after-forward=G): a pack of a shard view over the
/// reshard group.
static bool isReshardCopy(Operation *op) {
  auto pack = dyn_cast_or_null<PackOp>(op);
  if (!pack || pack.getInputs().size() != 1)
    return false;
  auto v = pack.getInputs()[0].getDefiningOp<ShardViewOp>();
  return v && v.getGroup() && *v.getGroup() == "reshard";
}

namespace {
/// Where an aliased value lives: inside `base` (a value or a symbol's
/// storage) at a byte offset, plus rank * rankStride.
struct AliasInfo {
  Value base;
  FlatSymbolRefAttr symbol;
  int64_t byteOffset = 0;
  int64_t rankStride = 0;
  /// The stride counts the rank's index in the reshard group (shard index
  /// mod rankPeriod) instead of its shard index; 0: the shard index.
  int64_t rankPeriod = 0;
};
} // namespace

/// True when an accumulation acc + g may be written over `acc`: nothing but
/// the add reads `acc`, and its bytes are a buffer of its own (computed,
/// reduced by a collective, or an earlier in-place accumulation), never
/// storage, an input, or a view of a value someone else reads.
static bool canAccumulateInPlace(Value acc,
                                 const llvm::DenseMap<Value, AliasInfo> &alias) {
  if (!acc.hasOneUse() || isa<BlockArgument>(acc))
    return false;
  Operation *def = acc.getDefiningOp();
  if (auto w = dyn_cast<WaitOp>(def)) {
    // The result of an async collective that only this wait reads.
    Value c = w.getInput();
    return c.hasOneUse() && isa_and_nonnull<ReduceScatterOp, AllReduceOp>(
                                c.getDefiningOp());
  }
  if (isa<ReduceScatterOp, AllReduceOp>(def))
    return true;
  if ((def->hasAttr(kAccumAttrName) || def->hasAttr(kChunkAccumAttrName)) && isa<AddOp>(def))
    return true;
  if (auto mm = dyn_cast<MatmulOp>(def); mm && mm.getAcc()) // an earlier acc += a b
    return true;
  if (auto bg = dyn_cast<MatmulBiasGradOp>(def); bg && !bg.getAcc().empty())
    return true; // an earlier micro-batch's dw, db added by the GEMM and column sum
  return !alias.count(acc) && !isStorageAlias(def);
}

/// True when `g`, a cross_entropy_grad or cross_entropy_fused, may write its
/// gradient over its logits `l`: the logits are a buffer of their own
/// (computed, not storage, an input or a view; reshapes of it read by
/// nothing else count as it) and nothing
/// reads them after it; their only other readers are cross-entropies
/// before it. The kernels (CPU and CUDA) read a row's statistics before
/// writing any of it, and each element before writing it, so they run in
/// place.
static bool canOverwriteLogits(Operation *g, Value l,
                               const llvm::DenseMap<Value, AliasInfo> &alias) {
  Value root = l;
  while (auto r = root.getDefiningOp<ReshapeOp>()) {
    root = r.getInput();
    if (!root.hasOneUse())
      return false;
  }
  if (isa<BlockArgument>(root) || alias.count(root) || isStorageAlias(root.getDefiningOp()))
    return false;
  return llvm::all_of(l.getUsers(), [&](Operation *u) {
    return u == g ||
           (isa<CrossEntropyOp>(u) && u->getBlock() == g->getBlock() &&
            u->isBeforeInBlock(g));
  });
}

namespace {
/// One planMemory run: the algorithm of the file comment, one method per
/// step, called in order by run(). What a step finds (the persistent
/// cursors, instruction order, aliases, the transient buffers) is kept in
/// members for the steps after it; the plan grows in `plan`.
class MemoryPlanner {
public:
  MemoryPlanner(ModuleOp module, func::FuncOp step, int64_t alignment, bool place)
      : module(module), step(step), alignment(alignment), place(place) {}
  FailureOr<MemoryPlan> run();

private:
  int64_t addBuffer(PlannedBuffer b);
  PlannedBuffer persistent(std::string name, RankedTensorType t, BufKind kind, bool host = false);
  LogicalResult placeParams();
  void placeState();
  LogicalResult placeInputs();
  LogicalResult numberInstructions();
  void findAliases();
  void markGrad(Value v);
  void markGradients();
  LogicalResult createBuffers();
  FailureOr<std::tuple<int64_t, int64_t, int64_t, int64_t>> resolve(Value v);
  LogicalResult resolveAliases();
  LogicalResult planSwaps();
  int64_t rootOf(int64_t id);
  LogicalResult checkSides();
  void touch(Value v, int64_t at);
  void touchStaging(Operation *op, int64_t at);
  void computeLiveness();
  void placeTransients();
  void measurePeak();

  ModuleOp module;
  func::FuncOp step;
  Block *body = nullptr;
  const int64_t alignment;
  const bool place;
  MemoryPlan plan;

  // 1. Persistent storage. Device storage counts from `cursor`, host
  // storage (offloaded) from `hostCursor`: two arenas, one plan.
  int64_t cursor = 0, hostCursor = 0;
  /// fsdp-offload's nvme: state in the swap file counts from here.
  int64_t nvmeCursor = 0;
  llvm::StringSet<> offloaded;
  SmallVector<UnitOp> unitOps;
  int64_t persistentEnd = 0, hostPersistentEnd = 0;

  // 2. Instructions and aliases.
  SmallVector<int64_t> forwardEnds; ///< where each micro-batch's forward ends
  int64_t end = 0;                  ///< the number of instructions
  llvm::DenseMap<Value, AliasInfo> alias;
  DenseSet<Value> gradValues;
  SmallVector<int64_t> transient; ///< root buffers of the step's values
  /// Operands of updates joined in the next step: live through the step,
  /// no activation.
  llvm::DenseSet<int64_t> wholeStep;
};
} // namespace

FailureOr<MemoryPlan> mlir::fsdp::planMemory(ModuleOp module, func::FuncOp step, int64_t alignment,
                                             bool place) {
  return MemoryPlanner(module, step, alignment, place).run();
}

FailureOr<MemoryPlan> MemoryPlanner::run() {
  if (!step.getBody().hasOneBlock())
    return mlir::emitError(step.getLoc()) << "expected a single-block @train_step";
  body = &step.getBody().front();
  // 1. Persistent storage.
  if (failed(placeParams()))
    return failure();
  placeState();
  if (failed(placeInputs()))
    return failure();
  // 2. Instructions and aliases.
  if (failed(numberInstructions()))
    return failure();
  findAliases();
  markGradients();
  if (failed(createBuffers()) || failed(resolveAliases()) || failed(planSwaps()))
    return failure();
  // 3. Liveness over root buffers.
  if (failed(checkSides()))
    return failure();
  FailureOr<llvm::DenseMap<Operation *, Operation *>> joins = carriedJoins(step);
  if (failed(joins))
    return failure();
  plan.carried = std::move(*joins);
  computeLiveness();
  // 4. Placement, then the peak.
  placeTransients();
  measurePeak();
  return std::move(plan);
}

int64_t MemoryPlanner::addBuffer(PlannedBuffer b) {
  plan.buffers.push_back(std::move(b));
  return (int64_t)plan.buffers.size() - 1;
}

/// A persistent buffer of type t at the cursor of its side, which it
/// advances.
PlannedBuffer MemoryPlanner::persistent(std::string name, RankedTensorType t, BufKind kind,
                                        bool host) {
  PlannedBuffer b;
  b.name = std::move(name);
  b.type = t;
  b.kind = kind;
  b.persistent = true;
  b.bytes = byteSize(t);
  b.host = host;
  int64_t &at = host ? hostCursor : cursor;
  if (host) // device storage is aligned where its callers start a group
    at = alignUp(at, alignment);
  b.offset = at;
  at += b.bytes;
  return b;
}

// --- 1. Persistent storage. ---------------------------------------------

/// The parameters: one buffer per fsdp.unit (its flat parameters or its
/// shard), or without units one per fsdp.param, packed in unit order.
LogicalResult MemoryPlanner::placeParams() {
  unitOps.assign(module.getOps<UnitOp>().begin(), module.getOps<UnitOp>().end());
  if (!unitOps.empty()) {
    llvm::StringMap<std::pair<int64_t, int64_t>> paramPlace;
    for (auto [u, unit] : llvm::enumerate(unitOps)) {
      cursor = alignUp(cursor, alignment);
      PlannedUnit pu;
      pu.name = unit.getSymName().str();
      pu.flatNumel = unit.getNumel();
      pu.paddedNumel = unit.getPaddedNumel();
      pu.shardNumel = unit.getShardNumel();
      pu.sharded = unit.getSharded();
      pu.frozen = unit.getFrozen();
      if (unit.getOffloaded())
        offloaded.insert(unit.getSymName());
      auto storage = cast<RankedTensorType>(unit.getStorageType());
      PlannedBuffer b;
      if (unit->hasAttr(kNvmeAttrName)) {
        // fsdp-offload's nvme-params: in the swap file, on blocks of its own.
        b.name = pu.name;
        b.type = storage;
        b.kind = BufKind::Param;
        b.persistent = b.host = b.nvme = true;
        b.bytes = byteSize(storage);
        b.ioAlign = std::max(alignment, ::fsdp::kSwapAlignment);
        nvmeCursor = alignUp(nvmeCursor, b.ioAlign);
        b.offset = nvmeCursor;
        nvmeCursor += b.extent();
      } else {
        b = persistent(pu.name, storage, BufKind::Param, unit.getOffloaded());
      }
      b.unit = u;
      pu.buffer = addBuffer(b);
      plan.symbolBuffer[unit.getSymName()] = pu.buffer;
      plan.units.push_back(pu);
      int64_t off = 0;
      for (Attribute a : unit.getParams()) {
        StringRef name = cast<FlatSymbolRefAttr>(a).getValue();
        paramPlace[name] = {(int64_t)u, off};
        auto p = module.lookupSymbol<ParamOp>(name);
        if (!p)
          return unit.emitOpError() << "lists unknown parameter @" << name;
        off += p.getTensorType().getNumElements();
      }
    }
    for (ParamOp p : module.getOps<ParamOp>()) {
      auto it = paramPlace.find(p.getSymName());
      if (it == paramPlace.end())
        return p.emitOpError() << "belongs to no fsdp.unit";
      plan.params.push_back({p, -1, it->second.first, it->second.second});
    }
  } else {
    llvm::StringMap<int64_t> unitIndex;
    SmallVector<SmallVector<ParamOp>> unitParams;
    for (ParamOp p : module.getOps<ParamOp>()) {
      StringRef unit = p.getUnit() ? *p.getUnit() : StringRef("root");
      auto [it, inserted] = unitIndex.try_emplace(unit, plan.units.size());
      if (inserted) {
        PlannedUnit pu;
        pu.name = unit.str();
        plan.units.push_back(pu);
        unitParams.emplace_back();
      }
      unitParams[it->second].push_back(p);
    }
    for (auto [u, params] : llvm::enumerate(unitParams)) {
      cursor = alignUp(cursor, alignment);
      for (ParamOp p : params) {
        int64_t id = addBuffer(persistent(p.getSymName().str(),
                                          p.getTensorType(), BufKind::Param));
        plan.symbolBuffer[p.getSymName()] = id;
        plan.params.push_back({p, id, (int64_t)u, plan.units[u].flatNumel});
        plan.units[u].flatNumel += p.getTensorType().getNumElements();
      }
      plan.units[u].paddedNumel = plan.units[u].shardNumel =
          plan.units[u].flatNumel;
    }
  }
  return success();
}

/// Optimizer state, in the order of what it shadows.
void MemoryPlanner::placeState() {
  llvm::StringMap<SmallVector<StateOp>> statesOf;
  for (StateOp s : module.getOps<StateOp>())
    statesOf[s.getParam()].push_back(s);
  SmallVector<StringRef> shadowOrder;
  if (!unitOps.empty())
    for (UnitOp u : unitOps)
      shadowOrder.push_back(u.getSymName());
  else
    for (PlannedParam &p : plan.params)
      shadowOrder.push_back(p.op.getSymName());
  cursor = alignUp(cursor, alignment);
  // The swap file's block (kSwapAlignment: the runtime's direct transfers).
  const int64_t swapAlign = std::max(alignment, ::fsdp::kSwapAlignment);
  for (StringRef owner : shadowOrder)
    for (StateOp s : statesOf.lookup(owner)) {
      auto t = cast<RankedTensorType>(s.getType());
      if (s->hasAttr(kNvmeAttrName)) {
        // In the swap file, each buffer on blocks of its own.
        PlannedBuffer b;
        b.name = s.getSymName().str();
        b.type = t;
        b.kind = BufKind::State;
        b.persistent = b.host = b.nvme = true;
        b.bytes = byteSize(t);
        b.ioAlign = swapAlign;
        nvmeCursor = alignUp(nvmeCursor, b.ioAlign);
        b.offset = nvmeCursor;
        nvmeCursor += b.extent();
        plan.symbolBuffer[s.getSymName()] = addBuffer(b);
        continue;
      }
      int64_t id =
          addBuffer(persistent(s.getSymName().str(), t, BufKind::State, offloaded.contains(owner)));
      plan.symbolBuffer[s.getSymName()] = id;
    }
  if (nvmeCursor > 0) {
    plan.swapAlignment = swapAlign;
    plan.nvmeBytes = alignUp(nvmeCursor, plan.swapAlignment);
  }
}

/// The step's inputs, last; then where the persistent storage ends.
LogicalResult MemoryPlanner::placeInputs() {
  for (BlockArgument arg : body->getArguments()) {
    auto t = dyn_cast<RankedTensorType>(arg.getType());
    if (!t)
      return mlir::emitError(step.getLoc()) << "argument #" << arg.getArgNumber()
                              << " is not a ranked tensor";
    cursor = alignUp(cursor, alignment);
    plan.valueBuffer[arg] = addBuffer(persistent(
        "arg" + std::to_string(arg.getArgNumber()), t, BufKind::Input));
  }
  persistentEnd = alignUp(cursor, alignment);
  hostPersistentEnd = alignUp(hostCursor, alignment);
  return success();
}

// --- 2. Instructions and aliases. ---------------------------------------

/// Every op but the storage aliases becomes an instruction, in order;
/// forwardEnds are the instructions computing each micro-batch's loss.
LogicalResult MemoryPlanner::numberInstructions() {
  auto ret = dyn_cast<func::ReturnOp>(body->getTerminator());
  // The loss, and with clipping or loss scaling the squared gradient norm.
  if (!ret || ret.getNumOperands() < 1 || ret.getNumOperands() > 2)
    return mlir::emitError(step.getLoc()) << "expected @train_step to return the loss";
  // The forward pass ends at the loss (before any all-reduce of it); with
  // gradient accumulation each micro-batch's forward ends at its loss.
  Value lossValue = ret.getOperand(0);
  if (auto w = lossValue.getDefiningOp<WaitOp>()) // an async all-reduce
    lossValue = w.getInput();
  if (auto ar = lossValue.getDefiningOp<AllReduceOp>())
    lossValue = ar.getInput();
  DenseSet<Operation *> lossDefs;
  for (Value term : accumTerms(lossValue))
    lossDefs.insert(term.getDefiningOp());
  for (Operation &op : body->without_terminator()) {
    if (isStorageAlias(&op))
      continue;
    if (lossDefs.contains(&op))
      forwardEnds.push_back(plan.numInstructions);
    plan.instrIndex[&op] = plan.numInstructions++;
  }
  end = plan.numInstructions;
  return success();
}

/// The values that are windows of another (the file comment's step 2).
void MemoryPlanner::findAliases() {
  for (Operation &op : body->without_terminator()) {
    if (auto v = dyn_cast<ViewOp>(op))
      alias[v.getResult()] = {v.getInput(), {},
                              (int64_t)v.getOffset() * elemBytes(v.getResult()), 0};
    else if (auto v = dyn_cast<ShardViewOp>(op)) {
      int64_t period = 0;
      if (v.getGroup() && *v.getGroup() == "reshard")
        if (MeshAttr mesh = getMesh(v))
          period = mesh.getReshard();
      alias[v.getResult()] = {v.getInput(), {}, 0,
                              byteSize(cast<RankedTensorType>(v.getType())),
                              period};
    }
    else if (isa<GetParamOp, GetStateOp, GetUnitOp>(op))
      alias[op.getResult(0)] = {{}, storageRead(op.getResult(0)), 0, 0};
    else if (auto w = dyn_cast<WaitOp>(op))
      // The collective's result, now complete: the same buffer.
      alias[w.getResult()] = {w.getInput(), {}, 0, 0};
    else if (auto r = dyn_cast<ReshapeOp>(op))
      // Row-major data does not move: a reshape is the same bytes.
      alias[r.getResult()] = {r.getInput(), {}, 0, 0};
    else if (auto m = dyn_cast<MicrobatchOp>(op))
      // Rows of the outermost dimension are contiguous.
      alias[m.getResult()] = {
          m.getInput(), {},
          (int64_t)m.getIndex() * byteSize(cast<RankedTensorType>(m.getType())), 0};
    else if (auto add = dyn_cast<AddOp>(op);
             add && (add->hasAttr(kAccumAttrName) || add->hasAttr(kChunkAccumAttrName)) &&
             canAccumulateInPlace(add.getLhs(), alias))
      // Gradient accumulation (over micro-batches, or over fsdp-chunk-loss's
      // chunks): acc + g written over acc.
      alias[add.getResult()] = {add.getLhs(), {}, 0, 0};
    else if (auto mm = dyn_cast<MatmulOp>(op);
             mm && mm.getAcc() && canAccumulateInPlace(mm.getAcc(), alias))
      // acc + a b, a GEMM with beta = 1, written over acc.
      alias[mm.getResult()] = {mm.getAcc(), {}, 0, 0};
    else if (auto bg = dyn_cast<MatmulBiasGradOp>(op); bg && !bg.getAcc().empty()) {
      // aw + dy^T x and ab + dy's column sums, each written over its
      // accumulator where that may be overwritten.
      for (auto [r, acc] : llvm::zip(bg->getResults(), bg.getAcc()))
        if (canAccumulateInPlace(acc, alias))
          alias[r] = {acc, {}, 0, 0};
    } else if (auto g = dyn_cast<CrossEntropyGradOp>(op);
               g && canOverwriteLogits(g, g.getLogits(), alias))
      // llm.c's fused classifier: the logits' gradient overwrites the
      // logits (the largest activation of a language model, [tokens,
      // vocabulary]), so the two never take memory at once.
      alias[g.getResult()] = {g.getLogits(), {}, 0, 0};
    else if (auto f = dyn_cast<CrossEntropyFusedOp>(op);
             f && canOverwriteLogits(f, f.getLogits(), alias))
      alias[f.getDLogits()] = {f.getLogits(), {}, 0, 0};
    else if (auto ar = dyn_cast<AllReduceOp>(op)) {
      // In place only into a buffer of its own that nobody else reads.
      Value in = ar.getInput();
      if (in.hasOneUse() && !isa<BlockArgument>(in) && !alias.count(in))
        alias[ar.getResult()] = {in, {}, 0, 0};
    } else if (auto pack = dyn_cast<PackOp>(op)) {
      for (auto [in, off] : llvm::zip(pack.getInputs(), pack.getOffsets())) {
        Operation *d = in.getDefiningOp();
        if (!d || !in.hasOneUse() || isStorageAlias(d) || isa<AllReduceOp, PackOp>(d))
          continue;
        // fsdp-chunk-loss's in-place sum of a weight gradient's terms:
        // its first term, the bytes every add writes over, goes in the pack.
        Value v = in;
        while (Operation *vd = v.getDefiningOp()) {
          Value acc;
          if (auto add = dyn_cast<AddOp>(vd); add && add->hasAttr(kChunkAccumAttrName))
            acc = add.getLhs();
          else if (auto mm = dyn_cast<MatmulOp>(vd); mm && mm->hasAttr(kChunkAccumAttrName))
            acc = mm.getAcc();
          auto it = alias.find(v);
          if (!acc || it == alias.end() || it->second.base != acc || it->second.byteOffset != 0)
            break;
          v = acc;
        }
        Operation *vd = v.getDefiningOp();
        if (alias.count(v) || !vd || !v.hasOneUse() || isStorageAlias(vd) ||
            v.getType() != in.getType())
          continue;
        alias[v] = {pack.getResult(), {}, off * elemBytes(in), 0};
      }
    }
    Value written;
    if (FlatSymbolRefAttr sym = writtenSymbol(&op, written))
      if (isInPlaceWrite(written, sym)) {
        // Through a wait, it is the async collective that writes storage.
        if (auto w = written.getDefiningOp<WaitOp>())
          written = w.getInput();
        alias[written] = {{}, sym, 0, 0};
      }
  }
}

/// Marks v, and what it was reduced, cast, accumulated or packed from,
/// as gradient bytes.
void MemoryPlanner::markGrad(Value v) {
  if (!v || !gradValues.insert(v).second)
    return;
  Operation *d = v.getDefiningOp();
  if (auto mul = dyn_cast_or_null<MulOp>(d)) // clipping: g * coef
    markGrad(mul.getLhs());
  else if (isa_and_nonnull<ReduceScatterOp, AllReduceOp, WaitOp, CastOp, ToHostOp, AllToAllOp,
                           QuantizeOp, DequantizeOp>(d))
    markGrad(d->getOperand(0)); // a cast: a gradient in another dtype; qgZ's bytes
  else if (auto mm = dyn_cast_or_null<MatmulOp>(d); mm && mm.getAcc())
    markGrad(mm.getAcc()); // a chunk's weight-gradient term added by the GEMM
  else if (auto bg = dyn_cast_or_null<MatmulBiasGradOp>(d); bg && !bg.getAcc().empty())
    markGrad(bg.getAcc()[cast<OpResult>(v).getResultNumber()]); // dw or db's sum
  else if (d && (d->hasAttr(kAccumAttrName) || d->hasAttr(kChunkAccumAttrName)))
    for (Value in : d->getOperands()) // accumulated micro-batches or chunks
      markGrad(in);
  else if (auto pack = dyn_cast_or_null<PackOp>(d))
    for (Value in : pack.getInputs())
      markGrad(in);
}

/// Values that carry gradients and communication buffers (the breakdown).
void MemoryPlanner::markGradients() {
  for (Operation &op : *body) {
    if (auto s = dyn_cast<SetGradOp>(op))
      markGrad(s.getValue());
    else if (isa<AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambNormsOp, LambUpdateOp>(op))
      markGrad(op.getOperand(1));
  }
}

/// Buffers for every non-alias result; aliases resolve to their root.
/// Returns the transient ones in `transient`.
LogicalResult MemoryPlanner::createBuffers() {
  for (Operation &op : body->without_terminator()) {
    for (Value r : op.getResults()) {
      if (alias.count(r))
        continue;
      auto t = dyn_cast<RankedTensorType>(r.getType());
      if (!t)
        return op.emitOpError() << "result is not a ranked tensor";
      PlannedBuffer b;
      b.type = t;
      b.bytes = byteSize(t);
      int64_t idx = plan.instrIndex.lookup(&op);
      b.first = b.last = idx;
      Operation *d = r.getDefiningOp();
      if (isReshardCopy(d))
        b.kind = BufKind::Comm; // hpZ: a unit's 1/G kept for the backward
      else if (gradValues.contains(r) || isa<PackOp, ReduceScatterOp>(d))
        b.kind = BufKind::Grad;
      else if (isa<AllGatherOp>(d) ||
               (isa<CastOp, ToDeviceOp>(d) && storageRead(d->getOperand(0))))
        b.kind = BufKind::Comm; // gathered, or cast for compute (mixed
                                // precision), or an offloaded shard copied in
      else if (op.hasAttr(kRecomputeAttrName))
        // A forward value recomputed in the backward pass (fsdp-recompute)
        // is still an activation, only a shorter-lived one.
        b.kind = BufKind::Activation;
      else
        b.kind = BufKind::Temp; // activations are found after liveness
      // fsdp-offload: the update of an offloaded unit and the copies it
      // reads are host values.
      b.host = isa<ToHostOp>(op) || op.hasAttr(kOnHostAttrName);
      b.name = (op.getName().stripDialect() + "." + std::to_string(idx)).str();
      if (op.getNumResults() > 1)
        b.name += "." + std::to_string(cast<OpResult>(r).getResultNumber());
      int64_t id = addBuffer(b);
      plan.valueBuffer[r] = id;
      transient.push_back(id);
    }
  }
  return success();
}

/// The root buffer of v, its byte offset there, and its rank stride and
/// period (AliasInfo), through any chain of aliases; failure when v has
/// no buffer or two rank strides do not compose.
FailureOr<std::tuple<int64_t, int64_t, int64_t, int64_t>> MemoryPlanner::resolve(Value v) {
  auto it = alias.find(v);
  if (it == alias.end()) {
    auto b = plan.valueBuffer.find(v);
    if (b == plan.valueBuffer.end())
      return failure();
    int64_t id = b->second;
    while (plan.buffers[id].aliasOf >= 0)
      id = plan.buffers[id].aliasOf;
    return std::make_tuple(id, (int64_t)0, (int64_t)0, (int64_t)0);
  }
  AliasInfo a = it->second;
  int64_t root, off = a.byteOffset, stride = a.rankStride, period = a.rankPeriod;
  if (a.symbol) {
    auto s = plan.symbolBuffer.find(a.symbol.getValue());
    if (s == plan.symbolBuffer.end())
      return failure();
    root = s->second;
  } else {
    auto r = resolve(a.base);
    if (failed(r))
      return failure();
    root = std::get<0>(*r);
    off += std::get<1>(*r);
    // Strides over two different rank indices do not add up to one.
    if (stride && std::get<2>(*r) && period != std::get<3>(*r))
      return failure();
    if (std::get<2>(*r))
      period = std::get<3>(*r);
    stride += std::get<2>(*r);
  }
  return std::make_tuple(root, off, stride, period);
}

/// Resolve aliases (views of views, packed gradients of an in-place
/// all-reduce, ...) to root buffers. Each alias gets a buffer record of its
/// own (its shape and dtype) that points at the root.
LogicalResult MemoryPlanner::resolveAliases() {
  for (Operation &op : body->without_terminator())
    for (Value r : op.getResults()) {
      if (!alias.count(r))
        continue;
      auto res = resolve(r);
      if (failed(res))
        return op.emitOpError() << "cannot place this value in memory";
      auto [root, off, stride, period] = *res;
      const PlannedBuffer &rb = plan.buffers[root];
      auto t = cast<RankedTensorType>(r.getType());
      if (off == 0 && stride == 0 && t == rb.type) {
        plan.valueBuffer[r] = root; // the same buffer
        continue;
      }
      PlannedBuffer b;
      b.type = t;
      b.bytes = byteSize(t);
      b.kind = rb.kind;
      b.persistent = rb.persistent;
      b.host = rb.host;
      b.nvme = rb.nvme; // (a view of storage in the swap file: planSwaps)
      b.aliasOf = root;
      b.rankStride = stride;
      b.rankPeriod = stride ? period : 0;
      b.offset = off; // relative for now
      b.name = rb.name + ".view" + std::to_string(off);
      plan.valueBuffer[r] = addBuffer(b);
    }
  return success();
}

/// fsdp-offload's nvme: each host instruction reading state kept in the
/// swap file reads a staging buffer in the host arena instead, one per
/// state buffer, live while the instruction is (through its wait when it
/// is async); the runtime fills it from the file before the instruction
/// and writes it back after, when the instruction updates it in place.
/// With nvme-params a unit's storage is in the file too: its update swaps
/// it like its state, and each copy of it to the device (of the storage
/// or of a view of it) reads the whole blocks its bytes span into a
/// staging buffer and copies from a view of that. Nothing else may touch
/// what is in the file: the device never sees it.
LogicalResult MemoryPlanner::planSwaps() {
  auto fileRoot = [&](Value v) -> int64_t {
    auto it = plan.valueBuffer.find(v);
    if (it == plan.valueBuffer.end())
      return -1;
    int64_t root = rootOf(it->second);
    return plan.buffers[root].nvme ? root : -1;
  };
  for (Operation &op : body->without_terminator()) {
    if (!plan.instrIndex.count(&op) || isa<WaitOp>(op))
      continue;
    SmallVector<PlannedSwap> swaps;
    const bool copy = isa<ToDeviceOp>(op);
    for (Value v : op.getOperands()) {
      int64_t file = fileRoot(v);
      if (file < 0 || llvm::any_of(swaps, [&](const PlannedSwap &s) { return s.file == file; }))
        continue;
      const PlannedBuffer &fb = plan.buffers[file];
      const int64_t named = plan.valueBuffer.lookup(v);
      const PlannedBuffer &nb = plan.buffers[named];
      const char *what = fb.kind == BufKind::Param
                             ? "parameters kept in the swap file (offload-nvme-params)"
                             : "optimizer state kept in the swap file (offload-nvme)";
      if (!(op.hasAttr(kOnHostAttrName) && named == file) &&
          !(copy && (named == file || nb.rankStride == 0)))
        return op.emitOpError() << "reads @" << fb.name << ", " << what
                                << ": only a host instruction may (the whole buffer), or a copy "
                                   "to the device (the buffer or a view of it on every rank)";
      PlannedSwap s;
      s.file = s.operand = file;
      PlannedBuffer staging;
      staging.name = fb.name + ".swap";
      staging.type = fb.type;
      staging.kind = BufKind::State;
      staging.bytes = fb.bytes;
      staging.host = true;
      staging.ioAlign = fb.ioAlign; // the file's blocks land on its own
      if (named != file) {
        // The whole blocks the view's bytes span (nb.offset: from the
        // file buffer's start until placeTransients).
        const int64_t lo = nb.offset / fb.ioAlign * fb.ioAlign;
        const int64_t hi = alignUp(nb.offset + nb.bytes, fb.ioAlign);
        const int64_t elem = std::max<int64_t>(byteSize(fb.type) / fb.type.getNumElements(), 1);
        staging.name = fb.name + ".swap" + std::to_string(lo);
        staging.type = RankedTensorType::get({(hi - lo) / elem}, fb.type.getElementType());
        staging.bytes = hi - lo;
        s.offset = lo;
        s.operand = named;
      }
      s.staging = s.view = addBuffer(staging);
      transient.push_back(s.staging);
      if (named != file) {
        PlannedBuffer view;
        view.name = staging.name + ".view" + std::to_string(nb.offset - s.offset);
        view.type = nb.type;
        view.kind = BufKind::State;
        view.bytes = nb.bytes;
        view.host = true;
        view.aliasOf = s.staging;
        view.offset = nb.offset - s.offset; // relative for now
        s.view = addBuffer(view);
      }
      swaps.push_back(s);
    }
    for (Value r : op.getResults()) {
      int64_t file = fileRoot(r);
      if (file < 0)
        continue;
      auto it = llvm::find_if(swaps, [&](const PlannedSwap &s) { return s.file == file; });
      if (it == swaps.end() || copy || it->operand != file)
        return op.emitOpError() << "writes @" << plan.buffers[file].name
                                << " in the swap file (offload-nvme) without reading it: "
                                   "only an in-place update may";
      it->write = true;
    }
    if (!swaps.empty())
      plan.swaps[&op] = std::move(swaps);
  }
  // fsdp-offload's nvme-read-ahead R: the reads of the k-th swapping
  // instruction are issued after the (k-R)-th, the first R's after the
  // step's first instruction, so the drive reads ahead of the gradients
  // (and during the forward pass) instead of from when compute reaches
  // each update; computeLiveness widens the staging back to there. With
  // nvme-params the copies of storage on disk to the device count among
  // them: each is read while the copies before it run.
  int64_t ahead = 0;
  if (auto a = module->getAttrOfType<IntegerAttr>(kNvmeReadAheadAttrName))
    ahead = a.getInt();
  if (ahead > 0) {
    SmallVector<Operation *> order;
    Operation *first = nullptr;
    for (Operation &op : body->without_terminator()) {
      if (!first && plan.instrIndex.count(&op))
        first = &op;
      if (plan.swaps.count(&op) && (op.hasAttr("async") || isa<ToDeviceOp>(op)))
        order.push_back(&op); // (an update joined at once reads at its own)
    }
    for (size_t k = 0; k < order.size(); ++k)
      if (Operation *at = k >= size_t(ahead) ? order[k - ahead] : first; at && at != order[k])
        plan.swapReadAt[order[k]] = at;
  }
  return success();
}

// --- 3. Liveness over root buffers. --------------------------------------

int64_t MemoryPlanner::rootOf(int64_t id) {
  while (plan.buffers[id].aliasOf >= 0)
    id = plan.buffers[id].aliasOf;
  return id;
}

/// Every instruction reads and writes one side of memory, but for the
/// copies between them (fsdp-offload places them).
LogicalResult MemoryPlanner::checkSides() {
  for (Operation &op : body->without_terminator()) {
    // A wait touches no memory: it orders the stream after an async
    // collective or copy, on whichever side that wrote.
    if (!plan.instrIndex.count(&op) || isa<WaitOp>(op))
      continue;
    bool side = op.hasAttr(kOnHostAttrName);
    auto check = [&](Value v, bool want, StringRef what) -> LogicalResult {
      auto it = plan.valueBuffer.find(v);
      if (it == plan.valueBuffer.end() ||
          plan.buffers[rootOf(it->second)].host == want)
        return success();
      return op.emitOpError()
             << what << " is in " << (want ? "device" : "host")
             << " memory but the op runs on the " << (want ? "host" : "device")
             << ": run fsdp-offload to place the copies";
    };
    bool inSide = isa<ToDeviceOp>(op) ? true : isa<ToHostOp>(op) ? false : side;
    bool outSide = isa<ToHostOp>(op) ? true : isa<ToDeviceOp>(op) ? false : side;
    for (Value v : op.getOperands())
      if (failed(check(v, inSide, "an operand")))
        return failure();
    for (Value v : op.getResults())
      if (failed(check(v, outSide, "a result")))
        return failure();
    Value written;
    if (FlatSymbolRefAttr sym = writtenSymbol(&op, written)) {
      auto it = plan.symbolBuffer.find(sym.getValue());
      if (it != plan.symbolBuffer.end() &&
          plan.buffers[it->second].host != inSide)
        return op.emitOpError() << "writes " << sym << " across host and device memory";
    }
  }
  return success();
}

/// Widens v's buffer (and its root, if transient) to instruction `at`.
void MemoryPlanner::touch(Value v, int64_t at) {
  auto it = plan.valueBuffer.find(v);
  if (it == plan.valueBuffer.end() || at < 0)
    return;
  PlannedBuffer &own = plan.buffers[it->second];
  if (own.aliasOf >= 0) {
    own.first = std::min(own.first, at);
    own.last = std::max(own.last, at);
  }
  PlannedBuffer &root = plan.buffers[rootOf(it->second)];
  if (root.persistent)
    return;
  root.first = std::min(root.first, at);
  root.last = std::max(root.last, at);
}

/// Widens the staging buffers of `op`'s swaps (planSwaps) to `at`.
void MemoryPlanner::touchStaging(Operation *op, int64_t at) {
  auto it = plan.swaps.find(op);
  if (it == plan.swaps.end() || at < 0)
    return;
  for (const PlannedSwap &s : it->second)
    for (int64_t id : {s.staging, s.view}) {
      PlannedBuffer &b = plan.buffers[id];
      b.first = std::min(b.first, at);
      b.last = std::max(b.last, at);
    }
}

/// Each buffer's first and last instruction; transient values live
/// across a forward end are activations.
void MemoryPlanner::computeLiveness() {
  // Every transient buffer and every alias starts unused.
  for (PlannedBuffer &b : plan.buffers)
    if (!b.persistent || b.aliasOf >= 0) {
      b.first = INT64_MAX;
      b.last = -1;
    }
  for (Operation &op : *body) {
    auto it = plan.instrIndex.find(&op);
    int64_t at = it != plan.instrIndex.end() ? it->second : -2;
    for (Value r : op.getResults())
      touch(r, at);
    if (at >= 0 || isa<func::ReturnOp, SetGradOp>(op))
      for (Value v : op.getOperands())
        touch(v, at >= 0 ? at : end);
    touchStaging(&op, at);
    if (Operation *from = plan.swapReadAt.lookup(&op))
      touchStaging(&op, plan.instrIndex.lookup(from));
    // An async collective reads its input until its wait returns; an
    // async host update (fsdp-offload's overlap) every operand. One joined
    // in the next step (carried) reads them from where the step issues it
    // on, through the step's end, and in the next step up to its join: the
    // whole step.
    if (Operation *u = plan.carried.lookup(&op)) {
      for (Value v : u->getOperands()) {
        touch(v, 0);
        touch(v, end);
        auto it = plan.valueBuffer.find(v);
        if (it != plan.valueBuffer.end())
          wholeStep.insert(rootOf(it->second));
      }
      touchStaging(u, 0);
      touchStaging(u, end);
      for (const PlannedSwap &s : plan.swaps.lookup(u))
        wholeStep.insert(s.staging);
    } else if (auto w = dyn_cast<WaitOp>(op))
      if (Operation *c = w.getInput().getDefiningOp()) {
        if (c->hasAttr(kOnHostAttrName)) {
          for (Value v : c->getOperands())
            touch(v, at);
          touchStaging(c, at);
        } else {
          touch(c->getOperand(0), at);
          touchStaging(c, at); // (an async copy of storage on disk)
        }
      }
  }
  // A value defined by a storage alias (a view) whose users are
  // instructions: touched above through the users' operands. Buffers never
  // written nor read (unused results) still occupy their instruction.
  for (PlannedBuffer &b : plan.buffers) {
    if (b.persistent) {
      b.first = -1;
      b.last = end;
    } else if (b.last < 0) {
      b.first = b.last = 0;
    }
    if (b.first == INT64_MAX)
      b.first = b.last;
  }
  // Activations: transient values computed in forward and read in backward.
  for (int64_t id : transient) {
    PlannedBuffer &b = plan.buffers[id];
    if (b.kind == BufKind::Temp && !wholeStep.contains(id) &&
        llvm::any_of(forwardEnds, [&](int64_t forwardEnd) {
          return b.first <= forwardEnd && b.last > forwardEnd;
        }))
      b.kind = BufKind::Activation;
  }
}

// --- 4. Greedy-by-size placement of transient root buffers. --------------

void MemoryPlanner::placeTransients() {
  std::stable_sort(transient.begin(), transient.end(), [&](int64_t a, int64_t b) {
    const auto &x = plan.buffers[a], &y = plan.buffers[b];
    if (x.extent() != y.extent())
      return x.extent() > y.extent();
    return x.first < y.first;
  });
  // Each arena on its own.
  std::vector<int64_t> placed[2];
  int64_t arena[2] = {persistentEnd, hostPersistentEnd};
  const int64_t base[2] = {persistentEnd, hostPersistentEnd};
  plan.placed = place;
  if (!place)
    transient.clear();
  for (int64_t id : transient) {
    PlannedBuffer &b = plan.buffers[id];
    int side = b.host ? 1 : 0;
    SmallVector<std::pair<int64_t, int64_t>> busy;
    for (int64_t o : placed[side]) {
      const PlannedBuffer &p = plan.buffers[o];
      if (p.first <= b.last && b.first <= p.last)
        busy.push_back({p.offset, p.offset + p.extent()});
    }
    llvm::sort(busy);
    // A swap's staging buffer starts on a block and reserves its last one
    // whole (PlannedBuffer::ioAlign).
    const int64_t align = std::max(alignment, b.ioAlign);
    int64_t off = alignUp(base[side], align);
    for (auto [lo, hi] : busy) {
      if (off + b.extent() <= lo)
        break;
      off = std::max(off, alignUp(hi, align));
    }
    b.offset = off;
    arena[side] = std::max(arena[side], off + b.extent());
    placed[side].push_back(id);
  }
  plan.arenaBytes = place ? std::max(arena[0], cursor) : 0;
  plan.hostArenaBytes = place ? std::max(arena[1], hostCursor) : 0;
  for (PlannedBuffer &b : plan.buffers)
    if (b.aliasOf >= 0) {
      b.aliasOf = rootOf(b.aliasOf);
      b.offset += plan.buffers[b.aliasOf].offset;
    }
}

/// Peak live bytes and breakdowns (root buffers only).
void MemoryPlanner::measurePeak() {
  std::vector<int64_t> live(std::max<int64_t>(end, 1), 0), hostLive(live.size(), 0),
      stagingLive(live.size(), 0);
  std::vector<std::array<int64_t, kNumBufKinds>> liveKind(
      live.size(), std::array<int64_t, kNumBufKinds>{});
  for (const PlannedBuffer &b : plan.buffers) {
    if (b.nvme && b.aliasOf < 0) // the swap file is no arena
      (b.kind == BufKind::Param ? plan.nvmeParams : plan.nvmeState) += b.bytes;
    if (b.aliasOf >= 0 || b.nvme)
      continue;
    if (b.host) {
      plan.hostTotalByKind[(int)b.kind] += b.bytes;
      bool staging = b.kind == BufKind::State && !b.persistent;
      if (b.kind == BufKind::State && b.persistent)
        plan.hostPersistentState += b.bytes;
      for (int64_t i = std::max<int64_t>(b.first, 0); i <= std::min<int64_t>(b.last, end - 1);
           ++i) {
        hostLive[i] += b.bytes;
        if (staging)
          stagingLive[i] += b.bytes;
      }
      continue;
    }
    plan.totalByKind[(int)b.kind] += b.bytes;
    for (int64_t i = std::max<int64_t>(b.first, 0);
         i <= std::min<int64_t>(b.last, end - 1); ++i) {
      live[i] += b.bytes;
      liveKind[i][(int)b.kind] += b.bytes;
    }
  }
  for (int64_t i = 0; i < (int64_t)live.size(); ++i) {
    plan.hostPeakLive = std::max(plan.hostPeakLive, hostLive[i]);
    plan.hostStagingPeak = std::max(plan.hostStagingPeak, stagingLive[i]);
    if (live[i] > plan.peakLive) {
      plan.peakLive = live[i];
      plan.peakInstr = i;
    }
    for (int k = 0; k < kNumBufKinds; ++k)
      plan.maxLiveByKind[k] = std::max(plan.maxLiveByKind[k], liveKind[i][k]);
  }
  for (int k = 0; k < kNumBufKinds; ++k)
    plan.peakByKind[k] = liveKind[plan.peakInstr][k];
  plan.liveBytes = std::move(live);
}

MemoryPlanAnalysis::MemoryPlanAnalysis(Operation *op) : plan(failure()) {
  auto module = cast<ModuleOp>(op);
  if (auto a = module->getAttrOfType<IntegerAttr>("fsdp.alignment"))
    alignment = a.getInt();
  auto step = module.lookupSymbol<func::FuncOp>(kTrainStepName);
  if (!step) {
    mlir::emitError(module.getLoc()) << "no @" << kTrainStepName
                                     << ": run fsdp-autodiff first";
    return;
  }
  plan = planMemory(module, step, alignment);
}
