//===- CudaCommon.cuh - helpers shared by the .cu files ----------*- CUDA -*-===//
//
// Grid-stride launches, fixed-order warp / block reductions and broadcast
// index arithmetic, shared by CudaKernels.cu (the f32 reference kernels)
// and CudaNative.cu (bf16 / f16 / f32 storage). Internal: included by .cu
// files only; everything is in an anonymous namespace (one copy per file).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDACOMMON_CUH
#define FSDP_RUNTIME_CUDA_CUDACOMMON_CUH

#include "runtime/core/Moments4.h"
#include "runtime/core/Moments8.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/cuda/CudaKernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fsdp::cuda {
namespace {

constexpr int kThreads = 256;

// Storage types through f32 (bf16 / f16 round to nearest even).
__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half *p, float v) { *p = __float2half_rn(v); }
// One AdamW update, shared by the fused kernel (CudaNative.cu) and its f32
// reference (CudaKernels.cu). Every operation is rounded on its own, in
// cpu::adamwUpdate's order: nvcc contracts a * b + c into an FMA where it
// chooses, and the two kernels, written with the same expressions, were
// contracted differently (different bits on an H200). The scalars are
// torch's (doubles), computed once per thread.
struct AdamwScalars {
  float stepSize, bc2Sqrt, decay, b1, b2, omb1, omb2, eps;
};
__device__ __forceinline__ AdamwScalars adamwScalars(const float *lrp, const float *stepp,
                                                     double beta1, double beta2, double eps,
                                                     double wd) {
  double t = trunc((double)*stepp), l = (double)*lrp;
  return {(float)(l / (1 - pow(beta1, t))), (float)sqrt(1 - pow(beta2, t)),
          (float)(1 - l * wd), (float)beta1, (float)beta2, (float)(1 - beta1),
          (float)(1 - beta2), (float)eps};
}
__device__ __forceinline__ void adamwElement(const AdamwScalars &c, float p, float g, float m,
                                             float v, float &np, float &nm, float &nv) {
  float pi = __fmul_rn(p, c.decay);
  float mi = __fadd_rn(__fmul_rn(m, c.b1), __fmul_rn(c.omb1, g));
  float vi = __fadd_rn(__fmul_rn(v, c.b2), __fmul_rn(__fmul_rn(c.omb2, g), g));
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2Sqrt), c.eps);
  np = __fsub_rn(pi, __fmul_rn(c.stepSize, __fdiv_rn(mi, denom)));
  nm = mi;
  nv = vi;
}
// One SGD-with-momentum update, shared by the f32 kernel (CudaKernels.cu)
// and the bf16-buffer one (CudaNative.cu), each operation rounded on its
// own in cpu::sgdMomentumUpdate's order (no contraction: the CPU's bits).
// `first`: step 1, where torch clones the gradient into the buffer.
struct SgdMomentumScalars {
  float lr, momentum, omd, wd;
  bool decays, first, nesterov;
};
__device__ __forceinline__ void sgdMomentumElement(const SgdMomentumScalars &c, float p, float g,
                                                   float b, float &np, float &nb) {
  float d = c.decays ? __fadd_rn(g, __fmul_rn(c.wd, p)) : g;
  float nbi = c.first ? d : __fadd_rn(__fmul_rn(c.momentum, b), __fmul_rn(c.omd, d));
  nb = nbi;
  np = __fsub_rn(p, __fmul_rn(c.lr, c.nesterov ? __fadd_rn(d, __fmul_rn(c.momentum, nbi)) : nbi));
}
/// An update's parameters on the device (Params): read widened, written
/// f32 or rounded once to bf16, the stochastic draws' key formed once a
/// thread (so a captured graph replays each step's).
struct ParamIo {
  Params q;
  uint64_t k;
  __device__ explicit ParamIo(const Params &q)
      : q(q), k(q.ctx ? stochasticRoundingKey(q.ctx[0], (int64_t)q.ctx[1], q.key) : 0) {}
  __device__ float load(int64_t i) const {
    return q.bf16 ? ld(static_cast<const __nv_bfloat16 *>(q.p) + i)
                  : static_cast<const float *>(q.p)[i];
  }
  __device__ void store(int64_t i, float x) const {
    if (!q.bf16)
      static_cast<float *>(q.np)[i] = x;
    else if (q.ctx)
      static_cast<uint16_t *>(q.np)[i] = roundToBf16Stochastic(x, k, q.first + (uint64_t)i);
    else
      st(static_cast<__nv_bfloat16 *>(q.np) + i, x);
  }
  /// A skipped step: the parameter as it was (its bits).
  __device__ void keep(int64_t i) const {
    if (q.bf16)
      static_cast<uint16_t *>(q.np)[i] = static_cast<const uint16_t *>(q.p)[i];
    else
      static_cast<float *>(q.np)[i] = static_cast<const float *>(q.p)[i];
  }
};
constexpr int kReduceBlocks = 256; // stage-1 blocks of a two-stage reduction

