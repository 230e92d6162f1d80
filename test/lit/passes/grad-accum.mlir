// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 | FileCheck %s
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=1 | FileCheck %s --check-prefix=ONE
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=STEP
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum="micro-batches=2 reduce=microbatch" -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=MICRO
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum="micro-batches=2 reduce=microbatch" -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=DDP
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2" -fsdp-plan-memory | FileCheck %s --check-prefix=MEM
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2" -fsdp-fuse-epilogues -fsdp-plan-memory | FileCheck %s --check-prefix=FUSED
// RUN: fsdp-opt %s -split-input-file -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2" -fsdp-fuse-epilogues=accumulate=false | FileCheck %s --check-prefix=UNFUSED

// Tests that with micro-batches=2 the step takes twice the rows, runs the
// forward and backward pass once per micro-batch on its rows, and publishes
// the mean of the two gradients and losses; with 1 nothing changes.
// Where the collectives land: step mode reduces the accumulated gradient
// once, after the last micro-batch; microbatch mode reduces each
// micro-batch's gradient at once and sums the reduced shards. Every
// micro-batch gathers its own (stage 3) parameters.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK-LABEL: func.func @train_step
// CHECK-SAME: (%[[X:.+]]: tensor<8x4xf32>, %[[Y:.+]]: tensor<8x1xf32>)
// CHECK-SAME: fsdp.grad_accum = {micro_batches = 2 : i64, reduce = "step"}
// CHECK: %[[X0:.+]] = fsdp.microbatch %[[X]] index = 0 : tensor<8x4xf32> -> tensor<4x4xf32>
// CHECK: fsdp.matmul %[[X0]], %{{.+}} transpose_rhs
// CHECK: %[[L0:.+]] = fsdp.bce_with_logits
// CHECK: %[[DW0:.+]] = fsdp.matmul %{{.+}}, %[[X0]] transpose_lhs
// CHECK: %[[X1:.+]] = fsdp.microbatch %[[X]] index = 1 : tensor<8x4xf32> -> tensor<4x4xf32>
// CHECK: fsdp.matmul %[[X1]], %{{.+}} transpose_rhs
// CHECK: %[[L1:.+]] = fsdp.bce_with_logits
// CHECK: %[[LS:.+]] = fsdp.add %[[L0]], %[[L1]] {fsdp.accum}
// CHECK: %[[L:.+]] = fsdp.scale %[[LS]] {factor = 5.000000e-01 : f64, fsdp.accum} : tensor<f32>
// CHECK: %[[DW1:.+]] = fsdp.matmul %{{.+}}, %[[X1]] transpose_lhs
// CHECK: %[[DWS:.+]] = fsdp.add %[[DW0]], %[[DW1]] {fsdp.accum} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
// CHECK: %[[DW:.+]] = fsdp.scale %[[DWS]] {factor = 5.000000e-01 : f64, fsdp.accum} : tensor<8x4xf32>
// CHECK: fsdp.set_grad @w1 = %[[DW]]
// CHECK: fsdp.set_grad @b1
// CHECK: fsdp.set_grad @w2
// CHECK-NOT: fsdp.set_grad
// CHECK: return %[[L]]

// Gradient-accumulation fusion (fsdp-fuse-epilogues): the second
// micro-batch's weight-gradient GEMM of @w2 (no bias) adds into the first
// one's gradient (beta = 1), in place (the same arena offset), and no add
// is left for it; @w1's with its bias gradient (matmul_bias_grad) adds
// both into the first micro-batch's two, each in place.
// FUSED-LABEL: func.func @train_step
// FUSED: %[[G0:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs {fsdp.offsets = array<i64: [[OFF:[0-9]+]]>} : (tensor<4x1xf32>, tensor<4x8xf32>) -> tensor<1x8xf32>
// FUSED: %[[DW0:.+]], %[[DB0:.+]] = fsdp.matmul_bias_grad %{{.+}}, %{{.+}} transpose_lhs {fsdp.offsets = array<i64: [[OW:[0-9]+]], [[OB:[0-9]+]]>} : (tensor<4x8xf32>, tensor<4x4xf32>) -> (tensor<8x4xf32>, tensor<8xf32>)
// FUSED: %[[G:.+]] = fsdp.matmul %{{.+}}, %{{.+}} acc %[[G0]] transpose_lhs {fsdp.accum, fsdp.offsets = array<i64: [[OFF]]>} : (tensor<4x1xf32>, tensor<4x8xf32>, tensor<1x8xf32>) -> tensor<1x8xf32>
// FUSED-NEXT: fsdp.scale %[[G]] {factor = 5.000000e-01 : f64, fsdp.accum
// FUSED: %[[DW:.+]], %[[DB:.+]] = fsdp.matmul_bias_grad %{{.+}}, %{{.+}} acc %[[DW0]], %[[DB0]] transpose_lhs {fsdp.accum, fsdp.offsets = array<i64: [[OW]], [[OB]]>} : (tensor<4x8xf32>, tensor<4x4xf32>, tensor<8x4xf32>, tensor<8xf32>) -> (tensor<8x4xf32>, tensor<8xf32>)
// FUSED-NOT: fsdp.add %{{.+}} {fsdp.accum, fsdp.offsets = array<i64: {{[0-9]+}}>} : (tensor<8
// FUSED: fsdp.scale %[[DB]] {factor = 5.000000e-01 : f64, fsdp.accum
// FUSED: fsdp.scale %[[DW]] {factor = 5.000000e-01 : f64, fsdp.accum

