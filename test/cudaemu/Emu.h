//===- Emu.h - CUDA device code compiled as C++ for the CPU emulator ------===//
//
// Force-included (g++ -include) into the CUDA backend's .cu files after
// emu_transform.py has rewritten their launches (`k<<<g, b, smem, s>>>(..)`
// -> cudaemu::launch) and dynamic shared arrays. It maps CUDA's qualifiers
// to C++, gives every thread of a block its own fiber (so __syncthreads,
// __syncwarp and warp shuffles block and resume like a GPU's barriers),
// and emulates WMMA fragments. Together with EmuRuntime.cpp (the CUDA
// runtime API), EmuCublasLt.cpp and EmuNccl.cpp it lets the CUDA backend's
// own tests and fsdp-run --device cuda run on a CPU: a check of the
// backend's logic (indexing, barriers, stream and graph use, library
// calls) before a GPU is available. It is never a GPU measurement: no
// timing, no tensor-core rounding, no memory model beyond barriers
// (test/cudaemu/README.md says what it does and does not catch).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_TEST_CUDAEMU_EMU_H
#define FSDP_TEST_CUDAEMU_EMU_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// --- qualifiers -------------------------------------------------------------------
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __shared__
// Blocks run one at a time on one host thread, so a function-local static
// is exactly one block's shared variable.
#define __shared__ static
#undef __constant__
#define __constant__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __align__
#define __align__(n) alignas(n)

namespace cudaemu {

// The running thread's coordinates (set by the scheduler on every switch).
extern uint3 gThreadIdx, gBlockIdx;
extern dim3 gBlockDim, gGridDim;

void syncThreads();
void syncWarp(unsigned mask);
/// Exchanges 8-byte slots within the warp: every lane in `mask` publishes
/// `bits`, and gets lane `src(lane)`'s; src < 0 keeps its own value.
uint64_t warpExchange(unsigned mask, uint64_t bits, int srcLane);
/// The current block's dynamic shared memory (poisoned with 0xff bytes at
/// the start of every block, like uninitialised memory that reads as NaN).
void *dynamicShared();

/// Runs or captures a kernel launch: grid x block fibers each calling
/// body(); `fn` identifies the kernel for cudaFuncSetAttribute (null when
/// the launch site cannot name it).
void launchGrid(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                std::function<void()> body);

template <typename T> const void *fnId(T *f) { return reinterpret_cast<const void *>(f); }

/// k<<<grid, block, smem, stream>>>(args...): the arguments are evaluated
/// and copied once at the launch (as CUDA copies them to the parameter
/// buffer) and each thread gets its own copy.
template <typename F, typename... A>
void launch(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t s, F call,
            A &&...args) {
  auto params = std::make_tuple(std::decay_t<A>(std::forward<A>(args))...);
  launchGrid(fn, grid, block, smem, s, [call, params]() {
    auto mine = params;
    std::apply(call, mine);
  });
}

template <typename T> uint64_t toBits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of > 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T> T fromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

} // namespace cudaemu

// cuda_runtime.h's template overload for kernels (compiled by nvcc only).
template <typename T>
cudaError_t cudaFuncSetAttribute(T *entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void *>(entry), attr, value);
}

#define threadIdx (static_cast<const uint3 &>(::cudaemu::gThreadIdx))
#define blockIdx (static_cast<const uint3 &>(::cudaemu::gBlockIdx))
#define blockDim (static_cast<const dim3 &>(::cudaemu::gBlockDim))
#define gridDim (static_cast<const dim3 &>(::cudaemu::gGridDim))

inline void __syncthreads() { ::cudaemu::syncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cudaemu::syncWarp(mask); }

template <typename T> T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  int lane = (int)(threadIdx.x % 32), base = lane / width * width;
  return ::cudaemu::fromBits<T>(
      ::cudaemu::warpExchange(mask, ::cudaemu::toBits(v), base + ((src % width) + width) % width));
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int laneMask, int width = 32) {
  int lane = (int)(threadIdx.x % 32), src = lane ^ laneMask;
  // A source outside the lane's width-segment returns its own value.
  if (src / width != lane / width)
    src = -1;
  return ::cudaemu::fromBits<T>(::cudaemu::warpExchange(mask, ::cudaemu::toBits(v), src));
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = (int)(threadIdx.x % 32), src = lane + (int)delta;
  if (src / width != lane / width || src >= 32)
    src = -1;
  return ::cudaemu::fromBits<T>(::cudaemu::warpExchange(mask, ::cudaemu::toBits(v), src));
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = (int)(threadIdx.x % 32), src = lane - (int)delta;
  if (src < 0 || src / width != lane / width)
    src = -1;
  return ::cudaemu::fromBits<T>(::cudaemu::warpExchange(mask, ::cudaemu::toBits(v), src));
}

