//===- Pipeline.h - the fsdp compilation pipeline ---------------*- C++ -*-===//
//
// buildFsdpPipeline composes the passes a user normally runs, from a model
// to a plan file; it is also registered as --fsdp-pipeline for fsdp-opt.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_COMPILER_PIPELINE_H
#define FSDP_COMPILER_PIPELINE_H

#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassOptions.h"

namespace mlir::fsdp {

/// offload-next-step's and offload-prefetch's values (an enum: a misspelt
/// value is refused by the option parser, whether or not anything
/// offloads).
enum class AutoBool { False, True, Auto };

struct FsdpPipelineOptions
    : public PassPipelineOptions<FsdpPipelineOptions> {
  Option<std::string> optimizer{*this, "optimizer", llvm::cl::desc("sgd | adamw | lamb | none"),
                                llvm::cl::init("adamw")};
  Option<double> momentum{*this, "momentum", llvm::cl::desc("SGD momentum"),
                          llvm::cl::init(0.0)};
  Option<double> dampening{*this, "dampening",
                           llvm::cl::desc("SGD dampening"), llvm::cl::init(0.0)};
  Option<bool> nesterov{*this, "nesterov", llvm::cl::desc("SGD Nesterov"),
                        llvm::cl::init(false)};
  Option<double> weightDecay{*this, "weight-decay",
                             llvm::cl::desc("weight decay (default 0.01 AdamW and LAMB, 0 SGD)"),
                             llvm::cl::init(-1.0)};
  Option<std::string> weightDecayParams{
      *this, "weight-decay-params",
      llvm::cl::desc("all | matrices (rank >= 2 only: no decay for biases and "
                     "norm gains, as nanoGPT and llm.c)"),
      llvm::cl::init("all")};
  Option<double> beta1{*this, "beta1", llvm::cl::init(0.9)};
  Option<double> beta2{*this, "beta2", llvm::cl::init(0.999)};
  Option<double> eps{*this, "eps", llvm::cl::init(1e-8)};
  Option<double> maxGradNorm{*this, "max-grad-norm",
                             llvm::cl::desc("global-norm clipping (0: off)"),
                             llvm::cl::init(0.0)};
  Option<std::string> optimizerStateDtype{
      *this, "optimizer-state-dtype",
      llvm::cl::desc("f32 | bf16 | 8bit | 4bit: the optimizer's state (AdamW's and LAMB's "
                     "moments, SGD's momentum buffer) in bf16 (f32 math, half its bytes), in "
                     "8-bit block codes (about a quarter), or AdamW's in 4-bit ones (about an "
                     "eighth)"),
      llvm::cl::init("f32")};
  Option<int64_t> optimizerStateBlock{
      *this, "optimizer-state-block",
      llvm::cl::desc("with optimizer-state-dtype=8bit|4bit: elements per block of codes with "
                     "one f32 scale (a power of two in [32, 4096]; 0: 256 for 8bit, 128 for "
                     "4bit, torchao's)"),
      llvm::cl::init(0)};
  Option<std::string> optimizerStateRounding{
      *this, "optimizer-state-rounding",
      llvm::cl::desc("stochastic | nearest: how bf16 optimizer state is rounded when written"),
      llvm::cl::init("stochastic")};
  Option<int64_t> gradAccum{
      *this, "grad-accum",
      llvm::cl::desc("micro-batches per optimizer step (1: no accumulation)"),
      llvm::cl::init(1)};
  Option<std::string> accumReduce{
      *this, "accum-reduce",
      llvm::cl::desc("with grad-accum: step (reduce once per step) | "
                     "microbatch (reduce each micro-batch into the shard)"),
      llvm::cl::init("step")};
  Option<std::string> paramDtype{
      *this, "param-dtype",
      llvm::cl::desc("compute dtype of gathered parameters and activations: "
                     "f32 | bf16 | f16 (master parameters and optimizer state "
                     "stay f32; f16 implies loss-scale=dynamic)"),
      llvm::cl::init("f32")};
  Option<std::string> reduceDtype{
      *this, "reduce-dtype",
      llvm::cl::desc("dtype of the gradient reduce-scatter / all-reduce: "
                     "f32 | bf16 | f16"),
      llvm::cl::init("f32")};
  Option<bool> stochasticRounding{
      *this, "stochastic-rounding",
      llvm::cl::desc("round the f32 master parameters to bf16 stochastically "
                     "(unbiased, keyed by --seed, step and element) where "
                     "they are cast for compute, as llm.c; param-dtype=bf16 "
                     "only (default false: to nearest even)"),
      llvm::cl::init(false)};
  Option<std::string> masterDtype{
      *this, "master-dtype",
      llvm::cl::desc("f32 | bf16: the trainable parameters' stored dtype "
                     "(bf16: no f32 master copy; each update steps in f32 "
                     "and rounds the parameters back to bf16, stochastically "
                     "with stochastic-rounding=true); param-dtype=bf16 only"),
      llvm::cl::init("f32")};
  Option<std::string> lossScale{
      *this, "loss-scale",
      llvm::cl::desc("dynamic | none: dynamic loss scaling as PyTorch's "
                     "GradScaler (default: dynamic with f16, none otherwise)"),
      llvm::cl::init("")};
  Option<double> lossScaleInit{
      *this, "loss-scale-init",
      llvm::cl::desc("initial loss scale, a power of two (default 65536)"),
      llvm::cl::init(65536.0)};
  Option<int64_t> lossScaleGrowthInterval{
      *this, "loss-scale-growth-interval",
      llvm::cl::desc("overflow-free steps before the loss scale doubles "
                     "(default 2000)"),
      llvm::cl::init(2000)};
  Option<double> lossScaleGrowthFactor{
      *this, "loss-scale-growth-factor",
      llvm::cl::desc("loss scale factor after growth-interval clean steps, a "
                     "power of two above 1 (default 2)"),
      llvm::cl::init(2.0)};
  Option<double> lossScaleBackoffFactor{
      *this, "loss-scale-backoff-factor",
      llvm::cl::desc("loss scale factor after an overflow, a power of two "
                     "below 1 (default 0.5)"),
      llvm::cl::init(0.5)};
  Option<int64_t> padClasses{
      *this, "pad-classes",
      llvm::cl::desc("widen a classifier head feeding cross_entropy to a "
                     "multiple of this many columns (llm.c's 50257 -> 50304: "
                     "aligned rows for its GEMMs); 0 disables"),
      llvm::cl::init(64)};
  Option<std::string> lossChunks{
      *this, "loss-chunks",
      llvm::cl::desc("compute the classifier head and its cross-entropy in "
                     "this many row chunks, so the [tokens, V] logits are "
                     "never whole (Liger's fused linear cross-entropy): a "
                     "count (1: off) or auto (chunks whose logits are about "
                     "the size of the f32 weight gradient)"),
      llvm::cl::init("1")};
  Option<int64_t> worldSize{*this, "world-size",
                            llvm::cl::desc("ranks of the 1-D mesh"),
                            llvm::cl::init(1)};
  Option<std::string> mesh{
      *this, "mesh",
      llvm::cl::desc("RxS: hybrid sharding, R replicas x S shards (R*S = "
                     "world-size); empty: 1-D mesh"),
      llvm::cl::init("")};
  Option<int64_t> stage{*this, "stage",
                        llvm::cl::desc("ZeRO stage: 0 DDP, 1 optimizer "
                                       "state, 2 + gradients, 3 + parameters"),
                        llvm::cl::init(3)};
  Option<std::string> reshardAfterForward{
      *this, "reshard-after-forward",
      llvm::cl::desc("stage 3: true (free gathered parameters after "
                     "forward), false, or G (keep 1/G of each unit and "
                     "gather it within G consecutive ranks for backward: "
                     "hpZ)"),
      llvm::cl::init("true")};
  Option<int64_t> reshardUnits{
      *this, "reshard-units",
      llvm::cl::desc("stage 3 with reshard-after-forward true or G: only the "
                     "first K units of the forward reshard, the later ones "
                     "keep their gather for the backward (-1: all reshard)"),
      llvm::cl::init(-1)};
  Option<bool> reshardAfterBackward{
      *this, "reshard-after-backward",
      llvm::cl::desc("stage 3 with grad-accum: false keeps each unit's last gather "
                     "of a micro-batch for the next one's forward (FSDP2's "
                     "set_reshard_after_backward(False)): fewer all-gathers, the "
                     "units gathered across micro-batches"),
      llvm::cl::init(true)};
  Option<std::string> unitPolicy{*this, "unit-policy",
                                 llvm::cl::desc("layer | size | none"),
                                 llvm::cl::init("layer")};
  Option<int64_t> minUnitNumel{
      *this, "min-unit-numel",
      llvm::cl::desc("size policy: smallest unit, in elements"),
      llvm::cl::init(1000000)};
  Option<bool> overlap{*this, "overlap",
                       llvm::cl::desc("async collectives (and fsdp-offload's host updates) "
                                      "overlapped with compute"),
                       llvm::cl::init(true)};
  Option<bool> prefetch{*this, "prefetch",
                        llvm::cl::desc("issue each all-gather one unit ahead"),
                        llvm::cl::init(true)};
  Option<bool> overlapNodeExchange{
      *this, "overlap-node-exchange",
      llvm::cl::desc("with prefetch, hierarchical qgZ (ranks-per-node): each unit's "
                     "node all-to-all travels behind the next unit's backward "
                     "(false: waited for at once)"),
      llvm::cl::init(true)};
  Option<bool> nodeCommStream{
      *this, "node-comm-stream",
      llvm::cl::desc("hierarchical qgZ (ranks-per-node): the node group's exchanges "
                     "run on a second comm stream beside the cross-node ones "
                     "(false: one comm stream)"),
      llvm::cl::init(true)};
  Option<std::string> recompute{
      *this, "recompute",
      llvm::cl::desc("activation recomputation: none | unit (keep each "
                     "unit's input) | selective (keep matmul outputs)"),
      llvm::cl::init("none")};
  Option<int64_t> prefetchDepth{
      *this, "prefetch-depth",
      llvm::cl::desc("with prefetch: parameter all-gathers in flight at once"),
      llvm::cl::init(1)};
  ListOption<std::string> unitPrefetchDepth{
      *this, "unit-prefetch-depth",
      llvm::cl::desc("with prefetch: UNIT=D,... gives those units' all-gathers their "
                     "own prefetch depth (0: where read); with memory-budget it pins "
                     "it, with layers-per-unit pinned (else searched)")};
  Option<bool> searchUnitPrefetch{
      *this, "search-unit-prefetch",
      llvm::cl::desc("with memory-budget: weigh per-unit prefetch depth (a schedule "
                     "over the budget made one less deep at the units prefetched at "
                     "its peak)"),
      llvm::cl::init(true)};
  Option<std::string> backwardPrefetch{
      *this, "backward-prefetch",
      llvm::cl::desc("with prefetch, where the backward pass's all-gathers are "
                     "issued (FSDP's BackwardPrefetch): pre (BACKWARD_PRE: while "
                     "the unit after computes its gradients), post "
                     "(BACKWARD_POST: once its parameters are dead, one unit "
                     "fewer gathered at once) or none (where read)"),
      llvm::cl::init("pre")};
  Option<int64_t> layersPerUnit{
      *this, "layers-per-unit",
      llvm::cl::desc("layer policy: consecutive layers merged into one unit"),
      llvm::cl::init(1)};
  Option<std::string> memoryBudget{
      *this, "memory-budget",
      llvm::cl::desc("largest planned peak per rank (80GiB, 512MiB, bytes): "
                     "the compiler chooses recompute, reshard-after-forward, "
                     "prefetch-depth and layers-per-unit (those given a value "
                     "stay pinned) to minimise the predicted step time "
                     "(fsdp-search-schedule); empty: no search"),
      llvm::cl::init("")};
  Option<std::string> hostMemoryBudget{
      *this, "host-memory-budget",
      llvm::cl::desc("largest host arena per rank (offload: master shards, "
                     "optimizer state, gradient copies; 512GiB, bytes): with "
                     "memory-budget the search keeps to it, without one a "
                     "larger plan is an error; empty: no limit"),
      llvm::cl::init("")};
  Option<std::string> deviceProfile{
      *this, "device-profile",
      llvm::cl::desc("cost model: h100 (built in) or a JSON from fsdp-run "
                     "--calibrate"),
      llvm::cl::init("h100")};
  Option<int64_t> ranksPerNode{
      *this, "ranks-per-node",
      llvm::cl::desc("mesh topology: ranks on one node's NVLink; larger "
                     "groups use the inter-node link (-1: the profile's, 8 "
                     "for h100; 0: one node)"),
      llvm::cl::init(-1)};
  Option<bool> fuseEpilogues{
      *this, "fuse-epilogues",
      llvm::cl::desc("fold bias_add, gelu and gelu_grad into the matmul "
                     "before them (fsdp-fuse-epilogues)"),
      llvm::cl::init(true)};
  Option<bool> fuseGradAccum{*this, "fuse-grad-accum",
                             llvm::cl::desc("with grad-accum > 1 and fuse-epilogues: each later "
                                            "micro-batch's weight-gradient GEMM adds into the "
                                            "accumulated gradient (beta = 1) instead of writing a "
                                            "product that an add sums (Megatron's "
                                            "gradient-accumulation fusion)"),
                             llvm::cl::init(true)};
  Option<bool> simulate{
      *this, "simulate",
      llvm::cl::desc("print the predicted step time, exposed communication "
                     "and peak per rank (the model of fsdp-sim)"),
      llvm::cl::init(false)};
  Option<int64_t> recomputeUnits{
      *this, "recompute-units",
      llvm::cl::desc("recompute=unit: recompute only the first K units of "
                     "each micro-batch (-1: all)"),
      llvm::cl::init(-1)};
  Option<std::string> offload{
      *this, "offload",
      llvm::cl::desc("optimizer: master shards, optimizer state and the "
                     "update live on the host (ZeRO-Offload; fsdp-offload); "
                     "all: and the frozen units' storage, copied to the "
                     "device before each use (DeepSpeed's offload_param for "
                     "the weights a fine-tune does not train); auto (with "
                     "memory-budget): the search decides; none"),
      llvm::cl::init("none")};
  Option<std::string> weightQuantization{
      *this, "weight-quantization",
      llvm::cl::desc("int8: the parameter all-gathers of sharded units move "
                     "int8 values in blocks with an f32 scale each, "
                     "dequantized into the compute dtype after (ZeRO++'s "
                     "quantized weights, qwZ: about a byte a parameter on "
                     "the wire; the master shards stay exact); none (default)"),
      llvm::cl::init("none")};
  Option<std::string> gradientQuantization{
      *this, "gradient-quantization",
      llvm::cl::desc("int8: the gradient reduce-scatters of sharded units "
                     "become all-to-alls of int8 values in blocks with an "
                     "f32 scale each, every rank summing its part in f32 "
                     "after (ZeRO++'s quantized gradients, qgZ: about a byte "
                     "a gradient on the wire; the update stays exact on what "
                     "arrives); none (default)"),
      llvm::cl::init("none")};
  Option<int64_t> quantizationBlock{
      *this, "quantization-block",
      llvm::cl::desc("weight-quantization / gradient-quantization=int8: values "
                     "sharing one scale (256)"),
      llvm::cl::init(256)};
  Option<std::string> frozenStorage{
      *this, "frozen-storage",
      llvm::cl::desc("compute: with param-dtype=bf16|f16 each frozen unit "
                     "read only in that dtype stores it (rounded once instead "
                     "of at every read: the same training, half its bytes, "
                     "in device or, with offload=all, host memory); declared "
                     "(default): its parameters' dtype"),
      llvm::cl::init("declared")};
  Option<AutoBool> offloadNvme{
      *this, "offload-nvme",
      llvm::cl::desc("with offload=optimizer|all: true is ZeRO-Infinity's NVMe "
                     "offload; the offloaded units' optimizer state lives in "
                     "a per-rank swap file (fsdp-run --nvme-dir DIR), each "
                     "update reading it into the host arena and writing it "
                     "back (host memory: the master shards and the updates' "
                     "state in flight instead of all the state); auto: with "
                     "memory-budget the search weighs both (host-memory-budget "
                     "makes it win), without one false; false (the default)"),
      llvm::cl::values(clEnumValN(AutoBool::False, "false", "state in host memory"),
                       clEnumValN(AutoBool::True, "true", "state in the swap file"),
                       clEnumValN(AutoBool::Auto, "auto", "the search decides")),
      llvm::cl::init(AutoBool::False)};
  Option<unsigned> offloadNvmeInFlight{
      *this, "offload-nvme-in-flight",
      llvm::cl::desc("with offload-nvme: the async updates in flight at once "
                     "(1 to 8, default 2): 2 reads one unit's state from the "
                     "swap file while the previous unit's update runs, for one "
                     "more update's staging in host memory; 1 is the least "
                     "host memory, the drive idle during each update. Unset "
                     "with memory-budget: the search also tries 1 where only "
                     "that fits host-memory-budget"),
      llvm::cl::init(2)};
  Option<unsigned> offloadNvmeReadAhead{
      *this, "offload-nvme-read-ahead",
      llvm::cl::desc("with offload-nvme: each update's state is read from the "
                     "swap file this many updates on disk ahead of its own "
                     "(0 to 8, default 1): from where that earlier update is "
                     "issued, the first ones from the step's start, so the "
                     "drive reads during the forward pass and ahead of the "
                     "gradients, for this many more updates' staging in host "
                     "memory; 0 reads once compute reaches the update. Unset "
                     "with memory-budget: the search also tries 0 where only "
                     "that fits host-memory-budget, and up to 8 for its "
                     "fastest schedules"),
      llvm::cl::init(1)};
  Option<int64_t> offloadNvmeUnits{
      *this, "offload-nvme-units",
      llvm::cl::desc("with offload-nvme: how many offloaded trainable units keep "
                     "their state on disk, the first ones the step updates "
                     "(the last layers: the backward pass left hides their "
                     "swaps); the rest keep it in host memory: less drive "
                     "time for more host memory. "
                     "-1 (default): all; with memory-budget and "
                     "host-memory-budget the search puts the fewest on disk "
                     "that fit"),
      llvm::cl::init(-1)};
  Option<AutoBool> offloadNvmeParams{
      *this, "offload-nvme-params",
      llvm::cl::desc("with offload-nvme: true is ZeRO-Infinity's offload_param; "
                     "the master shards of the units whose state is on disk "
                     "(and with offload=all every frozen unit's storage) live "
                     "in the swap file too, each copy to the device reading "
                     "its bytes into a host staging buffer first: host memory "
                     "holds no parameter of theirs, the drive reads them at "
                     "every use; auto: with memory-budget the search puts them "
                     "there where only that fits host-memory-budget, without "
                     "one false; false (the default)"),
      llvm::cl::values(clEnumValN(AutoBool::False, "false", "master shards in host memory"),
                       clEnumValN(AutoBool::True, "true", "master shards in the swap file"),
                       clEnumValN(AutoBool::Auto, "auto", "the search decides")),
      llvm::cl::init(AutoBool::False)};
  Option<bool> offloadOverlap{
      *this, "offload-overlap",
      llvm::cl::desc("with offload=optimizer and overlap: each host update "
                     "runs asynchronously beside the backward pass as soon "
                     "as its gradient is on the host (false: all after it)"),
      llvm::cl::init(true)};
  Option<AutoBool> offloadPrefetch{
      *this, "offload-prefetch",
      llvm::cl::desc("with offload=optimizer|all and overlap: true runs each "
                     "copy of offloaded storage to the device on the copy "
                     "stream, issued one copy ahead of its use (it costs one "
                     "more copy's device memory); false runs it on the compute "
                     "stream right before its use; auto (the default): with "
                     "memory-budget the search weighs both, without one true"),
      llvm::cl::values(clEnumValN(AutoBool::False, "false", "copied at the use"),
                       clEnumValN(AutoBool::True, "true", "copied one copy ahead"),
                       clEnumValN(AutoBool::Auto, "auto", "the search decides")),
      llvm::cl::init(AutoBool::Auto)};
  Option<unsigned> offloadPrefetchDepth{
      *this, "offload-prefetch-depth",
      llvm::cl::desc("with offload-prefetch: the copies to the device in "
                     "flight at once (1 to 8), each issued where the copy "
                     "this many before it is read; each more costs one more "
                     "copy's device memory. Unset: 1, and with memory-budget "
                     "the search tries its fastest schedules with 2 to 4"),
      llvm::cl::init(1)};
  Option<AutoBool> offloadNextStep{
      *this, "offload-next-step",
      llvm::cl::desc("with offload=optimizer and overlap: true joins the host "
                     "updates in the next step, each right before its unit's "
                     "first use there, so they run beside the next step's "
                     "forward pass (exact; it costs host memory: with clipping "
                     "or loss scaling the updates can start only after the "
                     "whole backward pass); auto (the default): with "
                     "memory-budget the search weighs both, without one false"),
      llvm::cl::values(clEnumValN(AutoBool::False, "false", "joined in their step"),
                       clEnumValN(AutoBool::True, "true", "joined in the next step"),
                       clEnumValN(AutoBool::Auto, "auto", "the search decides")),
      llvm::cl::init(AutoBool::Auto)};
  Option<std::string> offloadActivations{
      *this, "offload-activations",
      llvm::cl::desc("true: keep the activations the backward pass reads in "
                     "host memory between the passes (fsdp-offload-activations; "
                     "with recompute=unit: each unit's input); auto (with "
                     "memory-budget): the search decides; false"),
      llvm::cl::init("false")};
  Option<std::string> plan{*this, "plan",
                           llvm::cl::desc("write the plan file to this path"),
                           llvm::cl::init("")};
  Option<bool> report{*this, "report",
                      llvm::cl::desc("print the per-rank memory report"),
                      llvm::cl::init(true)};
};

/// Adds the whole pipeline (autodiff, optimizer, memory plan and, when
/// options.plan is set, the plan export) to `pm`.
void buildFsdpPipeline(OpPassManager &pm, const FsdpPipelineOptions &options);

/// Registers --fsdp-pipeline.
void registerFsdpPipeline();

} // namespace mlir::fsdp

#endif // FSDP_COMPILER_PIPELINE_H
