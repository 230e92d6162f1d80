// Gradient check: bias_add, relu, gelu, softmax, layer_norm (gamma and
// beta trainable), bce_with_logits; a frozen parameter gets no gradient.
fsdp.param @w : tensor<8x6xf32> init("normal", 0.5)
fsdp.param @bias : tensor<8xf32> init("normal", 0.5)
fsdp.param @g : tensor<8xf32> init("normal", 1.0)
fsdp.param @beta : tensor<8xf32> init("normal", 0.5)
fsdp.param @frozen : tensor<8xf32> init("normal", 0.5) frozen
fsdp.param @head : tensor<1x8xf32> init("normal", 0.5)
func.func @model(%x: tensor<4x6xf32> {fsdp.role = "input"}, %y: tensor<4x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x6xf32>
  %bias = fsdp.get_param @bias : tensor<8xf32>
  %g = fsdp.get_param @g : tensor<8xf32>
  %beta = fsdp.get_param @beta : tensor<8xf32>
  %fz = fsdp.get_param @frozen : tensor<8xf32>
  %head = fsdp.get_param @head : tensor<1x8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<4x6xf32>, tensor<8x6xf32>) -> tensor<4x8xf32>
  %hb = fsdp.bias_add %h, %bias : tensor<4x8xf32>, tensor<8xf32>
  %n = fsdp.layer_norm %hb, %g, %beta : tensor<4x8xf32>, tensor<8xf32>
  %r = fsdp.relu %n : tensor<4x8xf32>
  %ge = fsdp.gelu %n : tensor<4x8xf32>
  %sm = fsdp.softmax %ge : tensor<4x8xf32>
  %m = fsdp.add %r, %sm : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %mf = fsdp.mul %m, %fz : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %o = fsdp.matmul %mf, %head transpose_rhs : (tensor<4x8xf32>, tensor<1x8xf32>) -> tensor<4x1xf32>
  %l = fsdp.bce_with_logits %o, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
