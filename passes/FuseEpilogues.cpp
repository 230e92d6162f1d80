//===- FuseEpilogues.cpp - fewer, fused kernels ---------------------------===//
//
// fsdp-fuse-epilogues: folds the elementwise ops that follow a rank-2
// matmul into the matmul, as cuBLASLt's epilogues (and llm.c's fused
// GELU GEMMs) do: the product is never written to memory and read back,
// one kernel runs instead of two or three, and in bf16 the result is
// rounded once instead of after every op. The same for the residual
// stream's adds around the layer norms and for the q/k/v slice gradients.
//
// Algorithm (one walk per pattern over the ops of every function).
// - Forward: `%y = bias_add(%m, %b)` where `%m = matmul(a, w)` is rank 2
//   and `%y` is its only reader becomes `%y = matmul_bias(a, w, %b)`. If
//   `%y`'s first reader is a tanh-form `gelu` (not a recomputed clone of
//   one), that gelu joins the kernel:
//   `%g, %y = matmul_bias(a, w, %b) gelu` keeps the pre-activation as a
//   second result only when something else reads it (the backward pass's
//   gelu_grad); otherwise the kernel returns %g alone.
// - Backward: `%dp = gelu_grad(%pre, %d)` (tanh form) where `%d =
//   matmul(a, b)` is rank 2 and `%dp` its only reader becomes
//   `%dp = matmul_gelu_grad(a, b, %pre)`; a `sum_to` of `%dp` to its last
//   dimension (the bias gradient fsdp-autodiff writes) becomes the fused
//   op's second result. A linear layer without GELU: `%db = sum_to %dy`
//   and its weight gradient `%dw = matmul %dy, %x transpose_lhs` become
//   `%dw, %db = matmul_bias_grad %dy, %x transpose_lhs` (cuBLASLt's BGRADB
//   epilogue: dy is read once).
// - Residual stream: `%s = add(a, b)` (one shape) read first by
//   `layer_norm(%s)` becomes `%s, %y = residual_layer_norm(a, b, ...)`; an
//   add of layer_norm_grad's input gradient (read by nothing else) and
//   another gradient (the residual's: fsdp-autodiff's adjoint sum)
//   becomes `layer_norm_grad_acc(..., acc)` (llm.c's fused residual
//   forward and its layernorm backward accumulating into dinp).
// - Slice gradients: a tree of adds summing slice_grads that tile one
//   dimension becomes one concat of the pieces (no zero-filled copies).
// - Packed attention: an `attention` whose q, k, v are the slices [0, C),
//   [C, C + KC), [C + KC, C + 2 KC) of the last dimension of one rank-3
//   tensor %x (GPT-2's fused q/k/v projection) becomes
//   `attention_qkv %x`: the kernels read the three column ranges in place
//   (row stride C + 2 KC) instead of from copies. Its `attention_grad`
//   on the same slices, whose dq, dk, dv are read only by one concat of
//   them in that order along the last dimension (the slice-gradient sum
//   above), becomes `attention_qkv_grad %x, ...`, which writes the
//   concat's result in place. Slices left unread go. Same arithmetic on
//   the same values: the same bits.
// - Classifier: a `cross_entropy` and its `cross_entropy_grad` on the same
//   logits, when nothing reads the loss before the gradient, become one
//   `cross_entropy_fused` where the gradient was (llm.c's fused
//   classifier): one read of the [tokens, vocabulary] logits instead of
//   two. The kernels compute the loss and the gradient from the same row
//   statistics the two ops computed: the same bits.
// - Optimizer: `%c = mul %g, %coef` (%coef from clip_coef or grad_coef:
//   global-norm clipping, loss-scale unscaling) read only as an update's
//   gradient becomes that update's `grad_scale %coef` operand (PyTorch's
//   fused AdamW grad_scale, llm.c's AdamW grad_scale): the clipped
//   gradient is never written and read back (8 bytes an element of every
//   gradient a step), one kernel a unit less. The update multiplies
//   first, as the mul did: the same bits.
// - Widened products: a matmul (or matmul_bias_grad, matmul_gelu_grad's
//   bias gradient, a layer norm gradient's d_gamma and d_beta, a sum_to,
//   an embedding gradient) on bf16 / f16 whose result is read only
//   by a cast to f32 (mixed precision's parameter gradients, cast for the
//   f32 reduction) returns f32 itself: the f32 sum is written unrounded
//   (cuBLASLt's D type), one kernel and 6 bytes an element less. Not the
//   same bits: one bf16 rounding less. An f32 value cast to bf16, only
//   sliced / reshaped and cast back to f32 is sliced / reshaped in f32.
// A fused matmul is placed where the last op it replaces was (bias_add,
// gelu_grad): every operand is defined there. The kernels compute exactly
// the ops they replace, in the same order (runtime/cpu/Dispatch.cpp), so
// f32 plans give bitwise the losses of unfused ones (the widened products
// occur only in mixed-precision plans).
//
// Where it runs: after fsdp-schedule (or inside fsdp-search-schedule's
// candidates), just before the memory plan, so no other pass needs to
// know the fused ops. After fsdp-recompute, so its clones are known as
// such: a GELU recomputed in the backward pass stays there, reading the
// pre-activation the forward kernel keeps, and is never moved up into a
// forward kernel (which would keep its output alive again).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/TypeSwitch.h"

#include <functional>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPFUSEEPILOGUES
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

/// The rank-2 matmul defining `v` when `v` has no other reader.
MatmulOp soleRank2Matmul(Value v) {
  auto mm = v.getDefiningOp<MatmulOp>();
  if (!mm || !v.hasOneUse() || cast<RankedTensorType>(v.getType()).getRank() != 2)
    return nullptr;
  return mm;
}

