// RUN: fsdp-opt %s -fsdp-group-units=policy=layer | FileCheck %s --check-prefix=LAYER
// RUN: fsdp-opt %s -fsdp-group-units="policy=size min-unit-numel=100" | FileCheck %s --check-prefix=SIZE
// RUN: fsdp-opt %s -fsdp-group-units=policy=none | FileCheck %s --check-prefix=NONE
// RUN: not fsdp-opt %s -fsdp-group-units=policy=magic 2>&1 | FileCheck %s --check-prefix=BAD

// Tests the auto-wrap policies.

// LAYER: fsdp.param @a : tensor<8x8xf32> init("normal", {{.+}}) unit "layers.0"
// LAYER: fsdp.param @b : tensor<8x8xf32> init("normal", {{.+}}) unit "layers.1"
// LAYER: fsdp.param @c : tensor<8x8xf32> init("normal", {{.+}}){{$}}

// 64 elements per parameter: a unit closes once it holds >= 100.
// SIZE: fsdp.param @a {{.*}} unit "group.0"
// SIZE: fsdp.param @b {{.*}} unit "group.0"
// SIZE: fsdp.param @c {{.*}} unit "group.1"

// NONE-COUNT-3: unit "root"

// BAD: unknown unit policy 'magic': expected layer, size or none

fsdp.param @a : tensor<8x8xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @c : tensor<8x8xf32> init("normal", 0.02)
