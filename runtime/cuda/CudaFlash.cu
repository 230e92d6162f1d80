//===- CudaFlash.cu - tiled attention, no T x T matrix in memory ----------===//
//
// Layout of every kernel: a block of 256 threads owns a tile of 64 rows (query
// rows in the forward and dq kernels, key rows in the dk/dv kernel); four
// adjacent lanes share a row: lane `part` of a row scores the tile's
// columns part, part + 4, ... and owns the output dimensions of the row's
// 16-byte chunks part, part + 4, ... (dimensions 4 part .. 4 part + 3, ...). Row reductions over
// the four lanes are two butterfly shuffles (a fixed order). Tiles are stored in shared memory as
// f32 with a padded row stride (tileStride: an odd number of 16-byte
// chunks) and read 16 bytes at a time, conflict-free: each product loads a
// chunk of its row operand once for the lane's 16 columns (the scores), or
// a column's weight once for the lane's chunks (P V, dS K, P^T dY, dS^T Q),
// so a 16-byte load feeds 4 to 16 FMAs instead of two scalar loads one.
// Every sum runs in the order of the scalar loops before. Dynamic shared memory:
// up to ~167 KB at D = 128 (opted in per kernel; H100 allows 227 KB).
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaFlash.h"

#include "runtime/cuda/CudaCheck.h"
#include "runtime/cuda/CudaMma.cuh"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

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

/// The problem's sizes; ldq, ldkv, ldy are the operands' row strides
/// (flash::Layout, 0 resolved to the dense ones).
struct Dims {
  int64_t B, T, C, H, KV, D, KC, tiles;
  int64_t ldq, ldkv, ldy;
  bool causal;
  float scale;
};

Dims dims(int64_t B, int64_t T, int64_t C, int64_t heads, bool causal, int64_t kvHeads,
          Layout rows) {
  Dims a;
  a.B = B;
  a.T = T;
  a.C = C;
  a.H = heads;
  a.KV = kvHeads > 0 ? kvHeads : heads;
  a.D = C / heads;
  a.KC = a.KV * a.D;
  a.ldq = rows.q ? rows.q : C;
  a.ldkv = rows.kv ? rows.kv : a.KC;
  a.ldy = rows.y ? rows.y : C;
  a.tiles = (T + kTile - 1) / kTile;
  a.causal = causal;
  a.scale = 1.f / sqrtf((float)a.D); // as the reference kernels
  return a;
}

/// The row stride (floats) of the shared f32 tiles for head dimension D:
/// whole 16-byte chunks (D rounded up to a multiple of 4) plus at least
/// one chunk, an odd number of chunks in all. The eight rows a warp reads
/// at once (the same chunk of each) then start in distinct 4-bank groups,
/// so a 16-byte load of them has no bank conflict.
__host__ __device__ constexpr int64_t tileStride(int64_t D) {
  return 4 * (((D + 3) / 4 + 1) | 1);
}
/// The row stride of the 64 x 64 probability / score-gradient tiles.
constexpr int kPS = kTile + 4;
/// 16-byte chunks of the dimensions a lane owns: 8 (kDims / 4).
constexpr int kChunks = kDims / 4;

__device__ __forceinline__ float4 lds4(const float *p) {
  return *reinterpret_cast<const float4 *>(p);
}
/// acc += x . y over one 16-byte chunk, in dimension order.
__device__ __forceinline__ void dot4(float &acc, float4 x, float4 y) {
  acc += x.x * y.x;
  acc += x.y * y.y;
  acc += x.z * y.z;
  acc += x.w * y.w;
}
/// acc += w * y, elementwise.
__device__ __forceinline__ void axpy4(float4 &acc, float w, float4 y) {
  acc.x += w * y.x;
  acc.y += w * y.y;
  acc.z += w * y.z;
  acc.w += w * y.w;
}
__device__ __forceinline__ float at4(const float4 &v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

/// acc[i] = sum over the tile's rows j, in order, of w[j] times the lane's
/// chunk i of row j (chunks part, part + 4, ... below NC): each weight read
/// once for all the lane's chunks (P V, dS K, P^T dY, dS^T Q).
__device__ __forceinline__ void weightedChunks(float4 (&acc)[kChunks], const float *w,
                                               const float *tile, int64_t SD, int64_t NC,
                                               int part) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    acc[i] = float4{0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < kTile; ++j) {
    float x = w[j];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      int64_t ch = part + kParts * i;
      if (i * kParts < NC && ch < NC)
        axpy4(acc[i], x, lds4(tile + j * SD + 4 * ch));
    }
  }
}

/// The backward's two products per column of the lane (part, part + 4,
/// ...): s[c] = a . x_col and dp[c] = b . y_col (a, b: the lane's row; x,
/// y: tiles), each in dimension order; a chunk of a and b read once for
/// all the columns.
__device__ __forceinline__ void pairScores(float (&s)[kCols], float (&dp)[kCols],
                                           const float *a, const float *b, const float *x,
                                           const float *y, int64_t SD, int64_t NC, int part) {
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    s[c] = dp[c] = 0.f;
  for (int64_t ch = 0; ch < NC; ++ch) {
    float4 ar = lds4(a + 4 * ch), br = lds4(b + 4 * ch);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int64_t col = part + kParts * c;
      dot4(s[c], ar, lds4(x + col * SD + 4 * ch));
      dot4(dp[c], br, lds4(y + col * SD + 4 * ch));
    }
  }
}

/// acc[4 i + e] = acc[4 i + e] * keep + add[i].e over the lane's chunks
/// (i below NC / 4): keep = 1 is a plain sum (exact: the same bits as
/// acc + add), the forward passes its rescale.
__device__ __forceinline__ void addChunks(float (&acc)[kDims], const float4 (&add)[kChunks],
                                          float keep, int64_t NC) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    if (i * kParts < NC)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[4 * i + e] = acc[4 * i + e] * keep + at4(add[i], e);
}

/// Stores acc * mul to the lane's dimensions (chunks part, part + 4, ...)
/// below D of the row at `dst`.
template <typename T>
__device__ __forceinline__ void storeChunks(T *dst, const float (&acc)[kDims], float mul,
                                            int part, int64_t NC, int64_t D) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t d = 4 * (part + kParts * i) + e;
      if (i * kParts < NC && d < D)
        st(dst + d, acc[4 * i + e] * mul);
    }
}

/// Loads rows r0.. of a [B, T, ld] tensor's head slice (b, column offset
/// col) into a kTile x D shared tile of row stride tileStride(D); rows past
/// T, and the columns from D to the next multiple of 4, are 0 (so the
/// 16-byte dot products over whole chunks add only 0 x 0 beyond D).
template <typename T>
__device__ __forceinline__ void loadTile(float *dst, const T *src, const Dims &a, int64_t b,
                                         int64_t r0, int64_t ldRow, int64_t col, int64_t D) {
  const int64_t SD = tileStride(D);
  // f32 operands: 16-byte loads and stores (4 elements), all of a thread's
  // loads issued before its first store (at most 8 a thread), where the
  // rows allow.
  if (sizeof(T) == 4 && D % 4 == 0 && ldRow % 4 == 0 && col % 4 == 0 &&
      (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    constexpr int kMaxVecs = kTile * (int)(kMaxHeadDim / 4) / kThreadsF;
    const float *fs = reinterpret_cast<const float *>(src);
    int vecs = (int)D / 4, total = kTile * vecs;
    float4 buf[kMaxVecs];
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      int i = (int)threadIdx.x + j * kThreadsF;
      buf[j] = float4{0.f, 0.f, 0.f, 0.f};
      if (i < total) {
        int r = i / vecs, d = (i - r * vecs) * 4;
        int64_t t = r0 + r;
        if (t < a.T)
          buf[j] = *reinterpret_cast<const float4 *>(fs + (b * a.T + t) * ldRow + col + d);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      int i = (int)threadIdx.x + j * kThreadsF;
      if (i < total) {
        int r = i / vecs, d = (i - r * vecs) * 4;
        *reinterpret_cast<float4 *>(dst + r * SD + d) = buf[j];
      }
    }
    return;
  }
  const int64_t D4 = (D + 3) / 4 * 4;
  for (int64_t i = threadIdx.x; i < kTile * D4; i += blockDim.x) {
    int64_t r = i / D4, d = i % D4, t = r0 + r;
    dst[r * SD + d] = t < a.T && d < D ? ld(src + (b * a.T + t) * ldRow + col + d) : 0.f;
  }
}

/// The forward pass over one (b, h, query tile). Writes y and the row
/// log-sum-exp (when lse is not null).
template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsF)
    forwardKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
  extern __shared__ float4 smem4[];
  float *sm = reinterpret_cast<float *>(smem4);
  // KD: D at compile time, 0: at run time; NC: its 16-byte chunks.
  const int64_t D = KD > 0 ? KD : a.D, SD = tileStride(D), NC = (D + 3) / 4;
  float *Qs = sm, *Ks = Qs + kTile * SD, *Vs = Ks + kTile * SD, *Ps = Vs + kTile * SD;
  // Longest (causal) tiles first: they start in the first wave.
  int64_t qt = a.tiles - 1 - (int64_t)(blockIdx.x % a.tiles);
  int64_t h = (blockIdx.x / a.tiles) % a.H, b = blockIdx.x / (a.tiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int row = threadIdx.x / kParts, part = threadIdx.x % kParts;
  int64_t t0 = qt * kTile, trow = t0 + row;
  loadTile(Qs, q, a, b, t0, a.ldq, h * D, D);
  float m = -INFINITY, l = 0.f, o[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i)
    o[i] = 0.f;
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads(); // the previous tile's K, V, P are no longer read
    loadTile(Ks, k, a, b, j0, a.ldkv, kvh * D, D);
    loadTile(Vs, v, a, b, j0, a.ldkv, kvh * D, D);
    __syncthreads();
    // Scores of the lane's 16 columns: the row's chunk of Q read once for
    // all of them (16-byte loads; each score in dimension order).
    float sc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      sc[c] = 0.f;
    for (int64_t ch = 0; ch < NC; ++ch) {
      float4 x = lds4(Qs + row * SD + 4 * ch);
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        dot4(sc[c], x, lds4(Ks + (part + kParts * c) * SD + 4 * ch));
    }
    float tmax = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int64_t jj = j0 + part + kParts * c;
      bool ok = jj < a.T && (!a.causal || jj <= trow);
      sc[c] = ok ? sc[c] * a.scale : -INFINITY;
      tmax = fmaxf(tmax, sc[c]);
    }
    tmax = rowMax4(tmax);
    float mNew = fmaxf(m, tmax);
    float alpha = m == -INFINITY ? 0.f : expf(m - mNew);
    float psum = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float p = sc[c] == -INFINITY ? 0.f : expf(sc[c] - mNew);
      Ps[row * kPS + part + kParts * c] = p;
      psum += p;
    }
    psum = rowSum4(psum);
    l = l * alpha + psum;
    m = mNew;
    __syncthreads();
    // P V over the lane's chunks (part, part + 4, ...): each column's
    // probability read once for all of them.
    float4 acc[kChunks];
    weightedChunks(acc, Ps + row * kPS, Vs, SD, NC, part);
    addChunks(o, acc, alpha, NC);
  }
  bool valid = trow < a.T;
  float inv = l > 0.f ? 1.f / l : 0.f;
  if (valid)
    storeChunks(y + (b * a.T + trow) * a.ldy + h * D, o, inv, part, NC, D);
  if (lse && valid && part == 0)
    lse[(b * a.H + h) * a.T + trow] = m + logf(l);
}

/// delta = dy_t . y_t per (b, h, t), from the stored (rounded, for bf16 /
/// f16) output y, as FlashAttention-2's backward. Eight lanes per row: lane
/// j of a row sums the dimensions of its 8-element chunks j, j + 8, ... in
/// order (16-byte loads where the rows are aligned), then three butterfly
/// shuffles add the lanes in a fixed order. (One thread per row read each
/// row 2 bytes at a time, rows apart across the warp: 104 us for GPT-2's
/// B=16 on the H200, an eighth of its bandwidth.)
constexpr int kDeltaLanes = 8;
template <typename T>
__global__ void deltaKernel(Dims a, const T *y, const T *dy, float *delta, bool vec) {
  int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t r = gid / kDeltaLanes;
  int j = (int)(gid % kDeltaLanes);
  bool live = r < a.B * a.H * a.T; // whole warps stay for the shuffles
  float acc = 0.f;
  if (live) {
    int64_t t = r % a.T, h = (r / a.T) % a.H, b = r / (a.T * a.H);
    int64_t at = (b * a.T + t) * a.ldy + h * a.D;
    for (int64_t d0 = 8 * j; d0 < a.D; d0 += 8 * kDeltaLanes) {
      if constexpr (sizeof(T) == 2) {
        if (vec) { // one 16-byte load of each operand
          uint4 yv = *reinterpret_cast<const uint4 *>(y + at + d0);
          uint4 dv = *reinterpret_cast<const uint4 *>(dy + at + d0);
          T ye[8], de[8]; // by memcpy: reading a uint4 through a T * is undefined
          memcpy(ye, &yv, 16);
          memcpy(de, &dv, 16);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            acc += ld(de + e) * ld(ye + e);
          continue;
        }
      }
      for (int64_t d = d0; d < d0 + 8 && d < a.D; ++d)
        acc += ld(dy + at + d) * ld(y + at + d);
    }
  }
#pragma unroll
  for (int o = kDeltaLanes / 2; o > 0; o /= 2)
    acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (live && j == 0)
    delta[r] = acc;
}

/// dq over one (b, h, query tile): dq_t = scale sum_j p_tj (dy_t . v_j - delta_t) k_j.
template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsF)
    dqKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
             const float *delta, T *dq) {
  extern __shared__ float4 smem4[];
  float *sm = reinterpret_cast<float *>(smem4);
  const int64_t D = KD > 0 ? KD : a.D, SD = tileStride(D), NC = (D + 3) / 4;
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
  loadTile(Qs, q, a, b, t0, a.ldq, h * D, D);
  loadTile(DYs, dy, a, b, t0, a.ldy, h * D, D);
  float acc[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i)
    acc[i] = 0.f;
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads();
    loadTile(Ks, k, a, b, j0, a.ldkv, kvh * D, D);
    loadTile(Vs, v, a, b, j0, a.ldkv, kvh * D, D);
    __syncthreads();
    // q . k and dy . v of the lane's 16 columns.
    float s[kCols], dp[kCols];
    pairScores(s, dp, Qs + row * SD, DYs + row * SD, Ks, Vs, SD, NC, part);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int j = part + kParts * c;
      int64_t jj = j0 + j;
      bool ok = valid && jj < a.T && (!a.causal || jj <= trow);
      float ds = 0.f;
      if (ok) {
        float p = expf(s[c] * a.scale - lr);
        ds = p * (dp[c] - dl);
      }
      DSs[row * kPS + j] = ds;
    }
    __syncthreads();
    float4 sacc[kChunks];
    weightedChunks(sacc, DSs + row * kPS, Ks, SD, NC, part);
    addChunks(acc, sacc, 1.f, NC);
  }
  if (valid)
    storeChunks(dq + (b * a.T + trow) * a.ldq + h * D, acc, a.scale, part, NC, D);
}

/// dk, dv over one (b, kv head, key tile): over the query heads of the
/// group, then the query tiles that see the key tile, in order:
/// dv_j = sum_t p_tj dy_t, dk_j = scale sum_t p_tj (dy_t . v_j - delta_t) q_t.
template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsF)
    dkvKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
              const float *delta, T *dk, T *dv) {
  extern __shared__ float4 smem4[];
  float *sm = reinterpret_cast<float *>(smem4);
  const int64_t D = KD > 0 ? KD : a.D, SD = tileStride(D), NC = (D + 3) / 4;
  float *Ks = sm, *Vs = Ks + kTile * SD, *Qs = Vs + kTile * SD, *DYs = Qs + kTile * SD,
        *Ps = DYs + kTile * SD, *DSs = Ps + kTile * kPS, *Ls = DSs + kTile * kPS,
        *Dl = Ls + kTile;
  int64_t kt = (int64_t)(blockIdx.x % a.tiles);
  int64_t kvh = (blockIdx.x / a.tiles) % a.KV, b = blockIdx.x / (a.tiles * a.KV);
  int row = threadIdx.x / kParts, part = threadIdx.x % kParts;
  int64_t j0 = kt * kTile, jj = j0 + row;
  bool valid = jj < a.T;
  loadTile(Ks, k, a, b, j0, a.ldkv, kvh * D, D);
  loadTile(Vs, v, a, b, j0, a.ldkv, kvh * D, D);
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
      loadTile(Qs, q, a, b, t0, a.ldq, h * D, D);
      loadTile(DYs, dy, a, b, t0, a.ldy, h * D, D);
      for (int64_t i = threadIdx.x; i < kTile; i += blockDim.x) {
        int64_t t = t0 + i, r = (b * a.H + h) * a.T + t;
        Ls[i] = t < a.T ? lse[r] : 0.f;
        Dl[i] = t < a.T ? delta[r] : 0.f;
      }
      __syncthreads();
      // k . q and v . dy of the lane's 16 query rows.
      float s[kCols], dp[kCols];
      pairScores(s, dp, Ks + row * SD, Vs + row * SD, Qs, DYs, SD, NC, part);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        int tr = part + kParts * c;
        int64_t tt = t0 + tr;
        bool ok = valid && tt < a.T && (!a.causal || jj <= tt);
        float p = 0.f, ds = 0.f;
        if (ok) {
          p = expf(s[c] * a.scale - Ls[tr]);
          ds = p * (dp[c] - Dl[tr]);
        }
        Ps[row * kPS + tr] = p;
        DSs[row * kPS + tr] = ds;
      }
      __syncthreads();
      float4 sv[kChunks], sk[kChunks];
      weightedChunks(sv, Ps + row * kPS, DYs, SD, NC, part);
      weightedChunks(sk, DSs + row * kPS, Qs, SD, NC, part);
      addChunks(accV, sv, 1.f, NC);
      addChunks(accK, sk, 1.f, NC);
    }
  }
  if (valid) {
    int64_t at = (b * a.T + jj) * a.ldkv + kvh * D;
    storeChunks(dk + at, accK, a.scale, part, NC, D);
    storeChunks(dv + at, accV, 1.f, part, NC, D);
  }
}

