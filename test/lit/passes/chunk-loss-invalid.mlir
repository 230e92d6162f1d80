// RUN: not fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=2 2>&1 | FileCheck %s
// RUN: fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=auto | FileCheck %s --check-prefix=AUTO

// A count > 1 on a step without a cross-entropy head is an error; auto
// leaves it alone.
// CHECK: error: fsdp-chunk-loss: chunks=2 but @train_step has no cross_entropy (with its gradient) whose classifier head could be chunked
// AUTO-LABEL: func.func @train_step
// AUTO: fsdp.mse_loss
fsdp.param @w : tensor<4x8xf32> init("normal", 0.02)
func.func @model(%x: tensor<6x4xf32> {fsdp.role = "input"}, %y: tensor<6x8xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4x8xf32>
  %p = fsdp.matmul %x, %w : (tensor<6x4xf32>, tensor<4x8xf32>) -> tensor<6x8xf32>
  %loss = fsdp.mse_loss %p, %y : tensor<6x8xf32> -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// Logits read by something else than their cross-entropy stay whole: the
// error names the reader.
// CHECK: error: 'fsdp.cross_entropy_grad' op cannot be chunked (fsdp-chunk-loss, chunks=2): its logits are also read by 'fsdp.softmax'
// AUTO-LABEL: func.func @train_step
// AUTO-NOT: fsdp.view
fsdp.param @w : tensor<4x8xf32> init("normal", 0.02)
func.func @model(%x: tensor<6x4xf32> {fsdp.role = "input"}, %y: tensor<6xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4x8xf32>
  %p = fsdp.matmul %x, %w : (tensor<6x4xf32>, tensor<4x8xf32>) -> tensor<6x8xf32>
  %s = fsdp.softmax %p : tensor<6x8xf32>
  %l = fsdp.cross_entropy %s, %y : (tensor<6x8xf32>, tensor<6xi32>) -> tensor<f32>
  %loss = fsdp.cross_entropy %p, %y : (tensor<6x8xf32>, tensor<6xi32>) -> tensor<f32>
  %t = fsdp.add %l, %loss : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %t : tensor<f32>
}

// -----

// Logits that are not a matmul's product (here an input) cannot be made
// in chunks.
// CHECK: error: 'fsdp.cross_entropy_grad' op cannot be chunked (fsdp-chunk-loss, chunks=2): its logits are not the product of a rank-2 matmul (without transpose_lhs)
fsdp.param @b : tensor<8xf32> init("zeros")
func.func @model(%x: tensor<6x8xf32> {fsdp.role = "input"}, %y: tensor<6xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %b = fsdp.get_param @b : tensor<8xf32>
  %l = fsdp.add %x, %b : (tensor<6x8xf32>, tensor<8xf32>) -> tensor<6x8xf32>
  %loss = fsdp.cross_entropy %l, %y : (tensor<6x8xf32>, tensor<6xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

