//===- Plan.h - the plan file the compiler emits and the runtime runs -*- C++ -*-===//
//
// The runtime owns this format (see docs/PLAN_FORMAT.md) and versions it.
// A plan is one training step for one rank of an N-rank mesh: every buffer
// with its offset in a single arena, every parameter / optimizer-state
// tensor with its initializer and shard placement, and the ordered list of
// kernel and collective calls. The runtime makes no decisions of its own: it
// validates the plan, allocates the arena and executes the program.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_PLAN_H
#define FSDP_RUNTIME_CORE_PLAN_H

#include "runtime/core/PlanSchema.h"
#include "runtime/core/Status.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

/// Elements of a shape (1 for a scalar).
inline int64_t shapeNumel(const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

struct Buffer {
  int64_t id = 0;
  int64_t offset = 0; ///< bytes from the arena's start
  int64_t bytes = 0;  ///< numel * dtype size (padded sizes included)
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  BufferKind kind = BufferKind::Temp;
  /// Live range in program indices: written first at `first`, read last at
  /// `last`. Persistent buffers span the whole program (-1 .. size).
  int64_t first = 0, last = 0;
  bool persistent = false;
  /// A view inside buffer `aliasOf` (which owns the memory); -1 otherwise.
  int64_t aliasOf = -1;
  /// Shard views: the address is offset + shard index * rankStride (the
  /// shard index is the rank on a 1-D mesh; Plan::shardIndex).
  int64_t rankStride = 0;
  /// Nonzero (a shard view over the reshard group): the stride counts the
  /// shard index modulo rankPeriod, this rank's index in that group.
  int64_t rankPeriod = 0;
  /// In the host arena (plan "space": "host", fsdp-offload); `offset`
  /// counts from its start. See [Note: two arenas].
  bool host = false;
  /// Optimizer state, or with offload-nvme-params a unit's storage (and
  /// views of it), in the per-rank swap file (plan "space": "nvme",
  /// fsdp-offload's nvme); `offset` counts from the file's start. In
  /// neither arena: no instruction names it, the instructions that read
  /// it name a staging buffer (Instruction::swaps). [Note: swap file]
  bool nvme = false;
  /// A swap's staging buffer (named as such by an instruction's "swap";
  /// set when the plan is read). With nvme: see reservedBytes().
  bool swapStaging = false;
  std::string name;
  int64_t numel() const { return shapeNumel(shape); }
};

/// One parameter of the model (global view) and where its shard lives.
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  std::string init; ///< normal | uniform | zeros | ones
  double scale = 0;
  bool trainable = true;
  int64_t unit = 0;        ///< index into Plan::units
  int64_t flatOffset = 0;  ///< element offset inside the unit's flat buffer
  int64_t buffer = -1;     ///< the full parameter (unsharded plans)
  int64_t numel() const { return shapeNumel(shape); }
};

/// Optimizer state shadowing one parameter (same shape, zero-initialized).
struct State {
  std::string name;
  std::string param; ///< the parameter it shadows (unsharded plans), or
  std::string unit;  ///< the unit it shadows (sharded plans)
  std::string kind;
  int64_t buffer = -1;
};

/// An FSDP unit: parameters packed into one flat buffer, padded to a
/// multiple of the shard count (the world size on a 1-D mesh); rank r holds
/// [i * shardNumel, (i+1) * shardNumel) with i = Plan::shardIndex(r).
struct Unit {
  std::string name;
  int64_t flatNumel = 0;
  int64_t paddedNumel = 0;
  int64_t shardNumel = 0;
  bool sharded = false; ///< only the shard persists (ZeRO-3)
  bool frozen = false;
  bool offloaded = false; ///< storage and state in the host arena
  int64_t buffer = -1;  ///< persistent storage, or -1 (unsharded plans)
};

/// A step input or output and the role the runtime gives it.
struct Binding {
  std::string name;
  std::string role; ///< input | target | lr | step | loss | grad
  int64_t buffer = -1;
  std::string param;   ///< for role "grad": the parameter
  int64_t range = 0;   ///< integer inputs: values lie in [0, range)
};

/// A buffer in the swap file that an instruction reads through its
/// staging buffer in the host arena (attrs "swap": [file, staging, write]
/// or [file, staging, write, offset]); `write`: the instruction updates
/// it, so it is written back. A copy to the device of part of a unit's
/// storage on disk (offload-nvme-params) reads only the staging's bytes
/// from byte `offset` of the file buffer on (whole blocks), and names a
/// view of the staging.
struct Swap {
  int64_t file = -1, staging = -1;
  bool write = false;
  int64_t offset = 0;
};

/// One kernel or collective call.
struct Instruction {
  std::string op; ///< dialect op name without "fsdp." (e.g. "matmul")
  std::vector<int64_t> in, out;
  nlohmann::json attrs = nlohmann::json::object();
  std::vector<Swap> swaps; ///< attrs "swap", read by the loader
  /// attrs "swap_read_at": the earlier instruction after which the swaps'
  /// reads are issued (offload-nvme's read-ahead); -1: at this one.
  int64_t swapReadAt = -1;
};

