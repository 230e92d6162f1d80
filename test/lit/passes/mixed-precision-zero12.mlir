// RUN: fsdp-opt %s -fsdp-mixed-precision -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=1" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-mixed-precision="param-dtype=f32 reduce-dtype=bf16" -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=2" | FileCheck %s --check-prefix=F32
// RUN: fsdp-opt %s -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="mesh=2x1 world-size=2 stage=2" | FileCheck %s --check-prefix=ONESHARD

// Tests ZeRO-1/2's mixed-precision layout: a trainable unit read only in
// bf16 keeps its f32 master shard and is gathered in bf16 once per step,
// read by both micro-batches of a gradient accumulation; a frozen unit
// keeps its whole f32 copy (no update, so nothing to gather), as does any
// unit when the compute dtype is f32, or when the mesh has one shard.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @g : tensor<8xf32> init("ones") unit "layers.0" frozen
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<20xf32> numel 40 params [@w1, @b1] sharded
// CHECK: fsdp.unit @layers.0.frozen : tensor<8xf32> shard tensor<4xf32> numel 8 params [@g] frozen
// CHECK-NOT: sharded
// CHECK: fsdp.unit @root : tensor<8xf32> shard tensor<4xf32> numel 8 params [@w2] sharded
// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.microbatch %arg0 index = 0
// CHECK: %[[S:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// CHECK-NEXT: %[[SB:.+]] = fsdp.cast %[[S]] : tensor<20xf32> -> tensor<20xbf16>
// CHECK-NEXT: %[[G:.+]] = fsdp.all_gather %[[SB]] : tensor<20xbf16> -> tensor<40xbf16>
// CHECK: fsdp.get_unit @layers.0.frozen : tensor<8xf32>
// CHECK: fsdp.all_gather %{{.+}} : tensor<4xbf16> -> tensor<8xbf16>
// The second micro-batch reads the same gathered units (views of them).
// CHECK: fsdp.microbatch %arg0 index = 1
// CHECK-NOT: fsdp.all_gather
// CHECK: fsdp.reduce_scatter %{{.+}} : tensor<40xf32> -> tensor<20xf32>
// CHECK: %[[M:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// CHECK: %[[NP:[^,]+]], {{.*}} = fsdp.adamw_update %[[M]], {{.+}} : tensor<20xf32>
// CHECK-NOT: fsdp.all_gather
// CHECK: fsdp.set_unit @layers.0 = %[[NP]] : tensor<20xf32>

// F32-NOT: sharded
// F32-LABEL: func.func @train_step
// F32: %[[W:.+]] = fsdp.get_unit @layers.0 : tensor<40xf32>
// F32: %[[NP:[^,]+]], {{.*}} = fsdp.adamw_update {{.+}} : tensor<20xf32>
// F32: fsdp.all_gather %[[NP]] : tensor<20xf32> -> tensor<40xf32>

// ONESHARD-NOT: sharded
// ONESHARD-LABEL: func.func @train_step
// ONESHARD-NOT: fsdp.all_gather
// ONESHARD: fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<40xf32>

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
