// RUN: fsdp-opt %s -split-input-file -fsdp-fuse-epilogues | FileCheck %s
// RUN: fsdp-opt %s -split-input-file -fsdp-fuse-epilogues | fsdp-opt -split-input-file | FileCheck %s
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 stage=3 optimizer=adamw max-grad-norm=1.0 report=false" | FileCheck %s --check-prefix=GPT
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 stage=3 optimizer=adamw max-grad-norm=1.0 report=false fuse-epilogues=false" | FileCheck %s --check-prefix=OFF
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 stage=3 recompute=selective report=false" | FileCheck %s --check-prefix=SEL
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 stage=3 param-dtype=bf16 report=false" | FileCheck %s --check-prefix=BF16
// RUN: fsdp-opt %fsdp_src/examples/llama_small.mlir --fsdp-pipeline="world-size=2 stage=3 optimizer=adamw param-dtype=bf16 report=false" | FileCheck %s --check-prefix=LLAMA
// RUN: fsdp-opt %fsdp_src/examples/llama_small.mlir --fsdp-pipeline="world-size=2 stage=3 optimizer=adamw recompute=selective report=false" | FileCheck %s --check-prefix=LLAMA

// A linear layer + GELU whose pre-activation the backward pass reads: one
// kernel with two results; the backward's matmul + gelu_grad + bias
// gradient: one kernel with two results.
// CHECK-LABEL: func.func @mlp
// CHECK: %[[G:.*]], %[[PRE:.*]] = fsdp.matmul_bias %arg0, %arg1, %arg2 transpose_rhs gelu : (tensor<8x4xf32>, tensor<16x4xf32>, tensor<16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>)
// CHECK-NEXT: %[[Y:.*]] = fsdp.matmul_bias %[[G]], %arg3, %arg4 transpose_rhs : (tensor<8x16xf32>, tensor<4x16xf32>, tensor<4xf32>) -> tensor<8x4xf32>
// CHECK-NEXT: %[[DH:.*]], %[[DB:.*]] = fsdp.matmul_gelu_grad %arg5, %arg3, %[[PRE]] : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16xf32>)
// CHECK-NEXT: %[[DW:.*]] = fsdp.matmul %[[DH]], %arg0 transpose_lhs
// CHECK-NOT: fsdp.bias_add
// CHECK-NOT: fsdp.gelu
// CHECK-NOT: fsdp.sum_to
// CHECK: return %[[Y]], %[[DB]], %[[DW]]
func.func @mlp(%x: tensor<8x4xf32>, %w1: tensor<16x4xf32>, %b1: tensor<16xf32>,
               %w2: tensor<4x16xf32>, %b2: tensor<4xf32>, %dy: tensor<8x4xf32>)
    -> (tensor<8x4xf32>, tensor<16xf32>, tensor<16x4xf32>) {
  %m = fsdp.matmul %x, %w1 transpose_rhs : (tensor<8x4xf32>, tensor<16x4xf32>) -> tensor<8x16xf32>
  %h = fsdp.bias_add %m, %b1 : tensor<8x16xf32>, tensor<16xf32>
  %g = fsdp.gelu %h : tensor<8x16xf32>
  %m2 = fsdp.matmul %g, %w2 transpose_rhs : (tensor<8x16xf32>, tensor<4x16xf32>) -> tensor<8x4xf32>
  %y = fsdp.bias_add %m2, %b2 : tensor<8x4xf32>, tensor<4xf32>
  %dg = fsdp.matmul %dy, %w2 : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %dh = fsdp.gelu_grad %h, %dg : tensor<8x16xf32>
  %db = fsdp.sum_to %dh : tensor<8x16xf32> -> tensor<16xf32>
  %dw = fsdp.matmul %dh, %x transpose_lhs : (tensor<8x16xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
  return %y, %db, %dw : tensor<8x4xf32>, tensor<16xf32>, tensor<16x4xf32>
}

// -----

// A GELU whose input nothing else reads: no pre-activation result. A
// gelu_grad without a bias gradient: one result.
// CHECK-LABEL: func.func @no_extra_results
// CHECK: %[[G:.*]] = fsdp.matmul_bias %arg0, %arg1, %arg2 gelu : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<16xf32>) -> tensor<8x16xf32>
// CHECK: %[[D:.*]] = fsdp.matmul_gelu_grad %arg0, %arg1, %arg3 : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
// CHECK: return %[[G]], %[[D]]
func.func @no_extra_results(%x: tensor<8x4xf32>, %w: tensor<4x16xf32>, %b: tensor<16xf32>,
                            %pre: tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>) {
  %m = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %h = fsdp.bias_add %m, %b : tensor<8x16xf32>, tensor<16xf32>
  %g = fsdp.gelu %h : tensor<8x16xf32>
  %d = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %dp = fsdp.gelu_grad %pre, %d : tensor<8x16xf32>
  return %g, %dp : tensor<8x16xf32>, tensor<8x16xf32>
}

// -----

// Left alone: a product read twice (it must be stored), the exact (erf)
// GELU and its gradient (cuBLASLt's GELU is the tanh form), a batched
// (rank-3) product, and a sum_to that is not the bias gradient.
// CHECK-LABEL: func.func @not_fused
// CHECK: %[[M:.*]] = fsdp.matmul %arg0, %arg1 :
// CHECK: fsdp.bias_add %[[M]], %arg2
// CHECK: %[[E:.*]] = fsdp.matmul_bias %arg0, %arg1, %arg2 : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<16xf32>) -> tensor<8x16xf32>
// CHECK: fsdp.gelu %[[E]] {approximate = "none"}
// CHECK: %[[B:.*]] = fsdp.matmul %arg3, %arg4 :
// CHECK: fsdp.bias_add %[[B]], %arg2
// CHECK: %[[D:.*]] = fsdp.matmul %arg0, %arg1 :
// CHECK: fsdp.gelu_grad %arg5, %[[D]] {approximate = "none"}
// CHECK: %[[D2:.*]], %[[DB:.*]] = fsdp.matmul_gelu_grad %arg0, %arg1, %arg5
// CHECK: fsdp.sum_to %[[D2]] : tensor<8x16xf32> -> tensor<1x16xf32>
func.func @not_fused(%x: tensor<8x4xf32>, %w: tensor<4x16xf32>, %b: tensor<16xf32>,
                     %bx: tensor<2x8x4xf32>, %bw: tensor<2x4x16xf32>, %pre: tensor<8x16xf32>)
    -> (tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<2x8x16xf32>,
        tensor<8x16xf32>, tensor<1x16xf32>, tensor<16xf32>) {
  %m = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %h = fsdp.bias_add %m, %b : tensor<8x16xf32>, tensor<16xf32>
  %m1 = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %h1 = fsdp.bias_add %m1, %b : tensor<8x16xf32>, tensor<16xf32>
  %e = fsdp.gelu %h1 {approximate = "none"} : tensor<8x16xf32>
  %bm = fsdp.matmul %bx, %bw : (tensor<2x8x4xf32>, tensor<2x4x16xf32>) -> tensor<2x8x16xf32>
  %bh = fsdp.bias_add %bm, %b : tensor<2x8x16xf32>, tensor<16xf32>
  %d = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %dx = fsdp.gelu_grad %pre, %d {approximate = "none"} : tensor<8x16xf32>
  %d2 = fsdp.matmul %x, %w : (tensor<8x4xf32>, tensor<4x16xf32>) -> tensor<8x16xf32>
  %dp = fsdp.gelu_grad %pre, %d2 : tensor<8x16xf32>
  %keep = fsdp.sum_to %dp : tensor<8x16xf32> -> tensor<1x16xf32>
  %db = fsdp.sum_to %dp : tensor<8x16xf32> -> tensor<16xf32>
  return %h, %m, %e, %bh, %dx, %keep, %db : tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>,
      tensor<2x8x16xf32>, tensor<8x16xf32>, tensor<1x16xf32>, tensor<16xf32>
}

// -----

// The Llama's MLPs, in bf16 and with selective recomputation (which re-runs
// the silu in the backward pass): every silu and silu_grad fused.
// Its residual stream as GPT's: residual_rms_norm, rms_norm_grad_acc.
// LLAMA-NOT: fsdp.silu
// LLAMA: fsdp.residual_rms_norm
// LLAMA: fsdp.swiglu %{{.*}} : tensor<
// LLAMA: fsdp.swiglu %{{.*}} : tensor<
// LLAMA: fsdp.swiglu_grad
// LLAMA: fsdp.rms_norm_grad_acc
// LLAMA: fsdp.swiglu_grad
// LLAMA-NOT: fsdp.silu

// The RMS norm's residual forms, as the layer norm's (@residual below):
// an add read first by an rms_norm, an rms_norm_grad's input gradient
// added to the residual's gradient.
// CHECK-LABEL: func.func @residual_rms
// CHECK-NEXT: %[[S:.*]], %[[Y:.*]] = fsdp.residual_rms_norm %arg0, %arg1, %arg2 epsilon = 1.000000e-05 : tensor<4x8xf32>, tensor<8xf32>
// CHECK-NEXT: %[[DX:.*]], %[[DW:.*]] = fsdp.rms_norm_grad_acc %[[S]], %arg2, %arg3, %arg4 epsilon = 1.000000e-05 : tensor<4x8xf32>, tensor<8xf32>
// CHECK-NEXT: return %[[S]], %[[Y]], %[[DX]], %[[DW]]
func.func @residual_rms(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>, %w: tensor<8xf32>,
                        %dy: tensor<4x8xf32>, %res: tensor<4x8xf32>)
    -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>) {
  %s = fsdp.add %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %y = fsdp.rms_norm %s, %w epsilon = 1.000000e-05 : tensor<4x8xf32>, tensor<8xf32>
  %dx, %dw = fsdp.rms_norm_grad %s, %w, %dy epsilon = 1.000000e-05 : tensor<4x8xf32>, tensor<8xf32>
  %t = fsdp.add %res, %dx : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return %s, %y, %t, %dw : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>
}

