// RUN: fsdp-opt %s | fsdp-opt | FileCheck %s
// RUN: fsdp-opt %s --mlir-print-op-generic | fsdp-opt | FileCheck %s

// Tests that every op of the dialect parses, prints and parses again.

// CHECK-LABEL: fsdp.param @w : tensor<8x4xf32> init("normal", 2.000000e-02) unit "layers.0"
fsdp.param @w : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
// CHECK: fsdp.param @b : tensor<8xf32> init("zeros") frozen
fsdp.param @b : tensor<8xf32> init("zeros") frozen
// CHECK: fsdp.param @u : tensor<8xf32> init("uniform", 5.000000e-01)
fsdp.param @u : tensor<8xf32> init("uniform", 0.5)
// CHECK: fsdp.param @o : tensor<8xf32> init("ones")
fsdp.param @o : tensor<8xf32> init("ones")
// CHECK: fsdp.state @w.exp_avg : tensor<8x4xf32> of @w kind "exp_avg"
fsdp.state @w.exp_avg : tensor<8x4xf32> of @w kind "exp_avg"
// 8-bit moments (state-dtype=8bit): 32 codes and one scale in blocks of 32.
// CHECK: fsdp.state @w.exp_avg_sq : tensor<36xi8> of @w kind "exp_avg_sq"
fsdp.state @w.exp_avg_sq : tensor<36xi8> of @w kind "exp_avg_sq"

// CHECK-LABEL: func.func @accessors
func.func @accessors(%x: tensor<8x4xf32>) {
  // CHECK: %[[W:.+]] = fsdp.get_param @w : tensor<8x4xf32>
  %w = fsdp.get_param @w : tensor<8x4xf32>
  // CHECK: fsdp.set_param @w = %[[W]] : tensor<8x4xf32>
  fsdp.set_param @w = %w : tensor<8x4xf32>
  // CHECK: fsdp.get_state @w.exp_avg : tensor<8x4xf32>
  %m = fsdp.get_state @w.exp_avg : tensor<8x4xf32>
  // CHECK: fsdp.set_state @w.exp_avg = %{{.+}} : tensor<8x4xf32>
  fsdp.set_state @w.exp_avg = %m : tensor<8x4xf32>
  // CHECK: fsdp.set_grad @w = %{{.+}} : tensor<8x4xf32>
  fsdp.set_grad @w = %x : tensor<8x4xf32>
  return
}

