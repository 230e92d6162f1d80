//===- Kernels.cpp - CPU kernels for every op of a plan -------------------===//
//
// See Kernels.h. Loops are written for clarity first; the hot ones (GEMM,
// elementwise, row-wise softmax / layer norm, attention over heads) are
// parallel. A loop runs in parallel only above kParallelGrain elements,
// below which thread start-up costs more than it saves.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Kernels.h"

#include "runtime/core/Dropout.h"
#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/StochasticRounding.h"

#include "runtime/core/Bf16.h"
#include "runtime/core/Quantize.h"
#include "runtime/core/ShapeRules.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace fsdp::cpu {

namespace {
constexpr int64_t kParallelGrain = 1 << 15;

/// Row-major strides of `s`.
Shape stridesOf(const Shape &s) {
  Shape st(s.size(), 1);
  for (int64_t i = (int64_t)s.size() - 2; i >= 0; --i)
    st[i] = st[i + 1] * s[i + 1];
  return st;
}

/// Strides of `in` seen through a broadcast to `out`: 0 along broadcast
/// dimensions (missing or of size 1).
Shape broadcastStrides(const Shape &in, const Shape &out) {
  Shape st(out.size(), 0);
  Shape own = stridesOf(in);
  size_t lead = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i)
    st[lead + i] = in[i] == 1 ? 0 : own[i];
  return st;
}

/// Calls f(outIndex, inOffset) for every element of `out`, with inOffset
/// the offset of the broadcast source element.
template <typename F>
void forEachBroadcast(const Shape &in, const Shape &out, F f) {
  Shape bs = broadcastStrides(in, out);
  int64_t n = numel(out);
  size_t r = out.size();
  std::vector<int64_t> idx(r, 0);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    f(i, off);
    for (int64_t d = (int64_t)r - 1; d >= 0; --d) {
      if (++idx[d] < out[d]) {
        off += bs[d];
        break;
      }
      off -= bs[d] * (out[d] - 1);
      idx[d] = 0;
    }
  }
}

/// True when `small` (leading 1s aside) is the trailing dims of `big`:
/// element i of `big` then meets element i % numel(small) of `small` (a
/// bias over rows, a position table over a batch).
bool repeatsOverRows(const Shape &small, const Shape &big) {
  size_t lead = 0;
  while (lead < small.size() && small[lead] == 1)
    ++lead;
  size_t k = small.size() - lead;
  if (k > big.size() || k == 0)
    return false;
  for (size_t d = 0; d < k; ++d)
    if (small[lead + d] != big[big.size() - k + d])
      return false;
  return true;
}

template <typename T> inline T applyBinary(BinaryKind k, T a, T b) {
  switch (k) {
  case BinaryKind::Add:
    return a + b;
  case BinaryKind::Sub:
    return a - b;
  case BinaryKind::Mul:
    return a * b;
  case BinaryKind::Div:
    return a / b;
  }
  return a;
}
} // namespace

int64_t numel(const Shape &s) {
  int64_t n = 1;
  for (int64_t d : s)
    n *= d;
  return n;
}

template <typename T>
void binary(BinaryKind k, const T *a, const Shape &sa, const T *b,
            const Shape &sb, T *out, const Shape &so) {
  int64_t n = numel(so);
  int64_t na = numel(sa), nb = numel(sb);
  if (na == n && nb == n) {
#pragma omp parallel for if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i)
      out[i] = applyBinary(k, a[i], b[i]);
    return;
  }
  if (na == n && nb == 1) {
    T bv = b[0];
#pragma omp parallel for if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i)
      out[i] = applyBinary(k, a[i], bv);
    return;
  }
  // One side repeats over the other's leading dims: rows of a loop the
  // compiler vectorizes (the general walk below costs ~2 ns an element).
  if (na == n && nb > 0 && repeatsOverRows(sb, so)) {
#pragma omp parallel for if (n > kParallelGrain)
    for (int64_t r = 0; r < n / nb; ++r)
      for (int64_t j = 0; j < nb; ++j)
        out[r * nb + j] = applyBinary(k, a[r * nb + j], b[j]);
    return;
  }
  if (nb == n && na > 0 && repeatsOverRows(sa, so)) {
#pragma omp parallel for if (n > kParallelGrain)
    for (int64_t r = 0; r < n / na; ++r)
      for (int64_t j = 0; j < na; ++j)
        out[r * na + j] = applyBinary(k, a[j], b[r * na + j]);
    return;
  }
  // General case: walk the output once, with both sources' offsets.
  Shape ba = broadcastStrides(sa, so), bb = broadcastStrides(sb, so);
  size_t r = so.size();
  std::vector<int64_t> idx(r, 0);
  int64_t oa = 0, ob = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = applyBinary(k, a[oa], b[ob]);
    for (int64_t d = (int64_t)r - 1; d >= 0; --d) {
      if (++idx[d] < so[d]) {
        oa += ba[d];
        ob += bb[d];
        break;
      }
      oa -= ba[d] * (so[d] - 1);
      ob -= bb[d] * (so[d] - 1);
      idx[d] = 0;
    }
  }
}

template <typename T>
void broadcastTo(const T *in, const Shape &si, T *out, const Shape &so) {
  int64_t n = numel(si);
  if (n > 0 && repeatsOverRows(si, so)) {
    for (int64_t r = 0; r < numel(so) / n; ++r)
      std::memcpy(out + r * n, in, sizeof(T) * n);
    return;
  }
  forEachBroadcast(si, so, [&](int64_t i, int64_t off) { out[i] = in[off]; });
}

template <typename T>
void sumTo(const T *in, const Shape &si, T *out, const Shape &so) {
  int64_t n = numel(so);
  if (n == numel(si)) {
    std::memcpy(out, in, sizeof(T) * n);
    return;
  }
  std::fill(out, out + n, T(0));
  if (n > 0 && repeatsOverRows(so, si)) {
    // A sum over rows (a bias gradient): each output adds its rows in the
    // order the general walk does, row 0 first, so the sums are the same
    // bits; the inner loop vectorizes.
    for (int64_t r = 0; r < numel(si) / n; ++r)
      for (int64_t c = 0; c < n; ++c)
        out[c] += in[r * n + c];
    return;
  }
  forEachBroadcast(so, si, [&](int64_t i, int64_t off) { out[off] += in[i]; });
}

template <typename T> void neg(const T *x, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    y[i] = -x[i];
}

template <typename T> void scale(const T *x, T *y, int64_t n, double f) {
  T tf = (T)f;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    y[i] = x[i] * tf;
}

template <typename T>
void dropout(const T *x, T *y, int64_t n, uint64_t key, uint64_t first, uint32_t threshold,
             double scale) {
  T s = (T)scale;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    y[i] = dropoutKeep(key, first + (uint64_t)i, threshold) ? x[i] * s : T(0);
}

void castBf16Stochastic(const float *x, uint16_t *y, int64_t n, uint64_t key, uint64_t first) {
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    y[i] = roundToBf16Stochastic(x[i], key, first + (uint64_t)i);
}

template <typename T> void fill(T *y, int64_t n, double v) {
  std::fill(y, y + n, (T)v);
}

template <typename T> void relu(const T *x, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    y[i] = x[i] > 0 ? x[i] : T(0);
}

template <typename T> void reluGrad(const T *x, const T *dy, T *dx, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    // Both loads unconditional: a select the compiler vectorizes. Written
    // as `x > 0 ? dy : 0` it became a branch per element, mispredicted on
    // about half of them (2 ns per element, 8x the bandwidth bound).
    T g = dy[i];
    dx[i] = x[i] > T(0) ? g : T(0);
  }
}

// GELU, tanh form (PyTorch approximate='tanh'):
//   y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Evaluated as y = x s with s = sigmoid(2u) = 1 / (1 + exp(-2u)), since
// 0.5 (1 + tanh(u)) = sigmoid(2u): one exp per element instead of a tanh
// (3.7 vs 14 ns per element on the 2-core VM; GELU and its gradient took
// 37% of the small GPT's step with tanh), and no cancellation in 1 + tanh(u)
// for large negative x. Limits: exp(-2u) -> inf gives s = 0 (y = -0 as
// before), exp(-2u) -> 0 gives s = 1.
// Gradient: 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s) with t = tanh(u),
//   dy/dx = s + 2 x s (1 - s) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// with 1 - s = e s (e = exp(-2u)), which keeps its relative precision as
// s -> 1, and 1 - s = 1 where e overflows (e s would be inf * 0). (A branch
// on e < 1 between e s and 1 - s cost 10 ns per element: mispredicted.)
constexpr double kGeluC = 0.7978845608028654; // sqrt(2/pi)
constexpr double kGeluA = 0.044715;

template <typename T> void gelu(const T *x, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    T u = T(kGeluC) * (v + T(kGeluA) * v * v * v);
    y[i] = v / (T(1) + std::exp(T(-2) * u));
  }
}

template <typename T> void geluGrad(const T *x, const T *dy, T *dx, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    T u = T(kGeluC) * (v + T(kGeluA) * v * v * v);
    T e = std::exp(T(-2) * u);
    T s = T(1) / (T(1) + e);
    T oneMinusS = e <= std::numeric_limits<T>::max() ? e * s : T(1);
    T du = T(kGeluC) * (T(1) + T(3 * kGeluA) * v * v);
    dx[i] = dy[i] * (s + T(2) * v * s * oneMinusS * du);
  }
}

// GELU, exact form (PyTorch's default): y = 0.5 x (1 + erf(x / sqrt(2))),
// dy/dx = 0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi).
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

template <typename T> void geluExact(const T *x, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    y[i] = T(0.5) * v * (T(1) + std::erf(v * T(kInvSqrt2)));
  }
}

