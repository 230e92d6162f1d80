//===- Pipeline.cpp - the fsdp compilation pipeline -----------------------===//

#include "compiler/Pipeline.h"

#include "passes/CostModel.h"
#include "passes/Passes.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;
using namespace mlir::fsdp;

/// fsdp-recompute when asked for, once the units are final and before
/// fsdp-shard (its description says why there).
static void addRecompute(OpPassManager &pm,
                         const FsdpPipelineOptions &options) {
  if (options.recompute == "none")
    return;
  FsdpRecomputeOptions recompute;
  recompute.policy = options.recompute;
  recompute.units = options.recomputeUnits;
  pm.addPass(createFsdpRecompute(recompute));
}

/// The search's spelling of an AutoBool option.
static std::string autoBoolName(AutoBool v) {
  return v == AutoBool::True ? "true" : v == AutoBool::False ? "false" : "auto";
}

/// With a memory budget, fsdp-search-schedule replaces fsdp-group-units,
/// fsdp-recompute, fsdp-shard and fsdp-schedule and chooses their options;
/// a knob the user gave a value is pinned (prefetch=false pins depth 0).
/// The mesh's ranks a node: ranks-per-node, else the device profile's
/// (0 where the profile does not load: fsdp-plan-memory reports that).
static int64_t ranksPerNode(const FsdpPipelineOptions &options) {
  if (options.ranksPerNode >= 0)
    return options.ranksPerNode;
  DeviceProfile profile;
  std::string error;
  return loadDeviceProfile(options.deviceProfile, profile, error) ? profile.ranksPerNode : 0;
}

static void addSearch(OpPassManager &pm, const FsdpPipelineOptions &options) {
  FsdpSearchScheduleOptions search;
  search.memoryBudget = options.memoryBudget;
  search.deviceProfile = options.deviceProfile;
  search.ranksPerNode = options.ranksPerNode;
  search.worldSize = options.worldSize;
  search.stage = options.stage;
  search.mesh = options.mesh;
  search.unitPolicy = options.unitPolicy;
  search.minUnitNumel = options.minUnitNumel;
  search.overlap = options.overlap;
  search.report = options.report;
  search.fuseEpilogues = options.fuseEpilogues;
  search.fuseGradAccum = options.fuseGradAccum;
  search.offload = options.offload;
  search.offloadActivations = options.offloadActivations;
  search.offloadOverlap = options.offloadOverlap;
  search.offloadNvme = autoBoolName(options.offloadNvme);
  if (options.offloadNvmeInFlight.hasValue())
    search.offloadNvmeInFlight = options.offloadNvmeInFlight;
  if (options.offloadNvmeReadAhead.hasValue())
    search.offloadNvmeReadAhead = options.offloadNvmeReadAhead;
  search.offloadNvmeUnits = options.offloadNvmeUnits;
  search.offloadNvmeParams = autoBoolName(options.offloadNvmeParams);
  if (options.offloadPrefetchDepth.hasValue())
    search.offloadPrefetchDepth = options.offloadPrefetchDepth;
  search.offloadPrefetch = autoBoolName(options.offloadPrefetch);
  search.offloadNextStep = autoBoolName(options.offloadNextStep);
  search.hostMemoryBudget = options.hostMemoryBudget;
  search.frozenStorage = options.frozenStorage;
  search.weightQuantization = options.weightQuantization;
  search.gradientQuantization = options.gradientQuantization;
  search.quantizationBlock = options.quantizationBlock;
  if (options.layersPerUnit.hasValue())
    search.layersPerUnit = options.layersPerUnit;
  if (options.recompute.hasValue())
    search.recompute = options.recompute;
  search.recomputeUnits = options.recomputeUnits;
  if (options.reshardAfterForward.hasValue())
    search.reshardAfterForward = options.reshardAfterForward;
  search.reshardUnits = options.reshardUnits;
  if (options.reshardAfterBackward.hasValue())
    search.reshardAfterBackward = options.reshardAfterBackward ? "true" : "false";
  if (options.prefetch.hasValue() && !options.prefetch)
    search.prefetchDepth = 0;
  else if (options.prefetchDepth.hasValue())
    search.prefetchDepth = options.prefetchDepth;
  if (options.backwardPrefetch.hasValue())
    search.backwardPrefetch = options.backwardPrefetch;
  search.unitPrefetchDepth = options.unitPrefetchDepth;
  search.searchUnitPrefetch = options.searchUnitPrefetch;
  if (options.overlapNodeExchange.hasValue())
    search.overlapNodeExchange = options.overlapNodeExchange ? "true" : "false";
  search.nodeCommStream = options.nodeCommStream;
  pm.addPass(createFsdpSearchSchedule(search));
}

