//===- Executor.h - one rank running a plan ---------------------*- C++ -*-===//
//
// Drives a Device (Device.h): has it allocate the arena (one allocation of
// the plan's arena_bytes), initializes parameters and optimizer state
// through host copies, and runs the program instruction by instruction:
// compute ops on the device's compute stream, collectives through the
// communicator on its comm stream ([Note: streams and events]). It also measures memory for real
// (see [Note: memory measurement] in Executor.cpp) so the compiler's prediction is checked, not
// echoed.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_EXECUTOR_H
#define FSDP_RUNTIME_CORE_EXECUTOR_H

#include "runtime/core/Comm.h"
#include "runtime/core/Data.h"
#include "runtime/core/Device.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SafeTensors.h"
#include "runtime/core/SwapFile.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace fsdp {

/// One span of the measured timeline (fsdp-run --trace): an instruction on
/// the compute thread (track 0), a collective on the communication
/// thread (track 1), an async host update on the host stream (track 2,
/// fsdp-offload's overlap), or an update's reads from and writes to the
/// swap file (tracks 4 and 5, offload-nvme's [Note: swap pipeline]; track 3
/// is fsdp-sim's copy stream), or a collective on the node comm stream
/// (track 6, [Note: node comm stream] in Device.h). Times are microseconds
/// of the monotonic clock, which all processes of one machine share.
constexpr int kComputeTrack = 0, kCommTrack = 1, kHostTrack = 2, kSwapInTrack = 4,
              kSwapOutTrack = 5, kNodeCommTrack = 6;
struct TraceEvent {
  std::string name;
  int track = 0;
  int64_t step = 0, index = 0; ///< step and instruction number
  double startUs = 0, durUs = 0;
};

struct MemoryMeasurement {
  int64_t highWater = 0; ///< highest arena byte written, + 1
  int64_t peakLive = 0;  ///< largest sum of live buffer bytes, by the runtime's own liveness
  /// The same for the host arena (fsdp-offload; 0 without one).
  int64_t hostHighWater = 0, hostPeakLive = 0;
};

class Executor {
public:
  /// `device` is this rank's (one per process); it outlives the executor.
  Executor(const Plan &plan, Communicator &comm, Device &device);
  ~Executor();

  /// Allocates the arena and initializes parameters (from `seed`) and state.
  Status init(uint64_t seed);

  /// Writes this rank's batch for `step` into the input buffers (filled
  /// on the host, then copied to the device).
  Status fillInputs(DataSource &data, int64_t step);

  /// Runs one step with learning rate `lr` (step is 1-based). The batch
  /// must already be in the input buffers.
  Status step(int64_t step, double lr, float &loss);

  /// The loss of the batch in the input buffers without training on it
  /// ([Note: evaluation] in Executor.cpp): the step's program up to its
  /// last write of the loss, then the loss's own collectives (the
  /// average over ranks). Parameters and optimizer state are untouched,
  /// so training after an evaluation is bitwise training without one. A
  /// collective: every rank calls it.
  Status evaluate(float &loss);

  /// Dynamic loss scaling (Plan::lossScaling), PyTorch's GradScaler: the
  /// scale the next step seeds its backward pass with, overflow-free steps
  /// since the scale last changed, and the steps whose updates were
  /// skipped (the optimizer's step count is the applied ones). Identical
  /// on every rank: each step's overflow test reads the global norm.
  struct LossScaler {
    double scale = 1;
    int64_t growthTracker = 0;
    int64_t skippedSteps = 0;
    bool lastSkipped = false; ///< the last step overflowed (updates skipped)
  };
  const LossScaler &lossScaler() const { return scaler; }
  /// Whether the plan returns the squared gradient norm (clipping or loss
  /// scaling), and the last step's global gradient norm: of the unscaled
  /// gradients, before clipping (what clip_grad_norm_ returns), inf or NaN
  /// when they overflowed.
  bool hasGradNorm() const;
  double lastGradNorm() const { return gradNorm; }
  /// The scaler's checkpoint record, and its restore (validated).
  nlohmann::json lossScalerState() const;
  Status restoreLossScaler(const nlohmann::json &state);

