//===- PlanMemory.cpp - the static memory plan, recorded in the IR --------===//
//
// fsdp-plan-memory: runs the planner of MemoryPlan.h on @train_step and
// records its result as attributes, so that the plan can be inspected (and
// lit-tested) in the IR itself, and optionally prints the per-rank report.
//
//===----------------------------------------------------------------------===//

#include "passes/CostModel.h"
#include "passes/MemoryPlan.h"
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

namespace mlir::fsdp {
#define GEN_PASS_DEF_FSDPPLANMEMORY
#include "passes/Passes.h.inc"
} // namespace mlir::fsdp

using namespace mlir;
using namespace mlir::fsdp;

namespace {

struct PlanMemoryPass : mlir::fsdp::impl::FsdpPlanMemoryBase<PlanMemoryPass> {
  using Base::Base;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto step = getTrainStep(module, "fsdp-autodiff");
    if (!step || failed(checkTensorSizes(module)))
      return signalPassFailure();
    if (alignment <= 0 || (alignment & (alignment - 1))) {
      mlir::emitError(module.getLoc()) << "alignment must be a power of two, found "
                         << alignment;
      return signalPassFailure();
    }
    // The analysis plans with the alignment recorded here; recording
    // attributes below changes nothing it depends on, so it is preserved
    // for convert-fsdp-to-plan.
    module->setAttr("fsdp.alignment",
                    IntegerAttr::get(IntegerType::get(&getContext(), 64),
                                     alignment));
    if (auto cached = getCachedAnalysis<MemoryPlanAnalysis>())
      if (cached->get().alignment != alignment)
        getAnalysisManager().invalidate({}); // planned with another alignment
    auto &analysis = getAnalysis<MemoryPlanAnalysis>();
    markAllAnalysesPreserved();
    FailureOr<MemoryPlan> &plan = analysis.plan;
    if (failed(plan))
      return signalPassFailure();
    if (!hostMemoryBudget.empty()) {
      int64_t hostBudget = 0;
      if (!parseByteSize(hostMemoryBudget, hostBudget)) {
        mlir::emitError(module.getLoc())
            << "host-memory-budget='" << hostMemoryBudget
            << "' is not a positive size (bytes, or a number with KiB, MiB, GiB, TiB, KB, "
               "MB, GB, TB: host-memory-budget=512GiB)";
        return signalPassFailure();
      }
      if (plan->hostArenaBytes > hostBudget) {
        mlir::emitError(module.getLoc())
            << "the host arena (" << formatBytes(plan->hostArenaBytes) << ", "
            << plan->hostArenaBytes
            << " bytes per rank) exceeds host-memory-budget=" << hostMemoryBudget << " ("
            << hostBudget << " bytes)";
        return signalPassFailure();
      }
    }

    OpBuilder b(&getContext());
    auto offsetOf = [&](int64_t id) { return plan->buffers[id].offset; };
    for (PlannedParam &p : plan->params)
      if (p.buffer >= 0)
        p.op->setAttr("fsdp.offset", b.getI64IntegerAttr(offsetOf(p.buffer)));
    for (UnitOp u : module.getOps<UnitOp>())
      u->setAttr("fsdp.offset",
                 b.getI64IntegerAttr(offsetOf(plan->symbolBuffer.lookup(u.getSymName()))));
    for (StateOp s : module.getOps<StateOp>())
      s->setAttr("fsdp.offset",
                 b.getI64IntegerAttr(offsetOf(plan->symbolBuffer.lookup(s.getSymName()))));
    SmallVector<int64_t> argOffsets;
    for (BlockArgument a : step.getArguments())
      argOffsets.push_back(offsetOf(plan->valueBuffer.lookup(a)));
    step->setAttr("fsdp.arg_offsets", b.getDenseI64ArrayAttr(argOffsets));
    step.walk([&](Operation *op) {
      if (op->getNumResults() == 0 || isStorageAlias(op))
        return;
      SmallVector<int64_t> offs;
      for (Value r : op->getResults())
        offs.push_back(offsetOf(plan->valueBuffer.lookup(r)));
      op->setAttr("fsdp.offsets", b.getDenseI64ArrayAttr(offs));
    });

