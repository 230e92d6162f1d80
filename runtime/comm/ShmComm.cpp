//===- ShmComm.cpp - CPU collectives through shared memory ----------------===//
//
// [Note: shared-memory collectives]
// Ranks on one machine exchange data through one POSIX shared-memory
// segment per group (created by the group's rank 0, met through the job's
// store, unlinked as soon as every rank has mapped it, so that nothing is
// left in /dev/shm whatever happens next). The segment holds two sets of
// per-rank slots and a barrier. A collective is a loop over chunks of at
// most one slot: each rank copies its chunk into its own slot, all meet at
// the barrier, and each rank reads what it needs from every slot:
// - all-gather: every slot, in rank order;
// - reduce-scatter: its own part of every slot, summed;
// - all-reduce: every slot, summed (each rank sums the whole chunk itself,
//   in rank order 0..N-1, so every rank gets the same bits without a second
//   barrier);
// - all-to-all: its own piece of every slot (each rank's slot holds its
//   pieces for every rank, as a reduce-scatter's);
// - broadcast: the root's slot.
// Sums run in f32 and are rounded once (bf16 / f16 included; a mean of f16
// divides each term first, as [Note: f16 means] in GlooComm.cpp explains).
// Chunk k uses slot set k mod 2 (k counts barriers): a rank writes set X
// again only after the next barrier, which every rank reaches after reading
// set X, so one barrier per chunk suffices.
//
// Against Gloo over TCP loopback (measured on a 2-core VM, bench/
// simulator.py's calibration): a collective costs one barrier (a futex wake
// of the waiters) instead of a ring of socket messages, each waking Gloo's
// event-loop thread, and data moves at memcpy speed instead of ~1 GB/s.
//
// [Note: shm barrier]
// A generation counter (the futex word) and an arrival count: the last rank
// to arrive resets the count and bumps the generation; the others spin
// briefly (a peer usually arrives within microseconds when ranks have
// cores to themselves), then sleep on the futex in short slices. Between
// slices a waiting rank looks at the ranks that have not arrived (each
// records how many barriers it entered): one that closed its communicator
// or whose process is gone makes the collective fail at once, naming it;
// otherwise the collective fails after the timeout, and the flight recorder
// (FlightRecorder.h) names who did not arrive, as with Gloo.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/ShmComm.h"

#include "runtime/comm/FlightRecorder.h"
#include "runtime/comm/GlooComm.h"
#include "runtime/comm/HybridComm.h"
#include "runtime/core/Bf16.h"

#include <gloo/rendezvous/prefix_store.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <linux/futex.h>
#include <random>
#include <sstream>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace fsdp {

