//===- CudaNative.cu - kernels on bf16 / f16 / f32 storage ----------------===//
//
// Each kernel is a template on the storage type T (float, __nv_bfloat16,
// __half): ld() widens exactly, st() rounds to nearest even once. The
// elementwise math is CudaKernels.cu's expression for expression (bitwise
// the widened path); the row-wise kernels give a row to a warp (shuffle
// reductions, no __syncthreads) or, over a vocabulary, to a block with an
// online max / sum-of-exp.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaNative.h"

#include "runtime/core/Moments8.h"
#include "runtime/core/StochasticRounding.h"
#include "runtime/cuda/CudaCommon.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace fsdp::cuda::native {
namespace {

/// Calls fn<T>(args...) for the storage type of `t`.
#define FSDP_NATIVE_DISPATCH(t, fn, ...)                                       \
  switch (t) {                                                                 \
  case FloatKind::F32:                                                         \
    return fn<float>(__VA_ARGS__);                                             \
  case FloatKind::BF16:                                                        \
    return fn<__nv_bfloat16>(__VA_ARGS__);                                     \
  case FloatKind::F16:                                                         \
    return fn<__half>(__VA_ARGS__);                                            \
  }                                                                            \
  return cudaErrorInvalidValue

/// FSDP_NATIVE_DISPATCH, but fn<T, float> when `outF32` and t is narrow:
/// the kernels of fsdp-fuse-epilogues' widened results (f32 outputs of
/// bf16 / f16 inputs).
#define FSDP_NATIVE_DISPATCH_F32_OUT(outF32, t, fn, ...)                      \
  if ((outF32) && (t) == FloatKind::BF16)                                      \
    return fn<__nv_bfloat16, float>(__VA_ARGS__);                              \
  if ((outF32) && (t) == FloatKind::F16)                                       \
    return fn<__half, float>(__VA_ARGS__);                                     \
  FSDP_NATIVE_DISPATCH(t, fn, __VA_ARGS__)

template <typename T> const T *cp(const void *p) { return static_cast<const T *>(p); }
template <typename T> T *mp(void *p) { return static_cast<T *>(p); }

/// The warp's sum / max, returned to every lane (butterfly: a fixed order).
__device__ __forceinline__ float warpAllSum(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warpAllMax(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

constexpr int kWarpsPerBlock = kThreads / 32;

/// Blocks for a warp-per-row kernel over `rows` rows.
unsigned warpGrid(int64_t rows) {
  int64_t b = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(b, 65535LL * 16));
}

// --- elementwise ---------------------------------------------------------------

template <typename T>
cudaError_t unaryT(UnaryKind k, const void *xv, void *yv, int64_t n, double factor,
                   cudaStream_t s) {
  const T *x = cp<T>(xv);
  T *y = mp<T>(yv);
  float ff = (float)factor;
  switch (k) {
  case UnaryKind::Neg:
    return forEach(n, s, [=] __device__(int64_t i) { st(y + i, -ld(x + i)); });
  case UnaryKind::Scale:
    return forEach(n, s, [=] __device__(int64_t i) { st(y + i, ld(x + i) * ff); });
  case UnaryKind::Relu:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      st(y + i, v > 0.f ? v : 0.f);
    });
  case UnaryKind::Gelu:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      float u = (float)kGeluC * (v + (float)kGeluA * v * v * v);
      st(y + i, 0.5f * v * (1.f + tanhf(u)));
    });
  case UnaryKind::GeluExact:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      st(y + i, 0.5f * v * (1.f + erff(v * 0.70710678118654752f)));
    });
  case UnaryKind::Silu:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      st(y + i, v / (1.f + expf(-v)));
    });
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t unaryGradT(UnaryGradKind k, const void *xv, const void *dyv, void *dxv, int64_t n,
                       cudaStream_t s) {
  const T *x = cp<T>(xv), *dy = cp<T>(dyv);
  T *dx = mp<T>(dxv);
  switch (k) {
  case UnaryGradKind::Relu:
    return forEach(n, s, [=] __device__(int64_t i) {
      st(dx + i, ld(x + i) > 0.f ? ld(dy + i) : 0.f);
    });
  case UnaryGradKind::Gelu:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      float u = (float)kGeluC * (v + (float)kGeluA * v * v * v);
      float t = tanhf(u);
      float du = (float)kGeluC * (1.f + (float)(3 * kGeluA) * v * v);
      st(dx + i, ld(dy + i) * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du));
    });
  case UnaryGradKind::GeluExact:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i);
      float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
      float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
      st(dx + i, ld(dy + i) * (cdf + v * pdf));
    });
  case UnaryGradKind::Silu:
    return forEach(n, s, [=] __device__(int64_t i) {
      float v = ld(x + i), sg = 1.f / (1.f + expf(-v));
      st(dx + i, ld(dy + i) * sg * (1.f + v * (1.f - sg)));
    });
  }
  return cudaErrorInvalidValue;
}

// SwiGLU in the CPU kernels' arithmetic (runtime/cpu/Kernels.cpp: siluOf,
// siluGradOf), in f32 whatever T stores.
template <typename T>
cudaError_t swigluT(const void *gv, const void *uv, void *yv, int64_t n, cudaStream_t s) {
  const T *g = cp<T>(gv), *u = cp<T>(uv);
  T *y = mp<T>(yv);
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = ld(g + i);
    st(y + i, v / (1.f + expf(-v)) * ld(u + i));
  });
}

template <typename T>
cudaError_t swigluGradT(const void *gv, const void *uv, const void *dyv, void *dgv, void *duv,
                        int64_t n, cudaStream_t s) {
  const T *g = cp<T>(gv), *u = cp<T>(uv), *dy = cp<T>(dyv);
  T *dg = mp<T>(dgv), *du = mp<T>(duv);
  return forEach(n, s, [=] __device__(int64_t i) {
    float v = ld(g + i), d = ld(dy + i), t = d * ld(u + i); // read before dg / du are written
    float e = 1.f + expf(-v), sg = 1.f / e;
    st(dg + i, t * sg * (1.f + v * (1.f - sg)));
    st(du + i, d * (v / e));
  });
}

template <typename T> cudaError_t fillT(void *yv, int64_t n, double v, cudaStream_t s) {
  T *y = mp<T>(yv);
  float fv = (float)v;
  return forEach(n, s, [=] __device__(int64_t i) { st(y + i, fv); });
}

__device__ __forceinline__ float applyBinary(BinaryKind k, float x, float y) {
  return k == BinaryKind::Add   ? x + y
         : k == BinaryKind::Sub ? x - y
         : k == BinaryKind::Mul ? x * y
                                : x / y;
}

template <typename T>
cudaError_t binaryT(BinaryKind k, const void *av, const Shape &sa, const void *bv,
                    const Shape &sb, void *outv, const Shape &so, cudaStream_t s) {
  if (!fits(so) || !fits(sa) || !fits(sb))
    return cudaErrorInvalidValue;
  const T *a = cp<T>(av), *b = cp<T>(bv);
  T *out = mp<T>(outv);
  if (sa == so && sb == so) // no broadcast: no index arithmetic
    return forEach(count(so), s, [=] __device__(int64_t i) {
      st(out + i, applyBinary(k, ld(a + i), ld(b + i)));
    });
  Dims d;
  d.rank = (int)so.size();
  for (int i = 0; i < d.rank; ++i)
    d.size[i] = so[i];
  alignStrides(sa, so, d.strideA);
  alignStrides(sb, so, d.strideB);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    st(out + i, applyBinary(k, ld(a + ia), ld(b + ib)));
  });
}

template <typename T>
cudaError_t biasAddT(const void *xv, const void *bv, void *yv, int64_t rows, int64_t cols,
                     cudaStream_t s) {
  const T *x = cp<T>(xv), *b = cp<T>(bv);
  T *y = mp<T>(yv);
  return forEach(rows * cols, s,
                 [=] __device__(int64_t i) { st(y + i, ld(x + i) + ld(b + i % cols)); });
}

template <typename T>
cudaError_t broadcastToT(const void *inv, const Shape &si, void *outv, const Shape &so,
                         cudaStream_t s) {
  if (!fits(so) || !fits(si))
    return cudaErrorInvalidValue;
  const T *in = cp<T>(inv);
  T *out = mp<T>(outv);
  Dims d;
  d.rank = (int)so.size();
  for (int i = 0; i < d.rank; ++i)
    d.size[i] = so[i];
  alignStrides(si, so, d.strideA);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    out[i] = in[ia]; // a copy: no rounding
  });
}

template <typename T, typename TO = T>
cudaError_t sumToT(const void *inv, const Shape &si, void *outv, const Shape &so, float *scratch,
                   cudaStream_t s) {
  if (!fits(si) || so.size() > si.size())
    return cudaErrorInvalidValue;
  const T *in = cp<T>(inv);
  TO *out = mp<TO>(outv);
  // The common case (bias gradients: a sum over the leading dims): the
  // column sum of CudaCommon.cuh.
  int64_t rows, cols;
  if (leadingRowsSum(si, so, rows, cols)) {
    if (columnSumScratch(rows, cols) > 0 && !scratch)
      return cudaErrorInvalidValue;
    return columnSum(in, out, rows, cols, cols, scratch, s);
  }
  Dims keep, red; // keep: output index -> input offset; red: summed dims
  int64_t nred;
  sumToDims(si, so, keep, red, nred);
  return forEach(count(so), s, [=] __device__(int64_t i) {
    int64_t base, unused;
    offsets(keep, i, base, unused);
    float acc = 0;
    for (int64_t j = 0; j < nred; ++j) {
      int64_t off, u2;
      offsets(red, j, off, u2);
      acc += ld(in + base + off);
    }
    st(out + i, acc);
  });
}

template <typename T>
cudaError_t transposeT(const void *xv, const Shape &sx, const std::vector<int64_t> &perm,
                       void *yv, cudaStream_t s) {
  if (!fits(sx) || perm.size() != sx.size())
    return cudaErrorInvalidValue;
  const T *x = cp<T>(xv);
  T *y = mp<T>(yv);
  int r = (int)sx.size();
  int64_t inStride[kMaxRank];
  int64_t stv = 1;
  for (int d = r - 1; d >= 0; --d) {
    inStride[d] = stv;
    stv *= sx[d];
  }
  Dims d;
  d.rank = r;
  for (int i = 0; i < r; ++i) {
    if (perm[i] < 0 || perm[i] >= r)
      return cudaErrorInvalidValue;
    d.size[i] = sx[perm[i]];
    d.strideA[i] = inStride[perm[i]];
  }
  return forEach(count(sx), s, [=] __device__(int64_t i) {
    int64_t ia, ib;
    offsets(d, i, ia, ib);
    y[i] = x[ia];
  });
}

/// slice / place (concat, slice_grad) move `outer` rows of len x inner
/// contiguous elements: from 64 bytes a row, one pitched copy
/// (cudaMemcpy2DAsync, the copy engine's speed; an index-decoding kernel
/// per element ran GPT-2's q/k/v split at a seventh of the bandwidth).
constexpr size_t kCopyRowBytes = 64;

template <typename T>
cudaError_t sliceT(const void *xv, void *yv, int64_t outer, int64_t full, int64_t len,
                   int64_t inner, int64_t offset, cudaStream_t s) {
  const T *x = cp<T>(xv);
  T *y = mp<T>(yv);
  if (size_t row = sizeof(T) * len * inner; row >= kCopyRowBytes && outer > 0)
    return cudaMemcpy2DAsync(y, row, x + offset * inner, sizeof(T) * full * inner, row,
                             (size_t)outer, cudaMemcpyDeviceToDevice, s);
  return forEach(outer * len * inner, s, [=] __device__(int64_t i) {
    int64_t in = i % inner, l = (i / inner) % len, o = i / (inner * len);
    y[i] = x[(o * full + offset + l) * inner + in];
  });
}

template <typename T>
cudaError_t placeT(const void *xv, void *yv, int64_t outer, int64_t full, int64_t len,
                   int64_t inner, int64_t offset, cudaStream_t s) {
  const T *x = cp<T>(xv);
  T *y = mp<T>(yv);
  if (size_t row = sizeof(T) * len * inner; row >= kCopyRowBytes && outer > 0)
    return cudaMemcpy2DAsync(y + offset * inner, sizeof(T) * full * inner, x, row, row,
                             (size_t)outer, cudaMemcpyDeviceToDevice, s);
  return forEach(outer * len * inner, s, [=] __device__(int64_t i) {
    int64_t in = i % inner, l = (i / inner) % len, o = i / (inner * len);
    y[(o * full + offset + l) * inner + in] = x[i];
  });
}