/// Predicted per-rank memory, in bytes, as the compiler computed it.
struct MemoryReport {
  int64_t params = 0, grads = 0, state = 0, activations = 0, temps = 0,
          inputs = 0, comm = 0, peak = 0, peakLive = 0;
  /// The host arena (fsdp-offload): what it holds and its planned peak.
  int64_t hostParams = 0, hostState = 0, hostPeak = 0, hostPeakLive = 0;
};

/// Dynamic loss scaling (plan "loss_scale", f16 mixed precision): the
/// runtime's GradScaler. The step reads the scale (input role
/// "loss_scale") and returns the global squared norm of the scaled
/// gradients (output role "grad_sumsq"); inf/NaN means the step overflowed
/// and its updates were skipped. A plan that clips returns "grad_sumsq"
/// without loss scaling too (the squared norm fsdp-run reports).
struct LossScaling {
  bool enabled = false;
  double init = 65536.0, growthFactor = 2.0, backoffFactor = 0.5;
  int64_t growthInterval = 2000;
};

struct Plan {
  int version = 0;
  /// Plan "requires": the features it needs beyond its version, each one
  /// of kPlanFeatures (PlanSchema.h); empty when absent.
  std::vector<std::string> features;
  /// Whether it requires optimizer-state-4bit: its packed i8 state (the
  /// updates' `state_bits`) is 4-bit codes (runtime/core/Moments4.h).
  bool stateCodes4() const {
    for (const std::string &f : features)
      if (f == "optimizer-state-4bit")
        return true;
    return false;
  }
  std::string model;
  int64_t worldSize = 1;
  /// The device mesh, replicas x shards (== worldSize). A 1-D plan is
  /// 1 x worldSize. Rank r belongs to replica r / shards and holds shard
  /// r % shards: each group of `shards` consecutive ranks shards the
  /// model (FSDP inside), and the `replicas` ranks holding the same shard
  /// all-reduce its gradient (HSDP, docs/PLAN_FORMAT.md).
  int64_t meshReplicas = 1, meshShards = 1;
  /// The reshard-after-forward group (hpZ, fsdp-shard's
  /// reshard-after-forward=G): G consecutive ranks of one replica's shard
  /// group; 0 when the plan has none.
  int64_t meshReshard = 0;
  /// The node size L (mesh "node"; hierarchical qgZ, ZeRO++): each shard
  /// group of S ranks is S / L nodes of L consecutive ranks. Groups
  /// "node" (the L ranks of this rank's node) and "cross" (the S / L ranks
  /// of its shard group at its place on their nodes); 0 when the plan has
  /// none.
  int64_t meshNode = 0;
  int64_t stage = 0;
  int64_t arenaBytes = 0;
  /// The host arena's size (plan "host_arena_bytes"; 0 without offload).
  int64_t hostArenaBytes = 0;
  /// The swap file's size per rank (plan "nvme_bytes"; 0 without
  /// fsdp-offload's nvme).
  int64_t nvmeBytes = 0;
  /// Plan "swap_alignment" (0 when absent, as in plans from before it):
  /// every buffer in the swap file and every staging buffer starts at a
  /// multiple of it and reserves its bytes rounded up to it, so the swaps
  /// may move whole blocks (O_DIRECT). [Note: swap file]
  int64_t swapAlignment = 0;
  std::vector<Buffer> buffers;
  std::vector<Param> params;
  std::vector<State> states;
  std::vector<Unit> units;
  std::vector<Binding> inputs, outputs;
  std::vector<Instruction> program;
  MemoryReport memory;
  nlohmann::json options; ///< compiler options, echoed for the log
  LossScaling lossScaling;

  /// Which shard of every sharded unit rank `rank` holds.
  int64_t shardIndex(int64_t rank) const { return rank % meshShards; }
  /// Ranks in a collective's group: "world" (all), "shard" (the ranks
  /// sharding one replica), "replica" (the ranks holding one shard) or
  /// "reshard" (meshReshard consecutive ranks of a shard group; 0 without
  /// one), "node" (meshNode consecutive ranks of a shard group) or "cross"
  /// (the shards / meshNode ranks of a shard group at one place on their
  /// nodes; both 0 without a node size); 0 for an unknown name.
  int64_t groupSize(const std::string &group) const {
    return group == "world"     ? worldSize
           : group == "shard"   ? meshShards
           : group == "replica" ? meshReplicas
           : group == "reshard" ? meshReshard
           : group == "node"    ? meshNode
           : group == "cross"   ? (meshNode ? meshShards / meshNode : 0)
                                : 0;
  }
};

