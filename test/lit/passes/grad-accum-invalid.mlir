// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=0 2>&1 | FileCheck %s --check-prefix=ZERO
// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=-3 2>&1 | FileCheck %s --check-prefix=NEG
// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum="micro-batches=2 reduce=foo" 2>&1 | FileCheck %s --check-prefix=MODE
// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-grad-accum=micro-batches=2 2>&1 | FileCheck %s --check-prefix=TWICE
// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 2>&1 | FileCheck %s --check-prefix=NOROWS
// RUN: not fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-grad-accum=micro-batches=2 2>&1 | FileCheck %s --check-prefix=LATE
// RUN: not fsdp-opt %s -split-input-file -fsdp-grad-accum=micro-batches=2 2>&1 | FileCheck %s --check-prefix=EARLY
// RUN: not fsdp-opt %s -split-input-file --fsdp-pipeline="grad-accum=0" 2>&1 | FileCheck %s --check-prefix=ZERO
// RUN: not fsdp-opt %s -split-input-file --fsdp-pipeline="grad-accum=2 accum-reduce=foo" 2>&1 | FileCheck %s --check-prefix=MODE

// Tests that bad options, a second run and the wrong place in the pipeline
// are reported with what was expected.
// ZERO: grad-accum (micro-batches) must be >= 1, found 0
// NEG: grad-accum (micro-batches) must be >= 1, found -3
// MODE: unknown accum-reduce 'foo': expected step (reduce once per step) or microbatch (reduce each micro-batch)
// TWICE: @train_step already accumulates: fsdp-grad-accum ran twice?
// LATE: 'fsdp.set_param' op fsdp-grad-accum runs between fsdp-autodiff and fsdp-insert-optimizer; found an optimizer update
// EARLY: no @train_step: run fsdp-autodiff first
fsdp.param @w : tensor<1x4xf32> init("normal", 0.02)
func.func @model(%x: tensor<4x4xf32>, %y: tensor<4x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4xf32>
  %o = fsdp.matmul %x, %w transpose_rhs : (tensor<4x4xf32>, tensor<1x4xf32>) -> tensor<4x1xf32>
  %l = fsdp.mse_loss %o, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that an input without rows (a 0-d tensor) cannot be split.
// ZERO: grad-accum (micro-batches) must be >= 1, found 0
// MODE: unknown accum-reduce 'foo'
// NOROWS: argument #1 of @train_step has no batch dimension to split into micro-batches: 'tensor<f32>'
fsdp.param @w : tensor<4xf32> init("normal", 0.02)
func.func @model(%x: tensor<4xf32>, %s: tensor<f32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  %p = fsdp.mul %x, %w : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  %r = fsdp.reduce_sum %p dims = [0] : tensor<4xf32> -> tensor<f32>
  %l = fsdp.mul %r, %s : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %l : tensor<f32>
}
