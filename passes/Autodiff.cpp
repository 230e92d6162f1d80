//===- Autodiff.cpp - reverse-mode differentiation of the model -----------===//
//
// fsdp-autodiff: clones the model function into @train_step and appends the
// backward pass.
//
// Algorithm. (1) A forward sweep marks the values that depend on a trainable
// parameter ("active" values); only those get adjoints, so the batch and
// frozen parameters cost nothing. (2) A reverse sweep over the ops keeps a
// map value -> adjoint; each op with an adjoint on its result contributes to
// the adjoints of its active operands through its vector-Jacobian product
// (VJP) rule below, and contributions to one value are summed with
// fsdp.add. (3) The adjoints of all reads of one parameter are summed (tied
// weights) and published with one fsdp.set_grad per trainable parameter.
// Every emitted op carries the location of the forward op it differentiates,
// so a problem in the backward pass points at the user's source line.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "dialects/fsdp/Shapes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/MapVector.h"
#include "llvm/ADT/TypeSwitch.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPAUTODIFF
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

RankedTensorType tensorTy(Value v) {
  return cast<RankedTensorType>(v.getType());
}

bool isFloatTensor(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  return t && isa<FloatType>(t.getElementType());
}

/// Emits the backward pass of one function. Holds the adjoint map.
class Differentiator {
public:
  Differentiator(func::FuncOp fn, ModuleOp module)
      : fn(fn), module(module), b(fn.getContext()) {}

  LogicalResult run(int64_t &numGradOps, int64_t &numGrads);

private:
  void markActive();
  /// Adds `g` to the adjoint of `v` (if `v` needs one).
  void accumulate(Value v, Value g);
  LogicalResult differentiate(Operation *op, Value dy);
  LogicalResult differentiateMatmul(MatmulOp o, Value dy);

  // Builders for the handful of ops many rules share.
  Value sumTo(Location loc, Value g, Type target) {
    if (g.getType() == target)
      return g;
    return create<SumToOp>(loc, target, g);
  }
  template <typename OpT, typename... Args>
  Value create(Location loc, Args &&...args) {
    ++emitted;
    return b.create<OpT>(loc, std::forward<Args>(args)...).getResult();
  }

  func::FuncOp fn;
  ModuleOp module;
  OpBuilder b;
  DenseSet<Value> active;
  DenseMap<Value, Value> adjoint;
  int64_t emitted = 0;
};

/// Gives every fsdp.attention of `fn` its log-sum-exp result (the
/// backward pass reads it instead of recomputing the softmax statistics).
void withLogSumExp(func::FuncOp fn) {
  SmallVector<AttentionOp> plain;
  fn.walk([&](AttentionOp o) {
    if (!o.getLse())
      plain.push_back(o);
  });
  for (AttentionOp o : plain) {
    OpBuilder b(o);
    auto q = cast<RankedTensorType>(o.getQ().getType());
    auto lse = RankedTensorType::get(
        {q.getDimSize(0), (int64_t)o.getHeads(), q.getDimSize(1)}, b.getF32Type());
    auto with = b.create<AttentionOp>(o.getLoc(), o.getResult().getType(), lse,
                                      o.getQ(), o.getK(), o.getV(),
                                      o.getHeadsAttr(), o.getCausalAttr(),
                                      o.getKvHeadsAttr());
    with->setDiscardableAttrs(o->getDiscardableAttrDictionary());
    o.getResult().replaceAllUsesWith(with.getResult());
    o.erase();
  }
}

/// Gives every fsdp.cross_entropy with ignore_index and no normalizer one:
/// fsdp.count_labels of its labels, the kept positions (PyTorch's mean
/// over them). fsdp-grad-accum and fsdp-shard make the count global.
void withLabelCounts(func::FuncOp fn) {
  fn.walk([&](CrossEntropyOp o) {
    auto ignore = o.getIgnoreIndexAttr();
    if (!ignore || o.getNormalizer())
      return;
    OpBuilder b(o);
    Value n = b.create<CountLabelsOp>(o.getLoc(), o.getLabels(), ignore, IntegerAttr());
    o.getNormalizerMutable().assign(n);
  });
}

void Differentiator::markActive() {
  fn.walk([&](Operation *op) {
    if (auto get = dyn_cast<GetParamOp>(op)) {
      auto param =
          SymbolTable::lookupNearestSymbolFrom<ParamOp>(op, get.getNameAttr());
      if (param && param.isTrainable())
        active.insert(get.getResult());
      return;
    }
    bool any = llvm::any_of(op->getOperands(),
                            [&](Value v) { return active.contains(v); });
    if (!any)
      return;
    for (Value r : op->getResults())
      if (isFloatTensor(r))
        active.insert(r);
  });
}

