//===- CudaGemm.cpp - row-major GEMMs through cuBLASLt --------------------===//

#include "runtime/cuda/CudaGemm.h"

#include "runtime/cuda/CudaCheck.h"

#include <algorithm>
#include <climits>
#include <utility>
#include <cublasLt.h>

namespace fsdp::cuda {

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la)
      cublasLtMatrixLayoutDestroy(la);
    if (lb)
      cublasLtMatrixLayoutDestroy(lb);
    if (lc)
      cublasLtMatrixLayoutDestroy(lc);
    if (desc)
      cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm() = default;

Gemm::~Gemm() {
  plans_.clear();
  if (ws_)
    cudaFree(ws_);
  if (stage_)
    cudaFree(stage_);
  if (handle_)
    cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

Status Gemm::init(size_t workspaceBytes, bool allowTf32) {
  cublasLtHandle_t h;
  FSDP_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspaceBytes)
    FSDP_CUDA_CHECK(cudaMalloc(&ws_, workspaceBytes));
  wsBytes_ = workspaceBytes;
  tf32_ = allowTf32;
  return Status::ok();
}

namespace {
cudaDataType_t dataType(FloatKind t) {
  return t == FloatKind::BF16 ? CUDA_R_16BF : t == FloatKind::F16 ? CUDA_R_16F : CUDA_R_32F;
}
size_t elemBytes(FloatKind t) { return t == FloatKind::F32 ? 4 : 2; }

/// The largest power of two dividing p's address, capped at 256 (cuBLASLt's
/// default assumption; null counts as 256), at least the element size.
uint32_t alignment(const void *p, size_t elem) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uintptr_t low = v & (~v + 1); // the lowest set bit; 0 for null
  uint32_t al = low == 0 || low > 256 ? 256u : (uint32_t)low;
  return std::max<uint32_t>(al, (uint32_t)elem);
}

/// Of C and the accumulator read into it (null: none), the one whose
/// address is less aligned: the plan's C and D alignment (cuBLASLt's C is
/// the accumulator, its D our C, one layout).
const void *lessAligned(const void *c, const void *acc, size_t elem) {
  return acc && alignment(acc, elem) < alignment(c, elem) ? acc : c;
}

/// A row length padded to a multiple of 8 elements (16 bytes of 16-bit).
int64_t padded(int64_t ld) { return (ld + 7) / 8 * 8; }

/// The row-major operands of C = op(A) op(B) ([m, k] / [k, m] A, [k, n] /
/// [n, k] B, [m, n] C): rows and row length (the leading dimension).
struct Operands {
  int64_t rowsA, ldA, rowsB, ldB, rowsC, ldC;
};
Operands operands(int64_t m, int64_t n, int64_t k, bool transA, bool transB) {
  return {transA ? k : m, transA ? m : k, transB ? n : k, transB ? k : n, m, n};
}

/// Bytes of one padded copy in staging (256-byte aligned starts).
size_t stagedBytes(int64_t rows, int64_t ld) {
  return ((size_t)(rows * padded(ld)) * 2 + 255) / 256 * 256;
}

/// A column-major rows x cols layout with leading dimension ld, batched.
Status layout(cublasLtMatrixLayout_t &l, cudaDataType_t type, uint64_t rows, uint64_t cols,
              int64_t ld, int32_t batch, int64_t stride) {
  FSDP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  if (batch > 1) {
    FSDP_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
    FSDP_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return Status::ok();
}
/// Sets the bias (or bias-gradient) and aux pointers an epilogue reads or
/// writes on `desc`.
Status setEpiloguePointers(cublasLtMatmulDesc_t desc, Epilogue kind, bool keepAux,
                           bool biasGrad, void *bias, void *aux) {
  if (kind == Epilogue::None)
    return Status::ok();
  if (kind != Epilogue::DGelu || biasGrad)
    FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias, sizeof(bias)));
  if (kind == Epilogue::DGelu || keepAux)
    FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  return Status::ok();
}