template <typename T> void geluExactGrad(const T *x, const T *dy, T *dx, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    T cdf = T(0.5) * (T(1) + std::erf(v * T(kInvSqrt2)));
    T pdf = T(kInvSqrt2Pi) * std::exp(T(-0.5) * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

namespace {
/// y = softmax(x) over one row of n (max-subtracted; y may not alias x).
template <typename T> void softmaxRow(const T *x, T *y, int64_t n) {
  T mx = *std::max_element(x, x + n);
  T sum = 0;
  for (int64_t c = 0; c < n; ++c) {
    y[c] = std::exp(x[c] - mx);
    sum += y[c];
  }
  T inv = T(1) / sum;
  for (int64_t c = 0; c < n; ++c)
    y[c] *= inv;
}
} // namespace

template <typename T> void softmax(const T *x, T *y, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r)
    softmaxRow(x + r * cols, y + r * cols, cols);
}

template <typename T>
void softmaxGrad(const T *y, const T *dy, T *dx, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    const T *yr = y + r * cols, *dyr = dy + r * cols;
    T dot = 0;
    for (int64_t c = 0; c < cols; ++c)
      dot += yr[c] * dyr[c];
    for (int64_t c = 0; c < cols; ++c)
      dx[r * cols + c] = yr[c] * (dyr[c] - dot);
  }
}

template <typename T>
void biasAdd(const T *x, const T *b, T *y, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = x[r * cols + c] + b[c];
}

namespace {
/// C (ldc) = alpha op(A) op(B) + beta C, row-major, with leading dimensions
/// (heads are column slices of [B, T, C] tensors).
void gemmLd(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
            const float *a, int64_t lda, const float *b, int64_t ldb,
            float beta, float *c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
              tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}
void gemmLd(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
            const double *a, int64_t lda, const double *b, int64_t ldb,
            double beta, double *c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
              tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}

/// c = op(a) op(b) (+ c with accumulate), contiguous row-major operands.
template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T *a, const T *b, T *c,
          bool accumulate) {
  gemmLd(ta, tb, m, n, k, T(1), a, ta ? m : k, b, tb ? k : n, T(accumulate ? 1 : 0), c, n);
}
} // namespace

template <typename T>
void matmul(const T *a, const T *b, T *c, int64_t batch, int64_t m, int64_t n, int64_t k,
            bool transA, bool transB, bool accumulate) {
  for (int64_t i = 0; i < batch; ++i)
    gemm(transA, transB, m, n, k, a + i * m * k, b + i * k * n, c + i * m * n, accumulate);
}

namespace {
/// Mean and 1 / sqrt(biased variance + eps) of one row; the backward pass
/// recomputes them with this same routine instead of storing them.
template <typename T>
void rowStats(const T *xr, int64_t cols, double eps, T &mean, T &rstd) {
  mean = 0;
  for (int64_t c = 0; c < cols; ++c)
    mean += xr[c];
  mean /= T(cols);
  T var = 0;
  for (int64_t c = 0; c < cols; ++c)
    var += (xr[c] - mean) * (xr[c] - mean);
  var /= T(cols);
  rstd = T(1) / std::sqrt(var + T(eps));
}
} // namespace

template <typename T>
void layerNorm(const T *x, const T *g, const T *b, T *y, int64_t rows,
               int64_t cols, double eps) {
#pragma omp parallel for if (rows * cols > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols;
    T mean, rstd;
    rowStats(xr, cols, eps, mean, rstd);
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = (xr[c] - mean) * rstd * g[c] + b[c];
  }
}

template <typename T>
void layerNormGrad(const T *x, const T *g, const T *dy, T *dx, T *dg, T *db,
                   int64_t rows, int64_t cols, double eps) {
  std::fill(dg, dg + cols, T(0));
  std::fill(db, db + cols, T(0));
  // dgamma / dbeta sum over rows: kept serial so the order is fixed.
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols, *dyr = dy + r * cols;
    T mean, rstd;
    rowStats(xr, cols, eps, mean, rstd);
    // dx = rstd * (dyg - mean(dyg) - xhat * mean(dyg * xhat)), dyg = dy * g.
    T sumDyg = 0, sumDygXhat = 0;
    for (int64_t c = 0; c < cols; ++c) {
      T xhat = (xr[c] - mean) * rstd;
      T dyg = dyr[c] * g[c];
      sumDyg += dyg;
      sumDygXhat += dyg * xhat;
      dg[c] += dyr[c] * xhat;
      db[c] += dyr[c];
    }
    T m1 = sumDyg / T(cols), m2 = sumDygXhat / T(cols);
    for (int64_t c = 0; c < cols; ++c) {
      T xhat = (xr[c] - mean) * rstd;
      dx[r * cols + c] = rstd * (dyr[c] * g[c] - m1 - xhat * m2);
    }
  }
}


namespace {
int64_t kvHeadsOr(int64_t kvHeads, int64_t heads) {
  return kvHeads > 0 ? kvHeads : heads;
}

/// Query rows per block: a block's scores are kQueryBlock x T values, so
/// memory stays O(T) per head however long the sequence.
constexpr int64_t kQueryBlock = 256;
} // namespace

// Attention: for batch b and head h, with D = C / heads and key/value head
// hk = h / (heads / kvHeads) (grouped-query attention; kvHeads = heads is
// multi-head attention),
//   S = Q_h K_hk^T / sqrt(D) (masked for t' > t when causal),
//   P = softmax(S), Y_h = P V_hk, lse_t = log sum_s exp(S_ts).
// Per (b, h) and block of up to kQueryBlock query rows: S for the block is
// one GEMM (against the keys up to the block's last row when causal), the
// softmax runs row by row, and Y for the block is a second GEMM written
// straight into y's head slice. K and V are read in place for every query
// head of their group (strided GEMM operands): the repeated keys are never
// materialized. P is never stored: the backward pass recomputes S and
// takes P = exp(S - lse). The GEMMs are OpenBLAS's (threaded by it where
// large), so the (b, h) loop is sequential; each row's result depends only
// on its own (b, h), never on B or the thread count.
template <typename T>
void attention(const T *q, const T *k, const T *v, T *y, T *lse, int64_t B,
               int64_t Tn, int64_t C, int64_t heads, bool causal,
               int64_t kvHeads, AttentionRows rows_) {
  int64_t D = C / heads, kvh = kvHeadsOr(kvHeads, heads);
  int64_t group = heads / kvh, Ck = kvh * D;
  const int64_t lq = rows_.q ? rows_.q : C, lkv = rows_.kv ? rows_.kv : Ck,
                ly = rows_.y ? rows_.y : C;
  T scale = T(1) / std::sqrt(T(D));
  int64_t bq = std::min(Tn, kQueryBlock);
  std::vector<T> s(bq * Tn);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const T *qh = q + b * Tn * lq + h * D;
      const T *kh = k + b * Tn * lkv + (h / group) * D;
      const T *vh = v + b * Tn * lkv + (h / group) * D;
      T *yh = y + b * Tn * ly + h * D;
      for (int64_t t0 = 0; t0 < Tn; t0 += bq) {
        int64_t rows = std::min(bq, Tn - t0);
        int64_t end = causal ? t0 + rows : Tn; // keys the block sees
        gemmLd(false, true, rows, end, D, scale, qh + t0 * lq, lq, kh, lkv, T(0),
               s.data(), end);
#pragma omp parallel for if (rows * end > kParallelGrain)
        for (int64_t r = 0; r < rows; ++r) {
          T *p = s.data() + r * end;
          int64_t rend = causal ? t0 + r + 1 : Tn; // this row's keys
          T mx = -std::numeric_limits<T>::infinity();
          for (int64_t j = 0; j < rend; ++j)
            mx = std::max(mx, p[j]);
          T sum = 0;
          for (int64_t j = 0; j < rend; ++j) {
            p[j] = std::exp(p[j] - mx);
            sum += p[j];
          }
          for (int64_t j = 0; j < rend; ++j)
            p[j] /= sum;
          std::fill(p + rend, p + end, T(0));
          if (lse)
            lse[(b * heads + h) * Tn + t0 + r] = mx + std::log(sum);
        }
        gemmLd(false, false, rows, D, end, T(1), s.data(), end, vh, lkv, T(0),
               yh + t0 * ly, ly);
      }
    }
}

// Backward, per (b, h) and query block, with P = exp(S - lse):
//   dV_hk += P^T dY, dP = dY V^T, dS = P * (dP - rowsum(P * dP)) / sqrt(D),
//   dQ = dS K, dK_hk += dS^T Q,
// five GEMMs per block. dK and dV of a key/value head sum over the query
// heads of its group and the query blocks in that order (a fixed
// summation order whatever the thread count).
template <typename T>
void attentionGrad(const T *q, const T *k, const T *v, const T *lse,
                   const T *dy, T *dq, T *dk, T *dv, int64_t B, int64_t Tn,
                   int64_t C, int64_t heads, bool causal, int64_t kvHeads,
                   AttentionRows rows_) {
  int64_t D = C / heads, kvh = kvHeadsOr(kvHeads, heads);
  int64_t group = heads / kvh, Ck = kvh * D;
  const int64_t lq = rows_.q ? rows_.q : C, lkv = rows_.kv ? rows_.kv : Ck,
                ly = rows_.y ? rows_.y : C;
  T scale = T(1) / std::sqrt(T(D));
  for (int64_t r = 0; r < B * Tn; ++r) {
    std::fill(dq + r * lq, dq + r * lq + C, T(0));
    std::fill(dk + r * lkv, dk + r * lkv + Ck, T(0));
    std::fill(dv + r * lkv, dv + r * lkv + Ck, T(0));
  }
  int64_t bq = std::min(Tn, kQueryBlock);
  std::vector<T> p(bq * Tn), ds(bq * Tn);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      int64_t hk = h / group;
      const T *qh = q + b * Tn * lq + h * D, *dyh = dy + b * Tn * ly + h * D;
      const T *kh = k + b * Tn * lkv + hk * D, *vh = v + b * Tn * lkv + hk * D;
      T *dqh = dq + b * Tn * lq + h * D;
      T *dkh = dk + b * Tn * lkv + hk * D, *dvh = dv + b * Tn * lkv + hk * D;
      for (int64_t t0 = 0; t0 < Tn; t0 += bq) {
        int64_t rows = std::min(bq, Tn - t0);
        int64_t end = causal ? t0 + rows : Tn;
        gemmLd(false, true, rows, end, D, scale, qh + t0 * lq, lq, kh, lkv, T(0),
               p.data(), end);
        gemmLd(false, true, rows, end, D, T(1), dyh + t0 * ly, ly, vh, lkv, T(0),
               ds.data(), end);
#pragma omp parallel for if (rows * end > kParallelGrain)
        for (int64_t r = 0; r < rows; ++r) {
          T *pr = p.data() + r * end, *dr = ds.data() + r * end;
          int64_t rend = causal ? t0 + r + 1 : Tn;
          T l = lse[(b * heads + h) * Tn + t0 + r];
          T dot = 0; // <dP, P> = dy_t . y_t, taken from P and dP
          for (int64_t j = 0; j < rend; ++j) {
            pr[j] = std::exp(pr[j] - l);
            dot += dr[j] * pr[j];
          }
          for (int64_t j = 0; j < rend; ++j)
            dr[j] = pr[j] * (dr[j] - dot) * scale;
          std::fill(pr + rend, pr + end, T(0));
          std::fill(dr + rend, dr + end, T(0));
        }
        gemmLd(true, false, end, D, rows, T(1), p.data(), end, dyh + t0 * ly,
               ly, T(1), dvh, lkv);
        gemmLd(false, false, rows, D, end, T(1), ds.data(), end, kh, lkv, T(0),
               dqh + t0 * lq, lq);
        gemmLd(true, false, end, D, rows, T(1), ds.data(), end, qh + t0 * lq,
               lq, T(1), dkh, lkv);
      }
    }
}

