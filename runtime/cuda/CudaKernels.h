//===- CudaKernels.h - CUDA kernels for every op of a plan ------*- C++ -*-===//
//
// The CUDA twin of runtime/cpu/Kernels.h: one function per op (forward,
// backward, optimizer), float32 on contiguous row-major device memory,
// enqueued on a stream. Semantics are the CPU kernels' (tanh GELU, biased
// layer-norm variance, HF RMSNorm / rotate-half RoPE, mean losses,
// torch.optim's SGD and AdamW), and the suite test/unit/CudaKernelsTest.cpp
// checks each against its CPU twin on the GPU machine.
//
// Determinism: every reduction runs in a fixed order (no floating-point
// atomics), so a step gives the same bits every time on one GPU.
// No host synchronisation: scalars the step computes (lr, step, loss
// gradients, clip coefficients) are read from device memory, and bad ids /
// labels are recorded in a device flag the caller reads once per step.
// Each function returns the launch's cudaError_t (cudaSuccess when the
// launch was accepted).
//
// GEMMs are in CudaGemm.h (cuBLASLt).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDAKERNELS_H
#define FSDP_RUNTIME_CUDA_CUDAKERNELS_H

#include <cstdint>
#include <cuda_runtime.h>
#include <vector>

namespace fsdp::cuda {

using Shape = std::vector<int64_t>;

enum class BinaryKind { Add, Sub, Mul, Div };
enum class FloatKind { F32, BF16, F16 };

/// The parameters an optimizer update reads (p) and writes (np; in place
/// allowed). f32 by default. With bf16 set (master-dtype=bf16) both hold
/// bf16: each parameter is widened on read, stepped in f32 and rounded
/// once on write, to nearest, or stochastically when ctx (the device's
/// {seed, step}) is given, with the stochastic cast's draws:
/// stochasticRoundingKey(seed, step, key), element i at first + i. The
/// bits of the f32 update of the widened parameters followed by
/// castBf16Stochastic (or the nearest cast), with no f32 copy in memory.
struct Params {
  const void *p = nullptr;
  void *np = nullptr;
  bool bf16 = false;
  const uint64_t *ctx = nullptr;
  int64_t key = 0;
  uint64_t first = 0;
  Params() = default;
  Params(const float *p, float *np) : p(p), np(np) {}
  static Params bf16Storage(const void *p, void *np, const uint64_t *ctx, int64_t key,
                            uint64_t first) {
    Params q;
    q.p = p, q.np = np, q.bf16 = true, q.ctx = ctx, q.key = key, q.first = first;
    return q;
  }
  /// Elements [at, ...): the pointers moved, and the draws' places.
  Params from(int64_t at) const {
    Params q = *this;
    const int64_t bytes = at * (bf16 ? 2 : 4);
    q.p = static_cast<const char *>(p) + bytes;
    q.np = static_cast<char *>(np) + bytes;
    q.first = first + (uint64_t)at;
    return q;
  }
};

/// The most dimensions a broadcast / transpose handles.
constexpr int kMaxRank = 8;

/// out = a (op) b with NumPy broadcasting; `so` is the broadcast shape.
cudaError_t binary(BinaryKind k, const float *a, const Shape &sa, const float *b,
                   const Shape &sb, float *out, const Shape &so, cudaStream_t s);
cudaError_t broadcastTo(const float *in, const Shape &si, float *out, const Shape &so,
                        cudaStream_t s);
/// The adjoint of broadcastTo: each output element sums its preimage in a
/// fixed order.
cudaError_t sumTo(const float *in, const Shape &si, float *out, const Shape &so,
                  cudaStream_t s);

cudaError_t neg(const float *x, float *y, int64_t n, cudaStream_t s);
cudaError_t scale(const float *x, float *y, int64_t n, double f, cudaStream_t s);
/// y = x * keep / (1 - p) (`scale`), keep from runtime/core/Dropout.h for
/// global elements first .. first + n - 1 with the key of op `id` at the
/// step ctx = {seed, step} (device memory, so a replayed CUDA graph draws
/// the step's mask): the CPU kernel's mask, bit for bit.
cudaError_t dropout(const float *x, float *y, int64_t n, const uint64_t *ctx, int64_t id,
                    uint64_t first, uint32_t threshold, double scale, cudaStream_t s);
cudaError_t fill(float *y, int64_t n, double v, cudaStream_t s);
/// y[i] = word for i < n (bit patterns: the arena's sentinel).
cudaError_t fillWords(uint32_t *y, int64_t n, uint32_t word, cudaStream_t s);
cudaError_t relu(const float *x, float *y, int64_t n, cudaStream_t s);
cudaError_t reluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s);
cudaError_t gelu(const float *x, float *y, int64_t n, cudaStream_t s);
cudaError_t geluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s);
/// The exact (erf) GELU and its VJP.
cudaError_t geluExact(const float *x, float *y, int64_t n, cudaStream_t s);
cudaError_t geluExactGrad(const float *x, const float *dy, float *dx, int64_t n,
                          cudaStream_t s);