// accumulate=false: the product, then the add.
// UNFUSED-LABEL: func.func @train_step
// UNFUSED: %[[G0:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<4x1xf32>, tensor<4x8xf32>) -> tensor<1x8xf32>
// UNFUSED: %[[B0:.+]], %[[C0:.+]] = fsdp.matmul_bias_grad %{{.+}}, %{{.+}} transpose_lhs :
// UNFUSED-NOT: {{ acc }}
// UNFUSED: %[[G1:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<4x1xf32>, tensor<4x8xf32>) -> tensor<1x8xf32>
// UNFUSED-NEXT: fsdp.add %[[G0]], %[[G1]] {fsdp.accum} : (tensor<1x8xf32>, tensor<1x8xf32>) -> tensor<1x8xf32>
// UNFUSED: %[[B1:.+]], %[[C1:.+]] = fsdp.matmul_bias_grad %{{.+}}, %{{.+}} transpose_lhs :
// UNFUSED-NEXT: fsdp.add %[[C0]], %[[C1]] {fsdp.accum}
// UNFUSED-NEXT: fsdp.scale
// UNFUSED-NEXT: fsdp.add %[[B0]], %[[B1]] {fsdp.accum}

// ONE-LABEL: func.func @train_step
// ONE-SAME: tensor<4x4xf32>
// ONE-NOT: fsdp.grad_accum
// ONE-NOT: fsdp.microbatch
// ONE-NOT: fsdp.accum

// Step mode: no communication in micro-batch 0 but the gathers; one
// reduce-scatter per unit, of the accumulated gradient.
// STEP-LABEL: func.func @train_step
// STEP: fsdp.microbatch %{{.+}} index = 0
// STEP: fsdp.all_gather %{{.+}} : tensor<20xf32> -> tensor<40xf32>
// STEP-NOT: fsdp.reduce_scatter
// STEP: fsdp.microbatch %{{.+}} index = 1
// STEP: fsdp.all_gather %{{.+}} : tensor<20xf32> -> tensor<40xf32>
// STEP: %[[S:.+]] = fsdp.scale %{{.+}} {factor = 5.000000e-01 : f64, fsdp.accum} : tensor<1x8xf32>
// STEP: %[[P:.+]] = fsdp.pack %[[S]] offsets = [0]
// STEP: fsdp.reduce_scatter %[[P]] {reduce = "mean"} : tensor<8xf32> -> tensor<4xf32>
// STEP: fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// STEP-NOT: fsdp.reduce_scatter
// STEP: fsdp.sgd_update

// Microbatch mode: each micro-batch's gradients are reduce-scattered as
// soon as a unit's are complete, summed into the shard, then halved; the
// per-parameter accumulation is gone.
// MICRO-LABEL: func.func @train_step
// MICRO: fsdp.microbatch %{{.+}} index = 0
// MICRO: %[[R0:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<8xf32> -> tensor<4xf32>
// MICRO: %[[U0:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// MICRO: fsdp.microbatch %{{.+}} index = 1
// MICRO: %[[R1:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<8xf32> -> tensor<4xf32>
// MICRO: %[[RS:.+]] = fsdp.add %[[R0]], %[[R1]] {fsdp.accum} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
// MICRO: %[[R:.+]] = fsdp.scale %[[RS]] {factor = 5.000000e-01 : f64, fsdp.accum} : tensor<4xf32>
// MICRO: %[[U1:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// MICRO: %[[US:.+]] = fsdp.add %[[U0]], %[[U1]] {fsdp.accum}
// MICRO: %[[U:.+]] = fsdp.scale %[[US]]
// MICRO-NOT: fsdp.add
// MICRO: fsdp.sgd_update %{{.+}}, %[[U]], %{{.+}} : tensor<20xf32>
// MICRO: fsdp.sgd_update %{{.+}}, %[[R]], %{{.+}} : tensor<4xf32>