// -----

// SwiGLU: autodiff's VJP of mul(silu(g), u) (mul(dh, u), mul(dh, s),
// silu_grad(g, .)) becomes one swiglu_grad, after which the forward's silu
// is read only by its mul: one swiglu, silu(g) never stored. Left alone: a
// silu read by something else too (its mul stays), and a silu squared.
// CHECK-LABEL: func.func @swiglu
// CHECK-NEXT: %[[H:.*]] = fsdp.swiglu %arg0, %arg1 : tensor<4x8xf32>
// CHECK-NEXT: %[[DG:.*]], %[[DU:.*]] = fsdp.swiglu_grad %arg0, %arg1, %arg2 : tensor<4x8xf32>
// CHECK-NEXT: %[[S2:.*]] = fsdp.silu %arg1
// CHECK-NEXT: fsdp.mul %[[S2]], %arg0
// CHECK-NEXT: fsdp.neg %[[S2]]
// CHECK-NEXT: %[[S3:.*]] = fsdp.silu %arg0
// CHECK-NEXT: fsdp.mul %[[S3]], %[[S3]]
// CHECK: return %[[H]], %[[DG]], %[[DU]]
func.func @swiglu(%g: tensor<4x8xf32>, %u: tensor<4x8xf32>, %dh: tensor<4x8xf32>)
    -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>,
        tensor<4x8xf32>) {
  %s = fsdp.silu %g : tensor<4x8xf32>
  %h = fsdp.mul %s, %u : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %t = fsdp.mul %dh, %u : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %du = fsdp.mul %dh, %s : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %dg = fsdp.silu_grad %g, %t : tensor<4x8xf32>
  %s2 = fsdp.silu %u : tensor<4x8xf32>
  %h2 = fsdp.mul %s2, %g : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %n2 = fsdp.neg %s2 : tensor<4x8xf32>
  %s3 = fsdp.silu %g : tensor<4x8xf32>
  %sq = fsdp.mul %s3, %s3 : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return %h, %dg, %du, %h2, %n2, %sq : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>,
      tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
}

// -----

// The residual stream: an add read first by a layer norm (and later by
// others) becomes residual_layer_norm; the layer norm's input gradient
// added to the residual's gradient becomes layer_norm_grad_acc (here the
// accumulated gradient is defined after the layer_norm_grad, which nothing
// reads before the add: the fused op goes where the add was). Left alone:
// a broadcasting add, an add read by something before the layer norm, and
// an input gradient read twice.
// CHECK-LABEL: func.func @residual
// CHECK: %[[S:.*]], %[[Y:.*]] = fsdp.residual_layer_norm %arg0, %arg1, %arg2, %arg3 : tensor<4x8xf32>, tensor<8xf32>
// CHECK: %[[B:.*]] = fsdp.add %arg0, %arg4 : (tensor<4x8xf32>, tensor<8xf32>)
// CHECK-NEXT: fsdp.layer_norm %[[B]]
// CHECK: %[[E:.*]] = fsdp.add %arg0, %arg1
// CHECK-NEXT: fsdp.neg %[[E]]
// CHECK-NEXT: fsdp.layer_norm %[[E]]
// CHECK: %[[R:.*]] = fsdp.neg %arg5
// CHECK-NEXT: %[[DX:.*]], %[[DG:.*]], %[[DB:.*]] = fsdp.layer_norm_grad_acc %[[S]], %arg2, %arg5, %[[R]] :
// CHECK: %[[D2:[a-z_0-9]+]], {{.*}} = fsdp.layer_norm_grad %[[S]]
// CHECK: fsdp.add %[[D2]], %arg5
// CHECK: return %[[Y]], {{.*}}, %[[DX]], %[[DG]]
func.func @residual(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>, %g: tensor<8xf32>,
                    %beta: tensor<8xf32>, %row: tensor<8xf32>, %dy: tensor<4x8xf32>)
    -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>,
        tensor<8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) {
  %s = fsdp.add %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %y = fsdp.layer_norm %s, %g, %beta : tensor<4x8xf32>, tensor<8xf32>
  %bs = fsdp.add %a, %row : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %by = fsdp.layer_norm %bs, %g, %beta : tensor<4x8xf32>, tensor<8xf32>
  %e = fsdp.add %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %en = fsdp.neg %e : tensor<4x8xf32>
  %ey = fsdp.layer_norm %e, %g, %beta : tensor<4x8xf32>, tensor<8xf32>
  %dx, %dg, %db = fsdp.layer_norm_grad %s, %g, %dy : tensor<4x8xf32>, tensor<8xf32>
  %res = fsdp.neg %dy : tensor<4x8xf32>
  %t = fsdp.add %dx, %res : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %dx2, %dg2, %db2 = fsdp.layer_norm_grad %s, %g, %dy : tensor<4x8xf32>, tensor<8xf32>
  %t2 = fsdp.add %dx2, %dy : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %twice = fsdp.add %t2, %dx2 : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return %y, %by, %en, %ey, %t, %dg, %twice, %s : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>,
      tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
}

