// RUN: fsdp-opt %s -fsdp-offload | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload -fsdp-offload | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload=prefetch-depth=2 | FileCheck %s --check-prefix=TWO

// fsdp-offload's prefetch with one device op (%y) reading two offloaded
// units, each updated (async, overlap) before %y in program order: the
// copy of @a goes to the top of the step; @b's copy is issued right after
// @a's wait (one copy ahead, never above it); each copy is joined right
// before the update that overwrites its storage, not at %y, so no update
// writes what a copy still reads. Running the pass twice changes nothing.
// With two copies in flight both go to the top, @a's first (the copy
// stream runs in issue order), each still joined before its update.

// CHECK-LABEL: func.func @train_step
// CHECK-NEXT: %[[A:.+]] = fsdp.get_unit @a
// CHECK-NEXT: %[[AD:.+]] = fsdp.to_device %[[A]] {async}
// CHECK-NEXT: fsdp.relu
// CHECK: %[[AW:.+]] = fsdp.wait %[[AD]]
// CHECK-NEXT: %[[BD:.+]] = fsdp.to_device %{{.+}} {async}
// CHECK-NEXT: %[[P:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CHECK: %[[BW:.+]] = fsdp.wait %[[BD]]
// CHECK-NEXT: %[[Q:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CHECK-NEXT: fsdp.add %[[AW]], %[[BW]]
// CHECK-NOT: fsdp.to_device

// TWO-LABEL: func.func @train_step
// TWO-NEXT: fsdp.get_unit @a
// TWO-NEXT: %[[AD:.+]] = fsdp.to_device %{{.+}} {async}
// TWO-NEXT: fsdp.get_unit @b
// TWO-NEXT: %[[BD:.+]] = fsdp.to_device %{{.+}} {async}
// TWO-NEXT: fsdp.relu
// TWO: %[[AW:.+]] = fsdp.wait %[[AD]]
// TWO-NEXT: fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// TWO: %[[BW:.+]] = fsdp.wait %[[BD]]
// TWO-NEXT: fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// TWO-NEXT: fsdp.add %[[AW]], %[[BW]]

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%x: tensor<8xf32> {fsdp.role = "input"}, %lr: tensor<f32> {fsdp.role = "lr"}, %step: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %g = fsdp.relu %x : tensor<8xf32>
    %s1 = fsdp.get_unit @a : tensor<8xf32>
    %t1 = fsdp.get_unit @b : tensor<8xf32>
    %y = fsdp.add %s1, %t1 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %s = fsdp.get_unit @a : tensor<8xf32>
    %m = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %v = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %p, %m2, %v2 = fsdp.adamw_update %s, %g, %m, %v, %lr, %step : tensor<8xf32>
    %t = fsdp.get_unit @b : tensor<8xf32>
    %bm = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %bv = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %q, %bm2, %bv2 = fsdp.adamw_update %t, %g, %bm, %bv, %lr, %step : tensor<8xf32>
    fsdp.set_state @a.exp_avg = %m2 : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %v2 : tensor<8xf32>
    fsdp.set_unit @a = %p : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %bm2 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %bv2 : tensor<8xf32>
    fsdp.set_unit @b = %q : tensor<8xf32>
    return %y : tensor<8xf32>
  }
}
