//===- Shard.cpp - ZeRO stages 0-3 as a rewrite of the training step -----===//
//
// fsdp-shard: the heart of the compiler. It finds, by looking at the
// training graph, everything weight-update sharding needs: which values are
// gradients (the operands of the elementwise optimizer updates), where each
// unit's gradients are complete (the last definition among them), where
// each unit's parameters are first and last read in forward and in
// backward (relative to the loss), and rewrites the step accordingly.
//
// Algorithm.
// 1. Units: parameters are grouped by their `unit` (frozen parameters of a
//    unit go to a unit of their own, which is gathered but never updated)
//    and packed into an `fsdp.unit` of numel padded to a multiple of N.
// 2. Reads: every fsdp.get_param of the model becomes an fsdp.view of the
//    unit's flat parameters. With stage 3 the flat parameters come from an
//    all-gather of the local shard, issued before the unit's first forward
//    read and (reshard-after-forward) again before its first backward read;
//    liveness then frees the gathered buffer after its last read.
// 3. Gradients: a unit's gradients are packed into one flat buffer (the
//    memory planner lets the gradient ops write straight into it) right
//    after the last of them is computed, and all-reduced (stage 0) or
//    reduce-scattered (stage 2/3) there; stage 1 reduce-scatters after the
//    whole backward pass.
// 4. Update: the per-parameter updates are replaced by one update per unit
//    on flat tensors (valid because every update is elementwise), on the
//    whole unit (stage 0) or on this rank's shard (stages 1-3), with the
//    optimizer state sharded the same way; stages 1/2 all-gather the new
//    parameters. Clipping sums squared norms over shards and all-reduces
//    the scalar. The loss is all-reduced (mean), and so is a
//    cross-entropy's kept-label count (ignore_index), right after it.
// Mixed precision (fsdp-mixed-precision ran before autodiff): a read whose
// only user is a cast is a read in the cast's dtype, so the unit is cast
// once (the shard before its all-gather at stage 3) and gathered in it;
// gradients are packed and reduced in the module's reduce_dtype and cast
// to the master dtype right before the unit's update.
// Every rank runs this same program, so collectives are issued in the same
// order everywhere by construction. ShardRewrite below runs these steps,
// one method each, in this order.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "runtime/core/ShapeRules.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/MapVector.h"
#include "llvm/ADT/SetVector.h"

#include <optional>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPSHARD
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct UnitInfo {
  std::string name;
  bool frozen = false;
  SmallVector<ParamOp> params;
  SmallVector<int64_t> offsets;
  int64_t decayNumel = 0; ///< the leading elements weight decay applies to
  int64_t numel = 0;
  int64_t index = 0; ///< position among the units (the stochastic rounding's key)
  UnitOp op;
};

/// One per-parameter optimizer update found in the step.
struct Update {
  Operation *op = nullptr;
  StringAttr param;
  Value rawGrad; ///< the gradient before clipping
};

bool isUpdateOp(Operation *op) {
  return isa<AdamwUpdateOp, SgdUpdateOp, SgdMomentumUpdateOp, LambUpdateOp>(op);
}

/// The reads of one unit in one micro-batch and one dtype: its gets, and
/// the first and last uses on each side of the micro-batch's loss.
struct Reads {
  SmallVector<GetParamOp> gets;
  Operation *firstForwardUse = nullptr, *firstBackwardUse = nullptr;
  Operation *lastForwardUse = nullptr;
  int64_t lossIdx = -1;
};

RankedTensorType withElem(Type t, Type elem) {
  return RankedTensorType::get(cast<RankedTensorType>(t).getShape(), elem);
}
Type elemOf(Value v) { return cast<RankedTensorType>(v.getType()).getElementType(); }
FlatSymbolRefAttr symOf(UnitInfo &u) { return FlatSymbolRefAttr::get(u.op.getSymNameAttr()); }
RankedTensorType fullTy(UnitInfo &u) { return cast<RankedTensorType>(u.op.getType()); }
RankedTensorType shardTy(UnitInfo &u) { return cast<RankedTensorType>(u.op.getShardType()); }
/// Whether v is the factor gradients are multiplied by before their update.
bool isCoef(Value v) {
  Operation *d = v.getDefiningOp();
  return d && isa<ClipCoefOp, GradCoefOp>(d);
}
/// What a parameter read stands for: the read, or its only user when that
/// is a cast (fsdp-mixed-precision: a read in the cast's dtype).
Value readValue(GetParamOp get) {
  if (get->hasOneUse())
    if (auto c = dyn_cast<CastOp>(*get->getUsers().begin()))
      return c.getResult();
  return get.getResult();
}

struct ShardPass : mlir::fsdp::impl::FsdpShardBase<ShardPass> {
  using Base::Base;

  void runOnOperation() override;
};

/// The pass options fsdp-shard reads (Passes.td).
struct ShardOptions {
  int64_t worldSize, stage, reshardUnits;
  std::string mesh, reshardAfterForward, offload, frozenStorage;
  bool reshardAfterBackward = true;
  std::string weightQuantization = "none";
  int64_t quantizationBlock = 256;
  std::string gradientQuantization = "none";
  int64_t ranksPerNode = 0;
};

/// One run of fsdp-shard over a module: the algorithm of the file comment,
/// one method per step, called in order by run(). What a step finds (the
/// units, program order, the updates, the reads, the flat gradients) is
/// kept in members for the steps after it.
class ShardRewrite {
public:
  ShardRewrite(ModuleOp module, const ShardOptions &options)
      : options(options), module(module), ctx(module.getContext()), b(ctx) {}
  LogicalResult run();
  /// Collectives inserted (the pass's statistic).
  int64_t collectives = 0;

private:
  LogicalResult checkStep();
  LogicalResult readOptions();
  LogicalResult buildUnits();
  void mergeRecomputedCasts();
  LogicalResult analyzeStep();
  LogicalResult findUpdates();
  void collectReads();
  bool keepsForwardGather(const Reads &r);
  void shardNarrowUnits();
  void narrowFrozenStorage();
  LogicalResult narrowTrainableStorage();
  Type stepElem(UnitInfo &u);
  Value gather(UnitInfo &u, Operation *before, Type elem);
  Value regather(Value full, Operation *lastFwd, Operation *firstBwd);
  void chooseKeptGathers();
  void rewriteReads();
  LogicalResult collectGradientTerms();
  bool narrowable(Value v, Type packElem);
  Value narrow(Value v, Type packElem);
  LogicalResult reduceGradients();
  void eraseOptimizerSection();
  void toMaster(UnitInfo &u, Value &g, Location loc);
  void clipGradients(Location loc);
  void updateUnits(Location loc);
  Value lambNorms(UnitInfo &u, ArrayRef<Value> operands, NamedAttrList &attrs, RankedTensorType pTy,
                  Location loc);

  void renumber();
  int64_t microOf(Operation *op);
  Value allGather(Location loc, Type ty, Value in, StringAttr group);
  Value quantizedGather(UnitInfo &u, Value s, Location loc);
  Value reduceScatter(Location loc, Type ty, Value in, StringRef reduce, StringAttr group);
  Value quantizedReduceScatter(Location loc, RankedTensorType ty, Value in, StringRef reduce,
                               StringAttr group);
  Value allReduce(Location loc, Type ty, Value in, StringRef reduce, StringAttr group);

  const ShardOptions &options;
  ModuleOp module;
  MLIRContext *ctx;
  OpBuilder b;
  func::FuncOp step;
  Block *body = nullptr;
  func::ReturnOp ret;

  // The mesh and the stage (readOptions).
  int64_t world = 1, replicas = 1, shards = 1;
  int64_t eff = 0; ///< the stage as run: 1 and 2 are 0 with one shard
  bool reshard = false;
  int64_t hpz = 0; ///< the intermediate group's size (1 < G < S), or 0
  StringAttr shardGroup, replicaGroup, reshardGroup;

  // 1. Units.
  llvm::MapVector<StringRef, UnitInfo> units;
  llvm::DenseMap<StringAttr, std::pair<UnitInfo *, int64_t>> where;
  std::vector<std::string> names; // keeps StringRef keys alive
  DictionaryAttr optDict;
  bool matricesOnly = false;

