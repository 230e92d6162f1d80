//===- MemoryPlan.h - buffers, liveness and arena offsets -------*- C++ -*-===//
//
// The static memory plan of one training step, shared by the
// fsdp-plan-memory pass (which records it in the IR and reports it) and by
// convert-fsdp-to-plan (which writes it into the plan file), so both see
// exactly the same buffers.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_MEMORYPLAN_H
#define FSDP_PASSES_MEMORYPLAN_H

#include "dialects/fsdp/FsdpOps.h"

#include "runtime/core/PlanSchema.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/StringMap.h"

#include <string>
#include <vector>

namespace mlir::fsdp {

/// What a buffer holds (the plan's "kind"): the plan schema's enum, shared
/// with the runtime (runtime/core/PlanSchema.h).
using BufKind = ::fsdp::BufferKind;
constexpr int kNumBufKinds = ::fsdp::kNumBufferKinds;
llvm::StringRef bufKindName(BufKind k);

struct PlannedBuffer {
  std::string name; ///< symbol or a readable value name
  RankedTensorType type;
  BufKind kind = BufKind::Temp;
  bool persistent = false;
  int64_t bytes = 0;
  int64_t offset = 0;
  /// Live range in instruction indices (see MemoryPlan::instrIndex).
  int64_t first = 0, last = 0;
  /// An alias (a view) lives inside buffer `aliasOf` at byte `offset` from
  /// the arena start; the runtime adds rank * rankStride (shard views).
  int64_t aliasOf = -1;
  int64_t rankStride = 0;
  /// Nonzero: the stride counts shard index mod rankPeriod (a shard view
  /// over the reshard group), not the shard index.
  int64_t rankPeriod = 0;
  /// For a unit's storage: the unit index.
  int64_t unit = -1;
  /// In the host arena (fsdp-offload): offsets count from its start.
  bool host = false;
  /// Optimizer state in the swap file (fsdp-offload's nvme): `host` too
  /// (host ops read it), but its offset counts from the file's start and
  /// no arena holds it; each host instruction reading it reads a staging
  /// copy instead (MemoryPlan::swaps).
  bool nvme = false;
  /// Nonzero (the swap file's buffers and their staging buffers): the
  /// offset is a multiple of it and the bytes rounded up to it are
  /// reserved, for the runtime's whole-block transfers (kSwapAlignment).
  int64_t ioAlign = 0;
  /// The bytes this buffer reserves: `bytes`, rounded up to ioAlign.
  int64_t extent() const { return ioAlign ? (bytes + ioAlign - 1) / ioAlign * ioAlign : bytes; }
};

/// One state buffer a host instruction reads through the swap file
/// (fsdp-offload's nvme): the runtime reads `file` into `staging` right
/// before the instruction and, when the instruction writes it (`write`: an
/// update's in-place result), writes `staging` back right after, in the
/// same work item (on the host stream when the instruction is async).
struct PlannedSwap {
  int64_t file = -1, staging = -1;
  bool write = false;
  /// A copy to the device of part of `file` (nvme-params: a view of a
  /// unit's storage) reads only the whole blocks that part spans: from
  /// byte `offset` of `file` (a multiple of its ioAlign), the staging's
  /// bytes; the instruction names `view` (a view of `staging`) where it
  /// named `operand` (the view of `file`). Whole: offset 0, operand ==
  /// file, view == staging.
  int64_t offset = 0, operand = -1, view = -1;
};

struct PlannedUnit {
  std::string name;
  int64_t flatNumel = 0;
  int64_t paddedNumel = 0; ///< equals flatNumel without fsdp.unit ops
  int64_t shardNumel = 0;
  bool sharded = false;
  bool frozen = false;
  int64_t buffer = -1; ///< persistent storage (fsdp.unit), else -1
};

/// Where a parameter lives: its buffer, unit and element offset in the
/// unit's flat buffer.
struct PlannedParam {
  ParamOp op;
  int64_t buffer = -1;
  int64_t unit = 0;
  int64_t flatOffset = 0;
};

struct MemoryPlan {
  std::vector<PlannedBuffer> buffers;
  std::vector<PlannedUnit> units;
  std::vector<PlannedParam> params;
  llvm::StringMap<int64_t> symbolBuffer; ///< param/state symbol -> buffer
  llvm::DenseMap<Value, int64_t> valueBuffer;
  /// Instruction index of each op that becomes an instruction (ops that only
  /// alias storage, like fsdp.get_param, have none).
  llvm::DenseMap<Operation *, int64_t> instrIndex;
  int64_t numInstructions = 0;
  int64_t arenaBytes = 0;
  /// Buffers have their arena offsets (planMemory's `place`).
  bool placed = false;
  /// Largest sum of live buffer bytes at any instruction, and its breakdown
  /// by kind at that instruction.
  int64_t peakLive = 0;
  int64_t peakInstr = 0;
  /// The device's live bytes at each instruction (peakLive is their
  /// largest).
  std::vector<int64_t> liveBytes;
  int64_t peakByKind[kNumBufKinds] = {};
  /// Totals over the whole step, by kind (persistent ones are always live).
  int64_t totalByKind[kNumBufKinds] = {};
  /// The largest number of bytes of each kind live at once.
  int64_t maxLiveByKind[kNumBufKinds] = {};
  // Everything above counts device buffers only; the host arena
  // (fsdp-offload's master shards, optimizer state and the gradient shards
  // copied for the update) is planned the same way on its own.
  int64_t hostArenaBytes = 0;
  int64_t hostPeakLive = 0;
  int64_t hostTotalByKind[kNumBufKinds] = {};
  /// fsdp-offload's nvme: bytes of the per-rank swap file, and the swaps
  /// of each host instruction that reads state kept there.
  /// the file, the state and the parameters (nvme-params) in it
  int64_t nvmeBytes = 0, nvmeState = 0, nvmeParams = 0;
  /// The ioAlign of every swapped buffer and staging buffer (the plan's
  /// "swap_alignment"; 0 without the swap file).
  int64_t swapAlignment = 0;
  /// The host arena's persistent state (the rest of hostTotalByKind's
  /// state is staging) and the most staging bytes live at once.
  int64_t hostPersistentState = 0, hostStagingPeak = 0;
  llvm::DenseMap<Operation *, SmallVector<PlannedSwap>> swaps;
  /// fsdp-offload's nvme-read-ahead: the instruction after which each
  /// swapping instruction's reads are issued, earlier than it (absent: at
  /// the instruction, once compute reaches it); its staging buffers are
  /// live from there (the plan's "swap_read_at").
  llvm::DenseMap<Operation *, Operation *> swapReadAt;
  /// fsdp-offload's next-step: each carried `fsdp.wait` and the async host
  /// update it joins (found once per plan: carriedJoins).
  llvm::DenseMap<Operation *, Operation *> carried;
};

/// The symbol the storage read `v` (fsdp.get_param / get_state / get_unit)
/// names, or null when `v` is no such read.
FlatSymbolRefAttr storageRead(Value v);

/// The symbol the storage write `op` (fsdp.set_param / set_state /
/// set_unit) names, with the value it writes; a null symbol when `op` is
/// no such write.
std::pair<StringRef, Value> storageWrite(Operation *op);

/// fsdp-offload's next-step: each carried `fsdp.wait` of `step` and the
/// async host update it joins (the one writing back the unit the wait
/// reads), found in one walk of the step. Fails with a diagnostic naming
/// the unit when a carried wait joins no such update, or does not read a
/// unit.
FailureOr<llvm::DenseMap<Operation *, Operation *>> carriedJoins(func::FuncOp step);

/// Ops that become no instruction: reads of storage, in-place write-backs,
/// and fsdp.set_grad (an output binding).
bool isStorageAlias(Operation *op);

/// Plans `step` (the @train_step of `module`). Fails with a diagnostic when
/// the function is not a single straight-line block of fsdp ops.
/// With `place` false, buffers get no offsets and arenaBytes stays 0: the
/// liveness (peakLive, the breakdowns) costs a fraction of the placement,
/// and the budget search ranks candidates by it.
FailureOr<MemoryPlan> planMemory(ModuleOp module, func::FuncOp step,
                                 int64_t alignment, bool place = true);

/// The memory plan as an analysis: fsdp-plan-memory computes it (with the
/// alignment it records in the module attribute `fsdp.alignment`, 64 when
/// absent) and preserves it, so convert-fsdp-to-plan reads the same plan
/// without planning again; the budget search plans its candidates
/// directly with planMemory.
struct MemoryPlanAnalysis {
  explicit MemoryPlanAnalysis(Operation *op);
  /// Failure when the step cannot be planned (reported already).
  FailureOr<MemoryPlan> plan;
  int64_t alignment = 64;
};

/// "1.50 MiB" for reports.
std::string formatBytes(int64_t bytes);

} // namespace mlir::fsdp

#endif // FSDP_PASSES_MEMORYPLAN_H
