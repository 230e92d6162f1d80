//===- EmuRuntime.cpp - the CUDA runtime API on a CPU, for tests ----------===//
//
// The subset of the CUDA runtime API the backend uses (runtime/cuda/),
// implemented on host memory so its tests and fsdp-run --device cuda run
// on a machine without a GPU (test/cudaemu/README.md). Kernels run at their
// launch on the calling host thread: the blocks one after another, every
// thread of a block on its own fiber, switched only at __syncthreads,
// __syncwarp and warp shuffles. Executing every stream operation when it
// is issued is one legal schedule of a CUDA program (an operation's
// dependencies are issued before it), so stream and event misuse that
// needs a race to show stays hidden, but everything the API checks on a
// GPU is checked here as well, and more strictly where that finds bugs:
//  - launch configurations (block size, grid size, dynamic shared memory
//    above 48 KiB only after cudaFuncSetAttribute raised the kernel's
//    limit, at most the H100's 227 KiB);
//  - a barrier some threads of the block never reach, a shuffle mask that
//    names missing or exited lanes: the launch fails (a hang or undefined
//    behaviour on a GPU);
//  - copies: a device-side pointer that no cudaMalloc / cudaMallocHost
//    returned, or a range past the end of its allocation;
//  - stream capture: synchronizing calls during a capture fail, a stream
//    forked into a capture must be joined back before it ends, copies
//    from pageable host memory cannot be captured; a graph replays the
//    captured kernels with the arguments they were captured with;
//  - device memory: cudaMalloc fails past CUDAEMU_MEMORY_BYTES (default
//    8 GiB), as it would past the GPU's memory.
// CUDAEMU_THREAD_ORDER=reverse runs each block's threads (and the blocks)
// in reverse, which changes the result of a kernel that reads shared
// memory another thread writes without a barrier between.
//
//===----------------------------------------------------------------------===//

#include "test/cudaemu/Emu.h"
#include "test/cudaemu/EmuInternal.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <random>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

// --- opaque handles ---------------------------------------------------------------
namespace cudaemu {
struct Graph; // a capture in progress (below)
} // namespace cudaemu
struct CUstream_st {
  int priority = 0;
  unsigned flags = 0;
  // Capture state (cudaStreamBeginCapture, or joined by waiting on an
  // event recorded in a capturing stream).
  cudaemu::Graph *capture = nullptr;
  bool origin = false;
  uint64_t lastOp = 0; ///< sequence number of the last op captured on it
  // CUDAEMU_STREAMS=threads: the stream's queue, run by its own thread.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t issued = 0, completed = 0; ///< operations queued / finished
  bool stop = false;
  std::thread worker;
};
struct CUevent_st {
  unsigned flags = 0;
  bool recorded = false;
  std::chrono::steady_clock::time_point when;
  cudaemu::Graph *capture = nullptr; ///< recorded inside this capture
  uint64_t captureId = 0;            ///< which one (the Graph may be gone)
  CUstream_st *stream = nullptr;
  uint64_t seq = 0;     ///< capture: the stream's last captured op
  uint64_t execSeq = 0; ///< threads: complete once the stream completed this many
};
namespace cudaemu {
struct Graph {
  uint64_t id = 0;
  std::vector<std::function<void()>> ops;
  uint64_t nextSeq = 1;
  std::set<CUstream_st *> members;
  std::map<CUstream_st *, uint64_t> joinedBack; ///< last op of a member the origin waited on
  std::string error; ///< the first capture error (invalidates the capture)
};
} // namespace cudaemu
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};

namespace cudaemu {

uint3 gThreadIdx, gBlockIdx;
dim3 gBlockDim, gGridDim;

namespace {

// --- errors ---------------------------------------------------------------------------
thread_local cudaError_t lastError = cudaSuccess;
thread_local std::string lastMessage; // why the last call failed (per thread, as the error)

cudaError_t fail(cudaError_t e, const std::string &why) {
  lastError = e;
  lastMessage = why;
  std::fprintf(stderr, "cudaemu: %s\n", why.c_str());
  return e;
}

// --- allocations ----------------------------------------------------------------------
struct Alloc {
  size_t bytes;
  bool pinned;
  bool registered = false; ///< cudaHostRegister: the caller's memory
};
std::mutex allocMu;
std::map<uintptr_t, Alloc> allocs; // by base address
size_t deviceBytes = 0;

size_t memoryLimit() {
  static size_t lim = [] {
    const char *e = std::getenv("CUDAEMU_MEMORY_BYTES");
    return e ? (size_t)std::strtoull(e, nullptr, 10) : (size_t)8 << 30;
  }();
  return lim;
}

/// The allocation holding [p, p + n), or null.
const Alloc *findAlloc(const void *p, size_t n, uintptr_t *base = nullptr) {
  std::lock_guard<std::mutex> g(allocMu);
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  auto it = allocs.upper_bound(v);
  if (it == allocs.begin())
    return nullptr;
  --it;
  if (v + n > it->first + it->second.bytes)
    return nullptr;
  if (base)
    *base = it->first;
  return &it->second;
}

cudaError_t checkDeviceRange(const void *p, size_t n, const char *what) {
  if (n == 0)
    return cudaSuccess;
  if (!findAlloc(p, n)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: [%p, +%zu) is not inside one cudaMalloc/cudaMallocHost "
                  "allocation", what, p, n);
    return fail(cudaErrorInvalidValue, buf);
  }
  return cudaSuccess;
}

// --- streams and capture ------------------------------------------------------------------
std::mutex captureMu;
thread_local Graph *threadCapture = nullptr; // a ThreadLocal-mode capture begun on this thread

CUstream_st legacyStream;
std::map<Graph *, uint64_t> liveCaptures; // captures in progress, by id
uint64_t nextCaptureId = 1;

/// The capture an event was recorded in, if it is still in progress (an
/// event recorded in a capture that has ended is a completed one here).
Graph *liveCaptureOf(const CUevent_st *e) {
  if (!e->capture)
    return nullptr;
  auto it = liveCaptures.find(e->capture);
  return it != liveCaptures.end() && it->second == e->captureId ? e->capture : nullptr;
}
CUstream_st *resolve(cudaStream_t s) { return s ? s : &legacyStream; }

// [Note: stream execution]
// By default every stream operation runs when it is issued, on the
// issuing thread: one legal schedule, deterministic and fast. With
// CUDAEMU_STREAMS=threads each created stream gets a queue and a thread
// of its own, as a GPU runs streams concurrently: an operation runs after
// the ones before it on its stream and after the events it was made to
// wait for, and no later; synchronizing calls wait for what they name.
// Work the backend forgot to order (a kernel reading what a collective on
// the other stream writes, a host read of a buffer a stream still writes)
// then races for real, and CUDAEMU_STREAM_DELAY_US=N delays every queued
// operation by a random 0..N us so that it loses the race. The legacy
// default stream (0) runs on the calling thread after the blocking streams
// (those created without cudaStreamNonBlocking) have drained, as its
// implicit synchronization says.
bool threadedStreams() {
  static const bool on = [] {
    const char *e = std::getenv("CUDAEMU_STREAMS");
    return e && std::string(e) == "threads";
  }();
  return on;
}
unsigned streamDelayUs() {
  static const unsigned us = [] {
    const char *e = std::getenv("CUDAEMU_STREAM_DELAY_US");
    return e ? (unsigned)std::atoi(e) : 0u;
  }();
  return us;
}

std::mutex streamsMu;
std::set<CUstream_st *> streams; // created, not destroyed

/// Blocks until stream st has completed `seq` operations.
void waitFor(CUstream_st *st, uint64_t seq) {
  std::unique_lock<std::mutex> l(st->mu);
  st->cv.wait(l, [&] { return st->completed >= seq; });
}
/// Blocks until st has completed everything issued to it so far.
void drain(CUstream_st *st) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(st->mu);
    seq = st->issued;
  }
  waitFor(st, seq);
}
void drainAll(bool blockingOnly) {
  std::vector<CUstream_st *> all;
  {
    std::lock_guard<std::mutex> g(streamsMu);
    for (CUstream_st *st : streams)
      if (!blockingOnly || !(st->flags & cudaStreamNonBlocking))
        all.push_back(st);
  }
  for (CUstream_st *st : all)
    drain(st);
}

