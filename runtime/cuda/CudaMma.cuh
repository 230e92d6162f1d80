//===- CudaMma.cuh - warp-level tensor-core primitives ------------*- CUDA -*-===//
//
// mma.sync m16n8k16 (bf16 / f16 operands, f32 accumulators), ldmatrix x4
// and cp.async (16-byte global -> shared copies in commit groups), as PTX. Unlike WMMA's opaque
// fragments, PTX specifies which lane holds which element, so a kernel can keep products in
// registers and turn an accumulator into the next product's A operand without shared memory
// (FlashAttention-2's layout). Fragments, for lane l = 4 g + q:
//   A (16 x 16, row):  register j holds row g + 8 (j % 2), columns
//                      2 q + 8 (j / 2) and + 1 (low half first);
//   B (16 x 8, col):   register j holds rows 2 q + 8 j and + 1 of column g;
//   C / D (16 x 8):    float i is row g + 8 (i / 2), column 2 q + i % 2.
// ldmatrix x4: lanes 8 i .. 8 i + 7 give the 16-byte rows of 8 x 8 matrix
// i; register i receives its row g, elements 2 q, 2 q + 1 (.trans: its
// elements (2 q, g) and (2 q + 1, g)).
//
// Internal: included by .cu files only. Under the CPU emulator
// (test/cudaemu) Emu.h provides the same instructions, lane by lane.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDAMMA_CUH
#define FSDP_RUNTIME_CUDA_CUDAMMA_CUH

#include <cstdint>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fsdp::cuda::mma {

/// Two storage values (lo, hi) packed in one register, each rounded once.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat16 v[2] = {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
  uint32_t r;
  memcpy(&r, v, 4);
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half v[2] = {__float2half_rn(lo), __float2half_rn(hi)};
  uint32_t r;
  memcpy(&r, v, 4);
  return r;
}

#ifdef FSDP_CUDAEMU_MMA
__device__ __forceinline__ void ldmatrixX4(uint32_t (&r)[4], const void *row) {
  ::cudaemu::ldmatrixX4(r, row, false);
}
__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&r)[4], const void *row) {
  ::cudaemu::ldmatrixX4(r, row, true);
}
/// d += a b (m16n8k16, f32 accumulators).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t *b) {
  const uint32_t bb[2] = {b[0], b[1]};
  ::cudaemu::mma16816(d, a, bb, std::is_same_v<T, __nv_bfloat16>);
}
__device__ __forceinline__ void cpAsync16(void *smem, const void *gmem) {
  ::cudaemu::cpAsync(smem, gmem, 16);
}
__device__ __forceinline__ void cpAsyncCommit() { ::cudaemu::cpAsyncCommit(); }
template <int N> __device__ __forceinline__ void cpAsyncWait() { ::cudaemu::cpAsyncWait(N); }
#else
__device__ __forceinline__ uint32_t sharedAddress(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
/// 16 bytes global -> shared without passing through registers (L2 only,
/// .cg); complete after the cp.async.wait_group that covers its group.
__device__ __forceinline__ void cpAsync16(void *smem, const void *gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sharedAddress(smem)),
               "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/// Waits until at most N of this thread's committed groups are in flight.
template <int N> __device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrixX4(uint32_t (&r)[4], const void *row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(sharedAddress(row)));
}
__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&r)[4], const void *row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(sharedAddress(row)));
}
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t *b);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t *b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t *b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

/// The A fragment of the 16 x 16 block at `tile` (row-major, `ld` elements
/// per row, rows 16-byte aligned).
template <typename T>
__device__ __forceinline__ void loadA(uint32_t (&r)[4], const T *tile, int ld, int lane) {
  ldmatrixX4(r, tile + (lane % 16) * ld + (lane / 16) * 8);
}

/// The A fragment of A = M^T for the 16 x 16 block of M at `tile`
/// (row-major, `ld` elements per row, rows 16-byte aligned; A's rows are
/// M's columns): ldmatrix .trans, matrix j from M's rows 8 (j / 2) .. + 7
/// at column 8 (j % 2). (dS in dS K, from dS^T kept key-major.)
template <typename T>
__device__ __forceinline__ void loadAt(uint32_t (&r)[4], const T *tile, int ld, int lane) {
  int m = lane / 8;
  ldmatrixX4Trans(r, tile + ((lane % 8) + (m >> 1) * 8) * ld + (m & 1) * 8);
}

/// B fragments of two adjacent 8-column n-tiles for one 16-deep k step,
/// where B[k][n] = M[n][k] for the row-major M at `tile` (rows n .. n + 15,
/// columns k .. k + 15): r[0..1] is n-tile 0, r[2..3] n-tile 1. (K in
/// Q K^T: rows are keys, columns the head dimension.)
template <typename T>
__device__ __forceinline__ void loadBt(uint32_t (&r)[4], const T *tile, int ld, int lane) {
  int m = lane / 8;
  ldmatrixX4(r, tile + ((lane % 8) + (m >> 1) * 8) * ld + (m & 1) * 8);
}

/// B fragments of two adjacent n-tiles for one k step, where B[k][n] =
/// M[k][n] for the row-major M at `tile` (rows k .. k + 15, columns
/// n .. n + 15): r[0..1] n-tile 0, r[2..3] n-tile 1. (V in P V.)
template <typename T>
__device__ __forceinline__ void loadB(uint32_t (&r)[4], const T *tile, int ld, int lane) {
  int m = lane / 8;
  ldmatrixX4Trans(r, tile + ((lane % 8) + (m & 1) * 8) * ld + (m >> 1) * 8);
}

/// The A fragment (16 x 16) of accumulator n-tiles c0 (columns 0..7) and
/// c1 (columns 8..15), rounded to T: the accumulator layout of two
/// adjacent n-tiles is the A layout of one k step.
template <typename T>
__device__ __forceinline__ void accToA(uint32_t (&r)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  r[0] = pack2<T>(c0[0], c0[1]);
  r[1] = pack2<T>(c0[2], c0[3]);
  r[2] = pack2<T>(c1[0], c1[1]);
  r[3] = pack2<T>(c1[2], c1[3]);
}

} // namespace fsdp::cuda::mma

#endif // FSDP_RUNTIME_CUDA_CUDAMMA_CUH
