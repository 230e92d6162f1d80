//===- Recompute.cpp - activation recomputation (checkpointing) -----------===//
//
// fsdp-recompute: trades compute for memory. A forward value the backward
// pass reads (a saved activation) normally lives from the forward op that
// computes it to its last backward read, so at the start of the backward
// pass every layer's saved activations are live at once. This pass chooses
// forward ops to recompute and clones each into the backward pass right
// before the first backward read of its result; the backward reads the
// clone and the original dies in the forward pass.
//
// Algorithm.
// 1. Forward ops: the ops the loss depends on (with gradient accumulation,
//    each micro-batch's loss term; an op belongs to the micro-batch of the
//    first loss term that reaches it). Every other op of @train_step
//    (backward, optimizer) is a "backward reader"; a forward result that a
//    backward reader uses is "saved".
// 2. Policy -> the set R of forward ops to recompute.
//    - unit: the forward ops of each micro-batch are cut, in program order,
//      into segments, one per run of ops reading parameters of one FSDP
//      unit (ops reading no parameter join the segment they follow; ops
//      before the first parameter read form a preamble). R = every op of a
//      segment whose results no later segment reads: only each segment's
//      outputs (the next unit's input) stay saved. The last segment of a
//      micro-batch (the one computing the loss) is not recomputed: its
//      backward follows at once, so recomputing it would save nothing.
//    - selective (Korthikanti et al. 2022): R = the cheap ops (elementwise,
//      bias, silu, layer/RMS norm, rope, softmax, attention, reshapes and
//      slices) whose every operand is available in the backward pass
//      anyway: a parameter, an input, a saved value, or itself recomputed.
//      Matmul outputs stay saved, and no value is kept across the forward
//      pass that was not kept before (a clone may only hold a saved operand
//      a little longer inside the backward pass).
// 3. Rewrite: walking the backward readers in program order, each operand
//    whose definition is in R is replaced by its clone, built (with its
//    recomputed operands, recursively) just before that reader and reused
//    by later readers. Under the unit policy the first such reader of a
//    segment triggers the clone of all of the segment's values the
//    backward needs, in forward order: the unit's forward runs again, once.
// Clones carry the `fsdp.recompute` attribute (ignored by the lowering).
//
// Why here, after fsdp-group-units and before fsdp-shard: after autodiff
// the backward pass is explicit IR, so what is saved is simply a forward
// value with a backward reader, and recomputation is a clone; the units
// are final once fsdp-group-units ran. fsdp-shard then treats a clone's
// parameter reads like any other backward read (a read after the loss):
// at stage 3 they read the parameters all-gathered for the backward pass,
// and that all-gather is placed before the unit's first backward read,
// i.e. before the recomputed forward. No later pass needs to know.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/SetVector.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPRECOMPUTE
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

/// Reads of storage: never recomputed (they cost nothing and have no
/// buffer of their own); a clone reads the original.
bool isStorageRead(Operation *op) { return isa<GetParamOp, MicrobatchOp>(op); }

/// The selective policy's cheap ops: memory-bound, O(size) work (or, for
/// attention, work that only needs its saved inputs q, k and v).
bool isCheap(Operation *op) {
  return isa<AddOp, SubOp, MulOp, DivOp, NegOp, ScaleOp, DropoutOp, ReluOp, GeluOp, SiluOp,
             SoftmaxOp, BiasAddOp, CastOp, BroadcastOp, LayerNormOp, RmsNormOp,
             RopeOp, AttentionOp, ReshapeOp, TransposeOp, SliceOp, ConcatOp>(
      op);
}

struct RecomputePass : mlir::fsdp::impl::FsdpRecomputeBase<RecomputePass> {
  using Base::Base;

  void runOnOperation() override;

private:
  /// The clone of `v` (defined by an op in `recompute`), built before
  /// `before` together with the clones of its recomputed operands.
  Value materialize(Value v, Operation *before);

  DenseSet<Operation *> recompute;
  IRMapping clones;
  OpBuilder *builder = nullptr;
};

Value RecomputePass::materialize(Value v, Operation *before) {
  if (Value c = clones.lookupOrNull(v))
    return c;
  Operation *def = v.getDefiningOp();
  for (Value operand : def->getOperands())
    if (Operation *d = operand.getDefiningOp(); d && recompute.contains(d))
      materialize(operand, before);
  builder->setInsertionPoint(before);
  Operation *clone = builder->clone(*def, clones);
  clone->setAttr(kRecomputeAttrName, builder->getUnitAttr());
  ++numRecomputed;
  return clones.lookup(v);
}