  // Program order, micro-batches, precision (analyzeStep).
  DenseMap<Operation *, int64_t> index;
  SmallVector<int64_t> lossIdx;
  int64_t numMicro = 0;
  bool reducePerMicro = false;
  Type reduceElem;
  bool stochastic = false; // round trainable units' master casts stochastically
  bool bf16Master = false; // master-dtype=bf16: trainable units stored in bf16
  llvm::DenseSet<UnitInfo *> narrowedMaster; // the units it narrowed
  bool quantize = false;   // weight-quantization=int8 (ZeRO++'s qwZ)
  int64_t quantizedGathers = 0;
  bool quantizeGrads = false; // gradient-quantization=int8 (ZeRO++'s qgZ)
  /// Hierarchical qgZ: ranks of a shard group on one node (1 < L < S, L
  /// dividing S), or 0 for one all-to-all over the shard group.
  int64_t qgzNode = 0;
  int64_t quantizedReductions = 0;

  // The optimizer section (findUpdates).
  SmallVector<Update> updates;
  llvm::DenseMap<StringAttr, Update *> updateOf;
  // The factor every gradient is multiplied by before its update: clipping
  // (fsdp.clip_coef) or loss-scale unscaling (fsdp.grad_coef, maybe also
  // clipping); rebuilt below over the flat gradients.
  Operation *clipCoef = nullptr;
  DenseSet<Operation *> optimizerOps; // erased after the rewrite
  FloatAttr maxNorm;
  Value oldSumsq;  // skip_nonfinite of the updates and a step result
  Value lossScale; // fsdp.grad_coef's scale (an argument): null for clip_coef
  // What the per-unit update needs from the first per-parameter one (all
  // share options and lr/step): they are erased before it is built.
  std::optional<OperationName> updName;
  SmallVector<NamedAttribute> updAttrs;
  SmallVector<Value> updOperands;
  unsigned updResults = 0;
  // State kinds by operand position of the update op.
  SmallVector<std::pair<unsigned, std::string>> stateSlots;
  SmallVector<Type> stateElems; ///< each state slot's element type

  // 2. Reads.
  llvm::MapVector<std::tuple<UnitInfo *, int64_t, Type>, Reads> reads;
  // The gathers of a unit sharded at stage 1/2, by dtype: one per step,
  // read by every micro-batch (the parameters do not change within it).
  llvm::DenseMap<std::pair<UnitInfo *, Type>, Value> stepGather;
  llvm::DenseSet<UnitInfo *> keepGather;

  // 3. Gradients.
  int64_t rounds = 1;
  llvm::DenseMap<StringAttr, SmallVector<Value>> termsOf;
  SmallVector<Operation *> perParamAccum; // replaced by the per-unit sums
  llvm::MapVector<UnitInfo *, Value> flatGrad;
  // Per-parameter casts to f32 of bf16 gradients that a bf16 pack reads
  // past: erased with the per-parameter updates once nothing reads them.
  llvm::SetVector<Operation *> maybeDead;
};

void ShardPass::runOnOperation() {
  ShardOptions options{worldSize,
                       stage,
                       reshardUnits,
                       mesh,
                       reshardAfterForward,
                       offload,
                       frozenStorage,
                       reshardAfterBackward,
                       weightQuantization,
                       quantizationBlock,
                       gradientQuantization,
                       ranksPerNode};
  ShardRewrite rewrite(getOperation(), options);
  LogicalResult result = rewrite.run();
  numCollectives += rewrite.collectives;
  if (failed(result))
    signalPassFailure();
}

LogicalResult ShardRewrite::run() {
  if (failed(checkStep()) || failed(readOptions()))
    return failure();
  // 1. Units.
  if (failed(buildUnits()))
    return failure();
  mergeRecomputedCasts();
  // Program order, the loss, the optimizer section.
  if (failed(analyzeStep()) || failed(findUpdates()))
    return failure();
  // 2. Reads become views of the gathered units.
  collectReads();
  shardNarrowUnits();
  narrowFrozenStorage();
  if (failed(narrowTrainableStorage()))
    return failure();
  chooseKeptGathers();
  rewriteReads();
  // 3. Gradients packed per unit and reduced.
  if (failed(collectGradientTerms()) || failed(reduceGradients()))
    return failure();
  // 4. One update per unit, at the end of the step.
  eraseOptimizerSection();
  b.setInsertionPoint(ret);
  Location loc = step.getLoc();
  if (oldSumsq) // clipCoef itself is erased by now
    clipGradients(loc);
  updateUnits(loc);
  // weight-quantization quantizes the gathers of a unit's compute copy
  // (stage 3; stages 1/2 with a 16-bit compute dtype, where the master
  // shard is apart from it). Stages 1/2 in f32 gather the updated
  // parameters themselves, kept exact: say so rather than ignore it.
  if (quantize && quantizedGathers == 0)
    mlir::emitWarning(module.getLoc())
        << "fsdp-shard: weight-quantization=int8 quantized no all-gather: only the gathers "
           "of a compute copy are (stage 3, or stages 1/2 with param-dtype=bf16|f16); at "
           "stages 1/2 in f32 the all-gather of the updated parameters is the parameters "
           "and stays exact, and a world of one shard gathers nothing";
  // gradient-quantization quantizes reduce-scatters: stage 0 all-reduces
  // (a whole replica's gradients on every rank), and one shard a replica
  // scatters nothing.
  if (quantizeGrads && quantizedReductions == 0)
    mlir::emitWarning(module.getLoc())
        << "fsdp-shard: gradient-quantization=int8 quantized no reduction: only the "
           "reduce-scatters of sharded units' gradients are (stages 1-3 with more than one "
           "shard); stage 0's all-reduce and the replicas' all-reduce stay exact";
  // The loss every rank reports is the global mean.
  if (world > 1) {
    Value loss = ret.getOperand(0);
    ret.setOperand(0, allReduce(loc, loss.getType(), loss, "mean", StringAttr()));
    // So is a cross-entropy's kept-label count (ignore_index): each rank's
    // loss divides its kept sum by the ranks' mean count, and the mean of
    // those losses is the global kept mean.
    SmallVector<CountLabelsOp> counts(body->getOps<CountLabelsOp>());
    for (CountLabelsOp count : counts) {
      b.setInsertionPointAfter(count);
      Value mean = allReduce(count.getLoc(), count.getType(), count, "mean", StringAttr());
      count.getResult().replaceAllUsesExcept(mean, mean.getDefiningOp());
    }
  }
  return success();
}

Value ShardRewrite::allGather(Location loc, Type ty, Value in, StringAttr group) {
  ++collectives;
  return b.create<AllGatherOp>(loc, ty, in, UnitAttr(), group).getResult();
}

Value ShardRewrite::reduceScatter(Location loc, Type ty, Value in, StringRef reduce,
                                  StringAttr group) {
  ++collectives;
  return b.create<ReduceScatterOp>(loc, ty, in, b.getStringAttr(reduce), UnitAttr(), group)
      .getResult();
}

/// ZeRO++'s qgZ: the reduce-scatter of `in` (G parts of S) as each part
/// quantized on its own, an all-to-all that hands part r to rank r, and the
/// G parts rank r received dequantized and summed in f32 (part order).
///
/// Hierarchical (qgzNode = L, the G ranks on M = G / L nodes; ZeRO++'s
/// hierarchical qgZ): first within the node, where the links are fast,
/// then across nodes with 1/L of the bytes. Rank n L + j (place j on node
/// n) quantizes the parts it sends place j of its node in one run: chunks
/// j, j + L, ..., (n' L + j for every node n'; fsdp.quantize `chunks`);
/// the node all-to-all hands them to place j, which sums what its node's
/// L ranks sent (f32, their mean), requantizes those M chunks as M parts
/// and the all-to-all across nodes (group "cross": place j of every node)
/// hands chunk n L + j to node n's place j, which sums the M nodes'
/// parts: the mean of the node means, its own shard. Each rank sends
/// (L - 1) / L of the unit's int8 bytes over the node link and
/// (M - 1) / (M L) of them across nodes (the flat all-to-all: (G - L) / G
/// of them across nodes, L x more).
Value ShardRewrite::quantizedReduceScatter(Location loc, RankedTensorType ty, Value in,
                                           StringRef reduce, StringAttr group) {
  ++collectives;
  ++quantizedReductions;
  const int64_t parts = cast<RankedTensorType>(in.getType()).getNumElements() / ty.getNumElements();
  const int64_t block = options.quantizationBlock;
  auto bytes = [&](int64_t parts, int64_t n) {
    return RankedTensorType::get({parts * ::fsdp::shapes::quantizedBytes(n, block)},
                                 b.getIntegerType(8));
  };
  auto exchange = [&](Value v, int64_t parts, IntegerAttr chunks, int64_t n, Type out,
                      StringAttr over) -> Value {
    RankedTensorType t = bytes(parts, n);
    Value q = b.create<QuantizeOp>(loc, t, v, b.getI64IntegerAttr(block),
                                   b.getI64IntegerAttr(parts), chunks);
    Value r = b.create<AllToAllOp>(loc, t, q, UnitAttr(), over).getResult();
    return b.create<DequantizeOp>(loc, out, r, b.getI64IntegerAttr(block),
                                  b.getI64IntegerAttr(parts), b.getStringAttr(reduce));
  };
  const int64_t n = ty.getNumElements();
  if (!qgzNode)
    return exchange(in, parts, IntegerAttr(), n, ty, group);
  ++collectives;
  const int64_t node = qgzNode, nodes = parts / node;
  auto mid = RankedTensorType::get({nodes * n}, b.getF32Type());
  Value sum =
      exchange(in, node, b.getI64IntegerAttr(parts), nodes * n, mid, b.getStringAttr("node"));
  return exchange(sum, nodes, IntegerAttr(), n, ty, b.getStringAttr("cross"));
}