cudaError_t silu(const float *x, float *y, int64_t n, cudaStream_t s);
cudaError_t siluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s);
cudaError_t softmax(const float *x, float *y, int64_t rows, int64_t cols, cudaStream_t s);
cudaError_t softmaxGrad(const float *y, const float *dy, float *dx, int64_t rows,
                        int64_t cols, cudaStream_t s);
cudaError_t biasAdd(const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                    cudaStream_t s);

cudaError_t layerNorm(const float *x, const float *g, const float *b, float *y,
                      int64_t rows, int64_t cols, double eps, cudaStream_t s);
/// `scratch`: 2 * rows floats (each row's mean and 1/std, computed once
/// and read by the column sums of dg and db).
cudaError_t layerNormGrad(const float *x, const float *g, const float *dy, float *dx,
                          float *dg, float *db, float *scratch, int64_t rows, int64_t cols,
                          double eps, cudaStream_t s);
cudaError_t rmsNorm(const float *x, const float *w, float *y, int64_t rows, int64_t cols,
                    double eps, cudaStream_t s);
/// `scratch`: rows floats (each row's 1/rms).
cudaError_t rmsNormGrad(const float *x, const float *w, const float *dy, float *dx,
                        float *dw, float *scratch, int64_t rows, int64_t cols, double eps,
                        cudaStream_t s);

/// Causal or full multi-head / grouped-query attention on [B, T, C] (see
/// cpu::attention). One block per (batch, head, query row); the row's
/// scores live in shared memory, so T is limited by attentionMaxT().
int64_t attentionMaxT();
/// `lse`, when not null, receives each (b, h, t) row's log-sum-exp (index
/// (b * heads + h) * T + t).
cudaError_t attention(const float *q, const float *k, const float *v, float *y, float *lse,
                      int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                      int64_t kvHeads, cudaStream_t s);
/// Scratch floats attentionGrad needs (one per query row and head).
int64_t attentionGradScratch(int64_t B, int64_t T, int64_t heads);
/// dq, dk, dv without atomics from the forward's output y and log-sum-exp:
/// a pass per query row (delta = dy . y), one for dq, one per key row for
/// dk and dv.
cudaError_t attentionGrad(const float *q, const float *k, const float *v, const float *y,
                          const float *lse, const float *dy, float *dq, float *dk, float *dv,
                          float *scratch, int64_t B, int64_t T, int64_t C, int64_t heads,
                          bool causal, int64_t kvHeads, cudaStream_t s);

cudaError_t rope(const float *x, float *y, int64_t B, int64_t T, int64_t C, int64_t heads,
                 double theta, cudaStream_t s);
cudaError_t ropeGrad(const float *dy, float *dx, int64_t B, int64_t T, int64_t C,
                     int64_t heads, double theta, cudaStream_t s);