void RecomputePass::runOnOperation() {
  ModuleOp module = getOperation();
  if (policy != "none" && policy != "unit" && policy != "selective") {
    mlir::emitError(module.getLoc()) << "unknown recompute policy '" << policy
                                     << "': expected none, unit or selective";
    return signalPassFailure();
  }
  if (policy == "none")
    return;
  recompute.clear();
  clones.clear();
  func::FuncOp step = getTrainStep(module, "fsdp-autodiff");
  if (!step)
    return signalPassFailure();
  if (!module.getOps<UnitOp>().empty()) {
    mlir::emitError(module.getLoc())
        << "fsdp-recompute must run before fsdp-shard: after it, parameter "
           "reads are views of all-gathered units";
    return signalPassFailure();
  }
  Block &body = step.getBody().front();
  auto ret = cast<func::ReturnOp>(body.getTerminator());

  // --- 1. Forward ops, by micro-batch; saved values. ---------------------
  DenseMap<Operation *, int64_t> microOf;
  for (auto [k, term] : llvm::enumerate(accumTerms(ret.getOperand(0)))) {
    SmallVector<Operation *> work;
    if (Operation *d = term.getDefiningOp())
      work.push_back(d);
    while (!work.empty()) {
      Operation *op = work.pop_back_val();
      if (!microOf.try_emplace(op, k).second)
        continue;
      for (Value operand : op->getOperands())
        if (Operation *d = operand.getDefiningOp())
          work.push_back(d);
    }
  }
  SmallVector<Operation *> forward, readers;
  for (Operation &op : body.without_terminator())
    (microOf.count(&op) ? forward : readers).push_back(&op);
  // Computed before any rewrite: step 3 redirects backward reads to clones.
  DenseSet<Value> saved;
  for (Operation *op : forward)
    for (Value r : op->getResults())
      if (llvm::any_of(r.getUsers(),
                       [&](Operation *u) { return !microOf.count(u); }))
        saved.insert(r);

  // --- 2. The policy's set R. ----------------------------------------------
  // Units are looked up by parameter; frozen parameters share their unit's
  // segment (they are read in the same place).
  auto unitOf = [&](Operation *op) -> std::optional<StringRef> {
    for (Value operand : op->getOperands())
      if (auto get = operand.getDefiningOp<GetParamOp>()) {
        auto p = SymbolTable::lookupNearestSymbolFrom<ParamOp>(
            op, get.getNameAttr());
        if (p)
          return p.getUnit() ? *p.getUnit() : StringRef("root");
      }
    return std::nullopt;
  };
  // Segment of each forward op (unit policy), in program order; -1: the
  // preamble of a micro-batch.
  DenseMap<Operation *, int64_t> segmentOf;
  SmallVector<SmallVector<Operation *>> segments;
  if (policy == "unit") {
    SmallVector<int64_t> lastOfMicro; // last segment of each micro-batch
    SmallVector<int64_t> indexInMicro; // of each segment
    int64_t cur = -1, curMicro = -1, inMicro = 0;
    std::optional<StringRef> curUnit;
    for (Operation *op : forward) {
      if (isStorageRead(op))
        continue;
      int64_t micro = microOf[op];
      std::optional<StringRef> unit = unitOf(op);
      if (micro != curMicro) {
        curMicro = micro;
        cur = -1;
        inMicro = 0;
        curUnit.reset();
      }
      if (unit && unit != curUnit) {
        segments.emplace_back();
        indexInMicro.push_back(inMicro++);
        cur = segments.size() - 1;
        curUnit = unit;
        if ((int64_t)lastOfMicro.size() <= micro)
          lastOfMicro.resize(micro + 1, -1);
        lastOfMicro[micro] = cur;
      }
      segmentOf[op] = cur;
      if (cur >= 0)
        segments[cur].push_back(op);
    }
    DenseSet<int64_t> last(lastOfMicro.begin(), lastOfMicro.end());
    for (auto [s, ops] : llvm::enumerate(segments)) {
      // units=K: only the first K segments (their backward runs last, when
      // the later units' activations are already freed).
      if (last.contains(s) || (units >= 0 && indexInMicro[s] >= units))
        continue;
      for (Operation *op : ops) {
        bool readLater = llvm::any_of(op->getUsers(), [&](Operation *u) {
          auto it = segmentOf.find(u);
          return it != segmentOf.end() && it->second != (int64_t)s;
        });
        if (!readLater)
          recompute.insert(op);
      }
    }
  } else {
    auto available = [&](Value v) {
      Operation *d = v.getDefiningOp();
      return !d || isStorageRead(d) || recompute.contains(d) ||
             saved.contains(v);
    };
    for (Operation *op : forward)
      if (isCheap(op) && llvm::all_of(op->getOperands(), available))
        recompute.insert(op);
  }

  // --- 3. Clone into the backward pass. ------------------------------------
  OpBuilder b(&getContext());
  builder = &b;
  DenseSet<int64_t> segmentDone;
  for (Operation *reader : readers) {
    for (OpOperand &use : reader->getOpOperands()) {
      Operation *def = use.get().getDefiningOp();
      if (!def || !recompute.contains(def))
        continue;
      if (policy == "unit") {
        int64_t s = segmentOf.lookup(def);
        if (segmentDone.insert(s).second)
          for (Operation *op : segments[s])
            if (recompute.contains(op))
              for (Value r : op->getResults())
                if (saved.contains(r))
                  materialize(r, reader);
      }
      use.set(materialize(use.get(), reader));
    }
  }
}

} // namespace
