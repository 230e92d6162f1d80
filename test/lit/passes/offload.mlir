// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload | FileCheck %s --check-prefixes=CHECK,OVER
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload -fsdp-offload | FileCheck %s --check-prefixes=CHECK,OVER
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload=overlap=false | FileCheck %s --check-prefixes=CHECK,SERIAL
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload="overlap=false prefetch=false" | FileCheck %s --check-prefix=NOPF
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer offload-prefetch=false plan=%t.plan" -o /dev/null 2>/dev/null
// RUN: python3 -c "import json, sys; p = json.load(open(sys.argv[1]))['program']; print(' '.join(i['op'] + ('@' + str(i['out'][0]) if i['op'] in ('wait', 'adamw_update') else '') + ('(async)' if i.get('attrs', {}).get('async') and i['op'] == 'adamw_update' else '') for i in p if i['op'] in ('adamw_update', 'wait', 'to_host')))" %t.plan | FileCheck %s --check-prefix=PLAN
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=2 stage=3" -fsdp-offload | FileCheck %s --check-prefix=CLIP
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2 offload=optimizer" -fsdp-offload | FileCheck %s --check-prefix=Z2
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-schedule -fsdp-offload -fsdp-offload | FileCheck %s --check-prefix=SCHED
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload -fsdp-plan-memory="report=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" -fsdp-offload=offload=all | FileCheck %s --check-prefix=ALL
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2 offload=all" -fsdp-offload=offload=all | FileCheck %s --check-prefix=ALLZ2
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=2" -fsdp-offload 2>&1 | FileCheck %s --check-prefix=WHOLE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3" -fsdp-offload=offload=cpu 2>&1 | FileCheck %s --check-prefix=MODE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-shard="world-size=2 stage=3 offload=gpu" 2>&1 | FileCheck %s --check-prefix=SHARDMODE

// Optimizer offload: the trainable units a and root keep their master
// shard and AdamW moments in host memory; b is frozen and stays on the
// device (no update, no state). Every device read of an offloaded
// shard (each all-gather, forward and backward) gets its own to_device
// copy right before it (tests/e2e/offload.py's GPT has backward ones).
// The update runs on the host (fsdp.on_host) on a to_host copy of its
// gradient shard, made as soon as the shard is final, and on copies of
// the learning rate and step made once before the first update. Running
// the pass twice changes nothing (the memory-budget search runs it on its
// candidates).

// offload=all: the frozen b's storage moves too (no update, no state):
// its shard at stage 3, copied to the device before each of its
// all-gathers; at stage 2 the whole unit, each parameter copied to the
// device before each device op reading it.
// ALL: fsdp.unit @b.frozen : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wb] sharded frozen offloaded
// ALL-LABEL: func.func @train_step
// ALL: %[[B:.+]] = fsdp.get_unit @b.frozen
// ALL-NEXT: %[[BD:.+]] = fsdp.to_device %[[B]] {async} : tensor<8xf32>
// ALL: %[[BW:.+]] = fsdp.wait %[[BD]]
// ALL: fsdp.all_gather %[[BW]]
// ALL: %[[B2:.+]] = fsdp.get_unit @b.frozen
// ALL-NEXT: %[[BD2:.+]] = fsdp.to_device %[[B2]] {async} : tensor<8xf32>
// ALL: %[[BW2:.+]] = fsdp.wait %[[BD2]]
// ALL-NEXT: fsdp.all_gather %[[BW2]]
// ALL-NOT: set_unit @b.frozen
// ALLZ2: fsdp.unit @b.frozen : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wb] frozen offloaded
// ALLZ2-LABEL: func.func @train_step
// ALLZ2: fsdp.get_unit @b.frozen : tensor<16xf32>
// ALLZ2: fsdp.to_device %{{.+}} {async} : tensor<4x4xf32>
// ALLZ2: fsdp.to_device %{{.+}} {async} : tensor<4x4xf32>

fsdp.param @wa : tensor<4x4xf32> init("normal", 0.5) unit "a"
fsdp.param @wb : tensor<4x4xf32> init("normal", 0.5) unit "b" frozen
fsdp.param @wr : tensor<1x4xf32> init("normal", 0.5)