Value ShardRewrite::allReduce(Location loc, Type ty, Value in, StringRef reduce, StringAttr group) {
  ++collectives;
  return b.create<AllReduceOp>(loc, ty, in, b.getStringAttr(reduce), UnitAttr(), group).getResult();
}

/// index: each op's position in the step (again after insertions).
void ShardRewrite::renumber() {
  index.clear();
  for (auto [i, op] : llvm::enumerate(*body))
    index[&op] = i;
}

/// The micro-batch an op of the forward pass belongs to: the number of
/// losses computed before it (its own comes after it).
int64_t ShardRewrite::microOf(Operation *op) {
  int64_t k = llvm::upper_bound(lossIdx, index[op] - 1) - lossIdx.begin();
  return std::min(k, numMicro - 1);
}

/// The step to rewrite: autodiffed, with an optimizer, not yet sharded.
LogicalResult ShardRewrite::checkStep() {
  // 65536 ranks: the runtime's bound too (Plan.cpp kMaxWorld).
  if (options.worldSize < 1 || options.worldSize > 65536 || options.stage < 0 ||
      options.stage > 3) {
    mlir::emitError(module.getLoc()) << "fsdp-shard needs world-size in 1..65536 "
                                        "and stage in 0..3, found world-size="
                                     << options.worldSize << " stage=" << options.stage;
    return failure();
  }
  step = getTrainStep(module, "fsdp-autodiff and fsdp-insert-optimizer");
  if (!step)
    return failure();
  if (!module.getOps<UnitOp>().empty()) {
    mlir::emitError(module.getLoc()) << "the module is already sharded";
    return failure();
  }
  body = &step.getBody().front();
  ret = cast<func::ReturnOp>(body->getTerminator());
  for (Operation &op : *body)
    if (isa<SetGradOp>(op)) {
      op.emitOpError() << "fsdp-shard needs an optimizer: with optimizer=none "
                          "the step outputs whole gradients";
      return failure();
    }
  return success();
}

/// The mesh (R replicas x S shards), the stage as run and where
/// parameters reshard after the forward pass, from the pass options.
LogicalResult ShardRewrite::readOptions() {
  world = options.worldSize;
  // The mesh: R replicas x S shards, rank r = replica * S + shard.
  shards = world;
  if (!options.mesh.empty()) {
    StringRef text = options.mesh, r, sh;
    std::tie(r, sh) = text.split('x');
    if (r.getAsInteger(10, replicas) || sh.getAsInteger(10, shards) ||
        replicas < 1 || shards < 1 || replicas > world || shards > world ||
        replicas * shards != world) {
      mlir::emitError(module.getLoc()) << "fsdp-shard: mesh='" << options.mesh
                                       << "' must be RxS with R*S = world-size (" << world << ")";
      return failure();
    }
  }
  // With one shard per replica there is nothing to shard: stages 1 and 2
  // are stage 0.
  const int64_t stage = options.stage;
  eff = (shards == 1 && (stage == 1 || stage == 2)) ? 0 : stage;
  // reshard-after-forward: true (to the S ranks of the shard group), false
  // (keep the gathered unit: 1 rank) or G ranks (hpZ: 1 < G < S).
  int64_t reshardTo = shards;
  {
    StringRef v = options.reshardAfterForward;
    bool ok = true;
    if (v == "true")
      reshardTo = shards;
    else if (v == "false")
      reshardTo = 1;
    else
      ok = !v.getAsInteger(10, reshardTo) && reshardTo >= 1 &&
           (eff != 3 || (reshardTo <= shards && shards % reshardTo == 0));
    if (!ok) {
      mlir::emitError(module.getLoc())
          << "fsdp-shard: reshard-after-forward='" << v
          << "' must be true, false or a number of ranks G dividing the "
          << shards << " ranks of the shard group";
      return failure();
    }
  }
  if (options.reshardUnits < -1) {
    mlir::emitError(module.getLoc()) << "fsdp-shard: reshard-units=" << options.reshardUnits
                                     << " must be a number of units (0 or more), or -1 for all";
    return failure();
  }
  if (options.weightQuantization != "none" && options.weightQuantization != "int8") {
    mlir::emitError(module.getLoc()) << "fsdp-shard: weight-quantization='"
                                     << options.weightQuantization << "' must be none or int8";
    return failure();
  }
  if (options.gradientQuantization != "none" && options.gradientQuantization != "int8") {
    mlir::emitError(module.getLoc()) << "fsdp-shard: gradient-quantization='"
                                     << options.gradientQuantization << "' must be none or int8";
    return failure();
  }
  if (options.quantizationBlock < 1 || options.quantizationBlock > (int64_t(1) << 30)) {
    mlir::emitError(module.getLoc())
        << "fsdp-shard: quantization-block=" << options.quantizationBlock
        << " must be 1 to 2^30 values a scale";
    return failure();
  }
  quantize = options.weightQuantization == "int8";
  quantizeGrads = options.gradientQuantization == "int8";
  if (options.ranksPerNode < 0) {
    mlir::emitError(module.getLoc())
        << "fsdp-shard: ranks-per-node=" << options.ranksPerNode << " must be 0 or more";
    return failure();
  }
  // Hierarchical qgZ where the shard group spans whole nodes.
  if (quantizeGrads && eff > 0 && options.ranksPerNode > 1 && options.ranksPerNode < shards) {
    if (shards % options.ranksPerNode == 0)
      qgzNode = options.ranksPerNode;
    else
      mlir::emitWarning(module.getLoc())
          << "fsdp-shard: gradient-quantization=int8 over a shard group of " << shards
          << " ranks that " << options.ranksPerNode
          << " ranks a node do not divide: one all-to-all over the group, not per node";
  }
  if (options.frozenStorage != "declared" && options.frozenStorage != "compute") {
    mlir::emitError(module.getLoc()) << "fsdp-shard: frozen-storage='" << options.frozenStorage
                                     << "' must be declared or compute";
    return failure();
  }
  StringRef offload = options.offload;
  if (offload != "none" && offload != "optimizer" && offload != "all") {
    mlir::emitError(module.getLoc())
        << "fsdp-shard: offload='" << offload << "' must be none, optimizer or all"
        << (offload == "auto" ? " (auto needs memory-budget: the schedule search decides)" : "");
    return failure();
  }
  reshard = reshardTo > 1;
  // The intermediate group (hpZ), if any: 1 < G < S.
  hpz = (eff == 3 && reshardTo > 1 && reshardTo < shards) ? reshardTo : 0;
  // The group a collective on one mesh axis runs over; none (every rank)
  // when that axis is the whole world.
  shardGroup = replicas > 1 ? b.getStringAttr("shard") : StringAttr();
  replicaGroup = shards > 1 ? b.getStringAttr("replica") : StringAttr();
  reshardGroup = b.getStringAttr("reshard");
  module->setAttr(kMeshAttrName, MeshAttr::get(ctx, replicas, shards, hpz, qgzNode));
  module->setAttr("fsdp.stage", b.getI64IntegerAttr(stage));
  module->setAttr("fsdp.reshard_after_forward", b.getBoolAttr(reshard));
  return success();
}

