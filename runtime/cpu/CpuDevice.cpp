//===- CpuDevice.cpp - the CPU implementation of Device -------------------===//
//
// [Note: the CPU comm stream]
// The compute stream is the calling thread: run() executes the kernel
// before returning, so an event recorded on it is complete at once and
// waiting for it costs nothing. The comm stream is one thread that runs
// enqueued work in order; an event on it is a marker in its queue, set
// when the thread reaches it, carrying the stream's (sticky) status so far.
// wait(compute, e) blocks the caller on the marker; wait(comm, e) on a
// compute event is free (compute already reached it). The memory plan keeps
// an async collective's input and output alive until its wait, so the two
// threads never touch the same bytes.
// The node comm stream ([Note: node comm stream] in Device.h) and the host
// stream (the offloaded optimizer's async updates) are each another such
// thread, in the same way; a wait between two of these threads
// is a job on the waiting one that blocks on the other's marker. Its
// kernels are the compute stream's (cpu::runInstruction: the same bits),
// OpenMP regions started from a second thread; the kernels keep no shared
// mutable state but the widened scratch's high-water mark, an atomic.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/CpuDevice.h"

#include "runtime/core/HostWorker.h"

#include "runtime/cpu/Calibrate.h"
#include "runtime/cpu/Dispatch.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

extern "C" void openblas_set_num_threads(int);
extern "C" char *openblas_get_config(void);

namespace fsdp::cpu {

namespace {

class CpuStream final : public Stream {};

/// An event: complete (compute stream), or a marker's future on the comm
/// or host stream's thread.
class CpuEvent final : public Event {
public:
  std::shared_future<Status> done; ///< invalid: complete, ok
  const Stream *on = nullptr;      ///< the worker stream of the marker
};

class CpuDevice final : public Device {
public:
  explicit CpuDevice(const DeviceOptions &options) : threads(options.threads) {
    if (threads > 0) {
      omp_set_num_threads(threads);
      openblas_set_num_threads(threads);
    }
    // OpenMP's thread count is per thread: the host stream's kernels use
    // the compute stream's.
    int n = threads;
    hostWorker = std::make_unique<HostWorker>([n] {
      if (n > 0)
        omp_set_num_threads(n);
    });
  }
  ~CpuDevice() override {
    // Each joins once its queued work has run.
    swapOutWorker.reset();
    hostWorker.reset();
    swapInWorker.reset();
    nodeWorker.reset();
    worker.reset();
    std::free(arena);
  }

  const char *name() const override { return "cpu"; }
  std::string describe() const override {
    const char *blas = openblas_get_config(); // e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Zen ..."
    return std::string("cpu (") + (blas ? blas : "OpenBLAS") + ")";
  }

  Status allocateArena(int64_t bytes, int64_t hostBytes) override {
    size_t n;
    if (hostBytes < 0)
      return FSDP_ERROR("cannot allocate a host arena of ", hostBytes, " bytes");
    // Host memory either way: one block, the host arena at its start
    // offset ([Note: two arenas]).
    if (hostBytes > 0 && bytes >= 0)
      bytes = hostArenaStart(bytes) + hostBytes;
    FSDP_RETURN_IF_ERROR(arenaSize(bytes, arena != nullptr, n));
    // On a page, so the host arena's start (hostArenaStart: a multiple of
    // a page) is one too: the swap file's direct transfers need it.
    arena = static_cast<uint8_t *>(std::aligned_alloc(
        kSwapAlignment, (n + kSwapAlignment - 1) / kSwapAlignment * kSwapAlignment));
    if (!arena)
      return FSDP_ERROR("cannot allocate the arena of ", n, " bytes");
    size = (int64_t)n;
    return Status::ok();
  }
  uint8_t *arenaBase() const override { return arena; }
  int64_t arenaBytes() const override { return size; }

  Status copyToDevice(void *dst, const void *src, int64_t bytes) override {
    if (bytes > 0 && dst != src)
      std::memmove(dst, src, (size_t)bytes);
    return Status::ok();
  }
  Status copyToHost(void *dst, const void *src, int64_t bytes) override {
    if (bytes > 0 && dst != src)
      std::memmove(dst, src, (size_t)bytes);
    return Status::ok();
  }
  Status fillWords(void *dst, uint32_t word, int64_t bytes) override {
    std::fill_n(static_cast<uint32_t *>(dst), bytes / 4, word);
    return Status::ok();
  }

