//===- Kernels.h - CPU kernels for every op of a plan -----------*- C++ -*-===//
//
// One function per op (forward, backward and optimizer), on contiguous
// row-major data, templated on the element type so that the tests can check
// every vector-Jacobian product against finite differences in double
// precision; the runtime uses the float instantiation. GEMM goes through
// OpenBLAS; elementwise and row-wise loops are split across threads with
// OpenMP when they are large enough to pay for it. Reductions run in a
// fixed order so results do not depend on the thread count... except inside
// GEMM, which is OpenBLAS's business.
//
// Semantics follow PyTorch exactly where the oracle compares against it:
// GELU is the tanh form, layer norm uses the biased variance with epsilon
// inside the square root, RMSNorm and RoPE are HF transformers' Llama ones
// (rotate-half pairs), the losses are means, SGD and AdamW are
// torch.optim's single-tensor implementations.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CPU_KERNELS_H
#define FSDP_RUNTIME_CPU_KERNELS_H

#include "runtime/core/LambLayout.h"

#include <cstdint>
#include <vector>

namespace fsdp::cpu {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape &s);

enum class BinaryKind { Add, Sub, Mul, Div };

/// out = a (op) b with NumPy broadcasting; `so` is the broadcast shape.
template <typename T>
void binary(BinaryKind k, const T *a, const Shape &sa, const T *b,
            const Shape &sb, T *out, const Shape &so);

/// out[i] = `in` broadcast to `so` (NumPy rules).
template <typename T>
void broadcastTo(const T *in, const Shape &si, T *out, const Shape &so);
/// The adjoint of broadcastTo: sums `in` (shape si) down to `so`.
template <typename T>
void sumTo(const T *in, const Shape &si, T *out, const Shape &so);

template <typename T> void neg(const T *x, T *y, int64_t n);
template <typename T> void scale(const T *x, T *y, int64_t n, double f);
/// y = x * keep / (1 - p) (`scale`) with keep from runtime/core/Dropout.h:
/// element i is global element first + i.
template <typename T>
void dropout(const T *x, T *y, int64_t n, uint64_t key, uint64_t first, uint32_t threshold,
             double scale);
/// f32 -> bf16 bits rounded stochastically (runtime/core/StochasticRounding.h):
/// element i draws with global index first + i.
void castBf16Stochastic(const float *x, uint16_t *y, int64_t n, uint64_t key, uint64_t first);
template <typename T> void fill(T *y, int64_t n, double v);
template <typename T> void relu(const T *x, T *y, int64_t n);
template <typename T> void reluGrad(const T *x, const T *dy, T *dx, int64_t n);
template <typename T> void gelu(const T *x, T *y, int64_t n);
template <typename T> void geluGrad(const T *x, const T *dy, T *dx, int64_t n);
/// GELU, exact (erf) form, and its VJP.
template <typename T> void geluExact(const T *x, T *y, int64_t n);
template <typename T> void geluExactGrad(const T *x, const T *dy, T *dx, int64_t n);
/// Row-wise softmax over the last dimension (`cols`).
template <typename T> void softmax(const T *x, T *y, int64_t rows, int64_t cols);
template <typename T>
void softmaxGrad(const T *y, const T *dy, T *dx, int64_t rows, int64_t cols);
template <typename T>
void biasAdd(const T *x, const T *b, T *y, int64_t rows, int64_t cols);

/// C[b] = op(A[b]) op(B[b]) for b < batch; A is [m,k] ([k,m] if transA),
/// B is [k,n] ([n,k] if transB). With `accumulate`, C[b] += the product
/// (the BLAS's beta = 1).
template <typename T>
void matmul(const T *a, const T *b, T *c, int64_t batch, int64_t m, int64_t n, int64_t k,
            bool transA, bool transB, bool accumulate = false);

template <typename T>
void layerNorm(const T *x, const T *g, const T *b, T *y, int64_t rows,
               int64_t cols, double eps);
template <typename T>
void layerNormGrad(const T *x, const T *g, const T *dy, T *dx, T *dg, T *db,
                   int64_t rows, int64_t cols, double eps);