size_t fwdSmem(int64_t D) {
  return sizeof(float) * (3 * kTile * tileStride(D) + kTile * kPS);
}
size_t dqSmem(int64_t D) { return sizeof(float) * (4 * kTile * tileStride(D) + kTile * kPS); }
size_t dkvSmem(int64_t D) {
  return sizeof(float) * (4 * kTile * tileStride(D) + 2 * kTile * kPS + 2 * kTile);
}

template <typename K> cudaError_t optIn(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

/// Launches one implementation's forward kernel (a block per (b, h, query
/// tile), `threads` threads, `sm` bytes of dynamic shared memory).
template <typename T, typename Kernel>
cudaError_t launchForward(Kernel kernel, size_t sm, int threads, int64_t rowsPerBlock,
                          const void *q, const void *k, const void *v, void *y, float *lse,
                          const Dims &a, cudaStream_t s) {
  if (cudaError_t e = optIn(kernel, sm))
    return e;
  int64_t blocks = a.B * a.H * ((a.T + rowsPerBlock - 1) / rowsPerBlock);
  kernel<<<(unsigned)blocks, threads, sm, s>>>(
      a, static_cast<const T *>(q), static_cast<const T *>(k), static_cast<const T *>(v),
      static_cast<T *>(y), lse);
  return cudaGetLastError();
}

/// Launches one implementation's backward: the delta kernel, then its dq
/// kernel (a block per (b, h, query tile)) and its dk/dv kernel (a block
/// per (b, kv head, key tile)).
template <typename T, typename DqKernel, typename DkvKernel>
cudaError_t launchBackward(DqKernel dqK, size_t smq, DkvKernel dkvK, size_t smkv, int threads, int64_t dqRows, int64_t dkvRows,
                           const void *q, const void *k, const void *v, const void *y,
                           const float *lse, const void *dy, void *dq, void *dk, void *dv,
                           float *delta, const Dims &a, cudaStream_t s) {
  const T *Q = static_cast<const T *>(q), *K = static_cast<const T *>(k),
          *V = static_cast<const T *>(v), *DY = static_cast<const T *>(dy);
  int64_t rows = a.B * a.H * a.T;
  // 16-byte loads: 16-bit storage, D and the row stride multiples of 8,
  // both tensors 16-byte aligned.
  bool vec = sizeof(T) == 2 && a.D % 8 == 0 && a.ldy % 8 == 0 &&
             ((reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(dy)) & 15) == 0;
  deltaKernel<T><<<(unsigned)((rows * kDeltaLanes + 255) / 256), 256, 0, s>>>(
      a, static_cast<const T *>(y), DY, delta, vec);
  if (cudaError_t e = cudaGetLastError())
    return e;
  if (cudaError_t e = optIn(dqK, smq))
    return e;
  if (cudaError_t e = optIn(dkvK, smkv))
    return e;
  int64_t dqBlocks = a.B * a.H * ((a.T + dqRows - 1) / dqRows);
  dqK<<<(unsigned)dqBlocks, threads, smq, s>>>(a, Q, K, V, DY, lse, delta, static_cast<T *>(dq));
  if (cudaError_t e = cudaGetLastError())
    return e;
  int64_t dkvBlocks = a.B * a.KV * ((a.T + dkvRows - 1) / dkvRows);
  dkvK<<<(unsigned)dkvBlocks, threads, smkv, s>>>(
      a, Q, K, V, DY, lse, delta, static_cast<T *>(dk), static_cast<T *>(dv));
  return cudaGetLastError();
}

/// The CUDA-core kernels for launchForward / launchBackward (forwardWith).
struct CoresKernels {
  static constexpr int kThreads = kThreadsF;
  template <typename T, int KD> static auto fwd() { return forwardKernel<T, KD>; }
  template <typename T, int KD> static auto dq() { return dqKernel<T, KD>; }
  template <typename T, int KD> static auto dkv() { return dkvKernel<T, KD>; }
  static size_t fwdBytes(int64_t D) { return fwdSmem(D); }
  static int64_t fwdRows(int64_t) { return kTile; }
  static size_t dqBytes(int64_t D) { return dqSmem(D); }
  static int64_t dqRows(int64_t) { return kTile; }
  static size_t dkvBytes(int64_t D) { return dkvSmem(D); }
  static int64_t dkvRows(int64_t) { return kTile; }
};

// ---------------------------------------------------------------------------
// Tensor-core kernels (bf16 / f16 storage, D a multiple of 16): the same
// tiling, online softmax and backward split as above, with every tile
// product on the tensor cores through WMMA (16 x 16 x 16 fragments, f32
// accumulation). A block of 4 warps owns a tile of 64 rows; warp w owns
// rows 16 w .. 16 w + 15 of every product, of the softmax and of the
// accumulators, so only the K/V (forward, dq) or Q/dY (dk/dv) tile loads
// need the whole block. Elementwise work (scaling, masks, exp, the running
// max and sum) reads the f32 products from shared memory, two lanes per
// row taking alternate columns (adjacent banks). The kernels are compiled
// for D = 64 and 128 as constants (every loop over D unrolled) and for
// any other D at run time. The products' operands are the stored bf16 / f16 values, exact
// in f32; the probabilities P and the score gradients dS are rounded to
// the storage type before they multiply V, dY, K or Q (FlashAttention-2
// does the same), one rounding each: docs/RUNTIME.md and
// CudaFastKernelsTest bound its effect.

namespace wm = nvcuda::wmma;
constexpr int kWarpsTc = 4;
constexpr int kThreadsTc = 32 * kWarpsTc; // 128
constexpr int kLdS = kTile + 4;           // f32 row stride of score tiles
constexpr int kLdP = kTile + 8;           // 16-bit row stride of P / dS tiles

template <typename T> __device__ __forceinline__ T cvt(float v);
template <> __device__ __forceinline__ __nv_bfloat16 cvt(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half cvt(float v) { return __float2half_rn(v); }

template <typename T>
using FragA = wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major>;
template <typename T>
using FragB = wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major>;
template <typename T>
using FragBt = wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major>;
using FragC = wm::fragment<wm::accumulator, 16, 16, 16, float>;

/// Rows r0.. of a [B, T, ldRow] tensor's head slice (b, column offset col)
/// into a kTile x D shared tile of the storage type, row stride ld
/// (D + 8); rows past T are 0.
template <typename T>
__device__ __forceinline__ void loadTileTc(T *dst, const T *src, const Dims &a, int64_t b,
                                           int64_t r0, int64_t ldRow, int64_t col, int ld,
                                           int D) {
  // 16-byte moves (8 elements) where the source rows allow them: D is a
  // multiple of 16 here and ld = D + 8, so every shared row starts 16-byte
  // aligned. One 2-byte load per element (and a division per element) made
  // these loads most of the kernels' time (the first H100 profile).
  // All of a thread's loads are issued before its first store (a tile is
  // at most 8 vectors a thread), so they wait on memory together.
  if (ldRow % 8 == 0 && col % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    constexpr int kMaxVecs = kTile * (int)(kMaxHeadDim / 8) / kThreadsTc;
    int vecs = D / 8, total = kTile * vecs;
    uint4 buf[kMaxVecs];
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      int i = (int)threadIdx.x + j * kThreadsTc;
      buf[j] = uint4{0u, 0u, 0u, 0u}; // +0 in bf16 and f16
      if (i < total) {
        int r = i / vecs, d = (i - r * vecs) * 8;
        int64_t t = r0 + r;
        if (t < a.T)
          buf[j] = *reinterpret_cast<const uint4 *>(src + (b * a.T + t) * ldRow + col + d);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      int i = (int)threadIdx.x + j * kThreadsTc;
      if (i < total) {
        int r = i / vecs, d = (i - r * vecs) * 8;
        *reinterpret_cast<uint4 *>(dst + r * ld + d) = buf[j];
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    int r = i / D, d = i % D;
    int64_t t = r0 + r;
    dst[r * ld + d] = t < a.T ? src[(b * a.T + t) * ldRow + col + d] : cvt<T>(0.f);
  }
}

/// out (16 x 64, f32, stride kLdS) = A (16 x D rows of a, stride lda)
/// times B^T, B the 64 x D tile b (stride ldb): the warp's 16 rows of
/// A B^T.
template <typename T>
__device__ __forceinline__ void productABt(float *out, const T *a, int lda, const T *b, int ldb,
                                           int D) {
#pragma unroll
  for (int n = 0; n < kTile / 16; ++n) {
    FragC acc;
    wm::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < D; kk += 16) {
      FragA<T> fa;
      FragBt<T> fb;
      wm::load_matrix_sync(fa, a + kk, lda);
      wm::load_matrix_sync(fb, b + n * 16 * ldb + kk, ldb);
      wm::mma_sync(acc, fa, fb, acc);
    }
    wm::store_matrix_sync(out + n * 16, acc, kLdS, wm::mem_row_major);
  }
}

/// acc[n] += A (the warp's 16 x 64 rows of p, stride kLdP) times the
/// 64 x D tile b (stride ldb), for n < D / 16.
template <typename T>
__device__ __forceinline__ void accumulateAB(FragC (&acc)[kMaxHeadDim / 16], const T *p, const T *b,
                                             int ldb, int D) {
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n) {
    if (n * 16 >= D)
      break;
#pragma unroll
    for (int kk = 0; kk < kTile; kk += 16) {
      FragA<T> fa;
      FragB<T> fb;
      wm::load_matrix_sync(fa, p + kk, kLdP);
      wm::load_matrix_sync(fb, b + kk * ldb + n * 16, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

size_t tcTile(int64_t D) { return sizeof(uint16_t) * kTile * (D + 8); }
size_t tcFwdSmem(int64_t D) {
  return 3 * tcTile(D) + sizeof(float) * kTile * kLdS + sizeof(uint16_t) * kTile * kLdP +
         sizeof(float) * (kTile * (D + 4) + 2 * kTile);
}
size_t tcDqSmem(int64_t D) {
  return 4 * tcTile(D) + 2 * sizeof(float) * kTile * kLdS + sizeof(uint16_t) * kTile * kLdP;
}
size_t tcDkvSmem(int64_t D) {
  return 4 * tcTile(D) + 2 * sizeof(float) * kTile * kLdS +
         2 * sizeof(uint16_t) * kTile * kLdP + 2 * sizeof(float) * kTile;
}

template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsTc)
    forwardTcKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
  extern __shared__ __align__(128) unsigned char smTc[];
  // KD: the head dimension at compile time (64, 128), 0: at run time.
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8, LDO = D + 4;
  T *Qs = reinterpret_cast<T *>(smTc), *Ks = Qs + kTile * LDT, *Vs = Ks + kTile * LDT;
  float *Ss = reinterpret_cast<float *>(Vs + kTile * LDT);
  T *Ps = reinterpret_cast<T *>(Ss + kTile * kLdS);
  float *Os = reinterpret_cast<float *>(Ps + kTile * kLdP), *Ms = Os + kTile * LDO,
        *Ls = Ms + kTile;
  int64_t qt = a.tiles - 1 - (int64_t)(blockIdx.x % a.tiles);
  int64_t h = (blockIdx.x / a.tiles) % a.H, b = blockIdx.x / (a.tiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int r = warp * 16 + lane / 2, side = lane % 2; // this lane's row, which half of its columns
  int64_t t0 = qt * kTile, trow = t0 + r;
  loadTileTc(Qs, q, a, b, t0, a.ldq, h * D, LDT, D);
  for (int i = threadIdx.x; i < kTile * LDO; i += blockDim.x)
    Os[i] = 0.f;
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
    Ms[i] = -INFINITY;
    Ls[i] = 0.f;
  }
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads(); // Q, O, m, l ready; the previous K, V no longer read
    loadTileTc(Ks, k, a, b, j0, a.ldkv, kvh * D, LDT, D);
    loadTileTc(Vs, v, a, b, j0, a.ldkv, kvh * D, LDT, D);
    __syncthreads();
    productABt(Ss + warp * 16 * kLdS, Qs + warp * 16 * LDT, LDT, Ks, LDT, D);
    __syncwarp();
    float *srow = Ss + r * kLdS;
    float tmax = -INFINITY;
    for (int c = 0; c < kTile / 2; ++c) {
      int j = 2 * c + side; // interleaved: the two lanes of a row in adjacent banks
      int64_t jj = j0 + j;
      bool ok = jj < a.T && (!a.causal || jj <= trow);
      float sc = ok ? srow[j] * a.scale : -INFINITY;
      srow[j] = sc;
      tmax = fmaxf(tmax, sc);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    float m = Ms[r], mNew = fmaxf(m, tmax);
    float alpha = m == -INFINITY ? 0.f : expf(m - mNew);
    float psum = 0.f;
    for (int c = 0; c < kTile / 2; ++c) {
      int j = 2 * c + side; // interleaved: the two lanes of a row in adjacent banks
      float p = srow[j] == -INFINITY ? 0.f : expf(srow[j] - mNew);
      Ps[r * kLdP + j] = cvt<T>(p);
      psum += p;
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    for (int d = side; d < D; d += 2)
      Os[r * LDO + d] *= alpha;
    __syncwarp(); // every lane has read Ms[r] and written its P and O
    if (side == 0) {
      Ls[r] = Ls[r] * alpha + psum;
      Ms[r] = mNew;
    }
    FragC acc[kMaxHeadDim / 16];
    float *orow = Os + warp * 16 * LDO;
#pragma unroll
    for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
      if (n * 16 < D)
        wm::load_matrix_sync(acc[n], orow + n * 16, LDO, wm::mem_row_major);
    accumulateAB(acc, Ps + warp * 16 * kLdP, Vs, LDT, D);
#pragma unroll
    for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
      if (n * 16 < D)
        wm::store_matrix_sync(orow + n * 16, acc[n], LDO, wm::mem_row_major);
    __syncwarp();
  }
  __syncthreads();
  bool valid = trow < a.T;
  float l = Ls[r], inv = l > 0.f ? 1.f / l : 0.f;
  for (int d = side; d < D; d += 2)
    if (valid)
      y[(b * a.T + trow) * a.ldy + h * D + d] = cvt<T>(Os[r * LDO + d] * inv);
  if (lse && valid && side == 0)
    lse[(b * a.H + h) * a.T + trow] = Ms[r] + logf(l);
}

/// dq over one (b, h, query tile) on the tensor cores:
/// dq_t = scale sum_j p_tj (dy_t . v_j - delta_t) k_j.
template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsTc)
    dqTcKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
               const float *delta, T *dq) {
  extern __shared__ __align__(128) unsigned char smTc[];
  // KD: the head dimension at compile time (64, 128), 0: at run time.
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8, LDO = D + 4;
  T *Qs = reinterpret_cast<T *>(smTc), *DYs = Qs + kTile * LDT, *Ks = DYs + kTile * LDT,
    *Vs = Ks + kTile * LDT;
  float *Ss = reinterpret_cast<float *>(Vs + kTile * LDT), *DPs = Ss + kTile * kLdS;
  T *DSs = reinterpret_cast<T *>(DPs + kTile * kLdS);
  float *Os = Ss; // the result, after the loop: kTile x (D + 4) <= 2 kTile x kLdS
  int64_t qt = a.tiles - 1 - (int64_t)(blockIdx.x % a.tiles);
  int64_t h = (blockIdx.x / a.tiles) % a.H, b = blockIdx.x / (a.tiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int r = warp * 16 + lane / 2, side = lane % 2;
  int64_t t0 = qt * kTile, trow = t0 + r;
  bool valid = trow < a.T;
  int64_t sr = (b * a.H + h) * a.T + trow;
  float lr = valid ? lse[sr] : 0.f, dl = valid ? delta[sr] : 0.f;
  loadTileTc(Qs, q, a, b, t0, a.ldq, h * D, LDT, D);
  loadTileTc(DYs, dy, a, b, t0, a.ldy, h * D, LDT, D);
  FragC acc[kMaxHeadDim / 16];
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
    wm::fill_fragment(acc[n], 0.f);
  int64_t kEnd = a.causal && t0 + kTile < a.T ? t0 + kTile : a.T;
  for (int64_t j0 = 0; j0 < kEnd; j0 += kTile) {
    __syncthreads();
    loadTileTc(Ks, k, a, b, j0, a.ldkv, kvh * D, LDT, D);
    loadTileTc(Vs, v, a, b, j0, a.ldkv, kvh * D, LDT, D);
    __syncthreads();
    productABt(Ss + warp * 16 * kLdS, Qs + warp * 16 * LDT, LDT, Ks, LDT, D);
    productABt(DPs + warp * 16 * kLdS, DYs + warp * 16 * LDT, LDT, Vs, LDT, D);
    __syncwarp();
    for (int c = 0; c < kTile / 2; ++c) {
      int j = 2 * c + side; // interleaved: the two lanes of a row in adjacent banks
      int64_t jj = j0 + j;
      bool ok = valid && jj < a.T && (!a.causal || jj <= trow);
      float ds = 0.f;
      if (ok) {
        float p = expf(Ss[r * kLdS + j] * a.scale - lr);
        ds = p * (DPs[r * kLdS + j] - dl);
      }
      DSs[r * kLdP + j] = cvt<T>(ds);
    }
    __syncwarp();
    accumulateAB(acc, DSs + warp * 16 * kLdP, Ks, LDT, D);
  }
  __syncthreads(); // Ss / DPs become the result tile
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
    if (n * 16 < D)
      wm::store_matrix_sync(Os + warp * 16 * LDO + n * 16, acc[n], LDO, wm::mem_row_major);
  __syncwarp();
  for (int d = side; d < D; d += 2)
    if (valid)
      dq[(b * a.T + trow) * a.ldq + h * D + d] = cvt<T>(Os[r * LDO + d] * a.scale);
}

/// dk, dv over one (b, kv head, key tile) on the tensor cores, over the
/// query heads of the group, then the query tiles that see the key tile,
/// in order: dv_j = sum_t p_tj dy_t, dk_j = scale sum_t p_tj (dy_t . v_j -
/// delta_t) q_t. The warp's rows are key rows: it forms S^T = K Q^T and
/// dP^T = V dY^T, so P^T and dS^T multiply dY and Q directly.
template <typename T, int KD>
__global__ void __launch_bounds__(kThreadsTc)
    dkvTcKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
                const float *delta, T *dk, T *dv) {
  extern __shared__ __align__(128) unsigned char smTc[];
  // KD: the head dimension at compile time (64, 128), 0: at run time.
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8, LDO = D + 4;
  T *Ks = reinterpret_cast<T *>(smTc), *Vs = Ks + kTile * LDT, *Qs = Vs + kTile * LDT,
    *DYs = Qs + kTile * LDT;
  float *Ss = reinterpret_cast<float *>(DYs + kTile * LDT), *DPs = Ss + kTile * kLdS;
  T *PTs = reinterpret_cast<T *>(DPs + kTile * kLdS), *DSTs = PTs + kTile * kLdP;
  float *Lq = reinterpret_cast<float *>(DSTs + kTile * kLdP), *Dq = Lq + kTile;
  float *Os = Ss; // the results, after the loops
  int64_t kt = (int64_t)(blockIdx.x % a.tiles);
  int64_t kvh = (blockIdx.x / a.tiles) % a.KV, b = blockIdx.x / (a.tiles * a.KV);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int r = warp * 16 + lane / 2, side = lane % 2; // r: a key row
  int64_t j0 = kt * kTile, jj = j0 + r;
  bool valid = jj < a.T;
  loadTileTc(Ks, k, a, b, j0, a.ldkv, kvh * D, LDT, D);
  loadTileTc(Vs, v, a, b, j0, a.ldkv, kvh * D, LDT, D);
  FragC accK[kMaxHeadDim / 16], accV[kMaxHeadDim / 16];
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n) {
    wm::fill_fragment(accK[n], 0.f);
    wm::fill_fragment(accV[n], 0.f);
  }
  int64_t group = a.H / a.KV;
  for (int64_t g = 0; g < group; ++g) {
    int64_t h = kvh * group + g;
    for (int64_t qt = a.causal ? kt : 0; qt < a.tiles; ++qt) {
      int64_t t0 = qt * kTile;
      __syncthreads(); // the previous query tile is no longer read
      loadTileTc(Qs, q, a, b, t0, a.ldq, h * D, LDT, D);
      loadTileTc(DYs, dy, a, b, t0, a.ldy, h * D, LDT, D);
      for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
        int64_t t = t0 + i, sr = (b * a.H + h) * a.T + t;
        Lq[i] = t < a.T ? lse[sr] : 0.f;
        Dq[i] = t < a.T ? delta[sr] : 0.f;
      }
      __syncthreads();
      productABt(Ss + warp * 16 * kLdS, Ks + warp * 16 * LDT, LDT, Qs, LDT, D);
      productABt(DPs + warp * 16 * kLdS, Vs + warp * 16 * LDT, LDT, DYs, LDT, D);
      __syncwarp();
      for (int c = 0; c < kTile / 2; ++c) {
        int tr = 2 * c + side; // interleaved, as in the forward
        int64_t tt = t0 + tr;
        bool ok = valid && tt < a.T && (!a.causal || jj <= tt);
        float p = 0.f, ds = 0.f;
        if (ok) {
          p = expf(Ss[r * kLdS + tr] * a.scale - Lq[tr]);
          ds = p * (DPs[r * kLdS + tr] - Dq[tr]);
        }
        PTs[r * kLdP + tr] = cvt<T>(p);
        DSTs[r * kLdP + tr] = cvt<T>(ds);
      }
      __syncwarp();
      accumulateAB(accV, PTs + warp * 16 * kLdP, DYs, LDT, D);
      accumulateAB(accK, DSTs + warp * 16 * kLdP, Qs, LDT, D);
    }
  }
  __syncthreads(); // Ss / DPs become the result tile
  float *orow = Os + warp * 16 * LDO;
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
    if (n * 16 < D)
      wm::store_matrix_sync(orow + n * 16, accK[n], LDO, wm::mem_row_major);
  __syncwarp();
  for (int d = side; d < D; d += 2)
    if (valid)
      dk[(b * a.T + jj) * a.ldkv + kvh * D + d] = cvt<T>(Os[r * LDO + d] * a.scale);
  __syncwarp();
#pragma unroll
  for (int n = 0; n < (int)kMaxHeadDim / 16; ++n)
    if (n * 16 < D)
      wm::store_matrix_sync(orow + n * 16, accV[n], LDO, wm::mem_row_major);
  __syncwarp();
  for (int d = side; d < D; d += 2)
    if (valid)
      dv[(b * a.T + jj) * a.ldkv + kvh * D + d] = cvt<T>(Os[r * LDO + d]);
}

/// The WMMA kernels (Impl::Wmma) for forwardWith / backwardWith.
struct WmmaKernels {
  static constexpr int kThreads = kThreadsTc;
  template <typename T, int KD> static auto fwd() { return forwardTcKernel<T, KD>; }
  template <typename T, int KD> static auto dq() { return dqTcKernel<T, KD>; }
  template <typename T, int KD> static auto dkv() { return dkvTcKernel<T, KD>; }
  static size_t fwdBytes(int64_t D) { return tcFwdSmem(D); }
  static int64_t fwdRows(int64_t) { return kTile; }
  static size_t dqBytes(int64_t D) { return tcDqSmem(D); }
  static int64_t dqRows(int64_t) { return kTile; }
  static size_t dkvBytes(int64_t D) { return tcDkvSmem(D); }
  static int64_t dkvRows(int64_t) { return kTile; }
};

// ---------------------------------------------------------------------------
// Register-tile kernels (mma.sync, bf16 / f16 storage, D a multiple of 16):
// FlashAttention-2's layout. The same tiles, online softmax, backward split
// and roundings as the WMMA kernels above (P and dS rounded to the storage
// type before their products), but a warp's scores, probabilities and
// output rows never leave its registers: the m16n8k16 accumulators of a
// 16 x 64 score block are, two n-tiles at a time, the A operand of the
// next product (CudaMma.cuh), each lane owns two rows (g and g + 8) and
// reduces over the four lanes of its quad. Shared memory holds only the
// operand tiles, read with ldmatrix. The WMMA kernels stored every score
// and output tile to shared memory and read it back (37 TFLOP/s for
// GPT-2's attention on the H100, 30 of its 107 ms bf16 step).

/// The register kernels' softmax runs in base 2: exp(x) = exp2(x log2 e),
/// the score scale and log2 e folded into one multiply-add before each
/// exp2 (a single MUFU.EX2; expf is a multi-instruction sequence, and the
/// softmax's instructions, not the tensor cores, bounded these kernels).
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

constexpr int kNt = kTile / 8;                   // 8-column n-tiles of a 64-wide score block
constexpr int kMaxDt = (int)kMaxHeadDim / 8;     // n-tiles of a D-wide accumulator: 16
constexpr int kMaxKs = (int)kMaxHeadDim / 16;    // 16-deep k steps over D: 8

/// loadTileTc's tile, its 16-byte moves issued as cp.async (the caller
/// commits and waits: the copies land while the block computes on the
/// other buffer); rows past T and operands the 16-byte path cannot take
/// are stored directly, visible after the caller's barrier as the copies.
template <typename T>
__device__ __forceinline__ void loadTileAsync(T *dst, const T *src, const Dims &a, int64_t b,
                                              int64_t r0, int64_t ldRow, int64_t col, int ld,
                                              int D) {
  if (ldRow % 8 == 0 && col % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    int vecs = D / 8, total = kTile * vecs;
    for (int i = threadIdx.x; i < total; i += kThreadsTc) {
      int r = i / vecs, d = (i - r * vecs) * 8;
      int64_t t = r0 + r;
      if (t < a.T)
        mma::cpAsync16(dst + r * ld + d, src + (b * a.T + t) * ldRow + col + d);
      else
        *reinterpret_cast<uint4 *>(dst + r * ld + d) = uint4{0u, 0u, 0u, 0u};
    }
    return;
  }
  loadTileTc(dst, src, a, b, r0, ldRow, col, ld, D);
}

/// Zeroes MT m-tiles of 16 x D accumulators.
template <int MT> __device__ __forceinline__ void zeroAcc(float (&acc)[MT][kMaxDt][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int n = 0; n < kMaxDt; ++n)
      acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;
}

/// s (MT m-tiles of 16 rows x NT * 8 columns) = A B^T: A the warp's rows
/// at a, a + 16 ld, ..., B the NT * 8 rows at b (both row-major, stride
/// ld, D columns): each B
/// fragment (a key tile's rows) is loaded once for the MT products, so a
/// warp owning 32 rows reads the key tile from shared memory half as often
/// per product, and has twice the independent tensor-core work in flight.
template <int MT, int NT = kNt, typename T>
__device__ __forceinline__ void scoresMmaN(float (&s)[MT][NT][4], const T *a, const T *b,
                                           int ld, int D, int lane) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kMaxKs; ++kk) {
    if (kk * 16 >= D)
      break;
    uint32_t af[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
      mma::loadA(af[i], a + i * 16 * ld + kk * 16, ld, lane);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t bf[4];
      mma::loadBt(bf, b + np * 16 * ld + kk * 16, ld, lane);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        mma::mma16816<T>(s[i][2 * np], af[i], bf);
        mma::mma16816<T>(s[i][2 * np + 1], af[i], bf + 2);
      }
    }
  }
}

