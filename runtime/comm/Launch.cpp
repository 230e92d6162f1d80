//===- Launch.cpp - fsdp-run --nproc: N local ranks -----------------------===//
//
// [Note: launcher and ranks]
// A job must never outlive its launcher, nor leave its rendezvous directory
// behind. The cases:
// - a rank fails: the launcher sends SIGTERM (and SIGCONT, for a stopped
//   rank) to the others, SIGKILL after a grace period;
// - the launcher gets SIGTERM / SIGINT / SIGHUP: the same, then it removes
//   the directory and dies by that signal. It waits for children and
//   signals in one place (sigtimedwait on a blocked set), so a signal that
//   arrives between two checks is never lost;
// - the launcher is killed (SIGKILL, OOM killer): each rank asked the
//   kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG, set in the
//   child between fork and exec; a parent that died before that call is
//   caught by comparing getppid() with the pid recorded before fork). The
//   rank's handler (followLauncher) sees the launcher gone, removes the
//   directory the launcher can no longer remove, and dies by the signal.
// A rank stopped with SIGSTOP when the launcher is killed would keep the
// parent-death signal pending and stay stopped forever: the launcher writes
// the ranks' pids to `<store>/ranks`, and the first rank that finds its
// launcher gone sends SIGCONT to the others before removing the directory.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/Launch.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char **environ;

namespace fsdp {

namespace {

constexpr const char *kStorePrefix = "fsdp-store-";

bool isOurStore(const std::string &dir) {
  return !dir.empty() && std::filesystem::path(dir).filename().string().rfind(
                             kStorePrefix, 0) == 0;
}

/// Removes a rendezvous directory (only one of ours, by its name). Several
/// ranks may race to remove the same one: retry until it is gone.
void removeStore(const std::string &dir) {
  if (!isOurStore(dir))
    return;
  for (int i = 0; i < 5; ++i) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (!std::filesystem::exists(dir, ec))
      return;
  }
}

struct RemoveOnExit {
  std::string dir;
  ~RemoveOnExit() { removeStore(dir); }
};

std::string describe(int sig) {
  const char *name = strsignal(sig);
  return std::to_string(sig) + " (" + (name ? name : "?") + ")";
}

// followLauncher's state: written once before the handler is installed.
int wakePipe[2] = {-1, -1};

void onSignal(int sig) {
  unsigned char b = (unsigned char)sig;
  // Async-signal-safe: hand the signal to the watcher thread.
  ssize_t ignored = ::write(wakePipe[1], &b, 1);
  (void)ignored;
}

} // namespace

Status checkLocalNodes(int nproc, int nnodes) {
  if (nnodes > 1 && nproc < 2)
    return FSDP_ERROR("--nnodes ", nnodes, " needs --nproc N (the ranks to split into nodes)");
  if (nnodes < 1 || nproc % nnodes != 0)
    return FSDP_ERROR("--nnodes ", nnodes, " does not divide --nproc ", nproc,
                      ": every node holds the same number of ranks");
  return Status::ok();
}

