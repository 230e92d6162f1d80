//===- EmuCublasLt.cpp - cuBLASLt on the host CPU, for tests --------------===//
//
// A CPU implementation of the part of the cuBLASLt API that
// runtime/cuda/CudaGemm.cpp uses, so that the CUDA backend's tests can run
// without a GPU (device pointers are host memory in the emulator). It is a
// test emulator, not a GPU result: it computes what NVIDIA's documentation
// says cublasLtMatmul computes, with its own (sequential) summation order,
// and it is deliberately stricter than a real GPU where the documentation
// states a requirement, so that misuse fails here instead of misbehaving on
// hardware. The semantics come from the doc comments of
// /usr/local/cuda/include/cublasLt.h (cuBLAS 13.1, quoted next to each use)
// and, where the header is silent (the GELU formula, what DGELU_BGRAD sums,
// DGELU with k = 1), from NVIDIA's own tests of these epilogues against the
// real library: nvmath-python, tests/nvmath_tests/linalg/advanced/matmul/
// test_epilog.py (simulate_epilog) and nvmath/linalg/_internal/
// epilog_protocol.py. It follows those sources, not CudaGemm.cpp's comments:
// the point is an independent check of how CudaGemm.cpp calls cuBLASLt.
//
// Numerics: D = epilogue(alpha * op(A) op(B) + beta * C) with every operand
// widened exactly to f32 (bf16 / f16 with the host conversions of
// cuda_bf16.h / cuda_fp16.h), f32 products and an f32 accumulator summed in
// k order (p = 0, 1, ..., k-1) for each output element, then one
// round-to-nearest-even conversion to D's type. CUBLAS_COMPUTE_32F_FAST_TF32
// first rounds each A and B element to TF32 (10 explicit mantissa bits,
// round to nearest even). A GPU sums in an order of its own (and may use
// split-K), so tests compare with a tolerance, never bit for bit.
//
// The matmul runs on the stream as the emulator runs kernels
// (cudaemu::enqueue: at the call, or captured into a CUDA graph). There is
// no global mutable state: every object is owned by its handle and each
// call works on locals, so calls from several host threads on distinct
// descriptors are safe. No exception crosses the C API.
//
//===----------------------------------------------------------------------===//

#include "test/cudaemu/EmuInternal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

/// The handle's pointee (the header names the tag: `typedef struct
/// cublasLtContext *cublasLtHandle_t`).
struct cublasLtContext {
  uint64_t magic;
};

namespace {

// Tags in the first word of each object, so that a destroyed or foreign
// pointer is refused (best effort: it reads the word) instead of used.
constexpr uint64_t kHandleMagic = 0x454d55484e444c31ull; // "EMUHNDL1"
constexpr uint64_t kLayoutMagic = 0x454d554c41594f31ull;
constexpr uint64_t kDescMagic = 0x454d554d4d444531ull;
constexpr uint64_t kPrefMagic = 0x454d555052454631ull;
constexpr uint64_t kAlgoMagic = 0x454d55414c474f31ull;

/// An opaque object: the header's semi-opaque struct first (so that the
/// pointer handed out is a pointer to it, and converts back), then the
/// attribute values, each in a 64-bit slot indexed by the attribute's enum
/// value, stored as the bytes the caller passed.
template <class Opaque, int N> struct Object {
  Opaque opaque; // opaque.data[0]: the magic
  uint64_t val[N];

  template <class T> T get(int a) const {
    T v;
    std::memcpy(&v, &val[a], sizeof(T));
    return v;
  }
  template <class T> void put(int a, T v) {
    val[a] = 0;
    std::memcpy(&val[a], &v, sizeof(T));
  }
};
using Layout = Object<cublasLtMatrixLayoutOpaque_t, 9>;
using Desc = Object<cublasLtMatmulDescOpaque_t, 40>;
using Pref = Object<cublasLtMatmulPreferenceOpaque_t, 13>;

template <class Obj, class P> Obj *objectOf(P p, uint64_t magic) {
  if (!p || p->data[0] != magic)
    return nullptr;
  return reinterpret_cast<Obj *>(p);
}
bool validHandle(cublasLtHandle_t h) { return h && h->magic == kHandleMagic; }

/// The documented storage size of each attribute ("int32_t", "uint64_t",
/// "void *" ... in the attribute's doc comment in cublasLt.h); 0 for an
/// attribute this header does not have. A set with another size is
/// CUBLAS_STATUS_INVALID_VALUE ("if buf is NULL or sizeInBytes doesn't
/// match size of internal storage for selected attribute").
size_t layoutAttrSize(int a) {
  switch (a) {
  case CUBLASLT_MATRIX_LAYOUT_TYPE:       // uint32_t
  case CUBLASLT_MATRIX_LAYOUT_ORDER:      // int32_t
  case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: // int32_t
  case CUBLASLT_MATRIX_LAYOUT_BATCH_MODE: // uint32_t
    return 4;
  case CUBLASLT_MATRIX_LAYOUT_ROWS:                 // uint64_t
  case CUBLASLT_MATRIX_LAYOUT_COLS:                 // uint64_t
  case CUBLASLT_MATRIX_LAYOUT_LD:                   // int64_t
  case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: // int64_t
  case CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET:         // int64_t
    return 8;
  default:
    return 0;
  }
}

size_t descAttrSize(int a) {
  switch (a) {
  case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
  case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
  case CUBLASLT_MATMUL_DESC_POINTER_MODE:
  case CUBLASLT_MATMUL_DESC_TRANSA:
  case CUBLASLT_MATMUL_DESC_TRANSB:
  case CUBLASLT_MATMUL_DESC_TRANSC:
  case CUBLASLT_MATMUL_DESC_FILL_MODE:
  case CUBLASLT_MATMUL_DESC_EPILOGUE: // uint32_t
  case CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
  case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
  case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
  case CUBLASLT_MATMUL_DESC_B_SCALE_MODE:
  case CUBLASLT_MATMUL_DESC_C_SCALE_MODE:
  case CUBLASLT_MATMUL_DESC_D_SCALE_MODE:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE:
  case CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE:
    return 4; // int32_t unless noted
  case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
  case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_C_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_D_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_AMAX_D_POINTER:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER:
  case CUBLASLT_MATMUL_DESC_D_OUT_SCALE_POINTER:
  case CUBLASLT_MATMUL_DESC_EMULATION_DESCRIPTOR:
    return sizeof(void *);
  case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
  case CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE:
    return 8; // int64_t
  case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
    return 1; // int8_t
  default:
    return 0;
  }
}

size_t prefAttrSize(int a) {
  switch (a) {
  case CUBLASLT_MATMUL_PREF_SEARCH_MODE:           // uint32_t
  case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: // uint32_t
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: // uint32_t
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
  case CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT: // float
    return 4;
  case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: // uint64_t
  case CUBLASLT_MATMUL_PREF_IMPL_MASK:           // uint64_t
    return 8;
  default:
    return 0;
  }
}

template <class Obj>
cublasStatus_t setAttr(Obj *o, int attr, size_t expected, const void *buf, size_t size) {
  if (!o || !buf || expected == 0 || size != expected)
    return CUBLAS_STATUS_INVALID_VALUE;
  o->val[attr] = 0;
  std::memcpy(&o->val[attr], buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

size_t elemBytes(int32_t t) {
  switch (t) {
  case CUDA_R_32F:
    return 4;
  case CUDA_R_16BF:
  case CUDA_R_16F:
    return 2;
  default:
    return 0;
  }
}

float load(int32_t t, const void *p, int64_t i) {
  switch (t) {
  case CUDA_R_16BF:
    return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
  case CUDA_R_16F:
    return __half2float(static_cast<const __half *>(p)[i]);
  default:
    return static_cast<const float *>(p)[i];
  }
}

void store(int32_t t, void *p, int64_t i, float v) {
  switch (t) {
  case CUDA_R_16BF:
    static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
    break;
  case CUDA_R_16F:
    static_cast<__half *>(p)[i] = __float2half_rn(v);
    break;
  default:
    static_cast<float *>(p)[i] = v;
  }
}

/// x rounded to TF32 (1 + 8 + 10 bits), round to nearest even; what
/// CUBLAS_COMPUTE_32F_FAST_TF32 "allows down-converting inputs to"
/// (cublas_api.h). Inf and NaN are kept as they are.
float toTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u)
    return x;
  u += 0x0fffu + ((u >> 13) & 1u);
  u &= 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

/// GELU, tanh approximation. cublasLt.h only says "apply GELU point-wise
/// transform to the results (x:=GELU(x))"; NVIDIA's test of this epilogue
/// against the library (nvmath-python test_epilog.py, gelu() and dgelu())
/// uses 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) and its derivative.
/// Evaluated in double, rounded once to float.
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCubic = 0.044715;
float gelu(float xf) {
  double x = xf;
  return float(0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x))));
}
float dgelu(float xf) {
  double x = xf;
  double t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  return float(0.5 * (1.0 + t) +
               0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * x * x));
}

