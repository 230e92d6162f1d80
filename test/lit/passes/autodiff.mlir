// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff | FileCheck %s

// Tests that a linear layer gets the two matmul VJPs, the bias a sum_to,
// and that the input (not trainable) gets no gradient.
fsdp.param @w : tensor<8x4xf32> init("normal", 0.02)
fsdp.param @b : tensor<8xf32> init("zeros")
// CHECK-LABEL: func.func @train_step
// CHECK-SAME: attributes {fsdp.train_step}
func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  // CHECK: %[[W:.+]] = fsdp.get_param @w
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %b = fsdp.get_param @b : tensor<8xf32>
  // CHECK: %[[H:.+]] = fsdp.matmul %[[X:.+]], %[[W]] transpose_rhs
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  // CHECK: %[[HB:.+]] = fsdp.bias_add %[[H]]
  %hb = fsdp.bias_add %h, %b : tensor<16x8xf32>, tensor<8xf32>
  // CHECK: %[[R:.+]] = fsdp.relu %[[HB]]
  %r = fsdp.relu %hb : tensor<16x8xf32>
  // CHECK: %[[L:.+]] = fsdp.mse_loss %[[R]], %[[Y:.+]] :
  %l = fsdp.mse_loss %r, %y : tensor<16x8xf32> -> tensor<f32>
  // CHECK: %[[ONE:.+]] = fsdp.fill {value = 1.000000e+00 : f64} : tensor<f32>
  // CHECK: %[[DR:.+]] = fsdp.mse_loss_grad %[[R]], %[[Y]], %[[ONE]]
  // CHECK: %[[DHB:.+]] = fsdp.relu_grad %[[HB]], %[[DR]]
  // CHECK: %[[DB:.+]] = fsdp.sum_to %[[DHB]] : tensor<16x8xf32> -> tensor<8xf32>
  // CHECK: %[[DW:.+]] = fsdp.matmul %[[DHB]], %[[X]] transpose_lhs : (tensor<16x8xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  // CHECK-NOT: fsdp.matmul %[[DHB]], %[[W]]
  // CHECK: fsdp.set_grad @w = %[[DW]]
  // CHECK: fsdp.set_grad @b = %[[DB]]
  // CHECK: return %[[L]]
  return %l : tensor<f32>
}

// -----

