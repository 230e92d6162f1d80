//===- Launch.h - fsdp-run --nproc: N local ranks ---------------*- C++ -*-===//
//
// The local launcher: starts N copies of fsdp-run with FSDP_RANK /
// FSDP_WORLD_SIZE / FSDP_STORE_DIR / FSDP_LAUNCHER_PID set, waits, and if
// one rank fails kills the others, so that a dead rank ends the job with an
// error instead of a hang. The ranks and the launcher live and die
// together; see [Note: launcher and ranks] in Launch.cpp.
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
/// failed and how. The rendezvous directory ($TMPDIR or /tmp, then
/// fsdp-store-XXXXXX) is removed on every return. When SIGTERM, SIGINT or
/// SIGHUP stops the launcher, the ranks are stopped too and
/// `stoppedBySignal` is set to the signal (0 otherwise): the caller reports
/// the error and then dies by that signal, as the shell expects.
/// `nnodes` > 1 splits the ranks into that many groups of consecutive
/// ranks that act as nodes of a multi-node job (FSDP_NODE_RANK,
/// FSDP_LOCAL_RANK, FSDP_LOCAL_WORLD_SIZE): `--comm auto` then runs the
/// hierarchical communicator, as it would across machines.
Status launchLocal(int nproc, const std::vector<std::string> &args, int &stoppedBySignal,
                   int nnodes = 1);

/// Whether `nproc` local ranks split into `nnodes` equal nodes (launchLocal
/// refuses any other layout with this error).
Status checkLocalNodes(int nproc, int nnodes);

/// In a rank started by launchLocal (FSDP_LAUNCHER_PID is set; otherwise
/// nothing happens): on SIGTERM / SIGINT / SIGHUP, if the launcher is gone
/// (it was killed and the kernel sent the parent-death signal), removes the
/// rendezvous directory the launcher can no longer remove, then dies by the
/// signal as it would have without a handler. Call it early (a signal that
/// comes before keeps its default action). An error when the launcher is
/// already gone.
Status followLauncher();

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_LAUNCH_H