/// Copies the attributes the lowering ignores but later passes read
/// (fsdp.recompute) from `from` to `to`.
void keepMarks(Operation *from, Operation *to) {
  if (auto a = from->getAttr(kRecomputeAttrName))
    to->setAttr(kRecomputeAttrName, a);
}

struct FuseEpiloguesPass : mlir::fsdp::impl::FsdpFuseEpiloguesBase<FuseEpiloguesPass> {
  using Base::Base;

  void runOnOperation() override {
    SmallVector<BiasAddOp> biases;
    SmallVector<GeluGradOp> geluGrads;
    SmallVector<LayerNormOp> norms;
    SmallVector<LayerNormGradOp> normGrads;
    SmallVector<RmsNormOp> rmsNorms;
    SmallVector<RmsNormGradOp> rmsNormGrads;
    getOperation().walk([&](Operation *op) {
      if (auto b = dyn_cast<BiasAddOp>(op))
        biases.push_back(b);
      else if (auto g = dyn_cast<GeluGradOp>(op))
        geluGrads.push_back(g);
      else if (auto n = dyn_cast<LayerNormOp>(op))
        norms.push_back(n);
      else if (auto n = dyn_cast<LayerNormGradOp>(op))
        normGrads.push_back(n);
      else if (auto n = dyn_cast<RmsNormOp>(op))
        rmsNorms.push_back(n);
      else if (auto n = dyn_cast<RmsNormGradOp>(op))
        rmsNormGrads.push_back(n);
    });
    for (BiasAddOp b : biases)
      fuseForward(b);
    for (GeluGradOp g : geluGrads)
      fuseBackward(g);
    // After the GELU gradients: the bias gradients they took are gone.
    SmallVector<SumToOp> biasGrads;
    getOperation().walk([&](SumToOp s) { biasGrads.push_back(s); });
    for (SumToOp s : biasGrads)
      fuseBiasGrad(s);
    // SwiGLU: the backward pattern first (it frees silu(g) of its backward
    // reader), then the forward one.
    SmallVector<SiluGradOp> siluGrads;
    getOperation().walk([&](SiluGradOp g) { siluGrads.push_back(g); });
    for (SiluGradOp g : siluGrads)
      fuseSwigluGrad(g);
    SmallVector<SiluOp> silus;
    getOperation().walk([&](SiluOp s) { silus.push_back(s); });
    for (SiluOp s : silus)
      fuseSwiglu(s);
    for (LayerNormOp n : norms)
      fuseResidualNorm(n);
    for (LayerNormGradOp n : normGrads)
      fuseNormGradAcc(n);
    for (RmsNormOp n : rmsNorms)
      fuseResidualNorm(n);
    for (RmsNormGradOp n : rmsNormGrads)
      fuseNormGradAcc(n);
    // Outermost sums first: an inner add of a tree is erased with it.
    SmallVector<AddOp> adds;
    getOperation().walk([&](AddOp a) { adds.push_back(a); });
    DenseSet<Operation *> erased;
    for (AddOp a : llvm::reverse(adds))
      if (!erased.contains(a))
        fuseSliceGradSum(a, erased);
    // After the slice-gradient sums: their concats are what the packed
    // gradient replaces.
    SmallVector<AttentionOp> attentions;
    SmallVector<AttentionGradOp> attentionGrads;
    getOperation().walk([&](Operation *op) {
      if (auto a = dyn_cast<AttentionOp>(op))
        attentions.push_back(a);
      else if (auto g = dyn_cast<AttentionGradOp>(op))
        attentionGrads.push_back(g);
    });
    SmallVector<CrossEntropyGradOp> ceGrads;
    getOperation().walk([&](CrossEntropyGradOp g) { ceGrads.push_back(g); });
    for (CrossEntropyGradOp g : ceGrads)
      fuseClassifier(g);
    SmallVector<SliceOp> slices;
    for (AttentionOp a : attentions)
      fusePackedAttention(a, slices);
    for (AttentionGradOp g : attentionGrads)
      fusePackedAttentionGrad(g, slices);
    for (SliceOp s : slices) // each once (packedSource)
      if (s->use_empty())
        s.erase();
    SmallVector<MulOp> muls;
    getOperation().walk([&](MulOp m) { muls.push_back(m); });
    for (MulOp m : muls)
      fuseGradScale(m);
    // Last: the weight-gradient matmuls are final now (matmul_bias_grad
    // took its sum_to above).
    SmallVector<CastOp> casts;
    getOperation().walk([&](CastOp c) { casts.push_back(c); });
    DenseSet<Operation *> gone;
    for (CastOp c : casts)
      if (!gone.contains(c) && !foldRoundTrip(c, gone))
        fuseWidenedProduct(c, gone);
    // After that (a term's product is f32 now): products only added to
    // fsdp-chunk-loss's running sums, or to fsdp-grad-accum's sums over
    // the micro-batches (Megatron's gradient-accumulation fusion: each
    // micro-batch's weight-gradient GEMM adds into the accumulated
    // gradient), accumulate into them.
    SmallVector<AddOp> sums;
    getOperation().walk([&](AddOp a) {
      if (a->hasAttr(kChunkAccumAttrName) || (accumulate && a->hasAttr(kAccumAttrName)))
        sums.push_back(a);
    });
    DenseSet<Operation *> summed;
    for (AddOp a : sums)
      if (!summed.contains(a))
        fuseAccumulate(a, summed);
    // Last (the round trips above leave f32 slices): leading rows as views.
    SmallVector<SliceOp> rowSlices;
    getOperation().walk([&](SliceOp s) { rowSlices.push_back(s); });
    for (SliceOp s : rowSlices)
      sliceAsView(s);
  }

