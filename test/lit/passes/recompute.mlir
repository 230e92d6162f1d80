// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-recompute | FileCheck %s --check-prefix=NONE
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-recompute=policy=unit | FileCheck %s --check-prefix=UNIT
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-recompute=policy=selective | FileCheck %s --check-prefix=SEL
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-recompute=policy=unit | fsdp-opt -split-input-file | FileCheck %s --check-prefix=UNIT
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-group-units -fsdp-recompute=policy=unit -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=ZERO3
// RUN: fsdp-opt %s -split-input-file --fsdp-pipeline="optimizer=sgd world-size=2 stage=3 recompute=selective report=false" | FileCheck %s --check-prefix=PIPE
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-recompute=policy=unit | FileCheck %s --check-prefix=ACCUM
// RUN: fsdp-opt %s -split-input-file --fsdp-pipeline="optimizer=sgd unit-policy=none recompute=unit report=false" | FileCheck %s --check-prefix=ONEUNIT
// RUN: fsdp-opt %s -split-input-file --fsdp-pipeline="optimizer=sgd unit-policy=size min-unit-numel=40 recompute=unit report=false" | FileCheck %s --check-prefix=SIZE
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 param-dtype=bf16 recompute=selective report=false" | FileCheck %s --check-prefix=BF16
// RUN: fsdp-opt %fsdp_src/examples/gpt_small.mlir --fsdp-pipeline="world-size=2 param-dtype=bf16 recompute=unit report=false" | FileCheck %s --check-prefix=BF16

// Tests that with bf16 compute a recomputed read (its cast cloned into the
// backward pass) is still gathered in bf16, in both passes: fsdp-shard
// merges the casts, so no whole f32 unit is all-gathered.
// BF16-LABEL: func.func @train_step
// BF16-NOT: fsdp.all_gather {{.*}} -> tensor<{{[0-9]+}}xf32>
// BF16: fsdp.all_gather {{.*}} -> tensor<{{[0-9]+}}xbf16>
// BF16-NOT: fsdp.all_gather {{.*}} -> tensor<{{[0-9]+}}xf32>
// BF16: return

// Tests that policy=none changes nothing; that policy=unit keeps only what
// a later unit reads (layers.0's output %O, layers.1's output %R3) and
// re-runs the rest of each unit's forward in the backward pass, in forward
// order, right before the backward first reads it; that the segment
// computing the loss (the root head) is not recomputed; and that
// policy=selective keeps the matmul and bias outputs and recomputes only
// the relus (their inputs are saved for relu_grad anyway).

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<4x8xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w3 : tensor<4x4xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @wh : tensor<1x4xf32> init("uniform", 0.3)

// NONE-LABEL: func.func @train_step(%{{.+}}: tensor<2x4xf32>
// NONE-NOT: fsdp.recompute
// NONE: return

// UNIT-LABEL: func.func @train_step(%arg0: tensor<2x4xf32>
// UNIT: %[[W1:.+]] = fsdp.get_param @w1
// UNIT: %[[B1:.+]] = fsdp.get_param @b1
// UNIT: %[[H:.+]] = fsdp.matmul %arg0, %[[W1]] transpose_rhs :
// UNIT: %[[A:.+]] = fsdp.bias_add %[[H]], %[[B1]] :
// UNIT: %[[R:.+]] = fsdp.relu %[[A]] :
// UNIT: %[[O:.+]] = fsdp.matmul %[[R]], %{{.+}} transpose_rhs :
// UNIT: %[[W3:.+]] = fsdp.get_param @w3
// UNIT: %[[H3:.+]] = fsdp.matmul %[[O]], %[[W3]] transpose_rhs :
// UNIT: %[[R3:.+]] = fsdp.relu %[[H3]] :
// UNIT: fsdp.bce_with_logits
// UNIT-NOT: fsdp.recompute
// UNIT: fsdp.matmul %{{.+}}, %[[R3]] transpose_lhs
// UNIT-NOT: %[[H3]],
// UNIT: %[[H3R:.+]] = fsdp.matmul %[[O]], %[[W3]] transpose_rhs {fsdp.recompute}
// UNIT-NEXT: fsdp.relu_grad %[[H3R]],
// UNIT: fsdp.matmul %{{.+}}, %[[O]] transpose_lhs
// UNIT-NOT: %[[R]] transpose_lhs
// UNIT: %[[HR:.+]] = fsdp.matmul %arg0, %[[W1]] transpose_rhs {fsdp.recompute}
// UNIT-NEXT: %[[AR:.+]] = fsdp.bias_add %[[HR]], %[[B1]] {fsdp.recompute}
// UNIT-NEXT: %[[RR:.+]] = fsdp.relu %[[AR]] {fsdp.recompute}
// UNIT-NEXT: fsdp.matmul %{{.+}}, %[[RR]] transpose_lhs
// UNIT-NEXT: fsdp.relu_grad %[[AR]],
// UNIT-NOT: fsdp.recompute
// UNIT: return

