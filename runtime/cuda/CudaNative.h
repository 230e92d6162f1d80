//===- CudaNative.h - kernels on bf16 / f16 / f32 storage -------*- C++ -*-===//
//
// The fast path of the CUDA device for mixed-precision plans: kernels that
// read their tensors in the storage dtype (f32, bf16 or f16), compute in
// f32 and round once at the output, so a bf16 instruction no longer goes
// through f32 copies in scratch (CudaDevice.cpp's widened fallback, kept
// for the ops without a kernel here).
//
// Semantics: [Note: bf16 storage, f32 compute] (runtime/core/OpRules.cpp):
// inputs widened exactly, the f32 math, one round-to-nearest-even per
// output element. Where a kernel's f32 math is the reference kernel's
// (CudaKernels.cu) expression for expression, the result is bitwise that
// of the widened path; the row-wise kernels (layer norm, softmax,
// cross-entropy) reduce in another fixed order (a warp per row), so they
// agree with the reference within the f32 reduction bound, and then within
// one bf16 ulp after the rounding. test/unit/CudaFastKernelsTest.cpp checks
// both.
//
// Every tensor operand of one call has the storage dtype `t`; scalars the
// step computes (loss, its gradient, lr, step, skip_nonfinite, grad scale) stay
// f32. Pointers are device memory; functions return the launch's status.
// Deterministic: fixed-order reductions, no floating-point atomics.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDANATIVE_H
#define FSDP_RUNTIME_CUDA_CUDANATIVE_H

#include "runtime/cuda/CudaKernels.h"

#include <vector>

