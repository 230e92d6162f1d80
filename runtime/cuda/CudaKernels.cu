//===- CudaKernels.cu - CUDA kernels for every op of a plan -----------------===//
//
// Straightforward, deterministic f32 kernels: grid-stride elementwise loops,
// one block per row for row-wise ops, fixed-order two-stage reductions.
// They are the correctness baseline of the CUDA backend; the fused and
// tuned kernels of the performance work are checked against them.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaKernels.h"

#include "runtime/core/Dropout.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/ShapeRules.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/cpu/Kernels.h" // lambPieces: the CPU's walk of a LAMB layout
#include "runtime/cuda/CudaCommon.cuh"

#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace fsdp::cuda {

// --- elementwise ------------------------------------------------------------------

namespace {
__device__ __forceinline__ float applyF32(BinaryKind k, float x, float y) {
  return k == BinaryKind::Add   ? x + y
         : k == BinaryKind::Sub ? x - y
         : k == BinaryKind::Mul ? x * y
                                : x / y;
}
} // namespace

cudaError_t binary(BinaryKind k, const float *a, const Shape &sa, const float *b,
                   const Shape &sb, float *out, const Shape &so, cudaStream_t s) {
  if (!fits(so) || !fits(sa) || !fits(sb))
    return cudaErrorInvalidValue;
  if (sa == so && sb == so) {
    // No broadcast (the tied embedding's two gradients, 0.25 ms with the
    // index arithmetic on the H200): four elements a thread where the
    // pointers are 16-byte aligned, then the tail; the same bits.
    const int64_t n = count(so);
    const bool vec = ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                       reinterpret_cast<uintptr_t>(out)) &
                      15) == 0;
    const int64_t n4 = vec ? n / 4 : 0;
    if (n4 > 0)
      if (cudaError_t e = forEach(n4, s, [=] __device__(int64_t i) {
            float4 x = reinterpret_cast<const float4 *>(a)[i],
                   y = reinterpret_cast<const float4 *>(b)[i];
            reinterpret_cast<float4 *>(out)[i] =
                float4{applyF32(k, x.x, y.x), applyF32(k, x.y, y.y), applyF32(k, x.z, y.z),
                       applyF32(k, x.w, y.w)};
          }))
        return e;
    return forEach(n - 4 * n4, s, [=] __device__(int64_t i) {
      int64_t j = 4 * n4 + i;
      out[j] = applyF32(k, a[j], b[j]);
    });
  }
  Dims d;
  d.rank = (int)so.size();
  for (int i = 0; i < d.rank; ++i)
    d.size[i] = so[i];
  alignStrides(sa, so, d.strideA);
  alignStrides(sb, so, d.strideB);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    out[i] = applyF32(k, a[ia], b[ib]);
  });
}

cudaError_t broadcastTo(const float *in, const Shape &si, float *out, const Shape &so,
                        cudaStream_t s) {
  if (!fits(so) || !fits(si))
    return cudaErrorInvalidValue;
  Dims d;
  d.rank = (int)so.size();
  for (int i = 0; i < d.rank; ++i)
    d.size[i] = so[i];
  alignStrides(si, so, d.strideA);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    out[i] = in[ia];
  });
}

cudaError_t sumTo(const float *in, const Shape &si, float *out, const Shape &so,
                  cudaStream_t s) {
  if (!fits(si) || so.size() > si.size())
    return cudaErrorInvalidValue;
  Dims keep, red; // keep: output index -> input offset; red: summed dims
  int64_t nred;
  sumToDims(si, so, keep, red, nred);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t base, unused;
    offsets(keep, i, base, unused);
    float acc = 0;
    for (int64_t j = 0; j < nred; ++j) { // row-major over the summed dims
      int64_t off, u2;
      offsets(red, j, off, u2);
      acc += in[base + off];
    }
    out[i] = acc;
  });
}

cudaError_t neg(const float *x, float *y, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) { y[i] = -x[i]; });
}

cudaError_t scale(const float *x, float *y, int64_t n, double f, cudaStream_t s) {
  float ff = (float)f;
  return forEach(n, s, [=] __device__(int64_t i) { y[i] = x[i] * ff; });
}

namespace {
/// The key once a thread (from the step context in device memory), then the
/// grid-stride loop over the elements.
__global__ void dropoutKernel(const float *x, float *y, int64_t n, const uint64_t *ctx,
                              int64_t id, uint64_t first, uint32_t threshold, float scale) {
  const uint64_t key = dropoutKey(ctx[0], (int64_t)ctx[1], id);
  FSDP_GRID_STRIDE(i, n) {
    y[i] = dropoutKeep(key, first + (uint64_t)i, threshold) ? x[i] * scale : 0.f;
  }
}
} // namespace

cudaError_t dropout(const float *x, float *y, int64_t n, const uint64_t *ctx, int64_t id,
                    uint64_t first, uint32_t threshold, double scale, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  dropoutKernel<<<gridFor(n), kThreads, 0, s>>>(x, y, n, ctx, id, first, threshold,
                                                (float)scale);
  return cudaGetLastError();
}

cudaError_t fill(float *y, int64_t n, double v, cudaStream_t s) {
  float fv = (float)v;
  return forEach(n, s, [=] __device__(int64_t i) { y[i] = fv; });
}

cudaError_t fillWords(uint32_t *y, int64_t n, uint32_t word, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) { y[i] = word; });
}

cudaError_t relu(const float *x, float *y, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) { y[i] = x[i] > 0.f ? x[i] : 0.f; });
}

cudaError_t reluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) { dx[i] = x[i] > 0.f ? dy[i] : 0.f; });
}

cudaError_t gelu(const float *x, float *y, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i];
    float u = (float)kGeluC * (v + (float)kGeluA * v * v * v);
    y[i] = 0.5f * v * (1.f + tanhf(u));
  });
}

cudaError_t geluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i];
    float u = (float)kGeluC * (v + (float)kGeluA * v * v * v);
    float t = tanhf(u);
    float du = (float)kGeluC * (1.f + (float)(3 * kGeluA) * v * v);
    dx[i] = dy[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
  });
}

cudaError_t geluExact(const float *x, float *y, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i];
    y[i] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  });
}

cudaError_t geluExactGrad(const float *x, const float *dy, float *dx, int64_t n,
                          cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i];
    float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
    float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  });
}

cudaError_t silu(const float *x, float *y, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i];
    y[i] = v / (1.f + expf(-v));
  });
}

cudaError_t siluGrad(const float *x, const float *dy, float *dx, int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = x[i], sg = 1.f / (1.f + expf(-v));
    dx[i] = dy[i] * sg * (1.f + v * (1.f - sg));
  });
}

cudaError_t biasAdd(const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                    cudaStream_t s) {
  return forEach(rows * cols, s, [=] __device__(int64_t i) { y[i] = x[i] + b[i % cols]; });
}

// --- row-wise ------------------------------------------------------------------------

namespace {

/// A row's maximum and sum of exp(x - max), block-reduced (every thread
/// gets both): the stable softmax / log-sum-exp of softmax and the losses.
__device__ void rowMaxSumExp(const float *xr, int64_t cols, float *sh, float &mx,
                             float &sum) {
  mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    mx = fmaxf(mx, xr[c]);
  mx = blockMax(mx, sh);
  sum = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    sum += expf(xr[c] - mx);
  sum = blockSum(sum, sh);
}

__global__ void softmaxKernel(const float *x, float *y, int64_t cols) {
  __shared__ float sh[32];
  const float *xr = x + blockIdx.x * cols;
  float *yr = y + blockIdx.x * cols;
  float mx, sum;
  rowMaxSumExp(xr, cols, sh, mx, sum);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    yr[c] = expf(xr[c] - mx) / sum;
}

__global__ void softmaxGradKernel(const float *y, const float *dy, float *dx, int64_t cols) {
  __shared__ float sh[32];
  int64_t o = blockIdx.x * cols;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += y[o + c] * dy[o + c];
  dot = blockSum(dot, sh);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dx[o + c] = y[o + c] * (dy[o + c] - dot);
}

/// Row mean and 1/sqrt(biased variance + eps), two passes, into stats.
__global__ void layerNormKernel(const float *x, const float *g, const float *b, float *y,
                                float *stats, int64_t rows, int64_t cols, float eps) {
  __shared__ float sh[32];
  const float *xr = x + blockIdx.x * cols;
  float sum = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    sum += xr[c];
  float mean = blockSum(sum, sh) / (float)cols;
  float var = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    var += (xr[c] - mean) * (xr[c] - mean);
  var = blockSum(var, sh) / (float)cols;
  float rstd = 1.f / sqrtf(var + eps);
  if (stats && threadIdx.x == 0) {
    stats[blockIdx.x] = mean;
    stats[rows + blockIdx.x] = rstd;
  }
  if (y)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      y[blockIdx.x * cols + c] = (xr[c] - mean) * rstd * g[c] + b[c];
}

/// dx = rstd (dy g - mean(dy g) - xhat mean(dy g xhat)).
__global__ void layerNormDxKernel(const float *x, const float *g, const float *dy, float *dx,
                                  const float *stats, int64_t rows, int64_t cols) {
  __shared__ float sh[32];
  int64_t o = blockIdx.x * cols;
  float mean = stats[blockIdx.x], rstd = stats[rows + blockIdx.x];
  float s1 = 0, s2 = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float gy = dy[o + c] * g[c], xhat = (x[o + c] - mean) * rstd;
    s1 += gy;
    s2 += gy * xhat;
  }
  s1 = blockSum(s1, sh) / (float)cols;
  s2 = blockSum(s2, sh) / (float)cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float gy = dy[o + c] * g[c], xhat = (x[o + c] - mean) * rstd;
    dx[o + c] = rstd * (gy - s1 - xhat * s2);
  }
}

