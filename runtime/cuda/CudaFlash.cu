//===- CudaFlash.cu - tiled attention, no T x T matrix in memory ----------===//
//
// Layout of every kernel: a block of 256 threads owns a tile of 64 rows (query
// rows in the forward and dq kernels, key rows in the dk/dv kernel); four
// adjacent lanes share a row: lane `part` of a row scores the tile's
// columns part, part + 4, ... and owns the output dimensions part,
// part + 4, ... of the row. Row reductions over the four lanes are two
// butterfly shuffles (a fixed order). Tiles are stored in shared memory as
// f32 with a padded row stride (D + 1) so that the eight rows a warp reads
// at once fall in distinct banks. Dynamic shared memory: up to ~166 KB at
// D = 128 (opted in per kernel; H100 allows 227 KB).
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaFlash.h"

#include "runtime/cuda/CudaCheck.h"

#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fsdp::cuda::flash {
namespace {

constexpr int kTile = 64;                       // rows and columns of a tile
constexpr int kParts = 4;                       // lanes per row
constexpr int kThreadsF = kTile * kParts;       // 256
constexpr int kCols = kTile / kParts;           // columns a lane scores: 16
constexpr int kDims = (int)kMaxHeadDim / kParts; // dimensions a lane owns: 32

__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half *p, float v) { *p = __float2half_rn(v); }

/// Sum / max over the four lanes of a row (all 32 lanes must call).
__device__ __forceinline__ float rowSum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
__device__ __forceinline__ float rowMax4(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}

struct Dims {
  int64_t B, T, C, H, KV, D, KC, tiles;
  bool causal;
  float scale;
};

Dims dims(int64_t B, int64_t T, int64_t C, int64_t heads, bool causal, int64_t kvHeads) {
  Dims a;
  a.B = B;
  a.T = T;
  a.C = C;
  a.H = heads;
  a.KV = kvHeads > 0 ? kvHeads : heads;
  a.D = C / heads;
  a.KC = a.KV * a.D;
  a.tiles = (T + kTile - 1) / kTile;
  a.causal = causal;
  a.scale = 1.f / sqrtf((float)a.D); // as the reference kernels
  return a;
}

/// Loads rows r0.. of a [B, T, ld] tensor's head slice (b, column offset
/// col) into a kTile x D shared tile with stride D + 1; rows past T are 0.
template <typename T>
__device__ void loadTile(float *dst, const T *src, const Dims &a, int64_t b, int64_t r0,
                         int64_t ldRow, int64_t col) {
  int64_t D = a.D, SD = D + 1;
  for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    int64_t r = i / D, d = i % D, t = r0 + r;
    dst[r * SD + d] = t < a.T ? ld(src + (b * a.T + t) * ldRow + col + d) : 0.f;
  }
}

__device__ __forceinline__ float dotShared(const float *x, const float *y, int64_t D) {
  float acc = 0;
  for (int64_t d = 0; d < D; ++d)
    acc += x[d] * y[d];
  return acc;
}

/// The forward pass over one (b, h, query tile). Writes y and the row
/// log-sum-exp (when lse is not null).
template <typename T>
__global__ void __launch_bounds__(kThreadsF)
    forwardKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
  extern __shared__ float sm[];
  int64_t D = a.D, SD = D + 1;
  float *Qs = sm, *Ks = Qs + kTile * SD, *Vs = Ks + kTile * SD, *Ps = Vs + kTile * SD;
  // Longest (causal) tiles first: they start in the first wave.
  int64_t qt = a.tiles - 1 - (int64_t)(blockIdx.x % a.tiles);
  int64_t h = (blockIdx.x / a.tiles) % a.H, b = blockIdx.x / (a.tiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int row = threadIdx.x / kParts, part = threadIdx.x % kParts;
  int64_t t0 = qt * kTile, trow = t0 + row;
  loadTile(Qs, q, a, b, t0, a.C, h * D);
  float m = -INFINITY, l = 0.f, o[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i)
    o[i] = 0.f;
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads(); // the previous tile's K, V, P are no longer read
    loadTile(Ks, k, a, b, j0, a.KC, kvh * D);
    loadTile(Vs, v, a, b, j0, a.KC, kvh * D);
    __syncthreads();
    float sc[kCols], tmax = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int j = part + kParts * c;
      int64_t jj = j0 + j;
      bool ok = jj < a.T && (!a.causal || jj <= trow);
      float s = dotShared(Qs + row * SD, Ks + j * SD, D) * a.scale;
      sc[c] = ok ? s : -INFINITY;
      tmax = fmaxf(tmax, sc[c]);
    }
    tmax = rowMax4(tmax);
    float mNew = fmaxf(m, tmax);
    float alpha = m == -INFINITY ? 0.f : expf(m - mNew);
    float psum = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float p = sc[c] == -INFINITY ? 0.f : expf(sc[c] - mNew);
      Ps[row * (kTile + 1) + part + kParts * c] = p;
      psum += p;
    }
    psum = rowSum4(psum);
    l = l * alpha + psum;
    m = mNew;
    __syncthreads();
    const float *pr = Ps + row * (kTile + 1);
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      int64_t d = part + kParts * i;
      if (d < D) {
        float acc = 0.f;
        for (int j = 0; j < kTile; ++j)
          acc += pr[j] * Vs[j * SD + d];
        o[i] = o[i] * alpha + acc;
      }
    }
  }
  bool valid = trow < a.T;
  float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    int64_t d = part + kParts * i;
    if (valid && d < D)
      st(y + (b * a.T + trow) * a.C + h * D + d, o[i] * inv);
  }
  if (lse && valid && part == 0)
    lse[(b * a.H + h) * a.T + trow] = m + logf(l);
}