/// 1. Units: the parameters grouped by unit (frozen ones apart), each
/// unit an fsdp.unit of numel padded to a multiple of S.
LogicalResult ShardRewrite::buildUnits() {
  SmallVector<ParamOp> params(module.getOps<ParamOp>());
  names.reserve(params.size());
  for (ParamOp p : params) {
    std::string name = p.getUnit() ? p.getUnit()->str() : "root";
    if (p.getFrozen())
      name += ".frozen";
    names.push_back(name);
  }
  // weight-decay-params=matrices (fsdp-insert-optimizer): a unit packs its
  // matrices first, so weight decay covers a prefix of its flat
  // parameters (decay_numel on the per-unit update).
  optDict = module->getAttrOfType<DictionaryAttr>("fsdp.optimizer");
  auto policy = optDict ? optDict.getAs<StringAttr>("weight_decay_params") : StringAttr();
  matricesOnly = policy && policy.getValue() == "matrices";
  if (matricesOnly) {
    // Within each unit only: units keep the order of their first
    // parameter, parameters of a kind keep theirs.
    llvm::StringMap<size_t> unitOrder;
    SmallVector<std::pair<ParamOp, std::string>> byUnit;
    for (auto [p, name] : llvm::zip(params, names)) {
      unitOrder.try_emplace(name, unitOrder.size());
      byUnit.push_back({p, name});
    }
    auto key = [&](const std::pair<ParamOp, std::string> &pn) {
      ParamOp p = pn.first;
      return std::make_pair(unitOrder.lookup(pn.second), p.getTensorType().getRank() < 2);
    };
    llvm::stable_sort(byUnit, [&](auto &a, auto &b) { return key(a) < key(b); });
    for (auto [i, pn] : llvm::enumerate(byUnit)) {
      params[i] = pn.first;
      names[i] = pn.second;
    }
  }
  for (auto [p, name] : llvm::zip(params, names)) {
    bool first = !units.count(name);
    UnitInfo &u = units[name];
    if (first)
      u.index = (int64_t)units.size() - 1;
    u.name = name;
    u.frozen = p.getFrozen();
    u.params.push_back(p);
    u.offsets.push_back(u.numel);
    u.numel += p.getTensorType().getNumElements();
    if (!matricesOnly || p.getTensorType().getRank() >= 2)
      u.decayNumel = u.numel;
  }
  if (units.empty()) {
    mlir::emitError(module.getLoc()) << "the model has no parameters to shard";
    return failure();
  }
  b.setInsertionPointAfter(params.back());
  for (auto &[key, u] : units) {
    Type elem = u.params.front().getTensorType().getElementType();
    for (ParamOp p : u.params)
      if (p.getTensorType().getElementType() != elem) {
        p.emitOpError() << "has element type "
                        << p.getTensorType().getElementType()
                        << " but unit '" << u.name << "' holds " << elem
                        << "; a unit packs one dtype";
        return failure();
      }
    // 8-bit moments (state-dtype=8bit) count their blocks from each
    // shard's first element: a trainable f32 unit padded to whole blocks
    // per shard has its unit's blocks in every layout (N ranks store what
    // one rank stores).
    int64_t align = shards;
    if (auto blk = optDict ? optDict.getAs<IntegerAttr>("state_block") : IntegerAttr();
        blk && !u.frozen && elem.isF32())
      align = shards * blk.getInt();
    int64_t padded = (u.numel + align - 1) / align * align;
    SmallVector<Attribute> refs;
    for (ParamOp p : u.params)
      refs.push_back(FlatSymbolRefAttr::get(p.getSymNameAttr()));
    u.op = b.create<UnitOp>(
        u.params.front().getLoc(), b.getStringAttr(u.name),
        TypeAttr::get(RankedTensorType::get({padded}, elem)),
        TypeAttr::get(RankedTensorType::get({padded / shards}, elem)),
        b.getI64IntegerAttr(u.numel), b.getArrayAttr(refs),
        eff == 3 ? b.getUnitAttr() : UnitAttr(),
        u.frozen ? b.getUnitAttr() : UnitAttr());
    for (auto [p, off] : llvm::zip(u.params, u.offsets))
      where[p.getSymNameAttr()] = {&u, off};
  }
  return success();
}

/// fsdp-recompute clones a read's cast (fsdp-mixed-precision) into the
/// backward pass, so the read has several casts to one dtype. They compute
/// bitwise the same value: keep the first, so the read is a read in that
/// dtype and the unit is gathered in it (bf16: half the bytes) in both
/// passes, as without recomputation.
void ShardRewrite::mergeRecomputedCasts() {
  for (Operation &op : *body) {
    auto get = dyn_cast<GetParamOp>(op);
    if (!get || get->hasOneUse() || get->use_empty())
      continue;
    CastOp first;
    bool allCasts = true;
    for (Operation *user : get->getUsers()) {
      auto c = dyn_cast<CastOp>(user);
      if (!c || c->getBlock() != body || (first && c.getType() != first.getType())) {
        allCasts = false;
        break;
      }
      if (!first || c->isBeforeInBlock(first))
        first = c;
    }
    if (!allCasts)
      continue;
    for (Operation *user : llvm::to_vector(get->getUsers()))
      if (user != first.getOperation()) {
        user->getResult(0).replaceAllUsesWith(first.getResult());
        user->erase();
      }
  }
}

/// Program order, where each micro-batch's forward pass ends, how
/// gradients are accumulated and reduced, and the precision policy.
LogicalResult ShardRewrite::analyzeStep() {
  renumber();
  // With gradient accumulation (fsdp-grad-accum) the step runs K
  // micro-batches, each a forward pass up to its own loss and a backward
  // pass; the loss returned is their mean. lossIdx[k] is where micro-batch
  // k's forward pass ends.
  for (Value term : accumTerms(ret.getOperand(0))) {
    Operation *def = term.getDefiningOp();
    lossIdx.push_back(def ? index[def] : -1);
  }
  llvm::sort(lossIdx);
  numMicro = lossIdx.size();
  if (auto accum = step->getAttrOfType<DictionaryAttr>(kGradAccumAttrName)) {
    auto mode = accum.getAs<StringAttr>("reduce");
    if (!mode || (mode.getValue() != "step" && mode.getValue() != "microbatch")) {
      step.emitOpError() << "has an invalid " << kGradAccumAttrName
                         << " attribute: expected reduce = \"step\" or "
                            "\"microbatch\"";
      return failure();
    }
    reducePerMicro = mode.getValue() == "microbatch";
  }

  // Mixed precision (fsdp-mixed-precision): gradients are packed and
  // reduced in reduce_dtype; null keeps each unit's own dtype.
  if (auto mp = module->getAttrOfType<DictionaryAttr>(kMixedPrecisionAttrName)) {
    auto r = mp.getAs<TypeAttr>("reduce_dtype");
    if (!r || !isa<FloatType>(r.getValue())) {
      mlir::emitError(module.getLoc())
          << "has an invalid " << kMixedPrecisionAttrName
          << " attribute: expected reduce_dtype = a float type";
      return failure();
    }
    reduceElem = r.getValue();
    stochastic = mp.get(kStochasticRoundingAttrName) != nullptr;
    if (auto m = mp.getAs<TypeAttr>(kMasterDtypeAttrName)) {
      if (!m.getValue().isBF16()) {
        mlir::emitError(module.getLoc())
            << "has an invalid " << kMixedPrecisionAttrName
            << " attribute: " << kMasterDtypeAttrName << " = " << m.getValue() << ", expected bf16";
        return failure();
      }
      bf16Master = true;
    }
  }
  return success();
}

