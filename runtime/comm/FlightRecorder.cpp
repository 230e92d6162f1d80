//===- FlightRecorder.cpp - who a failed collective waited for ------------===//
//
// [Note: progress records]
// Each rank owns one record in the rendezvous store:
//   fsdp-progress 1 <entered> <completed> <kind> <state> <beat> <host>
//     <pid> <start>     (one line)
//   <note>              (the rest)
// `entered` / `completed` are sequence numbers of collectives (#1 is the
// first collective of the job on every rank), `kind` names the last one
// entered, `state` is running | failed | finished, `beat` counts heartbeats
// and `note` is the explanation a failed rank gave.
//
// Who writes when: enter() and complete() only store two atomics (a few
// nanoseconds; the MLP issues ~30 collectives a step). A heartbeat thread
// publishes the record every `period` (timeout / 8): it is also the
// liveness signal, since a rank that is stopped (SIGSTOP, a debugger), hung
// in the kernel or dead stops beating while a live rank blocked in a
// collective keeps beating. Publishing on every collective instead would
// cost a file write or a store round trip each time and would still not
// tell a stopped rank from a waiting one, which both sit at the same
// collective. A record is at most one period stale, much less than the
// timeout after which anyone reads it.
//
// What a failed rank concludes: it reads every record, waits four periods,
// reads again. A peer whose beat did not move is not responding; on the
// same host, /proc/<pid>/stat says whether it is stopped ('T') or gone. A
// responding peer whose `entered` is below the failed collective's number
// did not arrive (busy or stuck outside the collectives). The rest
// arrived. A rank that was itself stopped notices on resuming that its own
// heartbeat has a gap and says so: its peers gave up on it.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/FlightRecorder.h"

#include "runtime/comm/JobEnv.h"
#include "runtime/comm/TcpStore.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace fsdp {

namespace {

int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string seconds(int64_t ns) {
  std::ostringstream os;
  os.precision(ns >= 10'000'000'000 ? 0 : 1);
  os << std::fixed << (double)ns / 1e9 << " s";
  return os.str();
}

static_assert(std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "live counters are shared between processes");

/// Maps `path` (created and sized when `create`) as one Live block.
ProgressBoard::Live *mapLive(const std::string &path, bool create) {
  int fd = ::open(path.c_str(),
                  (create ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC, 0600);
  if (fd < 0)
    return nullptr;
  size_t bytes = sizeof(ProgressBoard::Live);
  struct stat st {};
  if ((create && ::ftruncate(fd, (off_t)bytes) != 0) || ::fstat(fd, &st) != 0 ||
      (size_t)st.st_size < bytes) {
    ::close(fd);
    return nullptr;
  }
  void *p = ::mmap(nullptr, bytes, create ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED)
    return nullptr;
  // A fresh file is zero-filled: the atomics start at 0 as constructed.
  return static_cast<ProgressBoard::Live *>(p);
}

class DirectoryBoard final : public ProgressBoard {
public:
  DirectoryBoard(std::string dir, int64_t rank) : dir(std::move(dir)) {
    path = this->dir + "/progress." + std::to_string(rank);
    tmp = this->dir + "/.progress." + std::to_string(rank) + ".tmp";
    mine =
        mapLive(this->dir + "/live." + std::to_string(rank), /*create=*/true);
  }
  ~DirectoryBoard() override {
    if (mine)
      ::munmap(mine, sizeof(Live));
    for (auto &[r, l] : peers)
      if (l)
        ::munmap(const_cast<Live *>(l), sizeof(Live));
  }

  Live *live() override { return mine; }

  const Live *peerLive(int64_t rank) override {
    const Live *&l = peers[rank];
    if (!l)
      l = mapLive(dir + "/live." + std::to_string(rank), /*create=*/false);
    return l;
  }

  bool publish(const std::string &record) override {
    int fd =
        ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
      return false; // the launcher removed the directory: the job is over
    bool ok =
        ::write(fd, record.data(), record.size()) == (ssize_t)record.size();
    ::close(fd);
    // rename() replaces the old record atomically: a reader never sees a
    // half-written one.
    return ok && ::rename(tmp.c_str(), path.c_str()) == 0;
  }

  bool read(int64_t rank, std::string &record, std::string &error) override {
    std::string p = dir + "/progress." + std::to_string(rank);
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno != ENOENT)
        error = "cannot read " + p + ": " + std::strerror(errno);
      return false;
    }
    record.clear();
    char buf[512];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0)
      record.append(buf, (size_t)n);
    ::close(fd);
    return true;
  }

private:
  std::string dir, path, tmp;
  Live *mine = nullptr;
  std::map<int64_t, const Live *> peers;
};