// CHECK: fsdp.unit @a : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wa] sharded offloaded
// CHECK: fsdp.unit @b.frozen : tensor<16xf32> shard tensor<8xf32> numel 16 params [@wb] sharded frozen{{$}}
// CHECK: fsdp.unit @root : {{.*}} sharded offloaded
// CHECK-LABEL: func.func @train_step
// Each copy to the device runs on the copy stream (prefetch): issued right
// after the previous copy's wait (the first at the top), waited for right
// before its reader.
// CHECK: %[[A:.+]] = fsdp.get_unit @a
// CHECK-NEXT: %[[AD:.+]] = fsdp.to_device %[[A]] {async} : tensor<8xf32>
// CHECK-NEXT: %[[AW:.+]] = fsdp.wait %[[AD]]
// CHECK-NEXT: %[[R:.+]] = fsdp.get_unit @root
// CHECK-NEXT: %[[RD:.+]] = fsdp.to_device %[[R]] {async}
// CHECK-NEXT: fsdp.all_gather %[[AW]]
// CHECK: %[[B:.+]] = fsdp.get_unit @b.frozen
// CHECK-NEXT: fsdp.all_gather %[[B]]
// CHECK: %[[RW:.+]] = fsdp.wait %[[RD]]
// CHECK-NEXT: fsdp.all_gather %[[RW]]
// NOPF: %[[A:.+]] = fsdp.get_unit @a
// NOPF-NEXT: %[[AD:.+]] = fsdp.to_device %[[A]] : tensor<8xf32>
// NOPF-NEXT: fsdp.all_gather %[[AD]]
// NOPF: %[[R:.+]] = fsdp.get_unit @root
// NOPF-NEXT: %[[RD:.+]] = fsdp.to_device %[[R]] :
// NOPF-NEXT: fsdp.all_gather %[[RD]]
// NOPF-NOT: async}
// CHECK: fsdp.mse_loss
// The backward: root (the last unit) kept its gather, a's gradient needs
// no parameter, the frozen b is gathered again, without a copy.
// CHECK-NOT: fsdp.to_device
// CHECK: %[[GR:.+]] = fsdp.reduce_scatter {{.*}} -> tensor<2xf32>
// The gradient leaves the device as soon as it is final.
// SERIAL-NEXT: %[[GRH:.+]] = fsdp.to_host %[[GR]] : tensor<2xf32>
// SERIAL: %[[B2:.+]] = fsdp.get_unit @b.frozen
// SERIAL-NEXT: fsdp.all_gather %[[B2]]
// SERIAL: %[[GA:.+]] = fsdp.reduce_scatter {{.*}} -> tensor<8xf32>
// SERIAL-NEXT: %[[GAH:.+]] = fsdp.to_host %[[GA]] : tensor<8xf32>
// SERIAL: %[[LR:.+]] = fsdp.to_host %arg2 : tensor<f32>
// SERIAL-NEXT: %[[ST:.+]] = fsdp.to_host %arg3 : tensor<f32>
// SERIAL-NEXT: fsdp.adamw_update %{{.+}}, %[[GAH]], %{{.+}}, %{{.+}}, %[[LR]], %[[ST]] {fsdp.on_host}
// SERIAL-NOT: fsdp.to_host
// SERIAL: fsdp.adamw_update %{{.+}}, %[[GRH]], %{{.+}}, %{{.+}}, %[[LR]], %[[ST]] {fsdp.on_host}
// SERIAL-NOT: fsdp.to_
// SERIAL-NOT: fsdp.wait
// SERIAL: return
// With overlap (the default) root's update runs beside a's backward: it
// is issued async right after its gradient's copy, with the storage reads
// and the copies of lr and step it takes along, and is joined right
// before a's update is issued; a's is joined before the step returns.
// OVER-NEXT: %[[R2:.+]] = fsdp.get_unit @root
// OVER-NEXT: %[[GRH:.+]] = fsdp.to_host %[[GR]] : tensor<2xf32>
// OVER: %[[LR:.+]] = fsdp.to_host %arg2 : tensor<f32>
// OVER-NEXT: %[[ST:.+]] = fsdp.to_host %arg3 : tensor<f32>
// OVER-NEXT: %[[RP:.+]], %{{.+}}, %{{.+}} = fsdp.adamw_update %[[R2]], %[[GRH]], %{{.+}}, %{{.+}}, %[[LR]], %[[ST]] {async, fsdp.on_host}
// OVER-NEXT: fsdp.relu_grad
// OVER: %[[B2:.+]] = fsdp.get_unit @b.frozen
// OVER-NEXT: fsdp.all_gather %[[B2]]
// OVER: %[[GA:.+]] = fsdp.reduce_scatter {{.*}} -> tensor<8xf32>
// OVER: %[[GAH:.+]] = fsdp.to_host %[[GA]] : tensor<8xf32>
// OVER: %[[RW:.+]] = fsdp.wait %[[RP]] : tensor<2xf32>
// OVER-NEXT: %[[AP:.+]], %{{.+}}, %{{.+}} = fsdp.adamw_update %{{.+}}, %[[GAH]], %{{.+}}, %{{.+}}, %[[LR]], %[[ST]] {async, fsdp.on_host}
// OVER-NOT: fsdp.to_
// OVER: fsdp.set_unit @root = %[[RW]]
// OVER: fsdp.wait %[[AP]] : tensor<8xf32>
// OVER-NEXT: return

