// Gradient check: add / sub / mul / div / neg / scale with broadcasting,
// reduce_sum, reshape, mse_loss.
fsdp.param @a : tensor<6xf32> init("normal", 0.5)
fsdp.param @b : tensor<4x6xf32> init("normal", 0.5)
fsdp.param @c : tensor<1x6xf32> init("normal", 0.5)
func.func @model(%x: tensor<4x6xf32> {fsdp.role = "input"}, %y: tensor<4x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %a = fsdp.get_param @a : tensor<6xf32>
  %b = fsdp.get_param @b : tensor<4x6xf32>
  %c = fsdp.get_param @c : tensor<1x6xf32>
  %h1 = fsdp.add %x, %a : (tensor<4x6xf32>, tensor<6xf32>) -> tensor<4x6xf32>
  %h2 = fsdp.sub %h1, %b : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %h3 = fsdp.mul %h2, %c : (tensor<4x6xf32>, tensor<1x6xf32>) -> tensor<4x6xf32>
  %bb = fsdp.mul %b, %b : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %two = fsdp.fill {value = 2.0 : f64} : tensor<1x1xf32>
  %den = fsdp.add %bb, %two : (tensor<4x6xf32>, tensor<1x1xf32>) -> tensor<4x6xf32>
  %h4 = fsdp.div %h3, %den : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %h5 = fsdp.neg %h4 : tensor<4x6xf32>
  %h6 = fsdp.scale %h5 {factor = 1.5 : f64} : tensor<4x6xf32>
  %s = fsdp.reduce_sum %h6 dims = [1] : tensor<4x6xf32> -> tensor<4xf32>
  %p = fsdp.reshape %s : tensor<4xf32> -> tensor<4x1xf32>
  %l = fsdp.mse_loss %p, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
