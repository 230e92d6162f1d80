// Not even parseable.
func.func @model(%x: tensor<4x16xf32>) -> tensor<f32> {
  %y = fsdp.relu %x : tensor<4x16xf32
}