  /// `slice %x dim = d offset = o` where every dimension before d has size
  /// 1 (d = 0 usually), so the result is contiguous rows of %x: a view of
  /// %x flattened (`view (reshape %x) offset = o * row`), which the memory
  /// plan aliases onto %x, no copy. Only where the result is at least half
  /// of %x (fsdp-pad-classes's slice of the padded head's gradient: 50257
  /// of 50304 rows): the view keeps %x alive as long as itself, which costs
  /// no more than the copy it replaces. And only where the slice is %x's
  /// one reader, so nothing can write %x in place while the view is read.
  void sliceAsView(SliceOp s) {
    auto in = cast<RankedTensorType>(s.getInput().getType());
    auto out = cast<RankedTensorType>(s.getType());
    int64_t d = s.getDim();
    for (int64_t i = 0; i < d; ++i)
      if (in.getShape()[i] != 1)
        return;
    if (!in.hasStaticShape() || 2 * out.getNumElements() < in.getNumElements() ||
        !s.getInput().hasOneUse())
      return;
    int64_t row = 1;
    for (int64_t i = d + 1; i < in.getRank(); ++i)
      row *= in.getShape()[i];
    OpBuilder b(s);
    auto flatType = RankedTensorType::get({in.getNumElements()}, in.getElementType());
    Value flat = b.create<ReshapeOp>(s.getLoc(), flatType, s.getInput());
    auto view =
        b.create<ViewOp>(s.getLoc(), out, flat, b.getI64IntegerAttr((int64_t)s.getOffset() * row));
    keepMarks(s, view);
    s.getResult().replaceAllUsesWith(view.getResult());
    s.erase();
    ++numFused;
  }

  /// `%s = add %acc, %p {fsdp.chunk_accum}` (or `{fsdp.accum}`) where `%p`
  /// is a rank-2 matmul's product of the sum's type read by nothing else:
  /// `%s = matmul ... acc %acc` (a GEMM with beta = 1), still marked, which
  /// the memory plan runs in place over %acc: no buffer for the product,
  /// one pass over the sum instead of a write, two reads and a write.
  ///
  /// A matmul_bias_grad both of whose results are only so added (the same
  /// mark): `%sw, %sb = matmul_bias_grad ... acc %aw, %ab` where it was,
  /// both accumulators defined before it; `erased` collects the adds.
  void fuseAccumulate(AddOp add, DenseSet<Operation *> &erased) {
    if (auto bg = add.getRhs().getDefiningOp<MatmulBiasGradOp>())
      return fuseBiasGradAccumulate(bg, erased);
    auto mm = add.getRhs().getDefiningOp<MatmulOp>();
    Type t = add.getResult().getType();
    if (!mm || mm.getAcc() || !add.getRhs().hasOneUse() || mm->getBlock() != add->getBlock() ||
        cast<RankedTensorType>(mm.getLhs().getType()).getRank() != 2 || mm.getType() != t ||
        add.getLhs().getType() != t)
      return;
    OpBuilder b(add);
    auto fused = b.create<MatmulOp>(add.getLoc(), t, mm.getLhs(), mm.getRhs(), mm.getTransposeLhs(),
                                    mm.getTransposeRhs(), add.getLhs());
    fused->setAttr(add->hasAttr(kAccumAttrName) ? kAccumAttrName : kChunkAccumAttrName,
                   b.getUnitAttr());
    keepMarks(mm, fused);
    add.getResult().replaceAllUsesWith(fused.getResult());
    add.erase();
    mm.erase();
    ++numFused;
  }

  void fuseBiasGradAccumulate(MatmulBiasGradOp bg, DenseSet<Operation *> &erased) {
    if (!bg.getAcc().empty())
      return;
    StringAttr mark;
    AddOp adds[2];
    for (unsigned i = 0; i < 2; ++i) {
      Value r = bg->getResult(i);
      auto add = r.hasOneUse() ? dyn_cast<AddOp>(*r.getUsers().begin()) : AddOp();
      if (!add || add.getRhs() != r || add.getLhs() == r || add->getBlock() != bg->getBlock() ||
          add.getType() != r.getType() || add.getLhs().getType() != r.getType())
        return;
      StringAttr m =
          StringAttr::get(bg.getContext(), add->hasAttr(kAccumAttrName)        ? kAccumAttrName
                                           : add->hasAttr(kChunkAccumAttrName) ? kChunkAccumAttrName
                                                                               : "");
      if (m.getValue().empty() || (mark && m != mark))
        return;
      Operation *d = add.getLhs().getDefiningOp();
      if (d && (d->getBlock() != bg->getBlock() || !d->isBeforeInBlock(bg)))
        return; // an accumulator defined after the gradients (or elsewhere)
      mark = m;
      adds[i] = add;
    }
    OpBuilder b(bg);
    auto fused = b.create<MatmulBiasGradOp>(
        bg.getLoc(), bg->getResultTypes(), bg.getLhs(), bg.getRhs(), bg.getTransposeLhsAttr(),
        bg.getTransposeRhsAttr(), ValueRange{adds[0].getLhs(), adds[1].getLhs()});
    fused->setAttr(mark, b.getUnitAttr());
    keepMarks(bg, fused);
    for (unsigned i = 0; i < 2; ++i) {
      adds[i].getResult().replaceAllUsesWith(fused->getResult(i));
      erased.insert(adds[i]);
      adds[i].erase();
    }
    bg.erase();
    ++numFused;
  }