namespace {

constexpr uint64_t kMagic = 0x316d687370647366ull; // "fsdpshm1"
constexpr uint32_t kAttached = 1, kLeft = 2;

/// One rank's record, on its own cache line.
struct alignas(64) Peer {
  std::atomic<int64_t> pid;
  std::atomic<uint64_t> arrivals; ///< barriers this rank has entered
  std::atomic<uint32_t> state;    ///< 0, kAttached, kLeft
};

struct Header {
  uint64_t magic;
  uint64_t token; ///< rank 0's random number: a rank checks it mapped this job's segment
  int64_t size, slotBytes;
  alignas(64) std::atomic<uint32_t> gen; ///< the barrier's generation: the futex word
  alignas(64) std::atomic<uint32_t> arrived;
  std::atomic<uint32_t> sleepers; ///< ranks in (or entering) futex_wait
};

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

/// A slot's size for `n` ranks: two sets of n slots within 8 MiB (a 2x2
/// HSDP job maps 5 segments, 40 MiB in all: Docker's default /dev/shm is
/// 64 MiB), a slot between 64 KiB and 2 MiB. A chunk of 1 MiB costs ~100 us
/// to copy and a barrier ~10-40 us, so larger chunks would save little.
int64_t slotBytesFor(int64_t n) {
  int64_t b = ((int64_t)8 << 20) / (2 * n);
  b = std::clamp<int64_t>(b, 64 << 10, 2 << 20);
  return b / 4096 * 4096;
}

long futexWait(std::atomic<uint32_t> *word, uint32_t expect, int64_t ns) {
  timespec ts{(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAIT, expect, &ts,
                   nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t> *word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/// True when process `pid` is gone (or a zombie nobody reaped yet).
bool processGone(int64_t pid) {
  if (pid <= 0)
    return false;
  if (::kill((pid_t)pid, 0) != 0 && errno == ESRCH)
    return true;
  std::vector<std::string> stat = procStat(pid);
  return !stat.empty() && stat[0] == "Z";
}

/// The mapped segment; rank 0's also unlinks its name (once every rank has
/// mapped it, or on the way out).
class Segment {
public:
  ~Segment() {
    if (base)
      ::munmap(base, (size_t)bytes);
    unlink();
  }

  Status create(const std::string &shmName, int64_t n, uint64_t token) {
    name = shmName;
    int64_t slot = slotBytesFor(n);
    bytes = layout(n, slot);
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      return FSDP_ERROR("shm_open('", name, "') failed: ", std::strerror(errno));
    owner = true;
    // Reserve the pages now: a full /dev/shm is an error here, not a
    // SIGBUS in the middle of a step.
    int err = ::posix_fallocate(fd, 0, (off_t)bytes);
    if (err != 0) {
      ::close(fd);
      return FSDP_ERROR("reserving ", bytes, " bytes of shared memory for ", n,
                        " ranks failed: ", std::strerror(err),
                        " (is /dev/shm full or small? --comm gloo does without it)");
    }
    Status st = map(fd);
    if (!st)
      return st;
    auto *h = new (base) Header();
    h->token = token;
    h->size = n;
    h->slotBytes = slot;
    for (int64_t r = 0; r < n; ++r)
      new (peer(r)) Peer();
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
    return Status::ok();
  }

  Status open(const std::string &shmName, int64_t n, uint64_t token) {
    name = shmName;
    int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0)
      return FSDP_ERROR("shm_open('", name, "') failed: ", std::strerror(errno),
                        " (are all ranks on one machine, in one IPC namespace?)");
    bytes = layout(n, slotBytesFor(n));
    struct stat sb {};
    if (::fstat(fd, &sb) != 0 || sb.st_size != (off_t)bytes) {
      ::close(fd);
      return FSDP_ERROR("shared memory '", name, "' has ", (int64_t)sb.st_size,
                        " bytes, expected ", bytes, " for ", n, " ranks");
    }
    Status st = map(fd);
    if (!st)
      return st;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (header()->magic != kMagic || header()->token != token || header()->size != n)
      return FSDP_ERROR("shared memory '", name, "' is not this job's segment");
    return Status::ok();
  }

  void unlink() {
    if (owner && !name.empty())
      ::shm_unlink(name.c_str());
    owner = false;
  }

  Header *header() { return static_cast<Header *>(base); }
  Peer *peer(int64_t r) {
    return reinterpret_cast<Peer *>(static_cast<uint8_t *>(base) + peersOffset()) + r;
  }
  /// Rank r's slot in set `set` (0 or 1).
  uint8_t *slot(int set, int64_t r) {
    Header *h = header();
    return static_cast<uint8_t *>(base) + slotsOffset(h->size) +
           (set * h->size + r) * h->slotBytes;
  }
  int64_t slotBytes() { return header()->slotBytes; }

private:
  static int64_t peersOffset() { return alignUp(sizeof(Header), 64); }
  static int64_t slotsOffset(int64_t n) {
    return alignUp(peersOffset() + n * (int64_t)sizeof(Peer), 4096);
  }
  static int64_t layout(int64_t n, int64_t slot) { return slotsOffset(n) + 2 * n * slot; }

  Status map(int fd) {
    void *p = ::mmap(nullptr, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED)
      return FSDP_ERROR("mmap of ", bytes, " bytes of shared memory failed: ",
                        std::strerror(errno));
    base = p;
    return Status::ok();
  }

  std::string name;
  bool owner = false;
  void *base = nullptr;
  int64_t bytes = 0;
};

class ShmComm final : public Communicator, public RunCollectives {
public:
  ShmComm(std::unique_ptr<Segment> seg, int64_t me, int64_t n,
          std::chrono::milliseconds timeout, std::unique_ptr<FlightRecorder> recorder,
          std::shared_ptr<gloo::rendezvous::Store> store, std::string prefix)
      : seg(std::move(seg)), me(me), n(n), timeout(timeout),
        spin(n <= (int64_t)std::thread::hardware_concurrency()),
        recorder(std::move(recorder)), store(std::move(store)), prefix(std::move(prefix)) {
    Peer *p = this->seg->peer(me);
    p->pid.store((int64_t)::getpid());
    p->state.store(kAttached);
  }

  /// Peers waiting for this rank learn at once that it will not come.
  ~ShmComm() override {
    seg->peer(me)->state.store(kLeft);
    futexWakeAll(&seg->header()->gen);
  }

  int64_t rank() const override { return me; }
  const char *backend() const override { return "shm"; }
  int64_t size() const override { return n; }

  Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                  std::unique_ptr<Communicator> &out) override;

  Status allReduce(const void *in, void *out, int64_t count, DType dtype, ReduceOp op,
                   Stream *) override {
    FSDP_RETURN_IF_ERROR(checkSummable("all_reduce", dtype));
    const int64_t es = dtypeSize(dtype);
    const int64_t per = seg->slotBytes() / es;
    bytesSent_ += 2 * (n - 1) * count * es / n;
    return guard("all_reduce", [&]() -> Status {
      for (int64_t o = 0; o < count; o += per) {
        const int64_t cnt = std::min(per, count - o);
        const int set = nextSet();
        std::memcpy(seg->slot(set, me), static_cast<const uint8_t *>(in) + o * es,
                    (size_t)(cnt * es));
        FSDP_RETURN_IF_ERROR(sync());
        sum(static_cast<uint8_t *>(out) + o * es, set, 0, cnt, dtype, op);
      }
      return Status::ok();
    });
  }

  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype, ReduceOp op,
                       Stream *) override {
    return reduceScatterRuns(in, contiguous(shard * dtypeSize(dtype)), out, dtype, op);
  }

  Status reduceScatterRuns(const void *in, const BlockRuns &blocks, void *out, DType dtype,
                           ReduceOp op) override {
    FSDP_RETURN_IF_ERROR(checkSummable("reduce_scatter", dtype));
    const int64_t es = dtypeSize(dtype), shard = blocks.runs * blocks.runBytes / es;
    const int64_t per = std::max<int64_t>(1, seg->slotBytes() / (n * es));
    bytesSent_ += (n - 1) * shard * es;
    return guard("reduce_scatter", [&]() -> Status {
      for (int64_t o = 0; o < shard; o += per) {
        const int64_t cnt = std::min(per, shard - o);
        const int set = nextSet();
        uint8_t *mine = seg->slot(set, me);
        for (int64_t r = 0; r < n; ++r)
          forRuns(blocks, r, o * es, cnt * es, [&](int64_t user, int64_t at, int64_t bytes) {
            std::memcpy(mine + r * cnt * es + at, static_cast<const uint8_t *>(in) + user,
                        (size_t)bytes);
          });
        FSDP_RETURN_IF_ERROR(sync());
        sum(static_cast<uint8_t *>(out) + o * es, set, me * cnt * es, cnt, dtype, op);
      }
      return Status::ok();
    });
  }

  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *) override {
    return allGatherRuns(in, out, contiguous(shard * dtypeSize(dtype)), dtype);
  }

