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

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_GLOOCOMM_H
