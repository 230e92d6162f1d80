// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 gradient-quantization=int8 quantization-block=8" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3 gradient-quantization=int8 quantization-block=8" -fsdp-schedule | FileCheck %s --check-prefix=SCHED
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=2 mesh=2x2 gradient-quantization=int8 quantization-block=8" | FileCheck %s --check-prefix=HSDP
// RUN: fsdp-opt %s -fsdp-mixed-precision="param-dtype=bf16 reduce-dtype=bf16" -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=2 gradient-quantization=int8 weight-quantization=int8 quantization-block=8" | FileCheck %s --check-prefix=BOTH
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=0 gradient-quantization=int8" 2>&1 | FileCheck %s --check-prefix=ZERO0
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 gradient-quantization=fp8" 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=4 stage=3 gradient-quantization=int8 quantization-block=8 plan=%t.json report=false" -o /dev/null && FileCheck %s --check-prefix=PLAN < %t.json

// Tests ZeRO++'s quantized gradient reduce-scatter (qgZ): each unit's
// packed gradients (G = 4 parts of S values) are quantized part by part
// (each part its own blocks and scales), an all-to-all hands part r to
// rank r, and rank r dequantizes the 4 parts it received and averages them
// in f32: its shard of the mean. layers.0: S = 10 values in blocks of 8 =
// 12 bytes of values (padded to 4) + 2 scales = 20 bytes a part, 80 in
// all; root: S = 2, 4 + 4 = 8 bytes a part. The parameter all-gathers and
// the update are unchanged.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.all_gather %{{.+}} : tensor<10xf32> -> tensor<40xf32>
// CHECK: %[[P0:.+]] = fsdp.pack %{{.+}} offsets = [0] : (tensor<1x8xf32>) -> tensor<8xf32>
// CHECK-NEXT: %[[Q0:.+]] = fsdp.quantize %[[P0]] {block = 8 : i64, parts = 4 : i64} : tensor<8xf32> -> tensor<32xi8>
// CHECK-NEXT: %[[A0:.+]] = fsdp.all_to_all %[[Q0]] : tensor<32xi8> -> tensor<32xi8>
// CHECK-NEXT: %[[R0:.+]] = fsdp.dequantize %[[A0]] {block = 8 : i64, parts = 4 : i64, reduce = "mean"} : tensor<32xi8> -> tensor<2xf32>
// CHECK: %[[P1:.+]] = fsdp.pack {{.+}} -> tensor<40xf32>
// CHECK-NEXT: %[[Q1:.+]] = fsdp.quantize %[[P1]] {block = 8 : i64, parts = 4 : i64} : tensor<40xf32> -> tensor<80xi8>
// CHECK-NEXT: %[[A1:.+]] = fsdp.all_to_all %[[Q1]] : tensor<80xi8> -> tensor<80xi8>
// CHECK-NEXT: %[[R1:.+]] = fsdp.dequantize %[[A1]] {block = 8 : i64, parts = 4 : i64, reduce = "mean"} : tensor<80xi8> -> tensor<10xf32>
// CHECK-NOT: fsdp.reduce_scatter
// CHECK: fsdp.adamw_update %{{.+}}, %[[R1]], {{.+}} : tensor<10xf32>
// CHECK: fsdp.adamw_update %{{.+}}, %[[R0]], {{.+}} : tensor<2xf32>

// With the schedule the all-to-all is async like the reduce-scatter it
// replaces: one in flight, the root unit's waited for before layers.0's is
// issued, its dequantize right after its wait (the received bytes are
// freed there, not held to the update).
// SCHED-LABEL: func.func @train_step
// SCHED: %[[A0:.+]] = fsdp.all_to_all %{{.+}} {async} : tensor<32xi8> -> tensor<32xi8>
// SCHED: fsdp.quantize %{{.+}} {block = 8 : i64, parts = 4 : i64} : tensor<40xf32> -> tensor<80xi8>
// SCHED-NEXT: %[[W0:.+]] = fsdp.wait %[[A0]] : tensor<32xi8>
// SCHED-NEXT: fsdp.dequantize %[[W0]] {block = 8 : i64, parts = 4 : i64, reduce = "mean"} : tensor<32xi8> -> tensor<2xf32>
// SCHED-NEXT: %[[A1:.+]] = fsdp.all_to_all %{{.+}} {async} : tensor<80xi8> -> tensor<80xi8>
// SCHED: %[[W1:.+]] = fsdp.wait %[[A1]] : tensor<80xi8>
// SCHED-NEXT: %[[R1:.+]] = fsdp.dequantize %[[W1]] {{.+}} -> tensor<10xf32>
// SCHED: fsdp.adamw_update %{{.+}}, %[[R1]], {{.+}} : tensor<10xf32>

// HSDP (2 replicas x 2 shards): the all-to-all runs over the shard group
// (2 parts), the replicas' all-reduce of the shard stays exact.
// HSDP-LABEL: func.func @train_step
// HSDP: fsdp.quantize %{{.+}} {block = 8 : i64, parts = 2 : i64} : tensor<40xf32> -> tensor<64xi8>
// HSDP-NEXT: fsdp.all_to_all %{{.+}} {group = "shard"} : tensor<64xi8> -> tensor<64xi8>
// HSDP-NEXT: %[[R:.+]] = fsdp.dequantize %{{.+}} {block = 8 : i64, parts = 2 : i64, reduce = "mean"} : tensor<64xi8> -> tensor<20xf32>
// HSDP-NEXT: fsdp.all_reduce %[[R]] {group = "replica", reduce = "mean"} : tensor<20xf32>

// With bf16 compute and reduce-dtype=bf16 and quantized weights too: the
// bf16 gradients are quantized, the f32 sum rounded once into bf16 (the
// reduce dtype), and the parameters' gathers are qwZ's.
// BOTH-LABEL: func.func @train_step
// BOTH: fsdp.quantize %{{.+}} {block = 8 : i64} : tensor<10xbf16> -> tensor<20xi8>
// BOTH: fsdp.quantize %{{.+}} {block = 8 : i64, parts = 4 : i64} : tensor<40xbf16> -> tensor<80xi8>
// BOTH-NEXT: fsdp.all_to_all
// BOTH-NEXT: fsdp.dequantize %{{.+}} {block = 8 : i64, parts = 4 : i64, reduce = "mean"} : tensor<80xi8> -> tensor<10xbf16>

// Stage 0 all-reduces whole gradients: nothing to quantize, and it says so.
// ZERO0: warning: fsdp-shard: gradient-quantization=int8 quantized no reduction
// ZERO0-LABEL: func.func @train_step
// ZERO0-NOT: fsdp.all_to_all
// ZERO0: fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<40xf32>

// BAD: gradient-quantization='fp8' must be none or int8

// The plan: all_to_all moves i8 bytes; quantize has parts, dequantize reduce.
// PLAN: "op": "quantize"
// PLAN: "op": "all_to_all"
// PLAN: "reduce": "mean"

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
