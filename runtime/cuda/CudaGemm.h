//===- CudaGemm.h - row-major GEMMs through cuBLASLt ------------*- C++ -*-===//
//
// C[b] = op(A[b]) op(B[b]) for b < batch, row-major, as cpu::matmul: A is
// [m,k] ([k,m] if transA), B is [k,n] ([n,k] if transB). cuBLASLt is
// column-major, so the row-major product is computed as C^T = op(B)^T op(A)^T
// with the operands swapped (no data moves). Float32 with FP32 compute by
// default (TF32 off, as the CPU reference); allowTf32 opts in. The
// descriptors and the heuristic's algorithm are cached per shape, chosen
// once. The workspace is the runtime's own scratch, reported beside the
// arena.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDAGEMM_H
#define FSDP_RUNTIME_CUDA_CUDAGEMM_H

#include "runtime/core/Status.h"

#include <cstdint>
#include <cuda_runtime.h>
#include <map>
#include <memory>
#include <tuple>

namespace fsdp::cuda {

class Gemm {
public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm &) = delete;
  Gemm &operator=(const Gemm &) = delete;

  /// Creates the cuBLASLt handle and a workspace of `workspaceBytes`.
  Status init(size_t workspaceBytes, bool allowTf32);
  size_t workspaceBytes() const { return wsBytes_; }

  Status run(const float *a, const float *b, float *c, int64_t batch, int64_t m, int64_t n,
             int64_t k, bool transA, bool transB, cudaStream_t s);

private:
  struct Plan;
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool>;
  Status plan(const Key &key, Plan *&out);

  void *handle_ = nullptr; // cublasLtHandle_t
  void *ws_ = nullptr;
  size_t wsBytes_ = 0;
  bool tf32_ = false;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDAGEMM_H
