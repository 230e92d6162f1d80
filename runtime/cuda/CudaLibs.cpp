//===- CudaLibs.cpp - cuBLASLt and NCCL through dlopen --------------------===//
//
// Each function the backend calls is defined here with the signature its
// header declares (so the compiler checks every one against it) and calls
// the library's own, resolved when the library is loaded. A forwarder
// called before a successful load tries the load itself and, if it fails,
// returns the library's "not initialized" error; the backend's entry
// points (checkCudaDevice, the NCCL communicator) call loadCublasLt /
// loadNccl first so that the user sees the load's own message instead.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaLibs.h"

#include <cublasLt.h>
#include <nccl.h>

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>

#ifndef FSDP_CUBLASLT_DIR
#define FSDP_CUBLASLT_DIR ""
#endif
#ifndef FSDP_NCCL_DIR
#define FSDP_NCCL_DIR ""
#endif

#define FSDP_STR2(x) #x
#define FSDP_STR(x) FSDP_STR2(x)

namespace fsdp::cuda {
namespace {

// Every function of each library the backend calls (a new call site needs
// its name here and a forwarder below; the link fails without one).
#define FSDP_CUBLASLT_FUNCTIONS(X)                                                                 \
  X(cublasLtCreate)                                                                                \
  X(cublasLtDestroy)                                                                               \
  X(cublasLtGetStatusName)                                                                         \
  X(cublasLtGetStatusString)                                                                       \
  X(cublasLtGetVersion)                                                                            \
  X(cublasLtMatmul)                                                                                \
  X(cublasLtMatmulAlgoGetHeuristic)                                                                \
  X(cublasLtMatmulDescCreate)                                                                      \
  X(cublasLtMatmulDescDestroy)                                                                     \
  X(cublasLtMatmulDescSetAttribute)                                                                \
  X(cublasLtMatmulPreferenceCreate)                                                                \
  X(cublasLtMatmulPreferenceDestroy)                                                               \
  X(cublasLtMatmulPreferenceSetAttribute)                                                          \
  X(cublasLtMatrixLayoutCreate)                                                                    \
  X(cublasLtMatrixLayoutDestroy)                                                                   \
  X(cublasLtMatrixLayoutSetAttribute)

#define FSDP_NCCL_FUNCTIONS(X)                                                                     \
  X(ncclGetUniqueId)                                                                               \
  X(ncclCommInitRank)                                                                              \
  X(ncclCommSplit)                                                                                 \
  X(ncclCommDestroy)                                                                               \
  X(ncclCommAbort)                                                                                 \
  X(ncclCommGetAsyncError)                                                                         \
  X(ncclGetErrorString)                                                                            \
  X(ncclGetLastError)                                                                              \
  X(ncclGetVersion)                                                                                \
  X(ncclAllReduce)                                                                                 \
  X(ncclReduceScatter)                                                                             \
  X(ncclAllGather)                                                                                 \
  X(ncclSend)                                                                                      \
  X(ncclRecv)                                                                                      \
  X(ncclGroupStart)                                                                                \
  X(ncclGroupEnd)

#define FSDP_ENUM(name) name,
#define FSDP_NAME(name) #name,
enum class Lt { FSDP_CUBLASLT_FUNCTIONS(FSDP_ENUM) Count };
enum class Nccl { FSDP_NCCL_FUNCTIONS(FSDP_ENUM) Count };
const char *const ltNames[] = {FSDP_CUBLASLT_FUNCTIONS(FSDP_NAME)};
const char *const ncclNames[] = {FSDP_NCCL_FUNCTIONS(FSDP_NAME)};
#undef FSDP_ENUM
#undef FSDP_NAME

/// One library: where it is, what it must export, and the load's outcome.
template <int N> struct Library {
  const char *what;   // for messages: "cuBLASLt"
  const char *env;    // the variable naming another file
  const char *soname; // what the headers were built for
  const char *dir;    // the toolkit's library directory at build time ("" if unknown)
  const char *const *names;
  std::once_flag once;
  Status status;
  void *handle = nullptr;
  void *fn[N] = {};

  std::string file() const {
    const char *o = std::getenv(env);
    return o && *o ? o : soname;
  }

  Status load() {
    const char *o = std::getenv(env);
    bool overridden = o && *o;
    std::string name = file();
    dlerror();
    void *h = dlopen(name.c_str(), RTLD_LAZY | RTLD_LOCAL);
    std::string why = h ? "" : dlerror();
    if (!h && !overridden && *dir) {
      std::string alt = std::string(dir) + "/" + soname;
      h = dlopen(alt.c_str(), RTLD_LAZY | RTLD_LOCAL);
      if (!h)
        why += std::string("; ") + dlerror();
    }
    if (!h)
      return FSDP_ERROR("cannot load ", what, " '", name, "' (", why, "); the CUDA backend ",
                        "needs it: put its directory on LD_LIBRARY_PATH or name the file in ", env);
    for (int i = 0; i < N; ++i) {
      fn[i] = dlsym(h, names[i]);
      if (!fn[i]) {
        dlclose(h);
        for (void *&f : fn)
          f = nullptr;
        return FSDP_ERROR(what, " '", name, "' has no ", names[i], ": an older ", what,
                          " than the headers the backend was built with (", soname,
                          ")? Name another file in ", env);
      }
    }
    handle = h;
    return Status::ok();
  }

  /// The path the loader resolved the file to ("" before a load).
  std::string path() const {
    struct link_map *m = nullptr;
    if (!handle || dlinfo(handle, RTLD_DI_LINKMAP, &m) != 0 || !m || !m->l_name)
      return "";
    return m->l_name;
  }

  Status ensure() {
    std::call_once(once, [this] { status = load(); });
    return status;
  }

  /// The function, loading the library on first use; null if it fails.
  template <class F> F get(int i) { return ensure().isOk() ? reinterpret_cast<F>(fn[i]) : nullptr; }
};

Library<(int)Lt::Count> &lt() {
  static Library<(int)Lt::Count> lib{"cuBLASLt", "FSDP_CUBLASLT_LIBRARY",
                                     "libcublasLt.so." FSDP_STR(CUBLAS_VER_MAJOR),
                                     FSDP_CUBLASLT_DIR, ltNames};
  return lib;
}

Library<(int)Nccl::Count> &nccl() {
  static Library<(int)Nccl::Count> lib{
      "NCCL", "FSDP_NCCL_LIBRARY", "libnccl.so." FSDP_STR(NCCL_MAJOR), FSDP_NCCL_DIR, ncclNames};
  return lib;
}

} // namespace

Status loadCublasLt() { return lt().ensure(); }
Status loadNccl() { return nccl().ensure(); }
std::string cublasLtLibraryName() { return lt().file(); }
std::string ncclLibraryName() { return nccl().file(); }

namespace {
/// "13.1.0" from a version number major * 10000 + minor * 100 + patch
/// (cuBLASLt's and, since 2.9, NCCL's encoding).
std::string dotted(long long v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}
} // namespace

std::string cublasLtDescription() {
  if (!lt().handle)
    return "";
  return "cuBLASLt " + dotted((long long)::cublasLtGetVersion()) + " (" + lt().path() + ")";
}
std::string ncclDescription() {
  int v = 0;
  if (!nccl().handle || ::ncclGetVersion(&v) != ncclSuccess)
    return "";
  return "NCCL " + dotted(v) + " (" + nccl().path() + ")";
}

} // namespace fsdp::cuda

