// RUN: fsdp-opt %s -fsdp-offload="next-step=true" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload="next-step=true" -fsdp-offload="next-step=true" | FileCheck %s
// RUN: not fsdp-opt %s -fsdp-offload="next-step=true overlap=false" 2>&1 | FileCheck %s --check-prefix=NOOVERLAP

// fsdp-offload's next-step: an async host update whose results only the
// write-backs read is joined in the next step, by a carried wait on a read
// of its unit placed right before the first op of the step that reads
// what it writes or computes one of its operands (here the copy of @a to
// the device in the forward pass), and it keeps no wait in its own step.
// @b's update is read by a device op in its own step (%z): it keeps its
// wait there and is not carried. Running the pass twice (the memory-budget
// search and the pipeline do) changes nothing more.

// CHECK-LABEL: func.func @train_step
// CHECK-NEXT: %[[S:.+]] = fsdp.get_unit @a
// CHECK-NEXT: %[[R:.+]] = fsdp.get_unit @a
// CHECK-NEXT: fsdp.wait %[[R]] {carried, copy_stream}
// CHECK-NEXT: fsdp.to_device %[[S]] {async}
// CHECK-NOT: carried
// CHECK: %[[P:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CHECK-NOT: fsdp.wait %[[P]]
// CHECK: %[[Q:[a-z_0-9]+]], %{{.+}}, %{{.+}} = fsdp.adamw_update {{.*}} {async, fsdp.on_host}
// CHECK-NEXT: %[[QW:.+]] = fsdp.wait %[[Q]]
// CHECK-NEXT: fsdp.to_device %[[QW]]
// CHECK-NOT: fsdp.wait %[[P]]
// CHECK: fsdp.set_unit @a = %[[P]]
// CHECK: fsdp.set_unit @b = %[[QW]]
// CHECK-NOT: carried

// NOOVERLAP: fsdp-offload: next-step joins the async host updates in the next step: it needs overlap

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
    %s1 = fsdp.get_unit @a : tensor<8xf32>
    %y = fsdp.add %s1, %x : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %t1 = fsdp.get_unit @b : tensor<8xf32>
    %y2 = fsdp.add %t1, %y : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %g = fsdp.relu %y2 : tensor<8xf32>
    %g2 = fsdp.relu %y : tensor<8xf32>
    %s = fsdp.get_unit @a : tensor<8xf32>
    %m = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %v = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %p, %m2, %v2 = fsdp.adamw_update %s, %g, %m, %v, %lr, %step : tensor<8xf32>
    %t = fsdp.get_unit @b : tensor<8xf32>
    %bm = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %bv = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %q, %bm2, %bv2 = fsdp.adamw_update %t, %g2, %bm, %bv, %lr, %step : tensor<8xf32>
    %z = fsdp.add %q, %x : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    fsdp.set_state @a.exp_avg = %m2 : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %v2 : tensor<8xf32>
    fsdp.set_unit @a = %p : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %bm2 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %bv2 : tensor<8xf32>
    fsdp.set_unit @b = %q : tensor<8xf32>
    return %z : tensor<8xf32>
  }
}
