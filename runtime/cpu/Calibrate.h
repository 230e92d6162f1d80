//===- Calibrate.h - measures this machine for the cost model ----*- C++ -*-===//
//
// `fsdp-run --calibrate [--nproc N] [--threads T]` times the CPU kernels
// and the communicator on this machine and prints a device profile (JSON)
// that fsdp-sim reads (tools/fsdp-sim, docs/SIMULATOR.md): a roofline
// (GEMM FLOP/s, memory bandwidth, per-instruction overhead) and the alpha
// (latency) / beta (seconds per byte) of the ring collectives at N ranks.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CPU_CALIBRATE_H
#define FSDP_RUNTIME_CPU_CALIBRATE_H

#include "runtime/core/Comm.h"
#include "runtime/core/Status.h"

#include <nlohmann/json.hpp>

namespace fsdp::cpu {

/// Every rank calls it (the collectives are timed over `comm`); rank 0's
/// figures are returned in `profile` on every rank.
Status calibrate(Communicator &comm, int threads, nlohmann::json &profile);

} // namespace fsdp::cpu

#endif // FSDP_RUNTIME_CPU_CALIBRATE_H