void workerLoop(CUstream_st *st) {
  std::mt19937 jitter((unsigned)reinterpret_cast<uintptr_t>(st));
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock<std::mutex> l(st->mu);
      st->cv.wait(l, [&] { return st->stop || !st->queue.empty(); });
      if (st->queue.empty())
        return;
      op = std::move(st->queue.front());
      st->queue.pop_front();
    }
    if (unsigned us = streamDelayUs())
      std::this_thread::sleep_for(std::chrono::microseconds(jitter() % (us + 1)));
    op();
    {
      std::lock_guard<std::mutex> l(st->mu);
      ++st->completed;
    }
    st->cv.notify_all();
  }
}

/// Runs op on stream s: appended to the graph s is capturing, queued on
/// s's thread (threads mode), or run now.
cudaError_t enqueueOn(cudaStream_t s, std::function<void()> op) {
  CUstream_st *st = resolve(s);
  {
    std::lock_guard<std::mutex> g(captureMu);
    if (st->capture) {
      st->lastOp = st->capture->nextSeq++;
      st->capture->ops.push_back(std::move(op));
      return cudaSuccess;
    }
  }
  if (threadedStreams() && st != &legacyStream) {
    {
      std::lock_guard<std::mutex> l(st->mu);
      st->queue.push_back(std::move(op));
      ++st->issued;
    }
    st->cv.notify_all();
    return cudaSuccess;
  }
  if (threadedStreams())
    drainAll(/*blockingOnly=*/true);
  op();
  return cudaSuccess;
}

/// A synchronizing call is an error while this thread captures.
cudaError_t refuseDuringCapture(const char *call) {
  if (threadCapture)
    return fail(cudaErrorStreamCaptureImplicit,
                std::string(call) + " during a stream capture (it would synchronize)");
  return cudaSuccess;
}

// --- fibers -----------------------------------------------------------------------------------
// A minimal x86-64 context switch (callee-saved registers and the stack
// pointer; System V ABI). ucontext's swapcontext makes a signal-mask
// syscall per switch, 30x slower for blocks of 256 fibers.
extern "C" void cudaemu_switch(void **saveSp, void *newSp);
asm(R"(
.text
.globl cudaemu_switch
.type cudaemu_switch,@function
cudaemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size cudaemu_switch,.-cudaemu_switch
.section .note.GNU-stack,"",@progbits
.text
)");

constexpr size_t kStackBytes = 512 << 10; // per fiber (WMMA fragments are whole tiles here)

struct Fiber {
  void *sp = nullptr;
  uint3 tid{};
};