void mlir::fsdp::buildFsdpPipeline(OpPassManager &pm,
                                   const FsdpPipelineOptions &options) {
  // Mixed precision retypes the model before its backward pass is
  // derived. With the defaults (f32, f32) it is left out, so the pipeline
  // is exactly what it was before.
  if (options.paramDtype != "f32" || options.reduceDtype != "f32" || !options.lossScale.empty() ||
      options.stochasticRounding || options.masterDtype != "f32") {
    FsdpMixedPrecisionOptions mp;
    mp.stochasticRounding = options.stochasticRounding;
    mp.masterDtype = options.masterDtype;
    mp.paramDtype = options.paramDtype;
    mp.reduceDtype = options.reduceDtype;
    mp.lossScale = options.lossScale;
    mp.lossScaleInit = options.lossScaleInit;
    mp.lossScaleGrowthInterval = options.lossScaleGrowthInterval;
    mp.lossScaleGrowthFactor = options.lossScaleGrowthFactor;
    mp.lossScaleBackoffFactor = options.lossScaleBackoffFactor;
    pm.addPass(createFsdpMixedPrecision(mp));
  }
  // After mixed precision (the zero padding is made in the compute dtype),
  // before autodiff (the padded head's backward is derived by the rules).
  if (options.padClasses != 0) {
    FsdpPadClassesOptions pad;
    pad.multiple = options.padClasses;
    pm.addPass(createFsdpPadClasses(pad));
  }
  pm.addPass(createFsdpAutodiff());
  // On the differentiated step, before accumulation clones it (each
  // micro-batch's loss is then read only after its head's backward), so
  // every later pass and the memory-budget search see the chunked head.
  if (options.lossChunks != "1") {
    FsdpChunkLossOptions chunk;
    chunk.chunks = options.lossChunks;
    pm.addPass(createFsdpChunkLoss(chunk));
  }
  bool searched = false; // fsdp-search-schedule ran (and applied offloads)
  // Accumulation clones the differentiated step; the optimizer and the
  // sharding after it see one gradient per parameter. With the defaults
  // the pass is left out, so the pipeline is exactly what it was before.
  if (options.gradAccum != 1 || options.accumReduce != "step") {
    FsdpGradAccumOptions accum;
    accum.microBatches = options.gradAccum;
    accum.reduce = options.accumReduce;
    pm.addPass(createFsdpGradAccum(accum));
  }
  FsdpInsertOptimizerOptions opt;
  opt.optimizer = options.optimizer;
  opt.momentum = options.momentum;
  opt.dampening = options.dampening;
  opt.nesterov = options.nesterov;
  opt.weightDecay = options.weightDecay;
  opt.weightDecayParams = options.weightDecayParams;
  opt.beta1 = options.beta1;
  opt.beta2 = options.beta2;
  opt.eps = options.eps;
  opt.maxGradNorm = options.maxGradNorm;
  opt.stateDtype = options.optimizerStateDtype;
  opt.stateRounding = options.optimizerStateRounding;
  opt.stateBlock = options.optimizerStateBlock;
  pm.addPass(createFsdpInsertOptimizer(opt));
  // Sharding rewrites the optimizer's updates; without an optimizer the
  // step outputs whole gradients and is not sharded (asking for several
  // ranks then reaches fsdp-shard, which says why it cannot).
  if (options.optimizer != "none" || options.worldSize != 1 ||
      !options.mesh.empty()) {
    if (!options.memoryBudget.empty()) {
      addSearch(pm, options);
      searched = true;
    } else {
      FsdpGroupUnitsOptions group;
      group.policy = options.unitPolicy;
      group.minUnitNumel = options.minUnitNumel;
      group.layersPerUnit = options.layersPerUnit;
      pm.addPass(createFsdpGroupUnits(group));
      addRecompute(pm, options);
      FsdpShardOptions shard;
      shard.worldSize = options.worldSize;
      shard.stage = options.stage;
      shard.reshardAfterForward = options.reshardAfterForward;
      shard.reshardUnits = options.reshardUnits;
      shard.reshardAfterBackward = options.reshardAfterBackward;
      shard.mesh = options.mesh;
      shard.offload = options.offload;
      shard.frozenStorage = options.frozenStorage;
      shard.weightQuantization = options.weightQuantization;
      shard.gradientQuantization = options.gradientQuantization;
      shard.quantizationBlock = options.quantizationBlock;
      shard.ranksPerNode = ranksPerNode(options);
      pm.addPass(createFsdpShard(shard));
      if (options.overlap) {
        FsdpScheduleOptions sched;
        sched.prefetch = options.prefetch;
        sched.prefetchDepth = options.prefetchDepth;
        sched.backwardPrefetch = options.backwardPrefetch;
        sched.unitPrefetchDepth = options.unitPrefetchDepth;
        sched.overlapNodeExchange = options.overlapNodeExchange;
        sched.nodeCommStream = options.nodeCommStream;
        pm.addPass(createFsdpSchedule(sched));
      }
    }
  } else {
    addRecompute(pm, options);
  }
  // Last of the rewrites (after recompute and the schedule), so no other
  // pass sees the fused ops; the memory-budget search fuses each candidate
  // the same way, so this finds nothing left to do after it.
  if (options.fuseEpilogues) {
    FsdpFuseEpiloguesOptions fuse;
    fuse.accumulate = options.fuseGradAccum;
    pm.addPass(createFsdpFuseEpilogues(fuse));
  }
  // After the schedule and the fusion: the copies go where the runtime
  // will run the saved activations' definitions and first backward reads.
  // With a memory budget the search applied it to its choice.
  if (options.offloadActivations != "false" && !searched) {
    FsdpOffloadActivationsOptions oa;
    oa.overlap = options.overlap;
    // auto is the search's; where the pipeline runs none (optimizer=none
    // on one rank: nothing to shard) a budget drives nothing, and auto
    // offloads nothing.
    oa.mode = options.offloadActivations == "auto" && !options.memoryBudget.empty()
                  ? std::string("false")
                  : options.offloadActivations.getValue();
    pm.addPass(createFsdpOffloadActivations(oa));
  }
  // With a memory budget the search applied it to its choice (auto: if
  // it chose it, and next-step as it chose); without one fsdp-offload
  // refuses auto by name, and offload-next-step=auto is false.
  // offload-nvme (or its units) without offload reaches fsdp-offload,
  // which says why not.
  if ((options.offload != "none" && !searched &&
       (options.memoryBudget.empty() || options.offload != "auto")) ||
      ((options.offloadNvme == AutoBool::True || options.offloadNvmeUnits >= 0 ||
        options.offloadNvmeParams == AutoBool::True) &&
       options.offload == "none")) {
    FsdpOffloadOptions off;
    off.mode = options.offload;
    off.overlap = options.overlap && options.offloadOverlap;
    off.prefetch = options.overlap && options.offloadPrefetch != AutoBool::False;
    off.nextStep = options.offloadNextStep == AutoBool::True;
    off.nvme = options.offloadNvme == AutoBool::True;
    off.nvmeInFlight = options.offloadNvmeInFlight;
    off.nvmeReadAhead = options.offloadNvmeReadAhead;
    off.nvmeUnits = options.offloadNvmeUnits;
    off.nvmeParams = options.offloadNvmeParams == AutoBool::True;
    off.prefetchDepth = options.offloadPrefetchDepth;
    pm.addPass(createFsdpOffload(off));
  }
  FsdpPlanMemoryOptions mem;
  mem.report = options.report;
  mem.simulate = options.simulate;
  mem.deviceProfile = options.deviceProfile;
  mem.ranksPerNode = options.ranksPerNode;
  mem.hostMemoryBudget = options.hostMemoryBudget;
  pm.addPass(createFsdpPlanMemory(mem));
  if (!options.plan.empty()) {
    FsdpExportPlanOptions exp;
    exp.output = options.plan;
    pm.addPass(createFsdpExportPlan(exp));
  }
}

void mlir::fsdp::registerFsdpPipeline() {
  PassPipelineRegistration<FsdpPipelineOptions>(
      "fsdp-pipeline",
      "model -> training step -> optimizer -> memory plan -> plan file",
      buildFsdpPipeline);
}