__global__ void rmsKernel(const float *x, const float *w, float *y, float *rstdOut,
                          int64_t cols, double eps) {
  __shared__ double sh[32];
  const float *xr = x + blockIdx.x * cols;
  double ss = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    ss += (double)xr[c] * (double)xr[c];
  ss = blockSum(ss, sh);
  float rstd = (float)(1.0 / sqrt(ss / (double)cols + eps));
  if (rstdOut && threadIdx.x == 0)
    rstdOut[blockIdx.x] = rstd;
  if (y)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      y[blockIdx.x * cols + c] = xr[c] * rstd * w[c];
}

__global__ void rmsDxKernel(const float *x, const float *w, const float *dy, float *dx,
                            const float *rstdIn, int64_t cols) {
  __shared__ double sh[32];
  int64_t o = blockIdx.x * cols;
  float rstd = rstdIn[blockIdx.x];
  double dot = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += (double)(dy[o + c] * w[c]) * (double)(x[o + c] * rstd);
  float m = (float)(blockSum(dot, sh) / (double)cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dx[o + c] = rstd * (dy[o + c] * w[c] - x[o + c] * rstd * m);
}

} // namespace

cudaError_t softmax(const float *x, float *y, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  softmaxKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, y, cols);
  return cudaGetLastError();
}

cudaError_t softmaxGrad(const float *y, const float *dy, float *dx, int64_t rows,
                        int64_t cols, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  softmaxGradKernel<<<(unsigned)rows, kThreads, 0, s>>>(y, dy, dx, cols);
  return cudaGetLastError();
}

cudaError_t layerNorm(const float *x, const float *g, const float *b, float *y,
                      int64_t rows, int64_t cols, double eps, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  layerNormKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, g, b, y, nullptr, rows, cols,
                                                      (float)eps);
  return cudaGetLastError();
}

cudaError_t layerNormGrad(const float *x, const float *g, const float *dy, float *dx,
                          float *dg, float *db, float *scratch, int64_t rows, int64_t cols,
                          double eps, cudaStream_t s) {
  if (rows <= 0) {
    if (cudaError_t e = cudaMemsetAsync(dg, 0, sizeof(float) * cols, s))
      return e;
    return cudaMemsetAsync(db, 0, sizeof(float) * cols, s);
  }
  layerNormKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, g, nullptr, nullptr, scratch, rows,
                                                      cols, (float)eps);
  layerNormDxKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, g, dy, dx, scratch, rows, cols);
  if (cudaError_t e = cudaGetLastError())
    return e;
  // dgamma, dbeta: one thread per column sums the rows in order.
  const float *st = scratch;
  return forEach(cols, s, [=] __device__(int64_t c) {
    float sg = 0, sb = 0;
    for (int64_t r = 0; r < rows; ++r) {
      float d = dy[r * cols + c];
      sg += d * ((x[r * cols + c] - st[r]) * st[rows + r]);
      sb += d;
    }
    dg[c] = sg;
    db[c] = sb;
  });
}

cudaError_t rmsNorm(const float *x, const float *w, float *y, int64_t rows, int64_t cols,
                    double eps, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  rmsKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, w, y, nullptr, cols, eps);
  return cudaGetLastError();
}

cudaError_t rmsNormGrad(const float *x, const float *w, const float *dy, float *dx,
                        float *dw, float *scratch, int64_t rows, int64_t cols, double eps,
                        cudaStream_t s) {
  if (rows <= 0)
    return cudaMemsetAsync(dw, 0, sizeof(float) * cols, s);
  rmsKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, w, nullptr, scratch, cols, eps);
  rmsDxKernel<<<(unsigned)rows, kThreads, 0, s>>>(x, w, dy, dx, scratch, cols);
  if (cudaError_t e = cudaGetLastError())
    return e;
  const float *rs = scratch;
  return forEach(cols, s, [=] __device__(int64_t c) {
    float acc = 0;
    for (int64_t r = 0; r < rows; ++r)
      acc += dy[r * cols + c] * (x[r * cols + c] * rs[r]);
    dw[c] = acc;
  });
}

// --- attention -------------------------------------------------------------------------

namespace {

struct AttnDims {
  int64_t B, T, C, H, KV, D, KC; // KC = KV * D
  bool causal;
  float scale;
};

AttnDims attnDims(int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                  int64_t kvHeads) {
  AttnDims a;
  a.B = B;
  a.T = T;
  a.C = C;
  a.H = heads;
  a.KV = kvHeads > 0 ? kvHeads : heads;
  a.D = C / heads;
  a.KC = a.KV * a.D;
  a.causal = causal;
  a.scale = 1.f / sqrtf((float)a.D);
  return a;
}

__device__ inline float dotRow(const float *a, const float *b, int64_t D) {
  float acc = 0;
  for (int64_t d = 0; d < D; ++d)
    acc += a[d] * b[d];
  return acc;
}

/// Scores of query row t against keys 0..S-1 into p (shared), softmax
/// normalised; returns the log-sum-exp. Block per (b, h, t).
__device__ float attnRow(const AttnDims &a, const float *q, const float *k, int64_t b,
                         int64_t h, int64_t t, float *p, float *sh) {
  int64_t S = a.causal ? t + 1 : a.T;
  int64_t kvh = h / (a.H / a.KV);
  const float *qr = q + (b * a.T + t) * a.C + h * a.D;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
    float sc = dotRow(qr, k + (b * a.T + j) * a.KC + kvh * a.D, a.D) * a.scale;
    p[j] = sc;
    mx = fmaxf(mx, sc);
  }
  mx = blockMax(mx, sh);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
    float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = blockSum(sum, sh);
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x)
    p[j] /= sum;
  __syncthreads();
  return mx + logf(sum);
}

__global__ void attnForwardKernel(AttnDims a, const float *q, const float *k, const float *v,
                                  float *y, float *lse) {
  extern __shared__ float p[];
  __shared__ float sh[32];
  int64_t t = blockIdx.x % a.T, h = (blockIdx.x / a.T) % a.H, b = blockIdx.x / (a.T * a.H);
  float l = attnRow(a, q, k, b, h, t, p, sh);
  if (lse && threadIdx.x == 0)
    lse[blockIdx.x] = l;
  int64_t S = a.causal ? t + 1 : a.T, kvh = h / (a.H / a.KV);
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < S; ++j)
      acc += p[j] * v[(b * a.T + j) * a.KC + kvh * a.D + d];
    y[(b * a.T + t) * a.C + h * a.D + d] = acc;
  }
}

/// Pass 1 of the backward: delta = dy_t . y_t per (b, h, t), block per row.
__global__ void attnDeltaKernel(AttnDims a, const float *y, const float *dy, float *delta) {
  __shared__ float sh[32];
  int64_t t = blockIdx.x % a.T, h = (blockIdx.x / a.T) % a.H, b = blockIdx.x / (a.T * a.H);
  int64_t at = (b * a.T + t) * a.C + h * a.D;
  float dot = 0;
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x)
    dot += y[at + d] * dy[at + d];
  dot = blockSum(dot, sh);
  if (threadIdx.x == 0)
    delta[blockIdx.x] = dot;
}

/// Pass 2: dq_t = scale sum_j p_tj (dy_t . v_j - delta_t) k_j.
__global__ void attnDqKernel(AttnDims a, const float *q, const float *k, const float *v,
                             const float *dy, const float *lse, const float *delta,
                             float *dq) {
  extern __shared__ float ds[];
  int64_t t = blockIdx.x % a.T, h = (blockIdx.x / a.T) % a.H, b = blockIdx.x / (a.T * a.H);
  int64_t S = a.causal ? t + 1 : a.T, kvh = h / (a.H / a.KV);
  const float *qr = q + (b * a.T + t) * a.C + h * a.D;
  const float *dyr = dy + (b * a.T + t) * a.C + h * a.D;
  float l = lse[blockIdx.x], dl = delta[blockIdx.x];
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
    const float *kr = k + (b * a.T + j) * a.KC + kvh * a.D;
    const float *vr = v + (b * a.T + j) * a.KC + kvh * a.D;
    float pj = expf(dotRow(qr, kr, a.D) * a.scale - l);
    ds[j] = pj * (dotRow(dyr, vr, a.D) - dl);
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < S; ++j)
      acc += ds[j] * k[(b * a.T + j) * a.KC + kvh * a.D + d];
    dq[(b * a.T + t) * a.C + h * a.D + d] = acc * a.scale;
  }
}

