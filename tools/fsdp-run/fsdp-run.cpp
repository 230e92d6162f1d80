//===- fsdp-run.cpp - runs a plan on CPU ranks ----------------------------===//
//
// `fsdp-run PLAN [options]` trains on this process (one rank, or one rank
// of a job described by the environment: torchrun, mpirun, srun);
// `fsdp-run --nproc N PLAN ...` launches N local ranks itself (`--nnodes K`:
// as K nodes of N / K ranks, for trying a multi-node job on one machine). Exit codes:
// 0 success, 1 runtime error, 2 usage error.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/ShmComm.h"
#include "runtime/comm/Launch.h"
#include "runtime/core/Trainer.h"
#include "runtime/devices/Devices.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace fsdp;

static int fail(const Status &st, int code, int64_t rank = -1) {
  if (rank > 0)
    std::fprintf(stderr, "fsdp-run: error [rank %lld]: %s\n", (long long)rank,
                 st.message().c_str());
  else
    std::fprintf(stderr, "fsdp-run: error: %s\n", st.message().c_str());
  return code;
}

int main(int argc, char **argv) {
  // OpenMP threads that spin after an elementwise loop steal the cores
  // OpenBLAS needs for the next GEMM (2 threads ran 1.7x slower than 1 on a
  // 2-core machine); a short spin keeps both fast. Set before OpenMP starts;
  // a user's own setting wins.
  ::setenv("GOMP_SPINCOUNT", "1000", /*overwrite=*/0);
  // A peer that dies closes its sockets; writing to one must fail with
  // EPIPE (which Gloo reports and we turn into an error naming the
  // collective), not kill this rank silently with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  // --nproc and --nnodes are the launcher's; everything else goes to the ranks.
  std::vector<std::string> args{argv[0]};
  int nproc = 0, nnodes = 1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    // The launcher's own options: --nproc N, --nnodes K.
    int *slot = a == "--nproc" ? &nproc : a == "--nnodes" ? &nnodes : nullptr;
    if (slot) {
      if (i + 1 >= argc)
        return fail(FSDP_ERROR(a, " needs a value"), 2);
      char *end;
      long n = std::strtol(argv[++i], &end, 10);
      if (*end || n < 1 || n > 1024)
        return fail(FSDP_ERROR("invalid ", a, " '", argv[i], "'"), 2);
      *slot = (int)n;
      continue;
    }
    args.push_back(a);
  }
  std::vector<char *> rest;
  for (std::string &a : args)
    rest.push_back(a.data());
  TrainOptions opt;
  bool help = false;
  Status st = parseTrainOptions((int)rest.size(), rest.data(), opt, help);
  if (help) {
    std::printf("%s", trainUsage());
    return 0;
  }
  if (!st) {
    std::fprintf(stderr, "%s", trainUsage());
    return fail(st, 2);
  }
  // The device before any rank starts: `--device cuda` where no CUDA
  // backend or GPU exists is one clear error, not N.
  st = checkDevice(opt.device);
  if (!st)
    return fail(st, 1);
  if (nnodes > 1) {
    st = checkLocalNodes(nproc, nnodes);
    if (!st)
      return fail(st, 2);
  }
  if (nproc > 1) {
    int stoppedBy = 0;
    Status launched = launchLocal(nproc, args, stoppedBy, nnodes);
    if (!launched)
      fail(launched, 1);
    if (stoppedBy) {
      // Die by the signal that stopped the job, as the shell expects (an
      // interrupted script stops instead of going on to its next line).
      std::signal(stoppedBy, SIG_DFL);
      std::raise(stoppedBy);
    }
    return launched ? 0 : 1;
  }
  JobEnv job;
  st = jobFromEnvironment(job);
  if (!st)
    return fail(st, 2);
  // A rank of `--nproc` dies with its launcher.
  st = followLauncher();
  if (!st)
    return fail(st, 1, job.rank);
  double timeout = 60;
  if (const char *t = std::getenv("FSDP_COMM_TIMEOUT_S"))
    timeout = std::atof(t) > 0 ? std::atof(t) : timeout;
  std::unique_ptr<Communicator> comm;
  st = makeHostCommunicator(opt.comm, job, timeout, comm);
  if (!st)
    return fail(st, 1, job.rank);
  std::unique_ptr<Device> device;
  DeviceOptions dopt;
  dopt.threads = opt.threads;
  dopt.localRank = job.localRank; // one process per device where there are enough
  dopt.allowTf32 = opt.allowTf32;
  st = createDevice(opt.device, dopt, device);
  if (!st)
    return fail(st, 1, job.rank);
  st = deviceCommunicator(opt.device, job, timeout, comm);
  if (!st)
    return fail(st, 1, job.rank);
  opt.localWorldSize = job.localWorldSize;
  st = train(opt, *comm, *device);
  if (!st)
    return fail(st, 1, job.rank);
  return 0;
}
