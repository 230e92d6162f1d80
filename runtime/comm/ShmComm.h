//===- ShmComm.h - CPU collectives through shared memory --------*- C++ -*-===//
//
// The Communicator for ranks that share one machine: a POSIX shared-memory
// segment per group, collectives as copies through per-rank slots and a
// futex barrier, instead of Gloo's TCP loopback (see [Note: shared-memory
// collectives] in ShmComm.cpp). Met through the job's rendezvous store
// (JobEnv.h), like Gloo.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_SHMCOMM_H
#define FSDP_RUNTIME_COMM_SHMCOMM_H

#include "runtime/comm/JobEnv.h"
#include "runtime/core/Comm.h"

#include <memory>
#include <string>

namespace fsdp {

/// Connects to the other ranks of `job`, which must all run on this
/// machine (bounded by `timeoutSeconds`). When rank 0 could not create the
/// segment (no /dev/shm, not enough room), every rank returns that error
/// and sets `unavailable`, so that a caller may fall back to Gloo on all
/// ranks alike.
Status makeShmCommunicator(const JobEnv &job, double timeoutSeconds,
                           std::unique_ptr<Communicator> &out, bool *unavailable = nullptr);

/// A shared-memory communicator over `n` ranks of this machine (this one
/// is number `index`) met in the job's `store` under the key prefix
/// `prefix`, which names the group; no flight recorder. `unavailable` as
/// for makeShmCommunicator.
Status makeShmGroup(std::shared_ptr<gloo::rendezvous::Store> store, const std::string &prefix,
                    int64_t index, int64_t n, double timeoutSeconds,
                    std::unique_ptr<Communicator> &out, bool *unavailable = nullptr);

/// The communicator `fsdp-run --comm` names: "gloo", "shm", "hybrid"
/// (HybridComm.h), or "auto": shm when every rank of the job runs on this
/// machine, by the environment (`fsdp-run --nproc`, or LOCAL_WORLD_SIZE ==
/// WORLD_SIZE and its MPI / Slurm names), falling back to Gloo where shm
/// is unavailable; hybrid otherwise.
Status makeHostCommunicator(const std::string &kind, const JobEnv &job,
                            double timeoutSeconds, std::unique_ptr<Communicator> &out);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_SHMCOMM_H
