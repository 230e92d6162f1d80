// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=0,layers.2=0" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="prefetch-depth=2 unit-prefetch-depth=layers.2=1" | FileCheck %s --check-prefix=DEPTH2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="prefetch-depth=1 unit-prefetch-depth=layers.2=1" | FileCheck %s --check-prefix=SAME
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="prefetch-depth=1" | FileCheck %s --check-prefix=SAME
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.2=2" | FileCheck %s --check-prefix=DEEPER
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.7=0" 2>&1 | FileCheck %s --check-prefix=UNKNOWN
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=-1" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=0,layers.1=1" 2>&1 | FileCheck %s --check-prefix=TWICE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="prefetch=false unit-prefetch-depth=layers.1=1" 2>&1 | FileCheck %s --check-prefix=NOPREFETCH
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=1/0,layers.2=1/0" | FileCheck %s --check-prefix=FWD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=0/1,layers.2=0/1" | FileCheck %s --check-prefix=BWD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.0=1/0,layers.1=1/0" | FileCheck %s --check-prefix=ACCUM
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=1/" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=1/0/0" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=1/-1" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="unit-prefetch-depth=layers.1=/1" 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// RUN: fsdp-opt %s --fsdp-pipeline="world-size=2 stage=3 optimizer=adamw unit-prefetch-depth=layers.1=0,layers.2=0" | FileCheck %s --check-prefix=PIPE

// Tests fsdp-schedule's unit-prefetch-depth (FSDP2's per-module
// prefetch): the listed units' gathers get their own depth, one for both
// passes (UNIT=D) or one for the forward's gathers and one for the
// backward's (UNIT=F/B); the others keep prefetch-depth.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @w3 : tensor<8x8xf32> init("normal", 0.02) unit "layers.2"

// Depth 1, layers.1 and layers.2 at 0: layers.0 is prefetched as before,
// layers.1 and layers.2 are gathered where they are read (layers.1 after
// layers.0's matmul, not beside it), and layers.1's backward gather waits
// for layers.2's backward instead of travelling beside it: at the
// backward's start only layers.2 is gathered.
// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.get_unit @layers.0
// CHECK-NEXT: %[[G0:.+]] = fsdp.all_gather
// CHECK-NEXT: fsdp.wait %[[G0]]
// CHECK-NEXT: fsdp.view
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.get_unit @layers.1
// CHECK-NEXT: %[[G1:.+]] = fsdp.all_gather
// CHECK-NEXT: fsdp.wait %[[G1]]
// CHECK-NEXT: fsdp.view
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.get_unit @layers.2
// CHECK-NEXT: %[[G2:.+]] = fsdp.all_gather
// CHECK-NEXT: fsdp.wait %[[G2]]
// CHECK: fsdp.mse_loss
// CHECK-NOT: fsdp.all_gather
// CHECK: %[[RS2:.+]] = fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"} : tensor<64xf32> -> tensor<32xf32>
// CHECK-NEXT: fsdp.get_unit @layers.1
// CHECK-NEXT: %[[B1:.+]] = fsdp.all_gather
// CHECK-NEXT: fsdp.wait %[[B1]]
// The reduce-scatter is still in flight beside layers.1's backward.
// CHECK: fsdp.wait %[[RS2]]
// CHECK-NEXT: fsdp.reduce_scatter

// Depth 2, layers.2 at 1: layers.1 is issued two gathers ahead, beside
// layers.0's gather, but layers.2 (depth 1) only once layers.1 arrives.
// DEPTH2-LABEL: func.func @train_step
// DEPTH2: %[[G0:.+]] = fsdp.all_gather
// DEPTH2-NEXT: fsdp.wait %[[G0]]
// DEPTH2-NEXT: fsdp.get_unit @layers.1
// DEPTH2-NEXT: %[[G1:.+]] = fsdp.all_gather
// DEPTH2-NEXT: fsdp.view
// DEPTH2-NEXT: fsdp.matmul
// DEPTH2-NEXT: fsdp.wait %[[G1]]
// DEPTH2-NEXT: fsdp.get_unit @layers.2
// DEPTH2-NEXT: fsdp.all_gather

// A unit's depth equal to prefetch-depth is the uniform schedule.
// SAME-LABEL: func.func @train_step
// SAME: fsdp.get_unit @layers.0
// SAME-NEXT: %[[G0:.+]] = fsdp.all_gather
// SAME-NEXT: fsdp.wait %[[G0]]
// SAME-NEXT: fsdp.get_unit @layers.1
// SAME-NEXT: %[[G1:.+]] = fsdp.all_gather
// SAME-NEXT: fsdp.view
// SAME-NEXT: fsdp.matmul
// SAME-NEXT: fsdp.wait %[[G1]]
// SAME-NEXT: fsdp.get_unit @layers.2
// SAME: fsdp.mse_loss
// SAME-NEXT: fsdp.get_unit @layers.1
// SAME-NEXT: fsdp.all_gather

