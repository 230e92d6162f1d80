// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3" -fsdp-schedule | FileCheck %s --check-prefix=SCHED
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3" -fsdp-schedule=prefetch=false | FileCheck %s --check-prefix=NOPF
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3" -fsdp-schedule=overlap-node-exchange=false | FileCheck %s --check-prefix=NOPF
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 report=false" | FileCheck %s --check-prefix=PIPE
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 report=false overlap-node-exchange=false" | FileCheck %s --check-prefix=PIPEOFF
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3" -fsdp-schedule=node-comm-stream=false | FileCheck %s --check-prefix=ONESTREAM
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 report=false node-comm-stream=false" | FileCheck %s --check-prefix=ONESTREAM
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 report=false node-comm-stream=false memory-budget=1GiB" | FileCheck %s --check-prefix=ONESTREAM
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 report=false memory-budget=1GiB" | FileCheck %s --check-prefix=SEARCH
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=8 stage=2 mesh=2x4 gradient-quantization=int8 quantization-block=8 ranks-per-node=2" -fsdp-schedule | FileCheck %s --check-prefix=HSDPS
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=8 stage=2 mesh=2x4 gradient-quantization=int8 quantization-block=8 ranks-per-node=2" | FileCheck %s --check-prefix=HSDP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 ranks-per-node=4" 2>&1 | FileCheck %s --check-prefix=UNEVEN
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 gradient-quantization=int8 ranks-per-node=6" | FileCheck %s --check-prefix=ONENODE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=3 ranks-per-node=3" | FileCheck %s --check-prefix=EXACT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 stage=0 gradient-quantization=int8 ranks-per-node=3" 2>&1 | FileCheck %s --check-prefix=ZERO0
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=6 gradient-quantization=int8 ranks-per-node=-2" 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=6 stage=3 gradient-quantization=int8 quantization-block=8 ranks-per-node=3 plan=%t.json report=false" -o /dev/null && FileCheck %s --check-prefix=PLAN < %t.json
// RUN: fsdp-opt %s "--fsdp-pipeline=optimizer=adamw world-size=16 stage=3 gradient-quantization=int8 quantization-block=8 plan=%t16.json report=false" -o /dev/null && FileCheck %s --check-prefix=PROFILE < %t16.json

// Tests hierarchical qgZ (ZeRO++'s): with ranks-per-node=L a shard group
// of G = L x M ranks (M whole nodes) reduces its quantized gradients in two
// levels. Rank n L + j (node n, place j) quantizes, for place j of its
// node, the chunks of ranks j, j + L, ... in one part (fsdp.quantize
// chunks = G, parts = L); the all-to-all over group "node" hands them
// over; place j averages its node's L parts (f32) into M chunks,
// requantizes them as M parts, and the all-to-all over group "cross"
// (place j of every node) hands node n chunk n L + j, whose M parts it
// averages: its shard of the mean, with 1/L of the flat all-to-all's bytes
// crossing nodes.
//
// G = 6, L = 3, M = 2, blocks of 8. layers.0: 40 values padded to 42, a
// shard S = 7. Node level: parts of M S = 14 values, 16 bytes of values +
// 2 scales = 24 bytes, 72 in all, averaged into 14 f32; cross level: 2
// parts of 7 values, 8 + 4 = 12 bytes each, 24 in all. root: 8 values
// padded to 12, S = 2: 3 parts of 4 values (8 bytes), then 2 parts of 2
// (8 bytes).

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// CHECK: module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 6, node = 3>
// CHECK-LABEL: func.func @train_step
// CHECK: %[[Q0:.+]] = fsdp.quantize %{{.+}} {block = 8 : i64, chunks = 6 : i64, parts = 3 : i64} : tensor<12xf32> -> tensor<24xi8>
// CHECK-NEXT: %[[A0:.+]] = fsdp.all_to_all %[[Q0]] {group = "node"} : tensor<24xi8> -> tensor<24xi8>
// CHECK-NEXT: %[[M0:.+]] = fsdp.dequantize %[[A0]] {block = 8 : i64, parts = 3 : i64, reduce = "mean"} : tensor<24xi8> -> tensor<4xf32>
// CHECK-NEXT: %[[Q1:.+]] = fsdp.quantize %[[M0]] {block = 8 : i64, parts = 2 : i64} : tensor<4xf32> -> tensor<16xi8>
// CHECK-NEXT: %[[A1:.+]] = fsdp.all_to_all %[[Q1]] {group = "cross"} : tensor<16xi8> -> tensor<16xi8>
// CHECK-NEXT: %[[R0:.+]] = fsdp.dequantize %[[A1]] {block = 8 : i64, parts = 2 : i64, reduce = "mean"} : tensor<16xi8> -> tensor<2xf32>
// CHECK: %[[P1:.+]] = fsdp.pack {{.+}} -> tensor<42xf32>
// CHECK-NEXT: %[[Q2:.+]] = fsdp.quantize %[[P1]] {block = 8 : i64, chunks = 6 : i64, parts = 3 : i64} : tensor<42xf32> -> tensor<72xi8>
// CHECK-NEXT: %[[A2:.+]] = fsdp.all_to_all %[[Q2]] {group = "node"} : tensor<72xi8> -> tensor<72xi8>
// CHECK-NEXT: %[[M1:.+]] = fsdp.dequantize %[[A2]] {block = 8 : i64, parts = 3 : i64, reduce = "mean"} : tensor<72xi8> -> tensor<14xf32>
// CHECK-NEXT: %[[Q3:.+]] = fsdp.quantize %[[M1]] {block = 8 : i64, parts = 2 : i64} : tensor<14xf32> -> tensor<24xi8>
// CHECK-NEXT: %[[A3:.+]] = fsdp.all_to_all %[[Q3]] {group = "cross"} : tensor<24xi8> -> tensor<24xi8>
// CHECK-NEXT: %[[R1:.+]] = fsdp.dequantize %[[A3]] {block = 8 : i64, parts = 2 : i64, reduce = "mean"} : tensor<24xi8> -> tensor<7xf32>
// CHECK-NOT: fsdp.reduce_scatter
// CHECK: fsdp.adamw_update %{{.+}}, %[[R1]], {{.+}} : tensor<7xf32>
// CHECK: fsdp.adamw_update %{{.+}}, %[[R0]], {{.+}} : tensor<2xf32>

