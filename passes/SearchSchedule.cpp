//===- SearchSchedule.cpp - the schedule chosen under a memory budget -----===//
//
// fsdp-search-schedule. Algorithm: the knobs are evaluated as a tree so
// that candidates share work: the step after fsdp-insert-optimizer is
// cloned once per unit grouping (fsdp-group-units), each grouping once per
// recompute policy (fsdp-recompute), each of those once per
// reshard-after-forward choice (fsdp-shard) and each of those once per
// prefetch depth (fsdp-schedule). Every leaf is planned by liveness only
// (planMemory without placement: peak live bytes, a lower bound of the
// arena) and predicted by the cost model (CostModel.h). Leaves whose peak
// live bytes fit the budget are sorted by predicted step time; the first
// whose placed arena also fits is taken, and its module body replaces the
// pass's. Nothing fits: the leaf with the smallest arena is the floor,
// reported with its breakdown.
//
//===----------------------------------------------------------------------===//

#include "passes/CostModel.h"
#include "passes/MemoryPlan.h"
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/Format.h"

#include "llvm/Support/raw_ostream.h"
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPSEARCHSCHEDULE
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct Choice {
  int64_t layersPerUnit = 1;
  std::string recompute = "none";
  /// reshard-after-forward: "true", "false" or a reshard group size G.
  std::string reshard = "true";
  int64_t depth = 1;
  /// recompute=unit: recompute only the first `units` units (-1: all).
  int64_t units = -1;
  /// reshard true or G: only the first `reshardUnits` units reshard (-1:
  /// all).
  int64_t reshardUnits = -1;
  /// fsdp-offload: "none", "optimizer" or "all".
  std::string offload = "none";
  /// fsdp-offload-activations: saved activations in host memory.
  bool activations = false;
  /// fsdp-offload's next-step: the host updates joined in the next step.
  bool nextStep = false;
  /// fsdp-offload's prefetch: its copies to the device on the copy stream.
  bool prefetch = false;
  /// fsdp-offload's prefetch-depth: with prefetch, the copies in flight.
  int64_t copiesInFlight = 1;
  /// fsdp-offload's nvme: the offloaded optimizer state in the swap file.
  bool nvme = false;
  /// fsdp-offload's nvme-in-flight: with nvme, the async updates in flight.
  int64_t nvmeInFlight = 2;
  /// fsdp-offload's nvme-read-ahead: with nvme, the updates each read runs ahead.
  int64_t nvmeReadAhead = 1;
  /// fsdp-offload's nvme-units: with nvme, the units keeping their state
  /// on disk, the first ones updated (-1: all).
  int64_t nvmeUnits = -1;
  /// fsdp-offload's nvme-params: with nvme, those units' master shards on
  /// disk too.
  bool nvmeParams = false;
  /// fsdp-schedule's backward-prefetch: with depth > 0, pre, post or none.
  std::string backward = "pre";
  /// fsdp-shard's reshard-after-backward: false keeps each unit's last
  /// gather of a micro-batch for the next one (gradient accumulation).
  bool reshardAfterBackward = true;
  /// fsdp-schedule's overlap-node-exchange (hierarchical qgZ, depth > 0):
  /// each unit's node all-to-all in flight behind the next unit's backward.
  bool overlapNode = true;
  /// fsdp-schedule's unit-prefetch-depth (with depth > 0): UNIT=D or
  /// UNIT=F/B entries, the units prefetched at their own depth.
  std::vector<std::string> unitDepths;

  std::string str() const {
    return "layers-per-unit=" + std::to_string(layersPerUnit) + " recompute=" + recompute +
           (units >= 0 ? " recompute-units=" + std::to_string(units) : "") +
           " reshard-after-forward=" + reshard +
           (reshardUnits >= 0 ? " reshard-units=" + std::to_string(reshardUnits) : "") +
           (reshardAfterBackward ? "" : " reshard-after-backward=false") +
           " prefetch-depth=" + std::to_string(depth) +
           (depth > 0 && !unitDepths.empty() ? " unit-prefetch-depth=" + llvm::join(unitDepths, ",")
                                             : "") +
           (depth > 0 && backward != "pre" ? " backward-prefetch=" + backward : "") +
           (overlapNode ? "" : " overlap-node-exchange=false") +
           (offload != "none" ? " offload=" + offload : "") +
           (activations ? " offload-activations=true" : "") +
           (nextStep ? " offload-next-step=true" : "") +
           (offload != "none" ? std::string(" offload-prefetch=") + (prefetch ? "true" : "false")
                              : "") +
           (prefetch ? " offload-prefetch-depth=" + std::to_string(copiesInFlight) : "") +
           (nvme ? " offload-nvme=true offload-nvme-in-flight=" + std::to_string(nvmeInFlight) +
                       " offload-nvme-read-ahead=" + std::to_string(nvmeReadAhead)
                 : "") +
           (nvme && nvmeUnits >= 0 ? " offload-nvme-units=" + std::to_string(nvmeUnits) : "") +
           (nvme && nvmeParams ? " offload-nvme-params=true" : "");
  }
};

struct Leaf {
  Choice choice;
  int64_t peakLive = 0;
  /// Peak live bytes of the host arena (offloaded candidates; else 0).
  int64_t hostPeakLive = 0;
  /// The units whose optimizer state is in the swap file (fsdp-offload's
  /// nvme; else 0).
  int64_t unitsOnDisk = 0;
  /// Gathered parameters' bytes live at the peak (liveness).
  int64_t peakGathered = 0;
  StepPrediction predicted;
};

/// The units whose state a module keeps on disk (fsdp-offload's nvme).
static int64_t unitsOnDisk(ModuleOp m) {
  llvm::StringSet<> units;
  for (StateOp s : m.getOps<StateOp>())
    if (s->hasAttr(kNvmeAttrName))
      units.insert(s.getParam());
  return int64_t(units.size());
}

