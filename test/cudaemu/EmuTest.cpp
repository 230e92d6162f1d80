//===- EmuTest.cpp - the CUDA emulator's own checks -----------------------===//
//
// What test/cudaemu/README.md promises the emulator catches, each shown on
// a small kernel written against Emu.h (launched through cudaemu::launch,
// what emu_transform.py makes of `k<<<...>>>`): barriers and shuffles
// that work, a deadlock, a bad shuffle mask, a missing barrier, the
// dynamic shared memory opt-in, copies outside allocations, stream capture
// rules and graphs that replay the captured arguments, mma.sync and
// ldmatrix against the PTX fragment tables, wgmma against the PTX canonical
// shared-memory layouts, cp.async landing at its wait, and (stream threads) a
// race between streams that only an event wait prevents.
//
//===----------------------------------------------------------------------===//

#include "test/cudaemu/Emu.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

template <typename T> T *devAlloc(size_t n) {
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T *>(p);
}

// A block sum: warp shuffles, then warp 0 over the warps' partials.
void blockSumKernel(const int *x, int *out) {
  __shared__ int partial[32];
  int v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0)
    partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0;
    for (int o = 16; o > 0; o >>= 1)
      v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0)
      out[blockIdx.x] = v;
  }
}

TEST(CudaEmu, BarriersAndShufflesReduceABlock) {
  const int blocks = 3, threads = 256;
  std::vector<int> h(blocks * threads);
  std::iota(h.begin(), h.end(), 1);
  int *x = devAlloc<int>(h.size()), *out = devAlloc<int>(blocks);
  ASSERT_EQ(cudaMemcpy(x, h.data(), h.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  cudaemu::launch(nullptr, blocks, threads, 0, nullptr,
                  [=](auto... a) { blockSumKernel(a...); }, x, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<int> got(blocks);
  ASSERT_EQ(cudaMemcpy(got.data(), out, blocks * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    int first = b * threads + 1, last = first + threads - 1;
    EXPECT_EQ(got[b], (first + last) * threads / 2) << "block " << b;
  }
  cudaFree(x);
  cudaFree(out);
}

// Lane 0 waits at __syncthreads while lanes 1..31 wait for it at a warp
// barrier: a hang on a GPU, a failed launch here.
void deadlockKernel() {
  if (threadIdx.x == 0)
    __syncthreads();
  else
    __syncwarp();
}

TEST(CudaEmu, ADeadlockFailsTheLaunch) {
  cudaemu::launch(nullptr, 1, 32, 0, nullptr, [=](auto... a) { deadlockKernel(a...); });
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  // The failure is sticky, as a GPU's launch failure is, until a reset.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

void exitedLaneShuffle(int *out) {
  if (threadIdx.x >= 16)
    return; // lanes 16..31 leave; the full mask still names them
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
void partialWarpShuffle(int *out) {
  // 40 threads: the second warp has 8 lanes, the full mask names 32.
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

TEST(CudaEmu, AShuffleMaskNamingMissingLanesFails) {
  int *out = devAlloc<int>(64);
  cudaemu::launch(nullptr, 1, 32, 0, nullptr, [=](auto... a) { exitedLaneShuffle(a...); }, out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  cudaDeviceReset();
  cudaemu::launch(nullptr, 1, 40, 0, nullptr, [=](auto... a) { partialWarpShuffle(a...); }, out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  cudaDeviceReset();
  cudaFree(out);
}

// Each thread reads its neighbour's shared slot; without the barrier the
// neighbour has not written it yet in one of the two thread orders.
// (base differs per launch: a static shared array keeps the last block's
// values, where a GPU's would be undefined.)
template <bool Barrier> void neighbourKernel(int *out, int base) {
  __shared__ int s[64];
  s[threadIdx.x] = (int)threadIdx.x * 10 + base;
  if (Barrier)
    __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

TEST(CudaEmu, AMissingBarrierChangesTheResult) {
  int *out = devAlloc<int>(64);
  std::vector<int> want(64), got(64);
  for (int i = 0; i < 64; ++i)
    want[i] = (i + 1) % 64 * 10;
  cudaemu::launch(nullptr, 1, 64, 0, nullptr, [=](auto... a) { neighbourKernel<true>(a...); },
                  out, 0);
  ASSERT_EQ(cudaMemcpy(got.data(), out, 256, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want);
  for (int &w : want)
    w += 1000;
  cudaemu::launch(nullptr, 1, 64, 0, nullptr, [=](auto... a) { neighbourKernel<false>(a...); },
                  out, 1000);
  ASSERT_EQ(cudaMemcpy(got.data(), out, 256, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_NE(got, want);
  cudaFree(out);
}

void smemKernel(float *out) {
  float *sm = static_cast<float *>(cudaemu::dynamicShared());
  sm[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = sm[(threadIdx.x + 1) % blockDim.x];
}

TEST(CudaEmu, DynamicSharedMemoryAbove48KiBNeedsTheOptIn) {
  float *out = devAlloc<float>(32);
  auto launch = [&](size_t smem) {
    cudaemu::launch(cudaemu::fnId(smemKernel), 1, 32, smem, nullptr,
                    [=](auto... a) { smemKernel(a...); }, out);
    return cudaGetLastError();
  };
  EXPECT_EQ(launch(48 << 10), cudaSuccess);
  EXPECT_EQ(launch(64 << 10), cudaErrorInvalidValue);
  ASSERT_EQ(cudaFuncSetAttribute(smemKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 64 << 10),
            cudaSuccess);
  EXPECT_EQ(launch(64 << 10), cudaSuccess);
  EXPECT_EQ(launch(65 << 10), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFuncSetAttribute(smemKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 228 << 10),
            cudaErrorInvalidValue); // past the H100's 227 KiB
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  cudaemu::launch(nullptr, 1, 1025, 0, nullptr, [=](auto... a) { smemKernel(a...); }, out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaFree(out);
}

// mma.sync m16n8k16 and ldmatrix x4 against the PTX ISA's fragment
// tables, written out here element by element (not through the backend's
// CudaMma.cuh helpers): A (16 x 16) in shared memory row-major with 24
// elements a row, Bt (8 x 16, B's transpose) likewise. Small integers:
// every product and sum is exact in f32.
uint16_t bf16Bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return (uint16_t)(w >> 16); // exact for the small integers used
}

void mmaSpecKernel(float *d, uint32_t *lm, uint32_t *lmt) {
  const uint16_t *A = static_cast<const uint16_t *>(cudaemu::dynamicShared());
  const uint16_t *Bt = A + 16 * 24;
  unsigned lane = threadIdx.x, g = lane >> 2, q = lane % 4;
  auto pack = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; };
  // A: a_i at row g (i in 0, 1, 4, 5) or g + 8, column 2 q + (i & 1),
  // + 8 for i >= 4; register j holds a_2j (low) and a_2j+1.
  uint32_t a[4], b[2];
  for (int j = 0; j < 4; ++j) {
    int i = 2 * j, row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
    int col = 2 * q + (i >= 4 ? 8 : 0);
    a[j] = pack(A[row * 24 + col], A[row * 24 + col + 1]);
  }
  // B: b_i at row (k) 2 q + (i & 1), + 8 for i >= 2, column g.
  for (int j = 0; j < 2; ++j) {
    int k = 2 * q + (j ? 8 : 0);
    b[j] = pack(Bt[g * 24 + k], Bt[g * 24 + k + 1]);
  }
  float c[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  cudaemu::mma16816(c, a, b, true);
  // C: c_i at row g (i < 2) or g + 8, column 2 q + (i & 1).
  for (int i = 0; i < 4; ++i)
    d[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * q + (i & 1)] = c[i];
  // ldmatrix x4 over A's four 8 x 8 quarters: lane l names row l % 8 of
  // quarter l / 8 (rows + 8 for odd quarters, columns + 8 for the last two).
  const uint16_t *rowp = A + ((lane % 8) + (lane / 8 % 2) * 8) * 24 + (lane / 16) * 8;
  uint32_t r[4];
  cudaemu::ldmatrixX4(r, rowp, false);
  for (int i = 0; i < 4; ++i)
    lm[lane * 4 + i] = r[i];
  cudaemu::ldmatrixX4(r, rowp, true);
  for (int i = 0; i < 4; ++i)
    lmt[lane * 4 + i] = r[i];
}

TEST(CudaEmu, MmaAndLdmatrixFollowThePtxFragmentTables) {
  float Af[16][16], Btf[8][16];
  std::vector<uint16_t> sm(16 * 24 + 8 * 24, 0);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) {
      Af[r][c] = (float)((r * 7 + c * 3) % 11 - 5);
      sm[r * 24 + c] = bf16Bits(Af[r][c]);
    }
  for (int n = 0; n < 8; ++n)
    for (int k = 0; k < 16; ++k) {
      Btf[n][k] = (float)((n * 5 + k) % 9 - 4);
      sm[16 * 24 + n * 24 + k] = bf16Bits(Btf[n][k]);
    }
  float *d = devAlloc<float>(16 * 8);
  uint32_t *lm = devAlloc<uint32_t>(128), *lmt = devAlloc<uint32_t>(128);
  // The kernel copies its operands into dynamic shared memory first.
  uint16_t *src = devAlloc<uint16_t>(sm.size());
  ASSERT_EQ(cudaMemcpy(src, sm.data(), sm.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  size_t n = sm.size();
  cudaemu::launch(nullptr, 1, 32, n * 2, nullptr,
                  [=](auto... x) {
                    uint16_t *s = static_cast<uint16_t *>(cudaemu::dynamicShared());
                    for (size_t i = threadIdx.x; i < n; i += 32)
                      s[i] = src[i];
                    __syncwarp();
                    mmaSpecKernel(x...);
                  },
                  d, lm, lmt);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> got(16 * 8);
  std::vector<uint32_t> gl(128), glt(128);
  ASSERT_EQ(cudaMemcpy(got.data(), d, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gl.data(), lm, 512, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(glt.data(), lmt, 512, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) {
      float want = 0.5f;
      for (int k = 0; k < 16; ++k)
        want += Af[r][k] * Btf[c][k];
      EXPECT_EQ(got[r * 8 + c], want) << "D[" << r << "][" << c << "]";
    }
  // ldmatrix: register i of lane l = 4 g + q holds quarter i's (row g,
  // columns 2 q, 2 q + 1); .trans: its (row 2 q, column g), (2 q + 1, g).
  // Quarter i covers rows 8 (i % 2) .., columns 8 (i / 2) .. of A.
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      int g = l / 4, q = l % 4, r0 = 8 * (i % 2), c0 = 8 * (i / 2);
      uint32_t want = bf16Bits(Af[r0 + g][c0 + 2 * q]) |
                      (uint32_t)bf16Bits(Af[r0 + g][c0 + 2 * q + 1]) << 16;
      uint32_t wantT = bf16Bits(Af[r0 + 2 * q][c0 + g]) |
                       (uint32_t)bf16Bits(Af[r0 + 2 * q + 1][c0 + g]) << 16;
      EXPECT_EQ(gl[l * 4 + i], want) << "lane " << l << " register " << i;
      EXPECT_EQ(glt[l * 4 + i], wantT) << "lane " << l << " register " << i << " (.trans)";
    }
  for (void *p : {(void *)d, (void *)lm, (void *)lmt, (void *)src})
    cudaFree(p);
  // A misaligned row fails the launch (sticky, as on a GPU, until a reset).
  cudaemu::launch(nullptr, 1, 32, 64, nullptr,
                  [=](auto...) {
                    uint32_t r[4];
                    cudaemu::ldmatrixX4(r, static_cast<char *>(cudaemu::dynamicShared()) + 2,
                                        false);
                  },
                  0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
}

// wgmma.mma_async against the PTX ISA's canonical shared-memory layouts,
// written here from the ISA's own bf16 examples ("Canonical Layouts":
// MN-major with no swizzle, 32- and 64-byte swizzles, their exact CuTe
// layouts and LBO / SBO) and its K-major 128-byte form, not through
// CudaMma.cuh: A (64 x 16) K-major 128-byte swizzled, B (16 x N) in each
// example's layout, descriptors assembled by hand. Small integers: exact.
struct WgmmaExample {
  int n, swizzleBits, mode; // N; Swizzle<B,4,3>'s B; the descriptor's mode
  uint32_t lbo, sbo;        // bytes
  int (*elem)(int mn, int k); // the exact layout: element offset of (mn, k)
};

size_t swizzled(size_t byte, int bits) {
  return byte ^ (((byte >> 7) & ((1u << bits) - 1)) << 4);
}

TEST(CudaEmu, WgmmaReadsThePtxCanonicalLayouts) {
  const WgmmaExample examples[] = {
      // ((8,1,2),(8,2)):((1,8,64),(8,128)), LBO 128, SBO 64 elements
      {16, 0, 0, 256, 128,
       [](int mn, int k) { return mn % 8 + (mn / 8) * 64 + (k % 8) * 8 + (k / 8) * 128; }},
      // Swizzle<1,4,3> o ((8,2,2),(8,2)):((1,8,128),(16,256)), LBO 128, SBO 256
      {32, 1, 3, 256, 512,
       [](int mn, int k) {
         return mn % 8 + (mn / 8 % 2) * 8 + (mn / 16) * 128 + (k % 8) * 16 + (k / 8) * 256;
       }},
      // Swizzle<2,4,3> o ((8,4,2),(8,2)):((1,8,256),(32,512)), LBO 256, SBO 512
      {64, 2, 2, 512, 1024,
       [](int mn, int k) {
         return mn % 8 + (mn / 8 % 4) * 8 + (mn / 32) * 256 + (k % 8) * 32 + (k / 8) * 512;
       }},
  };
  for (const WgmmaExample &ex : examples) {
    SCOPED_TRACE("N-major B, N = " + std::to_string(ex.n));
    const size_t bBase = 8192, bytes = bBase + 4096;
    std::vector<uint8_t> sm(bytes, 0);
    float Af[64][16], Bf[16][64];
    auto put = [&](size_t byte, float v) {
      uint16_t h = bf16Bits(v);
      std::memcpy(&sm[byte], &h, 2);
    };
    // A: Swizzle<3,4,3> o ((8,m),(8,2)):((64,512),(1,8)) elements (SBO 1024 bytes).
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < 16; ++k) {
        Af[r][k] = (float)((r * 5 + k * 3) % 7 - 3);
        put(swizzled(2 * (size_t)((r % 8) * 64 + (r / 8) * 512 + k), 3), Af[r][k]);
      }
    for (int k = 0; k < 16; ++k)
      for (int c = 0; c < ex.n; ++c) {
        Bf[k][c] = (float)((k * 3 + c * 7) % 9 - 4);
        put(bBase + swizzled(2 * (size_t)ex.elem(c, k), ex.swizzleBits), Bf[k][c]);
      }
    auto desc = [](size_t addr, uint32_t lbo, uint32_t sbo, int mode) {
      return (uint64_t)(addr >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32 |
             (uint64_t)mode << 62;
    };
    uint64_t da = desc(0, 16, 1024, 1), db = desc(bBase, ex.lbo, ex.sbo, ex.mode);
    uint8_t *src = devAlloc<uint8_t>(bytes);
    float *d = devAlloc<float>(64 * 64);
    ASSERT_EQ(cudaMemcpy(src, sm.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    int n = ex.n;
    cudaemu::launch(nullptr, 1, 128, bytes, nullptr,
                    [=](auto...) {
                      uint8_t *s = static_cast<uint8_t *>(cudaemu::dynamicShared());
                      for (size_t i = threadIdx.x; i < bytes; i += 128)
                        s[i] = src[i];
                      __syncthreads();
                      float acc[32];
                      for (float &x : acc)
                        x = 1.f; // scale-d 1: d = A B + 1
                      cudaemu::wgmmaFence();
                      cudaemu::wgmma(acc, n, nullptr, da, db, true, false, true, true);
                      cudaemu::wgmmaCommit();
                      cudaemu::wgmmaWait(0);
                      // d[4 j + e]: row 16 w + g + 8 (e / 2), column 8 j + 2 q + e % 2
                      unsigned t = threadIdx.x, w = t / 32, g = t % 32 / 4, q = t % 4;
                      for (int i = 0; i < n / 2; ++i)
                        d[(16 * w + g + 8 * (i / 2 % 2)) * 64 + 8 * (i / 4) + 2 * q + i % 2] =
                            acc[i];
                    },
                    0);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<float> got(64 * 64);
    ASSERT_EQ(cudaMemcpy(got.data(), d, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int bad = 0;
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < ex.n; ++c) {
        float want = 1.f;
        for (int k = 0; k < 16; ++k)
          want += Af[r][k] * Bf[k][c];
        if (got[r * 64 + c] != want && bad++ < 3)
          ADD_FAILURE() << "D[" << r << "][" << c << "] = " << got[r * 64 + c] << ", want "
                        << want;
      }
    cudaFree(src);
    cudaFree(d);
  }
  // A product some thread of the warpgroup never waits for fails the
  // launch, as does a warpgroup with a missing warp.
  cudaemu::launch(nullptr, 1, 128, 1024, nullptr,
                  [=](auto...) {
                    float acc[8] = {};
                    cudaemu::wgmma(acc, 16, nullptr, 0, 0, false, false, false, true);
                    cudaemu::wgmmaCommit();
                  },
                  0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
  cudaemu::launch(nullptr, 1, 96, 1024, nullptr, [=](auto...) { cudaemu::wgmmaFence(); }, 0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
}

// cp.async lands only when a wait covers its group: before the wait the
// shared slot still holds the block's poison (0xff bytes).
void cpAsyncKernel(const uint32_t *src, uint32_t *out) {
  uint32_t *sm = static_cast<uint32_t *>(cudaemu::dynamicShared());
  int t = threadIdx.x;
  cudaemu::cpAsync(sm + 4 * t, src + 4 * t, 16);
  cudaemu::cpAsyncCommit();
  cudaemu::cpAsync(sm + 128 + 4 * t, src + 128 + 4 * t, 16);
  cudaemu::cpAsyncCommit();
  out[t] = sm[4 * t];             // no wait: poison
  cudaemu::cpAsyncWait(1);        // the first group only
  out[32 + t] = sm[4 * t];        // landed
  out[64 + t] = sm[128 + 4 * t];  // still poison
  cudaemu::cpAsyncWait(0);
  out[96 + t] = sm[128 + 4 * t];  // landed
}

TEST(CudaEmu, CpAsyncLandsAtItsWait) {
  std::vector<uint32_t> h(256);
  std::iota(h.begin(), h.end(), 1u);
  uint32_t *src = devAlloc<uint32_t>(256), *out = devAlloc<uint32_t>(128);
  ASSERT_EQ(cudaMemcpy(src, h.data(), 1024, cudaMemcpyHostToDevice), cudaSuccess);
  cudaemu::launch(nullptr, 1, 32, 1024, nullptr, [=](auto... a) { cpAsyncKernel(a...); }, src,
                  out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<uint32_t> got(128);
  ASSERT_EQ(cudaMemcpy(got.data(), out, 512, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(got[t], 0xffffffffu) << t;
    EXPECT_EQ(got[32 + t], h[4 * t]) << t;
    EXPECT_EQ(got[64 + t], 0xffffffffu) << t;
    EXPECT_EQ(got[96 + t], h[128 + 4 * t]) << t;
  }
  cudaFree(src);
  cudaFree(out);
  // A destination outside dynamic shared memory fails the launch.
  uint32_t *g = devAlloc<uint32_t>(8);
  cudaemu::launch(nullptr, 1, 32, 64, nullptr,
                  [=](auto...) { cudaemu::cpAsync(g, g + 4, 16); }, 0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
}

TEST(CudaEmu, CopiesMustStayInsideAnAllocation) {
  float *d = devAlloc<float>(16);
  std::vector<float> h(32);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 64, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 68, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d + 1, h.data(), 64, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  // A host pointer where the copy says device.
  EXPECT_EQ(cudaMemcpy(h.data(), d, 64, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemsetAsync(d + 8, 0, 64, nullptr), cudaErrorInvalidValue);
  cudaGetLastError();
  cudaFree(d);
}

void addKernel(float *x, float v) { x[threadIdx.x] += v; }

TEST(CudaEmu, AGraphReplaysTheArgumentsItWasCapturedWith) {
  float *x = devAlloc<float>(4);
  ASSERT_EQ(cudaMemset(x, 0, 16), cudaSuccess);
  cudaStream_t s, side;
  ASSERT_EQ(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, 0), cudaSuccess);
  float v = 1.f;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaemu::launch(nullptr, 1, 4, 0, s, [=](auto... a) { addKernel(a...); }, x, v);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureImplicit);
  std::vector<float> pageable(4);
  EXPECT_EQ(cudaMemcpyAsync(pageable.data(), x, 16, cudaMemcpyDeviceToHost, s),
            cudaErrorStreamCaptureUnsupported);
  cudaGraph_t g;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  cudaGetLastError();
  std::vector<float> h(4);
  ASSERT_EQ(cudaMemcpy(h.data(), x, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[0], 0.f) << "a captured kernel ran at capture";
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  v = 100.f; // too late: the graph holds 1
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  // s is non-blocking: cudaMemcpy on the legacy stream does not wait for it.
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), x, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, std::vector<float>(4, 2.f));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);

  // A stream forked into the capture must be joined back.
  cudaEvent_t fork, join;
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), cudaSuccess);
  for (bool joined : {true, false}) {
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, s), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
    cudaemu::launch(nullptr, 1, 4, 0, side, [=](auto... a) { addKernel(a...); }, x, 1.f);
    if (joined) {
      ASSERT_EQ(cudaEventRecord(join, side), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(s, join, 0), cudaSuccess);
    }
    cudaGraph_t g2 = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &g2), joined ? cudaSuccess : cudaErrorStreamCaptureUnjoined);
    if (g2)
      cudaGraphDestroy(g2);
  }
  cudaGetLastError();
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(s);
  cudaStreamDestroy(side);
  cudaFree(x);
}

TEST(CudaEmu, DeviceMemoryIsBounded) {
  size_t freeB = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&freeB, &total), cudaSuccess);
  void *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, freeB + 1), cudaErrorMemoryAllocation);
  EXPECT_EQ(p, nullptr);
  cudaGetLastError();
}

} // namespace

namespace {

// CUDAEMU_STREAMS=threads (ctest runs this binary a second time so): a
// copy on one stream that reads what an operation on another stream
// writes gets the old value without an event wait and the new one with it.
TEST(CudaEmu, StreamThreadsRaceWithoutAnEventWait) {
  const char *mode = std::getenv("CUDAEMU_STREAMS");
  if (!mode || std::string(mode) != "threads")
    GTEST_SKIP() << "streams run at issue here (CUDAEMU_STREAMS=threads runs this case)";
  int *x = devAlloc<int>(1), *y = devAlloc<int>(1);
  cudaStream_t producer, consumer;
  ASSERT_EQ(cudaStreamCreateWithPriority(&producer, cudaStreamNonBlocking, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithPriority(&consumer, cudaStreamNonBlocking, -1), cudaSuccess);
  cudaEvent_t written;
  ASSERT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);
  for (bool wait : {false, true}) {
    ASSERT_EQ(cudaMemset(x, 0, 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(y, 0xff, 4), cudaSuccess);
    // The producer writes x = 7 on its stream. Without the wait it holds
    // until the host has seen the consumer finish (so the copy cannot
    // win by luck of scheduling); with the wait it writes at once.
    struct Write {
      int *x;
      bool hold;
      std::atomic<bool> released{false};
    };
    static Write w;
    w.x = x;
    w.hold = !wait;
    w.released = false;
    ASSERT_EQ(cudaLaunchHostFunc(
                  producer,
                  [](void *p) {
                    auto *w = static_cast<Write *>(p);
                    for (int i = 0; w->hold && !w->released && i < 10000; ++i)
                      std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    *w->x = 7;
                  },
                  &w),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(written, producer), cudaSuccess);
    if (wait) {
      ASSERT_EQ(cudaStreamWaitEvent(consumer, written, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(y, x, 4, cudaMemcpyDeviceToDevice, consumer), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(consumer), cudaSuccess);
    w.released = true;
    int got = -1;
    ASSERT_EQ(cudaMemcpy(&got, y, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, wait ? 7 : 0) << (wait ? "with" : "without") << " the event wait";
    ASSERT_EQ(cudaStreamSynchronize(producer), cudaSuccess);
  }
  cudaEventDestroy(written);
  cudaStreamDestroy(producer);
  cudaStreamDestroy(consumer);
  cudaFree(x);
  cudaFree(y);
}

} // namespace