/// What an epilogue reads and writes (cublasLtEpilogue_t in cublasLt.h).
struct Epi {
  bool known = false;
  bool bias = false;   // adds the bias vector
  bool relu = false;   // x := max(x, 0)
  bool gelu = false;   // x := GELU(x)
  bool auxOut = false; // writes the GELU input to the aux matrix
  bool dgelu = false;  // multiplies by GELU'(aux)
  bool bgrad = false;  // writes the bias gradient (of the result: DGELU_BGRAD)
  bool bgradA = false; // writes the bias gradient of op(A): sum over k, m values
  bool bgradB = false; // writes the bias gradient of op(B): sum over k, n values
  /// Whether the epilogue reads or writes the bias pointer.
  bool biasVector() const { return bias || bgrad || bgradA || bgradB; }
};
Epi epiOf(uint32_t e) {
  Epi r;
  r.known = true;
  switch (e) {
  case CUBLASLT_EPILOGUE_DEFAULT:
    break;
  case CUBLASLT_EPILOGUE_RELU:
    r.relu = true;
    break;
  case CUBLASLT_EPILOGUE_BIAS:
    r.bias = true;
    break;
  case CUBLASLT_EPILOGUE_RELU_BIAS:
    r.bias = r.relu = true;
    break;
  case CUBLASLT_EPILOGUE_GELU:
    r.gelu = true;
    break;
  case CUBLASLT_EPILOGUE_GELU_AUX:
    r.gelu = r.auxOut = true;
    break;
  case CUBLASLT_EPILOGUE_GELU_BIAS:
    r.gelu = r.bias = true;
    break;
  case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    r.gelu = r.bias = r.auxOut = true;
    break;
  case CUBLASLT_EPILOGUE_DGELU:
    r.dgelu = true;
    break;
  case CUBLASLT_EPILOGUE_DGELU_BGRAD:
    r.dgelu = r.bgrad = true;
    break;
  // "BGRADA: Apply Bias gradient to the input matrix A. The bias size
  // corresponds to the number of rows of the matrix D. The reduction
  // happens over the GEMM's "k" dimension." BGRADB the same for B and the
  // number of columns of D. D = op(A) op(B) is written unchanged.
  case CUBLASLT_EPILOGUE_BGRADA:
    r.bgradA = true;
    break;
  case CUBLASLT_EPILOGUE_BGRADB:
    r.bgradB = true;
    break;
  default:
    // The ReLU bit-mask epilogues (RELU_AUX*, DRELU*) are not emulated:
    // CUBLAS_STATUS_NOT_SUPPORTED.
    r.known = false;
  }
  return r;
}

/// The largest power of two dividing p, capped at 256 (the preferences'
/// documented default); null counts as 256. The heuristic reads the
/// bias and aux pointers' alignment from their values: "Routines that
/// don't dereference this pointer, like cublasLtMatmulAlgoGetHeuristic()
/// depend on its value to determine expected pointer alignment."
uint32_t alignmentOf(const void *p) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uintptr_t low = v & (~v + 1);
  return low == 0 || low > 256 ? 256u : uint32_t(low);
}
bool alignedTo(const void *p, uint64_t al) {
  return al <= 1 || reinterpret_cast<uintptr_t>(p) % al == 0;
}

