// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw plan=%t.plan report=false" -o /dev/null
// RUN: FileCheck %s < %t.plan
// RUN: FileCheck %s --check-prefix=PROGRAM < %t.plan
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=none plan=%t.none.plan report=false" -o /dev/null
// RUN: FileCheck %s --check-prefix=NONE < %t.none.plan
// The plan uses the alignment fsdp-plan-memory was given (parameters and
// state are packed per unit; every other buffer is aligned).
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer -fsdp-plan-memory=alignment=4096 -convert-fsdp-to-plan=output=%t.a.plan -o /dev/null
// RUN: %python -c "import json,sys; p=json.load(open(sys.argv[1])); bad=[b['id'] for b in p['buffers'] if 'alias_of' not in b and b['kind'] not in ('param', 'state') and b['offset'] %% 4096]; print('misaligned', bad); sys.exit(1 if bad else 0)" %t.a.plan
// The features a runtime needs beyond the version (PlanSchema.h): listed
// only where the plan uses one, so an f32 plan has no "requires".
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw optimizer-state-dtype=bf16 plan=%t.bf16.plan report=false" -o /dev/null
// RUN: %python -c "import json,sys; print('requires', *(json.load(open(f)).get('requires') for f in sys.argv[1:]))" %t.plan %t.none.plan %t.bf16.plan | FileCheck %s --check-prefix=FEATURES
// FEATURES: requires None None ['optimizer-state-bf16']
// RUN: not fsdp-opt %s -fsdp-autodiff -convert-fsdp-to-plan 2>&1 | FileCheck %s --check-prefix=NOOUT
// RUN: not fsdp-opt %s --fsdp-pipeline="plan=/nonexistent-dir/x.plan report=false" -o /dev/null 2>&1 | FileCheck %s --check-prefix=NOWRITE

// Tests the plan file: format and version, optimizer options, the unit
// packing of parameters, the input bindings with their roles (and the
// class range of integer labels), and the instruction list with in-place
// optimizer updates and no instruction for get_param.

// CHECK: "arena_bytes":
// CHECK: "format": "fsdp-plan"
// CHECK: "inputs": [
// CHECK: "name": "input"
// CHECK-NEXT: "role": "input"
// CHECK: "name": "target"
// CHECK-NEXT: "range": 4
// CHECK-NEXT: "role": "target"
// CHECK: "name": "lr"
// CHECK: "name": "step"
// CHECK: "memory": {
// CHECK: "model": "model"
// CHECK: "optimizer": "adamw"
// CHECK: "outputs": [
// CHECK: "role": "loss"
// CHECK: "params": [
// CHECK: "flat_offset": 0
// CHECK: "init": "normal"
// CHECK: "name": "layers.0.w"
// CHECK: "unit": 0
// CHECK: "flat_offset": 0
// CHECK: "name": "head.w"
// CHECK: "unit": 1
// CHECK: "states": [
// CHECK: "kind": "exp_avg"
// CHECK: "units": [
// CHECK: "flat_numel": 32
// CHECK: "name": "layers.0"
// CHECK: "flat_numel": 32
// CHECK: "name": "root"
// CHECK: "version": 2
// CHECK: "world_size": 1

// PROGRAM: "program": [
// PROGRAM-NOT: get_param
// PROGRAM: "op": "matmul"
// PROGRAM: "op": "relu"
// PROGRAM: "op": "matmul"
// PROGRAM: "op": "fill"
// PROGRAM: "op": "cross_entropy_fused"
// PROGRAM: "op": "adamw_update"
// PROGRAM: "op": "adamw_update"
// PROGRAM-NOT: "op": "copy"

// NONE: "role": "grad"
// NONE: "role": "grad"
// NONE: "states": [],
// NONE-NOT: adamw_update

// NOOUT: convert-fsdp-to-plan needs output=PATH
// NOWRITE: cannot write the plan to '/nonexistent-dir/x.plan'

fsdp.param @"layers.0.w" : tensor<8x4xf32> init("normal", 0.5) unit "layers.0"
fsdp.param @"head.w" : tensor<4x8xf32> init("uniform", 0.3)
func.func @model(%x: tensor<16x4xf32> {fsdp.role = "input"}, %y: tensor<16xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @"layers.0.w" : tensor<8x4xf32>
  %w2 = fsdp.get_param @"head.w" : tensor<4x8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %r = fsdp.relu %h : tensor<16x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<16x8xf32>, tensor<4x8xf32>) -> tensor<16x4xf32>
  %l = fsdp.cross_entropy %o, %y : (tensor<16x4xf32>, tensor<16xi32>) -> tensor<f32>
  return %l : tensor<f32>
}
