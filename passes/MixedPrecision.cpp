//===- MixedPrecision.cpp - compute in bf16 on f32 master parameters -----===//
//
// fsdp-mixed-precision: FSDP2's MixedPrecisionPolicy as a rewrite of the
// model function, before fsdp-autodiff. Parameters stay f32 symbols (the
// master copy the optimizer updates, with f32 optimizer state); the model
// reads each one through an `fsdp.cast` to the compute dtype, casts its
// float inputs the same way, and every op downstream of a cast value is
// retyped to the compute dtype. Losses compute in f32, as autocast's fp32
// op list does (the softmax over the vocabulary and the log are where
// bf16 would lose the most): MSE and BCE read f32 casts of their operands;
// cross-entropy reads its logits in the compute dtype and widens them
// itself (no f32 copy of a [tokens, vocabulary] matrix, and its gradient
// is written in the compute dtype, rounded once). The function still
// returns an f32 loss.
//
// Why before autodiff: the backward pass is then derived in the compute
// dtype by the ordinary VJP rules (a cast's VJP is the cast back), so
// every gradient op computes in bf16 and each parameter's gradient reaches
// `fsdp.set_grad` as a cast to f32 of a bf16 value. The module attribute
// `fsdp.mixed_precision` records the policy; fsdp-shard reads it and
// (1) gathers a unit in the dtype its reads are cast to, casting the f32
// shard BEFORE the all-gather (half the bytes moved and gathered), and
// (2) packs and reduces gradients in `reduce_dtype`, casting the reduced
// shard to f32 right before the unit's update.
//
// The rule that decides each op's dtype is dataflow, not a list of op
// names: an op with a float operand in the compute dtype, or reading a
// float input of the model, computes in it (its other f32 operands are
// cast once, its f32 results retyped); an op with only f32 operands (a
// constant fill, anything after the loss) stays f32, and an input only a
// loss reads (a regression target) is never rounded.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

#include <cmath>
#include <sstream>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPMIXEDPRECISION
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

/// f32 / bf16 / f16 from an option value; null (after reporting) otherwise.
Type parseDtype(MLIRContext *ctx, ModuleOp module, StringRef option,
                StringRef value) {
  if (value == "f32")
    return Float32Type::get(ctx);
  if (value == "bf16")
    return BFloat16Type::get(ctx);
  if (value == "f16")
    return Float16Type::get(ctx);
  mlir::emitError(module.getLoc())
      << "fsdp-mixed-precision: " << option << "='" << value
      << "' is not a dtype: expected f32, bf16 or f16";
  return {};
}

bool isFloatTensorOf(Type t, Type elem) {
  auto rt = dyn_cast<RankedTensorType>(t);
  return rt && rt.getElementType() == elem;
}

/// Losses read f32 (their verifiers require it; autocast computes them in
/// f32 too) and return a 0-d f32.
bool isLoss(Operation *op) {
  return isa<CrossEntropyOp, MseLossOp, BceWithLogitsOp>(op);
}

struct MixedPrecisionPass
    : mlir::fsdp::impl::FsdpMixedPrecisionBase<MixedPrecisionPass> {
  using Base::Base;

  void runOnOperation() override;

private:
  /// Resolves loss-scale (f16's default is dynamic) into `scaling` and
  /// checks its factors.
  LogicalResult checkLossScaling(ModuleOp module, Type compute, Type reduce, StringRef &scaling);
  /// Records the policy as the module's `fsdp.mixed_precision` attribute.
  void recordPolicy(ModuleOp module, Type compute, Type reduce, StringRef scaling);
  /// Retypes the model function's ops to `compute` (the file comment's
  /// dataflow rule) and casts where the dtypes meet.
  void retypeModel(func::FuncOp model, Type compute);
};