/// One matrix's layout, read from its descriptor.
struct Mat {
  int32_t type;
  int64_t rows, cols, ld, stride;
  int32_t batch;
};

/// A matmul's configuration, resolved and checked.
struct Problem {
  int32_t compute, scale;
  bool transA, transB;
  uint32_t epilogue;
  Epi epi;
  int64_t m, n, k;
  int32_t batch;
  Mat a, b, c, d;
  int32_t biasType, auxType;
  int64_t biasStride, auxLd, auxStride;
};

cublasStatus_t readLayout(const Layout *l, Mat &out) {
  if (l->get<int32_t>(CUBLASLT_MATRIX_LAYOUT_ORDER) != CUBLASLT_ORDER_COL ||
      l->get<int64_t>(CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET) != 0 ||
      l->get<uint32_t>(CUBLASLT_MATRIX_LAYOUT_BATCH_MODE) != CUBLASLT_BATCH_MODE_STRIDED)
    return CUBLAS_STATUS_NOT_SUPPORTED; // not emulated: column order, strided batches only
  uint64_t rows = l->get<uint64_t>(CUBLASLT_MATRIX_LAYOUT_ROWS);
  uint64_t cols = l->get<uint64_t>(CUBLASLT_MATRIX_LAYOUT_COLS);
  // ROWS / COLS: "Usually only values that can be expressed as int32_t
  // are supported."
  if (rows > INT32_MAX || cols > INT32_MAX)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  out.type = int32_t(l->get<uint32_t>(CUBLASLT_MATRIX_LAYOUT_TYPE));
  out.rows = int64_t(rows);
  out.cols = int64_t(cols);
  out.ld = l->get<int64_t>(CUBLASLT_MATRIX_LAYOUT_LD);
  out.batch = l->get<int32_t>(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT);
  out.stride = l->get<int64_t>(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET);
  // LD: "Currently only non-negative values are supported, must be large
  // enough so that matrix memory locations are not overlapping (e.g.
  // greater or equal to CUBLASLT_MATRIX_LAYOUT_ROWS in case of
  // CUBLASLT_ORDER_COL)."
  if (out.ld < 0 || out.ld < out.rows || out.batch < 1 || out.stride < 0)
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

/// Resolves and checks everything cublasLtMatmulAlgoGetHeuristic and
/// cublasLtMatmul both need: a status other than success when the
/// configuration is inconsistent (INVALID_VALUE: "parameters are in
/// conflict or in an impossible configuration") or not one the emulator
/// (or, where noted, cuBLASLt) runs (NOT_SUPPORTED).
cublasStatus_t resolve(const Desc *desc, const Layout *la, const Layout *lb,
                       const Layout *lc, const Layout *ld, Problem &p) {
  cublasStatus_t st;
  if ((st = readLayout(la, p.a)) != CUBLAS_STATUS_SUCCESS ||
      (st = readLayout(lb, p.b)) != CUBLAS_STATUS_SUCCESS ||
      (st = readLayout(lc, p.c)) != CUBLAS_STATUS_SUCCESS ||
      (st = readLayout(ld, p.d)) != CUBLAS_STATUS_SUCCESS)
    return st;

  p.compute = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE);
  p.scale = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_SCALE_TYPE);
  int32_t ta = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSA);
  int32_t tb = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSB);
  auto validOp = [](int32_t o) {
    return o == CUBLAS_OP_N || o == CUBLAS_OP_T || o == CUBLAS_OP_C;
  };
  if (!validOp(ta) || !validOp(tb))
    return CUBLAS_STATUS_INVALID_VALUE;
  // Real types: the conjugate transpose is the transpose.
  p.transA = ta != CUBLAS_OP_N;
  p.transB = tb != CUBLAS_OP_N;
  // TRANSC: "Currently only CUBLAS_OP_N is supported."
  if (desc->get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSC) != CUBLAS_OP_N ||
      desc->get<int32_t>(CUBLASLT_MATMUL_DESC_FILL_MODE) != CUBLAS_FILL_MODE_FULL ||
      desc->get<int32_t>(CUBLASLT_MATMUL_DESC_POINTER_MODE) != CUBLASLT_POINTER_MODE_HOST)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  // The scale / amax pointers and scale modes are for fp8 / block-scaled
  // types: "If set for an unsupported matrix data, scale, and compute type
  // combination, calling cublasLtMatmul() will return CUBLAS_INVALID_VALUE."
  for (int a : {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                CUBLASLT_MATMUL_DESC_C_SCALE_POINTER, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER,
                CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_POINTER,
                CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER,
                CUBLASLT_MATMUL_DESC_D_OUT_SCALE_POINTER, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                CUBLASLT_MATMUL_DESC_B_SCALE_MODE, CUBLASLT_MATMUL_DESC_C_SCALE_MODE,
                CUBLASLT_MATMUL_DESC_D_SCALE_MODE, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE,
                CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE})
    if (desc->val[a] != 0)
      return CUBLAS_STATUS_INVALID_VALUE;

  // Shapes: D = alpha op(A) op(B) + beta C with op(A) m x k, op(B) k x n,
  // C and D m x n (the header's "D = alpha * op(A) * op(B) + beta * C").
  p.m = p.d.rows;
  p.n = p.d.cols;
  int64_t aRows = p.transA ? p.a.cols : p.a.rows;
  p.k = p.transA ? p.a.rows : p.a.cols;
  int64_t bRows = p.transB ? p.b.cols : p.b.rows;
  int64_t bCols = p.transB ? p.b.rows : p.b.cols;
  if (aRows != p.m || bRows != p.k || bCols != p.n || p.c.rows != p.m || p.c.cols != p.n)
    return CUBLAS_STATUS_INVALID_VALUE;
  // One batch count for all four ("Number of matmul operations to perform
  // in the batch"; our reading: nvmath-python broadcasts an operand with
  // stride 0 and the common count, never with count 1).
  p.batch = p.d.batch;
  if (p.a.batch != p.batch || p.b.batch != p.batch || p.c.batch != p.batch)
    return CUBLAS_STATUS_INVALID_VALUE;
  // Our inference from the LD rule ("not overlapping"): the batch's D
  // matrices must not overlap either, or the GPU's writes would race.
  if (p.batch > 1 && p.m > 0 && p.n > 0 && p.d.stride < p.d.ld * (p.n - 1) + p.m)
    return CUBLAS_STATUS_INVALID_VALUE;

  // Types (the cuBLAS guide's table of cublasLtMatmul type combinations,
  // its f32-accumulation rows): f32 accumulation with an f32 scale type;
  // A and B of one type, C and D of one type; bf16 / f16 inputs with an
  // output of the same type or f32; TF32 only on f32.
  if (p.a.type != p.b.type || p.c.type != p.d.type || p.scale != CUDA_R_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  bool f32 = p.a.type == CUDA_R_32F && p.d.type == CUDA_R_32F;
  bool narrow = (p.a.type == CUDA_R_16BF || p.a.type == CUDA_R_16F) &&
                (p.d.type == p.a.type || p.d.type == CUDA_R_32F);
  if (p.compute == CUBLAS_COMPUTE_32F || p.compute == CUBLAS_COMPUTE_32F_PEDANTIC) {
    if (!f32 && !narrow)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (p.compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
    if (!f32)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  } else {
    return CUBLAS_STATUS_NOT_SUPPORTED; // not emulated
  }

  p.epilogue = desc->get<uint32_t>(CUBLASLT_MATMUL_DESC_EPILOGUE);
  p.epi = epiOf(p.epilogue);
  if (!p.epi.known)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  p.biasStride = desc->get<int64_t>(CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE);
  p.auxLd = desc->get<int64_t>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD);
  p.auxStride = desc->get<int64_t>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE);
  int32_t biasAttr = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE);
  int32_t auxAttr = desc->get<int32_t>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE);
  p.biasType = biasAttr == -1 ? p.d.type : biasAttr;
  p.auxType = auxAttr == -1 ? p.d.type : auxAttr;
  if (p.epi.biasVector()) {
    // BIAS_DATA_TYPE: "Bias vector elements are the same type as the
    // elements of output matrix (Dtype)" with exceptions only for IMMA and
    // fp8 kernels; BIAS_POINTER: "Bias gradient vector elements are the
    // same type as the output elements (Ctype)".
    if (p.biasType != p.d.type)
      return CUBLAS_STATUS_NOT_SUPPORTED;
    if (p.biasStride < 0)
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p.epi.auxOut || p.epi.dgelu) {
    // AUX_DATA_TYPE: "GELU input matrix elements type is the same as the
    // type of elements of the output matrix" (exceptions for fp8 only);
    // "If set for an unsupported ... combination, calling cublasLtMatmul()
    // will return CUBLAS_INVALID_VALUE."
    if (p.auxType != p.d.type)
      return CUBLAS_STATUS_INVALID_VALUE;
    // AUX_LD: "GELU input matrix leading dimension in elements ... Must be
    // divisible by 8 and be no less than the number of rows in the output
    // matrix." (default 0; AUX_POINTER: "Requires setting
    // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD attribute"). The header names
    // GELU_AUX_BIAS and DGELU_BGRAD; GELU_AUX and DGELU read or write the
    // same matrix, so the rule is applied to them as well.
    // AUX_BATCH_STRIDE: "GELU input matrix batch stride ... Must be
    // divisible by 8."
    if (p.auxLd <= 0 || p.auxLd % 8 != 0 || p.auxLd < p.m || p.auxStride < 0 ||
        p.auxStride % 8 != 0)
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  // nvmath-python epilog_protocol.py (DGeluAuxHandler): "K=1 is not
  // supported by cuBLAS" for DGELU and DGELU_BGRAD.
  if (p.epi.dgelu && p.k == 1)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

// The emulated algorithm (cublasLtMatmulAlgo_t::data, "semi-opaque"):
// what the heuristic was told, so that cublasLtMatmul can refuse a call
// that breaks it.
enum AlgoWord {
  kAlgoTag,       // kAlgoMagic
  kAlgoAlignAB,   // preference MIN_ALIGNMENT_A | _B << 32
  kAlgoAlignCD,   // preference MIN_ALIGNMENT_C | _D << 32
  kAlgoAlignEpi,  // alignment of the bias | aux pointer values << 32
  kAlgoEpiComp,   // epilogue | compute type << 32
  kAlgoTypes,     // A | B << 16 | C << 32 | D << 48 (cudaDataType)
  kAlgoWorkspace, // bytes needed: 0
};

uint64_t typesWord(const Problem &p) {
  return uint64_t(uint16_t(p.a.type)) | uint64_t(uint16_t(p.b.type)) << 16 |
         uint64_t(uint16_t(p.c.type)) << 32 | uint64_t(uint16_t(p.d.type)) << 48;
}
uint64_t epiCompWord(const Problem &p) {
  return uint64_t(p.epilogue) | uint64_t(uint32_t(p.compute)) << 32;
}

/// op(X) (rows x cols of the product's view) widened to f32, column-major
/// with leading dimension `rows`, TF32-rounded when asked: the operands
/// are read once, and the product loop then walks contiguous memory.
void widen(const Mat &x, const void *base, int64_t batchIndex, bool trans, int64_t rows,
           int64_t cols, bool tf32, std::vector<float> &out) {
  out.resize(size_t(rows * cols));
  int64_t off = batchIndex * x.stride;
  if (!trans) { // stored rows x cols
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < rows; ++i)
        out[size_t(i + j * rows)] = load(x.type, base, off + i + j * x.ld);
  } else { // stored cols x rows: op(X)(i, j) = X(j, i)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        out[size_t(i + j * rows)] = load(x.type, base, off + j + i * x.ld);
  }
  if (tf32)
    for (float &v : out)
      v = toTf32(v);
}