void Differentiator::accumulate(Value v, Value g) {
  if (!active.contains(v))
    return;
  assert(v.getType() == g.getType() && "adjoint type must match its value");
  Value &slot = adjoint[v];
  if (!slot) {
    slot = g;
    return;
  }
  slot = create<AddOp>(g.getLoc(), v.getType(), slot, g);
}

/// C = op(A) op(B). With the flags (ta, tb) the adjoints are again single
/// matmuls; see the table in docs/AUTODIFF.md:
///   (0,0): dA = dC B^T          dB = A^T dC
///   (0,1): dA = dC B            dB = dC^T A
///   (1,0): dA = B dC^T          dB = A dC
///   (1,1): dA = B^T dC^T        dB = dC^T A^T
LogicalResult Differentiator::differentiateMatmul(MatmulOp o, Value dy) {
  Location loc = o.getLoc();
  if (o.getAcc()) {
    o.emitOpError() << "has no differentiation rule with an accumulator (acc is "
                       "fsdp-fuse-epilogues'; add the product to it in the model instead)";
    return failure();
  }
  Value a = o.getLhs(), bm = o.getRhs();
  bool ta = o.getTransposeLhs(), tb = o.getTransposeRhs();
  // An f32 product of bf16 / f16 operands is fsdp-fuse-epilogues'
  // (after this pass); its adjoint would need a cast of dC first.
  Type inElem = cast<RankedTensorType>(a.getType()).getElementType();
  if (cast<RankedTensorType>(o.getType()).getElementType() != inElem) {
    o.emitOpError() << "has no differentiation rule for an f32 product of " << inElem
                    << " operands (cast the result in the model instead)";
    return failure();
  }
  auto mm = [&](Value x, Value y, bool tx, bool ty, Type t) {
    ++emitted;
    auto m = b.create<MatmulOp>(loc, t, x, y);
    if (tx)
      m.setTransposeLhs(true);
    if (ty)
      m.setTransposeRhs(true);
    return m.getResult();
  };
  if (active.contains(a)) {
    Value da =
        !ta ? (!tb ? mm(dy, bm, false, true, a.getType()) : mm(dy, bm, false, false, a.getType()))
            : (!tb ? mm(bm, dy, false, true, a.getType()) : mm(bm, dy, true, true, a.getType()));
    accumulate(a, da);
  }
  if (active.contains(bm)) {
    Value db =
        !ta ? (!tb ? mm(a, dy, true, false, bm.getType()) : mm(dy, a, true, false, bm.getType()))
            : (!tb ? mm(a, dy, false, false, bm.getType()) : mm(dy, a, true, true, bm.getType()));
    accumulate(bm, db);
  }
  return success();
}

