//===- Launch.cpp - fsdp-run --nproc: N local ranks -----------------------===//

#include "runtime/comm/Launch.h"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace fsdp {

Status launchLocal(int nproc, const std::vector<std::string> &args) {
  char tmpl[] = "/tmp/fsdp-store-XXXXXX";
  if (!::mkdtemp(tmpl))
    return FSDP_ERROR("cannot create the rendezvous directory: ", std::strerror(errno));
  std::string store = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids)
        ::kill(p, SIGKILL);
      return FSDP_ERROR("fork failed: ", std::strerror(errno));
    }
    if (pid == 0) {
      ::setenv("FSDP_RANK", std::to_string(r).c_str(), 1);
      ::setenv("FSDP_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("FSDP_STORE_DIR", store.c_str(), 1);
      // The launcher owns the rank variables: stale torchrun ones would
      // otherwise disagree.
      ::unsetenv("RANK");
      ::unsetenv("WORLD_SIZE");
      std::vector<char *> argv;
      std::string self = "fsdp-run";
      argv.push_back(self.data());
      for (size_t i = 1; i < args.size(); ++i)
        argv.push_back(const_cast<char *>(args[i].c_str()));
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "fsdp-run: error: cannot start rank %d: %s\n", r,
                   std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  Status result = Status::ok();
  int alive = nproc;
  bool killing = false;
  auto killAt = std::chrono::steady_clock::time_point::max();
  while (alive > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, killing ? WNOHANG : 0);
    if (pid == 0) {
      if (std::chrono::steady_clock::now() > killAt)
        for (pid_t p : pids)
          if (p > 0)
            ::kill(p, SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR)
        continue;
      break;
    }
    int rank = -1;
    for (int r = 0; r < nproc; ++r)
      if (pids[r] == pid) {
        rank = r;
        pids[r] = -1;
      }
    --alive;
    bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && result) {
      result = WIFSIGNALED(status)
                   ? FSDP_ERROR("rank ", rank, " was killed by signal ",
                                WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                                "); stopping the other ranks")
                   : FSDP_ERROR("rank ", rank, " exited with status ",
                                WEXITSTATUS(status), "; stopping the other ranks");
      // A dead rank would leave its peers waiting in a collective until
      // their timeout: stop them now, forcefully after a grace period.
      for (pid_t p : pids)
        if (p > 0)
          ::kill(p, SIGTERM);
      killing = true;
      killAt = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(store, ec);
  return result;
}

} // namespace fsdp