// Deeper than prefetch-depth: layers.2 at depth 2 is issued once
// layers.0 arrives, beside layers.1, before layers.0's matmul.
// DEEPER-LABEL: func.func @train_step
// DEEPER: %[[G0:.+]] = fsdp.all_gather
// DEEPER-NEXT: fsdp.wait %[[G0]]
// DEEPER-NEXT: fsdp.get_unit @layers.1
// DEEPER-NEXT: %[[G1:.+]] = fsdp.all_gather
// DEEPER-NEXT: fsdp.get_unit @layers.2
// DEEPER-NEXT: %[[G2:.+]] = fsdp.all_gather
// DEEPER-NEXT: fsdp.view
// DEEPER-NEXT: fsdp.matmul
// DEEPER-NEXT: fsdp.wait %[[G1]]

// Forward 1, backward 0: the forward pass as the uniform schedule's
// (layers.1 travels beside layers.0's matmul), the backward as the first
// case's (layers.1's backward gather is issued where it is read, after
// layers.2's reduce-scatter).
// FWD-LABEL: func.func @train_step
// FWD: fsdp.get_unit @layers.0
// FWD-NEXT: %[[G0:.+]] = fsdp.all_gather
// FWD-NEXT: fsdp.wait %[[G0]]
// FWD-NEXT: fsdp.get_unit @layers.1
// FWD-NEXT: %[[G1:.+]] = fsdp.all_gather
// FWD-NEXT: fsdp.view
// FWD-NEXT: fsdp.matmul
// FWD-NEXT: fsdp.wait %[[G1]]
// FWD-NEXT: fsdp.get_unit @layers.2
// FWD: fsdp.mse_loss
// FWD-NOT: fsdp.all_gather
// FWD: fsdp.reduce_scatter
// FWD-NEXT: fsdp.get_unit @layers.1
// FWD-NEXT: %[[B1:.+]] = fsdp.all_gather
// FWD-NEXT: fsdp.wait %[[B1]]

// Forward 0, backward 1: the other way round.
// BWD-LABEL: func.func @train_step
// BWD: fsdp.matmul
// BWD-NEXT: fsdp.get_unit @layers.1
// BWD-NEXT: %[[G1:.+]] = fsdp.all_gather
// BWD-NEXT: fsdp.wait %[[G1]]
// BWD: fsdp.mse_loss
// BWD-NEXT: fsdp.get_unit @layers.1
// BWD-NEXT: fsdp.all_gather

// With two micro-batches the second's forward gathers are prefetched into
// the first's backward: still forward gathers (judged by where they are
// read), at their forward depth. layers.0 (1/0) is issued once layers.1's
// backward gather (depth 0, where it is read) arrives, before the second
// micro-batch starts.
// ACCUM-LABEL: func.func @train_step
// ACCUM: fsdp.mse_loss
// ACCUM-NOT: fsdp.all_gather
// ACCUM: fsdp.matmul %{{.+}} transpose_lhs
// ACCUM-NEXT: fsdp.get_unit @layers.1
// ACCUM-NEXT: %[[B1:.+]] = fsdp.all_gather
// ACCUM-NEXT: fsdp.wait %[[B1]]
// ACCUM-NEXT: fsdp.get_unit @layers.0
// ACCUM-NEXT: %[[F0:.+]] = fsdp.all_gather
// ACCUM: fsdp.microbatch %{{.+}} index = 1
// ACCUM: fsdp.wait %[[F0]]
// ACCUM-NEXT: fsdp.get_unit @layers.1
// ACCUM-NEXT: fsdp.all_gather

// UNKNOWN: error: unit-prefetch-depth: unit 'layers.7' has no parameter all-gather in @train_step
// NEGATIVE: error: unit-prefetch-depth entry '{{.+}}': expected UNIT=D, or UNIT=F/B (forward / backward), with depths >= 0
// TWICE: error: unit-prefetch-depth: unit 'layers.1' given twice
// NOPREFETCH: error: unit-prefetch-depth needs prefetch (prefetch-depth > 0)

// The pipeline passes it on.
// PIPE-LABEL: func.func @train_step
// PIPE: fsdp.matmul
// PIPE-NEXT: fsdp.get_unit @layers.1
// PIPE-NEXT: %[[G1:.+]] = fsdp.all_gather
// PIPE-NEXT: fsdp.wait %[[G1]]

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %w3 = fsdp.get_param @w3 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %g = fsdp.matmul %h, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %o = fsdp.matmul %g, %w3 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %l = fsdp.mse_loss %o, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