/// Pass 3: per key row j of key/value head kvh: over the query heads of
/// its group and the rows t that see j, dk_j = scale sum p (dp - delta) q_t,
/// dv_j = sum p dy_t.
__global__ void attnDkvKernel(AttnDims a, const float *q, const float *k, const float *v,
                              const float *dy, const float *lse, const float *delta,
                              float *dk, float *dv) {
  extern __shared__ float smem[];
  float *pt = smem, *dst = smem + a.T, *acck = smem + 2 * a.T, *accv = acck + a.D;
  int64_t j = blockIdx.x % a.T, kvh = (blockIdx.x / a.T) % a.KV, b = blockIdx.x / (a.T * a.KV);
  const float *kr = k + (b * a.T + j) * a.KC + kvh * a.D;
  const float *vr = v + (b * a.T + j) * a.KC + kvh * a.D;
  int64_t group = a.H / a.KV, t0 = a.causal ? j : 0;
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x)
    acck[d] = accv[d] = 0;
  for (int64_t g = 0; g < group; ++g) {
    int64_t h = kvh * group + g;
    for (int64_t t = t0 + threadIdx.x; t < a.T; t += blockDim.x) {
      int64_t row = (b * a.H + h) * a.T + t;
      const float *qr = q + (b * a.T + t) * a.C + h * a.D;
      const float *dyr = dy + (b * a.T + t) * a.C + h * a.D;
      float p = expf(dotRow(qr, kr, a.D) * a.scale - lse[row]);
      pt[t] = p;
      dst[t] = p * (dotRow(dyr, vr, a.D) - delta[row]);
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
      float sk = 0, sv = 0;
      for (int64_t t = t0; t < a.T; ++t) {
        sk += dst[t] * q[(b * a.T + t) * a.C + h * a.D + d];
        sv += pt[t] * dy[(b * a.T + t) * a.C + h * a.D + d];
      }
      acck[d] += sk;
      accv[d] += sv;
    }
    __syncthreads();
  }
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    dk[(b * a.T + j) * a.KC + kvh * a.D + d] = acck[d] * a.scale;
    dv[(b * a.T + j) * a.KC + kvh * a.D + d] = accv[d];
  }
}

constexpr int64_t kAttnSmemFloats = 48 * 1024 / 4; // the default dynamic limit

} // namespace

int64_t attentionMaxT() { return kAttnSmemFloats / 2 - 2 * 256; }

cudaError_t attention(const float *q, const float *k, const float *v, float *y, float *lse,
                      int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                      int64_t kvHeads, cudaStream_t s) {
  if (T > attentionMaxT() || heads <= 0 || C % heads)
    return cudaErrorInvalidValue;
  AttnDims a = attnDims(B, T, C, heads, causal, kvHeads);
  if (B * heads * T <= 0)
    return cudaSuccess;
  attnForwardKernel<<<(unsigned)(B * heads * T), kThreads, sizeof(float) * T, s>>>(a, q, k,
                                                                                   v, y, lse);
  return cudaGetLastError();
}

int64_t attentionGradScratch(int64_t B, int64_t T, int64_t heads) { return B * heads * T; }

cudaError_t attentionGrad(const float *q, const float *k, const float *v, const float *y,
                          const float *lse, const float *dy, float *dq, float *dk, float *dv,
                          float *scratch, int64_t B, int64_t T, int64_t C, int64_t heads,
                          bool causal, int64_t kvHeads, cudaStream_t s) {
  if (T > attentionMaxT() || heads <= 0 || C % heads)
    return cudaErrorInvalidValue;
  AttnDims a = attnDims(B, T, C, heads, causal, kvHeads);
  if (a.D > 256)
    return cudaErrorInvalidValue;
  int64_t rows = B * heads * T;
  if (rows <= 0)
    return cudaSuccess;
  float *delta = scratch;
  attnDeltaKernel<<<(unsigned)rows, kThreads, 0, s>>>(a, y, dy, delta);
  attnDqKernel<<<(unsigned)rows, kThreads, sizeof(float) * T, s>>>(a, q, k, v, dy, lse, delta,
                                                                   dq);
  attnDkvKernel<<<(unsigned)(B * a.KV * T), kThreads, sizeof(float) * (2 * T + 2 * a.D), s>>>(
      a, q, k, v, dy, lse, delta, dk, dv);
  return cudaGetLastError();
}

// --- rope, embedding, data movement ---------------------------------------------------

namespace {
cudaError_t ropeRotate(const float *x, float *y, int64_t B, int64_t T, int64_t C,
                       int64_t heads, double theta, double sign, cudaStream_t s) {
  int64_t D = C / heads, half = D / 2;
  return forEach(B * T * heads * half, s, [=] __device__(int64_t idx) {
    int64_t i = idx % half, h = (idx / half) % heads, t = (idx / (half * heads)) % T,
            b = idx / (half * heads * T);
    // the CPU kernel's angle, in double, then rounded to float
    double ang = (double)t * pow(theta, -2.0 * (double)i / (double)D);
    float c = (float)cos(ang), sn = (float)(sign * sin(ang));
    const float *xr = x + (b * T + t) * C + h * D;
    float *yr = y + (b * T + t) * C + h * D;
    float x1 = xr[i], x2 = xr[i + half];
    yr[i] = x1 * c - x2 * sn;
    yr[i + half] = x2 * c + x1 * sn;
  });
}
} // namespace

cudaError_t rope(const float *x, float *y, int64_t B, int64_t T, int64_t C, int64_t heads,
                 double theta, cudaStream_t s) {
  return ropeRotate(x, y, B, T, C, heads, theta, 1.0, s);
}

cudaError_t ropeGrad(const float *dy, float *dx, int64_t B, int64_t T, int64_t C,
                     int64_t heads, double theta, cudaStream_t s) {
  return ropeRotate(dy, dx, B, T, C, heads, theta, -1.0, s);
}

cudaError_t embedding(const float *table, const int32_t *ids, float *y, int64_t n,
                      int64_t vocab, int64_t width, long long *badPos, cudaStream_t s) {
  return forEach(n * width, s, [=] __device__(int64_t i) {
    int64_t r = i / width, c = i % width;
    int32_t id = ids[r];
    if (id < 0 || id >= vocab) {
      y[i] = 0.f;
      if (c == 0)
        atomicMin(badPos, (long long)r);
      return;
    }
    y[i] = table[(int64_t)id * width + c];
  });
}

cudaError_t embeddingGrad(const int32_t *ids, const float *dy, float *dtable, int64_t n,
                          int64_t vocab, int64_t width, long long *badPos, cudaStream_t s) {
  if (cudaError_t e = cudaMemsetAsync(dtable, 0, sizeof(float) * vocab * width, s))
    return e;
  return forEach(width, s, [=] __device__(int64_t c) {
    for (int64_t r = 0; r < n; ++r) { // in id order, as the CPU kernel
      int32_t id = ids[r];
      if (id < 0 || id >= vocab) {
        if (c == 0)
          atomicMin(badPos, (long long)r);
        continue;
      }
      dtable[(int64_t)id * width + c] += dy[r * width + c];
    }
  });
}

cudaError_t transpose(const float *x, const Shape &sx, const std::vector<int64_t> &perm,
                      float *y, cudaStream_t s) {
  if (!fits(sx) || perm.size() != sx.size())
    return cudaErrorInvalidValue;
  int r = (int)sx.size();
  int64_t inStride[kMaxRank];
  int64_t st = 1;
  for (int d = r - 1; d >= 0; --d) {
    inStride[d] = st;
    st *= sx[d];
  }
  Dims d;
  d.rank = r;
  for (int i = 0; i < r; ++i) {
    d.size[i] = sx[perm[i]];
    d.strideA[i] = inStride[perm[i]];
  }
  return forEach(count(sx), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    y[i] = x[ia];
  });
}

cudaError_t slice(const float *x, float *y, int64_t outer, int64_t full, int64_t len,
                  int64_t inner, int64_t offset, cudaStream_t s) {
  return forEach(outer * len * inner, s, [=] __device__(int64_t i) {
    int64_t in = i % inner, l = (i / inner) % len, o = i / (inner * len);
    y[i] = x[(o * full + offset + l) * inner + in];
  });
}

cudaError_t place(const float *x, float *y, int64_t outer, int64_t full, int64_t len,
                  int64_t inner, int64_t offset, cudaStream_t s) {
  return forEach(outer * len * inner, s, [=] __device__(int64_t i) {
    int64_t in = i % inner, l = (i / inner) % len, o = i / (inner * len);
    y[(o * full + offset + l) * inner + in] = x[i];
  });
}

cudaError_t sliceGrad(const float *dy, float *dx, int64_t outer, int64_t full, int64_t len,
                      int64_t inner, int64_t offset, cudaStream_t s) {
  if (cudaError_t e = cudaMemsetAsync(dx, 0, sizeof(float) * outer * full * inner, s))
    return e;
  return place(dy, dx, outer, full, len, inner, offset, s);
}

// --- losses and reductions ----------------------------------------------------------------

