//===- CudaFlash.h - tiled attention, no T x T matrix in memory -*- C++ -*-===//
//
// FlashAttention-2-style attention for fsdp.attention / attention_grad
// (causal or full, grouped-query: query head h reads key/value head
// h / (heads / kv_heads); q, y, dq are [B, T, C], k, v, dk, dv are
// [B, T, kv_heads * D], D = C / heads). Tiles of 64 query rows and 64 keys
// live in shared memory; the softmax is online (running max and sum per
// row); scores never reach global memory. Storage f32, bf16 or f16, all
// math and accumulation in f32, one rounding per output element.
//
// Backward (the dialect's attention_grad reads q, k, v, the forward's
// output y and the log-sum-exp lse it saved, and dy), three kernels, no
// atomics and no second forward pass:
//   1. delta = dy_t . y_t per (b, h, t) into runtime scratch: B*H*T floats
//      (backwardScratch), from the stored y (rounded for bf16 / f16, as in
//      FlashAttention-2);
//   2. dq per (b, h, query tile), looping over key tiles, P = exp(S - lse);
//   3. dk, dv per (b, kv head, key tile), looping over the query heads of
//      its group and over the query tiles, in that fixed order.
// Or (Impl::MmaFused) 2 and 3 in one pass per (b, kv head, key block),
// each block's share of dq into f32 partials that a fourth kernel adds in
// key-block order.
// Deterministic: every sum runs in a fixed order.
//
// Three implementations of the same tiling: the tile products on the CUDA
// cores (f32 FMAs; every dtype and head dimension, and the only f32 path)
// and on the tensor cores (bf16 / f16 storage with D a multiple of 16; P
// and dS are rounded to the storage type before their products, as
// FlashAttention-2 does), either through WMMA with the score tiles in
// shared memory, or through mma.sync with scores, probabilities and
// accumulators in registers (FlashAttention-2's layout), or (Impl::Wgmma
// and the others named Wgmma, at D = 64 and 128) through Hopper's warpgroup wgmma.mma_async with
// the operands in 128-byte swizzled shared memory. Impl::Auto takes the
// mma.sync kernels where they apply. See docs/RUNTIME.md.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDAFLASH_H
#define FSDP_RUNTIME_CUDA_CUDAFLASH_H

#include "runtime/core/Status.h"
#include "runtime/cuda/CudaKernels.h"