  /// `%w = cast %p : bf16 -> f32` (or f16) where `%p` is the product of a
  /// matmul (or both results of a matmul_bias_grad, matmul_gelu_grad's
  /// bias gradient, or the d_gamma and d_beta of a layer norm gradient,
  /// each read only by such a cast; or a sum_to or embedding_grad, sums in
  /// f32 too: GPT-2's position and token embedding gradients) and
  /// read by nothing else: the op returns f32 there and the casts go. The
  /// kernels sum in f32 either way; the sum is no longer rounded to bf16
  /// and widened back, and never written and read in between (a
  /// mixed-precision plan's parameter gradients, cast for the f32
  /// reduction and update: 6 bytes an element of every gradient a step, a
  /// kernel each). Where the cast's result was, cast(round(x)) becomes x:
  /// the values differ by that rounding, the plan is more exact, not the
  /// same bits (PyTorch's autocast and FSDP2 round the gradient to bf16
  /// first). The op keeps its place; only its result types change.
  void fuseWidenedProduct(CastOp c, DenseSet<Operation *> &erased) {
    Operation *op = c.getInput().getDefiningOp();
    SmallVector<unsigned, 2> results;
    if (isa_and_nonnull<MatmulOp, SumToOp, EmbeddingGradOp>(op))
      results = {0};
    else if (isa_and_nonnull<MatmulBiasGradOp>(op))
      results = {0, 1}; // BGRADB's bias gradient has the product's type
    else if (isa_and_nonnull<LayerNormGradOp, LayerNormGradAccOp>(op))
      results = {1, 2}; // d_gamma and d_beta: one type
    else if (isa_and_nonnull<MatmulGeluGradOp>(op) && op->getNumResults() == 2 &&
             c.getInput() == op->getResult(1))
      results = {1}; // the bias gradient alone (the input gradient dh stays narrow)
    else
      return;
    SmallVector<CastOp, 2> casts;
    for (unsigned i : results) {
      Value r = op->getResult(i);
      auto user = r.hasOneUse() ? dyn_cast<CastOp>(*r.getUsers().begin()) : CastOp();
      if (!user)
        return;
      Type from = cast<RankedTensorType>(r.getType()).getElementType(),
           to = cast<RankedTensorType>(user.getType()).getElementType();
      if (!(from.isBF16() || from.isF16()) || !to.isF32())
        return;
      casts.push_back(user);
    }
    for (auto [i, cst] : llvm::zip(results, casts)) {
      Value r = op->getResult(i);
      r.setType(cst.getType());
      cst.getResult().replaceAllUsesWith(r);
      erased.insert(cst);
      cst.erase();
    }
    ++numFused;
  }

  /// `%w = cast %n : bf16 -> f32` (or f16) where %n is an f32 value %x
  /// cast to that type and then only sliced or reshaped (each step read by
  /// the next alone): the slices and reshapes on %x itself, in f32, and
  /// both casts go. fsdp-chunk-loss casts its f32 sum of the head's weight
  /// gradient back to the gradient's bf16, fsdp-pad-classes slices the
  /// padded classes off, and mixed precision casts the parameter gradient
  /// to f32: for GPT-2 a [50304, 768] round trip through bf16 (three
  /// kernels over 38.6M elements, one rounding) becomes one f32 slice.
  /// Not the same bits: the rounding is gone.
  bool foldRoundTrip(CastOp c, DenseSet<Operation *> &erased) {
    auto elem = [](Value v) { return cast<RankedTensorType>(v.getType()).getElementType(); };
    Type narrow = elem(c.getInput());
    if (!(narrow.isBF16() || narrow.isF16()) || !elem(c.getResult()).isF32())
      return false;
    SmallVector<Operation *> moves; // from c's operand back
    Value v = c.getInput();
    while (v.hasOneUse() && isa_and_nonnull<SliceOp, ReshapeOp>(v.getDefiningOp())) {
      moves.push_back(v.getDefiningOp());
      v = v.getDefiningOp()->getOperand(0);
    }
    auto first = v.getDefiningOp<CastOp>();
    if (!first || !v.hasOneUse() || !elem(first.getInput()).isF32())
      return false;
    OpBuilder b(c);
    Value x = first.getInput();
    for (Operation *op : llvm::reverse(moves)) {
      auto t = cast<RankedTensorType>(op->getResult(0).getType()).clone(elem(x));
      Operation *wide = isa<SliceOp>(op)
                            ? b.create<SliceOp>(op->getLoc(), t, x, cast<SliceOp>(op).getDimAttr(),
                                                cast<SliceOp>(op).getOffsetAttr())
                            : b.create<ReshapeOp>(op->getLoc(), t, x).getOperation();
      keepMarks(op, wide);
      x = wide->getResult(0);
    }
    c.getResult().replaceAllUsesWith(x);
    erased.insert(c);
    c.erase();
    for (Operation *op : moves) {
      erased.insert(op);
      op->erase();
    }
    erased.insert(first);
    first.erase();
    ++numFused;
    return true;
  }

  /// `%c = mul %g, %coef` (%coef a clip_coef / grad_coef scalar, %g of
  /// the product's type) whose readers are all updates' gradient operands
  /// (updates without grad_scale; LAMB's norms and update both read it):
  /// each reads %g with `grad_scale %coef`. The updates are where they
  /// were; %g and %coef are defined before the mul, so before them.
  void fuseGradScale(MulOp mul) {
    Operation *coef = mul.getRhs().getDefiningOp();
    if (!coef || !isa<ClipCoefOp, GradCoefOp>(coef) ||
        mul.getLhs().getType() != mul.getResult().getType() || mul->use_empty())
      return;
    auto foldable = [](OpOperand &use) {
      Operation *u = use.getOwner();
      auto free = [](auto op) { return !op.getGradScale(); };
      if (use.getOperandNumber() != 1)
        return false;
      return TypeSwitch<Operation *, bool>(u)
          .Case<AdamwUpdateOp, SgdMomentumUpdateOp, SgdUpdateOp, LambNormsOp, LambUpdateOp>(
              [&](auto op) { return free(op); })
          .Default([](Operation *) { return false; });
    };
    if (!llvm::all_of(mul->getUses(), foldable))
      return;
    for (OpOperand &use : llvm::make_early_inc_range(mul->getUses()))
      TypeSwitch<Operation *>(use.getOwner())
          .Case<AdamwUpdateOp, SgdMomentumUpdateOp, SgdUpdateOp, LambNormsOp, LambUpdateOp>(
              [&](auto op) {
                op.getGradScaleMutable().assign(mul.getRhs());
                op.getGradMutable().assign(mul.getLhs());
              });
    mul.erase();
  }