/// acc (MT m-tiles, 16 x D each) += P B: P the warp's blocks in
/// accumulator layout (rounded to T here), B the NT * 8 x D rows at b
/// (row-major, stride ld); each B fragment loaded once for the MT
/// products.
template <int MT, int NT = kNt, typename T>
__device__ __forceinline__ void accumulateMmaN(float (&acc)[MT][kMaxDt][4],
                                               const float (&p)[MT][NT][4], const T *b, int ld,
                                               int D, int lane) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t af[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
      mma::accToA<T>(af[i], p[i][2 * kk], p[i][2 * kk + 1]);
#pragma unroll
    for (int np = 0; np < kMaxDt / 2; ++np) {
      if (np * 16 >= D)
        break;
      uint32_t bf[4];
      mma::loadB(bf, b + kk * 16 * ld + np * 16, ld, lane);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        mma::mma16816<T>(acc[i][2 * np], af[i], bf);
        mma::mma16816<T>(acc[i][2 * np + 1], af[i], bf + 2);
      }
    }
  }
}

/// Stores rows r0 (floats 0, 1 of each n-tile) and r0 + 8 (floats 2, 3)
/// of a 16 x D accumulator times `mul`, columns 2 q, 2 q + 1 of each
/// n-tile, to out[row * ldo + col] (rows < rows only).
template <typename T>
__device__ __forceinline__ void storeAcc(T *out, int64_t ldo, const float (&acc)[kMaxDt][4],
                                         float mul0, float mul1, int64_t r0, int64_t rows,
                                         int D, int lane) {
  int q = lane % 4;
#pragma unroll
  for (int n = 0; n < kMaxDt; ++n) {
    if (n * 8 >= D)
      break;
    int c = n * 8 + 2 * q;
    if (r0 < rows) {
      out[r0 * ldo + c] = cvt<T>(acc[n][0] * mul0);
      out[r0 * ldo + c + 1] = cvt<T>(acc[n][1] * mul0);
    }
    if (r0 + 8 < rows) {
      out[(r0 + 8) * ldo + c] = cvt<T>(acc[n][2] * mul1);
      out[(r0 + 8) * ldo + c + 1] = cvt<T>(acc[n][3] * mul1);
    }
  }
}

// Two buffers of the streamed tiles (K, V; or Q, dY and their rows' lse
// and delta): the next tile's copies fly while the block computes. (The
// forward's: MmaKernels::fwdBytes, its Q tile MT tiles high.)

/// The forward over one (b, h, block of 64 MT query rows): warp w owns the
/// MT 16-row m-tiles of rows 16 MT w .. 16 MT (w + 1) - 1 (MT = 2:
/// FlashAttention-2's 32 rows a warp, each key fragment feeding two
/// products).
template <typename T, int KD, int MT = 1>
__global__ void __launch_bounds__(kThreadsTc, MT == 2 ? 3 : 4)
    forwardMmaKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
  extern __shared__ __align__(128) unsigned char smTc[];
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8;
  const float sl2 = a.scale * kLog2e; // scores to base-2 exponents
  constexpr int QR = kTile * MT;      // the block's query rows
  // Q (QR rows), then K and V twice (buffer it % 2 holds key tile it).
  T *Qs = reinterpret_cast<T *>(smTc), *KV = Qs + QR * LDT;
  const int64_t qTiles = (a.T + QR - 1) / QR;
  int64_t qt = qTiles - 1 - (int64_t)(blockIdx.x % qTiles);
  int64_t h = (blockIdx.x / qTiles) % a.H, b = blockIdx.x / (qTiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  int64_t t0 = qt * QR, w0 = t0 + warp * 16 * MT;
  float o[MT][kMaxDt][4];
  zeroAcc(o);
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
    m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.f;
  int64_t kEnd = a.causal && t0 + QR < a.T ? t0 + QR : a.T;
  int64_t nTiles = (kEnd + kTile - 1) / kTile;
  auto issue = [&](int64_t it) {
    T *Kb = KV + (it % 2) * 2 * kTile * LDT;
    loadTileAsync(Kb, k, a, b, it * kTile, a.ldkv, kvh * D, LDT, D);
    loadTileAsync(Kb + kTile * LDT, v, a, b, it * kTile, a.ldkv, kvh * D, LDT, D);
    mma::cpAsyncCommit();
  };
#pragma unroll
  for (int i = 0; i < MT; ++i)
    loadTileAsync(Qs + i * kTile * LDT, q, a, b, t0 + i * kTile, a.ldq, h * D, LDT, D);
  issue(0); // one group: Q and the first K, V
  for (int64_t it = 0; it < nTiles; ++it) {
    if (it + 1 < nTiles) {
      issue(it + 1); // into the buffer iteration it - 1 read (its barrier passed)
      mma::cpAsyncWait<1>();
    } else {
      mma::cpAsyncWait<0>();
    }
    __syncthreads(); // tile it (every thread's copies) is in shared memory
    int64_t j0 = it * kTile;
    const T *Ks = KV + (it % 2) * 2 * kTile * LDT, *Vs = Ks + kTile * LDT;
    float s[MT][kNt][4];
    scoresMmaN<MT>(s, Qs + warp * 16 * MT * LDT, Ks, LDT, D, lane);
    // Masks only where the tile crosses the diagonal or the end (uniform
    // over the block: every interior tile skips the compares). The row
    // maximum of the raw scores, scaled once (the scale is positive and
    // rounding is monotonic: the maximum of the scaled scores).
    bool masked = j0 + kTile > a.T || (a.causal && j0 + kTile - 1 > t0);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kNt; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          int64_t key = j0 + n * 8 + 2 * qd + (i & 1), r = w0 + 16 * mt + g + 8 * (i / 2);
          if (masked && !(key < a.T && (!a.causal || key <= r)))
            s[mt][n][i] = -INFINITY;
          tmax[i / 2] = fmaxf(tmax[i / 2], s[mt][n][i]);
        }
      float alpha[2], mUse[2], psum[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mNew = fmaxf(m[mt][e], rowMax4(tmax[e]) * sl2);
        // A row with every key masked so far keeps m = -inf: exponents
        // against 0 (exp2(-inf) = 0), not -inf - -inf.
        mUse[e] = mNew == -INFINITY ? 0.f : mNew;
        alpha[e] = exp2f(m[mt][e] - mUse[e]);
        m[mt][e] = mNew;
      }
#pragma unroll
      for (int n = 0; n < kNt; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float p = exp2f(fmaf(s[mt][n][i], sl2, -mUse[i / 2]));
          s[mt][n][i] = p;
          psum[i / 2] += p;
        }
#pragma unroll
      for (int e = 0; e < 2; ++e)
        l[mt][e] = l[mt][e] * alpha[e] + rowSum4(psum[e]);
#pragma unroll
      for (int n = 0; n < kMaxDt; ++n) {
        o[mt][n][0] *= alpha[0];
        o[mt][n][1] *= alpha[0];
        o[mt][n][2] *= alpha[1];
        o[mt][n][3] *= alpha[1];
      }
    }
    accumulateMmaN<MT>(o, s, Vs, LDT, D, lane);
    __syncthreads(); // buffer it % 2 is free for tile it + 2
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    int64_t r0 = w0 + 16 * mt + g;
    float inv[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      inv[e] = l[mt][e] > 0.f ? 1.f / l[mt][e] : 0.f;
    storeAcc(y + b * a.T * a.ldy + h * D, a.ldy, o[mt], inv[0], inv[1], r0, a.T, D, lane);
    if (lse && qd == 0) // natural-log units (m is in base 2)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (r0 + 8 * e < a.T)
          lse[(b * a.H + h) * a.T + r0 + 8 * e] = (m[mt][e] + log2f(l[mt][e])) * kLn2;
  }
}