/// Multi-head attention: q and y are [B, T, C] with `heads` heads of
/// D = C / heads; k and v are [B, T, kvHeads * D], kvHeads dividing heads
/// (grouped-query attention: query head h reads key/value head
/// h / (heads / kvHeads)); kvHeads = 0 means heads. `lse` ([B, heads, T],
/// may be null in the forward) is each query row's log-sum-exp of its
/// scaled, masked scores; the backward pass forms the probabilities from
/// it as exp(S - lse).
/// `rows`: the operands' row strides in elements (q and dq; k, v, dk and
/// dv; y and dy), 0 for dense rows; attention_qkv reads q, k, v as column
/// ranges of one packed [B, T, C + 2 kvHeads D] tensor and writes the
/// gradients into the packed gradient's.
struct AttentionRows {
  int64_t q = 0, kv = 0, y = 0;
};
template <typename T>
void attention(const T *q, const T *k, const T *v, T *y, T *lse, int64_t B,
               int64_t Tn, int64_t C, int64_t heads, bool causal,
               int64_t kvHeads = 0, AttentionRows rows = {});
template <typename T>
void attentionGrad(const T *q, const T *k, const T *v, const T *lse,
                   const T *dy, T *dq, T *dk, T *dv, int64_t B, int64_t Tn,
                   int64_t C, int64_t heads, bool causal, int64_t kvHeads = 0,
                   AttentionRows rows = {});

/// SiLU, x * sigmoid(x), and its VJP.
template <typename T> void silu(const T *x, T *y, int64_t n);
template <typename T> void siluGrad(const T *x, const T *dy, T *dx, int64_t n);
/// y = silu(g) * u: bitwise silu then mul.
template <typename T> void swiglu(const T *g, const T *u, T *y, int64_t n);
/// dg = silu_grad(g, dy * u), du = dy * silu(g): bitwise the two muls and
/// silu_grad autodiff derives for mul(silu(g), u).
template <typename T>
void swigluGrad(const T *g, const T *u, const T *dy, T *dg, T *du, int64_t n);

/// RMSNorm over rows of `cols`: y = x / sqrt(mean(x^2) + eps) * w.
template <typename T>
void rmsNorm(const T *x, const T *w, T *y, int64_t rows, int64_t cols,
             double eps);
template <typename T>
void rmsNormGrad(const T *x, const T *w, const T *dy, T *dx, T *dw,
                 int64_t rows, int64_t cols, double eps);

/// Rotary position embedding on [B, T, C], C = heads * D, D even, in the
/// rotate-half layout (HF Llama): pair (i, i + D/2) of each head at
/// position t turns by t * theta^(-2i/D). ropeGrad turns back.
template <typename T>
void rope(const T *x, T *y, int64_t B, int64_t Tn, int64_t C, int64_t heads,
          double theta);
template <typename T>
void ropeGrad(const T *dy, T *dx, int64_t B, int64_t Tn, int64_t C,
              int64_t heads, double theta);

/// Returns the index of the first out-of-range id, or -1.
template <typename T, typename I>
int64_t embedding(const T *table, const I *ids, T *y, int64_t n, int64_t vocab,
                  int64_t width);
template <typename T, typename I>
int64_t embeddingGrad(const I *ids, const T *dy, T *dtable, int64_t n,
                      int64_t vocab, int64_t width);

template <typename T>
void transpose(const T *x, const Shape &sx, const std::vector<int64_t> &perm,
               T *y);
/// Slices along `dim`: x is [outer, full, inner], y is [outer, len, inner].
template <typename T>
void slice(const T *x, T *y, int64_t outer, int64_t full, int64_t len,
           int64_t inner, int64_t offset);
template <typename T>
void sliceGrad(const T *dy, T *dx, int64_t outer, int64_t full, int64_t len,
               int64_t inner, int64_t offset);

/// Cross-entropy mean over `rows`; returns the first bad label index or -1.
/// Row r starts at r * stride (0: classes); the columns from `classes` on
/// are padding (fsdp-pad-classes): left out of the softmax, gradient 0.
/// `smoothing` e in [0, 1]: the target is (1 - e) on the label plus e /
/// classes on each class (PyTorch's label_smoothing); e = 0 is the plain
/// one-hot loss, computed as without the option (the same bits).
/// With `normalizer` (PyTorch's ignore_index): a row whose label is
/// `ignore` adds 0 to the loss and gets a zero gradient row, and the loss
/// is the kept rows' sum over *normalizer (the kept-label count; <= 0: a
/// loss and gradient of 0) instead of the mean over `rows`.
template <typename T, typename I>
int64_t crossEntropy(const T *logits, const I *labels, T *loss, int64_t rows, int64_t classes,
                     int64_t stride = 0, double smoothing = 0, const T *normalizer = nullptr,
                     int64_t ignore = 0);
