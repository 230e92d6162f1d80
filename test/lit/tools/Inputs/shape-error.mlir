// A model whose first layer has the wrong input width.
fsdp.param @w : tensor<8x32xf32> init("normal", 0.02)
func.func @model(%x: tensor<4x16xf32> {fsdp.role = "input"},
                 %y: tensor<4x8xf32> {fsdp.role = "target"}) -> tensor<f32>
    attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x32xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<4x16xf32>, tensor<8x32xf32>) -> tensor<4x8xf32>
  %l = fsdp.mse_loss %h, %y : tensor<4x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