struct SearchSchedulePass
    : mlir::fsdp::impl::FsdpSearchScheduleBase<SearchSchedulePass> {
  using Base::Base;

  void runOnOperation() override;

  /// Runs `pass` on `module`; false (diagnostics emitted) on failure.
  bool run(ModuleOp module, std::unique_ptr<Pass> pass) {
    PassManager pm(module->getContext(), ModuleOp::getOperationName(),
                   OpPassManager::Nesting::Explicit);
    pm.enableVerifier(false);
    pm.addPass(std::move(pass));
    return succeeded(pm.run(module));
  }

  OwningOpRef<ModuleOp> clone(ModuleOp m) {
    return OwningOpRef<ModuleOp>(cast<ModuleOp>(m->clone()));
  }

  // The four steps from the optimizer's output to a scheduled step; each
  // works on `m` in place.
  bool group(ModuleOp m, int64_t k) {
    FsdpGroupUnitsOptions g;
    g.policy = unitPolicy;
    g.minUnitNumel = minUnitNumel;
    g.layersPerUnit = k;
    return run(m, createFsdpGroupUnits(g));
  }
  bool recomputeStep(ModuleOp m, StringRef policy, int64_t units = -1) {
    if (policy == "none")
      return true;
    FsdpRecomputeOptions r;
    r.policy = policy.str();
    r.units = units;
    return run(m, createFsdpRecompute(r));
  }
  bool shard(ModuleOp m, StringRef reshard, int64_t units, StringRef off, bool rab) {
    FsdpShardOptions s;
    s.reshardAfterBackward = rab;
    s.worldSize = worldSize;
    s.stage = stage;
    s.reshardAfterForward = reshard.str();
    s.reshardUnits = units;
    s.mesh = mesh;
    s.offload = off.str();
    s.frozenStorage = frozenStorage;
    s.weightQuantization = weightQuantization;
    s.gradientQuantization = gradientQuantization;
    s.quantizationBlock = quantizationBlock;
    s.ranksPerNode = std::max<int64_t>(0, profile.ranksPerNode);
    return run(m, createFsdpShard(s));
  }
  bool schedule(ModuleOp m, const Choice &c) {
    if (!overlap)
      return true;
    FsdpScheduleOptions sched;
    sched.prefetch = c.depth > 0;
    sched.prefetchDepth = c.depth;
    if (c.depth > 0)
      sched.unitPrefetchDepth = c.unitDepths;
    sched.backwardPrefetch = c.backward;
    sched.overlapNodeExchange = c.overlapNode;
    sched.nodeCommStream = nodeCommStream;
    return run(m, createFsdpSchedule(sched));
  }
  /// The passes the pipeline runs after this one: fsdp-fuse-epilogues and,
  /// for an offloaded candidate, fsdp-offload-activations and fsdp-offload
  /// (its peak is the device's).
  bool finish(ModuleOp m, const Choice &c) {
    FsdpFuseEpiloguesOptions fuse;
    fuse.accumulate = fuseGradAccum;
    if (fuseEpilogues && !run(m, createFsdpFuseEpilogues(fuse)))
      return false;
    if (c.activations) {
      FsdpOffloadActivationsOptions oa;
      oa.overlap = overlap;
      if (!run(m, createFsdpOffloadActivations(oa)))
        return false;
    }
    if (c.offload == "none")
      return true;
    FsdpOffloadOptions o;
    o.mode = c.offload;
    o.overlap = overlap && offloadOverlap;
    o.prefetch = c.prefetch;
    o.nextStep = c.nextStep;
    o.nvme = c.nvme;
    o.nvmeInFlight = c.nvmeInFlight;
    o.nvmeReadAhead = c.nvmeReadAhead;
    // (pinned: at most the units this candidate's grouping has)
    int64_t trainable = 0;
    for (UnitOp u : m.getOps<UnitOp>())
      trainable += u.getSharded() && !u.getFrozen();
    o.nvmeUnits = c.nvmeUnits < 0 ? -1 : std::min(c.nvmeUnits, std::max<int64_t>(trainable, 1));
    o.nvmeParams = c.nvme && c.nvmeParams;
    o.prefetchDepth = c.copiesInFlight;
    o.warnings = false;
    return run(m, createFsdpOffload(o));
  }
  /// Units after grouping K layers per unit (marked units plus root).
  int64_t unitsOf(int64_t k) {
    llvm::StringSet<> marked;
    bool root = false;
    for (ParamOp p : getOperation().getOps<ParamOp>()) {
      if (p.getUnit())
        marked.insert(*p.getUnit());
      else
        root = true;
    }
    return (int64_t(marked.size()) + k - 1) / k + (root ? 1 : 0);
  }

  /// The leaf evaluated with choice `c`, if any.
  Leaf *find(const Choice &c) {
    auto same = [](const Choice &a, const Choice &b) {
      return a.layersPerUnit == b.layersPerUnit && a.recompute == b.recompute &&
             a.units == b.units && a.reshard == b.reshard && a.reshardUnits == b.reshardUnits &&
             a.depth == b.depth && a.offload == b.offload && a.activations == b.activations &&
             a.nextStep == b.nextStep && a.prefetch == b.prefetch &&
             a.copiesInFlight == b.copiesInFlight && a.nvme == b.nvme &&
             a.nvmeInFlight == b.nvmeInFlight && a.nvmeReadAhead == b.nvmeReadAhead &&
             a.nvmeUnits == b.nvmeUnits && a.nvmeParams == b.nvmeParams &&
             a.backward == b.backward && a.reshardAfterBackward == b.reshardAfterBackward &&
             a.overlapNode == b.overlapNode && a.unitDepths == b.unitDepths;
    };
    for (Leaf &l : leaves)
      if (same(l.choice, c))
        return &l;
    return nullptr;
  }

  /// Compiles, plans (liveness) and predicts one choice.
  bool evaluate(Leaf &leaf) {
    OwningOpRef<ModuleOp> m = build(leaf.choice);
    return m && measure(leaf, *m);
  }
  /// `leaf`'s liveness (unplaced), units on disk and predicted step, from
  /// its module `m`; the liveness plan into `out` if given.
  bool measure(Leaf &leaf, ModuleOp m, MemoryPlan *out = nullptr) {
    auto step = m.lookupSymbol<func::FuncOp>(kTrainStepName);
    FailureOr<MemoryPlan> plan = planMemory(m, step, 64, /*place=*/false);
    if (failed(plan))
      return false;
    leaf.peakLive = plan->peakLive;
    leaf.hostPeakLive = plan->hostPeakLive;
    leaf.unitsOnDisk = unitsOnDisk(m);
    leaf.peakGathered = plan->peakByKind[(int)BufKind::Comm];
    leaf.predicted = predictStep(m, step, *plan, profile);
    ++numCandidates;
    ++evaluated;
    if (out)
      *out = std::move(*plan);
    return true;
  }
  /// Its liveness fits both budgets (the device's, and the host's when
  /// given).
  bool fits(const Leaf &l) const {
    return l.peakLive <= budget && (hostBudget < 0 || l.hostPeakLive <= hostBudget);
  }
  DeviceProfile profile;
  int64_t evaluated = 0; ///< schedules compiled, planned and predicted

  // What runOnOperation's steps find, in its order: the budget and the
  // shard group (readOptions), each knob's values, searched or pinned
  // (chooseKnobValues), and the candidates evaluated (searchUniform,
  // walkPerUnit).
  int64_t budget = 0;
  int64_t hostBudget = -1;   ///< host-memory-budget in bytes; -1: none
  int64_t bestHostArena = 0; ///< the chosen schedule's host arena (pickByArena)
  int64_t shards = 1;
  SmallVector<int64_t> groupings, depths;
  SmallVector<std::string> recomputes, reshards, offloads;
  SmallVector<bool> activationChoices, nextStepChoices, prefetchChoices, nvmeChoices;
  SmallVector<bool> rabChoices; ///< reshard-after-backward's values
  SmallVector<bool> overlapNodeChoices; ///< overlap-node-exchange's values
  std::vector<Leaf> leaves;
  /// The host-memory tunings' tries that fit the device but not the host
  /// budget: not candidates, but failWithFloor's host floor counts them.
  std::vector<Leaf> hostUnfit;

  LogicalResult fail(const Twine &msg) {
    mlir::emitError(getOperation().getLoc()) << msg;
    return failure();
  }
  LogicalResult readOptions();
  LogicalResult chooseKnobValues();
  LogicalResult searchUniform();
  LogicalResult walkPerUnit();
  LogicalResult shallowPeak();
  LogicalResult walkUnitDepths(Leaf leaf, int64_t target);
  /// A placed plan's arenas fit both budgets.
  bool placedFits(const MemoryPlan &p) const {
    return p.arenaBytes <= budget && (hostBudget < 0 || p.hostArenaBytes <= hostBudget);
  }
  LogicalResult deepenPrefetch();
  LogicalResult tuneNvmeInFlight();
  LogicalResult tuneNvmeUnits();
  LogicalResult tuneNvmeParams();
  bool keepIfFits(Leaf leaf);
  LogicalResult deepenReadAhead();
  LogicalResult deepen(Leaf leaf, ArrayRef<int64_t> values,
                       llvm::function_ref<void(Choice &, int64_t)> set);
  std::vector<size_t> tunable(std::vector<size_t> ids, size_t n) const;
  LogicalResult pickByArena(Leaf *&best, OwningOpRef<ModuleOp> &bestModule, int64_t &bestArena);
  LogicalResult failWithFloor();
  void adopt(const Leaf &best, OwningOpRef<ModuleOp> bestModule, int64_t bestArena);

  /// The whole chain for one choice, on a clone of the pass's module.
  OwningOpRef<ModuleOp> build(const Choice &c) {
    OwningOpRef<ModuleOp> m = clone(getOperation());
    if (!group(*m, c.layersPerUnit) || !recomputeStep(*m, c.recompute, c.units) ||
        !shard(*m, c.reshard, c.reshardUnits, c.offload, c.reshardAfterBackward) ||
        !schedule(*m, c) || !finish(*m, c))
      return nullptr;
    return m;
  }
  /// build(c) into m, and its placed memory plan (the arena decides).
  FailureOr<MemoryPlan> buildPlaced(const Choice &c, OwningOpRef<ModuleOp> &m) {
    m = build(c);
    if (!m)
      return failure();
    auto step = m->lookupSymbol<func::FuncOp>(kTrainStepName);
    return planMemory(*m, step, 64);
  }
};

