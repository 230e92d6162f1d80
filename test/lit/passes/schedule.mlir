// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=prefetch=false | FileCheck %s --check-prefix=NOPRE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=prefetch-depth=0 | FileCheck %s --check-prefix=NOPRE
// RUN: not fsdp-opt %s -fsdp-schedule 2>&1 | FileCheck %s --check-prefix=NOSTEP
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=prefetch-depth=-1 2>&1 | FileCheck %s --check-prefix=NEGDEPTH

// Tests that collectives become async with a wait before the first read,
// that the next unit's all-gather is prefetched (issued before the current
// unit computes), and that at most one collective is in flight.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"

// CHECK-LABEL: func.func @train_step
// CHECK: %[[G0:.+]] = fsdp.all_gather %{{.+}} {async} : tensor<16xf32> -> tensor<32xf32>
// CHECK: %[[W0:.+]] = fsdp.wait %[[G0]] : tensor<32xf32>
// The gather of layers.1 is issued before layers.0's matmul.
// CHECK: %[[G1:.+]] = fsdp.all_gather %{{.+}} {async} : tensor<32xf32> -> tensor<64xf32>
// CHECK: fsdp.view %[[W0]]
// CHECK: fsdp.matmul
// CHECK: %[[W1:.+]] = fsdp.wait %[[G1]]
// CHECK: fsdp.view %[[W1]]
// CHECK: fsdp.mse_loss
// Gradients: reduce-scatter issued async, waited before the next collective.
// CHECK: %[[RS:.+]] = fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"}
// CHECK: fsdp.wait %[[RS]]
// CHECK: fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"}
// CHECK-NOT: fsdp.all_gather %{{.+}} : 
// CHECK: fsdp.adamw_update
// CHECK: %[[L:.+]] = fsdp.all_reduce %{{.+}} {async, reduce = "mean"} : tensor<f32>
// CHECK: %[[LW:.+]] = fsdp.wait %[[L]]
// CHECK: return %[[LW]]

// Without prefetch the gather of layers.1 stays after layers.0's matmul.
// NOPRE-LABEL: func.func @train_step
// NOPRE: fsdp.all_gather {{.*}} -> tensor<32xf32>
// NOPRE: fsdp.matmul
// NOPRE: fsdp.all_gather {{.*}} -> tensor<64xf32>

// NOSTEP: no @train_step: run fsdp-shard first

// prefetch-depth=2: test/lit/passes/schedule-backward.mlir.

// NEGDEPTH: prefetch-depth must be >= 0, found -1

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %o = fsdp.matmul %h, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %l = fsdp.mse_loss %o, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