template <typename T, typename I>
int64_t crossEntropyGrad(const T *logits, const I *labels, const T *dloss, T *dlogits, int64_t rows,
                         int64_t classes, int64_t stride = 0, double smoothing = 0,
                         const T *normalizer = nullptr, int64_t ignore = 0);
/// count_labels: how many of the n labels differ from `ignore`, over
/// `divisor`, rounded once to float.
template <typename I>
float countLabels(const I *labels, int64_t n, int64_t ignore, int64_t divisor);
template <typename T> void mseLoss(const T *x, const T *t, T *loss, int64_t n);
template <typename T>
void mseLossGrad(const T *x, const T *t, const T *dl, T *dx, int64_t n);
template <typename T> void bceWithLogits(const T *x, const T *t, T *loss, int64_t n);
template <typename T>
void bceWithLogitsGrad(const T *x, const T *t, const T *dl, T *dx, int64_t n);

// Optimizers: in place allowed (p == newP, m == newM, ...). The gradient
// is g[i] * gradScale (the update ops' grad_scale operand; 1 is exact).
template <typename T>
void sgdUpdate(const T *p, const T *g, T *np, int64_t n, double lr, double wd,
               T gradScale = T(1));
template <typename T>
void sgdMomentumUpdate(const T *p, const T *g, const T *buf, T *np, T *nbuf,
                       int64_t n, double lr, int64_t step, double momentum,
                       double dampening, double wd, bool nesterov,
                       T gradScale = T(1));
template <typename T>
void adamwUpdate(const T *p, const T *g, const T *m, const T *v, T *np, T *nm,
                 T *nv, int64_t n, double lr, int64_t step, double beta1,
                 double beta2, double eps, double wd, T gradScale = T(1));
/// How adamwUpdateBf16State writes the moments: to nearest even, or
/// stochastically with the draws of `key` (stateRoundingKey), element i
/// drawing as element first + i of its unit (roundMomentsToBf16Stochastic).
struct MomentRounding {
  bool stochastic = false;
  uint64_t key = 0, first = 0;
};
/// sgdMomentumUpdate<float> with the buffer stored in bf16: widened, the
/// same f32 arithmetic (the parameter's update reads the f32 buffer), the
/// new buffer rounded once as `rounding` says (stochastically: one draw an
/// element, roundToBf16Stochastic).
void sgdMomentumUpdateBf16State(const float *p, const float *g, const uint16_t *buf, float *np,
                                uint16_t *nbuf, int64_t n, double lr, int64_t step, double momentum,
                                double dampening, double wd, bool nesterov, float gradScale,
                                const MomentRounding &rounding);
/// adamwUpdate<float> with the moments stored in bf16: widened, the same
/// f32 arithmetic (the parameter's update reads the f32 moments), the new
/// moments rounded once as `rounding` says.
void adamwUpdateBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                          float *np, uint16_t *nm, uint16_t *nv, int64_t n, double lr, int64_t step,
                          double beta1, double beta2, double eps, double wd, float gradScale,
                          const MomentRounding &rounding);

/// adamwUpdate<float> with the moments stored in 8 bits (state-dtype=8bit,
/// runtime/core/Moments8.h): m and v are packed shards of n elements in
/// blocks of `block` (codes, then the blocks' f32 scales); nm, nv may be
/// m, v (in place). Each block is decoded (exp_avg_sq as its root
/// squared), updated with adamwUpdate's f32 arithmetic (the parameter's
/// update reads the f32 moments) and encoded once. Elements [0, decayed)
/// take weight decay wd, the rest none (weight-decay-params=matrices).
/// Runs with AVX2 where the CPU has it (Isa::Best), every build storing the
/// same bytes; tests pick each (Isa::Avx2 without AVX2: the baseline).
enum class Isa { Best, Baseline, Avx2 };
bool cpuHasAvx2();
void adamwUpdate8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                          float *np, uint8_t *nm, uint8_t *nv, int64_t n, int64_t block, double lr,
                          int64_t step, double beta1, double beta2, double eps, double wd,
                          int64_t decayed, float gradScale, Isa isa = Isa::Best);