void printBreakdown(llvm::raw_ostream &os, const MemoryPlan &plan) {
  auto row = [&](StringRef name, BufKind k, bool peak) {
    int64_t v = peak ? plan.peakByKind[(int)k] : plan.totalByKind[(int)k];
    os << "\n    " << name << " " << formatBytes(v);
  };
  row("parameters", BufKind::Param, false);
  row("optimizer state", BufKind::State, false);
  row("inputs", BufKind::Input, false);
  row("gradients", BufKind::Grad, true);
  row("activations", BufKind::Activation, true);
  row("temporaries", BufKind::Temp, true);
  row("gathered parameters", BufKind::Comm, true);
  os << "\n    (peak live " << formatBytes(plan.peakLive) << " at instruction "
     << plan.peakInstr << " of " << plan.numInstructions << "; arena "
     << formatBytes(plan.arenaBytes) << ")";
}

void SearchSchedulePass::runOnOperation() {
  leaves.clear();
  hostUnfit.clear();
  if (failed(readOptions()) || failed(chooseKnobValues()) || failed(searchUniform()) ||
      failed(walkPerUnit()) || failed(shallowPeak()) || failed(deepenPrefetch()) ||
      failed(tuneNvmeInFlight()) || failed(tuneNvmeParams()) || failed(tuneNvmeUnits()) ||
      failed(deepenReadAhead()))
    return signalPassFailure();
  Leaf *best = nullptr;
  OwningOpRef<ModuleOp> bestModule;
  int64_t bestArena = 0;
  if (failed(pickByArena(best, bestModule, bestArena)))
    return signalPassFailure();
  if (!best) {
    (void)failWithFloor();
    return signalPassFailure();
  }
  adopt(*best, std::move(bestModule), bestArena);
}

/// The budget, the device profile and the shard group from the options,
/// each checked.
LogicalResult SearchSchedulePass::readOptions() {
  ModuleOp module = getOperation();
  if (!parseByteSize(memoryBudget, budget))
    return fail("memory-budget='" + memoryBudget +
                "' is not a positive size (bytes, or a number with KiB, MiB, "
                "GiB, TiB, KB, MB, GB, TB: memory-budget=80GiB)");
  if (!hostMemoryBudget.empty() && !parseByteSize(hostMemoryBudget, hostBudget))
    return fail("host-memory-budget='" + hostMemoryBudget +
                "' is not a positive size (bytes, or a number with KiB, MiB, GiB, "
                "TiB, KB, MB, GB, TB: host-memory-budget=512GiB)");
  std::string error;
  if (!loadDeviceProfile(deviceProfile, profile, error))
    return fail(error);
  if (ranksPerNode >= 0)
    profile.ranksPerNode = ranksPerNode;
  if (!recompute.empty() &&
      !llvm::is_contained({"none", "unit", "selective"}, recompute.getValue()))
    return fail("recompute='" + recompute +
                "': expected none, selective or unit");
  // The shard group's size (fsdp-shard checks the mesh itself).
  shards = worldSize;
  if (!mesh.empty()) {
    int64_t r = 0;
    if (StringRef(mesh).split('x').first.getAsInteger(10, r) || r < 1 ||
        worldSize % r)
      return fail("mesh='" + mesh + "': expected RxS with R*S = world-size");
    shards = worldSize / r;
  }
  int64_t pinnedGroup = 0;
  if (!reshardAfterForward.empty() && reshardAfterForward != "true" &&
      reshardAfterForward != "false" &&
      StringRef(reshardAfterForward).getAsInteger(10, pinnedGroup))
    return fail("reshard-after-forward='" + reshardAfterForward +
                "': expected true, false or a number of ranks");
  if (!getTrainStep(module, "fsdp-autodiff"))
    return failure();
  return success();
}