/// dq over one (b, h, block of 64 MT query rows), registers: dq_t = scale
/// sum_j p_tj (dy_t . v_j - delta_t) k_j. As the forward, warp w owns MT
/// m-tiles; with MT = 2 each key tile is taken in two halves of 32 keys
/// (the score and dP blocks of 32 rows x 32 keys fit the registers beside
/// the 32 x D accumulator), the same tile loads and barriers.
template <typename T, int KD, int MinBlocks = 1, int MT = 1>
__global__ void __launch_bounds__(kThreadsTc, MinBlocks)
    dqMmaKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
                const float *delta, T *dq) {
  extern __shared__ __align__(128) unsigned char smTc[];
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8;
  const float sl2 = a.scale * kLog2e; // P = exp2(s sl2 - lse log2 e)
  constexpr int QR = kTile * MT, NT = MT == 1 ? kNt : kNt / 2, HALVES = kNt / NT;
  // Q, dY (QR rows each), then K and V twice (buffer it % 2 holds key tile it).
  T *Qs = reinterpret_cast<T *>(smTc), *DYs = Qs + QR * LDT, *KV = DYs + QR * LDT;
  const int64_t qTiles = (a.T + QR - 1) / QR;
  int64_t qt = qTiles - 1 - (int64_t)(blockIdx.x % qTiles);
  int64_t h = (blockIdx.x / qTiles) % a.H, b = blockIdx.x / (qTiles * a.H);
  int64_t kvh = h / (a.H / a.KV);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  int64_t t0 = qt * QR, w0 = t0 + warp * 16 * MT;
  float lr[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      int64_t r = w0 + 16 * mt + g + 8 * e, sr = (b * a.H + h) * a.T + r;
      lr[mt][e] = r < a.T ? lse[sr] * kLog2e : 0.f;
      dl[mt][e] = r < a.T ? delta[sr] : 0.f;
    }
  float acc[MT][kMaxDt][4];
  zeroAcc(acc);
  int64_t kEnd = a.causal && t0 + QR < a.T ? t0 + QR : a.T;
  int64_t nTiles = (kEnd + kTile - 1) / kTile;
  auto issue = [&](int64_t it) {
    T *Kb = KV + (it % 2) * 2 * kTile * LDT;
    loadTileAsync(Kb, k, a, b, it * kTile, a.ldkv, kvh * D, LDT, D);
    loadTileAsync(Kb + kTile * LDT, v, a, b, it * kTile, a.ldkv, kvh * D, LDT, D);
    mma::cpAsyncCommit();
  };
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    loadTileAsync(Qs + i * kTile * LDT, q, a, b, t0 + i * kTile, a.ldq, h * D, LDT, D);
    loadTileAsync(DYs + i * kTile * LDT, dy, a, b, t0 + i * kTile, a.ldy, h * D, LDT, D);
  }
  issue(0); // one group: Q, dY and the first K, V
  for (int64_t it = 0; it < nTiles; ++it) {
    if (it + 1 < nTiles) {
      issue(it + 1);
      mma::cpAsyncWait<1>();
    } else {
      mma::cpAsyncWait<0>();
    }
    __syncthreads(); // tile it is in shared memory
    const T *Ks = KV + (it % 2) * 2 * kTile * LDT, *Vs = Ks + kTile * LDT;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) {
      int64_t j0 = it * kTile + hf * NT * 8;
      float s[MT][NT][4], dp[MT][NT][4];
      scoresMmaN<MT, NT>(s, Qs + warp * 16 * MT * LDT, Ks + hf * NT * 8 * LDT, LDT, D, lane);
      scoresMmaN<MT, NT>(dp, DYs + warp * 16 * MT * LDT, Vs + hf * NT * 8 * LDT, LDT, D, lane);
      bool masked =
          j0 + NT * 8 > a.T || t0 + QR > a.T || (a.causal && j0 + NT * 8 - 1 > t0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            int64_t key = j0 + n * 8 + 2 * qd + (i & 1), r = w0 + 16 * mt + g + 8 * (i / 2);
            bool ok = !masked || (r < a.T && key < a.T && (!a.causal || key <= r));
            float p = exp2f(fmaf(s[mt][n][i], sl2, -lr[mt][i / 2]));
            s[mt][n][i] = ok ? p * (dp[mt][n][i] - dl[mt][i / 2]) : 0.f;
          }
      accumulateMmaN<MT, NT>(acc, s, Ks + hf * NT * 8 * LDT, LDT, D, lane);
    }
    __syncthreads(); // buffer it % 2 is free for tile it + 2
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    storeAcc(dq + b * a.T * a.ldq + h * D, a.ldq, acc[mt], a.scale, a.scale,
             w0 + 16 * mt + g, a.T, D, lane);
}

/// Rows of dq partial sums (b, query head) keeps from the key blocks before
/// kb (blocks of KR = kTile * m key rows): key block k adds to query tiles
/// q0(k) .. tiles - 1 (q0(k) = k m when causal, else 0), kTile rows each.
__host__ __device__ inline int64_t partRowsBefore(const Dims &a, int64_t m, int64_t kb) {
  int64_t tiles = kb * a.tiles - (a.causal ? m * kb * (kb - 1) / 2 : 0);
  return tiles * kTile;
}
/// All of (b, query head)'s partial rows, and its key blocks.
__host__ __device__ inline int64_t keyBlocks(const Dims &a, int64_t m) {
  return (a.T + kTile * m - 1) / (kTile * m);
}
__host__ __device__ inline int64_t partRows(const Dims &a, int64_t m) {
  return partRowsBefore(a, m, keyBlocks(a, m));
}

/// Two rounded values (pack2) into 16-bit shared memory at p (4-byte
/// aligned); by memcpy under the emulator (a host compiler may reorder a
/// store through another type's pointer).
template <typename T> __device__ __forceinline__ void store2(T *p, uint32_t v) {
#ifdef FSDP_CUDAEMU_MMA
  memcpy(p, &v, 4);
#else
  *reinterpret_cast<uint32_t *>(p) = v;
#endif
}

/// dk, dv over one (b, kv head, block of 64 MT key rows), registers; the
/// warp's rows are key rows (MT m-tiles, as the forward's query rows):
/// S^T = K Q^T and dP^T = V dY^T, so P^T and dS^T multiply dY and Q
/// directly. Query heads of the group, then query tiles, in order; with
/// MT = 2 each query tile is taken in two halves of 32 queries (the score
/// blocks fit the registers beside the two 32 x D accumulators), the
/// same tile loads and barriers, the same order of every sum.
///
/// Fused (bwdFusedMmaKernel, Impl::MmaFused): also the block's share of
/// dq, dS K over its KR keys, for each query tile, so each P and dS is
/// computed once for the three gradients (dqMmaKernel recomputes the
/// scores, P and dP). dS^T, rounded to T as it is for dK, goes to shared
/// memory key-major; after a barrier warp w takes query rows 16 w .. 16 w +
/// 15 of the tile against all KR keys (dS through ldmatrix .trans) and
/// stores its 16 x D f32 sums to dqPart (rows partRowsBefore(kb) + t -
/// 64 q0(kb) of query head b H + h - bh0). dqReduceKernel adds the key
/// blocks' partials in key-block order: deterministic, no atomics.
template <typename T, int KD, int MT, bool Fused>
__device__ __forceinline__ void dkvBody(const Dims &a, int64_t kt, int64_t kvh, int64_t b,
                                        int64_t bh0, const T *q, const T *k, const T *v,
                                        const T *dy, const float *lse, const float *delta, T *dk,
                                        T *dv, float *dqPart) {
  extern __shared__ __align__(128) unsigned char smTc[];
  const int D = KD > 0 ? KD : (int)a.D, LDT = D + 8;
  const float sl2 = a.scale * kLog2e; // P = exp2(s sl2 - lse log2 e)
  constexpr int KR = kTile * MT, NT = MT == 1 ? kNt : kNt / 2, HALVES = kNt / NT;
  // K, V (KR rows each), then Q and dY twice (buffer it % 2 holds step it's
  // query tile), then lse and delta of those rows twice; fused, then dS^T
  // (KR x kTile).
  T *Ks = reinterpret_cast<T *>(smTc), *Vs = Ks + KR * LDT, *QD = Vs + KR * LDT;
  float *LD = reinterpret_cast<float *>(QD + 4 * kTile * LDT);
  T *DS = reinterpret_cast<T *>(LD + 4 * kTile);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  int64_t j0 = kt * KR, w0 = j0 + warp * 16 * MT, key[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    key[mt][0] = w0 + 16 * mt + g, key[mt][1] = w0 + 16 * mt + g + 8;
  float accK[MT][kMaxDt][4], accV[MT][kMaxDt][4];
  zeroAcc(accK);
  zeroAcc(accV);
  // Steps: the group's query heads in order, each over the query tiles
  // that see this key block, in order.
  int64_t group = a.H / a.KV, q0 = a.causal ? j0 / kTile : 0, perHead = a.tiles - q0;
  int64_t steps = group * perHead;
  // Fused: the partial rows of (b, the group's first query head) for this
  // key block's first query tile; each head adds partRows.
  int64_t partBase = 0, partHead = 0;
  if constexpr (Fused) {
    partHead = partRows(a, MT);
    partBase = (b * a.H + kvh * group - bh0) * partHead + partRowsBefore(a, MT, kt);
  }
  auto issue = [&](int64_t it) {
    int64_t h = kvh * group + it / perHead, t0 = (q0 + it % perHead) * kTile;
    T *Qb = QD + (it % 2) * 2 * kTile * LDT;
    float *Lb = LD + (it % 2) * 2 * kTile;
    loadTileAsync(Qb, q, a, b, t0, a.ldq, h * D, LDT, D);
    loadTileAsync(Qb + kTile * LDT, dy, a, b, t0, a.ldy, h * D, LDT, D);
    mma::cpAsyncCommit();
    for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
      int64_t t = t0 + i, sr = (b * a.H + h) * a.T + t;
      Lb[i] = t < a.T ? lse[sr] * kLog2e : 0.f; // base 2
      Lb[kTile + i] = t < a.T ? delta[sr] : 0.f;
    }
  };
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    loadTileAsync(Ks + i * kTile * LDT, k, a, b, j0 + i * kTile, a.ldkv, kvh * D, LDT, D);
    loadTileAsync(Vs + i * kTile * LDT, v, a, b, j0 + i * kTile, a.ldkv, kvh * D, LDT, D);
  }
  issue(0); // one group: K, V and the first Q, dY
  for (int64_t it = 0; it < steps; ++it) {
    if (it + 1 < steps) {
      issue(it + 1);
      mma::cpAsyncWait<1>();
    } else {
      mma::cpAsyncWait<0>();
    }
    __syncthreads(); // step it's tiles are in shared memory
    int64_t t0 = (q0 + it % perHead) * kTile;
    const T *Qs = QD + (it % 2) * 2 * kTile * LDT, *DYs = Qs + kTile * LDT;
    const float *Lq = LD + (it % 2) * 2 * kTile, *Dq = Lq + kTile;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) {
      const int c0 = hf * NT * 8; // the half's first query column in the tile
      float st[MT][NT][4], dpt[MT][NT][4];
      scoresMmaN<MT, NT>(st, Ks + warp * 16 * MT * LDT, Qs + c0 * LDT, LDT, D, lane);
      scoresMmaN<MT, NT>(dpt, Vs + warp * 16 * MT * LDT, DYs + c0 * LDT, LDT, D, lane);
      bool masked = j0 + KR > a.T || t0 + kTile > a.T || (a.causal && j0 + KR - 1 > t0 + c0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            int c = c0 + n * 8 + 2 * qd + (i & 1);
            int64_t tt = t0 + c, jj = key[mt][i / 2];
            bool ok = !masked || (jj < a.T && tt < a.T && (!a.causal || jj <= tt));
            float p = ok ? exp2f(fmaf(st[mt][n][i], sl2, -Lq[c])) : 0.f;
            st[mt][n][i] = p;
            dpt[mt][n][i] = ok ? p * (dpt[mt][n][i] - Dq[c]) : 0.f;
          }
      if constexpr (Fused) { // dS^T for the tile's dq: the warp's key rows, the half's columns
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              store2(DS + (warp * 16 * MT + 16 * mt + g + 8 * e) * kLdP + c0 + n * 8 + 2 * qd,
                     mma::pack2<T>(dpt[mt][n][2 * e], dpt[mt][n][2 * e + 1]));
      }
      accumulateMmaN<MT, NT>(accV, st, DYs + c0 * LDT, LDT, D, lane);
      accumulateMmaN<MT, NT>(accK, dpt, Qs + c0 * LDT, LDT, D, lane);
    }
    if constexpr (Fused) {
      __syncthreads(); // the tile's dS^T (every warp's key rows) is in DS
      float dqa[kMaxDt][4];
#pragma unroll
      for (int n = 0; n < kMaxDt; ++n)
        dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KR / 16; ++kk) {
        uint32_t af[4];
        mma::loadAt(af, DS + kk * 16 * kLdP + warp * 16, kLdP, lane);
#pragma unroll
        for (int np = 0; np < kMaxDt / 2; ++np) {
          if (np * 16 >= D)
            break;
          uint32_t bf[4];
          mma::loadB(bf, Ks + kk * 16 * LDT + np * 16, LDT, lane);
          mma::mma16816<T>(dqa[2 * np], af, bf);
          mma::mma16816<T>(dqa[2 * np + 1], af, bf + 2);
        }
      }
      float *dst = dqPart + (partBase + (it / perHead) * partHead + (it % perHead) * kTile +
                             warp * 16 + g) *
                                D;
#pragma unroll
      for (int n = 0; n < kMaxDt; ++n) {
        if (n * 8 >= D)
          break;
        int c = n * 8 + 2 * qd;
        *reinterpret_cast<float2 *>(dst + c) = float2{dqa[n][0], dqa[n][1]};
        *reinterpret_cast<float2 *>(dst + 8 * D + c) = float2{dqa[n][2], dqa[n][3]};
      }
    }
    __syncthreads(); // buffer it % 2 (and DS) are free for step it + 1
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    int64_t r0 = w0 + 16 * mt + g;
    storeAcc(dk + b * a.T * a.ldkv + kvh * D, a.ldkv, accK[mt], a.scale, a.scale, r0, a.T, D,
             lane);
    storeAcc(dv + b * a.T * a.ldkv + kvh * D, a.ldkv, accV[mt], 1.f, 1.f, r0, a.T, D, lane);
  }
}

/// dkvBody over one (b, kv head, key block): block index (b, kv head) major.
template <typename T, int KD, int MinBlocks = 1, int MT = 1>
__global__ void __launch_bounds__(kThreadsTc, MinBlocks)
    dkvMmaKernel(Dims a, const T *q, const T *k, const T *v, const T *dy, const float *lse,
                 const float *delta, T *dk, T *dv) {
  const int64_t kTiles = (a.T + kTile * MT - 1) / (kTile * MT);
  int64_t kt = (int64_t)(blockIdx.x % kTiles);
  int64_t kvh = (blockIdx.x / kTiles) % a.KV, b = blockIdx.x / (kTiles * a.KV);
  dkvBody<T, KD, MT, false>(a, kt, kvh, b, 0, q, k, v, dy, lse, delta, dk, dv, nullptr);
}

/// The fused backward's kernel (dkvBody, Fused) over (b, kv head) pairs g0 ..
/// g0 + pairs - 1 (g = b KV + kv head; backwardFused launches the pairs in
/// chunks whose partials fit its scratch): dqPart holds query heads
/// b H + h - g0 group onwards. Key blocks in order, each for every pair:
/// causal, the first blocks see the most queries, so the longest blocks
/// start first and the grid's last wave is the shortest ones.
template <typename T, int KD, int MinBlocks = 1, int MT = 1>
__global__ void __launch_bounds__(kThreadsTc, MinBlocks)
    bwdFusedMmaKernel(Dims a, int64_t g0, int64_t pairs, const T *q, const T *k, const T *v,
                      const T *dy, const float *lse, const float *delta, T *dk, T *dv,
                      float *dqPart) {
  int64_t kt = (int64_t)blockIdx.x / pairs, pair = g0 + (int64_t)blockIdx.x % pairs;
  dkvBody<T, KD, MT, true>(a, kt, pair % a.KV, pair / a.KV, g0 * (a.H / a.KV), q, k, v, dy, lse,
                           delta, dk, dv, dqPart);
}

/// dq = scale * (the sum over key blocks 0, 1, ... of their partials), a
/// thread per 4 dimensions of a row (D a multiple of 16 here): the key
/// blocks of KR = 64 m rows that see row t (all, or those up to t / KR when
/// causal), in order; for `heads` query heads (b H + h) from bh0, whose
/// partials start at part.
template <typename T>
__global__ void dqReduceKernel(Dims a, int64_t m, int64_t bh0, int64_t heads, const float *part,
                               T *dq) {
  const int64_t D4 = a.D / 4, KR = kTile * m;
  int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= heads * a.T * D4)
    return;
  int64_t d = (gid % D4) * 4, r = gid / D4, t = r % a.T, local = r / a.T, bh = bh0 + local;
  int64_t h = bh % a.H, b = bh / a.H;
  int64_t last = a.causal ? t / KR : keyBlocks(a, m) - 1;
  const float *base = part + local * partRows(a, m) * a.D + d;
  float4 s = float4{0.f, 0.f, 0.f, 0.f};
  for (int64_t kb = 0; kb <= last; ++kb) {
    int64_t row = partRowsBefore(a, m, kb) + t - (a.causal ? kb * KR : 0);
    float4 p = *reinterpret_cast<const float4 *>(base + row * a.D);
    s.x += p.x;
    s.y += p.y;
    s.z += p.z;
    s.w += p.w;
  }
  T *out = dq + (b * a.T + t) * a.ldq + h * a.D + d;
  out[0] = cvt<T>(s.x * a.scale);
  out[1] = cvt<T>(s.y * a.scale);
  out[2] = cvt<T>(s.z * a.scale);
  out[3] = cvt<T>(s.w * a.scale);
}

/// The floats before the partials in the fused backward's scratch (each
/// row's delta, rounded up to whole 16-byte chunks).
int64_t deltaFloats(const Dims &a) { return (a.B * a.H * a.T + 3) / 4 * 4; }

/// The most bytes of dq partials the fused backward keeps at once
/// (setFusedScratchCap): (b, kv head) pairs run in chunks that fit.
int64_t gFusedCapBytes = int64_t(512) << 20;

/// Floats of partials one (b, kv head) pair writes (its group's query
/// heads).
int64_t pairFloats(const Dims &a, int m) { return (a.H / a.KV) * partRows(a, m) * a.D; }
/// (b, kv head) pairs per chunk: as many as fit the cap, at least 0 (the
/// fused backward does not apply: one pair's partials exceed the cap).
int64_t pairsPerChunk(const Dims &a, int m) {
  int64_t per = pairFloats(a, m);
  return per > 0 ? std::min(a.B * a.KV, gFusedCapBytes / (int64_t)sizeof(float) / per)
                 : a.B * a.KV;
}

/// Key m-tiles a warp owns in the fused backward: 2 for MmaFused at D = 64
/// (key blocks of 128, as MmaTight3's dk / dv), else 1 (blocks of 64;
/// MmaFused64 at D = 64 bounded to 3 blocks a multiprocessor, as
/// MmaTight's dk / dv). The partial layout's m: WgmmaFused's is
/// MmaFused's (2), WgmmaFused64's MmaFused64's (1).
int fusedTiles(Impl impl, int64_t D) {
  return (impl == Impl::MmaFused || impl == Impl::WgmmaFused || impl == Impl::WgmmaFusedSerial) &&
                 D == 64
             ? 2
             : 1;
}

