// Gradient check: embedding with repeated ids (scatter-add), a tied
// embedding / output projection read twice, cross_entropy, positional add.
fsdp.param @wte : tensor<16x8xf32> init("normal", 0.5)
fsdp.param @wpe : tensor<4x8xf32> init("normal", 0.5)
fsdp.param @g : tensor<8xf32> init("ones")
fsdp.param @b : tensor<8xf32> init("zeros")
func.func @model(%ids: tensor<3x4xi32> {fsdp.role = "input"}, %t: tensor<3x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %wte = fsdp.get_param @wte : tensor<16x8xf32>
  %wpe = fsdp.get_param @wpe : tensor<4x8xf32>
  %g = fsdp.get_param @g : tensor<8xf32>
  %b = fsdp.get_param @b : tensor<8xf32>
  %e = fsdp.embedding %wte, %ids : (tensor<16x8xf32>, tensor<3x4xi32>) -> tensor<3x4x8xf32>
  %x = fsdp.add %e, %wpe : (tensor<3x4x8xf32>, tensor<4x8xf32>) -> tensor<3x4x8xf32>
  %n = fsdp.layer_norm %x, %g, %b : tensor<3x4x8xf32>, tensor<8xf32>
  %h = fsdp.reshape %n : tensor<3x4x8xf32> -> tensor<12x8xf32>
  %wte2 = fsdp.get_param @wte : tensor<16x8xf32>
  %logits = fsdp.matmul %h, %wte2 transpose_rhs : (tensor<12x8xf32>, tensor<16x8xf32>) -> tensor<12x16xf32>
  %tf = fsdp.reshape %t : tensor<3x4xi32> -> tensor<12xi32>
  %l = fsdp.cross_entropy %logits, %tf : (tensor<12x16xf32>, tensor<12xi32>) -> tensor<f32>
  return %l : tensor<f32>
}