/// The knobs' values, searched or pinned.
LogicalResult SearchSchedulePass::chooseKnobValues() {
  groupings.assign({1, 2});
  if (layersPerUnit > 0 || unitPolicy != "layer")
    groupings.assign(1, std::max<int64_t>(1, layersPerUnit));
  else if (unitsOf(1) == unitsOf(2))
    groupings.assign(1, 1); // fewer than two marked layers: nothing to merge
  recomputes.assign({"none", "selective", "unit"});
  if (!recompute.empty())
    recomputes.assign(1, recompute);
  // Resharding after forward: not at all, to the shard group, or (hpZ) to
  // one node of the profile's link when that is a proper divisor of the
  // shard group: the backward's gathers then stay on the node's link.
  reshards.assign({"false", "true"});
  int64_t node = profile.ranksPerNode;
  if (node > 1 && node < shards && shards % node == 0)
    reshards.push_back(std::to_string(node));
  if (!reshardAfterForward.empty())
    reshards.assign(1, reshardAfterForward);
  else if (stage != 3)
    reshards.assign(1, "true"); // only stage 3 reshards
  // Keeping each unit's gather across micro-batches: only gradient
  // accumulation at stage 3 has the choice (fewer gathers, the units
  // gathered across each micro-batch boundary).
  if (!reshardAfterBackward.empty() && reshardAfterBackward != "true" &&
      reshardAfterBackward != "false")
    return fail("reshard-after-backward='" + reshardAfterBackward + "': expected true or false");
  rabChoices.assign({reshardAfterBackward != "false"});
  auto step = getTrainStep(getOperation(), "fsdp-autodiff");
  if (reshardAfterBackward.empty() && stage == 3 && step && step->hasAttr(kGradAccumAttrName))
    rabChoices.push_back(false);
  // Hierarchical qgZ's node exchange in flight behind the next unit's
  // backward holds its int8 buffers (about half the unit's f32 gradient
  // bytes) a unit longer: weighed where a candidate has node exchanges and
  // prefetch (searchUniform), unless pinned.
  if (!overlapNodeExchange.empty() && overlapNodeExchange != "true" &&
      overlapNodeExchange != "false")
    return fail("overlap-node-exchange='" + overlapNodeExchange + "': expected true or false");
  overlapNodeChoices.assign({overlapNodeExchange != "false"});
  if (overlapNodeExchange.empty())
    overlapNodeChoices.push_back(false);
  // Optimizer offload: pinned (none, optimizer, all) or searched (auto:
  // each; it saves the device 4 + 8 bytes per parameter shard and costs
  // host copies and a host update, which the cost model prices; `all`
  // also moves the frozen units' storage, so it is a candidate only when
  // the model has frozen parameters).
  if (offload != "none" && offload != "optimizer" && offload != "all" && offload != "auto")
    return fail("offload='" + offload + "': expected none, optimizer, all or auto");
  offloads.assign({offload == "auto" ? "none" : offload.getValue()});
  if (offload == "auto") {
    offloads.push_back("optimizer");
    if (llvm::any_of(getOperation().getOps<ParamOp>(), [](ParamOp p) { return p.getFrozen(); }))
      offloads.push_back("all");
  }
  // Activation offload: pinned or searched the same way (it frees the
  // saved activations between the passes and costs two copies of each,
  // overlapped with compute on the copy stream).
  if (offloadActivations != "false" && offloadActivations != "true" &&
      offloadActivations != "auto")
    return fail("offload-activations='" + offloadActivations +
                "': expected false, true or auto");
  activationChoices.assign({offloadActivations == "true"});
  if (offloadActivations == "auto")
    activationChoices.push_back(true);
  // Joining the host updates in the next step: pinned or weighed (auto).
  // Only an offloaded candidate whose updates are async has the choice;
  // it is exact and costs host memory only (each update's operands live
  // through the step), so a tie goes to the smaller host arena.
  if (offloadNextStep != "false" && offloadNextStep != "true" && offloadNextStep != "auto")
    return fail("offload-next-step='" + offloadNextStep + "': expected false, true or auto");
  nextStepChoices.assign({offloadNextStep == "true"});
  if (offloadNextStep == "auto" && overlap && offloadOverlap)
    nextStepChoices.push_back(true);
  // Prefetching the copies to the device: pinned or weighed (auto). It
  // costs one more copy's device memory; a tie (a CPU profile: the device
  // copies in place either way) goes to the smaller peak, the first leaf.
  if (offloadPrefetch != "false" && offloadPrefetch != "true" && offloadPrefetch != "auto")
    return fail("offload-prefetch='" + offloadPrefetch + "': expected false, true or auto");
  prefetchChoices.assign({offloadPrefetch == "true" && overlap});
  if (offloadPrefetch == "auto" && overlap)
    prefetchChoices.push_back(true);
  // The optimizer state on disk: pinned or weighed (auto). It only adds
  // the swaps to the host updates, so it wins where host-memory-budget
  // needs it, or where the host stream hides the swaps entirely (a tie
  // goes to the smaller host arena).
  if (offloadNvme != "false" && offloadNvme != "true" && offloadNvme != "auto")
    return fail("offload-nvme='" + offloadNvme + "': expected false, true or auto");
  if (offloadNvmeUnits >= 0 && offloadNvme == "false")
    return fail("offload-nvme-units=" + std::to_string(offloadNvmeUnits) +
                " keeps part of the optimizer state on disk: it needs offload-nvme=true or auto");
  if (offloadNvmeParams != "false" && offloadNvmeParams != "true" && offloadNvmeParams != "auto")
    return fail("offload-nvme-params='" + offloadNvmeParams + "': expected false, true or auto");
  if (offloadNvmeParams != "false" && offloadNvme == "false")
    return fail("offload-nvme-params puts the master shards on disk with the optimizer state: "
                "it needs offload-nvme=true or auto");
  nvmeChoices.assign({offloadNvme == "true"});
  if (offloadNvme == "auto")
    nvmeChoices.push_back(true);
  // A pinned unit-prefetch-depth names units: the grouping must be
  // pinned with it (merged layers are other units).
  if (!unitPrefetchDepth.empty() && groupings.size() > 1)
    return fail("unit-prefetch-depth names units, and the search tries 1 and 2 layers a "
                "unit: pin layers-per-unit with it");
  depths.assign({0, 1, 2});
  if (prefetchDepth >= 0)
    depths.assign(1, prefetchDepth);
  else if (!overlap)
    depths.assign(1, 0);
  // Where the backward gathers go: pinned, or pre at every depth and
  // post at depth 1 too (BACKWARD_POST: one unit's gathered parameters
  // fewer at the backward's peak than pre, more overlap than depth 0).
  if (!backwardPrefetch.empty() &&
      !llvm::is_contained({"pre", "post", "none"}, backwardPrefetch.getValue()))
    return fail("backward-prefetch='" + backwardPrefetch + "': expected pre, post or none");
  return success();
}

/// The tree: a clone per node, so each step runs once per distinct prefix.
LogicalResult SearchSchedulePass::searchUniform() {
  ModuleOp module = getOperation();
  for (int64_t k : groupings) {
    OwningOpRef<ModuleOp> grouped = clone(module);
    if (!group(*grouped, k))
      return failure();
    for (const std::string &rc : recomputes) {
      OwningOpRef<ModuleOp> recomputed = clone(*grouped);
      int64_t units = rc == "unit" ? int64_t(recomputeUnits) : -1;
      if (!recomputeStep(*recomputed, rc, units))
        return failure();
      for (const std::string &reshard : reshards)
        for (const std::string &off : offloads)
          for (bool rab : rabChoices) {
            OwningOpRef<ModuleOp> sharded = clone(*recomputed);
            int64_t rsUnits = reshard != "false" ? int64_t(reshardUnits) : -1;
            if (!shard(*sharded, reshard, rsUnits, off, rab))
              return failure();
            // Next-step is fsdp-offload's option: without offload one leaf.
            ArrayRef<bool> nextSteps =
                off == "none" ? ArrayRef<bool>(nextStepChoices).take_front() : nextStepChoices;
            ArrayRef<bool> prefetches =
                off == "none" ? ArrayRef<bool>(prefetchChoices).take_front() : prefetchChoices;
            ArrayRef<bool> nvmes =
                off == "none" ? ArrayRef<bool>(nvmeChoices).take_front() : nvmeChoices;
            // Only a candidate with node exchanges has the choice.
            bool hasNodeHops = false;
            sharded->walk([&](AllToAllOp a) { hasNodeHops |= isNodeExchange(a); });
            ArrayRef<bool> overlaps = hasNodeHops ? ArrayRef<bool>(overlapNodeChoices)
                                                  : ArrayRef<bool>(overlapNodeChoices).take_front();
            SmallVector<std::tuple<int64_t, std::string, bool>> schedules;
            for (int64_t depth : depths)
              for (bool ov : depth > 0 ? overlaps : overlaps.take_front()) {
                if (!backwardPrefetch.empty()) {
                  schedules.push_back({depth, backwardPrefetch, ov});
                  continue;
                }
                schedules.push_back({depth, "pre", ov});
                if (depth == 1)
                  schedules.push_back({depth, "post", ov});
              }
            for (auto &[depth, backward, ov] : schedules)
              for (bool acts : activationChoices)
                for (bool ns : nextSteps)
                  for (bool pf : prefetches)
                    for (bool nv : nvmes) {
                      // The state on disk with next-step, where either is
                      // weighed (auto), is dominated: every staging copy lives
                      // through the step, so the host arena is next-step's
                      // without the disk, plus the swaps (offload-nvme=true
                      // asks for the disk to save host memory; only a pinned
                      // offload-next-step=true gets the pair).
                      if (nv && ns && (nvmes.size() > 1 || nextSteps.size() > 1))
                        continue;
                      Leaf leaf;
                      leaf.choice = {k,
                                     rc,
                                     reshard,
                                     depth,
                                     units,
                                     rsUnits,
                                     off,
                                     acts,
                                     ns && off != "none",
                                     pf && off != "none",
                                     offloadPrefetchDepth >= 0 ? int64_t(offloadPrefetchDepth) : 1,
                                     nv && off != "none",
                                     offloadNvmeInFlight >= 0 ? int64_t(offloadNvmeInFlight) : 2,
                                     offloadNvmeReadAhead >= 0 ? int64_t(offloadNvmeReadAhead) : 1,
                                     nv && off != "none" ? int64_t(offloadNvmeUnits) : -1,
                                     nv && off != "none" && offloadNvmeParams == "true"};
                      leaf.choice.backward = backward;
                      leaf.choice.reshardAfterBackward = rab;
                      leaf.choice.overlapNode = ov;
                      if (depth > 0)
                        leaf.choice.unitDepths.assign(unitPrefetchDepth.begin(),
                                                      unitPrefetchDepth.end());
                      bool last = std::tie(depth, backward, ov) == schedules.back() &&
                                  acts == activationChoices.back() && ns == nextSteps.back() &&
                                  pf == prefetches.back() && nv == nvmes.back();
                      OwningOpRef<ModuleOp> m = last ? std::move(sharded) : clone(*sharded);
                      if (!schedule(*m, leaf.choice) || !finish(*m, leaf.choice))
                        return failure();
                      if (!measure(leaf, *m))
                        return failure();
                      leaves.push_back(std::move(leaf));
                    }
          }
    }
  }
  return success();
}