unsigned gridFor(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(b, 65535LL * 16));
}

#define FSDP_GRID_STRIDE(i, n)                                                 \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);    \
       i += (int64_t)gridDim.x * blockDim.x)

template <typename F> __global__ void mapKernel(int64_t n, F f) {
  FSDP_GRID_STRIDE(i, n) f(i);
}

/// Runs f(i) for i < n on the stream; returns the launch status.
template <typename F> cudaError_t forEach(int64_t n, cudaStream_t s, F f) {
  if (n <= 0)
    return cudaSuccess;
  mapKernel<<<gridFor(n), kThreads, 0, s>>>(n, f);
  return cudaGetLastError();
}

// --- block reductions (blockDim.x == kThreads) --------------------------------

template <typename T> __device__ T warpSum(T v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
template <typename T> __device__ T warpMax(T v) {
  for (int o = 16; o > 0; o >>= 1)
    v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

/// The block's sum, returned to every thread (fixed order for fixed
/// blockDim: each warp reduces by shuffles, then warp 0 reduces the warps).
template <typename T> __device__ T blockSum(T v, T *sh) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warpSum(v);
  __syncthreads(); // sh may still be read from a previous reduction
  if (lane == 0)
    sh[warp] = v;
  __syncthreads();
  int warps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < warps ? sh[threadIdx.x] : T(0);
  if (warp == 0)
    v = warpSum(v);
  if (threadIdx.x == 0)
    sh[0] = v;
  __syncthreads();
  return sh[0];
}

/// A label-smoothed cross-entropy row term (smoothing e): -log p[label]
/// = lse - x[label] weighted 1 - e, plus e times the mean over the
/// `classes` classes of -log p[c], which is lse - rowSum / classes. The
/// CPU kernels' formula (runtime/cpu/Kernels.cpp), in double.
__device__ inline double smoothedCeTerm(double lse, double atLabel, double rowSum, int64_t classes,
                                        double e) {
  return (1 - e) * (lse - atLabel) + e * (lse - rowSum / (double)classes);
}

/// The gradient's two target weights, as the CPU kernels round them: the
/// label's (1 - e) f and every class's e f / classes (f = dloss / rows);
/// f and 0 without smoothing.
struct CeTarget {
  float onLabel, uniform;
};
__device__ inline CeTarget ceTarget(float f, int64_t classes, double e) {
  if (e == 0)
    return {f, 0.f};
  return {(float)((1 - e) * (double)f), (float)(e * (double)f / (double)classes)};
}

/// ignore_index (CeIgnore): whether a row with this label is left out.
__device__ inline bool ceSkip(CeIgnore ig, int32_t label) { return ig.count && label == ig.index; }
/// The gradient's factor f: dloss / rows, or with ignore_index dloss / the
/// kept count (0 for a count of 0), as the CPU kernels compute it.
__device__ inline float ceFactor(const float *dloss, int64_t rows, CeIgnore ig) {
  if (!ig.count)
    return *dloss / (float)rows;
  float n = *ig.count;
  return n > 0 ? *dloss / n : 0.f;
}
/// The loss from its rows' sum with ignore_index: over the kept count.
__device__ inline float ceKeptMean(double sum, CeIgnore ig) {
  float n = *ig.count;
  return n > 0 ? (float)(sum / (double)n) : 0.f;
}

/// The loss from its n rows' terms (one block): their sum in a fixed
/// order, over n, or with ignore_index over the kept count.
__global__ void ceMeanOfRows(const double *perRow, int64_t n, CeIgnore ig, float *out) {
  __shared__ double sh[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    acc += perRow[i];
  acc = blockSum(acc, sh);
  if (threadIdx.x == 0)
    *out = ig.count ? ceKeptMean(acc, ig) : (float)(acc / (double)n);
}

__device__ float blockMax(float v, float *sh) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warpMax(v);
  __syncthreads();
  if (lane == 0)
    sh[warp] = v;
  __syncthreads();
  int warps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < warps ? sh[threadIdx.x] : -INFINITY;
  if (warp == 0)
    v = warpMax(v);
  if (threadIdx.x == 0)
    sh[0] = v;
  __syncthreads();
  return sh[0];
}

/// The two largest magnitudes of a quantization block (encodeMomentBlock's
/// and encodeMoment4Block's first half): each thread's am, ar (bit
/// patterns) reduced over the thread block, NaN above infinity. Starts with
/// a barrier (every slot written, every old code read).
__device__ inline void blockMaxes(uint32_t am, uint32_t ar, uint32_t *warpM, uint32_t *warpR,
                                  float &amaxM, float &amaxR) {
  namespace m8 = moments8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  am = warpMax(am);
  ar = warpMax(ar);
  if (lane == 0) {
    warpM[warp] = am;
    warpR[warp] = ar;
  }
  __syncthreads();
  am = 0, ar = 0;
  for (int w = 0; w < warps; ++w) {
    am = max(am, warpM[w]);
    ar = max(ar, warpR[w]);
  }
  amaxM = am > 0x7f800000u ? m8::floatOf(0x7fc00000u) : m8::floatOf(am);
  amaxR = ar > 0x7f800000u ? m8::floatOf(0x7fc00000u) : m8::floatOf(ar);
}

/// The end of a thread block's pass over quantization block j of 8-bit
/// moments (runtime/core/Moments8.h; adamw8bitStateKernel's and
/// lambMoments8bitKernel's): each thread has kept its elements' new
/// exp_avg in mf and exp_avg_sq's root in rf (shared, len each) and their
/// largest magnitudes' bit patterns in am, ar. These reduce over the
/// threads (NaN above infinity, as the CPU's blockAmax); each thread then
/// encodes its own elements into nm + o, nv + o, and thread 0 writes the
/// block's scales nsm[j], nsv[j]. A barrier first (every old code and scale
/// read, every slot written: in place allowed) and last (the slots and
/// warpM, warpR free for the next block).
__device__ inline void encodeMomentBlock(const float *mf, const float *rf, int len, uint32_t am,
                                         uint32_t ar, uint32_t *warpM, uint32_t *warpR, uint8_t *nm,
                                         uint8_t *nv, float *nsm, float *nsv, int64_t o,
                                         int64_t j) {
  namespace m8 = moments8;
  float amaxM, amaxR;
  blockMaxes(am, ar, warpM, warpR, amaxM, amaxR);
  float s1, inv1, s2, inv2;
  m8::blockScale(amaxM, m8::kMantM, s1, inv1);
  m8::blockScale(amaxR, m8::kMantV, s2, inv2);
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    nm[o + i] = inv1 != 0 ? m8::encodeM(mf[i], inv1) : 0;
    nv[o + i] = inv2 != 0 ? m8::encodeV(rf[i], inv2) : 0;
  }
  if (threadIdx.x == 0) {
    nsm[j] = s1;
    nsv[j] = s2;
  }
  __syncthreads();
}