// Stage 0 in microbatch mode: an all-reduce per micro-batch (DDP without
// no_sync), summed whole.
// DDP-LABEL: func.func @train_step
// DDP-NOT: fsdp.reduce_scatter
// DDP: fsdp.microbatch %{{.+}} index = 0
// DDP: %[[A0:.+]] = fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<40xf32>
// DDP: fsdp.microbatch %{{.+}} index = 1
// DDP: %[[A1:.+]] = fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<40xf32>
// DDP: fsdp.add %[[A0]], %[[A1]] {fsdp.accum} : (tensor<40xf32>, tensor<40xf32>) -> tensor<40xf32>

// The memory plan: micro-batches are views of the batch (no copy), and
// each accumulation is written over the accumulator.
// MEM-LABEL: func.func @train_step
// MEM: fsdp.microbatch %{{.+}} index = 0 : tensor<8x4xf32>
// MEM-NOT: fsdp.offsets
// MEM-SAME: -> tensor<4x4xf32>
// MEM: %[[G0:.+]] = fsdp.matmul {{.*}} transpose_lhs {fsdp.offsets = array<i64: [[GOFF:[0-9]+]]>} : (tensor<4x8xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
// MEM: fsdp.add %[[G0]], %{{.+}} {fsdp.accum, fsdp.offsets = array<i64: [[GOFF]]>}
func.func @model(%x: tensor<4x4xf32>, %y: tensor<4x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<4x4xf32>, tensor<8x4xf32>) -> tensor<4x8xf32>
  %hb = fsdp.bias_add %h, %b1 : tensor<4x8xf32>, tensor<8xf32>
  %r = fsdp.relu %hb : tensor<4x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<4x8xf32>, tensor<1x8xf32>) -> tensor<4x1xf32>
  %l = fsdp.bce_with_logits %o, %y : tensor<4x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that integer inputs (token ids, labels) are split the same way and
// that a tied weight's two contributions per micro-batch are summed before
// the accumulation.
fsdp.param @emb : tensor<16x4xf32> init("normal", 0.02)
// CHECK-LABEL: func.func @train_step
// CHECK-SAME: (%[[IDS:.+]]: tensor<4x3xi32> {fsdp.role = "input"}, %[[T:.+]]: tensor<4x3xi32> {fsdp.role = "target"})
// CHECK: fsdp.microbatch %[[IDS]] index = 0 : tensor<4x3xi32> -> tensor<2x3xi32>
// CHECK: fsdp.microbatch %[[T]] index = 0 : tensor<4x3xi32> -> tensor<2x3xi32>
// CHECK: %[[G0:.+]] = fsdp.add %{{.+}}, %{{.+}} : (tensor<16x4xf32>, tensor<16x4xf32>)
// CHECK: fsdp.microbatch %[[IDS]] index = 1 : tensor<4x3xi32> -> tensor<2x3xi32>
// CHECK: %[[G1:.+]] = fsdp.add %{{.+}}, %{{.+}} : (tensor<16x4xf32>, tensor<16x4xf32>)
// CHECK: %[[GS:.+]] = fsdp.add %[[G0]], %[[G1]] {fsdp.accum}
// CHECK: %[[G:.+]] = fsdp.scale %[[GS]]
// CHECK: fsdp.set_grad @emb = %[[G]]
func.func @model(%ids: tensor<2x3xi32> {fsdp.role = "input"}, %tgt: tensor<2x3xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %e = fsdp.get_param @emb : tensor<16x4xf32>
  %h = fsdp.embedding %e, %ids : (tensor<16x4xf32>, tensor<2x3xi32>) -> tensor<2x3x4xf32>
  %h2 = fsdp.reshape %h : tensor<2x3x4xf32> -> tensor<6x4xf32>
  %lg = fsdp.matmul %h2, %e transpose_rhs : (tensor<6x4xf32>, tensor<16x4xf32>) -> tensor<6x16xf32>
  %t2 = fsdp.reshape %tgt : tensor<2x3xi32> -> tensor<6xi32>
  %l = fsdp.cross_entropy %lg, %t2 : (tensor<6x16xf32>, tensor<6xi32>) -> tensor<f32>
  return %l : tensor<f32>
}