/// Rows of `table` selected by int32 ids. An id outside [0, vocab) writes
/// zeros and records the smallest such position in *badPos (device memory,
/// set to INT64_MAX by the caller before the step).
cudaError_t embedding(const float *table, const int32_t *ids, float *y, int64_t n,
                      int64_t vocab, int64_t width, long long *badPos, cudaStream_t s);
/// dtable = scatter-add of dy rows; each column sums its rows in id order
/// (deterministic). Bad ids are skipped and recorded as in embedding.
cudaError_t embeddingGrad(const int32_t *ids, const float *dy, float *dtable, int64_t n,
                          int64_t vocab, int64_t width, long long *badPos, cudaStream_t s);

cudaError_t transpose(const float *x, const Shape &sx, const std::vector<int64_t> &perm,
                      float *y, cudaStream_t s);
/// x is [outer, full, inner], y is [outer, len, inner] (rows offset.. of x).
cudaError_t slice(const float *x, float *y, int64_t outer, int64_t full, int64_t len,
                  int64_t inner, int64_t offset, cudaStream_t s);
/// dx = zeros with dy placed at offset (the VJP of slice).
cudaError_t sliceGrad(const float *dy, float *dx, int64_t outer, int64_t full, int64_t len,
                      int64_t inner, int64_t offset, cudaStream_t s);
/// Places x [outer, len, inner] into y [outer, full, inner] at offset (concat).
cudaError_t place(const float *x, float *y, int64_t outer, int64_t full, int64_t len,
                  int64_t inner, int64_t offset, cudaStream_t s);

/// cross_entropy's ignore_index on the kernels: a row whose label is
/// `index` adds 0 to the loss and gets a zero gradient row (its label is
/// not range-checked), and the loss and gradient divide by *count (a
/// device f32: the kept-label count, count_labels; <= 0 gives 0) instead
/// of the row count. `count` null: off.
struct CeIgnore {
  const float *count = nullptr;
  int32_t index = 0;
};

/// count_labels: *out = (the labels differing from `ignore`) / divisor,
/// rounded once to f32, as the CPU kernel computes it.
cudaError_t countLabels(const int32_t *labels, int64_t n, int32_t ignore, int64_t divisor,
                        float *out, cudaStream_t s);

/// Mean cross-entropy over rows into *loss; a label outside [0, classes)
/// records its row in *badPos. Row r starts at r * stride (stride >=
/// classes: columns from `classes` on are padding, outside the softmax,
/// and their gradient is written as 0). `scratch`: rows doubles (per-row
/// losses, summed in a fixed order). `smoothing` e: label smoothing, the
/// target (1 - e) onehot + e / classes (the CPU kernels' arithmetic).
cudaError_t crossEntropy(const float *logits, const int32_t *labels, float *loss, double *scratch,
                         int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                         cudaStream_t s, double smoothing = 0, CeIgnore ignore = {});
cudaError_t crossEntropyGrad(const float *logits, const int32_t *labels, const float *dloss,
                             float *dlogits, int64_t rows, int64_t classes, int64_t stride,
                             long long *badPos, cudaStream_t s, double smoothing = 0,
                             CeIgnore ignore = {});
/// `partial`: reductionScratch() doubles (fixed-order two-stage sums).
int64_t reductionScratch();
cudaError_t mseLoss(const float *x, const float *t, float *loss, double *partial, int64_t n,
                    cudaStream_t s);
cudaError_t mseLossGrad(const float *x, const float *t, const float *dl, float *dx,
                        int64_t n, cudaStream_t s);
cudaError_t bceWithLogits(const float *x, const float *t, float *loss, double *partial,
                          int64_t n, cudaStream_t s);
cudaError_t bceWithLogitsGrad(const float *x, const float *t, const float *dl, float *dx,
                              int64_t n, cudaStream_t s);