// --- wgmma (sm_90a): the forward on Hopper's warpgroup tensor cores ------------------------------
//
// One block is one warpgroup (128 threads) and owns 64 query rows of one
// (b, h); it streams key / value tiles of 128 rows (at D = 64; at D = 128
// tiles of 64 rows, each row two 64-element column blocks: WgFwd). S = Q
// K^T is four wgmma m64n128k16 (A = Q, B = K, both K-major in shared memory), the
// softmax runs on S in registers exactly as the mma.sync forward's (warp w
// holds rows 16 w .. 16 w + 15 in the same accumulator layout), P is
// rounded to the storage type into wgmma A fragments (registers), and
// O += P V is eight wgmma m64n64k16 with V N-major in shared memory (no
// transposed copy). Q, K and V tiles are stored as the canonical 128-byte
// swizzled layout: rows of D = 64 elements (128 bytes), 16-byte chunk c of
// row r at chunk c ^ (r % 8), eight-row groups 1024 bytes apart, so wgmma
// reads them without bank conflicts and cp.async writes whole chunks.
// The block's shared memory: Q 8 KiB, K and V twice (the next tile's
// copies fly while the block computes) 64 KiB, 73 KiB with the 1024-byte
// alignment the swizzle pattern needs: three blocks a multiprocessor
// (at D = 128: Q 16 KiB, 81 KiB, two blocks).

constexpr int kWgRows = 64; // query rows of a block (a warpgroup: 4 warps x 16)
/// The wgmma forward's geometry at head dimension D (64 or 128): Keys keys
/// a streamed tile (128 at D = 64, 64 at D = 128: the same 16 KiB K or V
/// tile), tiles of D / 64 column blocks of 64 elements (rows of 128 bytes,
/// each block its own swizzled sub-tile), shared memory for Q and two K
/// and two V tiles, and the blocks a multiprocessor the launch bounds ask
/// for: three at D = 64 (73 KiB; ptxas fits both kernels, the pipelined
/// one's S, in-flight P and O included, in 168 registers without spills:
/// at two blocks it took 222), two at D = 128 (81 KiB; 154 and 156
/// registers).
template <int D> struct WgFwd {
  static constexpr int Keys = D == 64 ? 128 : 64;
  static constexpr int TileQ = kWgRows * 2 * D, TileKV = Keys * 2 * D; // bytes
  static constexpr size_t Smem = 1024 + TileQ + 4 * TileKV;
  static constexpr int SerialBlocks = D == 64 ? 3 : 2, PipeBlocks = SerialBlocks;
};

/// Where element chunk c (elements 8 c .. 8 c + 7) of row r lives in a
/// 128-byte swizzled tile of 64-element rows (bytes from the tile start).
__host__ __device__ constexpr int sw128(int r, int c) {
  return (r / 8) * 1024 + (r % 8) * 128 + ((c ^ (r % 8)) << 4);
}

/// The dynamic shared memory rounded up to the next 1024-byte boundary of
/// the shared address space (the swizzle pattern's; WgFwd::Smem and
/// kWgBwdSmem have the room).
__device__ __forceinline__ unsigned char *alignShared1024(unsigned char *p) {
  uint32_t a = mma::sharedAddress(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

/// Rows r0 .. r0 + rows - 1 (64 elements each, from column col of rows of
/// ldRow elements of (b, *)) into a 128-byte swizzled tile by cp.async
/// (wgmmaApplies: every chunk 16-byte aligned); rows past T zero, stored
/// (visible after the caller's barrier, as the copies after their wait).
/// NT: the block's threads.
template <int NT = kThreadsTc, typename T>
__device__ __forceinline__ void loadTileSw(unsigned char *dst, const T *src, const Dims &a,
                                           int64_t b, int64_t r0, int rows, int64_t ldRow,
                                           int64_t col) {
  for (int i = threadIdx.x; i < rows * 8; i += NT) {
    int r = i / 8, c = i % 8;
    unsigned char *d = dst + sw128(r, c);
    int64_t t = r0 + r;
    if (t < a.T)
      mma::cpAsync16(d, src + (b * a.T + t) * ldRow + col + 8 * c);
    else
      *reinterpret_cast<uint4 *>(d) = uint4{0u, 0u, 0u, 0u};
  }
}

/// loadTileSw for rows of D elements (D / 64 column blocks, each a
/// swizzled sub-tile of `rows` rows, block c at c * rows * 128 bytes).
template <int D, int NT = kThreadsTc, typename T>
__device__ __forceinline__ void loadTileD(unsigned char *dst, const T *src, const Dims &a,
                                          int64_t b, int64_t r0, int rows, int64_t ldRow,
                                          int64_t col) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
    loadTileSw<NT>(dst + c * rows * 128, src, a, b, r0, rows, ldRow, col + 64 * c);
}

/// K-major 128-byte swizzled operand (Q or K) at k step kk (columns
/// 16 kk .. 16 kk + 15): eight-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t descKMajor(const unsigned char *tile, int kk) {
  return mma::smemDesc(tile + 32 * kk, 16, 1024, 1);
}
/// ... of a D-wide tile (loadTileD's) of `rows` rows, k step kk of D / 16.
__device__ __forceinline__ uint64_t descKMajorD(const unsigned char *tile, int kk, int rows) {
  return descKMajor(tile + (kk / 4) * rows * 128, kk % 4);
}
/// An M- or N-major operand from a 128-byte swizzled tile of `rows` rows
/// whose rows are its k index (V in P V: k = key, n = dimension) at k step
/// kk (rows 16 kk .. 16 kk + 15): eight-row groups 1024 bytes apart, the
/// next 64 columns (LBO) a sub-tile further (loadTileD's layout).
__device__ __forceinline__ uint64_t descNMajorRows(const unsigned char *tile, int kk, int rows) {
  return mma::smemDesc(tile + 2048 * kk, rows * 128, 1024, 1);
}

/// One key tile's online-softmax step of the wgmma forwards, on the
/// m64nK accumulator s of scores: s[4 j + e] is row w0 + g + 8 (e / 2),
/// key j0 + 8 j + 2 qd + e % 2 (forwardMmaKernel's softmax on the same
/// layout: masks only on tiles that cross the diagonal or the end; m in
/// base 2). Updates the running max m and sum l, gives the factor alpha
/// for the output's rows, and leaves P (f32) in s.
template <int K>
__device__ __forceinline__ void wgSoftmax(float (&s)[K / 2], const Dims &a, int64_t j0,
                                          int64_t t0, int64_t w0, int g, int qd, float sl2,
                                          float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  bool masked = j0 + K > a.T || (a.causal && j0 + K - 1 > t0);
  float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < K / 2; ++i) {
    int64_t key = j0 + 8 * (i / 4) + 2 * qd + (i & 1), r = w0 + g + 8 * (i / 2 % 2);
    if (masked && !(key < a.T && (!a.causal || key <= r)))
      s[i] = -INFINITY;
    tmax[i / 2 % 2] = fmaxf(tmax[i / 2 % 2], s[i]);
  }
  float mUse[2], psum[2] = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mNew = fmaxf(m[e], rowMax4(tmax[e]) * sl2);
    mUse[e] = mNew == -INFINITY ? 0.f : mNew;
    alpha[e] = exp2f(m[e] - mUse[e]);
    m[e] = mNew;
  }
#pragma unroll
  for (int i = 0; i < K / 2; ++i) {
    float p = exp2f(fmaf(s[i], sl2, -mUse[i / 2 % 2]));
    s[i] = p;
    psum[i / 2 % 2] += p;
  }
#pragma unroll
  for (int e = 0; e < 2; ++e)
    l[e] = l[e] * alpha[e] + rowSum4(psum[e]);
}

/// P (wgSoftmax's s) rounded to T as wgmma A fragments: k step kk is keys
/// 16 kk .. + 15, the accumulator n-tiles 2 kk, 2 kk + 1.
template <typename T, int K>
__device__ __forceinline__ void wgPackP(const float (&s)[K / 2], uint32_t (&pa)[K / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      pa[kk][r] = mma::pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

/// The wgmma forwards' end: the thread's rows of O / l (the m64nD
/// accumulator layout) into y, and their log-sum-exp (natural-log units;
/// m is in base 2) into lse.
template <typename T, int D>
__device__ __forceinline__ void wgStoreRows(const float (&o)[D / 2], const float (&m)[2],
                                            const float (&l)[2], const Dims &a, T *y,
                                            float *lse, int64_t b, int64_t h, int64_t w0, int g,
                                            int qd) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    int64_t r = w0 + g + 8 * e;
    float inv = l[e] > 0.f ? 1.f / l[e] : 0.f;
    if (r < a.T) {
      T *out = y + (b * a.T + r) * a.ldy + h * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        out[8 * j + 2 * qd] = cvt<T>(o[4 * j + 2 * e] * inv);
        out[8 * j + 2 * qd + 1] = cvt<T>(o[4 * j + 2 * e + 1] * inv);
      }
      if (lse && qd == 0)
        lse[(b * a.H + h) * a.T + r] = (m[e] + log2f(l[e])) * kLn2;
    }
  }
}

/// What a wgmma forward block owns: the 64 query rows t0 .. of (b, h)
/// (the longest causal rows first), the thread's first row w0 (warp w:
/// rows 16 w ..) and accumulator coordinates g, qd, the kv head, and the
/// key tiles of `keys` rows it visits.
struct WgQueryBlock {
  int64_t t0, w0, h, b, kvh, nTiles;
  int g, qd;
  __device__ WgQueryBlock(const Dims &a, int keys) {
    const int64_t qTiles = (a.T + kWgRows - 1) / kWgRows;
    int64_t qt = qTiles - 1 - (int64_t)(blockIdx.x % qTiles);
    h = (blockIdx.x / qTiles) % a.H;
    b = blockIdx.x / (qTiles * a.H);
    kvh = h / (a.H / a.KV);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    g = lane / 4;
    qd = lane % 4;
    t0 = qt * kWgRows;
    w0 = t0 + warp * 16;
    int64_t kEnd = a.causal && t0 + kWgRows < a.T ? t0 + kWgRows : a.T;
    nTiles = (kEnd + keys - 1) / keys;
  }
};

/// The wgmma forward without the overlap (Impl::WgmmaSerial): each
/// product waited for before the softmax or the next tile that follows.
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsTc, WgFwd<D>::SerialBlocks)
    forwardWgmmaKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
#if defined(FSDP_CUDAEMU_MMA) || !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = WgFwd<D>;
  constexpr int K = G::Keys;
  extern __shared__ __align__(128) unsigned char smTc[];
  unsigned char *Qs = alignShared1024(smTc), *KV = Qs + G::TileQ;
  const float sl2 = a.scale * kLog2e;
  const WgQueryBlock qb(a, K);
  const int64_t t0 = qb.t0, w0 = qb.w0, h = qb.h, b = qb.b, kvh = qb.kvh, nTiles = qb.nTiles;
  const int g = qb.g, qd = qb.qd;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  auto issue = [&](int64_t it) {
    unsigned char *Kb = KV + (it % 2) * 2 * G::TileKV;
    loadTileD<D>(Kb, k, a, b, it * K, K, a.ldkv, kvh * D);
    loadTileD<D>(Kb + G::TileKV, v, a, b, it * K, K, a.ldkv, kvh * D);
    mma::cpAsyncCommit();
  };
  loadTileD<D>(Qs, q, a, b, t0, kWgRows, a.ldq, h * D);
  issue(0); // one group: Q and the first K, V
  for (int64_t it = 0; it < nTiles; ++it) {
    if (it + 1 < nTiles) {
      issue(it + 1); // into the buffer iteration it - 1 read (its barrier passed)
      mma::cpAsyncWait<1>();
    } else {
      mma::cpAsyncWait<0>();
    }
    mma::fenceProxyAsync(); // this thread's copies and stores, before wgmma reads them
    __syncthreads();        // tile it (every thread's) is in shared memory
    const unsigned char *Ks = KV + (it % 2) * 2 * G::TileKV, *Vs = Ks + G::TileKV;
    float s[K / 2];
    mma::wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      mma::Wgmma<T, K>::template ss<0, 0>(s, descKMajorD(Qs, kk, kWgRows),
                                          descKMajorD(Ks, kk, K), kk > 0);
    mma::wgmmaCommit();
    mma::wgmmaWait<0>();
    mma::fenceRegs(s);
    float alpha[2];
    uint32_t pa[K / 16][4];
    wgSoftmax<K>(s, a, it * K, t0, w0, g, qd, sl2, m, l, alpha);
    wgPackP<T, K>(s, pa);
#pragma unroll
    for (int i = 0; i < D / 2; ++i)
      o[i] *= alpha[i / 2 % 2];
    mma::fenceRegs(o);
    mma::wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
      mma::Wgmma<T, D>::template rs<1>(o, pa[kk], descNMajorRows(Vs, kk, K), 1);
    mma::wgmmaCommit();
    mma::wgmmaWait<0>();
    mma::fenceRegs(o);
    __syncthreads(); // buffer it % 2 is free for tile it + 2
  }
  wgStoreRows<T, D>(o, m, l, a, y, lse, b, h, w0, g, qd);
#else
  __trap(); // wgmma needs sm_90a
#endif
}

/// The wgmma forward with FlashAttention-3's intra-warpgroup overlap
/// (Impl::Wgmma, WgmmaFused, WgmmaFused64; forwardWgmmaKernel, without
/// it, is Impl::WgmmaSerial's): iteration it issues S = Q K_it^T and
/// then O += P_{it-1} V_{it-1} as two wgmma groups, waits for the first
/// only, and runs tile it's softmax on the multiprocessor's other units
/// while the tensor cores compute the second; O is rescaled by tile it's
/// alpha after that wait (O then holds the tiles before it, in the
/// previous max's units). The products, softmax and roundings are
/// forwardWgmmaKernel's, in the same order: the two give the same bits.
/// K and V have rings of their own (two tiles each, the same memory):
/// the top of iteration it copies K_{it+1} (over K_{it-1}, whose product
/// iteration it - 1 waited for) and V_it (over V_{it-2}), one group that
/// iteration it + 1 waits for.
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsTc, WgFwd<D>::PipeBlocks)
    forwardWgmmaPipeKernel(Dims a, const T *q, const T *k, const T *v, T *y, float *lse) {
#if defined(FSDP_CUDAEMU_MMA) || !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = WgFwd<D>;
  constexpr int K = G::Keys;
  extern __shared__ __align__(128) unsigned char smTc[];
  unsigned char *Qs = alignShared1024(smTc), *KV = Qs + G::TileQ;
  const float sl2 = a.scale * kLog2e;
  const WgQueryBlock qb(a, K);
  const int64_t t0 = qb.t0, w0 = qb.w0, h = qb.h, b = qb.b, kvh = qb.kvh, nTiles = qb.nTiles;
  const int g = qb.g, qd = qb.qd;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  auto kBuf = [&](int64_t it) { return KV + (it % 2) * G::TileKV; };
  auto vBuf = [&](int64_t it) { return KV + (2 + it % 2) * G::TileKV; };
  loadTileD<D>(Qs, q, a, b, t0, kWgRows, a.ldq, h * D);
  loadTileD<D>(kBuf(0), k, a, b, 0, K, a.ldkv, kvh * D);
  mma::cpAsyncCommit();
  // The top of iteration it: K_it and V_{it-1} are in shared memory
  // (every thread's copies; every product of iteration it - 1 done), and
  // K_{it+1} and V_it are on their way.
  auto top = [&](int64_t it) {
    mma::cpAsyncWait<0>();
    mma::fenceProxyAsync(); // this thread's copies and stores, before wgmma reads them
    __syncthreads();
    if (it + 1 < nTiles)
      loadTileD<D>(kBuf(it + 1), k, a, b, (it + 1) * K, K, a.ldkv, kvh * D);
    if (it < nTiles)
      loadTileD<D>(vBuf(it), v, a, b, it * K, K, a.ldkv, kvh * D);
    mma::cpAsyncCommit();
  };
  auto scores = [&](float(&s)[K / 2], int64_t it) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      mma::Wgmma<T, K>::template ss<0, 0>(s, descKMajorD(Qs, kk, kWgRows),
                                          descKMajorD(kBuf(it), kk, K), kk > 0);
    mma::wgmmaCommit();
  };
  auto pv = [&](const uint32_t(&p)[K / 16][4], int64_t it) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
      mma::Wgmma<T, D>::template rs<1>(o, p[kk], descNMajorRows(vBuf(it), kk, K), 1);
    mma::wgmmaCommit();
  };
  // Tile 0: S, its softmax (O is zero: no rescale).
  uint32_t pa[K / 16][4]; // P of tile it - 1 (A fragments)
  float alpha[2];
  {
    top(0);
    float s[K / 2];
    mma::wgmmaFence();
    scores(s, 0);
    mma::wgmmaWait<0>();
    mma::fenceRegs(s);
    wgSoftmax<K>(s, a, 0, t0, w0, g, qd, sl2, m, l, alpha);
    wgPackP<T, K>(s, pa);
  }
  // Tiles 1 .. nTiles - 1: S_it and P_{it-1} V_{it-1} in flight, then
  // tile it's softmax while the second runs.
  for (int64_t it = 1; it < nTiles; ++it) {
    top(it);
    float s[K / 2];
    mma::fenceRegs(o);
    mma::wgmmaFence();
    scores(s, it);
    pv(pa, it - 1);
    mma::wgmmaWait<1>(); // S only
    mma::fenceRegs(s);
    wgSoftmax<K>(s, a, it * K, t0, w0, g, qd, sl2, m, l, alpha);
    mma::wgmmaWait<0>();
    mma::fenceRegs(o);
#pragma unroll
    for (int i = 0; i < D / 2; ++i)
      o[i] *= alpha[i / 2 % 2];
    // P_it into the A fragments only now: they are the finished
    // product's inputs (ptxas serializes wgmma whose input registers are
    // written while it may still run).
    wgPackP<T, K>(s, pa);
  }
  // The last tile's P V.
  top(nTiles);
  mma::fenceRegs(o);
  mma::wgmmaFence();
  pv(pa, nTiles - 1);
  mma::wgmmaWait<0>();
  mma::fenceRegs(o);
  wgStoreRows<T, D>(o, m, l, a, y, lse, b, h, w0, g, qd);
#else
  __trap(); // wgmma needs sm_90a
#endif
}

/// The head dimensions of the wgmma kernels.
bool wgmmaDim(int64_t D) { return D == 64 || D == 128; }