// -----

// Slice gradients that tile their dimension, summed by a tree of adds:
// one concat in offset order. Left alone: pieces that leave a gap (the
// zeros matter), and a piece read by something else.
// CHECK-LABEL: func.func @slice_grads
// CHECK: %[[C:.*]] = fsdp.concat %arg0, %arg1, %arg2 dim = 1 : (tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x12xf32>
// CHECK-NOT: fsdp.slice_grad %arg0
// CHECK: %[[G0:.*]] = fsdp.slice_grad %arg0 dim = 1 offset = 0
// CHECK: %[[G2:.*]] = fsdp.slice_grad %arg2 dim = 1 offset = 8
// CHECK: fsdp.add %[[G0]], %[[G2]]
// CHECK: return %[[C]]
func.func @slice_grads(%q: tensor<2x4xf32>, %k: tensor<2x4xf32>, %v: tensor<2x4xf32>)
    -> (tensor<2x12xf32>, tensor<2x12xf32>, tensor<2x12xf32>) {
  %dv = fsdp.slice_grad %v dim = 1 offset = 8 : tensor<2x4xf32> -> tensor<2x12xf32>
  %dq = fsdp.slice_grad %q dim = 1 offset = 0 : tensor<2x4xf32> -> tensor<2x12xf32>
  %dk = fsdp.slice_grad %k dim = 1 offset = 4 : tensor<2x4xf32> -> tensor<2x12xf32>
  %s = fsdp.add %dv, %dq : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  %t = fsdp.add %dk, %s : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  %gq = fsdp.slice_grad %q dim = 1 offset = 0 : tensor<2x4xf32> -> tensor<2x12xf32>
  %gv = fsdp.slice_grad %v dim = 1 offset = 8 : tensor<2x4xf32> -> tensor<2x12xf32>
  %gap = fsdp.add %gq, %gv : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  %hq = fsdp.slice_grad %q dim = 1 offset = 0 : tensor<2x4xf32> -> tensor<2x12xf32>
  %hk = fsdp.slice_grad %k dim = 1 offset = 4 : tensor<2x4xf32> -> tensor<2x12xf32>
  %hv = fsdp.slice_grad %v dim = 1 offset = 8 : tensor<2x4xf32> -> tensor<2x12xf32>
  %h1 = fsdp.add %hq, %hk : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  %h2 = fsdp.add %h1, %hv : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  %twice = fsdp.add %h2, %hq : (tensor<2x12xf32>, tensor<2x12xf32>) -> tensor<2x12xf32>
  return %t, %gap, %twice : tensor<2x12xf32>, tensor<2x12xf32>, tensor<2x12xf32>
}

// -----

// Attention on the three column ranges of one projection: attention_qkv
// reads them in place; its gradient, whose dq, dk, dv only the concat
// reads, writes the concat's result; the slices go. Grouped-query (KC = 8
// of C = 16) keeps kv_heads.
// CHECK-LABEL: func.func @packed
// CHECK-NOT: fsdp.slice
// CHECK: %[[Y:.*]], %[[L:.*]] = fsdp.attention_qkv %arg0 heads = 4 kv_heads = 2 causal : tensor<2x8x32xf32> -> tensor<2x8x16xf32>, tensor<2x4x8xf32>
// CHECK-NEXT: %[[D:.*]] = fsdp.attention_qkv_grad %arg0, %[[Y]], %[[L]], %arg1 heads = 4 kv_heads = 2 causal : tensor<2x8x32xf32>, tensor<2x8x16xf32>, tensor<2x4x8xf32>
// CHECK-NOT: fsdp.concat
// CHECK: return %[[Y]], %[[D]]
func.func @packed(%x: tensor<2x8x32xf32>, %dy: tensor<2x8x16xf32>) -> (tensor<2x8x16xf32>, tensor<2x8x32xf32>) {
  %q = fsdp.slice %x dim = 2 offset = 0 : tensor<2x8x32xf32> -> tensor<2x8x16xf32>
  %k = fsdp.slice %x dim = 2 offset = 16 : tensor<2x8x32xf32> -> tensor<2x8x8xf32>
  %v = fsdp.slice %x dim = 2 offset = 24 : tensor<2x8x32xf32> -> tensor<2x8x8xf32>
  %y, %lse = fsdp.attention %q, %k, %v heads = 4 kv_heads = 2 causal : tensor<2x8x16xf32>, tensor<2x8x8xf32> -> tensor<2x4x8xf32>
  %dq, %dk, %dv = fsdp.attention_grad %q, %k, %v, %y, %lse, %dy heads = 4 kv_heads = 2 causal : tensor<2x8x16xf32>, tensor<2x8x8xf32>
  %d = fsdp.concat %dq, %dk, %dv dim = 2 : (tensor<2x8x16xf32>, tensor<2x8x8xf32>, tensor<2x8x8xf32>) -> tensor<2x8x32xf32>
  return %y, %d : tensor<2x8x16xf32>, tensor<2x8x32xf32>
}

// -----

// Not packed: k and v swapped (v first) in the source tensor; and a
// forward that is packed whose gradient's dq is read elsewhere too (the
// gradient stays on the slices, which stay).
// CHECK-LABEL: func.func @not_packed
// CHECK: fsdp.attention %{{.*}}, %{{.*}}, %{{.*}} heads = 2
// CHECK: fsdp.attention_qkv %arg1 heads = 2
// CHECK: fsdp.attention_grad
// CHECK: fsdp.concat
func.func @not_packed(%x: tensor<1x4x24xf32>, %z: tensor<1x4x24xf32>, %dy: tensor<1x4x8xf32>)
    -> (tensor<1x4x8xf32>, tensor<1x4x8xf32>, tensor<1x4x24xf32>, tensor<1x4x8xf32>) {
  %q = fsdp.slice %x dim = 2 offset = 0 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %v = fsdp.slice %x dim = 2 offset = 8 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %k = fsdp.slice %x dim = 2 offset = 16 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %y = fsdp.attention %q, %k, %v heads = 2 : tensor<1x4x8xf32>
  %q2 = fsdp.slice %z dim = 2 offset = 0 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %k2 = fsdp.slice %z dim = 2 offset = 8 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %v2 = fsdp.slice %z dim = 2 offset = 16 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %y2, %lse = fsdp.attention %q2, %k2, %v2 heads = 2 : tensor<1x4x8xf32> -> tensor<1x2x4xf32>
  %dq, %dk, %dv = fsdp.attention_grad %q2, %k2, %v2, %y2, %lse, %dy heads = 2 : tensor<1x4x8xf32>
  %d = fsdp.concat %dq, %dk, %dv dim = 2 : (tensor<1x4x8xf32>, tensor<1x4x8xf32>, tensor<1x4x8xf32>) -> tensor<1x4x24xf32>
  return %y, %y2, %d, %dq : tensor<1x4x8xf32>, tensor<1x4x8xf32>, tensor<1x4x24xf32>, tensor<1x4x8xf32>
}