/// The per-parameter optimizer section: each update with its gradient
/// (before clipping), the clipping / unscaling factor, and what the
/// per-unit updates copy from the first update.
LogicalResult ShardRewrite::findUpdates() {
  for (Operation &op : *body) {
    if (isa<ClipCoefOp, GradCoefOp>(op))
      clipCoef = &op;
    if (!isUpdateOp(&op))
      continue;
    auto get = op.getOperand(0).getDefiningOp<GetParamOp>();
    if (!get) {
      op.emitOpError() << "expected the parameter operand to be read with "
                          "fsdp.get_param";
      return failure();
    }
    Update u;
    u.op = &op;
    u.param = get.getNameAttr().getAttr();
    u.rawGrad = op.getOperand(1);
    if (auto mul = u.rawGrad.getDefiningOp<MulOp>())
      if (isCoef(mul.getRhs()))
        u.rawGrad = mul.getLhs();
    updates.push_back(u);
    optimizerOps.insert(&op);
    optimizerOps.insert(get);
    for (Value v : op.getOperands())
      if (auto gs = v.getDefiningOp<GetStateOp>())
        optimizerOps.insert(gs);
    // LAMB's norms: rebuilt per unit by updateUnits.
    if (auto lamb = dyn_cast<LambUpdateOp>(op))
      if (Operation *norms = lamb.getNorms().getDefiningOp())
        optimizerOps.insert(norms);
    for (Operation *user : op.getUsers())
      optimizerOps.insert(user);
    if (auto mul = op.getOperand(1).getDefiningOp<MulOp>())
      if (isCoef(mul.getRhs()))
        optimizerOps.insert(mul);
  }
  if (updates.empty()) {
    mlir::emitError(step.getLoc()) << "no optimizer updates to shard: run "
                        "fsdp-insert-optimizer first";
    return failure();
  }
  for (Update &u : updates)
    updateOf[u.param] = &u;
  if (clipCoef) {
    oldSumsq = clipCoef->getOperand(0);
    if (isa<GradCoefOp>(clipCoef))
      lossScale = clipCoef->getOperand(1);
    maxNorm = clipCoef->getAttrOfType<FloatAttr>("max_norm");
    optimizerOps.insert(clipCoef);
    if (Operation *sq = clipCoef->getOperand(0).getDefiningOp())
      optimizerOps.insert(sq);
  }
  Operation *templ = updates.front().op;
  updName = templ->getName();
  updAttrs.assign(templ->getAttrs().begin(), templ->getAttrs().end());
  updOperands.assign(templ->getOperands().begin(), templ->getOperands().end());
  updResults = templ->getNumResults();
  for (auto [i, v] : llvm::enumerate(templ->getOperands()))
    if (auto gs = v.getDefiningOp<GetStateOp>()) {
      auto st = module.lookupSymbol<StateOp>(gs.getNameAttr());
      stateSlots.push_back({(unsigned)i, st.getKind().str()});
      stateElems.push_back(st.getTensorType().getElementType());
    }
  return success();
}

// --- 2. Parameter reads become views of the unit's flat parameters. ----

/// autodiff reuses the forward's reads in backward, so a read's uses are
/// split by position: uses after the loss (of the read's micro-batch) are
/// backward uses. Each micro-batch gathers for itself. A read whose only
/// user is a cast (fsdp-mixed-precision) is a read in the cast's dtype:
/// the unit is cast once, before its all-gather, and gathered in it.
void ShardRewrite::collectReads() {
  for (Operation &op : *body) {
    auto get = dyn_cast<GetParamOp>(op);
    if (!get || optimizerOps.contains(get))
      continue;
    int64_t micro = microOf(get);
    Value read = readValue(get);
    Reads &r = reads[{where[get.getNameAttr().getAttr()].first, micro,
                      elemOf(read)}];
    r.gets.push_back(get);
    r.lossIdx = lossIdx[micro];
    for (Operation *user : read.getUsers()) {
      bool backward = index[user] > r.lossIdx;
      Operation *&first = backward ? r.firstBackwardUse : r.firstForwardUse;
      if (!first || index[user] < index[first])
        first = user;
      if (!backward && (!r.lastForwardUse || index[user] > index[r.lastForwardUse]))
        r.lastForwardUse = user;
    }
  }
}

/// A unit whose backward reads come before any other unit is gathered
/// again (the last unit of the forward: its backward starts right after
/// the loss) keeps its forward gather instead of resharding and
/// gathering the same bytes again; FSDP2 does not reshard the root
/// either. Nothing else is gathered in between, so this holds one unit's
/// parameters across the loss and saves an all-gather.
bool ShardRewrite::keepsForwardGather(const Reads &r) {
  if (!r.firstForwardUse || !r.firstBackwardUse)
    return false;
  int64_t lo = index[r.lastForwardUse], hi = index[r.firstBackwardUse];
  for (auto &[key, other] : reads) {
    if (&other == &r)
      continue;
    for (Operation *use : {other.firstForwardUse, other.firstBackwardUse})
      if (use && index[use] > lo && index[use] < hi)
        return false;
  }
  return true;
}

/// Mixed precision at stages 1/2 (ZeRO's layout): a trainable unit read
/// only in a narrower compute dtype keeps just its f32 master shard, like
/// stage 3, and is gathered once per step in the compute dtype (the
/// persistent bf16 copy of DeepSpeed's ZeRO-1/2, held from the first
/// read to the last instead of across the step boundary); the new
/// parameters are then not all-gathered in f32 after the update. Memory
/// (2 + 4/N) Psi instead of 4 Psi for the parameters, half the gathered
/// bytes; gradients stay as the stage says.
void ShardRewrite::shardNarrowUnits() {
  if (eff == 1 || eff == 2) {
    llvm::DenseMap<UnitInfo *, bool> narrowOnly;
    for (auto &[key, r] : reads) {
      UnitInfo *u = std::get<0>(key);
      bool narrow = std::get<2>(key) != fullTy(*u).getElementType() &&
                    (r.firstForwardUse || r.firstBackwardUse);
      auto [it, fresh] = narrowOnly.try_emplace(u, narrow);
      if (!fresh)
        it->second = it->second && narrow;
    }
    // Optimizer offload (fsdp-offload) moves the master shard to the
    // host, so every trainable unit takes this layout, f32 too: the device
    // keeps only the once-per-step gather, ZeRO-Offload's stage 1/2.
    for (auto &[u, narrow] : narrowOnly)
      if ((narrow || options.offload != "none") && !u->frozen)
        u->op.setSharded(true);
  }
}

/// frozen-storage=compute: a frozen unit every read of which is in one
/// 16-bit float dtype (fsdp-mixed-precision's compute dtype) stores it.
/// Each value is then rounded to nearest once, when it is stored, instead
/// of at every read's cast: the same bits reach compute, the storage and
/// its gathers are half the bytes, and no cast remains.
void ShardRewrite::narrowFrozenStorage() {
  if (options.frozenStorage != "compute")
    return;
  llvm::MapVector<UnitInfo *, Type> only;
  llvm::DenseSet<UnitInfo *> mixed;
  for (auto &[key, r] : reads) {
    UnitInfo *u = std::get<0>(key);
    if (!u->frozen || (!r.firstForwardUse && !r.firstBackwardUse))
      continue;
    auto [it, fresh] = only.try_emplace(u, std::get<2>(key));
    if (!fresh && it->second != std::get<2>(key))
      mixed.insert(u);
  }
  for (auto &[u, elem] : only) {
    if (mixed.contains(u) || !isa<BFloat16Type, Float16Type>(elem) ||
        !fullTy(*u).getElementType().isF32())
      continue;
    u->op.setTypeAttr(TypeAttr::get(withElem(fullTy(*u), elem)));
    u->op.setShardTypeAttr(TypeAttr::get(withElem(shardTy(*u), elem)));
  }
}

/// master-dtype=bf16 (fsdp-mixed-precision): every trainable f32 unit
/// stores bf16, its compute dtype, with no f32 master copy. Its reads then
/// gather the stored bf16 values without a cast, and its update widens
/// them, steps in f32 (stepElem) and rounds the new parameters back
/// (updateUnits).
LogicalResult ShardRewrite::narrowTrainableStorage() {
  if (!bf16Master)
    return success();
  if (*updName == OperationName(LambUpdateOp::getOperationName(), ctx)) {
    mlir::emitError(module.getLoc())
        << "fsdp-shard: master-dtype=bf16 with LAMB is not supported: its trust ratios "
           "(fsdp.lamb_norms) read f32 parameters; use AdamW or SGD, or master-dtype=f32";
    return failure();
  }
  Type bf16 = b.getBF16Type();
  for (auto &[name, u] : units) {
    if (u.frozen || !fullTy(u).getElementType().isF32())
      continue;
    u.op.setTypeAttr(TypeAttr::get(withElem(fullTy(u), bf16)));
    u.op.setShardTypeAttr(TypeAttr::get(withElem(shardTy(u), bf16)));
    narrowedMaster.insert(&u);
  }
  return success();
}

