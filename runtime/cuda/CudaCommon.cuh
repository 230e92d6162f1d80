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

#include "runtime/cuda/CudaKernels.h"

#include <algorithm>

namespace fsdp::cuda {
namespace {

constexpr int kThreads = 256;
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

} // namespace
} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDACOMMON_CUH
