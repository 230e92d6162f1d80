// A model reading a parameter nobody declared.
fsdp.param @"layers.0.weight" : tensor<16x16xf32> init("normal", 0.02)
func.func @model(%x: tensor<4x16xf32>, %y: tensor<4x16xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w0 = fsdp.get_param @"layers.0.weight" : tensor<16x16xf32>
  %w9 = fsdp.get_param @"layers.9.weight" : tensor<16x16xf32>
  %l = fsdp.mse_loss %x, %y : tensor<4x16xf32> -> tensor<f32>
  return %l : tensor<f32>
}