  Status allGatherRuns(const void *in, void *out, const BlockRuns &blocks, DType) override {
    const int64_t bytes = blocks.runs * blocks.runBytes;
    const int64_t per = seg->slotBytes();
    bytesSent_ += (n - 1) * bytes;
    return guard("all_gather", [&]() -> Status {
      for (int64_t o = 0; o < bytes; o += per) {
        const int64_t cnt = std::min(per, bytes - o);
        const int set = nextSet();
        std::memcpy(seg->slot(set, me), static_cast<const uint8_t *>(in) + o, (size_t)cnt);
        FSDP_RETURN_IF_ERROR(sync());
        for (int64_t r = 0; r < n; ++r)
          forRuns(blocks, r, o, cnt, [&](int64_t user, int64_t at, int64_t len) {
            std::memcpy(static_cast<uint8_t *>(out) + user, seg->slot(set, r) + at, (size_t)len);
          });
      }
      return Status::ok();
    });
  }

  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *) override {
    const int64_t bytes = chunk * dtypeSize(dtype);
    // Bytes of each destination's chunk per round: a rank's slot holds
    // its pieces for every rank, as a reduce-scatter's.
    const int64_t per = std::max<int64_t>(1, seg->slotBytes() / n);
    const auto *src = static_cast<const uint8_t *>(in);
    auto *dst = static_cast<uint8_t *>(out);
    bytesSent_ += (n - 1) * bytes;
    return guard("all_to_all", [&]() -> Status {
      for (int64_t o = 0; o < bytes; o += per) {
        const int64_t cnt = std::min(per, bytes - o);
        const int set = nextSet();
        uint8_t *mine = seg->slot(set, me);
        for (int64_t j = 0; j < n; ++j)
          if (j != me)
            std::memcpy(mine + j * cnt, src + j * bytes + o, (size_t)cnt);
        std::memcpy(dst + me * bytes + o, src + me * bytes + o, (size_t)cnt);
        FSDP_RETURN_IF_ERROR(sync());
        for (int64_t r = 0; r < n; ++r)
          if (r != me)
            std::memcpy(dst + r * bytes + o, seg->slot(set, r) + me * cnt, (size_t)cnt);
      }
      return Status::ok();
    });
  }

  Status broadcast(void *data, int64_t bytes, int64_t root) override {
    if (root < 0 || root >= n)
      return FSDP_ERROR("broadcast: root ", root, " is not a rank of ", n);
    const int64_t per = seg->slotBytes();
    return guard("broadcast", [&]() -> Status {
      for (int64_t o = 0; o < bytes; o += per) {
        const int64_t cnt = std::min(per, bytes - o);
        const int set = nextSet();
        if (me == root)
          std::memcpy(seg->slot(set, root), static_cast<uint8_t *>(data) + o, (size_t)cnt);
        FSDP_RETURN_IF_ERROR(sync());
        if (me != root)
          std::memcpy(static_cast<uint8_t *>(data) + o, seg->slot(set, root), (size_t)cnt);
      }
      return Status::ok();
    });
  }

  Status barrier() override {
    return guard("barrier", [&]() -> Status {
      nextSet();
      return sync();
    });
  }

