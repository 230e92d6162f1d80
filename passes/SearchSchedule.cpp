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
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/Format.h"

#include <cmath>
#include <limits>
#include <optional>
#include "llvm/Support/raw_ostream.h"

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

  std::string str() const {
    return "layers-per-unit=" + std::to_string(layersPerUnit) +
           " recompute=" + recompute +
           (units >= 0 ? " recompute-units=" + std::to_string(units) : "") +
           " reshard-after-forward=" + reshard +
           " prefetch-depth=" + std::to_string(depth);
  }
};

struct Leaf {
  Choice choice;
  int64_t peakLive = 0;
  StepPrediction predicted;
};

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
  bool shard(ModuleOp m, StringRef reshard) {
    FsdpShardOptions s;
    s.worldSize = worldSize;
    s.stage = stage;
    s.reshardAfterForward = reshard.str();
    s.mesh = mesh;
    return run(m, createFsdpShard(s));
  }
  bool schedule(ModuleOp m, int64_t depth) {
    if (!overlap)
      return true;
    FsdpScheduleOptions sched;
    sched.prefetch = depth > 0;
    sched.prefetchDepth = depth;
    return run(m, createFsdpSchedule(sched));
  }
  /// fsdp-fuse-epilogues, as the pipeline runs it after this pass.
  bool fuse(ModuleOp m) { return !fuseEpilogues || run(m, createFsdpFuseEpilogues()); }
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

  /// Compiles, plans (liveness) and predicts one choice.
  bool evaluate(Leaf &leaf) {
    OwningOpRef<ModuleOp> m = build(leaf.choice);
    if (!m)
      return false;
    auto step = m->lookupSymbol<func::FuncOp>(kTrainStepName);
    FailureOr<MemoryPlan> plan = planMemory(*m, step, 64, /*place=*/false);
    if (failed(plan))
      return false;
    leaf.peakLive = plan->peakLive;
    leaf.predicted = predictStep(*m, step, *plan, profile);
    ++numCandidates;
    ++evaluated;
    return true;
  }
  DeviceProfile profile;
  int64_t evaluated = 0; ///< schedules compiled, planned and predicted

  /// The whole chain for one choice, on a clone of the pass's module.
  OwningOpRef<ModuleOp> build(const Choice &c) {
    OwningOpRef<ModuleOp> m = clone(getOperation());
    if (!group(*m, c.layersPerUnit) ||
        !recomputeStep(*m, c.recompute, c.units) ||
        !shard(*m, c.reshard) || !schedule(*m, c.depth) || !fuse(*m))
      return nullptr;
    return m;
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
  ModuleOp module = getOperation();
  auto fail = [&](const Twine &msg) {
    mlir::emitError(module.getLoc()) << msg;
    signalPassFailure();
  };
  int64_t budget = 0;
  if (!parseByteSize(memoryBudget, budget))
    return fail("memory-budget='" + memoryBudget +
                "' is not a positive size (bytes, or a number with KiB, MiB, "
                "GiB, TiB, KB, MB, GB, TB: memory-budget=80GiB)");
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
  int64_t shards = worldSize;
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
    return signalPassFailure();

  // The knobs' values, searched or pinned.
  SmallVector<int64_t> groupings{1, 2};
  if (layersPerUnit > 0 || unitPolicy != "layer")
    groupings.assign(1, std::max<int64_t>(1, layersPerUnit));
  else if (unitsOf(1) == unitsOf(2))
    groupings.assign(1, 1); // fewer than two marked layers: nothing to merge
  SmallVector<std::string> recomputes{"none", "selective", "unit"};
  if (!recompute.empty())
    recomputes.assign(1, recompute);
  // Resharding after forward: not at all, to the shard group, or (hpZ) to
  // one node of the profile's link when that is a proper divisor of the
  // shard group: the backward's gathers then stay on the node's link.
  SmallVector<std::string> reshards{"false", "true"};
  int64_t node = profile.ranksPerNode;
  if (node > 1 && node < shards && shards % node == 0)
    reshards.push_back(std::to_string(node));
  if (!reshardAfterForward.empty())
    reshards.assign(1, reshardAfterForward);
  else if (stage != 3)
    reshards.assign(1, "true"); // only stage 3 reshards
  SmallVector<int64_t> depths{0, 1, 2};
  if (prefetchDepth >= 0)
    depths.assign(1, prefetchDepth);
  else if (!overlap)
    depths.assign(1, 0);

  // The tree: a clone per node, so each step runs once per distinct prefix.
  std::vector<Leaf> leaves;
  for (int64_t k : groupings) {
    OwningOpRef<ModuleOp> grouped = clone(module);
    if (!group(*grouped, k))
      return signalPassFailure();
    for (const std::string &rc : recomputes) {
      OwningOpRef<ModuleOp> recomputed = clone(*grouped);
      int64_t units = rc == "unit" ? int64_t(recomputeUnits) : -1;
      if (!recomputeStep(*recomputed, rc, units))
        return signalPassFailure();
      for (const std::string &reshard : reshards) {
        OwningOpRef<ModuleOp> sharded = clone(*recomputed);
        if (!shard(*sharded, reshard))
          return signalPassFailure();
        for (int64_t depth : depths) {
          Leaf leaf;
          leaf.choice = {k, rc, reshard, depth, units};
          OwningOpRef<ModuleOp> m =
              depth == depths.back() ? std::move(sharded) : clone(*sharded);
          if (!schedule(*m, depth) || !fuse(*m))
            return signalPassFailure();
          auto step = m->lookupSymbol<func::FuncOp>(kTrainStepName);
          FailureOr<MemoryPlan> plan =
              planMemory(*m, step, /*alignment=*/64, /*place=*/false);
          if (failed(plan))
            return signalPassFailure();
          leaf.peakLive = plan->peakLive;
          leaf.predicted = predictStep(*m, step, *plan, profile);
          ++numCandidates;
          ++evaluated;
          leaves.push_back(std::move(leaf));
        }
      }
    }
  }

  // Per unit: recompute only the first K units. Where recompute=none does
  // not fit and unit does (same grouping, resharding and depth), the
  // peak and the step are about linear in K: the best such combination by
  // that estimate is compiled at the estimated K and walked to the
  // smallest K that fits (a few steps), if it may beat the best uniform
  // schedule.
  if (recomputes.size() == 3 && recomputeUnits < 0) {
    auto find = [&](const Choice &c, StringRef rc) -> Leaf * {
      for (Leaf &l : leaves)
        if (l.choice.layersPerUnit == c.layersPerUnit && l.choice.recompute == rc &&
            l.choice.reshard == c.reshard && l.choice.depth == c.depth)
          return &l;
      return nullptr;
    };
    double bestUniform = std::numeric_limits<double>::infinity();
    for (Leaf &l : leaves)
      if (l.peakLive <= budget)
        bestUniform = std::min(bestUniform, l.predicted.stepS);
    struct Estimate {
      Choice choice;
      double stepS;
    };
    std::optional<Estimate> est;
    for (Leaf &l : leaves) {
      if (l.choice.recompute != "none" || l.peakLive <= budget)
        continue;
      Leaf *unit = find(l.choice, "unit");
      if (!unit || unit->peakLive > budget || unit->peakLive >= l.peakLive)
        continue;
      int64_t numUnits = unitsOf(l.choice.layersPerUnit);
      double f = double(l.peakLive - budget) / double(l.peakLive - unit->peakLive);
      Choice c = l.choice;
      c.recompute = "unit";
      c.units = std::min<int64_t>(numUnits, std::ceil(f * numUnits));
      double t = l.predicted.stepS + f * (unit->predicted.stepS - l.predicted.stepS);
      if (t < bestUniform && (!est || t < est->stepS))
        est = Estimate{c, t};
    }
    if (est) {
      // Up while it does not fit, then down while it does: at most 4. Every
      // K that fits by liveness is kept: the arena (placement adds
      // fragmentation) may reject the smallest.
      Leaf leaf;
      leaf.choice = est->choice;
      std::optional<Leaf> fit;
      int64_t numUnits = unitsOf(leaf.choice.layersPerUnit);
      for (int tries = 0; tries < 4 && leaf.choice.units >= 0 &&
                          leaf.choice.units <= numUnits;
           ++tries) {
        if (!evaluate(leaf))
          return signalPassFailure();
        if (leaf.peakLive <= budget) {
          fit = leaf;
          leaves.push_back(leaf);
          --leaf.choice.units;
        } else if (fit) {
          break;
        } else {
          ++leaf.choice.units;
        }
      }
    }
  }

  // Fastest first among those whose liveness fits; the arena decides.
  std::vector<Leaf *> order;
  for (Leaf &l : leaves)
    if (l.peakLive <= budget)
      order.push_back(&l);
  llvm::stable_sort(order, [](Leaf *a, Leaf *b) {
    return a->predicted.stepS < b->predicted.stepS;
  });
  Leaf *best = nullptr;
  OwningOpRef<ModuleOp> bestModule;
  int64_t bestArena = 0;
  for (Leaf *l : order) {
    OwningOpRef<ModuleOp> m = build(l->choice);
    if (!m)
      return signalPassFailure();
    auto step = m->lookupSymbol<func::FuncOp>(kTrainStepName);
    FailureOr<MemoryPlan> plan = planMemory(*m, step, 64);
    if (failed(plan))
      return signalPassFailure();
    if (plan->arenaBytes <= budget) {
      best = l;
      bestModule = std::move(m);
      bestArena = plan->arenaBytes;
      break;
    }
  }

  if (!best) {
    // The floor: the smallest arena any candidate reaches (placed for the
    // few with the smallest liveness).
    std::vector<Leaf *> bySize;
    for (Leaf &l : leaves)
      bySize.push_back(&l);
    llvm::stable_sort(bySize, [](Leaf *a, Leaf *b) {
      return a->peakLive < b->peakLive;
    });
    std::optional<MemoryPlan> floorPlan;
    Leaf *floorLeaf = nullptr;
    for (size_t i = 0; i < bySize.size() && i < 3; ++i) {
      OwningOpRef<ModuleOp> m = build(bySize[i]->choice);
      if (!m)
        return signalPassFailure();
      auto step = m->lookupSymbol<func::FuncOp>(kTrainStepName);
      FailureOr<MemoryPlan> plan = planMemory(*m, step, 64);
      if (failed(plan))
        return signalPassFailure();
      if (!floorPlan || plan->arenaBytes < floorPlan->arenaBytes) {
        floorPlan = std::move(*plan);
        floorLeaf = bySize[i];
      }
    }
    std::string msg;
    llvm::raw_string_ostream os(msg);
    os << "no schedule fits memory-budget=" << memoryBudget << " ("
       << budget << " bytes per rank); the smallest peak reachable is "
       << formatBytes(floorPlan->arenaBytes) << " (" << floorPlan->arenaBytes
       << " bytes), with " << floorLeaf->choice.str() << " (" << evaluated
       << " schedules tried):";
    printBreakdown(os, *floorPlan);
    return fail(os.str());
  }

  // Take the winner's body and attributes.
  Choice c = best->choice;
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
          b.getNamedAttr("reshard_after_forward",
                         b.getBoolAttr(c.reshard != "false")),
          // hpZ (reshard-after-forward=G): G, as fsdp-shard recorded it on
          // the mesh; 0 otherwise.
          b.getNamedAttr("reshard_group",
                         b.getI64IntegerAttr(getMesh(module).getReshard())),
          b.getNamedAttr("prefetch_depth", b.getI64IntegerAttr(c.depth)),
          b.getNamedAttr("predicted_step_s",
                         b.getF64FloatAttr(best->predicted.stepS)),
          b.getNamedAttr("exposed_comm_pct",
                         b.getF64FloatAttr(best->predicted.exposedPct())),
          b.getNamedAttr("peak", b.getI64IntegerAttr(bestArena)),
          b.getNamedAttr("budget", b.getI64IntegerAttr(budget)),
          b.getNamedAttr("profile", b.getStringAttr(profile.name)),
          b.getNamedAttr("candidates", b.getI64IntegerAttr(evaluated)),
      }));
  if (report) {
    llvm::raw_ostream &os = llvm::errs();
    os << "fsdp schedule search: " << evaluated << " candidates, budget "
       << formatBytes(budget) << " per rank (" << profile.name << ")\n"
       << "  chose " << c.str() << "\n"
       << llvm::format("  predicted step %.3f ms, exposed communication "
                       "%.1f%%, peak ",
                       best->predicted.stepS * 1e3,
                       best->predicted.exposedPct())
       << formatBytes(bestArena) << " (" << bestArena << " bytes)\n";
  }
}

} // namespace