  /// The rank-3 tensor whose last dimension q, k and v are the slices
  /// [0, C), [C, C + KC), [C + KC, C + 2 KC) of, covering it; else null.
  /// The slices are appended to `slices` (candidates to erase).
  static Value packedSource(Value q, Value k, Value v, SmallVectorImpl<SliceOp> &slices) {
    auto sq = q.getDefiningOp<SliceOp>(), sk = k.getDefiningOp<SliceOp>(),
         sv = v.getDefiningOp<SliceOp>();
    if (!sq || !sk || !sv)
      return nullptr;
    Value x = sq.getInput();
    auto xt = cast<RankedTensorType>(x.getType());
    if (sk.getInput() != x || sv.getInput() != x || xt.getRank() != 3)
      return nullptr;
    int64_t c = cast<RankedTensorType>(q.getType()).getShape()[2],
            kc = cast<RankedTensorType>(k.getType()).getShape()[2];
    if (sq.getDim() != 2 || sk.getDim() != 2 || sv.getDim() != 2 || sq.getOffset() != 0 ||
        (int64_t)sk.getOffset() != c || (int64_t)sv.getOffset() != c + kc ||
        xt.getShape()[2] != c + 2 * kc)
      return nullptr;
    for (SliceOp s : {sq, sk, sv})
      if (!llvm::is_contained(slices, s))
        slices.push_back(s);
    return x;
  }

  void fusePackedAttention(AttentionOp att, SmallVectorImpl<SliceOp> &slices) {
    Value x = packedSource(att.getQ(), att.getK(), att.getV(), slices);
    if (!x)
      return;
    OpBuilder b(att);
    auto fused = b.create<AttentionQkvOp>(att.getLoc(), att->getResultTypes(), x,
                                          att.getHeadsAttr(), att.getCausalAttr(),
                                          att.getKvHeadsAttr());
    keepMarks(att, fused);
    att->replaceAllUsesWith(fused->getResults());
    att.erase();
    ++numFused;
  }

  void fusePackedAttentionGrad(AttentionGradOp g, SmallVectorImpl<SliceOp> &slices) {
    Value dq = g.getDQ(), dk = g.getDK(), dv = g.getDV();
    if (!dq.hasOneUse() || !dk.hasOneUse() || !dv.hasOneUse())
      return;
    auto concat = dyn_cast<ConcatOp>(*dq.getUsers().begin());
    if (!concat || concat.getDim() != 2 || concat.getInputs().size() != 3 ||
        concat.getInputs()[0] != dq || concat.getInputs()[1] != dk ||
        concat.getInputs()[2] != dv)
      return;
    Value x = packedSource(g.getQ(), g.getK(), g.getV(), slices);
    if (!x || x.getType() != concat.getResult().getType())
      return;
    OpBuilder b(g);
    auto fused = b.create<AttentionQkvGradOp>(g.getLoc(), x.getType(), x, g.getY(), g.getLse(),
                                              g.getGrad(), g.getHeadsAttr(), g.getCausalAttr(),
                                              g.getKvHeadsAttr());
    keepMarks(g, fused);
    concat.getResult().replaceAllUsesWith(fused.getDQkv());
    concat.erase();
    g.erase();
    ++numFused;
  }

  /// `%db = sum_to %dy` ([M, N] -> [N]) and `%dw = matmul %dy, %x
  /// transpose_lhs` (rank 2, the only such matmul of %dy, one block):
  /// `%dw, %db = matmul_bias_grad %dy, %x transpose_lhs` (a linear layer's
  /// weight and bias gradients, one read of dy), where the first of the two
  /// was when %x is defined before it, else where the second was when
  /// nothing reads the first's result in between.
  void fuseBiasGrad(SumToOp st) {
    Value dy = st.getInput();
    auto dt = cast<RankedTensorType>(dy.getType());
    auto bt = cast<RankedTensorType>(st.getResult().getType());
    if (dt.getRank() != 2 || bt.getRank() != 1 || bt.getShape()[0] != dt.getShape()[1] ||
        bt.getElementType() != dt.getElementType())
      return;
    MatmulOp mm;
    for (Operation *u : dy.getUsers()) {
      auto m = dyn_cast<MatmulOp>(u);
      if (!m || m.getLhs() != dy || !m.getTransposeLhs() || m.getTransposeRhs() ||
          m->getBlock() != st->getBlock() ||
          cast<RankedTensorType>(m.getRhs().getType()).getRank() != 2 ||
          cast<RankedTensorType>(m.getType()).getElementType() != dt.getElementType())
        continue;
      if (mm)
        return; // two weight gradients of one dy: ambiguous
      mm = m;
    }
    if (!mm)
      return;
    Block *block = st->getBlock();
    bool mmFirst = mm->isBeforeInBlock(st);
    Operation *first = mmFirst ? mm.getOperation() : st.getOperation(),
              *second = mmFirst ? st.getOperation() : mm.getOperation();
    Value x = mm.getRhs();
    Operation *at = nullptr;
    Operation *xDef = x.getDefiningOp();
    Operation *xAt = xDef ? block->findAncestorOpInBlock(*xDef) : nullptr;
    if (!xAt || xAt->isBeforeInBlock(first)) {
      at = first;
    } else {
      for (Operation *u : first->getResult(0).getUsers()) {
        Operation *ua = block->findAncestorOpInBlock(*u);
        if (!ua || !second->isBeforeInBlock(ua))
          return;
      }
      at = second;
    }
    OpBuilder b(at);
    auto fused =
        b.create<MatmulBiasGradOp>(mm.getLoc(), TypeRange{mm.getType(), st.getResult().getType()},
                                   dy, x, b.getUnitAttr(), UnitAttr(), ValueRange{});
    keepMarks(mm, fused);
    mm.getResult().replaceAllUsesWith(fused.getResult());
    st.getResult().replaceAllUsesWith(fused.getBiasGrad());
    mm.erase();
    st.erase();
    ++numFused;
  }

