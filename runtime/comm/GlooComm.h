//===- GlooComm.h - CPU collectives through Gloo ----------------*- C++ -*-===//
//
// The CPU backend of the Communicator: Gloo over TCP, one context per rank.
// Which job a process joins is read from the environment:
// - FSDP_RANK / FSDP_WORLD_SIZE / FSDP_STORE_DIR: set by `fsdp-run --nproc`;
// - torchrun: RANK / WORLD_SIZE (+ MASTER_ADDR / MASTER_PORT naming the
//   rendezvous); Open MPI: OMPI_COMM_WORLD_RANK / _SIZE; Slurm: SLURM_PROCID
//   / SLURM_NTASKS.
// Rendezvous goes through a directory (Gloo's FileStore) for the local
// launcher (FSDP_STORE_DIR), and otherwise through a TCP store that rank 0
// serves at MASTER_ADDR:MASTER_PORT (TcpStore.h), which spans machines.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_GLOOCOMM_H
#define FSDP_RUNTIME_COMM_GLOOCOMM_H

#include "runtime/core/Comm.h"

#include <memory>
#include <string>

namespace fsdp {

/// Where this process stands in a job, from the environment.
struct JobEnv {
  int64_t rank = 0, worldSize = 1;
  std::string storeDir;   ///< rendezvous through a directory (local launch)
  std::string masterAddr; ///< or through the TCP store rank 0 serves here
  int masterPort = 0;
  std::string source;   ///< which variables were used, for messages
};

/// Reads the job from `getenv`; an inconsistent environment is an error.
Status jobFromEnvironment(JobEnv &job);

/// Connects to the other ranks (bounded by `timeoutSeconds`).
Status makeGlooCommunicator(const JobEnv &job, double timeoutSeconds,
                            std::unique_ptr<Communicator> &out);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_GLOOCOMM_H