// [Note: fiber scheduling]
// A block's threads are fibers run from a ready queue: a fiber runs until
// it waits at a barrier or ends; the last arrival at a barrier queues the
// waiters again (in arrival order) and goes on. Only runnable fibers are
// ever visited, so a warp shuffling while the other warps wait at
// __syncthreads costs nothing for them. Threads that ended no longer hold
// __syncthreads up (as on Volta and later); a deadlock is an empty queue
// with fibers still waiting.
struct BlockState {
  std::vector<Fiber> fibers;
  std::deque<int> ready;
  void *schedSp = nullptr;
  Fiber *cur = nullptr;
  int live = 0;
  std::vector<int> blockWaiters; // at __syncthreads
  // per warp: lanes arrived at the warp barrier and their mask, waiters,
  // two alternating sets of shuffle slots, lanes that ended
  std::vector<unsigned> warpArrived, warpMask, warpParity, exited;
  std::vector<std::vector<int>> warpWaiters;
  std::vector<uint64_t> slots;
  std::vector<unsigned char> shared;
  // per thread: cp.async copies not yet committed, and committed groups
  // not yet waited for (performed at cp.async.wait_group, oldest first)
  struct AsyncCopy {
    void *dst;
    const void *src;
    size_t n;
  };
  struct ThreadAsync {
    std::vector<AsyncCopy> open;
    std::deque<std::vector<AsyncCopy>> groups;
  };
  std::vector<ThreadAsync> async;
  // per thread: wgmma products queued / committed, not yet waited for
  // (performed at wgmma.wait_group); per warpgroup: threads at its barrier
  struct WgmmaOp {
    float *d;
    int n;
    bool aRegs, acc, tnspA, tnspB, bf16;
    uint32_t a[4];
    uint64_t da, db;
  };
  struct ThreadWgmma {
    std::vector<WgmmaOp> open;
    std::deque<std::vector<WgmmaOp>> groups;
  };
  std::vector<ThreadWgmma> wgmma;
  std::vector<std::vector<int>> groupWaiters;
  const std::function<void()> *body = nullptr;
  std::string error;
  bool reverse = false;
};

BlockState blk;            // the running block (one at a time: launchMu)
std::mutex launchMu;       // kernels from several host threads run one at a time
std::map<const void *, size_t> maxDynamicSmem; // cudaFuncSetAttribute
std::vector<char *> stackPool;

char *stackFor(size_t i) {
  while (stackPool.size() <= i) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "cudaemu: cannot map a fiber stack\n");
      std::abort();
    }
    mprotect(m, page, PROT_NONE); // an overflow faults instead of corrupting
    stackPool.push_back(static_cast<char *>(m) + page);
  }
  return stackPool[i];
}

int self() { return (int)(blk.cur - blk.fibers.data()); }

/// Back to the scheduler; the fiber runs again when something queues it.
void suspend() { cudaemu_switch(&blk.cur->sp, blk.schedSp); }

/// Stops the launch: the fiber never runs again, the kernel fails.
void failLaunch(const std::string &why) {
  if (blk.error.empty())
    blk.error = why;
  suspend();
}

void releaseBlockBarrier() {
  for (int i : blk.blockWaiters)
    blk.ready.push_back(i);
  blk.blockWaiters.clear();
}

void fiberMain() {
  (*blk.body)();
  int i = self();
  if (!blk.wgmma[i].open.empty() || !blk.wgmma[i].groups.empty())
    failLaunch("thread " + std::to_string(i) + " of block " + std::to_string(gBlockIdx.x) +
               " ended with wgmma products it never waited for (wgmma.wait_group)");
  --blk.live;
  blk.exited[i / 32] |= 1u << (i % 32);
  if (!blk.blockWaiters.empty() && (int)blk.blockWaiters.size() == blk.live)
    releaseBlockBarrier();
  suspend();
  __builtin_unreachable();
}

void initFiber(Fiber &f, char *stack, int i) {
  // Stack top, 16-aligned: a zero "return address" slot, fiberMain as the
  // address cudaemu_switch returns to, and six zero callee-saved registers.
  // The tops are staggered by 192 bytes per fiber: at one stride apart
  // they would all fall in the same cache sets.
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStackBytes - (size_t)(i % 64) * 192) &
                  ~uintptr_t(15);
  void **sp = reinterpret_cast<void **>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void *>(&fiberMain);
  for (int i = 0; i < 6; ++i)
    *--sp = nullptr;
  f.sp = sp;
}

/// Runs one block to completion; false (with blk.error) on a fault or a
/// deadlock.
bool runBlock(dim3 dims) {
  int n = (int)(dims.x * dims.y * dims.z);
  int warps = (n + 31) / 32;
  blk.fibers.assign(n, Fiber{});
  blk.ready.clear();
  for (int k = 0; k < n; ++k) {
    int i = blk.reverse ? n - 1 - k : k;
    initFiber(blk.fibers[i], stackFor(i), i);
    blk.fibers[i].tid = uint3{(unsigned)(i % dims.x), (unsigned)(i / dims.x % dims.y),
                              (unsigned)(i / (dims.x * dims.y))};
    blk.ready.push_back(i);
  }
  blk.live = n;
  blk.blockWaiters.clear();
  blk.warpArrived.assign(warps, 0);
  blk.warpMask.assign(warps, 0);
  blk.warpParity.assign(warps, 0);
  blk.exited.assign(warps, 0);
  blk.warpWaiters.assign(warps, {});
  blk.slots.assign((size_t)warps * 64, 0);
  blk.async.assign(n, {});
  blk.wgmma.assign(n, {});
  blk.groupWaiters.assign((n + 127) / 128, {});
  std::fill(blk.shared.begin(), blk.shared.end(), (unsigned char)0xff);
  while (!blk.ready.empty() && blk.error.empty()) {
    Fiber &f = blk.fibers[blk.ready.front()];
    blk.ready.pop_front();
    blk.cur = &f;
    gThreadIdx = f.tid;
    cudaemu_switch(&blk.schedSp, f.sp);
  }
  if (!blk.error.empty())
    return false;
  if (blk.live > 0) {
    int atWarp = 0;
    for (auto &w : blk.warpWaiters)
      atWarp += (int)w.size();
    blk.error = "deadlock in block (" + std::to_string(gBlockIdx.x) + "," +
                std::to_string(gBlockIdx.y) + "," + std::to_string(gBlockIdx.z) + "): " +
                std::to_string(blk.blockWaiters.size()) + " thread(s) wait at __syncthreads, " +
                std::to_string(atWarp) +
                " at a warp barrier or shuffle whose other lanes never arrive";
    return false;
  }
  return true;
}

} // namespace

// --- device-side primitives ------------------------------------------------------------------
void syncThreads() {
  blk.blockWaiters.push_back(self());
  if ((int)blk.blockWaiters.size() == blk.live) { // the last to arrive goes on
    blk.blockWaiters.pop_back();
    releaseBlockBarrier();
    return;
  }
  suspend();
}