namespace {

/// Stage 2 of every fixed-order reduction: out = scale * sum(partial[0..n)),
/// one block, rounded to Out once (double: kept, as squaredNorm's
/// per-tensor totals).
template <typename Out>
__global__ void finishSum(const double *partial, int64_t n, double scale, Out *out) {
  __shared__ double sh[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    acc += partial[i];
  acc = blockSum(acc, sh);
  if (threadIdx.x == 0)
    *out = (Out)(acc * scale);
}

template <typename F>
__global__ void partialSums(int64_t n, F term, double *partial) {
  __shared__ double sh[32];
  double acc = 0;
  FSDP_GRID_STRIDE(i, n) acc += term(i);
  acc = blockSum(acc, sh);
  if (threadIdx.x == 0)
    partial[blockIdx.x] = acc;
}

/// *out = scale * sum_i term(i), in double, in a fixed order.
template <typename F>
cudaError_t reduceSum(int64_t n, F term, double scale, float *out, double *partial,
                      cudaStream_t s) {
  partialSums<<<kReduceBlocks, kThreads, 0, s>>>(n, term, partial);
  finishSum<<<1, kThreads, 0, s>>>(partial, kReduceBlocks, scale, out);
  return cudaGetLastError();
}

// Row r of the logits starts at r * stride; its first `classes` columns are
// the classes, the rest (fsdp-pad-classes' padding) are left out of the
// softmax and get a zero gradient.
// With label smoothing e the row's term and gradient take the smoothed
// target (smoothedCeTerm, ceTarget).
// With ignore_index (ig) a skipped row's term and gradient are 0.
__global__ void ceRowKernel(const float *logits, const int32_t *labels, double *perRow,
                            int64_t classes, int64_t stride, long long *badPos, double e,
                            CeIgnore ig) {
  __shared__ float sh[32];
  __shared__ double shd[32];
  const float *lr = logits + blockIdx.x * stride;
  int32_t label = labels[blockIdx.x];
  bool skip = ceSkip(ig, label);
  bool bad = !skip && (label < 0 || label >= classes);
  float mx, sum;
  rowMaxSumExp(lr, classes, sh, mx, sum);
  double xs = 0;
  if (e != 0) {
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
      xs += (double)lr[c];
    xs = blockSum(xs, shd);
  }
  if (threadIdx.x == 0) {
    if (bad)
      atomicMin(badPos, (long long)blockIdx.x);
    perRow[blockIdx.x] = bad || skip ? 0.0
                         : e == 0
                             ? (double)(logf(sum) + mx - lr[label])
                             : smoothedCeTerm((double)(logf(sum) + mx), lr[label], xs, classes, e);
  }
}

__global__ void ceGradKernel(const float *logits, const int32_t *labels, const float *dloss,
                             float *dlogits, int64_t rows, int64_t classes, int64_t stride,
                             long long *badPos, double e, CeIgnore ig) {
  __shared__ float sh[32];
  const float *lr = logits + blockIdx.x * stride;
  float *dr = dlogits + blockIdx.x * stride;
  int32_t label = labels[blockIdx.x];
  bool skip = ceSkip(ig, label);
  float mx, sum;
  rowMaxSumExp(lr, classes, sh, mx, sum);
  float f = ceFactor(dloss, rows, ig);
  CeTarget t = ceTarget(f, classes, e);
  for (int64_t c = threadIdx.x; c < stride; c += blockDim.x)
    dr[c] = c < classes && !skip
                ? expf(lr[c] - mx) / sum * f - (t.uniform + (c == label ? t.onLabel : 0.f))
                : 0.f;
  if (threadIdx.x == 0 && !skip && (label < 0 || label >= classes))
    atomicMin(badPos, (long long)blockIdx.x);
}

__global__ void countLabelsKernel(const int32_t *labels, int64_t n, int32_t ignore, int64_t divisor,
                                  float *out) {
  __shared__ double sh[32];
  double kept = 0; // exact: counts below 2^53
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    kept += labels[i] != ignore ? 1.0 : 0.0;
  kept = blockSum(kept, sh);
  if (threadIdx.x == 0)
    *out = (float)(kept / (double)divisor);
}

} // namespace

int64_t reductionScratch() { return kReduceBlocks; }

cudaError_t crossEntropy(const float *logits, const int32_t *labels, float *loss, double *scratch,
                         int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                         cudaStream_t s, double smoothing, CeIgnore ignore) {
  if (rows <= 0 || classes <= 0 || stride < classes)
    return cudaErrorInvalidValue;
  ceRowKernel<<<(unsigned)rows, kThreads, 0, s>>>(logits, labels, scratch, classes, stride, badPos,
                                                  smoothing, ignore);
  if (ignore.count)
    ceMeanOfRows<<<1, kThreads, 0, s>>>(scratch, rows, ignore, loss);
  else
    finishSum<<<1, kThreads, 0, s>>>(scratch, rows, 1.0 / (double)rows, loss);
  return cudaGetLastError();
}

cudaError_t countLabels(const int32_t *labels, int64_t n, int32_t ignore, int64_t divisor,
                        float *out, cudaStream_t s) {
  if (n < 0 || divisor < 1)
    return cudaErrorInvalidValue;
  countLabelsKernel<<<1, kThreads, 0, s>>>(labels, n, ignore, divisor, out);
  return cudaGetLastError();
}

cudaError_t crossEntropyGrad(const float *logits, const int32_t *labels, const float *dloss,
                             float *dlogits, int64_t rows, int64_t classes, int64_t stride,
                             long long *badPos, cudaStream_t s, double smoothing, CeIgnore ignore) {
  if (rows <= 0 || classes <= 0 || stride < classes)
    return cudaErrorInvalidValue;
  ceGradKernel<<<(unsigned)rows, kThreads, 0, s>>>(logits, labels, dloss, dlogits, rows, classes,
                                                   stride, badPos, smoothing, ignore);
  return cudaGetLastError();
}

cudaError_t mseLoss(const float *x, const float *t, float *loss, double *partial, int64_t n,
                    cudaStream_t s) {
  return reduceSum(
      n,
      [=] __device__(int64_t i) {
        double d = (double)(x[i] - t[i]);
        return d * d;
      },
      1.0 / (double)n, loss, partial, s);
}

cudaError_t mseLossGrad(const float *x, const float *t, const float *dl, float *dx,
                        int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    dx[i] = (x[i] - t[i]) * (2.f * *dl / (float)n);
  });
}

cudaError_t bceWithLogits(const float *x, const float *t, float *loss, double *partial,
                          int64_t n, cudaStream_t s) {
  return reduceSum(
      n,
      [=] __device__(int64_t i) {
        float v = x[i];
        return (double)(fmaxf(v, 0.f) - v * t[i] + log1pf(expf(-fabsf(v))));
      },
      1.0 / (double)n, loss, partial, s);
}

cudaError_t bceWithLogitsGrad(const float *x, const float *t, const float *dl, float *dx,
                              int64_t n, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    float sig = 1.f / (1.f + expf(-x[i]));
    dx[i] = (sig - t[i]) * (*dl / (float)n);
  });
}

namespace {

/// Stage-1 blocks of squaredNorm: enough 16-byte loads in flight to reach
/// the memory's bandwidth on a large GPU (the gradient norm reads every
/// gradient once a step).
constexpr int kNormBlocks = 1024;

/// partial[block] = the block's share of sum_i x_i^2, each square and sum
/// in double (a float's square is exact there): 16-byte loads where x is
/// 16-byte aligned, then the tail. The partition is fixed (kNormBlocks x
/// kThreads threads, each over a fixed grid stride): the same sum every run.
__global__ void squaresPartial(const float *x, int64_t n, double *partial) {
  __shared__ double sh[32];
  double acc = 0;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x,
                stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t n4 = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / 4 : 0;
  const float4 *x4 = reinterpret_cast<const float4 *>(x);
  for (int64_t i = first; i < n4; i += stride) {
    float4 v = x4[i];
    acc += (double)v.x * v.x;
    acc += (double)v.y * v.y;
    acc += (double)v.z * v.z;
    acc += (double)v.w * v.w;
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride)
    acc += (double)x[i] * x[i];
  acc = blockSum(acc, sh);
  if (threadIdx.x == 0)
    partial[blockIdx.x] = acc;
}

} // namespace

int64_t squaredNormScratch(int64_t tensors) { return kNormBlocks + tensors; }

cudaError_t squaredNorm(const std::vector<const float *> &xs, const std::vector<int64_t> &ns,
                        float *out, double *partial, cudaStream_t s) {
  if (xs.size() != ns.size())
    return cudaErrorInvalidValue;
  if (xs.empty())
    return fill(out, 1, 0.0, s);
  // partial[0..kNormBlocks) per tensor (in stream order: each tensor's
  // stage 2 has read them before the next one's stage 1 writes), its total
  // in partial[kNormBlocks + i], then the totals summed into out.
  for (size_t i = 0; i < xs.size(); ++i) {
    squaresPartial<<<kNormBlocks, kThreads, 0, s>>>(xs[i], ns[i], partial);
    finishSum<<<1, kThreads, 0, s>>>(partial, kNormBlocks, 1.0, partial + kNormBlocks + i);
  }
  finishSum<<<1, kThreads, 0, s>>>(partial + kNormBlocks, (int64_t)xs.size(), 1.0, out);
  return cudaGetLastError();
}

cudaError_t clipCoef(const float *sumsq, float *out, double maxNorm, cudaStream_t s) {
  return forEach(1, s, [=] __device__(int64_t) {
    double c = maxNorm / (sqrt((double)*sumsq) + 1e-6);
    *out = (float)(c < 1.0 ? c : 1.0);
  });
}