// SiLU: y = x s, s = sigmoid(x) = 1 / (1 + exp(-x)); for x -> -inf,
// exp(-x) overflows to inf and s to 0, which is the limit.
// One definition each, so swiglu(_grad) computes bitwise what silu, mul
// and silu_grad compute one after the other.
template <typename T> inline T siluOf(T x) { return x / (T(1) + std::exp(-x)); }
template <typename T> inline T siluGradOf(T x, T dy) {
  T s = T(1) / (T(1) + std::exp(-x));
  return dy * s * (T(1) + x * (T(1) - s));
}

template <typename T> void silu(const T *x, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i)
    y[i] = siluOf(x[i]);
}

template <typename T> void siluGrad(const T *x, const T *dy, T *dx, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i)
    dx[i] = siluGradOf(x[i], dy[i]);
}

template <typename T> void swiglu(const T *g, const T *u, T *y, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i)
    y[i] = siluOf(g[i]) * u[i];
}

template <typename T>
void swigluGrad(const T *g, const T *u, const T *dy, T *dg, T *du, int64_t n) {
#pragma omp parallel for if (n > kParallelGrain / 8)
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i], ui = u[i], d = dy[i]; // dg / du may overwrite g / u
    dg[i] = siluGradOf(gi, d * ui);
    du[i] = d * siluOf(gi);
  }
}

namespace {
/// 1 / sqrt(mean(x^2) + eps) of one row, the sum in double; the backward
/// pass recomputes it with this same routine instead of storing it.
template <typename T> T rowRstd(const T *xr, int64_t cols, double eps) {
  double ss = 0;
  for (int64_t c = 0; c < cols; ++c)
    ss += (double)xr[c] * (double)xr[c];
  return T(1.0 / std::sqrt(ss / (double)cols + eps));
}
} // namespace

// RMSNorm (HF LlamaRMSNorm): y = x r w, r = 1 / sqrt(mean(x^2) + eps).
template <typename T>
void rmsNorm(const T *x, const T *w, T *y, int64_t rows, int64_t cols,
             double eps) {
#pragma omp parallel for if (rows * cols > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols;
    T rstd = rowRstd(xr, cols, eps);
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = xr[c] * rstd * w[c];
  }
}

// With xhat = x r and g = dy w: dx = r (g - xhat mean(g xhat)), since
// dr/dx_j = -r^3 x_j / cols; dw = sum over rows of dy xhat.
template <typename T>
void rmsNormGrad(const T *x, const T *w, const T *dy, T *dx, T *dw,
                 int64_t rows, int64_t cols, double eps) {
  std::fill(dw, dw + cols, T(0));
  // dw sums over rows: kept serial so the order is fixed.
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols, *dyr = dy + r * cols;
    T rstd = rowRstd(xr, cols, eps);
    double dot = 0;
    for (int64_t c = 0; c < cols; ++c) {
      T xhat = xr[c] * rstd;
      dot += (double)(dyr[c] * w[c]) * (double)xhat;
      dw[c] += dyr[c] * xhat;
    }
    T m = T(dot / (double)cols);
    for (int64_t c = 0; c < cols; ++c)
      dx[r * cols + c] = rstd * (dyr[c] * w[c] - xr[c] * rstd * m);
  }
}

namespace {
/// Rotates each (i, i + D/2) pair of every head of row t by `sign` * t *
/// theta^(-2i/D). The angles, cosines and sines are computed in double
/// (HF computes them in float32; the oracle in float64).
template <typename T>
void ropeRotate(const T *x, T *y, int64_t B, int64_t Tn, int64_t C,
                int64_t heads, double theta, double sign) {
  int64_t D = C / heads, half = D / 2;
  std::vector<T> cs(Tn * half), sn(Tn * half);
  for (int64_t i = 0; i < half; ++i) {
    double freq = std::pow(theta, -2.0 * (double)i / (double)D);
    for (int64_t t = 0; t < Tn; ++t) {
      double a = (double)t * freq;
      cs[t * half + i] = T(std::cos(a));
      sn[t * half + i] = T(sign * std::sin(a));
    }
  }
#pragma omp parallel for collapse(2) if (B * Tn * C > kParallelGrain)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const T *c = cs.data() + t * half, *s = sn.data() + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T *xr = x + (b * Tn + t) * C + h * D;
        T *yr = y + (b * Tn + t) * C + h * D;
        for (int64_t i = 0; i < half; ++i) {
          T x1 = xr[i], x2 = xr[i + half];
          yr[i] = x1 * c[i] - x2 * s[i];
          yr[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
}
} // namespace

template <typename T>
void rope(const T *x, T *y, int64_t B, int64_t Tn, int64_t C, int64_t heads,
          double theta) {
  ropeRotate(x, y, B, Tn, C, heads, theta, 1.0);
}

template <typename T>
void ropeGrad(const T *dy, T *dx, int64_t B, int64_t Tn, int64_t C,
              int64_t heads, double theta) {
  ropeRotate(dy, dx, B, Tn, C, heads, theta, -1.0);
}

template <typename T, typename I>
int64_t embedding(const T *table, const I *ids, T *y, int64_t n, int64_t vocab,
                  int64_t width) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      return i;
#pragma omp parallel for if (n * width > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(y + i * width, table + (int64_t)ids[i] * width,
                sizeof(T) * width);
  return -1;
}

template <typename T, typename I>
int64_t embeddingGrad(const I *ids, const T *dy, T *dtable, int64_t n,
                      int64_t vocab, int64_t width) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      return i;
  std::fill(dtable, dtable + vocab * width, T(0));
  // Repeated ids accumulate: serial, in order.
  for (int64_t i = 0; i < n; ++i) {
    T *row = dtable + (int64_t)ids[i] * width;
    const T *g = dy + i * width;
    for (int64_t c = 0; c < width; ++c)
      row[c] += g[c];
  }
  return -1;
}

template <typename T>
void transpose(const T *x, const Shape &sx, const std::vector<int64_t> &perm,
               T *y) {
  size_t r = sx.size();
  Shape sy(r), xs = stridesOf(sx), srcStride(r);
  for (size_t i = 0; i < r; ++i) {
    sy[i] = sx[perm[i]];
    srcStride[i] = xs[perm[i]];
  }
  int64_t n = numel(sy);
  std::vector<int64_t> idx(r, 0);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    y[i] = x[off];
    for (int64_t d = (int64_t)r - 1; d >= 0; --d) {
      if (++idx[d] < sy[d]) {
        off += srcStride[d];
        break;
      }
      off -= srcStride[d] * (sy[d] - 1);
      idx[d] = 0;
    }
  }
}

template <typename T>
void slice(const T *x, T *y, int64_t outer, int64_t full, int64_t len,
           int64_t inner, int64_t offset) {
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(y + o * len * inner, x + (o * full + offset) * inner,
                sizeof(T) * len * inner);
}

template <typename T>
void sliceGrad(const T *dy, T *dx, int64_t outer, int64_t full, int64_t len,
               int64_t inner, int64_t offset) {
  std::fill(dx, dx + outer * full * inner, T(0));
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(dx + (o * full + offset) * inner, dy + o * len * inner,
                sizeof(T) * len * inner);
}

template <typename T, typename I>
int64_t crossEntropy(const T *logits, const I *labels, T *loss, int64_t rows, int64_t classes,
                     int64_t stride, double smoothing, const T *normalizer, int64_t ignore) {
  stride = stride ? stride : classes;
  auto skipped = [&](int64_t r) { return normalizer && (int64_t)labels[r] == ignore; };
  for (int64_t r = 0; r < rows; ++r)
    if ((labels[r] < 0 || labels[r] >= classes) && !skipped(r))
      return r;
  std::vector<double> per(rows);
#pragma omp parallel for if (rows * classes > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    if (skipped(r))
      continue; // per[r] stays 0
    const T *lr = logits + r * stride;
    T mx = *std::max_element(lr, lr + classes);
    T sum = 0;
    for (int64_t c = 0; c < classes; ++c)
      sum += std::exp(lr[c] - mx);
    if (smoothing == 0) {
      per[r] = (double)(std::log(sum) + mx - lr[labels[r]]);
      continue;
    }
    // -log p[c] = lse - x[c]: (1 - e) of the label's plus e of their mean
    // over the classes, which is lse - mean(x).
    double lse = (double)(std::log(sum) + mx), xs = 0;
    for (int64_t c = 0; c < classes; ++c)
      xs += (double)lr[c];
    per[r] =
        (1 - smoothing) * (lse - (double)lr[labels[r]]) + smoothing * (lse - xs / (double)classes);
  }
  double total = 0;
  for (double v : per)
    total += v;
  if (!normalizer)
    *loss = (T)(total / rows);
  else
    *loss = *normalizer > 0 ? (T)(total / (double)*normalizer) : T(0);
  return -1;
}