LogicalResult Differentiator::differentiate(Operation *op, Value dy) {
  Location loc = op->getLoc();
  auto vjpBinary = [&](Value lhs, Value rhs, Value dl, Value dr) {
    if (dl)
      accumulate(lhs, sumTo(loc, dl, lhs.getType()));
    if (dr)
      accumulate(rhs, sumTo(loc, dr, rhs.getType()));
  };
  auto act = [&](Value v) { return active.contains(v); };
  Type dyTy = dy.getType();

  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case([&](AddOp o) {
        vjpBinary(o.getLhs(), o.getRhs(), dy, dy);
        return success();
      })
      .Case([&](SubOp o) {
        Value neg = act(o.getRhs()) ? create<NegOp>(loc, dyTy, dy) : Value();
        vjpBinary(o.getLhs(), o.getRhs(), dy, neg);
        return success();
      })
      .Case([&](MulOp o) {
        Value dl = act(o.getLhs()) ? create<MulOp>(loc, dyTy, dy, o.getRhs())
                                   : Value();
        Value dr = act(o.getRhs()) ? create<MulOp>(loc, dyTy, dy, o.getLhs())
                                   : Value();
        vjpBinary(o.getLhs(), o.getRhs(), dl, dr);
        return success();
      })
      .Case([&](DivOp o) {
        // d(a/b)/da = 1/b; d(a/b)/db = -(a/b)/b.
        Value dl = act(o.getLhs()) ? create<DivOp>(loc, dyTy, dy, o.getRhs())
                                   : Value();
        Value dr;
        if (act(o.getRhs())) {
          Value cOverB = create<DivOp>(loc, dyTy, o.getResult(), o.getRhs());
          Value prod = create<MulOp>(loc, dyTy, dy, cOverB);
          dr = create<NegOp>(loc, dyTy, prod);
        }
        vjpBinary(o.getLhs(), o.getRhs(), dl, dr);
        return success();
      })
      .Case([&](NegOp o) {
        accumulate(o.getInput(), create<NegOp>(loc, dyTy, dy));
        return success();
      })
      .Case([&](ScaleOp o) {
        accumulate(o.getInput(),
                   create<ScaleOp>(loc, dyTy, dy, o.getFactorAttr()));
        return success();
      })
      .Case([&](DropoutOp o) {
        // y = x * m / (1 - p): dx = dy * m / (1 - p), the same mask (same
        // attributes, same step): nothing is saved.
        accumulate(o.getInput(),
                   create<DropoutOp>(loc, dyTy, dy, o.getPAttr(), o.getIdAttr(),
                                     o.getMicroAttr(), o.getMicroCountAttr()));
        return success();
      })
      .Case([&](ReluOp o) {
        accumulate(o.getInput(),
                   create<ReluGradOp>(loc, dyTy, o.getInput(), dy));
        return success();
      })
      .Case([&](GeluOp o) {
        accumulate(o.getInput(),
                   create<GeluGradOp>(loc, dyTy, o.getInput(), dy,
                                      o.getApproximateAttr()));
        return success();
      })
      .Case([&](SiluOp o) {
        accumulate(o.getInput(),
                   create<SiluGradOp>(loc, dyTy, o.getInput(), dy));
        return success();
      })
      .Case([&](SwigluOp o) {
        ++emitted;
        auto g = b.create<SwigluGradOp>(loc, TypeRange{dyTy, dyTy}, o.getGate(),
                                        o.getUp(), dy);
        if (act(o.getGate()))
          accumulate(o.getGate(), g.getDGate());
        if (act(o.getUp()))
          accumulate(o.getUp(), g.getDUp());
        return success();
      })
      .Case([&](RmsNormOp o) {
        ++emitted;
        auto g = b.create<RmsNormGradOp>(
            loc, TypeRange{o.getInput().getType(), o.getWeight().getType()},
            o.getInput(), o.getWeight(), dy, o.getEpsilonAttr());
        accumulate(o.getInput(), g.getDInput());
        accumulate(o.getWeight(), g.getDWeight());
        return success();
      })
      .Case([&](RopeOp o) {
        accumulate(o.getInput(), create<RopeGradOp>(loc, dyTy, dy,
                                                    o.getHeadsAttr(),
                                                    o.getThetaAttr()));
        return success();
      })
      .Case([&](SoftmaxOp o) {
        accumulate(o.getInput(),
                   create<SoftmaxGradOp>(loc, dyTy, o.getResult(), dy));
        return success();
      })
      .Case([&](BiasAddOp o) {
        accumulate(o.getInput(), dy);
        if (act(o.getBias()))
          accumulate(o.getBias(), sumTo(loc, dy, o.getBias().getType()));
        return success();
      })
      .Case([&](MatmulOp o) { return differentiateMatmul(o, dy); })
      .Case([&](LayerNormOp o) {
        ++emitted;
        auto g = b.create<LayerNormGradOp>(
            loc, TypeRange{o.getInput().getType(), o.getGamma().getType(),
                           o.getBeta().getType()},
            o.getInput(), o.getGamma(), dy, o.getEpsilonAttr());
        accumulate(o.getInput(), g.getDInput());
        accumulate(o.getGamma(), g.getDGamma());
        accumulate(o.getBeta(), g.getDBeta());
        return success();
      })
      .Case([&](AttentionOp o) {
        ++emitted;
        // withLogSumExp gave every attention its lse before the sweep.
        assert(o.getLse() && "attention without its log-sum-exp");
        Type t = o.getQ().getType(), kv = o.getK().getType();
        auto g = b.create<AttentionGradOp>(
            loc, TypeRange{t, kv, kv}, o.getQ(), o.getK(), o.getV(),
            o.getResult(), o.getLse(), dy, o.getHeadsAttr(),
            o.getCausalAttr(), o.getKvHeadsAttr());
        accumulate(o.getQ(), g.getDQ());
        accumulate(o.getK(), g.getDK());
        accumulate(o.getV(), g.getDV());
        return success();
      })
      .Case([&](EmbeddingOp o) {
        accumulate(o.getTable(),
                   create<EmbeddingGradOp>(loc, o.getTable().getType(),
                                           o.getIds(), dy));
        return success();
      })
      .Case([&](ReshapeOp o) {
        accumulate(o.getInput(),
                   create<ReshapeOp>(loc, o.getInput().getType(), dy));
        return success();
      })
      .Case([&](TransposeOp o) {
        ArrayRef<int64_t> perm = o.getPerm();
        SmallVector<int64_t> inverse(perm.size());
        for (auto [i, p] : llvm::enumerate(perm))
          inverse[p] = i;
        accumulate(o.getInput(),
                   create<TransposeOp>(loc, o.getInput().getType(), dy,
                                       b.getDenseI64ArrayAttr(inverse)));
        return success();
      })
      .Case([&](SliceOp o) {
        accumulate(o.getInput(),
                   create<SliceGradOp>(loc, o.getInput().getType(), dy,
                                       o.getDimAttr(), o.getOffsetAttr()));
        return success();
      })
      .Case([&](ConcatOp o) {
        int64_t offset = 0, dim = o.getDim();
        for (Value in : o.getInputs()) {
          if (act(in))
            accumulate(in, create<SliceOp>(loc, in.getType(), dy,
                                           o.getDimAttr(),
                                           b.getI64IntegerAttr(offset)));
          offset += tensorTy(in).getShape()[dim];
        }
        return success();
      })
      .Case<ReduceSumOp, ReduceMeanOp>([&](auto o) {
        auto in = tensorTy(o.getInput());
        auto kept = RankedTensorType::get(
            keptShape(in.getShape(), o.getDims()), in.getElementType());
        Value g = create<ReshapeOp>(loc, kept, dy);
        g = create<BroadcastOp>(loc, in, g);
        if constexpr (std::is_same_v<decltype(o), ReduceMeanOp>) {
          int64_t count = 1;
          for (int64_t d : o.getDims())
            count *= in.getShape()[d];
          g = create<ScaleOp>(loc, in, g, b.getF64FloatAttr(1.0 / count));
        }
        accumulate(o.getInput(), g);
        return success();
      })
      .Case([&](BroadcastOp o) {
        accumulate(o.getInput(), sumTo(loc, dy, o.getInput().getType()));
        return success();
      })
      .Case([&](SumToOp o) {
        accumulate(o.getInput(),
                   create<BroadcastOp>(loc, o.getInput().getType(), dy));
        return success();
      })
      .Case([&](CastOp o) {
        accumulate(o.getInput(),
                   create<CastOp>(loc, o.getInput().getType(), dy));
        return success();
      })
      .Case([&](CrossEntropyOp o) {
        accumulate(o.getLogits(), create<CrossEntropyGradOp>(
                                      loc, o.getLogits().getType(), o.getLogits(), o.getLabels(),
                                      dy, o.getNormalizer(), o.getClassesAttr(),
                                      o.getLabelSmoothingAttr(), o.getIgnoreIndexAttr()));
        return success();
      })
      .Case([&](MseLossOp o) {
        Type t = o.getInput().getType();
        if (act(o.getInput()))
          accumulate(o.getInput(), create<MseLossGradOp>(
                                       loc, t, o.getInput(), o.getTarget(), dy));
        if (act(o.getTarget())) {
          // Symmetric in its operands up to sign.
          Value g =
              create<MseLossGradOp>(loc, t, o.getInput(), o.getTarget(), dy);
          accumulate(o.getTarget(), create<NegOp>(loc, t, g));
        }
        return success();
      })
      .Case([&](BceWithLogitsOp o) {
        if (act(o.getTarget())) {
          o.emitOpError() << "cannot differentiate with respect to the target";
          return failure();
        }
        accumulate(o.getInput(), create<BceWithLogitsGradOp>(
                                     loc, o.getInput().getType(), o.getInput(),
                                     o.getTarget(), dy));
        return success();
      })
      .Case<FillOp, GetParamOp>([&](Operation *) { return success(); })
      .Default([&](Operation *other) {
        other->emitOpError() << "has no differentiation rule (it may not "
                                "appear in a model function)";
        return failure();
      });
}