    auto k = [&](BufKind kind, bool peak) {
      return peak ? plan->peakByKind[(int)kind] : plan->totalByKind[(int)kind];
    };
    auto maxLive = [&](BufKind kind) { return plan->maxLiveByKind[(int)kind]; };
    module->setAttr(
        "fsdp.memory",
        b.getDictionaryAttr({
            b.getNamedAttr("arena", b.getI64IntegerAttr(plan->arenaBytes)),
            b.getNamedAttr("peak_live", b.getI64IntegerAttr(plan->peakLive)),
            b.getNamedAttr("params", b.getI64IntegerAttr(k(BufKind::Param, false))),
            b.getNamedAttr("state", b.getI64IntegerAttr(k(BufKind::State, false))),
            b.getNamedAttr("inputs", b.getI64IntegerAttr(k(BufKind::Input, false))),
            b.getNamedAttr("grads_at_peak", b.getI64IntegerAttr(k(BufKind::Grad, true))),
            b.getNamedAttr("activations_at_peak",
                           b.getI64IntegerAttr(k(BufKind::Activation, true))),
            b.getNamedAttr("temps_at_peak", b.getI64IntegerAttr(k(BufKind::Temp, true))),
            b.getNamedAttr("grads_max", b.getI64IntegerAttr(maxLive(BufKind::Grad))),
            b.getNamedAttr("comm_max", b.getI64IntegerAttr(maxLive(BufKind::Comm))),
        }));
    if (plan->hostArenaBytes > 0)
      module->setAttr(
          "fsdp.host_memory",
          b.getDictionaryAttr({
              b.getNamedAttr("arena", b.getI64IntegerAttr(plan->hostArenaBytes)),
              b.getNamedAttr("peak_live", b.getI64IntegerAttr(plan->hostPeakLive)),
              b.getNamedAttr("params", b.getI64IntegerAttr(
                                           plan->hostTotalByKind[(int)BufKind::Param])),
              b.getNamedAttr("state", b.getI64IntegerAttr(
                                          plan->hostTotalByKind[(int)BufKind::State])),
          }));

    if (report) {
      llvm::raw_ostream &os = llvm::errs();
      os << "fsdp memory plan (per rank)\n";
      auto row = [&](StringRef name, int64_t v) {
        os << llvm::format("  %-22s %14lld  %s\n", name.str().c_str(),
                           (long long)v, formatBytes(v).c_str());
      };
      row("parameters", k(BufKind::Param, false));
      row("optimizer state", k(BufKind::State, false));
      row("inputs", k(BufKind::Input, false));
      os << "  at the peak (instruction " << plan->peakInstr << " of "
         << plan->numInstructions << "):\n";
      row("  gradients", k(BufKind::Grad, true));
      row("  activations", k(BufKind::Activation, true));
      row("  temporaries", k(BufKind::Temp, true));
      row("  gathered parameters", k(BufKind::Comm, true));
      os << "  largest at any instruction:\n";
      row("  gradients", maxLive(BufKind::Grad));
      row("  gathered parameters", maxLive(BufKind::Comm));
      row("  activations", maxLive(BufKind::Activation));
      row("peak live bytes", plan->peakLive);
      row("arena (planned peak)", plan->arenaBytes);
      if (plan->hostArenaBytes > 0) {
        // fsdp-offload: what lives in host memory instead.
        os << "  host (offloaded):\n";
        row("  parameters", plan->hostTotalByKind[(int)BufKind::Param]);
        if (plan->nvmeBytes > 0) {
          // fsdp-offload's nvme: the state is in the swap file; the host
          // arena holds the updates' staging copies of it.
          row("  optimizer state", plan->hostPersistentState);
          row(plan->nvmeParams ? "  staging (state, params)" : "  state staging",
              plan->hostStagingPeak);
          row("  state in swap file", plan->nvmeState);
          if (plan->nvmeParams)
            row("  params in swap file", plan->nvmeParams);
          row("  swap file (nvme)", plan->nvmeBytes);
        } else {
          row("  optimizer state", plan->hostTotalByKind[(int)BufKind::State]);
        }
        // fsdp-offload-activations: the saved activations' copies (their
        // sum: the host arena reuses a copy's bytes once its backward read
        // is done).
        if (int64_t a = plan->hostTotalByKind[(int)BufKind::Activation])
          row("  activations (sum)", a);
        row("  host arena", plan->hostArenaBytes);
      }
    }

    if (simulate) {
      DeviceProfile profile;
      std::string error;
      if (!loadDeviceProfile(deviceProfile, profile, error)) {
        mlir::emitError(module.getLoc()) << error;
        return signalPassFailure();
      }
      if (ranksPerNode >= 0)
        profile.ranksPerNode = ranksPerNode;
      StepPrediction p = predictStep(module, step, *plan, profile);
      llvm::errs() << "fsdp predicted step (" << profile.name << ", one rank)\n"
                   << llvm::format("  step                   %12.3f ms\n"
                                   "  compute                %12.3f ms\n"
                                   "  communication          %12.3f ms\n"
                                   "  exposed communication  %12.3f ms  %.1f%%\n",
                                   p.stepS * 1e3, p.computeS * 1e3, p.commS * 1e3, p.exposedS * 1e3,
                                   p.exposedPct());
      if (p.hostS > 0)
        llvm::errs() << llvm::format("  host updates           %12.3f ms\n"
                                     "  waited for them        %12.3f ms\n",
                                     p.hostS * 1e3, p.hostExposedS * 1e3);
      if (p.swapS > 0)
        llvm::errs() << llvm::format("  swaps (drive busy)     %12.3f ms\n"
                                     "  reads and writes at once %10.3f ms\n",
                                     p.swapS * 1e3, p.swapDuplexS * 1e3);
      if (p.copyS > 0)
        llvm::errs() << llvm::format("  activation copies      %12.3f ms\n"
                                     "  waited for them        %12.3f ms\n",
                                     p.copyS * 1e3, p.copyExposedS * 1e3);
      llvm::errs() << "  peak per rank          "
                   << llvm::format("%14lld", (long long)plan->arenaBytes) << "  "
                   << formatBytes(plan->arenaBytes) << "\n";
    }
  }
};

} // namespace