/// The wgmma kernels apply at D = 64 or 128 with q, k, v 16-byte aligned
/// and their row strides multiples of 8 elements (cp.async's whole
/// chunks).
bool wgmmaApplies(const Dims &a, const void *q, const void *k, const void *v) {
  return wgmmaDim(a.D) && a.ldq % 8 == 0 && a.ldkv % 8 == 0 &&
         ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) |
           reinterpret_cast<uintptr_t>(v)) &
          15) == 0;
}

/// The wgmma forward where wgmmaApplies: pipelined (Impl::Wgmma,
/// WgmmaFused, WgmmaFused64) or not (WgmmaSerial).
template <typename T, int D>
cudaError_t forwardWgmmaD(const void *q, const void *k, const void *v, void *y, float *lse,
                          const Dims &a, bool pipe, cudaStream_t s) {
  return launchForward<T>(pipe ? forwardWgmmaPipeKernel<T, D> : forwardWgmmaKernel<T, D>,
                          WgFwd<D>::Smem, kThreadsTc, kWgRows, q, k, v, y, lse, a, s);
}
template <typename T>
cudaError_t forwardWgmma(const void *q, const void *k, const void *v, void *y, float *lse,
                         const Dims &a, bool pipe, cudaStream_t s) {
  return a.D == 64 ? forwardWgmmaD<T, 64>(q, k, v, y, lse, a, pipe, s)
                   : forwardWgmmaD<T, 128>(q, k, v, y, lse, a, pipe, s);
}

/// wgmmaProduct's kernel: the operands laid out as the descriptors say,
/// one product, d stored row-major.
template <typename T, int N>
__global__ void __launch_bounds__(kThreadsTc)
    wgmmaProductKernel(const T *a, const T *b, float *d, int swizzle, int aMode, bool bMn) {
#if defined(FSDP_CUDAEMU_MMA) || !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smTc[];
  unsigned char *As = alignShared1024(smTc), *Bs = As + 64 * 256;
  // Layout parameters (bytes): W the swizzle width (0 none).
  const int W = swizzle == 1 ? 128 : swizzle == 2 ? 64 : swizzle == 3 ? 32 : 0;
  auto swz = [&](int off) {
    return W == 128 ? off ^ ((off >> 7 & 7) << 4)
           : W == 64 ? off ^ ((off >> 7 & 3) << 4)
           : W == 32 ? off ^ ((off >> 7 & 1) << 4)
                     : off;
  };
  // The canonical layouts (CudaMma.cuh, smemDesc) of a 16-deep operand
  // with `rows` M / N rows. K-major: none: core matrices of 8 rows x 16
  // bytes, the two k halves LBO = 128 apart, eight-row groups SBO = 256
  // apart; W-byte: rows W apart (the first 32 bytes used), groups SBO =
  // 8 W apart. MN-major: none: core matrices of 8 k rows x 8 mn (16
  // bytes), mn groups SBO = 128 apart, k halves LBO = 16 rows apart;
  // W-byte: k rows of W / 2 mn, W apart, k groups SBO = 8 W apart, mn
  // blocks LBO = 16 W apart.
  struct Lay {
    uint32_t lbo, sbo;
  };
  auto lay = [&](bool mnMajor, int rows) {
    return !mnMajor ? Lay{128u, W ? 8u * W : 256u}
                    : Lay{W ? 16u * W : 16u * rows, W ? 8u * W : 128u};
  };
  auto byteOf = [&](bool mnMajor, Lay l, int mn, int kk) {
    int off;
    if (!mnMajor)
      off = W ? (mn % 8) * W + (mn / 8) * l.sbo + 2 * kk
              : (mn % 8) * 16 + (mn / 8) * l.sbo + (kk % 8) * 2 + (kk / 8) * l.lbo;
    else
      off = W ? (mn % (W / 2)) * 2 + (mn / (W / 2)) * l.lbo + (kk % 8) * W + (kk / 8) * l.sbo
              : (mn % 8) * 2 + (mn / 8) * l.sbo + (kk % 8) * 16 + (kk / 8) * l.lbo;
    return swz(off);
  };
  // A: 64 x 16, K-major (aMode 0) or M-major (1); 2: registers.
  const Lay la = lay(aMode == 1, 64);
  // B: 16 x N. N = 32 N-major with 128-byte swizzling (rows of 64): the
  // columns 32 .. 63 of a 64-wide tile, its first 32 columns poison, the
  // descriptor 64 bytes into it (the backward's dq reads K so).
  const bool upper = N == 32 && bMn && W == 128;
  const Lay lb = lay(bMn, upper ? 64 : N);
  for (int i = threadIdx.x; i < 64 * 16; i += kThreadsTc)
    memcpy(As + byteOf(aMode == 1, la, i / 16, i % 16), a + i, sizeof(T));
  if (upper) {
    T poison = cvt<T>(1.0e4f);
    for (int i = threadIdx.x; i < 16 * 32; i += kThreadsTc)
      memcpy(Bs + byteOf(true, lb, i % 32, i / 32), &poison, sizeof(T));
  }
  for (int i = threadIdx.x; i < 16 * N; i += kThreadsTc)
    memcpy(Bs + byteOf(bMn, lb, i % N + (upper ? 32 : 0), i / N), b + i, sizeof(T));
  mma::fenceProxyAsync();
  __syncthreads();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i)
    acc[i] = 0.f;
  uint64_t db = mma::smemDesc(Bs + (upper ? 64 : 0), lb.lbo, lb.sbo, swizzle);
  mma::wgmmaFence();
  if (aMode == 2) {
    // mma.sync's A layout for the warp's rows 16 w .. 16 w + 15.
    uint32_t af[4];
    const T *rowLo = a + (16 * warp + g) * 16, *rowHi = rowLo + 8 * 16;
    auto pack = [](T lo, T hi) {
      uint16_t h[2];
      memcpy(&h[0], &lo, 2);
      memcpy(&h[1], &hi, 2);
      return (uint32_t)h[0] | (uint32_t)h[1] << 16;
    };
    af[0] = pack(rowLo[2 * qd], rowLo[2 * qd + 1]);
    af[1] = pack(rowHi[2 * qd], rowHi[2 * qd + 1]);
    af[2] = pack(rowLo[2 * qd + 8], rowLo[2 * qd + 9]);
    af[3] = pack(rowHi[2 * qd + 8], rowHi[2 * qd + 9]);
    if (bMn)
      mma::Wgmma<T, N>::template rs<1>(acc, af, db, 0);
    else
      mma::Wgmma<T, N>::template rs<0>(acc, af, db, 0);
  } else {
    uint64_t da = mma::smemDesc(As, la.lbo, la.sbo, swizzle);
    if (aMode == 1)
      bMn ? mma::Wgmma<T, N>::template ss<1, 1>(acc, da, db, 0)
          : mma::Wgmma<T, N>::template ss<1, 0>(acc, da, db, 0);
    else
      bMn ? mma::Wgmma<T, N>::template ss<0, 1>(acc, da, db, 0)
          : mma::Wgmma<T, N>::template ss<0, 0>(acc, da, db, 0);
  }
  mma::wgmmaCommit();
  mma::wgmmaWait<0>();
  mma::fenceRegs(acc);
#pragma unroll
  for (int i = 0; i < N / 2; ++i)
    d[(16 * warp + g + 8 * (i / 2 % 2)) * N + 8 * (i / 4) + 2 * qd + i % 2] = acc[i];
#else
  __trap(); // wgmma needs sm_90a
#endif
}

// The wgmma backwards' common pieces (bwdWgmmaKernel, bwdWgmmaPipeKernel;
// wgBwdMasked, wgBwdKeep, wgBwdP and wgBwdDS are bwdWgmmaPipeKernel's
// only: bwdWgmmaKernel writes the same arithmetic out, which ptxas fits
// at D = 128 without spilling).
// A thread's share of an m64n64 S^T or dP^T accumulator: element i is key
// row w0 + g + 8 (i / 2 % 2), query t0 + 8 (i / 4) + 2 qd + i % 2.

/// Whether the step's key block (keys from j0) and query tile (from t0)
/// need the mask (they cross the diagonal or the end).
__device__ __forceinline__ bool wgBwdMasked(const Dims &a, int64_t j0, int keys, int64_t t0) {
  return j0 + keys > a.T || t0 + kTile > a.T || (a.causal && j0 + keys - 1 > t0);
}
/// Whether element i counts (inside T and, causal, on or below the
/// diagonal).
__device__ __forceinline__ bool wgBwdKeep(const Dims &a, bool masked, int64_t t0, int64_t w0,
                                          int g, int qd, int i) {
  int64_t tt = t0 + 8 * (i / 4) + 2 * qd + (i & 1), jj = w0 + g + 8 * (i / 2 % 2);
  return !masked || (jj < a.T && tt < a.T && (!a.causal || jj <= tt));
}

/// S^T = K Q^T (or dP^T = V dY^T) as one wgmma group: m64n64k16 x D / 16,
/// A the warpgroup's 64 rows of a `rows`-row key tile, B a query tile of
/// 64, both K-major (loadTileD's layout).
template <typename T, int D>
__device__ __forceinline__ void wgIssueScoresT(float (&acc)[32], const unsigned char *keys,
                                               int rows, const unsigned char *qry) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    mma::Wgmma<T, 64>::template ss<0, 0>(acc, descKMajorD(keys, kk, rows),
                                         descKMajorD(qry, kk, 64), kk > 0);
  mma::wgmmaCommit();
}

/// P^T = exp2(S^T scale log2 e - lse log2 e) where ok allows, else 0
/// (lq: the query tile's lse in base 2).
template <typename Ok>
__device__ __forceinline__ void wgBwdP(float (&st)[32], const Ok &ok, const float *lq, int qd,
                                       float sl2) {
#pragma unroll
  for (int i = 0; i < 32; ++i)
    st[i] = ok(i) ? exp2f(fmaf(st[i], sl2, -lq[8 * (i / 4) + 2 * qd + (i & 1)])) : 0.f;
}

/// dS^T = P^T (dP^T - delta) where ok allows, else 0 (dl: the query
/// tile's delta).
template <typename Ok>
__device__ __forceinline__ void wgBwdDS(float (&dpt)[32], const float (&pt)[32], const Ok &ok,
                                        const float *dl, int qd) {
#pragma unroll
  for (int i = 0; i < 32; ++i)
    dpt[i] = ok(i) ? pt[i] * (dpt[i] - dl[8 * (i / 4) + 2 * qd + (i & 1)]) : 0.f;
}

/// A thread's P^T or dS^T fragments (wgPackP's: key rows r0 + g and
/// r0 + g + 8) into a key-major 128-byte swizzled tile, pairs of query
/// columns.
template <typename T>
__device__ __forceinline__ void wgStoreKeyMajor(unsigned char *tile, const uint32_t (&f)[4][4],
                                                int r0, int g, int qd) {
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    int c = 8 * (i / 4) + 2 * qd, r = r0 + g + 8 * (i / 2 % 2);
    store2(reinterpret_cast<T *>(tile + sw128(r, c / 8) + 2 * (c % 8)), f[i / 8][i % 8 / 2]);
  }
}

/// A dq product's m64nN accumulator (element 4 j + e: the tile's query row
/// 16 warp + g + 8 (e / 2), column 8 j + 2 qd + e % 2) into f32 partial
/// rows of D floats; dst is the thread's first row and column.
template <int N, int D>
__device__ __forceinline__ void wgStoreDq(float *dst, const float (&dqa)[N / 2]) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    float *p = dst + 8 * j;
    *reinterpret_cast<float2 *>(p) = float2{dqa[4 * j], dqa[4 * j + 1]};
    *reinterpret_cast<float2 *>(p + 8 * D) = float2{dqa[4 * j + 2], dqa[4 * j + 3]};
  }
}

/// The end of a wgmma backward: the thread's key rows w0 + g, w0 + g + 8
/// of dK (times the scale) and dV (the m64nD accumulator layout).
template <typename T, int D>
__device__ __forceinline__ void wgStoreKV(const float (&accK)[D / 2], const float (&accV)[D / 2],
                                          const Dims &a, int64_t b, int64_t kvh, int64_t w0,
                                          int g, int qd, T *dk, T *dv) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    int64_t r = w0 + g + 8 * e;
    if (r < a.T) {
      T *ok = dk + (b * a.T + r) * a.ldkv + kvh * D, *ov = dv + (b * a.T + r) * a.ldkv + kvh * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        ok[8 * j + 2 * qd] = cvt<T>(accK[4 * j + 2 * e] * a.scale);
        ok[8 * j + 2 * qd + 1] = cvt<T>(accK[4 * j + 2 * e + 1] * a.scale);
        ov[8 * j + 2 * qd] = cvt<T>(accV[4 * j + 2 * e]);
        ov[8 * j + 2 * qd + 1] = cvt<T>(accV[4 * j + 2 * e + 1]);
      }
    }
  }
}

/// A wgmma backward block's coordinates: key block kt of `keys` (64 a
/// warpgroup) rows from j0 of (b, kv head kvh), the thread's warpgroup,
/// warp and lane parts, its first key row w0; the query tiles it visits
/// (from q0, perHead a head, steps in all) and where its dq partials go
/// (partBase, partHead a head; layout m).
struct WgKeyBlock {
  int64_t kvh, b, j0, w0, q0, perHead, steps, partHead, partBase;
  int wg, warp, g, qd;
  __device__ WgKeyBlock(const Dims &a, int64_t g0, int64_t pairs, int keys, int m) {
    int64_t kt = (int64_t)blockIdx.x / pairs, pair = g0 + (int64_t)blockIdx.x % pairs;
    kvh = pair % a.KV;
    b = pair / a.KV;
    wg = threadIdx.x / 128;
    warp = threadIdx.x % 128 / 32;
    int lane = threadIdx.x % 32;
    g = lane / 4;
    qd = lane % 4;
    j0 = kt * keys;
    w0 = j0 + 64 * wg + 16 * warp;
    int64_t group = a.H / a.KV, bh0 = g0 * group;
    q0 = a.causal ? j0 / kTile : 0;
    perHead = a.tiles - q0;
    steps = group * perHead;
    partHead = partRows(a, m);
    partBase = (b * a.H + kvh * group - bh0) * partHead + partRowsBefore(a, m, kt);
  }
};

/// Step it's query tile for a wgmma backward block (NT threads): Q and dY
/// (one cp.async group) into Qb and Qb + tileBytes, lse (base 2) and
/// delta into Lb and Lb + 64.
template <int D, int NT, typename T>
__device__ __forceinline__ void wgBwdLoadStep(unsigned char *Qb, int tileBytes, float *Lb,
                                              const T *q, const T *dy, const float *lse,
                                              const float *delta, const Dims &a,
                                              const WgKeyBlock &kb, int64_t it) {
  int64_t h = kb.kvh * (a.H / a.KV) + it / kb.perHead, t0 = (kb.q0 + it % kb.perHead) * kTile;
  loadTileD<D, NT>(Qb, q, a, kb.b, t0, 64, a.ldq, h * D);
  loadTileD<D, NT>(Qb + tileBytes, dy, a, kb.b, t0, 64, a.ldy, h * D);
  mma::cpAsyncCommit();
  for (int i = threadIdx.x; i < 64; i += NT) {
    int64_t t = t0 + i, sr = (kb.b * a.H + h) * a.T + t;
    Lb[i] = t < a.T ? lse[sr] * kLog2e : 0.f;
    Lb[64 + i] = t < a.T ? delta[sr] : 0.f;
  }
}

template <int WG> constexpr int kWgBwdThreads = WG * kThreadsTc;
template <int WG, int D>
constexpr size_t kWgBwdSmem = 1024 + 2 * (64 * WG) * 2 * D + (64 * WG) * 128 +
                              4 * 64 * 2 * D + 4 * 64 * 4;

