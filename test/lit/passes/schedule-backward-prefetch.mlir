// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule | FileCheck %s --check-prefix=PRE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=backward-prefetch=post | FileCheck %s --check-prefix=POST
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule="backward-prefetch=post prefetch-depth=2" | FileCheck %s --check-prefix=POST2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=backward-prefetch=none | FileCheck %s --check-prefix=NONE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=backward-prefetch=none | FileCheck %s --check-prefix=ACCUM
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3 reshard-after-backward=false" -fsdp-schedule=backward-prefetch=post | FileCheck %s --check-prefix=KEEPPOST
// RUN: fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 backward-prefetch=post plan=%t.post.plan"
// RUN: fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 plan=%t.pre.plan"
// RUN: %python -c "import json, sys; g = lambda f: [i['op'] for i in json.load(open(f))['program']]; a, b = g(sys.argv[1]), g(sys.argv[2]); print('pipeline', a != b, sorted(a) == sorted(b))" %t.post.plan %t.pre.plan | FileCheck %s --check-prefix=PIPE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule=backward-prefetch=later 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: not fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw world-size=2 memory-budget=1GiB backward-prefetch=later" 2>&1 | FileCheck %s --check-prefix=BADSEARCH

// Tests where fsdp-schedule's backward-prefetch puts the backward pass's
// all-gathers (FSDP's BackwardPrefetch). Four one-matmul units; layers.3,
// the last of the forward, keeps its gather for its backward. A unit's
// backward reads its weight once, in the input gradient (matmul %dy, %w);
// its weight gradient (transpose_lhs) reads no parameter.
// pre (BACKWARD_PRE, the default): layers.2's gather is issued right after
// the loss and travels while layers.3 computes its gradients, both units
// gathered at once.
// post (BACKWARD_POST): it is issued right after layers.3's last read of its
// parameters, so the two never live at once (the backward holds one unit's
// gathered parameters, pre two); it still travels beside layers.3's weight
// gradient and ahead of its reduce-scatter.
// none: gathered where it is read.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @w3 : tensor<8x8xf32> init("normal", 0.02) unit "layers.2"
fsdp.param @w4 : tensor<8x8xf32> init("normal", 0.02) unit "layers.3"

// PRE-LABEL: func.func @train_step
// PRE: fsdp.mse_loss
// PRE-NEXT: fsdp.get_unit @layers.2
// PRE-NEXT: %[[G2:.+]] = fsdp.all_gather
// PRE-NEXT: fsdp.fill
// PRE-NEXT: fsdp.mse_loss_grad
// PRE-NEXT: fsdp.matmul
// PRE-NEXT: fsdp.matmul {{.+}} transpose_lhs
// PRE-NEXT: fsdp.pack
// PRE-NEXT: fsdp.reduce_scatter
// PRE-NEXT: fsdp.wait %[[G2]]
// PRE-NEXT: fsdp.get_unit @layers.1
// PRE-NEXT: fsdp.all_gather

// POST-LABEL: func.func @train_step
// POST: fsdp.get_unit @layers.3
// POST-NEXT: %[[G3:.+]] = fsdp.all_gather
// POST: %[[W3:.+]] = fsdp.wait %[[G3]]
// POST-NEXT: fsdp.view %[[W3]]
// POST-NEXT: %[[V3:.+]] = fsdp.view %[[W3]]
// POST: fsdp.mse_loss
// POST-NEXT: fsdp.fill
// POST-NEXT: %[[DY:.+]] = fsdp.mse_loss_grad
// POST-NEXT: fsdp.matmul %[[DY]], %[[V3]]
// POST-NEXT: fsdp.get_unit @layers.2
// POST-NEXT: %[[G2:.+]] = fsdp.all_gather
// POST-NEXT: fsdp.matmul {{.+}} transpose_lhs
// POST-NEXT: fsdp.pack
// POST-NEXT: fsdp.reduce_scatter
// POST-NEXT: %[[W2:.+]] = fsdp.wait %[[G2]]
// POST-NEXT: %[[V2:.+]] = fsdp.view %[[W2]]
// POST-NEXT: fsdp.matmul %{{.+}}, %[[V2]]
// POST-NEXT: fsdp.get_unit @layers.1
// POST-NEXT: fsdp.all_gather
// POST-NEXT: fsdp.matmul {{.+}} transpose_lhs