template <typename T>
cudaError_t sliceGradT(const void *dy, void *dx, int64_t outer, int64_t full, int64_t len,
                       int64_t inner, int64_t offset, cudaStream_t s) {
  if (cudaError_t e = cudaMemsetAsync(dx, 0, sizeof(T) * outer * full * inner, s))
    return e;
  return placeT<T>(dy, dx, outer, full, len, inner, offset, s);
}

template <typename T>
cudaError_t embeddingT(const void *tablev, const int32_t *ids, void *yv, int64_t n,
                       int64_t vocab, int64_t width, long long *badPos, cudaStream_t s) {
  const T *table = cp<T>(tablev);
  T *y = mp<T>(yv);
  return forEach(n * width, s, [=] __device__(int64_t i) {
    int64_t r = i / width, c = i % width;
    int32_t id = ids[r];
    if (id < 0 || id >= vocab) {
      st(y + i, 0.f);
      if (c == 0)
        atomicMin(badPos, (long long)r);
      return;
    }
    y[i] = table[(int64_t)id * width + c];
  });
}

/// embedding_grad: dtable[v] = sum over the rows r with ids[r] == v of
/// dy[r], in f32 in row order (the CPU kernel's order), rounded once to
/// dtable's type (TO: T, or f32 for a widened gradient).
/// One thread per column walking all n rows left the GPU idle (7.8 ms for
/// GPT-2's 16384 tokens on an H100). Here the (id, row) pairs are sorted
/// (a bitonic sort in global memory on 64-bit keys id << 32 | row: unique,
/// so the order is total and the result the same bits every run), and a
/// block per run of one id sums its rows in row order, column by column,
/// with eight rows' loads in flight; the table is zeroed first. Ids out of
/// range are reported (badPos) and skipped, as in the forward.
int64_t embedKeys(int64_t n) {
  int64_t p = 1;
  while (p < n)
    p <<= 1;
  return p;
}

__global__ void embedKeysKernel(const int32_t *ids, uint64_t *keys, int64_t n, int64_t padded,
                                int64_t vocab, long long *badPos) {
  FSDP_GRID_STRIDE(i, padded) {
    if (i >= n) {
      keys[i] = ~0ull; // after every real key
      continue;
    }
    int32_t id = ids[i];
    bool bad = id < 0 || id >= vocab;
    if (bad)
      atomicMin(badPos, (long long)i);
    keys[i] = (uint64_t)(bad ? vocab : id) << 32 | (uint64_t)i;
  }
}

/// Keys a block sorts in shared memory: every step (k, j) with j below
/// kSortChunk / 2 exchanges keys inside one chunk, so those steps run in
/// one launch per k (and one for every k up to kSortChunk) instead of one
/// launch a step (105 launches, 0.28 ms of GPT-2's step on the H200, for
/// its 16384 tokens; 10 now).
constexpr int64_t kSortChunk = 2048;

/// The bitonic sort's steps (k, j) for k = kFirst, 2 kFirst, ..., kLast
/// and j from min(k, chunk) / 2 down to 1, on each block's chunk of
/// min(kSortChunk, padded) keys in shared memory: the same compare-exchanges
/// as bitonicStep (direction from the key's global index), so the same
/// result as the global steps.
__global__ void bitonicLocal(uint64_t *keys, int64_t padded, int64_t kFirst, int64_t kLast) {
  __shared__ uint64_t sk[kSortChunk];
  const int64_t C = padded < kSortChunk ? padded : kSortChunk, base = blockIdx.x * C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    sk[i] = keys[base + i];
  __syncthreads();
  for (int64_t k = kFirst; k <= kLast; k <<= 1)
    for (int64_t j = (k < C ? k : C) >> 1; j > 0; j >>= 1) {
      for (int64_t p = threadIdx.x; p < C / 2; p += blockDim.x) {
        int64_t i = (p / j) * 2 * j + p % j, l = i + j;
        uint64_t a = sk[i], b = sk[l];
        bool up = ((base + i) & k) == 0;
        if ((a > b) == up) {
          sk[i] = b;
          sk[l] = a;
        }
      }
      __syncthreads();
    }
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    keys[base + i] = sk[i];
}

/// One compare-exchange step (k, j) of the bitonic sort over `padded` keys.
__global__ void bitonicStep(uint64_t *keys, int64_t padded, int64_t k, int64_t j) {
  FSDP_GRID_STRIDE(i, padded) {
    int64_t l = i ^ j;
    if (l > i) {
      uint64_t a = keys[i], b = keys[l];
      bool up = (i & k) == 0;
      if ((a > b) == up) {
        keys[i] = b;
        keys[l] = a;
      }
    }
  }
}

template <typename T, typename TO>
__global__ void embedSumRuns(const uint64_t *keys, const T *dy, TO *dtable, int64_t n,
                             int64_t vocab, int64_t width) {
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    uint64_t id = keys[p] >> 32;
    if (id >= (uint64_t)vocab || (p > 0 && keys[p - 1] >> 32 == id))
      continue; // a bad id, or not the first row of its run
    int64_t end = p + 1;
    while (end < n && keys[end] >> 32 == id)
      ++end;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      float acc = 0.f;
      int64_t q = p;
      for (; q + 8 <= end; q += 8) {
        float x[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          x[u] = ld(dy + (int64_t)(uint32_t)keys[q + u] * width + c);
#pragma unroll
        for (int u = 0; u < 8; ++u)
          acc += x[u]; // in row order
      }
      for (; q < end; ++q)
        acc += ld(dy + (int64_t)(uint32_t)keys[q] * width + c);
      st(dtable + (int64_t)id * width + c, acc);
    }
  }
}

template <typename T, typename TO = T>
cudaError_t embeddingGradT(const int32_t *ids, const void *dyv, void *dtablev, float *scratch,
                           int64_t n, int64_t vocab, int64_t width, long long *badPos,
                           cudaStream_t s) {
  TO *dtable = mp<TO>(dtablev);
  if (cudaError_t e = cudaMemsetAsync(dtable, 0, sizeof(TO) * vocab * width, s))
    return e;
  if (n <= 0)
    return cudaSuccess;
  if (n > INT32_MAX || vocab >= (int64_t)UINT32_MAX)
    return cudaErrorInvalidValue;
  int64_t padded = embedKeys(n);
  auto *keys = reinterpret_cast<uint64_t *>(scratch); // 2 floats a key
  embedKeysKernel<<<gridFor(padded), kThreads, 0, s>>>(ids, keys, n, padded, vocab, badPos);
  if (cudaError_t e = cudaGetLastError())
    return e;
  // Steps inside a chunk in shared memory (bitonicLocal), the others
  // (j >= kSortChunk) one launch each, in the network's order.
  const int64_t chunk = std::min(padded, kSortChunk);
  const unsigned chunks = (unsigned)(padded / chunk);
  bitonicLocal<<<chunks, kThreads, 0, s>>>(keys, padded, 2, chunk);
  if (cudaError_t e = cudaGetLastError())
    return e;
  for (int64_t k = 2 * chunk; k <= padded; k <<= 1) {
    for (int64_t j = k >> 1; j >= chunk; j >>= 1) {
      bitonicStep<<<gridFor(padded), kThreads, 0, s>>>(keys, padded, k, j);
      if (cudaError_t e = cudaGetLastError())
        return e;
    }
    bitonicLocal<<<chunks, kThreads, 0, s>>>(keys, padded, k, k);
    if (cudaError_t e = cudaGetLastError())
      return e;
  }
  unsigned blocks = (unsigned)std::min<int64_t>(n, 65535);
  embedSumRuns<T, TO><<<blocks, kThreads, 0, s>>>(keys, cp<T>(dyv), dtable, n, vocab, width);
  return cudaGetLastError();
}

// --- row-wise --------------------------------------------------------------------

template <typename T>
__global__ void softmaxWarpKernel(const T *x, T *y, int64_t rows, int64_t cols) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    const T *xr = x + r * cols;
    float mx = -INFINITY;
    for (int64_t c = lane; c < cols; c += 32)
      mx = fmaxf(mx, ld(xr + c));
    mx = warpAllMax(mx);
    float sum = 0;
    for (int64_t c = lane; c < cols; c += 32)
      sum += expf(ld(xr + c) - mx);
    sum = warpAllSum(sum);
    for (int64_t c = lane; c < cols; c += 32)
      st(y + r * cols + c, expf(ld(xr + c) - mx) / sum);
  }
}

template <typename T>
__global__ void softmaxGradWarpKernel(const T *y, const T *dy, T *dx, int64_t rows,
                                      int64_t cols) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    int64_t o = r * cols;
    float dot = 0;
    for (int64_t c = lane; c < cols; c += 32)
      dot += ld(y + o + c) * ld(dy + o + c);
    dot = warpAllSum(dot);
    for (int64_t c = lane; c < cols; c += 32)
      st(dx + o + c, ld(y + o + c) * (ld(dy + o + c) - dot));
  }
}

// --- layer norm: lanes own 16-byte chunks ------------------------------------------
//
// One warp per row. The row is cut into chunks of kVec<T> elements (16
// bytes: 8 bf16 / f16, 4 f32); lane l owns chunks l, l + 32, ... and adds
// its elements chunk by chunk in column order, then the warp adds the
// lanes with butterfly shuffles: a fixed order. Where every row's chunks
// are whole and 16-byte aligned (cols a multiple of kVec, the tensors
// aligned: `vec`), a chunk is one 16-byte load or store; else it is read
// element by element in the same order, so the bits do not depend on it.
// (Lanes owning single columns l, l + 32, ... made 2-byte loads: GPT-2's
// B=16 layer-norm backward ran at a quarter of the H200's bandwidth.)

/// 16 bytes of a row: kVec<T> elements, loaded or stored as one uint4
/// (moved to and from T[] by memcpy, not by a cast pointer: reading a
/// uint4 through a T* is undefined, and the emulator's host compiler did
/// miscompile it).
template <typename T> constexpr int kVec = 16 / (int)sizeof(T);
template <typename T> __device__ __forceinline__ void ld16(const T *p, float *v) {
  uint4 u = *reinterpret_cast<const uint4 *>(p);
  T e[kVec<T>];
  memcpy(e, &u, sizeof(u));
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i)
    v[i] = ld(e + i);
}
template <typename T> __device__ __forceinline__ void st16(T *p, const float *v) {
  T e[kVec<T>];
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i)
    st(e + i, v[i]);
  uint4 u;
  memcpy(&u, e, sizeof(u));
  *reinterpret_cast<uint4 *>(p) = u;
}

/// v = the chunk of `row` at column c0, 0 past cols.
template <typename T>
__device__ __forceinline__ void loadChunk(const T *row, int64_t c0, int64_t cols, bool vec,
                                          float (&v)[kVec<T>]) {
  constexpr int V = kVec<T>;
  if (vec) {
    ld16(row + c0, v);
    return;
  }
#pragma unroll
  for (int i = 0; i < V; ++i)
    v[i] = c0 + i < cols ? ld(row + c0 + i) : 0.f;
}

/// Stores v (rounded to T) to the chunk of `row` at column c0, below cols.
template <typename T>
__device__ __forceinline__ void storeChunk(T *row, int64_t c0, int64_t cols, bool vec,
                                           const float (&v)[kVec<T>]) {
  constexpr int V = kVec<T>;
  if (vec) {
    st16(row + c0, v);
    return;
  }
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (c0 + i < cols)
      st(row + c0 + i, v[i]);
}

/// Whether the norm kernels take 16-byte chunks: cols a multiple of
/// kVec<T> and every pointer 16-byte aligned (nullptr allowed).
template <typename T> bool chunkAligned(int64_t cols, std::initializer_list<const void *> ps) {
  if (cols % kVec<T>)
    return false;
  for (const void *p : ps)
    if (reinterpret_cast<uintptr_t>(p) & 15)
      return false;
  return true;
}