// The forwarders. `params` is the header's parameter list, `args` the call.
#define FSDP_FORWARD(lib, Enum, ret, fail, name, params, args)                                     \
  extern "C" ret name params {                                                                     \
    auto f = fsdp::cuda::lib().get<decltype(&::name)>((int)fsdp::cuda::Enum::name);                \
    return f ? f args : (fail);                                                                    \
  }
#define FSDP_LT(name, params, args)                                                                \
  FSDP_FORWARD(lt, Lt, cublasStatus_t CUBLASWINAPI, CUBLAS_STATUS_NOT_INITIALIZED, name, params,   \
               args)
#define FSDP_NCCL(name, params, args)                                                              \
  FSDP_FORWARD(nccl, Nccl, ncclResult_t, ncclSystemError, name, params, args)

FSDP_LT(cublasLtCreate, (cublasLtHandle_t * h), (h))
FSDP_LT(cublasLtDestroy, (cublasLtHandle_t h), (h))
FSDP_FORWARD(lt, Lt, const char *CUBLASWINAPI, "cuBLASLt is not loaded", cublasLtGetStatusName,
             (cublasStatus_t s), (s))
FSDP_FORWARD(lt, Lt, const char *CUBLASWINAPI, "cuBLASLt is not loaded", cublasLtGetStatusString,
             (cublasStatus_t s), (s))