class TcpStoreBoard final : public ProgressBoard {
public:
  TcpStoreBoard(std::unique_ptr<TcpStore> store, int64_t rank)
      : store(std::move(store)), key(keyOf(rank)) {}

  bool publish(const std::string &record) override {
    try {
      store->set(key, std::vector<char>(record.begin(), record.end()));
      return true;
    } catch (const std::exception &) {
      return false;
    }
  }

  bool read(int64_t rank, std::string &record, std::string &error) override {
    try {
      std::vector<char> v;
      if (!store->tryGet(keyOf(rank), v))
        return false;
      record.assign(v.begin(), v.end());
      return true;
    } catch (const std::exception &e) {
      error = std::string("the TCP store (served by rank 0) is unreachable: ") +
              e.what();
      return false;
    }
  }

private:
  static std::string keyOf(int64_t rank) {
    return "fsdp-progress/" + std::to_string(rank);
  }
  std::unique_ptr<TcpStore> store;
  std::string key;
};

struct Record {
  bool present = false;
  int64_t entered = 0, completed = 0, pid = 0;
  uint64_t beat = 0;
  std::string kind, state, host, startTime, note;
};

bool parse(const std::string &text, Record &r) {
  std::istringstream is(text);
  std::string magic;
  int version = 0;
  if (!(is >> magic >> version >> r.entered >> r.completed >> r.kind >>
        r.state >> r.beat >> r.host >> r.pid >> r.startTime) ||
      magic != "fsdp-progress" || version != 1)
    return false;
  is.ignore(1);
  std::getline(is, r.note);
  r.present = true;
  return true;
}

} // namespace

std::vector<std::string> procStat(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line))
    return {};
  size_t close = line.rfind(')');
  if (close == std::string::npos)
    return {};
  std::istringstream is(line.substr(close + 1));
  std::vector<std::string> fields;
  for (std::string s; is >> s;)
    fields.push_back(s);
  return fields;
}

namespace {

std::string hostName() {
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0 || !name[0])
    return "unknown";
  std::string h = name;
  std::replace(h.begin(), h.end(), ' ', '_');
  return h;
}

/// What the kernel says about a peer on this host ("" when it is running or
/// sleeping normally, or lives elsewhere).
std::string localProcessState(const Record &r, const std::string &myHost) {
  if (r.host != myHost || r.pid <= 0)
    return "";
  std::vector<std::string> f = procStat(r.pid);
  if (f.size() < 20 || f[19] != r.startTime || f[0] == "Z" || f[0] == "X")
    return "has exited or was killed";
  if (f[0] == "T")
    return "is stopped (SIGSTOP, or suspended by a debugger)";
  if (f[0] == "t")
    return "is stopped by a debugger";
  if (f[0] == "D")
    return "is blocked in the kernel (uninterruptible I/O)";
  return "";
}

std::string rankList(const std::vector<int64_t> &ranks) {
  std::string s;
  for (int64_t r : ranks)
    s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

std::string oneLine(std::string s, size_t max) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  if (s.size() > max)
    s = s.substr(0, max) + "...";
  return s;
}

} // namespace

std::unique_ptr<ProgressBoard> makeDirectoryBoard(const std::string &dir,
                                                  int64_t rank) {
  return std::make_unique<DirectoryBoard>(dir, rank);
}

std::unique_ptr<ProgressBoard>
makeTcpStoreBoard(std::unique_ptr<TcpStore> store, int64_t rank) {
  return std::make_unique<TcpStoreBoard>(std::move(store), rank);
}

FlightRecorder::FlightRecorder(int64_t rank, int64_t size,
                               std::unique_ptr<ProgressBoard> board,
                               std::chrono::milliseconds timeout)
    : rank(rank), size(size), board(std::move(board)), timeout(timeout),
      period(std::clamp(timeout / 8, std::chrono::milliseconds(50),
                        std::chrono::milliseconds(1000))),
      host(hostName()), pid(::getpid()) {
  std::vector<std::string> self = procStat(pid);
  startTime = self.size() >= 20 ? self[19] : "0";
  live = this->board->live();
  lastBeatNs = steadyNs();
  publishNow();
  heartbeat = std::thread([this] { heartbeatLoop(); });
}