// The norms' per-element arithmetic, every operation rounded on its own
// (__fmul_rn and friends): nvcc contracts a * b + c into one FMA or not
// depending on the code around it, so the register and streaming kernels
// (and the aligned and element-wise loads) gave dx + acc different bits in
// a few elements on the H200 until each step was spelled out.
__device__ __forceinline__ float lnXhat(float x, float mean, float rstd) {
  return __fmul_rn(__fsub_rn(x, mean), rstd);
}
__device__ __forceinline__ float lnSquare(float acc, float x, float mean) {
  float d = __fsub_rn(x, mean);
  return __fadd_rn(acc, __fmul_rn(d, d));
}
/// layer_norm's output: xhat * g + b.
__device__ __forceinline__ float lnOut(float x, float mean, float rstd, float g, float b) {
  return __fadd_rn(__fmul_rn(lnXhat(x, mean, rstd), g), b);
}
/// layer_norm_grad's dx: rstd (dy g - m1 - xhat m2).
__device__ __forceinline__ float lnDx(float x, float dy, float g, float mean, float rstd,
                                      float m1, float m2) {
  float xhat = lnXhat(x, mean, rstd);
  return __fmul_rn(rstd, __fsub_rn(__fsub_rn(__fmul_rn(dy, g), m1), __fmul_rn(xhat, m2)));
}

/// Row mean and 1/sqrt(biased variance + eps), two passes (cpu rowStats),
/// streaming the row.
template <typename T>
__device__ __forceinline__ void rowStatsWarp(const T *xr, int64_t cols, float eps, int lane,
                                             bool vec, float &mean, float &rstd) {
  constexpr int V = kVec<T>;
  float sum = 0;
  for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
    float v[V];
    loadChunk(xr, c0, cols, vec, v);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (c0 + i < cols)
        sum += v[i];
  }
  mean = warpAllSum(sum) / (float)cols;
  float var = 0;
  for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
    float v[V];
    loadChunk(xr, c0, cols, vec, v);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (c0 + i < cols)
        var = lnSquare(var, v[i], mean);
  }
  var = warpAllSum(var) / (float)cols;
  rstd = 1.f / sqrtf(var + eps);
}

/// out = (x - mean) * rstd * g + b over one chunk.
template <typename T>
__device__ __forceinline__ void normChunk(float (&out)[kVec<T>], const float (&x)[kVec<T>],
                                          const T *g, const T *b, int64_t c0, int64_t cols,
                                          bool vec, float mean, float rstd) {
  constexpr int V = kVec<T>;
  float gv[V], bv[V];
  loadChunk(g, c0, cols, vec, gv);
  loadChunk(b, c0, cols, vec, bv);
#pragma unroll
  for (int i = 0; i < V; ++i)
    out[i] = lnOut(x[i], mean, rstd, gv[i], bv[i]);
}

template <typename T>
__global__ void layerNormWarpKernel(const T *x, const T *g, const T *b, T *y, int64_t rows,
                                    int64_t cols, float eps, bool vec) {
  constexpr int V = kVec<T>;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    const T *xr = x + r * cols;
    float mean, rstd;
    rowStatsWarp(xr, cols, eps, lane, vec, mean, rstd);
    for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
      float v[V], o[V];
      loadChunk(xr, c0, cols, vec, v);
      normChunk(o, v, g, b, c0, cols, vec, mean, rstd);
      storeChunk(y + r * cols, c0, cols, vec, o);
    }
  }
}

/// sum = a + b rounded to T, y = layer_norm(sum): each lane reads back only
/// the sum elements it wrote, so no synchronisation is needed.
template <typename T>
__global__ void residualLayerNormWarpKernel(const T *a, const T *b, const T *g, const T *beta,
                                            T *sum, T *y, int64_t rows, int64_t cols,
                                            float eps, bool vec) {
  constexpr int V = kVec<T>;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    int64_t o = r * cols;
    for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
      float av[V], bv[V];
      loadChunk(a + o, c0, cols, vec, av);
      loadChunk(b + o, c0, cols, vec, bv);
#pragma unroll
      for (int i = 0; i < V; ++i)
        av[i] += bv[i];
      storeChunk(sum + o, c0, cols, vec, av);
    }
    float mean, rstd;
    rowStatsWarp(sum + o, cols, eps, lane, vec, mean, rstd);
    for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
      float v[V], out[V];
      loadChunk(sum + o, c0, cols, vec, v);
      normChunk(out, v, g, beta, c0, cols, vec, mean, rstd);
      storeChunk(y + o, c0, cols, vec, out);
    }
  }
}

/// The rows of layerNormGrad's dg / db (and rmsNormGrad's dw) partials:
/// partial w sums rows w, w + W, ... (1024: 6 MB of partials for GPT-2's
/// 768 columns, where 4096 warps' partials moved half as many bytes as the
/// tensors).
int64_t lnGradPartials(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, 1024));
}

/// The backward's dx terms over one chunk: s1 += dy g, s2 += dy g xhat (the
/// first pass), or (dx) out = rstd (dy g - m1 - xhat m2) [+ acc].
template <typename T>
__device__ __forceinline__ void gradSums(const float (&x)[kVec<T>], const float (&dy)[kVec<T>],
                                         const T *g, int64_t c0, int64_t cols, bool vec,
                                         float mean, float rstd, float &s1, float &s2) {
  constexpr int V = kVec<T>;
  float gv[V];
  loadChunk(g, c0, cols, vec, gv);
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (c0 + i < cols) {
      float dyg = __fmul_rn(dy[i], gv[i]);
      s1 = __fadd_rn(s1, dyg);
      s2 = __fadd_rn(s2, __fmul_rn(dyg, lnXhat(x[i], mean, rstd)));
    }
}
template <typename T>
__device__ __forceinline__ void gradChunk(float (&out)[kVec<T>], const float (&x)[kVec<T>],
                                          const float (&dy)[kVec<T>], const T *g,
                                          const T *accRow, int64_t c0, int64_t cols, bool vec,
                                          float mean, float rstd, float m1, float m2) {
  constexpr int V = kVec<T>;
  float gv[V], av[V] = {};
  loadChunk(g, c0, cols, vec, gv);
  if (accRow)
    loadChunk(accRow, c0, cols, vec, av);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    float v = lnDx(x[i], dy[i], gv[i], mean, rstd, m1, m2);
    out[i] = accRow ? __fadd_rn(av[i], v) : v;
  }
}

/// The backward's dx, one warp per row over all rows, streaming the row;
/// lane 0 stores the row's mean and rstd in `stats` for
/// normGradColumnsKernel (which computes dg / db).
template <typename T>
__global__ void layerNormGradWarpKernel(const T *x, const T *g, const T *dy, T *dx,
                                        float *stats, int64_t rows, int64_t cols, float eps,
                                        const T *acc, bool vec) {
  constexpr int V = kVec<T>;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    const T *xr = x + r * cols, *dyr = dy + r * cols;
    float mean, rstd;
    rowStatsWarp(xr, cols, eps, lane, vec, mean, rstd);
    float s1 = 0, s2 = 0;
    for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
      float xv[V], dv[V];
      loadChunk(xr, c0, cols, vec, xv);
      loadChunk(dyr, c0, cols, vec, dv);
      gradSums(xv, dv, g, c0, cols, vec, mean, rstd, s1, s2);
    }
    float m1 = warpAllSum(s1) / (float)cols, m2 = warpAllSum(s2) / (float)cols;
    for (int64_t c0 = lane * V; c0 < cols; c0 += 32 * V) {
      float xv[V], dv[V], out[V];
      loadChunk(xr, c0, cols, vec, xv);
      loadChunk(dyr, c0, cols, vec, dv);
      gradChunk(out, xv, dv, g, acc ? acc + r * cols : nullptr, c0, cols, vec, mean, rstd, m1,
                m2);
      storeChunk(dx + r * cols, c0, cols, vec, out);
    }
    if (lane == 0) {
      stats[2 * r] = mean;
      stats[2 * r + 1] = rstd;
    }
  }
}

/// The norms' parameter-gradient partials from the rows' stored
/// statistics (stats[2 r] = mean, 0 for rms_norm, whose x - 0 is x
/// exactly; stats[2 r + 1] = rstd), one thread per (partial w, chunk of
/// kVec<T> columns), consecutive threads on consecutive chunks (coalesced
/// 16-byte loads where `vec`): for each column, the sum over rows w, w + W,
/// ... in that order of dy * xhat, each product rounded on its own, at
/// partial + w * stride, and with Bias (layer_norm's db) of dy at
/// partial + w * stride + cols. A fixed order: no atomics.
template <typename T, bool Bias>
__global__ void normGradColumnsKernel(const T *x, const T *dy, const float *stats,
                                      float *partial, int64_t rows, int64_t cols, int64_t W,
                                      int64_t stride, bool vec) {
  constexpr int V = kVec<T>;
  const int64_t chunks = (cols + V - 1) / V;
  FSDP_GRID_STRIDE(i, W * chunks) {
    int64_t w = i / chunks, c0 = (i - w * chunks) * V;
    float pg[V], pb[V];
#pragma unroll
    for (int e = 0; e < V; ++e)
      pg[e] = pb[e] = 0.f;
#pragma unroll 4
    for (int64_t r = w; r < rows; r += W) {
      float xv[V], dv[V], mean = stats[2 * r], rstd = stats[2 * r + 1];
      loadChunk(x + r * cols, c0, cols, vec, xv);
      loadChunk(dy + r * cols, c0, cols, vec, dv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        pg[e] = __fadd_rn(pg[e], __fmul_rn(dv[e], lnXhat(xv[e], mean, rstd)));
        if (Bias)
          pb[e] += dv[e];
      }
    }
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (c0 + e < cols) {
        partial[w * stride + c0 + e] = pg[e];
        if (Bias)
          partial[w * stride + cols + c0 + e] = pb[e];
      }
  }
}

// --- layer norm with the row in registers -------------------------------------------
//
// The kernels above stream each row from memory once per pass (the
// statistics' two passes, then the output). For rows of at most 32 * CPL
// columns the kernels below hold a row in registers: lane l owns the same
// chunks as above (CPL / kVec<T> of them) and adds in the same order, so
// their results are bitwise those of the streaming kernels (the tests
// check it); only the memory traffic changes. Both backward kernels
// compute dx only; dg / db come from normGradColumnsKernel over the row
// statistics they store.

/// The raw bits of the chunk of `row` at column c0 (T's zero past cols):
/// the register kernels keep their rows packed, CPL / kVec<T> 16-byte
/// chunks a lane (12 registers for 768 bf16 columns, half the widened
/// floats), and widen a chunk where they use it (exact, cheap).
template <typename T>
__device__ __forceinline__ uint4 rawChunk(const T *row, int64_t c0, int64_t cols, bool vec) {
  if (vec && c0 < cols)
    return *reinterpret_cast<const uint4 *>(row + c0);
  T e[kVec<T>];
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i)
    if (c0 + i < cols)
      e[i] = row[c0 + i];
    else
      st(e + i, 0.f);
  uint4 u;
  memcpy(&u, e, sizeof(u));
  return u;
}
template <typename T>
__device__ __forceinline__ void widen(const uint4 &u, float (&v)[kVec<T>]) {
  T e[kVec<T>];
  memcpy(e, &u, sizeof(u));
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i)
    v[i] = ld(e + i);
}

/// A lane's chunks k = 0 .. NCH - 1 of a row (columns (lane + 32 k) kVec).
template <typename T, int NCH>
__device__ __forceinline__ void loadRowReg(const T *r, int64_t cols, int lane, bool vec,
                                           uint4 (&raw)[NCH]) {
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    raw[k] = rawChunk(r, (int64_t)(lane + 32 * k) * kVec<T>, cols, vec);
}

template <typename T, int NCH>
__device__ __forceinline__ void rowStatsReg(const uint4 (&raw)[NCH], int64_t cols, float eps,
                                            int lane, float &mean, float &rstd) {
  constexpr int V = kVec<T>;
  float sum = 0;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    float v[V];
    widen<T>(raw[k], v);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if ((lane + 32 * k) * V + i < cols)
        sum += v[i];
  }
  mean = warpAllSum(sum) / (float)cols;
  float var = 0;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    float v[V];
    widen<T>(raw[k], v);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if ((lane + 32 * k) * V + i < cols)
        var = lnSquare(var, v[i], mean);
  }
  var = warpAllSum(var) / (float)cols;
  rstd = 1.f / sqrtf(var + eps);
}