private:
  Status checkSummable(const char *what, DType dtype) {
    if (dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16)
      return Status::ok();
    return FSDP_ERROR(what, ": this communicator sums f32, bf16 and f16, not ",
                      dtypeName(dtype));
  }

  /// The slot set of the next barrier ([Note: shared-memory collectives]).
  int nextSet() { return (int)((barriers + 1) & 1); }

  /// Blocks of `bytes` one after the other (rank r's at r x bytes).
  static BlockRuns contiguous(int64_t bytes) {
    return BlockRuns{1, bytes, [bytes](int64_t r, int64_t) { return r * bytes; }};
  }

  /// f(byte in the caller's buffer, byte in the range, length) for each
  /// contiguous piece of block r's bytes [off, off + len).
  template <typename F>
  static void forRuns(const BlockRuns &b, int64_t r, int64_t off, int64_t len, F f) {
    for (int64_t at = 0; at < len;) {
      const int64_t j = (off + at) / b.runBytes, w = (off + at) % b.runBytes;
      const int64_t k = std::min(len - at, b.runBytes - w);
      f(b.start(r, j) + w, at, k);
      at += k;
    }
  }

  /// out[0..cnt) = the sum (or mean) over ranks, in rank order, of `cnt`
  /// elements at byte `offset` of each rank's slot in `set`.
  void sum(uint8_t *out, int set, int64_t offset, int64_t cnt, DType dtype, ReduceOp op) {
    const bool mean = op == ReduceOp::Mean;
    if (dtype == DType::F32) {
      auto *o = reinterpret_cast<float *>(out);
      const auto *s0 = reinterpret_cast<const float *>(seg->slot(set, 0) + offset);
      std::copy(s0, s0 + cnt, o);
      for (int64_t q = 1; q < n; ++q) {
        const auto *s = reinterpret_cast<const float *>(seg->slot(set, q) + offset);
        for (int64_t i = 0; i < cnt; ++i)
          o[i] += s[i];
      }
      if (mean) { // times 1/N, as the Gloo communicator does
        const float f = 1.0f / (float)n;
        for (int64_t i = 0; i < cnt; ++i)
          o[i] *= f;
      }
      return;
    }
    const bool half = dtype == DType::F16;
    const bool pre = mean && half; // [Note: f16 means] in GlooComm.cpp
    acc.assign((size_t)cnt, 0.0f);
    for (int64_t q = 0; q < n; ++q) {
      const auto *s = reinterpret_cast<const uint16_t *>(seg->slot(set, q) + offset);
      for (int64_t i = 0; i < cnt; ++i) {
        float v = half ? widenHalf(s[i]) : widenBf16(s[i]);
        acc[i] += pre ? v / (float)n : v;
      }
    }
    auto *o = reinterpret_cast<uint16_t *>(out);
    for (int64_t i = 0; i < cnt; ++i) {
      float v = mean && !pre ? acc[i] / (float)n : acc[i];
      o[i] = half ? roundToHalf(v) : roundToBf16(v);
    }
  }

  /// The barrier ([Note: shm barrier]). OK once every rank arrived; an error
  /// naming the ranks that did not, when one left or died, or at the timeout.
  Status sync() {
    Header *h = seg->header();
    const uint64_t mine = ++barriers;
    seg->peer(me)->arrivals.store(mine, std::memory_order_release);
    const uint32_t g = h->gen.load(std::memory_order_acquire);
    if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)n) {
      h->arrived.store(0, std::memory_order_relaxed);
      h->gen.store(g + 1); // seq_cst: ordered before the sleepers load
      if (h->sleepers.load() > 0)
        futexWakeAll(&h->gen);
      return Status::ok();
    }
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    // Spin about 20 us when every rank can have a core of its own.
    if (spin)
      for (auto until = start + std::chrono::microseconds(20); Clock::now() < until;)
        for (int k = 0; k < 64; ++k) {
          if (h->gen.load(std::memory_order_acquire) != g)
            return Status::ok();
          cpuRelax();
        }
    const auto deadline = start + timeout;
    while (true) {
      h->sleepers.fetch_add(1);
      if (h->gen.load() == g)
        futexWait(&h->gen, g, 20 * 1000 * 1000); // 20 ms slices
      h->sleepers.fetch_sub(1);
      if (h->gen.load(std::memory_order_acquire) != g)
        return Status::ok();
      std::vector<int64_t> missing;
      for (int64_t r = 0; r < n; ++r) {
        Peer *p = seg->peer(r);
        if (p->arrivals.load(std::memory_order_acquire) >= mine)
          continue;
        if (p->state.load() == kLeft)
          return FSDP_ERROR("rank ", r, " closed its communicator before arriving");
        if (processGone(p->pid.load()))
          return FSDP_ERROR("rank ", r, " (pid ", p->pid.load(),
                            ") exited without arriving");
        missing.push_back(r);
      }
      if (Clock::now() >= deadline) {
        std::ostringstream os;
        for (size_t i = 0; i < missing.size(); ++i)
          os << (i ? "," : "") << missing[i];
        return FSDP_ERROR("waited ", timeout.count() / 1000.0, " s for rank(s) ", os.str());
      }
    }
  }

  template <typename F> Status guard(const char *what, F f) {
    if (broken)
      return FSDP_ERROR("rank ", me, ": ", what,
                        " refused: an earlier collective of this communicator failed");
    int64_t seq = recorder ? recorder->enter(what) : 0;
    Status st = f();
    if (st) {
      if (recorder)
        recorder->complete(seq);
      return st;
    }
    // The barrier's count now includes this rank's arrival: the segment is
    // out of step for good.
    broken = true;
    std::string why = recorder ? recorder->explain(seq, what, st.message()) + ". shm: " : "";
    return FSDP_ERROR("rank ", me, ": ", what, " failed (a peer died or timed out after ",
                      timeout.count() / 1000.0, " s): ", why, st.message());
  }

  std::unique_ptr<Segment> seg;
  int64_t me, n;
  std::chrono::milliseconds timeout;
  /// Every rank can have a core of its own: a barrier spins before sleeping.
  bool spin;
  std::unique_ptr<FlightRecorder> recorder;
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::string prefix;
  uint64_t barriers = 0; ///< barriers entered: the same count on every rank
  bool broken = false;
  std::vector<float> acc; ///< bf16 / f16 sums
};