void syncWarp(unsigned mask) {
  int i = self(), w = i / 32, lane = i % 32;
  int inWarp = std::min(32, (int)blk.fibers.size() - w * 32);
  unsigned present = inWarp == 32 ? 0xffffffffu : ((1u << inWarp) - 1);
  if (!(mask >> lane & 1u) || (mask & ~present) || (mask & blk.exited[w])) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "warp barrier/shuffle in block %u, thread %d: mask 0x%08x %s", gBlockIdx.x, i,
                  mask,
                  !(mask >> lane & 1u) ? "does not include the calling lane"
                  : (mask & ~present) ? "names lanes past the end of the block"
                                      : "names lanes that have exited");
    failLaunch(buf);
  }
  if (blk.warpArrived[w] && blk.warpMask[w] != mask)
    failLaunch("lanes of one warp wait at warp barriers with different masks");
  blk.warpMask[w] = mask;
  blk.warpArrived[w] |= 1u << lane;
  if (blk.warpArrived[w] == mask) { // the last lane releases the others
    blk.warpArrived[w] = 0;
    blk.warpParity[w] ^= 1u;
    for (int j : blk.warpWaiters[w])
      blk.ready.push_back(j);
    blk.warpWaiters[w].clear();
    return;
  }
  blk.warpWaiters[w].push_back(i);
  suspend();
}

uint64_t warpExchange(unsigned mask, uint64_t bits, int srcLane) {
  int i = self(), w = i / 32;
  if (srcLane >= 0 && !(mask >> srcLane & 1u)) // undefined in CUDA
    failLaunch("a shuffle reads lane " + std::to_string(srcLane) + ", which is not in its mask");
  // Two slot sets alternate with the barrier's parity: a lane can write
  // the next exchange's set while slower lanes still read this one, and
  // cannot reach the set after without every lane passing the barrier
  // between (so one barrier per shuffle suffices).
  uint64_t *set = &blk.slots[(size_t)w * 64 + 32 * blk.warpParity[w]];
  set[i % 32] = bits;
  syncWarp(mask); // every lane has published
  return srcLane >= 0 ? set[srcLane] : bits;
}

void *dynamicShared() { return blk.shared.data(); }

void cpAsync(void *dst, const void *src, size_t n) {
  auto *c = static_cast<unsigned char *>(dst);
  const unsigned char *lo = blk.shared.data(), *hi = lo + blk.shared.size();
  if ((n != 4 && n != 8 && n != 16) || (reinterpret_cast<uintptr_t>(dst) % n) ||
      (reinterpret_cast<uintptr_t>(src) % n) || c < lo || c + n > hi) {
    failLaunch("cp.async in block " + std::to_string(gBlockIdx.x) + ", thread " +
               std::to_string(self()) + ": " + std::to_string(n) +
               " bytes to a destination outside dynamic shared memory, or a misaligned "
               "source or destination");
    return;
  }
  blk.async[self()].open.push_back({dst, src, n});
}

