// RUN: fsdp-opt %s -fsdp-offload="next-step=true" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload="next-step=true" -fsdp-offload="next-step=true" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-offload="next-step=true prefetch=false" | FileCheck %s --check-prefix=NOPF

// fsdp-offload's next-step with prefetch: a carried wait right before the
// prefetched copy of its unit joins the copy stream instead of compute
// ({carried, copy_stream}) and goes up with the copy: @a's, at the top.
// @b's gradient comes from the input alone, so its copy to the host (a
// compute write of a buffer the previous step's update of @b still reads)
// comes before @b's copy is waited for: @b's carried wait stays on
// compute, and its copy is issued after it. Without prefetch no carried
// wait joins the copy stream.

// CHECK-LABEL: func.func @train_step
// CHECK-NEXT: %[[S:.+]] = fsdp.get_unit @a
// CHECK-NEXT: %[[R:.+]] = fsdp.get_unit @a
// CHECK-NEXT: fsdp.wait %[[R]] {carried, copy_stream}
// CHECK-NEXT: %[[C:.+]] = fsdp.to_device %[[S]] {async}
// CHECK-NEXT: fsdp.wait %[[C]] :
// CHECK: %[[RB:.+]] = fsdp.get_unit @b
// CHECK-NEXT: fsdp.wait %[[RB]] {carried} :
// CHECK: fsdp.to_device %{{.+}} {async}
// CHECK-NEXT: fsdp.to_host
// CHECK-NOT: copy_stream
// CHECK: return

// NOPF-LABEL: func.func @train_step
// NOPF-NOT: copy_stream
// NOPF: fsdp.wait %{{.+}} {carried} :
// NOPF-NEXT: fsdp.to_device %{{.+}} :
// NOPF-NOT: copy_stream
// NOPF: return

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
    %gb = fsdp.relu %x : tensor<8xf32>
    %t1 = fsdp.get_unit @b : tensor<8xf32>
    %y2 = fsdp.add %t1, %y : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %ga = fsdp.relu %y2 : tensor<8xf32>
    %s = fsdp.get_unit @a : tensor<8xf32>
    %m = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %v = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %p, %m2, %v2 = fsdp.adamw_update %s, %ga, %m, %v, %lr, %step : tensor<8xf32>
    %t = fsdp.get_unit @b : tensor<8xf32>
    %bm = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %bv = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %q, %bm2, %bv2 = fsdp.adamw_update %t, %gb, %bm, %bv, %lr, %step : tensor<8xf32>
    fsdp.set_state @a.exp_avg = %m2 : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %v2 : tensor<8xf32>
    fsdp.set_unit @a = %p : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %bm2 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %bv2 : tensor<8xf32>
    fsdp.set_unit @b = %q : tensor<8xf32>
    return %y2 : tensor<8xf32>
  }
}