// Optimizers (in place allowed); lr and step are device scalars. `skip`
// (nullable): when *skip is inf or NaN (an overflowed loss-scaled step)
// every result is its input. `gradScale` (nullable, a device scalar): the
// gradient is g * *gradScale (the ops' grad_scale operand), rounded before
// anything else reads it, as fsdp.mul's product. adamw_update runs
// native::adamw (fused, with its own skip and scale); adamwUpdate is its
// f32 reference in the tests.
cudaError_t sgdUpdate(const float *p, const float *g, float *np, int64_t n, const float *lr,
                      double wd, cudaStream_t s, const float *skip = nullptr,
                      const float *gradScale = nullptr);
cudaError_t sgdMomentumUpdate(const float *p, const float *g, const float *buf, float *np,
                              float *nbuf, int64_t n, const float *lr, const float *step,
                              double momentum, double dampening, double wd, bool nesterov,
                              cudaStream_t s, const float *skip = nullptr,
                              const float *gradScale = nullptr);
/// The same with the parameters as `q` says (f32, or bf16: Params).
cudaError_t sgdUpdate(Params q, const float *g, int64_t n, const float *lr, double wd,
                      cudaStream_t s, const float *skip, const float *gradScale);
cudaError_t sgdMomentumUpdate(Params q, const float *g, const float *buf, float *nbuf, int64_t n,
                              const float *lr, const float *step, double momentum, double dampening,
                              double wd, bool nesterov, cudaStream_t s, const float *skip,
                              const float *gradScale);
cudaError_t adamwUpdate(const float *p, const float *g, const float *m, const float *v,
                        float *np, float *nm, float *nv, int64_t n, const float *lr,
                        const float *step, double beta1, double beta2, double eps,
                        double wd, cudaStream_t s);
/// LAMB, cpu::lambNorms / cpu::lambUpdate's math on the layout
/// LambLayout{segments, base, decayNumel} (runtime/core/LambLayout.h) describes, each f32
/// operation rounded as there (the same bits for the same scalars); step
/// and lr are device scalars, gradScale and skip nullable ones (as above).
/// lambNorms sums in double in a fixed order of its own (not the CPU's);
/// `partial`: lambScratch() doubles. The layout must give each parameter
/// one piece (decayNumel not inside one; cudaErrorInvalidValue otherwise).
int64_t lambScratch();
cudaError_t lambNorms(const float *p, const float *g, const float *m, const float *v, float *norms,
                      int64_t n, const std::vector<int64_t> &segments, int64_t base,
                      int64_t decayNumel, const float *step, double beta1, double beta2, double eps,
                      double wd, const float *gradScale, double *partial, cudaStream_t s);
cudaError_t lambUpdate(const float *p, const float *g, const float *m, const float *v,
                       const float *norms, float *np, float *nm, float *nv, int64_t n,
                       const std::vector<int64_t> &segments, int64_t base, int64_t decayNumel,
                       const float *lr, const float *step, double beta1, double beta2, double eps,
                       double wd, const float *gradScale, const float *skip, cudaStream_t s);
/// lambNorms / lambUpdate with the moments (and the new ones) stored in
/// bf16 (state-dtype=bf16): widened, the same f32 math, the new moments
/// rounded once, to nearest, or stochastically when ctx (the device's
/// {seed, step}) is given: stateRoundingKey(seed, step, key), element i
/// drawing as element first + i of its unit (roundMomentsToBf16Stochastic;
/// cpu::lambUpdateBf16State's bits).
cudaError_t lambNormsBf16State(const float *p, const float *g, const void *m, const void *v,
                               float *norms, int64_t n, const std::vector<int64_t> &segments,
                               int64_t base, int64_t decayNumel, const float *step, double beta1,
                               double beta2, double eps, double wd, const float *gradScale,
                               double *partial, cudaStream_t s);
cudaError_t lambUpdateBf16State(const float *p, const float *g, const void *m, const void *v,
                                const float *norms, float *np, void *nm, void *nv, int64_t n,
                                const std::vector<int64_t> &segments, int64_t base,
                                int64_t decayNumel, const float *lr, const float *step,
                                double beta1, double beta2, double eps, double wd,
                                const float *gradScale, const float *skip, const uint64_t *ctx,
                                int64_t key, uint64_t first, cudaStream_t s);