/// The key's epilogue code: kind << 2 | keeps aux | writes a bias gradient.
int epilogueCode(const EpilogueArgs &e) {
  return (int(e.kind) << 2) | (e.kind == Epilogue::GeluAuxBias && e.aux ? 1 : 0) |
         ((e.kind == Epilogue::DGelu || e.kind == Epilogue::BGradA) && e.biasGrad ? 2 : 0);
}

/// The epilogue's bias-vector pointer: the gradient it writes, or the bias
/// it reads.
void *biasPointer(const EpilogueArgs &e) {
  return e.kind == Epilogue::DGelu || e.kind == Epilogue::BGradA
             ? e.biasGrad
             : const_cast<void *>(e.bias);
}

} // namespace

Status Gemm::plan(const Key &key, Plan *&out, const void *tuneA, const void *tuneB, void *tuneC,
                  const EpilogueArgs *tuneEpi) {
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    out = it->second.get();
    return Status::ok();
  }
  auto [kind, batch, m, n, k, transA, transB, alA, alB, alC, epi, alBias, alAux, pad] = key;
  // Leading dimensions: the row lengths of the row-major operands, padded
  // to a multiple of 8 elements for the staged GEMM.
  Operands o = operands(m, n, k, transA, transB);
  int64_t ldA = pad ? padded(o.ldA) : o.ldA, ldB = pad ? padded(o.ldB) : o.ldB,
          ldC = pad ? padded(o.ldC) : o.ldC;
  FloatKind t = FloatKind(kind & 15), tOut = FloatKind(kind >> 4);
  cudaDataType_t dt = dataType(t), dtOut = dataType(tOut);
  auto p = std::make_unique<Plan>();
  // f32 accumulation whatever the storage; TF32 only for f32 operands
  // and only when allowed.
  bool fast = tf32_ && t == FloatKind::F32;
  FSDP_CUBLAS_CHECK(cublasLtMatmulDescCreate(
      &p->desc, fast ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
  // first cuBLASLt operand is B, the second A (see the header).
  // The attributes are int32_t (cublasLt.h), whatever size the enum has.
  int32_t opFirst = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  int32_t opSecond = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &opFirst, sizeof(opFirst)));
  FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &opSecond, sizeof(opSecond)));
  int32_t nb = (int32_t)batch;
  // First operand (B): op N -> stored n x k col-major (ld n); op T -> k x n (ld k).
  FSDP_RETURN_IF_ERROR(transB ? layout(p->la, dt, k, n, ldB, nb, n * k)
                              : layout(p->la, dt, n, k, ldB, nb, n * k));
  // Second operand (A): op N -> k x m (ld k); op T -> m x k (ld m).
  FSDP_RETURN_IF_ERROR(transA ? layout(p->lb, dt, m, k, ldA, nb, m * k)
                              : layout(p->lb, dt, k, m, ldA, nb, m * k));
  FSDP_RETURN_IF_ERROR(layout(p->lc, dtOut, n, m, ldC, nb, m * n));
  // The epilogue (see the header). Row-major C [m, n] is column-major
  // n x m: the bias runs along cuBLASLt's rows (length n, broadcast over
  // the m columns), and its gradient sums over them.
  auto kindOf = Epilogue(epi >> 2);
  bool keepAux = epi & 1, biasGrad = epi & 2;
  if (kindOf != Epilogue::None) {
    if ((kindOf == Epilogue::DGelu || keepAux) && n % 8 != 0)
      return FSDP_ERROR("cuBLASLt's GELU epilogues need n (", n,
                        ") to be a multiple of 8 (the aux leading dimension)");
    if (kindOf == Epilogue::DGelu && k == 1)
      return FSDP_ERROR("cuBLASLt's DGELU epilogues do not support k = 1");
    if (kindOf == Epilogue::BGradA && !biasGrad)
      return FSDP_ERROR("a BGradA epilogue without its bias gradient");
    // BGradA: our A is cuBLASLt's second operand (B), so its bias
    // gradient (the sum over k of op(B), D's n x m columns) is BGRADB.
    uint32_t code = kindOf == Epilogue::Bias ? CUBLASLT_EPILOGUE_BIAS
                    : kindOf == Epilogue::GeluAuxBias
                        ? (keepAux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS)
                    : kindOf == Epilogue::BGradA
                        ? CUBLASLT_EPILOGUE_BGRADB
                        : (biasGrad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU);
    FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &code, sizeof(code)));
    if (kindOf != Epilogue::DGelu || biasGrad) {
      int32_t bt = dtOut; // the bias (gradient) has C's type
      FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
    if (kindOf == Epilogue::DGelu || keepAux) {
      int64_t ld = n;
      FSDP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
    // The heuristic reads the epilogue pointers' alignment from their
    // values: stand-ins with the alignments of the key; run() sets the
    // real pointers.
    FSDP_RETURN_IF_ERROR(setEpiloguePointers(p->desc, kindOf, keepAux, biasGrad,
                                             reinterpret_cast<void *>(uintptr_t(alBias)),
                                             reinterpret_cast<void *>(uintptr_t(alAux))));
  }
  cublasLtMatmulPreference_t pref;
  FSDP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = wsBytes_;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  // The pointers' actual alignments (the default assumes 256 bytes). The
  // cuBLASLt operands are swapped (see above): its A is our B, its B our
  // A; C and D are both our C.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alB},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alA},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alC},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alC}};
  for (const auto &[attr, al] : aligns)
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al));
  // Tuning (setTuning; GEMMs warmed with their pointers, an epilogue's
  // too): the heuristic's first kTuneCandidates, each timed on the real
  // operands.
  const bool tuning = tune_ && tuneA && tuneB && tuneC && (epi == 0 || tuneEpi);
  cublasLtMatmulHeuristicResult_t results[kTuneCandidates] = {};
  cublasLtMatmulHeuristicResult_t &result = results[0];
  int found = 0;
  auto ask = [&] {
    return cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), p->desc,
                                          p->la, p->lb, p->lc, p->lc, pref,
                                          tuning ? kTuneCandidates : 1, results, &found);
  };
  // setBiasGradSplitK(false): a BGRADB GEMM without split-K where the
  // heuristic has one, else as usual.
  if (st == CUBLAS_STATUS_SUCCESS && kindOf == Epilogue::BGradA && !bgradSplitK_) {
    uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &none, sizeof(none)) == CUBLAS_STATUS_SUCCESS &&
        ask() == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      st = CUBLAS_STATUS_SUCCESS;
    } else {
      uint32_t any = CUBLASLT_REDUCTION_SCHEME_MASK;
      found = 0;
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                &any, sizeof(any));
      if (st == CUBLAS_STATUS_SUCCESS)
        st = ask();
    }
  } else if (st == CUBLAS_STATUS_SUCCESS) {
    st = ask();
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // No algorithm for the problem is CUBLAS_STATUS_NOT_SUPPORTED with no
  // result (cublasLt.h), and a result is usable only when its own state
  // is success: both are "no algorithm", reported with the problem.
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (found > 0 && result.state != CUBLAS_STATUS_SUCCESS))
    found = 0;
  else
    FSDP_CUBLAS_CHECK(st);
  if (found == 0)
    return FSDP_ERROR("cuBLASLt has no algorithm for a ", batch, " x [", m, ", ", k, "] x [", k,
                      ", ", n, "] ",
                      t == FloatKind::F32    ? "float32"
                      : t == FloatKind::BF16 ? "bf16"
                                             : "f16",
                      tOut != t ? " -> float32" : "", " GEMM (transA ", transA, ", transB ", transB,
                      ") within a ", wsBytes_, "-byte workspace with ", alA, "/", alB, "/", alC,
                      "-byte-aligned A/B/C");
  p->algo = result.algo;
  if (tuning && found > 1)
    FSDP_RETURN_IF_ERROR(pickFastest(*p, results, found, tuneA, tuneB, tuneC, tuneEpi));
  out = p.get();
  plans_.emplace(key, std::move(p));
  return Status::ok();
}