void compute(const Problem &p, float alpha, float beta, const void *A, const void *B,
             const void *C, void *D, void *bias, void *aux) {
  bool tf32 = p.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  std::vector<float> opA, opB, acc(size_t(p.m)), bgrad;
  for (int32_t bi = 0; bi < p.batch; ++bi) {
    widen(p.a, A, bi, p.transA, p.m, p.k, tf32, opA); // m x k
    widen(p.b, B, bi, p.transB, p.k, p.n, tf32, opB); // k x n
    int64_t cOff = bi * p.c.stride, dOff = bi * p.d.stride;
    int64_t biasOff = bi * p.biasStride, auxOff = bi * p.auxStride;
    if (p.epi.bgrad)
      bgrad.assign(size_t(p.m), 0.f);
    for (int64_t j = 0; j < p.n; ++j) {
      std::fill(acc.begin(), acc.end(), 0.f);
      // f32 accumulation in k order for every element of column j.
      for (int64_t q = 0; q < p.k; ++q) {
        float bv = opB[size_t(q + j * p.k)];
        const float *ac = opA.data() + q * p.m;
        for (int64_t i = 0; i < p.m; ++i)
          acc[size_t(i)] += ac[i] * bv;
      }
      for (int64_t i = 0; i < p.m; ++i) {
        float t = alpha * acc[size_t(i)];
        // beta == 0: C is not read (the BLAS convention), so an
        // uninitialised C cannot leak NaN into D.
        if (beta != 0.f)
          t += beta * load(p.c.type, C, cOff + i + j * p.c.ld);
        // BIAS: "Bias vector length must match matrix D rows, it must be
        // packed (stride between vector elements is 1). Bias vector is
        // broadcasted to all columns and added before applying final
        // postprocessing."
        if (p.epi.bias)
          t += load(p.biasType, bias, biasOff + i);
        // GELU_AUX(_BIAS): "outputs GELU input as a separate matrix"
        // (AUX_POINTER: "Output of GELU input matrix in forward pass"):
        // the value after the bias, before GELU, in the aux type.
        if (p.epi.auxOut)
          store(p.auxType, aux, auxOff + i + j * p.auxLd, t);
        if (p.epi.gelu)
          t = gelu(t);
        if (p.epi.relu)
          t = t > 0.f ? t : 0.f; // "x:=max(x, 0)"
        // DGELU: "Apply GELU gradient to matmul output. Store GELU
        // gradient in the output matrix." i.e. D = (alpha AB + beta C) *
        // GELU'(aux) with aux the forward pass's GELU input (AUX_POINTER:
        // "Input of GELU input matrix for backward pass"); nvmath's
        // simulate_dgelu: (a @ b) * dgelu(x).
        if (p.epi.dgelu)
          t *= dgelu(load(p.auxType, aux, auxOff + i + j * p.auxLd));
        // DGELU_BGRAD: "Store GELU gradient in the output matrix, and Bias
        // gradient in the auxiliary output (see
        // CUBLASLT_MATMUL_DESC_BIAS_POINTER)"; its length is D's rows
        // (BIAS_POINTER). nvmath's reference: result.sum(axis=1) of the
        // DGELU result, i.e. the sum over D's columns of the GELU
        // gradient. Summed here in f32 before D's rounding.
        if (p.epi.bgrad)
          bgrad[size_t(i)] += t;
        store(p.d.type, D, dOff + i + j * p.d.ld, t);
      }
    }
    if (p.epi.bgrad)
      for (int64_t i = 0; i < p.m; ++i)
        store(p.biasType, bias, biasOff + i, bgrad[size_t(i)]);
    // BGRADA / BGRADB: sums of the (widened) operand over k, in k order,
    // in f32, rounded once to the bias type.
    if (p.epi.bgradA)
      for (int64_t i = 0; i < p.m; ++i) {
        float t = 0.f;
        for (int64_t q = 0; q < p.k; ++q)
          t += opA[size_t(i + q * p.m)];
        store(p.biasType, bias, biasOff + i, t);
      }
    if (p.epi.bgradB)
      for (int64_t j = 0; j < p.n; ++j) {
        float t = 0.f;
        for (int64_t q = 0; q < p.k; ++q)
          t += opB[size_t(q + j * p.k)];
        store(p.biasType, bias, biasOff + j, t);
      }
  }
}

} // namespace

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t *lightHandle) {
  if (!lightHandle)
    return CUBLAS_STATUS_INVALID_VALUE;
  auto *h = new (std::nothrow) cublasLtContext{kHandleMagic};
  if (!h)
    return CUBLAS_STATUS_ALLOC_FAILED;
  *lightHandle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (!validHandle(lightHandle))
    return CUBLAS_STATUS_NOT_INITIALIZED;
  lightHandle->magic = 0;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

const char *CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
  case CUBLAS_STATUS_SUCCESS:
    return "CUBLAS_STATUS_SUCCESS";
  case CUBLAS_STATUS_NOT_INITIALIZED:
    return "CUBLAS_STATUS_NOT_INITIALIZED";
  case CUBLAS_STATUS_ALLOC_FAILED:
    return "CUBLAS_STATUS_ALLOC_FAILED";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "CUBLAS_STATUS_INVALID_VALUE";
  case CUBLAS_STATUS_ARCH_MISMATCH:
    return "CUBLAS_STATUS_ARCH_MISMATCH";
  case CUBLAS_STATUS_MAPPING_ERROR:
    return "CUBLAS_STATUS_MAPPING_ERROR";
  case CUBLAS_STATUS_EXECUTION_FAILED:
    return "CUBLAS_STATUS_EXECUTION_FAILED";
  case CUBLAS_STATUS_INTERNAL_ERROR:
    return "CUBLAS_STATUS_INTERNAL_ERROR";
  case CUBLAS_STATUS_NOT_SUPPORTED:
    return "CUBLAS_STATUS_NOT_SUPPORTED";
  case CUBLAS_STATUS_LICENSE_ERROR:
    return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char *CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
  switch (status) {
  case CUBLAS_STATUS_SUCCESS:
    return "success";
  case CUBLAS_STATUS_NOT_INITIALIZED:
    return "the library was not initialized";
  case CUBLAS_STATUS_ALLOC_FAILED:
    return "the resource allocation failed";
  case CUBLAS_STATUS_INVALID_VALUE:
    return "an invalid numeric value was used as an argument";
  case CUBLAS_STATUS_ARCH_MISMATCH:
    return "an absent device architectural feature is required";
  case CUBLAS_STATUS_MAPPING_ERROR:
    return "an access to GPU memory space failed";
  case CUBLAS_STATUS_EXECUTION_FAILED:
    return "the GPU program failed to execute";
  case CUBLAS_STATUS_INTERNAL_ERROR:
    return "an internal operation failed";
  case CUBLAS_STATUS_NOT_SUPPORTED:
    return "the functionality requested is not supported";
  case CUBLAS_STATUS_LICENSE_ERROR:
    return "error detected trying to check the license";
  }
  return "unknown error";
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *matLayout,
                                                       cudaDataType type, uint64_t rows,
                                                       uint64_t cols, int64_t ld) {
  if (!matLayout)
    return CUBLAS_STATUS_INVALID_VALUE;
  auto *l = new (std::nothrow) Layout{};
  if (!l)
    return CUBLAS_STATUS_ALLOC_FAILED;
  l->opaque.data[0] = kLayoutMagic;
  l->put<uint32_t>(CUBLASLT_MATRIX_LAYOUT_TYPE, uint32_t(type));
  l->put<int32_t>(CUBLASLT_MATRIX_LAYOUT_ORDER, CUBLASLT_ORDER_COL);
  l->put<uint64_t>(CUBLASLT_MATRIX_LAYOUT_ROWS, rows);
  l->put<uint64_t>(CUBLASLT_MATRIX_LAYOUT_COLS, cols);
  l->put<int64_t>(CUBLASLT_MATRIX_LAYOUT_LD, ld);
  l->put<int32_t>(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, 1);
  *matLayout = &l->opaque;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  Layout *l = objectOf<Layout>(matLayout, kLayoutMagic);
  if (!l)
    return matLayout ? CUBLAS_STATUS_INVALID_VALUE : CUBLAS_STATUS_SUCCESS;
  l->opaque.data[0] = 0;
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                             cublasLtMatrixLayoutAttribute_t attr,
                                                             const void *buf,
                                                             size_t sizeInBytes) {
  return setAttr(objectOf<Layout>(matLayout, kLayoutMagic), attr, layoutAttrSize(attr), buf,
                 sizeInBytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *matmulDesc,
                                                     cublasComputeType_t computeType,
                                                     cudaDataType_t scaleType) {
  if (!matmulDesc)
    return CUBLAS_STATUS_INVALID_VALUE;
  auto *d = new (std::nothrow) Desc{};
  if (!d)
    return CUBLAS_STATUS_ALLOC_FAILED;
  d->opaque.data[0] = kDescMagic;
  // The documented defaults; everything else defaults to 0 / NULL.
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, computeType);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_SCALE_TYPE, scaleType);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_HOST);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_TRANSC, CUBLAS_OP_N);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_FILL_MODE, CUBLAS_FILL_MODE_FULL);
  d->put<uint32_t>(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DEFAULT);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, -1);
  d->put<int32_t>(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, -1);
  *matmulDesc = &d->opaque;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  Desc *d = objectOf<Desc>(matmulDesc, kDescMagic);
  if (!d)
    return matmulDesc ? CUBLAS_STATUS_INVALID_VALUE : CUBLAS_STATUS_SUCCESS;
  d->opaque.data[0] = 0;
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                                           cublasLtMatmulDescAttributes_t attr,
                                                           const void *buf, size_t sizeInBytes) {
  return setAttr(objectOf<Desc>(matmulDesc, kDescMagic), attr, descAttrSize(attr), buf,
                 sizeInBytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
  if (!pref)
    return CUBLAS_STATUS_INVALID_VALUE;
  auto *p = new (std::nothrow) Pref{};
  if (!p)
    return CUBLAS_STATUS_ALLOC_FAILED;
  p->opaque.data[0] = kPrefMagic;
  // Defaults: search BEST_FIT, "MAX_WORKSPACE_BYTES ... default: 0 - no
  // workspace allowed", every reduction scheme, alignments "default: 256",
  // no waves limit, every implementation.
  p->put<uint32_t>(CUBLASLT_MATMUL_PREF_SEARCH_MODE, CUBLASLT_SEARCH_BEST_FIT);
  p->put<uint32_t>(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, CUBLASLT_REDUCTION_SCHEME_MASK);
  for (int a : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    p->put<uint32_t>(a, 256u);
  p->put<float>(CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT, 0.f);
  p->put<uint64_t>(CUBLASLT_MATMUL_PREF_IMPL_MASK, ~uint64_t(0));
  *pref = &p->opaque;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  Pref *p = objectOf<Pref>(pref, kPrefMagic);
  if (!p)
    return pref ? CUBLAS_STATUS_INVALID_VALUE : CUBLAS_STATUS_SUCCESS;
  p->opaque.data[0] = 0;
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(
    cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
    size_t sizeInBytes) {
  return setAttr(objectOf<Pref>(pref, kPrefMagic), attr, prefAttrSize(attr), buf, sizeInBytes);
}

/// One algorithm (needing no workspace) for every configuration resolve()
/// accepts, and none otherwise. "No algorithm" is CUBLAS_STATUS_NOT_SUPPORTED
/// with *returnAlgoCount = 0: the header's "CUBLAS_STATUS_NOT_SUPPORTED if
/// no heuristic function available for current configuration", and what
/// the real library returns in practice (e.g. PyTorch's reports of
/// "CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic(
/// ...)"); a caller must treat that status and a count of 0 alike.
cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
    cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc,
    cublasLtMatrixLayout_t Ddesc, cublasLtMatmulPreference_t preference,
    int requestedAlgoCount, cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
    int *returnAlgoCount) {
  try {
    if (returnAlgoCount)
      *returnAlgoCount = 0;
    if (!validHandle(lightHandle))
      return CUBLAS_STATUS_NOT_INITIALIZED;
    // "CUBLAS_STATUS_INVALID_VALUE if requestedAlgoCount is less or equal
    // to zero"
    if (requestedAlgoCount <= 0 || !heuristicResultsArray || !returnAlgoCount)
      return CUBLAS_STATUS_INVALID_VALUE;
    const Desc *desc = objectOf<Desc>(operationDesc, kDescMagic);
    const Layout *la = objectOf<Layout>(Adesc, kLayoutMagic);
    const Layout *lb = objectOf<Layout>(Bdesc, kLayoutMagic);
    const Layout *lc = objectOf<Layout>(Cdesc, kLayoutMagic);
    const Layout *ld = objectOf<Layout>(Ddesc, kLayoutMagic);
    const Pref *pref = objectOf<Pref>(preference, kPrefMagic);
    if (!desc || !la || !lb || !lc || !ld || !pref)
      return CUBLAS_STATUS_INVALID_VALUE;
    Problem p;
    cublasStatus_t st = resolve(desc, la, lb, lc, ld, p);
    if (st != CUBLAS_STATUS_SUCCESS)
      return st;
    // CUDAEMU_EPILOGUES=0: no algorithm for any epilogue (read at every
    // call), as a real heuristic may answer for a type, shape or alignment,
    // so that a test can reach its caller's fallback.
    const char *epis = std::getenv("CUDAEMU_EPILOGUES");
    if (epis && std::string(epis) == "0" && p.epilogue != CUBLASLT_EPILOGUE_DEFAULT)
      return CUBLAS_STATUS_NOT_SUPPORTED;
    // LIMITED_BY_ALGO_ID needs an algo from cublasLtMatmulAlgoInit, which
    // is not emulated.
    if (pref->get<uint32_t>(CUBLASLT_MATMUL_PREF_SEARCH_MODE) != CUBLASLT_SEARCH_BEST_FIT)
      return CUBLAS_STATUS_NOT_SUPPORTED;
    // MIN_ALIGNMENT_*: "Selecting a smaller value will exclude algorithms
    // that can not work with matrix A that is not as strictly aligned as
    // they need." Our algorithm works with any element-aligned pointer;
    // below the element size (or 0) no algorithm can.
    uint32_t al[4];
    const int alignAttr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    const int32_t alignType[4] = {p.a.type, p.b.type, p.c.type, p.d.type};
    for (int i = 0; i < 4; ++i) {
      al[i] = pref->get<uint32_t>(alignAttr[i]);
      if (al[i] < elemBytes(alignType[i]))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    // The epilogue pointers' alignment, from their values (see
    // alignmentOf); cublasLtMatmul holds the real pointers to it.
    uint32_t alBias = alignmentOf(
        desc->get<const void *>(CUBLASLT_MATMUL_DESC_BIAS_POINTER));
    uint32_t alAux = alignmentOf(
        desc->get<const void *>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER));
    if ((p.epi.biasVector() && alBias < elemBytes(p.biasType)) ||
        ((p.epi.auxOut || p.epi.dgelu) && alAux < elemBytes(p.auxType)))
      return CUBLAS_STATUS_NOT_SUPPORTED;
    // MAX_WAVES_COUNT: "Selecting a non-zero value will exclude algorithms
    // that report device utilization higher than specified"; ours reports
    // 1 wave.
    float maxWaves = pref->get<float>(CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT);
    if (maxWaves > 0.f && maxWaves < 1.f)
      return CUBLAS_STATUS_NOT_SUPPORTED;
    // The workspace needed (0 bytes) is within MAX_WORKSPACE_BYTES.
    const uint64_t wsNeeded = 0;
    if (wsNeeded > pref->get<uint64_t>(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES))
      return CUBLAS_STATUS_NOT_SUPPORTED;

    cublasLtMatmulHeuristicResult_t &r = heuristicResultsArray[0];
    std::memset(&r, 0, sizeof(r));
    r.algo.data[kAlgoTag] = kAlgoMagic;
    r.algo.data[kAlgoAlignAB] = uint64_t(al[0]) | uint64_t(al[1]) << 32;
    r.algo.data[kAlgoAlignCD] = uint64_t(al[2]) | uint64_t(al[3]) << 32;
    r.algo.data[kAlgoAlignEpi] = uint64_t(alBias) | uint64_t(alAux) << 32;
    r.algo.data[kAlgoEpiComp] = epiCompWord(p);
    r.algo.data[kAlgoTypes] = typesWord(p);
    r.algo.data[kAlgoWorkspace] = wsNeeded;
    r.workspaceSize = size_t(wsNeeded);
    r.state = CUBLAS_STATUS_SUCCESS;
    r.wavesCount = 1.f;
    // cuBLASLt returns up to requestedAlgoCount candidates, best first; the
    // emulation has one algorithm, offered twice when more are asked for
    // (so a caller that times the candidates has two to time).
    int count = requestedAlgoCount >= 2 ? 2 : 1;
    for (int i = 1; i < count; ++i)
      heuristicResultsArray[i] = r;
    *returnAlgoCount = count;
    return CUBLAS_STATUS_SUCCESS;
  } catch (const std::bad_alloc &) {
    return CUBLAS_STATUS_ALLOC_FAILED;
  } catch (...) {
    return CUBLAS_STATUS_INTERNAL_ERROR;
  }
}

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t lightHandle,
                                           cublasLtMatmulDesc_t computeDesc, const void *alpha,
                                           const void *A, cublasLtMatrixLayout_t Adesc,
                                           const void *B, cublasLtMatrixLayout_t Bdesc,
                                           const void *beta, const void *C,
                                           cublasLtMatrixLayout_t Cdesc, void *D,
                                           cublasLtMatrixLayout_t Ddesc,
                                           const cublasLtMatmulAlgo_t *algo, void *workspace,
                                           size_t workspaceSizeInBytes, cudaStream_t stream) {
  (void)workspace;
  try {
    if (!validHandle(lightHandle))
      return CUBLAS_STATUS_NOT_INITIALIZED;
    const Desc *desc = objectOf<Desc>(computeDesc, kDescMagic);
    const Layout *la = objectOf<Layout>(Adesc, kLayoutMagic);
    const Layout *lb = objectOf<Layout>(Bdesc, kLayoutMagic);
    const Layout *lc = objectOf<Layout>(Cdesc, kLayoutMagic);
    const Layout *ld = objectOf<Layout>(Ddesc, kLayoutMagic);
    if (!desc || !la || !lb || !lc || !ld || !alpha || !beta)
      return CUBLAS_STATUS_INVALID_VALUE;
    Problem p;
    cublasStatus_t st = resolve(desc, la, lb, lc, ld, p);
    if (st != CUBLAS_STATUS_SUCCESS)
      return st;
    // The algorithm must be one the heuristic returned for this kind of
    // operation (same types, compute type and epilogue): using one chosen
    // for another configuration is a conflict.
    if (!algo || algo->data[kAlgoTag] != kAlgoMagic ||
        algo->data[kAlgoEpiComp] != epiCompWord(p) || algo->data[kAlgoTypes] != typesWord(p))
      return CUBLAS_STATUS_INVALID_VALUE;
    // "CUBLAS_STATUS_INVALID_VALUE ... e.g. when workspaceSizeInBytes is
    // less than workspace required by configured algo"
    if (workspaceSizeInBytes < algo->data[kAlgoWorkspace])
      return CUBLAS_STATUS_INVALID_VALUE;
    // Scale type CUDA_R_32F (resolve()), host pointer mode: f32 scalars.
    float a = *static_cast<const float *>(alpha);
    float b = *static_cast<const float *>(beta);
    if (p.m == 0 || p.n == 0 || p.batch == 0)
      return CUBLAS_STATUS_SUCCESS;
    bool readC = b != 0.f;
    if ((p.k > 0 && (!A || !B)) || !D || (readC && !C))
      return CUBLAS_STATUS_INVALID_VALUE;
    void *bias = desc->get<void *>(CUBLASLT_MATMUL_DESC_BIAS_POINTER);
    void *aux = desc->get<void *>(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER);
    if ((p.epi.biasVector() && !bias) || ((p.epi.auxOut || p.epi.dgelu) && !aux))
      return CUBLAS_STATUS_INVALID_VALUE;
    // Alignment. The heuristic chose the algorithm for the alignments the
    // preference promised (MIN_ALIGNMENT_*) and for the epilogue pointer
    // values it saw; a real kernel given less-aligned pointers may fault or
    // compute garbage. The emulator refuses with CUBLAS_STATUS_INVALID_VALUE:
    // the pointers are "in conflict" with the configured algo, like the
    // header's example of a too-small workspace (NOT_SUPPORTED would claim
    // the operation itself is unsupported, which it is not). Every pointer
    // must also be aligned to its element.
    auto lo = [](uint64_t w) { return w & 0xffffffffu; };
    auto hi = [](uint64_t w) { return w >> 32; };
    if ((p.k > 0 && (!alignedTo(A, lo(algo->data[kAlgoAlignAB])) ||
                     !alignedTo(B, hi(algo->data[kAlgoAlignAB])) ||
                     !alignedTo(A, elemBytes(p.a.type)) || !alignedTo(B, elemBytes(p.b.type)))) ||
        (readC && (!alignedTo(C, lo(algo->data[kAlgoAlignCD])) ||
                   !alignedTo(C, elemBytes(p.c.type)))) ||
        !alignedTo(D, hi(algo->data[kAlgoAlignCD])) || !alignedTo(D, elemBytes(p.d.type)))
      return CUBLAS_STATUS_INVALID_VALUE;
    if ((p.epi.biasVector() &&
         (!alignedTo(bias, lo(algo->data[kAlgoAlignEpi])) ||
          !alignedTo(bias, elemBytes(p.biasType)))) ||
        ((p.epi.auxOut || p.epi.dgelu) && (!alignedTo(aux, hi(algo->data[kAlgoAlignEpi])) ||
                                           !alignedTo(aux, elemBytes(p.auxType)))))
      return CUBLAS_STATUS_INVALID_VALUE;
    // In place (C == D) needs C's layout to be D's, or the product would
    // read elements it has already overwritten.
    if (readC && C == D &&
        (p.c.ld != p.d.ld || p.c.type != p.d.type || p.c.stride != p.d.stride))
      return CUBLAS_STATUS_INVALID_VALUE;
    // Every operand lies in device memory: its last element (of the last
    // batch) inside the allocation its first is in.
    auto extent = [](const Mat &x) {
      return ((int64_t)(x.batch - 1) * x.stride + (x.cols - 1) * x.ld + x.rows) *
             (int64_t)elemBytes(x.type);
    };
    if ((p.k > 0 && (cudaemu::checkDevicePointer(A, extent(p.a), "cublasLtMatmul A") ||
                     cudaemu::checkDevicePointer(B, extent(p.b), "cublasLtMatmul B"))) ||
        (readC && cudaemu::checkDevicePointer(C, extent(p.c), "cublasLtMatmul C")) ||
        cudaemu::checkDevicePointer(D, extent(p.d), "cublasLtMatmul D"))
      return CUBLAS_STATUS_INVALID_VALUE;
    // Stream-ordered like the kernels a GPU would launch: run now, or
    // captured into the graph the stream is capturing (the scalars are
    // read at the call, as host pointer mode reads them).
    if (cudaemu::enqueue(stream, [=] { compute(p, a, b, A, B, C, D, bias, aux); }) !=
        cudaSuccess)
      return CUBLAS_STATUS_EXECUTION_FAILED;
    return CUBLAS_STATUS_SUCCESS;
  } catch (const std::bad_alloc &) {
    return CUBLAS_STATUS_ALLOC_FAILED;
  } catch (...) {
    return CUBLAS_STATUS_INTERNAL_ERROR;
  }
}

} // extern "C"