template <typename T, int CPL>
__global__ void layerNormRegKernel(const T *x, const T *g, const T *b, T *y, int64_t rows,
                                   int64_t cols, float eps, bool vec) {
  constexpr int V = kVec<T>, NCH = CPL / V;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    uint4 raw[NCH];
    float mean, rstd;
    loadRowReg(x + r * cols, cols, lane, vec, raw);
    rowStatsReg<T>(raw, cols, eps, lane, mean, rstd);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      int64_t c0 = (lane + 32 * k) * V;
      if (c0 < cols) {
        float t[V], o[V];
        widen<T>(raw[k], t);
        normChunk(o, t, g, b, c0, cols, vec, mean, rstd);
        storeChunk(y + r * cols, c0, cols, vec, o);
      }
    }
  }
}

template <typename T, int CPL>
__global__ void residualLayerNormRegKernel(const T *a, const T *b, const T *g, const T *beta,
                                           T *sum, T *y, int64_t rows, int64_t cols,
                                           float eps, bool vec) {
  constexpr int V = kVec<T>, NCH = CPL / V;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    int64_t o = r * cols;
    uint4 raw[NCH], rb[NCH];
    float mean, rstd;
    loadRowReg(a + o, cols, lane, vec, raw);
    loadRowReg(b + o, cols, lane, vec, rb);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      int64_t c0 = (lane + 32 * k) * V;
      float av[V], bv[V];
      widen<T>(raw[k], av);
      widen<T>(rb[k], bv);
      T rounded[V]; // the stored sum, as the streaming kernel reads it back
#pragma unroll
      for (int i = 0; i < V; ++i)
        st(rounded + i, c0 + i < cols ? av[i] + bv[i] : 0.f);
      memcpy(&raw[k], rounded, sizeof(uint4));
      if (c0 < cols) {
        float t[V];
        widen<T>(raw[k], t);
        storeChunk(sum + o, c0, cols, vec, t);
      }
    }
    rowStatsReg<T>(raw, cols, eps, lane, mean, rstd);
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      int64_t c0 = (lane + 32 * k) * V;
      if (c0 < cols) {
        float t[V], out[V];
        widen<T>(raw[k], t);
        normChunk(out, t, g, beta, c0, cols, vec, mean, rstd);
        storeChunk(y + o, c0, cols, vec, out);
      }
    }
  }
}

/// The backward's dx with the row in registers: one warp per row, as the
/// forward (no dg / db partials in registers: with them the kernel needed
/// 198 registers a thread, one block per multiprocessor, and ran GPT-2's
/// [16384, 768] bf16 at 0.25 ms, a tenth of the H200's bandwidth). x, dy
/// and acc are all loaded before the first reduction (one memory round
/// trip a row). Lane 0 stores the row's mean and rstd in `stats` for
/// normGradColumnsKernel.
template <typename T, int CPL>
__global__ void layerNormGradRegKernel(const T *x, const T *g, const T *dy, T *dx,
                                       float *stats, int64_t rows, int64_t cols, float eps,
                                       const T *acc, bool vec) {
  constexpr int V = kVec<T>, NCH = CPL / V;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    uint4 xr[NCH], dr[NCH], ar[NCH];
    float mean, rstd;
    loadRowReg(x + r * cols, cols, lane, vec, xr);
    loadRowReg(dy + r * cols, cols, lane, vec, dr);
    if (acc)
      loadRowReg(acc + r * cols, cols, lane, vec, ar);
    rowStatsReg<T>(xr, cols, eps, lane, mean, rstd);
    float s1 = 0, s2 = 0;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      int64_t c0 = (lane + 32 * k) * V;
      if (c0 < cols) {
        float xt[V], dt[V];
        widen<T>(xr[k], xt);
        widen<T>(dr[k], dt);
        gradSums(xt, dt, g, c0, cols, vec, mean, rstd, s1, s2);
      }
    }
    float m1 = warpAllSum(s1) / (float)cols, m2 = warpAllSum(s2) / (float)cols;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      int64_t c0 = (lane + 32 * k) * V;
      if (c0 < cols) {
        float xt[V], dt[V], gv[V], out[V];
        widen<T>(xr[k], xt);
        widen<T>(dr[k], dt);
        loadChunk(g, c0, cols, vec, gv);
        float av[V] = {};
        if (acc)
          widen<T>(ar[k], av);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float v = lnDx(xt[i], dt[i], gv[i], mean, rstd, m1, m2);
          out[i] = acc ? __fadd_rn(av[i], v) : v;
        }
        storeChunk(dx + r * cols, c0, cols, vec, out);
      }
    }
    if (lane == 0) {
      stats[2 * r] = mean;
      stats[2 * r + 1] = rstd;
    }
  }
}

/// Rows of at most 32 * CPL columns run the register kernels, for the
/// smallest CPL in {8, 24, 32} that holds them (24: GPT-2's 768 columns
/// without the 8 idle slots of 32, which cost the backward 198 registers).
/// CPL is a multiple of every kVec<T> (8, 4): whole chunks per lane.
inline int lnRegCpl(int64_t cols, LayerNormImpl impl) {
  if (impl == LayerNormImpl::Streaming || cols > 32 * 32)
    return 0;
  return cols <= 32 * 8 ? 8 : cols <= 32 * 24 ? 24 : 32;
}

template <typename T>
cudaError_t softmaxT(const void *x, void *y, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  softmaxWarpKernel<T><<<warpGrid(rows), kThreads, 0, s>>>(cp<T>(x), mp<T>(y), rows, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t softmaxGradT(const void *y, const void *dy, void *dx, int64_t rows, int64_t cols,
                         cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  softmaxGradWarpKernel<T>
      <<<warpGrid(rows), kThreads, 0, s>>>(cp<T>(y), cp<T>(dy), mp<T>(dx), rows, cols);
  return cudaGetLastError();
}

/// The register kernel K<CPL> for lnRegCpl's CPL (8, 24, 32), else the
/// streaming one.
template <typename F> F lnKernel(int cpl, F reg8, F reg24, F reg32, F streaming) {
  return cpl == 8 ? reg8 : cpl == 24 ? reg24 : cpl == 32 ? reg32 : streaming;
}

template <typename T>
cudaError_t layerNormT(const void *x, const void *g, const void *b, void *y, int64_t rows,
                       int64_t cols, double eps, cudaStream_t s, LayerNormImpl impl) {
  if (rows <= 0)
    return cudaSuccess;
  auto kernel = lnKernel(lnRegCpl(cols, impl), layerNormRegKernel<T, 8>,
                         layerNormRegKernel<T, 24>, layerNormRegKernel<T, 32>,
                         layerNormWarpKernel<T>);
  kernel<<<warpGrid(rows), kThreads, 0, s>>>(cp<T>(x), cp<T>(g), cp<T>(b), mp<T>(y), rows, cols,
                                             (float)eps, chunkAligned<T>(cols, {x, g, b, y}));
  return cudaGetLastError();
}

template <typename T>
cudaError_t residualLayerNormT(const void *a, const void *b, const void *g, const void *beta,
                               void *sum, void *y, int64_t rows, int64_t cols, double eps,
                               cudaStream_t s, LayerNormImpl impl) {
  if (rows <= 0)
    return cudaSuccess;
  auto kernel = lnKernel(lnRegCpl(cols, impl), residualLayerNormRegKernel<T, 8>,
                         residualLayerNormRegKernel<T, 24>, residualLayerNormRegKernel<T, 32>,
                         residualLayerNormWarpKernel<T>);
  kernel<<<warpGrid(rows), kThreads, 0, s>>>(cp<T>(a), cp<T>(b), cp<T>(g), cp<T>(beta),
                                             mp<T>(sum), mp<T>(y), rows, cols, (float)eps,
                                             chunkAligned<T>(cols, {a, b, g, beta, sum, y}));
  return cudaGetLastError();
}

/// normGradColumnsKernel over W partials of [rows, cols] (one thread per
/// partial and chunk).
template <typename T, bool Bias>
cudaError_t normGradColumns(const void *x, const void *dy, const float *stats, float *partial,
                            int64_t rows, int64_t cols, int64_t W, int64_t stride,
                            cudaStream_t s) {
  int64_t chunks = (cols + kVec<T> - 1) / kVec<T>;
  normGradColumnsKernel<T, Bias><<<gridFor(W * chunks), kThreads, 0, s>>>(
      cp<T>(x), cp<T>(dy), stats, partial, rows, cols, W, stride,
      chunkAligned<T>(cols, {x, dy}));
  return cudaGetLastError();
}

/// TP: the type of dg and db (T, or float: paramGradsF32).
template <typename T, typename TP = T>
cudaError_t layerNormGradT(const void *x, const void *g, const void *dy, void *dxv, void *dgv,
                           void *dbv, float *partial, int64_t rows, int64_t cols, double eps,
                           cudaStream_t s, const void *acc, LayerNormImpl impl) {
  TP *dg = mp<TP>(dgv), *db = mp<TP>(dbv);
  if (rows <= 0) {
    if (cudaError_t e = cudaMemsetAsync(dg, 0, sizeof(TP) * cols, s))
      return e;
    return cudaMemsetAsync(db, 0, sizeof(TP) * cols, s);
  }
  int64_t W = lnGradPartials(rows);
  float *more = partial + W * 2 * cols, *stats = more + columnSumScratch(W, 2 * cols);
  auto kernel = lnKernel(lnRegCpl(cols, impl), layerNormGradRegKernel<T, 8>,
                         layerNormGradRegKernel<T, 24>, layerNormGradRegKernel<T, 32>,
                         layerNormGradWarpKernel<T>);
  kernel<<<warpGrid(rows), kThreads, 0, s>>>(cp<T>(x), cp<T>(g), cp<T>(dy), mp<T>(dxv), stats,
                                             rows, cols, (float)eps, cp<T>(acc),
                                             chunkAligned<T>(cols, {x, g, dy, dxv, acc}));
  if (cudaError_t e = cudaGetLastError())
    return e;
  if (cudaError_t e = normGradColumns<T, true>(x, dy, stats, partial, rows, cols, W, 2 * cols, s))
    return e;
  // The partials, [W, 2 cols], summed per column (CudaCommon.cuh) in one
  // column sum: dg the first cols, db the rest (one or two launches, not
  // two or four; for GPT-2's 768 columns the same row chunks, so the same
  // bits, as two sums of cols).
  return columnSumSplit(partial, dg, db, cols, W, 2 * cols, 2 * cols, more, s);
}

// --- rms norm and rope (Llama) ------------------------------------------------------
//
// One warp per row, as the layer-norm kernels above: the row's 1 / rms from
// a warp-wide sum of squares; the backward's dw from normGradColumnsKernel's
// partials summed per column (columnSum): a fixed order, no atomics. The
// CPU kernels' formulas (runtime/cpu/Kernels.cpp rmsNorm, rmsNormGrad), in
// f32.

template <typename T>
__device__ __forceinline__ float rowRstdWarp(const T *xr, int64_t cols, float eps, int lane) {
  float ss = 0;
  for (int64_t c = lane; c < cols; c += 32) {
    float v = ld(xr + c);
    ss += v * v;
  }
  return 1.f / sqrtf(warpAllSum(ss) / (float)cols + eps);
}

/// y = rms_norm(x); with b (residual_rms_norm) x = a + b is first rounded
/// to T and stored in `sum`, and the norm reads the stored sum back (each
/// lane only the elements it wrote: no synchronisation), as the CPU's add,
/// then rms_norm.
template <typename T>
__global__ void rmsNormWarpKernel(const T *a, const T *b, const T *w, T *sum, T *y,
                                  int64_t rows, int64_t cols, float eps) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    int64_t o = r * cols;
    const T *xr = a + o;
    if (b) {
      for (int64_t c = lane; c < cols; c += 32)
        st(sum + o + c, ld(a + o + c) + ld(b + o + c));
      xr = sum + o;
    }
    float rstd = rowRstdWarp(xr, cols, eps, lane);
    for (int64_t c = lane; c < cols; c += 32)
      st(y + o + c, ld(xr + c) * rstd * ld(w + c));
  }
}

