// Gradient check: matmul with every transpose combination, rank 2 and
// batched rank 3, broadcast, sum_to, reduce_mean.
fsdp.param @w1 : tensor<5x6xf32> init("normal", 0.4)
fsdp.param @w2 : tensor<5x3xf32> init("normal", 0.4)
fsdp.param @p : tensor<6x4xf32> init("normal", 0.4)
fsdp.param @r : tensor<2x6x3xf32> init("normal", 0.4)
fsdp.param @t : tensor<2x3x2xf32> init("normal", 0.4)
func.func @model(%x: tensor<4x6xf32> {fsdp.role = "input"}, %y: tensor<4x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<5x6xf32>
  %w2 = fsdp.get_param @w2 : tensor<5x3xf32>
  %p = fsdp.get_param @p : tensor<6x4xf32>
  %r = fsdp.get_param @r : tensor<2x6x3xf32>
  %t = fsdp.get_param @t : tensor<2x3x2xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<4x6xf32>, tensor<5x6xf32>) -> tensor<4x5xf32>
  %h2 = fsdp.matmul %h, %w2 : (tensor<4x5xf32>, tensor<5x3xf32>) -> tensor<4x3xf32>
  %q = fsdp.matmul %p, %x transpose_lhs transpose_rhs : (tensor<6x4xf32>, tensor<4x6xf32>) -> tensor<4x4xf32>
  %q2 = fsdp.matmul %q, %p transpose_rhs : (tensor<4x4xf32>, tensor<6x4xf32>) -> tensor<4x6xf32>
  %x3 = fsdp.reshape %x : tensor<4x6xf32> -> tensor<2x2x6xf32>
  %b1 = fsdp.matmul %x3, %r : (tensor<2x2x6xf32>, tensor<2x6x3xf32>) -> tensor<2x2x3xf32>
  %b2 = fsdp.matmul %b1, %t : (tensor<2x2x3xf32>, tensor<2x3x2xf32>) -> tensor<2x2x2xf32>
  %b3 = fsdp.matmul %b2, %b1 transpose_lhs : (tensor<2x2x2xf32>, tensor<2x2x3xf32>) -> tensor<2x2x3xf32>
  %bf = fsdp.reshape %b3 : tensor<2x2x3xf32> -> tensor<4x3xf32>
  %s1 = fsdp.add %h2, %bf : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
  %qm = fsdp.reduce_mean %q2 dims = [1] : tensor<4x6xf32> -> tensor<4xf32>
  %qr = fsdp.reshape %qm : tensor<4xf32> -> tensor<4x1xf32>
  %qb = fsdp.broadcast %qr : tensor<4x1xf32> -> tensor<4x3xf32>
  %s2 = fsdp.mul %s1, %qb : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
  %st = fsdp.sum_to %s2 : tensor<4x3xf32> -> tensor<4x1xf32>
  %l = fsdp.mse_loss %st, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
