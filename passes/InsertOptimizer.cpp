//===- InsertOptimizer.cpp - optimizer updates and state ------------------===//
//
// fsdp-insert-optimizer: turns the gradients published by fsdp-autodiff into
// parameter updates at the end of @train_step.
//
// The learning rate and step count are function arguments (roles "lr" and
// "step") rather than constants, so one plan serves any LR schedule. Every
// update op is elementwise; this is what lets fsdp-shard later apply the
// same update to a 1/N shard of a parameter (weight-update sharding). The
// non-elementwise parts are separate ops that sum over their operand, so
// that sharding can turn each into partial sums plus an all-reduce: the
// global gradient norm for clipping (fsdp.squared_norm, a scalar) and
// LAMB's per-parameter norms of the weights and the update
// (fsdp.lamb_norms, two per parameter, read by fsdp.lamb_update).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "runtime/core/ShapeRules.h"

#include "mlir/IR/Builders.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPINSERTOPTIMIZER
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct InsertOptimizerPass
    : mlir::fsdp::impl::FsdpInsertOptimizerBase<InsertOptimizerPass> {
  using Base::Base;

  void runOnOperation() override;

private:
  /// Declares a zero-initialized state tensor shadowing `param`.
  /// `elem`: the state's element type (null: the parameter's).
  /// The state `kind` of `param`: of its type, of its shape in `elem`, or
  /// of type `whole` (8-bit moments' packed codes).
  StateOp createState(ParamOp param, StringRef kind, Type elem = {}, Type whole = {}) {
    OpBuilder b(param);
    b.setInsertionPointAfter(lastSymbol ? lastSymbol : param.getOperation());
    std::string name = (param.getSymName() + "." + kind).str();
    TypeAttr type = whole  ? TypeAttr::get(whole)
                    : elem ? TypeAttr::get(param.getTensorType().clone(elem))
                           : param.getTypeAttr();
    auto state =
        b.create<StateOp>(param.getLoc(), b.getStringAttr(name), type,
                          FlatSymbolRefAttr::get(param.getSymNameAttr()), b.getStringAttr(kind));
    lastSymbol = state;
    ++numStates;
    return state;
  }

  Operation *lastSymbol = nullptr;
};