LogicalResult MixedPrecisionPass::checkLossScaling(ModuleOp module, Type compute, Type reduce,
                                                   StringRef &scaling) {
  // Dynamic loss scaling: f16's default, optional otherwise.
  scaling = lossScale;
  if (scaling.empty())
    scaling = isa<Float16Type>(compute) || isa<Float16Type>(reduce) ? "dynamic"
                                                                     : "none";
  if (scaling != "dynamic" && scaling != "none") {
    mlir::emitError(module.getLoc())
        << "fsdp-mixed-precision: loss-scale='" << scaling
        << "': expected dynamic or none";
    return failure();
  }
  // Powers of two, so that scaling, unscaling and every change of the
  // scale round nothing (the runtime refuses other factors too).
  auto show = [](double v) {
    std::ostringstream os;
    os << v; // 0.25, 3, 1e-05: as the user wrote it
    return os.str();
  };
  auto powerOfTwo = [](double v) {
    int exp = 0;
    return std::isfinite(v) && v > 0 && std::frexp(v, &exp) == 0.5;
  };
  if (scaling == "dynamic") {
    if (!powerOfTwo(lossScaleInit) || lossScaleInit < 1.0 ||
        lossScaleInit > 0x1p127) {
      mlir::emitError(module.getLoc())
          << "fsdp-mixed-precision: loss-scale-init=" << (double)lossScaleInit
          << " must be a power of two in [1, 2^127] (so scaling and "
             "unscaling round nothing)";
      return failure();
    }
    if (lossScaleGrowthInterval < 1) {
      mlir::emitError(module.getLoc())
          << "fsdp-mixed-precision: loss-scale-growth-interval="
          << (int64_t)lossScaleGrowthInterval << " must be at least 1";
      return failure();
    }
    if (!powerOfTwo(lossScaleGrowthFactor) || lossScaleGrowthFactor <= 1.0 ||
        lossScaleGrowthFactor > 0x1p64) {
      mlir::emitError(module.getLoc())
          << "fsdp-mixed-precision: loss-scale-growth-factor="
          << show(lossScaleGrowthFactor)
          << " must be a power of two in [2, 2^64]";
      return failure();
    }
    if (!powerOfTwo(lossScaleBackoffFactor) || lossScaleBackoffFactor >= 1.0 ||
        lossScaleBackoffFactor < 0x1p-64) {
      mlir::emitError(module.getLoc())
          << "fsdp-mixed-precision: loss-scale-backoff-factor="
          << show(lossScaleBackoffFactor)
          << " must be a power of two in [2^-64, 1/2]";
      return failure();
    }
  }
  return success();
}

void MixedPrecisionPass::recordPolicy(ModuleOp module, Type compute, Type reduce,
                                      StringRef scaling) {
  OpBuilder b(module.getContext());
  SmallVector<NamedAttribute> policy{
      b.getNamedAttr("param_dtype", TypeAttr::get(compute)),
      b.getNamedAttr("reduce_dtype", TypeAttr::get(reduce))};
  if (stochasticRounding)
    policy.push_back(b.getNamedAttr(kStochasticRoundingAttrName, b.getUnitAttr()));
  if (masterDtype == "bf16")
    policy.push_back(b.getNamedAttr(kMasterDtypeAttrName, TypeAttr::get(compute)));
  if (scaling == "dynamic")
    policy.push_back(b.getNamedAttr(
        kLossScaleAttrName,
        b.getDictionaryAttr(
            {b.getNamedAttr("init", b.getF64FloatAttr(lossScaleInit)),
             b.getNamedAttr("growth_interval",
                            b.getI64IntegerAttr(lossScaleGrowthInterval)),
             b.getNamedAttr("growth_factor",
                            b.getF64FloatAttr(lossScaleGrowthFactor)),
             b.getNamedAttr("backoff_factor",
                            b.getF64FloatAttr(lossScaleBackoffFactor))})));
  module->setAttr(kMixedPrecisionAttrName, b.getDictionaryAttr(policy));
}

/// The one function marked `fsdp.model`, with a single block; null (after
/// reporting) otherwise.
func::FuncOp findModel(ModuleOp module) {
  func::FuncOp model;
  for (auto fn : module.getOps<func::FuncOp>())
    if (fn->hasAttr(kModelAttrName)) {
      if (model) {
        mlir::emitError(fn.getLoc()) << "more than one model function";
        return {};
      }
      model = fn;
    }
  if (!model || !model.getBody().hasOneBlock()) {
    mlir::emitError(module.getLoc())
        << "no model function with a single block: mark one func.func with "
           "the `fsdp.model` attribute";
    return {};
  }
  return model;
}

