// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations="min-bytes=64 overlap=false" | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations=min-bytes=64 | FileCheck %s --check-prefix=ASYNC
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations=min-bytes=256 | FileCheck %s --check-prefix=BIG
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations=min-bytes=64 -fsdp-plan-memory="report=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations=min-bytes=64 -fsdp-offload-activations=min-bytes=64 -o /dev/null 2>&1 | FileCheck %s --check-prefix=TWICE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd -fsdp-offload-activations=mode=auto -o /dev/null 2>&1 | FileCheck %s --check-prefix=AUTO

// Activation offload: each activation the backward pass reads (the
// matmul output h for relu's gradient, the relu output a through two
// reshapes for w2's gradient) is copied to the host right after its
// definition and back right before its first backward read; the backward
// reads the copy, through a rebuilt reshape chain where it read a
// reshape. The output o is not: the loss is the forward's last op and its
// gradient reads o at once. The batch (an argument) and the parameters
// are not activations. min-bytes leaves smaller ones (128 B here) on the
// device. With overlap (the default) the copies are async, each with one
// wait: the copies out are waited for where the forward pass ends (or
// two copies later), the copy back of the next activation the backward
// reads is issued right after the wait of the one it reads now.

fsdp.param @w1 : tensor<8x8xf32> init("normal", 0.5)
fsdp.param @w2 : tensor<8x8xf32> init("normal", 0.5)
func.func @model(%x: tensor<4x8xf32> {fsdp.role = "input"}, %y: tensor<4x8xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x8xf32>
  %h = fsdp.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %a = fsdp.relu %h : tensor<4x8xf32>
  %r = fsdp.reshape %a : tensor<4x8xf32> -> tensor<2x16xf32>
  %s = fsdp.reshape %r : tensor<2x16xf32> -> tensor<4x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<8x8xf32>
  %o = fsdp.matmul %s, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %l = fsdp.mse_loss %o, %y : tensor<4x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// CHECK-LABEL: func.func @train_step
// CHECK: %[[H:.+]] = fsdp.matmul %arg0
// CHECK-NEXT: %[[HH:.+]] = fsdp.to_host %[[H]] : tensor<4x8xf32>
// CHECK-NEXT: %[[A:.+]] = fsdp.relu %[[H]]
// CHECK-NEXT: %[[AH:.+]] = fsdp.to_host %[[A]] : tensor<4x8xf32>
// CHECK-NEXT: %[[R:.+]] = fsdp.reshape %[[A]]
// CHECK-NEXT: %[[S:.+]] = fsdp.reshape %[[R]]
// CHECK: %[[O:.+]] = fsdp.matmul %[[S]]
// CHECK-NEXT: fsdp.mse_loss %[[O]], %arg1
// CHECK: %[[DO:.+]] = fsdp.mse_loss_grad %[[O]], %arg1
// CHECK: %[[AD:.+]] = fsdp.to_device %[[AH]] : tensor<4x8xf32>
// CHECK-NEXT: %[[R2:.+]] = fsdp.reshape %[[AD]] : tensor<4x8xf32> -> tensor<2x16xf32>
// CHECK-NEXT: %[[S2:.+]] = fsdp.reshape %[[R2]] : tensor<2x16xf32> -> tensor<4x8xf32>
// CHECK-NEXT: fsdp.matmul %[[S2]], %[[DO]] transpose_lhs
// CHECK: %[[HD:.+]] = fsdp.to_device %[[HH]] : tensor<4x8xf32>
// CHECK-NEXT: fsdp.relu_grad %[[HD]]
// CHECK-NOT: fsdp.to_host
// CHECK-NOT: fsdp.to_device
// CHECK-NOT: fsdp.wait
// CHECK: return

// ASYNC-LABEL: func.func @train_step
// ASYNC: %[[H:.+]] = fsdp.matmul %arg0
// ASYNC-NEXT: %[[HH:.+]] = fsdp.to_host %[[H]] {async} : tensor<4x8xf32>
// ASYNC: %[[AH:.+]] = fsdp.to_host %{{.+}} {async} : tensor<4x8xf32>
// ASYNC: fsdp.mse_loss
// ASYNC-NEXT: %[[HW:.+]] = fsdp.wait %[[HH]] : tensor<4x8xf32>
// ASYNC-NEXT: %[[AW:.+]] = fsdp.wait %[[AH]] : tensor<4x8xf32>
// ASYNC: %[[AD:.+]] = fsdp.to_device %[[AW]] {async} : tensor<4x8xf32>
// ASYNC-NEXT: %[[ADW:.+]] = fsdp.wait %[[AD]] : tensor<4x8xf32>
// ASYNC-NEXT: %[[HD:.+]] = fsdp.to_device %[[HW]] {async} : tensor<4x8xf32>
// ASYNC-NEXT: fsdp.reshape %[[ADW]]
// ASYNC: %[[HDW:.+]] = fsdp.wait %[[HD]] : tensor<4x8xf32>
// ASYNC-NEXT: fsdp.relu_grad %[[HDW]]
// ASYNC: return

// BIG-LABEL: func.func @train_step
// BIG-NOT: fsdp.to_host
// BIG-NOT: fsdp.to_device
// BIG: return

// REPORT: host (offloaded):
// REPORT:   activations (sum) {{ *}}256
// REPORT:   host arena

// TWICE: error: fsdp-offload-activations: @train_step already has host copies: run it once, before fsdp-offload
// AUTO: error: fsdp-offload-activations: offload-activations='auto' must be true or false (auto needs memory-budget: the schedule search decides)