/// adamwUpdate8bitState over elements [from, from + count) of the operand
/// only (from a multiple of block; count one too unless it ends the
/// operand), its parameters read from pf and written to npf (may be pf),
/// f32 pieces of count elements: master-dtype=bf16 widens its bf16
/// parameters a piece at a time. g, m, v, nm, nv are the whole operand's.
void adamwUpdate8bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                               const float *g, const uint8_t *m, const uint8_t *v, uint8_t *nm,
                               uint8_t *nv, int64_t n, int64_t block, double lr, int64_t step,
                               double beta1, double beta2, double eps, double wd, int64_t decayed,
                               float gradScale);

/// adamwUpdate8bitState with the moments stored in 4 bits (state-dtype=
/// 4bit, runtime/core/Moments4.h: two codes a byte, then the blocks' f32
/// scales; block even), the same f32 step: each block decoded, updated,
/// encoded once. Every build stores the same bytes.
void adamwUpdate4bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                          float *np, uint8_t *nm, uint8_t *nv, int64_t n, int64_t block, double lr,
                          int64_t step, double beta1, double beta2, double eps, double wd,
                          int64_t decayed, float gradScale, Isa isa = Isa::Best);
/// adamwUpdate4bitState over elements [from, from + count) (as
/// adamwUpdate8bitStatePiece).
void adamwUpdate4bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                               const float *g, const uint8_t *m, const uint8_t *v, uint8_t *nm,
                               uint8_t *nv, int64_t n, int64_t block, double lr, int64_t step,
                               double beta1, double beta2, double eps, double wd, int64_t decayed,
                               float gradScale);

/// sgdMomentumUpdate<float> with the buffer stored in 8 bits (state-dtype=
/// 8bit): buf a packed shard of n elements in blocks of `block`, coded as
/// exp_avg is (a sign and E4M3; runtime/core/Moments8.h); nbuf may be buf.
/// Each block decoded, updated with sgdMomentumUpdate's f32 arithmetic
/// (the parameter's update reads the f32 buffer) and encoded once.
/// Elements [0, decayed) take weight decay wd, the rest none. `isa` as
/// adamwUpdate8bitState's (every build the same bytes).
void sgdMomentumUpdate8bitState(const float *p, const float *g, const uint8_t *buf, float *np,
                                uint8_t *nbuf, int64_t n, int64_t block, double lr, int64_t step,
                                double momentum, double dampening, double wd, bool nesterov,
                                int64_t decayed, float gradScale, Isa isa = Isa::Best);
/// The same over elements [from, from + count) (as adamwUpdate8bitStatePiece).
void sgdMomentumUpdate8bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                                     const float *g, const uint8_t *buf, uint8_t *nbuf, int64_t n,
                                     int64_t block, double lr, int64_t step, double momentum,
                                     double dampening, double wd, bool nesterov, int64_t decayed,
                                     float gradScale, Isa isa = Isa::Best);

/// LAMB (timm's Lamb, apex FusedLAMB's defaults: grad averaging, bias
/// correction, the trust ratio only where weight decay applies, no trust
/// clipping) over an operand of n elements, a whole FSDP unit's flat
/// parameters or one shard of them, laid out as a LambLayout says
/// (runtime/core/LambLayout.h, shared with the plan check and CUDA).
using ::fsdp::LambLayout;
using ::fsdp::LambPiece;
using ::fsdp::lambPieces;
/// lamb_norms: norms[k] = the sum of p^2 over this operand's elements of
/// parameter k, norms[K + k] = the sum of u^2, u the update direction
/// m_hat / (sqrt(v_hat) + eps) + wd p (of the moments this step would
/// write: m and v are only read); both in double, in a fixed order, stored
/// as T. A parameter outside the operand gets 0; padding adds nothing.
template <typename T>
void lambNorms(const T *p, const T *g, const T *m, const T *v, T *norms, int64_t n,
               const LambLayout &layout, int64_t step, double beta1, double beta2, double eps,
               double wd, T gradScale = T(1));
