// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-plan-memory | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-plan-memory=report 2>&1 >/dev/null | FileCheck %s --check-prefix=REPORT
// RUN: not fsdp-opt %s -fsdp-plan-memory 2>&1 | FileCheck %s --check-prefix=NOSTEP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard=world-size=2 -fsdp-schedule -fsdp-plan-memory | FileCheck %s --check-prefix=SCHED

// Tests the static memory plan: parameters packed per unit at the bottom
// of the arena (the unit "layers.0" first, 64-byte aligned, then the root
// unit), state mirroring them, optimizer updates in place, and transient
// buffers with disjoint live ranges sharing memory.

// With two ranks the returned loss is the wait of an async all-reduce: the
// forward pass still ends at the loss, so forward values read in backward
// count as activations (this once counted only the 4-byte loss).
// SCHED: fsdp.memory = {activations_at_peak = 1028 : i64,

// CHECK: fsdp.memory = {activations_at_peak = {{[0-9]+}} : i64, arena = 2756 : i64, {{.*}}inputs = 328 : i64, params = 192 : i64, peak_live = 2540 : i64, state = 384 : i64
// CHECK: fsdp.param @w1 {{.*}} {fsdp.offset = 0 : i64}
// CHECK: fsdp.param @b1 {{.*}} {fsdp.offset = 128 : i64}
// CHECK: fsdp.param @w2 {{.*}} {fsdp.offset = 192 : i64}
// CHECK: fsdp.state @w1.exp_avg {{.*}} {fsdp.offset = 256 : i64}
fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK-LABEL: func.func @train_step
// CHECK-SAME: fsdp.arg_offsets = array<i64: 640, 896, 960, 1024>
// CHECK: %[[H:.+]] = fsdp.matmul {{.*}} {fsdp.offsets = array<i64: [[OFF_H:[0-9]+]]>}
// CHECK: fsdp.relu {{.*}} {fsdp.offsets = array<i64: [[OFF_H]]>}
// CHECK: fsdp.adamw_update {{.*}} {fsdp.offsets = array<i64: 0, 256, 384>}
// CHECK: fsdp.adamw_update {{.*}} {fsdp.offsets = array<i64: 128, 512, 544>}
// CHECK: fsdp.adamw_update {{.*}} {fsdp.offsets = array<i64: 192, 576, 608>}

// REPORT: fsdp memory plan (per rank)
// REPORT: parameters 192
// REPORT: optimizer state 384
// REPORT: peak live bytes 2540
// REPORT: arena (planned peak) 2756

// NOSTEP: no @train_step: run fsdp-autodiff first
func.func @model(%x: tensor<16x4xf32> {fsdp.role = "input"}, %y: tensor<16x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %b1 : tensor<16x8xf32>, tensor<8xf32>
  %r = fsdp.relu %hb : tensor<16x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<1x8xf32>) -> tensor<16x1xf32>
  %l = fsdp.bce_with_logits %o, %y : tensor<16x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