void InsertOptimizerPass::runOnOperation() {
  ModuleOp module = getOperation();
  auto step = getTrainStep(module, "fsdp-autodiff");
  if (!step)
    return signalPassFailure();
  if (optimizer != "sgd" && optimizer != "adamw" && optimizer != "lamb" && optimizer != "none") {
    mlir::emitError(module.getLoc())
        << "unknown optimizer '" << optimizer << "': expected sgd, adamw, lamb or none";
    return signalPassFailure();
  }
  if (maxGradNorm < 0 || momentum < 0 || eps <= 0 || beta1 < 0 ||
      beta1 >= 1 || beta2 < 0 || beta2 >= 1) {
    mlir::emitError(module.getLoc()) << "invalid optimizer options: need max-grad-norm >= "
                          "0, momentum >= 0, eps > 0, 0 <= beta < 1";
    return signalPassFailure();
  }
  if (nesterov && (momentum <= 0 || dampening != 0)) {
    mlir::emitError(module.getLoc())
        << "nesterov momentum requires momentum > 0 and zero dampening";
    return signalPassFailure();
  }
  if (stateDtype != "f32" && stateDtype != "bf16" && stateDtype != "8bit" && stateDtype != "4bit") {
    mlir::emitError(module.getLoc())
        << "state-dtype must be f32, bf16, 8bit or 4bit, found '" << stateDtype << "'";
    return signalPassFailure();
  }
  // 4-bit codes are 8-bit's packing of AdamW's moments at half the bits
  // (runtime/core/Moments4.h): a `state_bits = 4` on the packed update.
  const bool state4 = stateDtype == "4bit";
  const bool state8 = stateDtype == "8bit" || state4;
  if (state4 && optimizer != "adamw") {
    mlir::emitError(module.getLoc())
        << "state-dtype=4bit keeps AdamW's moments in 4-bit block codes (torchao's AdamW4bit); "
           "optimizer="
        << optimizer << " has no 4-bit state here: use state-dtype=8bit";
    return signalPassFailure();
  }
  // The block's default: torchao's for its 4-bit AdamW, 256 for 8 bits.
  const int64_t stateBlock = this->stateBlock ? this->stateBlock.getValue() : state4 ? 128 : 256;
  if (state8 && optimizer != "adamw" && optimizer != "lamb" &&
      !(optimizer == "sgd" && momentum > 0)) {
    mlir::emitError(module.getLoc())
        << "state-dtype=8bit keeps AdamW's and LAMB's moments or SGD's momentum buffer in 8-bit "
           "block codes; optimizer="
        << optimizer
        << (optimizer == "sgd" ? " without momentum keeps no state" : " keeps no state");
    return signalPassFailure();
  }
  if (state8 && (stateBlock < 32 || stateBlock > 4096 || (stateBlock & (stateBlock - 1)))) {
    mlir::emitError(module.getLoc())
        << "state-block must be a power of two in [32, 4096], found " << stateBlock;
    return signalPassFailure();
  }
  if (stateRounding != "stochastic" && stateRounding != "nearest") {
    mlir::emitError(module.getLoc())
        << "state-rounding must be stochastic or nearest, found '" << stateRounding << "'";
    return signalPassFailure();
  }
  const bool bf16State = stateDtype == "bf16";
  if (bf16State && optimizer == "sgd" && momentum <= 0) {
    mlir::emitError(module.getLoc())
        << "state-dtype=bf16 stores optimizer state in bf16, and SGD without momentum keeps "
           "none (set momentum > 0, or state-dtype=f32)";
    return signalPassFailure();
  }

  double wd = weightDecay >= 0 ? weightDecay.getValue() : (optimizer == "sgd" ? 0.0 : 0.01);
  if (weightDecayParams != "all" && weightDecayParams != "matrices") {
    mlir::emitError(module.getLoc())
        << "weight-decay-params must be all or matrices, found '"
        << weightDecayParams << "'";
    return signalPassFailure();
  }
  // nanoGPT's and llm.c's AdamW groups: matrices (embeddings and linear
  // weights) decay, vectors (biases, norm gains) do not.
  auto decayOf = [&](ParamOp param) {
    return weightDecayParams == "all" || param.getTensorType().getRank() >= 2 ? wd : 0.0;
  };

  MLIRContext *ctx = &getContext();
  OpBuilder b(ctx);
  // Record the options: the plan carries them to fsdp-run (and the PyTorch
  // oracle uses them to build the same optimizer).
  SmallVector<NamedAttribute> recorded = {
      b.getNamedAttr("optimizer", b.getStringAttr(optimizer)),
      b.getNamedAttr("momentum", b.getF64FloatAttr(momentum)),
      b.getNamedAttr("dampening", b.getF64FloatAttr(dampening)),
      b.getNamedAttr("nesterov", b.getBoolAttr(nesterov)),
      b.getNamedAttr("weight_decay", b.getF64FloatAttr(wd)),
      b.getNamedAttr("weight_decay_params", b.getStringAttr(weightDecayParams)),
      b.getNamedAttr("beta1", b.getF64FloatAttr(beta1)),
      b.getNamedAttr("beta2", b.getF64FloatAttr(beta2)),
      b.getNamedAttr("eps", b.getF64FloatAttr(eps)),
      b.getNamedAttr("max_grad_norm", b.getF64FloatAttr(maxGradNorm)),
  };
  if (bf16State) { // f32 moments leave the record as it was
    recorded.push_back(b.getNamedAttr("state_dtype", b.getStringAttr(stateDtype)));
    recorded.push_back(b.getNamedAttr("state_rounding", b.getStringAttr(stateRounding)));
  }
  if (state8) {
    recorded.push_back(b.getNamedAttr("state_dtype", b.getStringAttr(stateDtype)));
    recorded.push_back(b.getNamedAttr("state_block", b.getI64IntegerAttr(stateBlock)));
    if (state4)
      recorded.push_back(b.getNamedAttr("state_bits", b.getI64IntegerAttr(4)));
  }
  module->setAttr("fsdp.optimizer", b.getDictionaryAttr(recorded));
  if (optimizer == "none") {
    if (getLossScalePolicy(module)) {
      mlir::emitError(module.getLoc())
          << "loss scaling needs an optimizer (the updates unscale the "
             "gradients and skip overflowed steps); optimizer=none would "
             "output scaled gradients: use loss-scale=none";
      return signalPassFailure();
    }
    auto mp = module->getAttrOfType<DictionaryAttr>(kMixedPrecisionAttrName);
    if (mp && mp.get(kMasterDtypeAttrName)) {
      mlir::emitError(module.getLoc())
          << "master-dtype=bf16 stores the parameters the optimizer updates in bf16; "
             "optimizer=none updates none: use master-dtype=f32";
      return signalPassFailure();
    }
    return;
  }

  SmallVector<SetGradOp> sets;
  step.walk([&](SetGradOp op) { sets.push_back(op); });
  // LAMB's trust ratio divides f32 norms of the master weights: a model
  // whose parameters are stored in 16 bits has no master to take them of.
  for (SetGradOp set : sets)
    if (auto param = module.lookupSymbol<ParamOp>(set.getNameAttr());
        optimizer == "lamb" && param && !param.getTensorType().getElementType().isF32()) {
      param.emitOpError() << "optimizer=lamb needs f32 parameters (the master copy; "
                             "param-dtype=bf16|f16 gives the 16-bit compute), found "
                          << param.getTensorType().getElementType();
      return signalPassFailure();
    }
  if (sets.empty()) {
    mlir::emitError(step.getLoc()) << "no fsdp.set_grad to update: nothing is trainable";
    return signalPassFailure();
  }

  // lr and step are appended as 0-d f32 arguments.
  auto scalarTy = RankedTensorType::get({}, b.getF32Type());
  Block &body = step.getBody().front();
  unsigned base = step.getNumArguments();
  step.insertArguments({base, base}, {scalarTy, scalarTy},
                       {b.getDictionaryAttr(b.getNamedAttr(
                            kRoleAttrName, b.getStringAttr("lr"))),
                        b.getDictionaryAttr(b.getNamedAttr(
                            kRoleAttrName, b.getStringAttr("step")))},
                       {step.getLoc(), step.getLoc()});
  Value lr = body.getArgument(base), stepCount = body.getArgument(base + 1);

  for (auto p : module.getOps<ParamOp>())
    lastSymbol = p;
  for (auto s : module.getOps<StateOp>())
    lastSymbol = s;

  b.setInsertionPoint(body.getTerminator());
  Location loc = step.getLoc();

  // Global-norm clipping: one squared norm over all gradients, one factor.
  SmallVector<Value> grads;
  for (SetGradOp set : sets)
    grads.push_back(set.getValue());
  // With dynamic loss scaling the gradients are `scale` times too large:
  // one factor unscales (and clips) them, and the updates are skipped when
  // the squared norm overflowed. Either way the step returns the squared
  // norm after the loss: the runtime's found_inf that drives the scale,
  // and the gradient norm fsdp-run reports (what clip_grad_norm_ returns).
  Value lossScale = findRoleArgument(step, "loss_scale"), skip;
  if (lossScale || maxGradNorm > 0) {
    Value sumsq = b.create<SquaredNormOp>(loc, scalarTy, grads);
    FloatAttr maxNorm = maxGradNorm > 0 ? b.getF64FloatAttr(maxGradNorm) : FloatAttr();
    Value coef = lossScale
                     ? b.create<GradCoefOp>(loc, scalarTy, sumsq, lossScale, maxNorm).getResult()
                     : b.create<ClipCoefOp>(loc, scalarTy, sumsq, maxNorm).getResult();
    for (Value &g : grads)
      g = b.create<MulOp>(loc, g.getType(), g, coef);
    if (lossScale)
      skip = sumsq;
    auto ret = cast<func::ReturnOp>(body.getTerminator());
    ret->insertOperands(ret.getNumOperands(), sumsq);
    step.setType(FunctionType::get(ctx, step.getArgumentTypes(), ret.getOperandTypes()));
  }

  int64_t ordinal = 0; // the update's place among the step's updates
  for (auto [set, grad] : llvm::zip(sets, grads)) {
    auto param = module.lookupSymbol<ParamOp>(set.getNameAttr());
    Location ploc = set.getLoc();
    Value p = b.create<GetParamOp>(ploc, param.getType(), set.getNameAttr());
    auto symRef = [&](StateOp s) {
      return FlatSymbolRefAttr::get(s.getSymNameAttr());
    };
    // bf16 state of f32 parameters only (the verifier's rule); a bf16
    // parameter's state is bf16 already. The stochastic draws' key: the
    // update's ordinal here; fsdp-shard gives each unit's update the
    // unit's.
    Type stateElem = bf16State && param.getTensorType().getElementType().isF32()
                         ? Type(b.getBF16Type())
                         : Type();
    const bool stochastic = stateElem && stateRounding == "stochastic";
    // 8-bit state of an f32 parameter: a packed i8 vector of its codes and
    // block scales (the update's state_block).
    const bool packed = state8 && param.getTensorType().getElementType().isF32();
    Type packedTy = RankedTensorType::get(
        {::fsdp::shapes::packedStateBytes(param.getTensorType().getNumElements(), stateBlock,
                                          state4 ? 4 : 8)},
        b.getIntegerType(8));
    if (optimizer == "lamb") {
      // The norms over the whole parameter (one segment), then the step;
      // fsdp-shard rebuilds both over each unit's flat shard, its
      // parameters as segments, with an all-reduce of the norms between.
      StateOp m = createState(param, "exp_avg", stateElem, packed ? packedTy : Type());
      StateOp v = createState(param, "exp_avg_sq", stateElem, packed ? packedTy : Type());
      Value mv = b.create<GetStateOp>(ploc, m.getType(), symRef(m));
      Value vv = b.create<GetStateOp>(ploc, v.getType(), symRef(v));
      Type t = param.getType(), st = m.getType();
      auto segments = b.getDenseI64ArrayAttr({0, param.getTensorType().getNumElements()});
      auto normsTy = RankedTensorType::get({2}, b.getF32Type());
      IntegerAttr block = packed ? b.getI64IntegerAttr(stateBlock) : IntegerAttr();
      Value norms = b.create<LambNormsOp>(
          ploc, normsTy, p, grad, mv, vv, stepCount, /*grad_scale=*/Value(), segments,
          b.getF64FloatAttr(beta1), b.getF64FloatAttr(beta2), b.getF64FloatAttr(eps),
          b.getF64FloatAttr(decayOf(param)), IntegerAttr(), IntegerAttr(), block);
      auto upd = b.create<LambUpdateOp>(
          ploc, TypeRange{t, st, st}, p, grad, mv, vv, norms, lr, stepCount, skip,
          /*grad_scale=*/Value(), segments, b.getF64FloatAttr(beta1), b.getF64FloatAttr(beta2),
          b.getF64FloatAttr(eps), b.getF64FloatAttr(decayOf(param)), IntegerAttr(), IntegerAttr(),
          stochastic ? b.getUnitAttr() : UnitAttr(),
          stochastic ? b.getI64IntegerAttr(ordinal) : IntegerAttr(), block);
      b.create<SetParamOp>(ploc, set.getNameAttr(), upd.getNewParam());
      b.create<SetStateOp>(ploc, symRef(m), upd.getNewExpAvg());
      b.create<SetStateOp>(ploc, symRef(v), upd.getNewExpAvgSq());
    } else if (optimizer == "adamw") {
      StateOp m = createState(param, "exp_avg", stateElem, packed ? packedTy : Type());
      StateOp v = createState(param, "exp_avg_sq", stateElem, packed ? packedTy : Type());
      Value mv = b.create<GetStateOp>(ploc, m.getType(), symRef(m));
      Value vv = b.create<GetStateOp>(ploc, v.getType(), symRef(v));
      Type t = param.getType(), st = m.getType();
      auto upd = b.create<AdamwUpdateOp>(
          ploc, TypeRange{t, st, st}, p, grad, mv, vv, lr, stepCount, skip,
          /*grad_scale=*/Value(), b.getF64FloatAttr(beta1), b.getF64FloatAttr(beta2),
          b.getF64FloatAttr(eps), b.getF64FloatAttr(decayOf(param)), IntegerAttr(), IntegerAttr(),
          stochastic ? b.getUnitAttr() : UnitAttr(), /*stochastic_param=*/UnitAttr(),
          stochastic ? b.getI64IntegerAttr(ordinal) : IntegerAttr(),
          packed ? b.getI64IntegerAttr(stateBlock) : IntegerAttr(),
          packed && state4 ? b.getI64IntegerAttr(4) : IntegerAttr());
      b.create<SetParamOp>(ploc, set.getNameAttr(), upd.getNewParam());
      b.create<SetStateOp>(ploc, symRef(m), upd.getNewExpAvg());
      b.create<SetStateOp>(ploc, symRef(v), upd.getNewExpAvgSq());
    } else if (momentum > 0) {
      StateOp buf = createState(param, "momentum_buffer", stateElem, packed ? packedTy : Type());
      Value bv = b.create<GetStateOp>(ploc, buf.getType(), symRef(buf));
      Type t = param.getType();
      auto upd = b.create<SgdMomentumUpdateOp>(
          ploc, TypeRange{t, buf.getType()}, p, grad, bv, lr, stepCount, skip,
          /*grad_scale=*/Value(), b.getF64FloatAttr(momentum), b.getF64FloatAttr(dampening),
          b.getF64FloatAttr(decayOf(param)), IntegerAttr(), IntegerAttr(),
          nesterov ? b.getUnitAttr() : UnitAttr(), stochastic ? b.getUnitAttr() : UnitAttr(),
          /*stochastic_param=*/UnitAttr(),
          stochastic ? b.getI64IntegerAttr(ordinal) : IntegerAttr(),
          packed ? b.getI64IntegerAttr(stateBlock) : IntegerAttr());
      b.create<SetParamOp>(ploc, set.getNameAttr(), upd.getNewParam());
      b.create<SetStateOp>(ploc, symRef(buf), upd.getNewBuffer());
    } else {
      Value np =
          b.create<SgdUpdateOp>(ploc, param.getType(), p, grad, lr, skip, /*grad_scale=*/Value(),
                                b.getF64FloatAttr(decayOf(param)), IntegerAttr(), IntegerAttr(),
                                /*stochastic_param=*/UnitAttr(), /*key=*/IntegerAttr());
      b.create<SetParamOp>(ploc, set.getNameAttr(), np);
    }
    ++numUpdates;
    ++ordinal;
  }
  for (SetGradOp set : sets)
    set.erase();
}

} // namespace