Status launchLocal(int nproc, const std::vector<std::string> &args, int &stoppedBySignal,
                   int nnodes) {
  FSDP_RETURN_IF_ERROR(checkLocalNodes(nproc, nnodes));
  stoppedBySignal = 0;
  const char *tmp = std::getenv("TMPDIR");
  std::string tmpl =
      std::string(tmp && *tmp ? tmp : "/tmp") + "/" + kStorePrefix + "XXXXXX";
  std::vector<char> path(tmpl.begin(), tmpl.end());
  path.push_back('\0');
  if (!::mkdtemp(path.data()))
    return FSDP_ERROR("cannot create the rendezvous directory '", tmpl,
                      "': ", std::strerror(errno),
                      " (set TMPDIR to a writable directory)");
  RemoveOnExit cleanup{path.data()};
  const std::string &store = cleanup.dir;
  pid_t launcher = ::getpid();

  // Everything the children need is built before fork: between fork and
  // exec they only restore the signal mask, ask for the parent-death
  // signal and exec.
  std::vector<std::string> self{"fsdp-run"};
  for (size_t i = 1; i < args.size(); ++i)
    self.push_back(args[i]);
  std::vector<char *> argv;
  for (std::string &a : self)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> common;
  // The launcher owns the rank variables: stale torchrun ones would
  // otherwise disagree.
  const char *owned[] = {
      "FSDP_RANK=",      "FSDP_WORLD_SIZE=", "FSDP_STORE_DIR=",        "FSDP_LAUNCHER_PID=",
      "FSDP_NODE_RANK=", "FSDP_LOCAL_RANK=", "FSDP_LOCAL_WORLD_SIZE=", "RANK=",
      "WORLD_SIZE="};
  for (char **e = environ; *e; ++e) {
    bool skip = false;
    for (const char *o : owned)
      skip |= std::strncmp(*e, o, std::strlen(o)) == 0;
    if (!skip)
      common.push_back(*e);
  }
  common.push_back("FSDP_WORLD_SIZE=" + std::to_string(nproc));
  common.push_back("FSDP_STORE_DIR=" + store);
  common.push_back("FSDP_LAUNCHER_PID=" + std::to_string(launcher));
  std::vector<std::vector<std::string>> envs(nproc, common);
  std::vector<std::vector<char *>> envps(nproc);
  // --nnodes K: K "nodes" of nproc / K consecutive ranks on this machine,
  // numbered as a multi-node launcher numbers them (HybridComm.h).
  const int perNode = nproc / nnodes;
  for (int r = 0; r < nproc; ++r) {
    envs[r].push_back("FSDP_RANK=" + std::to_string(r));
    if (nnodes > 1) {
      envs[r].push_back("FSDP_NODE_RANK=" + std::to_string(r / perNode));
      envs[r].push_back("FSDP_LOCAL_RANK=" + std::to_string(r % perNode));
      envs[r].push_back("FSDP_LOCAL_WORLD_SIZE=" + std::to_string(perNode));
    }
    for (std::string &e : envs[r])
      envps[r].push_back(e.data());
    envps[r].push_back(nullptr);
  }

  sigset_t watched, old;
  sigemptyset(&watched);
  for (int s : {SIGCHLD, SIGTERM, SIGINT, SIGHUP})
    sigaddset(&watched, s);
  ::pthread_sigmask(SIG_BLOCK, &watched, &old);

  std::vector<pid_t> pids;
  auto signalAll = [&](int sig) {
    for (pid_t p : pids)
      if (p > 0)
        ::kill(p, sig);
  };
  Status result = Status::ok();
  int alive = 0;
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      result =
          FSDP_ERROR("fork failed for rank ", r, ": ", std::strerror(errno));
      break;
    }
    if (pid == 0) {
      ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher)
        ::_exit(1); // the launcher died before prctl: nobody to serve
      ::execve("/proc/self/exe", argv.data(), envps[r].data());
      const char msg[] = "fsdp-run: error: cannot start a rank: exec failed\n";
      ssize_t ignored = ::write(2, msg, sizeof msg - 1);
      (void)ignored;
      ::_exit(127);
    }
    pids.push_back(pid);
    ++alive;
  }
  if (FILE *f = std::fopen((store + "/ranks").c_str(), "w")) {
    for (pid_t p : pids)
      std::fprintf(f, "%d\n", (int)p);
    std::fclose(f);
  }

  bool killing = false;
  auto killAt = std::chrono::steady_clock::time_point::max();
  auto stopRanks = [&] {
    // A stopped rank acts on SIGTERM only once continued.
    signalAll(SIGTERM);
    signalAll(SIGCONT);
    killing = true;
    killAt = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  };
  if (!result)
    stopRanks(); // fork failed part-way
  while (alive > 0) {
    // Signals first: with Ctrl-C the ranks die of SIGINT too, and the job
    // was stopped by the user, not failed by a rank. (SIGCHLD, numbered
    // after SIGHUP, SIGINT and SIGTERM, is dequeued after them.)
    timespec wait{0, 50'000'000};
    int sig = ::sigtimedwait(&watched, nullptr, &wait);
    if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
      if (stoppedBySignal) {
        signalAll(SIGKILL); // asked twice: no more grace
      } else {
        stoppedBySignal = sig;
        if (result)
          result = FSDP_ERROR("stopped by signal ", describe(sig),
                              ": stopping the ranks and removing ", store);
        stopRanks();
      }
    }
    int status = 0;
    pid_t pid;
    while (alive > 0 && (pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      int rank = -1;
      for (int r = 0; r < (int)pids.size(); ++r)
        if (pids[r] == pid) {
          rank = r;
          pids[r] = -1;
        }
      if (rank < 0)
        continue;
      --alive;
      bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      if (failed && result) {
        result =
            WIFSIGNALED(status)
                ? FSDP_ERROR("rank ", rank, " was killed by signal ",
                             describe(WTERMSIG(status)),
                             "; stopping the other ranks")
                : FSDP_ERROR("rank ", rank, " exited with status ",
                             WEXITSTATUS(status),
                             " (its error is above); stopping the other ranks");
        // A dead rank would leave its peers waiting in a collective until
        // their timeout: stop them now, forcefully after a grace period.
        stopRanks();
      }
    }
    if (alive > 0 && killing && std::chrono::steady_clock::now() > killAt)
      signalAll(SIGKILL);
  }
  // A signal that came after the last rank exited is still this job's.
  timespec none{0, 0};
  for (int sig; (sig = ::sigtimedwait(&watched, nullptr, &none)) > 0;)
    if (sig != SIGCHLD && !stoppedBySignal) {
      stoppedBySignal = sig;
      if (result)
        result = FSDP_ERROR("stopped by signal ", describe(sig));
    }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return result;
}

Status followLauncher() {
  const char *v = std::getenv("FSDP_LAUNCHER_PID");
  if (!v)
    return Status::ok();
  pid_t launcher = (pid_t)std::atol(v);
  const char *dir = std::getenv("FSDP_STORE_DIR");
  std::string store = dir ? dir : "";
  if (::pipe2(wakePipe, O_CLOEXEC) != 0)
    return FSDP_ERROR("cannot create a pipe: ", std::strerror(errno));
  std::thread([launcher, store] {
    unsigned char b = 0;
    while (::read(wakePipe[0], &b, 1) != 1)
      ;
    int sig = b;
    // See [Note: launcher and ranks]: a live launcher removes the
    // directory itself; a dead one cannot.
    if (::getppid() != launcher && isOurStore(store)) {
      // A stopped sibling would keep its parent-death signal pending.
      if (FILE *f = std::fopen((store + "/ranks").c_str(), "r")) {
        for (int p; std::fscanf(f, "%d", &p) == 1;)
          if (p > 0 && p != ::getpid())
            ::kill(p, SIGCONT);
        std::fclose(f);
      }
      removeStore(store);
    }
    std::signal(sig, SIG_DFL);
    ::kill(::getpid(), sig);
  }).detach();
  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGTERM, SIGINT, SIGHUP})
    ::sigaction(s, &sa, nullptr);
  // The parent-death signal covers a launcher that dies from now on; one
  // that died before the handler was installed left only this trace.
  if (::getppid() != launcher) {
    removeStore(store);
    return FSDP_ERROR("the launcher (pid ", launcher,
                      ") is gone: not starting");
  }
  return Status::ok();
}

} // namespace fsdp