/// Meets the group's other ranks under `prefix` in `store`: rank 0 creates
/// the segment and publishes its name; every rank maps it and publishes
/// whether that worked; all read every rank's result, so all agree.
Status connect(gloo::rendezvous::Store &base, const std::string &prefix, int64_t me,
               int64_t n, std::chrono::milliseconds timeout,
               std::unique_ptr<Segment> &seg, bool &unavailable) {
  unavailable = false;
  gloo::rendezvous::PrefixStore store(prefix + "/shm", base);
  auto bytes = [](const std::string &s) { return std::vector<char>(s.begin(), s.end()); };
  auto fetch = [&](const std::string &key, std::string &value) -> Status {
    try {
      store.wait({key}, timeout);
      std::vector<char> v = store.get(key);
      value.assign(v.begin(), v.end());
    } catch (const std::exception &e) {
      return FSDP_ERROR("waiting for '", key, "' in the rendezvous store failed: ", e.what());
    }
    return Status::ok();
  };
  seg = std::make_unique<Segment>();
  std::string name;
  uint64_t token = 0;
  if (me == 0) {
    std::random_device rd;
    token = ((uint64_t)rd() << 32) ^ rd() ^ (uint64_t)::getpid();
    char buf[64];
    std::snprintf(buf, sizeof buf, "/fsdp-%d-%016llx", (int)::getpid(),
                  (unsigned long long)token);
    name = buf;
    Status st = seg->create(name, n, token);
    try {
      store.set("name", bytes(st ? name + " " + std::to_string(token) : "!" + st.message()));
    } catch (const std::exception &e) {
      return FSDP_ERROR("publishing the shared-memory segment failed: ", e.what());
    }
    if (!st) {
      unavailable = true;
      return st;
    }
  } else {
    std::string v;
    FSDP_RETURN_IF_ERROR(fetch("name", v));
    if (!v.empty() && v[0] == '!') {
      unavailable = true;
      return FSDP_ERROR("rank 0 could not set up shared memory: ", v.substr(1));
    }
    std::istringstream is(v);
    is >> name >> token;
  }
  Status mapped = me == 0 ? Status::ok() : seg->open(name, n, token);
  try {
    store.set("attached-" + std::to_string(me), bytes(mapped ? "ok" : "!" + mapped.message()));
  } catch (const std::exception &e) {
    return FSDP_ERROR("publishing the shared-memory attach failed: ", e.what());
  }
  for (int64_t r = 0; r < n; ++r) {
    std::string v;
    FSDP_RETURN_IF_ERROR(fetch("attached-" + std::to_string(r), v));
    if (v != "ok") {
      unavailable = true;
      return FSDP_ERROR("rank ", r, " could not map the shared memory: ", v.substr(1));
    }
  }
  seg->unlink(); // every rank has it mapped: nothing can leak from here on
  return Status::ok();
}