cudaError_t gradCoef(const float *sumsq, const float *scale, float *out, double maxNorm,
                     cudaStream_t s) {
  // as the CPU's grad_coef: the factor rounded to f32, then divided by the
  // (power-of-two) scale, which is exact
  return forEach(1, s, [=] __device__(int64_t) {
    double sc = *scale;
    double c = 1.0;
    if (maxNorm > 0) {
      c = maxNorm / (sqrt((double)*sumsq) / sc + 1e-6);
      c = c < 1.0 ? c : 1.0;
    }
    *out = (float)((double)(float)c / sc);
  });
}

// --- optimizers --------------------------------------------------------------------------

namespace {

/// sgd_update and sgd_momentum_update, a grid-stride loop each, so the
/// parameters' stochastic key (ParamIo) and the step's scalars are formed
/// once a thread rather than once an element.
__global__ void sgdKernel(Params q, const float *g, int64_t n, const float *lr, float twd,
                          bool decay, const float *skip, const float *gradScale) {
  const ParamIo io(q);
  if (skip && !isfinite(*skip)) {
    FSDP_GRID_STRIDE(i, n) io.keep(i);
    return;
  }
  const float rate = *lr;
  FSDP_GRID_STRIDE(i, n) {
    // Every operation rounded on its own, as cpu::sgdUpdate's (nvcc would
    // contract the decay and the step into FMAs on a GPU).
    const float p = io.load(i);
    float d = gradScale ? __fmul_rn(g[i], *gradScale) : g[i];
    if (decay)
      d = __fadd_rn(d, __fmul_rn(twd, p));
    io.store(i, __fsub_rn(p, __fmul_rn(rate, d)));
  }
}

__global__ void sgdMomentumKernel(Params q, const float *g, const float *buf, float *nbuf,
                                  int64_t n, const float *lr, const float *step, double momentum,
                                  double dampening, double wd, bool nesterov, const float *skip,
                                  const float *gradScale) {
  const ParamIo io(q);
  if (skip && !isfinite(*skip)) {
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nbuf[i] = buf[i];
    }
    return;
  }
  const SgdMomentumScalars c{
      *lr, (float)momentum, (float)(1 - dampening), (float)wd, wd != 0, *step < 2.f, nesterov};
  FSDP_GRID_STRIDE(i, n) {
    // __fmul_rn: the product rounded on its own, as the mul it replaces.
    float d = gradScale ? __fmul_rn(g[i], *gradScale) : g[i];
    float pn;
    sgdMomentumElement(c, io.load(i), d, buf[i], pn, nbuf[i]);
    io.store(i, pn);
  }
}

} // namespace

cudaError_t sgdUpdate(Params q, const float *g, int64_t n, const float *lr, double wd,
                      cudaStream_t s, const float *skip, const float *gradScale) {
  if (n <= 0)
    return cudaSuccess;
  sgdKernel<<<gridFor(n), kThreads, 0, s>>>(q, g, n, lr, (float)wd, wd != 0, skip, gradScale);
  return cudaGetLastError();
}

cudaError_t sgdUpdate(const float *p, const float *g, float *np, int64_t n, const float *lr,
                      double wd, cudaStream_t s, const float *skip, const float *gradScale) {
  return sgdUpdate(Params(p, np), g, n, lr, wd, s, skip, gradScale);
}

cudaError_t sgdMomentumUpdate(Params q, const float *g, const float *buf, float *nbuf, int64_t n,
                              const float *lr, const float *step, double momentum, double dampening,
                              double wd, bool nesterov, cudaStream_t s, const float *skip,
                              const float *gradScale) {
  if (n <= 0)
    return cudaSuccess;
  sgdMomentumKernel<<<gridFor(n), kThreads, 0, s>>>(q, g, buf, nbuf, n, lr, step, momentum,
                                                    dampening, wd, nesterov, skip, gradScale);
  return cudaGetLastError();
}

cudaError_t sgdMomentumUpdate(const float *p, const float *g, const float *buf, float *np,
                              float *nbuf, int64_t n, const float *lr, const float *step,
                              double momentum, double dampening, double wd, bool nesterov,
                              cudaStream_t s, const float *skip, const float *gradScale) {
  return sgdMomentumUpdate(Params(p, np), g, buf, nbuf, n, lr, step, momentum, dampening, wd,
                           nesterov, s, skip, gradScale);
}

cudaError_t adamwUpdate(const float *p, const float *g, const float *m, const float *v,
                        float *np, float *nm, float *nv, int64_t n, const float *lr,
                        const float *step, double beta1, double beta2, double eps,
                        double wd, cudaStream_t s) {
  return forEach(n, s, [=] __device__(int64_t i) {
    // the scalars per element: cheap beside the memory traffic, and no
    // host round trip for the step
    AdamwScalars c = adamwScalars(lr, step, beta1, beta2, eps, wd);
    adamwElement(c, p[i], g[i], m[i], v[i], np[i], nm[i], nv[i]);
  });
}

namespace {

/// LAMB's per-step scalars as cpu::lambScalars forms them (doubles, each
/// rounded once to f32), per thread: no host round trip for the step.
struct LambScalars {
  float b1, b2, omb1, omb2, bc1, bc2Sqrt, eps;
};
__device__ __forceinline__ LambScalars lambScalars(const float *stepp, double beta1, double beta2,
                                                   double eps) {
  double t = trunc((double)*stepp);
  return {(float)beta1,
          (float)beta2,
          (float)(1 - beta1),
          (float)(1 - beta2),
          (float)(1 - pow(beta1, t)),
          (float)sqrt(1 - pow(beta2, t)),
          (float)eps};
}
/// cpu::lambDirection's new moments alone (lambMoments8bitKernel's: they
/// take no trust ratio and no weight decay), rounded as lambElement's.
__device__ __forceinline__ void lambMoments(const LambScalars &c, float g, float m, float v,
                                            const float *gs, float &mi, float &vi) {
  float gi = gs ? __fmul_rn(g, *gs) : g;
  mi = __fadd_rn(__fmul_rn(m, c.b1), __fmul_rn(c.omb1, gi));
  vi = __fadd_rn(__fmul_rn(v, c.b2), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
}
/// cpu::lambDirection, every operation rounded on its own (no FMA
/// contraction: the CPU rounds each).
__device__ __forceinline__ float lambElement(const LambScalars &c, float p, float g, float m,
                                             float v, const float *gs, bool decay, float wd,
                                             float &nm, float &nv) {
  float mi, vi;
  lambMoments(c, g, m, v, gs, mi, vi);
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2Sqrt), c.eps);
  float u = __fdiv_rn(__fdiv_rn(mi, c.bc1), denom);
  nm = mi;
  nv = vi;
  return decay ? __fadd_rn(u, __fmul_rn(wd, p)) : u;
}

/// Stage-1 blocks of lamb_norms (one parameter at a time), as squaredNorm's.
constexpr int kLambBlocks = 1024;

/// The moments a LAMB kernel reads, element i of a piece: f32 or bf16
/// (state-dtype=bf16: widened) where they lie, m and v at the piece's start.
template <typename M> struct PlainMoments {
  const M *m, *v;
  __device__ __forceinline__ void operator()(int64_t i, float &mi, float &vi) const {
    mi = ld(m + i);
    vi = ld(v + i);
  }
};
/// 8-bit codes (state-dtype=8bit): element i of a piece is element at + i
/// of packed shards of codes m, v with block scales sm, sv, decoded as
/// cpu::lambNorms8bitState decodes them (exp_avg_sq as its root squared).
struct Codes8Moments {
  const uint8_t *m, *v;
  const float *sm, *sv;
  int64_t at;
  int shift; // log2 of the block (a power of two): a shift, not a 64-bit divide an element
  __device__ __forceinline__ void operator()(int64_t i, float &mi, float &vi) const {
    const int64_t e = at + i, j = e >> shift;
    mi = moments8::decodeM(m[e], sm[j]);
    const float r = moments8::decodeRoot(v[e], sv[j]);
    vi = __fmul_rn(r, r);
  }
};

/// partial[b] = block b's share of sum p^2 over one parameter's piece,
/// partial[gridDim.x + b] that of u^2; the partition is fixed for a length.
/// Ld: the moments' reader (PlainMoments, Codes8Moments).
template <typename Ld>
__global__ void lambSumsKernel(const float *p, const float *g, Ld ld, int64_t len,
                               const float *step, double beta1, double beta2, double eps,
                               const float *gs, bool decay, float wd, double *partial) {
  __shared__ double sh[32];
  LambScalars c = lambScalars(step, beta1, beta2, eps);
  double sp = 0, su = 0;
  FSDP_GRID_STRIDE(i, len) {
    float mi, vi, nm, nv;
    ld(i, mi, vi);
    float u = lambElement(c, p[i], g[i], mi, vi, gs, decay, wd, nm, nv);
    sp += (double)p[i] * p[i];
    su += (double)u * u;
  }
  sp = blockSum(sp, sh);
  su = blockSum(su, sh);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = sp;
    partial[gridDim.x + blockIdx.x] = su;
  }
}