// -----

// Widened products: a bf16 matmul (and a matmul_bias_grad, both of whose
// results are) read only by a cast to f32 returns f32 itself, where the
// matmul was. Not when the bf16 product has another reader, not for one
// result of a matmul_bias_grad, not for a cast to bf16 or of an f32
// product, not for another op's result.
// CHECK-LABEL: func.func @widened
// CHECK: %[[W:.*]], %[[B:.*]] = fsdp.matmul_bias_grad %arg0, %arg1 transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> (tensor<6x4xf32>, tensor<6xf32>)
// CHECK-NEXT: %[[P:.*]] = fsdp.matmul %arg0, %arg1 transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xf32>
// CHECK-NEXT: %[[Q:.*]] = fsdp.matmul %arg0, %arg1 transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xbf16>
// CHECK-NEXT: %[[QF:.*]] = fsdp.cast %[[Q]] : tensor<6x4xbf16> -> tensor<6x4xf32>
// CHECK-NEXT: %[[W2:.*]], %[[B2:.*]] = fsdp.matmul_bias_grad %arg2, %arg1 transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> (tensor<6x4xbf16>, tensor<6xbf16>)
// CHECK-NEXT: fsdp.cast %[[W2]] : tensor<6x4xbf16> -> tensor<6x4xf32>
// CHECK-NEXT: %[[R:.*]] = fsdp.matmul %arg0, %arg1 transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xbf16>
// CHECK-NEXT: fsdp.cast %[[R]] : tensor<6x4xbf16> -> tensor<6x4xf16>
// CHECK-NEXT: %[[F:.*]] = fsdp.matmul %arg3, %arg3 transpose_lhs : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
// CHECK-NEXT: fsdp.cast %[[F]] : tensor<4x4xf32> -> tensor<4x4xbf16>
// CHECK-NEXT: %[[D:.*]] = fsdp.add %arg0, %arg2
// CHECK-NEXT: fsdp.cast %[[D]] : tensor<8x6xbf16> -> tensor<8x6xf32>
// CHECK-NOT: fsdp.cast
// CHECK: return %[[W]], %[[B]], %[[P]], %[[QF]], %[[Q]], %[[B2]]
func.func @widened(%dy: tensor<8x6xbf16>, %x: tensor<8x4xbf16>, %dz: tensor<8x6xbf16>,
                   %y: tensor<8x4xf32>)
    -> (tensor<6x4xf32>, tensor<6xf32>, tensor<6x4xf32>, tensor<6x4xf32>, tensor<6x4xbf16>,
        tensor<6xbf16>, tensor<6x4xf32>, tensor<6x4xf16>, tensor<4x4xbf16>, tensor<8x6xf32>) {
  %w, %b = fsdp.matmul_bias_grad %dy, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> (tensor<6x4xbf16>, tensor<6xbf16>)
  %wf = fsdp.cast %w : tensor<6x4xbf16> -> tensor<6x4xf32>
  %bf = fsdp.cast %b : tensor<6xbf16> -> tensor<6xf32>
  %p = fsdp.matmul %dy, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xbf16>
  %pf = fsdp.cast %p : tensor<6x4xbf16> -> tensor<6x4xf32>
  %q = fsdp.matmul %dy, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xbf16>
  %qf = fsdp.cast %q : tensor<6x4xbf16> -> tensor<6x4xf32>
  %w2, %b2 = fsdp.matmul_bias_grad %dz, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> (tensor<6x4xbf16>, tensor<6xbf16>)
  %w2f = fsdp.cast %w2 : tensor<6x4xbf16> -> tensor<6x4xf32>
  %r = fsdp.matmul %dy, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> tensor<6x4xbf16>
  %rh = fsdp.cast %r : tensor<6x4xbf16> -> tensor<6x4xf16>
  %f = fsdp.matmul %y, %y transpose_lhs : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
  %fb = fsdp.cast %f : tensor<4x4xf32> -> tensor<4x4xbf16>
  %d = fsdp.add %dy, %dz : (tensor<8x6xbf16>, tensor<8x6xbf16>) -> tensor<8x6xbf16>
  %df = fsdp.cast %d : tensor<8x6xbf16> -> tensor<8x6xf32>
  return %wf, %bf, %pf, %qf, %q, %b2, %w2f, %rh, %fb, %df : tensor<6x4xf32>, tensor<6xf32>, tensor<6x4xf32>, tensor<6x4xf32>, tensor<6x4xbf16>, tensor<6xbf16>, tensor<6x4xf32>, tensor<6x4xf16>, tensor<4x4xbf16>, tensor<8x6xf32>
}

// -----

// matmul_gelu_grad's bias gradient read only by a cast to f32: returned in
// f32, the input gradient dh staying bf16; not where the cast reads dh,
// nor where the bias gradient has another reader.
// CHECK-LABEL: func.func @widened_gelu_bias
// CHECK: %[[H:.*]], %[[B:.*]] = fsdp.matmul_gelu_grad %arg0, %arg1, %arg2 : (tensor<8x6xbf16>, tensor<6x4xbf16>, tensor<8x4xbf16>) -> (tensor<8x4xbf16>, tensor<4xf32>)
// CHECK-NEXT: %[[H2:.*]], %[[B2:.*]] = fsdp.matmul_gelu_grad %arg0, %arg1, %arg2 : (tensor<8x6xbf16>, tensor<6x4xbf16>, tensor<8x4xbf16>) -> (tensor<8x4xbf16>, tensor<4xbf16>)
// CHECK-NEXT: %[[HF:.*]] = fsdp.cast %[[H2]] : tensor<8x4xbf16> -> tensor<8x4xf32>
// CHECK-NEXT: %[[BF:.*]] = fsdp.cast %[[B2]] : tensor<4xbf16> -> tensor<4xf32>
// CHECK-NOT: fsdp.cast
// CHECK: return %[[H]], %[[B]], %[[HF]], %[[BF]], %[[B2]]
func.func @widened_gelu_bias(%dz: tensor<8x6xbf16>, %w: tensor<6x4xbf16>, %pre: tensor<8x4xbf16>)
    -> (tensor<8x4xbf16>, tensor<4xf32>, tensor<8x4xf32>, tensor<4xf32>, tensor<4xbf16>) {
  %h, %b = fsdp.matmul_gelu_grad %dz, %w, %pre : (tensor<8x6xbf16>, tensor<6x4xbf16>, tensor<8x4xbf16>) -> (tensor<8x4xbf16>, tensor<4xbf16>)
  %bf = fsdp.cast %b : tensor<4xbf16> -> tensor<4xf32>
  %h2, %b2 = fsdp.matmul_gelu_grad %dz, %w, %pre : (tensor<8x6xbf16>, tensor<6x4xbf16>, tensor<8x4xbf16>) -> (tensor<8x4xbf16>, tensor<4xbf16>)
  %h2f = fsdp.cast %h2 : tensor<8x4xbf16> -> tensor<8x4xf32>
  %b2f = fsdp.cast %b2 : tensor<4xbf16> -> tensor<4xf32>
  return %h, %bf, %h2f, %b2f, %b2 : tensor<8x4xbf16>, tensor<4xf32>, tensor<8x4xf32>, tensor<4xf32>, tensor<4xbf16>
}