Status ShmComm::subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                         std::unique_ptr<Communicator> &out) {
  int64_t me = 0;
  FSDP_RETURN_IF_ERROR(checkGroup(ranks, tag, me));
  if (ranks.size() == 1)
    return Communicator::subgroup(ranks, tag, out);
  std::string name = prefix + "/" + tag;
  std::unique_ptr<Segment> sub;
  bool unavailable = false;
  const int64_t n = (int64_t)ranks.size();
  Status st = connect(*store, name, me, n, timeout, sub, unavailable);
  if (!st)
    return FSDP_ERROR("rank ", rank(), ": connecting group '", tag, "' (", n,
                      " ranks) failed: ", st.message());
  out = std::make_unique<ShmComm>(std::move(sub), me, n, timeout, nullptr, store, name);
  return Status::ok();
}

} // namespace

Status makeShmCommunicator(const JobEnv &job, double timeoutSeconds,
                           std::unique_ptr<Communicator> &out, bool *unavailable) {
  bool none = false;
  if (unavailable)
    *unavailable = false;
  if (job.worldSize == 1) {
    out = makeSingleProcessCommunicator();
    return Status::ok();
  }
  auto timeout = std::chrono::milliseconds((int64_t)(timeoutSeconds * 1000));
  const std::string where = rendezvousName(job);
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::unique_ptr<FlightRecorder> recorder;
  try {
    store = openRendezvousStore(job, timeout);
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, " of ", job.worldSize, ": rendezvous through '",
                      where, "' failed (", job.source, "): ", e.what());
  }
  std::unique_ptr<Segment> seg;
  Status st = connect(*store, "fsdp", job.rank, job.worldSize, timeout, seg, none);
  if (unavailable)
    *unavailable = none;
  if (!st)
    return FSDP_ERROR("rank ", job.rank, " of ", job.worldSize, ": rendezvous through '",
                      where, "' failed (", job.source, "): shared memory: ", st.message());
  try {
    recorder = makeJobFlightRecorder(job, timeout);
  } catch (const std::exception &e) {
    return FSDP_ERROR("rank ", job.rank, ": the flight recorder's store failed: ", e.what());
  }
  out = std::make_unique<ShmComm>(std::move(seg), job.rank, job.worldSize, timeout,
                                  std::move(recorder), store, "fsdp");
  return Status::ok();
}