template <typename I>
float countLabels(const I *labels, int64_t n, int64_t ignore, int64_t divisor) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i)
    kept += (int64_t)labels[i] != ignore;
  return (float)((double)kept / (double)divisor);
}
template float countLabels<int32_t>(const int32_t *, int64_t, int64_t, int64_t);
template float countLabels<int64_t>(const int64_t *, int64_t, int64_t, int64_t);

template <typename T, typename I>
int64_t crossEntropyGrad(const T *logits, const I *labels, const T *dloss, T *dlogits, int64_t rows,
                         int64_t classes, int64_t stride, double smoothing, const T *normalizer,
                         int64_t ignore) {
  stride = stride ? stride : classes;
  auto skipped = [&](int64_t r) { return normalizer && (int64_t)labels[r] == ignore; };
  for (int64_t r = 0; r < rows; ++r)
    if ((labels[r] < 0 || labels[r] >= classes) && !skipped(r))
      return r;
  T f = !normalizer ? *dloss / T(rows) : *normalizer > 0 ? *dloss / *normalizer : T(0);
  // The target: (1 - e) on the label, e / K on every class.
  T onLabel = smoothing == 0 ? f : (T)((1 - smoothing) * (double)f);
  T uniform = (T)(smoothing * (double)f / (double)classes);
#pragma omp parallel for if (rows * classes > kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    T *dr = dlogits + r * stride;
    if (skipped(r)) {
      std::fill(dr, dr + stride, T(0));
      continue;
    }
    softmaxRow(logits + r * stride, dr, classes);
    for (int64_t c = 0; c < classes; ++c)
      dr[c] *= f;
    if (smoothing != 0)
      for (int64_t c = 0; c < classes; ++c)
        dr[c] -= uniform;
    dr[labels[r]] -= onLabel;
    std::fill(dr + classes, dr + stride, T(0));
  }
  return -1;
}

template <typename T> void mseLoss(const T *x, const T *t, T *loss, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i)
    s += (double)(x[i] - t[i]) * (double)(x[i] - t[i]);
  *loss = (T)(s / n);
}

template <typename T>
void mseLossGrad(const T *x, const T *t, const T *dl, T *dx, int64_t n) {
  T f = T(2) * *dl / T(n);
  for (int64_t i = 0; i < n; ++i)
    dx[i] = (x[i] - t[i]) * f;
}

// Stable form, as torch: max(x, 0) - x t + log(1 + exp(-|x|)).
template <typename T>
void bceWithLogits(const T *x, const T *t, T *loss, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    s += (double)(std::max(v, T(0)) - v * t[i] +
                  std::log1p(std::exp(-std::abs(v))));
  }
  *loss = (T)(s / n);
}

template <typename T>
void bceWithLogitsGrad(const T *x, const T *t, const T *dl, T *dx, int64_t n) {
  T f = *dl / T(n);
  for (int64_t i = 0; i < n; ++i) {
    T sig = T(1) / (T(1) + std::exp(-x[i]));
    dx[i] = (sig - t[i]) * f;
  }
}

template <typename T>
void sgdUpdate(const T *p, const T *g, T *np, int64_t n, double lr, double wd,
               T gradScale) {
  T tlr = (T)lr, twd = (T)wd;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    T d = g[i] * gradScale;
    if (wd != 0)
      d += twd * p[i];
    np[i] = p[i] - tlr * d;
  }
}

namespace {

/// SGD-with-momentum's per-step scalars, each rounded once to T, and one
/// element's step with them (torch's _single_tensor_sgd).
template <typename T> struct SgdMomentumStep {
  T lr, momentum, oneMinusDampening, wd;
  bool first, decays, nesterov;
  SgdMomentumStep(double lr, int64_t step, double momentum, double dampening, double wd,
                  bool nesterov)
      : lr((T)lr), momentum((T)momentum), oneMinusDampening((T)(1 - dampening)), wd((T)wd),
        first(step <= 1), decays(wd != 0), nesterov(nesterov) {}
  /// p, the (scaled) gradient g and the buffer b -> np, nb.
  void apply(T p, T g, T b, T &np, T &nb) const {
    T d = g;
    if (decays)
      d += wd * p;
    // torch: the first step clones the gradient into the buffer.
    T nbi = first ? d : momentum * b + oneMinusDampening * d;
    nb = nbi;
    np = p - lr * (nesterov ? d + momentum * nbi : nbi);
  }
};

} // namespace

template <typename T>
void sgdMomentumUpdate(const T *p, const T *g, const T *buf, T *np, T *nbuf,
                       int64_t n, double lr, int64_t step, double momentum,
                       double dampening, double wd, bool nesterov,
                       T gradScale) {
  const SgdMomentumStep<T> s(lr, step, momentum, dampening, wd, nesterov);
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    s.apply(p[i], g[i] * gradScale, buf[i], np[i], nbuf[i]);
}

void sgdMomentumUpdateBf16State(const float *p, const float *g, const uint16_t *buf, float *np,
                                uint16_t *nbuf, int64_t n, double lr, int64_t step, double momentum,
                                double dampening, double wd, bool nesterov, float gradScale,
                                const MomentRounding &rounding) {
  // sgdMomentumUpdate<float>'s arithmetic on the widened buffer, in chunks
  // as adamwUpdateBf16State's.
  const SgdMomentumStep<float> s(lr, step, momentum, dampening, wd, nesterov);
  const MomentRounding r = rounding;
  constexpr int64_t kChunk = 512;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t len = std::min(kChunk, n - c);
    float bf[kChunk];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      s.apply(p[c + j], g[c + j] * gradScale, widenBf16(buf[c + j]), np[c + j], bf[j]);
    if (r.stochastic) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j)
        nbuf[c + j] = roundToBf16Stochastic(bf[j], r.key, r.first + (uint64_t)(c + j));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j)
        nbuf[c + j] = roundToBf16(bf[j]);
    }
  }
}

namespace {

/// AdamW's per-step scalars as torch forms them (Python floats, i.e.
/// double), each rounded once to T, and one element's step with them
/// (torch 1.13: exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1), ...).
template <typename T> struct AdamwStep {
  T stepSize, bc2Sqrt, decay, b1, b2, oneMinusB1, oneMinusB2, eps;
  AdamwStep(double lr, int64_t step, double beta1, double beta2, double epsilon, double wd)
      : stepSize((T)(lr / (1 - std::pow(beta1, (double)step)))),
        bc2Sqrt((T)std::sqrt(1 - std::pow(beta2, (double)step))), decay((T)(1 - lr * wd)),
        b1((T)beta1), b2((T)beta2), oneMinusB1((T)(1 - beta1)), oneMinusB2((T)(1 - beta2)),
        eps((T)epsilon) {}
  /// p, the (scaled) gradient g and the moments m, v -> np, nm, nv.
  void apply(T p, T g, T m, T v, T &np, T &nm, T &nv) const {
    T mi = m * b1 + oneMinusB1 * g;
    T vi = v * b2 + oneMinusB2 * g * g;
    T denom = std::sqrt(vi) / bc2Sqrt + eps;
    np = p * decay - stepSize * (mi / denom);
    nm = mi;
    nv = vi;
  }
};

} // namespace

template <typename T>
void adamwUpdate(const T *p, const T *g, const T *m, const T *v, T *np, T *nm,
                 T *nv, int64_t n, double lr, int64_t step, double beta1,
                 double beta2, double eps, double wd, T gradScale) {
  const AdamwStep<T> a(lr, step, beta1, beta2, eps, wd);
  // simd: iteration i reads and writes element i only, and each output is
  // either its input (in place) or disjoint from every operand, so the
  // vectorizer may skip the 21 runtime alias checks it would otherwise
  // need and give up on (the loop ran scalar: 3.3 ns per element).
#pragma omp parallel for simd if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i)
    a.apply(p[i], g[i] * gradScale, m[i], v[i], np[i], nm[i], nv[i]);
}

void adamwUpdateBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                          float *np, uint16_t *nm, uint16_t *nv, int64_t n, double lr, int64_t step,
                          double beta1, double beta2, double eps, double wd, float gradScale,
                          const MomentRounding &rounding) {
  // adamwUpdate<float>'s arithmetic on the widened moments.
  const AdamwStep<float> a(lr, step, beta1, beta2, eps, wd);
  const MomentRounding r = rounding;
  // In chunks: the f32 update vectorized into two small buffers, then
  // the rounding (a hash per element when stochastic). One element-wise
  // loop with the rounding in it ran scalar, 1.7x the f32 step's time
  // for an 8M-parameter MLP.
  constexpr int64_t kChunk = 512;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t len = std::min(kChunk, n - c);
    float mf[kChunk], vf[kChunk];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      a.apply(p[c + j], g[c + j] * gradScale, widenBf16(m[c + j]), widenBf16(v[c + j]), np[c + j],
              mf[j], vf[j]);
    if (r.stochastic) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j)
        roundMomentsToBf16Stochastic(mf[j], vf[j], r.key, r.first + (uint64_t)(c + j), nm[c + j],
                                     nv[c + j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        nm[c + j] = roundToBf16(mf[j]);
        nv[c + j] = roundToBf16(vf[j]);
      }
    }
  }
}

