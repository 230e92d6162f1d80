//===- Executor.h - one rank running a plan ---------------------*- C++ -*-===//
//
// Owns the arena (one allocation of the plan's arena_bytes), initializes
// parameters and optimizer state, and runs the program instruction by
// instruction: compute ops through the CPU dispatch, collectives through
// the communicator. It also measures memory for real (see
// [Note: memory measurement] in Executor.cpp) so the compiler's prediction
// is checked, not echoed.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_EXECUTOR_H
#define FSDP_RUNTIME_CORE_EXECUTOR_H

#include "runtime/core/Comm.h"
#include "runtime/core/Plan.h"
#include "runtime/core/SafeTensors.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace fsdp {

/// One span of the measured timeline (fsdp-run --trace): an instruction on
/// the compute thread (track 0) or a collective on the communication
/// thread (track 1). Times are microseconds of the monotonic clock, which
/// all processes of one machine share.
struct TraceEvent {
  std::string name;
  int track = 0;
  int64_t step = 0, index = 0; ///< step and instruction number
  double startUs = 0, durUs = 0;
};

struct MemoryMeasurement {
  int64_t highWater = 0; ///< highest arena byte written, + 1
  int64_t peakLive = 0;  ///< largest sum of live buffer bytes, by the runtime's own liveness
};

class Executor {
public:
  Executor(const Plan &plan, Communicator &comm);
  ~Executor();

  /// Allocates the arena and initializes parameters (from `seed`) and state.
  Status init(uint64_t seed);

  /// Runs one step with learning rate `lr` (step is 1-based). The batch
  /// must already be in the input buffers.
  Status step(int64_t step, double lr, float &loss);

  uint8_t *address(int64_t bufferId) const;

  /// Every parameter, whole (sharded units are all-gathered): a collective,
  /// so every rank must call it.
  Status gatherParams(TensorMap &out);
  /// Loads whole parameters (each rank keeps its shard).
  Status loadParams(const TensorMap &in);
  /// Gradients published by a plan compiled with optimizer=none.
  Status gradOutputs(TensorMap &out) const;

  /// Reads / writes one element of a parameter in local storage (for the
  /// gradient check); false when this rank does not hold it.
  bool paramElement(const Param &p, int64_t i, float *&ptr) const;

  /// Records every instruction's span from now on (see TraceEvent).
  void setTracing(bool on) { tracing = on; }
  /// The spans recorded so far, both threads (call between steps).
  std::vector<TraceEvent> traceEvents();

  MemoryMeasurement measureMemory() const;
  /// Bytes this rank sent, over every group it collects in.
  int64_t commBytes() const;
  /// The shard of every sharded unit this rank holds.
  int64_t shardIndex() const { return plan.shardIndex(comm.rank()); }

private:
  Status runCollective(const Instruction &inst);
  /// Queues `job` on the communication thread.
  std::future<Status> submit(std::function<Status()> job);
  void commLoop();

  /// The communicator of a collective's group (see Plan::groupSize).
  Communicator &group(const std::string &name);

  const Plan &plan;
  Communicator &comm;
  /// On a 2-D mesh: the ranks sharding this rank's replica, and the ranks
  /// holding this rank's shard (null where the group is the whole world).
  std::unique_ptr<Communicator> shardComm, replicaComm;
  uint8_t *arena = nullptr;
  int64_t peakLive = 0;

  // [Note: the communication thread] in Executor.cpp.
  std::thread commThread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::packaged_task<Status()>> jobs;
  bool stopping = false;
  /// Async collectives in flight, by the buffer their wait names.
  std::map<int64_t, std::future<Status>> inFlight;

  bool tracing = false;
  std::vector<TraceEvent> computeEvents; ///< main thread only
  std::mutex traceMu;                    ///< guards commEvents
  std::vector<TraceEvent> commEvents;
  int64_t currentStep = 0, traceIndex = 0;
};

/// The learning rate of `step` (1-based) for the schedule: "constant" (with
/// linear warmup) or "cosine" (linear warmup, then cosine decay to minLr at
/// the last step).
double scheduledLr(const std::string &schedule, double lr, double minLr,
                   int64_t warmup, int64_t steps, int64_t step);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_EXECUTOR_H