void MixedPrecisionPass::retypeModel(func::FuncOp model, Type compute) {
  OpBuilder b(model.getContext());
  Type f32 = Float32Type::get(model.getContext());
  Block &body = model.getBody().front();
  auto retype = [&](Type t, Type elem) {
    auto rt = cast<RankedTensorType>(t);
    return RankedTensorType::get(rt.getShape(), elem);
  };
  auto castTo = [&](Location loc, Value v, Type elem) -> Value {
    auto c = b.create<CastOp>(loc, retype(v.getType(), elem), v);
    ++numCasts;
    return c.getResult();
  };
  // One cast to the compute dtype per f32 value a compute op reads (an
  // input, a constant), placed right after its definition. A float input
  // only a loss reads (a regression target) is never rounded.
  DenseMap<Value, Value> computeCopy;
  auto toCompute = [&](Value v) -> Value {
    Value &c = computeCopy[v];
    if (!c) {
      OpBuilder::InsertionGuard guard(b);
      if (Operation *def = v.getDefiningOp())
        b.setInsertionPointAfter(def);
      else
        b.setInsertionPointToStart(&body);
      c = castTo(v.getLoc(), v, compute);
    }
    return c;
  };
  SmallVector<Operation *> ops;
  for (Operation &op : body)
    ops.push_back(&op);
  for (Operation *op : ops) {
    b.setInsertionPoint(op);
    if (auto get = dyn_cast<GetParamOp>(op)) {
      // A read of the master copy, in the compute dtype.
      b.setInsertionPointAfter(get);
      Value c = castTo(get.getLoc(), get.getResult(), compute);
      get.getResult().replaceAllUsesExcept(c, c.getDefiningOp());
      continue;
    }
    if (isa<CastOp>(op))
      continue; // the model's own casts say what they mean
    if (isLoss(op) || isa<func::ReturnOp>(op)) {
      for (OpOperand &o : op->getOpOperands()) {
        // Cross-entropy reads logits in the compute dtype and computes in
        // f32 from them (the same values as from an f32 copy, which for a
        // vocabulary-sized matrix would cost two passes and twice its
        // bytes); its gradient comes back in that dtype, rounded once.
        if (isa<CrossEntropyOp>(op) && o.getOperandNumber() == 0)
          continue;
        if (isFloatTensorOf(o.get().getType(), compute))
          o.set(castTo(op->getLoc(), o.get(), f32));
      }
      continue;
    }
    // Reads a value in the compute dtype, or a float input of the model
    // (x @ w reads x in bf16 once w is).
    bool inCompute = llvm::any_of(op->getOperands(), [&](Value v) {
      return isFloatTensorOf(v.getType(), compute) ||
             (isa<BlockArgument>(v) && isFloatTensorOf(v.getType(), f32));
    });
    if (!inCompute)
      continue;
    for (OpOperand &o : op->getOpOperands())
      if (isFloatTensorOf(o.get().getType(), f32))
        o.set(toCompute(o.get()));
    for (Value r : op->getResults())
      if (isFloatTensorOf(r.getType(), f32)) {
        r.setType(retype(r.getType(), compute));
        ++numRetyped;
      }
  }
}

void MixedPrecisionPass::runOnOperation() {
  ModuleOp module = getOperation();
  MLIRContext *ctx = &getContext();
  Type compute = parseDtype(ctx, module, "param-dtype", paramDtype);
  if (!compute)
    return signalPassFailure();
  Type reduce = parseDtype(ctx, module, "reduce-dtype", reduceDtype);
  if (!reduce)
    return signalPassFailure();
  if (module.lookupSymbol(kTrainStepName)) {
    mlir::emitError(module.getLoc())
        << "fsdp-mixed-precision runs before fsdp-autodiff (it retypes the "
           "model, and the backward pass is derived from it); @"
        << kTrainStepName << " already exists";
    return signalPassFailure();
  }
  if (module->hasAttr(kMixedPrecisionAttrName)) {
    mlir::emitError(module.getLoc()) << "fsdp-mixed-precision already ran on this module";
    return signalPassFailure();
  }
  StringRef scaling;
  if (failed(checkLossScaling(module, compute, reduce, scaling)))
    return signalPassFailure();
  if (stochasticRounding && !isa<BFloat16Type>(compute)) {
    mlir::emitError(module.getLoc())
        << "fsdp-mixed-precision: stochastic-rounding=true rounds the master "
           "parameters to bf16; it needs param-dtype=bf16";
    return signalPassFailure();
  }
  if (masterDtype != "f32" && masterDtype != "bf16") {
    mlir::emitError(module.getLoc())
        << "fsdp-mixed-precision: master-dtype='" << masterDtype << "': expected f32 or bf16";
    return signalPassFailure();
  }
  if (masterDtype == "bf16" && !isa<BFloat16Type>(compute)) {
    mlir::emitError(module.getLoc())
        << "fsdp-mixed-precision: master-dtype=bf16 stores the trainable parameters in the "
           "compute dtype; it needs param-dtype=bf16";
    return signalPassFailure();
  }
  Type f32 = Float32Type::get(ctx);
  for (ParamOp p : module.getOps<ParamOp>())
    if (p.getTensorType().getElementType() != f32) {
      p.emitOpError() << "is " << p.getTensorType().getElementType()
                      << ": with mixed precision parameters are the f32 "
                         "master copy (the compute dtype is param-dtype)";
      return signalPassFailure();
    }
  recordPolicy(module, compute, reduce, scaling);
  if (compute == f32)
    return; // only the reduce dtype changes (fsdp-shard reads it)
  func::FuncOp model = findModel(module);
  if (!model)
    return signalPassFailure();
  retypeModel(model, compute);
}

} // namespace