  /// Joins the host updates the last step left running (a plan compiled
  /// with offload-next-step joins them in the next step): called before
  /// anything outside a step reads or writes what they touch (evaluation,
  /// parameters, checkpoints), and by the trainer after the last step.
  Status finishCarried();

  /// Where init() creates the swap file of a plan keeping optimizer state
  /// on disk (fsdp-offload's nvme, [Note: swap file]); such a plan fails
  /// init() without one.
  void setNvmeDir(std::string dir) { nvmeDir = std::move(dir); }
  /// How it is read and written (fsdp-run --nvme-io; [Note: swap file I/O]
  /// in SwapFile.cpp): Auto by default.
  void setNvmeIo(SwapIoMode mode) { nvmeIo = mode; }
  /// The swap file (null without one).
  const SwapFile *swapFile() const { return swap.get(); }

  /// Host copies of buffer `id` (its bytes, this rank's view).
  Status readBuffer(int64_t id, void *host) const;
  Status writeBuffer(int64_t id, const void *host);
  /// `n` bytes from byte `at` of buffer `id`, in its arena or the swap
  /// file (no settle: the caller's).
  Status readBytes(int64_t id, int64_t at, void *host, int64_t n) const;
  Status writeBytes(int64_t id, int64_t at, const void *host, int64_t n);

  /// Every parameter, whole (sharded units are all-gathered): a collective,
  /// so every rank must call it.
  Status gatherParams(TensorMap &out);
  /// The AdamW moments or SGD momentum buffer of every parameter, whole
  /// and widened to f32, as "<param>.exp_avg" / "<param>.exp_avg_sq" /
  /// "<param>.momentum_buffer" (--dump-dir of a plan with bf16 state: the
  /// oracle replays each update from them). A collective over the shard
  /// group where the state is sharded.
  Status gatherMoments(TensorMap &out);
  /// Loads whole parameters (each rank keeps its shard).
  Status loadParams(const TensorMap &in);
  /// Supplies elements [first, first + count) of parameter `p` (row-major
  /// positions in the whole tensor) as f32 into `out`.
  using ParamReader =
      std::function<Status(const Param &p, int64_t first, int64_t count, float *out)>;
  /// Elements per piece loadParams(ParamReader) asks for: 16 MiB of f32.
  static constexpr int64_t kLoadChunkElems = int64_t(4) << 20;
  /// Loads every parameter through `read`, asking only for the elements
  /// this rank stores (its slice of a sharded unit; all of an unsharded
  /// unit or of a parameter's own buffer), at most `chunk` elements at a
  /// time through one host buffer: host memory is bounded by the chunk,
  /// not by the model (fsdp-run --init-from, InitFrom.h). The caller
  /// checks names, shapes and dtypes first.
  Status loadParams(const ParamReader &read, int64_t chunk = kLoadChunkElems);
  /// Gradients published by a plan compiled with optimizer=none.
  Status gradOutputs(TensorMap &out) const;

  /// Element i of a parameter in local storage (for the gradient check):
  /// false when this rank does not hold it.
  bool holdsParamElement(const Param &p, int64_t i) const;
  Status getParamElement(const Param &p, int64_t i, float &value) const;
  Status setParamElement(const Param &p, int64_t i, float value);

  /// Records every instruction's span from now on (see TraceEvent). On an
  /// asynchronous device the compute spans are the device's own times
  /// ([Note: stamped trace] in Executor.cpp), or with `syncEach` (or a
  /// device without timing stamps) the host's around a synchronize after
  /// every instruction: each instruction alone, no overlap.
  void setTracing(bool on, bool syncEach = false) {
    tracing = on;
    traceSync = syncEach;
  }
  /// Runs the first step as usual, captures the second and replays the
  /// capture from then on ([Note: step capture] in Executor.cpp). An error
  /// where the device cannot capture or a collective runs host code.
  Status setStepCapture(bool on);
  /// The spans recorded so far, every track (call between steps; with
  /// carried host updates after finishCarried, or the last step's are
  /// missing).
  std::vector<TraceEvent> traceEvents();