/// encodeMomentBlock for 4-bit moments (runtime/core/Moments4.h;
/// adamw4bitStateKernel's): the codes two a byte, each thread writing
/// whole bytes (elements 2b and 2b + 1 of the block from the shared
/// slots) at nm + o / 2, nv + o / 2 (o even); an odd last block's last
/// high nibble 0. The same barriers.
__device__ inline void encodeMoment4Block(const float *mf, const float *rf, int len, uint32_t am,
                                          uint32_t ar, uint32_t *warpM, uint32_t *warpR,
                                          uint8_t *nm, uint8_t *nv, float *nsm, float *nsv,
                                          int64_t o, int64_t j) {
  namespace m4 = moments4;
  float amaxM, amaxR;
  blockMaxes(am, ar, warpM, warpR, amaxM, amaxR);
  float s1, inv1, s2, inv2;
  m4::blockScale(amaxM, s1, inv1);
  m4::blockScale(amaxR, s2, inv2);
  auto codeM = [&](int i) {
    return i >= len ? 0u : inv1 != 0 ? m4::encodeM(__fmul_rn(mf[i], inv1)) : m4::kZeroM;
  };
  auto codeV = [&](int i) {
    return i >= len ? 0u : inv2 != 0 ? m4::encodeV(__fmul_rn(rf[i], inv2)) : 0u;
  };
  for (int b = threadIdx.x; 2 * b < len; b += blockDim.x) {
    nm[o / 2 + b] = (uint8_t)(codeM(2 * b) | (codeM(2 * b + 1) << 4));
    nv[o / 2 + b] = (uint8_t)(codeV(2 * b) | (codeV(2 * b + 1) << 4));
  }
  if (threadIdx.x == 0) {
    nsm[j] = s1;
    nsv[j] = s2;
  }
  __syncthreads();
}

