// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=prefetch=false | FileCheck %s --check-prefix=NOPRE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=prefetch-depth=2 | FileCheck %s --check-prefix=DEPTH2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=COUNT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3 reshard-after-forward=false" | FileCheck %s --check-prefix=NORESHARD

// Tests backward prefetch (FSDP's BACKWARD_PRE) and the last forward
// unit's kept gather. The gathers form one prefetch chain through forward
// and backward: the next unit's all-gather is issued as soon as the
// previous one arrives, so in the backward pass it moves past the current
// unit's reduce-scatter. A reduce-scatter stays in flight while the next
// unit's backward computes and is waited for only before the next
// reduce-scatter. Without prefetch one collective is in flight at a time.
// layers.2, the last unit of the forward, is gathered once: its backward
// follows the loss with no other unit gathered in between (FSDP2 does not
// reshard the root either); layers.1 is resharded and gathered again.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @w3 : tensor<8x8xf32> init("normal", 0.02) unit "layers.2"

// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.get_unit @layers.2
// CHECK-NEXT: %[[G2:.+]] = fsdp.all_gather
// CHECK: %[[W2:.+]] = fsdp.wait %[[G2]]
// layers.2's backward reads its forward gather.
// CHECK-NEXT: fsdp.view %[[W2]]
// CHECK-NEXT: fsdp.view %[[W2]]
// CHECK-NEXT: fsdp.matmul
// layers.1's backward gather is issued once the loss is computed (never
// above it: it would be held across the loss), and travels during
// layers.2's backward.
// CHECK-NEXT: fsdp.mse_loss
// CHECK-NEXT: fsdp.get_unit @layers.1
// CHECK-NEXT: %[[G1:.+]] = fsdp.all_gather %{{.+}} {async} : tensor<32xf32> -> tensor<64xf32>
// CHECK-NEXT: fsdp.fill
// CHECK-NEXT: fsdp.mse_loss_grad
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.pack
// CHECK-NEXT: %[[RS2:.+]] = fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"} : tensor<64xf32> -> tensor<32xf32>
// CHECK-NEXT: fsdp.wait %[[G1]]
// layers.1's backward runs while layers.2's reduce-scatter is in flight.
// CHECK-NEXT: fsdp.view
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.matmul
// CHECK-NEXT: fsdp.pack
// CHECK-NEXT: fsdp.wait %[[RS2]]
// CHECK-NEXT: fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"} : tensor<64xf32> -> tensor<32xf32>

// NOPRE-LABEL: func.func @train_step
// NOPRE: fsdp.mse_loss_grad
// NOPRE: %[[RS2:.+]] = fsdp.reduce_scatter %{{.+}} {async, reduce = "mean"} : tensor<64xf32> -> tensor<32xf32>
// NOPRE: fsdp.wait %[[RS2]]
// NOPRE-NEXT: %[[G1:.+]] = fsdp.all_gather %{{.+}} {async} : tensor<32xf32> -> tensor<64xf32>
// NOPRE-NEXT: fsdp.wait %[[G1]]

// Two gathers in flight: layers.1 and layers.2 are issued before
// layers.0's matmul. layers.1's backward gather could go when layers.1's
// forward one arrives, but not above the loss.
// DEPTH2-LABEL: func.func @train_step
// DEPTH2: %[[G0:.+]] = fsdp.all_gather
// DEPTH2-NEXT: fsdp.wait %[[G0]]
// DEPTH2-NEXT: fsdp.get_unit @layers.1
// DEPTH2-NEXT: %[[G1:.+]] = fsdp.all_gather
// DEPTH2-NEXT: fsdp.get_unit @layers.2
// DEPTH2-NEXT: %[[G2:.+]] = fsdp.all_gather
// DEPTH2: fsdp.matmul
// DEPTH2: fsdp.wait %[[G1]]
// DEPTH2-NOT: fsdp.all_gather
// DEPTH2: fsdp.wait %[[G2]]
// DEPTH2-NOT: fsdp.all_gather
// DEPTH2: fsdp.mse_loss
// DEPTH2-NEXT: fsdp.get_unit @layers.1
// DEPTH2-NEXT: fsdp.all_gather

// fsdp-shard alone: four gathers (layers.0, 1, 2 and layers.1 again; the
// backward of layers.0 reads no parameter); without resharding three.
// COUNT-LABEL: func.func @train_step
// COUNT-COUNT-4: fsdp.all_gather
// COUNT-NOT: fsdp.all_gather
// NORESHARD-LABEL: func.func @train_step
// NORESHARD-COUNT-3: fsdp.all_gather
// NORESHARD-NOT: fsdp.all_gather

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
