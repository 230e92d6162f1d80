//===- Launch.h - fsdp-run --nproc: N local ranks ---------------*- C++ -*-===//
//
// The local launcher: starts N copies of fsdp-run with FSDP_RANK /
// FSDP_WORLD_SIZE / FSDP_STORE_DIR set, waits, and if one rank fails kills
// the others, so that a dead rank ends the job with an error instead of a
// hang.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_LAUNCH_H
#define FSDP_RUNTIME_COMM_LAUNCH_H

#include "runtime/core/Status.h"

#include <string>
#include <vector>

namespace fsdp {

/// Runs `args` (argv[0] is ignored: /proc/self/exe is used) as `nproc`
/// ranks and returns when all exited; an error names the first rank that
/// failed and how.
Status launchLocal(int nproc, const std::vector<std::string> &args);

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_LAUNCH_H