/// rms_norm_grad's dx, one warp per row over all rows (no dw partials: a
/// partial per warp read and written for every row was the layer norm's
/// cost too, see layerNormGradRegKernel); lane 0 stores the row's rstd
/// (and a mean of 0) for normGradColumnsKernel. With acc (rms_norm_grad_acc), dx = acc + the
/// input gradient, added in f32 before dx's one rounding.
template <typename T>
__global__ void rmsNormGradRowKernel(const T *x, const T *w, const T *dy, T *dx,
                                     float *stats, int64_t rows, int64_t cols, float eps,
                                     const T *acc) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  int lane = threadIdx.x & 31;
  for (int64_t r = warp; r < rows; r += nw) {
    const T *xr = x + r * cols, *dyr = dy + r * cols;
    float rstd = rowRstdWarp(xr, cols, eps, lane);
    float dot = 0;
    for (int64_t c = lane; c < cols; c += 32)
      dot += ld(dyr + c) * ld(w + c) * (ld(xr + c) * rstd);
    float m = warpAllSum(dot) / (float)cols;
    for (int64_t c = lane; c < cols; c += 32) {
      float v = rstd * (ld(dyr + c) * ld(w + c) - ld(xr + c) * rstd * m);
      st(dx + r * cols + c, acc ? ld(acc + r * cols + c) + v : v);
    }
    if (lane == 0) {
      stats[2 * r] = 0.f; // normGradColumnsKernel's mean
      stats[2 * r + 1] = rstd;
    }
  }
}

/// rms_norm (b and sum null) or residual_rms_norm.
template <typename T>
cudaError_t rmsNormT(const void *a, const void *b, const void *w, void *sum, void *y,
                     int64_t rows, int64_t cols, double eps, cudaStream_t s) {
  if (rows <= 0)
    return cudaSuccess;
  rmsNormWarpKernel<T><<<warpGrid(rows), kThreads, 0, s>>>(
      cp<T>(a), cp<T>(b), cp<T>(w), mp<T>(sum), mp<T>(y), rows, cols, (float)eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rmsNormGradT(const void *x, const void *w, const void *dy, void *dx, void *dwv,
                         float *partial, int64_t rows, int64_t cols, double eps,
                         cudaStream_t s, const void *acc) {
  T *dw = mp<T>(dwv);
  if (rows <= 0)
    return cudaMemsetAsync(dw, 0, sizeof(T) * cols, s);
  int64_t W = lnGradPartials(rows);
  float *more = partial + W * cols, *stats = more + columnSumScratch(W, cols);
  rmsNormGradRowKernel<T><<<warpGrid(rows), kThreads, 0, s>>>(
      cp<T>(x), cp<T>(w), cp<T>(dy), mp<T>(dx), stats, rows, cols, (float)eps, cp<T>(acc));
  if (cudaError_t e = cudaGetLastError())
    return e;
  if (cudaError_t e = normGradColumns<T, false>(x, dy, stats, partial, rows, cols, W, cols, s))
    return e;
  return columnSum(partial, dw, W, cols, cols, more, s);
}

/// Rotates each (i, i + D/2) pair of every head of row t by sign * t *
/// theta^(-2i/D), reading the angle's cosine and sine from tables [T, D/2]
/// made on the host at prepare (ropeAngles: the CPU kernel's values), so
/// the kernel moves bytes only (computing them here took double-precision
/// pow, cos and sin per pair, every layer, every step). The pair is read
/// before it is written (in place is fine).
template <typename T>
cudaError_t ropeT(const void *xv, void *yv, int64_t B, int64_t Tn, int64_t C, int64_t heads,
                  const float *cs, const float *sn, float sign, cudaStream_t s) {
  const T *x = cp<T>(xv);
  T *y = mp<T>(yv);
  int64_t D = C / heads, half = D / 2;
  return forEach(B * Tn * heads * half, s, [=] __device__(int64_t idx) {
    int64_t i = idx % half, h = (idx / half) % heads, t = (idx / (half * heads)) % Tn,
            b = idx / (half * heads * Tn);
    float c = cs[t * half + i], sg = sign * sn[t * half + i];
    int64_t o = (b * Tn + t) * C + h * D;
    float x1 = ld(x + o + i), x2 = ld(x + o + i + half);
    st(y + o + i, x1 * c - x2 * sg);
    st(y + o + i + half, x2 * c + x1 * sg);
  });
}

// --- softmax + cross-entropy over a vocabulary -------------------------------------

/// exp(x) as exp2(x log2 e): one multiply and the MUFU.EX2 instruction
/// (a few ulp; expf is a longer sequence, and the vocabulary-wide
/// cross-entropy, 824M exponentials a GPT-2 step at B=16, was bounded by
/// its instructions as much as by its bytes). exp(-inf) is 0.
__device__ __forceinline__ float expQuick(float x) { return exp2f(x * 1.4426950408889634f); }

/// Online (max, sum of exp(x - max)) of one block's row, combined in a
/// fixed order (lanes by butterfly, then warps in index order).
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  float m = fmaxf(a.m, b.m);
  if (m == -INFINITY)
    return {m, 0.f};
  return {m, a.s * expQuick(a.m - m) + b.s * expQuick(b.m - m)};
}

/// Folds v into a thread's running (max, sum of exp(x - max)).
__device__ __forceinline__ void absorb(MaxSum &a, float v) {
  if (v > a.m) {
    a.s = a.s * expQuick(a.m - v) + 1.f;
    a.m = v;
  } else if (v != -INFINITY) { // exp(-inf) adds 0; -inf - -inf would be NaN
    a.s += expQuick(v - a.m);
  }
}

/// Folds n values at once: the running max moves (and the sum is rescaled)
/// at most once, then each value adds its exponential in order.
template <int N>
__device__ __forceinline__ void absorbChunk(MaxSum &a, const float (&v)[N], int n) {
  float cm = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < n)
      cm = fmaxf(cm, v[i]);
  if (cm > a.m) {
    a.s *= expQuick(a.m - cm); // 0 while a.m is -inf (a.s is 0 then)
    a.m = cm;
  }
  if (a.m == -INFINITY) // every value so far -inf
    return;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < n)
      a.s += expQuick(v[i] - a.m);
}

/// Calls f(v, n) for this thread's share of the row xr[0, cols), n values
/// in v at a time. Vec: xr is 16-byte aligned and readable up to cols
/// rounded up to kVec<T> (a padded row): 16-byte chunks, the elements past
/// cols left out (n < kVec<T> on the last); else one element at a time.
template <bool Vec, typename T, typename F>
__device__ __forceinline__ void forRowShare(const T *xr, int64_t cols, F &&f) {
  if constexpr (Vec) {
    constexpr int N = kVec<T>;
    int64_t chunks = (cols + N - 1) / N;
    for (int64_t k = threadIdx.x; k < chunks; k += blockDim.x) {
      float v[N];
      ld16(xr + k * N, v);
      f(v, cols - k * N < N ? (int)(cols - k * N) : N);
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float v[1] = {ld(xr + c)};
      f(v, 1);
    }
  }
}

/// The block's (max, sum of exp) over xr[0, cols), read by forRowShare.
/// Threads combine in a fixed order (lanes by butterfly, then warps in
/// index order).
template <bool Vec, typename T>
__device__ MaxSum rowMaxSumOnline(const T *xr, int64_t cols, MaxSum *sh) {
  MaxSum a{-INFINITY, 0.f};
  forRowShare<Vec>(xr, cols, [&](const auto &v, int n) {
    if constexpr (Vec)
      absorbChunk(a, v, n);
    else
      absorb(a, v[0]);
  });
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
    a = combine(a, b);
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0)
    sh[warp] = a;
  __syncthreads();
  MaxSum r = sh[0];
  for (int i = 1; i < warps; ++i)
    r = combine(r, sh[i]);
  return r;
}

/// The block's sum of xr[0, cols) in double (label smoothing's mean
/// logit), read as rowMaxSumOnline<Vec> reads the row; every thread gets
/// it, after a barrier (so a row written in place afterwards is safe).
template <bool Vec, typename T> __device__ double rowSumD(const T *xr, int64_t cols, double *sh) {
  double a = 0;
  forRowShare<Vec>(xr, cols, [&](const auto &v, int n) {
    for (int i = 0; i < n; ++i)
      a += (double)v[i];
  });
  return blockSum(a, sh);
}

/// A row's loss term from its statistics: -log p[label], or with label
/// smoothing e the smoothed term (rowSum: the row's sum of logits).
__device__ inline double ceRowTerm(MaxSum ms, float atLabel, double rowSum, int64_t classes,
                                   double e) {
  if (e == 0)
    return (double)(logf(ms.s) + ms.m - atLabel);
  return smoothedCeTerm((double)(logf(ms.s) + ms.m), atLabel, rowSum, classes, e);
}

// Row r of the logits starts at r * stride; its first `classes` columns are
// the classes, the rest (fsdp-pad-classes' padding) are left out of the
// softmax and get a zero gradient. Vec: stride is a multiple of kVec<T>
// and the rows are 16-byte aligned (a padded head's rows are). e: label
// smoothing; ig: ignore_index (a skipped row's term and gradient are 0).
template <bool Vec, typename T>
__global__ void ceRowKernel(const T *logits, const int32_t *labels, double *perRow, int64_t classes,
                            int64_t stride, long long *badPos, double e, CeIgnore ig) {
  __shared__ MaxSum sh[32];
  __shared__ double shd[32];
  const T *lr = logits + blockIdx.x * stride;
  int32_t label = labels[blockIdx.x];
  bool skip = ceSkip(ig, label);
  bool bad = !skip && (label < 0 || label >= classes);
  MaxSum ms = rowMaxSumOnline<Vec>(lr, classes, sh);
  double xs = e != 0 ? rowSumD<Vec>(lr, classes, shd) : 0.0;
  if (threadIdx.x == 0) {
    if (bad)
      atomicMin(badPos, (long long)blockIdx.x);
    perRow[blockIdx.x] = bad || skip ? 0.0 : ceRowTerm(ms, ld(lr + label), xs, classes, e);
  }
}

/// Row blockIdx.x of the gradient from `lr`, its logits: global memory,
/// or the block's shared-memory copy of them (ceGradCachedKernel).
/// With perRow (cross_entropy_fused) the row's loss term is written there
/// too, from the same statistics and as ceRowKernel<Vec> computes it.
template <bool Vec, typename T>
__device__ void ceGradRow(const T *lr, const int32_t *labels, const float *dloss, T *dlogits,
                          int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                          MaxSum *sh, double *shd, double e, CeIgnore ig,
                          double *perRow = nullptr) {
  T *dr = dlogits + blockIdx.x * stride;
  int32_t label = labels[blockIdx.x];
  bool skip = ceSkip(ig, label);
  bool badLabel = !skip && (label < 0 || label >= classes);
  // The label's logit (and the row sum) are read before the statistics'
  // barriers, so before any thread writes the row (in place, lr may be dr).
  float atLabel = perRow && threadIdx.x == 0 && !badLabel && !skip ? ld(lr + label) : 0.f;
  MaxSum ms = rowMaxSumOnline<Vec>(lr, classes, sh);
  double xs = perRow && e != 0 ? rowSumD<Vec>(lr, classes, shd) : 0.0;
  if (perRow && threadIdx.x == 0)
    perRow[blockIdx.x] = badLabel || skip ? 0.0 : ceRowTerm(ms, atLabel, xs, classes, e);
  float f = ceFactor(dloss, rows, ig), inv = f / ms.s; // one division a row
  CeTarget t = ceTarget(f, classes, e);
  auto grad = [&](int64_t c, float x) {
    // One subtraction, as without smoothing (uniform is 0 then): the same
    // bits, whether or not the compiler contracts it into an FMA.
    return c < classes && !skip
               ? expQuick(x - ms.m) * inv - (t.uniform + (c == label ? t.onLabel : 0.f))
               : 0.f;
  };
  if constexpr (Vec) {
    constexpr int N = kVec<T>;
    for (int64_t k = threadIdx.x; k < stride / N; k += blockDim.x) {
      float v[N];
      ld16(lr + k * N, v);
#pragma unroll
      for (int i = 0; i < N; ++i)
        v[i] = grad(k * N + i, v[i]);
      st16(dr + k * N, v);
    }
  } else {
    for (int64_t c = threadIdx.x; c < stride; c += blockDim.x)
      st(dr + c, grad(c, c < classes ? ld(lr + c) : 0.f));
  }
  if (threadIdx.x == 0 && badLabel)
    atomicMin(badPos, (long long)blockIdx.x);
}

