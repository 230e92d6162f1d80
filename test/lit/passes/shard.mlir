// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=false" | FileCheck %s --check-prefix=Z3KEEP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=2" | FileCheck %s --check-prefix=Z2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=1" | FileCheck %s --check-prefix=Z1
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9" -fsdp-shard="world-size=3 stage=0" | FileCheck %s --check-prefix=DDP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=2 stage=2" | FileCheck %s --check-prefix=CLIP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=1 stage=3" | FileCheck %s --check-prefix=ONE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=none -fsdp-shard="world-size=2" 2>&1 | FileCheck %s --check-prefix=NOOPT
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=4" 2>&1 | FileCheck %s --check-prefix=BADSTAGE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=4 stage=3 mesh=2x2" | FileCheck %s --check-prefix=HSDP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=6 stage=2 mesh=3x2" | FileCheck %s --check-prefix=HSDP2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 mesh=4x1" | FileCheck %s --check-prefix=REPL
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 mesh=3x2" 2>&1 | FileCheck %s --check-prefix=BADMESH
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 mesh=2by2" 2>&1 | FileCheck %s --check-prefix=BADMESH
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=2" | FileCheck %s --check-prefix=HPZ
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=8 stage=3 mesh=2x4 reshard-after-forward=2" | FileCheck %s --check-prefix=HPZMESH
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=4" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=1" | FileCheck %s --check-prefix=Z3KEEP
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=3" 2>&1 | FileCheck %s --check-prefix=BADHPZ
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=8 stage=3 mesh=2x4 reshard-after-forward=8" 2>&1 | FileCheck %s --check-prefix=BADHPZMESH
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 reshard-after-forward=yes" 2>&1 | FileCheck %s --check-prefix=BADHPZYES

// Tests where each stage puts its collectives: two units ("layers.0" with
// 8x4 + 8 = 40 elements, the root unit with 8, padded to multiples of the
// world size), a frozen parameter that is gathered but never updated.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)
fsdp.param @f : tensor<1x1xf32> init("ones") frozen

// The mesh is recorded as a typed attribute (a 1-D mesh: one replica).
// Z3: module attributes {{{.*}}fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>
// Z3: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<10xf32> numel 40 params [@w1, @b1] sharded
// Z3: fsdp.unit @root : tensor<8xf32> shard tensor<2xf32> numel 8 params [@w2] sharded
// Z3: fsdp.unit @root.frozen : tensor<4xf32> shard tensor<1xf32> numel 1 params [@f] sharded frozen
// Z3: fsdp.state @layers.0.exp_avg : tensor<10xf32> of @layers.0 kind "exp_avg"
// Z3-NOT: fsdp.state @root.frozen
// Z3-LABEL: func.func @train_step
// Z3-NOT: fsdp.get_param
// Z3: %[[S0:.+]] = fsdp.get_unit @layers.0 : tensor<10xf32>
// Z3: %[[F0:.+]] = fsdp.all_gather %[[S0]] : tensor<10xf32> -> tensor<40xf32>
// Z3: fsdp.view %[[F0]] offset = 0 : tensor<40xf32> -> tensor<8x4xf32>
// Z3: %[[F1:.+]] = fsdp.all_gather %{{.+}} : tensor<2xf32> -> tensor<8xf32>
// Z3: %[[W2F:.+]] = fsdp.view %[[F1]] offset = 0 : tensor<8xf32> -> tensor<1x8xf32>
// Z3: fsdp.matmul %{{.+}}, %[[W2F]] transpose_rhs
// Z3: fsdp.bce_with_logits
// The root unit is gathered again for backward (reshard after forward).
// Z3: %[[F2:.+]] = fsdp.all_gather %{{.+}} : tensor<2xf32> -> tensor<8xf32>
// Z3: %[[W2B:.+]] = fsdp.view %[[F2]] offset = 0
// Z3: fsdp.matmul %{{.+}}, %[[W2B]] :
// Each unit's gradients are reduce-scattered as soon as they are complete.
// Z3: %[[G1:.+]] = fsdp.pack %{{.+}} offsets = [0] : (tensor<1x8xf32>) -> tensor<8xf32>
// Z3: fsdp.reduce_scatter %[[G1]] {reduce = "mean"} : tensor<8xf32> -> tensor<2xf32>
// Z3: fsdp.relu_grad
// Z3: %[[G0:.+]] = fsdp.pack %{{.+}}, %{{.+}} offsets = [0, 32] : (tensor<8x4xf32>, tensor<8xf32>) -> tensor<40xf32>
// Z3: %[[GS0:.+]] = fsdp.reduce_scatter %[[G0]] {reduce = "mean"} : tensor<40xf32> -> tensor<10xf32>
// Z3: %[[P0:.+]] = fsdp.get_unit @layers.0 : tensor<10xf32>
// Z3: %[[NP0:[^,]+]], {{.*}} = fsdp.adamw_update %[[P0]], %[[GS0]]
// Z3: fsdp.set_unit @layers.0 = %[[NP0]] : tensor<10xf32>
// Z3: %[[L:.+]] = fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<f32>
// Z3: return %[[L]]