namespace {

/// adamwUpdate8bitState's operands and step, for one block at a time.
struct Update8 {
  const float *p, *g; ///< p (and np) from element pFrom of the operand
  const uint8_t *m, *v;
  float *np;
  uint8_t *nm, *nv;
  int64_t n, block, decayed, pFrom;
  float gradScale;
  AdamwStep<float> decay, plain;
  int bits; ///< 8 (moments8) or 4 (moments4: two codes a byte)
};

/// Block j of an 8-bit update (at most 4096 elements: the verifier's
/// bound), each step a loop of its own so that each vectorizes: decoded
/// into f32 buffers (the block is read whole before any of it is written:
/// the update runs in place), updated (the decayed prefix, then the rest),
/// the roots taken, then each moment's largest magnitude and codes
/// (moments8::encodeBlock). Every operation is a correctly rounded IEEE
/// one or an integer one, and no target it is compiled for contracts a
/// multiply and an add (AVX2 without FMA), so every build of it stores
/// the same bytes.
/// Block j's new f32 moments (exp_avg in mf, exp_avg_sq in vf, which
/// takes its roots) encoded once: codes at nm + o, nv + o, scales at byte
/// at + 4 j. What the 8-bit AdamW and LAMB updates store.
[[gnu::always_inline]] inline void storeMoments8(float *mf, float *vf, int64_t len, uint8_t *nm,
                                                 uint8_t *nv, int64_t at, int64_t o, int64_t j) {
  namespace m8 = moments8;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i)
    vf[i] = std::sqrt(vf[i]);
  const float sm = m8::encodeBlock(mf, len, m8::kMantM, nm + o);
  const float sv = m8::encodeBlock(vf, len, m8::kMantV, nv + o);
  std::memcpy(nm + at + 4 * j, &sm, 4);
  std::memcpy(nv + at + 4 * j, &sv, 4);
}

/// The same for 4-bit moments (moments4): codes at nm + o / 2, nv + o / 2.
[[gnu::always_inline]] inline void storeMoments4(float *mf, float *vf, int64_t len, uint8_t *nm,
                                                 uint8_t *nv, int64_t at, int64_t o, int64_t j) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i)
    vf[i] = std::sqrt(vf[i]);
  const float sm = moments4::encodeBlock(mf, len, /*root=*/false, nm + o / 2);
  const float sv = moments4::encodeBlock(vf, len, /*root=*/true, nv + o / 2);
  std::memcpy(nm + at + 4 * j, &sm, 4);
  std::memcpy(nv + at + 4 * j, &sv, 4);
}

[[gnu::always_inline]] inline void update8bitBlock(const Update8 &u, int64_t j) {
  namespace m8 = moments8;
  const bool four = u.bits == 4;
  const int64_t at = four ? moments4::scalesOffset(u.n) : m8::scalesOffset(u.n), o = j * u.block,
                len = std::min(u.block, u.n - o);
  const int64_t dec = std::clamp<int64_t>(u.decayed - o, 0, len);
  float scaleM, scaleV;
  std::memcpy(&scaleM, u.m + at + 4 * j, 4);
  std::memcpy(&scaleV, u.v + at + 4 * j, 4);
  float mf[m8::kMaxBlock + 1], vf[m8::kMaxBlock + 1];
  const float *pj = u.p + (o - u.pFrom), *gj = u.g + o;
  float *npj = u.np + (o - u.pFrom);
  if (four) {
    // the levels a byte (two elements) at a time, then scaled (an odd
    // last block's last slot is past it: written, never read)
    const moments4::DecodeTables &table = moments4::decodeTables();
    const uint8_t *mj = u.m + o / 2, *vj = u.v + o / 2;
    for (int64_t b = 0; b < (len + 1) / 2; ++b) {
      std::memcpy(mf + 2 * b, table.pairM[mj[b]], 8);
      std::memcpy(vf + 2 * b, table.pairRoot[vj[b]], 8);
    }
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      mf[i] = mf[i] * scaleM;
      const float r = vf[i] * scaleV;
      vf[i] = r * r;
    }
  } else {
    const m8::DecodeTables &table = m8::decodeTables();
    const uint8_t *mj = u.m + o, *vj = u.v + o;
    for (int64_t i = 0; i < len; ++i) {
      mf[i] = table.m[mj[i]] * scaleM;
      const float r = table.root[vj[i]] * scaleV;
      vf[i] = r * r;
    }
  }
  const float gs = u.gradScale;
#pragma omp simd
  for (int64_t i = 0; i < dec; ++i)
    u.decay.apply(pj[i], gj[i] * gs, mf[i], vf[i], npj[i], mf[i], vf[i]);
#pragma omp simd
  for (int64_t i = dec; i < len; ++i)
    u.plain.apply(pj[i], gj[i] * gs, mf[i], vf[i], npj[i], mf[i], vf[i]);
  if (four)
    storeMoments4(mf, vf, len, u.nm, u.nv, at, o, j);
  else
    storeMoments8(mf, vf, len, u.nm, u.nv, at, o, j);
}

void update8bitBlockBaseline(const Update8 &u, int64_t j) { update8bitBlock(u, j); }
/// The same block with AVX2's 8-lane integer and float operations: 1.6x
/// faster on an AMD EPYC (8M elements: 14.5 ms instead of 23.7).
__attribute__((target("avx2"))) void update8bitBlockAvx2(const Update8 &u, int64_t j) {
  update8bitBlock(u, j);
}

} // namespace

bool cpuHasAvx2() { return __builtin_cpu_supports("avx2"); }

namespace {

/// Blocks [from / block, (from + count) / block rounded up) of an 8-bit
/// update, the parameters p / np holding elements [from, from + count).
void update8bitBlocks(const float *p, const float *g, const uint8_t *m, const uint8_t *v, float *np,
                      uint8_t *nm, uint8_t *nv, int64_t from, int64_t count, int64_t n,
                      int64_t block, double lr, int64_t step, double beta1, double beta2,
                      double eps, double wd, int64_t decayed, float gradScale, Isa isa, int bits) {
  const Update8 u{p,
                  g,
                  m,
                  v,
                  np,
                  nm,
                  nv,
                  n,
                  block,
                  decayed,
                  from,
                  gradScale,
                  AdamwStep<float>(lr, step, beta1, beta2, eps, wd),
                  AdamwStep<float>(lr, step, beta1, beta2, eps, 0.0),
                  bits};
  const int64_t first = from / block, last = (from + count + block - 1) / block;
  // Isa::Avx2 on a CPU without it runs the baseline build (the same
  // bytes), never an instruction the CPU lacks.
  void (*const run)(const Update8 &, int64_t) =
      isa == Isa::Baseline || !cpuHasAvx2() ? update8bitBlockBaseline : update8bitBlockAvx2;
#pragma omp parallel for if (count > kParallelGrain)
  for (int64_t j = first; j < last; ++j)
    run(u, j);
  // the codes' padding to 4 bytes stays zero
  if (from + count == n) {
    const int64_t end = bits == 4 ? (n + 1) / 2 : n,
                  at = bits == 4 ? moments4::scalesOffset(n) : moments8::scalesOffset(n);
    for (int64_t i = end; i < at; ++i)
      nm[i] = nv[i] = 0;
  }
}

} // namespace

void adamwUpdate8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                          float *np, uint8_t *nm, uint8_t *nv, int64_t n, int64_t block, double lr,
                          int64_t step, double beta1, double beta2, double eps, double wd,
                          int64_t decayed, float gradScale, Isa isa) {
  update8bitBlocks(p, g, m, v, np, nm, nv, 0, n, n, block, lr, step, beta1, beta2, eps, wd, decayed,
                   gradScale, isa, 8);
}

void adamwUpdate4bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                          float *np, uint8_t *nm, uint8_t *nv, int64_t n, int64_t block, double lr,
                          int64_t step, double beta1, double beta2, double eps, double wd,
                          int64_t decayed, float gradScale, Isa isa) {
  update8bitBlocks(p, g, m, v, np, nm, nv, 0, n, n, block, lr, step, beta1, beta2, eps, wd, decayed,
                   gradScale, isa, 4);
}

void adamwUpdate8bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                               const float *g, const uint8_t *m, const uint8_t *v, uint8_t *nm,
                               uint8_t *nv, int64_t n, int64_t block, double lr, int64_t step,
                               double beta1, double beta2, double eps, double wd, int64_t decayed,
                               float gradScale) {
  update8bitBlocks(pf, g, m, v, npf, nm, nv, from, count, n, block, lr, step, beta1, beta2, eps, wd,
                   decayed, gradScale, Isa::Best, 8);
}

void adamwUpdate4bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                               const float *g, const uint8_t *m, const uint8_t *v, uint8_t *nm,
                               uint8_t *nv, int64_t n, int64_t block, double lr, int64_t step,
                               double beta1, double beta2, double eps, double wd, int64_t decayed,
                               float gradScale) {
  update8bitBlocks(pf, g, m, v, npf, nm, nv, from, count, n, block, lr, step, beta1, beta2, eps, wd,
                   decayed, gradScale, Isa::Best, 4);
}