/// Per unit: recompute only the first K units, or reshard only the first
/// K units. Where the uniform choice that saves nothing (recompute=none,
/// reshard=false) does not fit and the one that saves on every unit
/// (recompute=unit; reshard true or G) does, with the other knobs equal,
/// the peak and the step are about linear in K: the best such
/// combination by that estimate is compiled at the estimated K and
/// walked to the smallest K that fits (a few steps), if it may beat the
LogicalResult SearchSchedulePass::walkPerUnit() {
  // best uniform schedule. Each of the two knobs gets one such walk.
  double bestUniform = std::numeric_limits<double>::infinity();
  for (Leaf &l : leaves)
    if (fits(l))
      bestUniform = std::min(bestUniform, l.predicted.stepS);
  struct Knob {
    bool searched;
    /// The uniform choice that saves nothing.
    std::function<bool(const Choice &)> isBase;
    /// The uniform choices that save on every unit, from a base one.
    std::function<SmallVector<Choice>(const Choice &)> partners;
    /// The K of a choice: only its first K units save (-1: all).
    std::function<int64_t &(Choice &)> unitsOf;
  };
  Knob knobs[] = {
      {recomputes.size() == 3 && recomputeUnits < 0,
       [](const Choice &c) { return c.recompute == "none"; },
       [](const Choice &c) {
         Choice u = c;
         u.recompute = "unit";
         return SmallVector<Choice>{u};
       },
       [](Choice &c) -> int64_t & { return c.units; }},
      {reshards.size() > 1 && reshardUnits < 0,
       [](const Choice &c) { return c.reshard == "false"; },
       [&](const Choice &c) {
         SmallVector<Choice> out;
         for (const std::string &r : reshards)
           if (r != "false") {
             Choice u = c;
             u.reshard = r;
             out.push_back(u);
           }
         return out;
       },
       [](Choice &c) -> int64_t & { return c.reshardUnits; }},
  };
  for (Knob &knob : knobs) {
    if (!knob.searched)
      continue;
    struct Estimate {
      Choice choice;
      double stepS;
    };
    // The best estimate for each backward-prefetch placement: the
    // interpolation cannot tell pre from post apart reliably (post's
    // smaller peak moves K, its lost overlap changes the slope), so each
    // is walked.
    std::map<std::string, Estimate> ests;
    size_t uniformLeaves = leaves.size();
    for (size_t i = 0; i < uniformLeaves; ++i) {
      Leaf &l = leaves[i];
      if (!knob.isBase(l.choice) || l.peakLive <= budget)
        continue;
      for (const Choice &pc : knob.partners(l.choice)) {
        Leaf *all = find(pc);
        if (!all || !fits(*all) || all->peakLive >= l.peakLive)
          continue;
        int64_t numUnits = unitsOf(l.choice.layersPerUnit);
        double f = double(l.peakLive - budget) / double(l.peakLive - all->peakLive);
        Choice c = pc;
        knob.unitsOf(c) = std::min<int64_t>(numUnits, std::ceil(f * numUnits));
        double t = l.predicted.stepS + f * (all->predicted.stepS - l.predicted.stepS);
        auto it = ests.find(c.backward);
        if (t < bestUniform && (it == ests.end() || t < it->second.stepS))
          ests.insert_or_assign(c.backward, Estimate{c, t});
      }
    }
    for (auto &[placement, est] : ests) {
      // Up while it does not fit, then down while it does: at most 4.
      // Every K that fits by liveness is kept: the arena (placement adds
      // fragmentation) may reject the smallest.
      Leaf leaf;
      leaf.choice = est.choice;
      std::optional<Leaf> fit;
      int64_t numUnits = unitsOf(leaf.choice.layersPerUnit);
      int64_t &k = knob.unitsOf(leaf.choice);
      for (int tries = 0; tries < 4 && k >= 0 && k <= numUnits; ++tries) {
        if (!evaluate(leaf))
          return failure();
        if (fits(leaf)) {
          fit = leaf;
          leaves.push_back(leaf);
          --k;
        } else if (fit) {
          break;
        } else {
          ++k;
        }
      }
    }
  }
  return success();
}

/// A unit's prefetch in one pass: the forward pass's gathers of `unit`,
/// or the backward pass's (its gradients' and recomputation's).
struct UnitPass {
  std::string unit;
  bool backward;
  std::string key() const { return unit + (backward ? "/b" : "/f"); }
};

/// The units' passes with a prefetched parameter all-gather in flight while
/// the device's live bytes exceed `budget` (between its issue and its
/// wait, by `plan`'s liveness), leaving out `skip` (UnitPass keys): the
/// prefetches the peak is made of.
static std::vector<UnitPass> prefetchesOverBudget(ModuleOp m, const MemoryPlan &plan,
                                                  int64_t budget, const llvm::StringSet<> &skip) {
  auto step = m.lookupSymbol<func::FuncOp>(kTrainStepName);
  Block &body = step.getBody().front();
  llvm::SmallPtrSet<Operation *, 16> backward = backwardGathers(body, stepLossOps(body));
  std::vector<UnitPass> out;
  llvm::StringSet<> seen;
  for (Operation &op : body) {
    GetUnitOp read = gatheredUnitRead(&op);
    if (!read)
      continue;
    UnitPass pass{read.getName().str(), backward.contains(&op)};
    if (skip.contains(pass.key()) || seen.contains(pass.key()))
      continue;
    auto issue = plan.instrIndex.find(&op);
    if (issue == plan.instrIndex.end())
      continue;
    bool over = false;
    for (Operation *user : op.getUsers()) {
      auto wait = plan.instrIndex.find(user);
      if (!isa<WaitOp>(user) || wait == plan.instrIndex.end())
        continue;
      for (int64_t i = issue->second;
           !over && i <= wait->second && i < int64_t(plan.liveBytes.size()); ++i)
        over = plan.liveBytes[i] > budget;
    }
    if (over) {
      seen.insert(pass.key());
      out.push_back(std::move(pass));
    }
  }
  return out;
}

