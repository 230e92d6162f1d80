//===- ChunkLoss.cpp - the classifier head and its loss in row chunks -----===//
//
// fsdp-chunk-loss: Liger-Kernel's fused linear cross-entropy (and Apple's
// cut cross-entropy's motivation) as a rewrite of the differentiated step.
// A language model's largest activation is its logits, [tokens, V]: GPT-2
// at B=32, T=1024 holds 32768 x 50304 of them (3.3 GB in bf16, twice that
// in f32), Llama 3's V=128256 is 2.5x more. They live from the head's
// matmul to the weight gradient's. The rewrite, for `chunks` row ranges
// [r_i, r_i + m_i) of the M rows (tokens):
//
//   %l  = matmul %h, %w transpose_rhs        %hi = view rows i of %h, %yi of %y
//   %c  = cross_entropy %l, %y               %li = matmul %hi, %w transpose_rhs
//   %dl = cross_entropy_grad %l, %y, %s  ->  %ci = cross_entropy %li, %yi
//   %dh = matmul %dl, %w                     %di = cross_entropy_grad %li, %yi, %si
//   %dw = matmul %dl, %h transpose_lhs       %dhi = matmul %di, %w
//                                            %dwi = matmul %di, %hi transpose_lhs
//                                            %acc = add %acc, %dwi {fsdp.chunk_accum}
//                                          (for i = 0..K-1, in turn), then
//                                            %dh = concat %dh0, ... dim = 0
//                                            %c  = sum of %ci (weighed)
//
// Chunk i's logits die with its weight-gradient term, before chunk i+1's
// are made, so the memory plan holds one chunk's [m_i, V] at a time. The
// views are aliases (no copies of %h or %y); the input-gradient rows are
// concatenated (an [M, C] copy: C << V); the weight-gradient terms are
// summed in place, in f32 for bf16 / f16 operands (fsdp-fuse-epilogues then
// makes each term's matmul write f32 and accumulate into the sum: a GEMM
// with beta = 1, no buffer for the term), then cast back where the
// unchunked gradient was narrower (or replace its cast to f32).
//
// Losses and seeds. With a normalizer (ignore_index: the loss is the kept
// sum over the step's count) each chunk's loss is its kept sum over that
// count, the chunks add up and each takes the step's seed. Without one the
// loss is a mean: chunk i's mean counts m_i / M of the step's, and so does
// its gradient (its seed is scaled by m_i / M).
//
// What it matches (the readers of %dl may go through reshapes to [M, V]):
// the logits are a rank-2 matmul's [M, V] product (not transpose_lhs; an
// optional bias_add; reshapes to the cross-entropy's shape), read by one
// cross_entropy and one cross_entropy_grad of the same labels and
// attributes; the gradient is read by matmuls with it as their
// untransposed lhs (rows -> concat), matmuls contracting its rows with
// another [M, K] value (transpose_lhs, not transpose_rhs -> sum), and
// sum_to [V] (a bias gradient -> sum). Anything else, with chunks > 1
// asked for, is an error naming the op; `auto` leaves such a head alone.
//
// Order: after fsdp-autodiff, before fsdp-grad-accum (which clones the
// chunked head into every micro-batch; after it, micro-batch k's loss is
// summed right after its forward, before its gradient, which the rewrite
// refuses).
//
// Placement: the whole chunked head goes where the cross-entropy gradient
// was (after the seed), so the forward logits are made in the backward's
// first position. The loss is then defined after the head's backward:
// passes that split the step at its loss count the head's backward as
// forward, which it now is (its gradients come with the loss, as Liger
// computes them in the forward).
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/STLExtras.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPCHUNKLOSS
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

RankedTensorType rtt(Value v) { return cast<RankedTensorType>(v.getType()); }

RankedTensorType withElem(RankedTensorType t, Type elem) {
  return RankedTensorType::get(t.getShape(), elem);
}

/// True when `v` is available at `at`: a block argument of its block, or
/// defined before it in that block.
bool availableAt(Value v, Operation *at) {
  if (auto arg = dyn_cast<BlockArgument>(v))
    return arg.getOwner() == at->getBlock();
  Operation *d = v.getDefiningOp();
  return d->getBlock() == at->getBlock() && d->isBeforeInBlock(at);
}