// Blocks run one at a time and threads switch only at barriers, so a
// read-modify-write is atomic.
template <typename T> T atomicMin(T *p, T v) {
  T old = *p;
  if (v < old)
    *p = v;
  return old;
}
template <typename T> T atomicMax(T *p, T v) {
  T old = *p;
  if (v > old)
    *p = v;
  return old;
}
template <typename T> T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T> T __ldg(const T *p) { return *p; }

// Device math that C++ spells differently.
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
using std::isfinite;
using std::isinf;
using std::isnan;

// --- WMMA ---------------------------------------------------------------------------
// A fragment's element layout is opaque on the GPU, so code may only load,
// store, fill and multiply whole fragments (the backend does). Here every
// lane keeps the whole tile: loads and stores by the 32 lanes agree, and
// mma_sync accumulates in f32 in k order (the tensor cores' order within a
// 16-wide product is unspecified; tests bound it). load, store and mma are
// warp-collective: each "waits until all warp lanes have arrived" (CUDA C++
// Programming Guide, WMMA), so each begins with a full-warp barrier;
// without it a lane could store a tile before another lane loaded it.
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct FragShape;
template <int M, int N, int K> struct FragShape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct FragShape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct FragShape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = FragShape<Use, M, N, K>::rows;
  static constexpr int cols = FragShape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  using element_type = T;
  T x[num_elements]; // row-major, whatever the memory layout it was loaded from
};

template <typename T> inline float toF(T v) { return static_cast<float>(v); }
inline float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float toF(__half v) { return __half2float(v); }

template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L> &f, const T &v) {
  for (auto &e : f.x)
    e = v;
}
template <typename Use, int M, int N, int K, typename T, typename L>
void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const T *p, unsigned ld) {
  static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>,
                "an operand fragment names its layout");
  ::cudaemu::syncWarp(0xffffffffu);
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] =
          std::is_same_v<L, row_major> ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r];
}
template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T> &f, const T *p, unsigned ld,
                      layout_t layout) {
  ::cudaemu::syncWarp(0xffffffffu);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r];
}
template <int M, int N, int K, typename T>
void store_matrix_sync(T *p, const fragment<accumulator, M, N, K, T> &f, unsigned ld,
                       layout_t layout) {
  ::cudaemu::syncWarp(0xffffffffu);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      (layout == mem_row_major ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r]) = f.x[r * N + c];
}
template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB,
          typename TC>
void mma_sync(fragment<accumulator, M, N, K, TC> &d, const fragment<matrix_a, M, N, K, TA, LA> &a,
              const fragment<matrix_b, M, N, K, TB, LB> &b,
              const fragment<accumulator, M, N, K, TC> &c) {
  static_assert(M * N <= 256, "fragment larger than the scratch");
  // Every lane holds the same operands: lane 0 multiplies for the warp
  // (32x less work), the others copy its product.
  static TC product[32][256];
  unsigned t = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
  TC *out = product[t / 32 % 32];
  ::cudaemu::syncWarp(0xffffffffu);
  if (t % 32 == 0)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        float s = c.x[i * N + j];
        for (int k = 0; k < K; ++k)
          s += toF(a.x[i * K + k]) * toF(b.x[k * N + j]);
        out[i * N + j] = s;
      }
  ::cudaemu::syncWarp(0xffffffffu);
  std::memcpy(d.x, out, sizeof(TC) * M * N);
  ::cudaemu::syncWarp(0xffffffffu); // read before the next product overwrites it
}
} // namespace wmma
} // namespace nvcuda