// SEL-LABEL: func.func @train_step(%arg0: tensor<2x4xf32>
// SEL: %[[A:.+]] = fsdp.bias_add
// SEL-NEXT: fsdp.relu %[[A]] :
// SEL: fsdp.matmul
// SEL: %[[H3:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs :
// SEL-NEXT: fsdp.relu %[[H3]] :
// SEL: fsdp.bce_with_logits
// SEL: %[[R3R:.+]] = fsdp.relu %[[H3]] {fsdp.recompute}
// SEL-NEXT: fsdp.matmul %{{.+}}, %[[R3R]] transpose_lhs
// SEL: fsdp.relu_grad %[[H3]],
// SEL: %[[RR:.+]] = fsdp.relu %[[A]] {fsdp.recompute}
// SEL-NEXT: fsdp.matmul %{{.+}}, %[[RR]] transpose_lhs
// SEL-NEXT: fsdp.relu_grad %[[A]],
// SEL-NOT: fsdp.recompute
// SEL: return

// At stage 3 the recomputed forward reads the parameters all-gathered for
// the backward pass: each unit's backward all-gather comes first.
// ZERO3-LABEL: func.func @train_step(%arg0: tensor<2x4xf32>
// ZERO3: fsdp.bce_with_logits
// ZERO3: %[[U1:.+]] = fsdp.get_unit @layers.1
// ZERO3-NEXT: %[[G1:.+]] = fsdp.all_gather %[[U1]] : tensor<8xf32> -> tensor<16xf32>
// ZERO3-NEXT: %[[W3:.+]] = fsdp.view %[[G1]] offset = 0 : tensor<16xf32> -> tensor<4x4xf32>
// ZERO3-NEXT: fsdp.matmul %{{.+}}, %[[W3]] transpose_rhs {fsdp.recompute}
// ZERO3: %[[U0:.+]] = fsdp.get_unit @layers.0
// ZERO3-NEXT: %[[G0:.+]] = fsdp.all_gather %[[U0]] : tensor<36xf32> -> tensor<72xf32>
// ZERO3: %[[W1:.+]] = fsdp.view %[[G0]] offset = 0 : tensor<72xf32> -> tensor<8x4xf32>
// ZERO3-NOT: fsdp.all_gather
// ZERO3: fsdp.matmul %arg0, %[[W1]] transpose_rhs {fsdp.recompute}
// ZERO3-NOT: fsdp.all_gather
// ZERO3: return

// The segments are the units fsdp-group-units formed, not the model's
// marks: with one unit for the whole model (unit-policy=none) its only
// segment computes the loss and nothing is recomputed; with units by size
// (group.0 = w1, b1; group.1 = w2, w3; group.2 = wh) group.1 re-runs both
// of its matmuls and group.0 its matmul and bias, fused into one
// matmul_bias by fsdp-fuse-epilogues (their relus feed the next unit and
// stay saved).
// ONEUNIT-LABEL: func.func @train_step(%arg0: tensor<2x4xf32>
// ONEUNIT-NOT: fsdp.recompute
// ONEUNIT: return

// SIZE-LABEL: func.func @train_step(%arg0: tensor<2x4xf32>
// SIZE: fsdp.bce_with_logits
// SIZE: %[[M2:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs {{.*}}fsdp.recompute} : (tensor<2x8xf32>, tensor<4x8xf32>)
// SIZE-NEXT: fsdp.matmul %[[M2]], %{{.+}} transpose_rhs {{.*}}fsdp.recompute} : (tensor<2x4xf32>, tensor<4x4xf32>)
// SIZE: fsdp.matmul_bias %arg0, {{.+}}fsdp.recompute
// SIZE-NOT: fsdp.recompute
// SIZE: return

// PIPE-LABEL: func.func @train_step(%{{.+}}: tensor<2x4xf32>
// PIPE: fsdp.bce_with_logits
// PIPE: fsdp.relu {{.+}}fsdp.recompute
// PIPE: fsdp.relu {{.+}}fsdp.recompute
// PIPE-NOT: fsdp.recompute
// PIPE: return

