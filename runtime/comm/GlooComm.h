//===- GlooComm.h - CPU collectives through Gloo ----------------*- C++ -*-===//
//
// The CPU backend of the Communicator: Gloo over TCP, one context per rank,
// connected through the job's rendezvous store (JobEnv.h, shared with the
// NCCL communicator to come).
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_GLOOCOMM_H
#define FSDP_RUNTIME_COMM_GLOOCOMM_H

#include "runtime/comm/JobEnv.h"
#include "runtime/core/Comm.h"

#include <memory>
#include <string>

namespace fsdp {

/// Connects to the other ranks (bounded by `timeoutSeconds`).
Status makeGlooCommunicator(const JobEnv &job, double timeoutSeconds,
                            std::unique_ptr<Communicator> &out);

/// The same over the job's rendezvous store `store` (opened by the caller:
/// the TCP store is served once, by rank 0), at any world size; with the
/// job's flight recorder only when `withRecorder` (a communicator built on
/// this one may keep the recorder itself).
Status makeGlooCommunicatorOn(const JobEnv &job, std::shared_ptr<gloo::rendezvous::Store> store,
                              double timeoutSeconds, bool withRecorder,
                              std::unique_ptr<Communicator> &out);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_GLOOCOMM_H