void cpAsyncCommit() {
  auto &t = blk.async[self()];
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

void cpAsyncWait(int pending) {
  auto &t = blk.async[self()];
  while ((int)t.groups.size() > pending) {
    for (const auto &c : t.groups.front())
      std::memcpy(c.dst, c.src, c.n);
    t.groups.pop_front();
  }
}

// --- wgmma (sm_90a) ------------------------------------------------------------------------------
namespace {
/// Fails the launch unless the calling thread is in a whole warpgroup
/// (four warps, the first a multiple of four) none of whose threads ended.
int warpgroupOf(const char *what) {
  int i = self(), g = i / 128;
  if ((size_t)(g + 1) * 128 > blk.fibers.size() ||
      (blk.exited[4 * g] | blk.exited[4 * g + 1] | blk.exited[4 * g + 2] | blk.exited[4 * g + 3]))
    failLaunch(std::string(what) + " in block " + std::to_string(gBlockIdx.x) + ", thread " +
               std::to_string(i) + ": not every thread of its warpgroup (128) is there");
  return g;
}

/// A barrier of the calling thread's warpgroup.
void syncWarpgroup(const char *what) {
  int i = self(), g = warpgroupOf(what);
  auto &w = blk.groupWaiters[g];
  w.push_back(i);
  if (w.size() == 128) {
    w.pop_back();
    for (int j : w)
      blk.ready.push_back(j);
    w.clear();
    return;
  }
  suspend();
}

/// The byte offset in dynamic shared memory of element (mn, k) of a
/// 16-bit wgmma operand at descriptor desc (mn: the M or N index), as
/// CudaMma.cuh's smemDesc describes the canonical layouts.
size_t operandByte(uint64_t desc, int mn, int k, bool mnMajor) {
  uint64_t start = (desc & 0x3FFFu) << 4, lbo = (desc >> 16 & 0x3FFFu) << 4,
           sbo = (desc >> 32 & 0x3FFFu) << 4;
  unsigned base = (unsigned)(desc >> 49 & 7u), mode = (unsigned)(desc >> 62);
  if (base != 0) {
    failLaunch("wgmma: a descriptor with a non-zero base offset (not emulated)");
    return 0;
  }
  uint64_t width = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0, off;
  if (!mnMajor)
    off = width == 0 ? (mn % 8) * 16 + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * lbo
                     : (mn % 8) * width + (mn / 8) * sbo + 2 * k;
  else if (width == 0)
    off = (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo;
  else
    off = (mn % (width / 2)) * 2 + (mn / (width / 2)) * lbo + (k % 8) * width + (k / 8) * sbo;
  uint64_t addr = start + off;
  if (width == 128)
    addr ^= (addr >> 7 & 7) << 4;
  else if (width == 64)
    addr ^= (addr >> 7 & 3) << 4;
  else if (width == 32)
    addr ^= (addr >> 7 & 1) << 4;
  if (addr + 2 > blk.shared.size()) {
    failLaunch("wgmma: an operand element outside dynamic shared memory (descriptor 0x" +
               [&] {
                 char b[20];
                 std::snprintf(b, sizeof b, "%016llx", (unsigned long long)desc);
                 return std::string(b);
               }() + ")");
    return 0;
  }
  return (size_t)addr;
}

float operandAt(size_t byte, bool bf16) {
  uint16_t h;
  std::memcpy(&h, blk.shared.data() + byte, 2);
  return bitsToFloat(h, bf16);
}

/// Performs the calling thread's part (its d elements) of product o of
/// its committed group g; every thread of the warpgroup is at the wait.
void performWgmma(int i, size_t g, size_t o) {
  const auto &op = blk.wgmma[i].groups[g][o];
  int lead = i / 128 * 128, warpBase = i / 32 * 32, w = i % 128 / 32, lane = i % 32;
  const auto &leadGroups = blk.wgmma[lead].groups;
  if (leadGroups.size() <= g || leadGroups[g].size() <= o) {
    failLaunch("wgmma: the threads of a warpgroup committed different products");
    return;
  }
  const auto &l = leadGroups[g][o];
  if (l.n != op.n || l.aRegs != op.aRegs || l.da != op.da || l.db != op.db || l.acc != op.acc ||
      l.tnspA != op.tnspA || l.tnspB != op.tnspB || l.bf16 != op.bf16) {
    failLaunch("wgmma: the threads of a warpgroup issued one product with different operands");
    return;
  }
  auto A = [&](int r, int k) { // r: the row within the warp's 16
    if (!op.aRegs)
      return operandAt(operandByte(op.da, 16 * w + r, k, op.tnspA), op.bf16);
    const auto &src = blk.wgmma[warpBase + (r % 8) * 4 + (k % 8) / 2].groups[g][o];
    uint32_t reg = src.a[(r >= 8) + 2 * (k >= 8)];
    return bitsToFloat((uint16_t)(k % 2 ? reg >> 16 : reg & 0xffffu), op.bf16);
  };
  // The thread's two rows of A and its n / 4 columns of B, read once.
  int gr = lane / 4, q = lane % 4;
  float a[2][16], b[32][2][16];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k)
      a[h][k] = A(gr + 8 * h, k);
  for (int j = 0; j < op.n / 8; ++j)
    for (int c = 0; c < 2; ++c)
      for (int k = 0; k < 16; ++k)
        b[j][c][k] = operandAt(operandByte(op.db, 8 * j + 2 * q + c, k, op.tnspB), op.bf16);
  for (int e = 0; e < op.n / 2; ++e) {
    const float *x = a[e / 2 % 2], *y = b[e / 4][e % 2];
    float s = op.acc ? op.d[e] : 0.f;
    for (int k = 0; k < 16; ++k)
      s += x[k] * y[k];
    op.d[e] = s;
  }
}
} // namespace

uint32_t sharedOffset(const void *p) {
  auto *c = static_cast<const unsigned char *>(p);
  const unsigned char *lo = blk.shared.data(), *hi = lo + blk.shared.size();
  if (c < lo || c > hi)
    failLaunch("a shared-memory address (descriptor) outside dynamic shared memory");
  return (uint32_t)(c - lo);
}

void wgmma(float *d, int n, const uint32_t *a, uint64_t da, uint64_t db, bool accumulate,
           bool tnspA, bool tnspB, bool bf16) {
  warpgroupOf("wgmma.mma_async");
  if (n % 8 || n < 8 || n > 256)
    failLaunch("wgmma: N = " + std::to_string(n) + " is not a multiple of 8 in 8..256");
  BlockState::WgmmaOp op{d, n, a != nullptr, accumulate, tnspA, tnspB, bf16, {}, da, db};
  if (a)
    std::memcpy(op.a, a, sizeof op.a);
  blk.wgmma[self()].open.push_back(op);
}

void wgmmaFence() { warpgroupOf("wgmma.fence"); }

void wgmmaCommit() {
  warpgroupOf("wgmma.commit_group");
  auto &t = blk.wgmma[self()];
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

void wgmmaWait(int pending) {
  int i = self();
  syncWarpgroup("wgmma.wait_group"); // every thread has queued its operands
  auto &t = blk.wgmma[i];
  size_t done = t.groups.size() > (size_t)pending ? t.groups.size() - pending : 0;
  for (size_t g = 0; g < done; ++g)
    for (size_t o = 0; o < t.groups[g].size(); ++o)
      performWgmma(i, g, o);
  syncWarpgroup("wgmma.wait_group"); // every thread has read the others' A registers
  for (size_t g = 0; g < done; ++g)
    t.groups.pop_front();
}

void checkLdmatrixRow(const void *p) {
  auto *c = static_cast<const unsigned char *>(p);
  const unsigned char *lo = blk.shared.data(), *hi = lo + blk.shared.size();
  if ((reinterpret_cast<uintptr_t>(p) & 15) || c < lo || c + 16 > hi)
    failLaunch("ldmatrix in block " + std::to_string(gBlockIdx.x) + ", thread " +
               std::to_string(self()) +
               ": a row address that is not a 16-byte aligned row of dynamic shared memory");
}


// --- launches -----------------------------------------------------------------------------------
namespace {
constexpr size_t kDefaultSmem = 48 << 10, kMaxSmemOptIn = 227 << 10; // H100

/// Runs a whole grid; the launch's error, or success.
cudaError_t runGrid(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body) {
  std::lock_guard<std::mutex> g(launchMu);
  static const bool reverse = [] {
    const char *e = std::getenv("CUDAEMU_THREAD_ORDER");
    return e && std::string(e) == "reverse";
  }();
  blk.reverse = reverse;
  blk.body = &body;
  blk.error.clear();
  blk.shared.assign(std::max<size_t>(smem, 1), 0xff);
  gGridDim = grid;
  gBlockDim = block;
  uint64_t blocks = (uint64_t)grid.x * grid.y * grid.z;
  for (uint64_t k = 0; k < blocks; ++k) {
    uint64_t b = reverse ? blocks - 1 - k : k;
    gBlockIdx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                      (unsigned)(b / ((uint64_t)grid.x * grid.y))};
    if (!runBlock(block))
      return fail(cudaErrorLaunchFailure, "kernel failed: " + blk.error);
  }
  return cudaSuccess;
}
} // namespace

void launchGrid(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                std::function<void()> body) {
  uint64_t threads = (uint64_t)block.x * block.y * block.z;
  char buf[200];
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    std::snprintf(buf, sizeof buf,
                  "invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u)", grid.x, grid.y,
                  grid.z, block.x, block.y, block.z);
    fail(cudaErrorInvalidConfiguration, buf);
    return;
  }
  if (smem > kDefaultSmem) {
    size_t allowed = kDefaultSmem;
    {
      std::lock_guard<std::mutex> g(launchMu);
      auto it = fn ? maxDynamicSmem.find(fn) : maxDynamicSmem.end();
      if (it != maxDynamicSmem.end())
        allowed = it->second;
    }
    if (smem > allowed) {
      std::snprintf(buf, sizeof buf,
                    "a launch asks for %zu bytes of dynamic shared memory; the kernel allows %zu "
                    "(cudaFuncAttributeMaxDynamicSharedMemorySize raises the 48 KiB default)",
                    smem, allowed);
      fail(cudaErrorInvalidValue, buf);
      return;
    }
  }
  auto run = [grid, block, smem, body = std::move(body)]() {
    cudaError_t e = runGrid(grid, block, smem, body);
    if (e != cudaSuccess)
      stickyError(e);
  };
  enqueueOn(s, std::move(run));
}