/// delta = dy_t . y_t per (b, h, t), one thread per row, from the stored
/// (rounded, for bf16 / f16) output y, as FlashAttention-2's backward.
template <typename T>
__global__ void deltaKernel(Dims a, const T *y, const T *dy, float *delta) {
  int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= a.B * a.H * a.T)
    return;
  int64_t t = r % a.T, h = (r / a.T) % a.H, b = r / (a.T * a.H);
  int64_t at = (b * a.T + t) * a.C + h * a.D;
  float acc = 0.f;
  for (int64_t d = 0; d < a.D; ++d)
    acc += ld(dy + at + d) * ld(y + at + d);
  delta[r] = acc;
}

/// dq over one (b, h, query tile): dq_t = scale sum_j p_tj (dy_t . v_j - delta_t) k_j.
template <typename T>
__global__ void __launch_bounds__(kThreadsF)
    dqKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
             const float *delta, T *dq) {
  extern __shared__ float sm[];
  int64_t D = a.D, SD = D + 1;
  float *Qs = sm, *DYs = Qs + kTile * SD, *Ks = DYs + kTile * SD, *Vs = Ks + kTile * SD,
        *DSs = Vs + kTile * SD;
  int64_t qt = a.tiles - 1 - (int64_t)(blockIdx.x % a.tiles);
  int64_t h = (blockIdx.x / a.tiles) % a.H, b = blockIdx.x / (a.tiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int row = threadIdx.x / kParts, part = threadIdx.x % kParts;
  int64_t t0 = qt * kTile, trow = t0 + row;
  bool valid = trow < a.T;
  int64_t sr = (b * a.H + h) * a.T + trow;
  float lr = valid ? lse[sr] : 0.f, dl = valid ? delta[sr] : 0.f;
  loadTile(Qs, q, a, b, t0, a.C, h * D);
  loadTile(DYs, dy, a, b, t0, a.C, h * D);
  float acc[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i)
    acc[i] = 0.f;
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads();
    loadTile(Ks, k, a, b, j0, a.KC, kvh * D);
    loadTile(Vs, v, a, b, j0, a.KC, kvh * D);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int j = part + kParts * c;
      int64_t jj = j0 + j;
      bool ok = valid && jj < a.T && (!a.causal || jj <= trow);
      float ds = 0.f;
      if (ok) {
        float p = expf(dotShared(Qs + row * SD, Ks + j * SD, D) * a.scale - lr);
        ds = p * (dotShared(DYs + row * SD, Vs + j * SD, D) - dl);
      }
      DSs[row * (kTile + 1) + j] = ds;
    }
    __syncthreads();
    const float *dr = DSs + row * (kTile + 1);
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      int64_t d = part + kParts * i;
      if (d < D) {
        float sacc = 0.f;
        for (int j = 0; j < kTile; ++j)
          sacc += dr[j] * Ks[j * SD + d];
        acc[i] += sacc;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    int64_t d = part + kParts * i;
    if (valid && d < D)
      st(dq + (b * a.T + trow) * a.C + h * D + d, acc[i] * a.scale);
  }
}

