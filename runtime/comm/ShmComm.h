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

#include <functional>
#include <memory>
#include <string>

namespace fsdp {

/// Where a collective's blocks lie in the caller's buffer: block r (of the
/// group's rank r) is `runs` runs of `runBytes` bytes each, run j starting
/// at byte `start(r, j)`. Plain collectives have one run a block, block r
/// at r x its size.
struct BlockRuns {
  int64_t runs = 1, runBytes = 0;
  std::function<int64_t(int64_t r, int64_t j)> start;
};

/// Collectives over blocks laid out as BlockRuns, which the shared-memory
/// communicator of more than one rank implements: the two-level
/// collectives (HybridComm.cpp) hand it a node's blocks where they lie in
/// the caller's buffer instead of reordering them through a scratch
/// buffer (its slots are the only copy).
class RunCollectives {
public:
  virtual ~RunCollectives() = default;
  /// reduce-scatter whose input block r is `blocks`' runs of `in`; `out`
  /// gets this rank's block reduced (runs x runBytes bytes, contiguous).
  virtual Status reduceScatterRuns(const void *in, const BlockRuns &blocks, void *out, DType dtype,
                                   ReduceOp op) = 0;
  /// all-gather of `in` (runs x runBytes bytes, contiguous), rank r's
  /// block written to `blocks`' runs of `out`.
  virtual Status allGatherRuns(const void *in, void *out, const BlockRuns &blocks, DType dtype) = 0;
};

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