LogicalResult Differentiator::run(int64_t &numGradOps, int64_t &numGrads) {
  Block &body = fn.getBody().front();
  auto ret = cast<func::ReturnOp>(body.getTerminator());
  if (ret.getNumOperands() != 1)
    return ret.emitOpError()
           << "expected the model function to return one value (the loss), "
              "found "
           << ret.getNumOperands();
  Value loss = ret.getOperand(0);
  auto lossTy = dyn_cast<RankedTensorType>(loss.getType());
  if (!lossTy || lossTy.getRank() != 0 || !lossTy.getElementType().isF32())
    return ret.emitOpError() << "expected the loss to be a tensor<f32>, found "
                             << loss.getType();

  withLogSumExp(fn);
  withLabelCounts(fn);
  markActive();
  b.setInsertionPoint(ret);
  if (active.contains(loss)) {
    if (getLossScalePolicy(module)) {
      // Dynamic loss scaling: d(loss) = the scale, a 0-d argument the
      // runtime sets each step, so every gradient comes out scaled.
      unsigned n = fn.getNumArguments();
      fn.insertArgument(n, lossTy,
                        b.getDictionaryAttr(b.getNamedAttr(
                            kRoleAttrName, b.getStringAttr("loss_scale"))),
                        fn.getLoc());
      adjoint[loss] = fn.getArgument(n);
    } else {
      adjoint[loss] =
          create<FillOp>(ret.getLoc(), lossTy, b.getF64FloatAttr(1.0));
    }
  }

  SmallVector<Operation *> ops;
  for (Operation &op : body.without_terminator())
    ops.push_back(&op);
  for (Operation *op : llvm::reverse(ops)) {
    if (auto att = dyn_cast<AttentionOp>(op)) {
      if (adjoint.lookup(att.getLse()))
        return op->emitOpError() << "has no differentiation rule for its "
                                    "log-sum-exp result (read only by "
                                    "fsdp.attention_grad)";
    } else if (op->getNumResults() != 1) {
      return op->emitOpError() << "has no differentiation rule (it may not "
                                  "appear in a model function)";
    }
    Value dy = adjoint.lookup(op->getResult(0));
    if (!dy)
      continue;
    if (failed(differentiate(op, dy)))
      return failure();
  }

  // Sum the adjoints of every read of each parameter (tied weights), in
  // program order, and publish one gradient per trainable parameter.
  llvm::MapVector<StringAttr, Value> grads;
  for (Operation *op : ops)
    if (auto get = dyn_cast<GetParamOp>(op)) {
      Value g = adjoint.lookup(get.getResult());
      if (!g)
        continue;
      Value &slot = grads[get.getNameAttr().getAttr()];
      slot = slot ? create<AddOp>(get.getLoc(), g.getType(), slot, g) : g;
    }
  for (ParamOp param : module.getOps<ParamOp>()) {
    if (!param.isTrainable())
      continue;
    Value g = grads.lookup(param.getSymNameAttr());
    if (!g) {
      // The loss does not depend on it: its gradient is exactly zero, as
      // in PyTorch after zero_grad(set_to_none=False).
      param.emitWarning() << "the loss does not depend on this parameter; "
                             "its gradient is zero";
      g = create<FillOp>(param.getLoc(), param.getTensorType(),
                         b.getF64FloatAttr(0.0));
    }
    b.create<SetGradOp>(param.getLoc(), FlatSymbolRefAttr::get(param.getSymNameAttr()), g);
    ++numGrads;
  }
  numGradOps = emitted;
  return success();
}