// A kernel fault is sticky on a GPU (every later call fails); here it is
// reported by the next cudaGetLastError / synchronization.
namespace {
std::atomic<int> sticky{0};
}
void stickyError(cudaError_t e) {
  int zero = 0;
  sticky.compare_exchange_strong(zero, (int)e);
}
cudaError_t takeSticky() { return (cudaError_t)sticky.load(); }
void clearSticky() { sticky.store(0); }

cudaError_t enqueue(cudaStream_t s, std::function<void()> op) {
  return enqueueOn(s, std::move(op));
}
bool runsAtIssue(cudaStream_t s) {
  std::lock_guard<std::mutex> g(captureMu);
  return !resolve(s)->capture && (!threadedStreams() || !s);
}
cudaError_t checkDevicePointer(const void *p, size_t n, const char *what) {
  return checkDeviceRange(p, n, what);
}

} // namespace cudaemu

using namespace cudaemu;

// --- the runtime API ------------------------------------------------------------------------
extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
  const char *e = std::getenv("CUDAEMU_DEVICES");
  *count = e ? std::atoi(e) : 1;
  return *count > 0 ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaSetDevice(int d) {
  int n = 0;
  cudaGetDeviceCount(&n);
  return d >= 0 && d < n ? cudaSuccess
                         : fail(cudaErrorInvalidDevice, "cudaSetDevice: no such device");
}
cudaError_t cudaGetDevice(int *d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (d < 0 || d >= n)
    return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: no such device");
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "CUDA emulator");
  p->major = 9; // the Hopper features the backend uses (wgmma, 227 KiB shared memory)
  p->minor = 0;
  p->totalGlobalMem = memoryLimit();
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least)
    *least = 0;
  if (greatest)
    *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = cudaemu::lastError;
  cudaemu::lastError = cudaSuccess;
  if (e == cudaSuccess)
    e = takeSticky();
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  return cudaemu::lastError != cudaSuccess ? cudaemu::lastError : takeSticky();
}
const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "cudaSuccess";
  case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
  case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
  case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
  case cudaErrorNoDevice: return "cudaErrorNoDevice";
  case cudaErrorNotReady: return "cudaErrorNotReady";
  case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
  case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
  case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
  case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
  case cudaErrorIllegalState: return "cudaErrorIllegalState";
  case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
  default: return "cudaErrorUnknown";
  }
}
const char *cudaGetErrorString(cudaError_t e) {
  static thread_local std::string s;
  s = std::string(cudaGetErrorName(e)) + " (CPU emulator";
  if (e != cudaSuccess && !cudaemu::lastMessage.empty())
    s += ": " + cudaemu::lastMessage;
  s += ")";
  return s.c_str();
}

cudaError_t cudaMalloc(void **p, size_t n) {
  *p = nullptr;
  if (cudaError_t e = refuseDuringCapture("cudaMalloc"))
    return e;
  size_t bytes = std::max<size_t>(n, 1);
  {
    std::lock_guard<std::mutex> g(allocMu);
    if (deviceBytes + bytes > memoryLimit())
      return fail(cudaErrorMemoryAllocation,
                  "cudaMalloc of " + std::to_string(n) + " bytes: " +
                      std::to_string(memoryLimit() - deviceBytes) +
                      " bytes free of the emulated device's " + std::to_string(memoryLimit()) +
                      " (CUDAEMU_MEMORY_BYTES)");
  }
  void *m = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!m)
    return fail(cudaErrorMemoryAllocation, "cudaMalloc: host allocation failed");
  std::lock_guard<std::mutex> g(allocMu);
  allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{bytes, false};
  deviceBytes += bytes;
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
  *p = nullptr;
  size_t bytes = std::max<size_t>(n, 1);
  // Pinned memory is whole pages, as CUDA's is (O_DIRECT reads into it).
  void *m = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (!m)
    return fail(cudaErrorMemoryAllocation, "cudaMallocHost: host allocation failed");
  std::lock_guard<std::mutex> g(allocMu);
  allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{bytes, true};
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) { return cudaMallocHost(p, n); }
static cudaError_t freeAlloc(void *p, bool pinned, const char *call) {
  if (!p)
    return cudaSuccess;
  std::lock_guard<std::mutex> g(allocMu);
  auto it = allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocs.end() || it->second.pinned != pinned || it->second.registered)
    return fail(cudaErrorInvalidValue,
                std::string(call) + ": not a pointer its allocator returned");
  if (!pinned)
    deviceBytes -= it->second.bytes;
  allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFree(void *p) { return freeAlloc(p, false, "cudaFree"); }
