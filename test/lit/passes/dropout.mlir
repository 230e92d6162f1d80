// RUN: fsdp-opt %s -fsdp-autodiff | FileCheck %s
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-grad-accum=micro-batches=3 | FileCheck %s --check-prefix=ACC

// Tests dropout's VJP (the same dropout, same attributes, of the incoming
// gradient: nothing saved) and that gradient accumulation numbers the
// micro-batches in every dropout, forward and backward alike.

fsdp.param @w : tensor<8x4xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @train_step
// CHECK: %[[Y:.+]] = fsdp.matmul
// CHECK: %[[D:.+]] = fsdp.dropout %[[Y]] {id = 7 : i64, p = 2.500000e-01 : f64} : tensor<2x8xf32>
// CHECK: %[[DY:.+]] = fsdp.mse_loss_grad
// CHECK: %[[DX:.+]] = fsdp.dropout %[[DY]] {id = 7 : i64, p = 2.500000e-01 : f64} : tensor<2x8xf32>
// CHECK: fsdp.matmul %[[DX]]

// ACC-LABEL: func.func @train_step
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro = 1 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro = 1 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro = 2 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC: fsdp.dropout %{{.+}} {id = 7 : i64, micro = 2 : i64, micro_count = 3 : i64, p = 2.500000e-01 : f64}
// ACC-NOT: fsdp.dropout


func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x8xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %y = fsdp.matmul %x, %w transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %d = fsdp.dropout %y {p = 0.25 : f64, id = 7 : i64} : tensor<2x8xf32>
  %l = fsdp.mse_loss %d, %t : tensor<2x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
