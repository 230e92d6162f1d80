// Gradient check: the Llama ops. rms_norm (input and weight), rope on
// queries and grouped keys, grouped-query attention (causal with one
// key/value head for two query heads, and not causal with two for four),
// silu and the SwiGLU product, in a Llama-style block fragment.
fsdp.param @norm1 : tensor<8xf32> init("normal", 1.0)
fsdp.param @wq : tensor<8x8xf32> init("normal", 0.5)
fsdp.param @wk : tensor<4x8xf32> init("normal", 0.5)
fsdp.param @wv : tensor<4x8xf32> init("normal", 0.5)
fsdp.param @norm2 : tensor<8xf32> init("normal", 1.0)
fsdp.param @wg : tensor<12x8xf32> init("normal", 0.5)
fsdp.param @wu : tensor<12x8xf32> init("normal", 0.5)
fsdp.param @wd : tensor<1x12xf32> init("normal", 0.5)
func.func @model(%xf: tensor<8x8xf32> {fsdp.role = "input"}, %y: tensor<8x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %n1 = fsdp.get_param @norm1 : tensor<8xf32>
  %wq = fsdp.get_param @wq : tensor<8x8xf32>
  %wk = fsdp.get_param @wk : tensor<4x8xf32>
  %wv = fsdp.get_param @wv : tensor<4x8xf32>
  %n2 = fsdp.get_param @norm2 : tensor<8xf32>
  %wg = fsdp.get_param @wg : tensor<12x8xf32>
  %wu = fsdp.get_param @wu : tensor<12x8xf32>
  %wd = fsdp.get_param @wd : tensor<1x12xf32>
  %x = fsdp.reshape %xf : tensor<8x8xf32> -> tensor<2x4x8xf32>
  %h = fsdp.rms_norm %x, %n1 epsilon = 1.0e-05 : tensor<2x4x8xf32>, tensor<8xf32>
  %hf = fsdp.reshape %h : tensor<2x4x8xf32> -> tensor<8x8xf32>
  %q2 = fsdp.matmul %hf, %wq transpose_rhs : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
  %k2 = fsdp.matmul %hf, %wk transpose_rhs : (tensor<8x8xf32>, tensor<4x8xf32>) -> tensor<8x4xf32>
  %v2 = fsdp.matmul %hf, %wv transpose_rhs : (tensor<8x8xf32>, tensor<4x8xf32>) -> tensor<8x4xf32>
  %q = fsdp.reshape %q2 : tensor<8x8xf32> -> tensor<2x4x8xf32>
  %k = fsdp.reshape %k2 : tensor<8x4xf32> -> tensor<2x4x4xf32>
  %v = fsdp.reshape %v2 : tensor<8x4xf32> -> tensor<2x4x4xf32>
  %qr = fsdp.rope %q heads = 2 theta = 1.0e+04 : tensor<2x4x8xf32>
  %kr = fsdp.rope %k heads = 1 theta = 1.0e+04 : tensor<2x4x4xf32>
  %a = fsdp.attention %qr, %kr, %v heads = 2 kv_heads = 1 causal : tensor<2x4x8xf32>, tensor<2x4x4xf32>
  %b = fsdp.attention %qr, %kr, %v heads = 4 kv_heads = 2 : tensor<2x4x8xf32>, tensor<2x4x4xf32>
  %ab = fsdp.add %a, %b : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %r = fsdp.add %x, %ab : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %m = fsdp.rms_norm %r, %n2 epsilon = 1.0e-05 : tensor<2x4x8xf32>, tensor<8xf32>
  %mf = fsdp.reshape %m : tensor<2x4x8xf32> -> tensor<8x8xf32>
  %g = fsdp.matmul %mf, %wg transpose_rhs : (tensor<8x8xf32>, tensor<12x8xf32>) -> tensor<8x12xf32>
  %u = fsdp.matmul %mf, %wu transpose_rhs : (tensor<8x8xf32>, tensor<12x8xf32>) -> tensor<8x12xf32>
  %s = fsdp.silu %g : tensor<8x12xf32>
  %su = fsdp.mul %s, %u : (tensor<8x12xf32>, tensor<8x12xf32>) -> tensor<8x12xf32>
  %o = fsdp.matmul %su, %wd transpose_rhs : (tensor<8x12xf32>, tensor<1x12xf32>) -> tensor<8x1xf32>
  %l = fsdp.mse_loss %o, %y : tensor<8x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