namespace {

/// One 8-bit SGD update's operands (sgdMomentumUpdate8bitStatePiece).
struct Sgd8 {
  const float *p, *g;
  const uint8_t *buf;
  float *np;
  uint8_t *nbuf;
  int64_t n, block, decayed, pFrom;
  float gradScale;
  SgdMomentumStep<float> decay, plain;
};

/// Block j of an 8-bit SGD update: decoded (exp_avg's signed codes),
/// stepped with sgdMomentumUpdate<float>'s arithmetic, encoded once. In
/// place allowed: the block is read whole before its codes and scale are
/// written. Correctly rounded operations only (no contraction on any
/// target it is built for), so every build stores the same bytes.
[[gnu::always_inline]] inline void sgd8bitBlock(const Sgd8 &u, int64_t j) {
  namespace m8 = moments8;
  const int64_t at = m8::scalesOffset(u.n), o = j * u.block, len = std::min(u.block, u.n - o);
  const int64_t dec = std::clamp<int64_t>(u.decayed - o, 0, len);
  float scale;
  std::memcpy(&scale, u.buf + at + 4 * j, 4);
  float bf[m8::kMaxBlock];
  const m8::DecodeTables &table = m8::decodeTables();
  for (int64_t i = 0; i < len; ++i)
    bf[i] = table.m[u.buf[o + i]] * scale;
  const float *pj = u.p + (o - u.pFrom), *gj = u.g + o;
  float *npj = u.np + (o - u.pFrom);
  const float gs = u.gradScale;
#pragma omp simd
  for (int64_t i = 0; i < dec; ++i)
    u.decay.apply(pj[i], gj[i] * gs, bf[i], npj[i], bf[i]);
#pragma omp simd
  for (int64_t i = dec; i < len; ++i)
    u.plain.apply(pj[i], gj[i] * gs, bf[i], npj[i], bf[i]);
  const float s = m8::encodeBlock(bf, len, m8::kMantM, u.nbuf + o);
  std::memcpy(u.nbuf + at + 4 * j, &s, 4);
}

void sgd8bitBlockBaseline(const Sgd8 &u, int64_t j) { sgd8bitBlock(u, j); }
/// With AVX2: 1.6x faster on an AMD EPYC (8M elements, one thread: 8.2 ms
/// instead of 13.2).
__attribute__((target("avx2"))) void sgd8bitBlockAvx2(const Sgd8 &u, int64_t j) {
  sgd8bitBlock(u, j);
}

} // namespace

void sgdMomentumUpdate8bitStatePiece(const float *pf, float *npf, int64_t from, int64_t count,
                                     const float *g, const uint8_t *buf, uint8_t *nbuf, int64_t n,
                                     int64_t block, double lr, int64_t step, double momentum,
                                     double dampening, double wd, bool nesterov, int64_t decayed,
                                     float gradScale, Isa isa) {
  const Sgd8 u{pf,
               g,
               buf,
               npf,
               nbuf,
               n,
               block,
               decayed,
               from,
               gradScale,
               SgdMomentumStep<float>(lr, step, momentum, dampening, wd, nesterov),
               SgdMomentumStep<float>(lr, step, momentum, dampening, 0.0, nesterov)};
  const int64_t first = from / block, last = (from + count + block - 1) / block;
  // Isa::Avx2 on a CPU without it runs the baseline build (the same bytes)
  void (*const run)(const Sgd8 &, int64_t) =
      isa == Isa::Baseline || !cpuHasAvx2() ? sgd8bitBlockBaseline : sgd8bitBlockAvx2;
#pragma omp parallel for if (count > kParallelGrain)
  for (int64_t j = first; j < last; ++j)
    run(u, j);
  if (from + count == n) // the codes' padding to 4 bytes stays zero
    for (int64_t i = n; i < moments8::scalesOffset(n); ++i)
      nbuf[i] = 0;
}

void sgdMomentumUpdate8bitState(const float *p, const float *g, const uint8_t *buf, float *np,
                                uint8_t *nbuf, int64_t n, int64_t block, double lr, int64_t step,
                                double momentum, double dampening, double wd, bool nesterov,
                                int64_t decayed, float gradScale, Isa isa) {
  sgdMomentumUpdate8bitStatePiece(p, np, 0, n, g, buf, nbuf, n, block, lr, step, momentum,
                                  dampening, wd, nesterov, decayed, gradScale, isa);
}

namespace {

/// LAMB's per-step scalars, formed as adamwUpdate forms its own: torch's
/// doubles, each rounded once to T.
template <typename T> struct LambScalars { T b1, b2, oneMinusB1, oneMinusB2, bc1, bc2Sqrt, eps; };
template <typename T>
LambScalars<T> lambScalars(int64_t step, double beta1, double beta2, double eps) {
  double bc1 = 1 - std::pow(beta1, (double)step), bc2 = 1 - std::pow(beta2, (double)step);
  return {(T)beta1, (T)beta2, (T)(1 - beta1), (T)(1 - beta2), (T)bc1, (T)std::sqrt(bc2), (T)eps};
}

/// One element's new moments and update direction u, each operation
/// rounded on its own in this order (CudaKernels.cu's lambElement repeats
/// it with explicit roundings). The decay term is added only where weight
/// decay applies (timm adds it only for weight_decay != 0: no 0 * p, whose
/// sign or NaN could show).
template <typename T>
inline T lambDirection(const LambScalars<T> &c, T p, T g, T m, T v, T gradScale, bool decay, T wd,
                       T &nm, T &nv) {
  T gi = g * gradScale;
  T mi = m * c.b1 + c.oneMinusB1 * gi;
  T vi = v * c.b2 + c.oneMinusB2 * gi * gi;
  T denom = std::sqrt(vi) / c.bc2Sqrt + c.eps;
  T u = (mi / c.bc1) / denom;
  nm = mi;
  nv = vi;
  return decay ? u + wd * p : u;
}

/// lamb_norms sums each parameter's terms in chunks of this many elements
/// (the chunks in parallel, their partial sums then in chunk order): the
/// same bits for any thread count.
constexpr int64_t kLambChunk = 1 << 12;

/// Moments stored as S, as T: T state read where it lies (mw, vw point
/// into m, v); bf16 state (state-dtype=bf16) widened into mb, vb (a
/// vectorized loop of its own: widened inside the LAMB arithmetic's loop,
/// that loop ran scalar, 1.7x the f32 update). The LAMB kernels take their
/// chunks kLambWiden elements at a time, so the buffers stay in L1.
constexpr int64_t kLambWiden = 512;
template <typename T, typename S> constexpr bool kSameState = std::is_same_v<T, S>;
template <typename T, typename S>
inline void widenStates(const S *m, const S *v, int64_t n, T *mb, T *vb, const T *&mw,
                        const T *&vw) {
  if constexpr (kSameState<T, S>) {
    mw = m, vw = v;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      mb[i] = widenBf16(m[i]);
      vb[i] = widenBf16(v[i]);
    }
    mw = mb, vw = vb;
  }
}

/// The moments a LAMB kernel reads, stored as S: T or bf16 (widenStates),
/// elements [at, at + len) at a time.
template <typename T, typename S> struct WideMoments {
  static constexpr bool kInPlace = kSameState<T, S>;
  const S *m, *v;
  void read(int64_t at, int64_t len, T *mb, T *vb, const T *&mw, const T *&vw) const {
    widenStates(m + at, v + at, len, mb, vb, mw, vw);
  }
};
/// 8-bit moments (state-dtype=8bit): packed shards of n elements in blocks
/// of `block`, decoded as the AdamW update decodes them (exp_avg_sq as its
/// root squared).
struct Codes8Moments {
  static constexpr bool kInPlace = false;
  const uint8_t *m, *v;
  int64_t n, block;
  void read(int64_t at, int64_t len, float *mb, float *vb, const float *&mw,
            const float *&vw) const {
    namespace m8 = moments8;
    const int64_t scales = m8::scalesOffset(n) + 4 * (at / block);
    m8::decodeRange(m + at, m + scales, at, len, block, false, mb);
    m8::decodeRange(v + at, v + scales, at, len, block, true, vb);
    mw = mb, vw = vb;
  }
};

template <typename T, typename In>
void lambNormsT(const T *p, const T *g, const In &in, T *norms, int64_t n, const LambLayout &layout,
                int64_t step, double beta1, double beta2, double eps, double wd, T gradScale) {
  const int64_t K = (int64_t)layout.segments.size() - 1;
  const LambScalars<T> c = lambScalars<T>(step, beta1, beta2, eps);
  const T twd = (T)wd;
  struct Chunk {
    int64_t begin, end, segment;
    bool decay;
  };
  std::vector<Chunk> chunks;
  for (const LambPiece &pc : lambPieces(layout, n))
    if (pc.segment >= 0) // padding adds nothing
      for (int64_t b = pc.begin; b < pc.end; b += kLambChunk)
        chunks.push_back({b, std::min(b + kLambChunk, pc.end), pc.segment, pc.decay && wd != 0});
  std::vector<double> sumP(chunks.size()), sumU(chunks.size());
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t j = 0; j < (int64_t)chunks.size(); ++j) {
    const Chunk ch = chunks[j];
    const int64_t len = ch.end - ch.begin;
    const T *pj = p + ch.begin, *gj = g + ch.begin;
    T u[kLambChunk];
    for (int64_t s0 = 0; s0 < len; s0 += kLambWiden) {
      const int64_t sl = std::min(kLambWiden, len - s0);
      const T *mw, *vw;
      T mb[In::kInPlace ? 1 : kLambWiden], vb[In::kInPlace ? 1 : kLambWiden];
      in.read(ch.begin + s0, sl, mb, vb, mw, vw);
#pragma omp simd
      for (int64_t i = 0; i < sl; ++i) {
        T nm, nv;
        u[s0 + i] = lambDirection(c, pj[s0 + i], gj[s0 + i], mw[i], vw[i], gradScale, ch.decay, twd,
                                  nm, nv);
      }
    }
    // serial: a vectorized reduction's order would follow the alignment
    double sp = 0, su = 0;
    for (int64_t i = 0; i < len; ++i) {
      sp += (double)pj[i] * (double)pj[i];
      su += (double)u[i] * (double)u[i];
    }
    sumP[j] = sp;
    sumU[j] = su;
  }
  std::vector<double> segP(K > 0 ? K : 0), segU(segP.size());
  for (size_t j = 0; j < chunks.size(); ++j) {
    segP[chunks[j].segment] += sumP[j];
    segU[chunks[j].segment] += sumU[j];
  }
  for (int64_t k = 0; k < K; ++k) {
    norms[k] = (T)segP[k];
    norms[K + k] = (T)segU[k];
  }
}