Status Gemm::pickFastest(Plan &p, const cublasLtMatmulHeuristicResult_t *results, int found,
                         const void *a, const void *b, void *c, const EpilogueArgs *epi) {
  // At prepare, before any step: the legacy stream, one warm-up and three
  // timed runs per candidate, the fastest kept (the heuristic's order on
  // ties). Candidates that fail to run are skipped. An epilogue runs on
  // its real bias / aux pointers: it reads and writes them as C (the
  // device tunes before the arena is filled, so what it writes there is
  // overwritten before the first step).
  if (epi) {
    int code = epilogueCode(*epi);
    FSDP_RETURN_IF_ERROR(
        setEpiloguePointers(p.desc, epi->kind, code & 1, code & 2, biasPointer(*epi), epi->aux));
  }
  cudaEvent_t e0, e1;
  FSDP_CUDA_CHECK(cudaEventCreate(&e0));
  FSDP_CUDA_CHECK(cudaEventCreate(&e1));
  float alpha = 1.f, beta = 0.f, best = 0.f;
  int chosen = -1;
  auto h = static_cast<cublasLtHandle_t>(handle_);
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize > wsBytes_)
      continue;
    const cublasLtMatmulAlgo_t *algo = &results[i].algo;
    bool ok = cublasLtMatmul(h, p.desc, &alpha, b, p.la, a, p.lb, &beta, c, p.lc, c, p.lc, algo,
                             ws_, wsBytes_, 0) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cudaEventRecord(e0, 0) == cudaSuccess;
    for (int r = 0; r < 3 && ok; ++r)
      ok = cublasLtMatmul(h, p.desc, &alpha, b, p.la, a, p.lb, &beta, c, p.lc, c, p.lc, algo,
                          ws_, wsBytes_, 0) == CUBLAS_STATUS_SUCCESS;
    float ms = 0.f;
    ok = ok && cudaEventRecord(e1, 0) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
         cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
    (void)cudaGetLastError();
    if (ok && (chosen < 0 || ms < best)) {
      chosen = i;
      best = ms;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (chosen > 0)
    p.algo = results[chosen].algo;
  if (chosen >= 0) { // a shape counts as tuned when a candidate ran
    ++tuned_;
    if (epi && epi->kind != Epilogue::None)
      ++tunedEpilogue_;
  }
  if (chosen > 0)
    ++tunedChanged_;
  return Status::ok();
}