/// Per-unit prefetch depth (fsdp-schedule's unit-prefetch-depth), unless
/// pinned or search-unit-prefetch=false. The walk (walkUnitDepths) starts
/// from a prefetching schedule (depth D, every unit) that would beat the
/// fastest schedule whose arena fits, but misses the budget:
/// - by its placed arena (it fits by liveness; fragmentation): the three
///   fastest such, the target lowered by what placement added;
/// - by liveness, over by less than D / (D + 1) of the gathered
///   parameters live at its peak (what one unit less deep can take off):
///   the three fastest such.
/// The units with a gather in flight while the live bytes exceed the
/// target get one less depth in that pass (forward or backward: a peak at
/// the backward's start keeps the forward's prefetch; a pass still in
/// flight there the next time one less again, to 0 at most) and the
/// schedule is planned again (its peak moves), at most four times, until
/// its arena fits (kept as a candidate) or no further unit is in flight
/// over the target. Every other unit and pass keeps depth D: the step
/// keeps D's overlap where memory allows it.
LogicalResult SearchSchedulePass::shallowPeak() {
  if (!unitPrefetchDepth.empty() || !searchUnitPrefetch)
    return success();
  auto byStep = [&](std::vector<size_t> &ids) {
    llvm::stable_sort(ids, [&](size_t a, size_t b) {
      return leaves[a].predicted.stepS < leaves[b].predicted.stepS;
    });
  };
  // Placed, the fastest schedules that fit by liveness (six at most): the
  // first whose arena fits is what pickByArena will choose (nothing less
  // deep beats it); each prefetching one before it (three at most) is over
  // the budget by its fragmentation, and is walked with that much more to
  // take off.
  std::vector<size_t> under, over;
  for (size_t i = 0; i < leaves.size(); ++i)
    (fits(leaves[i]) ? under : over).push_back(i);
  byStep(under);
  double bestPlaced = std::numeric_limits<double>::infinity();
  struct Start {
    size_t leaf;
    int64_t target; ///< the live bytes to bring its peak under
  };
  std::vector<Start> starts;
  for (size_t k = 0; k < under.size() && k < 6; ++k) {
    size_t i = under[k];
    OwningOpRef<ModuleOp> m;
    FailureOr<MemoryPlan> placed = buildPlaced(leaves[i].choice, m);
    if (failed(placed))
      return failure();
    if (placedFits(*placed)) {
      bestPlaced = leaves[i].predicted.stepS;
      break;
    }
    if (leaves[i].choice.depth > 0 && leaves[i].choice.unitDepths.empty())
      starts.push_back({i, budget - (placed->arenaBytes - placed->peakLive)});
    if (starts.size() >= 3)
      break;
  }
  // Over the budget by liveness: the three fastest that would beat the
  // best schedule that fits, over by less than what one unit less deep can
  // take off their peak (of the D + 1 units' gathered parameters there, at
  // most D).
  byStep(over);
  int found = 0;
  for (size_t i : over) {
    const Leaf &l = leaves[i];
    int64_t d = l.choice.depth;
    if (found >= 3 || l.predicted.stepS >= bestPlaced)
      break;
    if (d > 0 && l.choice.unitDepths.empty() && l.peakLive > budget &&
        (hostBudget < 0 || l.hostPeakLive <= hostBudget) &&
        (l.peakLive - budget) * (d + 1) < l.peakGathered * d) {
      starts.push_back({i, budget});
      ++found;
    }
  }
  for (const Start &start : starts)
    if (failed(walkUnitDepths(leaves[start.leaf], start.target)))
      return failure();
  return success();
}

/// shallowPeak's walk from `leaf` (a copy: leaves grows): the units'
/// passes in flight over `target` live bytes made one less deep (again
/// while still in flight there), at most four times; kept once its arena
/// fits. An arena over the budget lowers the target by its fragmentation.
LogicalResult SearchSchedulePass::walkUnitDepths(Leaf leaf, int64_t target) {
  llvm::StringSet<> shallow;                           // UnitPass keys down to depth 0
  std::vector<std::string> units;                      // in the order first made less deep
  llvm::StringMap<std::pair<int64_t, int64_t>> depths; // forward, backward
  int64_t d = leaf.choice.depth;
  OwningOpRef<ModuleOp> m = build(leaf.choice);
  MemoryPlan plan;
  if (!m || !measure(leaf, *m, &plan))
    return failure();
  for (int tries = 0; tries < 4; ++tries) {
    std::vector<UnitPass> passes = prefetchesOverBudget(*m, plan, target, shallow);
    if (passes.empty())
      break;
    for (const UnitPass &p : passes) {
      auto [it, added] = depths.try_emplace(p.unit, d, d);
      if (added)
        units.push_back(p.unit);
      // One less deep each time it is in flight over the target (from
      // depth 2 on, again while still in flight there); at 0 it is
      // gathered where read and never in flight before it is.
      int64_t &depth = p.backward ? it->second.second : it->second.first;
      if (--depth == 0)
        shallow.insert(p.key());
    }
    // UNIT=D where both passes are less deep, else UNIT=F/B.
    leaf.choice.unitDepths.clear();
    for (const std::string &u : units) {
      auto [f, b] = depths[u];
      leaf.choice.unitDepths.push_back(u + "=" + std::to_string(f) +
                                       (f == b ? "" : "/" + std::to_string(b)));
    }
    m = build(leaf.choice);
    if (!m || !measure(leaf, *m, &plan))
      return failure();
    if (!fits(leaf))
      continue;
    FailureOr<MemoryPlan> placed =
        planMemory(*m, m->lookupSymbol<func::FuncOp>(kTrainStepName), 64);
    if (failed(placed))
      return failure();
    if (placedFits(*placed)) {
      leaves.push_back(leaf);
      break;
    }
    target = std::min(target, budget - (placed->arenaBytes - placed->peakLive));
  }
  return success();
}

/// Copies in flight (fsdp-offload's prefetch-depth), unless pinned: each
/// of the fastest prefetching schedules that fit (three at most) is tried
/// again with 2, 3 and 4 copies in flight, and each that fits and beats
/// the fastest so far is kept. A deeper prefetch only costs device memory
/// (one more copy live) and only gains where the copy stream would stand
/// idle with copies left to make (behind a carried join, or beside compute
/// that outruns one copy ahead), so refining the winners is enough:
/// weighing it in every leaf would double the offloaded candidates.
LogicalResult SearchSchedulePass::deepenPrefetch() {
  if (offloadPrefetchDepth >= 0)
    return success();
  std::vector<size_t> order;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].choice.prefetch && fits(leaves[i]))
      order.push_back(i);
  llvm::stable_sort(order, [&](size_t a, size_t b) {
    return leaves[a].predicted.stepS < leaves[b].predicted.stepS;
  });
  order.resize(std::min<size_t>(order.size(), 3));
  for (size_t i : order)
    if (failed(deepen(leaves[i], {2, 3, 4}, [](Choice &c, int64_t d) { c.copiesInFlight = d; })))
      return failure();
  return success();
}

/// `leaf` tried again with each of `values` (deeper each) set by `set`:
/// each that fits and beats the fastest so far is kept; the first that
/// does not fit ends it (a deeper one holds more).
LogicalResult SearchSchedulePass::deepen(Leaf leaf, ArrayRef<int64_t> values,
                                         llvm::function_ref<void(Choice &, int64_t)> set) {
  double fastest = leaf.predicted.stepS;
  for (int64_t v : values) {
    set(leaf.choice, v);
    if (!evaluate(leaf))
      return failure();
    if (!fits(leaf))
      break;
    if (leaf.predicted.stepS < fastest) {
      fastest = leaf.predicted.stepS;
      leaves.push_back(leaf);
    }
  }
  return success();
}

/// Reads ahead with the state on disk (fsdp-offload's nvme-read-ahead),
/// unless pinned: each of such schedules that fit (the two fastest and the
/// two smallest host arenas: tunable) is tried again reading 1, 2, 4 and 8
/// updates ahead (those more than it has), and each that fits and beats
/// the fastest so far is kept.
/// Each more is one more update's staging in the host arena; it gains
/// where the drive would stand idle until compute reaches an update (the
/// forward pass: R reads run beside it).
LogicalResult SearchSchedulePass::deepenReadAhead() {
  if (offloadNvmeReadAhead >= 0)
    return success();
  std::vector<size_t> order;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].choice.nvme && fits(leaves[i]))
      order.push_back(i);
  for (size_t i : tunable(order, 4)) {
    SmallVector<int64_t, 4> deeper;
    for (int64_t r : {1, 2, 4, 8})
      if (r > leaves[i].choice.nvmeReadAhead)
        deeper.push_back(r);
    if (failed(deepen(leaves[i], deeper, [](Choice &c, int64_t r) { c.nvmeReadAhead = r; })))
      return failure();
  }
  return success();
}

/// Of the leaves `ids`, the ones the nvme tunings below start from: the
/// n/2 fastest, then the n/2 with the smallest host arenas (liveness) not
/// among them. The host arena is what those tunings trade: with the state
/// on disk the drive bounds the step, and a grouping predicted a little
/// faster (larger units) can be one whose host arena no tuning brings
/// under the budget, where a slightly slower one's can.
std::vector<size_t> SearchSchedulePass::tunable(std::vector<size_t> ids, size_t n) const {
  std::vector<size_t> byHost(ids);
  llvm::stable_sort(ids, [&](size_t a, size_t b) {
    return leaves[a].predicted.stepS < leaves[b].predicted.stepS;
  });
  llvm::stable_sort(
      byHost, [&](size_t a, size_t b) { return leaves[a].hostPeakLive < leaves[b].hostPeakLive; });
  std::vector<size_t> out(ids.begin(), ids.begin() + std::min(ids.size(), n / 2));
  for (size_t i : byHost) {
    if (out.size() >= std::min(n, ids.size()))
      break;
    if (!llvm::is_contained(out, i))
      out.push_back(i);
  }
  return out;
}