/// The trust ratio ||p|| / ||u|| of piece pc's whole parameter (the sums
/// over every shard, norms[k] and norms[K + k]), only where weight decay
/// applies (timm, apex); 1 elsewhere and on padding.
template <typename T>
T lambTrust(const LambLayout &layout, const T *norms, int64_t K, double wd, const LambPiece &pc) {
  if (pc.segment >= 0 && wd != 0 && layout.segments[pc.segment] < layout.decayNumel) {
    double pn = norms[pc.segment], un = norms[K + pc.segment];
    if (pn > 0 && un > 0)
      return (T)(std::sqrt(pn) / std::sqrt(un));
  }
  return T(1);
}

/// lamb_update over moments stored as S: T (written as computed) or bf16
/// (uint16_t: the new moments computed into chunk buffers, then rounded
/// once as `rounding` says, as adamwUpdateBf16State does).
template <typename T, typename S>
void lambUpdateT(const T *p, const T *g, const S *m, const S *v, const T *norms, T *np, S *nm,
                 S *nv, int64_t n, const LambLayout &layout, double lr, int64_t step, double beta1,
                 double beta2, double eps, double wd, T gradScale, const MomentRounding &rounding) {
  constexpr bool kSame = kSameState<T, S>;
  const int64_t K = (int64_t)layout.segments.size() - 1;
  const LambScalars<T> c = lambScalars<T>(step, beta1, beta2, eps);
  const T twd = (T)wd, tlr = (T)lr;
  const MomentRounding r = rounding;
  // The pieces cut into chunks as lamb_norms cuts them, so a unit of many
  // small parameters runs in parallel too (one parallel loop per piece ran
  // each below the grain, serially, and paid its set-up every time).
  struct Chunk {
    int64_t begin, end;
    T trust;
    bool decay;
  };
  std::vector<Chunk> chunks;
  for (const LambPiece &pc : lambPieces(layout, n)) {
    const T trust = lambTrust(layout, norms, K, wd, pc);
    for (int64_t b = pc.begin; b < pc.end; b += kLambChunk)
      chunks.push_back({b, std::min(b + kLambChunk, pc.end), trust, pc.decay && wd != 0});
  }
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t j = 0; j < (int64_t)chunks.size(); ++j) {
    const Chunk ch = chunks[j];
    for (int64_t s0 = ch.begin; s0 < ch.end; s0 += kLambWiden) {
      const int64_t sl = std::min(kLambWiden, ch.end - s0);
      const T *pj = p + s0, *gj = g + s0;
      T *npj = np + s0;
      // f32 state: read and written in place; bf16: widened into mb, vb,
      // which then take the new f32 moments (element i read, then written,
      // by iteration i only), rounded below.
      const T *mw, *vw;
      T mb[kSame ? 1 : kLambWiden], vb[kSame ? 1 : kLambWiden];
      widenStates(m + s0, v + s0, sl, mb, vb, mw, vw);
      T *nmj, *nvj;
      if constexpr (kSame)
        nmj = nm + s0, nvj = nv + s0;
      else
        nmj = mb, nvj = vb;
#pragma omp simd
      for (int64_t i = 0; i < sl; ++i) {
        T mi, vi;
        T u = lambDirection(c, pj[i], gj[i], mw[i], vw[i], gradScale, ch.decay, twd, mi, vi);
        npj[i] = pj[i] - tlr * (u * ch.trust);
        nmj[i] = mi;
        nvj[i] = vi;
      }
      if constexpr (!kSame) {
        S *om = nm + s0, *ov = nv + s0;
        if (r.stochastic) {
#pragma omp simd
          for (int64_t i = 0; i < sl; ++i)
            roundMomentsToBf16Stochastic(mb[i], vb[i], r.key, r.first + (uint64_t)(s0 + i), om[i],
                                         ov[i]);
        } else {
#pragma omp simd
          for (int64_t i = 0; i < sl; ++i) {
            om[i] = roundToBf16(mb[i]);
            ov[i] = roundToBf16(vb[i]);
          }
        }
      }
    }
  }
}

} // namespace

template <typename T>
void lambNorms(const T *p, const T *g, const T *m, const T *v, T *norms, int64_t n,
               const LambLayout &layout, int64_t step, double beta1, double beta2, double eps,
               double wd, T gradScale) {
  lambNormsT(p, g, WideMoments<T, T>{m, v}, norms, n, layout, step, beta1, beta2, eps, wd,
             gradScale);
}

template <typename T>
void lambUpdate(const T *p, const T *g, const T *m, const T *v, const T *norms, T *np, T *nm, T *nv,
                int64_t n, const LambLayout &layout, double lr, int64_t step, double beta1,
                double beta2, double eps, double wd, T gradScale) {
  lambUpdateT(p, g, m, v, norms, np, nm, nv, n, layout, lr, step, beta1, beta2, eps, wd, gradScale,
              MomentRounding{});
}

void lambNormsBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                        float *norms, int64_t n, const LambLayout &layout, int64_t step,
                        double beta1, double beta2, double eps, double wd, float gradScale) {
  lambNormsT(p, g, WideMoments<float, uint16_t>{m, v}, norms, n, layout, step, beta1, beta2, eps,
             wd, gradScale);
}

void lambNorms8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                        float *norms, int64_t n, int64_t block, const LambLayout &layout,
                        int64_t step, double beta1, double beta2, double eps, double wd,
                        float gradScale) {
  lambNormsT(p, g, Codes8Moments{m, v, n, block}, norms, n, layout, step, beta1, beta2, eps, wd,
             gradScale);
}

namespace {

/// A run of one trust ratio and one weight decay of a LAMB operand (every
/// element lies in one).
struct LambRun {
  int64_t begin, end;
  float trust;
  bool decay;
};
/// One 8-bit LAMB update's operands (lambUpdate8bitState).
struct Lamb8 {
  const float *p, *g;
  const uint8_t *m, *v;
  float *np;
  uint8_t *nm, *nv;
  int64_t n, block;
  const std::vector<LambRun> *runs;
  LambScalars<float> c;
  float twd, tlr, gradScale;
};

/// Block j: decoded, each element stepped with lambUpdate<float>'s
/// arithmetic (the parameter reads the f32 moments, as lamb_norms' u
/// does) with the trust ratio of its run, the new moments encoded once.
/// In place allowed: the block is read whole before its codes and scales
/// are written. Correctly rounded operations only (no contraction on any
/// target it is built for), so every build stores the same bytes.
[[gnu::always_inline]] inline void lamb8bitBlock(const Lamb8 &u, int64_t j) {
  namespace m8 = moments8;
  const int64_t at = m8::scalesOffset(u.n), o = j * u.block, len = std::min(u.block, u.n - o);
  if (len <= 0 || len > m8::kMaxBlock) // (never: o < n; told to GCC's bounds warnings)
    return;
  float mf[m8::kMaxBlock], vf[m8::kMaxBlock];
  m8::decodeRange(u.m + o, u.m + at + 4 * j, o, len, u.block, false, mf);
  m8::decodeRange(u.v + o, u.v + at + 4 * j, o, len, u.block, true, vf);
  const std::vector<LambRun> &runs = *u.runs;
  auto r = std::upper_bound(runs.begin(), runs.end(), o,
                            [](int64_t x, const LambRun &run) { return x < run.end; });
  const float *pj = u.p + o, *gj = u.g + o;
  float *npj = u.np + o;
  for (; r != runs.end() && r->begin < o + len; ++r) {
    const int64_t a = std::max(r->begin, o) - o, b = std::min(r->end, o + len) - o;
    const float trust = r->trust, tlr = u.tlr, twd = u.twd, gs = u.gradScale;
    const bool decay = r->decay;
#pragma omp simd
    for (int64_t i = a; i < b; ++i) {
      float mi, vi;
      const float d = lambDirection(u.c, pj[i], gj[i], mf[i], vf[i], gs, decay, twd, mi, vi);
      npj[i] = pj[i] - tlr * (d * trust);
      mf[i] = mi;
      vf[i] = vi;
    }
  }
  storeMoments8(mf, vf, len, u.nm, u.nv, at, o, j);
}

void lamb8bitBlockBaseline(const Lamb8 &u, int64_t j) { lamb8bitBlock(u, j); }
/// The same block with AVX2's 8-lane operations (the same bytes).
__attribute__((target("avx2"))) void lamb8bitBlockAvx2(const Lamb8 &u, int64_t j) {
  lamb8bitBlock(u, j);
}

} // namespace

void lambUpdate8bitState(const float *p, const float *g, const uint8_t *m, const uint8_t *v,
                         const float *norms, float *np, uint8_t *nm, uint8_t *nv, int64_t n,
                         int64_t block, const LambLayout &layout, double lr, int64_t step,
                         double beta1, double beta2, double eps, double wd, float gradScale,
                         Isa isa) {
  const int64_t K = (int64_t)layout.segments.size() - 1;
  std::vector<LambRun> runs;
  for (const LambPiece &pc : lambPieces(layout, n))
    runs.push_back({pc.begin, pc.end, lambTrust(layout, norms, K, wd, pc), pc.decay && wd != 0});
  const Lamb8 u{p,
                g,
                m,
                v,
                np,
                nm,
                nv,
                n,
                block,
                &runs,
                lambScalars<float>(step, beta1, beta2, eps),
                (float)wd,
                (float)lr,
                gradScale};
  // Isa::Avx2 on a CPU without it runs the baseline build (the same
  // bytes), never an instruction the CPU lacks.
  void (*const run)(const Lamb8 &, int64_t) =
      isa == Isa::Baseline || !cpuHasAvx2() ? lamb8bitBlockBaseline : lamb8bitBlockAvx2;
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t j = 0; j < blocks; ++j)
    run(u, j);
  // the codes' padding to 4 bytes stays zero
  for (int64_t i = n; i < moments8::scalesOffset(n); ++i)
    nm[i] = nv[i] = 0;
}