/// lambNorms / lambUpdate with the moments (and the new ones: nm, nv may be
/// m, v) stored in 8 bits (state-dtype=8bit): packed shards of n elements
/// in blocks of `block` (a power of two, as the plan check holds it;
/// runtime/core/Moments8.h), decoded, the same f32
/// math, the new moments encoded once a block (the parameters read the f32
/// moments). The norms are lambNorms' sums over the decoded moments;
/// cpu::lambUpdate8bitState's bytes for the same norms.
cudaError_t lambNorms8bitState(const float *p, const float *g, const void *m, const void *v,
                               float *norms, int64_t n, int64_t block,
                               const std::vector<int64_t> &segments, int64_t base,
                               int64_t decayNumel, const float *step, double beta1, double beta2,
                               double eps, double wd, const float *gradScale, double *partial,
                               cudaStream_t s);
cudaError_t lambUpdate8bitState(const float *p, const float *g, const void *m, const void *v,
                                const float *norms, float *np, void *nm, void *nv, int64_t n,
                                int64_t block, const std::vector<int64_t> &segments, int64_t base,
                                int64_t decayNumel, const float *lr, const float *step,
                                double beta1, double beta2, double eps, double wd,
                                const float *gradScale, const float *skip, cudaStream_t s);
/// *out = sum over the tensors of x^2, accumulated in double in a fixed
/// order. `partial`: squaredNormScratch(tensors) doubles.
int64_t squaredNormScratch(int64_t tensors);
cudaError_t squaredNorm(const std::vector<const float *> &xs, const std::vector<int64_t> &ns,
                        float *out, double *partial, cudaStream_t s);
/// *out = min(1, maxNorm / (sqrt(*sumsq) + 1e-6)).
cudaError_t clipCoef(const float *sumsq, float *out, double maxNorm, cudaStream_t s);
/// Loss-scale unscaling (fsdp.grad_coef): *out = c / *scale, c the clip
/// factor of the unscaled norm sqrt(*sumsq) / *scale (1 when maxNorm <= 0).
cudaError_t gradCoef(const float *sumsq, const float *scale, float *out, double maxNorm,
                     cudaStream_t s);

/// fsdp.quantize (ZeRO++'s qwZ and qgZ; the arithmetic of
/// runtime/core/Quantize.h, bit for bit): `parts` parts of n values of x,
/// each into shapes::quantizedBytes(n, block) bytes of out, one after
/// another; a warp per block of `block` values. x is chunks of `chunk`
/// values (dividing n) and part p is chunks p, p + parts, p + 2 parts, ...
/// (quantize's `chunks`, hierarchical qgZ); chunk == n: part p is values
/// [p n, (p + 1) n).
cudaError_t quantize(const void *x, FloatKind from, int64_t parts, int64_t n, int64_t chunk,
                     int64_t block, uint8_t *out, cudaStream_t s);
/// fsdp.dequantize: `parts` quantized parts of n values each, in order,
/// into y (parts x n values), rounded to nearest even into a narrow `to`;
/// with `reduce` ("sum" or "mean", qgZ) the parts summed into n values.
cudaError_t dequantize(const uint8_t *in, int64_t parts, int64_t n, int64_t block, void *y,
                       FloatKind to, const char *reduce, cudaStream_t s);

/// Element type conversion, round to nearest even (as cpu::floatToBf16).
cudaError_t cast(const void *x, FloatKind from, void *y, FloatKind to, int64_t n,
                 cudaStream_t s);
/// f32 -> bf16 rounded stochastically (runtime/core/StochasticRounding.h),
/// element i drawing as global element first + i, the key from ctx =
/// {seed, step} in device memory (so a replayed CUDA graph reads the step's):
/// cpu::castBf16Stochastic's bits.
cudaError_t castBf16Stochastic(const float *x, void *y, int64_t n, const uint64_t *ctx,
                               int64_t unit, uint64_t first, cudaStream_t s);

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDAKERNELS_H