/// The layout's pieces, or false when a parameter has two (decayNumel
/// inside it: the plan check refuses that).
bool lambPiecesOnce(const std::vector<int64_t> &segments, int64_t base, int64_t decayNumel,
                    int64_t n, std::vector<cpu::LambPiece> &out) {
  out = cpu::lambPieces(cpu::LambLayout{segments, base, decayNumel}, n);
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].segment >= 0 && out[i].segment == out[i - 1].segment)
      return false;
  return !segments.empty();
}

} // namespace

namespace {

/// A LAMB update's new moments: f32 as computed; bf16 rounded once, to
/// nearest or (key: the step's formed key) with draw g of the key.
__device__ __forceinline__ void storeMoments(float *nm, float *nv, float m, float v,
                                             const uint64_t *, uint64_t) {
  *nm = m;
  *nv = v;
}
/// 8-bit moments: lambMoments8bitKernel writes them (a block at a time).
struct NoMoments {};
__device__ __forceinline__ void storeMoments(__nv_bfloat16 *nm, __nv_bfloat16 *nv, float m, float v,
                                             const uint64_t *key, uint64_t g) {
  if (!key) {
    st(nm, m);
    st(nv, v);
    return;
  }
  uint16_t bm, bv;
  roundMomentsToBf16Stochastic(m, v, *key, g, bm, bv);
  memcpy(nm, &bm, 2);
  memcpy(nv, &bv, 2);
}

/// lamb_update over one piece of len elements (one parameter's, or
/// padding's): the step's scalars, the trust ratio (pn, un: the
/// parameter's sums in device memory, or null: 1) and the draws' key
/// (ctx: the device's {seed, step}) formed once a thread, as
/// adamwBf16StateKernel forms its own, so a captured graph still replays
/// each step's. Element i draws as element first + i of its unit.
/// Ld reads the moments (PlainMoments, Codes8Moments); M is their new
/// ones' storage (NoMoments: written by lambMoments8bitKernel).
template <typename Ld, typename M>
__global__ void lambUpdateKernel(const float *p, const float *g, Ld ld, float *np, M *nm, M *nv,
                                 const M *m, const M *v, int64_t len, const float *pn,
                                 const float *un, const float *lrp, const float *stepp,
                                 double beta1, double beta2, double eps, bool decay, float wd,
                                 const float *gs, const float *skip, const uint64_t *ctx,
                                 int64_t key, uint64_t first) {
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, len) {
      np[i] = p[i];
      if constexpr (!std::is_same_v<M, NoMoments>) {
        nm[i] = m[i];
        nv[i] = v[i];
      }
    }
    return;
  }
  // cpu::lambUpdate's trust ratio (double sqrt and divide: correctly
  // rounded on both)
  float trust = 1.f;
  if (pn) {
    double a = *pn, b = *un;
    if (a > 0 && b > 0)
      trust = (float)(sqrt(a) / sqrt(b));
  }
  const LambScalars c = lambScalars(stepp, beta1, beta2, eps);
  const float lr = *lrp;
  const uint64_t k = ctx ? stateRoundingKey(ctx[0], (int64_t)ctx[1], key) : 0;
  FSDP_GRID_STRIDE(i, len) {
    float mo, vo, mi, vi;
    ld(i, mo, vo);
    float u = lambElement(c, p[i], g[i], mo, vo, gs, decay, wd, mi, vi);
    np[i] = __fsub_rn(p[i], __fmul_rn(lr, __fmul_rn(u, trust)));
    if constexpr (!std::is_same_v<M, NoMoments>)
      storeMoments(nm + i, nv + i, mi, vi, ctx ? &k : nullptr, first + (uint64_t)i);
  }
}

/// The reader of f32 or bf16 moments m, v (PlainMoments from each piece's start).
template <typename M> auto plainReader(const M *m, const M *v) {
  return [=](int64_t begin) { return PlainMoments<M>{m + begin, v + begin}; };
}

/// `reader(begin)`: the moments' reader for the piece from element begin.
template <typename Reader>
cudaError_t lambNormsT(const float *p, const float *g, Reader reader, float *norms, int64_t n,
                       const std::vector<int64_t> &segments, int64_t base, int64_t decayNumel,
                       const float *step, double beta1, double beta2, double eps, double wd,
                       const float *gradScale, double *partial, cudaStream_t s) {
  std::vector<cpu::LambPiece> pieces;
  if (!lambPiecesOnce(segments, base, decayNumel, n, pieces))
    return cudaErrorInvalidValue;
  const int64_t K = (int64_t)segments.size() - 1;
  // the parameters outside this operand sum to 0
  if (cudaError_t e = cudaMemsetAsync(norms, 0, sizeof(float) * 2 * K, s))
    return e;
  // One parameter at a time through `partial` (stream order: a piece's
  // stage 2 has read it before the next piece's stage 1 writes).
  for (const cpu::LambPiece &pc : pieces) {
    if (pc.segment < 0)
      continue; // padding adds nothing
    int64_t len = pc.end - pc.begin;
    unsigned blocks = (unsigned)std::min<int64_t>(kLambBlocks, (len + kThreads - 1) / kThreads);
    lambSumsKernel<<<blocks, kThreads, 0, s>>>(p + pc.begin, g + pc.begin, reader(pc.begin), len,
                                               step, beta1, beta2, eps, gradScale,
                                               pc.decay && wd != 0, (float)wd, partial);
    finishSum<<<1, kThreads, 0, s>>>(partial, blocks, 1.0, norms + pc.segment);
    finishSum<<<1, kThreads, 0, s>>>(partial + blocks, blocks, 1.0, norms + K + pc.segment);
  }
  return cudaGetLastError();
}

/// M as lambNormsT's; bf16 moments are written rounded once, to nearest
/// or (ctx: the device's {seed, step}) stochastically, element i of the
/// operand drawing as element first + i of its unit.
/// `reader` as lambNormsT's; M the new moments' storage (NoMoments: none
/// written here, m, v, nm, nv null).
template <typename Reader, typename M>
cudaError_t lambUpdateT(const float *p, const float *g, Reader reader, const M *m, const M *v,
                        const float *norms, float *np, M *nm, M *nv, int64_t n,
                        const std::vector<int64_t> &segments, int64_t base, int64_t decayNumel,
                        const float *lr, const float *step, double beta1, double beta2, double eps,
                        double wd, const float *gradScale, const float *skip, const uint64_t *ctx,
                        int64_t key, uint64_t first, cudaStream_t s) {
  std::vector<cpu::LambPiece> pieces;
  if (!lambPiecesOnce(segments, base, decayNumel, n, pieces))
    return cudaErrorInvalidValue;
  const int64_t K = (int64_t)segments.size() - 1;
  const float twd = (float)wd;
  for (const cpu::LambPiece &pc : pieces) {
    // the trust ratio only where weight decay applies (cpu::lambUpdate)
    const float *pn = nullptr, *un = nullptr;
    if (pc.segment >= 0 && wd != 0 && segments[pc.segment] < decayNumel) {
      pn = norms + pc.segment;
      un = norms + K + pc.segment;
    }
    const int64_t len = pc.end - pc.begin;
    if (len <= 0)
      continue;
    unsigned blocks = std::min<unsigned>(gridFor(len), 2048u); // as adamwT's
    auto at = [&](auto *x) { return x ? x + pc.begin : x; };
    lambUpdateKernel<<<blocks, kThreads, 0, s>>>(
        p + pc.begin, g + pc.begin, reader(pc.begin), np + pc.begin, at(nm), at(nv), at(m), at(v),
        len, pn, un, lr, step, beta1, beta2, eps, pc.decay && wd != 0, twd, gradScale, skip, ctx,
        key, first + (uint64_t)pc.begin);
    if (cudaError_t e = cudaGetLastError())
      return e;
  }
  return cudaSuccess;
}

} // namespace

int64_t lambScratch() { return 2 * kLambBlocks; }

cudaError_t lambNorms(const float *p, const float *g, const float *m, const float *v, float *norms,
                      int64_t n, const std::vector<int64_t> &segments, int64_t base,
                      int64_t decayNumel, const float *step, double beta1, double beta2, double eps,
                      double wd, const float *gradScale, double *partial, cudaStream_t s) {
  return lambNormsT(p, g, plainReader(m, v), norms, n, segments, base, decayNumel, step, beta1,
                    beta2, eps, wd, gradScale, partial, s);
}

cudaError_t lambNormsBf16State(const float *p, const float *g, const void *m, const void *v,
                               float *norms, int64_t n, const std::vector<int64_t> &segments,
                               int64_t base, int64_t decayNumel, const float *step, double beta1,
                               double beta2, double eps, double wd, const float *gradScale,
                               double *partial, cudaStream_t s) {
  return lambNormsT(
      p, g,
      plainReader(static_cast<const __nv_bfloat16 *>(m), static_cast<const __nv_bfloat16 *>(v)),
      norms, n, segments, base, decayNumel, step, beta1, beta2, eps, wd, gradScale, partial, s);
}