// Without resharding, one gather serves forward and backward.
// Z3KEEP-LABEL: func.func @train_step
// Z3KEEP-COUNT-3: fsdp.all_gather
// Z3KEEP-NOT: fsdp.all_gather

// Stage 2: whole parameters persist; the update runs on a shard view and
// the new shard is all-gathered into the unit.
// Z2: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<10xf32> numel 40 params [@w1, @b1]{{$}}
// Z2: fsdp.state @layers.0.exp_avg : tensor<10xf32>
// Z2-LABEL: func.func @train_step
// Z2: fsdp.get_unit @layers.0 : tensor<40xf32>
// Z2-NOT: fsdp.all_gather %{{.+}} : tensor<10xf32> -> tensor<40xf32>
// Z2: fsdp.bce_with_logits
// Z2: fsdp.reduce_scatter {{.*}} -> tensor<2xf32>
// Z2: fsdp.relu_grad
// Z2: fsdp.reduce_scatter {{.*}} -> tensor<10xf32>
// Z2: %[[FULL:.+]] = fsdp.get_unit @layers.0 : tensor<40xf32>
// Z2: %[[P:.+]] = fsdp.shard_view %[[FULL]] : tensor<40xf32> -> tensor<10xf32>
// Z2: %[[NP:[^,]+]], {{.*}} = fsdp.adamw_update %[[P]]
// Z2: %[[NF:.+]] = fsdp.all_gather %[[NP]] : tensor<10xf32> -> tensor<40xf32>
// Z2: fsdp.set_unit @layers.0 = %[[NF]] : tensor<40xf32>

// Stage 1: the reduce-scatters wait for the end of the backward pass.
// Z1-LABEL: func.func @train_step
// Z1: fsdp.relu_grad
// Z1: fsdp.matmul {{.*}} transpose_lhs
// Z1: fsdp.reduce_scatter {{.*}} -> tensor<10xf32>
// Z1: fsdp.reduce_scatter {{.*}} -> tensor<2xf32>
// Z1: fsdp.shard_view

// Stage 0 (DDP): all-reduce, whole update, no gather, state not sharded.
// DDP: fsdp.unit @layers.0 : tensor<42xf32> shard tensor<14xf32> numel 40
// DDP: fsdp.state @layers.0.momentum_buffer : tensor<42xf32>
// DDP-LABEL: func.func @train_step
// DDP-NOT: fsdp.all_gather
// DDP-NOT: fsdp.reduce_scatter
// DDP: fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<9xf32>
// DDP: fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<42xf32>
// DDP: fsdp.sgd_momentum_update {{.*}} : tensor<42xf32>

// Clipping with sharded gradients: local squared norms, one scalar sum.
// CLIP-LABEL: func.func @train_step
// CLIP: %[[SQ:.+]] = fsdp.squared_norm %{{.+}}, %{{.+}} : tensor<20xf32>, tensor<4xf32>
// CLIP: %[[ALL:.+]] = fsdp.all_reduce %[[SQ]] {reduce = "sum"} : tensor<f32>
// CLIP: %[[C:.+]] = fsdp.clip_coef %[[ALL]]
// CLIP: fsdp.mul %{{.+}}, %[[C]]

// One rank: flat units, no collectives.
// ONE-LABEL: func.func @train_step
// ONE-NOT: fsdp.all_gather
// ONE-NOT: fsdp.reduce_scatter
// ONE-NOT: fsdp.all_reduce
// ONE: fsdp.adamw_update

// Hybrid sharding on a 2x2 mesh: units are cut into 2 shards; gathers and
// reduce-scatters run in the shard group, each gradient shard is then
// all-reduced over the replica group; the clipping norm sums over the shard
// group only, the loss averages over every rank.
// HSDP: module attributes {{{.*}}fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 2>
// HSDP: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<20xf32> numel 40 params [@w1, @b1] sharded
// HSDP: fsdp.state @layers.0.exp_avg : tensor<20xf32>
// HSDP-LABEL: func.func @train_step
// HSDP: %[[S0:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// HSDP: fsdp.all_gather %[[S0]] {group = "shard"} : tensor<20xf32> -> tensor<40xf32>
// HSDP: %[[G0:.+]] = fsdp.pack %{{.+}}, %{{.+}} offsets = [0, 32]
// HSDP: %[[GS0:.+]] = fsdp.reduce_scatter %[[G0]] {group = "shard", reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// HSDP: %[[GR0:.+]] = fsdp.all_reduce %[[GS0]] {group = "replica", reduce = "mean"} : tensor<20xf32>
// HSDP: %[[SQ:.+]] = fsdp.squared_norm %[[GR0]], %{{.+}} : tensor<20xf32>, tensor<4xf32>
// HSDP: fsdp.all_reduce %[[SQ]] {group = "shard", reduce = "sum"} : tensor<f32>
// HSDP: fsdp.adamw_update
// HSDP: %[[L:.+]] = fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<f32>
// HSDP: return %[[L]]