Status Gemm::run(const float *a, const float *b, float *c, int64_t batch, int64_t m, int64_t n,
                 int64_t k, bool transA, bool transB, cudaStream_t s, const float *acc) {
  return run(FloatKind::F32, a, b, c, batch, m, n, k, transA, transB, s, acc);
}

Gemm::Key Gemm::key(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA,
                    bool transB, const void *a, const void *b, const void *c,
                    const EpilogueArgs &ep, bool pad) {
  size_t e = elemBytes(t.in), eOut = elemBytes(t.out);
  const void *bias = biasPointer(ep);
  return Key{int(t.in) | int(t.out) << 4,
             batch,
             m,
             n,
             k,
             transA,
             transB,
             alignment(a, e),
             alignment(b, e),
             alignment(c, eOut),
             epilogueCode(ep),
             alignment(bias, eOut),
             alignment(ep.aux, eOut),
             pad};
}

size_t Gemm::stagingNeed(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k,
                         bool transA, bool transB) {
  // Staging copies 16-bit rows: an f32 product is never staged (nor are
  // its operands: the f32 row of C may be misaligned the same way).
  if (t.in == FloatKind::F32 || t.out != t.in || batch != 1 || m <= 0 || n <= 0 || k <= 0)
    return 0;
  Operands o = operands(m, n, k, transA, transB);
  size_t need = 0;
  for (auto [rows, ld] : std::initializer_list<std::pair<int64_t, int64_t>>{
           {o.rowsA, o.ldA}, {o.rowsB, o.ldB}, {o.rowsC, o.ldC}})
    if (ld % 8)
      need += stagedBytes(rows, ld);
  return need;
}

Status Gemm::reserveStaging(size_t bytes) {
  if (bytes <= stageBytes_)
    return Status::ok();
  if (stage_)
    FSDP_CUDA_CHECK(cudaFree(stage_));
  stage_ = nullptr;
  stageBytes_ = 0;
  FSDP_CUDA_CHECK(cudaMalloc(&stage_, bytes));
  stageBytes_ = bytes;
  return Status::ok();
}