cudaError_t lambUpdate(const float *p, const float *g, const float *m, const float *v,
                       const float *norms, float *np, float *nm, float *nv, int64_t n,
                       const std::vector<int64_t> &segments, int64_t base, int64_t decayNumel,
                       const float *lr, const float *step, double beta1, double beta2, double eps,
                       double wd, const float *gradScale, const float *skip, cudaStream_t s) {
  return lambUpdateT(p, g, plainReader(m, v), m, v, norms, np, nm, nv, n, segments, base,
                     decayNumel, lr, step, beta1, beta2, eps, wd, gradScale, skip, nullptr, 0, 0,
                     s);
}

cudaError_t lambUpdateBf16State(const float *p, const float *g, const void *m, const void *v,
                                const float *norms, float *np, void *nm, void *nv, int64_t n,
                                const std::vector<int64_t> &segments, int64_t base,
                                int64_t decayNumel, const float *lr, const float *step,
                                double beta1, double beta2, double eps, double wd,
                                const float *gradScale, const float *skip, const uint64_t *ctx,
                                int64_t key, uint64_t first, cudaStream_t s) {
  auto *mb = static_cast<const __nv_bfloat16 *>(m), *vb = static_cast<const __nv_bfloat16 *>(v);
  return lambUpdateT(p, g, plainReader(mb, vb), mb, vb, norms, np, static_cast<__nv_bfloat16 *>(nm),
                     static_cast<__nv_bfloat16 *>(nv), n, segments, base, decayNumel, lr, step,
                     beta1, beta2, eps, wd, gradScale, skip, ctx, key, first, s);
}

namespace {

/// The 8-bit reader of packed shards m, v of n elements in blocks of `block`.
auto codes8Reader(const void *m, const void *v, int64_t n, int64_t block) {
  const uint8_t *mc = static_cast<const uint8_t *>(m), *vc = static_cast<const uint8_t *>(v);
  const int64_t at = moments8::scalesOffset(n);
  const float *sm = reinterpret_cast<const float *>(mc + at),
              *sv = reinterpret_cast<const float *>(vc + at);
  int shift = 0;
  while ((int64_t(1) << shift) < block)
    ++shift;
  return [=](int64_t begin) { return Codes8Moments{mc, vc, sm, sv, begin, shift}; };
}

/// lamb_update's new 8-bit moments (the parameters are lambUpdateKernel's,
/// which reads the old codes first: stream order): one thread block a
/// quantization block at a time, as adamw8bitStateKernel (CudaNative.cu)
/// takes its own. Each thread decodes its elements, forms their new f32
/// moments (lambMoments: no trust ratio, no weight decay in them) and keeps
/// the moment and the new v's root in shared memory; the block's largest
/// magnitudes reduce over the threads; each thread encodes its own. In
/// place allowed (each element and the scales are read before the
/// barriers that precede their writes). cpu::lambUpdate8bitState's bytes.
__global__ void lambMoments8bitKernel(const float *g, const uint8_t *m, const uint8_t *v,
                                      uint8_t *nm, uint8_t *nv, int64_t n, int block,
                                      const float *stepp, double beta1, double beta2, double eps,
                                      const float *gs, const float *skip) {
  namespace m8 = moments8;
  extern __shared__ float slots[]; // the block's new moments, then roots
  __shared__ uint32_t warpM[32], warpR[32];
  const int64_t blocks = (n + block - 1) / block, at = m8::scalesOffset(n);
  const float *sm = reinterpret_cast<const float *>(m + at),
              *sv = reinterpret_cast<const float *>(v + at);
  float *nsm = reinterpret_cast<float *>(nm + at), *nsv = reinterpret_cast<float *>(nv + at);
  if (blockIdx.x == 0 && threadIdx.x < at - n) // the codes' padding stays zero
    nm[n + threadIdx.x] = nv[n + threadIdx.x] = 0;
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      nm[i] = m[i];
      nv[i] = v[i];
    }
    FSDP_GRID_STRIDE(j, blocks) {
      nsm[j] = sm[j];
      nsv[j] = sv[j];
    }
    return;
  }
  const LambScalars c = lambScalars(stepp, beta1, beta2, eps);
  float *mf = slots, *rf = slots + block;
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t o = j * block;
    const int len = (int)min((int64_t)block, n - o);
    const float scaleM = sm[j], scaleV = sv[j];
    uint32_t am = 0, ar = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t e = o + i;
      const float r = m8::decodeRoot(v[e], scaleV);
      float mn, vn;
      lambMoments(c, g[e], m8::decodeM(m[e], scaleM), __fmul_rn(r, r), gs, mn, vn);
      const float rn = __fsqrt_rn(vn);
      mf[i] = mn;
      rf[i] = rn;
      am = max(am, m8::bitsOf(mn) & 0x7fffffffu);
      ar = max(ar, m8::bitsOf(rn) & 0x7fffffffu);
    }
    encodeMomentBlock(mf, rf, len, am, ar, warpM, warpR, nm, nv, nsm, nsv, o, j);
  }
}

} // namespace

cudaError_t lambNorms8bitState(const float *p, const float *g, const void *m, const void *v,
                               float *norms, int64_t n, int64_t block,
                               const std::vector<int64_t> &segments, int64_t base,
                               int64_t decayNumel, const float *step, double beta1, double beta2,
                               double eps, double wd, const float *gradScale, double *partial,
                               cudaStream_t s) {
  return lambNormsT(p, g, codes8Reader(m, v, n, block), norms, n, segments, base, decayNumel, step,
                    beta1, beta2, eps, wd, gradScale, partial, s);
}

cudaError_t lambUpdate8bitState(const float *p, const float *g, const void *m, const void *v,
                                const float *norms, float *np, void *nm, void *nv, int64_t n,
                                int64_t block, const std::vector<int64_t> &segments, int64_t base,
                                int64_t decayNumel, const float *lr, const float *step,
                                double beta1, double beta2, double eps, double wd,
                                const float *gradScale, const float *skip, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  // the parameters first: they read the old codes, which the moments'
  // kernel then overwrites (in place)
  if (cudaError_t e = lambUpdateT(p, g, codes8Reader(m, v, n, block), (const NoMoments *)nullptr,
                                  (const NoMoments *)nullptr, norms, np, (NoMoments *)nullptr,
                                  (NoMoments *)nullptr, n, segments, base, decayNumel, lr, step,
                                  beta1, beta2, eps, wd, gradScale, skip, nullptr, 0, 0, s))
    return e;
  const int64_t blocks = (n + block - 1) / block;
  unsigned grid = (unsigned)std::min<int64_t>(blocks, 4096);
  lambMoments8bitKernel<<<grid, kThreads, 2 * block * sizeof(float), s>>>(
      g, static_cast<const uint8_t *>(m), static_cast<const uint8_t *>(v),
      static_cast<uint8_t *>(nm), static_cast<uint8_t *>(nv), n, (int)block, step, beta1, beta2,
      eps, gradScale, skip);
  return cudaGetLastError();
}

// --- casts ----------------------------------------------------------------------------------

namespace {
/// y = x converted, four elements a thread per step (four independent loads
/// in flight), the types fixed at compile time: the per-element dtype
/// branches of a generic kernel cost GPT-2's parameter and gradient casts
/// several times their bytes. f32 -> bf16 / f16 rounds to nearest even.
template <typename A, typename B>
__global__ void castKernel(const A *x, B *y, int64_t n) {
  int64_t quads = n / 4;
  FSDP_GRID_STRIDE(i, quads) {
    float f0 = ld(x + 4 * i), f1 = ld(x + 4 * i + 1), f2 = ld(x + 4 * i + 2),
          f3 = ld(x + 4 * i + 3);
    st(y + 4 * i, f0);
    st(y + 4 * i + 1, f1);
    st(y + 4 * i + 2, f2);
    st(y + 4 * i + 3, f3);
  }
  int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t < n - 4 * quads)
    st(y + 4 * quads + t, ld(x + 4 * quads + t));
}

/// 8 elements of T at p (16-byte aligned) <-> floats, in 16-byte moves
/// (one for 16-bit types, two for f32), through memcpy (not a cast pointer).
template <typename T> __device__ __forceinline__ void load8(const T *p, float (&f)[8]) {
  T v[8];
  constexpr int kMoves = (int)sizeof(T) * 8 / 16;
#pragma unroll
  for (int m = 0; m < kMoves; ++m) {
    uint4 u = reinterpret_cast<const uint4 *>(p)[m];
    memcpy(reinterpret_cast<char *>(v) + 16 * m, &u, 16);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    f[i] = ld(v + i);
}
template <typename T> __device__ __forceinline__ void store8(T *p, const float (&f)[8]) {
  T v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    st(v + i, f[i]);
  constexpr int kMoves = (int)sizeof(T) * 8 / 16;
#pragma unroll
  for (int m = 0; m < kMoves; ++m) {
    uint4 u;
    memcpy(&u, reinterpret_cast<const char *>(v) + 16 * m, 16);
    reinterpret_cast<uint4 *>(p)[m] = u;
  }
}

/// castKernel for 16-byte aligned x and y: 8 elements a thread per step in
/// 16-byte loads and stores (the 2-byte accesses of castKernel use a
/// fraction of each memory transaction); the tail (< 8) one a thread.
/// The same conversion per element, so the same bits.
template <typename A, typename B>
__global__ void castVecKernel(const A *x, B *y, int64_t n) {
  int64_t octs = n / 8;
  FSDP_GRID_STRIDE(i, octs) {
    float f[8];
    load8(x + 8 * i, f);
    store8(y + 8 * i, f);
  }
  int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t < n - 8 * octs)
    st(y + 8 * octs + t, ld(x + 8 * octs + t));
}