// Tests that a parameter read twice (tied embedding / LM head) gets the sum
// of both contributions, and that a frozen parameter gets no gradient.
fsdp.param @wte : tensor<16x8xf32> init("normal", 0.02)
fsdp.param @g : tensor<8xf32> init("ones") frozen
fsdp.param @bb : tensor<8xf32> init("zeros")
// CHECK-LABEL: func.func @train_step
func.func @model(%ids: tensor<2x4xi32>, %t: tensor<8xi32>) -> tensor<f32> attributes {fsdp.model} {
  %wte = fsdp.get_param @wte : tensor<16x8xf32>
  %g = fsdp.get_param @g : tensor<8xf32>
  %bb = fsdp.get_param @bb : tensor<8xf32>
  %e = fsdp.embedding %wte, %ids : (tensor<16x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
  %n = fsdp.layer_norm %e, %g, %bb : tensor<2x4x8xf32>, tensor<8xf32>
  %h = fsdp.reshape %n : tensor<2x4x8xf32> -> tensor<8x8xf32>
  %wte2 = fsdp.get_param @wte : tensor<16x8xf32>
  %logits = fsdp.matmul %h, %wte2 transpose_rhs : (tensor<8x8xf32>, tensor<16x8xf32>) -> tensor<8x16xf32>
  %l = fsdp.cross_entropy %logits, %t : (tensor<8x16xf32>, tensor<8xi32>) -> tensor<f32>
  // CHECK: %[[DLOG:.+]] = fsdp.cross_entropy_grad
  // CHECK: %[[DHEAD:.+]] = fsdp.matmul %[[DLOG]], %{{.+}} transpose_lhs
  // CHECK: %[[DX:[^,]+]], %{{[^,]+}}, %[[DBETA:[^ ]+]] = fsdp.layer_norm_grad
  // CHECK: %[[DEMB:.+]] = fsdp.embedding_grad %{{.+}}, %[[DX]]
  // CHECK: %[[SUM:.+]] = fsdp.add %[[DEMB]], %[[DHEAD]]
  // CHECK-NOT: fsdp.set_grad @g
  // CHECK: fsdp.set_grad @wte = %[[SUM]]
  // CHECK: fsdp.set_grad @bb = %[[DBETA]]
  return %l : tensor<f32>
}

// -----

// Tests the VJPs of the shape ops: transpose inverts its permutation,
// slice becomes slice_grad, reduce_mean broadcasts and scales, concat
// slices its gradient.
fsdp.param @p : tensor<2x3x4xf32> init("normal", 1.0)
// CHECK-LABEL: func.func @train_step
func.func @model(%x: tensor<4x3x2xf32>) -> tensor<f32> attributes {fsdp.model} {
  %p = fsdp.get_param @p : tensor<2x3x4xf32>
  %t = fsdp.transpose %p perm = [2, 0, 1] : tensor<2x3x4xf32> -> tensor<4x2x3xf32>
  %s = fsdp.slice %t dim = 2 offset = 1 : tensor<4x2x3xf32> -> tensor<4x2x2xf32>
  %c = fsdp.concat %s, %s dim = 1 : (tensor<4x2x2xf32>, tensor<4x2x2xf32>) -> tensor<4x4x2xf32>
  %m = fsdp.reduce_mean %c dims = [0, 1, 2] : tensor<4x4x2xf32> -> tensor<f32>
  // CHECK: %[[R:.+]] = fsdp.reshape %{{.+}} : tensor<f32> -> tensor<1x1x1xf32>
  // CHECK: %[[B:.+]] = fsdp.broadcast %[[R]] : tensor<1x1x1xf32> -> tensor<4x4x2xf32>
  // CHECK: %[[S:.+]] = fsdp.scale %[[B]] {factor = 3.125000e-02 : f64}
  // CHECK: %[[S0:.+]] = fsdp.slice %[[S]] dim = 1 offset = 0
  // CHECK: %[[S1:.+]] = fsdp.slice %[[S]] dim = 1 offset = 2
  // CHECK: %[[A:.+]] = fsdp.add %[[S0]], %[[S1]]
  // CHECK: %[[SG:.+]] = fsdp.slice_grad %[[A]] dim = 2 offset = 1 : tensor<4x2x2xf32> -> tensor<4x2x3xf32>
  // CHECK: %[[T:.+]] = fsdp.transpose %[[SG]] perm = [1, 2, 0] : tensor<4x2x3xf32> -> tensor<2x3x4xf32>
  // CHECK: fsdp.set_grad @p = %[[T]]
  return %m : tensor<f32>
}

// -----

// Tests the attention VJP and the gelu VJP in a GPT block fragment.
fsdp.param @wqkv : tensor<24x8xf32> init("normal", 0.02)
// CHECK-LABEL: func.func @train_step
func.func @model(%x: tensor<2x4x8xf32>, %y: tensor<2x4x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @wqkv : tensor<24x8xf32>
  %xf = fsdp.reshape %x : tensor<2x4x8xf32> -> tensor<8x8xf32>
  %qkv = fsdp.matmul %xf, %w transpose_rhs : (tensor<8x8xf32>, tensor<24x8xf32>) -> tensor<8x24xf32>
  %q3 = fsdp.reshape %qkv : tensor<8x24xf32> -> tensor<2x4x24xf32>
  %q = fsdp.slice %q3 dim = 2 offset = 0 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %k = fsdp.slice %q3 dim = 2 offset = 8 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %v = fsdp.slice %q3 dim = 2 offset = 16 : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %a = fsdp.attention %q, %k, %v heads = 2 causal : tensor<2x4x8xf32>
  %g = fsdp.gelu %a {approximate = "none"} : tensor<2x4x8xf32>
  %l = fsdp.mse_loss %g, %y : tensor<2x4x8xf32> -> tensor<f32>
  // The forward keeps its log-sum-exp for the backward (f32 [B, heads, T]).
  // CHECK: %[[Y:[^,]+]], %[[LSE:[^ ]+]] = fsdp.attention %[[Q:[^,]+]], %[[K:[^,]+]], %[[V:[^ ]+]] heads = 2 causal : tensor<2x4x8xf32> -> tensor<2x2x4xf32>
  // The VJP keeps the form (exact GELU here).
  // CHECK: %[[DG:.+]] = fsdp.gelu_grad %{{.+}}, %{{.+}} {approximate = "none"}
  // CHECK: %[[DQ:[^,]+]], %[[DK:[^,]+]], %[[DV:[^ ]+]] = fsdp.attention_grad %[[Q]], %[[K]], %[[V]], %[[Y]], %[[LSE]], %[[DG]] heads = 2 causal : tensor<2x4x8xf32>{{$}}
  // CHECK: fsdp.slice_grad %[[DV]] dim = 2 offset = 16
  // CHECK: fsdp.slice_grad %[[DK]] dim = 2 offset = 8
  // CHECK: fsdp.slice_grad %[[DQ]] dim = 2 offset = 0
  // CHECK: fsdp.set_grad @wqkv
  return %l : tensor<f32>
}

// -----

// Tests the Llama VJPs: silu, grouped-query attention (key and value
// gradients of the key/value type), rope (rotated back, summed with the
// value gradient of the same tensor) and rms_norm.
fsdp.param @wn : tensor<8xf32> init("ones")
fsdp.param @wk : tensor<4x8xf32> init("normal", 0.02)
// CHECK-LABEL: func.func @train_step
func.func @model(%x: tensor<2x4x8xf32>, %y: tensor<2x4x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %wn = fsdp.get_param @wn : tensor<8xf32>
  %wk = fsdp.get_param @wk : tensor<4x8xf32>
  %h = fsdp.rms_norm %x, %wn epsilon = 1.0e-5 : tensor<2x4x8xf32>, tensor<8xf32>
  %hf = fsdp.reshape %h : tensor<2x4x8xf32> -> tensor<8x8xf32>
  %k2 = fsdp.matmul %hf, %wk transpose_rhs : (tensor<8x8xf32>, tensor<4x8xf32>) -> tensor<8x4xf32>
  %k = fsdp.reshape %k2 : tensor<8x4xf32> -> tensor<2x4x4xf32>
  %kr = fsdp.rope %k heads = 1 theta = 1.0e4 : tensor<2x4x4xf32>
  %a = fsdp.attention %h, %kr, %k heads = 2 kv_heads = 1 causal : tensor<2x4x8xf32>, tensor<2x4x4xf32>
  %s = fsdp.silu %a : tensor<2x4x8xf32>
  %l = fsdp.mse_loss %s, %y : tensor<2x4x8xf32> -> tensor<f32>
  // CHECK: %[[Y:[^,]+]], %[[LSE:[^ ]+]] = fsdp.attention {{.+}} -> tensor<2x2x4xf32>
  // CHECK: %[[DS:.+]] = fsdp.silu_grad
  // CHECK: %[[DQ:[^,]+]], %[[DK:[^,]+]], %[[DV:[^ ]+]] = fsdp.attention_grad %{{.+}}, %{{.+}}, %{{.+}}, %[[Y]], %[[LSE]], %[[DS]] heads = 2 kv_heads = 1 causal : tensor<2x4x8xf32>, tensor<2x4x4xf32>{{$}}
  // CHECK: %[[DR:.+]] = fsdp.rope_grad %[[DK]] heads = 1 theta = 1.000000e+04 : tensor<2x4x4xf32>
  // CHECK: fsdp.add %[[DV]], %[[DR]]
  // CHECK: fsdp.rms_norm_grad %{{.+}}, %{{.+}}, %{{.+}} epsilon = 1.000000e-05 : tensor<2x4x8xf32>, tensor<8xf32>
  // CHECK: fsdp.set_grad @wn
  // CHECK: fsdp.set_grad @wk
  return %l : tensor<f32>
}

// -----

// swiglu (which fsdp-fuse-epilogues writes, and a model may too): one
// swiglu_grad gives both operands' gradients.
fsdp.param @wg : tensor<8x4xf32> init("normal", 0.02)
fsdp.param @wu : tensor<8x4xf32> init("normal", 0.02)
// CHECK-LABEL: func.func @train_step
// CHECK: %[[G:.+]] = fsdp.matmul %{{.+}}, %[[WG:.+]] transpose_rhs
// CHECK: %[[U:.+]] = fsdp.matmul %{{.+}}, %[[WU:.+]] transpose_rhs
// CHECK: %[[H:.+]] = fsdp.swiglu %[[G]], %[[U]] : tensor<16x8xf32>
// CHECK: %[[DG:[a-z_0-9]+]], %[[DU:[a-z_0-9]+]] = fsdp.swiglu_grad %[[G]], %[[U]], %{{.+}} : tensor<16x8xf32>
// CHECK-DAG: fsdp.matmul %[[DG]], %{{.+}} transpose_lhs
// CHECK-DAG: fsdp.matmul %[[DU]], %{{.+}} transpose_lhs
func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %wg = fsdp.get_param @wg : tensor<8x4xf32>
  %wu = fsdp.get_param @wu : tensor<8x4xf32>
  %g = fsdp.matmul %x, %wg transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %u = fsdp.matmul %x, %wu transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %h = fsdp.swiglu %g, %u : tensor<16x8xf32>
  %l = fsdp.mse_loss %h, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
