// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -verify-diagnostics

// Tests that a module without a model function is rejected.
// expected-error @+1 {{no model function: mark one func.func with the `fsdp.model` attribute}}
module {
  func.func @f(%x: tensor<4xf32>) -> tensor<4xf32> {
    return %x : tensor<4xf32>
  }
}

// -----

// Tests that the loss must be a 0-d f32 tensor.
fsdp.param @w : tensor<4xf32> init("zeros")
func.func @model(%x: tensor<4xf32>) -> tensor<4xf32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  %y = fsdp.add %x, %w : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  // expected-error @+1 {{expected the loss to be a tensor<f32>, found 'tensor<4xf32>'}}
  return %y : tensor<4xf32>
}

// -----

// Tests that a parameter the loss does not depend on gets a warning (and a
// zero gradient).
fsdp.param @w : tensor<4xf32> init("zeros")
// expected-warning @+1 {{the loss does not depend on this parameter; its gradient is zero}}
fsdp.param @unused : tensor<4xf32> init("zeros")
func.func @model(%x: tensor<4xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  %l = fsdp.mse_loss %x, %w : tensor<4xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that backward-only ops have no rule of their own.
fsdp.param @w : tensor<4xf32> init("zeros")
func.func @model(%x: tensor<4xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  // expected-error @+1 {{has no differentiation rule}}
  %g = fsdp.relu_grad %x, %w : tensor<4xf32>
  %l = fsdp.mse_loss %g, %x : tensor<4xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that two model functions are ambiguous.
fsdp.param @w : tensor<4xf32> init("zeros")
func.func @a(%x: tensor<4xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  %l = fsdp.mse_loss %x, %w : tensor<4xf32> -> tensor<f32>
  return %l : tensor<f32>
}
// expected-error @+1 {{more than one model function}}
func.func @b(%x: tensor<4xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4xf32>
  %l = fsdp.mse_loss %x, %w : tensor<4xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that attention's log-sum-exp result is not differentiable: a model
// that reads it gets an error, not a gradient that ignores it.
fsdp.param @w : tensor<1x4x8xf32> init("normal", 0.02)
func.func @model(%x: tensor<1x4x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4x8xf32>
  // expected-error @+1 {{has no differentiation rule for its log-sum-exp result}}
  %y, %lse = fsdp.attention %w, %w, %w heads = 2 causal : tensor<1x4x8xf32> -> tensor<1x2x4xf32>
  %l = fsdp.reduce_sum %lse dims = [0, 1, 2] : tensor<1x2x4xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that an f32 product of bf16 operands (fsdp-fuse-epilogues writes
// them, after autodiff) has no differentiation rule.
fsdp.param @w : tensor<4x4xbf16> init("zeros")
func.func @model(%x: tensor<2x4xbf16>, %t: tensor<2x4xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4x4xbf16>
  // expected-error @+1 {{has no differentiation rule for an f32 product of 'bf16' operands (cast the result in the model instead)}}
  %y = fsdp.matmul %x, %w : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
  %l = fsdp.mse_loss %y, %t : tensor<2x4xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// The accumulating matmul (acc) is fsdp-fuse-epilogues': autodiff has no
// rule for it.
fsdp.param @w : tensor<4x8xf32> init("normal", 0.02)
func.func @model(%x: tensor<6x4xf32> {fsdp.role = "input"}, %y: tensor<6xi32> {fsdp.role = "target"}, %a: tensor<6x8xf32> {fsdp.role = "input"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<4x8xf32>
  // expected-error @+1 {{has no differentiation rule with an accumulator}}
  %p = fsdp.matmul %x, %w acc %a : (tensor<6x4xf32>, tensor<4x8xf32>, tensor<6x8xf32>) -> tensor<6x8xf32>
  %loss = fsdp.cross_entropy %p, %y : (tensor<6x8xf32>, tensor<6xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
