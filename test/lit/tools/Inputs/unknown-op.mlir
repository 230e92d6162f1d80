// A model using an op the dialect does not have.
func.func @model(%x: tensor<4x16xf32>) -> tensor<f32> attributes {fsdp.model} {
  %c = fsdp.fill {value = 0.0 : f64} : tensor<f32>
  %y = fsdp.conv2d %x : tensor<4x16xf32>
  return %c : tensor<f32>
}