  Status prepare(const Plan &p, int64_t shard) override {
    plan = &p;
    shardIndex = shard;
    return Status::ok();
  }
  Status run(int64_t index) override {
    return runInstruction(*plan, plan->program[index], arena, shardIndex, dropoutContext());
  }
  Status runOn(Stream &stream, int64_t index, std::unique_ptr<Event> &done) override {
    if (index < 0 || index >= (int64_t)plan->program.size())
      return FSDP_ERROR("instruction #", index, " is not in the program");
    if (&stream == &host) {
      // The offloaded update on the host thread, overlapping what the
      // caller runs next; `done` is its marker.
      const Plan *p = plan;
      uint8_t *a = arena;
      int64_t shard = shardIndex;
      DropoutContext ctx = dropoutContext();
      hostWorker->pushWork([p, index, a, shard, ctx] {
        return runInstruction(*p, p->program[index], a, shard, ctx);
      });
      done = record(host);
      return Status::ok();
    }
    // The copy stream is the compute stream. Both arenas are host memory
    // here: the copy is a memcpy on the same memory bus as compute, so
    // there is nothing to overlap, and handing it to a worker thread would
    // cost thread handoffs per copy (its marker and the wait on it: the
    // small GPT's step took 3.1-4.2 ms so against 2.7 in place). It runs
    // at once on the caller, whose compute wrote its input already; `done`
    // is a compute event, complete.
    (void)stream;
    Status st = run(index);
    done = record(compute);
    return st;
  }
  bool implementsOp(const std::string &op) const override { return cpu::implementsOp(op); }

  Stream &computeStream() override { return compute; }
  Stream &commStream() override { return comm; }
  Stream &nodeCommStream() override { return nodeComm; }
  Stream &hostStream() override { return host; }
  /// Copies run in place on the caller (runOn): compute's.
  Stream &copyStream() override { return compute; }
  Stream &swapInStream() override { return swapIn; }
  Stream &swapOutStream() override { return swapOut; }

  void enqueue(Stream &stream, std::function<Status()> work) override {
    if (&stream == &compute) {
      // The calling thread is the compute stream.
      if (computeSticky)
        computeSticky = work();
      return;
    }
    workerOf(stream)->pushWork(std::move(work));
  }
  std::unique_ptr<Event> record(Stream &stream) override {
    auto e = std::make_unique<CpuEvent>();
    if (&stream != &compute) {
      e->done = workerOf(stream)->marker();
      e->on = &stream;
    }
    return e;
  }
  Status wait(Stream &stream, Event &event) override {
    auto &e = static_cast<CpuEvent &>(event);
    if (!e.done.valid())
      return computeSticky; // a compute event: already complete
    if (&stream == e.on)
      return Status::ok(); // ordered on its own stream anyway
    if (&stream == &compute)
      return e.done.get();
    // One worker stream waits for the other's marker: a job blocking it,
    // which fails it if the other had failed (an update does not run on
    // state its read did not bring, nor is it written back).
    workerOf(stream)->pushWork([f = e.done] { return f.get(); });
    return Status::ok();
  }
  Status synchronize() override {
    Status st = computeSticky;
    // The update waits for its reads, its writes for it: drained in that
    // order, nothing is queued behind a drained stream.
    for (HostWorker *w : {worker.get(), nodeWorker.get(), swapInWorker.get(), hostWorker.get(),
                          swapOutWorker.get()}) {
      Status wSt = w->drain();
      if (st)
        st = wSt;
    }
    computeSticky = Status::ok();
    return st;
  }
  Status synchronizeDevice() override {
    Status st = computeSticky;
    for (HostWorker *w : {worker.get(), nodeWorker.get()}) {
      Status wSt = w->drain();
      if (st)
        st = wSt;
    }
    computeSticky = Status::ok();
    return st;
  }

  int64_t scratchHighWater() const override { return widenedScratchHighWater(); }
  Status calibrate(Communicator &c, nlohmann::json &profile) override {
    return cpu::calibrate(c, threads > 0 ? threads : 0, profile);
  }

private:
  int threads = 0;
  uint8_t *arena = nullptr;
  int64_t size = 0;
  const Plan *plan = nullptr;
  int64_t shardIndex = 0;
  HostWorker *workerOf(Stream &stream) {
    return &stream == &host       ? hostWorker.get()
           : &stream == &swapIn   ? swapInWorker.get()
           : &stream == &swapOut  ? swapOutWorker.get()
           : &stream == &nodeComm ? nodeWorker.get()
                                  : worker.get();
  }

  CpuStream compute, comm, nodeComm, host, swapIn, swapOut;
  Status computeSticky;
  std::unique_ptr<HostWorker> worker = std::make_unique<HostWorker>(); ///< comm
  std::unique_ptr<HostWorker> nodeWorker = std::make_unique<HostWorker>(); ///< node comm
  std::unique_ptr<HostWorker> hostWorker;
  std::unique_ptr<HostWorker> swapInWorker = std::make_unique<HostWorker>();
  std::unique_ptr<HostWorker> swapOutWorker = std::make_unique<HostWorker>();
};

} // namespace

Status createCpuDevice(const DeviceOptions &options, std::unique_ptr<Device> &out) {
  out = std::make_unique<CpuDevice>(options);
  return Status::ok();
}

} // namespace fsdp::cpu
