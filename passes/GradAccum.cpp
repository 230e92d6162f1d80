//===- GradAccum.cpp - K micro-batches per optimizer step -----------------===//
//
// fsdp-grad-accum: turns the differentiated step for a micro-batch of B rows
// into a step over K*B rows that runs K forward/backward copies in sequence
// and accumulates their gradients.
//
// Algorithm. (1) Every argument of @train_step gets K times its rows
// (dimension 0). (2) The step's ops (forward and backward, set_grad aside)
// are micro-batch 0: their uses of argument a now read
// fsdp.microbatch(a, 0). (3) For k = 1..K-1 the same ops are cloned before
// the return, reading fsdp.microbatch(a, k). (4) Each parameter's gradient
// and the loss are accumulated right after each micro-batch computes them
// (acc = acc + g_k, marked fsdp.accum so that the memory planner adds in
// place and the micro-batch gradient dies at once), and scaled by 1/K
// right after the last one: the mean over K*B rows, as one batch of K*B
// rows gives when the model's loss is a mean over its rows. A
// cross-entropy's kept-label count (ignore_index) is counted once over the
// whole step and divided by K, so the mean stays the step's kept mean.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPGRADACCUM
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct GradAccumPass : mlir::fsdp::impl::FsdpGradAccumBase<GradAccumPass> {
  using Base::Base;

  void runOnOperation() override;
};