  /// `%l = cross_entropy %x, %y` and `%dx = cross_entropy_grad %x, %y,
  /// %s` (same labels, classes, smoothing, ignore_index and normalizer, one block, the loss first)
  /// where nothing reads %l before the gradient: `%l, %dx = cross_entropy_fused %x, %y, %s` where
  /// the gradient was. The loss is computed later, from the same row statistics as the gradient;
  /// every operand is defined there and nothing between needed it. Several cross-entropies of %x
  /// (an ambiguous pairing) fuse none.
  void fuseClassifier(CrossEntropyGradOp g) {
    Value x = g.getLogits();
    CrossEntropyOp ce;
    for (Operation *u : x.getUsers()) {
      auto c = dyn_cast<CrossEntropyOp>(u);
      if (!c || c.getLabels() != g.getLabels())
        continue;
      if (ce)
        return;
      ce = c;
    }
    if (!ce || ce->getBlock() != g->getBlock() || !ce->isBeforeInBlock(g) ||
        ce.getClassesAttr() != g.getClassesAttr() ||
        ce.getLabelSmoothingAttr() != g.getLabelSmoothingAttr() ||
        ce.getIgnoreIndexAttr() != g.getIgnoreIndexAttr() ||
        ce.getNormalizer() != g.getNormalizer())
      return;
    for (Operation *u : ce.getResult().getUsers()) {
      Operation *at = g->getBlock()->findAncestorOpInBlock(*u);
      if (!at || !g->isBeforeInBlock(at))
        return;
    }
    OpBuilder b(g);
    auto fused = b.create<CrossEntropyFusedOp>(
        g.getLoc(), TypeRange{ce.getResult().getType(), g.getResult().getType()}, x, g.getLabels(),
        g.getGrad(), g.getNormalizer(), g.getClassesAttr(), g.getLabelSmoothingAttr(),
        g.getIgnoreIndexAttr());
    keepMarks(g, fused);
    ce.getResult().replaceAllUsesWith(fused.getLoss());
    g.getResult().replaceAllUsesWith(fused.getDLogits());
    g.erase();
    ce.erase();
    ++numFused;
  }

  /// A tree of adds (each inner one read only by the next) whose leaves
  /// are slice_grads (each read only by the tree) of one dimension that
  /// tile it exactly: the sum of zero-padded pieces is their concat
  /// (fsdp-autodiff's gradient of q, k, v sliced from one projection).
  /// One concat replaces the pieces' zero-filled copies and the adds. Every
  /// element is one piece's element plus zeros: the same value (a -0 piece
  /// element was +0 after the add, the concat keeps -0).
  void fuseSliceGradSum(AddOp root, DenseSet<Operation *> &erased) {
    Type t = root.getResult().getType();
    SmallVector<SliceGradOp> leaves;
    SmallVector<AddOp> inner;
    std::function<bool(Value)> collect = [&](Value v) {
      if (auto s = v.getDefiningOp<SliceGradOp>()) {
        if (!v.hasOneUse() || s->getBlock() != root->getBlock() || s.getType() != t)
          return false;
        leaves.push_back(s);
        return true;
      }
      auto a = v.getDefiningOp<AddOp>();
      if (!a || !v.hasOneUse() || a->getBlock() != root->getBlock() || !sameShapedAdd(a))
        return false;
      inner.push_back(a);
      return collect(a.getLhs()) && collect(a.getRhs());
    };
    if (!sameShapedAdd(root) || !collect(root.getLhs()) || !collect(root.getRhs()))
      return;
    int64_t dim = leaves.front().getDim();
    llvm::sort(leaves, [](SliceGradOp a, SliceGradOp b) { return a.getOffset() < b.getOffset(); });
    int64_t next = 0;
    for (SliceGradOp s : leaves) {
      auto piece = cast<RankedTensorType>(s.getGrad().getType());
      if (s.getDim() != dim || s.getOffset() != next)
        return;
      next += piece.getShape()[dim];
    }
    if (next != cast<RankedTensorType>(t).getShape()[dim])
      return; // pieces missing: the zeros matter
    SmallVector<Value> pieces;
    for (SliceGradOp s : leaves)
      pieces.push_back(s.getGrad());
    OpBuilder b(root);
    auto concat = b.create<ConcatOp>(root.getLoc(), t, pieces, b.getI64IntegerAttr(dim));
    keepMarks(root, concat);
    root.getResult().replaceAllUsesWith(concat.getResult());
    erased.insert(root);
    root.erase();
    for (AddOp a : inner) {
      erased.insert(a);
      a.erase();
    }
    for (SliceGradOp s : leaves)
      s.erase();
    ++numFused;
  }

  /// `%s = add %a, %b` (one shape, no broadcast, not a gradient
  /// accumulation of fsdp-grad-accum) read first by `layer_norm %s` in the
  /// same block and pass: `%s, %y = residual_layer_norm %a, %b, ...` where
  /// the layer norm was (nothing reads %s before it).
  void fuseResidualNorm(LayerNormOp ln) {
    fuseResidual(ln, [&](OpBuilder &b, AddOp add, Type t) {
      return b.create<ResidualLayerNormOp>(ln.getLoc(), TypeRange{t, t}, add.getLhs(),
                                           add.getRhs(), ln.getGamma(), ln.getBeta(),
                                           ln.getEpsilonAttr());
    });
  }
  void fuseResidualNorm(RmsNormOp rn) {
    fuseResidual(rn, [&](OpBuilder &b, AddOp add, Type t) {
      return b.create<ResidualRmsNormOp>(rn.getLoc(), TypeRange{t, t}, add.getLhs(),
                                         add.getRhs(), rn.getWeight(), rn.getEpsilonAttr());
    });
  }

