module {
  fsdp.param @"layers.0.in_proj.weight" : tensor<8x8xf32> init("uniform", 0.353553391) unit "layers.0"
  fsdp.param @"layers.0.in_proj.bias" : tensor<8xf32> init("uniform", 0.353553391) unit "layers.0"
  fsdp.param @"layers.0.out_proj.weight" : tensor<8x8xf32> init("uniform", 0.353553391) unit "layers.0"
  fsdp.param @"layers.0.out_proj.bias" : tensor<8xf32> init("uniform", 0.353553391) unit "layers.0"
  fsdp.param @"layers.1.in_proj.weight" : tensor<8x8xf32> init("uniform", 0.353553391) unit "layers.1"
  fsdp.param @"layers.1.in_proj.bias" : tensor<8xf32> init("uniform", 0.353553391) unit "layers.1"
  fsdp.param @"layers.1.out_proj.weight" : tensor<8x8xf32> init("uniform", 0.353553391) unit "layers.1"
  fsdp.param @"layers.1.out_proj.bias" : tensor<8xf32> init("uniform", 0.353553391) unit "layers.1"
  fsdp.param @"head.weight" : tensor<1x8xf32> init("uniform", 0.353553391)
  fsdp.param @"head.bias" : tensor<1xf32> init("uniform", 0.353553391)
  func.func @model(%x: tensor<4x8xf32> {fsdp.role = "input"}, %y: tensor<4x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
    %v1 = fsdp.get_param @"layers.0.in_proj.weight" : tensor<8x8xf32>
    %v2 = fsdp.get_param @"layers.0.in_proj.bias" : tensor<8xf32>
    %v3 = fsdp.matmul %x, %v1 transpose_rhs : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %v4 = fsdp.bias_add %v3, %v2 : tensor<4x8xf32>, tensor<8xf32>
    %v5 = fsdp.relu %v4 : tensor<4x8xf32>
    %v6 = fsdp.get_param @"layers.0.out_proj.weight" : tensor<8x8xf32>
    %v7 = fsdp.get_param @"layers.0.out_proj.bias" : tensor<8xf32>
    %v8 = fsdp.matmul %v5, %v6 transpose_rhs : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %v9 = fsdp.bias_add %v8, %v7 : tensor<4x8xf32>, tensor<8xf32>
    %v10 = fsdp.get_param @"layers.1.in_proj.weight" : tensor<8x8xf32>
    %v11 = fsdp.get_param @"layers.1.in_proj.bias" : tensor<8xf32>
    %v12 = fsdp.matmul %v9, %v10 transpose_rhs : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %v13 = fsdp.bias_add %v12, %v11 : tensor<4x8xf32>, tensor<8xf32>
    %v14 = fsdp.relu %v13 : tensor<4x8xf32>
    %v15 = fsdp.get_param @"layers.1.out_proj.weight" : tensor<8x8xf32>
    %v16 = fsdp.get_param @"layers.1.out_proj.bias" : tensor<8xf32>
    %v17 = fsdp.matmul %v14, %v15 transpose_rhs : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %v18 = fsdp.bias_add %v17, %v16 : tensor<4x8xf32>, tensor<8xf32>
    %v19 = fsdp.get_param @"head.weight" : tensor<1x8xf32>
    %v20 = fsdp.get_param @"head.bias" : tensor<1xf32>
    %v21 = fsdp.matmul %v18, %v19 transpose_rhs : (tensor<4x8xf32>, tensor<1x8xf32>) -> tensor<4x1xf32>
    %v22 = fsdp.bias_add %v21, %v20 : tensor<4x1xf32>, tensor<1xf32>
    %v23 = fsdp.bce_with_logits %v22, %y : tensor<4x1xf32> -> tensor<f32>
    return %v23 : tensor<f32>
  }
}
