// RUN: fsdp-opt %s -fsdp-offload=offload=all | FileCheck %s --check-prefix=ONE
// RUN: fsdp-opt %s -fsdp-offload="offload=all prefetch-depth=2" | FileCheck %s --check-prefix=TWO
// RUN: fsdp-opt %s -fsdp-offload="offload=all prefetch-depth=2" -fsdp-offload="offload=all prefetch-depth=2" | FileCheck %s --check-prefix=TWO
// RUN: fsdp-opt %s -fsdp-offload="offload=all prefetch-depth=8" | FileCheck %s --check-prefix=ALL
// RUN: not fsdp-opt %s -fsdp-offload="offload=all prefetch-depth=0" 2>&1 | FileCheck %s --check-prefix=ZERO
// RUN: not fsdp-opt %s -fsdp-offload="offload=all prefetch-depth=9" 2>&1 | FileCheck %s --check-prefix=NINE
// RUN: fsdp-opt %s -fsdp-offload="offload=all prefetch=false prefetch-depth=0" | FileCheck %s --check-prefix=OFF

// fsdp-offload's prefetch-depth: four frozen units, each read by one
// device op in turn (%y1..%y4). Each copy to the device is issued where
// the copy `prefetch-depth` before it is joined (right before its reader),
// the first ones at the top of the step, in the order they are read (the
// copy stream runs in issue order). At 1 (the default) @b's copy comes
// after @a's wait; at 2 @a's and @b's are both at the top and @c's after
// @a's wait, @d's after @b's; at 8 (more than there are) all four at the
// top. A second run changes nothing. 0 and 9 are refused by name; without
// prefetch the depth is not read.

// ONE-LABEL: func.func @train_step
// ONE-NEXT: fsdp.get_unit @a
// ONE-NEXT: %[[AD:.+]] = fsdp.to_device {{.*}} {async}
// ONE-NEXT: %[[AW:.+]] = fsdp.wait %[[AD]]
// ONE-NEXT: fsdp.get_unit @b
// ONE-NEXT: %[[BD:.+]] = fsdp.to_device {{.*}} {async}
// ONE-NEXT: fsdp.add %{{.+}}, %[[AW]]
// ONE-NEXT: %[[BW:.+]] = fsdp.wait %[[BD]]
// ONE-NEXT: fsdp.get_unit @c
// ONE-NEXT: %[[CD:.+]] = fsdp.to_device {{.*}} {async}
// ONE-NEXT: fsdp.add %{{.+}}, %[[BW]]
// ONE-NEXT: %[[CW:.+]] = fsdp.wait %[[CD]]
// ONE-NEXT: fsdp.get_unit @d
// ONE-NEXT: %[[DD:.+]] = fsdp.to_device {{.*}} {async}
// ONE-NEXT: fsdp.add %{{.+}}, %[[CW]]
// ONE-NEXT: %[[DW:.+]] = fsdp.wait %[[DD]]
// ONE-NEXT: fsdp.add %{{.+}}, %[[DW]]

// TWO-LABEL: func.func @train_step
// TWO-NEXT: fsdp.get_unit @a
// TWO-NEXT: %[[AD:.+]] = fsdp.to_device {{.*}} {async}
// TWO-NEXT: fsdp.get_unit @b
// TWO-NEXT: %[[BD:.+]] = fsdp.to_device {{.*}} {async}
// TWO-NEXT: %[[AW:.+]] = fsdp.wait %[[AD]]
// TWO-NEXT: fsdp.get_unit @c
// TWO-NEXT: %[[CD:.+]] = fsdp.to_device {{.*}} {async}
// TWO-NEXT: fsdp.add %{{.+}}, %[[AW]]
// TWO-NEXT: %[[BW:.+]] = fsdp.wait %[[BD]]
// TWO-NEXT: fsdp.get_unit @d
// TWO-NEXT: %[[DD:.+]] = fsdp.to_device {{.*}} {async}
// TWO-NEXT: fsdp.add %{{.+}}, %[[BW]]
// TWO-NEXT: %[[CW:.+]] = fsdp.wait %[[CD]]
// TWO-NEXT: fsdp.add %{{.+}}, %[[CW]]
// TWO-NEXT: %[[DW:.+]] = fsdp.wait %[[DD]]
// TWO-NEXT: fsdp.add %{{.+}}, %[[DW]]
// TWO-NOT: fsdp.to_device

// ALL-LABEL: func.func @train_step
// ALL-NEXT: fsdp.get_unit @a
// ALL-NEXT: fsdp.to_device {{.*}} {async}
// ALL-NEXT: fsdp.get_unit @b
// ALL-NEXT: fsdp.to_device {{.*}} {async}
// ALL-NEXT: fsdp.get_unit @c
// ALL-NEXT: fsdp.to_device {{.*}} {async}
// ALL-NEXT: fsdp.get_unit @d
// ALL-NEXT: fsdp.to_device {{.*}} {async}
// ALL-NEXT: fsdp.wait

// ZERO: fsdp-offload: prefetch-depth=0 must be 1 to 8 (the copies to the device in flight at once)
// NINE: fsdp-offload: prefetch-depth=9 must be 1 to 8

// OFF-LABEL: func.func @train_step
// OFF-NOT: async
// OFF: fsdp.get_unit @d
// OFF-NEXT: fsdp.to_device
// OFF-NEXT: fsdp.add

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @wa : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @wb : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.param @wc : tensor<8xf32> init("normal", 5.000000e-01) unit "c"
  fsdp.param @wd : tensor<8xf32> init("normal", 5.000000e-01) unit "d"
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "t"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@wa] sharded frozen
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@wb] sharded frozen
  fsdp.unit @c : tensor<8xf32> shard tensor<8xf32> numel 8 params [@wc] sharded frozen
  fsdp.unit @d : tensor<8xf32> shard tensor<8xf32> numel 8 params [@wd] sharded frozen
  fsdp.unit @t : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded
  func.func @train_step(%x: tensor<8xf32> {fsdp.role = "input"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %a = fsdp.get_unit @a : tensor<8xf32>
    %y1 = fsdp.add %x, %a : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %b = fsdp.get_unit @b : tensor<8xf32>
    %y2 = fsdp.add %y1, %b : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %c = fsdp.get_unit @c : tensor<8xf32>
    %y3 = fsdp.add %y2, %c : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %d = fsdp.get_unit @d : tensor<8xf32>
    %y4 = fsdp.add %y3, %d : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %y4 : tensor<8xf32>
  }
}
