//===- FlightRecorder.h - who a failed collective waited for ----*- C++ -*-===//
//
// A collective that times out tells a rank only that *someone* did not
// answer, and with ring and halving-doubling algorithms that someone is
// usually a neighbour that was itself waiting: the message used to blame
// rank 0 or 1 for a stall of rank 2. Like NCCL's Flight Recorder, every rank
// here numbers its collectives (#1, #2, ... in issue order, which is the
// same on every rank by the Communicator contract) and publishes through
// the rendezvous store where it stands: the last collective it entered and
// completed, a heartbeat, and whether it failed or finished. When a
// collective fails, the rank reads every peer's record twice, a few
// heartbeats apart, and names who did not arrive and who stopped
// responding. See [Note: progress records] in FlightRecorder.cpp.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_FLIGHTRECORDER_H
#define FSDP_RUNTIME_COMM_FLIGHTRECORDER_H

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include <thread>

namespace fsdp {

class TcpStore;
struct JobEnv;

/// One record per rank, written only by that rank. Implementations must
/// replace a record atomically (a reader sees the old or the new one) and
/// never block for long: the recorder reports through them precisely when
/// something is stuck.
class ProgressBoard {
public:
  /// Counters a board may share live with readers (the directory board maps
  /// them from a file): stored to on every collective, read by peers as
  /// they are, so a stalled rank is reported at the collective it really
  /// reached, not at its last heartbeat.
  struct Live {
    std::atomic<int64_t> entered{0}, completed{0};
    std::atomic<int32_t> kind{0}; ///< index into kCollectiveKinds
  };
  /// Live::kind indexes this: new kinds go at the end.
  static constexpr const char *kCollectiveKinds[] = {
      "none", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all"};

  virtual ~ProgressBoard() = default;
  /// This rank's live counters, or null when the board has none.
  virtual Live *live() { return nullptr; }
  /// A peer's live counters (null when unavailable).
  virtual const Live *peerLive(int64_t /*rank*/) { return nullptr; }
  /// Replaces this rank's record; false when the store is gone.
  virtual bool publish(const std::string &record) = 0;
  /// Reads `rank`'s record; false when it has none (yet) or the store is
  /// unreachable (then `error` says so).
  virtual bool read(int64_t rank, std::string &record, std::string &error) = 0;
};

/// Records as files `progress.<rank>` in the rendezvous directory (written
/// to a temporary name and renamed over the old one).
std::unique_ptr<ProgressBoard> makeDirectoryBoard(const std::string &dir,
                                                  int64_t rank);
/// Records as keys `fsdp-progress/<rank>` of the TCP store (own connection,
/// requests bounded by `ioTimeout`).
std::unique_ptr<ProgressBoard>
makeTcpStoreBoard(std::unique_ptr<TcpStore> store, int64_t rank);

class FlightRecorder;
/// The recorder of a job's world communicator (every backend's): records on
/// the job's directory store or its TCP store; null when
/// FSDP_FLIGHT_RECORDER=0.
/// Fields of /proc/<pid>/stat after the command name: [0] is the state
/// ("Z": a zombie), [19] the start time in clock ticks; empty when the
/// process is gone or /proc cannot say.
std::vector<std::string> procStat(int64_t pid);

std::unique_ptr<FlightRecorder> makeJobFlightRecorder(const JobEnv &job,
                                                      std::chrono::milliseconds timeout);

/// Sequence numbers, heartbeat and failure explanations for one rank.
class FlightRecorder {
public:
  /// `timeout` is the collective timeout: the heartbeat period is derived
  /// from it (timeout / 8, within [50 ms, 1 s]) so that a stalled rank is
  /// told apart from a live one well before anyone times out.
  FlightRecorder(int64_t rank, int64_t size,
                 std::unique_ptr<ProgressBoard> board,
                 std::chrono::milliseconds timeout);
  /// Publishes "finished" and stops the heartbeat.
  ~FlightRecorder();

  /// Called before each collective; returns its sequence number. Two
  /// relaxed atomic stores: the heartbeat thread does the publishing.
  int64_t enter(const char *kind);
  void complete(int64_t seq);

  /// After collective `seq` failed with `what` (Gloo's message): waits a few
  /// heartbeats, reads every rank's record, publishes this rank's failure
  /// and returns a sentence naming the ranks that did not arrive, e.g.
  /// "collective #96 (all_gather): rank 2 did not arrive: it is stopped
  /// (SIGSTOP, or suspended by a debugger), last seen after collective #95
  /// (all_gather); ranks 0,1,3 arrived".
  std::string explain(int64_t seq, const char *kind, const std::string &what);

  std::chrono::milliseconds heartbeatPeriod() const { return period; }

private:
  void heartbeatLoop();
  void publishNow();

  int64_t rank, size;
  std::unique_ptr<ProgressBoard> board;
  std::chrono::milliseconds timeout, period;
  std::string host;
  int64_t pid = 0;
  std::string startTime; ///< /proc/self/stat field 22: tells a reused pid apart

  std::atomic<int64_t> entered{0}, completed{0};
  std::atomic<const char *> kind{"none"};
  ProgressBoard::Live *live = nullptr; ///< the board's, when it shares them
  std::atomic<uint64_t> beat{0};
  /// steady_clock nanoseconds of the last heartbeat, and the longest gap
  /// between two heartbeats lately (this process stopped or starved).
  std::atomic<int64_t> lastBeatNs{0}, stallNs{0}, stallEndNs{0};

  std::mutex publishMu; ///< one writer at a time (heartbeat, failure, finish)
  std::string state = "running", note;

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread heartbeat;
};

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_FLIGHTRECORDER_H