void GradAccumPass::runOnOperation() {
  ModuleOp module = getOperation();
  if (microBatches < 1) {
    mlir::emitError(module.getLoc())
        << "grad-accum (micro-batches) must be >= 1, found "
        << microBatches.getValue();
    return signalPassFailure();
  }
  if (reduce != "step" && reduce != "microbatch") {
    mlir::emitError(module.getLoc())
        << "unknown accum-reduce '" << reduce
        << "': expected step (reduce once per step) or microbatch (reduce "
           "each micro-batch)";
    return signalPassFailure();
  }
  auto step = getTrainStep(module, "fsdp-autodiff");
  if (!step)
    return signalPassFailure();
  const int64_t k = microBatches;
  if (k == 1)
    return; // nothing to accumulate: the step is unchanged
  if (step->hasAttr(kGradAccumAttrName)) {
    mlir::emitError(step.getLoc()) << "@" << kTrainStepName
                                   << " already accumulates: fsdp-grad-accum "
                                      "ran twice?";
    return signalPassFailure();
  }
  Block &body = step.getBody().front();
  auto ret = cast<func::ReturnOp>(body.getTerminator());
  SmallVector<SetGradOp> sets;
  SmallVector<Operation *> ops;
  for (Operation &op : body.without_terminator()) {
    if (auto s = dyn_cast<SetGradOp>(op)) {
      sets.push_back(s);
      continue;
    }
    if (isa<SetParamOp, SetStateOp, SetUnitOp, UnitOp, GetUnitOp>(op)) {
      op.emitOpError() << "fsdp-grad-accum runs between fsdp-autodiff and "
                          "fsdp-insert-optimizer; found an optimizer update";
      return signalPassFailure();
    }
    ops.push_back(&op);
  }
  if (sets.empty()) {
    mlir::emitError(step.getLoc()) << "no fsdp.set_grad to accumulate: "
                                      "nothing is trainable";
    return signalPassFailure();
  }
  if (ret.getNumOperands() != 1) {
    ret.emitOpError() << "expected @" << kTrainStepName
                      << " to return the loss only";
    return signalPassFailure();
  }

  // --- 1. K*B rows per argument. ------------------------------------------
  OpBuilder b(&getContext());
  SmallVector<RankedTensorType> microTypes;
  // The loss scale (a 0-d argument) is shared by every micro-batch.
  BlockArgument lossScale = findRoleArgument(step, "loss_scale");
  for (BlockArgument arg : body.getArguments()) {
    if (arg == lossScale) {
      microTypes.push_back(RankedTensorType());
      continue;
    }
    auto t = dyn_cast<RankedTensorType>(arg.getType());
    if (!t || t.getRank() < 1) {
      mlir::emitError(step.getLoc())
          << "argument #" << arg.getArgNumber() << " of @" << kTrainStepName
          << " has no batch dimension to split into micro-batches: "
          << arg.getType();
      return signalPassFailure();
    }
    int64_t rows;
    if (__builtin_mul_overflow(t.getShape()[0], k, &rows)) {
      mlir::emitError(step.getLoc()) << "argument #" << arg.getArgNumber()
                                     << ": " << k << " micro-batches of "
                                     << t.getShape()[0] << " rows overflow";
      return signalPassFailure();
    }
    SmallVector<int64_t> shape(t.getShape());
    shape[0] = rows;
    microTypes.push_back(t);
    arg.setType(RankedTensorType::get(shape, t.getElementType()));
  }
  step.setType(FunctionType::get(&getContext(), body.getArgumentTypes(),
                                 step.getResultTypes()));
  if (failed(checkTensorSizes(module)))
    return signalPassFailure();

  auto microbatches = [&](int64_t index) {
    SmallVector<Value> views;
    for (auto [arg, t] : llvm::zip(body.getArguments(), microTypes))
      views.push_back(t ? b.create<MicrobatchOp>(arg.getLoc(), t, arg,
                                                 b.getI64IntegerAttr(index))
                              .getResult()
                        : Value(arg));
    return views;
  };
  auto accumulate = [&](Value acc, Value term) {
    // Right after the later of the two definitions (the term's, normally).
    Operation *after = term.getDefiningOp();
    if (Operation *accDef = acc.getDefiningOp())
      if (!after || after->isBeforeInBlock(accDef))
        after = accDef;
    if (after)
      b.setInsertionPointAfter(after);
    else
      b.setInsertionPointToStart(&body);
    auto add = b.create<AddOp>(term.getLoc(), acc.getType(), acc, term);
    add->setAttr(kAccumAttrName, b.getUnitAttr());
    return add.getResult();
  };

  // --- 2. Micro-batch 0: the step's own ops. ------------------------------
  // Dropout keys its mask by the element's global index, which now counts
  // the micro-batches (DropoutOp): this is micro-batch 0 of K.
  for (Operation *op : ops)
    if (auto d = dyn_cast<DropoutOp>(op)) {
      d.setMicro(0);
      d.setMicroCount(k);
    }
  b.setInsertionPointToStart(&body);
  SmallVector<Value> first = microbatches(0);
  for (auto [arg, view] : llvm::zip(body.getArguments(), first))
    if (view != arg)
      arg.replaceAllUsesExcept(view, view.getDefiningOp());
  // A cross-entropy's kept-label count (ignore_index) is the whole step's,
  // over K: counted once on the argument, shared by every micro-batch (so
  // each one's loss is its kept sum over the step's mean count, and their
  // mean is the step's kept mean).
  for (Operation *op : ops) {
    auto count = dyn_cast<CountLabelsOp>(op);
    if (!count)
      continue;
    Value v = count.getLabels();
    while (auto r = v.getDefiningOp<ReshapeOp>())
      v = r.getInput();
    auto mb = v.getDefiningOp<MicrobatchOp>();
    if (!mb || !isa<BlockArgument>(mb.getInput())) {
      count.emitOpError() << "counts labels that are not an argument of @" << kTrainStepName
                          << " (or a reshape of one): fsdp-grad-accum cannot count them over "
                             "the step's micro-batches";
      return signalPassFailure();
    }
    count.getLabelsMutable().assign(mb.getInput());
    count.setDivisorAttr(b.getI64IntegerAttr(k));
  }
  llvm::erase_if(ops, [](Operation *op) { return isa<CountLabelsOp>(op); });
  SmallVector<Value> grads;
  for (SetGradOp s : sets)
    grads.push_back(s.getValue());
  Value loss = ret.getOperand(0);

  // --- 3. Micro-batches 1..K-1: clones, accumulated as they complete. -----
  for (int64_t i = 1; i < k; ++i) {
    b.setInsertionPoint(ret);
    IRMapping map;
    for (auto [view, next] : llvm::zip(first, microbatches(i)))
      map.map(view, next);
    for (Operation *op : ops)
      if (auto d = dyn_cast<DropoutOp>(b.clone(*op, map)))
        d.setMicro(i); // a mask of its own: these are other rows
    ++numCopies;
    for (auto [acc, s] : llvm::zip(grads, sets))
      acc = accumulate(acc, map.lookupOrDefault(s.getValue()));
    loss = accumulate(loss, map.lookupOrDefault(ret.getOperand(0)));
  }

  // --- 4. The mean: 1/K right after the last term. -------------------------
  auto mean = [&](Value acc) {
    b.setInsertionPointAfterValue(acc);
    auto s = b.create<ScaleOp>(acc.getLoc(), acc.getType(), acc,
                               b.getF64FloatAttr(1.0 / k));
    s->setAttr(kAccumAttrName, b.getUnitAttr());
    return s.getResult();
  };
  for (auto [acc, s] : llvm::zip(grads, sets)) {
    s.getValueMutable().assign(mean(acc));
    // set_grad stays the step's last word on the parameter.
    s->moveBefore(ret);
  }
  ret.setOperand(0, mean(loss));
  step->setAttr(kGradAccumAttrName,
                b.getDictionaryAttr(
                    {b.getNamedAttr("micro_batches", b.getI64IntegerAttr(k)),
                     b.getNamedAttr("reduce", b.getStringAttr(reduce))}));
}

} // namespace