/// Updates in flight with the state on disk (fsdp-offload's
/// nvme-in-flight), unless pinned. The candidates have 2: one unit's state
/// read while the previous unit's update runs, and one read ahead. Such
/// candidates that fit the device but not host-memory-budget (the fastest
/// and the smallest host arenas: tunable) are tried with 1 and no read
/// ahead (nvme-read-ahead=0; each unpinned: two updates' staging and one
/// gradient copy less in the host arena, the drive idle during each update
/// and until compute reaches it) and kept where that fits. (More than 2 is not
/// tried: with the drive shared by reads and writes it bounds the step
/// already at 2 in every model priced so far, docs/BENCHMARKS.md.)
LogicalResult SearchSchedulePass::tuneNvmeInFlight() {
  if (offloadNvmeInFlight >= 0 && offloadNvmeReadAhead >= 0)
    return success();
  std::vector<size_t> tight;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].choice.nvme && !fits(leaves[i]) && leaves[i].peakLive <= budget)
      tight.push_back(i);
  // Eight tried at most (on a large model each is a whole compile): the
  // four fastest and the four smallest host arenas.
  for (size_t t : tunable(tight, 8)) {
    Leaf leaf = leaves[t];
    if (offloadNvmeInFlight < 0)
      leaf.choice.nvmeInFlight = 1;
    if (offloadNvmeReadAhead < 0)
      leaf.choice.nvmeReadAhead = 0;
    if (!keepIfFits(leaf))
      return failure();
  }
  return success();
}

/// A host-memory tuning's try: evaluated, kept as a candidate where it
/// fits, else remembered for the host floor where it fits the device.
/// False when it cannot be evaluated.
bool SearchSchedulePass::keepIfFits(Leaf leaf) {
  if (!evaluate(leaf))
    return false;
  if (fits(leaf))
    leaves.push_back(std::move(leaf));
  else if (leaf.peakLive <= budget)
    hostUnfit.push_back(std::move(leaf));
  return true;
}

/// The master shards on disk too (fsdp-offload's nvme-params), where
/// offload-nvme-params=auto and host-memory-budget: the candidates with
/// the state on disk that fit the device but not the host budget (the
/// fastest and the smallest host arenas: tunable) are tried with their
/// shards on disk too, as they are and (unless pinned) with one update in
/// flight and no read ahead, and kept where that fits: the host arena loses the shards
/// for the staging of the copies and updates in flight, the drive reads
/// every unit at every use. tuneNvmeUnits then brings back to host memory
/// the units that fit there.
LogicalResult SearchSchedulePass::tuneNvmeParams() {
  if (offloadNvmeParams != "auto" || hostBudget < 0)
    return success();
  std::vector<size_t> tight;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].choice.nvme && !leaves[i].choice.nvmeParams && !fits(leaves[i]) &&
        leaves[i].peakLive <= budget)
      tight.push_back(i);
  for (size_t t : tunable(tight, 8)) {
    // As it is, and (unless pinned) with 1 update in flight and no read
    // ahead: the staging of the shards is what the two add.
    SmallVector<Leaf, 2> tries{leaves[t]};
    if ((offloadNvmeInFlight < 0 && leaves[t].choice.nvmeInFlight > 1) ||
        (offloadNvmeReadAhead < 0 && leaves[t].choice.nvmeReadAhead > 0)) {
      tries.push_back(leaves[t]);
      if (offloadNvmeInFlight < 0)
        tries.back().choice.nvmeInFlight = 1;
      if (offloadNvmeReadAhead < 0)
        tries.back().choice.nvmeReadAhead = 0;
    }
    for (Leaf &leaf : tries) {
      leaf.choice.nvmeParams = true;
      if (!keepIfFits(leaf))
        return failure();
    }
  }
  return success();
}

/// Units keeping their state on disk (fsdp-offload's nvme-units), unless
/// pinned, under host-memory-budget: the fastest few candidates with the
/// state on disk that fit are tried with fewer units there, the fewest
/// that still fit (halving the range: the host arena grows as units come
/// back to it), which keeps the rest in host memory and takes their swaps
/// off the drive; and so again without the read ahead (nvme-read-ahead=0,
/// unless pinned), whose staging may be what keeps a unit out. Without a
/// host budget the state stays on disk whole, as offload-nvme asked.
LogicalResult SearchSchedulePass::tuneNvmeUnits() {
  if (offloadNvmeUnits >= 0 || hostBudget < 0)
    return success();
  std::vector<size_t> fit;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].choice.nvme && leaves[i].choice.nvmeUnits < 0 && fits(leaves[i]))
      fit.push_back(i);
  // The two fastest and the two with the smallest host arenas (the most
  // room to bring units back).
  for (size_t t : tunable(fit, 4)) {
    const Leaf base = leaves[t];
    // All of them fit; find the fewest that do. Unless pinned, also
    // without the read ahead: its staging is host memory the units
    // brought back to it may need more (a unit in host memory saves the
    // drive more time than a read ahead hides).
    SmallVector<int64_t, 2> aheads{base.choice.nvmeReadAhead};
    if (offloadNvmeReadAhead < 0 && base.choice.nvmeReadAhead > 0)
      aheads.push_back(0);
    for (int64_t ahead : aheads) {
      int64_t lo = 1, hi = base.unitsOnDisk;
      std::optional<Leaf> fewest;
      while (lo < hi) {
        Leaf l = base;
        l.choice.nvmeReadAhead = ahead;
        l.choice.nvmeUnits = lo + (hi - lo) / 2;
        if (!evaluate(l))
          return failure();
        if (fits(l)) {
          hi = l.choice.nvmeUnits;
          fewest = l;
        } else {
          lo = l.choice.nvmeUnits + 1;
        }
      }
      if (fewest)
        leaves.push_back(*fewest);
    }
  }
  return success();
}

/// Fastest first among those whose liveness fits; the arena decides.
/// best stays null when no arena fits.
LogicalResult SearchSchedulePass::pickByArena(Leaf *&best, OwningOpRef<ModuleOp> &bestModule,
                                              int64_t &bestArena) {
  std::vector<Leaf *> order;
  for (Leaf &l : leaves)
    if (fits(l))
      order.push_back(&l);
  // Equal predicted steps (offload-next-step where the host stream bounds
  // the step either way): the smaller host arena. Equal to the nanosecond:
  // the model's sums of thousands of terms differ in their last bits when
  // the same work is ordered differently.
  auto ns = [](const Leaf *l) { return std::llround(l->predicted.stepS * 1e9); };
  llvm::stable_sort(order, [&](Leaf *a, Leaf *b) {
    if (ns(a) != ns(b))
      return ns(a) < ns(b);
    return a->hostPeakLive < b->hostPeakLive;
  });
  for (Leaf *l : order) {
    OwningOpRef<ModuleOp> m;
    FailureOr<MemoryPlan> plan = buildPlaced(l->choice, m);
    if (failed(plan))
      return failure();
    if (placedFits(*plan)) {
      best = l;
      bestModule = std::move(m);
      bestArena = plan->arenaBytes;
      bestHostArena = plan->hostArenaBytes;
      break;
    }
  }
  return success();
}

