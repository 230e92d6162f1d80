module {
  fsdp.param @"transformer.wte.weight" : tensor<15x8xf32> init("normal", 0.02)
  fsdp.param @"transformer.wpe.weight" : tensor<4x8xf32> init("normal", 0.01)
  fsdp.param @"transformer.h.0.ln_1.weight" : tensor<8xf32> init("ones") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.ln_1.bias" : tensor<8xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.attn.c_attn.weight" : tensor<24x8xf32> init("normal", 0.02) unit "transformer.h.0"
  fsdp.param @"transformer.h.0.attn.c_attn.bias" : tensor<24xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.attn.c_proj.weight" : tensor<8x8xf32> init("normal", 0.0141421356) unit "transformer.h.0"
  fsdp.param @"transformer.h.0.attn.c_proj.bias" : tensor<8xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.ln_2.weight" : tensor<8xf32> init("ones") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.ln_2.bias" : tensor<8xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.mlp.c_fc.weight" : tensor<32x8xf32> init("normal", 0.02) unit "transformer.h.0"
  fsdp.param @"transformer.h.0.mlp.c_fc.bias" : tensor<32xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.h.0.mlp.c_proj.weight" : tensor<8x32xf32> init("normal", 0.0141421356) unit "transformer.h.0"
  fsdp.param @"transformer.h.0.mlp.c_proj.bias" : tensor<8xf32> init("zeros") unit "transformer.h.0"
  fsdp.param @"transformer.ln_f.weight" : tensor<8xf32> init("ones")
  fsdp.param @"transformer.ln_f.bias" : tensor<8xf32> init("zeros")
  func.func @model(%ids: tensor<2x4xi32> {fsdp.role = "input"}, %targets: tensor<2x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
    %v1 = fsdp.get_param @"transformer.wte.weight" : tensor<15x8xf32>
    %v2 = fsdp.get_param @"transformer.wpe.weight" : tensor<4x8xf32>
    %v3 = fsdp.embedding %v1, %ids : (tensor<15x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
    %v4 = fsdp.add %v3, %v2 : (tensor<2x4x8xf32>, tensor<4x8xf32>) -> tensor<2x4x8xf32>
    %v5 = fsdp.get_param @"transformer.h.0.ln_1.weight" : tensor<8xf32>
    %v6 = fsdp.get_param @"transformer.h.0.ln_1.bias" : tensor<8xf32>
    %v7 = fsdp.layer_norm %v4, %v5, %v6 : tensor<2x4x8xf32>, tensor<8xf32>
    %v8 = fsdp.reshape %v7 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v9 = fsdp.get_param @"transformer.h.0.attn.c_attn.weight" : tensor<24x8xf32>
    %v10 = fsdp.get_param @"transformer.h.0.attn.c_attn.bias" : tensor<24xf32>
    %v11 = fsdp.matmul %v8, %v9 transpose_rhs : (tensor<8x8xf32>, tensor<24x8xf32>) -> tensor<8x24xf32>
    %v12 = fsdp.bias_add %v11, %v10 : tensor<8x24xf32>, tensor<24xf32>
    %v13 = fsdp.reshape %v12 : tensor<8x24xf32> -> tensor<2x4x24xf32>
    %v14 = fsdp.slice %v13 dim = 2 offset = 0 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
    %v15 = fsdp.slice %v13 dim = 2 offset = 8 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
    %v16 = fsdp.slice %v13 dim = 2 offset = 16 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
    %v17 = fsdp.attention %v14, %v15, %v16 heads = 2 causal : tensor<2x4x8xf32>
    %v18 = fsdp.reshape %v17 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v19 = fsdp.get_param @"transformer.h.0.attn.c_proj.weight" : tensor<8x8xf32>
    %v20 = fsdp.get_param @"transformer.h.0.attn.c_proj.bias" : tensor<8xf32>
    %v21 = fsdp.matmul %v18, %v19 transpose_rhs : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %v22 = fsdp.bias_add %v21, %v20 : tensor<8x8xf32>, tensor<8xf32>
    %v23 = fsdp.reshape %v22 : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %v24 = fsdp.add %v4, %v23 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %v25 = fsdp.get_param @"transformer.h.0.ln_2.weight" : tensor<8xf32>
    %v26 = fsdp.get_param @"transformer.h.0.ln_2.bias" : tensor<8xf32>
    %v27 = fsdp.layer_norm %v24, %v25, %v26 : tensor<2x4x8xf32>, tensor<8xf32>
    %v28 = fsdp.reshape %v27 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v29 = fsdp.get_param @"transformer.h.0.mlp.c_fc.weight" : tensor<32x8xf32>
    %v30 = fsdp.get_param @"transformer.h.0.mlp.c_fc.bias" : tensor<32xf32>
    %v31 = fsdp.matmul %v28, %v29 transpose_rhs : (tensor<8x8xf32>, tensor<32x8xf32>) -> tensor<8x32xf32>
    %v32 = fsdp.bias_add %v31, %v30 : tensor<8x32xf32>, tensor<32xf32>
    %v33 = fsdp.gelu %v32 : tensor<8x32xf32>
    %v34 = fsdp.get_param @"transformer.h.0.mlp.c_proj.weight" : tensor<8x32xf32>
    %v35 = fsdp.get_param @"transformer.h.0.mlp.c_proj.bias" : tensor<8xf32>
    %v36 = fsdp.matmul %v33, %v34 transpose_rhs : (tensor<8x32xf32>, tensor<8x32xf32>) -> tensor<8x8xf32>
    %v37 = fsdp.bias_add %v36, %v35 : tensor<8x8xf32>, tensor<8xf32>
    %v38 = fsdp.reshape %v37 : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %v39 = fsdp.add %v24, %v38 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %v40 = fsdp.get_param @"transformer.ln_f.weight" : tensor<8xf32>
    %v41 = fsdp.get_param @"transformer.ln_f.bias" : tensor<8xf32>
    %v42 = fsdp.layer_norm %v39, %v40, %v41 : tensor<2x4x8xf32>, tensor<8xf32>
    %v43 = fsdp.reshape %v42 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v44 = fsdp.get_param @"transformer.wte.weight" : tensor<15x8xf32>
    %v45 = fsdp.matmul %v43, %v44 transpose_rhs : (tensor<8x8xf32>, tensor<15x8xf32>) -> tensor<8x15xf32>
    %v46 = fsdp.reshape %targets : tensor<2x4xi32> -> tensor<8xi32>
    %v47 = fsdp.cross_entropy %v45, %v46 {ignore_index = -100 : i64} : (tensor<8x15xf32>, tensor<8xi32>) -> tensor<f32>
    return %v47 : tensor<f32>
  }
}