// --- shapes --------------------------------------------------------------------

struct Dims {
  int rank = 0;
  int64_t size[kMaxRank] = {};
  int64_t strideA[kMaxRank] = {}; // first input's stride per output dim (0: broadcast)
  int64_t strideB[kMaxRank] = {};
};

/// Strides of `in` (row-major) seen along the dims of `out`, aligned at the
/// trailing dimension; 0 where `in` is broadcast.
void alignStrides(const Shape &in, const Shape &out, int64_t *stride) {
  int r = (int)out.size(), ri = (int)in.size();
  int64_t st = 1;
  for (int d = r - 1; d >= 0; --d) {
    int di = d - (r - ri);
    if (di < 0) {
      stride[d] = 0;
      continue;
    }
    stride[d] = in[di] == 1 && out[d] != 1 ? 0 : st;
    st *= in[di];
  }
}

bool fits(const Shape &s) { return s.size() <= (size_t)kMaxRank; }

int64_t count(const Shape &s) {
  int64_t n = 1;
  for (int64_t d : s)
    n *= d;
  return n;
}

/// sum_to's index maps: `keep` takes an output index to its first input
/// offset, `red` walks the summed dims (where the output, aligned to the
/// input's rank, has 1 and the input does not); `nred` terms per output.
void sumToDims(const Shape &si, const Shape &so, Dims &keep, Dims &red, int64_t &nred) {
  int r = (int)si.size();
  Shape o(r, 1);
  for (size_t i = 0; i < so.size(); ++i)
    o[r - so.size() + i] = so[i];
  int64_t inStride[kMaxRank];
  int64_t st = 1;
  for (int d = r - 1; d >= 0; --d) {
    inStride[d] = st;
    st *= si[d];
  }
  keep = Dims{};
  red = Dims{};
  keep.rank = r;
  for (int d = 0; d < r; ++d) {
    keep.size[d] = o[d];
    keep.strideA[d] = o[d] == si[d] ? inStride[d] : 0;
    if (o[d] != si[d]) {
      red.size[red.rank] = si[d];
      red.strideA[red.rank] = inStride[d];
      ++red.rank;
    }
  }
  nred = 1;
  for (int d = 0; d < red.rank; ++d)
    nred *= red.size[d];
}

__device__ inline void offsets(const Dims &d, int64_t i, int64_t &a, int64_t &b) {
  a = 0;
  b = 0;
  for (int k = d.rank - 1; k >= 0; --k) {
    int64_t idx = i % d.size[k];
    i /= d.size[k];
    a += idx * d.strideA[k];
    b += idx * d.strideB[k];
  }
}