// -----

// sum_to and embedding_grad on bf16 / f16 read only by a cast to f32 (a
// mixed-precision plan's position and token embedding gradients): the f32
// sums returned unrounded. Not where the sum has another reader, nor for a
// cast to another narrow type.
// CHECK-LABEL: func.func @widened_sums
// CHECK-NEXT: %[[S:.*]] = fsdp.sum_to %arg1 : tensor<2x8x4xbf16> -> tensor<8x4xf32>
// CHECK-NEXT: %[[E:.*]] = fsdp.embedding_grad %arg0, %arg1 : (tensor<2x8xi32>, tensor<2x8x4xbf16>) -> tensor<16x4xf32>
// CHECK-NEXT: %[[H:.*]] = fsdp.embedding_grad %arg0, %arg2 : (tensor<2x8xi32>, tensor<2x8x4xf16>) -> tensor<16x4xf32>
// CHECK-NEXT: %[[S2:.*]] = fsdp.sum_to %arg1 : tensor<2x8x4xbf16> -> tensor<8x4xbf16>
// CHECK-NEXT: %[[S2F:.*]] = fsdp.cast %[[S2]] : tensor<8x4xbf16> -> tensor<8x4xf32>
// CHECK-NEXT: %[[E2:.*]] = fsdp.embedding_grad %arg0, %arg1 : (tensor<2x8xi32>, tensor<2x8x4xbf16>) -> tensor<16x4xbf16>
// CHECK-NEXT: %[[E2H:.*]] = fsdp.cast %[[E2]] : tensor<16x4xbf16> -> tensor<16x4xf16>
// CHECK-NEXT: return %[[S]], %[[E]], %[[H]], %[[S2F]], %[[S2]], %[[E2H]]
func.func @widened_sums(%ids: tensor<2x8xi32>, %dy: tensor<2x8x4xbf16>, %dh: tensor<2x8x4xf16>)
    -> (tensor<8x4xf32>, tensor<16x4xf32>, tensor<16x4xf32>, tensor<8x4xf32>, tensor<8x4xbf16>, tensor<16x4xf16>) {
  %s = fsdp.sum_to %dy : tensor<2x8x4xbf16> -> tensor<8x4xbf16>
  %sf = fsdp.cast %s : tensor<8x4xbf16> -> tensor<8x4xf32>
  %e = fsdp.embedding_grad %ids, %dy : (tensor<2x8xi32>, tensor<2x8x4xbf16>) -> tensor<16x4xbf16>
  %ef = fsdp.cast %e : tensor<16x4xbf16> -> tensor<16x4xf32>
  %h = fsdp.embedding_grad %ids, %dh : (tensor<2x8xi32>, tensor<2x8x4xf16>) -> tensor<16x4xf16>
  %hf = fsdp.cast %h : tensor<16x4xf16> -> tensor<16x4xf32>
  %s2 = fsdp.sum_to %dy : tensor<2x8x4xbf16> -> tensor<8x4xbf16>
  %s2f = fsdp.cast %s2 : tensor<8x4xbf16> -> tensor<8x4xf32>
  %e2 = fsdp.embedding_grad %ids, %dy : (tensor<2x8xi32>, tensor<2x8x4xbf16>) -> tensor<16x4xbf16>
  %e2h = fsdp.cast %e2 : tensor<16x4xbf16> -> tensor<16x4xf16>
  return %sf, %ef, %hf, %s2f, %s2, %e2h : tensor<8x4xf32>, tensor<16x4xf32>, tensor<16x4xf32>, tensor<8x4xf32>, tensor<8x4xbf16>, tensor<16x4xf16>
}

// -----

// An f32 value cast to bf16, sliced (and reshaped) and cast back to f32
// (fsdp-chunk-loss's head gradient sum cast back, fsdp-pad-classes's
// slice, mixed precision's f32 gradient): the slice and reshape in f32,
// no casts. Not where a step has another reader, nor for a round trip
// through bf16 from bf16. (3 of 8 rows: slices, not views, below.)
// CHECK-LABEL: func.func @round_trip
// CHECK-NEXT: %[[S:.*]] = fsdp.slice %arg0 dim = 0 offset = 1 : tensor<8x4xf32> -> tensor<3x4xf32>
// CHECK-NEXT: %[[R:.*]] = fsdp.reshape %[[S]] : tensor<3x4xf32> -> tensor<12xf32>
// CHECK-NEXT: %[[C:.*]] = fsdp.cast %arg0 : tensor<8x4xf32> -> tensor<8x4xbf16>
// CHECK-NEXT: %[[S2:.*]] = fsdp.slice %[[C]]
// CHECK-NEXT: fsdp.cast %[[S2]] : tensor<3x4xbf16> -> tensor<3x4xf32>
// CHECK-NEXT: %[[S3:.*]] = fsdp.slice %arg1
// CHECK-NEXT: fsdp.cast %[[S3]] : tensor<3x4xbf16> -> tensor<3x4xf32>
// CHECK-NOT: fsdp.cast
// CHECK: return %[[R]], %{{.*}}, %[[S2]], %{{.*}}
func.func @round_trip(%x: tensor<8x4xf32>, %y: tensor<8x4xbf16>)
    -> (tensor<12xf32>, tensor<3x4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>) {
  %c = fsdp.cast %x : tensor<8x4xf32> -> tensor<8x4xbf16>
  %s = fsdp.slice %c dim = 0 offset = 1 : tensor<8x4xbf16> -> tensor<3x4xbf16>
  %r = fsdp.reshape %s : tensor<3x4xbf16> -> tensor<12xbf16>
  %w = fsdp.cast %r : tensor<12xbf16> -> tensor<12xf32>
  %c2 = fsdp.cast %x : tensor<8x4xf32> -> tensor<8x4xbf16>
  %s2 = fsdp.slice %c2 dim = 0 offset = 0 : tensor<8x4xbf16> -> tensor<3x4xbf16>
  %w2 = fsdp.cast %s2 : tensor<3x4xbf16> -> tensor<3x4xf32>
  %s3 = fsdp.slice %y dim = 0 offset = 0 : tensor<8x4xbf16> -> tensor<3x4xbf16>
  %w3 = fsdp.cast %s3 : tensor<3x4xbf16> -> tensor<3x4xf32>
  return %w, %w2, %s2, %w3 : tensor<12xf32>, tensor<3x4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>
}

