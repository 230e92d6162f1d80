// RUN: fsdp-opt %s -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 weight-quantization=int8 quantization-block=8" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 weight-quantization=int8 quantization-block=8" -fsdp-schedule | FileCheck %s --check-prefix=SCHED
// RUN: fsdp-opt %s -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=1 weight-quantization=int8 quantization-block=8" | FileCheck %s --check-prefix=ZERO1
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=1 weight-quantization=int8 quantization-block=8" 2>&1 | FileCheck %s --check-prefix=ZERO1F32
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 weight-quantization=int4" 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 weight-quantization=int8 quantization-block=0" 2>&1 | FileCheck %s --check-prefix=BADBLOCK

// Tests ZeRO++'s quantized weight all-gather (qwZ): each gather of a
// sharded unit quantizes the shard in the compute dtype (after its cast),
// gathers the int8 bytes (10 values in blocks of 8: 12 bytes of values
// padded to 4, two f32 scales = 20 bytes a rank) and dequantizes them
// into the compute dtype; the master shard and its update stay f32 and
// the gradients' reduce-scatter is unchanged.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<10xf32>
// CHECK-LABEL: func.func @train_step
// CHECK: %[[S:.+]] = fsdp.get_unit @layers.0 : tensor<10xf32>
// CHECK-NEXT: %[[SB:.+]] = fsdp.cast %[[S]] : tensor<10xf32> -> tensor<10xbf16>
// CHECK-NEXT: %[[Q:.+]] = fsdp.quantize %[[SB]] {block = 8 : i64} : tensor<10xbf16> -> tensor<20xi8>
// CHECK-NEXT: %[[G:.+]] = fsdp.all_gather %[[Q]] : tensor<20xi8> -> tensor<80xi8>
// CHECK-NEXT: %[[D:.+]] = fsdp.dequantize %[[G]] {block = 8 : i64, parts = 4 : i64} : tensor<80xi8> -> tensor<40xbf16>
// CHECK: fsdp.view %[[D]]
// The root unit (2 values a rank: 4 bytes padded, one scale).
// CHECK: fsdp.get_unit @root : tensor<2xf32>
// CHECK: fsdp.quantize %{{.+}} {block = 8 : i64} : tensor<2xbf16> -> tensor<8xi8>
// CHECK-NEXT: fsdp.all_gather %{{.+}} : tensor<8xi8> -> tensor<32xi8>
// CHECK: fsdp.bce_with_logits
// CHECK-NOT: fsdp.all_gather
// CHECK: fsdp.reduce_scatter %{{.+}} : tensor<40xf32> -> tensor<10xf32>
// CHECK: fsdp.adamw_update {{.+}} : tensor<10xf32>

// With the schedule the quantize moves with its gather: the root unit's
// read, quantize and all-gather go right after the first unit's wait
// (prefetch depth 1), and each dequantize stays at its unit's first read.
// SCHED-LABEL: func.func @train_step
// SCHED: fsdp.get_unit @layers.0 : tensor<10xf32>
// SCHED-NEXT: fsdp.quantize
// SCHED-NEXT: fsdp.all_gather %{{.+}} {async} : tensor<20xi8> -> tensor<80xi8>
// SCHED-NEXT: %[[W:.+]] = fsdp.wait %{{.+}} : tensor<80xi8>
// SCHED-NEXT: fsdp.get_unit @root
// SCHED-NEXT: fsdp.quantize
// SCHED-NEXT: fsdp.all_gather %{{.+}} {async} : tensor<8xi8> -> tensor<32xi8>
// SCHED-NEXT: fsdp.dequantize %[[W]] {block = 8 : i64, parts = 4 : i64} : tensor<80xi8> -> tensor<40xf32>

// ZeRO-1 with bf16 compute: the bf16 copy of each unit's f32 master shard
// is gathered once a step, quantized; the update stays f32.
// ZERO1-LABEL: func.func @train_step
// ZERO1: fsdp.get_unit @layers.0 : tensor<10xf32>
// ZERO1-NEXT: fsdp.cast
// ZERO1-NEXT: fsdp.quantize %{{.+}} {block = 8 : i64} : tensor<10xbf16> -> tensor<20xi8>
// ZERO1-NEXT: fsdp.all_gather %{{.+}} : tensor<20xi8> -> tensor<80xi8>
// ZERO1: fsdp.adamw_update {{.+}} : tensor<10xf32>

// ZeRO-1 in f32: the all-gather after the update is the parameters
// themselves; it stays exact, and the pass says that it quantized nothing.
// ZERO1F32: warning: fsdp-shard: weight-quantization=int8 quantized no all-gather
// ZERO1F32-LABEL: func.func @train_step
// ZERO1F32-NOT: fsdp.quantize
// ZERO1F32: fsdp.all_gather %{{.+}} : tensor<10xf32> -> tensor<40xf32>

// BAD: weight-quantization='int4' must be none or int8
// BADBLOCK: quantization-block=0 must be 1 to 2^30 values a scale

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %y = fsdp.matmul %x, %w1 transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %z = fsdp.bias_add %y, %b1 : tensor<2x8xf32>, tensor<8xf32>
  %r = fsdp.relu %z : tensor<2x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<2x8xf32>, tensor<1x8xf32>) -> tensor<2x1xf32>
  %l = fsdp.bce_with_logits %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