/// The dtype a unit's update steps in: f32 for a unit master-dtype=bf16
/// stores in bf16, its own dtype otherwise.
Type ShardRewrite::stepElem(UnitInfo &u) {
  return narrowedMaster.contains(&u) ? Type(b.getF32Type()) : fullTy(u).getElementType();
}

/// The unit's parameters in dtype `elem` before `before`: its storage,
/// cast to elem if need be (the shard, before its all-gather), gathered
/// where it is sharded (once a step at stages 1/2).
Value ShardRewrite::gather(UnitInfo &u, Operation *before, Type elem) {
  if (eff != 3 && u.op.getSharded())
    if (Value v = stepGather.lookup({&u, elem}))
      return v;
  b.setInsertionPoint(before);
  Value s = b.create<GetUnitOp>(before->getLoc(), u.op.getStorageType(), symOf(u));
  if (elemOf(s) != elem) { // cast the shard, then gather half the bytes
    auto c = b.create<CastOp>(before->getLoc(), withElem(s.getType(), elem), s);
    if (stochastic && !u.frozen && elemOf(s).isF32() && elem.isBF16()) {
      c.setStochastic(true);
      c.setKey(u.index);
      c.setSharded(u.op.getSharded() && shards > 1);
    }
    s = c;
  }
  if (!u.op.getSharded() || shards == 1)
    return s;
  Value full = quantize ? quantizedGather(u, s, before->getLoc())
                        : allGather(before->getLoc(), withElem(fullTy(u), elem), s, shardGroup);
  if (eff != 3)
    stepGather[{&u, elem}] = full;
  return full;
}

/// ZeRO++'s qwZ: the shard `s` (already in the compute dtype) quantized,
/// the bytes all-gathered, dequantized back into the compute dtype. The
/// master shard stays exact; only what is gathered carries the
/// quantization's error (fsdp.quantize's description).
Value ShardRewrite::quantizedGather(UnitInfo &u, Value s, Location loc) {
  const int64_t block = options.quantizationBlock;
  ++quantizedGathers;
  auto sTy = cast<RankedTensorType>(s.getType());
  const int64_t part = ::fsdp::shapes::quantizedBytes(sTy.getNumElements(), block);
  auto bytes = [&](int64_t n) { return RankedTensorType::get({n}, b.getIntegerType(8)); };
  Value q = b.create<QuantizeOp>(loc, bytes(part), s, b.getI64IntegerAttr(block), IntegerAttr(),
                                 IntegerAttr());
  Value g = allGather(loc, bytes(part * shards), q, shardGroup);
  return b.create<DequantizeOp>(loc, withElem(fullTy(u), sTy.getElementType()), g,
                                b.getI64IntegerAttr(block), b.getI64IntegerAttr(shards),
                                StringAttr());
}

/// hpZ: after the unit's last forward read this rank copies its 1/G of
/// the gathered parameters (its index in the reshard group picks which),
/// the gathered buffer is freed, and the backward gathers the G copies
/// within the reshard group. The copy is in the gathered dtype, so a bf16
/// policy keeps 2 bytes per element.
Value ShardRewrite::regather(Value full, Operation *lastFwd, Operation *firstBwd) {
  auto fullType = cast<RankedTensorType>(full.getType());
  auto partTy = RankedTensorType::get({fullType.getNumElements() / hpz}, fullType.getElementType());
  b.setInsertionPointAfter(lastFwd);
  Value part = b.create<ShardViewOp>(lastFwd->getLoc(), partTy, full, reshardGroup);
  part = b.create<PackOp>(lastFwd->getLoc(), partTy, ValueRange{part}, b.getDenseI64ArrayAttr({0}));
  b.setInsertionPoint(firstBwd);
  return allGather(firstBwd->getLoc(), fullType, part, reshardGroup);
}

/// reshard-units=K: only the first K units of the forward reshard; the
/// later ones keep their forward gather for the backward (FSDP2's
/// reshard_after_forward=False on the last blocks). All of them are
/// live at the loss either way, so K trades K units' gathered bytes at
/// the peak for K fewer backward all-gathers; the last units hold their
/// gather for the shortest time.
void ShardRewrite::chooseKeptGathers() {
  if (eff == 3 && reshard && options.reshardUnits >= 0) {
    llvm::MapVector<UnitInfo *, int64_t> firstRead;
    for (auto &[key, r] : reads)
      if (r.firstForwardUse) {
        auto [it, fresh] = firstRead.try_emplace(std::get<0>(key),
                                                 index[r.firstForwardUse]);
        it->second = std::min(it->second, index[r.firstForwardUse]);
      }
    auto order = firstRead.takeVector();
    llvm::stable_sort(order, [](auto &a, auto &b) { return a.second < b.second; });
    for (size_t i = options.reshardUnits; i < order.size(); ++i)
      keepGather.insert(order[i].first);
  }
  if (!keepGather.empty())
    module->setAttr("fsdp.reshard_units", b.getI64IntegerAttr(options.reshardUnits));
}

/// Each read becomes a view of its unit's gathered parameters, one view
/// a read and phase: the forward's gather, and in the backward the same
/// one, the reshard group's regather or a second gather. Without
/// reshard-after-backward (FSDP2's set_reshard_after_backward(False), for
/// gradient accumulation) a micro-batch's forward reads the previous
/// micro-batch's last gather of the unit instead of gathering it again:
/// nothing writes a unit's storage before the optimizer, after the last
/// micro-batch, so the gathered values are the same.
void ShardRewrite::rewriteReads() {
  // (unit, gathered dtype) -> the last gather a later micro-batch may read.
  llvm::DenseMap<std::pair<UnitInfo *, Type>, Value> carried;
  for (auto &[key, r] : reads) {
    UnitInfo *u = std::get<0>(key);
    Type elem = std::get<2>(key);
    if (!r.firstForwardUse && !r.firstBackwardUse)
      continue; // read but unused
    Value fwd, bwd;
    if (eff == 3) {
      auto kept = options.reshardAfterBackward ? carried.end() : carried.find({u, elem});
      if (r.firstForwardUse)
        fwd = kept != carried.end() ? kept->second : gather(*u, r.firstForwardUse, elem);
      if (r.firstBackwardUse) {
        if (fwd && (!reshard || keepsForwardGather(r) || keepGather.contains(u)))
          bwd = fwd;
        else if (fwd && hpz)
          bwd = regather(fwd, r.lastForwardUse, r.firstBackwardUse);
        else
          bwd = gather(*u, r.firstBackwardUse, elem);
      }
      carried[{u, elem}] = bwd ? bwd : fwd;
    } else {
      Operation *first = r.firstForwardUse ? r.firstForwardUse : r.firstBackwardUse;
      if (r.firstForwardUse && r.firstBackwardUse &&
          index[r.firstBackwardUse] < index[first])
        first = r.firstBackwardUse;
      fwd = bwd = gather(*u, first, elem);
    }
    for (GetParamOp get : r.gets) {
      int64_t off = where[get.getNameAttr().getAttr()].second;
      Value read = readValue(get);
      // A view is free (an alias): one per read and phase.
      Value fwdView, bwdView;
      for (OpOperand &use : llvm::make_early_inc_range(read.getUses())) {
        Operation *user = use.getOwner();
        bool backward = index[user] > r.lossIdx;
        Value &view = backward ? bwdView : fwdView;
        if (!view) {
          // Insert the view right after the gather it reads so it dominates
          // every later use.
          Value flat = backward ? bwd : fwd;
          b.setInsertionPointAfterValue(flat);
          view = b.create<ViewOp>(get.getLoc(), read.getType(), flat,
                                  b.getI64IntegerAttr(off));
        }
        use.set(view);
      }
      if (read != get.getResult())
        read.getDefiningOp()->erase();
      get.erase();
    }
  }
}

// --- 3. Gradients: pack per unit, then reduce. ---------------------------