// -----

// A slice of contiguous rows (every dimension before its own of size 1)
// keeping at least half of its input is a view of the input flattened
// (no copy; fsdp-pad-classes's slice of the padded head gradient): not
// under half, not where an earlier dimension is larger than 1, not where
// the input has another reader (which might write it in place).
// CHECK-LABEL: func.func @rows_as_views
// CHECK-NEXT: %[[F:.*]] = fsdp.reshape %arg0 : tensor<8x4xf32> -> tensor<32xf32>
// CHECK-NEXT: %[[V:.*]] = fsdp.view %[[F]] offset = 4 : tensor<32xf32> -> tensor<5x4xf32>
// CHECK-NEXT: %[[S:.*]] = fsdp.slice %arg1 dim = 0 offset = 1 : tensor<8x4xf32> -> tensor<3x4xf32>
// CHECK-NEXT: %[[F2:.*]] = fsdp.reshape %arg2 : tensor<1x8x4xf32> -> tensor<32xf32>
// CHECK-NEXT: %[[V2:.*]] = fsdp.view %[[F2]] offset = 8 : tensor<32xf32> -> tensor<1x6x4xf32>
// CHECK-NEXT: %[[S2:.*]] = fsdp.slice %arg3 dim = 1 offset = 2 : tensor<2x8x4xf32> -> tensor<2x6x4xf32>
// CHECK-NEXT: %[[S3:.*]] = fsdp.slice %arg4 dim = 0 offset = 0 : tensor<8x4xf32> -> tensor<6x4xf32>
// CHECK-NEXT: return %[[V]], %[[S]], %[[V2]], %[[S2]], %[[S3]], %arg4
func.func @rows_as_views(%x: tensor<8x4xf32>, %w: tensor<8x4xf32>, %y: tensor<1x8x4xf32>,
                         %z: tensor<2x8x4xf32>, %u: tensor<8x4xf32>)
    -> (tensor<5x4xf32>, tensor<3x4xf32>, tensor<1x6x4xf32>, tensor<2x6x4xf32>, tensor<6x4xf32>,
        tensor<8x4xf32>) {
  %a = fsdp.slice %x dim = 0 offset = 1 : tensor<8x4xf32> -> tensor<5x4xf32>
  %b = fsdp.slice %w dim = 0 offset = 1 : tensor<8x4xf32> -> tensor<3x4xf32>
  %c = fsdp.slice %y dim = 1 offset = 2 : tensor<1x8x4xf32> -> tensor<1x6x4xf32>
  %d = fsdp.slice %z dim = 1 offset = 2 : tensor<2x8x4xf32> -> tensor<2x6x4xf32>
  %e = fsdp.slice %u dim = 0 offset = 0 : tensor<8x4xf32> -> tensor<6x4xf32>
  return %a, %b, %c, %d, %e, %u : tensor<5x4xf32>, tensor<3x4xf32>, tensor<1x6x4xf32>, tensor<2x6x4xf32>, tensor<6x4xf32>, tensor<8x4xf32>
}

// -----

// A layer norm gradient's d_gamma and d_beta, both read only by casts to
// f32: the op returns them in f32 (printed after `->`); not when one of
// them has another reader.
// CHECK-LABEL: func.func @widened_norm
// CHECK: %[[DX:.*]], %[[DG:.*]], %[[DB:.*]] = fsdp.layer_norm_grad %arg0, %arg1, %arg2 : tensor<4x8xbf16>, tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT: %[[DX2:.*]], %[[DG2:.*]], %[[DB2:.*]] = fsdp.layer_norm_grad %arg0, %arg1, %arg2 : tensor<4x8xbf16>, tensor<8xbf16>
// CHECK-NEXT: fsdp.cast %[[DG2]]
// CHECK-NEXT: fsdp.cast %[[DB2]]
// CHECK-NOT: fsdp.cast
// CHECK: return %[[DX]], %[[DG]], %[[DB]],
func.func @widened_norm(%x: tensor<4x8xbf16>, %g: tensor<8xbf16>, %dy: tensor<4x8xbf16>)
    -> (tensor<4x8xbf16>, tensor<8xf32>, tensor<8xf32>, tensor<4x8xbf16>, tensor<8xf32>, tensor<8xf32>, tensor<8xbf16>) {
  %dx, %dg, %db = fsdp.layer_norm_grad %x, %g, %dy {epsilon = 1.0e-05 : f64} : tensor<4x8xbf16>, tensor<8xbf16>
  %dgf = fsdp.cast %dg : tensor<8xbf16> -> tensor<8xf32>
  %dbf = fsdp.cast %db : tensor<8xbf16> -> tensor<8xf32>
  %dx2, %dg2, %db2 = fsdp.layer_norm_grad %x, %g, %dy {epsilon = 1.0e-05 : f64} : tensor<4x8xbf16>, tensor<8xbf16>
  %dg2f = fsdp.cast %dg2 : tensor<8xbf16> -> tensor<8xf32>
  %db2f = fsdp.cast %db2 : tensor<8xbf16> -> tensor<8xf32>
  return %dx, %dgf, %dbf, %dx2, %dg2f, %db2f, %db2 : tensor<4x8xbf16>, tensor<8xf32>, tensor<8xf32>, tensor<4x8xbf16>, tensor<8xf32>, tensor<8xf32>, tensor<8xbf16>
}

// -----

// A linear layer's bias gradient (sum_to of dy over its rows) and its
// weight gradient (dy^T x) become one matmul_bias_grad where the first of
// them was; a dy with two weight gradients, and a sum over the other
// dimension, are left alone.
// CHECK-LABEL: func.func @bias_grad
// CHECK: %[[W:.*]], %[[B:.*]] = fsdp.matmul_bias_grad %arg0, %arg1 transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>) -> (tensor<6x4xf32>, tensor<6xf32>)
// CHECK-NOT: fsdp.sum_to %arg0
// CHECK: fsdp.sum_to %arg2
// CHECK: fsdp.matmul %arg2, %arg1 transpose_lhs
// CHECK: fsdp.matmul %arg2, %arg1 transpose_lhs
// CHECK: return %[[W]], %[[B]]
func.func @bias_grad(%dy: tensor<8x6xf32>, %x: tensor<8x4xf32>, %dz: tensor<8x6xf32>)
    -> (tensor<6x4xf32>, tensor<6xf32>, tensor<6xf32>, tensor<6x4xf32>, tensor<6x4xf32>) {
  %db = fsdp.sum_to %dy : tensor<8x6xf32> -> tensor<6xf32>
  %dw = fsdp.matmul %dy, %x transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>) -> tensor<6x4xf32>
  %db2 = fsdp.sum_to %dz : tensor<8x6xf32> -> tensor<6xf32>
  %dw2 = fsdp.matmul %dz, %x transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>) -> tensor<6x4xf32>
  %dw3 = fsdp.matmul %dz, %x transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>) -> tensor<6x4xf32>
  return %dw, %db, %db2, %dw2, %dw3 : tensor<6x4xf32>, tensor<6xf32>, tensor<6xf32>, tensor<6x4xf32>, tensor<6x4xf32>
}