/// dk, dv over one (b, kv head, key tile): over the query heads of the
/// group, then the query tiles that see the key tile, in order:
/// dv_j = sum_t p_tj dy_t, dk_j = scale sum_t p_tj (dy_t . v_j - delta_t) q_t.
template <typename T>
__global__ void __launch_bounds__(kThreadsF)
    dkvKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
              const float *delta, T *dk, T *dv) {
  extern __shared__ float sm[];
  int64_t D = a.D, SD = D + 1;
  float *Ks = sm, *Vs = Ks + kTile * SD, *Qs = Vs + kTile * SD, *DYs = Qs + kTile * SD,
        *Ps = DYs + kTile * SD, *DSs = Ps + kTile * (kTile + 1), *Ls = DSs + kTile * (kTile + 1),
        *Dl = Ls + kTile;
  int64_t kt = (int64_t)(blockIdx.x % a.tiles);
  int64_t kvh = (blockIdx.x / a.tiles) % a.KV, b = blockIdx.x / (a.tiles * a.KV);
  int row = threadIdx.x / kParts, part = threadIdx.x % kParts;
  int64_t j0 = kt * kTile, jj = j0 + row;
  bool valid = jj < a.T;
  loadTile(Ks, k, a, b, j0, a.KC, kvh * D);
  loadTile(Vs, v, a, b, j0, a.KC, kvh * D);
  float accK[kDims], accV[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i)
    accK[i] = accV[i] = 0.f;
  int64_t group = a.H / a.KV;
  for (int64_t g = 0; g < group; ++g) {
    int64_t h = kvh * group + g;
    for (int64_t qt = a.causal ? kt : 0; qt < a.tiles; ++qt) {
      int64_t t0 = qt * kTile;
      __syncthreads(); // the previous query tile is no longer read
      loadTile(Qs, q, a, b, t0, a.C, h * D);
      loadTile(DYs, dy, a, b, t0, a.C, h * D);
      for (int64_t i = threadIdx.x; i < kTile; i += blockDim.x) {
        int64_t t = t0 + i, r = (b * a.H + h) * a.T + t;
        Ls[i] = t < a.T ? lse[r] : 0.f;
        Dl[i] = t < a.T ? delta[r] : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        int tr = part + kParts * c;
        int64_t tt = t0 + tr;
        bool ok = valid && tt < a.T && (!a.causal || jj <= tt);
        float p = 0.f, ds = 0.f;
        if (ok) {
          p = expf(dotShared(Qs + tr * SD, Ks + row * SD, D) * a.scale - Ls[tr]);
          ds = p * (dotShared(DYs + tr * SD, Vs + row * SD, D) - Dl[tr]);
        }
        Ps[row * (kTile + 1) + tr] = p;
        DSs[row * (kTile + 1) + tr] = ds;
      }
      __syncthreads();
      const float *pr = Ps + row * (kTile + 1), *dr = DSs + row * (kTile + 1);
#pragma unroll
      for (int i = 0; i < kDims; ++i) {
        int64_t d = part + kParts * i;
        if (d < D) {
          float sv = 0.f, sk = 0.f;
          for (int t = 0; t < kTile; ++t) {
            sv += pr[t] * DYs[t * SD + d];
            sk += dr[t] * Qs[t * SD + d];
          }
          accV[i] += sv;
          accK[i] += sk;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    int64_t d = part + kParts * i;
    if (valid && d < D) {
      int64_t at = (b * a.T + jj) * a.KC + kvh * D + d;
      st(dk + at, accK[i] * a.scale);
      st(dv + at, accV[i]);
    }
  }
}

size_t fwdSmem(int64_t D) { return sizeof(float) * (3 * kTile * (D + 1) + kTile * (kTile + 1)); }
size_t dqSmem(int64_t D) { return sizeof(float) * (4 * kTile * (D + 1) + kTile * (kTile + 1)); }
size_t dkvSmem(int64_t D) {
  return sizeof(float) * (4 * kTile * (D + 1) + 2 * kTile * (kTile + 1) + 2 * kTile);
}

template <typename K> cudaError_t optIn(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

template <typename T>
cudaError_t forwardT(const void *q, const void *k, const void *v, void *y, float *lse,
                     const Dims &a, cudaStream_t s) {
  size_t sm = fwdSmem(a.D);
  if (cudaError_t e = optIn(forwardKernel<T>, sm))
    return e;
  forwardKernel<T><<<(unsigned)(a.B * a.H * a.tiles), kThreadsF, sm, s>>>(
      a, static_cast<const T *>(q), static_cast<const T *>(k), static_cast<const T *>(v),
      static_cast<T *>(y), lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backwardT(const void *q, const void *k, const void *v, const void *y,
                      const float *lse, const void *dy, void *dq, void *dk, void *dv,
                      float *delta, const Dims &a, cudaStream_t s) {
  const T *Q = static_cast<const T *>(q), *K = static_cast<const T *>(k),
          *V = static_cast<const T *>(v), *DY = static_cast<const T *>(dy);
  int64_t rows = a.B * a.H * a.T;
  deltaKernel<T><<<(unsigned)((rows + 255) / 256), 256, 0, s>>>(a, static_cast<const T *>(y),
                                                                DY, delta);
  if (cudaError_t e = cudaGetLastError())
    return e;
  size_t smq = dqSmem(a.D), smkv = dkvSmem(a.D);
  if (cudaError_t e = optIn(dqKernel<T>, smq))
    return e;
  if (cudaError_t e = optIn(dkvKernel<T>, smkv))
    return e;
  dqKernel<T><<<(unsigned)(a.B * a.H * a.tiles), kThreadsF, smq, s>>>(a, Q, K, V, DY, lse,
                                                                       delta,
                                                                       static_cast<T *>(dq));
  if (cudaError_t e = cudaGetLastError())
    return e;
  dkvKernel<T><<<(unsigned)(a.B * a.KV * a.tiles), kThreadsF, smkv, s>>>(
      a, Q, K, V, DY, lse, delta, static_cast<T *>(dk), static_cast<T *>(dv));
  return cudaGetLastError();
}

} // namespace

Status check(int64_t B, int64_t T, int64_t C, int64_t heads, int64_t kvHeads) {
  int64_t kv = kvHeads > 0 ? kvHeads : heads;
  if (B < 0 || T < 0 || C <= 0 || heads <= 0 || C % heads || kv <= 0 || heads % kv)
    return FSDP_ERROR("attention: shape B=", B, " T=", T, " C=", C, " heads=", heads,
                      " kv_heads=", kv, " is not one the tiled CUDA kernel takes (heads must "
                      "divide C, kv_heads divide heads)");
  if (C / heads > kMaxHeadDim)
    return FSDP_ERROR("attention: head dimension ", C / heads,
                      " exceeds the tiled CUDA kernel's limit ", kMaxHeadDim);
  int64_t tiles = (T + kTile - 1) / kTile;
  if (B * heads * tiles > INT32_MAX || B * T * heads * 2 > ((int64_t)1 << 40))
    return FSDP_ERROR("attention: B=", B, " T=", T, " heads=", heads,
                      " exceeds the tiled CUDA kernel's grid");
  return Status::ok();
}

int64_t backwardScratch(int64_t B, int64_t T, int64_t heads) { return B * heads * T; }

cudaError_t forward(FloatKind t, const void *q, const void *k, const void *v, void *y,
                    float *lse, int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                    int64_t kvHeads, cudaStream_t s) {
  if (!check(B, T, C, heads, kvHeads))
    return cudaErrorInvalidValue;
  Dims a = dims(B, T, C, heads, causal, kvHeads);
  if (B * heads * a.tiles == 0)
    return cudaSuccess;
  switch (t) {
  case FloatKind::F32:
    return forwardT<float>(q, k, v, y, lse, a, s);
  case FloatKind::BF16:
    return forwardT<__nv_bfloat16>(q, k, v, y, lse, a, s);
  case FloatKind::F16:
    return forwardT<__half>(q, k, v, y, lse, a, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t backward(FloatKind t, const void *q, const void *k, const void *v, const void *y,
                     const float *lse, const void *dy, void *dq, void *dk, void *dv,
                     float *scratch, int64_t B, int64_t T, int64_t C, int64_t heads,
                     bool causal, int64_t kvHeads, cudaStream_t s) {
  if (!check(B, T, C, heads, kvHeads))
    return cudaErrorInvalidValue;
  Dims a = dims(B, T, C, heads, causal, kvHeads);
  if (B * heads * a.tiles == 0)
    return cudaSuccess;
  switch (t) {
  case FloatKind::F32:
    return backwardT<float>(q, k, v, y, lse, dy, dq, dk, dv, scratch, a, s);
  case FloatKind::BF16:
    return backwardT<__nv_bfloat16>(q, k, v, y, lse, dy, dq, dk, dv, scratch, a, s);
  case FloatKind::F16:
    return backwardT<__half>(q, k, v, y, lse, dy, dq, dk, dv, scratch, a, s);
  }
  return cudaErrorInvalidValue;
}

} // namespace fsdp::cuda::flash