// Scheduled (prefetch, the default): both all-to-alls async. Root's node
// all-to-all travels while layers.0 computes its gradients; its tail (the
// node average, the requantization and the cross-node all-to-all) runs
// just before layers.0's node all-to-all is issued, and root's cross-node
// exchange stays in flight behind it, waited for before layers.0's
// cross-node exchange.
// SCHED-LABEL: func.func @train_step
// SCHED: %[[A0:.+]] = fsdp.all_to_all %{{.+}} {async, group = "node", stream = "node"} : tensor<24xi8> -> tensor<24xi8>
// SCHED-NEXT: fsdp.relu_grad
// SCHED: fsdp.matmul
// SCHED: %[[Q1:.+]] = fsdp.quantize %{{.+}} -> tensor<72xi8>
// SCHED-NEXT: %[[W0:.+]] = fsdp.wait %[[A0]] : tensor<24xi8>
// SCHED-NEXT: fsdp.dequantize %[[W0]] {{.+}} -> tensor<4xf32>
// SCHED-NEXT: fsdp.quantize
// SCHED-NEXT: %[[A1:.+]] = fsdp.all_to_all %{{.+}} {async, group = "cross"} : tensor<16xi8> -> tensor<16xi8>
// SCHED-NEXT: %[[A2:.+]] = fsdp.all_to_all %[[Q1]] {async, group = "node", stream = "node"} : tensor<72xi8> -> tensor<72xi8>
// SCHED: %[[W2:.+]] = fsdp.wait %[[A2]] : tensor<72xi8>
// SCHED-NEXT: fsdp.dequantize %[[W2]] {{.+}} -> tensor<14xf32>
// SCHED-NEXT: fsdp.quantize
// SCHED-NEXT: %[[W1:.+]] = fsdp.wait %[[A1]] : tensor<16xi8>
// SCHED-NEXT: fsdp.dequantize %[[W1]] {{.+}} -> tensor<2xf32>
// SCHED-NEXT: fsdp.all_to_all %{{.+}} {async, group = "cross"} : tensor<24xi8> -> tensor<24xi8>

// Without prefetch one collective is in flight: the node level is waited
// for at once, and the cross level before the next unit's node level.
// overlap-node-exchange=false places them the same way with prefetch on.
// NOPF-LABEL: func.func @train_step
// NOPF: %[[A0:.+]] = fsdp.all_to_all %{{.+}} {async, group = "node", stream = "node"} : tensor<24xi8> -> tensor<24xi8>
// NOPF-NEXT: %[[W0:.+]] = fsdp.wait %[[A0]] : tensor<24xi8>
// NOPF-NEXT: fsdp.dequantize %[[W0]] {{.+}} -> tensor<4xf32>
// NOPF-NEXT: fsdp.quantize
// NOPF-NEXT: %[[A1:.+]] = fsdp.all_to_all %{{.+}} {async, group = "cross"} : tensor<16xi8> -> tensor<16xi8>
// NOPF-NEXT: fsdp.relu_grad
// NOPF: fsdp.quantize %{{.+}} -> tensor<72xi8>
// NOPF-NEXT: %[[W1:.+]] = fsdp.wait %[[A1]] : tensor<16xi8>
// NOPF-NEXT: fsdp.dequantize %[[W1]] {{.+}} -> tensor<2xf32>
// NOPF-NEXT: fsdp.all_to_all %{{.+}} {async, group = "node", stream = "node"} : tensor<72xi8> -> tensor<72xi8>
// NOPF-NEXT: fsdp.wait

// node-comm-stream=false (fsdp-schedule, the pipeline, the search's
// candidates): one comm stream, no collective marked.
// ONESTREAM-LABEL: func.func @train_step
// ONESTREAM-NOT: stream =
// ONESTREAM: fsdp.all_to_all %{{.+}} {async, {{.*}}group = "node"} : tensor<24xi8> -> tensor<24xi8>
// ONESTREAM-NOT: stream =