void lambUpdateBf16State(const float *p, const float *g, const uint16_t *m, const uint16_t *v,
                         const float *norms, float *np, uint16_t *nm, uint16_t *nv, int64_t n,
                         const LambLayout &layout, double lr, int64_t step, double beta1,
                         double beta2, double eps, double wd, float gradScale,
                         const MomentRounding &rounding) {
  lambUpdateT(p, g, m, v, norms, np, nm, nv, n, layout, lr, step, beta1, beta2, eps, wd, gradScale,
              rounding);
}

float gradCoef(float sumsq, float scale, double maxNorm) {
  double sc = scale;
  double c = 1.0;
  if (maxNorm > 0)
    c = std::min(maxNorm / (std::sqrt((double)sumsq) / sc + 1e-6), 1.0);
  return (float)((double)(float)c / sc);
}

template <typename T> double squaredNorm(const T *x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i)
    s += (double)x[i] * (double)x[i];
  return s;
}

// One definition of the bf16 rounding for the whole runtime
// (runtime/core/Bf16.h); these are the kernels' names for it.
uint16_t floatToBf16(float f) { return roundToBf16(f); }

float bf16ToFloat(uint16_t h) { return widenBf16(h); }

uint16_t floatToHalf(float f) { return roundToHalf(f); }

float halfToFloat(uint16_t h) { return widenHalf(h); }

// Explicit instantiations: float for the runtime, double for the tests.
#define FSDP_INSTANTIATE(T)                                                                        \
  template void binary<T>(BinaryKind, const T *, const Shape &, const T *, const Shape &, T *,     \
                          const Shape &);                                                          \
  template void broadcastTo<T>(const T *, const Shape &, T *, const Shape &);                      \
  template void sumTo<T>(const T *, const Shape &, T *, const Shape &);                            \
  template void neg<T>(const T *, T *, int64_t);                                                   \
  template void scale<T>(const T *, T *, int64_t, double);                                         \
  template void fill<T>(T *, int64_t, double);                                                     \
  template void dropout<T>(const T *, T *, int64_t, uint64_t, uint64_t, uint32_t, double);         \
  template void relu<T>(const T *, T *, int64_t);                                                  \
  template void reluGrad<T>(const T *, const T *, T *, int64_t);                                   \
  template void gelu<T>(const T *, T *, int64_t);                                                  \
  template void geluGrad<T>(const T *, const T *, T *, int64_t);                                   \
  template void geluExact<T>(const T *, T *, int64_t);                                             \
  template void geluExactGrad<T>(const T *, const T *, T *, int64_t);                              \
  template void softmax<T>(const T *, T *, int64_t, int64_t);                                      \
  template void softmaxGrad<T>(const T *, const T *, T *, int64_t, int64_t);                       \
  template void biasAdd<T>(const T *, const T *, T *, int64_t, int64_t);                           \
  template void matmul<T>(const T *, const T *, T *, int64_t, int64_t, int64_t, int64_t, bool,     \
                          bool, bool);                                                             \
  template void layerNorm<T>(const T *, const T *, const T *, T *, int64_t, int64_t, double);      \
  template void layerNormGrad<T>(const T *, const T *, const T *, T *, T *, T *, int64_t, int64_t, \
                                 double);                                                          \
  template void attention<T>(const T *, const T *, const T *, T *, T *, int64_t, int64_t, int64_t, \
                             int64_t, bool, int64_t, AttentionRows);                               \
  template void attentionGrad<T>(const T *, const T *, const T *, const T *, const T *, T *, T *,  \
                                 T *, int64_t, int64_t, int64_t, int64_t, bool, int64_t,           \
                                 AttentionRows);                                                   \
  template void silu<T>(const T *, T *, int64_t);                                                  \
  template void siluGrad<T>(const T *, const T *, T *, int64_t);                                   \
  template void swiglu<T>(const T *, const T *, T *, int64_t);                                     \
  template void swigluGrad<T>(const T *, const T *, const T *, T *, T *, int64_t);                 \
  template void rmsNorm<T>(const T *, const T *, T *, int64_t, int64_t, double);                   \
  template void rmsNormGrad<T>(const T *, const T *, const T *, T *, T *, int64_t, int64_t,        \
                               double);                                                            \
  template void rope<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t, double);               \
  template void ropeGrad<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t, double);           \
  template int64_t embedding<T, int32_t>(const T *, const int32_t *, T *, int64_t, int64_t,        \
                                         int64_t);                                                 \
  template int64_t embedding<T, int64_t>(const T *, const int64_t *, T *, int64_t, int64_t,        \
                                         int64_t);                                                 \
  template int64_t embeddingGrad<T, int32_t>(const int32_t *, const T *, T *, int64_t, int64_t,    \
                                             int64_t);                                             \
  template int64_t embeddingGrad<T, int64_t>(const int64_t *, const T *, T *, int64_t, int64_t,    \
                                             int64_t);                                             \
  template void transpose<T>(const T *, const Shape &, const std::vector<int64_t> &, T *);         \
  template void slice<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t);             \
  template void sliceGrad<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t);         \
  template int64_t crossEntropy<T, int32_t>(const T *, const int32_t *, T *, int64_t, int64_t,     \
                                            int64_t, double, const T *, int64_t);                  \
  template int64_t crossEntropy<T, int64_t>(const T *, const int64_t *, T *, int64_t, int64_t,     \
                                            int64_t, double, const T *, int64_t);                  \
  template int64_t crossEntropyGrad<T, int32_t>(const T *, const int32_t *, const T *, T *,        \
                                                int64_t, int64_t, int64_t, double, const T *,      \
                                                int64_t);                                          \
  template int64_t crossEntropyGrad<T, int64_t>(const T *, const int64_t *, const T *, T *,        \
                                                int64_t, int64_t, int64_t, double, const T *,      \
                                                int64_t);                                          \
  template void mseLoss<T>(const T *, const T *, T *, int64_t);                                    \
  template void mseLossGrad<T>(const T *, const T *, const T *, T *, int64_t);                     \
  template void bceWithLogits<T>(const T *, const T *, T *, int64_t);                              \
  template void bceWithLogitsGrad<T>(const T *, const T *, const T *, T *, int64_t);               \
  template void sgdUpdate<T>(const T *, const T *, T *, int64_t, double, double, T);               \
  template void sgdMomentumUpdate<T>(const T *, const T *, const T *, T *, T *, int64_t, double,   \
                                     int64_t, double, double, double, bool, T);                    \
  template void adamwUpdate<T>(const T *, const T *, const T *, const T *, T *, T *, T *, int64_t, \
                               double, int64_t, double, double, double, double, T);                \
  template void lambNorms<T>(const T *, const T *, const T *, const T *, T *, int64_t,             \
                             const LambLayout &, int64_t, double, double, double, double, T);      \
  template void lambUpdate<T>(const T *, const T *, const T *, const T *, const T *, T *, T *,     \
                              T *, int64_t, const LambLayout &, double, int64_t, double, double,   \
                              double, double, T);                                                  \
  template double squaredNorm<T>(const T *, int64_t);

FSDP_INSTANTIATE(float)
FSDP_INSTANTIATE(double)
#undef FSDP_INSTANTIATE

// Blocks in tasks of about 16K values (one block at least), so a task's
// loop is long enough to vectorize and the last block's owner writes the
// padding (quant::quantizeBlocks).
static int64_t blocksPerTask(int64_t block) {
  return std::max<int64_t>(1, (int64_t(1) << 14) / block);
}

void quantize(const float *x, int64_t n, int64_t block, uint8_t *out) {
  const int64_t blocks = shapes::quantizedBlocks(n, block), per = blocksPerTask(block);
#pragma omp parallel for if (n > kParallelGrain)
  for (int64_t b = 0; b < blocks; b += per)
    quant::quantizeBlocks(x, n, block, out, b, std::min(blocks, b + per));
}

void dequantize(const uint8_t *in, int64_t parts, int64_t n, int64_t block, void *y,
                DequantizeTo to) {
  const int64_t partBytes = shapes::quantizedBytes(n, block),
                blocks = shapes::quantizedBlocks(n, block);
  const int64_t per = blocksPerTask(block);
  auto *f = static_cast<float *>(y);
  auto *h = static_cast<uint16_t *>(y);
#pragma omp parallel for collapse(2) if (parts * n > kParallelGrain)
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t b = 0; b < blocks; b += per) {
      const uint8_t *part = in + p * partBytes;
      const int64_t at = p * n, b1 = std::min(blocks, b + per);
      if (to == DequantizeTo::F32)
        quant::dequantizeBlocks(part, n, block, b, b1, [&](int64_t i, float v) { f[at + i] = v; });
      else if (to == DequantizeTo::BF16)
        quant::dequantizeBlocks(part, n, block, b, b1,
                                [&](int64_t i, float v) { h[at + i] = roundToBf16(v); });
      else
        quant::dequantizeBlocks(part, n, block, b, b1,
                                [&](int64_t i, float v) { h[at + i] = roundToHalf(v); });
    }
}

void dequantizeSum(const uint8_t *in, int64_t parts, int64_t n, int64_t block, bool mean, void *y,
                   DequantizeTo to) {
  const int64_t blocks = shapes::quantizedBlocks(n, block), per = blocksPerTask(block);
  auto *f = static_cast<float *>(y);
  auto *h = static_cast<uint16_t *>(y);
#pragma omp parallel for if (parts * n > kParallelGrain)
  for (int64_t b = 0; b < blocks; b += per) {
    const int64_t b1 = std::min(blocks, b + per);
    if (to == DequantizeTo::F32)
      quant::dequantizeSumBlocks(in, parts, n, block, mean, b, b1,
                                 [&](int64_t i, float v) { f[i] = v; });
    else if (to == DequantizeTo::BF16)
      quant::dequantizeSumBlocks(in, parts, n, block, mean, b, b1,
                                 [&](int64_t i, float v) { h[i] = roundToBf16(v); });
    else
      quant::dequantizeSumBlocks(in, parts, n, block, mean, b, b1,
                                 [&](int64_t i, float v) { h[i] = roundToHalf(v); });
  }
}

} // namespace fsdp::cpu