constexpr double kGeluC = 0.7978845608028654; // sqrt(2/pi)
constexpr double kGeluA = 0.044715;

// --- column sums: out[c] = sum over r of in[r * cols + c] -------------------------
//
// Bias gradients (sum_to over leading dims) and the per-warp partials of
// row-wise reductions. One thread per column looping over every row leaves
// most of the GPU idle and waits on one load at a time (1.8 ms for a
// [16384, 768] bf16 bias gradient on an H100); here a block of 32 x 8
// threads owns 32 adjacent columns (coalesced loads) and a chunk of rows,
// warp y of it the rows y, y + 8, ... of the chunk in four running sums
// (four loads in flight), and the chunks' f32 partials are summed by the
// same kernel over them. The order depends only on (rows, cols): the same
// bits every run.

constexpr int kColTile = 32, kColWarps = 8, kColBlocksWanted = 1024;

/// Row chunks of the first pass (1: one pass straight into the output).
inline int64_t columnSumChunks(int64_t rows, int64_t cols) {
  int64_t tiles = (cols + kColTile - 1) / kColTile;
  int64_t byRows = (rows + 255) / 256; // at least 256 rows a chunk
  return std::max<int64_t>(
      1, std::min<int64_t>(byRows, kColBlocksWanted / std::max<int64_t>(tiles, 1)));
}

/// f32 scratch the two passes need (0: one pass).
inline int64_t columnSumScratch(int64_t rows, int64_t cols) {
  int64_t p = columnSumChunks(rows, cols);
  return p > 1 ? p * cols : 0;
}

