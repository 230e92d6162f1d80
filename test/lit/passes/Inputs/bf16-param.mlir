// A model whose parameter is declared bf16 (mixed-precision-invalid.mlir):
// with mixed precision the parameters are the f32 master copy.
fsdp.param @w : tensor<1x4xbf16> init("normal", 0.02)

func.func @model(%x: tensor<2x4xbf16> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4xbf16>
  %o = fsdp.matmul %x, %w transpose_rhs : (tensor<2x4xbf16>, tensor<1x4xbf16>) -> tensor<2x1xbf16>
  %of = fsdp.cast %o : tensor<2x1xbf16> -> tensor<2x1xf32>
  %l = fsdp.mse_loss %of, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
