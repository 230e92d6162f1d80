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
__device__ __forceinline__ uint32_t sharedAddress(const void *p) {
  return ::cudaemu::sharedOffset(p);
}
__device__ __forceinline__ void fenceProxyAsync() {}
__device__ __forceinline__ void wgmmaFence() { ::cudaemu::wgmmaFence(); }
__device__ __forceinline__ void wgmmaCommit() { ::cudaemu::wgmmaCommit(); }
template <int N> __device__ __forceinline__ void wgmmaWait() { ::cudaemu::wgmmaWait(N); }
template <int R> __device__ __forceinline__ void fenceRegs(float (&)[R]) {}
template <typename T, int N> struct Wgmma {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  template <int TnspA, int TnspB>
  static void ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
    ::cudaemu::wgmma(d, N, nullptr, da, db, acc != 0, TnspA != 0, TnspB != 0, kBf16);
  }
  template <int TnspB>
  static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
    ::cudaemu::wgmma(d, N, a, 0, db, acc != 0, false, TnspB != 0, kBf16);
  }
};
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
#if !defined(FSDP_CUDAEMU_MMA)
/// Orders this thread's generic-proxy writes of shared memory (stores,
/// cp.async) before later async-proxy reads (wgmma's operands); then a
/// barrier makes every thread's writes visible to the warpgroup's wgmma.
__device__ __forceinline__ void fenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/// wgmma.fence: registers written before it (accumulators, A fragments)
/// are what the following wgmma.mma_async read.
__device__ __forceinline__ void wgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
/// The warpgroup's wgmma.mma_async since the last commit become one group.
__device__ __forceinline__ void wgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/// Waits until at most N of the warpgroup's wgmma groups are in flight.
template <int N> __device__ __forceinline__ void wgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Ties accumulator registers to this point (CUTLASS's
/// warpgroup_fence_operand): the compiler neither reads them before a
/// wgmmaWait nor moves writes past the wgmma that reads them.
template <int R> __device__ __forceinline__ void fenceRegs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
}
/// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}: d (64 x N, f32;
/// thread i of the warpgroup, warp w = i / 32, lane 4 g + q, holds
/// d[4 j + e] = row 16 w + g + 8 (e / 2), column 8 j + 2 q + e % 2) =
/// A (64 x 16) B (16 x N) + (acc ? d : 0). ss: A and B in shared memory
/// (descriptors, smemDesc); rs: A in registers (warp w's rows 16 w ..
/// 16 w + 15 in mma.sync's A layout), B in shared memory. TnspA / TnspB:
/// 0 K-major, 1 M- / N-major. Asynchronous: d is read and written between
/// the instruction and the wgmmaWait that covers its group.
template <typename T, int N> struct Wgmma;
#define FSDP_WGMMA_N32(T, PT) \
template <> struct Wgmma<T, 32> { \
  template <int TnspA, int TnspB> \
  static __device__ __forceinline__ void ss(float (&d)[16], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
                 "%16, %17, p, 1, 1, %19, %20;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                 : "l"(da), "l"(db), "r"(acc), "n"(TnspA), "n"(TnspB) \
                 : "memory"); \
  } \
  template <int TnspB> \
  static __device__ __forceinline__ void rs(float (&d)[16], const uint32_t (&a)[4], uint64_t db, \
                                            int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
                 "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TnspB) \
                 : "memory"); \
  } \
};
FSDP_WGMMA_N32(__nv_bfloat16, "bf16")
FSDP_WGMMA_N32(__half, "f16")
#undef FSDP_WGMMA_N32
#define FSDP_WGMMA_N64(T, PT) \
template <> struct Wgmma<T, 64> { \
  template <int TnspA, int TnspB> \
  static __device__ __forceinline__ void ss(float (&d)[32], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "%32, %33, p, 1, 1, %35, %36;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
                   "+f"(d[30]), "+f"(d[31]) \
                 : "l"(da), "l"(db), "r"(acc), "n"(TnspA), "n"(TnspB) \
                 : "memory"); \
  } \
  template <int TnspB> \
  static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, \
                                            int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
                   "+f"(d[30]), "+f"(d[31]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TnspB) \
                 : "memory"); \
  } \
};
FSDP_WGMMA_N64(__nv_bfloat16, "bf16")
FSDP_WGMMA_N64(__half, "f16")
#undef FSDP_WGMMA_N64
#define FSDP_WGMMA_N128(T, PT) \
template <> struct Wgmma<T, 128> { \
  template <int TnspA, int TnspB> \
  static __device__ __forceinline__ void ss(float (&d)[64], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "%64, %65, p, 1, 1, %67, %68;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "l"(da), "l"(db), "r"(acc), "n"(TnspA), "n"(TnspB) \
                 : "memory"); \
  } \
  template <int TnspB> \
  static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db, \
                                            int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PT "." PT " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TnspB) \
                 : "memory"); \
  } \
};
FSDP_WGMMA_N128(__nv_bfloat16, "bf16")
FSDP_WGMMA_N128(__half, "f16")
#undef FSDP_WGMMA_N128
#endif

/// A shared-memory matrix descriptor for wgmma (PTX ISA, "Matrix
/// Descriptor Format"): start address, leading / stride dimension byte
/// offsets, swizzle 0 none, 1 128-byte, 2 64-byte, 3 32-byte (base offset
/// 0: swizzled tiles start on their pattern's boundary, 1024 bytes for
/// 128-byte swizzling). The canonical layouts, bf16 / f16 (bytes; swizzling
/// XORs address bits 4-6 with bits 7-9 for 128-byte, 4-5 with 7-8 for
/// 64-byte, 4 with 7 for 32-byte):
///   K-major, none:        (mn % 8) 16 + (mn / 8) SBO + (k % 8) 2 + (k / 8) LBO
///   K-major, W-byte:      (mn % 8) W + (mn / 8) SBO + 2 k
///   MN-major, none:       (mn % 8) 2 + (mn / 8) SBO + (k % 8) 16 + (k / 8) LBO
///   MN-major, W-byte:     (mn % (W / 2)) 2 + (mn / (W / 2)) LBO + (k % 8) W + (k / 8) SBO
__device__ __forceinline__ uint64_t smemDesc(const void *p, uint32_t lbo, uint32_t sbo,
                                             int swizzle) {
  return (uint64_t)((sharedAddress(p) & 0x3FFFFu) >> 4) |
         (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16 | (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32 |
         (uint64_t)(swizzle & 3) << 62;
}

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
