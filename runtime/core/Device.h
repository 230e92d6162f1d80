//===- Device.h - the device interface every backend implements -*- C++ -*-===//
//
// The seam between core (plan, validation, liveness, the step loop) and a
// backend (runtime/cpu/, later runtime/cuda/): core includes no backend
// header and drives a device only through this interface, in the spirit
// of IREE's HAL (one device interface, one driver per directory, one
// conformance suite run against every driver: test/unit/DeviceTest.cpp).
//
// A device owns
// - the arena: one allocation of the plan's arena_bytes in device memory.
//   Core computes buffer addresses (base + offset + shard * rank_stride) but
//   never dereferences them: host-side work (parameter init, checkpoints,
//   batches, the gradient check) goes through copyToDevice / copyToHost;
// - instruction execution: prepare() binds a validated plan, run(i)
//   enqueues instruction i of its program on the compute stream. Every
//   instruction passed checkInstruction (runtime/core/OpRules.h) at load,
//   so a device does not re-check shapes;
// - four streams and events: [Note: streams and events].
//
// [Note: streams and events]
// A stream is an in-order queue of device work; an event marks a point in
// one. The executor runs an async collective (fsdp-schedule's overlap) as
//   e = record(compute); wait(comm, e);        // its input is computed
//   enqueue(comm, collective); done = record(comm);
// and the plan's `wait` instruction as wait(compute, done): compute goes
// on until it needs the result, and the host blocks only at the end of
// the step (synchronize). A synchronous collective is the same with its
// wait right after it. Every collective goes through the one comm stream
// in program order, so the order across ranks is the plan's (the
// Communicator contract, Comm.h); the collectives a plan marks for the
// node stream go through a second one the same way ([Note: node comm
// stream]). An async copy between the arenas
// (activation offload) goes the same way on the copy stream, through
// runOn(copy, i): on a GPU the copy engines move it while the SMs compute
// and NCCL communicates, so a copy never waits behind a collective and a
// prefetching all-gather never waits behind a copy.
// The host stream runs the offloaded optimizer's host instructions marked
// async (fsdp-offload: each unit's update right after its gradient's
// to_host copy) in program order on a host thread, so the update overlaps
// the rest of the backward pass and its collectives:
//   e = record(compute); wait(host, e);         // its gradient copied
//   runOn(host, i, done);                       // the CPU kernel
// and the plan's `wait` on its first output is wait(compute, done): what
// compute enqueues after it (the copies of the new parameters back to the
// device) runs after the update. The memory plan keeps every operand of an
// async host update live until its wait.
// - CPU: the compute stream is the calling thread (run() executes at once,
//   so events on it are complete when recorded); the comm, node comm and
//   host streams are each a thread working through a queue (HostWorker.h); wait(compute,
//   e) blocks the caller, a wait between the two threads is a job blocking
//   the waiting one.
// - CPU: the copy stream is the compute stream: both arenas are host
//   memory, the copy a memcpy run in place (runOn).
// - CUDA: a compute stream, two high-priority comm streams (comm and node
//   comm) and a copy stream
//   (cudaMemcpyAsync between the arenas); events there
//   are cudaEvents, wait is cudaStreamWaitEvent, enqueue calls the
//   launcher at once from the host (NCCL enqueues on the stream it is
//   given: Stream::nativeHandle()). The host stream is a host thread; its
//   events are markers in its queue; wait(host, cudaEvent) is a job
//   polling the event (under the NCCL watchdog), wait(compute, marker)
//   blocks the caller until the host work is done.
// The swap-in and swap-out streams move offload-nvme's optimizer state
// between the swap file and the host arena's staging buffers ([Note: swap
// pipeline] in Executor.cpp): on every device each is a host thread of its
// own, like the host stream (its events markers, a wait between host
// threads a job blocking the waiting one), so a thread blocked in pread /
// pwrite holds neither the update nor the other direction.
//
// [Note: node comm stream]
// Hierarchical qgZ exchanges each unit's gradient in two hops: within the
// node (NVLink; shared memory on CPU ranks) and then across nodes (the
// network). On one comm stream unit k's node exchange queues behind unit
// k+1's cross-node exchange, though the two use different links. A plan
// marks the node group's collectives "stream": "node" (fsdp-schedule's
// node-comm-stream) and the executor runs them on nodeCommStream(), so
// the two hops of successive units travel at once. Each stream holds the
// collectives of its own groups in program order on every rank, and the
// only edges between streams are the plan's events (ready, wait), the
// same on every rank: no rank waits in one stream for a peer that waits
// in the other. On CUDA a host-staged collective is a host function, and
// CUDA may run host functions of different streams one at a time on one
// thread (a peer could then wait behind another peer's other stream):
// the executor keeps those on the comm stream.
// Errors are sticky per stream, as CUDA's are: work after a failure on
// the same stream is skipped, and the failure is returned by the wait on
// an event after it and by synchronize.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_DEVICE_H
#define FSDP_RUNTIME_CORE_DEVICE_H

