//===- flash_bench.cpp - the attention kernels' speed on one GPU ----------===//
//
// Times runtime/cuda/CudaFlash's forward and backward (the three
// implementations: CUDA cores, WMMA tensor cores with the score tiles in
// shared memory, mma.sync with them in registers; mma.sync once more on q,
// k, v read in place from one packed [B, T, 3C] tensor, as
// fsdp.attention_qkv runs it) on GPT-2's attention shape
// and prints ms per call and TFLOP/s (the causal products only: 2 B H T^2
// D for the forward's two GEMMs halved by the mask, 2.5x that for the
// backward), with the CUDA-core kernels as the reference measured in the
// same run. A benchmark, not a test: scripts/gpu-check.sh runs it where a
// GPU is lent.
//
//   FlashBench [B T heads D]   (default 16 1024 12 64, bf16, causal)
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaFlash.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace flash = fsdp::cuda::flash;
using fsdp::cuda::FloatKind;

namespace {

int fail(const char *what, cudaError_t e) {
  std::fprintf(stderr, "FlashBench: %s: %s\n", what, cudaGetErrorString(e));
  return 1;
}

} // namespace

int main(int argc, char **argv) {
  int64_t B = 16, T = 1024, H = 12, D = 64;
  if (argc == 5) {
    B = std::atoll(argv[1]);
    T = std::atoll(argv[2]);
    H = std::atoll(argv[3]);
    D = std::atoll(argv[4]);
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: FlashBench [B T heads D]\n");
    return 2;
  }
  int64_t C = H * D;
  if (!flash::check(B, T, C, H, H)) {
    std::fprintf(stderr, "FlashBench: shape not taken by the kernels\n");
    return 2;
  }
  size_t n = size_t(B * T * C);
  std::vector<uint16_t> host(n);
  uint32_t x = 12345;
  for (auto &h : host) { // bf16 of uniform values in [-1, 1)
    x = x * 1664525u + 1013904223u;
    float f = (float)(x >> 8) / float(1 << 24) * 2.f - 1.f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h = uint16_t(bits >> 16);
  }
  void *buf[8] = {};
  for (auto &p : buf)
    if (cudaError_t e = cudaMalloc(&p, 2 * n))
      return fail("cudaMalloc", e);
  for (int i = 0; i < 4; ++i)
    if (cudaError_t e = cudaMemcpy(buf[i], host.data(), 2 * n, cudaMemcpyHostToDevice))
      return fail("cudaMemcpy", e);
  float *lse = nullptr, *scratch = nullptr;
  if (cudaError_t e = cudaMalloc(&lse, sizeof(float) * B * H * T))
    return fail("cudaMalloc", e);
  // The largest need: the fused backward's dq partials.
  if (cudaError_t e = cudaMalloc(&scratch, sizeof(float) * flash::backwardScratch(
                                                        FloatKind::BF16, B, T, C, H, H, true,
                                                        flash::Impl::MmaFused)))
    return fail("cudaMalloc", e);
  // q, k, v side by side in one [B, T, 3C] tensor (fsdp.attention_qkv: the
  // kernels read them at row stride 3C) and its gradient.
  void *qkv = nullptr, *dqkv = nullptr;
  for (void **p : {&qkv, &dqkv})
    if (cudaError_t e = cudaMalloc(p, 6 * n))
      return fail("cudaMalloc", e);
  for (int i = 0; i < 3; ++i)
    if (cudaError_t e = cudaMemcpy((char *)qkv + 2 * n * i, host.data(), 2 * n,
                                   cudaMemcpyHostToDevice))
      return fail("cudaMemcpy", e);
  // The same values in f32 (the f32 plans' attention: the CUDA cores).
  std::vector<float> wide(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = uint32_t(host[i]) << 16;
    std::memcpy(&wide[i], &bits, 4);
  }
  void *buf32[8] = {};
  for (auto &p : buf32)
    if (cudaError_t e = cudaMalloc(&p, 4 * n))
      return fail("cudaMalloc", e);
  for (int i = 0; i < 4; ++i)
    if (cudaError_t e = cudaMemcpy(buf32[i], wide.data(), 4 * n, cudaMemcpyHostToDevice))
      return fail("cudaMemcpy", e);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  double fwdFlops = 2.0 * B * H * T * T * D; // 4 B H T^2 D, halved by the mask
  std::printf("attention B=%lld T=%lld heads=%lld D=%lld bf16 (last row f32) causal\n", (long long)B,
              (long long)T, (long long)H, (long long)D);
  std::printf("%-20s %10s %9s %11s %9s\n", "kernels", "fwd ms", "TFLOP/s", "fwd+bwd ms",
              "TFLOP/s");
  double ref = 0;
  struct Variant {
    const char *name;
    flash::Impl impl;
    bool packed, f32;
  };
  // The last row: f32 operands (an f32 plan's attention), against the bf16
  // CUDA-core row like the others.
  for (Variant var : {Variant{"CUDA cores", flash::Impl::CudaCores, false, false},
                      Variant{"WMMA", flash::Impl::Wmma, false, false},
                      Variant{"mma.sync", flash::Impl::Mma, false, false},
                      Variant{"mma.sync qkv", flash::Impl::Mma, true, false},
                      Variant{"mma tight", flash::Impl::MmaTight, false, false},
                      Variant{"mma tight2", flash::Impl::MmaTight2, false, false},
                      Variant{"mma tight3", flash::Impl::MmaTight3, false, false},
                      Variant{"mma fused", flash::Impl::MmaFused, false, false},
                      Variant{"mma fused qkv", flash::Impl::MmaFused, true, false},
                      Variant{"mma fused64", flash::Impl::MmaFused64, false, false},
                      Variant{"wgmma", flash::Impl::Wgmma, false, false},
                      Variant{"wgmma qkv", flash::Impl::Wgmma, true, false},
                      Variant{"wgmma serial", flash::Impl::WgmmaSerial, false, false},
                      Variant{"wgmma fused", flash::Impl::WgmmaFused, false, false},
                      Variant{"wgmma fused qkv", flash::Impl::WgmmaFused, true, false},
                      Variant{"wgmma fused64", flash::Impl::WgmmaFused64, false, false},
                      Variant{"wgmma fused serial", flash::Impl::WgmmaFusedSerial, false, false},
                      Variant{"wgmma fused64 serial", flash::Impl::WgmmaFused64Serial, false,
                              false},
                      Variant{"cores f32", flash::Impl::CudaCores, false, true}}) {
    const char *name = var.name;
    flash::Impl impl = var.impl;
    char *pq = (char *)qkv, *pd = (char *)dqkv;
    const int64_t cb = 2 * C; // one C-wide column range, in bytes
    void *const *b = var.f32 ? buf32 : buf;
    void *q = var.packed ? pq : b[0], *k = var.packed ? pq + cb : b[1],
         *v = var.packed ? pq + 2 * cb : b[2], *dq = var.packed ? pd : b[5],
         *dk = var.packed ? pd + cb : b[6], *dv = var.packed ? pd + 2 * cb : b[7],
         *dyv = b[3], *yv = b[4];
    FloatKind t = var.f32 ? FloatKind::F32 : FloatKind::BF16;
    flash::Layout rows = var.packed ? flash::Layout{3 * C, 3 * C, 0} : flash::Layout{};
    auto fwd = [&] {
      return flash::forward(t, q, k, v, yv, lse, B, T, C, H, true, H, 0, impl, rows);
    };
    auto bwd = [&] {
      return flash::backward(t, q, k, v, yv, lse, dyv, dq, dk, dv, scratch, B, T, C, H, true,
                             H, 0, impl, rows);
    };
    for (int w = 0; w < 2; ++w) // warm-up (and the shared-memory opt-in)
      if (cudaError_t e = fwd(); e || (e = bwd()))
        return fail(name, e);
    constexpr int kReps = 10;
    float msF = 0, msFB = 0;
    cudaEventRecord(t0);
    for (int r = 0; r < kReps; ++r)
      fwd();
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    cudaEventElapsedTime(&msF, t0, t1);
    cudaEventRecord(t0);
    for (int r = 0; r < kReps; ++r) {
      fwd();
      bwd();
    }
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    cudaEventElapsedTime(&msFB, t0, t1);
    if (cudaError_t e = cudaGetLastError())
      return fail(name, e);
    msF /= kReps;
    msFB /= kReps;
    if (!ref)
      ref = msFB;
    std::printf("%-20s %10.3f %9.1f %11.3f %9.1f  (%.2fx the CUDA cores)\n", name, msF,
                fwdFlops / (msF * 1e-3) / 1e12, msFB, 3.5 * fwdFlops / (msFB * 1e-3) / 1e12,
                ref / msFB);
  }
  for (auto p : buf)
    cudaFree(p);
  for (auto p : buf32)
    cudaFree(p);
  cudaFree(qkv);
  cudaFree(dqkv);
  cudaFree(lse);
  cudaFree(scratch);
  return 0;
}
