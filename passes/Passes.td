//===- Passes.td - the fsdp compiler's passes ----------------*- tablegen -*-===//
//
// The passes of the pipeline, in the order buildFsdpPipeline runs them. Each
// description says what must hold before, what holds after, and shows IR.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_TD
#define FSDP_PASSES_TD

include "mlir/Pass/PassBase.td"

def FsdpMixedPrecision : Pass<"fsdp-mixed-precision", "::mlir::ModuleOp"> {
  let summary = "mixed precision: bf16 compute and collectives, f32 master";
  let description = [{
    FSDP2's MixedPrecisionPolicy. Parameters stay f32 symbols: the sharded
    master copy that the optimizer updates in f32, with f32 optimizer
    state. The pass runs before fsdp-autodiff and retypes the model
    function: every `fsdp.get_param` is followed by an `fsdp.cast` to
    `param-dtype`, and every op with an operand in `param-dtype` (or
    reading a float input) computes in it: f32 operands cast once, f32
    results retyped. A float input only a loss reads (a regression
    target) stays f32. Loss ops read f32 (their operands are cast back, as
    in autocast's fp32 list) and the function returns the f32 loss.
    fsdp-autodiff then derives a backward pass in the compute dtype (a
    cast's VJP is the cast back), so each gradient reaches `fsdp.set_grad`
    as a cast to f32.

    The module attribute `fsdp.mixed_precision` = {param_dtype,
    reduce_dtype} carries the rest of the policy to fsdp-shard, which
    - gathers each unit in the dtype its reads are cast to: stage 3 casts
      the f32 shard BEFORE its all-gather (the all-gather and the gathered
      buffer are half the bytes); stages 0-2 cast the whole unit once
      where it is first read (the unit's storage stays the f32 master, so
      stages 1/2 still all-gather updated f32 shards);
    - packs each unit's gradients in `reduce-dtype` (the bf16 gradients as
      they are, or their f32 casts), reduce-scatters / all-reduces them in
      that dtype, and casts the reduced shard to f32 right before the
      unit's f32 update (before the squared norm with clipping).

    `stochastic-rounding=true` (bf16 only; the policy carries
    `stochastic_rounding`): fsdp-shard marks each trainable unit's cast of
    its master parameters `{stochastic, key = unit}`, so the bf16 copy the
    step computes with is the f32 master rounded up with probability equal
    to the fraction dropped (unbiased; llm.c's stochastic_rounding). The
    draw is keyed by the run's seed, the step, the unit and the element's
    index in the unit, so N ranks round exactly as one rank, and both
    gathers of a step (stage 3's forward and backward) see one copy.
    Frozen units and the casts of activations round to nearest.

    `master-dtype=bf16` (with `param-dtype=bf16`; the policy carries
    `master_dtype`): no f32 master copy. fsdp-shard stores each trainable
    unit in bf16, gathers it without a cast, and its update widens the
    parameters, steps in f32 (with f32 gradients and the state dtype
    fsdp-insert-optimizer chose) and rounds the new parameters to bf16
    once: stochastically with `stochastic-rounding=true` (the update's
    `stochastic_param`, the cast's draws: the pure-bf16 recipe of
    torchao's bf16 stochastic-rounding optimizers), to nearest otherwise,
    where an update below half a bf16 ulp is lost. Parameters then cost 2
    bytes each instead of 4 (with 8-bit moments and bf16 gradients, 2 + 2
    + 2 bytes a parameter instead of ZeRO's 2 + 2 + 12). LAMB (its trust
    ratios read f32 parameters) is refused by fsdp-shard.

    `param-dtype=f32` (the pipeline's default) leaves the model as it is;
    with `reduce-dtype=bf16` only the gradient reduction changes.

    `param-dtype=f16` (and `reduce-dtype=f16`): f16's 5 exponent bits
    underflow small gradients, so f16 implies dynamic loss scaling
    (`loss-scale=dynamic`, also available with bf16/f32, where a
    power-of-two scale changes no bit). The policy then carries
    `loss_scale = {init, growth_interval}`; fsdp-autodiff seeds d(loss)
    with a `loss_scale` argument of @train_step, and fsdp-insert-optimizer
    unscales (`fsdp.grad_coef`) and skips the update on overflow
    (`skip_nonfinite`). The runtime updates the scale as PyTorch's
    GradScaler: x0.5 after an overflow, x2 after `growth_interval`
    overflow-free steps.

    Before: the model in f32. After: casts at reads and inputs, compute in
    bf16, the loss in f32; `fsdp.mixed_precision` on the module. After
    fsdp-shard (stage 3, reduce-dtype=f32):

    ```mlir
    // model, before
    %w = fsdp.get_param @w : tensor<8x4xf32>
    %y = fsdp.matmul %x, %w transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
    %l = fsdp.mse_loss %y, %t : tensor<2x8xf32> -> tensor<f32>
    // model, after fsdp-mixed-precision
    %xb = fsdp.cast %x : tensor<2x4xf32> -> tensor<2x4xbf16>  // x: an input
    %w = fsdp.get_param @w : tensor<8x4xf32>
    %wb = fsdp.cast %w : tensor<8x4xf32> -> tensor<8x4xbf16>
    %y = fsdp.matmul %xb, %wb transpose_rhs : (tensor<2x4xbf16>, tensor<8x4xbf16>) -> tensor<2x8xbf16>
    %yf = fsdp.cast %y : tensor<2x8xbf16> -> tensor<2x8xf32>
    %l = fsdp.mse_loss %yf, %t : tensor<2x8xf32> -> tensor<f32>
    // @train_step after fsdp-shard (world-size=2, stage=3)
    %s = fsdp.get_unit @root : tensor<16xf32>
    %sb = fsdp.cast %s : tensor<16xf32> -> tensor<16xbf16>
    %f = fsdp.all_gather %sb : tensor<16xbf16> -> tensor<32xbf16>
    %wv = fsdp.view %f offset = 0 : tensor<32xbf16> -> tensor<8x4xbf16>
    ...
    %dw = fsdp.cast %dwb : tensor<8x4xbf16> -> tensor<8x4xf32>
    %g = fsdp.pack %dw offsets = [0] : (tensor<8x4xf32>) -> tensor<32xf32>
    %gs = fsdp.reduce_scatter %g {reduce = "mean"} : tensor<32xf32> -> tensor<16xf32>
    ```
  }];
  let options = [
    Option<"paramDtype", "param-dtype", "std::string", /*default=*/"\"bf16\"",
           "compute dtype of parameters and activations: bf16 | f16 | f32">,
    Option<"reduceDtype", "reduce-dtype", "std::string", /*default=*/"\"f32\"",
           "dtype of the gradient reduce-scatter / all-reduce: f32 | bf16 | f16">,
    Option<"stochasticRounding", "stochastic-rounding", "bool", /*default=*/"false",
           "round the master parameters to bf16 stochastically (unbiased) "
           "where they are cast for compute, as llm.c writes its bf16 "
           "parameters (with master-dtype=bf16: where the update writes "
           "them); param-dtype=bf16 only">,
    Option<"masterDtype", "master-dtype", "std::string", /*default=*/"\"f32\"",
           "f32 | bf16: the trainable parameters' stored dtype (bf16: no "
           "f32 master, the update steps in f32 and rounds the parameters "
           "back to bf16; param-dtype=bf16 only)">,
    Option<"lossScale", "loss-scale", "std::string", /*default=*/"\"\"",
           "dynamic | none (default: dynamic with f16, none otherwise)">,
    Option<"lossScaleInit", "loss-scale-init", "double", /*default=*/"65536.0",
           "initial loss scale (a power of two; GradScaler's 2^16)">,
    Option<"lossScaleGrowthInterval", "loss-scale-growth-interval", "int64_t",
           /*default=*/"2000",
           "overflow-free steps before the scale grows">,
    Option<"lossScaleGrowthFactor", "loss-scale-growth-factor", "double",
           /*default=*/"2.0",
           "factor of a growth (a power of two above 1; GradScaler's 2)">,
    Option<"lossScaleBackoffFactor", "loss-scale-backoff-factor", "double",
           /*default=*/"0.5",
           "factor after an overflow (a power of two below 1; GradScaler's 0.5)">,
  ];
  let statistics = [
    Statistic<"numCasts", "casts", "Casts inserted">,
    Statistic<"numRetyped", "retyped", "Results retyped to the compute dtype">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpPadClasses : Pass<"fsdp-pad-classes", "::mlir::ModuleOp"> {
  let summary = "widens a classifier head to a multiple of 64 columns";
  let description = [{
    llm.c's padded vocabulary (50257 -> 50304), as a rewrite of the model
    function before fsdp-autodiff: a `matmul` by a [V, C] (or [C, V])
    weight whose only user is `cross_entropy` (through reshapes) multiplies
    by the weight concatenated with zero rows up to a multiple of
    `multiple`, and the cross-entropy gets `classes = V`, which leaves the
    padding columns out of the softmax and gives them a zero gradient. The
    loss and every gradient are the unpadded head's; the head's GEMMs and
    the cross-entropy kernels run on rows of aligned width. Padding is
    skipped when it would add more than V/16 columns.

    ```mlir
    %z = fsdp.fill {value = 0.0 : f64} : tensor<5x64xf32>
    %wp = fsdp.concat %w, %z dim = 0 : (tensor<251x64xf32>, tensor<5x64xf32>) -> tensor<256x64xf32>
    %l = fsdp.matmul %h, %wp transpose_rhs : (tensor<32x64xf32>, tensor<256x64xf32>) -> tensor<32x256xf32>
    %ce = fsdp.cross_entropy %l, %y {classes = 251 : i64} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
    ```
  }];
  let options = [
    Option<"multiple", "multiple", "int64_t", /*default=*/"64",
           "pad the class dimension to a multiple of this (0: off)">,
  ];
  let statistics = [
    Statistic<"numPadded", "padded", "Classifier heads padded">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpAutodiff : Pass<"fsdp-autodiff", "::mlir::ModuleOp"> {
  let summary = "derives the training step: loss and every parameter gradient";
  let description = [{
    Reverse-mode differentiation of the function marked `fsdp.model`. The
    pass clones it into `@train_step` (the model function is kept for
    evaluation), seeds d(loss) = 1 and walks the ops backwards, emitting a
    vector-Jacobian product per op, in the same dialect. Adjoints of a value
    used several times are summed; a parameter read twice (tied weights)
    gets the sum of both contributions. Only values that depend on a
    trainable parameter are differentiated, so no gradient is computed for
    the batch or for frozen parameters. Every trainable parameter ends with
    exactly one `fsdp.set_grad`.

    Before: one `func.func` with `fsdp.model`, returning a 0-d f32 loss.
    After: `@train_step` returns the loss and ends with one `fsdp.set_grad`
    per trainable parameter.

    ```mlir
    // %y = fsdp.matmul %x, %w transpose_rhs : ...
    // becomes, in the backward part:
    %dw = fsdp.matmul %dy, %x transpose_lhs : ...
    fsdp.set_grad @w = %dw : tensor<8x4xf32>
    ```
  }];
  let options = [
    Option<"modelName", "model", "std::string", /*default=*/"\"\"",
           "Name of the model function (default: the one marked fsdp.model)">,
  ];
  let statistics = [
    Statistic<"numGradOps", "grad-ops", "Ops emitted for the backward pass">,
    Statistic<"numGrads", "grads", "Parameters that got a gradient">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpGradAccum : Pass<"fsdp-grad-accum", "::mlir::ModuleOp"> {
  let summary = "gradient accumulation: K micro-batches per optimizer step";
  let description = [{
    The model is written for a micro-batch of B rows. With
    `micro-batches` = K the step takes K*B rows of every input and runs K
    copies of the forward and backward pass, copy k reading rows
    [k*B, (k+1)*B) through `fsdp.microbatch` (an alias, no copy). Each
    parameter's gradient is the sum of the K micro-batch gradients, added
    into one accumulator (in place) right after each is computed, times
    1/K; the loss is the mean of the K micro-batch losses. The step thus
    computes exactly the loss and gradient of one batch of K*B rows (a
    mean over rows) while only one micro-batch's activations are live at
    a time: the copies run one after the other, so the memory planner
    reuses the activation buffers.

    Why a pass of its own, placed after fsdp-autodiff: autodiff sees one
    forward pass and derives one backward pass; accumulation is a
    schedule of K such pairs, and cloning the differentiated step keeps
    each backward right after its own forward (differentiating a K-fold
    forward would run all K forwards first and keep all activations).
    Before fsdp-insert-optimizer, the optimizer, clipping and sharding see
    one gradient per parameter, as without accumulation.

    The accumulation adds and the 1/K scales carry `fsdp.accum`; `fsdp.grad_accum` on @train_step records K and the
    reduction mode (`reduce`), which fsdp-shard reads:
    - `step` (default; DDP no_sync): gradients accumulate whole and are
      reduced once per step;
    - `microbatch` (FSDP, ZeRO-2/3 memory): fsdp-shard reduces each
      micro-batch's gradients at once (reduce-scatter, or all-reduce at
      stage 0) and accumulates them into the reduced (sharded) buffer, so
      whole gradients never persist across micro-batches.
    With K = 1 the pass changes nothing.

    Before: @train_step from fsdp-autodiff (one `fsdp.set_grad` per
    trainable parameter, no optimizer). After: inputs of K*B rows, K
    forward/backward copies, still one `fsdp.set_grad` per parameter.

    ```mlir
    // micro-batches=2, the model reads %x : tensor<4x8xf32>
    %x0 = fsdp.microbatch %x index = 0 : tensor<8x8xf32> -> tensor<4x8xf32>
    // ... forward and backward of micro-batch 0: %l0, %g0
    %x1 = fsdp.microbatch %x index = 1 : tensor<8x8xf32> -> tensor<4x8xf32>
    // ... forward and backward of micro-batch 1: %l1, %g1
    %a = fsdp.add %g0, %g1 {fsdp.accum} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    %g = fsdp.scale %a {factor = 5.000000e-01 : f64, fsdp.accum} : tensor<8x4xf32>
    fsdp.set_grad @w = %g : tensor<8x4xf32>
    ```
  }];
  let options = [
    Option<"microBatches", "micro-batches", "int64_t", /*default=*/"1",
           "micro-batches per optimizer step (K >= 1; 1: no accumulation)">,
    Option<"reduce", "reduce", "std::string", /*default=*/"\"step\"",
           "step (reduce once per step) | microbatch (reduce each micro-batch)">,
  ];
  let statistics = [
    Statistic<"numCopies", "copies", "Forward/backward copies added">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpInsertOptimizer : Pass<"fsdp-insert-optimizer", "::mlir::ModuleOp"> {
  let summary = "adds SGD, AdamW or LAMB updates, optimizer state and clipping";
  let description = [{
    Replaces every `fsdp.set_grad` of `@train_step` by an optimizer update
    at the end of the step. Optimizer state becomes `fsdp.state` symbols
    (zero-initialized, one per trainable parameter and moment). The learning
    rate and the 1-based step count become arguments of `@train_step`
    (roles "lr" and "step") so that fsdp-run chooses the schedule. With
    `max-grad-norm` > 0 the gradients are first scaled by the global-norm
    clipping factor (torch.nn.utils.clip_grad_norm_ semantics), and the
    step returns the squared global norm after the loss (fsdp-run reports
    the norm, as clip_grad_norm_ returns it; with loss scaling it is the
    overflow signal too).

    Before: `@train_step` with `fsdp.set_grad` ops. After: no `fsdp.set_grad`
    remains (unless optimizer=none); each trainable parameter is written
    back once with `fsdp.set_param`.

    With `state-dtype=bf16` AdamW's and LAMB's two moments (or SGD's
    momentum buffer) are bf16 state (torchao's bf16 optimizer states; DeepSpeed and FSDP
    keep them f32): the optimizer state falls from 8 to 4 bytes a parameter
    (SGD's from 4 to 2), the f32 master parameters stay. The update runs in f32 and rounds the new moments once;
    `state-rounding=stochastic` (the default) rounds them stochastically,
    since to nearest a bf16 v no longer moves once (1 - beta2) g^2 is
    below half its last place (beta2 = 0.999: under 2^-9 of v).

    With `state-dtype=8bit` (AdamW, LAMB, and SGD with momentum) the two moments
    (the momentum buffer) of each f32 parameter are 8-bit codes in blocks
    of `state-block` elements with an f32 scale each (bitsandbytes' and
    torchao's 8-bit AdamW, bitsandbytes' 8-bit SGD;
    runtime/core/Moments8.h): about 2 bytes of optimizer state a
    parameter instead of 8 (SGD's: about 1 instead of 4). The buffer is
    coded as exp_avg is (signed). Each moment is one packed i8 state of
    shapes::quantizedBytes(n, block) bytes, and the update carries
    `state_block`; the update decodes, runs in f32 and encodes the new
    moments to the nearest code (LAMB's fsdp.lamb_norms decodes them too,
    and its trust ratio reads the f32 step's direction). fsdp-shard pads
    each unit to whole blocks per shard, so the blocks do not depend on
    the world size. `state-block=0` (the default) is 256.

    With `state-dtype=4bit` (AdamW) the moments are 4-bit codes, two a
    byte, in blocks of `state-block` (default 128, torchao's AdamW4bit;
    runtime/core/Moments4.h: exp_avg on the signed dynamic-exponent map,
    exp_avg_sq's root on the linear map without zero): about 1 byte of
    optimizer state a parameter instead of 8. The update carries
    `state_bits = 4` beside `state_block`.

    ```mlir
    %p2, %m2, %v2 = fsdp.adamw_update %p, %g, %m, %v, %lr, %step {...} : tensor<64xf32>
    fsdp.set_param @w = %p2 : tensor<64xf32>
    ```
  }];
  let options = [
    Option<"optimizer", "optimizer", "std::string", /*default=*/"\"adamw\"",
           "sgd | adamw | lamb | none (none keeps fsdp.set_grad: the step outputs gradients)">,
    Option<"momentum", "momentum", "double", /*default=*/"0.0", "SGD momentum">,
    Option<"dampening", "dampening", "double", /*default=*/"0.0", "SGD dampening">,
    Option<"nesterov", "nesterov", "bool", /*default=*/"false", "SGD Nesterov momentum">,
    Option<"weightDecay", "weight-decay", "double", /*default=*/"-1.0",
           "weight decay (default: 0.01 for AdamW and LAMB, 0 for SGD)">,
    Option<"weightDecayParams", "weight-decay-params", "std::string",
           /*default=*/"\"all\"",
           "all | matrices: decay only parameters of rank >= 2 (no decay for "
           "biases and norm gains, nanoGPT's and llm.c's AdamW groups)">,
    Option<"beta1", "beta1", "double", /*default=*/"0.9", "AdamW / LAMB beta1">,
    Option<"beta2", "beta2", "double", /*default=*/"0.999", "AdamW / LAMB beta2">,
    Option<"eps", "eps", "double", /*default=*/"1e-8", "AdamW / LAMB epsilon">,
    Option<"maxGradNorm", "max-grad-norm", "double", /*default=*/"0.0",
           "global-norm gradient clipping threshold (0: off)">,
    Option<"stateDtype", "state-dtype", "std::string", /*default=*/"\"f32\"",
           "f32 | bf16 | 8bit | 4bit: the optimizer's state (AdamW's and LAMB's moments, SGD's "
           "momentum buffer) stored in bf16 (f32 math; half its bytes), in 8-bit "
           "block codes (about a quarter), or AdamW's in 4-bit ones (about an eighth)">,
    Option<"stateRounding", "state-rounding", "std::string",
           /*default=*/"\"stochastic\"",
           "stochastic | nearest: how bf16 moments are rounded when written">,
    Option<"stateBlock", "state-block", "int64_t", /*default=*/"0",
           "with state-dtype=8bit|4bit: elements per block of codes with one f32 scale "
           "(a power of two in [32, 4096]; 0: 256 for 8bit, 128 for 4bit)">,
  ];
  let statistics = [
    Statistic<"numUpdates", "updates", "Parameters given an update">,
    Statistic<"numStates", "states", "Optimizer state tensors created">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpChunkLoss : Pass<"fsdp-chunk-loss", "::mlir::ModuleOp"> {
  let summary = "computes the LM head and its cross-entropy in row chunks (no [tokens, V] logits)";
  let description = [{
    Liger-Kernel's fused linear cross-entropy, as a rewrite of the
    differentiated step: the classifier head `%l = matmul %h, %w` feeding
    `cross_entropy %l, %y`, its gradient `cross_entropy_grad %l, %y, %s`
    and that gradient's readers (the input gradient `matmul %dl, %w`, the
    weight gradient `matmul %dl, %h transpose_lhs`, a bias gradient
    `sum_to %dl`) are computed for `chunks` slices of the rows (tokens) in
    turn. Chunk i reads rows [r_i, r_i + m_i) of %h and %y through views (no
    copies), computes its [m_i, V] logits, loss, logits gradient, its rows
    of the input gradient and its term of the weight (and bias) gradient,
    and the next chunk starts once its logits are dead: the memory plan
    gives every chunk the same few [m_i, V] bytes instead of one [tokens,
    V] buffer, the largest activation of a language model (GPT-2 at B=32,
    T=1024: 3.3 GB in bf16).

    The input-gradient rows are concatenated; the weight- and bias-gradient
    terms are summed in f32 (the operands' type for f32 models), in place
    (marked `fsdp.chunk_accum`), and cast back where the unchunked gradient
    was narrower (fsdp-fuse-epilogues then drops the round trip where mixed
    precision casts that gradient to f32 again). Losses: with a `normalizer` (ignore_index) each chunk's
    is its kept sum over the step's count and they add up; without, chunk
    i's mean is weighed by m_i / tokens, and so is its gradient's seed. The
    same values as the unchunked head up to the order of the sums (the
    weight gradient's over rows, the loss's over chunks): not bitwise.

    Runs after fsdp-autodiff and before fsdp-grad-accum (which then clones
    the chunked head into every micro-batch; after it, a micro-batch's
    loss is summed before its gradient and the head is refused). The
    head's backward now runs before the step's loss is known, so
    fsdp-fuse-epilogues fuses each chunk's cross-entropy and gradient
    (cross_entropy_fused), and the passes that split the step at its loss
    count the head's backward with the forward pass. `chunks` is a
    positive count (1: off; at most one chunk per row) or `auto`: the
    fewest rows, a power of two, whose [rows, V] logits take at least the
    f32 weight gradient's [V, C] bytes (4 C / logit bytes rows; 2048 for
    GPT-2 in bf16). Every chunk's weight-gradient GEMM reads and writes
    the f32 sum (fsdp-fuse-epilogues makes it accumulate in place): with
    smaller chunks that traffic would outgrow the chunk's own logits'
    (Liger's rule, logits the size of the head's input, passes over the
    sum 4x as often for GPT-2).
    A count > 1 on a step without such a head is an error; auto leaves a
    step without one alone.

    ```mlir
    %hf = fsdp.reshape %h : tensor<128x64xf32> -> tensor<8192xf32>
    %h0 = fsdp.view %hf offset = 0 : tensor<8192xf32> -> tensor<64x64xf32>
    %y0 = fsdp.view %y offset = 0 : tensor<128xi32> -> tensor<64xi32>
    %l0 = fsdp.matmul %h0, %w transpose_rhs : (tensor<64x64xf32>, tensor<256x64xf32>) -> tensor<64x256xf32>
    %c0 = fsdp.cross_entropy %l0, %y0 : (tensor<64x256xf32>, tensor<64xi32>) -> tensor<f32>
    %d0 = fsdp.cross_entropy_grad %l0, %y0, %s : tensor<64x256xf32>, tensor<64xi32>
    ```
  }];
  let options = [
    Option<"chunks", "chunks", "std::string", /*default=*/"\"1\"",
           "row chunks of the classifier head and its loss: a count >= 1 "
           "(1: off) or auto (chunk logits about the f32 weight gradient's size)">,
  ];
  let statistics = [
    Statistic<"numChunked", "chunked", "Classifier heads chunked">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpGroupUnits : Pass<"fsdp-group-units", "::mlir::ModuleOp"> {
  let summary = "auto-wrap: assigns every parameter to an FSDP unit";
  let description = [{
    Sets the `unit` of every `fsdp.param`, the grouping fsdp-shard packs
    into one collective per unit.
    - `layer` (default): keeps the units the model marks (one per layer);
      unmarked parameters form the root unit.
    - `size`: walks the parameters in declaration order and closes a unit
      once it holds at least `min-unit-numel` elements (PyTorch's
      size_based_auto_wrap_policy); units are named "group.K".
    - `none`: one unit for the whole model.
    With `layer`, `layers-per-unit=K` merges K consecutive marked units
    into one named "first..last" (a bigger bucket: fewer, larger
    collectives, more gathered memory); the memory-budget search picks K.

    ```mlir
    // policy=size min-unit-numel=1000
    fsdp.param @a : tensor<40x40xf32> init("normal", 0.02) unit "group.0"
    ```
  }];
  let options = [
    Option<"policy", "policy", "std::string", /*default=*/"\"layer\"",
           "layer | size | none">,
    Option<"minUnitNumel", "min-unit-numel", "int64_t", /*default=*/"1000000",
           "size policy: smallest number of elements per unit">,
    Option<"layersPerUnit", "layers-per-unit", "int64_t", /*default=*/"1",
           "layer policy: merge this many consecutive marked units into one "
           "(named first..last)">,
  ];
  let statistics = [
    Statistic<"numUnits", "units", "Units formed">,
  ];
}

def FsdpRecompute : Pass<"fsdp-recompute", "::mlir::ModuleOp"> {
  let summary = "activation recomputation: re-runs forward ops in backward";
  let description = [{
    A forward value the backward pass reads (a saved activation) lives from
    the forward pass to its last backward read. This pass picks forward ops
    to recompute and clones each into the backward pass just before the
    first backward read of its result, so the original dies in the forward
    pass; the clones carry `fsdp.recompute`. Recomputation runs the same
    kernels on the same inputs, so losses and parameters are bitwise equal
    to those without it.
    - `none` (default): nothing changes.
    - `unit` (activation checkpointing per FSDP unit): the forward pass is
      cut into one segment per run of ops reading one unit's parameters;
      only each segment's outputs (the next unit's input) stay saved, and
      the first backward read of anything else of the segment re-runs the
      segment's forward (the ops the backward needs) at that point. The
      segment computing the loss is kept: its backward follows at once.
    - `selective` (Korthikanti et al. 2022): matmul outputs stay saved;
      cheap ops (elementwise, bias, silu, layer and RMS norm, rope,
      softmax, attention, reshapes and slices) are recomputed when every
      operand is available in the backward pass anyway (a parameter, an
      input, a saved value or itself recomputed), so no value is kept
      across the forward pass that was not kept before.

    Where it runs: after fsdp-group-units (the units are final) and before
    fsdp-shard. After autodiff the backward pass is explicit IR, so a saved
    activation is a forward value with a backward reader and recomputing
    it is a clone. fsdp-shard treats a clone's parameter reads as backward
    reads (they come after the loss): at stage 3 they read the parameters
    all-gathered again for the backward pass, and that all-gather is
    placed before the unit's first backward read, i.e. before the
    recomputed forward. With gradient accumulation each micro-batch is
    handled on its own.

    Before: @train_step from fsdp-autodiff (with or without the optimizer),
    no `fsdp.unit`. After: no backward op reads a value of R; the memory
    plan counts fewer activation bytes.

    ```mlir
    // recompute=selective: the relu output is not saved
    %h = fsdp.bias_add %m, %b : tensor<8x4xf32>, tensor<4xf32>
    %r = fsdp.relu %h : tensor<8x4xf32>
    // ... loss, then in the backward pass:
    %r2 = fsdp.relu %h {fsdp.recompute} : tensor<8x4xf32>
    %dw = fsdp.matmul %dy, %r2 transpose_lhs : ...
    ```
  }];
  let options = [
    Option<"policy", "policy", "std::string", /*default=*/"\"none\"",
           "none | unit | selective">,
    Option<"units", "units", "int64_t", /*default=*/"-1",
           "unit policy: recompute only the first K units of each "
           "micro-batch (-1: all; the memory-budget search picks K)">,
  ];
  let statistics = [
    Statistic<"numRecomputed", "recomputed-ops",
              "Forward ops cloned into the backward pass">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}
def FsdpShard : Pass<"fsdp-shard", "::mlir::ModuleOp"> {
  let summary = "shards gradients, optimizer state and parameters (stage 0-3)";
  let description = [{
    Rewrites @train_step for a 1-D mesh of `world-size` ranks. Parameters
    of each unit are packed into one flat `fsdp.unit` (padded to a multiple
    of the world size) that the model reads through `fsdp.view`; the
    optimizer (elementwise) runs once per unit on flat tensors.
    - stage 0 (DDP): each unit's gradients are packed and all-reduced
      (mean) as soon as the unit's backward is complete; the whole update
      runs on every rank.
    - stage 1 (weight-update sharding, Xu et al. 2020): after the backward
      pass each unit's gradients are reduce-scattered; each rank updates
      its 1/N of the parameters with its 1/N of the optimizer state and the
      new parameters are all-gathered.
    - stage 2: as 1, but each unit is reduce-scattered as soon as its
      gradients are complete, so the full gradients do not all coexist.
    - stage 3 (FSDP / ZeRO-3): only the shard of each unit persists; it is
      all-gathered before its first forward use and, with
      `reshard-after-forward`, freed after the forward and gathered again
      before its first backward use, except a unit that no other unit's
      gather separates from its backward (the last unit of the forward,
      like FSDP2's root), which keeps its forward gather.
      `reshard-after-forward=G` (1 < G < S, G divides S, S the shard
      group) reshards to an intermediate group instead (FSDP2's
      `reshard_after_forward=G`, ZeRO++'s hpZ): after the unit's last
      forward read each rank copies its 1/G of the gathered parameters
      (`fsdp.shard_view {group = "reshard"}` + `fsdp.pack`), and the
      backward gathers them within its G consecutive ranks (`group =
      "reshard"`, recorded as `reshard = G` in `fsdp.mesh`): a backward
      all-gather within one node instead of across the shard group, for
      1/G of the unit held between forward and backward. G = S is true,
      G = 1 false. `reshard-units=K` reshards only the first K units of
      the forward (per unit, like FSDP2's reshard_after_forward on each
      module): the later units keep their forward gather.
      With gradient accumulation every micro-batch gathers each unit for
      itself; `reshard-after-backward=false` (FSDP2's
      `set_reshard_after_backward(False)`) lets a micro-batch's forward
      read the unit's last gather of the micro-batch before (its backward
      gather, or with reshard-after-forward=false its forward one): K - 1
      forward all-gathers of every unit fewer over K micro-batches (with
      reshard-after-forward=false one gather a unit a step), for the units
      staying gathered across each micro-batch boundary.
    Global-norm clipping becomes a squared norm over the local shards plus
    a scalar all-reduce. With more than one rank the loss is all-reduced
    (mean) so every rank reports the global loss.

    Hybrid sharding (`mesh=RxS`, FSDP2's HSDP, DeepSpeed's MiCS): ranks
    form R replicas of S consecutive ranks each. Everything above happens
    inside each replica (`group = "shard"` on the collectives: units are
    padded to a multiple of S, each rank keeps 1/S), and each gradient
    shard is then all-reduced (mean) across the R ranks holding that shard
    (`group = "replica"`), so the replicas stay identical. The mean over S
    followed by the mean over R is the mean over all R*S ranks. With S = 1
    nothing is sharded (stages 1 and 2 are stage 0).

    With `frozen-storage=compute` a frozen unit every read of which is in
    one 16-bit compute dtype (fsdp-mixed-precision) stores that dtype: its
    values rounded once, when stored, instead of by the cast before each
    read (the same bits reach compute; the storage and its gathers are
    half the bytes, and no cast is left).

    Before: per-parameter updates from fsdp-insert-optimizer. After: no
    `fsdp.get_param` / `fsdp.set_param` remain in @train_step; collectives
    are `fsdp.all_gather`, `fsdp.reduce_scatter`, `fsdp.all_reduce`.

    ```mlir
    %s = fsdp.get_unit @"layers.0" : tensor<66xf32>
    %f = fsdp.all_gather %s : tensor<66xf32> -> tensor<264xf32>
    %w = fsdp.view %f offset = 0 : tensor<264xf32> -> tensor<8x4xf32>
    ```
  }];
  let options = [
    Option<"worldSize", "world-size", "int64_t", /*default=*/"1",
           "number of ranks (1-D mesh)">,
    Option<"stage", "stage", "int64_t", /*default=*/"3",
           "0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)">,
    Option<"reshardAfterForward", "reshard-after-forward", "std::string",
           /*default=*/"\"true\"",
           "stage 3: true (free gathered parameters after forward, gather "
           "again for backward), false (keep them), or G (keep 1/G of each "
           "unit after forward and gather it within G consecutive ranks for "
           "backward: FSDP2's reshard_after_forward=G, ZeRO++'s hpZ)">,
    Option<"mesh", "mesh", "std::string", /*default=*/"\"\"",
           "RxS: hybrid sharding on a 2-D mesh of R replicas x S shards "
           "(R*S = world-size); empty: 1-D mesh (S = world-size)">,
    Option<"reshardUnits", "reshard-units", "int64_t", /*default=*/"-1",
           "stage 3 with reshard-after-forward true or G: only the first K "
           "units of the forward reshard, the others keep their gather "
           "(-1: all reshard)">,
    Option<"reshardAfterBackward", "reshard-after-backward", "bool", /*default=*/"true",
           "stage 3 with gradient accumulation: false keeps each unit's last "
           "gather of a micro-batch for the next micro-batch's forward "
           "(FSDP2's set_reshard_after_backward(False)): fewer all-gathers, "
           "the units gathered across the micro-batch boundary">,
    Option<"offload", "offload", "std::string", /*default=*/"\"none\"",
           "optimizer or all: stages 1/2 keep every trainable unit as its "
           "master shard (gathered once per step), the layout fsdp-offload "
           "moves to host memory; none">,
    Option<"frozenStorage", "frozen-storage", "std::string", /*default=*/"\"declared\"",
           "compute: a frozen unit read only in one 16-bit compute dtype "
           "(fsdp-mixed-precision) stores it (each value rounded once, as "
           "every read would round it: the same bits, half the bytes); "
           "declared: its parameters' dtype">,
    Option<"weightQuantization", "weight-quantization", "std::string",
           /*default=*/"\"none\"",
           "int8: each parameter all-gather of a sharded unit moves its shard "
           "quantized to int8 in blocks with an f32 scale each, dequantized "
           "into the compute dtype after it (ZeRO++'s qwZ: a byte a "
           "parameter on the wire instead of 2 or 4); none">,
    Option<"gradientQuantization", "gradient-quantization", "std::string",
           /*default=*/"\"none\"",
           "int8: each gradient reduce-scatter of a sharded unit becomes "
           "an all-to-all of int8 values in blocks with an f32 scale each "
           "(every rank's part quantized on its own), dequantized and "
           "summed in f32 by the rank that owns the part (ZeRO++'s qgZ: "
           "about a byte a gradient on the wire instead of 2 or 4); none">,
    Option<"quantizationBlock", "quantization-block", "int64_t", /*default=*/"256",
           "weight-quantization / gradient-quantization=int8: values "
           "sharing one scale">,
    Option<"ranksPerNode", "ranks-per-node", "int64_t", /*default=*/"0",
           "gradient-quantization=int8: ranks on one node; a shard group of "
           "several whole nodes reduces in two levels (ZeRO++'s "
           "hierarchical qgZ: an int8 all-to-all within each node, summed "
           "and requantized, then one across nodes with 1/L of the bytes); "
           "0: one all-to-all over the shard group">,
  ];
  let statistics = [
    Statistic<"numCollectives", "collectives", "Collectives inserted">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpOffload : Pass<"fsdp-offload", "::mlir::ModuleOp"> {
  let summary = "optimizer offload: master shards, optimizer state and the update on the host";
  let description = [{
    ZeRO-Offload (DeepSpeed's `offload_optimizer`, FSDP2's
    CPUOffloadPolicy for the sharded parameters): every trainable unit
    with sharded storage (after fsdp-shard: stage 3, or stages 1/2 with
    `offload=optimizer`) becomes `offloaded`. With `offload=all` every
    frozen unit does too (DeepSpeed's `offload_param` for the weights a
    fine-tune does not train): its storage (the shard at stage 3, the
    whole unit at stages 1/2, in its stored dtype) lives in the host arena
    and is copied to the device before each use, as a trainable shard is;
    it has no update. Its f32 master shard and the
    optimizer state shadowing it live in the host arena, and its update
    (`fsdp.adamw_update` / `sgd_*`) is marked `fsdp.on_host` and runs on
    the host. The pass then inserts the copies the placement needs:
    - `fsdp.to_device` right before each device op that reads an
      offloaded shard (the cast or all-gather before each gather, every
      time: the device keeps no copy between uses);
    - `fsdp.to_host` for each device value a host update reads: the
      reduced gradient shard as soon as it is final when nothing else on
      the device reads it (right after it is computed; an async
      collective's wait moves up to just before the next collective of its
      kind is issued), so the device frees it during the backward pass;
      the learning rate, step and clipping coefficient once, before the
      first update that reads them.
    Every value is then either on the device or on the host, and every op
    reads and writes only its own side: fsdp-plan-memory checks it and
    places host values in a second arena. Runs last before
    fsdp-plan-memory, so the schedule's positions stay. The device saves
    the parameters (4 bytes per element of the shard) and the optimizer
    state (8 for AdamW) and pays one host-to-device copy of each shard per
    gather and one device-to-host copy of each gradient shard per step.

    With `overlap` (the default) each update then runs beside the backward
    pass instead of after it: it moves up to right after the last of its
    operands is ready (its gradient's copy; with clipping or loss scaling
    the coefficient, which comes after every gradient), is marked `async`
    (the runtime's host stream runs it while compute goes on), and an
    `fsdp.wait` on its parameter result joins it back right before the
    next async update is issued (the last one before the step ends): one
    update in flight, so the host arena holds one more gradient shard.
    An update never moves above a read of the storage it overwrites.

    With `next-step` (and overlap) no update is joined in its own step:
    every wait on an update's parameter result is replaced by a carried
    one at the top of the step, `fsdp.wait %s {carried}` on a read of the
    unit's storage, right before the first instruction that reads storage
    the update writes or computes one of its operands (the unit's
    `to_device` in the forward pass). The runtime joins there the update
    the previous step left running (nothing in the first step, or after
    a checkpoint, evaluation or the end of training, which finish them).
    The updates are issued in the order the next step needs them (the
    host stream runs them in issue order). So with clipping or loss scaling, whose updates can start only after
    the whole backward pass, the host updates run beside the next step's
    forward pass, each joined just before its unit is gathered: exact
    training (DeepSpeed's delayed parameter update instead trains the
    next step on the old parameters). The memory plan keeps each
    update's operands (host buffers) live through the whole step.

    With `prefetch` (the default) every copy of offloaded storage to the
    device (a trainable shard, a frozen unit) is marked `async`: the
    runtime runs it on the device's copy stream (DMA beside compute and
    the collectives) and an `fsdp.wait` right before its reader joins it.
    In program order each copy is issued right after the wait of the copy
    `prefetch-depth` copies before it (default 1: the previous one's), the
    first ones at the top of the step, never above the copy before it (the
    copy stream runs in issue order): the next copies run under the
    compute reading this one (`prefetch-depth` copies in flight; FSDP2's
    prefetch, for the host-to-device leg). A copy is never issued above a definition it
    reads (its storage read and views go along) nor above an op that
    writes its storage or joins a write of it (a write-back, a host
    update, its wait, a carried wait), and an update of its storage that
    comes before its reader (overlap placed it right after the copy) gets
    the wait before it instead: the copy reads exactly what the copy in
    place would have. The memory plan keeps the copy's device buffer live
    from its issue, so `prefetch-depth` more copies are live on the device;
    the memory-budget search weighs prefetch (`offload-prefetch=auto`) and
    tries its fastest prefetching schedules with 2 to 4 copies in flight
    (unless `offload-prefetch-depth` pins it). More than one helps where
    the copy stream would otherwise idle: behind a carried join (it runs
    in order, so the copies queued behind one wait with it) or beside
    compute that reads a small copy for long after a large one.

    With both, a carried wait right before a copy of its unit goes along
    with the copy and joins the copy stream instead of compute
    (`fsdp.wait %s {carried, copy_stream}`): the copy stream waits for the
    previous step's update, compute only for the copy (at its wait), so
    compute runs on through the units whose updates are done. Only where
    every other instruction touching that update's buffers (defining an
    operand, reading or writing storage it writes) is a later copy of it,
    a host op, or comes after the copy's wait; else the wait stays on
    compute where it was.

    With `nvme` (ZeRO-Infinity's optimizer offload to NVMe) the optimizer
    state of the offloaded units (Adam's two moments, SGD's momentum)
    leaves the host arena for a per-rank swap file: the pass marks each
    such `fsdp.state` `fsdp.nvme`, and fsdp-plan-memory gives it an offset
    in the file and every host instruction reading it a staging buffer in
    the host arena, live while the update is in flight. The runtime reads
    the state into the staging buffer on a swap-in stream once compute
    reaches the update and writes it back on a swap-out stream after it
    ([Note: swap pipeline] in runtime/core/Executor.cpp); the pass keeps
    `nvme-in-flight` async updates in flight (default 2: each joined
    before the one after the next), so one unit's state is read while the
    previous unit's update runs; 1 joins each before the next is issued,
    the least host memory. The host arena holds the master shards, the gradient copies and
    two updates' state in flight instead of all of it: about 4 bytes a
    parameter instead of 12 for AdamW.
    `nvme-read-ahead=R` (default 1) issues each update's read R updates
    on disk ahead, where the update R before it is issued (the first R at
    the step's start, so the drive reads during the forward pass instead
    of idling until the first gradient): fsdp-plan-memory keeps the
    staging buffer live from there (the plan's `swap_read_at`), R more
    updates' staging in the host arena; 0 reads once compute reaches the
    update.
    `nvme-params` (ZeRO-Infinity's offload_param) puts the master shards of
    the units whose state is on disk in the swap file too (with
    `offload=all` also every frozen unit's storage): the host arena then
    holds no parameter of theirs. fsdp-plan-memory gives each copy of such
    storage to the device (`fsdp.to_device`, of the shard or of a view of
    it) a staging buffer of the whole blocks its bytes span, read from the
    file first, and the update reads and writes the shard like its state;
    the reads ahead count these copies among the swapping instructions.
    `nvme-units=K` keeps only the state of the first K offloaded trainable
    units the step updates on disk (the backward pass's first: their
    swaps have the most of it left to hide behind) and the rest in the
    host arena:
    between the two placements in host memory, with K/U of the drive's
    traffic (-1, the default: every unit's).

    ```mlir
    %s = fsdp.get_unit @"layers.0" : tensor<66xf32>
    %d = fsdp.to_device %s : tensor<66xf32>
    %f = fsdp.all_gather %d : tensor<66xf32> -> tensor<264xf32>
    ...
    %gh = fsdp.to_host %g : tensor<66xf32>
    %p, %m, %v = fsdp.adamw_update %s, %gh, ... {fsdp.on_host}
    ```
  }];
  let options = [
    Option<"mode", "offload", "std::string", /*default=*/"\"optimizer\"",
           "optimizer (offload every trainable sharded unit) | all (and every "
           "frozen unit's storage) | none">,
    Option<"overlap", "overlap", "bool", /*default=*/"true",
           "run each host update asynchronously as soon as its operands are "
           "ready (beside the backward pass), one in flight">,
    Option<"nextStep", "next-step", "bool", /*default=*/"false",
           "with overlap: the updates are not joined in their step but in "
           "the next one, each right before the first instruction that "
           "reads what it writes (beside the next step's forward pass)">,
    Option<"prefetch", "prefetch", "bool", /*default=*/"true",
           "each copy of offloaded storage to the device runs async on the "
           "copy stream, issued right after the previous one's wait (one "
           "copy ahead); false: each runs on the compute stream right "
           "before its reader">,
    Option<"prefetchDepth", "prefetch-depth", "unsigned", /*default=*/"1",
           "with prefetch: copies to the device in flight at once (1 to 8), "
           "each issued where the copy this many before it is joined; each "
           "more is one more copy's device memory">,
    Option<"warnings", "warnings", "bool", /*default=*/"true",
           "warn where an option combination buys nothing (the memory-budget "
           "search turns it off for its candidates)">,
    Option<"nvme", "nvme", "bool", /*default=*/"false",
           "ZeRO-Infinity: the offloaded units' optimizer state lives in a "
           "per-rank swap file (fsdp-run --nvme-dir), read into a staging "
           "buffer of the host arena for each update and written back after">,
    Option<"nvmeInFlight", "nvme-in-flight", "unsigned", /*default=*/"2",
           "with nvme: async updates in flight at once, each joined before the "
           "one this many after it is issued (1 to 8; 1: the least host "
           "memory, the drive idle during each update; 2: the next one's "
           "state is read while one runs, for one more update's staging)">,
    Option<"nvmeReadAhead", "nvme-read-ahead", "unsigned", /*default=*/"1",
           "with nvme: each update's state is read from the swap file this "
           "many updates on disk ahead of its own (0 to 8): from where the "
           "update this many before it is issued, the first ones from the "
           "step's start (beside the forward pass), each one more update's "
           "staging in host memory; 0: from when compute reaches the update">,
    Option<"nvmeUnits", "nvme-units", "int64_t", /*default=*/"-1",
           "with nvme: how many offloaded trainable units keep their state in "
           "the swap file, the first ones the step updates; the rest keep it "
           "in host memory (-1: all)">,
    Option<"nvmeParams", "nvme-params", "bool", /*default=*/"false",
           "with nvme: the master shards of the units whose state is on disk "
           "(and with offload=all every frozen unit's storage) live in the swap "
           "file too (ZeRO-Infinity's offload_param): each copy to the device "
           "reads its bytes into a staging buffer first">,
  ];
  let statistics = [
    Statistic<"numCopies", "copies", "Host/device copies inserted">,
    Statistic<"numAsync", "async-updates", "Host updates made asynchronous">,
    Statistic<"numCarried", "carried-updates", "Host updates joined in the next step">,
    Statistic<"numPrefetched", "prefetched-copies", "Copies to the device made asynchronous">,
    Statistic<"numCopyStreamJoins", "copy-stream-joins",
              "Carried waits joining the copy stream instead of compute">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpOffloadActivations : Pass<"fsdp-offload-activations", "::mlir::ModuleOp"> {
  let summary = "activation offload: saved activations wait in host memory for the backward pass";
  let description = [{
    Activation offloading (DeepSpeed's `cpu_checkpointing`, torchtitan's
    activation offload): every activation the forward pass saves for the
    backward pass is copied to the host arena as soon as it is computed
    (`fsdp.to_host` right after its definition) and back to the device
    right before its first backward read (`fsdp.to_device`); the backward
    reads the copy. The device copy then dies at its last forward read
    instead of living until the backward pass: with recomputation
    (`recompute=unit`) what is saved is one boundary activation per unit,
    and the device holds none of them across the step.

    Saved activation: a result of a forward op (one the loss depends on)
    that depends on the batch (a function argument), of at least
    `min-bytes`, that an op outside the forward pass reads, directly or
    through reshapes (each reshape a backward op reads is rebuilt on the
    device copy). Parameters, gathered parameters, their casts, storage
    reads, collectives, views and copies are not activations.

    The copies are exact, so training is bitwise unchanged; the device pays
    one copy each way per saved activation per step (on the GPU, DMA on the
    copy stream beside compute and the collectives). Runs after the schedule, the fusion and before
    fsdp-offload and fsdp-plan-memory, which places the host copies in the
    host arena.

    ```mlir
    %h = fsdp.layer_norm %x, %g, %b ...            // forward
    %hh = fsdp.to_host %h : tensor<4x8x64xf32>
    ...
    %hd = fsdp.to_device %hh : tensor<4x8x64xf32>  // backward
    %dg = fsdp.layer_norm_grad %dy, %hd, ...
    ```
  }];
  let options = [
    Option<"minBytes", "min-bytes", "int64_t", /*default=*/"4096",
           "smallest activation moved (smaller ones stay: a copy's fixed cost "
           "outweighs the bytes)">,
    Option<"mode", "mode", "std::string", /*default=*/"\"true\"",
           "true: offload; false: nothing (auto is the memory-budget search's "
           "and refused here)">,
    Option<"overlap", "overlap", "bool", /*default=*/"true",
           "async copies on the device's copy stream: device -> host waited "
           "for two copies later, host -> device issued one copy ahead in "
           "the backward pass; false: in-order copies on the compute stream">,
  ];
  let statistics = [
    Statistic<"numOffloaded", "offloaded", "Saved activations moved to host memory">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpSchedule : Pass<"fsdp-schedule", "::mlir::ModuleOp"> {
  let summary = "overlaps collectives with compute: async issue, waits, prefetch";
  let description = [{
    Makes every collective of @train_step asynchronous: it is issued where
    it stands (the runtime's communication thread runs it) and an
    `fsdp.wait` is placed right before the first read of its result, so the
    compute in between overlaps the communication. Reduce-scatters and
    gradient all-reduces thus overlap the rest of the backward pass. With
    `prefetch` (FSDP's forward prefetch and BACKWARD_PRE), the parameter
    all-gathers form one chain through forward and backward, and each is
    moved up to right after the wait of the one before it, so unit k+1's
    parameters travel while unit k computes; in the backward pass that
    moves unit k-1's gather past unit k's reduce-scatter. The memory plan
    then holds two units' parameters at once, and reports it.
    `prefetch-depth=D` issues each gather D units ahead (D all-gathers in
    flight; D + 1 units gathered at once); 0 is no prefetch. Waits move up
    to bound what is in flight: with prefetch D gathers plus one
    reduce-scatter or all-reduce (which runs while the next unit's backward
    computes), without it one collective. Gathers keep their order among
    themselves; every rank runs the same program, so every rank issues the
    collectives in the same order.

    Hierarchical qgZ (fsdp-shard `ranks-per-node`): with prefetch, each
    unit's node all-to-all is issued where its gradients are quantized and
    its tail (the node average, the requantization, the cross-node
    all-to-all, its average and an HSDP replica all-reduce) moves down to
    just before the next gradient exchange is issued (the next unit's node
    all-to-all) or its result is read, so the node exchange travels behind
    the next unit's backward instead of being waited for at once; the
    cross-node exchange stays in flight behind the next node exchange and
    is waited for before the next cross-node one (DeepSpeed runs both
    levels on its reduce stream behind the backward).

    `node-comm-stream` (default true) marks the node group's collectives
    `stream = "node"`: the runtime runs them on a second comm stream, so
    unit k's node exchange (NVLink) travels while unit k+1's cross-node
    exchange (the network) is still in flight instead of queueing behind
    it. Each stream keeps its collectives in program order on every rank.

    Per unit (FSDP2's per-module prefetch): `unit-prefetch-depth=U=D,...`
    gives every gather of unit U (forward, recomputation and backward)
    depth D instead of `prefetch-depth`; 0 gathers it where it is read.
    `U=F/B` sets the forward pass's gathers to depth F and the backward
    pass's (its gradients' and recomputation's: those whose gathered value
    is first read after a micro-batch's loss) to B, as FSDP2 sets a
    module's forward and backward prefetch apart.
    The memory-budget search uses it to take the unit prefetched at the
    step's peak off that peak, in the pass where it is in flight, while
    every other unit keeps the full depth.
    A gather of depth d is issued right after the wait of the gather d
    before it in the chain, and a gather's wait comes before the first
    later gather issued after it (d gathers on, where every depth is d).

    `backward-prefetch` (FSDP1's BackwardPrefetch) places the backward
    pass's gathers: `pre` (BACKWARD_PRE, the default) as above; `post`
    (BACKWARD_POST) right after the last read of the parameters gathered
    `prefetch-depth` gathers earlier, so unit k-1 is gathered once unit
    k's parameters are dead (after its input gradient; it still travels
    beside unit k's weight gradient and ahead of its reduce-scatter) and
    the memory plan can give it their bytes: the backward holds D units'
    gathered parameters instead of D + 1, for less overlap; `none` where
    they are read (the forward still prefetches). A backward gather is one
    after a micro-batch's loss and before the next micro-batch's first op
    (its `fsdp.microbatch` slices: fsdp-grad-accum runs them in sequence).

    Before: synchronous collectives from fsdp-shard. After: every
    collective carries `async` and is read only through `fsdp.wait`.

    ```mlir
    %f1 = fsdp.all_gather %s1 {async} : tensor<66xf32> -> tensor<264xf32>
    %w1 = fsdp.wait %f1 : tensor<264xf32>
    %f2 = fsdp.all_gather %s2 {async} : tensor<66xf32> -> tensor<264xf32>
    // unit 1 computes here while unit 2 is gathered
    %w2 = fsdp.wait %f2 : tensor<264xf32>
    ```
  }];
  let options = [
    Option<"prefetch", "prefetch", "bool", /*default=*/"true",
           "issue each all-gather ahead of its use (prefetch-depth units)">,
    Option<"prefetchDepth", "prefetch-depth", "int64_t", /*default=*/"1",
           "with prefetch: parameter all-gathers in flight at once (0: none)">,
    Option<"backwardPrefetch", "backward-prefetch", "std::string",
           /*default=*/"\"pre\"",
           "with prefetch, the backward pass's gathers (FSDP's BackwardPrefetch): "
           "pre (before the unit after it computes its gradients), post (once "
           "that unit's parameters are dead: one unit fewer gathered at once) "
           "or none (where read)">,
    Option<"overlapNodeExchange", "overlap-node-exchange", "bool", /*default=*/"true",
           "with prefetch, hierarchical qgZ: each unit's node all-to-all travels "
           "behind the next unit's backward (false: waited for at once)">,
    Option<"nodeCommStream", "node-comm-stream", "bool", /*default=*/"true",
           "hierarchical qgZ: the node group's exchanges run on a second comm "
           "stream beside the cross-node ones (false: one comm stream)">,
    ListOption<"unitPrefetchDepth", "unit-prefetch-depth", "std::string",
               "with prefetch: UNIT=D,... gives those units' gathers their own "
               "depth D >= 0 (0: gathered where read; FSDP2's per-module "
               "prefetch), UNIT=F/B the forward's F and the backward's B; the "
               "others keep prefetch-depth">,
  ];
  let statistics = [
    Statistic<"numAsync", "async-collectives", "Collectives made asynchronous">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpFuseEpilogues : Pass<"fsdp-fuse-epilogues", "::mlir::ModuleOp"> {
  let summary = "folds bias_add, gelu, gelu_grad, residual adds, SwiGLU and slice-gradient sums into fewer kernels";
  let description = [{
    The elementwise ops after a rank-2 matmul run in the matmul's kernel
    (cuBLASLt's BIAS, GELU_AUX_BIAS and DGELU_BGRAD epilogues on the GPU):
    - `bias_add(matmul(a, w), b)`, the product read by nothing else, becomes
      `matmul_bias(a, w, b)`; a tanh-form `gelu` of it joins as
      `matmul_bias ... gelu`, which also returns the pre-activation when
      something else (the backward's gelu_grad) reads it;
    - `gelu_grad(pre, matmul(a, b))`, the product read by nothing else,
      becomes `matmul_gelu_grad(a, b, pre)`, and a `sum_to` of it to its
      last dimension (the bias gradient) becomes that op's second result;
    - `layer_norm(add(a, b))` (one shape, the layer norm reading the sum
      first) becomes `residual_layer_norm(a, b, ...)` returning the sum and
      the norm, and `add(layer_norm_grad's input gradient, acc)` becomes
      `layer_norm_grad_acc(..., acc)` (the residual stream, llm.c's fused
      residual forward and accumulating layernorm backward); the same for
      an RMS norm: `residual_rms_norm`, `rms_norm_grad_acc` (a Llama's);
    - a sum of slice_grads tiling one dimension (the gradient of q, k and v
      sliced from one projection) becomes one concat of the pieces;
    - `mul(g, c)` with c a `clip_coef` / `grad_coef`, read only as an
      optimizer update's gradient, becomes that update's `grad_scale c`
      (the product is never written);
    - SwiGLU (Llama's MLP): autodiff's VJP of `mul(silu(g), u)` (two muls
      and a silu_grad) becomes `swiglu_grad(g, u, dh)`, and then the
      forward `mul(silu(g), u)` becomes `swiglu(g, u)`: silu(g) is neither
      written nor kept for the backward pass (one [tokens, ffn] tensor per
      layer less at the peak without recomputation);
    - widened products (mixed precision): a bf16 / f16 `matmul`'s
      product, both results of a `matmul_bias_grad`, `matmul_gelu_grad`'s
      bias gradient, a layer-norm gradient's d_gamma and d_beta, a
      `sum_to` or an `embedding_grad` (GPT-2's position and token embedding
      gradients), each
      read only by a cast to f32 (a parameter gradient cast for the f32
      reduction), are returned in f32 by the op itself and the casts go:
      the f32 sum written unrounded, one kernel and 6 bytes an element less
      (one bf16 rounding less than PyTorch's autocast: not its bits);
      likewise an f32 value cast to bf16 / f16, only sliced or reshaped,
      and cast back to f32 (fsdp-chunk-loss's head-gradient sum cast back
      to the gradient's type, fsdp-pad-classes's slice, the f32 gradient):
      the slice and reshape in f32, no casts (GPT-2: three passes over
      [50304, 768] become one);
    - `add(acc, matmul(a, b)) {fsdp.chunk_accum}` (fsdp-chunk-loss's sum of
      a weight gradient's terms), the product read by nothing else and of
      the sum's type (after the f32 products above), becomes `matmul a, b
      acc acc` (a GEMM with beta = 1), run in place over the sum: no [V, C]
      buffer for the product. The same for `{fsdp.accum}` (fsdp-grad-accum's
      sum of a weight gradient over the micro-batches; `accumulate=false`
      leaves those): Megatron's gradient-accumulation fusion. A
      `matmul_bias_grad` both of whose results are only so added (a
      linear layer with a bias, GPT's) becomes `matmul_bias_grad dy, x acc
      aw, ab` where it was (both sums defined before it): the GEMM adds
      into aw, the column sums into ab, each in place.
    f32 losses are bitwise those of the unfused step (the CPU kernels
    compute the replaced ops in the same order), except where a product
    accumulates into a sum (the GEMM adds its blocks of the contraction to
    the sum one by one). Runs after fsdp-schedule
    (after fsdp-recompute, whose selective recomputation it leaves alone),
    just before the memory plan.

    ```mlir
    // before
    %m = fsdp.matmul %x, %w transpose_rhs : (tensor<8x4xf32>, tensor<16x4xf32>) -> tensor<8x16xf32>
    %h = fsdp.bias_add %m, %b : tensor<8x16xf32>, tensor<16xf32>
    %g = fsdp.gelu %h : tensor<8x16xf32>
    // after (%h is read by the backward pass)
    %g, %h = fsdp.matmul_bias %x, %w, %b transpose_rhs gelu : (...) -> (tensor<8x16xf32>, tensor<8x16xf32>)
    ```
  }];
  let options = [
    Option<"accumulate", "accumulate", "bool", /*default=*/"true",
           "fsdp-grad-accum's sums over micro-batches: each later "
           "micro-batch's weight-gradient GEMM adds into the sum (beta = 1; "
           "Megatron's gradient-accumulation fusion)">,
  ];
  let statistics = [
    Statistic<"numFused", "fused-epilogues", "Epilogues folded into a matmul">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpSearchSchedule : Pass<"fsdp-search-schedule", "::mlir::ModuleOp"> {
  let summary = "chooses recompute, resharding, prefetch depth and unit size under a memory budget";
  let description = [{
    Runs in place of fsdp-group-units, fsdp-recompute, fsdp-shard and
    fsdp-schedule when the pipeline has a `memory-budget`: it compiles
    the step (after fsdp-insert-optimizer) once per candidate schedule and
    keeps the one with the smallest predicted step time (CostModel.h, the
    model fsdp-sim uses) whose planned peak per rank (the memory plan's
    arena) is at most `memory-budget`. The candidates: `layers-per-unit`
    1 or 2 (unit size: bucket of the collectives), `recompute` none,
    selective or unit, `reshard-after-forward` true or false (stage 3)
    and `prefetch-depth` 0, 1 or 2 (with overlap), at depth 1 with
    `backward-prefetch` pre or post (BACKWARD_POST: one unit's gathered
    parameters fewer at the backward's peak, for less overlap). An option
    given a value pins that knob. With gradient accumulation at stage 3
    `reshard-after-backward` true and false are candidates too (false:
    fewer gathers, the units gathered across micro-batches). A candidate
    with hierarchical qgZ's node exchanges and prefetch is scheduled with
    `overlap-node-exchange` true and false too (false: each node exchange
    waited for at once, its int8 buffers held a unit less). Candidates
    share work: each grouping is recomputed once, sharded once per reshard
    choice and scheduled once per depth and backward placement.
    Per unit: where recompute=none does not fit and unit does, recomputing
    only the first K units (`recompute-units`, their backward runs last)
    is estimated by interpolation and, if it may beat the best uniform
    schedule, compiled at the estimated K and walked to the smallest K that
    fits (at most 4 more candidates); the same for resharding only the
    first K units (`reshard-units`) where reshard-after-forward=false does
    not fit and true (or G) does. Per-unit prefetch depth
    (`unit-prefetch-depth`, unless pinned or `search-unit-prefetch=false`):
    the fastest prefetching schedules (depth D) that beat every schedule
    that fits but are over the budget (by liveness, or by their placed
    arena's fragmentation; three of each at most) are planned again with
    the units whose gathers are in flight while the live bytes exceed the
    budget at depth D - 1 in that pass (forward or backward; `U=F/B`), up
    to four times as the peak moves (a pass still in flight there goes
    on down, to 0 at most), and kept once the arena fits;
    candidates are ranked by liveness (peak live bytes, a lower bound of
    the arena) and only the best one's arena is placed, falling back to
    the next when fragmentation pushes it over the budget.

    Offload: `offload=auto` weighs candidates with and without optimizer
    offload, `offload-activations=auto` with and without activation
    offload, and `offload-next-step=auto` (the default) each offloaded
    candidate whose host updates are async both with the updates joined
    in their step and in the next (fsdp-offload's next-step: exact, it
    costs host memory only, each update's operands kept through the
    step). Equal predicted steps go to the smaller host arena (when the
    host stream bounds the step either way, next-step buys nothing).
    `host-memory-budget` bounds the host arena of every candidate as
    `memory-budget` bounds the device's. Two in-flight counts are refined
    on the winners rather than weighed in every leaf (each costs memory
    only): the fastest prefetching candidates are tried with 2 to 4 copies
    to the device in flight (`offload-prefetch-depth`), and candidates with
    the state on disk with 1 update in flight where only that fits
    `host-memory-budget` (`offload-nvme-in-flight`); a value given pins
    either. Under `host-memory-budget` the fastest candidates with the
    state on disk that fit are also tried with fewer units' state there
    (`offload-nvme-units`, the units updated first), the fewest that
    still fit: the rest stays in host memory and off the drive.

    When nothing fits it fails with the smallest peak it reached, the
    schedule that reached it and what that peak is made of.

    Before: @train_step with the optimizer (no units grouped yet). After:
    as after fsdp-schedule, with `fsdp.strategy` = {layers_per_unit,
    recompute, recompute_units, reshard_after_forward, reshard_units,
    reshard_group, prefetch_depth, unit_prefetch_depth, offload,
    offload_activations, offload_next_step, offload_prefetch, offload_prefetch_depth,
    offload_nvme, offload_nvme_in_flight, offload_nvme_read_ahead, offload_nvme_units,
    offload_nvme_params, predicted_step_s, exposed_comm_pct, peak, budget,
    host_peak, host_budget, profile, candidates} on the module
    (convert-fsdp-to-plan writes it as the plan's `strategy`).

    ```
    fsdp-opt gpt7b.mlir --fsdp-pipeline="world-size=8 param-dtype=bf16 memory-budget=80GiB"
    fsdp schedule search: 36 candidates, budget 80.00 GiB per rank (h100)
      chose layers-per-unit=1 recompute=none reshard-after-forward=false prefetch-depth=2
      predicted step 283.603 ms, exposed communication 1.2%, peak 39.84 GiB (42773680260 bytes)
    ```
  }];
  let options = [
    Option<"offload", "offload", "std::string", /*default=*/"\"none\"",
           "optimizer: every candidate offloads its optimizer (fsdp-offload), "
           "so its peak is the device's; all: and the frozen units' storage; "
           "auto: candidates with each (all only with frozen parameters); none">,
    Option<"offloadActivations", "offload-activations", "std::string",
           /*default=*/"\"false\"",
           "true: every candidate offloads its saved activations "
           "(fsdp-offload-activations); auto: the search weighs candidates with "
           "and without; false">,
    Option<"offloadOverlap", "offload-overlap", "bool", /*default=*/"true",
           "with overlap: fsdp-offload's host updates run beside the backward "
           "pass (fsdp-offload's overlap)">,
    Option<"offloadPrefetch", "offload-prefetch", "std::string", /*default=*/"\"auto\"",
           "fsdp-offload's prefetch (with overlap: the copies to the device "
           "run ahead on the copy stream): true, false, or auto: each "
           "offloaded candidate is weighed both ways">,
    Option<"offloadNextStep", "offload-next-step", "std::string", /*default=*/"\"auto\"",
           "fsdp-offload's next-step (the host updates are joined in the next "
           "step, beside its forward pass): true, false, or auto: each "
           "offloaded candidate with async updates is weighed both ways">,
    Option<"offloadNvme", "offload-nvme", "std::string", /*default=*/"\"false\"",
           "fsdp-offload's nvme (the offloaded optimizer state in the per-rank "
           "swap file): true, false, or auto: each offloaded candidate is "
           "weighed both ways (host-memory-budget is what makes it win)">,
    Option<"offloadNvmeInFlight", "offload-nvme-in-flight", "int64_t", /*default=*/"-1",
           "pin fsdp-offload's nvme-in-flight for the candidates with the state "
           "on disk (-1: 2, then 1 where only that fits host-memory-budget)">,
    Option<"offloadNvmeReadAhead", "offload-nvme-read-ahead", "int64_t", /*default=*/"-1",
           "pin fsdp-offload's nvme-read-ahead for the candidates with the "
           "state on disk (-1: 1, then 0 with one update in flight where only "
           "that fits host-memory-budget, and up to 8 for the fastest few "
           "where that fits and is faster)">,
    Option<"offloadNvmeUnits", "offload-nvme-units", "int64_t", /*default=*/"-1",
           "pin fsdp-offload's nvme-units for the candidates with the state on "
           "disk (-1: all, and with host-memory-budget the fewest that fit)">,
    Option<"offloadNvmeParams", "offload-nvme-params", "std::string", /*default=*/"\"false\"",
           "fsdp-offload's nvme-params for the candidates with the state on "
           "disk (their master shards in the swap file too): false, true "
           "(pinned) or auto (with host-memory-budget, tried where the "
           "state on disk alone does not fit it)">,
    Option<"offloadPrefetchDepth", "offload-prefetch-depth", "int64_t", /*default=*/"-1",
           "pin fsdp-offload's prefetch-depth for the prefetching candidates "
           "(-1: 1, and the fastest few are tried with 2 to 4)">,
    Option<"memoryBudget", "memory-budget", "std::string", /*default=*/"\"\"",
           "largest planned peak per rank: bytes or with a unit (80GiB, 512MiB, 1.5GB)">,
    Option<"hostMemoryBudget", "host-memory-budget", "std::string", /*default=*/"\"\"",
           "largest planned host arena per rank (offloaded candidates), as "
           "memory-budget; empty: no limit">,
    Option<"frozenStorage", "frozen-storage", "std::string", /*default=*/"\"declared\"",
           "fsdp-shard's frozen-storage for every candidate">,
    Option<"weightQuantization", "weight-quantization", "std::string",
           /*default=*/"\"none\"", "fsdp-shard's weight-quantization for every candidate">,
    Option<"gradientQuantization", "gradient-quantization", "std::string",
           /*default=*/"\"none\"", "fsdp-shard's gradient-quantization for every candidate">,
    Option<"quantizationBlock", "quantization-block", "int64_t", /*default=*/"256",
           "fsdp-shard's quantization-block for every candidate">,
    Option<"deviceProfile", "device-profile", "std::string", /*default=*/"\"h100\"",
           "h100 (built in) or a JSON from fsdp-run --calibrate">,
    Option<"ranksPerNode", "ranks-per-node", "int64_t", /*default=*/"-1",
           "ranks on the intra-node link (-1: the profile's; 0: one node)">,
    Option<"worldSize", "world-size", "int64_t", /*default=*/"1", "ranks">,
    Option<"stage", "stage", "int64_t", /*default=*/"3", "ZeRO stage">,
    Option<"mesh", "mesh", "std::string", /*default=*/"\"\"", "RxS (HSDP) or empty">,
    Option<"unitPolicy", "unit-policy", "std::string", /*default=*/"\"layer\"",
           "layer | size | none">,
    Option<"minUnitNumel", "min-unit-numel", "int64_t", /*default=*/"1000000",
           "size policy: smallest unit">,
    Option<"overlap", "overlap", "bool", /*default=*/"true",
           "async collectives (fsdp-schedule)">,
    Option<"layersPerUnit", "layers-per-unit", "int64_t", /*default=*/"0",
           "pin the unit grouping (0: search 1, 2)">,
    Option<"recompute", "recompute", "std::string", /*default=*/"\"\"",
           "pin recompute (empty: search none, selective, unit)">,
    Option<"recomputeUnits", "recompute-units", "int64_t", /*default=*/"-1",
           "pin the units recompute=unit recomputes (-1: all, or searched "
           "when recompute is searched)">,
    Option<"reshardAfterForward", "reshard-after-forward", "std::string",
           /*default=*/"\"\"", "pin: true | false | G (empty: search)">,
    Option<"reshardUnits", "reshard-units", "int64_t", /*default=*/"-1",
           "pin the units that reshard (-1: all, or searched when "
           "reshard-after-forward is searched)">,
    Option<"reshardAfterBackward", "reshard-after-backward", "std::string",
           /*default=*/"\"\"",
           "pin: true | false (empty: with gradient accumulation at stage 3, "
           "search both; else true)">,
    Option<"prefetchDepth", "prefetch-depth", "int64_t", /*default=*/"-1",
           "pin the prefetch depth (-1: search 0, 1, 2)">,
    Option<"backwardPrefetch", "backward-prefetch", "std::string", /*default=*/"\"\"",
           "pin the backward gathers' placement: pre | post | none (empty: "
           "search pre and, at depth 1, post)">,
    ListOption<"unitPrefetchDepth", "unit-prefetch-depth", "std::string",
               "pin fsdp-schedule's unit-prefetch-depth (UNIT=D or UNIT=F/B,...) for every "
               "candidate with prefetch (empty: searched, where a schedule over "
               "the budget is one less deep at the units gathered at its peak)">,
    Option<"searchUnitPrefetch", "search-unit-prefetch", "bool", /*default=*/"true",
           "weigh per-unit prefetch depth where unit-prefetch-depth is not pinned "
           "(false: every unit at its candidate's depth)">,
    Option<"overlapNodeExchange", "overlap-node-exchange", "std::string", /*default=*/"\"\"",
           "pin fsdp-schedule's overlap-node-exchange: true | false (empty: "
           "hierarchical qgZ candidates with prefetch weigh both)">,
    Option<"nodeCommStream", "node-comm-stream", "bool", /*default=*/"true",
           "fsdp-schedule's node-comm-stream for every candidate">,
    Option<"fuseEpilogues", "fuse-epilogues", "bool", /*default=*/"true",
           "fold matmul epilogues in every candidate (fsdp-fuse-epilogues)">,
    Option<"fuseGradAccum", "fuse-grad-accum", "bool", /*default=*/"true",
           "fsdp-fuse-epilogues' accumulate option in every candidate">,
    Option<"report", "report", "bool", /*default=*/"false",
           "print the choice on stderr">,
  ];
  let statistics = [
    Statistic<"numCandidates", "candidates", "Schedules compiled and planned">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpPlanMemory : Pass<"fsdp-plan-memory", "::mlir::ModuleOp"> {
  let summary = "liveness and static offsets in one arena per rank";
  let description = [{
    Computes, for `@train_step`, the live range of every tensor (definition
    to last use, in program order) and gives each an offset in one arena:
    parameters and optimizer state first (persistent, packed per unit), the
    batch and scalar inputs next, then transient tensors placed greedily by
    size (largest first, lowest offset whose live ranges do not conflict).
    Optimizer updates are planned in place: an update's new parameter/state
    takes the storage of the parameter/state it replaces.

    Results are recorded as attributes for the lowering and for tests:
    `fsdp.offsets` (one byte offset per result) on every op, `fsdp.offset`
    on every `fsdp.param` / `fsdp.state`, `fsdp.arg_offsets` on the
    function, and a module attribute `fsdp.memory` with the peak and its
    breakdown (params, grads, state, activations, temps, inputs). An
    activation is a transient value computed in the forward pass and read
    in the backward pass, or a forward value fsdp-recompute re-runs in the
    backward pass (its clones carry `fsdp.recompute`). With `report`, the
    breakdown is printed to stderr. With `host-memory-budget` a host arena
    (fsdp-offload) larger than it is an error naming both sizes.
  }];
  let options = [
    Option<"alignment", "alignment", "int64_t", /*default=*/"64",
           "byte alignment of every buffer">,
    Option<"report", "report", "bool", /*default=*/"false",
           "print the per-rank memory report to stderr">,
    Option<"simulate", "simulate", "bool", /*default=*/"false",
           "print the predicted step time, exposed communication and peak "
           "(CostModel.h, the model of fsdp-sim)">,
    Option<"deviceProfile", "device-profile", "std::string", /*default=*/"\"h100\"",
           "with simulate: h100 or a JSON from fsdp-run --calibrate">,
    Option<"ranksPerNode", "ranks-per-node", "int64_t", /*default=*/"-1",
           "with simulate: ranks on the intra-node link (-1: the profile's)">,
    Option<"hostMemoryBudget", "host-memory-budget", "std::string", /*default=*/"\"\"",
           "largest host arena per rank (bytes or with a unit: 512GiB); a "
           "larger one is an error; empty: no limit">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

def FsdpExportPlan : Pass<"convert-fsdp-to-plan", "::mlir::ModuleOp"> {
  let summary = "writes the plan file fsdp-run executes";
  let description = [{
    Lowers the planned `@train_step` to the runtime's plan format
    (docs/PLAN_FORMAT.md): explicit buffers (offset, size, shape, dtype,
    kind, live range), parameters with initializers and shard placement,
    optimizer state, input/output bindings and the ordered instruction list.
    Requires `fsdp-plan-memory` to have run. The IR is left unchanged.
  }];
  let options = [
    Option<"output", "output", "std::string", /*default=*/"\"\"",
           "path of the plan file to write (required)">,
  ];
  let dependentDialects = ["::mlir::fsdp::FsdpDialect"];
}

#endif // FSDP_PASSES_TD
