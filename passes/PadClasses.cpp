//===- PadClasses.cpp - an LM head of aligned width -----------------------===//
//
// fsdp-pad-classes: widens the class dimension of a classifier head that
// feeds cross-entropy to a multiple of `multiple` columns, as llm.c pads
// GPT-2's 50257 to 50304 and torch.compile pads the logits' row stride.
// A [tokens, 50257] bf16 matrix has rows of 100514 bytes, not a multiple
// of 16: cuBLAS(Lt) then runs the head's three GEMMs (logits, the input's
// gradient, the weight's gradient), the largest of the step, on
// unvectorized kernels, and the cross-entropy kernels read unaligned rows.
//
// The rewrite, on the model function before fsdp-autodiff:
//
//   %w  = get_param [V, C]                 %z  = fill 0 [Vp - V, C]
//   %l  = matmul %h, %w transpose_rhs  ->  %wp = concat %w, %z dim = 0
//   %ce = cross_entropy %l, %y             %l  = matmul %h, %wp transpose_rhs   [N, Vp]
//                                          %ce = cross_entropy %l, %y {classes = V}
//
// (an untransposed [C, V] weight is padded along dim 1). The padding
// columns of the logits are exactly 0 (h . 0), cross-entropy leaves them
// out of the softmax and gives them a zero gradient, so the loss, the
// input's gradient and the weight's gradient (concat's VJP: the slice of
// the padded weight gradient's first V rows) are those of the unpadded
// head: only the GEMMs' blocking changes, i.e. their summation order. The
// parameter keeps its shape (checkpoints, the PyTorch oracle, sharding
// see [V, C]); the cost is one padded copy of the weight per step.
//
// A head is padded when its matmul's only user is the cross-entropy
// (through reshapes of the leading dimensions) and padding adds at most
// V/16 columns (a 32-class head is not doubled); `multiple=0` disables.
// Run after fsdp-mixed-precision, so the zeros and the copy are made in
// the compute dtype.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPPADCLASSES
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

RankedTensorType withDim(RankedTensorType t, int64_t dim, int64_t size) {
  SmallVector<int64_t> shape(t.getShape());
  shape[dim] = size;
  return RankedTensorType::get(shape, t.getElementType());
}

struct PadClassesPass : mlir::fsdp::impl::FsdpPadClassesBase<PadClassesPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (multiple < 0) {
      mlir::emitError(module.getLoc())
          << "fsdp-pad-classes: multiple=" << (int64_t)multiple
          << " must be >= 0 (0 disables)";
      return signalPassFailure();
    }
    if (multiple <= 1)
      return;
    if (module.lookupSymbol(kTrainStepName)) {
      mlir::emitError(module.getLoc())
          << "fsdp-pad-classes runs before fsdp-autodiff; @" << kTrainStepName
          << " already exists";
      return signalPassFailure();
    }
    SmallVector<CrossEntropyOp> losses;
    for (auto fn : module.getOps<func::FuncOp>())
      if (fn->hasAttr(kModelAttrName))
        fn.walk([&](CrossEntropyOp ce) { losses.push_back(ce); });
    for (CrossEntropyOp ce : losses)
      pad(ce);
  }

  /// Pads the head feeding `ce`, if it is one this pass handles.
  void pad(CrossEntropyOp ce) {
    if (ce.getClasses())
      return; // already padded (or the model says which columns count)
    // logits <- reshape* <- matmul, every link used once.
    SmallVector<ReshapeOp> chain;
    Value v = ce.getLogits();
    int64_t classes = cast<RankedTensorType>(v.getType()).getShape().back();
    while (auto r = v.getDefiningOp<ReshapeOp>()) {
      auto in = cast<RankedTensorType>(r.getInput().getType());
      if (!v.hasOneUse() || in.getRank() < 1 || in.getShape().back() != classes)
        return;
      chain.push_back(r);
      v = r.getInput();
    }
    auto mm = v.getDefiningOp<MatmulOp>();
    if (!mm || !v.hasOneUse() || mm.getTransposeLhs())
      return;
    auto w = cast<RankedTensorType>(mm.getRhs().getType());
    if (w.getRank() != 2)
      return;
    int64_t classDim = mm.getTransposeRhs() ? 0 : 1;
    if (w.getShape()[classDim] != classes)
      return;
    int64_t padded = (classes + multiple - 1) / multiple * multiple;
    if (padded == classes || (padded - classes) * 16 > classes)
      return;

    OpBuilder b(mm);
    Location loc = mm.getLoc();
    auto zeros = b.create<FillOp>(loc, withDim(w, classDim, padded - classes),
                                  b.getF64FloatAttr(0.0));
    auto wp = b.create<ConcatOp>(loc, withDim(w, classDim, padded),
                                 ValueRange{mm.getRhs(), zeros.getResult()},
                                 b.getI64IntegerAttr(classDim));
    mm.getRhsMutable().assign(wp.getResult());
    auto widen = [&](Value x) {
      auto t = cast<RankedTensorType>(x.getType());
      x.setType(withDim(t, t.getRank() - 1, padded));
    };
    widen(mm.getResult());
    for (auto it = chain.rbegin(); it != chain.rend(); ++it)
      widen(it->getResult());
    ce.setClassesAttr(b.getI64IntegerAttr(classes));
    ++numPadded;
  }
};

} // namespace
