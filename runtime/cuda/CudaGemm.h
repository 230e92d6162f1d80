//===- CudaGemm.h - row-major GEMMs through cuBLASLt ------------*- C++ -*-===//
//
// C[b] = op(A[b]) op(B[b]) for b < batch, row-major, as cpu::matmul: A is
// [m,k] ([k,m] if transA), B is [k,n] ([n,k] if transB). cuBLASLt is
// column-major, so the row-major product is computed as C^T = op(B)^T op(A)^T
// with the operands swapped (no data moves). Float32 with FP32 compute by
// default (TF32 off, as the CPU reference); allowTf32 opts in. The
// descriptors and the heuristic's algorithm are cached per shape and per
// operand alignment, chosen once. The heuristic is told each pointer's
// actual alignment (the largest power of two dividing its address, capped at
// cuBLASLt's default of 256 bytes, at least the element size): plan buffers
// are only 64-byte aligned and views / slices may be merely element-aligned,
// and an algorithm chosen for 256-byte pointers may fail on those. The
// workspace is the runtime's own scratch, reported beside the arena.
//
// bf16 / f16 GEMMs (mixed-precision plans): inputs and output in the
// storage dtype, CUBLAS_COMPUTE_32F (f32 accumulation), f32 alpha/beta.
// Against the reference semantics ("the f32 GEMM of the widened inputs,
// rounded once"): the products of two bf16 values are exact in f32, but the
// tensor cores add them in groups whose alignment may truncate rather than
// round, in an order of their own, so the f32 sum before the output
// rounding may differ by up to about k * 2^-22 * sum|a_i b_i| (Higham's
// gamma_k with a unit of 2^-23); the one rounding to bf16 may then land on
// the neighbouring value: one bf16 ulp (<= 2^-7 |c|). CudaFastKernelsTest
// derives its tolerance from exactly these two terms. A GemmType with an
// f32 output writes that f32 sum unrounded (C, D and an epilogue's bias
// vector in f32; cuBLAS's 16BF/16F-in, 32F-out row of its type table).
//
// Leading dimensions: cuBLASLt's fast 16-bit kernels need every row of
// every operand 16-byte aligned; a row-major dimension that is not a
// multiple of 8 (GPT-2's vocabulary, 50257) leaves it the slow ones (the
// [16384, 768] x [768, 50257] logits GEMM ran at 94 TFLOP/s on an H100).
// With staging reserved (reserveStaging, sized by stagingNeed), a bf16 /
// f16 GEMM copies each such operand into staging with its rows padded to
// a multiple of 8 elements (cudaMemcpy2DAsync), multiplies there, and
// copies a padded C back: the same product (the padding is never read),
// two extra passes over those operands' bytes.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDAGEMM_H
#define FSDP_RUNTIME_CUDA_CUDAGEMM_H

#include "runtime/core/Status.h"
#include "runtime/cuda/CudaKernels.h"

#include <cstdint>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <map>
#include <memory>
#include <tuple>

namespace fsdp::cuda {

/// A cuBLASLt epilogue on the row-major [m, n] result C of a GEMM
/// (fsdp-fuse-epilogues' ops; batch 1 only):
/// - Bias:        C = AB + bias ([n]);
/// - GeluAuxBias: aux = AB + bias, C = gelu_tanh(aux) (aux may be null:
///                GELU_BIAS, the pre-activation not kept);
/// - DGelu:       C = AB * gelu_tanh'(aux), and with a non-null biasGrad
///                ([n]) its sum over the m rows (DGELU_BGRAD).
/// - BGradA:      C = AB, and biasGrad ([m]) = the sum over k of op(A)
///                (a linear layer's weight gradient dW = dY^T X with its
///                bias gradient, the column sums of dY: llm.c's and
///                PyTorch's BGRADB on the swapped cuBLASLt operands).
/// aux is [m, n] row-major like C (cuBLASLt: column-major n x m, leading
/// dimension n, which must be a multiple of 8).
enum class Epilogue : int { None, Bias, GeluAuxBias, DGelu, BGradA };
struct EpilogueArgs {
  Epilogue kind = Epilogue::None;
  const void *bias = nullptr; ///< Bias, GeluAuxBias
  void *aux = nullptr;        ///< GeluAuxBias: written; DGelu: read
  void *biasGrad = nullptr;   ///< DGelu: written when not null; BGradA: written
};

/// A GEMM's storage types: A and B of type `in`, C of type `out`: one
/// type, or bf16 / f16 operands with an f32 product (the f32 accumulation
/// written unrounded: a mixed-precision weight gradient straight into the
/// f32 gradient). The bias (gradient) of an epilogue has C's type.
struct GemmType {
  FloatKind in, out;
  GemmType(FloatKind t) : in(t), out(t) {} // NOLINT: one type is the common case
  GemmType(FloatKind a, FloatKind c) : in(a), out(c) {}
};

class Gemm {
public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm &) = delete;
  Gemm &operator=(const Gemm &) = delete;

