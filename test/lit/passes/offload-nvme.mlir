// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload=nvme=true | FileCheck %s
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true plan=%t.plan" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT
// RUN: %python %s.py %t.plan | FileCheck %s --check-prefixes=PLAN,AHEAD1
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-overlap=false plan=%t.serial.plan report=false" -o /dev/null
// RUN: %python %s.py %t.serial.plan | FileCheck %s --check-prefixes=PLAN,AHEAD0
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-read-ahead=0 plan=%t.ra0.plan report=false" -o /dev/null
// RUN: %python %s.py %t.ra0.plan | FileCheck %s --check-prefixes=PLAN,AHEAD0
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-read-ahead=2 plan=%t.ra2.plan report=false" -o /dev/null
// RUN: %python %s.py %t.ra2.plan | FileCheck %s --check-prefixes=PLAN,AHEAD2
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-read-ahead=9" -o /dev/null 2>&1 | FileCheck %s --check-prefix=AHEAD9
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-in-flight=1 offload-nvme-read-ahead=0" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT10
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="nvme=true nvme-in-flight=1" | FileCheck %s --check-prefix=ONE
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-in-flight=1" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT1
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-nvme-in-flight=0" -o /dev/null 2>&1 | FileCheck %s --check-prefix=ZERO
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=sgd momentum=0.9 world-size=2 stage=2 offload=optimizer offload-nvme=true plan=%t.sgd.plan report=false" -o /dev/null
// RUN: %python %s.py %t.sgd.plan | FileCheck %s --check-prefix=SGD
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme=true offload-next-step=true report=false" -o /dev/null 2>&1 | FileCheck %s --check-prefix=NEXT
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload-nvme=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=NONE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="nvme=true nvme-units=1" | FileCheck %s --check-prefix=UNITS
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="nvme=true nvme-units=3" 2>&1 | FileCheck %s --check-prefix=UNITS3

// nvme-units=1: only the state of the unit updated first (root: its
// gradient is final first in the backward pass) goes to the swap file.
// UNITS: fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"{{$}}
// UNITS-NEXT: fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"{{$}}
// UNITS-NEXT: fsdp.state @root.exp_avg : tensor<2xf32> of @root kind "exp_avg" {fsdp.nvme}
// UNITS-NEXT: fsdp.state @root.exp_avg_sq : tensor<2xf32> of @root kind "exp_avg_sq" {fsdp.nvme}
// UNITS3: error: fsdp-offload: nvme-units=3 must be 1 to 2 (the offloaded trainable units whose state goes to the swap file), or -1 for all
// Without the state on disk the option is an error, not ignored.
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-nvme-units=1" -o /dev/null 2>&1 | FileCheck %s --check-prefix=UNITSOFF
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload-nvme-units=1" -o /dev/null 2>&1 | FileCheck %s --check-prefix=UNITSOFF
// UNITSOFF: error: fsdp-offload: nvme-units=1 keeps part of the optimizer state on disk: it needs nvme (offload-nvme=true)
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 memory-budget=1GiB offload=optimizer offload-nvme-units=1" -o /dev/null 2>&1 | FileCheck %s --check-prefix=UNITSSEARCH
// UNITSSEARCH: error: offload-nvme-units=1 keeps part of the optimizer state on disk: it needs offload-nvme=true or auto

// ZeRO-Infinity's optimizer offload to NVMe (fsdp-offload's nvme): the
// offloaded units' AdamW moments are marked fsdp.nvme, the frozen unit b
// has no state and the master shards stay in the host arena. In the plan
// every state buffer is in space "nvme" with its own bytes of the swap
// file, and each host update reads a staging buffer in the host arena
// instead, listed in its "swap" attribute with the file buffer and
// write-back flag; the host arena's state is the staging live at once.
// With the state on disk two updates are in flight ([Note: swap pipeline]:
// root's is joined after a's is issued, so a's state is read while root's
// update runs), so here that is all 80 B of it (a's two AdamW moments,
// 2 x 32 B, and root's, 2 x 8 B); each buffer in the file and each staging
// buffer has whole 4096-byte blocks of its own (swap_alignment: the
// runtime's O_DIRECT transfers move them whole).
// (A larger model keeps two units' staging of many: e2e/offload-nvme.test.)