namespace fsdp::cuda::flash {

/// The largest head dimension D the kernels take.
constexpr int64_t kMaxHeadDim = 128;

/// Row strides, in elements, of the [B, T, *] operands: q and dq, k, v, dk
/// and dv, y and dy. 0 is the dense layout (C, kv_heads * D, C). Packed
/// attention (fsdp.attention_qkv) reads q, k and v as column ranges of one
/// [B, T, C + 2 kv_heads D] tensor, and writes dq, dk and dv into its
/// gradient: all five at that stride, no copies.
struct Layout {
  int64_t q = 0, kv = 0, y = 0;
};

/// Ok when the kernels take these dimensions (heads divide C, kv_heads
/// divide heads, D <= kMaxHeadDim, grid limits; row strides at least the
/// rows they hold); else why not.
Status check(int64_t B, int64_t T, int64_t C, int64_t heads, int64_t kvHeads,
             Layout rows = {});

/// Which kernels run: Auto (Mma where tensor cores apply, else CudaCores),
/// or one of them (tests compare each with the CPU; Wmma or Mma where they
/// do not apply is cudaErrorInvalidValue):
///   CudaCores  f32 FMAs, every dtype and D;
///   Wmma       tensor cores through WMMA, score and output tiles through
///              shared memory;
///   Mma        tensor cores through mma.sync, the tiles in registers
///              (FlashAttention-2);
///   MmaTight   Mma at D = 64 with 32 query rows a warp in the forward
///              (two m-tiles: each key fragment feeds two products) and
///              the backward's kernels bounded to fewer registers (more
///              blocks a multiprocessor, a little spilled);
///   MmaTight2  MmaTight with dq also at 32 query rows a warp;
///   MmaTight3  MmaTight2 with dk / dv also at 32 key rows a warp;
///   MmaFused   MmaTight3's forward; the backward in one pass over key
///              blocks (dk, dv as MmaTight3's, bit for bit, and each key
///              block's share of dq, dS K, into f32 partial sums that a
///              second kernel adds in key-block order): P and dS computed
///              once, not twice. Scratch: the partials (backwardScratch);
///   MmaFused64 MmaFused with key blocks of 64 at D = 64 (16 key rows a
///              warp, launch bounds for 3 blocks a multiprocessor, as
///              MmaTight's dk / dv; twice the partials);
///   Wgmma      the forward at D = 64 and 128 on Hopper's warpgroup
///              instructions (wgmma.mma_async, sm_90a: a warpgroup per 64
///              query rows, key tiles of 128 (64 at D = 128), operands in
///              128-byte swizzled shared memory, P from registers);
///              elsewhere MmaTight3's forward.
///              The backward is MmaTight3's. The forward overlaps each
///              key tile's softmax with the previous tile's P V on the
///              tensor cores (FlashAttention-3's intra-warpgroup
///              pipelining): the same bits as WgmmaSerial's;
///   WgmmaSerial Wgmma without the overlap (each product waited for
///              before the softmax that follows it);
///   WgmmaFused Wgmma's forward; the one-pass backward on wgmma at D = 64
///              (two warpgroups per key block of 128, MmaFused's partials)
///              and D = 128 (one warpgroup per key block of 64, the
///              partials MmaFused's are there), elsewhere MmaFused's. At
///              D = 64 the backward is pipelined across query tiles (the
///              next tile's P^T computed while this tile's dV, dK and dq
///              run on the tensor cores): the same bits as
///              WgmmaFusedSerial's;
///   WgmmaFused64 WgmmaFused with one warpgroup per key block of 64
///              (MmaFused64's partials; two blocks a multiprocessor);
///   WgmmaFusedSerial, WgmmaFused64Serial WgmmaFused, WgmmaFused64
///              without either overlap (WgmmaSerial's forward, the
///              backward not pipelined across query tiles).
enum class Impl {
  Auto,
  CudaCores,
  Wmma,
  Mma,
  MmaTight,
  MmaTight2,
  MmaTight3,
  MmaFused,
  MmaFused64,
  Wgmma,
  WgmmaFused,
  WgmmaFused64,
  WgmmaSerial,
  WgmmaFusedSerial,
  WgmmaFused64Serial
};

/// True for the tensor-core implementations (bf16 / f16 storage, D a
/// multiple of 16): all but Auto and CudaCores.
bool tensorCoreImpl(Impl impl);


/// Parses FSDP_CUDA_ATTENTION's values: auto, cores, wmma, mma, mma-tight,
/// mma-tight2, mma-tight3, mma-fused, mma-fused64, wgmma, wgmma-fused,
/// wgmma-fused64, wgmma-serial, wgmma-fused-serial, wgmma-fused64-serial
/// (false for anything else).
bool parseImpl(const char *name, Impl &impl);

/// y = softmax(q k^T / sqrt(D) [+ causal mask]) v. `lse`, when not null,
/// receives each (b, h, t) row's log-sum-exp (B*H*T floats, index
/// (b * H + h) * T + t).
cudaError_t forward(FloatKind t, const void *q, const void *k, const void *v, void *y,
                    float *lse, int64_t B, int64_t T, int64_t C, int64_t heads, bool causal,
                    int64_t kvHeads, cudaStream_t s, Impl impl = Impl::Auto,
                    Layout rows = {});

/// Floats of scratch backward() needs for storage t and implementation
/// impl: B * heads * T (each row's delta), and for MmaFused also the dq
/// partial sums: per (b, head), D floats for each query row of each key
/// block of 128 rows (64 for MmaFused64 and where D != 64) that sees it
/// (about T^2 / 256 rows causal; for GPT-2 at T = 1024, 4608 rows: 1.18 MB
/// a head; MmaFused64: 8704 rows, 2.2 MB). The partials grow as T^2: the
/// fused backward runs the (b, kv head) pairs in chunks whose partials
/// fit setFusedScratchCap's bytes, and where one pair's do not (long
/// sequences), MmaTight3's kernels instead.
int64_t backwardScratch(FloatKind t, int64_t B, int64_t T, int64_t C, int64_t heads,
                        int64_t kvHeads, bool causal, Impl impl = Impl::Auto);

/// The most bytes of dq partials MmaFused / MmaFused64 keep at once
/// (default 512 MiB: GPT-2 at B=32 in one chunk, 453 MB); returns the
/// previous cap. Set it before backwardScratch and backward (tests force
/// the chunked and the fallback paths with it).
int64_t setFusedScratchCap(int64_t bytes);
/// dq, dk, dv from the forward's inputs, its output y and log-sum-exp lse
/// (as forward() wrote them) and dy.
cudaError_t backward(FloatKind t, const void *q, const void *k, const void *v, const void *y,
                     const float *lse, const void *dy, void *dq, void *dk, void *dv,
                     float *scratch, int64_t B, int64_t T, int64_t C, int64_t heads,
                     bool causal, int64_t kvHeads, cudaStream_t s, Impl impl = Impl::Auto,
                     Layout rows = {});

/// One wgmma.mma_async product (sm_90a), the primitive under Impl::Wgmma,
/// for the tests (a wrong reading of the PTX ISA's operand layouts shows
/// here first, named by its case): d (64 x n, f32, row-major) =
/// a (64 x 16) b (16 x n), a and b row-major device arrays of storage t
/// (bf16 or f16), n 32, 64 or 128. The operands are laid into shared
/// memory in the canonical layout of `swizzle` (0 none, 1 128-byte,
/// 2 64-byte, 3 32-byte: smemDesc in CudaMma.cuh), b K-major or (bNMajor)
/// N-major, a from shared memory K-major (aMode 0) or M-major (1), or
/// from registers (2). n = 32 N-major with 128-byte swizzling reads the
/// upper 32 columns of a 64-wide tile (the descriptor 64 bytes into its
/// rows, as WgmmaFused's dq reads K).
cudaError_t wgmmaProduct(FloatKind t, const void *a, const void *b, float *d, int n,
                         int swizzle, int aMode, bool bNMajor, cudaStream_t s);

} // namespace fsdp::cuda::flash

#endif // FSDP_RUNTIME_CUDA_CUDAFLASH_H
