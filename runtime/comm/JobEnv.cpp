//===- JobEnv.cpp - which job this process joins, and its rendezvous ------===//

#include "runtime/comm/JobEnv.h"

#include "runtime/comm/TcpStore.h"

#include <gloo/rendezvous/file_store.h>

#include <cstdlib>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdp {

namespace {

bool envInt(const char *name, int64_t &out, bool &present, Status &st) {
  const char *v = std::getenv(name);
  present = v != nullptr;
  if (!v)
    return false;
  char *end;
  long long x = std::strtoll(v, &end, 10);
  if (!*v || *end) {
    st = FSDP_ERROR("environment variable ", name, "='", v, "' is not an integer");
    return false;
  }
  out = x;
  return true;
}

} // namespace

Status jobFromEnvironment(JobEnv &job) {
  Status st;
  bool present = false, present2 = false;
  int64_t r = 0, w = 1;
  struct Source {
    const char *rank, *size, *name, *localRank, *localSize, *node;
  };
  const Source sources[] = {
      {"FSDP_RANK", "FSDP_WORLD_SIZE", "fsdp-run --nproc", "FSDP_LOCAL_RANK",
       "FSDP_LOCAL_WORLD_SIZE", "FSDP_NODE_RANK"},
      {"RANK", "WORLD_SIZE", "torchrun (RANK/WORLD_SIZE)", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
       "GROUP_RANK"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
      {"SLURM_PROCID", "SLURM_NTASKS", "srun (Slurm)", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
       "SLURM_NODEID"},
  };
  for (const Source &s : sources) {
    envInt(s.rank, r, present, st);
    envInt(s.size, w, present2, st);
    if (!st)
      return st;
    if (!present && !present2)
      continue;
    if (present != present2)
      return FSDP_ERROR("only one of ", s.rank, " and ", s.size, " is set");
    if (w < 1 || r < 0 || r >= w)
      return FSDP_ERROR("invalid ", s.rank, "=", r, " / ", s.size, "=", w,
                        ": need 0 <= rank < world size");
    job.rank = r;
    job.worldSize = w;
    job.source = s.name;
    // This node's share (which GPU a rank takes; whether ranks share one):
    // the launcher's local variables, else one node holds every rank.
    job.localRank = r;
    job.localWorldSize = w;
    int64_t lr = 0, lw = 0;
    bool hasLr = false, hasLw = false;
    if (s.localRank && envInt(s.localRank, lr, hasLr, st) && lr >= 0)
      job.localRank = lr;
    if (s.localSize && envInt(s.localSize, lw, hasLw, st) && lw >= 1)
      job.localWorldSize = lw;
    int64_t node = 0;
    bool hasNode = false;
    job.node.clear();
    if (s.node && envInt(s.node, node, hasNode, st) && node >= 0)
      job.node = std::to_string(node);
    if (!st)
      return st;
    if (const char *dir = std::getenv("FSDP_STORE_DIR")) {
      job.storeDir = dir;
    } else if (w > 1) {
      const char *addr = std::getenv("MASTER_ADDR");
      const char *port = std::getenv("MASTER_PORT");
      if (!addr || !port)
        return FSDP_ERROR(s.name, " job of ", w, " ranks: set MASTER_ADDR and "
                          "MASTER_PORT (or FSDP_STORE_DIR) so the ranks can "
                          "meet");
      int64_t p = 0;
      bool present3 = false;
      envInt("MASTER_PORT", p, present3, st);
      if (!st || p <= 0 || p > 65535)
        return FSDP_ERROR("invalid MASTER_PORT '", port, "'");
      job.masterAddr = addr;
      job.masterPort = (int)p;
    }
    return Status::ok();
  }
  job = JobEnv();
  job.source = "single process";
  return Status::ok();
}

std::shared_ptr<gloo::rendezvous::Store>
openRendezvousStore(const JobEnv &job, std::chrono::milliseconds timeout) {
  if (!job.storeDir.empty()) {
    ::mkdir(job.storeDir.c_str(), 0700);
    return std::make_shared<gloo::rendezvous::FileStore>(job.storeDir);
  }
  return std::make_shared<TcpStore>(job.masterAddr, job.masterPort, job.rank == 0, timeout);
}

std::string nodeIdentity(const JobEnv &job) {
  if (!job.node.empty())
    return "node " + job.node;
  std::string id = "machine";
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  if (boot >> bootId)
    id += " " + bootId;
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) == 0)
    id += " " + std::string(host);
  struct stat sb {};
  if (::stat("/dev/shm", &sb) == 0)
    id += " " + std::to_string((unsigned long long)sb.st_dev);
  return id;
}

std::string rendezvousName(const JobEnv &job) {
  return job.storeDir.empty() ? job.masterAddr + ":" + std::to_string(job.masterPort)
                              : job.storeDir;
}

} // namespace fsdp