Status makeShmGroup(std::shared_ptr<gloo::rendezvous::Store> store, const std::string &prefix,
                    int64_t index, int64_t n, double timeoutSeconds,
                    std::unique_ptr<Communicator> &out, bool *unavailable) {
  bool none = false;
  if (unavailable)
    *unavailable = false;
  if (n == 1) {
    out = makeSingleProcessCommunicator();
    return Status::ok();
  }
  auto timeout = std::chrono::milliseconds((int64_t)(timeoutSeconds * 1000));
  std::unique_ptr<Segment> seg;
  Status st = connect(*store, prefix, index, n, timeout, seg, none);
  if (unavailable)
    *unavailable = none;
  if (!st)
    return st;
  out = std::make_unique<ShmComm>(std::move(seg), index, n, timeout, nullptr, store, prefix);
  return Status::ok();
}

Status makeHostCommunicator(const std::string &kind, const JobEnv &job,
                            double timeoutSeconds, std::unique_ptr<Communicator> &out) {
  if (kind == "gloo")
    return makeGlooCommunicator(job, timeoutSeconds, out);
  if (kind == "shm")
    return makeShmCommunicator(job, timeoutSeconds, out);
  if (kind == "hybrid")
    return makeHybridCommunicator(job, timeoutSeconds, out);
  if (kind != "auto")
    return FSDP_ERROR("--comm must be auto, shm, gloo or hybrid, found '", kind, "'");
  // Across machines: shared memory within each node where nodes hold
  // several ranks (the hybrid communicator finds out, and is Gloo alone
  // where each holds one).
  if (job.localWorldSize != job.worldSize)
    return makeHybridCommunicator(job, timeoutSeconds, out);
  bool unavailable = false;
  Status st = makeShmCommunicator(job, timeoutSeconds, out, &unavailable);
  if (st || !unavailable)
    return st;
  // Every rank learnt the same: all fall back together.
  if (job.rank == 0)
    std::fprintf(stderr, "fsdp-run: shared memory is unavailable (%s); using Gloo\n",
                 st.message().c_str());
  return makeGlooCommunicator(job, timeoutSeconds, out);
}

} // namespace fsdp