  MemoryMeasurement measureMemory() const;
  /// Bytes this rank sent, over every group it collects in.
  int64_t commBytes() const;
  /// The shard of every sharded unit this rank holds.
  int64_t shardIndex() const { return plan.shardIndex(comm.rank()); }
  Device &device() { return dev; }

private:
  /// The device address of buffer `id`: never dereferenced on the host.
  uint8_t *address(int64_t bufferId) const;
  /// Where element i of `p` lives here: buffer and element index in it.
  bool paramLocation(const Param &p, int64_t i, int64_t &buffer, int64_t &elem) const;
  /// Issues what runs off the compute stream: a collective (comm stream),
  /// an async copy (copy stream), an async host instruction (host stream),
  /// or a wait joining one of them back.
  Status runOffCompute(const Instruction &inst);
  /// A copy between the arenas marked async (fsdp-offload-activations):
  /// run on the copy stream and waited for like a collective.
  static bool isAsyncCopy(const Instruction &inst) { return isArenaCopy(inst.op) && isAsync(inst); }
  /// A host instruction marked async (fsdp-offload's update): run on the
  /// host stream and waited for like a collective.
  static bool isAsyncHost(const Plan &plan, const Instruction &inst) {
    return isHostInstruction(plan, inst) && isAsync(inst);
  }

  /// The communicator of a collective's group (see Plan::groupSize).
  Communicator &group(const std::string &name);

  const Plan &plan;
  Communicator &comm;
  Device &dev;
  /// On a 2-D mesh: the ranks sharding this rank's replica, and the ranks
  /// holding this rank's shard (null where the group is the whole world).
  std::unique_ptr<Communicator> shardComm, replicaComm;
  /// reshard-after-forward=G: the G ranks gathering the parts kept after
  /// the forward pass ([Note: reshard group]); null without one.
  std::unique_ptr<Communicator> reshardComm;
  /// A node size L (mesh "node"): the L ranks of this rank's node and the
  /// shards / L ranks of its shard group at its place on their nodes
  /// ([Note: node groups]); null without one.
  std::unique_ptr<Communicator> nodeComm, crossComm;
  std::string nvmeDir;
  SwapIoMode nvmeIo = SwapIoMode::Auto;
  std::unique_ptr<SwapFile> swap;
  /// Host instruction `inst` on the host stream after `ready`, with its
  /// staging buffers read from the swap file before it and the updated
  /// ones written back after, on the swap streams ([Note: swap pipeline]);
  /// `done` completes with the last of them. With `span`, its times.
  Status runHostWithSwaps(const Instruction &inst, Event &ready, std::unique_ptr<Event> &done,
                          const std::shared_ptr<TraceEvent> &span);
  /// One swapping instruction's transfers, built once by prepareSwaps()
  /// (at init) and shared with the swap streams' work.
  struct SwapIo {
    struct Part {
      int64_t file, offset, bytes; ///< the state buffer, where it is in the file
      uint8_t *staging;
      bool write;
    };
    std::vector<Part> parts;
    bool writes = false;
  };
  void prepareSwaps();
  /// Instruction `index`'s reads of its swaps, as swap-in stream work after
  /// `ready` and the last writes of its state; `read` is their event.
  Status issueSwapReads(int64_t index, Event &ready, std::unique_ptr<Event> &read);
  /// Instruction `index`'s reads: those read ahead, or issued now after
  /// `ready`.
  Status swapReads(int64_t index, Event &ready, std::unique_ptr<Event> &read);
  /// A copy to the device of storage on disk (offload-nvme-params): its
  /// staging read first ([Note: parameters on disk]).
  Status runCopyWithSwaps(const Instruction &inst);
  /// The reads ahead issued after instruction i (swap_read_at == i).
  Status readAheadAfter(int64_t i);
  /// One direction's transfers of instruction `index`'s swaps.
  std::function<Status()> swapTransfer(int64_t index, bool write, bool traced);
  /// By instruction: the instructions whose reads are issued after it.
  std::vector<std::vector<int64_t>> readsAfter;
  /// By instruction: its reads issued ahead, not yet waited for.
  std::map<int64_t, std::unique_ptr<Event>> readAhead;
  /// By instruction: its swaps, null where it has none.
  std::vector<std::shared_ptr<const SwapIo>> swapIo;
  /// By state buffer: its last write back while it may be in flight (one
  /// event per writing instruction, shared by the buffers it wrote); the
  /// next read of it waits for it.
  std::map<int64_t, std::shared_ptr<Event>> lastSwapWrite;
  /// Per instruction: run by runOffCompute (a collective or wait, an
  /// async copy or a host instruction that is async or swaps), not by
  /// Device::run.
  std::vector<bool> offCompute;
  int64_t peakLive = 0, hostPeakLive = 0;