// Registered host memory is pinned memory the caller owns: copies may use
// it as they use cudaMallocHost's; it must not overlap another allocation
// and is unregistered by its base address.
cudaError_t cudaHostRegister(void *p, size_t n, unsigned) {
  if (!p || n == 0)
    return fail(cudaErrorInvalidValue, "cudaHostRegister: a null pointer or no bytes");
  std::lock_guard<std::mutex> g(allocMu);
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  auto next = allocs.lower_bound(v);
  bool overlaps = next != allocs.end() && next->first < v + n;
  if (next != allocs.begin()) {
    auto prev = std::prev(next);
    overlaps |= prev->first + prev->second.bytes > v;
  }
  if (overlaps)
    return fail(cudaErrorHostMemoryAlreadyRegistered,
                "cudaHostRegister: the range overlaps an allocation or registration");
  allocs[v] = Alloc{n, true, true};
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void *p) {
  std::lock_guard<std::mutex> g(allocMu);
  auto it = allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocs.end() || !it->second.registered)
    return fail(cudaErrorHostMemoryNotRegistered,
                "cudaHostUnregister: not the base of a registered range");
  allocs.erase(it);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { return freeAlloc(p, true, "cudaFreeHost"); }
cudaError_t cudaMemGetInfo(size_t *freeB, size_t *total) {
  std::lock_guard<std::mutex> g(allocMu);
  *total = memoryLimit();
  *freeB = memoryLimit() - deviceBytes;
  return cudaSuccess;
}