// [Note: swap file]
// With fsdp-offload's nvme (ZeRO-Infinity) the offloaded optimizer state
// lives in a file per rank (nvme_bytes; fsdp-run --nvme-dir), not in an
// arena. The compiler gives each host instruction reading such a state
// buffer a staging buffer in the host arena instead and lists the pairs
// in its "swap" attribute; the executor reads the file into the staging
// buffers before the instruction runs and writes the updated ones back
// after, on swap streams of their own ([Note: swap pipeline] in
// Executor.cpp), so an async update's I/O runs beside device compute as
// its arithmetic does, and beside the neighbouring units' updates.
// With offload-nvme-params a unit's storage (its master shard) is in the
// file too: its update swaps it like the state, and each copy of it (or
// of a view of it) to the device reads the whole blocks its bytes span
// into a staging buffer first, the copy reading a view of that; such a
// read has an offset into the file buffer (Swap::offset).
// Checkpoints and initialization reach the state through the file too
// (Executor::readBuffer / writeBuffer). With the plan's swap_alignment
// every swapped buffer and staging buffer has whole blocks of its own
// (reservedBytes), which the swaps move whole: with O_DIRECT where the
// file system allows ([Note: swap file I/O] in SwapFile.cpp).

// [Note: two arenas]
// A plan with optimizer offload has two arenas: the device arena
// (arena_bytes) and the host arena (host_arena_bytes), each planned on its
// own; a host buffer's offset counts from the host arena's start. The
// runtime addresses both through one offset range, the host arena
// following the device arena: bufferOffset() adds hostArenaStart() to a
// host buffer's offset, and Device::address() turns such an offset into a
// pointer (the CPU device allocates both in one block; the CUDA device
// maps the upper range to its pinned host allocation).

/// Where buffer `id` lies in the runtime's offset range (see [Note: two
/// arenas]), in bytes, for the rank holding shard `shard`
/// (Plan::shardIndex).
/// Where the host arena starts in that range: after a device arena of
/// `arenaBytes`, at the next multiple of kSwapAlignment (a page: the swap
/// file's direct transfers land on the host arena's blocks).
inline int64_t hostArenaStart(int64_t arenaBytes) {
  return (arenaBytes + kSwapAlignment - 1) / kSwapAlignment * kSwapAlignment;
}
inline int64_t bufferOffset(const Plan &plan, int64_t id, int64_t shard) {
  const Buffer &b = plan.buffers[id];
  return (b.host ? hostArenaStart(plan.arenaBytes) : 0) + b.offset +
         (b.rankPeriod ? shard % b.rankPeriod : shard) * b.rankStride;
}

/// The bytes buffer `b` of `plan` occupies: its own, but a buffer in the
/// swap file or a swap's staging buffer reserves them rounded up to the
/// plan's swap_alignment (the swaps move whole blocks).
inline int64_t reservedBytes(const Plan &plan, const Buffer &b) {
  const int64_t a = plan.swapAlignment;
  return a > 0 && (b.nvme || b.swapStaging) && b.aliasOf < 0 ? (b.bytes + a - 1) / a * a : b.bytes;
}

/// The buffer whose memory `id` uses: the buffer it aliases (validation
/// refuses chains), or itself.
inline int64_t storageRoot(const Plan &plan, int64_t id) {
  return plan.buffers[id].aliasOf >= 0 ? plan.buffers[id].aliasOf : id;
}

/// A copy between the two arenas: `to_host` (device -> host) or
/// `to_device` (host -> device).
inline bool isArenaCopy(const std::string &op) { return op == "to_host" || op == "to_device"; }
/// A host instruction: work on the host arena run by the host's kernel
/// (fsdp-offload's optimizer update), known by its first output in host
/// memory; neither a copy between the arenas nor a collective (validation
/// refuses a collective on host memory).
inline bool isHostInstruction(const Plan &plan, const Instruction &inst) {
  return !isCollectiveOp(inst.op) && !isArenaCopy(inst.op) && !inst.out.empty() &&
         plan.buffers[inst.out[0]].host;
}
/// A collective marked `"stream": "node"`: run on the node comm stream
/// ([Note: node comm stream] in Device.h).
inline bool onNodeCommStream(const Instruction &inst) {
  auto s = inst.attrs.find("stream");
  return isCollectiveOp(inst.op) && s != inst.attrs.end() && *s == "node";
}
/// Marked `"async": true`: run off the compute stream, joined by a wait.
inline bool isAsync(const Instruction &inst) { return inst.attrs.value("async", false); }
/// A wait marked `"carried": true` (fsdp-offload's next-step): it joins the
/// async host update that the previous step issued later in the program.
inline bool isCarried(const Instruction &inst) {
  return inst.op == "wait" && inst.attrs.value("carried", false);
}
/// A carried wait marked `"copy_stream": true`: the copy stream joins the
/// update (the async copy of its unit that follows), not compute.
inline bool isCopyStreamJoin(const Instruction &inst) {
  return isCarried(inst) && inst.attrs.value("copy_stream", false);
}

/// Parses and validates a plan. Rejects a wrong format, a newer version, a
/// truncated file, out-of-range buffer ids, buffers outside the arena, two
/// buffers whose memory and live ranges both overlap, and instructions whose
/// operand shapes do not fit their op.
Status loadPlan(const std::string &path, Plan &plan);
Status parsePlan(const std::string &text, Plan &plan);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_PLAN_H