FlightRecorder::~FlightRecorder() {
  {
    std::lock_guard<std::mutex> l(mu);
    stopping = true;
  }
  cv.notify_all();
  heartbeat.join();
  {
    std::lock_guard<std::mutex> l(publishMu);
    if (state == "running")
      state = "finished";
  }
  publishNow();
}

int64_t FlightRecorder::enter(const char *what) {
  int64_t seq = entered.load(std::memory_order_relaxed) + 1;
  kind.store(what, std::memory_order_relaxed);
  entered.store(seq, std::memory_order_relaxed);
  if (live) {
    int32_t code = 0;
    for (int32_t i = 0; i < (int32_t)std::size(ProgressBoard::kCollectiveKinds);
         ++i)
      if (std::strcmp(what, ProgressBoard::kCollectiveKinds[i]) == 0)
        code = i;
    live->kind.store(code, std::memory_order_relaxed);
    live->entered.store(seq, std::memory_order_release);
  }
  return seq;
}

void FlightRecorder::complete(int64_t seq) {
  completed.store(seq, std::memory_order_relaxed);
  if (live)
    live->completed.store(seq, std::memory_order_relaxed);
}

void FlightRecorder::publishNow() {
  std::lock_guard<std::mutex> l(publishMu);
  std::ostringstream os;
  os << "fsdp-progress 1 " << entered.load() << ' ' << completed.load() << ' '
     << kind.load() << ' ' << state << ' ' << beat.load() << ' ' << host << ' '
     << pid << ' ' << startTime << '\n'
     << note;
  board->publish(os.str());
}

