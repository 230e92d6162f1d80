// RUN: fsdp-opt %s -fsdp-offload="next-step=true" | FileCheck %s

// fsdp-offload's next-step issues the updates it joins in the next step in
// the order that step needs them: here both wait for the clipping
// coefficient, and overlap alone would issue @b's first (each update moves
// up to right after the coefficient, the later one ahead), which would
// make the forward's first unit (@a) wait for both; @a's update goes first.

// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.wait %{{.+}} {carried, copy_stream}
// CHECK: fsdp.to_device
// CHECK: fsdp.wait %{{.+}} {carried, copy_stream}
// CHECK: fsdp.clip_coef
// CHECK: %[[A:.+]] = fsdp.get_unit @a
// CHECK: fsdp.adamw_update %[[A]], {{.*}} {async, fsdp.on_host}
// CHECK: %[[B:.+]] = fsdp.get_unit @b
// CHECK: fsdp.adamw_update %[[B]], {{.*}} {async, fsdp.on_host}
// CHECK-NOT: fsdp.wait
// CHECK: return

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%x: tensor<8xf32> {fsdp.role = "input"}, %lr: tensor<f32> {fsdp.role = "lr"}, %step: tensor<f32> {fsdp.role = "step"}) -> tensor<f32> attributes {fsdp.train_step} {
    %s1 = fsdp.get_unit @a : tensor<8xf32>
    %y = fsdp.add %s1, %x : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %t1 = fsdp.get_unit @b : tensor<8xf32>
    %y2 = fsdp.add %t1, %y : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %gb = fsdp.relu %y2 : tensor<8xf32>
    %ga = fsdp.relu %y : tensor<8xf32>
    %n = fsdp.squared_norm %ga, %gb : tensor<8xf32>, tensor<8xf32>
    %c = fsdp.clip_coef %n {max_norm = 1.0 : f64} : tensor<f32>
    %s = fsdp.get_unit @a : tensor<8xf32>
    %m = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %v = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %p, %m2, %v2 = fsdp.adamw_update %s, %ga, %m, %v, %lr, %step grad_scale %c : tensor<8xf32>
    %t = fsdp.get_unit @b : tensor<8xf32>
    %bm = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %bv = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %q, %bm2, %bv2 = fsdp.adamw_update %t, %gb, %bm, %bv, %lr, %step grad_scale %c : tensor<8xf32>
    fsdp.set_state @a.exp_avg = %m2 : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %v2 : tensor<8xf32>
    fsdp.set_unit @a = %p : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %bm2 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %bv2 : tensor<8xf32>
    fsdp.set_unit @b = %q : tensor<8xf32>
    return %n : tensor<f32>
  }
}
