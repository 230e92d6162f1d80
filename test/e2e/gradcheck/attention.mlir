// Gradient check: attention (causal and not), slice, concat, transpose,
// reshape, in a GPT-style block fragment.
fsdp.param @wqkv : tensor<24x8xf32> init("normal", 0.4)
fsdp.param @wo : tensor<1x16xf32> init("normal", 0.4)
func.func @model(%x: tensor<2x32xf32> {fsdp.role = "input"}, %y: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @wqkv : tensor<24x8xf32>
  %wo = fsdp.get_param @wo : tensor<1x16xf32>
  %xf = fsdp.reshape %x : tensor<2x32xf32> -> tensor<8x8xf32>
  %qkv = fsdp.matmul %xf, %w transpose_rhs : (tensor<8x8xf32>, tensor<24x8xf32>) -> tensor<8x24xf32>
  %q3 = fsdp.reshape %qkv : tensor<8x24xf32> -> tensor<2x4x24xf32>
  %q = fsdp.slice %q3 dim = 2 offset = 0 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %k = fsdp.slice %q3 dim = 2 offset = 8 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %v = fsdp.slice %q3 dim = 2 offset = 16 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %a = fsdp.attention %q, %k, %v heads = 2 causal : tensor<2x4x8xf32>
  %b = fsdp.attention %k, %q, %v heads = 4 : tensor<2x4x8xf32>
  %c = fsdp.concat %a, %b dim = 2 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x16xf32>
  %t = fsdp.transpose %c perm = [1, 0, 2] : tensor<2x4x16xf32> -> tensor<4x2x16xf32>
  %m = fsdp.reduce_mean %t dims = [0] : tensor<4x2x16xf32> -> tensor<2x16xf32>
  %o = fsdp.matmul %m, %wo transpose_rhs : (tensor<2x16xf32>, tensor<1x16xf32>) -> tensor<2x1xf32>
  %l = fsdp.mse_loss %o, %y : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