/// One classifier head and everything the rewrite replaces.
struct Head {
  CrossEntropyOp ce;
  CrossEntropyGradOp grad;
  MatmulOp mm;
  BiasAddOp bias;                   ///< null without one
  SmallVector<Operation *> fwdChain; ///< reshapes from the product to the logits
  SmallVector<Operation *> dlChain;  ///< reshapes of the logits' gradient
  /// Readers of the [M, V] gradient: row-split (their rows are the
  /// gradient's) or contracting (a sum over its rows).
  SmallVector<Operation *> rowReaders, sumReaders;
  int64_t rows = 0, classes = 0, width = 0, logitBytes = 4;
};

struct ChunkLossPass : mlir::fsdp::impl::FsdpChunkLossBase<ChunkLossPass> {
  using Base::Base;

  /// Requested chunk count (0: auto).
  int64_t requested = 1;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (chunks == "auto") {
      requested = 0;
    } else if (StringRef(chunks).getAsInteger(10, requested) || requested < 1) {
      mlir::emitError(module.getLoc())
          << "fsdp-chunk-loss: chunks='" << chunks
          << "' is not a positive chunk count or auto (1: off)";
      return signalPassFailure();
    }
    if (requested == 1)
      return;
    func::FuncOp step = getTrainStep(module, "fsdp-autodiff");
    if (!step)
      return signalPassFailure();
    SmallVector<CrossEntropyGradOp> grads;
    step.walk([&](CrossEntropyGradOp g) { grads.push_back(g); });
    if (grads.empty() && requested > 1) {
      mlir::emitError(step.getLoc())
          << "fsdp-chunk-loss: chunks=" << requested << " but @" << kTrainStepName
          << " has no cross_entropy (with its gradient) whose classifier head could be chunked";
      return signalPassFailure();
    }
    for (CrossEntropyGradOp g : grads) {
      Head head;
      std::string why;
      if (!match(g, head, why)) {
        if (requested == 0)
          continue; // auto: only what can be chunked
        g.emitOpError() << "cannot be chunked (fsdp-chunk-loss, chunks=" << requested
                        << "): " << why;
        return signalPassFailure();
      }
      int64_t rowsPer = chunkRows(head);
      if (rowsPer >= head.rows)
        continue;
      rewrite(head, rowsPer);
      ++numChunked;
    }
  }

  /// Rows per chunk (the last may have fewer).
  int64_t chunkRows(const Head &h) const {
    if (requested > 0) {
      int64_t k = std::min(requested, h.rows);
      return (h.rows + k - 1) / k;
    }
    // auto: the fewest rows, a power of two, whose [rows, V] logits take
    // at least the f32 weight gradient's [V, C] bytes (4 C / logit bytes
    // rows). Each chunk's weight-gradient GEMM reads and writes the [V, C]
    // f32 sum: smaller chunks would move more bytes of it than of their
    // own logits.
    int64_t want = (4 * h.width + h.logitBytes - 1) / h.logitBytes;
    int64_t p = 1;
    while (p < want)
      p *= 2;
    return p;
  }

  /// Fills `h` from the gradient `g`; on failure says why in `why`.
  bool match(CrossEntropyGradOp g, Head &h, std::string &why) {
    llvm::raw_string_ostream os(why);
    h.grad = g;
    Value x = g.getLogits();
    for (Operation *u : x.getUsers()) {
      if (u == g.getOperation())
        continue;
      auto c = dyn_cast<CrossEntropyOp>(u);
      if (!c || h.ce) {
        os << "its logits are also read by '" << u->getName() << "'";
        return false;
      }
      h.ce = c;
    }
    CrossEntropyOp ce = h.ce;
    if (!ce) {
      os << "no cross_entropy reads its logits";
      return false;
    }
    if (ce.getLabels() != g.getLabels() || ce.getClassesAttr() != g.getClassesAttr() ||
        ce.getLabelSmoothingAttr() != g.getLabelSmoothingAttr() ||
        ce.getIgnoreIndexAttr() != g.getIgnoreIndexAttr() ||
        ce.getNormalizer() != g.getNormalizer()) {
      os << "the cross_entropy of its logits has other labels or attributes";
      return false;
    }
    if (ce->getBlock() != g->getBlock() || !ce->isBeforeInBlock(g)) {
      os << "the cross_entropy is not before it in its block";
      return false;
    }
    for (Operation *u : ce.getResult().getUsers()) {
      Operation *at = g->getBlock()->findAncestorOpInBlock(*u);
      if (!at || !g->isBeforeInBlock(at)) {
        os << "the loss is read by '" << u->getName() << "' before its gradient";
        if (u->hasAttr(kAccumAttrName))
          os << " (fsdp-grad-accum's sum: run fsdp-chunk-loss before it)";
        return false;
      }
    }
    // The product: reshapes (each read once) of a bias_add or matmul.
    Value v = x;
    while (auto r = v.getDefiningOp<ReshapeOp>()) {
      h.fwdChain.push_back(r);
      v = r.getInput();
      if (!v.hasOneUse()) {
        os << "a reshape of its logits' product is read elsewhere";
        return false;
      }
    }
    if (auto b = v.getDefiningOp<BiasAddOp>()) {
      h.bias = b;
      v = b.getInput();
      if (!v.hasOneUse()) {
        os << "the head's product before its bias is read elsewhere";
        return false;
      }
    }
    h.mm = v.getDefiningOp<MatmulOp>();
    if (!h.mm || h.mm.getTransposeLhs() || rtt(h.mm.getLhs()).getRank() != 2 ||
        rtt(h.mm.getRhs()).getRank() != 2) {
      os << "its logits are not the product of a rank-2 matmul (without transpose_lhs)";
      return false;
    }
    RankedTensorType prod = rtt(h.mm.getResult());
    h.rows = prod.getDimSize(0);
    h.classes = prod.getDimSize(1);
    h.width = rtt(h.mm.getLhs()).getDimSize(1);
    h.logitBytes = std::max<int64_t>(1, prod.getElementType().getIntOrFloatBitWidth() / 8);
    if (rtt(g.getLabels()).getNumElements() != h.rows) {
      os << "its labels are not one per row of the head's product";
      return false;
    }
    // The gradient's readers, through reshapes to [M, V].
    SmallVector<Value> work{g.getResult()};
    while (!work.empty()) {
      Value d = work.pop_back_val();
      for (Operation *u : d.getUsers()) {
        if (auto r = dyn_cast<ReshapeOp>(u)) {
          h.dlChain.push_back(r);
          work.push_back(r.getResult());
          continue;
        }
        if (rtt(d).getShape() != prod.getShape()) {
          os << "its gradient is read by '" << u->getName() << "' in another shape";
          return false;
        }
        if (!classify(u, d, h)) {
          os << "its gradient is read by '" << u->getName()
             << "', which is neither the head's input gradient (matmul %dl, %w) nor a sum "
                "over its rows (matmul transpose_lhs with an [M, K] operand, sum_to)";
          return false;
        }
        for (Value o : u->getOperands())
          if (o != d && !availableAt(o, g)) {
            os << "'" << u->getName() << "' reads a value defined after it";
            return false;
          }
      }
    }
    for (Value o : {h.mm.getLhs(), h.mm.getRhs()})
      if (!availableAt(o, g)) {
        os << "the head's matmul reads a value defined after it";
        return false;
      }
    if (h.bias && !availableAt(h.bias.getBias(), g)) {
      os << "the head's bias is defined after it";
      return false;
    }
    return true;
  }

  /// Files `u`, a reader of the [M, V] gradient `d`, by how it splits.
  static bool classify(Operation *u, Value d, Head &h) {
    if (auto s = dyn_cast<SumToOp>(u)) {
      if (rtt(s.getResult()).getShape() != ArrayRef<int64_t>{h.classes})
        return false;
      h.sumReaders.push_back(u);
      return true;
    }
    auto m = dyn_cast<MatmulOp>(u);
    if (!m || m.getLhs() == m.getRhs())
      return false;
    if (m.getLhs() == d && !m.getTransposeLhs() && rtt(m.getRhs()).getRank() == 2) {
      h.rowReaders.push_back(u);
      return true;
    }
    if (m.getTransposeLhs() && !m.getTransposeRhs()) {
      Value other = m.getLhs() == d ? m.getRhs() : m.getLhs();
      RankedTensorType t = rtt(other);
      if (t.getRank() == 2 && t.getDimSize(0) == h.rows) {
        h.sumReaders.push_back(u);
        return true;
      }
    }
    return false;
  }

  void rewrite(Head &h, int64_t rowsPer) {
    CrossEntropyGradOp g = h.grad;
    OpBuilder b(g);
    Location loc = g.getLoc();
    int64_t m = h.rows, k = (m + rowsPer - 1) / rowsPer;
    bool equal = m % rowsPer == 0;
    Value normalizer = g.getNormalizer();

    // Rows [r, r + n) of `v` (numel(v) = M x inner) as [n, inner...].
    DenseMap<Value, Value> flats;
    DenseMap<std::pair<Value, int64_t>, Value> views; // (value, first row)
    auto rowsOf = [&](Value v, int64_t r, int64_t n, ArrayRef<int64_t> inner) -> Value {
      Value &view = views[{v, r}];
      if (view)
        return view;
      RankedTensorType t = rtt(v);
      Value &flat = flats[v];
      if (!flat)
        flat = t.getRank() == 1
                   ? v
                   : b.create<ReshapeOp>(loc, RankedTensorType::get({t.getNumElements()},
                                                                    t.getElementType()),
                                         v)
                         .getResult();
      int64_t per = 1;
      for (int64_t s : inner)
        per *= s;
      SmallVector<int64_t> shape{n};
      shape.append(inner.begin(), inner.end());
      view = b.create<ViewOp>(loc, RankedTensorType::get(shape, t.getElementType()), flat,
                              b.getI64IntegerAttr(r * per));
      return view;
    };
    auto scaled = [&](Value v, double f) -> Value {
      return b.create<ScaleOp>(loc, v.getType(), v, b.getF64FloatAttr(f)).getResult();
    };
    DenseMap<int64_t, Value> seeds; // by rows: the seed x rows / M

    // Sums in f32 for narrow operands.
    auto accType = [](Value result) {
      RankedTensorType t = rtt(result);
      return t.getElementType().isF32() ? t : withElem(t, Float32Type::get(t.getContext()));
    };
    SmallVector<SmallVector<Value>> rowParts(h.rowReaders.size());
    SmallVector<Value> sums(h.sumReaders.size());
    SmallVector<std::pair<Value, int64_t>> losses; // (loss, rows)
    Value x = h.mm.getResult();
    for (int64_t i = 0; i < k; ++i) {
      int64_t r = i * rowsPer, n = std::min(rowsPer, m - r);
      Value hi = rowsOf(h.mm.getLhs(), r, n, {h.width});
      Value yi = rowsOf(g.getLabels(), r, n, {});
      auto li = b.create<MatmulOp>(loc, withRows(rtt(x), n), hi, h.mm.getRhs());
      li.setTransposeRhs(h.mm.getTransposeRhs());
      Value logits = li.getResult();
      if (h.bias)
        logits = b.create<BiasAddOp>(loc, logits.getType(), logits, h.bias.getBias()).getResult();
      Value seed = g.getGrad();
      if (!normalizer) {
        Value &s = seeds[n];
        if (!s)
          s = scaled(g.getGrad(), double(n) / m);
        seed = s;
      }
      auto ce = b.create<CrossEntropyOp>(loc, h.ce.getResult().getType(), logits, yi, normalizer,
                                         h.ce.getClassesAttr(), h.ce.getLabelSmoothingAttr(),
                                         h.ce.getIgnoreIndexAttr());
      losses.push_back({ce.getResult(), n});
      Value dl = b.create<CrossEntropyGradOp>(loc, logits.getType(), logits, yi, seed, normalizer,
                                              g.getClassesAttr(), g.getLabelSmoothingAttr(),
                                              g.getIgnoreIndexAttr())
                     .getResult();
      for (auto [j, u] : llvm::enumerate(h.rowReaders)) {
        auto mu = cast<MatmulOp>(u);
        auto part = b.create<MatmulOp>(loc, withRows(rtt(mu.getResult()), n), dl, mu.getRhs());
        part.setTransposeRhs(mu.getTransposeRhs());
        rowParts[j].push_back(part.getResult());
      }
      for (auto [j, u] : llvm::enumerate(h.sumReaders)) {
        Value term;
        if (auto s = dyn_cast<SumToOp>(u)) {
          term = b.create<SumToOp>(loc, s.getType(), dl).getResult();
        } else {
          auto mu = cast<MatmulOp>(u);
          bool dlLeft = isDl(mu.getLhs(), g.getResult());
          Value other = dlLeft ? mu.getRhs() : mu.getLhs();
          Value oi = rowsOf(other, r, n, {rtt(other).getDimSize(1)});
          auto t = b.create<MatmulOp>(loc, mu.getType(), dlLeft ? dl : oi, dlLeft ? oi : dl);
          t.setTransposeLhs(true);
          term = t.getResult();
        }
        RankedTensorType at = accType(u->getResult(0));
        if (rtt(term) != at)
          term = b.create<CastOp>(loc, at, term).getResult();
        if (!sums[j]) {
          sums[j] = term;
        } else {
          auto add = b.create<AddOp>(loc, at, sums[j], term);
          add->setAttr(kChunkAccumAttrName, b.getUnitAttr());
          sums[j] = add.getResult();
        }
      }
    }

    // The loss, after every chunk's gradient (so fsdp-fuse-epilogues fuses
    // each chunk's pair): the chunks' sum (kept sums over the step's
    // count, or means weighed by their rows), or their mean for equal
    // chunks.
    auto term = [&](std::pair<Value, int64_t> l) {
      return normalizer || equal ? l.first : scaled(l.first, double(l.second) / m);
    };
    Value loss = term(losses.front());
    for (auto l : ArrayRef(losses).drop_front())
      loss = b.create<AddOp>(loc, loss.getType(), loss, term(l)).getResult();
    if (!normalizer && equal)
      loss = scaled(loss, 1.0 / k);
    h.ce.getResult().replaceAllUsesWith(loss);
    for (auto [j, u] : llvm::enumerate(h.rowReaders)) {
      Value whole = b.create<ConcatOp>(loc, u->getResult(0).getType(), rowParts[j],
                                       b.getI64IntegerAttr(0))
                        .getResult();
      u->getResult(0).replaceAllUsesWith(whole);
    }
    for (auto [j, u] : llvm::enumerate(h.sumReaders)) {
      Value r = u->getResult(0), sum = sums[j];
      if (r.getType() == sum.getType()) {
        r.replaceAllUsesWith(sum);
        continue;
      }
      // A narrow gradient: its widening cast takes the f32 sum itself.
      SmallVector<Operation *> users(r.getUsers());
      for (Operation *user : users)
        if (auto c = dyn_cast<CastOp>(user); c && c.getType() == sum.getType()) {
          c.getResult().replaceAllUsesWith(sum);
          c.erase();
        }
      if (!r.use_empty())
        r.replaceAllUsesWith(b.create<CastOp>(loc, r.getType(), sum).getResult());
    }

    // The replaced ops, readers first.
    SmallVector<Operation *> dead(h.rowReaders);
    dead.append(h.sumReaders.begin(), h.sumReaders.end());
    dead.append(h.dlChain.rbegin(), h.dlChain.rend());
    dead.push_back(g);
    dead.push_back(h.ce);
    dead.append(h.fwdChain.begin(), h.fwdChain.end());
    if (h.bias)
      dead.push_back(h.bias);
    dead.push_back(h.mm);
    for (Operation *op : dead) {
      assert(op->use_empty() && "a replaced op is still read");
      op->erase();
    }
  }

  static RankedTensorType withRows(RankedTensorType t, int64_t n) {
    SmallVector<int64_t> shape(t.getShape());
    shape[0] = n;
    return RankedTensorType::get(shape, t.getElementType());
  }

  /// True when `v` is the logits gradient `dl` (or a reshape of it).
  static bool isDl(Value v, Value dl) {
    while (auto r = v.getDefiningOp<ReshapeOp>())
      v = r.getInput();
    return v == dl;
  }
};

} // namespace