func.func @model(%x: tensor<2x4xf32>, %y: tensor<2x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %a = fsdp.bias_add %h, %b1 : tensor<2x8xf32>, tensor<8xf32>
  %r = fsdp.relu %a : tensor<2x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<4x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<2x8xf32>, tensor<4x8xf32>) -> tensor<2x4xf32>
  %w3 = fsdp.get_param @w3 : tensor<4x4xf32>
  %h3 = fsdp.matmul %o, %w3 transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %r3 = fsdp.relu %h3 : tensor<2x4xf32>
  %wh = fsdp.get_param @wh : tensor<1x4xf32>
  %z = fsdp.matmul %r3, %wh transpose_rhs : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x1xf32>
  %l = fsdp.bce_with_logits %z, %y : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that policy=selective on a transformer block (Korthikanti et al.
// 2022) keeps the matmul outputs, the bias output and q, k, v, and
// recomputes the gelu, the attention and the layer norm (each with the
// reshape that aliases it) from those; and that policy=unit re-runs the
// whole block, matmuls included, but not its output %O (read by the head).

fsdp.param @g : tensor<8xf32> init("ones") unit "h.0"
fsdp.param @bt : tensor<8xf32> init("zeros") unit "h.0"
fsdp.param @wqkv : tensor<24x8xf32> init("normal", 0.02) unit "h.0"
fsdp.param @wo : tensor<8x8xf32> init("normal", 0.02) unit "h.0"
fsdp.param @wf : tensor<16x8xf32> init("normal", 0.02) unit "h.0"
fsdp.param @bf : tensor<16xf32> init("zeros") unit "h.0"
fsdp.param @wp : tensor<8x16xf32> init("normal", 0.02) unit "h.0"
fsdp.param @head : tensor<1x8xf32> init("normal", 0.02)

// SEL-LABEL: func.func @train_step(%arg0: tensor<1x4x8xf32>
// SEL: %[[G:.+]] = fsdp.get_param @g
// SEL: %[[BT:.+]] = fsdp.get_param @bt
// SEL: %[[Q:.+]] = fsdp.slice %{{.+}} dim = 2 offset = 0
// SEL: %[[K:.+]] = fsdp.slice %{{.+}} dim = 2 offset = 8
// SEL: %[[V:.+]] = fsdp.slice %{{.+}} dim = 2 offset = 16
// SEL: %[[FB:.+]] = fsdp.bias_add
// SEL: fsdp.mse_loss
// SEL-NOT: fsdp.matmul {{.+}}fsdp.recompute
// SEL: %[[GE:.+]] = fsdp.gelu %[[FB]] {fsdp.recompute}
// SEL-NEXT: fsdp.matmul %{{.+}}, %[[GE]] transpose_lhs
// SEL-NEXT: fsdp.gelu_grad %[[FB]],
// SEL-NOT: fsdp.matmul {{.+}}fsdp.recompute
// SEL: %[[AT:[^,]+]], %[[LSE:[^ ]+]] = fsdp.attention %[[Q]], %[[K]], %[[V]] heads = 2 causal {fsdp.recompute}
// SEL-NEXT: %[[AT2:.+]] = fsdp.reshape %[[AT]] {fsdp.recompute}
// SEL-NEXT: fsdp.matmul %{{.+}}, %[[AT2]] transpose_lhs
// SEL: fsdp.attention_grad %[[Q]], %[[K]], %[[V]], %[[AT]], %[[LSE]],
// SEL-NOT: fsdp.matmul {{.+}}fsdp.recompute
// SEL: %[[N:.+]] = fsdp.layer_norm %arg0, %[[G]], %[[BT]] {fsdp.recompute}
// SEL-NEXT: %[[N2:.+]] = fsdp.reshape %[[N]] {fsdp.recompute}
// SEL-NEXT: fsdp.matmul %{{.+}}, %[[N2]] transpose_lhs
// SEL-NOT: fsdp.recompute
// SEL: return

// UNIT-LABEL: func.func @train_step(%arg0: tensor<1x4x8xf32>
// UNIT: %[[O:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs : (tensor<4x16xf32>, tensor<8x16xf32>)
// UNIT: fsdp.mse_loss
// UNIT: fsdp.matmul %{{.+}}, %[[O]] transpose_lhs
// UNIT: fsdp.layer_norm %arg0, %{{.+}}, %{{.+}} {fsdp.recompute}
// UNIT: fsdp.matmul {{.+}}fsdp.recompute{{.+}}tensor<24x8xf32>
// UNIT: fsdp.attention {{.+}}fsdp.recompute
// UNIT: fsdp.matmul {{.+}}fsdp.recompute{{.+}}tensor<8x8xf32>
// UNIT: fsdp.matmul {{.+}}fsdp.recompute{{.+}}tensor<16x8xf32>
// UNIT: fsdp.gelu {{.+}}fsdp.recompute
// UNIT-NOT: fsdp.recompute
// UNIT: fsdp.gelu_grad
// UNIT-NOT: fsdp.recompute
// UNIT: return

func.func @model(%x: tensor<1x4x8xf32>, %y: tensor<4x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %g = fsdp.get_param @g : tensor<8xf32>
  %bt = fsdp.get_param @bt : tensor<8xf32>
  %n = fsdp.layer_norm %x, %g, %bt : tensor<1x4x8xf32>, tensor<8xf32>
  %n2 = fsdp.reshape %n : tensor<1x4x8xf32> -> tensor<4x8xf32>
  %wqkv = fsdp.get_param @wqkv : tensor<24x8xf32>
  %qkv = fsdp.matmul %n2, %wqkv transpose_rhs : (tensor<4x8xf32>, tensor<24x8xf32>) -> tensor<4x24xf32>
  %qkv3 = fsdp.reshape %qkv : tensor<4x24xf32> -> tensor<1x4x24xf32>
  %q = fsdp.slice %qkv3 dim = 2 offset = 0 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %k = fsdp.slice %qkv3 dim = 2 offset = 8 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %v = fsdp.slice %qkv3 dim = 2 offset = 16 : tensor<1x4x24xf32> -> tensor<1x4x8xf32>
  %at = fsdp.attention %q, %k, %v heads = 2 causal : tensor<1x4x8xf32>
  %at2 = fsdp.reshape %at : tensor<1x4x8xf32> -> tensor<4x8xf32>
  %wo = fsdp.get_param @wo : tensor<8x8xf32>
  %p = fsdp.matmul %at2, %wo transpose_rhs : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %wf = fsdp.get_param @wf : tensor<16x8xf32>
  %bf = fsdp.get_param @bf : tensor<16xf32>
  %f = fsdp.matmul %p, %wf transpose_rhs : (tensor<4x8xf32>, tensor<16x8xf32>) -> tensor<4x16xf32>
  %fb = fsdp.bias_add %f, %bf : tensor<4x16xf32>, tensor<16xf32>
  %ge = fsdp.gelu %fb : tensor<4x16xf32>
  %wp = fsdp.get_param @wp : tensor<8x16xf32>
  %o = fsdp.matmul %ge, %wp transpose_rhs : (tensor<4x16xf32>, tensor<8x16xf32>) -> tensor<4x8xf32>
  %head = fsdp.get_param @head : tensor<1x8xf32>
  %z = fsdp.matmul %o, %head transpose_rhs : (tensor<4x8xf32>, tensor<1x8xf32>) -> tensor<4x1xf32>
  %l = fsdp.mse_loss %z, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that with gradient accumulation each micro-batch's backward pass
// re-runs that micro-batch's forward: the clone after loss 0 reads rows 0,
// the clone after loss 1 reads rows 1.

fsdp.param @w : tensor<6x5xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @wh : tensor<1x6xf32> init("uniform", 0.3)

// ACCUM-LABEL: func.func @train_step(%arg0: tensor<6x5xf32>
// ACCUM: %[[X0:.+]] = fsdp.microbatch %arg0 index = 0
// ACCUM: fsdp.bce_with_logits
// ACCUM-NOT: fsdp.microbatch
// ACCUM: fsdp.matmul %[[X0]], %{{.+}} transpose_rhs {fsdp.recompute}
// ACCUM: %[[X1:.+]] = fsdp.microbatch %arg0 index = 1
// ACCUM: fsdp.bce_with_logits
// ACCUM: fsdp.matmul %[[X1]], %{{.+}} transpose_rhs {fsdp.recompute}
// ACCUM-NOT: fsdp.recompute
// ACCUM: return

func.func @model(%x: tensor<3x5xf32>, %y: tensor<3x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<6x5xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<3x5xf32>, tensor<6x5xf32>) -> tensor<3x6xf32>
  %r = fsdp.gelu %h : tensor<3x6xf32>
  %wh = fsdp.get_param @wh : tensor<1x6xf32>
  %z = fsdp.matmul %r, %wh transpose_rhs : (tensor<3x6xf32>, tensor<1x6xf32>) -> tensor<3x1xf32>
  %l = fsdp.bce_with_logits %z, %y : tensor<3x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