bool Gemm::warmEpilogue(GemmType t, int64_t m, int64_t n, int64_t k, bool transA, bool transB,
                        const void *a, const void *b, const void *c, const EpilogueArgs &e,
                        const void *acc) {
  if (m <= 0 || n <= 0 || k <= 0)
    return false; // degenerate: the unfused kernels handle it
  Plan *p;
  // Tuned (setTuning) where every pointer is given, on them (C, never acc).
  const bool all = a && b && c;
  return plan(key(t, 1, m, n, k, transA, transB, a, b, lessAligned(c, acc, elemBytes(t.out)), e), p,
              all ? a : nullptr, all ? b : nullptr, const_cast<void *>(c), &e)
      .isOk();
}

Status Gemm::run(GemmType t, const void *a, const void *b, void *c, int64_t m, int64_t n, int64_t k,
                 bool transA, bool transB, const EpilogueArgs &e, cudaStream_t s, const void *acc) {
  if (m <= 0 || n <= 0 || k <= 0)
    return FSDP_ERROR("a GEMM epilogue on an empty product ([", m, ", ", k, "] x [", k, ", ",
                      n, "])");
  Plan *p;
  FSDP_RETURN_IF_ERROR(
      plan(key(t, 1, m, n, k, transA, transB, a, b, lessAligned(c, acc, elemBytes(t.out)), e), p));
  int code = epilogueCode(e);
  void *bias = biasPointer(e);
  FSDP_RETURN_IF_ERROR(
      setEpiloguePointers(p->desc, e.kind, code & 1, code & 2, bias, e.aux));
  float alpha = 1.f, beta = acc ? 1.f : 0.f;
  FSDP_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p->desc, &alpha, b,
                                   p->la, a, p->lb, &beta, acc ? acc : c, p->lc, c, p->lc, &p->algo,
                                   ws_, wsBytes_, s));
  return Status::ok();
}

Status Gemm::warm(GemmType t, int64_t batch, int64_t m, int64_t n, int64_t k, bool transA,
                  bool transB, const void *a, const void *b, const void *c, const void *acc) {
  if (batch <= 0 || m <= 0 || n <= 0 || k <= 0)
    return Status::ok();
  if (batch > INT32_MAX)
    return FSDP_ERROR("GEMM batch ", batch, " exceeds cuBLASLt's int32 batch count");
  Plan *p;
  size_t need = stagingNeed(t, batch, m, n, k, transA, transB);
  // Tuned on C (never on the accumulator, whose contents a candidate's
  // timing run would overwrite), keyed by the less aligned of the two.
  void *cc = const_cast<void *>(c);
  if (need && need <= stageBytes_) { // the staged GEMM: the pointers runStaged will use
    stagedPointers(m, n, k, transA, transB, a, b, cc);
    // A staged C is the accumulator's copy too; an unstaged one reads it in place.
    const void *keyC = cc != c ? cc : lessAligned(c, acc, elemBytes(t.out));
    return plan(key(t, batch, m, n, k, transA, transB, a, b, keyC, {}, true), p, a, b, cc);
  }
  return plan(key(t, batch, m, n, k, transA, transB, a, b, lessAligned(c, acc, elemBytes(t.out))),
              p, a, b, cc);
}

