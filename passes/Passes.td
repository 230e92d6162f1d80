//===- Passes.td - the fsdp compiler's passes ----------------*- tablegen -*-===//
//
// The passes of the pipeline, in the order buildFsdpPipeline runs them. Each
// description says what must hold before, what holds after, and shows IR.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_PASSES_TD
#define FSDP_PASSES_TD

include "mlir/Pass/PassBase.td"

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

def FsdpInsertOptimizer : Pass<"fsdp-insert-optimizer", "::mlir::ModuleOp"> {
  let summary = "adds SGD or AdamW updates, optimizer state and clipping";
  let description = [{
    Replaces every `fsdp.set_grad` of `@train_step` by an optimizer update
    at the end of the step. Optimizer state becomes `fsdp.state` symbols
    (zero-initialized, one per trainable parameter and moment). The learning
    rate and the 1-based step count become arguments of `@train_step`
    (roles "lr" and "step") so that fsdp-run chooses the schedule. With
    `max-grad-norm` > 0 the gradients are first scaled by the global-norm
    clipping factor (torch.nn.utils.clip_grad_norm_ semantics).

    Before: `@train_step` with `fsdp.set_grad` ops. After: no `fsdp.set_grad`
    remains (unless optimizer=none); each trainable parameter is written
    back once with `fsdp.set_param`.

    ```mlir
    %p2, %m2, %v2 = fsdp.adamw_update %p, %g, %m, %v, %lr, %step {...} : tensor<64xf32>
    fsdp.set_param @w = %p2 : tensor<64xf32>
    ```
  }];
  let options = [
    Option<"optimizer", "optimizer", "std::string", /*default=*/"\"adamw\"",
           "sgd | adamw | none (none keeps fsdp.set_grad: the step outputs gradients)">,
    Option<"momentum", "momentum", "double", /*default=*/"0.0", "SGD momentum">,
    Option<"dampening", "dampening", "double", /*default=*/"0.0", "SGD dampening">,
    Option<"nesterov", "nesterov", "bool", /*default=*/"false", "SGD Nesterov momentum">,
    Option<"weightDecay", "weight-decay", "double", /*default=*/"-1.0",
           "weight decay (default: 0.01 for AdamW, 0 for SGD)">,
    Option<"beta1", "beta1", "double", /*default=*/"0.9", "AdamW beta1">,
    Option<"beta2", "beta2", "double", /*default=*/"0.999", "AdamW beta2">,
    Option<"eps", "eps", "double", /*default=*/"1e-8", "AdamW epsilon">,
    Option<"maxGradNorm", "max-grad-norm", "double", /*default=*/"0.0",
           "global-norm gradient clipping threshold (0: off)">,
  ];
  let statistics = [
    Statistic<"numUpdates", "updates", "Parameters given an update">,
    Statistic<"numStates", "states", "Optimizer state tensors created">,
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
    breakdown (params, grads, state, activations, temps, inputs). With
    `report`, the breakdown is printed to stderr.
  }];
  let options = [
    Option<"alignment", "alignment", "int64_t", /*default=*/"64",
           "byte alignment of every buffer">,
    Option<"report", "report", "bool", /*default=*/"false",
           "print the per-rank memory report to stderr">,
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