// --- mma.sync / ldmatrix (runtime/cuda/CudaMma.cuh) --------------------------------
// Unlike WMMA these fragments are not opaque: PTX specifies which lane
// holds which element (PTX ISA, "Matrix Fragments for mma.m16n8k16" and
// "ldmatrix"), and the kernels read and write fragment registers
// directly (an accumulator becomes the next product's A operand). So
// here each lane holds exactly its own registers, as on the GPU, and the
// warp-collective instructions gather the warp's registers through a
// per-warp scratch between two warp barriers. A kernel that assumes the
// wrong layout gets wrong products here as it would on a GPU.
#define FSDP_CUDAEMU_MMA 1
namespace cudaemu {
/// Fails the launch unless p is a 16-byte aligned row of 16 bytes inside
/// the block's dynamic shared memory (ldmatrix's operand).
void checkLdmatrixRow(const void *p);

/// cp.async.cg.shared.global (n = 16; also 4, 8): queued for the calling
/// thread, and copied only when a cp.async.wait_group lets its group
/// complete, so shared memory read before the wait still holds what it
/// held (the poison of a fresh block) and a missing wait shows.
void cpAsync(void *dst, const void *src, size_t n);
/// The offset of p in the block's dynamic shared memory (the emulated
/// shared address; fails the launch if p is outside it).
uint32_t sharedOffset(const void *p);
/// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} for the calling
/// thread of its warpgroup: queued, and performed at the wgmma.wait_group
/// that covers its group, after every thread of the warpgroup arrives
/// (then d, the shared-memory operands and the A registers queued here
/// are read: reading d before the wait sees its old values, as changing
/// an operand before the wait changes the product). a: the thread's four
/// A registers (mma.sync's A layout for its warp's 16 rows), or null for
/// A in shared memory at descriptor da. Descriptors are decoded as the
/// PTX ISA's canonical layouts (runtime/cuda/CudaMma.cuh, smemDesc).
void wgmma(float *d, int n, const uint32_t *a, uint64_t da, uint64_t db, bool accumulate,
           bool tnspA, bool tnspB, bool bf16);
/// wgmma.fence (checks the thread is in a whole warpgroup).
void wgmmaFence();
/// wgmma.commit_group: the thread's queued products become one group.
void wgmmaCommit();
/// wgmma.wait_group N: a warpgroup barrier, then all but the newest N
/// committed groups are performed.
void wgmmaWait(int pending);
/// cp.async.commit_group: the thread's queued copies become one group.
void cpAsyncCommit();
/// cp.async.wait_group N: completes all but the newest N committed groups.
void cpAsyncWait(int pending);

inline unsigned flatThread() {
  return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
}
inline float bitsToFloat(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

/// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8 i .. 8 i + 7
/// name the rows of matrix i; register i of lane l receives matrix i's
/// row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 (low half first), or
/// with .trans its elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
inline void ldmatrixX4(uint32_t (&r)[4], const void *row, bool trans) {
  static const uint16_t *rows[32][32];
  unsigned t = flatThread(), lane = t % 32;
  checkLdmatrixRow(row);
  rows[t / 32 % 32][lane] = static_cast<const uint16_t *>(row);
  syncWarp(0xffffffffu); // every lane has named its row
  const uint16_t *const *w = rows[t / 32 % 32];
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      lo = w[i * 8 + lane / 4][2 * (lane % 4)];
      hi = w[i * 8 + lane / 4][2 * (lane % 4) + 1];
    } else {
      lo = w[i * 8 + 2 * (lane % 4)][lane / 4];
      hi = w[i * 8 + 2 * (lane % 4) + 1][lane / 4];
    }
    r[i] = (uint32_t)lo | (uint32_t)hi << 16;
  }
  syncWarp(0xffffffffu); // every lane has read (the rows may change after)
}

/// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
/// d = a b + d. A (16 x 16): register j of lane l = 4 g + q holds row
/// g + 8 (j % 2), columns 2 q + 8 (j / 2) and + 1; B (16 x 8): register j
/// holds rows 2 q + 8 j and + 1 of column g; C/D (16 x 8): element i is
/// row g + 8 (i / 2), column 2 q + i % 2. Accumulates in f32 in k order.
inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf16) {
  static uint32_t sa[32][32][4], sb[32][32][2];
  unsigned t = flatThread(), lane = t % 32, w = t / 32 % 32;
  std::memcpy(sa[w][lane], a, sizeof a);
  std::memcpy(sb[w][lane], b, sizeof b);
  syncWarp(0xffffffffu); // every lane has published its operands
  auto half = [](uint32_t reg, int hi) { return (uint16_t)(hi ? reg >> 16 : reg & 0xffffu); };
  auto A = [&](int row, int col) {
    return bitsToFloat(half(sa[w][(row % 8) * 4 + (col % 8) / 2][(row >= 8) + 2 * (col >= 8)],
                            col % 2),
                       bf16);
  };
  auto B = [&](int k, int col) {
    return bitsToFloat(half(sb[w][col * 4 + (k % 8) / 2][k >= 8], k % 2), bf16);
  };
  float out[4];
  int g = (int)lane / 4, q = (int)lane % 4;
  for (int i = 0; i < 4; ++i) {
    int row = g + 8 * (i / 2), col = 2 * q + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k)
      s += A(row, k) * B(k, col);
    out[i] = s;
  }
  syncWarp(0xffffffffu); // every lane has read the operands
  std::memcpy(d, out, sizeof out);
}
} // namespace cudaemu

#endif // FSDP_TEST_CUDAEMU_EMU_H