// -----

// The classifier: cross_entropy and its gradient on the same logits and
// labels become one cross_entropy_fused where the gradient was (the
// padded head's `classes` kept); the loss, read only by the return,
// comes from it.
// CHECK-LABEL: func.func @classifier
// CHECK-NOT: fsdp.cross_entropy %
// CHECK: %[[S:.*]] = fsdp.fill
// CHECK-NEXT: %[[L:.*]], %[[D:.*]] = fsdp.cross_entropy_fused %arg0, %arg1, %[[S]] {classes = 250 : i64} : tensor<8x256xbf16>, tensor<8xi32>
// CHECK-NOT: fsdp.cross_entropy_grad
// CHECK: return %[[L]], %[[D]]
func.func @classifier(%x: tensor<8x256xbf16>, %y: tensor<8xi32>) -> (tensor<f32>, tensor<8x256xbf16>) {
  %l = fsdp.cross_entropy %x, %y {classes = 250 : i64} : (tensor<8x256xbf16>, tensor<8xi32>) -> tensor<f32>
  %s = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  %d = fsdp.cross_entropy_grad %x, %y, %s {classes = 250 : i64} : tensor<8x256xbf16>, tensor<8xi32>
  return %l, %d : tensor<f32>, tensor<8x256xbf16>
}

// -----

// Not fused: the loss read before the gradient (its seed depends on it);
// other labels; two cross-entropies of the same logits and labels (which
// one pairs with the gradient is ambiguous).
// CHECK-LABEL: func.func @classifier_not_fused
// CHECK-NOT: fsdp.cross_entropy_fused
// CHECK: return
func.func @classifier_not_fused(%x: tensor<8x256xf32>, %y: tensor<8xi32>, %z: tensor<8xi32>)
    -> (tensor<8x256xf32>, tensor<8x256xf32>, tensor<8x256xf32>, tensor<f32>, tensor<f32>) {
  %l = fsdp.cross_entropy %x, %y : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %s = fsdp.neg %l : tensor<f32>
  %d = fsdp.cross_entropy_grad %x, %y, %s : tensor<8x256xf32>, tensor<8xi32>
  %s2 = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  %d2 = fsdp.cross_entropy_grad %x, %z, %s2 : tensor<8x256xf32>, tensor<8xi32>
  %x3 = fsdp.neg %x : tensor<8x256xf32>
  %l3 = fsdp.cross_entropy %x3, %y : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %l4 = fsdp.cross_entropy %x3, %y : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %d3 = fsdp.cross_entropy_grad %x3, %y, %s2 : tensor<8x256xf32>, tensor<8xi32>
  %t = fsdp.add %l3, %l4 : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %d, %d2, %d3, %l, %t : tensor<8x256xf32>, tensor<8x256xf32>, tensor<8x256xf32>, tensor<f32>, tensor<f32>
}

// -----

// The optimizer: a gradient times the clipping factor, read only by its
// update, becomes the update's grad_scale (no product in memory); with
// loss scaling (grad_coef) beside skip_nonfinite, on every update op. A
// product someone else reads, or a factor that is not clip_coef /
// grad_coef, stays a mul.
// CHECK-LABEL: func.func @optimizer
// CHECK: %[[N:.*]] = fsdp.squared_norm
// CHECK-NEXT: %[[C:.*]] = fsdp.clip_coef %[[N]]
// CHECK-NOT: fsdp.mul %arg0
// CHECK: fsdp.adamw_update %arg2, %arg0, %arg3, %arg3, %arg4, %arg5 grad_scale %[[C]] {{{.*}}} : tensor<64xf32>
// CHECK: %[[K:.*]] = fsdp.grad_coef %[[N]], %arg6
// CHECK: fsdp.sgd_momentum_update %arg2, %arg1, %arg3, %arg4, %arg5 skip_nonfinite %[[N]] grad_scale %[[K]] {momentum = {{.*}}} : tensor<64xf32>
// CHECK: %[[M:.*]] = fsdp.mul %arg0, %[[K]]
// CHECK: fsdp.sgd_update %arg2, %[[M]], %arg4 : tensor<64xf32>
// CHECK: %[[F:.*]] = fsdp.mul %arg1, %arg4
// CHECK: fsdp.sgd_update %arg2, %[[F]], %arg4 : tensor<64xf32>
// CHECK: fsdp.sgd_update %arg2, %arg1, %arg4 grad_scale %[[K]] : tensor<64xf32>
// CHECK: return %{{.*}}, %[[M]]
func.func @optimizer(%g: tensor<64xf32>, %h: tensor<64xf32>, %p: tensor<64xf32>, %m: tensor<64xf32>,
                     %lr: tensor<f32>, %step: tensor<f32>, %scale: tensor<f32>)
    -> (tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>) {
  %n = fsdp.squared_norm %g, %h : tensor<64xf32>, tensor<64xf32>
  %c = fsdp.clip_coef %n {max_norm = 1.0 : f64} : tensor<f32>
  %gc = fsdp.mul %g, %c : (tensor<64xf32>, tensor<f32>) -> tensor<64xf32>
  %a:3 = fsdp.adamw_update %p, %gc, %m, %m, %lr, %step {weight_decay = 0.1 : f64} : tensor<64xf32>
  %k = fsdp.grad_coef %n, %scale {max_norm = 1.0 : f64} : tensor<f32>
  %hk = fsdp.mul %h, %k : (tensor<64xf32>, tensor<f32>) -> tensor<64xf32>
  %b:2 = fsdp.sgd_momentum_update %p, %hk, %m, %lr, %step skip_nonfinite %n {momentum = 0.9 : f64} : tensor<64xf32>
  %gk = fsdp.mul %g, %k : (tensor<64xf32>, tensor<f32>) -> tensor<64xf32>
  %s1 = fsdp.sgd_update %p, %gk, %lr : tensor<64xf32>
  %hl = fsdp.mul %h, %lr : (tensor<64xf32>, tensor<f32>) -> tensor<64xf32>
  %s2 = fsdp.sgd_update %p, %hl, %lr : tensor<64xf32>
  %hk2 = fsdp.mul %h, %k : (tensor<64xf32>, tensor<f32>) -> tensor<64xf32>
  %s3 = fsdp.sgd_update %p, %hk2, %lr : tensor<64xf32>
  return %a#0, %b#0, %s1, %s2, %s3, %gk : tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>, tensor<64xf32>
}

// -----

