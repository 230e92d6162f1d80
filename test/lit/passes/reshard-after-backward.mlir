// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=DEFAULT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3 reshard-after-backward=false" | FileCheck %s --check-prefix=KEEP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3 reshard-after-forward=false reshard-after-backward=false" | FileCheck %s --check-prefix=ONCE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3 reshard-after-backward=false" | FileCheck %s --check-prefix=ONEMICRO
// RUN: not fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw world-size=2 grad-accum=2 memory-budget=1GiB reshard-after-backward=maybe" 2>&1 | FileCheck %s --check-prefix=BAD

// Tests fsdp-shard's reshard-after-backward (FSDP2's
// set_reshard_after_backward) with two micro-batches of four one-matmul
// units. By default each micro-batch gathers every unit for its forward
// and (resharded units) again for its backward: 2 x (4 + 2) = 12 gathers
// (layers.3, the last of the forward, keeps its forward gather for its
// backward; layers.0's backward reads no parameter). With false, the
// second micro-batch's forward reads each unit's last gather of the first
// micro-batch (layers.1 and layers.2: their backward gathers; layers.0
// and layers.3: their forward gathers), so it gathers nothing before its
// loss: 12 - 4 = 8. With reshard-after-forward=false too, every unit is
// gathered once a step. One micro-batch: the option changes nothing.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @w3 : tensor<8x8xf32> init("normal", 0.02) unit "layers.2"
fsdp.param @w4 : tensor<8x8xf32> init("normal", 0.02) unit "layers.3"

// DEFAULT-LABEL: func.func @train_step
// DEFAULT-COUNT-12: fsdp.all_gather
// DEFAULT-NOT: fsdp.all_gather

// KEEP-LABEL: func.func @train_step
// KEEP: fsdp.mse_loss
// KEEP: fsdp.get_unit @layers.2
// KEEP-NEXT: %[[B2:.+]] = fsdp.all_gather
// KEEP-NEXT: %[[V2:.+]] = fsdp.view %[[B2]]
// KEEP: fsdp.get_unit @layers.1
// KEEP-NEXT: %[[B1:.+]] = fsdp.all_gather
// KEEP-NEXT: %[[V1:.+]] = fsdp.view %[[B1]]
// The second micro-batch: layers.1 and layers.2 read their first
// micro-batch's backward gathers.
// KEEP: fsdp.microbatch %arg0 index = 1
// KEEP-NOT: fsdp.all_gather
// KEEP: fsdp.matmul %{{.+}}, %[[V1]] transpose_rhs
// KEEP-NEXT: fsdp.matmul %{{.+}}, %[[V2]] transpose_rhs
// KEEP-NOT: fsdp.all_gather
// KEEP: fsdp.mse_loss
// KEEP-COUNT-2: fsdp.all_gather
// KEEP-NOT: fsdp.all_gather
// KEEP: return

// ONCE-LABEL: func.func @train_step
// ONCE-COUNT-4: fsdp.all_gather
// ONCE-NOT: fsdp.all_gather

// ONEMICRO-LABEL: func.func @train_step
// ONEMICRO-COUNT-6: fsdp.all_gather
// ONEMICRO-NOT: fsdp.all_gather

// BAD: for the --reshard-after-backward option: 'maybe' is invalid value for boolean argument

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %w3 = fsdp.get_param @w3 : tensor<8x8xf32>
  %w4 = fsdp.get_param @w4 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %g = fsdp.matmul %h, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %o = fsdp.matmul %g, %w3 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %q = fsdp.matmul %o, %w4 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %l = fsdp.mse_loss %q, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