#include "runtime/core/Dropout.h"
#include "runtime/core/Plan.h"
#include "runtime/core/Status.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fsdp {

class Communicator;

/// An in-order queue of device work ([Note: streams and events]).
class Stream {
public:
  virtual ~Stream() = default;
  /// The backend's own queue handle (a cudaStream_t on CUDA), for a
  /// communicator that enqueues its collectives on it (NCCL); null where
  /// work on the stream is host code (CPU).
  virtual void *nativeHandle() const { return nullptr; }
};

/// A point in a stream: complete once the work enqueued before it is.
class Event {
public:
  virtual ~Event() = default;
};

/// How the caller configures a device (fsdp-run's options).
struct DeviceOptions {
  int threads = 0;        ///< CPU compute threads (0: the library default)
  int64_t localRank = 0;  ///< which local accelerator (CUDA)
  bool allowTf32 = false; ///< CUDA: float32 GEMMs may use TF32 tensor cores
};

class Device {
public:
  /// The arena base is aligned to at least this (the memory planner's
  /// default alignment); the conformance suite checks it.
  static constexpr int64_t kArenaAlignment = 64;

  virtual ~Device() = default;
  /// "cpu", "cuda".
  virtual const char *name() const = 0;
  /// For the run's header: which device and what computes on it (the GPU
  /// and the versions and files of the CUDA libraries loaded; OpenBLAS's
  /// build and the kernel it chose).
  virtual std::string describe() const { return name(); }

  // --- memory -------------------------------------------------------------
  /// Allocates the arena (at least `bytes`, rounded up to the alignment;
  /// 0 is allowed) and, when `hostBytes` > 0, the host arena of an
  /// offloading plan in host memory the device can copy from and to at
  /// full speed (CUDA: pinned), addressed at offsets from
  /// hostArenaStart(bytes) on ([Note: two arenas] in Plan.h). Called once.
  virtual Status allocateArena(int64_t bytes, int64_t hostBytes) = 0;
  /// The address of offset `offset` of the runtime's offset range (device
  /// arena, then host arena): the device's or the host's memory.
  virtual uint8_t *address(int64_t offset) const { return arenaBase() + offset; }
  /// The size a device allocates for an arena of `bytes` (>= the
  /// alignment, rounded up to it), or an error for a second allocation or
  /// a negative size: the checks every allocateArena shares.
  static Status arenaSize(int64_t bytes, bool allocated, size_t &out);
  /// The arena's device address (null before allocateArena).
  virtual uint8_t *arenaBase() const = 0;
  /// Its size as allocated (>= the bytes asked for; the CPU device's one
  /// block also holds the host arena).
  virtual int64_t arenaBytes() const = 0;
  /// Host -> device, `bytes` at device address `dst`. Synchronous: returns
  /// when the host buffer may be reused and the data is visible to work
  /// enqueued after it. Called between steps, never in the hot loop.
  virtual Status copyToDevice(void *dst, const void *src, int64_t bytes) = 0;
  /// Device -> host, after all work enqueued before it.
  virtual Status copyToHost(void *dst, const void *src, int64_t bytes) = 0;
  /// Page-locks `bytes` of host memory at `p` that copyToHost will fill
  /// often (--async-save's staging image), so that those copies run at the
  /// link's rate instead of through a bounce buffer; unpinHost before it is
  /// freed. An error (nothing pinned) where the device's memory is host
  /// memory: there is nothing to gain.
  virtual Status pinHost(void *p, int64_t bytes) {
    (void)p, (void)bytes;
    return FSDP_ERROR(name(), ": host memory is this device's memory; nothing to pin");
  }
  virtual Status unpinHost(void *p) {
    (void)p;
    return FSDP_ERROR(name(), ": nothing was pinned");
  }
  /// Sets the `bytes / 4` words at device address `dst` to `word`,
  /// synchronously like copyToDevice (the arenas' sentinel before a run).
  virtual Status fillWords(void *dst, uint32_t word, int64_t bytes) = 0;

  // --- compute ------------------------------------------------------------
  /// Binds a validated plan and this rank's shard index (Plan::shardIndex)
  /// before the first run(); a device may precompute launch parameters.
  /// The plan outlives the device's use of it.
  virtual Status prepare(const Plan &plan, int64_t shardIndex) = 0;
  /// Enqueues compute instruction `index` of the plan's program on the
  /// compute stream (a virtual call per instruction, none per element).
  virtual Status run(int64_t index) = 0;
  /// Enqueues instruction `index`, an async copy between the arenas
  /// (fsdp-offload-activations' to_host / to_device marked async) on the
  /// copy stream, or an async host instruction (fsdp-offload's update) on
  /// the host stream, instead of the compute stream, after the executor
  /// made `stream` wait for compute; `done` completes when the instruction
  /// has (the plan's wait on its output joins it, as for a collective:
  /// [Note: streams and events]). It depends on compute only: a copy's
  /// input is an activation or an earlier copy's output, a host update's a
  /// to_host copy's output or host state, never a collective's.
  virtual Status runOn(Stream &stream, int64_t index, std::unique_ptr<Event> &done) = 0;
  /// True when run() implements compute op `op` (PlanSchema.h's names).
  virtual bool implementsOp(const std::string &op) const = 0;