// The whole pipeline on the small GPT, where every linear layer with a bias is
// fused (4 per block forward; the MLP's GELU joins its first), the LM
// head (no bias) is not; the backward's GELU gradient is fused with its
// bias gradient; the loss and the logits' gradient are one
// cross_entropy_fused.
// GPT-LABEL: func.func @train_step
// GPT-NOT: fsdp.bias_add
// GPT-NOT: fsdp.gelu
// GPT-NOT: fsdp.slice
// GPT: fsdp.attention_qkv {{.*}} heads = 4 causal
// GPT: fsdp.matmul_bias {{.*}} transpose_rhs gelu {{.*}} -> (tensor<{{.*}}>, tensor<{{.*}}>)
// GPT: fsdp.residual_layer_norm
// GPT-NOT: fsdp.cross_entropy %
// GPT: fsdp.cross_entropy_fused
// GPT: fsdp.matmul_gelu_grad {{.*}} -> (tensor<{{.*}}>, tensor<{{[0-9]+}}xf32>)
// GPT: fsdp.matmul_bias_grad
// GPT: fsdp.attention_qkv_grad
// GPT: fsdp.layer_norm_grad_acc
// GPT-NOT: fsdp.slice_grad
// GPT-NOT: fsdp.concat
// GPT-NOT: fsdp.cross_entropy_grad
// GPT-NOT: fsdp.sum_to {{.*}} -> tensor<{{[0-9]+}}xf32>
// GPT: %[[CLIP:.*]] = fsdp.clip_coef
// GPT-NOT: fsdp.mul
// GPT: fsdp.adamw_update {{.*}} grad_scale %[[CLIP]]
// GPT: return
// OFF-LABEL: func.func @train_step
// OFF-NOT: fsdp.matmul_bias
// OFF-NOT: fsdp.matmul_gelu_grad
// OFF-NOT: fsdp.residual_layer_norm
// OFF-NOT: fsdp.layer_norm_grad_acc
// OFF-NOT: fsdp.attention_qkv
// OFF: %[[CLIP:.*]] = fsdp.clip_coef
// OFF: fsdp.mul {{.*}}, %[[CLIP]]
// OFF-NOT: grad_scale
// OFF: return

// Selective recomputation recomputes the MLP's GELU in the backward pass
// from its saved input: the forward GELU still joins the kernel (which
// then keeps the pre-activation for the clone and the gradient); the
// clone stays a gelu of its own in the backward pass.
// SEL-LABEL: func.func @train_step
// SEL: %{{.*}}, %[[PRE:.*]] = fsdp.matmul_bias {{.*}} transpose_rhs gelu
// SEL: fsdp.gelu %[[PRE]] {{{.*}}fsdp.recompute
// SEL: fsdp.matmul_gelu_grad {{.*}}, %[[PRE]]
// SEL: fsdp.attention_qkv {{.*}}fsdp.recompute
// SEL: fsdp.attention_qkv_grad
// SEL: return

// bf16 compute: the fused kernels on bf16 operands.
// BF16-LABEL: func.func @train_step
// BF16: fsdp.matmul_bias {{.*}} gelu {{.*}} : (tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16>) -> (tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16>)
// The MLP input layer's bias gradient in f32 (dh in bf16):
// BF16: fsdp.matmul_gelu_grad {{.*}} -> (tensor<{{.*}}xbf16>, tensor<{{.*}}xf32>)
// The weight gradients straight into f32 (widened products):
// BF16: fsdp.matmul {{.*}} transpose_lhs {{.*}}: (tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16>) -> tensor<{{.*}}xf32>
// BF16: fsdp.matmul_bias_grad {{.*}}: (tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16>) -> (tensor<{{.*}}xf32>, tensor<{{.*}}xf32>)
// BF16: fsdp.layer_norm_grad_acc {{.*}}: tensor<{{.*}}xbf16>, tensor<{{.*}}xbf16> -> tensor<{{.*}}xf32>
// The position and token embedding gradients summed into f32:
// BF16: fsdp.sum_to {{.*}} : tensor<4x32x64xbf16> -> tensor<32x64xf32>
// BF16: fsdp.embedding_grad {{.*}} : (tensor<4x32xi32>, tensor<4x32x64xbf16>) -> tensor<256x64xf32>
// BF16-NOT: fsdp.cast {{.*}}bf16> -> tensor<{{.*}}xf32>
// BF16: return

// -----

// Not fused: the loss and the gradient smooth the labels differently
// (a gradient that is not the loss's).
// CHECK-LABEL: func.func @classifier_smoothing_differs
// CHECK-NOT: fsdp.cross_entropy_fused
// CHECK: fsdp.cross_entropy %arg0, %arg1 {label_smoothing = 1.000000e-01 : f64}
// CHECK: fsdp.cross_entropy_grad %arg0, %arg1, %{{.+}} {label_smoothing = 2.000000e-01 : f64}
func.func @classifier_smoothing_differs(%x: tensor<8x256xf32>, %y: tensor<8xi32>) -> (tensor<f32>, tensor<8x256xf32>) {
  %l = fsdp.cross_entropy %x, %y {label_smoothing = 0.1 : f64} : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %s = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  %d = fsdp.cross_entropy_grad %x, %y, %s {label_smoothing = 0.2 : f64} : tensor<8x256xf32>, tensor<8xi32>
  return %l, %d : tensor<f32>, tensor<8x256xf32>
}

// -----

// ignore_index: fused when the loss and the gradient ignore the same
// label and divide by the same count (the fused op keeps both); not when
// the counts differ.
// CHECK-LABEL: func.func @classifier_ignore_index
// CHECK: %[[N:.+]] = fsdp.count_labels %arg1
// CHECK: %{{.+}}, %{{.+}} = fsdp.cross_entropy_fused %arg0, %arg1, %{{.+}}, %[[N]] {ignore_index = -100 : i64} : tensor<8x256xf32>, tensor<8xi32>
func.func @classifier_ignore_index(%x: tensor<8x256xf32>, %y: tensor<8xi32>) -> (tensor<f32>, tensor<8x256xf32>) {
  %n = fsdp.count_labels %y {ignore_index = -100 : i64} : tensor<8xi32>
  %l = fsdp.cross_entropy %x, %y, %n {ignore_index = -100 : i64} : (tensor<8x256xf32>, tensor<8xi32>, tensor<f32>) -> tensor<f32>
  %s = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  %d = fsdp.cross_entropy_grad %x, %y, %s, %n {ignore_index = -100 : i64} : tensor<8x256xf32>, tensor<8xi32>
  return %l, %d : tensor<f32>, tensor<8x256xf32>
}

// -----

// CHECK-LABEL: func.func @classifier_ignore_count_differs
// CHECK-NOT: fsdp.cross_entropy_fused
// CHECK: fsdp.cross_entropy %arg0, %arg1, %arg2 {ignore_index = -100 : i64}
// CHECK: fsdp.cross_entropy_grad %arg0, %arg1, %{{.+}}, %arg3 {ignore_index = -100 : i64}
func.func @classifier_ignore_count_differs(%x: tensor<8x256xf32>, %y: tensor<8xi32>, %n: tensor<f32>, %m: tensor<f32>) -> (tensor<f32>, tensor<8x256xf32>) {
  %l = fsdp.cross_entropy %x, %y, %n {ignore_index = -100 : i64} : (tensor<8x256xf32>, tensor<8xi32>, tensor<f32>) -> tensor<f32>
  %s = fsdp.fill {value = 1.0 : f64} : tensor<f32>
  %d = fsdp.cross_entropy_grad %x, %y, %s, %m {ignore_index = -100 : i64} : tensor<8x256xf32>, tensor<8xi32>
  return %l, %d : tensor<f32>, tensor<8x256xf32>
}