Status Gemm::run(GemmType t, const void *a, const void *b, void *c, int64_t batch, int64_t m,
                 int64_t n, int64_t k, bool transA, bool transB, cudaStream_t s, const void *acc) {
  if (batch <= 0 || m <= 0 || n <= 0)
    return Status::ok();
  const size_t bytesC = elemBytes(t.out) * batch * m * n;
  if (k == 0) // an empty contraction: C = 0 (C = acc), as cpu::matmul
    return !acc
               ? cudaStatus(cudaMemsetAsync(c, 0, bytesC, s), "cudaMemsetAsync", __FILE__, __LINE__)
           : acc == c ? Status::ok()
                      : cudaStatus(cudaMemcpyAsync(c, acc, bytesC, cudaMemcpyDeviceToDevice, s),
                                   "cudaMemcpyAsync", __FILE__, __LINE__);
  if (batch > INT32_MAX)
    return FSDP_ERROR("GEMM batch ", batch, " exceeds cuBLASLt's int32 batch count");
  size_t need = stagingNeed(t, batch, m, n, k, transA, transB);
  if (need && need <= stageBytes_)
    return runStaged(t, a, b, c, m, n, k, transA, transB, s, acc);
  Plan *p;
  FSDP_RETURN_IF_ERROR(
      plan(key(t, batch, m, n, k, transA, transB, a, b, lessAligned(c, acc, elemBytes(t.out))), p));
  float alpha = 1.f, beta = acc ? 1.f : 0.f;
  FSDP_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p->desc, &alpha, b,
                                   p->la, a, p->lb, &beta, acc ? acc : c, p->lc, c, p->lc, &p->algo,
                                   ws_, wsBytes_, s));
  return Status::ok();
}

/// Where the staged GEMM reads A and B and writes C: staging for a
/// misaligned operand (A's copy first, then B's, then C), else in place.
void Gemm::stagedPointers(int64_t m, int64_t n, int64_t k, bool transA, bool transB,
                          const void *&a, const void *&b, void *&c) const {
  Operands o = operands(m, n, k, transA, transB);
  auto *next = static_cast<uint8_t *>(stage_);
  if (o.ldA % 8) {
    a = next;
    next += stagedBytes(o.rowsA, o.ldA);
  }
  if (o.ldB % 8) {
    b = next;
    next += stagedBytes(o.rowsB, o.ldB);
  }
  if (o.ldC % 8)
    c = next;
}

Status Gemm::runStaged(GemmType t, const void *a, const void *b, void *c, int64_t m, int64_t n,
                       int64_t k, bool transA, bool transB, cudaStream_t s, const void *acc) {
  Operands o = operands(m, n, k, transA, transB);
  // Where each operand is read and C written (stagedPointers, as warm()
  // planned it); a misaligned operand is first copied there, its rows padded.
  const void *sa = a, *sb = b;
  void *sc = c;
  stagedPointers(m, n, k, transA, transB, sa, sb, sc);
  for (auto [src, dst, rows, ld] :
       {std::tuple{a, sa, o.rowsA, o.ldA}, std::tuple{b, sb, o.rowsB, o.ldB}})
    if (dst != src)
      FSDP_CUDA_CHECK(cudaMemcpy2DAsync(const_cast<void *>(dst), (size_t)padded(ld) * 2, src,
                                        (size_t)ld * 2, (size_t)ld * 2, (size_t)rows,
                                        cudaMemcpyDeviceToDevice, s));
  // Accumulating into a staged C: the accumulator's rows are copied in
  // first; into an unstaged one (its rows already a multiple of 8, the
  // accumulator's too) it is read where it lies.
  const void *sacc = acc;
  if (acc && sc != c) {
    FSDP_CUDA_CHECK(cudaMemcpy2DAsync(sc, (size_t)padded(n) * 2, acc, (size_t)n * 2, (size_t)n * 2,
                                      (size_t)m, cudaMemcpyDeviceToDevice, s));
    sacc = sc;
  }
  // Every ld is a multiple of 8 now: the padded plan (its lds are the
  // padded row lengths, those of aligned operands unchanged).
  Plan *p;
  FSDP_RETURN_IF_ERROR(
      plan(key(t, 1, m, n, k, transA, transB, sa, sb, lessAligned(sc, sacc, 2), {}, true), p));
  float alpha = 1.f, beta = acc ? 1.f : 0.f;
  FSDP_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p->desc, &alpha, sb,
                                   p->la, sa, p->lb, &beta, sacc ? sacc : sc, p->lc, sc, p->lc,
                                   &p->algo, ws_, wsBytes_, s));
  if (sc != c)
    FSDP_CUDA_CHECK(cudaMemcpy2DAsync(c, (size_t)n * 2, sc, (size_t)padded(n) * 2,
                                      (size_t)n * 2, (size_t)m, cudaMemcpyDeviceToDevice, s));
  return Status::ok();
}

} // namespace fsdp::cuda