/// With accum-reduce=microbatch each micro-batch's gradients are packed
/// and reduced on their own, and the reduced (sharded) results summed in
/// place: one round per micro-batch. Otherwise one round reduces the
/// (accumulated) gradient once.
LogicalResult ShardRewrite::collectGradientTerms() {
  rounds = reducePerMicro ? numMicro : 1;
  for (Update &u : updates) {
    SmallVector<Value> terms{u.rawGrad};
    if (rounds > 1) {
      terms = accumTerms(u.rawGrad);
      if ((int64_t)terms.size() != rounds) {
        u.op->emitOpError() << "expected a gradient accumulated over "
                            << rounds << " micro-batches, found "
                            << terms.size() << " terms";
        return failure();
      }
      // The chain scale((t0 + t1) + ...): erased once the update is.
      Operation *op = u.rawGrad.getDefiningOp();
      perParamAccum.push_back(op);
      for (Value v = op->getOperand(0); v != terms.front();
           v = v.getDefiningOp()->getOperand(0))
        perParamAccum.push_back(v.getDefiningOp());
    }
    termsOf[u.param] = terms;
  }
  return success();
}

/// A gradient that is a cast of a packElem value, or a sum of such
/// (a tied parameter read twice), is taken in packElem: the sum of
/// two bf16 values in bf16 (computed in f32, rounded once) is
/// bitwise the f32 sum cast to bf16, without the f32 copies.
bool ShardRewrite::narrowable(Value v, Type packElem) {
  if (elemOf(v) == packElem)
    return true;
  if (auto c = v.getDefiningOp<CastOp>())
    return elemOf(c.getInput()) == packElem;
  auto add = v.getDefiningOp<AddOp>();
  return add && !add->hasAttr(kAccumAttrName) && add.getLhs().getType() == add.getRhs().getType() &&
         narrowable(add.getLhs(), packElem) && narrowable(add.getRhs(), packElem);
}

/// v in packElem (narrowable(v)): the casts it reads past are erased
/// later if nothing else reads them.
Value ShardRewrite::narrow(Value v, Type packElem) {
  if (elemOf(v) == packElem)
    return v;
  Operation *def = v.getDefiningOp();
  maybeDead.insert(def);
  if (auto c = dyn_cast<CastOp>(def))
    return c.getInput();
  auto add = cast<AddOp>(def);
  Value l = narrow(add.getLhs(), packElem), r = narrow(add.getRhs(), packElem);
  return b.create<AddOp>(add.getLoc(), l.getType(), l, r);
}

/// Each unit's gradients packed into one flat buffer right after the
/// last of them is computed (at stage 1, after the backward pass), in the
/// dtype they are reduced in, then all-reduced (stage 0) or
/// reduce-scattered (stages 1-3, and all-reduced over the replicas);
/// micro-batch rounds summed in place, then averaged.
LogicalResult ShardRewrite::reduceGradients() {
  for (int64_t round = 0; round < rounds; ++round) {
    renumber(); // after the insertions
    Operation *lastGradDef = nullptr;
    for (Update &u : updates)
      if (Operation *d = termsOf[u.param][round].getDefiningOp())
        if (!lastGradDef || index[d] > index[lastGradDef])
          lastGradDef = d;
    Operation *stage1Cursor = nullptr;
    for (auto &[key, u] : units) {
      if (u.frozen)
        continue;
      SmallVector<Value> grads;
      Operation *after = nullptr;
      for (ParamOp p : u.params) {
        Update *up = updateOf.lookup(p.getSymNameAttr());
        if (!up) {
          p.emitOpError() << "is trainable but has no optimizer update";
          return failure();
        }
        Value term = termsOf[up->param][round];
        grads.push_back(term);
        Operation *d = term.getDefiningOp();
        if (d && (!after || index[d] > index[after]))
          after = d;
      }
      // Stage 1 keeps whole gradients until the backward pass (of the
      // micro-batch) is over; its reductions follow in unit order.
      if (eff == 1 && lastGradDef)
        after = stage1Cursor ? stage1Cursor : lastGradDef;
      if (after)
        b.setInsertionPointAfter(after);
      else
        b.setInsertionPointToStart(body);
      Location loc = u.params.front().getLoc();
      // The gradients in the dtype they are reduced in: a bf16 gradient
      // autodiff cast to f32 is packed as it was computed.
      Type master = fullTy(u).getElementType();
      Type packElem = reduceElem ? reduceElem : master;
      for (Value &g : grads) {
        if (elemOf(g) == packElem)
          continue;
        if (narrowable(g, packElem))
          g = narrow(g, packElem);
        else
          g = b.create<CastOp>(loc, withElem(g.getType(), packElem), g);
      }
      RankedTensorType packFull = withElem(fullTy(u), packElem);
      RankedTensorType packShard = withElem(shardTy(u), packElem);
      Value g = b.create<PackOp>(loc, packFull, grads,
                                 b.getDenseI64ArrayAttr(u.offsets));
      if (world > 1 && eff == 0) {
        g = allReduce(loc, packFull, g, "mean", StringAttr());
      } else if (world > 1) {
        // Mean over the replica's S shards, then over the R replicas.
        if (shards > 1 && quantizeGrads)
          g = quantizedReduceScatter(loc, packShard, g, "mean", shardGroup);
        else if (shards > 1)
          g = reduceScatter(loc, packShard, g, "mean", shardGroup);
        if (replicas > 1)
          g = allReduce(loc, packShard, g, "mean", replicaGroup);
      }
      // Micro-batch gradients accumulate in the master dtype.
      if (rounds > 1 && packElem != master)
        g = b.create<CastOp>(loc, withElem(g.getType(), master), g);
      if (round > 0) {
        // acc += this micro-batch's reduced gradient (in place).
        auto add = b.create<AddOp>(loc, g.getType(), flatGrad[&u], g);
        add->setAttr(kAccumAttrName, b.getUnitAttr());
        g = add;
      }
      flatGrad[&u] = g;
      stage1Cursor = g.getDefiningOp();
    }
  }
  if (rounds > 1)
    for (auto &[u, g] : flatGrad) {
      b.setInsertionPointAfterValue(g);
      auto mean = b.create<ScaleOp>(g.getLoc(), g.getType(), g,
                                    b.getF64FloatAttr(1.0 / rounds));
      mean->setAttr(kAccumAttrName, b.getUnitAttr());
      g = mean;
    }
  return success();
}

// --- 4. The update, once per unit on flat tensors. ----------------------

/// Removes the per-parameter optimizer section (users first), the
/// per-parameter accumulation chains and state.
void ShardRewrite::eraseOptimizerSection() {
  SmallVector<Operation *> dead;
  for (Operation &op : llvm::reverse(*body))
    if (optimizerOps.contains(&op))
      dead.push_back(&op);
  for (Operation *op : dead) {
    op->dropAllUses();
    op->erase();
  }
  for (Operation *op : perParamAccum)
    op->erase();
  // Users before operands (insertion order), so a dead sum frees its casts.
  for (Operation *op : maybeDead)
    if (op->use_empty())
      op->erase();
  for (StateOp s : llvm::make_early_inc_range(module.getOps<StateOp>()))
    s.erase();
}

/// A gradient reduced in another dtype than the master's is cast to it
/// right before the unit's update (before the norm, with clipping), so
/// only one unit's f32 gradient shard exists at a time.
void ShardRewrite::toMaster(UnitInfo &u, Value &g, Location loc) {
  Type master = stepElem(u);
  if (elemOf(g) != master)
    g = b.create<CastOp>(loc, withElem(g.getType(), master), g);
}

/// Clipping (or loss-scale unscaling) over the flat gradients: one squared
/// norm over every unit's gradient (shard), all-reduced over the shards,
/// and its factor applied to each.
void ShardRewrite::clipGradients(Location loc) {
  auto scalarTy = RankedTensorType::get({}, b.getF32Type());
  for (auto &[u, g] : flatGrad)
    toMaster(*u, g, loc);
  SmallVector<Value> gs;
  for (auto &[u, g] : flatGrad)
    gs.push_back(g);
  Value sq = b.create<SquaredNormOp>(loc, scalarTy, gs);
  if (shards > 1 && eff != 0) {
    // Each rank holds 1/S of every gradient: partial sums, then one
    // scalar all-reduce over the shards (the replicas hold the same
    // reduced shards), so the norm is over the whole gradient.
    sq = allReduce(loc, scalarTy, sq, "sum", shardGroup);
  }
  Value coef;
  if (lossScale) {
    coef = b.create<GradCoefOp>(loc, scalarTy, sq, lossScale, maxNorm);
    // The updates skip on the new (global) squared norm.
    for (Value &v : updOperands)
      if (v == oldSumsq)
        v = sq;
  } else {
    coef = b.create<ClipCoefOp>(loc, scalarTy, sq, maxNorm);
  }
  // The step returns the global squared norm in place of the
  // per-parameter one (loss scaling's overflow signal, the norm fsdp-run
  // reports).
  for (OpOperand &o : ret->getOpOperands())
    if (o.getOperandNumber() > 0)
      o.set(sq);
  for (auto &[u, g] : flatGrad)
    g = b.create<MulOp>(loc, g.getType(), g, coef);
}

