// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw weight-decay-params=matrices" | FileCheck %s --check-prefix=OPT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw weight-decay-params=matrices" -fsdp-shard="world-size=3 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 weight-decay=0.1 weight-decay-params=matrices" -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=Z0
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw" -fsdp-shard="world-size=3 stage=3" | FileCheck %s --check-prefix=ALL
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw weight-decay-params=vectors" 2>&1 | FileCheck %s --check-prefix=BAD

// weight-decay-params=matrices (nanoGPT's and llm.c's AdamW groups): the
// bias b1 gets no weight decay; the matrices keep the optimizer's.
// OPT: fsdp.adamw_update {{.+}} {weight_decay = 0.000000e+00 : f64} : tensor<8xf32>
// OPT: fsdp.adamw_update {{.+}} : tensor<8x4xf32>
// OPT: fsdp.adamw_update {{.+}} : tensor<8x8xf32>

// fsdp-shard packs a unit's matrices first (w1 before b1 although b1 is
// declared first), so the decay covers the unit's first 32 elements:
// rank r's shard of 14 starts at 14 r (shard_stride). A unit of matrices
// only decays everywhere (no attributes).
// Units keep their order (head, whose only parameter is a vector, first).
// Z3: fsdp.unit @head : tensor<9xf32> shard tensor<3xf32> numel 8 params [@s] sharded
// Z3-NEXT: fsdp.unit @layers.0 : tensor<42xf32> shard tensor<14xf32> numel 40 params [@w1, @b1] sharded
// Z3: fsdp.adamw_update {{.+}} {decay_numel = 0 : i64, shard_stride = 3 : i64} : tensor<3xf32>
// Z3: fsdp.adamw_update {{.+}} {decay_numel = 32 : i64, shard_stride = 14 : i64} : tensor<14xf32>
// Z3: fsdp.adamw_update %{{[^{]+}} : tensor<22xf32>

// Stage 0 updates the whole unit: stride 0. SGD's weight decay 0.1 stays
// on the unit's update even though its first parameter (b1) had none.
// Z0: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<20xf32> numel 40 params [@w1, @b1]
// Z0: fsdp.sgd_momentum_update {{.+}} {decay_numel = 32 : i64, momentum = {{.+}}, shard_stride = 0 : i64, weight_decay = 1.000000e-01 : f64} : tensor<40xf32>

// Without the policy, declaration order and no decay attributes.
// ALL: fsdp.unit @layers.0 : tensor<42xf32> shard tensor<14xf32> numel 40 params [@b1, @w1] sharded
// ALL-NOT: decay_numel

// BAD: weight-decay-params must be all or matrices, found 'vectors'

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
