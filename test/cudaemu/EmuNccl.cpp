//===- EmuNccl.cpp - NCCL at world size 1 for the CUDA emulator -----------===//
//
// The NCCL calls the CUDA backend makes (runtime/cuda/CudaComm.cpp), for a
// communicator of one rank: every collective is then a copy (sum, mean or
// gather over one rank), ordered on its stream like a kernel and captured
// into a CUDA graph like one. Enough to run the backend's NCCL path
// (FSDP_CUDA_COMM=nccl) end to end on a CPU; communicators of more ranks
// are refused with a message saying so. Buffers are checked against the
// emulator's allocations: NCCL reads and writes device memory.
//
//===----------------------------------------------------------------------===//

#include "test/cudaemu/EmuInternal.h"

#include <nccl.h>

#include <cstring>
#include <string>

struct ncclComm {
  int nranks = 1;
  bool aborted = false;
  std::string lastError;
};

namespace {
thread_local std::string lastError;

ncclResult_t failed(ncclComm_t c, ncclResult_t r, const std::string &why) {
  lastError = why;
  if (c)
    c->lastError = why;
  return r;
}

size_t typeBytes(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

/// A one-rank collective: out = in (count elements of t) on stream s.
ncclResult_t copyCollective(const char *what, const void *in, void *out, size_t count,
                            ncclDataType_t t, ncclComm_t comm, cudaStream_t s) {
  if (!comm || comm->aborted)
    return failed(comm, ncclInvalidArgument, std::string(what) + ": invalid or aborted communicator");
  size_t bytes = count * typeBytes(t);
  if (typeBytes(t) == 0)
    return failed(comm, ncclInvalidArgument, std::string(what) + ": unsupported datatype");
  if (cudaemu::checkDevicePointer(in, bytes, what) != cudaSuccess ||
      cudaemu::checkDevicePointer(out, bytes, what) != cudaSuccess)
    return failed(comm, ncclInvalidArgument,
                  std::string(what) + ": a buffer is not device memory of that size");
  if (cudaemu::enqueue(s, [=] {
        if (in != out && bytes)
          std::memmove(out, in, bytes);
      }) != cudaSuccess)
    return failed(comm, ncclUnhandledCudaError, std::string(what) + ": enqueue failed");
  return ncclSuccess;
}
} // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  std::memset(id, 0, sizeof *id);
  std::strcpy(id->internal, "cudaemu");
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId, int rank) {
  *comm = nullptr;
  if (nranks != 1 || rank != 0)
    return failed(nullptr, ncclInvalidUsage,
                  "the CUDA emulator's NCCL runs communicators of one rank only (asked for " +
                      std::to_string(nranks) + ")");
  *comm = new ncclComm;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int, ncclComm_t *out, ncclConfig_t *) {
  *out = nullptr;
  if (!comm || comm->aborted)
    return failed(comm, ncclInvalidArgument, "ncclCommSplit of an invalid communicator");
  if (color == NCCL_SPLIT_NOCOLOR)
    return ncclSuccess;
  *out = new ncclComm;
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async) {
  *async = ncclSuccess;
  return comm ? ncclSuccess : ncclInvalidArgument;
}
const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error";
  case ncclSystemError: return "unhandled system error";
  case ncclInternalError: return "internal error";
  case ncclInvalidArgument: return "invalid argument";
  case ncclInvalidUsage: return "invalid usage";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}
const char *ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->lastError.c_str() : lastError.c_str();
}
ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t t,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return copyCollective("ncclAllReduce", in, out, count, t, comm, s);
}
ncclResult_t ncclReduceScatter(const void *in, void *out, size_t count, ncclDataType_t t,
                               ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return copyCollective("ncclReduceScatter", in, out, count, t, comm, s);
}
ncclResult_t ncclAllGather(const void *in, void *out, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s) {
  return copyCollective("ncclAllGather", in, out, count, t, comm, s);
}
ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

} // extern "C"