  /// Creates the cuBLASLt handle and a workspace of `workspaceBytes`.
  Status init(size_t workspaceBytes, bool allowTf32);
  size_t workspaceBytes() const { return wsBytes_; }
  /// Bytes of staging a GEMM of this shape pads its misaligned operands in
  /// (see the file comment; 0: none needs it).
  static size_t stagingNeed(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k,
                            bool transA, bool transB);
  /// Allocates staging of at least `bytes` (once: the maximum over a plan).
  Status reserveStaging(size_t bytes);
  size_t stagingBytes() const { return stageBytes_; }
  /// Autotuning (FSDP_CUDA_GEMM_TUNE=1): warm() and warmEpilogue() time the
  /// heuristic's first 8 algorithms for a GEMM on its real operands (and
  /// its epilogue's bias / aux pointers) and keep the fastest. The choice
  /// rests on timings, so two runs may choose differently and their
  /// results differ in the last bits (cuBLASLt's algorithms sum in
  /// different orders); off by default.
  void setTuning(bool on) { tune_ = on; }
  /// FSDP_CUDA_BGRAD_SPLITK=0: the bias-gradient (BGRADB) GEMMs ask the
  /// heuristic for algorithms without split-K (REDUCTION_SCHEME_NONE),
  /// falling back to any algorithm where there is none. cuBLASLt's first
  /// choice for GPT-2's weight gradients split K and ran a separate bias
  /// kernel and a split-K reduction (1.15 ms of a B=16 step on the H200);
  /// for the A/B. On by default (the heuristic chooses).
  void setBiasGradSplitK(bool on) { bgradSplitK_ = on; }
  /// GEMM shapes tuned so far, those of them with an epilogue, and those
  /// where a candidate other than the heuristic's first won.
  int tuned() const { return tuned_; }
  int tunedEpilogue() const { return tunedEpilogue_; }
  int tunedChanged() const { return tunedChanged_; }

  /// C = op(A) op(B), or given `acc` (C's shape and type) C = acc + op(A)
  /// op(B): cuBLASLt's beta = 1 with acc as its C and our C as its D, so
  /// acc is read where it lies (acc == c accumulates in place; no copy
  /// either way).
  Status run(const float *a, const float *b, float *c, int64_t batch, int64_t m, int64_t n,
             int64_t k, bool transA, bool transB, cudaStream_t s, const float *acc = nullptr);
  /// The same on operands and result of types `t` (f32 accumulation).
  Status run(GemmType t, const void *a, const void *b, void *c, int64_t batch, int64_t m, int64_t n,
             int64_t k, bool transA, bool transB, cudaStream_t s, const void *acc = nullptr);
  /// The same with an epilogue (batch 1), C = acc + op(A) op(B) given
  /// `acc` as above (the epilogue's bias gradient is op(A)'s or op(B)'s
  /// sum alone: a BGRAD epilogue writes it, never adds to it). An error
  /// when cuBLASLt has no algorithm for it; warmEpilogue tells beforehand.
  Status run(GemmType t, const void *a, const void *b, void *c, int64_t m, int64_t n, int64_t k,
             bool transA, bool transB, const EpilogueArgs &e, cudaStream_t s,
             const void *acc = nullptr);
  /// Builds the descriptors and asks the heuristic for this shape now (at
  /// prepare), so the first step does not. Pass the pointers run() will get
  /// (only their alignment is used); null stands for 256-byte-aligned ones
  /// (cudaMalloc's).
  Status warm(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA, bool transB,
              const void *a = nullptr, const void *b = nullptr, const void *c = nullptr,
              const void *acc = nullptr);
  /// warm() for a GEMM with epilogue `e` (its pointers as run() will get
  /// them): false when cuBLASLt cannot run it (no algorithm for these
  /// types, shapes and alignments, or an aux leading dimension n that is
  /// not a multiple of 8); the caller then runs the GEMM and the epilogue's
  /// own kernels instead.
  bool warmEpilogue(GemmType t, int64_t m, int64_t n, int64_t k, bool transA, bool transB,
                    const void *a, const void *b, const void *c, const EpilogueArgs &e,
                    const void *acc = nullptr);

private:
  struct Plan;
  /// the types (in | out << 4), batch, m, n, k, transA, transB, the byte alignments of the
  /// row-major A, B and C pointers, the epilogue (kind, whether it writes
  /// a bias gradient / keeps the aux matrix) and the alignments of its
  /// bias and aux pointers.
  /// The last: whether every leading dimension is padded to a multiple
  /// of 8 elements (the staged GEMM).
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, bool, bool, uint32_t,
                         uint32_t, uint32_t, int, uint32_t, uint32_t, bool>;
  static Key key(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA,
                 bool transB, const void *a, const void *b, const void *c,
                 const EpilogueArgs &e = {}, bool padded = false);
  /// The plan of `key`, built on first use; with tuning on and the
  /// operands given (warm), its algorithm is the fastest candidate timed
  /// on them.
  Status plan(const Key &key, Plan *&out, const void *tuneA = nullptr, const void *tuneB = nullptr,
              void *tuneC = nullptr, const EpilogueArgs *tuneEpi = nullptr);
  static constexpr int kTuneCandidates = 8;
  Status pickFastest(Plan &p, const cublasLtMatmulHeuristicResult_t *results, int found,
                     const void *a, const void *b, void *c, const EpilogueArgs *epi);
  void stagedPointers(int64_t m, int64_t n, int64_t k, bool transA, bool transB,
                      const void *&a, const void *&b, void *&c) const;
  /// run() through staging (stagingNeed > 0, reserved): batch 1.
  Status runStaged(GemmType t, const void *a, const void *b, void *c, int64_t m, int64_t n,
                   int64_t k, bool transA, bool transB, cudaStream_t s, const void *acc);

  void *handle_ = nullptr; // cublasLtHandle_t
  void *ws_ = nullptr;
  size_t wsBytes_ = 0;
  void *stage_ = nullptr;
  size_t stageBytes_ = 0;
  bool tune_ = false;
  bool bgradSplitK_ = true;
  int tuned_ = 0, tunedEpilogue_ = 0, tunedChanged_ = 0;
  bool tf32_ = false;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDAGEMM_H