// CHECK-LABEL: func.func @elementwise
func.func @elementwise(%a: tensor<4x8xf32>, %b: tensor<8xf32>, %c: tensor<4x1xf32>) {
  // CHECK: fsdp.add %{{.+}}, %{{.+}} : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %0 = fsdp.add %a, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  // CHECK: fsdp.sub
  %1 = fsdp.sub %a, %c : (tensor<4x8xf32>, tensor<4x1xf32>) -> tensor<4x8xf32>
  // CHECK: fsdp.mul
  %2 = fsdp.mul %c, %b : (tensor<4x1xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  // CHECK: fsdp.div
  %3 = fsdp.div %a, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  // CHECK: fsdp.neg %{{.+}} : tensor<4x8xf32>
  %4 = fsdp.neg %a : tensor<4x8xf32>
  // CHECK: fsdp.relu
  %5 = fsdp.relu %a : tensor<4x8xf32>
  // CHECK: fsdp.gelu %{{.+}} : tensor<4x8xf32>
  %6 = fsdp.gelu %a : tensor<4x8xf32>
  // The default form is not printed; the exact one is.
  // CHECK: fsdp.gelu %{{.+}} : tensor<4x8xf32>
  %gt = fsdp.gelu %a {approximate = "tanh"} : tensor<4x8xf32>
  // CHECK: fsdp.gelu %{{.+}} {approximate = "none"} : tensor<4x8xf32>
  %ge = fsdp.gelu %a {approximate = "none"} : tensor<4x8xf32>
  // CHECK: fsdp.softmax
  %7 = fsdp.softmax %a : tensor<4x8xf32>
  // CHECK: fsdp.scale %{{.+}} {factor = 5.000000e-01 : f64} : tensor<4x8xf32>
  %8 = fsdp.scale %a {factor = 0.5 : f64} : tensor<4x8xf32>
  // CHECK: fsdp.fill {value = 1.000000e+00 : f64} : tensor<f32>
  %9 = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  // CHECK: fsdp.bias_add %{{.+}}, %{{.+}} : tensor<4x8xf32>, tensor<8xf32>
  %10 = fsdp.bias_add %a, %b : tensor<4x8xf32>, tensor<8xf32>
  // CHECK: fsdp.cast %{{.+}} : tensor<4x8xf32> -> tensor<4x8xbf16>
  %11 = fsdp.cast %a : tensor<4x8xf32> -> tensor<4x8xbf16>
  // CHECK: fsdp.cast %{{.+}} : tensor<4x8xbf16> -> tensor<4x8xf16>
  %12 = fsdp.cast %11 : tensor<4x8xbf16> -> tensor<4x8xf16>
  // Sums of bf16 / f16 written in f32 (fsdp-fuse-epilogues' widened sums).
  // CHECK: fsdp.sum_to %{{.+}} : tensor<4x8xbf16> -> tensor<8xf32>
  %w1 = fsdp.sum_to %11 : tensor<4x8xbf16> -> tensor<8xf32>
  // CHECK: fsdp.sum_to %{{.+}} : tensor<4x8xf16> -> tensor<1x8xf16>
  %w2 = fsdp.sum_to %12 : tensor<4x8xf16> -> tensor<1x8xf16>
  return
}

// CHECK-LABEL: func.func @structure
func.func @structure(%x: tensor<2x16x64xf32>, %w: tensor<128x64xf32>, %m: tensor<32x64xf32>,
                     %t: tensor<256x64xf32>, %ids: tensor<2x16xi32>, %xt: tensor<2x64x16xf32>) {
  // CHECK: fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs : (tensor<32x64xf32>, tensor<128x64xf32>) -> tensor<32x128xf32>
  %0 = fsdp.matmul %m, %w transpose_rhs : (tensor<32x64xf32>, tensor<128x64xf32>) -> tensor<32x128xf32>
  // CHECK: fsdp.matmul %{{.+}}, %{{.+}} acc %{{.+}} transpose_lhs : (tensor<32x64xf32>, tensor<32x128xf32>, tensor<64x128xf32>) -> tensor<64x128xf32>
  %acc = fsdp.matmul %m, %0 transpose_lhs : (tensor<32x64xf32>, tensor<32x128xf32>) -> tensor<64x128xf32>
  %acc2 = fsdp.matmul %m, %0 acc %acc transpose_lhs : (tensor<32x64xf32>, tensor<32x128xf32>, tensor<64x128xf32>) -> tensor<64x128xf32>
  // CHECK: fsdp.matmul_bias_grad %{{.+}}, %{{.+}} acc %{{.+}}, %{{.+}} transpose_lhs : (tensor<32x128xf32>, tensor<32x64xf32>, tensor<128x64xf32>, tensor<128xf32>) -> (tensor<128x64xf32>, tensor<128xf32>)
  %bw, %bb = fsdp.matmul_bias_grad %0, %m transpose_lhs : (tensor<32x128xf32>, tensor<32x64xf32>) -> (tensor<128x64xf32>, tensor<128xf32>)
  %bw2, %bb2 = fsdp.matmul_bias_grad %0, %m acc %bw, %bb transpose_lhs : (tensor<32x128xf32>, tensor<32x64xf32>, tensor<128x64xf32>, tensor<128xf32>) -> (tensor<128x64xf32>, tensor<128xf32>)
  // CHECK: fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<2x16x64xf32>, tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
  %1 = fsdp.matmul %x, %x transpose_lhs : (tensor<2x16x64xf32>, tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
  // CHECK: fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs transpose_rhs
  %2 = fsdp.matmul %x, %xt transpose_lhs transpose_rhs : (tensor<2x16x64xf32>, tensor<2x64x16xf32>) -> tensor<2x64x64xf32>
  %g = fsdp.get_param @o : tensor<8xf32>
  // CHECK: fsdp.layer_norm %{{.+}}, %{{.+}}, %{{.+}} {epsilon = 1.250000e-04 : f64} : tensor<2x16x64xf32>, tensor<64xf32>
  %gm = fsdp.slice %t dim = 0 offset = 0 : tensor<256x64xf32> -> tensor<1x64xf32>
  %gv = fsdp.reshape %gm : tensor<1x64xf32> -> tensor<64xf32>
  %3 = fsdp.layer_norm %x, %gv, %gv {epsilon = 1.25e-4 : f64} : tensor<2x16x64xf32>, tensor<64xf32>
  // CHECK: fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 4 causal : tensor<2x16x64xf32>
  %4 = fsdp.attention %x, %x, %x heads = 4 causal : tensor<2x16x64xf32>
  // CHECK: fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 2 : tensor<2x16x64xf32>
  %5 = fsdp.attention %x, %x, %x heads = 2 : tensor<2x16x64xf32>
  // CHECK: fsdp.embedding %{{.+}}, %{{.+}} : (tensor<256x64xf32>, tensor<2x16xi32>) -> tensor<2x16x64xf32>
  %6 = fsdp.embedding %t, %ids : (tensor<256x64xf32>, tensor<2x16xi32>) -> tensor<2x16x64xf32>
  // CHECK: fsdp.reshape %{{.+}} : tensor<2x16x64xf32> -> tensor<32x64xf32>
  %7 = fsdp.reshape %x : tensor<2x16x64xf32> -> tensor<32x64xf32>
  // CHECK: fsdp.reshape %{{.+}} : tensor<2x16xi32> -> tensor<32xi32>
  %8 = fsdp.reshape %ids : tensor<2x16xi32> -> tensor<32xi32>
  // CHECK: fsdp.microbatch %{{.+}} index = 1 : tensor<2x16xi32> -> tensor<1x16xi32>
  %mb = fsdp.microbatch %ids index = 1 : tensor<2x16xi32> -> tensor<1x16xi32>
  // CHECK: fsdp.microbatch %{{.+}} index = 0 : tensor<2x16x64xf32> -> tensor<1x16x64xf32>
  %mbx = fsdp.microbatch %x index = 0 : tensor<2x16x64xf32> -> tensor<1x16x64xf32>
  // CHECK: fsdp.transpose %{{.+}} perm = [1, 0, 2] : tensor<2x16x64xf32> -> tensor<16x2x64xf32>
  %9 = fsdp.transpose %x perm = [1, 0, 2] : tensor<2x16x64xf32> -> tensor<16x2x64xf32>
  // CHECK: fsdp.slice %{{.+}} dim = 2 offset = 32 : tensor<2x16x64xf32> -> tensor<2x16x32xf32>
  %10 = fsdp.slice %x dim = 2 offset = 32 : tensor<2x16x64xf32> -> tensor<2x16x32xf32>
  // CHECK: fsdp.concat %{{.+}}, %{{.+}} dim = 2 : (tensor<2x16x64xf32>, tensor<2x16x32xf32>) -> tensor<2x16x96xf32>
  %11 = fsdp.concat %x, %10 dim = 2 : (tensor<2x16x64xf32>, tensor<2x16x32xf32>) -> tensor<2x16x96xf32>
  // CHECK: fsdp.reduce_sum %{{.+}} dims = [0, 2] : tensor<2x16x64xf32> -> tensor<16xf32>
  %12 = fsdp.reduce_sum %x dims = [0, 2] : tensor<2x16x64xf32> -> tensor<16xf32>
  // CHECK: fsdp.reduce_mean %{{.+}} dims = [0, 1, 2] : tensor<2x16x64xf32> -> tensor<f32>
  %13 = fsdp.reduce_mean %x dims = [0, 1, 2] : tensor<2x16x64xf32> -> tensor<f32>
  // CHECK: fsdp.broadcast %{{.+}} : tensor<16xf32> -> tensor<4x16xf32>
  %14 = fsdp.broadcast %12 : tensor<16xf32> -> tensor<4x16xf32>
  // CHECK: fsdp.sum_to %{{.+}} : tensor<4x16xf32> -> tensor<1x16xf32>
  %15 = fsdp.sum_to %14 : tensor<4x16xf32> -> tensor<1x16xf32>
  return
}

// CHECK-LABEL: func.func @llama
func.func @llama(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x32xf32>, %w: tensor<64xf32>, %m: tensor<32x64xf32>) {
  // CHECK: fsdp.rms_norm %{{.+}}, %{{.+}} epsilon = 1.250000e-04 : tensor<2x16x64xf32>, tensor<64xf32>
  %0 = fsdp.rms_norm %x, %w epsilon = 1.25e-4 : tensor<2x16x64xf32>, tensor<64xf32>
  // CHECK: fsdp.rope %{{.+}} heads = 4 theta = 1.000000e+04 : tensor<2x16x64xf32>
  %1 = fsdp.rope %x heads = 4 theta = 10000.0 : tensor<2x16x64xf32>
  // CHECK: fsdp.rope %{{.+}} heads = 2 theta = 5.000000e+05 : tensor<2x16x32xf32>
  %2 = fsdp.rope %kv heads = 2 theta = 500000.0 : tensor<2x16x32xf32>
  // CHECK: fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32>
  %3 = fsdp.attention %1, %2, %kv heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32>
  // CHECK: fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 4 kv_heads = 1 : tensor<2x16x64xf32>, tensor<2x16x16xf32>
  %kv1 = fsdp.slice %kv dim = 2 offset = 0 : tensor<2x16x32xf32> -> tensor<2x16x16xf32>
  %4 = fsdp.attention %x, %kv1, %kv1 heads = 4 kv_heads = 1 : tensor<2x16x64xf32>, tensor<2x16x16xf32>
  // A kv_heads equal to heads is multi-head attention, printed with one type.
  // CHECK: fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 4 kv_heads = 4 : tensor<2x16x64xf32>{{$}}
  %5 = fsdp.attention %x, %x, %x heads = 4 kv_heads = 4 : tensor<2x16x64xf32>
  // With its log-sum-exp (f32 [B, heads, T], also for bf16 operands).
  // CHECK: %{{.+}}, %{{.+}} = fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32> -> tensor<2x4x16xf32>
  %7:2 = fsdp.attention %1, %2, %kv heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32> -> tensor<2x4x16xf32>
  // CHECK: %{{.+}}, %{{.+}} = fsdp.attention %{{.+}}, %{{.+}}, %{{.+}} heads = 2 : tensor<2x16x64xbf16> -> tensor<2x2x16xf32>
  %xb = fsdp.cast %x : tensor<2x16x64xf32> -> tensor<2x16x64xbf16>
  %8:2 = fsdp.attention %xb, %xb, %xb heads = 2 : tensor<2x16x64xbf16> -> tensor<2x2x16xf32>
  // CHECK: fsdp.silu %{{.+}} : tensor<32x64xf32>
  %6 = fsdp.silu %m : tensor<32x64xf32>
  return
}

// CHECK-LABEL: func.func @llama_backward
func.func @llama_backward(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x32xf32>, %w: tensor<64xf32>, %m: tensor<32x64xf32>, %lse: tensor<2x4x16xf32>) {
  // CHECK: fsdp.rms_norm_grad %{{.+}}, %{{.+}}, %{{.+}} epsilon = 1.000000e-05 : tensor<2x16x64xf32>, tensor<64xf32>
  %0:2 = fsdp.rms_norm_grad %x, %w, %x epsilon = 1.0e-5 : tensor<2x16x64xf32>, tensor<64xf32>
  // CHECK: fsdp.rope_grad %{{.+}} heads = 2 theta = 1.000000e+04 : tensor<2x16x32xf32>
  %1 = fsdp.rope_grad %kv heads = 2 theta = 10000.0 : tensor<2x16x32xf32>
  // CHECK: fsdp.attention_grad %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}} heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32>{{$}}
  %2:3 = fsdp.attention_grad %x, %kv, %kv, %x, %lse, %x heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32>
  // CHECK: fsdp.silu_grad %{{.+}}, %{{.+}} : tensor<32x64xf32>
  %3 = fsdp.silu_grad %m, %m : tensor<32x64xf32>
  return
}

// CHECK-LABEL: func.func @losses
func.func @losses(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %p: tensor<32x1xf32>, %b: tensor<2x16x256xf32>, %yb: tensor<2x16xi64>) {
  // CHECK: fsdp.cross_entropy %{{.+}}, %{{.+}} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
  %0 = fsdp.cross_entropy %l, %y : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
  // CHECK: fsdp.cross_entropy %{{.+}}, %{{.+}} : (tensor<2x16x256xf32>, tensor<2x16xi64>) -> tensor<f32>
  %1 = fsdp.cross_entropy %b, %yb : (tensor<2x16x256xf32>, tensor<2x16xi64>) -> tensor<f32>
  // CHECK: fsdp.mse_loss %{{.+}}, %{{.+}} : tensor<32x1xf32> -> tensor<f32>
  %2 = fsdp.mse_loss %p, %p : tensor<32x1xf32> -> tensor<f32>
  // CHECK: fsdp.bce_with_logits %{{.+}}, %{{.+}} : tensor<32x1xf32> -> tensor<f32>
  %3 = fsdp.bce_with_logits %p, %p : tensor<32x1xf32> -> tensor<f32>
  return
}

// CHECK-LABEL: func.func @backward
func.func @backward(%x: tensor<2x16x64xf32>, %m: tensor<8x64xf32>, %g: tensor<64xf32>, %ids: tensor<2x16xi32>,
                    %l: tensor<32x256xf32>, %y: tensor<32xi32>, %s: tensor<f32>, %p: tensor<32x1xf32>,
                    %lse: tensor<2x4x16xf32>) {
  // CHECK: fsdp.relu_grad %{{.+}}, %{{.+}} : tensor<8x64xf32>
  %0 = fsdp.relu_grad %m, %m : tensor<8x64xf32>
  // CHECK: fsdp.gelu_grad
  %1 = fsdp.gelu_grad %m, %m : tensor<8x64xf32>
  // CHECK: fsdp.softmax_grad
  %2 = fsdp.softmax_grad %m, %m : tensor<8x64xf32>
  // CHECK: fsdp.layer_norm_grad %{{.+}}, %{{.+}}, %{{.+}} {epsilon = 1.250000e-04 : f64} : tensor<8x64xf32>, tensor<64xf32>
  %3:3 = fsdp.layer_norm_grad %m, %g, %m {epsilon = 1.25e-4 : f64} : tensor<8x64xf32>, tensor<64xf32>
  // CHECK: fsdp.attention_grad %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}} heads = 4 causal : tensor<2x16x64xf32>{{$}}
  %4:3 = fsdp.attention_grad %x, %x, %x, %x, %lse, %x heads = 4 causal : tensor<2x16x64xf32>
  // CHECK: fsdp.embedding_grad %{{.+}}, %{{.+}} : (tensor<2x16xi32>, tensor<2x16x64xf32>) -> tensor<256x64xf32>
  %5 = fsdp.embedding_grad %ids, %x : (tensor<2x16xi32>, tensor<2x16x64xf32>) -> tensor<256x64xf32>
  // CHECK: fsdp.embedding_grad %{{.+}}, %{{.+}} : (tensor<2x16xi32>, tensor<2x16x64xbf16>) -> tensor<256x64xf32>
  %xb16 = fsdp.cast %x : tensor<2x16x64xf32> -> tensor<2x16x64xbf16>
  %w5 = fsdp.embedding_grad %ids, %xb16 : (tensor<2x16xi32>, tensor<2x16x64xbf16>) -> tensor<256x64xf32>
  // CHECK: fsdp.slice_grad %{{.+}} dim = 0 offset = 8 : tensor<8x64xf32> -> tensor<32x64xf32>
  %6 = fsdp.slice_grad %m dim = 0 offset = 8 : tensor<8x64xf32> -> tensor<32x64xf32>
  // CHECK: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}} : tensor<32x256xf32>, tensor<32xi32>
  %7 = fsdp.cross_entropy_grad %l, %y, %s : tensor<32x256xf32>, tensor<32xi32>
  // CHECK: fsdp.mse_loss_grad %{{.+}}, %{{.+}}, %{{.+}} : tensor<32x1xf32>
  %8 = fsdp.mse_loss_grad %p, %p, %s : tensor<32x1xf32>
  // CHECK: fsdp.bce_with_logits_grad %{{.+}}, %{{.+}}, %{{.+}} : tensor<32x1xf32>
  %9 = fsdp.bce_with_logits_grad %p, %p, %s : tensor<32x1xf32>
  return
}

// CHECK-LABEL: func.func @optimizer
func.func @optimizer(%p: tensor<64xf32>, %lr: tensor<f32>, %step: tensor<f32>, %q: tensor<72xi8>, %h: tensor<40xi8>) {
  // CHECK: fsdp.sgd_update %{{.+}}, %{{.+}}, %{{.+}} {weight_decay = 1.000000e-01 : f64} : tensor<64xf32>
  %0 = fsdp.sgd_update %p, %p, %lr {weight_decay = 0.1 : f64} : tensor<64xf32>
  // CHECK: fsdp.sgd_momentum_update %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}} {momentum = 9.000000e-01 : f64, nesterov} : tensor<64xf32>
  %1:2 = fsdp.sgd_momentum_update %p, %p, %p, %lr, %step {momentum = 0.9 : f64, nesterov} : tensor<64xf32>
  // CHECK: fsdp.adamw_update %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}} {beta1 = 8.000000e-01 : f64} : tensor<64xf32>
  %2:3 = fsdp.adamw_update %p, %p, %p, %p, %lr, %step {beta1 = 0.8 : f64} : tensor<64xf32>
  // fsdp-offload's overlapped host update and its join.
  // CHECK: %[[U:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host} : tensor<64xf32>
  // CHECK-NEXT: fsdp.wait %[[U]] : tensor<64xf32>
  %u:3 = fsdp.adamw_update %p, %p, %p, %p, %lr, %step {async, fsdp.on_host} : tensor<64xf32>
  %w = fsdp.wait %u#0 : tensor<64xf32>
  // bf16 state beside f32 parameters (state-dtype=bf16), stochastic.
  // CHECK: fsdp.adamw_update {{.*}} {key = 2 : i64, stochastic} : tensor<64xf32> state tensor<64xbf16>
  %m16 = fsdp.cast %p : tensor<64xf32> -> tensor<64xbf16>
  %a:3 = fsdp.adamw_update %p, %p, %m16, %m16, %lr, %step {key = 2 : i64, stochastic} : tensor<64xf32> state tensor<64xbf16>
  // 8-bit moments (state-dtype=8bit): 64 codes and 2 scales of 32.
  // CHECK: fsdp.adamw_update {{.*}} {state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
  %e:3 = fsdp.adamw_update %p, %p, %q, %q, %lr, %step {state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
  // 4-bit moments (state-dtype=4bit): 64 codes in 32 bytes and 2 scales.
  // CHECK: fsdp.adamw_update {{.*}} {state_bits = 4 : i64, state_block = 32 : i64} : tensor<64xf32> state tensor<40xi8>
  %f:3 = fsdp.adamw_update %p, %p, %h, %h, %lr, %step {state_bits = 4 : i64, state_block = 32 : i64} : tensor<64xf32> state tensor<40xi8>
  // CHECK: fsdp.sgd_momentum_update {{.*}} {key = 3 : i64, momentum = 9.000000e-01 : f64, stochastic} : tensor<64xf32> state tensor<64xbf16>
  %b:2 = fsdp.sgd_momentum_update %p, %p, %m16, %lr, %step {key = 3 : i64, momentum = 0.9 : f64, stochastic} : tensor<64xf32> state tensor<64xbf16>
  // CHECK: fsdp.sgd_momentum_update {{.*}} {momentum = 9.000000e-01 : f64, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
  %b8:2 = fsdp.sgd_momentum_update %p, %p, %q, %lr, %step {momentum = 0.9 : f64, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
  // CHECK: fsdp.lamb_norms {{.*}} : tensor<64xf32> state tensor<64xbf16> -> tensor<2xf32>
  %ln = fsdp.lamb_norms %p, %p, %m16, %m16, %step {segments = array<i64: 0, 64>} : tensor<64xf32> state tensor<64xbf16> -> tensor<2xf32>
  // CHECK: fsdp.lamb_update {{.*}} {key = 4 : i64, segments = array<i64: 0, 64>, stochastic} : tensor<64xf32>, tensor<2xf32> state tensor<64xbf16>
  %lu:3 = fsdp.lamb_update %p, %p, %m16, %m16, %ln, %lr, %step {key = 4 : i64, segments = array<i64: 0, 64>, stochastic} : tensor<64xf32>, tensor<2xf32> state tensor<64xbf16>
  // CHECK: fsdp.lamb_norms {{.*}} {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8> -> tensor<2xf32>
  %ln8 = fsdp.lamb_norms %p, %p, %q, %q, %step {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8> -> tensor<2xf32>
  // CHECK: fsdp.lamb_update {{.*}} {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32>, tensor<2xf32> state tensor<72xi8>
  %lu8:3 = fsdp.lamb_update %p, %p, %q, %q, %ln8, %lr, %step {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32>, tensor<2xf32> state tensor<72xi8>
  // CHECK: fsdp.squared_norm %{{.+}}, %{{.+}} : tensor<64xf32>, tensor<64xf32>
  %3 = fsdp.squared_norm %p, %p : tensor<64xf32>, tensor<64xf32>
  // CHECK: fsdp.clip_coef %{{.+}} {max_norm = 1.000000e+00 : f64} : tensor<f32>
  %4 = fsdp.clip_coef %3 {max_norm = 1.0 : f64} : tensor<f32>
  return
}

// CHECK-LABEL: fsdp.unit @unit0 : tensor<8xf32> shard tensor<4xf32> numel 8 params [@b] sharded
fsdp.unit @unit0 : tensor<8xf32> shard tensor<4xf32> numel 8 params [@b] sharded
// CHECK-LABEL: func.func @sharding
func.func @sharding(%g: tensor<4xf32>, %h: tensor<3xf32>) {
  // CHECK: fsdp.get_unit @unit0 : tensor<4xf32>
  %s = fsdp.get_unit @unit0 : tensor<4xf32>
  // CHECK: fsdp.all_gather %{{.+}} : tensor<4xf32> -> tensor<8xf32>
  %f = fsdp.all_gather %s : tensor<4xf32> -> tensor<8xf32>
  // CHECK: fsdp.view %{{.+}} offset = 1 : tensor<8xf32> -> tensor<2x3xf32>
  %v = fsdp.view %f offset = 1 : tensor<8xf32> -> tensor<2x3xf32>
  // CHECK: fsdp.shard_view %{{.+}} : tensor<8xf32> -> tensor<4xf32>
  %sv = fsdp.shard_view %f : tensor<8xf32> -> tensor<4xf32>
  // CHECK: fsdp.pack %{{.+}}, %{{.+}} offsets = [0, 4] : (tensor<4xf32>, tensor<3xf32>) -> tensor<8xf32>
  %p = fsdp.pack %g, %h offsets = [0, 4] : (tensor<4xf32>, tensor<3xf32>) -> tensor<8xf32>
  // CHECK: fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<8xf32> -> tensor<4xf32>
  %r = fsdp.reduce_scatter %p {reduce = "mean"} : tensor<8xf32> -> tensor<4xf32>
  // CHECK: fsdp.all_reduce %{{.+}} {reduce = "sum"} : tensor<4xf32>
  %a = fsdp.all_reduce %r {reduce = "sum"} : tensor<4xf32>
  // CHECK: fsdp.set_unit @unit0 = %{{.+}} : tensor<4xf32>
  fsdp.set_unit @unit0 = %a : tensor<4xf32>
  return
}
