//===- HybridComm.h - shared memory within nodes, Gloo between -*- C++ -*-===//
//
// The host communicator of a job that spans several nodes, each holding
// several ranks: collectives in two levels, shared memory (ShmComm.h)
// among the ranks of a node and Gloo (GlooComm.h) among the ranks of the
// same place on every node, as NCCL runs NVLink within a node and the
// network between them. See [Note: hybrid collectives] in HybridComm.cpp.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_HYBRIDCOMM_H
#define FSDP_RUNTIME_COMM_HYBRIDCOMM_H

#include "runtime/comm/JobEnv.h"
#include "runtime/core/Comm.h"

#include <memory>

namespace fsdp {

/// Connects to the other ranks of `job` (bounded by `timeoutSeconds`):
/// every rank publishes its node (nodeIdentity) through the rendezvous
/// store; where each node holds one rank the result is the Gloo
/// communicator, otherwise the two-level one. Collectives fall back to Gloo
/// over every rank, on every rank alike, where nodes hold unequal numbers of
/// ranks or a node cannot set up shared memory.
Status makeHybridCommunicator(const JobEnv &job, double timeoutSeconds,
                              std::unique_ptr<Communicator> &out);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_HYBRIDCOMM_H