  /// `norm(add(a, b), ...)` (a layer or RMS norm whose input is a
  /// same-shaped add read by nothing before it): `make` builds the residual
  /// form returning (a + b, the norm).
  template <typename Norm, typename Make> void fuseResidual(Norm norm, Make make) {
    auto add = norm.getInput().template getDefiningOp<AddOp>();
    if (!add || !sameShapedAdd(add) || add->getBlock() != norm->getBlock() ||
        add->hasAttr(kRecomputeAttrName) != norm->hasAttr(kRecomputeAttrName))
      return;
    for (Operation *user : add.getResult().getUsers())
      if (user != norm && (user->getBlock() != norm->getBlock() || user->isBeforeInBlock(norm)))
        return;
    OpBuilder b(norm);
    auto fused = make(b, add, add.getResult().getType());
    keepMarks(norm, fused);
    norm.getResult().replaceAllUsesWith(fused.getResult());
    add.getResult().replaceAllUsesWith(fused.getSum());
    norm.erase();
    add.erase();
    ++numFused;
  }

  /// `%dx, %dg, %db = layer_norm_grad ...` whose %dx is read only by
  /// `%t = add %dx, %acc` (either order; one shape): `%t, %dg, %db =
  /// layer_norm_grad_acc ..., %acc`, where the layer_norm_grad was when
  /// %acc is defined before it, else where the add was when nothing reads
  /// %dg or %db before the add.
  void fuseNormGradAcc(LayerNormGradOp lg) {
    fuseGradAcc(lg, {lg.getDGamma(), lg.getDBeta()}, [&](OpBuilder &b, Value acc) {
      auto fused = b.create<LayerNormGradAccOp>(
          lg.getLoc(),
          TypeRange{lg.getDInput().getType(), lg.getDGamma().getType(),
                    lg.getDBeta().getType()},
          lg.getInput(), lg.getGamma(), lg.getGrad(), acc, lg.getEpsilonAttr());
      lg.getDGamma().replaceAllUsesWith(fused.getDGamma());
      lg.getDBeta().replaceAllUsesWith(fused.getDBeta());
      return fused;
    });
  }
  void fuseNormGradAcc(RmsNormGradOp rg) {
    fuseGradAcc(rg, {rg.getDWeight()}, [&](OpBuilder &b, Value acc) {
      auto fused = b.create<RmsNormGradAccOp>(
          rg.getLoc(), TypeRange{rg.getDInput().getType(), rg.getDWeight().getType()},
          rg.getInput(), rg.getWeight(), rg.getGrad(), acc, rg.getEpsilonAttr());
      rg.getDWeight().replaceAllUsesWith(fused.getDWeight());
      return fused;
    });
  }

  /// A norm gradient `g` whose input gradient is read only by a same-shaped
  /// add: `make` builds the accumulating form at the chosen place (and
  /// moves the parameter gradients `params` to it); the add's result
  /// becomes its d_input.
  template <typename Grad, typename Make>
  void fuseGradAcc(Grad g, std::initializer_list<Value> params, Make make) {
    Value dx = g.getDInput();
    if (!dx.hasOneUse())
      return;
    auto add = dyn_cast<AddOp>(*dx.getUsers().begin());
    if (!add || !sameShapedAdd(add) || add->getBlock() != g->getBlock() ||
        add->hasAttr(kRecomputeAttrName) != g->hasAttr(kRecomputeAttrName))
      return;
    Value acc = add.getLhs() == dx ? add.getRhs() : add.getLhs();
    if (acc == dx)
      return; // dx + dx
    Operation *at = g;
    Operation *def = acc.getDefiningOp();
    if (def && def->getBlock() == g->getBlock() && !def->isBeforeInBlock(g)) {
      for (Value v : params)
        for (Operation *user : v.getUsers())
          if (user->getBlock() != add->getBlock() || user->isBeforeInBlock(add))
            return;
      at = add;
    }
    OpBuilder b(at);
    auto fused = make(b, acc);
    keepMarks(g, fused);
    add.getResult().replaceAllUsesWith(fused.getDInput());
    add.erase();
    g.erase();
    ++numFused;
  }

  /// Autodiff's VJP of `%h = mul(silu(%g), %u)`: `%t = mul(%dh, %u)`,
  /// `%du = mul(%dh, %s)` with %s a silu of %g (the forward's, or its
  /// recomputed clone), `%dg = silu_grad(%g, %t)`, %t read by nothing else,
  /// one type throughout: `%dg, %du = swiglu_grad(%g, %u, %dh)` at the first
  /// of the three, which recomputes silu(%g) instead of reading %s; a silu
  /// left unread goes.
  void fuseSwigluGrad(SiluGradOp sg) {
    Value g = sg.getInput();
    Type t = sg.getResult().getType();
    auto m1 = sg.getGrad().getDefiningOp<MulOp>();
    if (!m1 || !m1.getResult().hasOneUse() || m1->getBlock() != sg->getBlock() ||
        m1.getLhs().getType() != t || m1.getRhs().getType() != t || m1.getType() != t)
      return;
    for (auto [dh, u] : {std::pair(m1.getLhs(), m1.getRhs()), std::pair(m1.getRhs(), m1.getLhs())}) {
      for (Operation *user : dh.getUsers()) {
        auto m2 = dyn_cast<MulOp>(user);
        if (!m2 || m2 == m1 || m2->getBlock() != sg->getBlock() || m2.getType() != t)
          continue;
        Value other = m2.getLhs() == dh ? m2.getRhs() : m2.getLhs();
        auto silu = other.getDefiningOp<SiluOp>();
        if (!silu || silu.getInput() != g || other == dh)
          continue;
        Operation *at = m1;
        for (Operation *op : {m2.getOperation(), sg.getOperation()})
          if (op->isBeforeInBlock(at))
            at = op;
        auto before = [&](Value v) {
          Operation *d = v.getDefiningOp();
          return !d || d->getBlock() != at->getBlock() || d->isBeforeInBlock(at);
        };
        if (!before(g) || !before(u) || !before(dh))
          continue;
        OpBuilder b(at);
        auto fused = b.create<SwigluGradOp>(sg.getLoc(), TypeRange{t, t}, g, u, dh);
        keepMarks(sg, fused);
        sg.getResult().replaceAllUsesWith(fused.getDGate());
        m2.getResult().replaceAllUsesWith(fused.getDUp());
        sg.erase();
        m1.erase();
        m2.erase();
        if (silu->use_empty())
          silu.erase();
        ++numFused;
        return;
      }
    }
  }

