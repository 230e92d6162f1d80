// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3 reshard-units=2" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=4 stage=3 reshard-after-forward=2 reshard-units=2" | FileCheck %s --check-prefix=HPZ
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3 reshard-units=0" | FileCheck %s --check-prefix=NONE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3 reshard-units=4" | FileCheck %s --check-prefix=ALL
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3 reshard-units=-2" 2>&1 | FileCheck %s --check-prefix=BAD

// Tests per-unit resharding: with reshard-units=K only the first K units of
// the forward (a, b here) free their gathered parameters after the
// forward; c keeps its forward gather for the backward, as does the last
// unit (root) whatever K. Unit a has no backward read (the input needs
// no gradient), so the backward gathers b only. K = 0 is
// reshard-after-forward=false; K >= the units is true.

fsdp.param @wa : tensor<4x4xf32> init("normal", 0.5) unit "a"
fsdp.param @wb : tensor<4x4xf32> init("normal", 0.5) unit "b"
fsdp.param @wc : tensor<4x4xf32> init("normal", 0.5) unit "c"
fsdp.param @wr : tensor<1x4xf32> init("normal", 0.5)

// CHECK: fsdp.reshard_units = 2
// CHECK-LABEL: func.func @train_step
// CHECK: %[[A:.+]] = fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// CHECK: %[[B:.+]] = fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// CHECK: %[[C:.+]] = fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// CHECK: %[[R:.+]] = fsdp.all_gather %{{.+}} : tensor<2xf32> -> tensor<4xf32>
// CHECK: fsdp.mse_loss
// One backward gather: b's.
// CHECK: %[[B2:.+]] = fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// CHECK-NOT: fsdp.all_gather
// CHECK: fsdp.view %[[B2]] offset = 0 : tensor<16xf32> -> tensor<4x4xf32>
// CHECK-NOT: fsdp.all_gather
// CHECK: return

// HPZ-LABEL: func.func @train_step
// HPZ: fsdp.mse_loss
// HPZ: fsdp.all_gather %{{.+}} {group = "reshard"} : tensor<8xf32> -> tensor<16xf32>
// HPZ-NOT: fsdp.all_gather
// HPZ: return

// NONE: fsdp.reshard_units = 0
// NONE-LABEL: func.func @train_step
// NONE: fsdp.mse_loss
// NONE-NOT: fsdp.all_gather
// NONE: return

// ALL-NOT: fsdp.reshard_units
// ALL-LABEL: func.func @train_step
// ALL: fsdp.mse_loss
// ALL: fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// ALL: fsdp.all_gather %{{.+}} : tensor<8xf32> -> tensor<16xf32>
// ALL-NOT: fsdp.all_gather
// ALL: return

// BAD: fsdp-shard: reshard-units=-2 must be a number of units (0 or more), or -1 for all

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %wa = fsdp.get_param @wa : tensor<4x4xf32>
  %a = fsdp.matmul %x, %wa transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %ra = fsdp.relu %a : tensor<2x4xf32>
  %wb = fsdp.get_param @wb : tensor<4x4xf32>
  %b = fsdp.matmul %ra, %wb transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %rb = fsdp.relu %b : tensor<2x4xf32>
  %wc = fsdp.get_param @wc : tensor<4x4xf32>
  %c = fsdp.matmul %rb, %wc transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %rc = fsdp.relu %c : tensor<2x4xf32>
  %wr = fsdp.get_param @wr : tensor<1x4xf32>
  %o = fsdp.matmul %rc, %wr transpose_rhs : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x1xf32>
  %l = fsdp.mse_loss %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