// Stage 2 on 3 replicas x 2 shards: the new shard is all-gathered in the
// shard group after the update.
// HSDP2-LABEL: func.func @train_step
// HSDP2: fsdp.reduce_scatter %{{.+}} {group = "shard", reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// HSDP2: fsdp.all_reduce %{{.+}} {group = "replica", reduce = "mean"} : tensor<20xf32>
// HSDP2: %[[NP:[^,]+]], {{.*}} = fsdp.adamw_update
// HSDP2: fsdp.all_gather %[[NP]] {group = "shard"} : tensor<20xf32> -> tensor<40xf32>

// One shard per replica (4x1) is plain data parallelism: no gathers, no
// reduce-scatters, one all-reduce per unit over every rank.
// REPL: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<40xf32>
// REPL-LABEL: func.func @train_step
// REPL-NOT: fsdp.all_gather
// REPL-NOT: fsdp.reduce_scatter
// REPL: fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<8xf32>
// REPL-NOT: group

// BADMESH: must be RxS with R*S = world-size (4)

// reshard-after-forward=2 (hpZ): the root unit's w2 is read again in
// backward (layers.0 is not: its weight gradient needs only activations).
// After its last forward read each rank copies its half of the gathered
// unit (its index in the reshard group picks which) and the backward
// gathers the two halves within the reshard group; G = 4 (the shard
// group) is plain resharding (Z3 above), G = 1 no resharding (Z3KEEP).
// HPZ: module attributes {{{.*}}fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4, reshard = 2>
// HPZ-LABEL: func.func @train_step
// HPZ: %[[F0:.+]] = fsdp.all_gather %{{.+}} : tensor<10xf32> -> tensor<40xf32>
// HPZ-NOT: fsdp.shard_view %[[F0]]
// HPZ: %[[F1:.+]] = fsdp.all_gather %{{.+}} : tensor<2xf32> -> tensor<8xf32>
// HPZ: %[[W2F:.+]] = fsdp.view %[[F1]] offset = 0 : tensor<8xf32> -> tensor<1x8xf32>
// HPZ: fsdp.matmul %{{.+}}, %[[W2F]] transpose_rhs
// HPZ-NEXT: %[[PART:.+]] = fsdp.shard_view %[[F1]] {group = "reshard"} : tensor<8xf32> -> tensor<4xf32>
// HPZ-NEXT: %[[KEPT:.+]] = fsdp.pack %[[PART]] offsets = [0] : (tensor<4xf32>) -> tensor<4xf32>
// HPZ: fsdp.bce_with_logits
// HPZ: %[[F2:.+]] = fsdp.all_gather %[[KEPT]] {group = "reshard"} : tensor<4xf32> -> tensor<8xf32>
// HPZ: %[[W2B:.+]] = fsdp.view %[[F2]] offset = 0
// HPZ: fsdp.matmul %{{.+}}, %[[W2B]] :
// HPZ-NOT: group = "reshard"
// HPZ: return

// On a 2 x 4 mesh the reshard group lies inside each replica's shard group.
// HPZMESH: fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 4, reshard = 2>
// HPZMESH: fsdp.all_gather %{{.+}} {group = "shard"} : tensor<2xf32> -> tensor<8xf32>
// HPZMESH: fsdp.shard_view %{{.+}} {group = "reshard"} : tensor<8xf32> -> tensor<4xf32>
// HPZMESH: fsdp.all_gather %{{.+}} {group = "reshard"} : tensor<4xf32> -> tensor<8xf32>

// BADHPZ: fsdp-shard: reshard-after-forward='3' must be true, false or a number of ranks G dividing the 4 ranks of the shard group
// BADHPZMESH: reshard-after-forward='8' must be true, false or a number of ranks G dividing the 4 ranks of the shard group
// BADHPZYES: reshard-after-forward='yes' must be true

// NOOPT: fsdp-shard needs an optimizer
// BADSTAGE: fsdp-shard needs world-size in 1..65536 and stage in 0..3, found world-size=2 stage=4

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x1xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %f = fsdp.get_param @f : tensor<1x1xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %b1 : tensor<16x8xf32>, tensor<8xf32>
  %r = fsdp.relu %hb : tensor<16x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<1x8xf32>) -> tensor<16x1xf32>
  %s = fsdp.mul %o, %f : (tensor<16x1xf32>, tensor<1x1xf32>) -> tensor<16x1xf32>
  %l = fsdp.bce_with_logits %s, %y : tensor<16x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