  // --- streams and events: [Note: streams and events] ----------------------
  virtual Stream &computeStream() = 0;
  /// Collectives: one stream, so they run in program order.
  virtual Stream &commStream() = 0;
  /// The collectives a plan puts on the node stream (instruction attribute
  /// "stream": "node", hierarchical qgZ's node exchanges): a second comm
  /// stream, in program order too, beside the first ([Note: node comm
  /// stream]).
  virtual Stream &nodeCommStream() = 0;
  /// The offloaded optimizer's async host instructions, in program order,
  /// on a host thread: they overlap device compute and collectives.
  virtual Stream &hostStream() = 0;
  /// Activation offload's async copies between the arenas, in program
  /// order, beside compute and the collectives (CPU: the compute stream).
  virtual Stream &copyStream() = 0;
  /// offload-nvme's reads of optimizer state from the swap file into the
  /// host arena, and its writes back: host threads beside the host stream,
  /// so the next update's state comes in and the last one's goes out while
  /// the host stream runs this one ([Note: swap pipeline]).
  virtual Stream &swapInStream() = 0;
  virtual Stream &swapOutStream() = 0;
  /// Enqueues host-issued `work` on `stream`: it runs (CPU) or launches
  /// its device work (CUDA) after everything enqueued there before. Its
  /// failure is sticky on the stream.
  virtual void enqueue(Stream &stream, std::function<Status()> work) = 0;
  /// An event completing when everything enqueued on `stream` so far has.
  virtual std::unique_ptr<Event> record(Stream &stream) = 0;
  /// Work enqueued on `stream` after this runs after `event`. Returns the
  /// failure of `event`'s stream up to the event where the device knows
  /// it already (the CPU device does: it blocks; CUDA reports it at
  /// synchronize).
  virtual Status wait(Stream &stream, Event &event) = 0;
  /// Blocks the host until all streams are idle; their first failure
  /// (compute, comm, node comm, copy, host, swap-in, swap-out), after
  /// which the streams run work again.
  virtual Status synchronize() = 0;
  /// Blocks the host until compute, the collectives (both comm streams)
  /// and the copies are idle, leaving the host and swap streams' work
  /// running (host updates a plan joins in the next step); their
  /// failures, if any, come at the wait joining them or at synchronize().
  virtual Status synchronizeDevice() { return synchronize(); }

  /// The step's seed, number and data rank, and whether it trains: what a
  /// dropout instruction and a stochastic cast read (runtime/core/Dropout.h,
  /// StochasticRounding.h). Set by the executor before it runs, captures or
  /// replays a step or an evaluation; a device whose kernels read it from
  /// device memory (CUDA: a replayed graph) copies it there.
  virtual Status setDropoutContext(const DropoutContext &c) {
    dropoutCtx = c;
    return Status::ok();
  }
  const DropoutContext &dropoutContext() const { return dropoutCtx; }

  // --- whole-step capture: [Note: step capture] in Executor.cpp -------------
  /// True when the device can record a step's work once and replay it
  /// (CUDA graphs).
  virtual bool canCapture() const { return false; }
  /// True when run() only enqueues (CUDA): the host's clock then times a
  /// launch, not the work, so --trace times the compute stream with the
  /// stamps below (or, with --trace-sync or on a device without stamps,
  /// synchronizes after each instruction).
  virtual bool enqueuesAsync() const { return false; }
  /// From now on, work enqueued on the compute stream (and on the streams
  /// joining it through events) is recorded, not run.
  virtual Status beginCapture();
  /// Ends the recording; keeps it for replay() when `keep`, else drops it.
  virtual Status endCapture(bool keep);
  /// Enqueues the recorded step on the compute stream.
  virtual Status replay();

  // --- device-side timing: [Note: stamped trace] in Executor.cpp -----------
  /// True when the device can time its own compute stream (CUDA events).
  virtual bool stampsCompute() const { return false; }
  /// Enqueues timing stamp `k` (>= 0) on the compute stream: it completes,
  /// and takes the device's time, when the work enqueued before it has.
  /// Re-stamping k replaces the earlier one.
  virtual Status stampCompute(int64_t k);
  /// After synchronize(): the device time from stamp `a` to stamp `b`, in
  /// milliseconds (both stamped since the last synchronize).
  virtual Status stampGapMs(int64_t a, int64_t b, double &ms);

  // --- measurements ---------------------------------------------------------
  /// Device memory used outside the arena so far (CPU: the f32 scratch of
  /// bf16 instructions, [Note: bf16 storage, f32 compute]).
  virtual int64_t scratchHighWater() const { return 0; }
  /// Times this device's kernels and, over `comm`, its collectives; writes
  /// the profile fsdp-sim reads (fsdp-run --calibrate).
  virtual Status calibrate(Communicator &comm, nlohmann::json &profile);

private:
  DropoutContext dropoutCtx;
};

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_DEVICE_H
