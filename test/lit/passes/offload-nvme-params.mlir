// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="nvme=true nvme-params=true" | FileCheck %s
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-params=true plan=%t.plan" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT
// RUN: %python %s.py %t.plan | FileCheck %s --check-prefix=PLAN
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=1 stage=3 offload=all offload-nvme=true offload-nvme-params=true offload-nvme-read-ahead=0 plan=%t.one.plan report=false" -o /dev/null
// RUN: %python %s.py %t.one.plan | FileCheck %s --check-prefix=ONE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="nvme-params=true" 2>&1 | FileCheck %s --check-prefix=NONVME
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload-nvme-params=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=NONVME
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 memory-budget=1GiB offload=optimizer offload-nvme-params=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=SEARCH

// ZeRO-Infinity's offload_param (fsdp-offload's nvme-params): the master
// shards of the units whose optimizer state is on disk go to the swap file
// too (fsdp.nvme on the unit); the frozen unit b, whose storage
// offload=optimizer leaves on the device, stays there.
// CHECK: fsdp.unit @a : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wa] sharded offloaded {fsdp.nvme}
// CHECK-NEXT: fsdp.unit @b.frozen : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wb] sharded frozen{{$}}
// CHECK-NEXT: fsdp.unit @root : tensor<4xf32> shard tensor<2xf32> numel 4 params [@wr] sharded offloaded {fsdp.nvme}
// CHECK: fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg" {fsdp.nvme}

// The host arena keeps no parameter: the staging live at once holds the
// two updates in flight (each its shard and two moments: 3 x 32 B for a,
// 3 x 8 B for root).
// REPORT: host (offloaded):
// REPORT-NEXT: parameters 0 0 B
// REPORT-NEXT: optimizer state 0 0 B
// REPORT-NEXT: staging (state, params) 120 120 B
// REPORT-NEXT: state in swap file 80 80 B
// REPORT-NEXT: params in swap file 40 40 B
// REPORT-NEXT: swap file (nvme) 24576 24.00 KiB

// In the plan each shard is in space "nvme" on a block of its own; no
// instruction names it. At 2 ranks each copy to the device is of the whole
// shard (a staging of its bytes, then all-gathered), read ahead of the one
// before it (the first at it); each update reads and writes the shard with
// its state, and its join names the staging as the update's first output.
// PLAN: unit a: nvme at 0 (on a block), 32 B
// PLAN-NEXT: unit b.frozen: device
// PLAN-NEXT: unit root: nvme at 4096 (on a block), 8 B
// PLAN-NEXT: memory.nvme.params 40 state 80 file 24576 memory.host.params 0
// PLAN-NEXT: no instruction names a swap-file buffer
// PLAN-NEXT: #0 to_device of a: blocks [0, 32) into a staging of 32 B, copies 32 B from its byte 0, read at it
// PLAN-NEXT: #2 to_device of root: blocks [0, 8) into a staging of 8 B, copies 8 B from its byte 0, read after #0
// PLAN-NEXT: #{{[0-9]+}} adamw_update: swaps 3, the unit root read and written, its staging first in out, joined at #{{[0-9]+}}
// PLAN-NEXT: #{{[0-9]+}} adamw_update: swaps 3, the unit a read and written, its staging first in out, joined at #{{[0-9]+}}

// At 1 rank with offload=all the frozen unit's storage is on disk too, and
// each copy is of a view of a unit (a weight): it reads the whole block
// its bytes span into a staging of that block and copies from a view of
// it; without a read ahead each read is issued at its copy.
// ONE: unit a: nvme at 0 (on a block), 64 B
// ONE-NEXT: unit b.frozen: nvme at 4096 (on a block), 64 B
// ONE-NEXT: unit root: nvme at 8192 (on a block), 16 B
// ONE-NEXT: memory.nvme.params 144 state 160 file 28672 memory.host.params 0
// ONE-NEXT: no instruction names a swap-file buffer
// ONE-NEXT: #0 to_device of a: blocks [0, 4096) into a staging of 4096 B, copies 64 B from its byte 0, read at it
// ONE-NEXT: #2 to_device of b.frozen: blocks [0, 4096) into a staging of 4096 B, copies 64 B from its byte 0, read at it
// ONE: adamw_update: swaps 3, the unit root read and written
// ONE-NEXT: adamw_update: swaps 3, the unit a read and written

// Without the state on disk the option is an error, not ignored.
// NONVME: error: fsdp-offload: nvme-params puts the master shards in the swap file with the optimizer state: it needs nvme (offload-nvme=true)
// SEARCH: error: offload-nvme-params puts the master shards on disk with the optimizer state: it needs offload-nvme=true or auto

fsdp.param @wa : tensor<4x4xf32> init("normal", 0.5) unit "a"
fsdp.param @wb : tensor<4x4xf32> init("normal", 0.5) unit "b" frozen
fsdp.param @wr : tensor<1x4xf32> init("normal", 0.5)

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %wa = fsdp.get_param @wa : tensor<4x4xf32>
  %a = fsdp.matmul %x, %wa transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %ra = fsdp.relu %a : tensor<2x4xf32>
  %wb = fsdp.get_param @wb : tensor<4x4xf32>
  %b = fsdp.matmul %ra, %wb transpose_rhs : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %rb = fsdp.relu %b : tensor<2x4xf32>
  %wr = fsdp.get_param @wr : tensor<1x4xf32>
  %o = fsdp.matmul %rb, %wr transpose_rhs : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x1xf32>
  %l = fsdp.mse_loss %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