// The plan: the updates are async host instructions, each joined by a
// wait on its parameter buffer (the runtime's host stream).
// PLAN: to_host to_host to_host adamw_update@[[R:[0-9]+]](async) wait@{{[0-9]+}} to_host wait@[[R]] adamw_update@[[A:[0-9]+]](async) wait@{{[0-9]+}} wait@[[A]]{{$}}

// With clipping, every update reads the coefficient, known only after
// the last gradient: they stay after it, async and joined one by one.
// CLIP: fsdp.reduce_scatter {{.*}} -> tensor<8xf32>
// CLIP: %[[C:.+]] = fsdp.clip_coef
// CLIP: fsdp.mul %{{.+}}, %[[C]]
// CLIP: %[[U1:.+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CLIP-NEXT: fsdp.mul %{{.+}}, %[[C]]
// CLIP: %[[W1:.+]] = fsdp.wait %[[U1]]
// CLIP-NEXT: %[[U2:.+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CLIP: fsdp.wait %[[U2]]
// CLIP-NEXT: return

// With fsdp-schedule the reduce-scatters are async and waited for at
// their first read, the update: fsdp-offload waits for root's right before
// the next reduce-scatter is issued (a's), copies it there and issues
// root's update, which then runs beside a's reduce-scatter.
// SCHED-LABEL: func.func @train_step
// SCHED: %[[RS1:.+]] = fsdp.reduce_scatter {{.*}}async{{.*}} -> tensor<2xf32>
// SCHED: %[[W1:.+]] = fsdp.wait %[[RS1]]
// SCHED-NEXT: fsdp.get_unit @root
// SCHED-NEXT: fsdp.to_host %[[W1]] : tensor<2xf32>
// SCHED: fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// SCHED-NEXT: %[[RS2:.+]] = fsdp.reduce_scatter {{.*}}async{{.*}} -> tensor<8xf32>
// SCHED: %[[W2:.+]] = fsdp.wait %[[RS2]]
// SCHED-NEXT: fsdp.to_host %[[W2]] : tensor<8xf32>

// Stage 2 with offload=optimizer: every trainable unit takes the sharded
// layout (its master shard, gathered once per step, here in f32), so the
// shard can move to the host; the frozen unit stays whole.
// Z2: fsdp.unit @a : {{.*}} sharded offloaded
// Z2: fsdp.unit @b.frozen : {{.*}} frozen{{$}}
// Z2-LABEL: func.func @train_step
// Z2: fsdp.to_device
// Z2: fsdp.sgd_update {{.*}} {async, fsdp.on_host}

// The device keeps only the frozen b's shard.
// REPORT: parameters 32 32 B
// REPORT: optimizer state 0 0 B
// REPORT: host (offloaded):
// REPORT-NEXT: parameters 40 40 B
// REPORT-NEXT: optimizer state 80 80 B

// WHOLE: fsdp-offload: offload=optimizer needs trainable units with sharded storage (3 unit(s), none sharded and trainable): use stage=3, or stage 1/2 on more than one shard with fsdp-shard's offload=optimizer
// MODE: fsdp-offload: offload='cpu' must be none, optimizer or all
// SHARDMODE: fsdp-shard: offload='gpu' must be none, optimizer or all

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