/// Two reads of the logits (the row statistics, then the gradient).
template <bool Vec, typename T>
__global__ void ceGradKernel(const T *logits, const int32_t *labels, const float *dloss, T *dlogits,
                             int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                             double e, CeIgnore ig, double *perRow) {
  __shared__ MaxSum sh[32];
  __shared__ double shd[32];
  ceGradRow<Vec>(logits + blockIdx.x * stride, labels, dloss, dlogits, rows, classes, stride,
                 badPos, sh, shd, e, ig, perRow);
}

/// Rows of at most this many bytes are read once, into shared memory (two
/// blocks an SM on Hopper's 227 KB): the statistics and the gradient then
/// read the copy, so the gradient costs one read of the logits and one
/// write instead of two reads and a write. GPT-2's padded bf16 row is
/// 50304 x 2 = 98 KB.
constexpr int64_t kCeRowCacheBytes = 112 << 10;

/// ceGradKernel<true> from a shared-memory copy of the row: the same
/// threads combine the same values in the same order, so the same bits.
/// The copy is taken before any write, so dlogits may be logits (in place).
template <typename T>
__global__ void ceGradCachedKernel(const T *logits, const int32_t *labels, const float *dloss,
                                   T *dlogits, int64_t rows, int64_t classes, int64_t stride,
                                   long long *badPos, double e, CeIgnore ig, double *perRow) {
  extern __shared__ uint4 ceRow[];
  __shared__ MaxSum sh[32];
  __shared__ double shd[32];
  const uint4 *src = reinterpret_cast<const uint4 *>(logits + blockIdx.x * stride);
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < stride / kVec<T>; k += blockDim.x)
    ceRow[k] = src[k];
  __syncthreads();
  ceGradRow<true>(reinterpret_cast<const T *>(ceRow), labels, dloss, dlogits, rows, classes, stride,
                  badPos, sh, shd, e, ig, perRow);
}

/// The padded-row fast path: 16-byte aligned rows of a whole number of
/// 16-byte chunks.
template <typename T> bool vectorRows(const void *a, const void *b, int64_t stride) {
  return stride % kVec<T> == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0;
}

template <typename T>
cudaError_t crossEntropyT(const void *logits, const int32_t *labels, float *loss, double *scratch,
                          int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                          double e, CeIgnore ig, cudaStream_t s) {
  if (rows <= 0 || rows > INT32_MAX || classes <= 0 || stride < classes)
    return cudaErrorInvalidValue;
  if (vectorRows<T>(logits, logits, stride))
    ceRowKernel<true, T><<<(unsigned)rows, kThreads, 0, s>>>(cp<T>(logits), labels, scratch,
                                                             classes, stride, badPos, e, ig);
  else
    ceRowKernel<false, T><<<(unsigned)rows, kThreads, 0, s>>>(cp<T>(logits), labels, scratch,
                                                              classes, stride, badPos, e, ig);
  ceMeanOfRows<<<1, kThreads, 0, s>>>(scratch, rows, ig, loss);
  return cudaGetLastError();
}

/// The gradient kernels; with perRow (cross_entropy_fused) they also
/// write each row's loss term, the fused path only where ceRowKernel would
/// take the same (vector) path, so the loss has the unfused bits: else
/// the caller runs crossEntropyT first.
template <typename T>
cudaError_t launchCeGrad(const void *logits, const int32_t *labels, const float *dloss,
                         void *dlogits, int64_t rows, int64_t classes, int64_t stride,
                         long long *badPos, double e, CeIgnore ig, bool cacheRow, double *perRow,
                         cudaStream_t s) {
  const size_t rowBytes = (size_t)stride * sizeof(T);
  if (cacheRow && vectorRows<T>(logits, dlogits, stride) && rowBytes <= kCeRowCacheBytes) {
    if (cudaError_t e = cudaFuncSetAttribute(ceGradCachedKernel<T>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)kCeRowCacheBytes))
      return e;
    ceGradCachedKernel<T><<<(unsigned)rows, kThreads, rowBytes, s>>>(
        cp<T>(logits), labels, dloss, mp<T>(dlogits), rows, classes, stride, badPos, e, ig, perRow);
  } else if (vectorRows<T>(logits, dlogits, stride))
    ceGradKernel<true, T><<<(unsigned)rows, kThreads, 0, s>>>(
        cp<T>(logits), labels, dloss, mp<T>(dlogits), rows, classes, stride, badPos, e, ig, perRow);
  else
    ceGradKernel<false, T><<<(unsigned)rows, kThreads, 0, s>>>(
        cp<T>(logits), labels, dloss, mp<T>(dlogits), rows, classes, stride, badPos, e, ig, perRow);
  return cudaGetLastError();
}

template <typename T>
cudaError_t crossEntropyGradT(const void *logits, const int32_t *labels, const float *dloss,
                              void *dlogits, int64_t rows, int64_t classes, int64_t stride,
                              long long *badPos, double e, CeIgnore ig, bool cacheRow,
                              cudaStream_t s) {
  if (rows <= 0 || rows > INT32_MAX || classes <= 0 || stride < classes)
    return cudaErrorInvalidValue;
  return launchCeGrad<T>(logits, labels, dloss, dlogits, rows, classes, stride, badPos, e, ig,
                         cacheRow, nullptr, s);
}

template <typename T>
cudaError_t crossEntropyFusedT(const void *logits, const int32_t *labels, const float *dloss,
                               float *loss, void *dlogits, double *scratch, int64_t rows,
                               int64_t classes, int64_t stride, long long *badPos, double e,
                               CeIgnore ig, bool cacheRow, cudaStream_t s) {
  if (rows <= 0 || rows > INT32_MAX || classes <= 0 || stride < classes)
    return cudaErrorInvalidValue;
  if (!vectorRows<T>(logits, dlogits, stride) && vectorRows<T>(logits, logits, stride)) {
    // The forward would read 16 bytes at a time and the gradient cannot
    // (dlogits misaligned): the two kernels, as unfused.
    if (cudaError_t err = crossEntropyT<T>(logits, labels, loss, scratch, rows, classes, stride,
                                           badPos, e, ig, s))
      return err;
    return launchCeGrad<T>(logits, labels, dloss, dlogits, rows, classes, stride, badPos, e, ig,
                           cacheRow, nullptr, s);
  }
  if (cudaError_t err = launchCeGrad<T>(logits, labels, dloss, dlogits, rows, classes, stride,
                                        badPos, e, ig, cacheRow, scratch, s))
    return err;
  ceMeanOfRows<<<1, kThreads, 0, s>>>(scratch, rows, ig, loss);
  return cudaGetLastError();
}

// --- AdamW ---------------------------------------------------------------------------

template <typename G>
__global__ void adamwKernel(Params q, const G *g, const float *m, const float *v, float *nm,
                            float *nv, int64_t n, const float *lrp, const float *stepp,
                            double beta1, double beta2, float eps, double wd,
                            const float *gradScale, const float *skip) {
  const ParamIo io(q);
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nm[i] = m[i];
      nv[i] = v[i];
    }
    return;
  }
  AdamwScalars c = adamwScalars(lrp, stepp, beta1, beta2, eps, wd);
  float gs = gradScale ? *gradScale : 1.f;
  bool scaled = gradScale != nullptr;
  auto grad = [&](float gi) {
    return scaled ? __fmul_rn(gi, gs) : gi; // rounded on its own, as fsdp.mul's product
  };
  // Four elements a thread at a time (16-byte loads and stores of p, m, v
  // and the results, 16 or 8 bytes of g) where every pointer allows it,
  // then the tail; elementwise, so the same bits either way. bf16
  // parameters (Params) take the element loop.
  auto at16 = [](const void *x) { return (reinterpret_cast<uintptr_t>(x) & 15) == 0; };
  const float *p = static_cast<const float *>(q.p);
  float *np = static_cast<float *>(q.np);
  const bool vec = !q.bf16 && at16(p) && at16(m) && at16(v) && at16(np) && at16(nm) && at16(nv) &&
                   (reinterpret_cast<uintptr_t>(g) & (4 * sizeof(G) - 1)) == 0;
  const int64_t n4 = vec ? n / 4 : 0;
  FSDP_GRID_STRIDE(i, n4) {
    float4 pv = reinterpret_cast<const float4 *>(p)[i], mv = reinterpret_cast<const float4 *>(m)[i],
           vv = reinterpret_cast<const float4 *>(v)[i], op, om, ov;
    G gv[4];
    if constexpr (sizeof(G) == 4) {
      float4 g4 = reinterpret_cast<const float4 *>(g)[i];
      memcpy(gv, &g4, 16);
    } else {
      uint2 g2 = reinterpret_cast<const uint2 *>(g)[i];
      memcpy(gv, &g2, 8);
    }
    adamwElement(c, pv.x, grad(ld(gv + 0)), mv.x, vv.x, op.x, om.x, ov.x);
    adamwElement(c, pv.y, grad(ld(gv + 1)), mv.y, vv.y, op.y, om.y, ov.y);
    adamwElement(c, pv.z, grad(ld(gv + 2)), mv.z, vv.z, op.z, om.z, ov.z);
    adamwElement(c, pv.w, grad(ld(gv + 3)), mv.w, vv.w, op.w, om.w, ov.w);
    reinterpret_cast<float4 *>(np)[i] = op;
    reinterpret_cast<float4 *>(nm)[i] = om;
    reinterpret_cast<float4 *>(nv)[i] = ov;
  }
  for (int64_t i = 4 * n4 + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float pn;
    adamwElement(c, io.load(i), grad(ld(g + i)), m[i], v[i], pn, nm[i], nv[i]);
    io.store(i, pn);
  }
}

template <typename G>
cudaError_t adamwT(Params q, const void *g, const float *m, const float *v, float *nm, float *nv,
                   int64_t n, const float *lr, const float *step, double beta1, double beta2,
                   double eps, double wd, const float *gradScale, const float *skip,
                   cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  // At most 2048 blocks: each thread then updates many elements, and the
  // per-thread scalars (two pow in double) stop costing as much as the
  // update (one thread per element ran GPT-2's 124M at a third of the
  // bandwidth on the H100). Elementwise: the same bits whatever the grid.
  unsigned blocks = std::min<unsigned>(gridFor(n), 2048u);
  adamwKernel<G><<<blocks, kThreads, 0, s>>>(q, cp<G>(g), m, v, nm, nv, n, lr, step, beta1, beta2,
                                             (float)eps, wd, gradScale, skip);
  return cudaGetLastError();
}

/// state-dtype=bf16: adamwKernel's arithmetic on the widened moments, the
/// new ones rounded once (to nearest, or with stateRoundingKey's draws
/// when ctx, the device's {seed, step}, is given: a replayed graph reads
/// each step's). One element a thread (the moments are half the bytes).
__global__ void adamwBf16StateKernel(Params q, const float *g, const __nv_bfloat16 *m,
                                     const __nv_bfloat16 *v, __nv_bfloat16 *nm, __nv_bfloat16 *nv,
                                     int64_t n, const float *lrp, const float *stepp, double beta1,
                                     double beta2, float eps, double wd, const float *gradScale,
                                     const float *skip, const uint64_t *ctx, int64_t key,
                                     uint64_t first) {
  const ParamIo io(q);
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nm[i] = m[i];
      nv[i] = v[i];
    }
    return;
  }
  AdamwScalars c = adamwScalars(lrp, stepp, beta1, beta2, eps, wd);
  const float gs = gradScale ? *gradScale : 1.f;
  const bool scaled = gradScale != nullptr;
  const uint64_t k = ctx ? stateRoundingKey(ctx[0], (int64_t)ctx[1], key) : 0;
  FSDP_GRID_STRIDE(i, n) {
    const float gi = scaled ? __fmul_rn(g[i], gs) : g[i];
    float pn, mn, vn;
    adamwElement(c, io.load(i), gi, ld(m + i), ld(v + i), pn, mn, vn);
    io.store(i, pn);
    if (ctx) {
      uint16_t bm, bv;
      roundMomentsToBf16Stochastic(mn, vn, k, first + (uint64_t)i, bm, bv);
      memcpy(nm + i, &bm, 2);
      memcpy(nv + i, &bv, 2);
    } else {
      st(nm + i, mn);
      st(nv + i, vn);
    }
  }
}

} // namespace

