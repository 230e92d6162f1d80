//===- Comm.h - the communicator interface ----------------------*- C++ -*-===//
//
// Collectives the executor issues for the plan's all_reduce /
// reduce_scatter / all_gather instructions. The contract: every rank calls
// the same collectives in the same order (the plan is one program for all
// ranks, so this holds by construction). A failure (dead peer, timeout)
// comes back as a Status naming what happened, never as a hang.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_COMM_H
#define FSDP_RUNTIME_CORE_COMM_H

#include "runtime/core/Plan.h"
#include "runtime/core/Status.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

class Stream;

/// The reductions a plan names (an all_reduce / reduce_scatter's `reduce`).
enum class ReduceOp { Sum, Mean };

/// Parses "sum" / "mean"; false when unknown.
inline bool parseReduceOp(const std::string &s, ReduceOp &out) {
  if (s == "sum" || s == "mean") {
    out = s == "sum" ? ReduceOp::Sum : ReduceOp::Mean;
    return true;
  }
  return false;
}

class Communicator {
public:
  virtual ~Communicator() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  /// Which implementation moves the data ("gloo", "shm", "nccl", ...):
  /// recorded in a calibrated profile, whose cost model depends on it.
  virtual const char *backend() const { return "local"; }
  /// For the run's header: the backend, and the version and file of the
  /// library it loaded where it loaded one (NCCL).
  virtual std::string describe() const { return backend(); }
  // Buffers are device addresses of `count` / `shard` elements of `dtype`:
  // f32, or bf16 / f16 in mixed-precision plans. A backend sums narrow
  // floats as it can (Gloo: pairwise in f32, rounded to the dtype after
  // each step, like NCCL); an all-gather only moves bytes. `stream` is the
  // device stream the collective is ordered on (Device.h): a host
  // communicator (Gloo) runs on the calling thread, which the CPU device's
  // comm stream is, and ignores it; NCCL enqueues on its nativeHandle().
  // Null: the host, synchronously (host buffers).
  /// out = sum (or mean) over ranks of in; in == out is allowed.
  virtual Status allReduce(const void *in, void *out, int64_t count, DType dtype,
                           ReduceOp op, Stream *stream = nullptr) = 0;
  /// in: size() * shard elements; out: this rank's reduced shard.
  virtual Status reduceScatter(const void *in, void *out, int64_t shard,
                               DType dtype, ReduceOp op, Stream *stream = nullptr) = 0;
  /// in: shard elements; out: size() * shard elements in rank order.
  virtual Status allGather(const void *in, void *out, int64_t shard,
                           DType dtype, Stream *stream = nullptr) = 0;
  /// in and out: size() * chunk elements each (distinct buffers). Chunk j
  /// of `in` goes to rank j; chunk i of `out` is what rank i sent this
  /// rank (its own chunk copied). Moves bytes only, any dtype (i8: the
  /// quantized gradients of ZeRO++'s qgZ, fsdp.all_to_all).
  virtual Status allToAll(const void *in, void *out, int64_t chunk, DType dtype,
                          Stream *stream = nullptr) = 0;
  // Host-only helpers (options, checkpoints, calibration): host buffers.
  virtual Status broadcast(void *data, int64_t bytes, int64_t root) = 0;
  virtual Status barrier() = 0;
  /// True when its collectives on a device stream only enqueue device work
  /// there (NCCL), so a step capture records them ([Note: step capture]).
  virtual bool capturable() const { return false; }

  /// A communicator over `ranks` (ranks of this communicator, ascending,
  /// this rank among them): one axis of a 2-D mesh. Every rank of `ranks`
  /// calls it with the same `tag`, and every group is created by all its
  /// members before any of them issues a collective on it. A group of one
  /// rank needs no peers; larger groups need a backend that can connect
  /// them (this default cannot).
  virtual Status subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                          std::unique_ptr<Communicator> &out);

  /// A communicator that runs its collectives in two levels ([Note: hybrid
  /// collectives] in runtime/comm/HybridComm.cpp) returns its levels: this
  /// rank's node (`node`, `perNode` ranks) and its place among the nodes
  /// (`cross`, one rank a node), so that --calibrate can measure each link.
  /// False (the default): one level.
  virtual bool levels(Communicator *&node, Communicator *&cross, int64_t &perNode) {
    (void)node, (void)cross, (void)perNode;
    return false;
  }

  /// Bytes this rank sent, by the ring algorithms' volume of the
  /// collectives the plan asked for, whichever algorithm a backend runs:
  /// all-reduce 2 (N-1)/N x buffer, reduce-scatter, all-gather and
  /// all-to-all (N-1)/N x buffer. (Gloo's reduce-scatter at a world size that is not a power of
  /// two is an all-reduce and moves twice that; shared memory moves no bytes
  /// over a link at all.) The same figure on every backend, so that it
  /// checks the compiler's communication volume.
  int64_t bytesSent() const { return bytesSent_; }
  void resetCounters() { bytesSent_ = 0; }

protected:
  /// For subgroup(): `ranks` must be ranks of this communicator, ascending,
  /// this rank among them; `index` is this rank's place in the group.
  Status checkGroup(const std::vector<int64_t> &ranks, const std::string &tag,
                    int64_t &index) const;

  int64_t bytesSent_ = 0;
};

/// One rank, no peers: collectives are copies (mean over one = identity).
std::unique_ptr<Communicator> makeSingleProcessCommunicator();

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_COMM_H