  /// `%h = mul(silu(%g), %u)` (either order, one type) where the silu is read
  /// by nothing else (its backward reader fused above): `%h = swiglu(%g,
  /// %u)`; silu(%g) is neither written nor kept for the backward pass.
  void fuseSwiglu(SiluOp silu) {
    Value s = silu.getResult();
    if (!s.hasOneUse())
      return;
    auto m = dyn_cast<MulOp>(*s.getUsers().begin());
    Type t = s.getType();
    if (!m || m->getBlock() != silu->getBlock() || m.getLhs().getType() != t ||
        m.getRhs().getType() != t || m.getType() != t ||
        m->hasAttr(kRecomputeAttrName) != silu->hasAttr(kRecomputeAttrName))
      return;
    Value u = m.getLhs() == s ? m.getRhs() : m.getLhs();
    if (u == s)
      return; // silu(g)^2
    OpBuilder b(m);
    auto fused = b.create<SwigluOp>(m.getLoc(), t, silu.getInput(), u);
    keepMarks(m, fused);
    m.getResult().replaceAllUsesWith(fused.getResult());
    m.erase();
    silu.erase();
    ++numFused;
  }

  /// An add of two operands of the result's type (no broadcast) that is not
  /// fsdp-grad-accum's or fsdp-chunk-loss's accumulation (the memory plan
  /// may run those in place over their accumulator).
  static bool sameShapedAdd(AddOp add) {
    Type t = add.getResult().getType();
    return add.getLhs().getType() == t && add.getRhs().getType() == t &&
           !add->hasAttr(kAccumAttrName) && !add->hasAttr(kChunkAccumAttrName);
  }

  void fuseForward(BiasAddOp bias) {
    MatmulOp mm = soleRank2Matmul(bias.getInput());
    if (!mm)
      return;
    Value y = bias.getResult();
    // The GELU joins only as y's first reader, in the same block and pass:
    // a later one (fsdp-recompute's clone in the backward pass) would be
    // moved up here, and its input kept alive for it anyway.
    Operation *first = nullptr;
    for (Operation *user : y.getUsers())
      if (user->getBlock() == bias->getBlock() &&
          (!first || user->isBeforeInBlock(first)))
        first = user;
    GeluOp gelu = dyn_cast_or_null<GeluOp>(first);
    if (gelu && (gelu.getApproximate() != "tanh" ||
                 gelu->hasAttr(kRecomputeAttrName) != bias->hasAttr(kRecomputeAttrName)))
      gelu = nullptr;
    bool keepPre = gelu && !y.hasOneUse();
    OpBuilder b(bias);
    SmallVector<Type> types{y.getType()};
    if (keepPre)
      types.push_back(y.getType());
    auto fused = b.create<MatmulBiasOp>(bias.getLoc(), types, mm.getLhs(), mm.getRhs(),
                                        bias.getBias(), mm.getTransposeLhs(),
                                        mm.getTransposeRhs(), /*gelu=*/bool(gelu));
    keepMarks(bias, fused);
    if (gelu) {
      gelu.getResult().replaceAllUsesWith(fused.getResult());
      gelu.erase();
      if (keepPre)
        y.replaceAllUsesWith(fused.getPre());
    } else {
      y.replaceAllUsesWith(fused.getResult());
    }
    bias.erase();
    mm.erase();
    ++numFused;
  }

  void fuseBackward(GeluGradOp gg) {
    if (gg.getApproximate() != "tanh")
      return;
    MatmulOp mm = soleRank2Matmul(gg.getGrad());
    if (!mm)
      return;
    Value dp = gg.getResult();
    auto type = cast<RankedTensorType>(dp.getType());
    SumToOp biasGrad;
    for (Operation *user : dp.getUsers())
      if (auto s = dyn_cast<SumToOp>(user)) {
        auto t = cast<RankedTensorType>(s.getResult().getType());
        if (t.getRank() == 1 && t.getShape()[0] == type.getShape()[1]) {
          biasGrad = s;
          break;
        }
      }
    OpBuilder b(gg);
    SmallVector<Type> types{type};
    if (biasGrad)
      types.push_back(biasGrad.getResult().getType());
    auto fused = b.create<MatmulGeluGradOp>(gg.getLoc(), types, mm.getLhs(), mm.getRhs(),
                                            gg.getInput(), mm.getTransposeLhs(),
                                            mm.getTransposeRhs());
    keepMarks(gg, fused);
    dp.replaceAllUsesWith(fused.getResult());
    gg.erase();
    mm.erase();
    if (biasGrad) {
      biasGrad.getResult().replaceAllUsesWith(fused.getBiasGrad());
      biasGrad.erase();
    }
    ++numFused;
  }
};

} // namespace
