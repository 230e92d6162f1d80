//===- CostModel.h - predicted step time of a planned step ------*- C++ -*-===//
//
// The compiler's cost model: a device profile (compute roofline, kernel
// launch overhead, the links collectives use) and a two-stream simulation
// of @train_step in program order, the way fsdp-run executes the plan. It
// is the C++ twin of tools/fsdp-sim (same formulas, same constants, same
// profile JSON): fsdp-opt's `simulate=true` and fsdp-sim on the written
// plan print the same numbers (test/lit/e2e/budget.test checks it). The
// memory-budget search (fsdp-search-schedule) ranks candidate schedules by
// it.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_COSTMODEL_H
#define FSDP_PASSES_COSTMODEL_H

#include "passes/MemoryPlan.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/StringMap.h"

#include <string>
#include <vector>

namespace mlir::fsdp {

/// What a device costs. Built in: "h100" (published peaks); otherwise a
/// JSON written by `fsdp-run --calibrate`.
struct DeviceProfile {
  std::string name = "h100";
  bool cpu = false;
  /// A CPU profile's collectives ran through Gloo (link.backend "gloo", or
  /// absent: profiles from before the shared-memory communicator), whose
  /// reduce-scatter at a group size that is not a power of two is an
  /// all-reduce.
  bool glooLink = false;
  /// CPU profiles: cores of the machine and threads each rank runs. The
  /// ranks share the cores by processor sharing (predictStep).
  int64_t cores = 0, threadsPerRank = 0;
  double gemmFlopsPerS = 67e12;     ///< f32 GEMM (no tensor cores)
  double gemmFlopsPerSBf16 = 989e12; ///< bf16/f16 GEMM (dense)
  double memBytesPerS = 3.35e12;
  double opOverheadS = 5e-6; ///< per kernel launch
  /// fsdp-offload: host <-> device copies (PCIe Gen5 x16, 64 GB/s per
  /// direction) and the host's memory bandwidth for the offloaded update
  /// (a DGX H100 socket's 8 DDR5-4800 channels, 307 GB/s, shared by its 4
  /// GPUs' ranks). 0 (a profile that leaves them out: a CPU, where both
  /// arenas are host memory): copies and host instructions are compute
  /// like any other.
  double hostLinkBytesPerS = 64e9, hostMemBytesPerS = 307e9 / 4;
  /// fsdp-offload's nvme: the swap file's read and write rates for one
  /// rank (one PCIe Gen4 NVMe drive a GPU, as a DGX H100's eight; also the
  /// default of a profile that leaves them out: fsdp-run --calibrate
  /// measures them only with --nvme-dir). An update's swaps are read
  /// before it and the updated state written after it, in its own host
  /// work.
  double nvmeReadBytesPerS = 6.5e9, nvmeWriteBytesPerS = 3.5e9;
  /// The fraction of its rate above that each swap stream keeps while the
  /// other one also moves data (the drive serves a read and a write at
  /// once). 0.5 each (the default; a profile without them): the two share
  /// the drive half and half, its busy time the sum of both alone.
  /// fsdp-run --calibrate --nvme-dir measures them (a read and a write at
  /// once); a share above 0.5 makes the drive do more together than
  /// alone, as a disk with separate read and write queues does.
  double nvmeDuplexReadShare = 0.5, nvmeDuplexWriteShare = 0.5;
  /// Measured seconds per work unit of an op (calibrated CPU profiles).
  llvm::StringMap<double> secondsPerUnit;
  /// The cache model (calibrated CPU profiles; [Note: the cache model] in
  /// CostModel.cpp): the fraction of a GEMM operand that misses the cache
  /// at each reuse distance (bytes, increasing), and the rate at which a
  /// GEMM streams what missed. Empty / 0: no cache model (h100).
  std::vector<double> cacheCurveBytes, cacheCurveCold;
  double gemmColdBytesPerS = 0;
  /// Ranks that share the intra-node link (NVLink); a collective whose
  /// group spans more ranks runs at the inter-node link's cost. 0: every
  /// rank is on one node.
  int64_t ranksPerNode = 8;
  double alphaS = 10e-6, betaSPerByte = 1.0 / 450e9;            ///< NVLink
  double interAlphaS = 10e-6, interBetaSPerByte = 1.0 / 50e9; ///< IB 400 Gb/s
  /// link.two_level (a profile calibrated over `--comm hybrid`): a
  /// collective over a group whose ranks sit L to a node on M nodes runs
  /// in two levels ([Note: hybrid collectives] in HybridComm.cpp): within
  /// each node on the node link, and between nodes among the M ranks of
  /// each place on the inter-node link, 1/L of the buffer each. False: a
  /// group that crosses nodes is one ring on the inter-node link.
  bool twoLevel = false;
  /// The inter-node level of a two-level profile is Gloo's (its
  /// reduce-scatter rule, as glooLink).
  bool interGlooLink = false;
};

/// `h100`, or the path of a profile JSON. On failure returns false and
/// sets `error`.
bool loadDeviceProfile(llvm::StringRef nameOrPath, DeviceProfile &profile,
                       std::string &error);

/// One rank's predicted step.
struct StepPrediction {
  double stepS = 0, computeS = 0, commS = 0, exposedS = 0;
  /// fsdp-offload's async host updates: their time on the host stream, and
  /// the time compute waited for them (at their joins, or at the wait of a
  /// copy held behind a copy-stream join until its update ended).
  double hostS = 0, hostExposedS = 0;
  /// fsdp-offload-activations' async copies between the arenas on a GPU:
  /// their time on the copy stream, and the time compute waited for them
  /// beyond the host part above (a CPU device copies in place: compute
  /// time there).
  double copyS = 0, copyExposedS = 0;
  /// offload-nvme's swaps of async updates: the drive's busy time reading
  /// state in and writing it back ([Note: swap pipeline]; compute's waits
  /// on a write count in hostExposedS).
  double swapS = 0;
  /// Of swapS, the time both swap streams moved data at once (each at its
  /// duplex share of its rate).
  double swapDuplexS = 0;
  double exposedPct() const { return stepS > 0 ? 100.0 * exposedS / stepS : 0; }
};

/// Simulates `step` (planned as `plan`) on two streams: compute runs the
/// instructions in order, each overhead + max(flops / gemm rate, bytes /
/// memory bandwidth); collectives run one at a time on the communication
/// stream (alpha-beta ring); compute stalls at a wait until its collective
/// is done. With a cache model a GEMM also streams its operands' cold
/// bytes. On a CPU profile the N ranks share the host's C cores: while
/// D = N (threads per rank [compute busy] + 1 [a collective in flight])
/// threads are runnable, each stream runs at min(1, C / D) of its speed
/// alone. Async host updates (fsdp-offload's overlap) run on a third
/// stream, one at a time, counted in D with as many threads as compute.
/// On a GPU profile async copies between the arenas (activation offload)
/// run on a fourth, the copy stream (the copy engines), one at a time,
/// beside the collectives; a CPU device copies in place on compute.
/// An async update that swaps (offload-nvme) reads its state on the
/// swap-in stream from when it is issued, runs on the host stream once the
/// read is done and writes back on the swap-out stream, which its wait
/// joins (the runtime's [Note: swap pipeline]); the two swap streams share
/// one drive: while both move data each runs at the profile's duplex share
/// of its rate (half and half by default).
/// Matches fsdp-sim's simulate() step for step.
StepPrediction predictStep(ModuleOp module, func::FuncOp step,
                           const MemoryPlan &plan, const DeviceProfile &profile);

/// Where a group's ranks sit: `nodes` nodes holding `perNode` of them
/// each, or (`uniform` false) unequal numbers on more than one node.
struct GroupSpan {
  int64_t nodes = 1, perNode = 1;
  bool uniform = true;
  bool crosses() const { return nodes > 1 || !uniform; }
};

/// The span of each group of `size` ranks of a `world` of nodes of
/// `perNode` consecutive ranks (0: one node): groups of consecutive ranks
/// tiling the world from rank 0 (`strided` false: shard and reshard
/// groups, the world), or every (world / size)-th rank (replica groups).
GroupSpan groupSpan(int64_t size, int64_t world, int64_t perNode, bool strided);
/// The same for groups of `size` ranks `stride` apart within runs of
/// size x stride consecutive ranks tiling the world (1: consecutive;
/// world / size: replica groups; a mesh node L within shard groups: the
/// "cross" groups of hierarchical qgZ).
GroupSpan groupSpanStrided(int64_t size, int64_t world, int64_t perNode, int64_t stride);

/// Seconds of one collective: `op` is all_gather / reduce_scatter /
/// all_reduce over `n` ranks moving `bytes` (the whole, unsharded buffer)
/// placed as `span` says: on one node, the node link; across nodes, one
/// ring on the inter-node link, or with a two-level profile, a level on
/// each link.
double collectiveSeconds(llvm::StringRef op, int64_t n, int64_t bytes, GroupSpan span,
                         const DeviceProfile &profile);

/// Parses "80GiB", "512MiB", "1.5GB", "1000000" (bytes) into bytes; false
/// when malformed, negative or zero.
bool parseByteSize(llvm::StringRef text, int64_t &bytes);

} // namespace mlir::fsdp

#endif // FSDP_PASSES_COSTMODEL_H