// CHECK: fsdp.unit @a : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wa] sharded offloaded
// CHECK-DAG: fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg" {fsdp.nvme}
// CHECK-DAG: fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq" {fsdp.nvme}
// CHECK-DAG: fsdp.state @root.exp_avg : {{.*}} {fsdp.nvme}
// CHECK-LABEL: func.func @train_step
// CHECK: %[[R:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, {{.*}}fsdp.on_host}
// CHECK-NOT: fsdp.wait %[[R]]
// CHECK: %[[A:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, {{.*}}fsdp.on_host}
// CHECK: fsdp.wait %[[R]]
// CHECK-NEXT: fsdp.wait %[[A]]

// With nvme-in-flight=1 root's update is joined before a's is issued,
// but a's state is read ahead from where root's update is issued (the
// default nvme-read-ahead=1), so both units' staging is still live at
// once (80 B); without the read ahead the staging live at once is a's two
// moments only (2 x 32 B).
// ONE: %[[R:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, {{.*}}fsdp.on_host}
// ONE: fsdp.wait %[[R]]
// ONE: fsdp.adamw_update {{.*}} {async, {{.*}}fsdp.on_host}
// REPORT1: state staging 80 80 B
// REPORT10: state staging 64 64 B
// ZERO: error: fsdp-offload: nvme-in-flight=0 must be 1 to 8

// REPORT: host (offloaded):
// REPORT-NEXT: parameters 40 40 B
// REPORT-NEXT: optimizer state 0 0 B
// REPORT-NEXT: state staging 80 80 B
// REPORT-NEXT: state in swap file 80 80 B
// REPORT-NEXT: swap file (nvme) 16384 16.00 KiB

// PLAN: nvme_bytes 16384 swap_alignment 4096
// PLAN-NEXT: state buffers in nvme: 4 of 4, on whole blocks, disjoint, inside the file
// PLAN-NEXT: adamw_update swaps 2: file in nvme, staging host transient same bytes on whole blocks of the host arena, read and written, in the instruction's in and out
// PLAN-NEXT: adamw_update swaps 2: file in nvme, staging host transient same bytes on whole blocks of the host arena, read and written, in the instruction's in and out
// PLAN-NEXT: no instruction names a swap-file buffer
// PLAN-NEXT: memory.nvme.state 80 file 16384 memory.host.state 0

// nvme-read-ahead (default 1): root's state (updated first) is read from
// the step's start, beside the forward pass, a's from where root's update
// is issued, each staging buffer live from its read; with 2 both from the
// step's start; with 0, and for updates joined at once (offload-overlap=
// false), each when compute reaches it.
// AHEAD1: reads: start, update 0; each staging live from its read
// AHEAD2: reads: start, start; each staging live from its read
// AHEAD0: reads: own, own; each staging live from its read
// AHEAD9: error: fsdp-offload: nvme-read-ahead=9 must be 0 to 8

// SGD: nvme_bytes 8192 swap_alignment 4096
// SGD-NEXT: state buffers in nvme: 2 of 2, on whole blocks, disjoint, inside the file
// SGD-NEXT: sgd_momentum_update swaps 1: file in nvme, staging host transient same bytes on whole blocks of the host arena, read and written, in the instruction's in and out

// NEXT: warning: fsdp-offload: with next-step every update's staging copy of its state is live through the whole step, so nvme saves no host memory here

// NONE: error: fsdp-offload: nvme keeps the offloaded optimizer state in a swap file: it needs offload=optimizer or all

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
