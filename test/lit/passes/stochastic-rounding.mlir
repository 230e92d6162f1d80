// RUN: fsdp-opt %s -fsdp-mixed-precision=stochastic-rounding=true | FileCheck %s --check-prefix=MODEL
// RUN: fsdp-opt %s -fsdp-mixed-precision=stochastic-rounding=true -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-mixed-precision=stochastic-rounding=true -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=1" | FileCheck %s --check-prefix=Z1
// RUN: fsdp-opt %s -fsdp-mixed-precision=stochastic-rounding=true -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=DDP
// RUN: fsdp-opt %s --fsdp-pipeline="world-size=2 stage=3 param-dtype=bf16 stochastic-rounding=true offload=optimizer report=false" | FileCheck %s --check-prefix=OFFLOAD
// RUN: fsdp-opt %s -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=NEAREST
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 stochastic-rounding=true" 2>&1 | FileCheck %s --check-prefix=F16
// RUN: not fsdp-opt %s --fsdp-pipeline="stochastic-rounding=true" 2>&1 | FileCheck %s --check-prefix=F32

// Tests where stochastic rounding goes: fsdp-mixed-precision records it in
// the policy and changes no cast of the model; fsdp-shard marks the cast of
// each trainable unit's f32 master (its shard at stages 1-3, `sharded`, the
// whole unit at stage 0) `{stochastic, key = unit index}`. A frozen unit,
// the activations' casts and the gradients' casts round to nearest.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @g : tensor<8xf32> init("ones") unit "layers.0" frozen
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// MODEL: module attributes {fsdp.mixed_precision = {param_dtype = bf16, reduce_dtype = f32, stochastic_rounding}}
// MODEL-NOT: stochastic,

// Z3-LABEL: func.func @train_step
// The input's cast rounds to nearest.
// Z3: fsdp.cast %arg0 : tensor<2x4xf32> -> tensor<2x4xbf16>
// Z3: %[[S0:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// Z3-NEXT: fsdp.cast %[[S0]] {key = 0 : i64, sharded, stochastic} : tensor<20xf32> -> tensor<20xbf16>
// Z3: %[[F:.+]] = fsdp.get_unit @layers.0.frozen : tensor<4xf32>
// Z3-NEXT: fsdp.cast %[[F]] : tensor<4xf32> -> tensor<4xbf16>
// Z3: %[[S2:.+]] = fsdp.get_unit @root : tensor<4xf32>
// Z3-NEXT: fsdp.cast %[[S2]] {key = 2 : i64, sharded, stochastic} : tensor<4xf32> -> tensor<4xbf16>
// The gradients' casts (to f32 for the pack) round nothing.
// Z3-NOT: stochastic
// Z3: fsdp.adamw_update

// Z1-LABEL: func.func @train_step
// Z1: fsdp.cast %{{.+}} {key = 0 : i64, sharded, stochastic} : tensor<20xf32> -> tensor<20xbf16>
// Z1-NEXT: fsdp.all_gather %{{.+}} : tensor<20xbf16> -> tensor<40xbf16>

// Stage 0: the whole unit, no shard offset.
// DDP-LABEL: func.func @train_step
// DDP: fsdp.cast %{{.+}} {key = 0 : i64, stochastic} : tensor<40xf32> -> tensor<40xbf16>

// Optimizer offload: the master comes from the host arena first; the cast
// still knows it reads this rank's shard.
// OFFLOAD: %[[H:.+]] = fsdp.to_device %{{.+}} {async{{.*}}} : tensor<20xf32>
// OFFLOAD: %[[HW:.+]] = fsdp.wait %[[H]]
// OFFLOAD: fsdp.cast %[[HW]] {{{.*}}key = 0 : i64, sharded, stochastic} : tensor<20xf32> -> tensor<20xbf16>

// NEAREST-NOT: stochastic

// F16: stochastic-rounding=true rounds the master parameters to bf16; it needs param-dtype=bf16
// F32: stochastic-rounding=true rounds the master parameters to bf16; it needs param-dtype=bf16

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %g = fsdp.get_param @g : tensor<8xf32>
  %y = fsdp.matmul %x, %w1 transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %z = fsdp.bias_add %y, %b1 : tensor<2x8xf32>, tensor<8xf32>
  %z2 = fsdp.bias_add %z, %g : tensor<2x8xf32>, tensor<8xf32>
  %r = fsdp.relu %z2 : tensor<2x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<2x8xf32>, tensor<1x8xf32>) -> tensor<2x1xf32>
  %l = fsdp.bce_with_logits %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