namespace fsdp::cuda::native {

enum class UnaryKind { Neg, Scale, Relu, Gelu, GeluExact, Silu };
enum class UnaryGradKind { Relu, Gelu, GeluExact, Silu };

/// y = f(x) (Scale: x * factor).
cudaError_t unary(FloatKind t, UnaryKind k, const void *x, void *y, int64_t n, double factor,
                  cudaStream_t s);
/// dx = f'(x) dy.
cudaError_t unaryGrad(FloatKind t, UnaryGradKind k, const void *x, const void *dy, void *dx,
                      int64_t n, cudaStream_t s);
/// y = silu(g) * u (f32 arithmetic, rounded once to t).
cudaError_t swiglu(FloatKind t, const void *g, const void *u, void *y, int64_t n,
                   cudaStream_t s);
/// dg = silu'(g) dy u, du = dy silu(g): one read of g, u, dy.
cudaError_t swigluGrad(FloatKind t, const void *g, const void *u, const void *dy, void *dg,
                       void *du, int64_t n, cudaStream_t s);
cudaError_t fill(FloatKind t, void *y, int64_t n, double v, cudaStream_t s);
/// out = a (op) b with NumPy broadcasting; a contiguous same-shape fast path.
cudaError_t binary(FloatKind t, BinaryKind k, const void *a, const Shape &sa, const void *b,
                   const Shape &sb, void *out, const Shape &so, cudaStream_t s);
cudaError_t biasAdd(FloatKind t, const void *x, const void *b, void *y, int64_t rows,
                    int64_t cols, cudaStream_t s);
cudaError_t broadcastTo(FloatKind t, const void *in, const Shape &si, void *out,
                        const Shape &so, cudaStream_t s);
/// sum_to, summing in f32: the reference order (row-major over the summed
/// dims), except that a sum over the leading dims (bias gradients) runs as a two-pass
/// column sum with sumToScratch(si, so) floats of scratch (0: none needed).
/// outF32: `out` is f32 whatever t (the sum unrounded; matmul_bias_grad's
/// and matmul_gelu_grad's f32 bias gradients of bf16 / f16 operands, a
/// widened sum_to).
int64_t sumToScratch(const Shape &si, const Shape &so);
cudaError_t sumTo(FloatKind t, const void *in, const Shape &si, void *out, const Shape &so,
                  float *scratch, cudaStream_t s, bool outF32 = false);
cudaError_t transpose(FloatKind t, const void *x, const Shape &sx,
                      const std::vector<int64_t> &perm, void *y, cudaStream_t s);
cudaError_t slice(FloatKind t, const void *x, void *y, int64_t outer, int64_t full,
                  int64_t len, int64_t inner, int64_t offset, cudaStream_t s);
cudaError_t sliceGrad(FloatKind t, const void *dy, void *dx, int64_t outer, int64_t full,
                      int64_t len, int64_t inner, int64_t offset, cudaStream_t s);
cudaError_t place(FloatKind t, const void *x, void *y, int64_t outer, int64_t full,
                  int64_t len, int64_t inner, int64_t offset, cudaStream_t s);
/// Rows of a table in dtype t (ids as CudaKernels.h's embedding).
cudaError_t embedding(FloatKind t, const void *table, const int32_t *ids, void *y, int64_t n,
                      int64_t vocab, int64_t width, long long *badPos, cudaStream_t s);
/// Floats of scratch embeddingGrad needs for n ids (sort keys).
int64_t embeddingGradScratch(int64_t n);
/// Sums each id's rows in f32 in row order (the CPU kernel's order),
/// rounds once: the ids sorted with their rows, a block per id
/// (CudaNative.cu). outF32: `dtable` is f32 whatever t (the sums
/// unrounded; a mixed-precision plan's widened embedding gradient).
cudaError_t embeddingGrad(FloatKind t, const int32_t *ids, const void *dy, void *dtable,
                          float *scratch, int64_t n, int64_t vocab, int64_t width,
                          long long *badPos, cudaStream_t s, bool outF32 = false);

// --- row-wise: a warp per row ------------------------------------------------

cudaError_t softmax(FloatKind t, const void *x, void *y, int64_t rows, int64_t cols,
                    cudaStream_t s);
cudaError_t softmaxGrad(FloatKind t, const void *y, const void *dy, void *dx, int64_t rows,
                        int64_t cols, cudaStream_t s);

/// Which layer-norm kernels run: Auto holds a row of at most 1024 columns
/// in registers (packed, in the 16-byte chunks its lanes own), Streaming
/// reads the row from memory in every pass (any width). Both give the same
/// bits; the tests compare them.
enum class LayerNormImpl { Auto, Streaming };

/// Fused layer norm forward (two-pass mean / biased variance per row, as
/// the CPU kernel).
cudaError_t layerNorm(FloatKind t, const void *x, const void *g, const void *b, void *y,
                      int64_t rows, int64_t cols, double eps, cudaStream_t s,
                      LayerNormImpl impl = LayerNormImpl::Auto);
/// Floats of scratch layerNormGrad needs: min(rows, 1024) partial column
/// sums of dg and db, their column sum's scratch, each row's mean and rstd.
int64_t layerNormGradScratch(int64_t rows, int64_t cols);
/// Fused layer norm backward: a warp per row computes the row statistics
/// again and dx, storing the row's mean and rstd; a column-parallel kernel
/// sums dg / db terms into min(rows, 1024) partials (rows w, w + W, ...
/// in order), then the partials are summed per column in order. No atomics.
/// With `acc` (layer_norm_grad_acc), dx = acc + the input gradient, added
/// in f32 before dx's one rounding. paramGradsF32: dg and db are f32
/// whatever t (the column sums unrounded; fsdp-fuse-epilogues' widened
/// gamma / beta gradients).
cudaError_t layerNormGrad(FloatKind t, const void *x, const void *g, const void *dy, void *dx,
                          void *dg, void *db, float *scratch, int64_t rows, int64_t cols,
                          double eps, cudaStream_t s, const void *acc = nullptr,
                          LayerNormImpl impl = LayerNormImpl::Auto, bool paramGradsF32 = false);
/// residual_layer_norm: sum = a + b (rounded to t and stored), then the
/// layer norm of the stored sum, one warp per row (as the CPU's add, then
/// layer_norm).
cudaError_t residualLayerNorm(FloatKind t, const void *a, const void *b, const void *g,
                              const void *beta, void *sum, void *y, int64_t rows, int64_t cols,
                              double eps, cudaStream_t s,
                              LayerNormImpl impl = LayerNormImpl::Auto);

/// RMS norm (Llama): y = x / rms(x) * w, one warp per row, f32 arithmetic.
cudaError_t rmsNorm(FloatKind t, const void *x, const void *w, void *y, int64_t rows,
                    int64_t cols, double eps, cudaStream_t s);
/// Floats of scratch rmsNormGrad needs: min(rows, 1024) partial column
/// sums of dw, their column sum's scratch, each row's statistics (0, rstd).
int64_t rmsNormGradScratch(int64_t rows, int64_t cols);
/// RMS norm backward: dx per row (one warp), dw as the layer norm's dg:
/// fixed-order column partials summed per column (no atomics; the same
/// bits every run). With
/// `acc` (rms_norm_grad_acc), dx = acc + the input gradient, added in f32
/// before dx's one rounding.
cudaError_t rmsNormGrad(FloatKind t, const void *x, const void *w, const void *dy, void *dx,
                        void *dw, float *scratch, int64_t rows, int64_t cols, double eps,
                        cudaStream_t s, const void *acc = nullptr);
/// residual_rms_norm: sum = a + b (rounded to t and stored), then the RMS
/// norm of the stored sum, one warp per row (as the CPU's add, then rms_norm).
cudaError_t residualRmsNorm(FloatKind t, const void *a, const void *b, const void *w, void *sum,
                            void *y, int64_t rows, int64_t cols, double eps, cudaStream_t s);
/// The rotary embedding's cos / sin of t * theta^(-2i/D), [T, D/2] each, as
/// the CPU kernel computes them (double, rounded to float).
void ropeAngles(int64_t T, int64_t D, double theta, std::vector<float> &cs,
                std::vector<float> &sn);
/// Rotary embedding of [B, T, C] (heads of C / heads), or its gradient (the
/// inverse rotation), with ropeAngles' tables in device memory.
cudaError_t rope(FloatKind t, const void *x, void *y, int64_t B, int64_t T, int64_t C,
                 int64_t heads, const float *cs, const float *sn, bool grad, cudaStream_t s);

/// Fused softmax + cross-entropy over the vocabulary, reading the logits in
/// their storage dtype (no f32 copy of the logits is written): one online
/// max / sum-of-exp pass per row, the per-row losses in `scratch` (rows
/// doubles), then their mean in a fixed order into *loss (f32). Row r
/// starts at r * stride; columns from `classes` on are padding (left out;
/// fsdp-pad-classes). Rows of 16-byte aligned, whole 16-byte chunks (a
/// padded head's) are read 16 bytes per load. `smoothing` e: label
/// smoothing (the target (1 - e) onehot + e / classes; e != 0 adds a pass
/// for each row's sum of logits), as the CPU kernels compute it.
/// `ignore`: ignore_index (CeIgnore), on the three kernels alike.
cudaError_t crossEntropy(FloatKind t, const void *logits, const int32_t *labels, float *loss,
                         double *scratch, int64_t rows, int64_t classes, int64_t stride,
                         long long *badPos, cudaStream_t s, double smoothing = 0,
                         CeIgnore ignore = {});
/// dlogits (dtype t) = (softmax - target) * dloss / rows, 0 in the padding
/// columns; dlogits may be logits (in place). A row of 16-byte chunks of
/// at most 112 KB (GPT-2's padded bf16 head: 98 KB) is read once into
/// shared memory, and the statistics and the gradient read that copy: one
/// read and one write of the logits. Otherwise (or with cacheRow false) a
/// read pass for the statistics and a read + write pass. Same bits either
/// way.
cudaError_t crossEntropyGrad(FloatKind t, const void *logits, const int32_t *labels,
                             const float *dloss, void *dlogits, int64_t rows, int64_t classes,
                             int64_t stride, long long *badPos, cudaStream_t s,
                             bool cacheRow = true, double smoothing = 0, CeIgnore ignore = {});
/// cross_entropy_fused: the loss (as crossEntropy, `scratch` its rows'
/// terms) and dlogits (as crossEntropyGrad) from one read of each row: the
/// gradient kernel writes each row's loss term from the statistics it
/// computed for the gradient, then the mean. Same bits as the two calls;
/// dlogits may be logits (in place).
cudaError_t crossEntropyFused(FloatKind t, const void *logits, const int32_t *labels,
                              const float *dloss, float *loss, void *dlogits, double *scratch,
                              int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                              cudaStream_t s, bool cacheRow = true, double smoothing = 0,
                              CeIgnore ignore = {});

// --- optimizer -----------------------------------------------------------------

/// Fused AdamW over a flat shard: f32 master p and state m, v; the gradient
/// in `gradKind` (f32 or bf16/f16) times *gradScale when gradScale is not
/// null (loss-scale unscaling, clipping); when skip is not null and *skip
/// is inf or NaN the update is skipped: np, nm, nv get p, m, v unchanged
/// (copies when not in place) — the optimizer ops' `skip_nonfinite` operand
/// (the global squared norm of the loss-scaled gradients).
/// lr, step: device scalars. The math is cpu::adamwUpdate's.
cudaError_t adamw(const float *p, const void *g, FloatKind gradKind, const float *m,
                  const float *v, float *np, float *nm, float *nv, int64_t n, const float *lr,
                  const float *step, double beta1, double beta2, double eps, double wd,
                  const float *gradScale, const float *skip, cudaStream_t s);
/// The same with the parameters as `q` says (f32, or bf16: Params).
cudaError_t adamw(Params q, const void *g, FloatKind gradKind, const float *m, const float *v,
                  float *nm, float *nv, int64_t n, const float *lr, const float *step, double beta1,
                  double beta2, double eps, double wd, const float *gradScale, const float *skip,
                  cudaStream_t s);

/// adamw with the moments m, v (and nm, nv) stored in bf16 (state-dtype=
/// bf16) and an f32 gradient: the same f32 math on the widened moments,
/// the new moments rounded once, to nearest, or stochastically when ctx
/// (the device's {seed, step}) is not null: stateRoundingKey(seed, step,
/// key), element i drawing as element first + i of its unit
/// (roundMomentsToBf16Stochastic). The parameters as `q` says (Params;
/// their draws are another stream). cpu::adamwUpdateBf16State's bits.
cudaError_t adamwBf16State(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, const float *lr, const float *step, double beta1,
                           double beta2, double eps, double wd, const float *gradScale,
                           const float *skip, const uint64_t *ctx, int64_t key, uint64_t first,
                           cudaStream_t s);

/// adamw_update with the moments stored in 8 bits (state-dtype=8bit):
/// m, v (and nm, nv, possibly the same) packed shards of n elements in
/// blocks of `block` (runtime/core/Moments8.h); elements [0, decayed)
/// take weight decay wd, the rest none; the parameters as `q` says
/// (Params). cpu::adamwUpdate8bitState's bits.
cudaError_t adamw8bitState(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, int64_t block, const float *lr, const float *step,
                           double beta1, double beta2, double eps, double wd, int64_t decayed,
                           const float *gradScale, const float *skip, cudaStream_t s);

/// adamw8bitState with the moments stored in 4 bits (state-dtype=4bit,
/// runtime/core/Moments4.h: two codes a byte; block even).
/// cpu::adamwUpdate4bitState's bits.
cudaError_t adamw4bitState(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, int64_t block, const float *lr, const float *step,
                           double beta1, double beta2, double eps, double wd, int64_t decayed,
                           const float *gradScale, const float *skip, cudaStream_t s);

/// sgd_momentum_update with the buffer stored in 8 bits (state-dtype=8bit):
/// buf (and nbuf, possibly the same) a packed shard of n elements in
/// blocks of `block`, coded as adamw8bitState's exp_avg; elements
/// [0, decayed) take weight decay wd, the rest none; the parameters as `q`
/// says (Params). cpu::sgdMomentumUpdate8bitState's bits.
cudaError_t sgdMomentum8bitState(Params q, const float *g, const void *buf, void *nbuf, int64_t n,
                                 int64_t block, const float *lr, const float *step, double momentum,
                                 double dampening, double wd, bool nesterov, int64_t decayed,
                                 const float *gradScale, const float *skip, cudaStream_t s);

/// sgd_momentum_update with the buffer (and the new one) stored in bf16
/// and f32 p, g: kernels::sgdMomentumUpdate's f32 element on the widened
/// buffer, the new buffer rounded once, to nearest, or stochastically when
/// ctx is given (roundToBf16Stochastic, keyed as adamwBf16State's).
/// The parameters as `q` says (Params). cpu::sgdMomentumUpdateBf16State's
/// bits.
cudaError_t sgdMomentumBf16State(Params q, const float *g, const void *buf, void *nbuf, int64_t n,
                                 const float *lr, const float *step, double momentum,
                                 double dampening, double wd, bool nesterov, const float *gradScale,
                                 const float *skip, const uint64_t *ctx, int64_t key,
                                 uint64_t first, cudaStream_t s);

} // namespace fsdp::cuda::native

#endif // FSDP_RUNTIME_CUDA_CUDANATIVE_H