// Two deep: layers.1's gather follows layers.3's last read, so layers.2
// and layers.1 are gathered while layers.2 computes (pre would add
// layers.3, three units).
// POST2-LABEL: func.func @train_step
// POST2: fsdp.mse_loss
// POST2-NEXT: fsdp.get_unit @layers.2
// POST2-NEXT: fsdp.all_gather
// POST2-NEXT: fsdp.fill
// POST2-NEXT: fsdp.mse_loss_grad
// POST2-NEXT: fsdp.matmul
// POST2-NEXT: fsdp.get_unit @layers.1
// POST2-NEXT: fsdp.all_gather

// NONE-LABEL: func.func @train_step
// NONE: fsdp.mse_loss
// NONE-NOT: fsdp.all_gather
// NONE: fsdp.reduce_scatter
// NONE-NEXT: fsdp.get_unit @layers.2
// NONE-NEXT: %[[G2:.+]] = fsdp.all_gather
// NONE-NEXT: fsdp.wait %[[G2]]

// With two micro-batches only the backward gathers stay where they are
// read: the second micro-batch's forward gathers are still prefetched,
// the first of them while the first micro-batch's backward runs.
// ACCUM-LABEL: func.func @train_step
// ACCUM: fsdp.mse_loss
// ACCUM-NOT: fsdp.all_gather
// ACCUM: fsdp.get_unit @layers.2
// ACCUM-NEXT: %[[B2:.+]] = fsdp.all_gather
// ACCUM-NEXT: fsdp.wait %[[B2]]
// ACCUM-NOT: fsdp.all_gather
// ACCUM: fsdp.get_unit @layers.1
// ACCUM-NEXT: %[[B1:.+]] = fsdp.all_gather
// ACCUM-NEXT: fsdp.wait %[[B1]]
// ACCUM-NEXT: fsdp.get_unit @layers.0
// ACCUM-NEXT: fsdp.all_gather
// ACCUM: fsdp.microbatch
// ACCUM: fsdp.mse_loss
// ACCUM-NOT: fsdp.all_gather
// ACCUM: fsdp.get_unit @layers.2
// ACCUM-NEXT: %[[C2:.+]] = fsdp.all_gather
// ACCUM-NEXT: fsdp.wait %[[C2]]

// post with reshard-after-backward=false: the first micro-batch's
// backward gathers stay for the second micro-batch's forward, so waiting
// for the last read of layers.2 frees nothing and layers.1's gather is
// issued as pre issues it (right after layers.2's arrives); in the last
// micro-batch they die, and post waits for layers.2's last read.
// KEEPPOST-LABEL: func.func @train_step
// KEEPPOST: fsdp.mse_loss
// KEEPPOST-NEXT: fsdp.get_unit @layers.2
// KEEPPOST-NEXT: %[[B2:.+]] = fsdp.all_gather
// KEEPPOST: fsdp.wait %[[B2]]
// KEEPPOST-NEXT: fsdp.get_unit @layers.1
// KEEPPOST-NEXT: fsdp.all_gather
// KEEPPOST: fsdp.microbatch %arg0 index = 1
// KEEPPOST: fsdp.mse_loss
// KEEPPOST-NEXT: fsdp.get_unit @layers.2
// KEEPPOST-NEXT: %[[C2:.+]] = fsdp.all_gather
// KEEPPOST: %[[X2:.+]] = fsdp.wait %[[C2]]
// KEEPPOST-NEXT: %[[V2:.+]] = fsdp.view %[[X2]]
// KEEPPOST-NEXT: fsdp.matmul %{{.+}}, %[[V2]]
// KEEPPOST-NEXT: fsdp.get_unit @layers.1
// KEEPPOST-NEXT: fsdp.all_gather

// The pipeline option reaches the schedule: the same instructions in
// another order.
// PIPE: pipeline True True

// BAD: backward-prefetch='later': expected pre (FSDP's BACKWARD_PRE), post (BACKWARD_POST) or none
// BADSEARCH: backward-prefetch='later': expected pre, post or none

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
