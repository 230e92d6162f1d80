// RUN: fsdp-opt %s -fsdp-schedule | FileCheck %s

// Tests that prefetch never moves a unit's storage read (and its gather)
// above a write of that storage: here a second gather of @layers.0 follows
// the unit's update, and stays after it, while the gather of @layers.1
// (whose storage is not written in between) moves up past the compute.

fsdp.param @w1 : tensor<4x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @w2 : tensor<4x4xf32> init("normal", 0.02) unit "layers.1"
fsdp.unit @layers.0 : tensor<16xf32> shard tensor<8xf32> numel 16 params [@w1] sharded
fsdp.unit @layers.1 : tensor<16xf32> shard tensor<8xf32> numel 16 params [@w2] sharded

// CHECK-LABEL: func.func @train_step
// CHECK: %[[G0:.+]] = fsdp.all_gather
// CHECK: fsdp.wait %[[G0]]
// CHECK-NEXT: fsdp.get_unit @layers.1
// CHECK-NEXT: %[[G1:.+]] = fsdp.all_gather
// CHECK: fsdp.set_unit @layers.0
// CHECK-NEXT: fsdp.get_unit @layers.0
// CHECK-NEXT: fsdp.all_gather
func.func @train_step(%lr: tensor<f32> {fsdp.role = "lr"}) -> tensor<16xf32> attributes {fsdp.train_step} {
  %s0 = fsdp.get_unit @layers.0 : tensor<8xf32>
  %g0 = fsdp.all_gather %s0 : tensor<8xf32> -> tensor<16xf32>
  %x = fsdp.add %g0, %g0 : (tensor<16xf32>, tensor<16xf32>) -> tensor<16xf32>
  %s1 = fsdp.get_unit @layers.1 : tensor<8xf32>
  %g1 = fsdp.all_gather %s1 : tensor<8xf32> -> tensor<16xf32>
  %y = fsdp.add %x, %g1 : (tensor<16xf32>, tensor<16xf32>) -> tensor<16xf32>
  %u = fsdp.get_unit @layers.0 : tensor<8xf32>
  %n = fsdp.sgd_update %u, %u, %lr : tensor<8xf32>
  fsdp.set_unit @layers.0 = %n : tensor<8xf32>
  %s2 = fsdp.get_unit @layers.0 : tensor<8xf32>
  %g2 = fsdp.all_gather %s2 : tensor<8xf32> -> tensor<16xf32>
  %z = fsdp.add %y, %g2 : (tensor<16xf32>, tensor<16xf32>) -> tensor<16xf32>
  return %z : tensor<16xf32>
}