/// No schedule fits: the error names the floor, the smallest arena any
/// candidate reaches (placed for the few with the smallest liveness).
LogicalResult SearchSchedulePass::failWithFloor() {
  // The device floor: the smallest placed arena among the few candidates
  // with the smallest liveness whose host arena meets host-memory-budget
  // (liveness first, then placed). When none does, the host budget is
  // what fails: its floor is the smallest host arena placed.
  auto hostFits = [&](int64_t bytes) { return hostBudget < 0 || bytes <= hostBudget; };
  std::vector<Leaf *> bySize, byHost;
  for (Leaf &l : leaves) {
    byHost.push_back(&l);
    if (hostFits(l.hostPeakLive))
      bySize.push_back(&l);
  }
  for (Leaf &l : hostUnfit)
    byHost.push_back(&l);
  llvm::stable_sort(bySize, [](Leaf *a, Leaf *b) { return a->peakLive < b->peakLive; });
  std::optional<MemoryPlan> floorPlan;
  Leaf *floorLeaf = nullptr;
  for (size_t i = 0; i < bySize.size() && i < 3; ++i) {
    OwningOpRef<ModuleOp> m;
    FailureOr<MemoryPlan> plan = buildPlaced(bySize[i]->choice, m);
    if (failed(plan))
      return failure();
    if (hostFits(plan->hostArenaBytes) &&
        (!floorPlan || plan->arenaBytes < floorPlan->arenaBytes)) {
      floorPlan = std::move(*plan);
      floorLeaf = bySize[i];
    }
  }
  if (!floorPlan) {
    llvm::stable_sort(byHost, [](Leaf *a, Leaf *b) { return a->hostPeakLive < b->hostPeakLive; });
    int64_t hostFloor = std::numeric_limits<int64_t>::max();
    for (size_t i = 0; i < byHost.size() && i < 3; ++i) {
      OwningOpRef<ModuleOp> m;
      FailureOr<MemoryPlan> plan = buildPlaced(byHost[i]->choice, m);
      if (failed(plan))
        return failure();
      if (plan->hostArenaBytes < hostFloor) {
        hostFloor = plan->hostArenaBytes;
        floorLeaf = byHost[i];
      }
    }
    return fail("no schedule fits host-memory-budget=" + hostMemoryBudget + " (" +
                Twine(hostBudget) + " bytes per rank); the smallest host arena reachable is " +
                formatBytes(hostFloor) + " (" + Twine(hostFloor) + " bytes), with " +
                floorLeaf->choice.str() + " (" + Twine(evaluated) + " schedules tried)");
  }
  std::string msg;
  llvm::raw_string_ostream os(msg);
  os << "no schedule fits memory-budget=" << memoryBudget << " (" << budget << " bytes per rank"
     << (hostBudget >= 0 ? ", with host-memory-budget=" + hostMemoryBudget : std::string())
     << "); the smallest peak reachable is " << formatBytes(floorPlan->arenaBytes) << " ("
     << floorPlan->arenaBytes << " bytes), with " << floorLeaf->choice.str() << " (" << evaluated
     << " schedules tried):";
  printBreakdown(os, *floorPlan);
  return fail(os.str());
}

/// Takes the winner's body and attributes, records the choice
/// (fsdp.strategy) and reports it.
void SearchSchedulePass::adopt(const Leaf &best, OwningOpRef<ModuleOp> bestModule,
                               int64_t bestArena) {
  ModuleOp module = getOperation();
  const Choice &c = best.choice;
  module.getBodyRegion().takeBody(bestModule->getBodyRegion());
  for (NamedAttribute a : (*bestModule)->getAttrs())
    if (a.getName() != SymbolTable::getSymbolAttrName())
      module->setAttr(a.getName(), a.getValue());
  OpBuilder b(&getContext());
  module->setAttr(
      "fsdp.strategy",
      b.getDictionaryAttr({
          b.getNamedAttr("layers_per_unit", b.getI64IntegerAttr(c.layersPerUnit)),
          b.getNamedAttr("recompute", b.getStringAttr(c.recompute)),
          b.getNamedAttr("recompute_units", b.getI64IntegerAttr(c.units)),
          b.getNamedAttr("reshard_after_forward", b.getBoolAttr(c.reshard != "false")),
          b.getNamedAttr("reshard_units", b.getI64IntegerAttr(c.reshardUnits)),
          b.getNamedAttr("reshard_after_backward", b.getBoolAttr(c.reshardAfterBackward)),
          // hpZ (reshard-after-forward=G): G, as fsdp-shard recorded it on
          // the mesh; 0 otherwise.
          b.getNamedAttr("reshard_group", b.getI64IntegerAttr(getMesh(module).getReshard())),
          b.getNamedAttr("prefetch_depth", b.getI64IntegerAttr(c.depth)),
          b.getNamedAttr("backward_prefetch", b.getStringAttr(c.backward)),
          // fsdp-schedule's unit-prefetch-depth, as the option is written
          // (UNIT=D,...; empty: every unit at prefetch_depth)
          b.getNamedAttr("unit_prefetch_depth",
                         b.getStringAttr(c.depth > 0 ? llvm::join(c.unitDepths, ",") : "")),
          b.getNamedAttr("overlap_node_exchange", b.getBoolAttr(c.overlapNode)),
          b.getNamedAttr("offload", b.getStringAttr(c.offload)),
          b.getNamedAttr("offload_activations", b.getBoolAttr(c.activations)),
          b.getNamedAttr("offload_next_step", b.getBoolAttr(c.nextStep)),
          b.getNamedAttr("offload_prefetch", b.getBoolAttr(c.prefetch)),
          b.getNamedAttr("offload_prefetch_depth",
                         b.getI64IntegerAttr(c.prefetch ? c.copiesInFlight : 0)),
          b.getNamedAttr("offload_nvme", b.getBoolAttr(c.nvme)),
          b.getNamedAttr("offload_nvme_in_flight",
                         b.getI64IntegerAttr(c.nvme ? c.nvmeInFlight : 0)),
          b.getNamedAttr("offload_nvme_read_ahead",
                         b.getI64IntegerAttr(c.nvme ? c.nvmeReadAhead : 0)),
          // the units whose state is on disk (all of them unless the
          // search or offload-nvme-units kept some in host memory)
          b.getNamedAttr("offload_nvme_units", b.getI64IntegerAttr(unitsOnDisk(module))),
          // and their master shards there too (offload-nvme-params)
          b.getNamedAttr("offload_nvme_params", b.getBoolAttr(c.nvme && c.nvmeParams)),
          b.getNamedAttr("predicted_step_s", b.getF64FloatAttr(best.predicted.stepS)),
          b.getNamedAttr("exposed_comm_pct", b.getF64FloatAttr(best.predicted.exposedPct())),
          b.getNamedAttr("peak", b.getI64IntegerAttr(bestArena)),
          b.getNamedAttr("budget", b.getI64IntegerAttr(budget)),
          b.getNamedAttr("host_peak", b.getI64IntegerAttr(bestHostArena)),
          b.getNamedAttr("host_budget", b.getI64IntegerAttr(hostBudget)),
          b.getNamedAttr("profile", b.getStringAttr(profile.name)),
          b.getNamedAttr("candidates", b.getI64IntegerAttr(evaluated)),
      }));
  if (report) {
    llvm::raw_ostream &os = llvm::errs();
    os << "fsdp schedule search: " << evaluated << " candidates, budget " << formatBytes(budget)
       << " per rank (" << profile.name << ")\n"
       << "  chose " << c.str() << "\n"
       << llvm::format("  predicted step %.3f ms, exposed communication "
                       "%.1f%%, peak ",
                       best.predicted.stepS * 1e3, best.predicted.exposedPct())
       << formatBytes(bestArena) << " (" << bestArena << " bytes)";
    if (bestHostArena > 0)
      os << ", host arena " << formatBytes(bestHostArena) << " (" << bestHostArena << " bytes)";
    os << "\n";
  }
}

} // namespace