FSDP_FORWARD(lt, Lt, size_t CUBLASWINAPI, 0, cublasLtGetVersion, (void), ())
FSDP_LT(cublasLtMatmul,
        (cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
         cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
         const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
         cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
         size_t workspaceBytes, cudaStream_t stream),
        (h, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
         workspaceBytes, stream))
FSDP_LT(cublasLtMatmulAlgoGetHeuristic,
        (cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
         cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
         cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
         int *returned),
        (h, desc, Adesc, Bdesc, Cdesc, Ddesc, pref, requested, results, returned))
FSDP_LT(cublasLtMatmulDescCreate,
        (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
        (desc, compute, scale))
FSDP_LT(cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
FSDP_LT(cublasLtMatmulDescSetAttribute,
        (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void *buf,
         size_t bytes),
        (desc, attr, buf, bytes))
FSDP_LT(cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
FSDP_LT(cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
FSDP_LT(cublasLtMatmulPreferenceSetAttribute,
        (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
         const void *buf, size_t bytes),
        (pref, attr, buf, bytes))
FSDP_LT(cublasLtMatrixLayoutCreate,
        (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols,
         int64_t ld),
        (layout, type, rows, cols, ld))
FSDP_LT(cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))
FSDP_LT(cublasLtMatrixLayoutSetAttribute,
        (cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const void *buf,
         size_t bytes),
        (layout, attr, buf, bytes))

FSDP_NCCL(ncclGetUniqueId, (ncclUniqueId * id), (id))
FSDP_NCCL(ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank),
          (comm, nranks, id, rank))
FSDP_NCCL(ncclCommSplit,
          (ncclComm_t comm, int color, int key, ncclComm_t *out, ncclConfig_t *config),
          (comm, color, key, out, config))
FSDP_NCCL(ncclCommDestroy, (ncclComm_t comm), (comm))
FSDP_NCCL(ncclCommAbort, (ncclComm_t comm), (comm))
FSDP_NCCL(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t *async), (comm, async))
FSDP_FORWARD(nccl, Nccl, const char *, "NCCL is not loaded", ncclGetErrorString, (ncclResult_t r),
             (r))
FSDP_FORWARD(nccl, Nccl, const char *, "NCCL is not loaded", ncclGetLastError, (ncclComm_t comm),
             (comm))
FSDP_NCCL(ncclGetVersion, (int *version), (version))
FSDP_NCCL(ncclAllReduce,
          (const void *in, void *out, size_t count, ncclDataType_t type, ncclRedOp_t op,
           ncclComm_t comm, cudaStream_t stream),
          (in, out, count, type, op, comm, stream))
FSDP_NCCL(ncclReduceScatter,
          (const void *in, void *out, size_t count, ncclDataType_t type, ncclRedOp_t op,
           ncclComm_t comm, cudaStream_t stream),
          (in, out, count, type, op, comm, stream))
FSDP_NCCL(ncclAllGather,
          (const void *in, void *out, size_t count, ncclDataType_t type, ncclComm_t comm,
           cudaStream_t stream),
          (in, out, count, type, comm, stream))
FSDP_NCCL(ncclSend,
          (const void *in, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
           cudaStream_t stream),
          (in, count, type, peer, comm, stream))
FSDP_NCCL(ncclRecv,
          (void *out, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
           cudaStream_t stream),
          (out, count, type, peer, comm, stream))
FSDP_NCCL(ncclGroupStart, (), ())
FSDP_NCCL(ncclGroupEnd, (), ())
