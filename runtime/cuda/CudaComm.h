//===- CudaComm.h - communicators for CUDA buffers --------------*- C++ -*-===//
//
// Two Communicators whose collectives take device pointers and a CUDA
// stream (Comm.h; the stream is the device's comm stream):
// - NCCL: one communicator per job, ncclUniqueId published through the
//   job's rendezvous store (JobEnv.h); subgroups by ncclCommSplit. NCCL
//   needs a GPU per rank (2.28 refuses two ranks on one device).
// - host-staged: device -> pinned host -> the Gloo communicator -> device,
//   all enqueued on the stream (async copies around a cudaLaunchHostFunc),
//   so the host thread never blocks and the stream order is kept; like
//   PyTorch's gloo backend for CUDA tensors. Any number of ranks may share
//   a GPU. A failure inside the host function (a dead peer) is recorded and
//   returned by takeAsyncCommError(), which the CUDA device's synchronize
//   reports from then on; later staged collectives are skipped (their
//   outputs are stale), so the error stays: nothing may read them.
// Host-buffer collectives (stream null: broadcast, barrier, checkpoints)
// go to the Gloo communicator either way.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CUDA_CUDACOMM_H
#define FSDP_RUNTIME_CUDA_CUDACOMM_H

#include "runtime/comm/JobEnv.h"
#include "runtime/core/Comm.h"

#include <memory>

namespace fsdp::cuda {

/// Wraps `host` (Gloo) for device buffers: NCCL when this node has a GPU
/// for each of its ranks (or FSDP_CUDA_COMM=nccl), host-staged otherwise
/// (or FSDP_CUDA_COMM=staged). `host` stays in use for host buffers.
Status makeCudaCommunicator(const JobEnv &job, double timeoutSeconds,
                            std::unique_ptr<Communicator> host,
                            std::unique_ptr<Communicator> &out);

/// The NCCL watchdog ([Note: the NCCL watchdog], CudaComm.cpp): the
/// collective timeout while an NCCL communicator lives (0: none, plain
/// stream synchronization); the first asynchronous error any of them
/// reports; and aborting them all, which ends their pending kernels.
double ncclWatchdogSeconds();
Status ncclAsyncError();
void abortNcclComms();

/// The first failure of a host-staged collective (ok if none). Sticky:
/// every later call returns it, since every staged collective after it
/// was skipped.
Status takeAsyncCommError();

} // namespace fsdp::cuda

#endif // FSDP_RUNTIME_CUDA_CUDACOMM_H
