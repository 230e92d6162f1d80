//===- Passes.h - the fsdp compiler's passes --------------------*- C++ -*-===//
//
// Declarations generated from Passes.td, and their registration.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_PASSES_H
#define FSDP_PASSES_PASSES_H

#include "dialects/fsdp/FsdpOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "llvm/ADT/SmallPtrSet.h"

namespace mlir::fsdp {

#define GEN_PASS_DECL
#include "passes/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "passes/Passes.h.inc"

/// Name of the function fsdp-autodiff creates.
constexpr llvm::StringLiteral kTrainStepName = "train_step";

/// The @train_step of `module`; when there is none, reports on the module
/// which passes must run first (`prerequisites`) and returns null.
inline func::FuncOp getTrainStep(ModuleOp module, llvm::StringRef prerequisites) {
  auto step = module.lookupSymbol<func::FuncOp>(kTrainStepName);
  if (!step)
    mlir::emitError(module.getLoc()) << "no @" << kTrainStepName << ": run "
                       << prerequisites << " first";
  return step;
}

/// Marks the adds and 1/K scales fsdp-grad-accum emits to accumulate
/// micro-batch gradients and losses.
constexpr llvm::StringLiteral kAccumAttrName = "fsdp.accum";
/// Marks the adds fsdp-chunk-loss emits to sum the chunks' weight (and
/// bias) gradient terms: the memory plan runs them in place over their
/// accumulator, as it does fsdp.accum's.
constexpr llvm::StringLiteral kChunkAccumAttrName = "fsdp.chunk_accum";
/// Marks the ops fsdp-offload runs on the host (optimizer updates of
/// offloaded units): they read and write host memory only.
constexpr llvm::StringLiteral kOnHostAttrName = "fsdp.on_host";
/// Marks the optimizer state fsdp-offload's nvme keeps in the per-rank swap
/// file (on fsdp.state; with nvme-params also on fsdp.unit: its storage):
/// fsdp-plan-memory gives it a file offset instead of an arena's and each
/// instruction reading it a staging buffer.
constexpr llvm::StringLiteral kNvmeAttrName = "fsdp.nvme";
/// On the module, with fsdp.nvme state: fsdp-offload's nvme-read-ahead,
/// how many updates on disk ahead each one's state is read
/// (fsdp-plan-memory's swap read points).
constexpr llvm::StringLiteral kNvmeReadAheadAttrName = "fsdp.nvme_read_ahead";
/// Marks the forward ops fsdp-recompute cloned into the backward pass.
constexpr llvm::StringLiteral kRecomputeAttrName = "fsdp.recompute";
/// On @train_step after fsdp-grad-accum: {micro_batches = K, reduce = "step"
/// | "microbatch"}, the reduction mode fsdp-shard implements.
constexpr llvm::StringLiteral kGradAccumAttrName = "fsdp.grad_accum";

/// On the module after fsdp-mixed-precision: {param_dtype = T, reduce_dtype
/// = T}, the compute dtype the model was retyped to and the dtype
/// fsdp-shard packs and reduces gradients in.
constexpr llvm::StringLiteral kMixedPrecisionAttrName = "fsdp.mixed_precision";
/// The entry of `fsdp.mixed_precision` that asks for dynamic loss scaling:
/// {init, growth_factor, backoff_factor (f64, powers of two),
/// growth_interval (i64)}.
constexpr llvm::StringLiteral kLossScaleAttrName = "loss_scale";
/// The entry of `fsdp.mixed_precision` (a unit attribute) that asks
/// fsdp-shard to round trainable units' master parameters to bf16
/// stochastically (fsdp.cast {stochastic, key}).
constexpr llvm::StringLiteral kStochasticRoundingAttrName = "stochastic_rounding";
/// The policy's stored dtype of trainable parameters when it is not f32
/// (master-dtype=bf16: no f32 master copy).
constexpr llvm::StringLiteral kMasterDtypeAttrName = "master_dtype";
/// The dynamic-loss-scaling policy of `module`, or null.
inline DictionaryAttr getLossScalePolicy(ModuleOp module) {
  auto mp = module->getAttrOfType<DictionaryAttr>(kMixedPrecisionAttrName);
  return mp ? mp.getAs<DictionaryAttr>(kLossScaleAttrName) : DictionaryAttr();
}
/// The argument of `fn` whose fsdp.role is `role` (e.g. the "loss_scale"
/// fsdp-autodiff adds to @train_step), or null.
inline BlockArgument findRoleArgument(func::FuncOp fn, llvm::StringRef role) {
  for (BlockArgument arg : fn.getArguments())
    if (auto r = fn.getArgAttrOfType<StringAttr>(arg.getArgNumber(), kRoleAttrName);
        r && r.getValue() == role)
      return arg;
  return BlockArgument();
}

/// The per-micro-batch terms of a value fsdp-grad-accum accumulated (a
/// gradient or the loss), in micro-batch order: for
/// v = scale((t0 + t1) + t2, 1/K) (ops marked fsdp.accum) returns
/// {t0, t1, t2}; any other value is its own single term.
inline SmallVector<Value> accumTerms(Value v) {
  auto scale = v.getDefiningOp<ScaleOp>();
  if (!scale || !scale->hasAttr(kAccumAttrName))
    return {v};
  SmallVector<Value> terms;
  Value cur = scale.getInput();
  for (auto add = cur.getDefiningOp<AddOp>(); add && add->hasAttr(kAccumAttrName);
       add = cur.getDefiningOp<AddOp>()) {
    terms.push_back(add.getRhs());
    cur = add.getLhs();
  }
  terms.push_back(cur);
  std::reverse(terms.begin(), terms.end());
  return terms;
}

/// Hierarchical qgZ's first level: an fsdp.all_to_all over group "node"
/// (fsdp-shard with ranks-per-node).
inline bool isNodeExchange(Operation *op) {
  auto a2a = dyn_cast_or_null<AllToAllOp>(op);
  return a2a && a2a.getGroup() == "node";
}

/// The unit read (fsdp.get_unit) a parameter all-gather gathers, read
/// directly or through ops of its own that move with the gather (a cast to
/// the compute dtype from fsdp-mixed-precision, fsdp-shard's fsdp.quantize
/// for weight-quantization), those ops in `chain` in program order if
/// given; null for any other op. Defined in Schedule.cpp.
GetUnitOp gatheredUnitRead(Operation *op, SmallVectorImpl<Operation *> *chain = nullptr);

/// Each micro-batch's loss in @train_step's `body` (the op defining the
/// term fsdp-grad-accum added up, before fsdp-shard's all-reduce of it),
/// in micro-batch order. Defined in Schedule.cpp.
SmallVector<Operation *> stepLossOps(Block &body);

/// The parameter all-gathers of `body` that serve the backward pass (its
/// gradients or a recomputation): those whose gathered value is first read
/// after a micro-batch's loss (`losses`, from stepLossOps) and before the
/// next fsdp.microbatch. Judged by the first reader, which fsdp-schedule
/// never moves, so the answer is the same before and after it (a forward
/// gather prefetched into the previous micro-batch's backward is still a
/// forward gather). Defined in Schedule.cpp.
llvm::SmallPtrSet<Operation *, 16> backwardGathers(Block &body, ArrayRef<Operation *> losses);

/// Largest tensor the compiler plans, in bytes (the runtime's bound too):
/// far above any real model, far below where int64 size arithmetic on a
/// few of them could overflow.
constexpr int64_t kMaxTensorBytes = int64_t(1) << 48;

/// Every tensor type in `module` (values, block arguments, type attributes
/// such as a parameter's) has static dimensions >= 1 and at most
/// kMaxTensorBytes: a batch of 0 or a shape like [2^62, 4] is reported on
/// the op that holds it, before any size arithmetic.
inline LogicalResult checkTensorSizes(ModuleOp module) {
  auto check = [](Type type, Operation *op) -> LogicalResult {
    auto t = dyn_cast<RankedTensorType>(type);
    if (!t)
      return success();
    int64_t bytes = std::max<int64_t>(1, t.getElementTypeBitWidth() / 8);
    for (int64_t d : t.getShape()) {
      if (d < 1)
        return op->emitError() << "tensor " << type
                               << " has a dimension < 1 (a batch or size of 0 "
                                  "cannot be trained)";
      if (__builtin_mul_overflow(bytes, d, &bytes) || bytes > kMaxTensorBytes)
        return op->emitError() << "tensor " << type << " is larger than "
                               << kMaxTensorBytes << " bytes";
    }
    return success();
  };
  WalkResult r = module.walk([&](Operation *op) {
    for (Type t : op->getResultTypes())
      if (failed(check(t, op)))
        return WalkResult::interrupt();
    for (Region &region : op->getRegions())
      for (Block &block : region)
        for (BlockArgument a : block.getArguments())
          if (failed(check(a.getType(), op)))
            return WalkResult::interrupt();
    for (NamedAttribute attr : op->getAttrs())
      if (auto ta = dyn_cast<TypeAttr>(attr.getValue()))
        if (failed(check(ta.getValue(), op)))
          return WalkResult::interrupt();
    return WalkResult::advance();
  });
  return failure(r.wasInterrupted());
}

} // namespace mlir::fsdp

#endif // FSDP_PASSES_PASSES_H
