// Two classifier heads over the same features (test/lit/e2e/logits-in-place.test):
// @a's logits (256 classes) are read only by its cross-entropy and its
// gradient; @b's (128 classes) by a mean as well.
fsdp.param @e : tensor<128x16xf32> init("normal", 0.02)
fsdp.param @a : tensor<256x16xf32> init("normal", 0.02)
fsdp.param @b : tensor<128x16xf32> init("normal", 0.02)
func.func @model(%ids: tensor<2x4xi32> {fsdp.role = "input"}, %t: tensor<2x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %e = fsdp.get_param @e : tensor<128x16xf32>
  %x3 = fsdp.embedding %e, %ids : (tensor<128x16xf32>, tensor<2x4xi32>) -> tensor<2x4x16xf32>
  %x = fsdp.reshape %x3 : tensor<2x4x16xf32> -> tensor<8x16xf32>
  %y = fsdp.reshape %t : tensor<2x4xi32> -> tensor<8xi32>
  %a = fsdp.get_param @a : tensor<256x16xf32>
  %la = fsdp.matmul %x, %a transpose_rhs : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
  %ca = fsdp.cross_entropy %la, %y : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %b = fsdp.get_param @b : tensor<128x16xf32>
  %lb = fsdp.matmul %x, %b transpose_rhs : (tensor<8x16xf32>, tensor<128x16xf32>) -> tensor<8x128xf32>
  %cb = fsdp.cross_entropy %lb, %y : (tensor<8x128xf32>, tensor<8xi32>) -> tensor<f32>
  %s = fsdp.reduce_mean %lb dims = [0, 1] : tensor<8x128xf32> -> tensor<f32>
  %t0 = fsdp.add %ca, %cb : (tensor<f32>, tensor<f32>) -> tensor<f32>
  %t1 = fsdp.add %t0, %s : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %t1 : tensor<f32>
}