/// LAMB's per-parameter norms for one unit's update: the unit's parameters
/// are its segments, positions need the shard's stride, and a shard's
/// partial sums are all-reduced over the shards (the replicas of a 2-D
/// mesh hold the same shard: nothing to add across them), like the
/// clipping norm's. `attrs` (the update's) gain the same layout.
Value ShardRewrite::lambNorms(UnitInfo &u, ArrayRef<Value> operands, NamedAttrList &attrs,
                              RankedTensorType pTy, Location loc) {
  SmallVector<int64_t> segments(u.offsets);
  segments.push_back(u.numel);
  attrs.set("segments", b.getDenseI64ArrayAttr(segments));
  if (eff != 0)
    attrs.set("shard_stride", b.getI64IntegerAttr(pTy.getNumElements()));
  auto normsTy = RankedTensorType::get({2 * (int64_t)u.params.size()}, b.getF32Type());
  // p, g, m, v and the step (the update's operand 6); no skip: an
  // overflowed step's norms are never applied.
  OperationState os(loc, LambNormsOp::getOperationName());
  os.addOperands({operands[0], operands[1], operands[2], operands[3], operands[6]});
  // (the rounding of bf16 moments is the update's: the norms write none)
  for (NamedAttribute a : attrs)
    if (a.getName() != LambUpdateOp::getOperandSegmentSizeAttr() && a.getName() != "stochastic" &&
        a.getName() != "key")
      os.addAttribute(a.getName(), a.getValue());
  os.addTypes(normsTy);
  Value norms = b.create(os)->getResult(0);
  if (shards > 1 && eff != 0)
    norms = allReduce(loc, normsTy, norms, "sum", shardGroup);
  return norms;
}

/// One update per unit on its flat parameters (whole at stage 0, this
/// rank's shard otherwise), its state sharded alike; stages 1/2 with whole
/// parameters all-gather the result. LAMB's units are prepared one ahead:
/// unit i + 1's norms and their all-reduce are issued before unit i's
/// update, so each small all-reduce runs behind the next unit's sums and
/// this unit's update instead of stalling right before its own update.
void ShardRewrite::updateUnits(Location loc) {
  Operation *lastState = nullptr;
  const bool lamb = *updName == OperationName(LambUpdateOp::getOperationName(), ctx);
  struct Prepared {
    UnitInfo *u;
    RankedTensorType pTy;
    bool wholeParams;
    SmallVector<StateOp> states;
    SmallVector<Value> operands;
    NamedAttrList attrs;
  };
  auto prepare = [&](UnitInfo *u, Value &grad) {
    Prepared pr{u, eff == 0 ? fullTy(*u) : shardTy(*u), false, {}, {}, {}};
    RankedTensorType pTy = pr.pTy;
    // Stages 1/2 with whole parameters update this rank's shard of them
    // and all-gather the result.
    pr.wholeParams = eff != 0 && !u->op.getSharded();
    toMaster(*u, grad, loc);
    Value p;
    if (pr.wholeParams) {
      Value full = b.create<GetUnitOp>(loc, fullTy(*u), symOf(*u));
      p = b.create<ShardViewOp>(loc, pTy, full);
    } else {
      p = b.create<GetUnitOp>(loc, pTy, symOf(*u));
    }
    // State symbols mirror the unit (whole or shard).
    {
      OpBuilder mb(ctx);
      mb.setInsertionPointAfter(lastState ? lastState : u->op.getOperation());
      if (!lastState) {
        for (UnitOp uo : module.getOps<UnitOp>())
          mb.setInsertionPointAfter(uo);
      }
      for (auto [i, sk] : llvm::enumerate(stateSlots)) {
        // 8-bit or 4-bit moments: the packed codes and block scales of the
        // operand
        Type stTy = pTy.clone(stateElems[i]);
        int64_t bits = 8;
        for (const NamedAttribute &na : updAttrs)
          if (na.getName() == "state_bits")
            bits = cast<IntegerAttr>(na.getValue()).getInt();
        for (const NamedAttribute &na : updAttrs)
          if (na.getName() == "state_block")
            stTy = RankedTensorType::get(
                {::fsdp::shapes::packedStateBytes(pTy.getNumElements(),
                                                  cast<IntegerAttr>(na.getValue()).getInt(), bits)},
                stateElems[i]);
        auto st = mb.create<StateOp>(loc, mb.getStringAttr(u->name + "." + sk.second),
                                     TypeAttr::get(stTy), symOf(*u),
                                     mb.getStringAttr(sk.second));
        pr.states.push_back(st);
        lastState = st;
      }
    }
    pr.operands.assign(updOperands.begin(), updOperands.end());
    pr.operands[0] = p;
    pr.operands[1] = grad;
    for (auto [i, slot] : llvm::enumerate(stateSlots))
      pr.operands[slot.first] = b.create<GetStateOp>(
          loc, pr.states[i].getTensorType(), FlatSymbolRefAttr::get(pr.states[i].getSymNameAttr()));
    pr.attrs.assign(updAttrs);
    if (narrowedMaster.contains(u) && stochastic) {
      // bf16 parameters written back stochastically, with the draws the
      // stochastic cast of an f32 master makes (the unit's index, each
      // element at its place in the unit).
      pr.attrs.set("stochastic_param", b.getUnitAttr());
      pr.attrs.set("key", b.getI64IntegerAttr(u->index));
      if (eff != 0)
        pr.attrs.set("shard_stride", b.getI64IntegerAttr(pTy.getNumElements()));
    }
    if (pr.attrs.get("stochastic")) {
      // bf16 moments rounded stochastically: the unit's draws (its index,
      // as the stochastic parameter casts'), each element at its place in
      // the unit (a shard's stride), so every layout stores the same bits.
      pr.attrs.set("key", b.getI64IntegerAttr(u->index));
      if (eff != 0)
        pr.attrs.set("shard_stride", b.getI64IntegerAttr(pTy.getNumElements()));
    }
    if (matricesOnly) {
      // The first update may be a vector's (weight_decay 0): the unit's
      // decayed prefix takes the optimizer's weight decay.
      pr.attrs.set("weight_decay", optDict.get("weight_decay"));
      if (u->decayNumel < u->numel) {
        pr.attrs.set("decay_numel", b.getI64IntegerAttr(u->decayNumel));
        pr.attrs.set("shard_stride", b.getI64IntegerAttr(eff == 0 ? 0 : pTy.getNumElements()));
      }
    }
    if (lamb)
      pr.operands[4] = lambNorms(*u, pr.operands, pr.attrs, pTy, loc);
    return pr;
  };
  auto finish = [&](Prepared &pr) {
    UnitInfo *u = pr.u;
    OperationState os(loc, *updName);
    os.addOperands(pr.operands);
    os.addAttributes(pr.attrs);
    os.addTypes(pr.pTy);
    for (unsigned i = 1; i < updResults; ++i) // the new states, typed as theirs
      os.addTypes(pr.states[i - 1].getTensorType());
    Operation *upd = b.create(os);
    for (auto [i, st] : llvm::enumerate(pr.states))
      b.create<SetStateOp>(loc, FlatSymbolRefAttr::get(st.getSymNameAttr()),
                           upd->getResult(i + 1));
    Value newP = upd->getResult(0);
    if (pr.wholeParams)
      newP = allGather(loc, fullTy(*u), newP, shardGroup);
    b.create<SetUnitOp>(loc, symOf(*u), newP);
  };
  std::optional<Prepared> ahead;
  for (auto &[u, grad] : flatGrad) {
    Prepared pr = prepare(u, grad);
    if (!lamb) {
      finish(pr);
      continue;
    }
    if (ahead)
      finish(*ahead);
    ahead = std::move(pr);
  }
  if (ahead)
    finish(*ahead);
}

} // namespace
