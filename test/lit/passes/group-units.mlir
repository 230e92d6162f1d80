// RUN: fsdp-opt %s -fsdp-group-units=policy=layer | FileCheck %s --check-prefix=LAYER
// RUN: fsdp-opt %s -fsdp-group-units="policy=size min-unit-numel=100" | FileCheck %s --check-prefix=SIZE
// RUN: fsdp-opt %s -fsdp-group-units=policy=none | FileCheck %s --check-prefix=NONE
// RUN: not fsdp-opt %s -fsdp-group-units=policy=magic 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: fsdp-opt %s -fsdp-group-units="policy=layer layers-per-unit=2" | FileCheck %s --check-prefix=MERGE2
// RUN: not fsdp-opt %s -fsdp-group-units="layers-per-unit=0" 2>&1 | FileCheck %s --check-prefix=MERGE0

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

// layers-per-unit=2: the two marked layers form one unit named first..last;
// the unmarked parameter stays in the root unit.
// MERGE2: fsdp.param @a {{.*}} unit "layers.0..layers.1"
// MERGE2: fsdp.param @b {{.*}} unit "layers.0..layers.1"
// MERGE2: fsdp.param @c : tensor<8x8xf32> init("normal", {{.+}}){{$}}
// MERGE0: layers-per-unit must be >= 1

fsdp.param @a : tensor<8x8xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b : tensor<8x8xf32> init("normal", 0.02) unit "layers.1"
fsdp.param @c : tensor<8x8xf32> init("normal", 0.02)