void FlightRecorder::heartbeatLoop() {
  // A gap this long between two beats means the whole process was not
  // running (stopped or starved); shorter ones are scheduling noise.
  int64_t stallThreshold =
      std::max<int64_t>(1'000'000'000, 4 * period.count() * 1'000'000);
  std::unique_lock<std::mutex> l(mu);
  int64_t last = steadyNs();
  while (!stopping) {
    cv.wait_for(l, period);
    if (stopping)
      break;
    int64_t now = steadyNs();
    if (now - last > stallThreshold) {
      stallNs = now - last;
      stallEndNs = now;
    }
    last = now;
    lastBeatNs = now;
    ++beat;
    l.unlock();
    publishNow();
    l.lock();
  }
}

std::string FlightRecorder::explain(int64_t seq, const char *what,
                                    const std::string &gloo) {
  int64_t start = steadyNs();
  // Say at once that this rank gave up (Gloo closes its connections, so
  // peers may fail next because of it); the full verdict follows.
  {
    std::lock_guard<std::mutex> l(publishMu);
    state = "failed";
    note = "collective #" + std::to_string(seq) + " (" + what +
           ") failed: " + oneLine(gloo, 120);
  }
  publishNow();
  // This rank's own gap: the heartbeat thread may not have run yet since
  // the process was resumed.
  int64_t ownGap = start - lastBeatNs.load();
  std::string storeError;
  auto readAll = [&](std::vector<Record> &out) {
    out.assign(size, Record());
    for (int64_t p = 0; p < size; ++p) {
      std::string text;
      if (p == rank || !board->read(p, text, storeError) ||
          !parse(text, out[p]))
        continue;
      // Live counters are newer than the last heartbeat's record.
      if (const ProgressBoard::Live *l = board->peerLive(p)) {
        int64_t e = l->entered.load(std::memory_order_acquire);
        if (e >= out[p].entered) {
          int32_t k = l->kind.load(std::memory_order_relaxed);
          out[p].entered = e;
          out[p].completed = l->completed.load(std::memory_order_relaxed);
          if (k >= 0 && k < (int32_t)std::size(ProgressBoard::kCollectiveKinds))
            out[p].kind = ProgressBoard::kCollectiveKinds[k];
        }
      }
    }
  };
  std::vector<Record> first, second;
  readAll(first);
  std::this_thread::sleep_for(4 * period);
  readAll(second);

  int64_t stallThreshold =
      std::max<int64_t>(1'000'000'000, 4 * period.count() * 1'000'000);
  int64_t stall = 0;
  int64_t recent = timeout.count() * 1'000'000 + 2'000'000'000;
  if (stallEndNs.load() > start - recent)
    stall = stallNs.load();
  if (ownGap > stallThreshold)
    stall = std::max(stall, ownGap);

  // Culprits first: ranks that stopped responding, then live ranks that
  // never came (computing), then live ranks still waiting inside an
  // earlier collective (for one of the former, usually).
  std::vector<std::string> silent, computing, waiting, gaveUp;
  std::vector<int64_t> arrived;
  if (stall == 0)
    arrived.push_back(rank);
  for (int64_t p = 0; p < size; ++p) {
    if (p == rank)
      continue;
    const Record &a = first[p], &b = second[p];
    std::string who = "rank " + std::to_string(p);
    if (!b.present) {
      if (storeError.empty())
        silent.push_back(who + " never published its progress");
      continue;
    }
    if (b.state == "failed") {
      // A peer that failed in this same collective had arrived; its verdict
      // matters to a rank that was itself stalled, and when it failed
      // elsewhere.
      if (b.entered >= seq && !stall)
        arrived.push_back(p);
      if (b.entered < seq || (stall && gaveUp.empty()))
        gaveUp.push_back(who + " gave up: " + oneLine(b.note, 300));
      continue;
    }
    if (b.state == "finished") {
      silent.push_back(who + " had already finished");
      continue;
    }
    std::string proc = localProcessState(b, host);
    bool quiet = !proc.empty() || (a.present && a.beat == b.beat);
    std::string where = (b.completed == b.entered ? "after collective #"
                                                  : "inside collective #") +
                        std::to_string(b.entered) + " (" + b.kind + ")";
    if (quiet) {
      std::string how =
          proc.empty() ? "is not responding (stopped, hung or dead)" : proc;
      silent.push_back(b.entered < seq ? who + " did not arrive: it " + how +
                                             ", last seen " + where
                                       : who + " entered it but " + how);
    } else if (b.entered >= seq) {
      arrived.push_back(p);
    } else if (b.completed == b.entered) {
      computing.push_back(who +
                          " did not arrive: it is alive but still computing " +
                          where + " (slow, or stuck outside the collectives)");
    } else {
      waiting.push_back(who + " is still waiting " + where);
    }
  }
  std::vector<std::string> blame = silent;
  blame.insert(blame.end(), computing.begin(), computing.end());
  blame.insert(blame.end(), waiting.begin(), waiting.end());
  std::sort(arrived.begin(), arrived.end());

  std::ostringstream os;
  os << "collective #" << seq << " (" << what << ")";
  std::vector<std::string> parts;
  if (stall)
    parts.push_back("this rank (" + std::to_string(rank) +
                    ") itself was not running for " + seconds(stall) +
                    " (stopped, swapped out or starved of CPU), "
                    "so its peers gave up waiting for it");
  for (const std::string &s : blame)
    parts.push_back(s);
  if (!arrived.empty())
    parts.push_back((arrived.size() == 1 ? "rank " : "ranks ") +
                    rankList(arrived) + " arrived");
  for (const std::string &s : gaveUp)
    parts.push_back(s);
  if (!storeError.empty())
    parts.push_back("progress records incomplete: " + storeError);
  if (blame.empty() && !stall && gaveUp.empty() && storeError.empty())
    parts.push_back("every rank arrived and is responding (the connection "
                    "itself failed?)");
  for (size_t i = 0; i < parts.size(); ++i)
    os << (i ? "; " : ": ") << parts[i];
  std::string sentence = os.str();
  {
    std::lock_guard<std::mutex> l(publishMu);
    state = "failed";
    note = sentence;
  }
  publishNow();
  return sentence;
}

std::unique_ptr<FlightRecorder> makeJobFlightRecorder(const JobEnv &job,
                                                      std::chrono::milliseconds timeout) {
  const char *fr = std::getenv("FSDP_FLIGHT_RECORDER");
  if (fr && std::string(fr) == "0")
    return nullptr;
  std::unique_ptr<ProgressBoard> board;
  if (!job.storeDir.empty()) {
    board = makeDirectoryBoard(job.storeDir, job.rank);
  } else {
    // Its own connection, bounded: it must never hang on a store whose
    // server (rank 0) is stopped.
    auto client = std::make_unique<TcpStore>(job.masterAddr, job.masterPort,
                                             /*serve=*/false, timeout);
    client->setIoTimeout(std::chrono::seconds(2));
    board = makeTcpStoreBoard(std::move(client), job.rank);
  }
  return std::make_unique<FlightRecorder>(job.rank, job.worldSize, std::move(board),
                                          timeout);
}

} // namespace fsdp