struct AutodiffPass : mlir::fsdp::impl::FsdpAutodiffBase<AutodiffPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (failed(checkTensorSizes(module)))
      return signalPassFailure();
    func::FuncOp model;
    for (auto fn : module.getOps<func::FuncOp>()) {
      bool match = modelName.empty() ? fn->hasAttr(kModelAttrName)
                                     : fn.getSymName() == modelName;
      if (!match)
        continue;
      if (model) {
        mlir::emitError(fn.getLoc()) << "more than one model function; pick one with "
                          "fsdp-autodiff{model=NAME}";
        return signalPassFailure();
      }
      model = fn;
    }
    if (!model) {
      mlir::emitError(module.getLoc()) << "no model function: mark one func.func with the "
                            "`fsdp.model` attribute";
      return signalPassFailure();
    }
    if (module.lookupSymbol(kTrainStepName)) {
      mlir::emitError(module.getLoc()) << "@" << kTrainStepName
                         << " already exists: fsdp-autodiff ran twice?";
      return signalPassFailure();
    }
    if (!model.getBody().hasOneBlock()) {
      mlir::emitError(model.getLoc()) << "expected a model function with a single block";
      return signalPassFailure();
    }

    OpBuilder b(model);
    b.setInsertionPointAfter(model);
    auto step = cast<func::FuncOp>(b.clone(*model));
    step.setSymName(kTrainStepName);
    step->removeAttr(kModelAttrName);
    step->setAttr("fsdp.train_step", b.getUnitAttr());

    int64_t ops = 0, grads = 0;
    if (failed(Differentiator(step, module).run(ops, grads))) {
      step.erase();
      return signalPassFailure();
    }
    numGradOps = ops;
    numGrads = grads;
  }
};

} // namespace