static cudaError_t checkCopy(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                             bool capturing) {
  bool dstDev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool srcDev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (dstDev)
    if (cudaError_t e = checkDeviceRange(dst, n, "copy destination"))
      return e;
  if (srcDev)
    if (cudaError_t e = checkDeviceRange(src, n, "copy source"))
      return e;
  if (capturing && n) {
    // A captured copy must not touch pageable host memory.
    if (!dstDev && !findAlloc(dst, n))
      return fail(cudaErrorStreamCaptureUnsupported,
                  "a captured copy to pageable host memory (use cudaMallocHost)");
    if (!srcDev && !findAlloc(src, n))
      return fail(cudaErrorStreamCaptureUnsupported,
                  "a captured copy from pageable host memory (use cudaMallocHost)");
  }
  return cudaSuccess;
}
static bool streamCapturing(cudaStream_t s) {
  std::lock_guard<std::mutex> g(captureMu);
  return resolve(s)->capture != nullptr;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  if (cudaError_t e = refuseDuringCapture("cudaMemcpy"))
    return e;
  if (cudaError_t e = checkCopy(dst, src, n, kind, false))
    return e;
  if (threadedStreams()) // the legacy stream waits for the blocking streams only
    drainAll(/*blockingOnly=*/true);
  if (n)
    std::memmove(dst, src, n);
  return takeSticky();
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s) {
  if (cudaError_t e = checkCopy(dst, src, n, kind, streamCapturing(s)))
    return e;
  return enqueue(s, [=] {
    if (n)
      std::memmove(dst, src, n);
  });
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t s) {
  if (width > dpitch || width > spitch)
    return fail(cudaErrorInvalidPitchValue, "cudaMemcpy2DAsync: width over a pitch");
  if (kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
    return fail(cudaErrorNotSupported,
                     "cudaMemcpy2DAsync: only device-to-device copies are emulated");
  if (width == 0 || height == 0)
    return cudaSuccess;
  if (cudaError_t e = checkDeviceRange(dst, dpitch * (height - 1) + width, "cudaMemcpy2DAsync"))
    return e;
  if (cudaError_t e = checkDeviceRange(src, spitch * (height - 1) + width, "cudaMemcpy2DAsync"))
    return e;
  auto *d = static_cast<char *>(dst);
  auto *c = static_cast<const char *>(src);
  return enqueue(s, [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(d + r * dpitch, c + r * spitch, width);
  });
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
  if (cudaError_t e = refuseDuringCapture("cudaMemset"))
    return e;
  if (cudaError_t e = checkDeviceRange(p, n, "cudaMemset"))
    return e;
  if (threadedStreams())
    drainAll(/*blockingOnly=*/true);
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
  if (cudaError_t e = checkDeviceRange(p, n, "cudaMemsetAsync"))
    return e;
  return enqueue(s, [=] { std::memset(p, v, n); });
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority) {
  *s = new CUstream_st;
  (*s)->flags = flags;
  (*s)->priority = priority;
  if (threadedStreams())
    (*s)->worker = std::thread(workerLoop, *s);
  std::lock_guard<std::mutex> g(streamsMu);
  streams.insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithPriority(s, 0, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  return cudaStreamCreateWithPriority(s, flags, 0);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (streamCapturing(s))
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamDestroy of a capturing stream");
  if (!s)
    return cudaSuccess;
  {
    std::lock_guard<std::mutex> g(streamsMu);
    streams.erase(s);
  }
  if (s->worker.joinable()) { // its queued work completes first, as on a GPU
    {
      std::lock_guard<std::mutex> l(s->mu);
      s->stop = true;
    }
    s->cv.notify_all();
    s->worker.join();
  }
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (streamCapturing(s))
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize of a capturing stream");
  if (threadedStreams()) {
    if (s)
      drain(s);
    else
      drainAll(/*blockingOnly=*/true);
  }
  return takeSticky();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (streamCapturing(s))
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery of a capturing stream");
  if (threadedStreams() && s) {
    std::lock_guard<std::mutex> l(s->mu);
    if (s->completed < s->issued)
      return cudaErrorNotReady;
  }
  return takeSticky();
}
// A GPU's sticky error lasts until the context is reset; the emulator's
// allocations stay (nothing in the backend resets a device it uses).
cudaError_t cudaDeviceReset(void) {
  clearSticky();
  cudaemu::lastError = cudaSuccess;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  if (cudaError_t e = refuseDuringCapture("cudaDeviceSynchronize"))
    return e;
  if (threadedStreams())
    drainAll(/*blockingOnly=*/false);
  return takeSticky();
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  *e = new CUevent_st;
  (*e)->flags = flags;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  CUstream_st *st = resolve(s);
  std::lock_guard<std::mutex> g(captureMu);
  e->recorded = true;
  e->capture = st->capture;
  e->captureId = st->capture ? st->capture->id : 0;
  e->stream = st;
  e->seq = st->capture ? st->lastOp : 0;
  if (threadedStreams() && !st->capture && st != &legacyStream) {
    {
      std::lock_guard<std::mutex> l(st->mu);
      if (!(e->flags & cudaEventDisableTiming)) {
        // A timing event takes the time the stream reaches it, not the
        // host's issue time (what cudaEventElapsedTime measures on a GPU).
        st->queue.push_back([e] { e->when = std::chrono::steady_clock::now(); });
        ++st->issued;
      }
      e->execSeq = st->issued; // complete with the work issued before it
    }
    st->cv.notify_all();
  } else {
    e->when = std::chrono::steady_clock::now(); // eager: the work before it has run
    e->execSeq = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned) {
  return cudaEventRecord(e, s);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  CUstream_st *st = resolve(s);
  std::unique_lock<std::mutex> g(captureMu);
  Graph *cap = liveCaptureOf(e);
  if (!cap) {
    if (threadedStreams() && e->execSeq && !st->capture) {
      g.unlock(); // never block, or take a stream's lock, under captureMu
      // The wait is an operation of s, ordered after what s has queued.
      CUstream_st *src = e->stream;
      uint64_t seq = e->execSeq;
      if (st == &legacyStream) {
        waitFor(src, seq);
        return cudaSuccess;
      }
      {
        std::lock_guard<std::mutex> l(st->mu);
        st->queue.push_back([src, seq] { waitFor(src, seq); });
        ++st->issued;
      }
      st->cv.notify_all();
    }
    return cudaSuccess; // eager: complete already, every issued op has run
  }
  if (st->capture && st->capture != cap)
    return fail(cudaErrorStreamCaptureIsolation, "a wait joins two different captures");
  if (!st->capture) { // fork: the waiting stream joins the capture
    st->capture = cap;
    st->origin = false;
    st->lastOp = 0;
    cap->members.insert(st);
  }
  auto &jb = cap->joinedBack[e->stream];
  if (st->origin)
    jb = std::max(jb, e->seq);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  bool captured;
  {
    std::lock_guard<std::mutex> g(captureMu);
    captured = liveCaptureOf(e) != nullptr;
  }
  if (captured)
    return fail(cudaErrorStreamCaptureUnsupported, "cudaEventSynchronize on a captured event");
  if (e->execSeq)
    waitFor(e->stream, e->execSeq);
  return takeSticky();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e->execSeq) {
    std::lock_guard<std::mutex> l(e->stream->mu);
    if (e->stream->completed < e->execSeq)
      return cudaErrorNotReady;
  }
  return cudaEventSynchronize(e);
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  if ((a->flags | b->flags) & cudaEventDisableTiming)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime on an event without timing");
  if (!a->recorded || !b->recorded)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime on an unrecorded event");
  for (cudaEvent_t e : {a, b})
    if (e->execSeq) { // threads: the stream must have reached it
      std::lock_guard<std::mutex> l(e->stream->mu);
      if (e->stream->completed < e->execSeq)
        return cudaErrorNotReady; // not sticky, as on a GPU
    }
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *data) {
  return enqueue(s, [fn, data] { fn(data); });
}

cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || (size_t)value > (227u << 10))
      return fail(cudaErrorInvalidValue,
                  "cudaFuncAttributeMaxDynamicSharedMemorySize " + std::to_string(value) +
                      " exceeds the H100's 227 KiB");
    std::lock_guard<std::mutex> g(launchMu);
    maxDynamicSmem[fn] = (size_t)value;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  CUstream_st *st = resolve(s);
  if (st == &legacyStream)
    return fail(cudaErrorStreamCaptureUnsupported, "capture of the legacy default stream");
  std::lock_guard<std::mutex> g(captureMu);
  if (st->capture)
    return fail(cudaErrorIllegalState, "cudaStreamBeginCapture on a capturing stream");
  st->capture = new Graph;
  st->capture->id = nextCaptureId++;
  liveCaptures[st->capture] = st->capture->id;
  st->capture->members.insert(st);
  st->origin = true;
  st->lastOp = 0;
  threadCapture = st->capture;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
  CUstream_st *st = resolve(s);
  std::unique_ptr<Graph> cap;
  std::string unjoined;
  {
    std::lock_guard<std::mutex> g(captureMu);
    if (!st->capture || !st->origin)
      return fail(cudaErrorIllegalState, "cudaStreamEndCapture on a stream not capturing");
    cap.reset(st->capture);
    liveCaptures.erase(cap.get());
    for (CUstream_st *m : cap->members) {
      if (m != st && m->lastOp > cap->joinedBack[m])
        unjoined = "a stream forked into the capture has work the origin stream never waited on";
      m->capture = nullptr;
      m->origin = false;
    }
    threadCapture = nullptr;
  }
  *graph = nullptr;
  if (!unjoined.empty())
    return fail(cudaErrorStreamCaptureUnjoined, unjoined);
  *graph = new CUgraph_st{std::move(cap->ops)};
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
  *status = streamCapturing(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->ops};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  for (auto &op : exec->ops)
    if (cudaError_t e = enqueue(s, op))
      return e;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t g) {
  delete g;
  return cudaSuccess;
}

} // extern "C"
