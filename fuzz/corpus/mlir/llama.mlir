module {
  fsdp.param @"model.embed_tokens.weight" : tensor<16x8xf32> init("normal", 0.02)
  fsdp.param @"model.layers.0.input_layernorm.weight" : tensor<8xf32> init("ones") unit "model.layers.0"
  fsdp.param @"model.layers.0.self_attn.q_proj.weight" : tensor<8x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.self_attn.k_proj.weight" : tensor<4x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.self_attn.v_proj.weight" : tensor<4x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.self_attn.o_proj.weight" : tensor<8x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.post_attention_layernorm.weight" : tensor<8xf32> init("ones") unit "model.layers.0"
  fsdp.param @"model.layers.0.mlp.gate_proj.weight" : tensor<16x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.mlp.up_proj.weight" : tensor<16x8xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.layers.0.mlp.down_proj.weight" : tensor<8x16xf32> init("normal", 0.02) unit "model.layers.0"
  fsdp.param @"model.norm.weight" : tensor<8xf32> init("ones")
  fsdp.param @"lm_head.weight" : tensor<16x8xf32> init("normal", 0.02)
  func.func @model(%ids: tensor<2x4xi32> {fsdp.role = "input"}, %targets: tensor<2x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
    %v1 = fsdp.get_param @"model.embed_tokens.weight" : tensor<16x8xf32>
    %v2 = fsdp.embedding %v1, %ids : (tensor<16x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
    %v3 = fsdp.get_param @"model.layers.0.input_layernorm.weight" : tensor<8xf32>
    %v4 = fsdp.rms_norm %v2, %v3 epsilon = 1.0e-05 : tensor<2x4x8xf32>, tensor<8xf32>
    %v5 = fsdp.reshape %v4 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v6 = fsdp.get_param @"model.layers.0.self_attn.q_proj.weight" : tensor<8x8xf32>
    %v7 = fsdp.matmul %v5, %v6 transpose_rhs : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %v8 = fsdp.reshape %v7 : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %v9 = fsdp.get_param @"model.layers.0.self_attn.k_proj.weight" : tensor<4x8xf32>
    %v10 = fsdp.matmul %v5, %v9 transpose_rhs : (tensor<8x8xf32>, tensor<4x8xf32>) -> tensor<8x4xf32>
    %v11 = fsdp.reshape %v10 : tensor<8x4xf32> -> tensor<2x4x4xf32>
    %v12 = fsdp.get_param @"model.layers.0.self_attn.v_proj.weight" : tensor<4x8xf32>
    %v13 = fsdp.matmul %v5, %v12 transpose_rhs : (tensor<8x8xf32>, tensor<4x8xf32>) -> tensor<8x4xf32>
    %v14 = fsdp.reshape %v13 : tensor<8x4xf32> -> tensor<2x4x4xf32>
    %v15 = fsdp.rope %v8 heads = 2 theta = 10000.0 : tensor<2x4x8xf32>
    %v16 = fsdp.rope %v11 heads = 1 theta = 10000.0 : tensor<2x4x4xf32>
    %v17 = fsdp.attention %v15, %v16, %v14 heads = 2 kv_heads = 1 causal : tensor<2x4x8xf32>, tensor<2x4x4xf32>
    %v18 = fsdp.reshape %v17 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v19 = fsdp.get_param @"model.layers.0.self_attn.o_proj.weight" : tensor<8x8xf32>
    %v20 = fsdp.matmul %v18, %v19 transpose_rhs : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %v21 = fsdp.reshape %v20 : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %v22 = fsdp.add %v2, %v21 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %v23 = fsdp.get_param @"model.layers.0.post_attention_layernorm.weight" : tensor<8xf32>
    %v24 = fsdp.rms_norm %v22, %v23 epsilon = 1.0e-05 : tensor<2x4x8xf32>, tensor<8xf32>
    %v25 = fsdp.reshape %v24 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v26 = fsdp.get_param @"model.layers.0.mlp.gate_proj.weight" : tensor<16x8xf32>
    %v27 = fsdp.matmul %v25, %v26 transpose_rhs : (tensor<8x8xf32>, tensor<16x8xf32>) -> tensor<8x16xf32>
    %v28 = fsdp.get_param @"model.layers.0.mlp.up_proj.weight" : tensor<16x8xf32>
    %v29 = fsdp.matmul %v25, %v28 transpose_rhs : (tensor<8x8xf32>, tensor<16x8xf32>) -> tensor<8x16xf32>
    %v30 = fsdp.silu %v27 : tensor<8x16xf32>
    %v31 = fsdp.mul %v30, %v29 : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
    %v32 = fsdp.get_param @"model.layers.0.mlp.down_proj.weight" : tensor<8x16xf32>
    %v33 = fsdp.matmul %v31, %v32 transpose_rhs : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x8xf32>
    %v34 = fsdp.reshape %v33 : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %v35 = fsdp.add %v22, %v34 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
    %v36 = fsdp.get_param @"model.norm.weight" : tensor<8xf32>
    %v37 = fsdp.rms_norm %v35, %v36 epsilon = 1.0e-05 : tensor<2x4x8xf32>, tensor<8xf32>
    %v38 = fsdp.reshape %v37 : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %v39 = fsdp.get_param @"lm_head.weight" : tensor<16x8xf32>
    %v40 = fsdp.matmul %v38, %v39 transpose_rhs : (tensor<8x8xf32>, tensor<16x8xf32>) -> tensor<8x16xf32>
    %v41 = fsdp.reshape %targets : tensor<2x4xi32> -> tensor<8xi32>
    %v42 = fsdp.cross_entropy %v40, %v41 : (tensor<8x16xf32>, tensor<8xi32>) -> tensor<f32>
    return %v42 : tensor<f32>
  }
}