template <typename A, typename B>
cudaError_t castTo(const A *x, B *y, int64_t n, cudaStream_t s) {
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) % 16 == 0)
    castVecKernel<<<gridFor((n + 7) / 8), kThreads, 0, s>>>(x, y, n);
  else
    castKernel<<<gridFor((n + 3) / 4), kThreads, 0, s>>>(x, y, n);
  return cudaGetLastError();
}

/// Stochastic f32 -> bf16: the key once a thread, 8 elements per step in
/// 16-byte moves when x and y are 16-byte aligned, one otherwise.
__global__ void castBf16StochasticKernel(const float *x, uint16_t *y, int64_t n,
                                         const uint64_t *ctx, int64_t unit, uint64_t first) {
  const uint64_t key = stochasticRoundingKey(ctx[0], (int64_t)ctx[1], unit);
  const bool vec = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) % 16) == 0;
  const int64_t octs = vec ? n / 8 : 0;
  FSDP_GRID_STRIDE(i, octs) {
    float f[8];
    load8(x + 8 * i, f);
    uint16_t b[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      b[k] = roundToBf16Stochastic(f[k], key, first + (uint64_t)(8 * i + k));
    uint4 u;
    memcpy(&u, b, 16);
    reinterpret_cast<uint4 *>(y)[i] = u;
  }
  FSDP_GRID_STRIDE(j, n - 8 * octs) {
    int64_t e = 8 * octs + j;
    y[e] = roundToBf16Stochastic(x[e], key, first + (uint64_t)e);
  }
}

template <typename A>
cudaError_t castFrom(const A *x, void *y, FloatKind to, int64_t n, cudaStream_t s) {
  if (to == FloatKind::F32)
    return castTo(x, static_cast<float *>(y), n, s);
  if (to == FloatKind::BF16)
    return castTo(x, static_cast<__nv_bfloat16 *>(y), n, s);
  return castTo(x, static_cast<__half *>(y), n, s);
}
} // namespace

cudaError_t castBf16Stochastic(const float *x, void *y, int64_t n, const uint64_t *ctx,
                               int64_t unit, uint64_t first, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  castBf16StochasticKernel<<<gridFor((n + 7) / 8), kThreads, 0, s>>>(
      x, static_cast<uint16_t *>(y), n, ctx, unit, first);
  return cudaGetLastError();
}

namespace {

/// A warp per block: the block's largest magnitude m (NaN if a value is
/// NaN, as quant::blockMax), then each value by 127 / m
/// (quant::quantizeValue); the scale m / 127 after the values. Blocks of
/// `parts` parts of n values (qgZ), each part quantized on its own into
/// its own partBytes. The values are chunks of c values and part p is
/// chunks p, p + parts, ... (hierarchical qgZ): its value k is
/// x0[((k / c) x parts + p) x c + k % c]; c == n is part p at p x n.
template <typename A>
__global__ void quantizeKernel(const A *x0, int64_t parts, int64_t n, int64_t c, int64_t block,
                               int64_t blocks, int64_t partBytes, uint8_t *out0) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const int64_t sOff = (n + 3) / 4 * 4;
  for (int64_t pb = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32; pb < parts * blocks;
       pb += warps) {
    const int64_t p = pb / blocks, b = pb % blocks;
    uint8_t *out = out0 + p * partBytes;
    const int64_t lo = b * block, len = n - lo < block ? n - lo : block;
    // Value k of the part (no 64-bit division without chunks).
    auto at = [=](int64_t k) {
      return c == n ? x0 + p * n + k : x0 + ((k / c) * parts + p) * c + k % c;
    };
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = lane; i < len; i += 32) {
      const float a = fabsf(ld(at(lo + i)));
      m = a > m ? a : m;
      nan |= a != a;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, m, o);
      m = v > m ? v : m;
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    const float sc = nan ? nanf("") : m / 127.0f;
    const bool ok = !nan && m > 0.0f && isfinite(m);
    const float inv = ok ? 127.0f / m : 0.0f;
    for (int64_t i = lane; i < len; i += 32) {
      float q = ok ? rintf(ld(at(lo + i)) * inv) : 0.0f;
      q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
      out[lo + i] = (uint8_t)(int8_t)q;
    }
    if (lane == 0)
      *reinterpret_cast<float *>(out + sOff + 4 * b) = sc;
  }
  if (blockIdx.x == 0 && threadIdx.x < sOff - n)
    for (int64_t p = 0; p < parts; ++p)
      out0[p * partBytes + n + threadIdx.x] = 0;
}

template <typename B>
__global__ void dequantizeKernel(const uint8_t *in, int64_t parts, int64_t n, int64_t block,
                                 int64_t partBytes, B *y) {
  const int64_t sOff = (n + 3) / 4 * 4;
  FSDP_GRID_STRIDE(g, parts * n) {
    const uint8_t *part = in + (g / n) * partBytes;
    const int64_t i = g % n;
    const float sc = *reinterpret_cast<const float *>(part + sOff + 4 * (i / block));
    st(y + g, (float)(int8_t)part[i] * sc);
  }
}

/// qgZ's reduce (quant::dequantizeSumBlocks): a thread per value, the
/// parts added in order, each product and sum rounded on its own (no
/// fused multiply-add, so the bits are the CPU's).
template <typename B>
__global__ void dequantizeSumKernel(const uint8_t *in, int64_t parts, int64_t n, int64_t block,
                                    int64_t partBytes, bool mean, B *y) {
  const int64_t sOff = (n + 3) / 4 * 4;
  FSDP_GRID_STRIDE(i, n) {
    const int64_t sAt = sOff + 4 * (i / block);
    float acc = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      const uint8_t *part = in + p * partBytes;
      const float v =
          __fmul_rn((float)(int8_t)part[i], *reinterpret_cast<const float *>(part + sAt));
      acc = p == 0 ? v : __fadd_rn(acc, v);
    }
    st(y + i, mean ? __fdiv_rn(acc, (float)parts) : acc);
  }
}

template <typename A>
cudaError_t quantizeFrom(const A *x, int64_t parts, int64_t n, int64_t c, int64_t block,
                         uint8_t *out, cudaStream_t s) {
  const int64_t blocks = shapes::quantizedBlocks(n, block);
  quantizeKernel<<<gridFor(parts * blocks * 32), kThreads, 0, s>>>(
      x, parts, n, c, block, blocks, shapes::quantizedBytes(n, block), out);
  return cudaGetLastError();
}

template <typename B>
cudaError_t dequantizeTo(const uint8_t *in, int64_t parts, int64_t n, int64_t block, B *y,
                         const char *reduce, cudaStream_t s) {
  const int64_t partBytes = shapes::quantizedBytes(n, block);
  if (reduce)
    dequantizeSumKernel<<<gridFor(n), kThreads, 0, s>>>(in, parts, n, block, partBytes,
                                                        reduce[0] == 'm', y);
  else
    dequantizeKernel<<<gridFor(parts * n), kThreads, 0, s>>>(in, parts, n, block, partBytes, y);
  return cudaGetLastError();
}

} // namespace

cudaError_t quantize(const void *x, FloatKind from, int64_t parts, int64_t n, int64_t chunk,
                     int64_t block, uint8_t *out, cudaStream_t s) {
  if (parts <= 0 || n <= 0 || block <= 0)
    return parts * n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  if (chunk <= 0 || n % chunk != 0)
    return cudaErrorInvalidValue;
  if (from == FloatKind::F32)
    return quantizeFrom(static_cast<const float *>(x), parts, n, chunk, block, out, s);
  if (from == FloatKind::BF16)
    return quantizeFrom(static_cast<const __nv_bfloat16 *>(x), parts, n, chunk, block, out, s);
  return quantizeFrom(static_cast<const __half *>(x), parts, n, chunk, block, out, s);
}

cudaError_t dequantize(const uint8_t *in, int64_t parts, int64_t n, int64_t block, void *y,
                       FloatKind to, const char *reduce, cudaStream_t s) {
  if (parts <= 0 || n <= 0 || block <= 0)
    return parts * n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  if (to == FloatKind::F32)
    return dequantizeTo(in, parts, n, block, static_cast<float *>(y), reduce, s);
  if (to == FloatKind::BF16)
    return dequantizeTo(in, parts, n, block, static_cast<__nv_bfloat16 *>(y), reduce, s);
  return dequantizeTo(in, parts, n, block, static_cast<__half *>(y), reduce, s);
}

cudaError_t cast(const void *x, FloatKind from, void *y, FloatKind to, int64_t n,
                 cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  if (from == FloatKind::F32)
    return castFrom(static_cast<const float *>(x), y, to, n, s);
  if (from == FloatKind::BF16)
    return castFrom(static_cast<const __nv_bfloat16 *>(x), y, to, n, s);
  return castFrom(static_cast<const __half *>(x), y, to, n, s);
}

} // namespace fsdp::cuda