/// The one-pass backward on wgmma (Impl::WgmmaFusedSerial at D = 64,
/// bwdWgmmaPipeKernel's reference; every wgmma-fused one at D = 128
/// below), MmaFused's scheme on warpgroups: a block of two warpgroups per (b, kv head, block
/// of 128 keys), warpgroup wg owning keys 64 wg .. 64 wg + 63 (the
/// partial layout, key-block order and dqReduceKernel of MmaFused with
/// key blocks of 128). For each query head of the group and each query
/// tile of 64 that sees the block, in order:
///   S^T = K Q^T and dP^T = V dY^T: m64n64k16 x 4 each, K / V (A) and
///     Q / dY (B) K-major from shared memory;
///   P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - delta) in registers
///     (the accumulator layout: key rows, query columns); S^T and dP^T
///     are two wgmma groups, and P^T's exponentials run while the tensor
///     cores compute dP^T;
///   dV += P^T dY and dK += dS^T Q: m64n64k16 x 4 each, P^T / dS^T
///     rounded to the storage type as A fragments from registers, dY / Q
///     N-major from shared memory;
///   dS^T (rounded) into a 128-byte swizzled shared tile, key rows; after
///     a barrier, the tile's dq partial dS K: m64n32k16 x 8 per warpgroup,
///     warpgroup wg taking dimensions 32 wg .. 32 wg + 31, A = dS read
///     M-major from the key-major tile (no transpose), B = K N-major;
///     stored as f32 partials as MmaFused's.
/// Shared memory: K, V and dS^T 16 KiB each, Q and dY twice 32 KiB, lse
/// and delta twice 1 KiB, 82 KiB with the alignment: one block (eight
/// warps) a multiprocessor, as the registers (four 64 x 64 f32
/// accumulators a thread's share: 200 registers) allow.
/// WG = 1 (Impl::WgmmaFused64Serial): one warpgroup per key block of 64,
/// MmaFused64's partials, its dq products m64n64k16 x 4; 58 KiB, two
/// blocks (of four warps each, not in lockstep) a multiprocessor as the
/// registers allow.
/// D = 128 (WG = 1 only: MmaFused's and MmaFused64's partials are both
/// key blocks of 64 there): K and V rows of two 64-element column blocks
/// (loadTileD's sub-tiles), S^T and dP^T over 8 k steps, dV and dK
/// m64n128k16, dq in two m64n64 halves (one per column block of K), each
/// waited for and stored before the next; K, V 16 KiB, dS^T 8 KiB, Q
/// and dY twice 64 KiB: 106 KiB, two blocks a multiprocessor.
template <typename T, int WG, int D>
__global__ void __launch_bounds__(kWgBwdThreads<WG>, WG == 2 ? 1 : 2)
    bwdWgmmaKernel(Dims a, int64_t g0, int64_t pairs, const T *q, const T *k, const T *v,
                   const T *dy, const float *lse, const float *delta, T *dk, T *dv,
                   float *dqPart) {
#if defined(FSDP_CUDAEMU_MMA) || !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smTc[];
  // KR key rows a block; m: MmaFused's (WG = 2) or MmaFused64's (WG = 1)
  // partial layout; NQ dq dimensions a warpgroup, NH of them a dq
  // product; NT threads.
  static_assert(D == 64 || (D == 128 && WG == 1));
  constexpr int KR = 64 * WG, m = WG, NQ = D / WG, NH = NQ < 64 ? NQ : 64,
                NT = kWgBwdThreads<WG>;
  constexpr int kTileKey = KR * 2 * D, kTileDS = KR * 128, kWgTileQry = 64 * 2 * D; // bytes
  unsigned char *Ks = alignShared1024(smTc), *Vs = Ks + kTileKey, *DS = Vs + kTileKey,
                *QD = DS + kTileDS;
  float *LD = reinterpret_cast<float *>(QD + 4 * kWgTileQry);
  const float sl2 = a.scale * kLog2e;
  const WgKeyBlock kb(a, g0, pairs, KR, m);
  const int64_t kvh = kb.kvh, b = kb.b, j0 = kb.j0, w0 = kb.w0, q0 = kb.q0,
                perHead = kb.perHead, steps = kb.steps, partHead = kb.partHead,
                partBase = kb.partBase;
  const int wg = kb.wg, warp = kb.warp, g = kb.g, qd = kb.qd;
  float accK[D / 2], accV[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    accK[i] = accV[i] = 0.f;
  auto issue = [&](int64_t it) {
    wgBwdLoadStep<D, NT>(QD + (it % 2) * 2 * kWgTileQry, kWgTileQry, LD + (it % 2) * 2 * 64, q,
                         dy, lse, delta, a, kb, it);
  };
  loadTileD<D, NT>(Ks, k, a, b, j0, KR, a.ldkv, kvh * D);
  loadTileD<D, NT>(Vs, v, a, b, j0, KR, a.ldkv, kvh * D);
  issue(0); // one group: K, V and the first Q, dY
  const unsigned char *Kw = Ks + wg * 64 * 128, *Vw = Vs + wg * 64 * 128; // the warpgroup's keys
  for (int64_t it = 0; it < steps; ++it) {
    if (it + 1 < steps) {
      issue(it + 1);
      mma::cpAsyncWait<1>();
    } else {
      mma::cpAsyncWait<0>();
    }
    mma::fenceProxyAsync();
    __syncthreads(); // step it's tiles are in shared memory
    int64_t t0 = (q0 + it % perHead) * kTile;
    const unsigned char *Qs = QD + (it % 2) * 2 * kWgTileQry, *DYs = Qs + kWgTileQry;
    const float *Lq = LD + (it % 2) * 2 * 64, *Dq = Lq + 64;
    float st[32], dpt[32];
    mma::wgmmaFence();
    wgIssueScoresT<T, D>(st, Kw, KR, Qs);
    wgIssueScoresT<T, D>(dpt, Vw, KR, DYs);
    // The mask, P^T and dS^T written out here, not through wgBwdMasked,
    // wgBwdKeep, wgBwdP and wgBwdDS as bwdWgmmaPipeKernel's: the same
    // arithmetic, but through the helpers ptxas took 255 registers and
    // spilled at D = 128 (240 and none like this).
    bool masked = j0 + KR > a.T || t0 + kTile > a.T || (a.causal && j0 + KR - 1 > t0);
    auto ok = [&](int i) {
      int64_t tt = t0 + 8 * (i / 4) + 2 * qd + (i & 1), jj = w0 + g + 8 * (i / 2 % 2);
      return !masked || (jj < a.T && tt < a.T && (!a.causal || jj <= tt));
    };
    // P^T while the tensor cores compute dP^T (the second group).
    mma::wgmmaWait<1>();
    mma::fenceRegs(st);
#pragma unroll
    for (int i = 0; i < 32; ++i)
      st[i] = ok(i) ? exp2f(fmaf(st[i], sl2, -Lq[8 * (i / 4) + 2 * qd + (i & 1)])) : 0.f;
    mma::wgmmaWait<0>();
    mma::fenceRegs(dpt);
#pragma unroll
    for (int i = 0; i < 32; ++i)
      dpt[i] = ok(i) ? st[i] * (dpt[i] - Dq[8 * (i / 4) + 2 * qd + (i & 1)]) : 0.f;
    uint32_t pa[4][4], sa[4][4];
    wgPackP<T, 64>(st, pa);
    wgPackP<T, 64>(dpt, sa);
    // dS^T, rounded, into the key-major tile (pairs of query columns).
    wgStoreKeyMajor<T>(DS, sa, 64 * wg + 16 * warp, g, qd);
    mma::fenceRegs(accV);
    mma::fenceRegs(accK);
    mma::wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      mma::Wgmma<T, D>::template rs<1>(accV, pa[kk], descNMajorRows(DYs, kk, 64), 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      mma::Wgmma<T, D>::template rs<1>(accK, sa[kk], descNMajorRows(Qs, kk, 64), 1);
    mma::wgmmaCommit();
    mma::fenceProxyAsync(); // this thread's dS^T stores, before the dq wgmma reads them
    __syncthreads();        // every warpgroup's dS^T is in DS
    // dq partial (64 queries x dimensions NQ wg ..), NH dimensions a
    // product: A = dS, M-major (the key-major tile read with its query
    // columns as rows), B = K N-major: at D = 64 from dimension 32 wg (64
    // bytes into each 128-byte row), at D = 128 column block c.
    float *dst = dqPart + (partBase + (it / perHead) * partHead + (it % perHead) * kTile +
                           16 * warp + g) *
                              D +
                 NQ * wg + 2 * qd;
#pragma unroll
    for (int c = 0; c < NQ / NH; ++c) {
      float dqa[NH / 2];
      mma::wgmmaFence();
#pragma unroll
      for (int kk = 0; kk < KR / 16; ++kk)
        mma::Wgmma<T, NH>::template ss<1, 1>(
            dqa, descNMajorRows(DS, kk, 64),
            descNMajorRows(Ks + (WG == 2 ? 2 * NQ * wg : c * KR * 128), kk, KR), kk > 0);
      mma::wgmmaCommit();
      mma::wgmmaWait<0>();
      mma::fenceRegs(accV);
      mma::fenceRegs(accK);
      mma::fenceRegs(dqa);
      wgStoreDq<NH, D>(dst + NH * c, dqa);
    }
    __syncthreads(); // buffer it % 2 and DS are free for step it + 1
  }
  wgStoreKV<T, D>(accK, accV, a, b, kvh, w0, g, qd, dk, dv);
#else
  __trap(); // wgmma needs sm_90a
#endif
}

/// bwdWgmmaKernel at D = 64 pipelined across steps (Impl::WgmmaFused and
/// WgmmaFused64 at D = 64; the same products, sums and order, so the same
/// bits): while step it's dV, dK and dq run on the tensor cores, the
/// warpgroup computes step it + 1's P^T. Iteration it issues four groups,
///   S^T(it + 1), then dV += P^T(it) dY(it) and dK += dS^T(it) Q(it),
///   then dq(it) = dS(it) K, then dP^T(it + 1),
/// waits for the first (wgmma.wait_group 3) and runs P^T(it + 1)'s
/// exponentials while the other three compute, waits for dV, dK and dq
/// (wait_group 1) and stores dq's partial while dP^T runs, then forms
/// dS^T(it + 1). P^T and dS^T go to shared memory (key-major tiles, two
/// of each, alternating by step) and dV / dK read their A from there, not
/// from registers: the registers hold S^T, dP^T, the dK and dV
/// accumulators and dq's, not also two steps' A fragments. Q and dY are
/// three buffers (step it's read by dV and dK, step it + 1's by S^T and
/// dP^T, step it + 2's arriving), so one barrier an iteration covers
/// every reuse. Shared memory: K, V 16 KiB, P^T and dS^T twice 16 KiB, Q
/// and dY three times 16 KiB, lse and delta three times 512 B: 147 KiB,
/// one block a multiprocessor (WG = 2); WG = 1 99 KiB, two. ptxas: 202
/// registers (WG = 2) and 213 (WG = 1), no spills, no wgmma serialized;
/// the last step is peeled off the loop so that every wgmma in it is
/// unconditional (with the step's products behind an `if`, ptxas
/// serialized them, C7515).
template <int WG>
constexpr size_t kWgBwdPipeSmem = 1024 + 2 * (64 * WG) * 128 + 4 * (64 * WG) * 128 +
                                  6 * 64 * 128 + 6 * 64 * 4;

template <typename T, int WG>
__global__ void __launch_bounds__(kWgBwdThreads<WG>, WG == 2 ? 1 : 2)
    bwdWgmmaPipeKernel(Dims a, int64_t g0, int64_t pairs, const T *q, const T *k, const T *v,
                       const T *dy, const float *lse, const float *delta, T *dk, T *dv,
                       float *dqPart) {
#if defined(FSDP_CUDAEMU_MMA) || !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smTc[];
  constexpr int D = 64, KR = 64 * WG, m = WG, NQ = D / WG, NT = kWgBwdThreads<WG>;
  constexpr int kTileKey = KR * 128, kWgTileQry = 64 * 128; // bytes
  unsigned char *Ks = alignShared1024(smTc), *Vs = Ks + kTileKey, *PT = Vs + kTileKey,
                *DS = PT + 2 * kTileKey, *QD = DS + 2 * kTileKey;
  float *LD = reinterpret_cast<float *>(QD + 6 * kWgTileQry);
  const float sl2 = a.scale * kLog2e;
  const WgKeyBlock kb(a, g0, pairs, KR, m);
  const int64_t kvh = kb.kvh, b = kb.b, j0 = kb.j0, w0 = kb.w0, q0 = kb.q0,
                perHead = kb.perHead, steps = kb.steps, partHead = kb.partHead,
                partBase = kb.partBase;
  const int wg = kb.wg, warp = kb.warp, g = kb.g, qd = kb.qd;
  float accK[D / 2], accV[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    accK[i] = accV[i] = 0.f;
  auto qTile = [&](int64_t it) { return QD + (it % 3) * 2 * kWgTileQry; };
  auto lTile = [&](int64_t it) { return LD + (it % 3) * 2 * 64; };
  auto issue = [&](int64_t it) {
    wgBwdLoadStep<D, NT>(qTile(it), kWgTileQry, lTile(it), q, dy, lse, delta, a, kb, it);
  };
  // P^T (from st) and dS^T (from dpt), rounded, into tiles `buf`.
  auto stash = [&](const float (&st)[32], const float (&dpt)[32], int buf) {
    uint32_t f[4][4];
    wgPackP<T, 64>(st, f);
    wgStoreKeyMajor<T>(PT + buf * kTileKey, f, 64 * wg + 16 * warp, g, qd);
    wgPackP<T, 64>(dpt, f);
    wgStoreKeyMajor<T>(DS + buf * kTileKey, f, 64 * wg + 16 * warp, g, qd);
  };
  loadTileSw<NT>(Ks, k, a, b, j0, KR, a.ldkv, kvh * D);
  loadTileSw<NT>(Vs, v, a, b, j0, KR, a.ldkv, kvh * D);
  issue(0); // one group: K, V and the first Q, dY
  if (steps > 1) {
    issue(1);
    mma::cpAsyncWait<1>();
  } else {
    mma::cpAsyncWait<0>();
  }
  mma::fenceProxyAsync();
  __syncthreads(); // step 0's tiles are in shared memory
  const unsigned char *Kw = Ks + wg * 64 * 128, *Vw = Vs + wg * 64 * 128; // the warpgroup's keys
  float st[32], dpt[32];
  { // step 0's P^T and dS^T, as bwdWgmmaKernel's
    int64_t t0 = q0 * kTile;
    bool masked = wgBwdMasked(a, j0, KR, t0);
    auto ok = [&](int i) { return wgBwdKeep(a, masked, t0, w0, g, qd, i); };
    mma::wgmmaFence();
    wgIssueScoresT<T, D>(st, Kw, KR, qTile(0));
    wgIssueScoresT<T, D>(dpt, Vw, KR, qTile(0) + kWgTileQry);
    mma::wgmmaWait<1>();
    mma::fenceRegs(st);
    wgBwdP(st, ok, lTile(0), qd, sl2);
    mma::wgmmaWait<0>();
    mma::fenceRegs(dpt);
    wgBwdDS(dpt, st, ok, lTile(0) + 64, qd);
    stash(st, dpt, 0);
  }
  // Step it's start: step it + 1's tiles and step it's P^T, dS^T in
  // shared memory (every warpgroup's; step it - 1's products are done),
  // step it + 2's tiles on their way into step it - 1's buffers.
  auto begin = [&](int64_t it) {
    mma::cpAsyncWait<0>();   // step it + 1's Q, dY
    mma::fenceProxyAsync(); // with this thread's P^T, dS^T stores, before wgmma reads them
    __syncthreads();
    if (it + 2 < steps)
      issue(it + 2);
    mma::fenceRegs(accV);
    mma::fenceRegs(accK);
    mma::wgmmaFence();
  };
  // Step it's dV += P^T dY, dK += dS^T Q (one group), then dq = dS K (A =
  // dS M-major from the key-major tile, B = K N-major from dimension NQ
  // wg, as bwdWgmmaKernel's; another).
  auto products = [&](int64_t it, float (&dqa)[NQ / 2]) {
    const unsigned char *Qs = qTile(it), *DYs = Qs + kWgTileQry,
                        *PTs = PT + (it % 2) * kTileKey, *DSs = DS + (it % 2) * kTileKey;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      mma::Wgmma<T, D>::template ss<0, 1>(accV, descKMajor(PTs + wg * 64 * 128, kk),
                                          descNMajorRows(DYs, kk, 64), 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      mma::Wgmma<T, D>::template ss<0, 1>(accK, descKMajor(DSs + wg * 64 * 128, kk),
                                          descNMajorRows(Qs, kk, 64), 1);
    mma::wgmmaCommit();
#pragma unroll
    for (int kk = 0; kk < KR / 16; ++kk)
      mma::Wgmma<T, NQ>::template ss<1, 1>(dqa, descNMajorRows(DSs, kk, 64),
                                           descNMajorRows(Ks + 2 * NQ * wg, kk, KR), kk > 0);
    mma::wgmmaCommit();
  };
  auto storeDq = [&](int64_t it, const float (&dqa)[NQ / 2]) {
    wgStoreDq<NQ, D>(dqPart + (partBase + (it / perHead) * partHead + (it % perHead) * kTile +
                               16 * warp + g) *
                                  D +
                         NQ * wg + 2 * qd,
                     dqa);
  };
  for (int64_t it = 0; it + 1 < steps; ++it) {
    begin(it);
    const unsigned char *Qn = qTile(it + 1);
    float dqa[NQ / 2];
    wgIssueScoresT<T, D>(st, Kw, KR, Qn); // S^T(it + 1)
    products(it, dqa);
    wgIssueScoresT<T, D>(dpt, Vw, KR, Qn + kWgTileQry); // dP^T(it + 1)
    int64_t t0 = (q0 + (it + 1) % perHead) * kTile;
    bool masked = wgBwdMasked(a, j0, KR, t0);
    auto ok = [&](int i) { return wgBwdKeep(a, masked, t0, w0, g, qd, i); };
    mma::wgmmaWait<3>(); // S^T(it + 1)
    mma::fenceRegs(st);
    wgBwdP(st, ok, lTile(it + 1), qd, sl2);
    mma::wgmmaWait<1>(); // dV, dK, dq(it)
    mma::fenceRegs(accV);
    mma::fenceRegs(accK);
    mma::fenceRegs(dqa);
    storeDq(it, dqa);
    mma::wgmmaWait<0>(); // dP^T(it + 1)
    mma::fenceRegs(dpt);
    wgBwdDS(dpt, st, ok, lTile(it + 1) + 64, qd);
    stash(st, dpt, (it + 1) % 2);
  }
  { // the last step: its products only
    float dqa[NQ / 2];
    begin(steps - 1);
    products(steps - 1, dqa);
    mma::wgmmaWait<0>();
    mma::fenceRegs(accV);
    mma::fenceRegs(accK);
    mma::fenceRegs(dqa);
    storeDq(steps - 1, dqa);
  }
  wgStoreKV<T, D>(accK, accV, a, b, kvh, w0, g, qd, dk, dv);
#else
  __trap(); // wgmma needs sm_90a
#endif
}

/// The fused backward (Impl::MmaFused, MmaFused64): delta,
/// bwdFusedMmaKernel (m key m-tiles a warp, fusedTiles), the dq reduction.
template <typename T>
cudaError_t backwardFused(const void *q, const void *k, const void *v, const void *y,
                          const float *lse, const void *dy, void *dq, void *dk, void *dv,
                          float *scratch, const Dims &a, int m, bool wgmma, bool pipe,
                          cudaStream_t s) {
  const T *Q = static_cast<const T *>(q), *K = static_cast<const T *>(k),
          *V = static_cast<const T *>(v), *DY = static_cast<const T *>(dy);
  float *delta = scratch, *part = scratch + deltaFloats(a);
  const int64_t chunk = pairsPerChunk(a, m), pairs = a.B * a.KV, group = a.H / a.KV;
  if (chunk <= 0)
    return cudaErrorInvalidValue; // backward() runs MmaTight3's kernels instead
  int64_t rows = a.B * a.H * a.T;
  bool vec = a.D % 8 == 0 && a.ldy % 8 == 0 &&
             ((reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(dy)) & 15) == 0;
  deltaKernel<T><<<(unsigned)((rows * kDeltaLanes + 255) / 256), 256, 0, s>>>(
      a, static_cast<const T *>(y), DY, delta, vec);
  if (cudaError_t e = cudaGetLastError())
    return e;
  auto kernel = a.D == 64    ? (m == 2 ? bwdFusedMmaKernel<T, 64, 2, 2>
                                       : bwdFusedMmaKernel<T, 64, 3, 1>)
                : a.D == 128 ? bwdFusedMmaKernel<T, 128, 1, 1>
                             : bwdFusedMmaKernel<T, 0, 1, 1>;
  size_t sm = (4 + 2 * m) * tcTile(a.D) + 4 * sizeof(float) * kTile +
              sizeof(uint16_t) * kTile * m * kLdP;
  int threads = kThreadsTc;
  if (wgmma) { // bwdWgmmaKernel: MmaFused's (m = 2) or MmaFused64's (m = 1) partials and order
    // (at D = 128 both fused impls have m = 1: fusedTiles)
    // pipe: bwdWgmmaPipeKernel at D = 64 (the same bits).
    pipe = pipe && a.D == 64;
    kernel = m == 2      ? (pipe ? bwdWgmmaPipeKernel<T, 2> : bwdWgmmaKernel<T, 2, 64>)
             : a.D == 64 ? (pipe ? bwdWgmmaPipeKernel<T, 1> : bwdWgmmaKernel<T, 1, 64>)
                         : bwdWgmmaKernel<T, 1, 128>;
    sm = m == 2      ? (pipe ? kWgBwdPipeSmem<2> : kWgBwdSmem<2, 64>)
         : a.D == 64 ? (pipe ? kWgBwdPipeSmem<1> : kWgBwdSmem<1, 64>)
                     : kWgBwdSmem<1, 128>;
    threads = m * kThreadsTc;
  }
  if (cudaError_t e = optIn(kernel, sm))
    return e;
  // Chunks of (b, kv head) pairs, each the fused kernel then its dq
  // reduction, the partials reused (stream order): the same sums in the
  // same order whatever the chunking.
  for (int64_t g0 = 0; g0 < pairs; g0 += chunk) {
    int64_t n = std::min(chunk, pairs - g0);
    kernel<<<(unsigned)(n * keyBlocks(a, m)), threads, sm, s>>>(
        a, g0, n, Q, K, V, DY, lse, delta, static_cast<T *>(dk), static_cast<T *>(dv), part);
    if (cudaError_t e = cudaGetLastError())
      return e;
    int64_t threads = n * group * a.T * (a.D / 4);
    dqReduceKernel<T><<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(
        a, m, g0 * group, n * group, part, static_cast<T *>(dq));
    if (cudaError_t e = cudaGetLastError())
      return e;
  }
  return cudaSuccess;
}

/// The mma.sync kernels for forwardWith / backwardWith: Impl::Mma
/// (Tight false: registers as the compiler chooses, 166 for dq and 222 for
/// dk / dv at D = 64, so 3 and 2 blocks a multiprocessor) or Impl::MmaTight
/// (at D = 64, launch bounds for 4 dq blocks and 3 dk / dv blocks, 128 and
/// 168 registers: a little spilled, more warps to hide latency).
template <bool Tight, int DqMT = 1, int DkvMT = 1> struct MmaKernels {
  static constexpr int kThreads = kThreadsTc;
  /// Query m-tiles a warp owns in the forward: 2 for Tight at D = 64.
  static constexpr int fwdTiles(int64_t D) { return Tight && D == 64 ? 2 : 1; }
  template <typename T, int KD> static auto fwd() {
    return forwardMmaKernel<T, KD, fwdTiles(KD)>;
  }
  static int64_t fwdRows(int64_t D) { return kTile * fwdTiles(D); }
  template <typename T, int KD> static auto dq() {
    return dqMmaKernel<T, KD, dqTiles(KD) == 2 ? 3 : Tight && KD == 64 ? 4 : 1, dqTiles(KD)>;
  }
  template <typename T, int KD> static auto dkv() {
    return dkvMmaKernel<T, KD, dkvTiles(KD) == 2 ? 2 : Tight && KD == 64 ? 3 : 1, dkvTiles(KD)>;
  }
  static size_t fwdBytes(int64_t D) { return (4 + fwdTiles(D)) * tcTile(D); }
  /// Query m-tiles a warp owns in dq: DqMT at D = 64 (Tight only).
  static constexpr int dqTiles(int64_t D) { return Tight && D == 64 ? DqMT : 1; }
  static int64_t dqRows(int64_t D) { return kTile * dqTiles(D); }
  static size_t dqBytes(int64_t D) { return (4 + 2 * dqTiles(D)) * tcTile(D); }
  /// Key m-tiles a warp owns in dk / dv: DkvMT at D = 64 (Tight only).
  static constexpr int dkvTiles(int64_t D) { return Tight && D == 64 ? DkvMT : 1; }
  static int64_t dkvRows(int64_t D) { return kTile * dkvTiles(D); }
  static size_t dkvBytes(int64_t D) {
    return (4 + 2 * dkvTiles(D)) * tcTile(D) + 4 * sizeof(float) * kTile;
  }
};

/// One implementation's (K: CoresKernels, WmmaKernels, MmaKernels) forward
/// and backward on storage T, its kernels compiled for D = 64 or 128 where
/// D is one of them, else its run-time-D instance.
template <typename K, typename T>
cudaError_t forwardWith(const void *q, const void *k, const void *v, void *y, float *lse,
                        const Dims &a, cudaStream_t s) {
  auto kernel = a.D == 64    ? K::template fwd<T, 64>()
                : a.D == 128 ? K::template fwd<T, 128>()
                             : K::template fwd<T, 0>();
  return launchForward<T>(kernel, K::fwdBytes(a.D), K::kThreads, K::fwdRows(a.D), q, k, v, y,
                          lse, a, s);
}

template <typename K, typename T>
cudaError_t backwardWith(const void *q, const void *k, const void *v, const void *y,
                         const float *lse, const void *dy, void *dq, void *dk, void *dv,
                         float *delta, const Dims &a, cudaStream_t s) {
  auto dqK = a.D == 64    ? K::template dq<T, 64>()
             : a.D == 128 ? K::template dq<T, 128>()
                          : K::template dq<T, 0>();
  auto dkvK = a.D == 64    ? K::template dkv<T, 64>()
              : a.D == 128 ? K::template dkv<T, 128>()
                           : K::template dkv<T, 0>();
  return launchBackward<T>(dqK, K::dqBytes(a.D), dkvK, K::dkvBytes(a.D), K::kThreads,
                           K::dqRows(a.D), K::dkvRows(a.D), q, k, v,
                           y, lse, dy, dq, dk, dv, delta, a, s);
}

/// f(K{}, T{}) for the implementation `impl` (resolved: not Auto) and the
/// storage type of `t`; the tensor-core ones take bf16 or f16 only.
template <typename F> cudaError_t withKernels(Impl impl, FloatKind t, F &&f) {
  bool bf = t == FloatKind::BF16;
  if (impl == Impl::Mma)
    return bf ? f(MmaKernels<false>{}, __nv_bfloat16{}) : f(MmaKernels<false>{}, __half{});
  if (impl == Impl::MmaTight)
    return bf ? f(MmaKernels<true>{}, __nv_bfloat16{}) : f(MmaKernels<true>{}, __half{});
  if (impl == Impl::MmaTight2)
    return bf ? f(MmaKernels<true, 2>{}, __nv_bfloat16{}) : f(MmaKernels<true, 2>{}, __half{});
  if (impl == Impl::MmaTight3 || impl == Impl::MmaFused || impl == Impl::MmaFused64)
    return bf ? f(MmaKernels<true, 2, 2>{}, __nv_bfloat16{})
              : f(MmaKernels<true, 2, 2>{}, __half{});
  if (impl == Impl::Wmma)
    return bf ? f(WmmaKernels{}, __nv_bfloat16{}) : f(WmmaKernels{}, __half{});
  switch (t) {
  case FloatKind::F32:
    return f(CoresKernels{}, float{});
  case FloatKind::BF16:
    return f(CoresKernels{}, __nv_bfloat16{});
  case FloatKind::F16:
    return f(CoresKernels{}, __half{});
  }
  return cudaErrorInvalidValue;
}

/// The tensor-core kernels (WMMA or mma.sync) take 16-bit storage and D a
/// multiple of 16.
bool tensorCoresApply(FloatKind t, const Dims &a) { return t != FloatKind::F32 && a.D % 16 == 0; }

/// The implementation that runs: Auto is the register-tile (mma.sync)
/// kernels where tensor cores apply, as MmaTight3 (32 rows a warp in all
/// three kernels at D = 64; on the H200 at GPT-2's shape, FlashBench B=16
/// forward + backward 0.830 ms against Mma's 0.903, MmaTight's 0.847 and
/// MmaTight2's 0.839; the B=32 step 68.82 ms against 70.08 and 70.45 in
/// the same call), else the CUDA-core ones.
Impl resolve(FloatKind t, const Dims &a, Impl impl) {
  if (impl == Impl::Auto)
    return tensorCoresApply(t, a) ? Impl::MmaTight3 : Impl::CudaCores;
  return impl;
}

} // namespace

Status check(int64_t B, int64_t T, int64_t C, int64_t heads, int64_t kvHeads, Layout rows) {
  int64_t kv = kvHeads > 0 ? kvHeads : heads;
  if (B < 0 || T < 0 || C <= 0 || heads <= 0 || C % heads || kv <= 0 || heads % kv)
    return FSDP_ERROR("attention: shape B=", B, " T=", T, " C=", C, " heads=", heads,
                      " kv_heads=", kv, " is not one the tiled CUDA kernel takes (heads must "
                      "divide C, kv_heads divide heads)");
  if ((rows.q && rows.q < C) || (rows.kv && rows.kv < kv * (C / heads)) ||
      (rows.y && rows.y < C) || rows.q < 0 || rows.kv < 0 || rows.y < 0)
    return FSDP_ERROR("attention: row strides q ", rows.q, ", kv ", rows.kv, ", y ", rows.y,
                      " are shorter than the rows they hold (C=", C, ")");
  if (C / heads > kMaxHeadDim)
    return FSDP_ERROR("attention: head dimension ", C / heads,
                      " exceeds the tiled CUDA kernel's limit ", kMaxHeadDim);
  int64_t tiles = (T + kTile - 1) / kTile;
  if (B * heads * tiles > INT32_MAX || B * T * heads > ((int64_t)1 << 35))
    return FSDP_ERROR("attention: B=", B, " T=", T, " heads=", heads,
                      " exceeds the tiled CUDA kernel's grid");
  return Status::ok();
}

bool tensorCoreImpl(Impl impl) { return impl != Impl::Auto && impl != Impl::CudaCores; }

int64_t setFusedScratchCap(int64_t bytes) {
  int64_t was = gFusedCapBytes;
  gFusedCapBytes = bytes;
  return was;
}

namespace {
/// The one-pass backwards (dq from per-key-block partials).
bool fusedImpl(Impl impl) {
  return impl == Impl::MmaFused || impl == Impl::MmaFused64 || impl == Impl::WgmmaFused ||
         impl == Impl::WgmmaFused64 || impl == Impl::WgmmaFusedSerial ||
         impl == Impl::WgmmaFused64Serial;
}

/// The backward's implementation: resolve's, except that a fused one whose
/// single (b, kv head) pair's partials exceed the cap runs MmaTight3's
/// kernels (the same dk, dv; dq summed per key tile).
Impl resolveBackward(FloatKind t, const Dims &a, Impl impl) {
  bool two = impl == Impl::WgmmaFused || impl == Impl::WgmmaFusedSerial,
       one = impl == Impl::WgmmaFused64 || impl == Impl::WgmmaFused64Serial;
  impl = impl == Impl::Wgmma || impl == Impl::WgmmaSerial ? Impl::MmaTight3
         : two && !wgmmaDim(a.D)                           ? Impl::MmaFused
         : one && !wgmmaDim(a.D)                           ? Impl::MmaFused64
                                                           : resolve(t, a, impl);
  if (fusedImpl(impl) && pairsPerChunk(a, fusedTiles(impl, a.D)) <= 0)
    return Impl::MmaTight3;
  return impl;
}
} // namespace

int64_t backwardScratch(FloatKind t, int64_t B, int64_t T, int64_t C, int64_t heads,
                        int64_t kvHeads, bool causal, Impl impl) {
  if (!check(B, T, C, heads, kvHeads) || B <= 0 || T <= 0)
    return std::max<int64_t>(0, B * heads * T);
  Dims a = dims(B, T, C, heads, causal, kvHeads, {});
  impl = resolveBackward(t, a, impl);
  if (!fusedImpl(impl))
    return B * heads * T;
  int m = fusedTiles(impl, a.D);
  return deltaFloats(a) + pairsPerChunk(a, m) * pairFloats(a, m);
}

bool parseImpl(const char *name, Impl &impl) {
  static const struct {
    const char *name;
    Impl impl;
  } kNames[] = {{"auto", Impl::Auto}, {"cores", Impl::CudaCores}, {"wmma", Impl::Wmma},
                {"mma", Impl::Mma}, {"mma-tight", Impl::MmaTight},
                {"mma-tight2", Impl::MmaTight2}, {"mma-tight3", Impl::MmaTight3},
                {"mma-fused", Impl::MmaFused}, {"mma-fused64", Impl::MmaFused64},
                {"wgmma", Impl::Wgmma}, {"wgmma-fused", Impl::WgmmaFused},
                {"wgmma-fused64", Impl::WgmmaFused64}, {"wgmma-serial", Impl::WgmmaSerial},
                {"wgmma-fused-serial", Impl::WgmmaFusedSerial},
                {"wgmma-fused64-serial", Impl::WgmmaFused64Serial}};
  for (const auto &n : kNames)
    if (name && std::string(name) == n.name) {
      impl = n.impl;
      return true;
    }
  return false;
}

cudaError_t forward(FloatKind t, const void *q, const void *k, const void *v, void *y,
                    float *lse, int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                    int64_t kvHeads, cudaStream_t s, Impl impl, Layout rows) {
  if (!check(B, T, C, heads, kvHeads, rows))
    return cudaErrorInvalidValue;
  Dims a = dims(B, T, C, heads, causal, kvHeads, rows);
  impl = resolve(t, a, impl);
  if (impl != Impl::CudaCores && !tensorCoresApply(t, a))
    return cudaErrorInvalidValue;
  if (B * heads * a.tiles == 0)
    return cudaSuccess;
  if (impl == Impl::Wgmma || impl == Impl::WgmmaFused || impl == Impl::WgmmaFused64 ||
      impl == Impl::WgmmaSerial || impl == Impl::WgmmaFusedSerial ||
      impl == Impl::WgmmaFused64Serial) {
    bool pipe = impl != Impl::WgmmaSerial && impl != Impl::WgmmaFusedSerial &&
                impl != Impl::WgmmaFused64Serial;
    if (wgmmaApplies(a, q, k, v))
      return t == FloatKind::BF16 ? forwardWgmma<__nv_bfloat16>(q, k, v, y, lse, a, pipe, s)
                                  : forwardWgmma<__half>(q, k, v, y, lse, a, pipe, s);
    impl = Impl::MmaTight3;
  }
  return withKernels(impl, t, [&](auto kernels, auto elem) {
    return forwardWith<decltype(kernels), decltype(elem)>(q, k, v, y, lse, a, s);
  });
}

cudaError_t backward(FloatKind t, const void *q, const void *k, const void *v, const void *y,
                     const float *lse, const void *dy, void *dq, void *dk, void *dv,
                     float *scratch, int64_t B, int64_t T, int64_t C, int64_t heads,
                     bool causal, int64_t kvHeads, cudaStream_t s, Impl impl,
                     Layout rows) {
  if (!check(B, T, C, heads, kvHeads, rows))
    return cudaErrorInvalidValue;
  Dims a = dims(B, T, C, heads, causal, kvHeads, rows);
  impl = resolveBackward(t, a, impl);
  if (impl != Impl::CudaCores && !tensorCoresApply(t, a))
    return cudaErrorInvalidValue;
  if (B * heads * a.tiles == 0)
    return cudaSuccess;
  if (fusedImpl(impl)) {
    int m = fusedTiles(impl, a.D);
    // WgmmaFused (64) where wgmmaApplies and dy's rows are whole chunks
    // too, else MmaFused (64): the same partials and scratch.
    // The serial ones: bwdWgmmaKernel at D = 64 too, not pipelined.
    bool serial = impl == Impl::WgmmaFusedSerial || impl == Impl::WgmmaFused64Serial;
    bool wg = (impl == Impl::WgmmaFused || impl == Impl::WgmmaFused64 || serial) &&
              wgmmaApplies(a, q, k, v) && a.ldy % 8 == 0 &&
              (reinterpret_cast<uintptr_t>(dy) & 15) == 0;
    bool pipe = wg && !serial;
    return t == FloatKind::BF16 ? backwardFused<__nv_bfloat16>(q, k, v, y, lse, dy, dq, dk, dv,
                                                               scratch, a, m, wg, pipe, s)
                                : backwardFused<__half>(q, k, v, y, lse, dy, dq, dk, dv, scratch,
                                                        a, m, wg, pipe, s);
  }
  return withKernels(impl, t, [&](auto kernels, auto elem) {
    return backwardWith<decltype(kernels), decltype(elem)>(q, k, v, y, lse, dy, dq, dk, dv,
                                                           scratch, a, s);
  });
}

cudaError_t wgmmaProduct(FloatKind t, const void *a, const void *b, float *d, int n,
                         int swizzle, int aMode, bool bNMajor, cudaStream_t s) {
  if ((t != FloatKind::BF16 && t != FloatKind::F16) || (n != 32 && n != 64 && n != 128) ||
      swizzle < 0 || swizzle > 3 || aMode < 0 || aMode > 2)
    return cudaErrorInvalidValue;
  auto run = [&](auto kernel, auto elem) {
    using T = decltype(elem);
    const size_t sm = 1024 + 64 * 256 + 16 * 1024 + 4096;
    if (cudaError_t e = optIn(kernel, sm))
      return e;
    kernel<<<1, kThreadsTc, sm, s>>>(static_cast<const T *>(a), static_cast<const T *>(b), d,
                                     swizzle, aMode, bNMajor);
    return cudaGetLastError();
  };
  if (t == FloatKind::BF16)
    return n == 32   ? run(wgmmaProductKernel<__nv_bfloat16, 32>, __nv_bfloat16{})
           : n == 64 ? run(wgmmaProductKernel<__nv_bfloat16, 64>, __nv_bfloat16{})
                     : run(wgmmaProductKernel<__nv_bfloat16, 128>, __nv_bfloat16{});
  return n == 32   ? run(wgmmaProductKernel<__half, 32>, __half{})
         : n == 64 ? run(wgmmaProductKernel<__half, 64>, __half{})
                   : run(wgmmaProductKernel<__half, 128>, __half{});
}

} // namespace fsdp::cuda::flash
