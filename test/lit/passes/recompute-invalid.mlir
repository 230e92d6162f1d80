// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-recompute=policy=every 2>&1 | FileCheck %s --check-prefix=POLICY
// RUN: not fsdp-opt %s --fsdp-pipeline="recompute=every" 2>&1 | FileCheck %s --check-prefix=POLICY
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=none recompute=Unit" 2>&1 | FileCheck %s --check-prefix=CASE
// RUN: not fsdp-opt %s -fsdp-recompute=policy=unit 2>&1 | FileCheck %s --check-prefix=EARLY
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard -fsdp-recompute=policy=unit 2>&1 | FileCheck %s --check-prefix=LATE
// RUN: fsdp-opt %s -fsdp-recompute | FileCheck %s --check-prefix=NOOP

// Tests that an unknown policy (on the pass and in the pipeline, with or
// without an optimizer) and the wrong place in the pipeline are reported
// with what was expected, and that the default (none) asks for nothing.
// POLICY: error: unknown recompute policy 'every': expected none, unit or selective
// CASE: error: unknown recompute policy 'Unit': expected none, unit or selective
// EARLY: error: no @train_step: run fsdp-autodiff first
// LATE: error: fsdp-recompute must run before fsdp-shard: after it, parameter reads are views of all-gathered units
// NOOP-LABEL: func.func @model
// NOOP-NOT: @train_step
fsdp.param @w : tensor<1x4xf32> init("normal", 0.02)
func.func @model(%x: tensor<4x4xf32>, %y: tensor<4x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4xf32>
  %o = fsdp.matmul %x, %w transpose_rhs : (tensor<4x4xf32>, tensor<1x4xf32>) -> tensor<4x1xf32>
  %r = fsdp.relu %o : tensor<4x1xf32>
  %l = fsdp.mse_loss %r, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