  /// Async collectives, copies and host updates in flight, by the buffer
  /// their wait names: the event on the comm or host stream that completes
  /// them.
  std::map<int64_t, std::unique_ptr<Event>> inFlight;
  /// The buffers of host updates the next step joins (carried waits:
  /// fsdp-offload's next-step), and whether the last step left any running.
  std::set<int64_t> carriedBufs;
  mutable bool carriedPending = false;
  /// Before host memory is read or written outside a step: the host
  /// updates the last step left running finish first.
  Status settle(int64_t id) const;

  bool tracing = false, traceSync = false;
  bool captureSteps = false; ///< setStepCapture
  bool captured = false;     ///< the device holds the step's capture
  int64_t stepsRun = 0;
  std::vector<TraceEvent> computeEvents; ///< main thread only
  std::mutex traceMu;                    ///< guards commEvents
  /// Spans recorded on other threads: collectives (track 1) and async host
  /// updates (track 2).
  std::vector<TraceEvent> commEvents;
  int64_t currentStep = 0, traceIndex = 0;
  uint64_t runSeed = 0; ///< init's seed: dropout masks are keyed by it
  LossScaler scaler;
  double gradNorm = 0;
};

/// A learning-rate schedule over a run of `steps` steps: linear warmup from
/// 0 over the first `warmup` steps to the peak `lr`, then
///   constant  lr;
///   cosine    minLr + (lr - minLr) (1 + cos(pi (t - W) / (steps - W))) / 2;
///   linear    minLr + (lr - minLr) (steps - t) / (steps - W)
///             (Hugging Face's get_linear_schedule_with_warmup, with a floor);
///   wsd       warmup-stable-decay: lr until the last `decaySteps` steps,
///             then minLr + (lr - minLr) (steps - t) / decaySteps.
/// Each decay reaches minLr at the last step.
struct LrSchedule {
  std::string kind = "constant"; ///< constant | cosine | linear | wsd
  double lr = 1e-3, minLr = 0;
  int64_t warmup = 0, steps = 1, decaySteps = 0;
  /// wsd's decay from lr to minLr over its decaySteps, with f the fraction
  /// of them done: linear (1 - f), cosine ((1 + cos(pi f)) / 2) or 1-sqrt
  /// (1 - sqrt(f), the cooldown of Hagele et al. 2024).
  std::string decayShape = "linear";
};

/// The schedule's kinds, for messages: "constant, cosine, linear or wsd".
std::string lrScheduleKinds();
bool isLrScheduleKind(const std::string &kind);
/// wsd's decay shapes, for messages: "linear, cosine or 1-sqrt".
std::string lrDecayShapes();
bool isLrDecayShape(const std::string &shape);

/// The learning rate of `step` (1-based; lr t / W during warmup, so the
/// first step does not run at 0).
double scheduledLr(const LrSchedule &s, int64_t step);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_EXECUTOR_H