cudaError_t adamwBf16State(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, const float *lr, const float *step, double beta1,
                           double beta2, double eps, double wd, const float *gradScale,
                           const float *skip, const uint64_t *ctx, int64_t key, uint64_t first,
                           cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  unsigned blocks = std::min<unsigned>(gridFor(n), 2048u); // as adamwT's
  adamwBf16StateKernel<<<blocks, kThreads, 0, s>>>(
      q, g, static_cast<const __nv_bfloat16 *>(m), static_cast<const __nv_bfloat16 *>(v),
      static_cast<__nv_bfloat16 *>(nm), static_cast<__nv_bfloat16 *>(nv), n, lr, step, beta1, beta2,
      (float)eps, wd, gradScale, skip, ctx, key, first);
  return cudaGetLastError();
}

namespace {

/// adamw_update with 8-bit moments (state-dtype=8bit, runtime/core/
/// Moments8.h): one thread block a quantization block at a time (grid-
/// stride over them). Each thread decodes, updates and keeps its elements'
/// new moment and root in shared memory (2 x block floats); the block's
/// largest magnitudes (as bit patterns: NaN above infinity, as the CPU's
/// blockAmax) reduce over the threads; then each thread encodes its own.
/// In place: an element is read and written by one thread, and the scales
/// are written after every thread has read them (the reduction's
/// barriers). cpu::adamwUpdate8bitState's bits.
__global__ void adamw8bitStateKernel(Params q, const float *g, const uint8_t *m, const uint8_t *v,
                                     uint8_t *nm, uint8_t *nv, int64_t n, int block,
                                     const float *lrp, const float *stepp, double beta1,
                                     double beta2, float eps, double wd, int64_t decayed,
                                     const float *gradScale, const float *skip) {
  namespace m8 = moments8;
  extern __shared__ float slots[]; // the block's new moments, then roots
  __shared__ uint32_t warpM[32], warpR[32];
  const int64_t blocks = (n + block - 1) / block, at = m8::scalesOffset(n);
  const float *sm = reinterpret_cast<const float *>(m + at),
              *sv = reinterpret_cast<const float *>(v + at);
  float *nsm = reinterpret_cast<float *>(nm + at), *nsv = reinterpret_cast<float *>(nv + at);
  const ParamIo io(q);
  if (blockIdx.x == 0 && threadIdx.x < at - n) // the codes' padding stays zero
    nm[n + threadIdx.x] = nv[n + threadIdx.x] = 0;
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nm[i] = m[i];
      nv[i] = v[i];
    }
    FSDP_GRID_STRIDE(j, blocks) {
      nsm[j] = sm[j];
      nsv[j] = sv[j];
    }
    return;
  }
  const AdamwScalars decay = adamwScalars(lrp, stepp, beta1, beta2, eps, wd),
                     plain = adamwScalars(lrp, stepp, beta1, beta2, eps, 0.0);
  const float gs = gradScale ? *gradScale : 1.f;
  const bool scaled = gradScale != nullptr;
  float *mf = slots, *rf = slots + block;
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t o = j * block;
    const int len = (int)min((int64_t)block, n - o);
    const float scaleM = sm[j], scaleV = sv[j];
    uint32_t am = 0, ar = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t e = o + i;
      const float gi = scaled ? __fmul_rn(g[e], gs) : g[e];
      const float r = m8::decodeRoot(v[e], scaleV);
      float pn, mn, vn;
      adamwElement(e < decayed ? decay : plain, io.load(e), gi, m8::decodeM(m[e], scaleM),
                   __fmul_rn(r, r), pn, mn, vn);
      io.store(e, pn);
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

cudaError_t adamw8bitState(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, int64_t block, const float *lr, const float *step,
                           double beta1, double beta2, double eps, double wd, int64_t decayed,
                           const float *gradScale, const float *skip, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  const int64_t blocks = (n + block - 1) / block;
  unsigned grid = (unsigned)std::min<int64_t>(blocks, 4096);
  adamw8bitStateKernel<<<grid, kThreads, 2 * block * sizeof(float), s>>>(
      q, g, static_cast<const uint8_t *>(m), static_cast<const uint8_t *>(v),
      static_cast<uint8_t *>(nm), static_cast<uint8_t *>(nv), n, (int)block, lr, step, beta1, beta2,
      (float)eps, wd, decayed, gradScale, skip);
  return cudaGetLastError();
}

namespace {

/// adamw_update with 4-bit moments (state-dtype=4bit, runtime/core/
/// Moments4.h): adamw8bitStateKernel's pass (a thread block a quantization
/// block at a time; decode, update, the new moment and root kept in shared
/// memory, the largest magnitudes reduced) with the codes two a byte: each
/// thread decodes its elements' nibbles and encodes whole bytes of the
/// block (encodeMoment4Block). In place: a byte's old codes are read by
/// the threads of its two elements before the reduction's barrier, and
/// written after it. cpu::adamwUpdate4bitState's bits.
__global__ void adamw4bitStateKernel(Params q, const float *g, const uint8_t *m, const uint8_t *v,
                                     uint8_t *nm, uint8_t *nv, int64_t n, int block,
                                     const float *lrp, const float *stepp, double beta1,
                                     double beta2, float eps, double wd, int64_t decayed,
                                     const float *gradScale, const float *skip) {
  namespace m4 = moments4;
  extern __shared__ float slots[]; // the block's new moments, then roots
  __shared__ uint32_t warpM[32], warpR[32];
  const int64_t blocks = (n + block - 1) / block, at = m4::scalesOffset(n), codeBytes = (n + 1) / 2;
  const float *sm = reinterpret_cast<const float *>(m + at),
              *sv = reinterpret_cast<const float *>(v + at);
  float *nsm = reinterpret_cast<float *>(nm + at), *nsv = reinterpret_cast<float *>(nv + at);
  const ParamIo io(q);
  if (blockIdx.x == 0 && threadIdx.x < at - codeBytes) // the codes' padding stays zero
    nm[codeBytes + threadIdx.x] = nv[codeBytes + threadIdx.x] = 0;
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) { io.keep(i); }
    FSDP_GRID_STRIDE(i, codeBytes) {
      nm[i] = m[i];
      nv[i] = v[i];
    }
    FSDP_GRID_STRIDE(j, blocks) {
      nsm[j] = sm[j];
      nsv[j] = sv[j];
    }
    return;
  }
  const AdamwScalars decay = adamwScalars(lrp, stepp, beta1, beta2, eps, wd),
                     plain = adamwScalars(lrp, stepp, beta1, beta2, eps, 0.0);
  const float gs = gradScale ? *gradScale : 1.f;
  const bool scaled = gradScale != nullptr;
  float *mf = slots, *rf = slots + block;
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t o = j * block;
    const int len = (int)min((int64_t)block, n - o);
    const float scaleM = sm[j], scaleV = sv[j];
    uint32_t am = 0, ar = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t e = o + i;
      const float gi = scaled ? __fmul_rn(g[e], gs) : g[e];
      const float r = __fmul_rn(m4::levelV(m4::codeAt(v, e)), scaleV);
      float pn, mn, vn;
      adamwElement(e < decayed ? decay : plain, io.load(e), gi,
                   __fmul_rn(m4::levelM(m4::codeAt(m, e)), scaleM), __fmul_rn(r, r), pn, mn, vn);
      io.store(e, pn);
      const float rn = __fsqrt_rn(vn);
      mf[i] = mn;
      rf[i] = rn;
      am = max(am, moments8::bitsOf(mn) & 0x7fffffffu);
      ar = max(ar, moments8::bitsOf(rn) & 0x7fffffffu);
    }
    encodeMoment4Block(mf, rf, len, am, ar, warpM, warpR, nm, nv, nsm, nsv, o, j);
  }
}

} // namespace

cudaError_t adamw4bitState(Params q, const float *g, const void *m, const void *v, void *nm,
                           void *nv, int64_t n, int64_t block, const float *lr, const float *step,
                           double beta1, double beta2, double eps, double wd, int64_t decayed,
                           const float *gradScale, const float *skip, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  const int64_t blocks = (n + block - 1) / block;
  unsigned grid = (unsigned)std::min<int64_t>(blocks, 4096);
  adamw4bitStateKernel<<<grid, kThreads, 2 * block * sizeof(float), s>>>(
      q, g, static_cast<const uint8_t *>(m), static_cast<const uint8_t *>(v),
      static_cast<uint8_t *>(nm), static_cast<uint8_t *>(nv), n, (int)block, lr, step, beta1, beta2,
      (float)eps, wd, decayed, gradScale, skip);
  return cudaGetLastError();
}

namespace {

/// sgd_momentum_update with an 8-bit buffer (state-dtype=8bit): as
/// adamw8bitStateKernel with the one state, coded as its exp_avg (a
/// thread block a quantization block at a time; each thread decodes,
/// updates and keeps its elements' new buffer in shared memory; the
/// block's largest magnitude reduces over the threads; each thread
/// encodes its own). cpu::sgdMomentumUpdate8bitState's bits.
__global__ void sgdMomentum8bitStateKernel(Params q, const float *g, const uint8_t *buf,
                                           uint8_t *nbuf, int64_t n, int block, const float *lrp,
                                           const float *stepp, double momentum, double dampening,
                                           double wd, bool nesterov, int64_t decayed,
                                           const float *gradScale, const float *skip) {
  namespace m8 = moments8;
  extern __shared__ float slots[]; // the block's new buffer
  __shared__ uint32_t warpB[32];
  const int64_t blocks = (n + block - 1) / block, at = m8::scalesOffset(n);
  const float *sb = reinterpret_cast<const float *>(buf + at);
  float *nsb = reinterpret_cast<float *>(nbuf + at);
  const ParamIo io(q);
  if (blockIdx.x == 0 && threadIdx.x < at - n) // the codes' padding stays zero
    nbuf[n + threadIdx.x] = 0;
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nbuf[i] = buf[i];
    }
    FSDP_GRID_STRIDE(j, blocks)
    nsb[j] = sb[j];
    return;
  }
  const bool first = *stepp < 2.f;
  const SgdMomentumScalars decay{*lrp,  (float)momentum, (float)(1 - dampening), (float)wd, wd != 0,
                                 first, nesterov},
      plain{*lrp, (float)momentum, (float)(1 - dampening), 0.f, false, first, nesterov};
  const float gs = gradScale ? *gradScale : 1.f;
  const bool scaled = gradScale != nullptr;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t o = j * block;
    const int len = (int)min((int64_t)block, n - o);
    const float scale = sb[j];
    uint32_t ab = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t e = o + i;
      const float gi = scaled ? __fmul_rn(g[e], gs) : g[e];
      float pn, bn;
      sgdMomentumElement(e < decayed ? decay : plain, io.load(e), gi, m8::decodeM(buf[e], scale),
                         pn, bn);
      io.store(e, pn);
      slots[i] = bn;
      ab = max(ab, m8::bitsOf(bn) & 0x7fffffffu);
    }
    ab = warpMax(ab);
    if (lane == 0)
      warpB[warp] = ab;
    __syncthreads(); // every scale read, every slot written
    ab = 0;
    for (int w = 0; w < warps; ++w)
      ab = max(ab, warpB[w]);
    const float amax = ab > 0x7f800000u ? m8::floatOf(0x7fc00000u) : m8::floatOf(ab);
    float s1, inv1;
    m8::blockScale(amax, m8::kMantM, s1, inv1);
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      nbuf[o + i] = inv1 != 0 ? m8::encodeM(slots[i], inv1) : 0;
    if (threadIdx.x == 0)
      nsb[j] = s1;
    __syncthreads(); // the slots and warp maxima are free for the next block
  }
}

} // namespace

cudaError_t sgdMomentum8bitState(Params q, const float *g, const void *buf, void *nbuf, int64_t n,
                                 int64_t block, const float *lr, const float *step, double momentum,
                                 double dampening, double wd, bool nesterov, int64_t decayed,
                                 const float *gradScale, const float *skip, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  const int64_t blocks = (n + block - 1) / block;
  unsigned grid = (unsigned)std::min<int64_t>(blocks, 4096);
  sgdMomentum8bitStateKernel<<<grid, kThreads, block * sizeof(float), s>>>(
      q, g, static_cast<const uint8_t *>(buf), static_cast<uint8_t *>(nbuf), n, (int)block, lr,
      step, momentum, dampening, wd, nesterov, decayed, gradScale, skip);
  return cudaGetLastError();
}