/// out1 (the final pass of columnSumSplit): columns from `split` on go to
/// out1[c - split] instead. V: adjacent columns a thread (2 for 16-bit
/// input whose rows allow 4-byte loads: a warp's load is then 128 bytes,
/// not 64), each summed exactly as with V = 1 (the same rows in the same
/// running sums): the same bits.
template <typename TI, typename TO, int V = 1>
__global__ void __launch_bounds__(kColTile *kColWarps)
    columnSumKernel(const TI *in, TO *out, int64_t rows, int64_t cols, int64_t ldIn,
                    int64_t chunkRows, TO *out1 = nullptr, int64_t split = 0) {
  __shared__ float part[kColWarps][kColTile * V + 1];
  int x = threadIdx.x, y = threadIdx.y;
  int64_t c = (blockIdx.x * (int64_t)kColTile + x) * V;
  int64_t r0 = blockIdx.y * chunkRows, r1 = r0 + chunkRows < rows ? r0 + chunkRows : rows;
  float a[V][4];
#pragma unroll
  for (int k = 0; k < V; ++k)
    a[k][0] = a[k][1] = a[k][2] = a[k][3] = 0.f;
  auto load = [&](int64_t r, float(&v)[V]) {
    if constexpr (V == 1) {
      v[0] = ld(in + r * ldIn + c);
    } else {
      static_assert(V == 2 && sizeof(TI) == 2, "two 16-bit columns a thread");
      uint32_t w = *reinterpret_cast<const uint32_t *>(in + r * ldIn + c);
      TI e[2]; // by memcpy: reading a uint32_t through a TI * is undefined
      memcpy(e, &w, 4);
      v[0] = ld(e);
      v[1] = ld(e + 1);
    }
  };
  if (c < cols) { // V = 2: cols is even, so c + 1 < cols too
    int64_t r = r0 + y;
    for (; r + 3 * kColWarps < r1; r += 4 * kColWarps) {
      float v0[V], v1[V], v2[V], v3[V];
      load(r, v0);
      load(r + kColWarps, v1);
      load(r + 2 * kColWarps, v2);
      load(r + 3 * kColWarps, v3);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        a[k][0] += v0[k];
        a[k][1] += v1[k];
        a[k][2] += v2[k];
        a[k][3] += v3[k];
      }
    }
    for (; r < r1; r += kColWarps) {
      float v0[V];
      load(r, v0);
#pragma unroll
      for (int k = 0; k < V; ++k)
        a[k][0] += v0[k];
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    part[y][x * V + k] = (a[k][0] + a[k][1]) + (a[k][2] + a[k][3]);
  __syncthreads();
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (y == 0 && c + k < cols) {
      float t = 0;
      for (int j = 0; j < kColWarps; ++j)
        t += part[j][x * V + k];
      if (out1 && c + k >= split)
        st(out1 + (c + k - split), t);
      else
        st(out + blockIdx.y * cols + c + k, t);
    }
}

/// out[c] = sum_r in[r * ldIn + c] for c < cols (ldIn >= cols: the row
/// stride of `in`), except that with out1 the columns from `split` on go to
/// out1[c - split] (two outputs, one sum: layer_norm_grad's dg and db);
/// `partial`: columnSumScratch(rows, cols) floats.
template <typename TI, typename TO>
cudaError_t columnSumSplit(const TI *in, TO *out, TO *out1, int64_t split, int64_t rows,
                           int64_t cols, int64_t ldIn, float *partial, cudaStream_t s) {
  if (cols <= 0)
    return cudaSuccess;
  // One pass of chunks row chunks into o (columns from `split` on into o1
  // where given): two 16-bit columns a thread where the rows allow 4-byte
  // loads, the same row chunks either way (columnSumChunks), so the same
  // sums.
  auto pass = [&](const auto *src, auto *o, auto *o1, int64_t r, int64_t ld, int64_t chunks,
                  int64_t chunkRows) {
    using I = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
    using O = std::remove_pointer_t<decltype(o)>;
    unsigned tiles = (unsigned)((cols + kColTile - 1) / kColTile);
    dim3 block(kColTile, kColWarps);
    if constexpr (sizeof(I) == 2)
      if (cols % 2 == 0 && ld % 2 == 0 && (reinterpret_cast<uintptr_t>(src) & 3) == 0) {
        columnSumKernel<I, O, 2><<<dim3((tiles + 1) / 2, (unsigned)chunks), block, 0, s>>>(
            src, o, r, cols, ld, chunkRows, o1, split);
        return cudaGetLastError();
      }
    columnSumKernel<I, O><<<dim3(tiles, (unsigned)chunks), block, 0, s>>>(src, o, r, cols, ld,
                                                                         chunkRows, o1, split);
    return cudaGetLastError();
  };
  int64_t p = columnSumChunks(rows, cols);
  if (p == 1)
    return pass(in, out, out1, rows, ldIn, 1, std::max<int64_t>(rows, 1));
  if (cudaError_t e = pass(in, partial, (float *)nullptr, rows, ldIn, p, (rows + p - 1) / p))
    return e;
  return pass((const float *)partial, out, out1, p, cols, 1, p);
}
template <typename TI, typename TO>
cudaError_t columnSum(const TI *in, TO *out, int64_t rows, int64_t cols, int64_t ldIn,
                      float *partial, cudaStream_t s) {
  return columnSumSplit<TI, TO>(in, out, nullptr, 0, rows, cols, ldIn, partial, s);
}

/// When sum_to(si -> so) sums exactly the leading dims (bias gradients):
/// the rows and columns of that column sum.
inline bool leadingRowsSum(const Shape &si, const Shape &so, int64_t &rows, int64_t &cols) {
  if (so.size() > si.size())
    return false;
  size_t lead = si.size() - so.size();
  // Trailing output dims of 1 over input dims > 1 are summed too: not this.
  size_t k = 0;
  while (k < so.size() && so[k] == 1 && si[lead + k] != 1)
    ++k;
  if (k > 0) // leading output 1s over summed dims: those are leading rows too
    lead += k;
  rows = 1;
  for (size_t d = 0; d < lead; ++d)
    rows *= si[d];
  cols = 1;
  for (size_t d = lead; d < si.size(); ++d) {
    if (si[d] != so[d - (si.size() - so.size())])
      return false;
    cols *= si[d];
  }
  return true;
}

} // namespace
} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDACOMMON_CUH
