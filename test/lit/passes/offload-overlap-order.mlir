// RUN: fsdp-opt %s -fsdp-offload | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload=prefetch=false | FileCheck %s --check-prefix=SYNC

// fsdp-offload's overlap moves each host update up to where its operands
// are ready, but never above a read of the storage it overwrites in
// place: here the gradient is final first, then a device op reads the
// unit's (old) shard; the update may only start once that read's copy to
// the device was issued (program order on the compute stream, which the
// host stream waits for), so it lands right after the copy, not right
// after the gradient (SYNC, prefetch=false). With prefetch the copy runs
// on the copy stream from the top of the step, and its wait moves up to
// right before the update, which may not write what the copy still reads.

// CHECK-LABEL: func.func @train_step
// CHECK-NEXT: %[[S:.+]] = fsdp.get_unit @a
// CHECK-NEXT: %[[D:.+]] = fsdp.to_device %[[S]] {async}
// CHECK-NEXT: %[[G:.+]] = fsdp.relu
// CHECK-NEXT: %[[GH:.+]] = fsdp.to_host %[[G]]
// CHECK-NOT: fsdp.add
// CHECK: %[[DW:.+]] = fsdp.wait %[[D]]
// CHECK-NEXT: %[[P:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update %{{.+}}, %[[GH]], {{.*}} {async, fsdp.on_host}
// CHECK-NEXT: fsdp.add %[[DW]]
// CHECK: fsdp.wait %[[P]]
// CHECK-NEXT: return

// SYNC-LABEL: func.func @train_step
// SYNC: %[[G:.+]] = fsdp.relu
// SYNC-NEXT: %[[GH:.+]] = fsdp.to_host %[[G]]
// SYNC-NEXT: %[[S:.+]] = fsdp.get_unit @a
// SYNC-NEXT: %[[D:.+]] = fsdp.to_device %[[S]] :
// SYNC-NOT: fsdp.add
// SYNC: %[[P:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update %{{.+}}, %[[GH]], {{.*}} {async, fsdp.on_host}
// SYNC-NEXT: fsdp.add %[[D]]
// SYNC: fsdp.wait %[[P]]
// SYNC-NEXT: return

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  func.func @train_step(%x: tensor<8xf32> {fsdp.role = "input"}, %lr: tensor<f32> {fsdp.role = "lr"}, %step: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %g = fsdp.relu %x : tensor<8xf32>
    %s1 = fsdp.get_unit @a : tensor<8xf32>
    %y = fsdp.add %s1, %x : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %s = fsdp.get_unit @a : tensor<8xf32>
    %m = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %v = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %p, %m2, %v2 = fsdp.adamw_update %s, %g, %m, %v, %lr, %step : tensor<8xf32>
    fsdp.set_state @a.exp_avg = %m2 : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %v2 : tensor<8xf32>
    fsdp.set_unit @a = %p : tensor<8xf32>
    return %y : tensor<8xf32>
  }
}