// The memory-budget search's candidates mark them too.
// SEARCH: fsdp.all_to_all {{.+}}group = "node", stream = "node"} : tensor<24xi8>

// The pipeline passes overlap-node-exchange on (default true), and
// node-comm-stream (default true) marks only the node group's exchanges.
// PIPE-NOT: group = "cross", stream
// PIPE: %[[A:.+]] = fsdp.all_to_all {{.+}}group = "node", stream = "node"} : tensor<24xi8>
// PIPE-NEXT: fsdp.relu_grad
// PIPE: fsdp.wait %[[A]]
// PIPEOFF: %[[A:.+]] = fsdp.all_to_all {{.+}}group = "node", stream = "node"} : tensor<24xi8>
// PIPEOFF-NEXT: fsdp.wait %[[A]]

// HSDP scheduled: the tail takes the replica all-reduce along, and it
// stays in flight behind layers.0's node all-to-all.
// HSDPS-LABEL: func.func @train_step
// HSDPS: %[[A0:.+]] = fsdp.all_to_all %{{.+}} {async, group = "node", stream = "node"} : tensor<16xi8> -> tensor<16xi8>
// HSDPS-NEXT: fsdp.relu_grad
// HSDPS: fsdp.quantize %{{.+}} -> tensor<64xi8>
// HSDPS-NEXT: fsdp.wait %[[A0]]
// HSDPS: %[[R0:.+]] = fsdp.all_reduce %{{.+}} {async, group = "replica", reduce = "mean"} : tensor<2xf32>
// HSDPS-NEXT: fsdp.all_to_all %{{.+}} {async, group = "node", stream = "node"} : tensor<64xi8> -> tensor<64xi8>
// HSDPS: fsdp.wait %[[R0]] : tensor<2xf32>
// HSDPS-NEXT: fsdp.all_to_all %{{.+}} {async, group = "cross"} : tensor<40xi8> -> tensor<40xi8>

// HSDP 2 replicas x 4 shards on nodes of 2: the two levels within each
// shard group (chunks = 4 of 10 values), then the replicas' exact
// all-reduce of the shard.
// HSDP: module attributes {fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 4, node = 2>
// HSDP-LABEL: func.func @train_step
// HSDP: fsdp.quantize %{{.+}} {block = 8 : i64, chunks = 4 : i64, parts = 2 : i64} : tensor<40xf32> -> tensor<64xi8>
// HSDP-NEXT: fsdp.all_to_all %{{.+}} {group = "node"} : tensor<64xi8> -> tensor<64xi8>
// HSDP-NEXT: fsdp.dequantize %{{.+}} {block = 8 : i64, parts = 2 : i64, reduce = "mean"} : tensor<64xi8> -> tensor<20xf32>
// HSDP-NEXT: fsdp.quantize %{{.+}} {block = 8 : i64, parts = 2 : i64} : tensor<20xf32> -> tensor<40xi8>
// HSDP-NEXT: fsdp.all_to_all %{{.+}} {group = "cross"} : tensor<40xi8> -> tensor<40xi8>
// HSDP-NEXT: %[[R:.+]] = fsdp.dequantize %{{.+}} {block = 8 : i64, parts = 2 : i64, reduce = "mean"} : tensor<40xi8> -> tensor<10xf32>
// HSDP-NEXT: fsdp.all_reduce %[[R]] {group = "replica", reduce = "mean"} : tensor<10xf32>

// Nodes of 4 do not tile a shard group of 6: one all-to-all, with a warning.
// UNEVEN: warning: fsdp-shard: gradient-quantization=int8 over a shard group of 6 ranks that 4 ranks a node do not divide
// UNEVEN: fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 6>
// UNEVEN-NOT: group = "node"
// UNEVEN: fsdp.all_to_all %{{.+}} : tensor<72xi8> -> tensor<72xi8>

// The shard group on one node: the flat all-to-all.
// ONENODE-NOT: node = 
// ONENODE-NOT: chunks
// ONENODE: fsdp.all_to_all %{{.+}} : tensor<72xi8> -> tensor<72xi8>

// Without gradient quantization the node size changes nothing.
// EXACT-NOT: node =
// EXACT: fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<42xf32> -> tensor<7xf32>

// ZERO0: warning: fsdp-shard: gradient-quantization=int8 quantized no reduction
// ZERO0-NOT: node =
// ZERO0-NOT: fsdp.all_to_all

// BAD: fsdp-shard: ranks-per-node=-2 must be 0 or more

// The plan records the node size and the quantize's chunks.
// PLAN: "mesh": {
// PLAN-NEXT: "node": 3,
// PLAN: "chunks": 6
// PLAN: "op": "quantize"
// PLAN: "group": "node",
// PLAN-NEXT: "stream": "node"
// PLAN: "op": "all_to_all"
// PLAN: "group": "cross"

// The pipeline takes the device profile's nodes (h100: 8 ranks) where
// ranks-per-node is not given: 16 ranks reduce in two levels.
// PROFILE: "node": 8,
// PROFILE: "group": "node"
// PROFILE: "group": "cross"

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
