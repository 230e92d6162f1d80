// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb" | FileCheck %s --check-prefix=OPT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb weight-decay-params=matrices" -fsdp-shard="world-size=3 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb" -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=Z0
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb" -fsdp-shard="world-size=4 mesh=2x2 stage=2" | FileCheck %s --check-prefix=HSDP
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=lamb max-grad-norm=1.0 world-size=2 stage=3 plan=%t.plan" -o /dev/null 2>/dev/null
// RUN: FileCheck %s --check-prefix=PLAN < %t.plan
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=lamb max-grad-norm=1.0 world-size=2 stage=3 offload=optimizer" 2>/dev/null | FileCheck %s --check-prefix=OFF
// RUN: not fsdp-opt %S/Inputs/bf16-param.mlir -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb" 2>&1 | FileCheck %s --check-prefix=BF16
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lars" 2>&1 | FileCheck %s --check-prefix=BAD

// LAMB (fsdp-insert-optimizer): per parameter, the norms of the weights
// and of the update direction (two f32 sums over one segment, the whole
// parameter), then the update reading them; AdamW's two moments.
// OPT: optimizer = "lamb", {{.*}}weight_decay = 1.000000e-02
// OPT: fsdp.state @s.exp_avg : tensor<8xf32> of @s kind "exp_avg"
// OPT: fsdp.state @s.exp_avg_sq : tensor<8xf32> of @s kind "exp_avg_sq"
// OPT: %[[N:.+]] = fsdp.lamb_norms %[[P:[0-9]+]], %[[G:[0-9]+]], %[[M:[0-9]+]], %[[V:[0-9]+]], %arg3 {{{.*}}segments = array<i64: 0, 8>} : tensor<8xf32> -> tensor<2xf32>
// OPT-NEXT: fsdp.lamb_update %[[P]], %[[G]], %[[M]], %[[V]], %[[N]], %arg2, %arg3 {{{.*}}segments = array<i64: 0, 8>} : tensor<8xf32>, tensor<2xf32>
// OPT: fsdp.lamb_norms {{.+}} {{{.*}}segments = array<i64: 0, 32>} : tensor<8x4xf32> -> tensor<2xf32>
// OPT: fsdp.lamb_norms {{.+}} {{{.*}}segments = array<i64: 0, 64>} : tensor<8x8xf32> -> tensor<2xf32>

// fsdp-shard: one norms op per unit, its parameters as segments (matrices
// first with weight-decay-params=matrices: the decayed prefix ends at a
// segment boundary), positions by the shard's stride, and the partial
// sums all-reduced over the shards before the update reads them. Units
// are prepared one ahead: the next unit's norms and all-reduce come
// before this unit's update (the all-reduce overlaps them).
// Z3: fsdp.unit @layers.0 : tensor<42xf32> shard tensor<14xf32> numel 40 params [@w1, @b1] sharded
// Z3: %[[N0:.+]] = fsdp.lamb_norms {{.+}} {decay_numel = 0 : i64, eps = {{.+}}, segments = array<i64: 0, 8>, shard_stride = 3 : i64} : tensor<3xf32> -> tensor<2xf32>
// Z3-NEXT: %[[R0:.+]] = fsdp.all_reduce %[[N0]] {reduce = "sum"} : tensor<2xf32>
// Z3: %[[N1:.+]] = fsdp.lamb_norms {{.+}} {decay_numel = 32 : i64, eps = {{.+}}, segments = array<i64: 0, 32, 40>, shard_stride = 14 : i64} : tensor<14xf32> -> tensor<4xf32>
// Z3-NEXT: %[[R1:.+]] = fsdp.all_reduce %[[N1]] {reduce = "sum"} : tensor<4xf32>
// Z3-NEXT: fsdp.lamb_update {{.+}}, %[[R0]], %arg2, %arg3 {decay_numel = 0 : i64, eps = {{.+}}, segments = array<i64: 0, 8>, shard_stride = 3 : i64} : tensor<3xf32>, tensor<2xf32>
// Z3: %[[N2:.+]] = fsdp.lamb_norms {{.+}} : tensor<22xf32> -> tensor<2xf32>
// Z3-NEXT: %[[R2:.+]] = fsdp.all_reduce %[[N2]]
// Z3-NEXT: fsdp.lamb_update {{.+}}, %[[R1]], %arg2, %arg3 {decay_numel = 32 : i64, eps = {{.+}}, segments = array<i64: 0, 32, 40>, shard_stride = 14 : i64} : tensor<14xf32>, tensor<4xf32>
// Z3: fsdp.lamb_update {{.+}}, %[[R2]], %arg2, %arg3

// Stage 0 updates whole units: no stride, nothing to all-reduce.
// Z0: fsdp.lamb_norms {{.+}} {eps = {{.+}}, segments = array<i64: 0, 8, 40>} : tensor<40xf32> -> tensor<4xf32>
// Z0-NOT: all_reduce {{.+}} : tensor<4xf32>
// Z0: fsdp.lamb_update

// A 2-D mesh: the norms are summed over the shard group only (the replicas
// hold the same reduced shard), then the shard is updated and gathered.
// HSDP: %[[N:.+]] = fsdp.lamb_norms {{.+}} {eps = {{.+}}, segments = array<i64: 0, 8, 40>, shard_stride = 20 : i64} : tensor<20xf32> -> tensor<4xf32>
// HSDP-NEXT: %[[R:.+]] = fsdp.all_reduce %[[N]] {group = "shard", reduce = "sum"} : tensor<4xf32>
// HSDP: %[[NP:[a-z_0-9]+]], {{.+}} = fsdp.lamb_update {{.+}}, %[[R]], {{.+}} : tensor<20xf32>, tensor<4xf32>
// HSDP: fsdp.all_gather %[[NP]] {group = "shard"} : tensor<20xf32> -> tensor<40xf32>

// The plan: clipping's factor folded into both ops (grad_scale), the
// all-reduce of the norms async with its wait before the update.
// PLAN: "grad_scale": true,
// PLAN: "segments": [
// PLAN: "shard_stride":
// PLAN: "op": "lamb_norms",
// PLAN: "op": "all_reduce",
// PLAN: "op": "wait",
// PLAN: "op": "lamb_update",

// Optimizer offload: both ops run on the host; the norms go to the device
// for their all-reduce and come back for the update.
// OFF: %[[N:.+]] = fsdp.lamb_norms {{.+}}fsdp.on_host{{.+}} -> tensor<2xf32>
// OFF: %[[D:.+]] = fsdp.to_device %[[N]]
// OFF: fsdp.all_reduce %[[D]]
// OFF: fsdp.lamb_update {{.+}}fsdp.on_host

// BF16: optimizer=lamb needs f32 parameters
// BAD: unknown optimizer 'lars': expected sgd, adamw, lamb or none

fsdp.param @s : tensor<8xf32> init("zeros") unit "head"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %s = fsdp.get_param @s : tensor<8xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %b1 : tensor<16x8xf32>, tensor<8xf32>
  %o = fsdp.matmul %hb, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
  %os = fsdp.bias_add %o, %s : tensor<16x8xf32>, tensor<8xf32>
  %l = fsdp.mse_loss %os, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