namespace {

/// sgd_momentum_update with a bf16 buffer (state-dtype=bf16): kernels/
/// sgdMomentumUpdate's f32 element on the widened buffer, the new buffer
/// rounded once (stochastically with ctx, as adamwBf16StateKernel's).
__global__ void sgdMomentumBf16StateKernel(Params q, const float *g, const __nv_bfloat16 *buf,
                                           __nv_bfloat16 *nbuf, int64_t n, const float *lrp,
                                           const float *stepp, double momentum, double dampening,
                                           double wd, bool nesterov, const float *gradScale,
                                           const float *skip, const uint64_t *ctx, int64_t key,
                                           uint64_t first) {
  const ParamIo io(q);
  if (skip && !isfinite(*skip)) { // an overflowed (skipped) step: state unchanged
    FSDP_GRID_STRIDE(i, n) {
      io.keep(i);
      nbuf[i] = buf[i];
    }
    return;
  }
  const SgdMomentumScalars c{
      *lrp, (float)momentum, (float)(1 - dampening), (float)wd, wd != 0, *stepp < 2.f, nesterov};
  const uint64_t k = ctx ? stateRoundingKey(ctx[0], (int64_t)ctx[1], key) : 0;
  FSDP_GRID_STRIDE(i, n) {
    const float gi = gradScale ? __fmul_rn(g[i], *gradScale) : g[i];
    float pn, bn;
    sgdMomentumElement(c, io.load(i), gi, ld(buf + i), pn, bn);
    io.store(i, pn);
    if (ctx) {
      uint16_t b = roundToBf16Stochastic(bn, k, first + (uint64_t)i);
      memcpy(nbuf + i, &b, 2);
    } else {
      st(nbuf + i, bn);
    }
  }
}

} // namespace

cudaError_t sgdMomentumBf16State(Params q, const float *g, const void *buf, void *nbuf, int64_t n,
                                 const float *lr, const float *step, double momentum,
                                 double dampening, double wd, bool nesterov, const float *gradScale,
                                 const float *skip, const uint64_t *ctx, int64_t key,
                                 uint64_t first, cudaStream_t s) {
  if (n <= 0)
    return cudaSuccess;
  unsigned blocks = std::min<unsigned>(gridFor(n), 2048u); // as adamwT's
  sgdMomentumBf16StateKernel<<<blocks, kThreads, 0, s>>>(
      q, g, static_cast<const __nv_bfloat16 *>(buf), static_cast<__nv_bfloat16 *>(nbuf), n, lr,
      step, momentum, dampening, wd, nesterov, gradScale, skip, ctx, key, first);
  return cudaGetLastError();
}

cudaError_t unary(FloatKind t, UnaryKind k, const void *x, void *y, int64_t n, double factor,
                  cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, unaryT, k, x, y, n, factor, s);
}
cudaError_t unaryGrad(FloatKind t, UnaryGradKind k, const void *x, const void *dy, void *dx,
                      int64_t n, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, unaryGradT, k, x, dy, dx, n, s);
}
cudaError_t swiglu(FloatKind t, const void *g, const void *u, void *y, int64_t n,
                   cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, swigluT, g, u, y, n, s);
}
cudaError_t swigluGrad(FloatKind t, const void *g, const void *u, const void *dy, void *dg,
                       void *du, int64_t n, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, swigluGradT, g, u, dy, dg, du, n, s);
}
cudaError_t fill(FloatKind t, void *y, int64_t n, double v, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, fillT, y, n, v, s);
}
cudaError_t binary(FloatKind t, BinaryKind k, const void *a, const Shape &sa, const void *b,
                   const Shape &sb, void *out, const Shape &so, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, binaryT, k, a, sa, b, sb, out, so, s);
}
cudaError_t biasAdd(FloatKind t, const void *x, const void *b, void *y, int64_t rows,
                    int64_t cols, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, biasAddT, x, b, y, rows, cols, s);
}
cudaError_t broadcastTo(FloatKind t, const void *in, const Shape &si, void *out,
                        const Shape &so, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, broadcastToT, in, si, out, so, s);
}
int64_t sumToScratch(const Shape &si, const Shape &so) {
  int64_t rows, cols;
  return leadingRowsSum(si, so, rows, cols) ? columnSumScratch(rows, cols) : 0;
}
cudaError_t sumTo(FloatKind t, const void *in, const Shape &si, void *out, const Shape &so,
                  float *scratch, cudaStream_t s, bool outF32) {
  FSDP_NATIVE_DISPATCH_F32_OUT(outF32, t, sumToT, in, si, out, so, scratch, s);
}
cudaError_t transpose(FloatKind t, const void *x, const Shape &sx,
                      const std::vector<int64_t> &perm, void *y, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, transposeT, x, sx, perm, y, s);
}
cudaError_t slice(FloatKind t, const void *x, void *y, int64_t outer, int64_t full,
                  int64_t len, int64_t inner, int64_t offset, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, sliceT, x, y, outer, full, len, inner, offset, s);
}
cudaError_t sliceGrad(FloatKind t, const void *dy, void *dx, int64_t outer, int64_t full,
                      int64_t len, int64_t inner, int64_t offset, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, sliceGradT, dy, dx, outer, full, len, inner, offset, s);
}
cudaError_t place(FloatKind t, const void *x, void *y, int64_t outer, int64_t full,
                  int64_t len, int64_t inner, int64_t offset, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, placeT, x, y, outer, full, len, inner, offset, s);
}
cudaError_t embedding(FloatKind t, const void *table, const int32_t *ids, void *y, int64_t n,
                      int64_t vocab, int64_t width, long long *badPos, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, embeddingT, table, ids, y, n, vocab, width, badPos, s);
}
int64_t embeddingGradScratch(int64_t n) { return 2 * embedKeys(std::max<int64_t>(n, 1)); }
cudaError_t embeddingGrad(FloatKind t, const int32_t *ids, const void *dy, void *dtable,
                          float *scratch, int64_t n, int64_t vocab, int64_t width,
                          long long *badPos, cudaStream_t s, bool outF32) {
  FSDP_NATIVE_DISPATCH_F32_OUT(outF32, t, embeddingGradT, ids, dy, dtable, scratch, n, vocab, width,
                               badPos, s);
}
cudaError_t softmax(FloatKind t, const void *x, void *y, int64_t rows, int64_t cols,
                    cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, softmaxT, x, y, rows, cols, s);
}
cudaError_t softmaxGrad(FloatKind t, const void *y, const void *dy, void *dx, int64_t rows,
                        int64_t cols, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, softmaxGradT, y, dy, dx, rows, cols, s);
}
cudaError_t layerNorm(FloatKind t, const void *x, const void *g, const void *b, void *y,
                      int64_t rows, int64_t cols, double eps, cudaStream_t s,
                      LayerNormImpl impl) {
  FSDP_NATIVE_DISPATCH(t, layerNormT, x, g, b, y, rows, cols, eps, s, impl);
}
int64_t layerNormGradScratch(int64_t rows, int64_t cols) {
  int64_t w = lnGradPartials(rows);
  return w * 2 * cols + columnSumScratch(w, 2 * cols) + 2 * std::max<int64_t>(rows, 0);
}
cudaError_t layerNormGrad(FloatKind t, const void *x, const void *g, const void *dy, void *dx,
                          void *dg, void *db, float *scratch, int64_t rows, int64_t cols,
                          double eps, cudaStream_t s, const void *acc, LayerNormImpl impl,
                          bool paramGradsF32) {
  FSDP_NATIVE_DISPATCH_F32_OUT(paramGradsF32, t, layerNormGradT, x, g, dy, dx, dg, db, scratch,
                               rows, cols, eps, s, acc, impl);
}
cudaError_t residualLayerNorm(FloatKind t, const void *a, const void *b, const void *g,
                              const void *beta, void *sum, void *y, int64_t rows, int64_t cols,
                              double eps, cudaStream_t s, LayerNormImpl impl) {
  FSDP_NATIVE_DISPATCH(t, residualLayerNormT, a, b, g, beta, sum, y, rows, cols, eps, s, impl);
}
cudaError_t rmsNorm(FloatKind t, const void *x, const void *w, void *y, int64_t rows,
                    int64_t cols, double eps, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, rmsNormT, x, nullptr, w, nullptr, y, rows, cols, eps, s);
}
int64_t rmsNormGradScratch(int64_t rows, int64_t cols) {
  int64_t w = lnGradPartials(rows);
  return w * cols + columnSumScratch(w, cols) + 2 * std::max<int64_t>(rows, 0);
}
cudaError_t rmsNormGrad(FloatKind t, const void *x, const void *w, const void *dy, void *dx,
                        void *dw, float *scratch, int64_t rows, int64_t cols, double eps,
                        cudaStream_t s, const void *acc) {
  FSDP_NATIVE_DISPATCH(t, rmsNormGradT, x, w, dy, dx, dw, scratch, rows, cols, eps, s, acc);
}
cudaError_t residualRmsNorm(FloatKind t, const void *a, const void *b, const void *w, void *sum,
                            void *y, int64_t rows, int64_t cols, double eps, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, rmsNormT, a, b, w, sum, y, rows, cols, eps, s);
}
void ropeAngles(int64_t T, int64_t D, double theta, std::vector<float> &cs,
                std::vector<float> &sn) {
  int64_t half = D / 2;
  cs.assign(T * half, 0.f);
  sn.assign(T * half, 0.f);
  for (int64_t i = 0; i < half; ++i) {
    double freq = std::pow(theta, -2.0 * (double)i / (double)D);
    for (int64_t t = 0; t < T; ++t) {
      double a = (double)t * freq;
      cs[t * half + i] = (float)std::cos(a);
      sn[t * half + i] = (float)std::sin(a);
    }
  }
}
cudaError_t rope(FloatKind t, const void *x, void *y, int64_t B, int64_t T, int64_t C,
                 int64_t heads, const float *cs, const float *sn, bool grad, cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(t, ropeT, x, y, B, T, C, heads, cs, sn, grad ? -1.f : 1.f, s);
}
cudaError_t crossEntropy(FloatKind t, const void *logits, const int32_t *labels, float *loss,
                         double *scratch, int64_t rows, int64_t classes, int64_t stride,
                         long long *badPos, cudaStream_t s, double smoothing, CeIgnore ignore) {
  FSDP_NATIVE_DISPATCH(t, crossEntropyT, logits, labels, loss, scratch, rows, classes, stride,
                       badPos, smoothing, ignore, s);
}
cudaError_t crossEntropyGrad(FloatKind t, const void *logits, const int32_t *labels,
                             const float *dloss, void *dlogits, int64_t rows, int64_t classes,
                             int64_t stride, long long *badPos, cudaStream_t s, bool cacheRow,
                             double smoothing, CeIgnore ignore) {
  FSDP_NATIVE_DISPATCH(t, crossEntropyGradT, logits, labels, dloss, dlogits, rows, classes, stride,
                       badPos, smoothing, ignore, cacheRow, s);
}
cudaError_t crossEntropyFused(FloatKind t, const void *logits, const int32_t *labels,
                              const float *dloss, float *loss, void *dlogits, double *scratch,
                              int64_t rows, int64_t classes, int64_t stride, long long *badPos,
                              cudaStream_t s, bool cacheRow, double smoothing, CeIgnore ignore) {
  FSDP_NATIVE_DISPATCH(t, crossEntropyFusedT, logits, labels, dloss, loss, dlogits, scratch, rows,
                       classes, stride, badPos, smoothing, ignore, cacheRow, s);
}
cudaError_t adamw(const float *p, const void *g, FloatKind gradKind, const float *m,
                  const float *v, float *np, float *nm, float *nv, int64_t n, const float *lr,
                  const float *step, double beta1, double beta2, double eps, double wd,
                  const float *gradScale, const float *skip, cudaStream_t s) {
  return adamw(Params(p, np), g, gradKind, m, v, nm, nv, n, lr, step, beta1, beta2, eps, wd,
               gradScale, skip, s);
}
cudaError_t adamw(Params q, const void *g, FloatKind gradKind, const float *m, const float *v,
                  float *nm, float *nv, int64_t n, const float *lr, const float *step, double beta1,
                  double beta2, double eps, double wd, const float *gradScale, const float *skip,
                  cudaStream_t s) {
  FSDP_NATIVE_DISPATCH(gradKind, adamwT, q, g, m, v, nm, nv, n, lr, step, beta1, beta2, eps, wd,
                       gradScale, skip, s);
}

} // namespace fsdp::cuda::native