/// lamb_update: the moments as AdamW's, then p -= lr * trust_k * u with
/// trust_k = sqrt(norms[k]) / sqrt(norms[K + k]) (the all-reduced sums of
/// lamb_norms) where parameter k decays and both sums are positive, else 1
/// (padding: 1). In place allowed.
template <typename T>
void lambUpdate(const T *p, const T *g, const T *m, const T *v, const T *norms, T *np, T *nm, T *nv,
                int64_t n, const LambLayout &layout, double lr, int64_t step, double beta1,
                double beta2, double eps, double wd, T gradScale = T(1));
/// lambNorms<float> / lambUpdate<float> with the moments stored in bf16
/// (state-dtype=bf16): widened, the same f32 arithmetic, the new moments
/// rounded once as `rounding` says (as adamwUpdateBf16State's).
void lambNormsBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                        float *norms, int64_t n, const LambLayout &layout, int64_t step,
                        double beta1, double beta2, double eps, double wd, float gradScale);
void lambUpdateBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                         const float *norms, float *np, uint16_t *nm, uint16_t *nv, int64_t n,
                         const LambLayout &layout, double lr, int64_t step, double beta1,
                         double beta2, double eps, double wd, float gradScale,
                         const MomentRounding &rounding);
/// lambNorms<float> / lambUpdate<float> with the moments stored in 8 bits
/// (state-dtype=8bit): m, v, nm, nv packed shards of n elements in blocks
/// of `block` (runtime/core/Moments8.h; nm, nv may be m, v). The norms are
/// lambNorms<float>'s over the decoded moments (exp_avg_sq as its root
/// squared); the update decodes each block, steps it with
/// lambUpdate<float>'s f32 arithmetic (the parameters read the f32 moments,
/// as the norms' direction does) and encodes the new moments once. A block
/// may hold several parameters, each with its own trust ratio. `isa` as
/// adamwUpdate8bitState's (every build the same bytes).
void lambNorms8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                        float *norms, int64_t n, int64_t block, const LambLayout &layout,
                        int64_t step, double beta1, double beta2, double eps, double wd,
                        float gradScale);
void lambUpdate8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                         const float *norms, float *np, uint8_t *nm, uint8_t *nv, int64_t n,
                         int64_t block, const LambLayout &layout, double lr, int64_t step,
                         double beta1, double beta2, double eps, double wd, float gradScale,
                         Isa isa = Isa::Best);
/// Sum of squares, accumulated in double.
template <typename T> double squaredNorm(const T *x, int64_t n);
/// fsdp.grad_coef: the factor that unscales loss-scaled gradients (and
/// clips them when maxNorm > 0): the clip factor min(1, maxNorm / (norm +
/// 1e-6)) of the unscaled norm sqrt(sumsq) / scale (1 without clipping),
/// rounded to f32, divided by the scale. With a power-of-two scale the
/// division is exact, so scaled gradients times this factor equal the
/// unscaled run's bits.
float gradCoef(float sumsq, float scale, double maxNorm);

/// IEEE half / bfloat16 conversions (round to nearest even).
uint16_t floatToBf16(float f);
float bf16ToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float halfToFloat(uint16_t h);

/// ZeRO++'s qwZ (fsdp.quantize, runtime/core/Quantize.h's arithmetic) over
/// the cores: n values of x into one quantized part of
/// shapes::quantizedBytes(n, block) bytes.
void quantize(const float *x, int64_t n, int64_t block, uint8_t *out);
/// The element type fsdp.dequantize writes.
enum class DequantizeTo { F32, BF16, F16 };
/// fsdp.dequantize: `parts` quantized parts of n values each, in order,
/// into y (parts x n values of `to`, rounded to nearest even if narrow).
void dequantize(const uint8_t *in, int64_t parts, int64_t n, int64_t block, void *y,
                DequantizeTo to);
/// fsdp.dequantize with `reduce` (ZeRO++'s qgZ): `parts` quantized parts
/// of n values each summed (mean: divided by parts) into y's n values.
void dequantizeSum(const uint8_t *in, int64_t parts, int64_t n, int64_t block, bool mean, void *y,
                   DequantizeTo to);

} // namespace fsdp::cpu

#endif // FSDP_RUNTIME_CPU_KERNELS_H
