//===- JobEnv.h - which job this process joins, and its rendezvous -*- C++ -*-===//
//
// Shared by every communicator (Gloo now, NCCL to come): the rank and world
// size read from the environment, and the store the ranks meet through.
// - FSDP_RANK / FSDP_WORLD_SIZE / FSDP_STORE_DIR: set by `fsdp-run --nproc`;
// - torchrun: RANK / WORLD_SIZE (+ MASTER_ADDR / MASTER_PORT naming the
//   rendezvous); Open MPI: OMPI_COMM_WORLD_RANK / _SIZE; Slurm: SLURM_PROCID
//   / SLURM_NTASKS.
// Rendezvous goes through a directory (Gloo's FileStore) for the local
// launcher (FSDP_STORE_DIR), and otherwise through a TCP store that rank 0
// serves at MASTER_ADDR:MASTER_PORT (TcpStore.h), which spans machines. Gloo
// connects its full mesh through the store; NCCL would publish rank 0's
// ncclUniqueId in it.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_JOBENV_H
#define FSDP_RUNTIME_COMM_JOBENV_H

#include "runtime/core/Status.h"

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp {

/// Where this process stands in a job, from the environment.
struct JobEnv {
  int64_t rank = 0, worldSize = 1;
  /// This process's place on its node (LOCAL_RANK / LOCAL_WORLD_SIZE and
  /// their MPI / Slurm names; the global ones when absent).
  int64_t localRank = 0, localWorldSize = 1;
  std::string storeDir;   ///< rendezvous through a directory (local launch)
  std::string masterAddr; ///< or through the TCP store rank 0 serves here
  int masterPort = 0;
  std::string source;   ///< which variables were used, for messages
  /// Which node this rank runs on, as the launcher numbers them
  /// (FSDP_NODE_RANK from `fsdp-run --nnodes`, torchrun's GROUP_RANK,
  /// Slurm's SLURM_NODEID); empty when the launcher does not say, and then
  /// nodeIdentity() names this machine instead. Ranks with the same node
  /// share memory (HybridComm.h).
  std::string node;
};

/// The node `job` runs on, as ranks compare it: "node <N>" from the
/// launcher's node rank, else "machine <boot id> <hostname> <device of
/// /dev/shm>": ranks that can map one shared-memory segment have the same
/// boot id (one kernel) and the same /dev/shm (one container's mount).
std::string nodeIdentity(const JobEnv &job);

/// Reads the job from `getenv`; an inconsistent environment is an error.
Status jobFromEnvironment(JobEnv &job);

/// Where the ranks meet, for messages: the store directory or host:port.
std::string rendezvousName(const JobEnv &job);

/// The key-value store the job's ranks meet through: a FileStore in
/// job.storeDir, or the TCP store at job.masterAddr:masterPort (served by
/// rank 0). Throws what the store's constructor throws (a connection
/// failure); callers wrap it in their rendezvous error message.
std::shared_ptr<gloo::rendezvous::Store>
openRendezvousStore(const JobEnv &job, std::chrono::milliseconds timeout);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_JOBENV_H
