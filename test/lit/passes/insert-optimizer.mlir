// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw weight-decay=0.1" | FileCheck %s --check-prefix=ADAM
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 max-grad-norm=1.0" | FileCheck %s --check-prefix=SGDM
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd" | FileCheck %s --check-prefix=SGD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=none" | FileCheck %s --check-prefix=NONE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lion" 2>&1 | FileCheck %s --check-prefix=BAD

// Tests that each trainable parameter gets state and one in-place update,
// that lr/step become arguments, and that frozen parameters are left alone.
fsdp.param @w : tensor<8x4xf32> init("normal", 0.02)
fsdp.param @f : tensor<8xf32> init("ones") frozen

// ADAM: fsdp.state @w.exp_avg : tensor<8x4xf32> of @w kind "exp_avg"
// ADAM: fsdp.state @w.exp_avg_sq : tensor<8x4xf32> of @w kind "exp_avg_sq"
// ADAM-NOT: fsdp.state @f
// ADAM-LABEL: func.func @train_step
// ADAM-SAME: %[[LR:[^:]+]]: tensor<f32> {fsdp.role = "lr"}, %[[STEP:[^:]+]]: tensor<f32> {fsdp.role = "step"}
// ADAM: %[[G:.+]] = fsdp.matmul {{.*}} transpose_lhs
// ADAM: %[[P:.+]] = fsdp.get_param @w
// ADAM: %[[M:.+]] = fsdp.get_state @w.exp_avg
// ADAM: %[[V:.+]] = fsdp.get_state @w.exp_avg_sq
// ADAM: %[[NP:[^,]+]], %[[NM:[^,]+]], %[[NV:[^ ]+]] = fsdp.adamw_update %[[P]], %[[G]], %[[M]], %[[V]], %[[LR]], %[[STEP]] {weight_decay = 1.000000e-01 : f64}
// ADAM: fsdp.set_param @w = %[[NP]]
// ADAM: fsdp.set_state @w.exp_avg = %[[NM]]
// ADAM: fsdp.set_state @w.exp_avg_sq = %[[NV]]
// ADAM-NOT: fsdp.set_grad
// ADAM-NOT: fsdp.set_param @f

// SGDM: fsdp.state @w.momentum_buffer : tensor<8x4xf32> of @w kind "momentum_buffer"
// SGDM-LABEL: func.func @train_step
// SGDM: %[[SQ:.+]] = fsdp.squared_norm %[[G:.+]] : tensor<8x4xf32>
// SGDM: %[[C:.+]] = fsdp.clip_coef %[[SQ]] {max_norm = 1.000000e+00 : f64}
// SGDM: %[[GC:.+]] = fsdp.mul %[[G]], %[[C]] : (tensor<8x4xf32>, tensor<f32>) -> tensor<8x4xf32>
// SGDM: fsdp.sgd_momentum_update %{{.+}}, %[[GC]], %{{.+}}, %{{.+}}, %{{.+}} {momentum = 9.000000e-01 : f64}

// SGD-NOT: fsdp.state
// SGD: %[[NP:.+]] = fsdp.sgd_update
// SGD: fsdp.set_param @w = %[[NP]]

// NONE-NOT: fsdp.state
// NONE: fsdp.optimizer = {{.*}}optimizer = "none"
// NONE: fsdp.set_grad @w

// BAD: unknown optimizer 'lion': expected sgd, adamw, lamb or none

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %f = fsdp.get_param @f : tensor<8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %f : tensor<16x8xf32>, tensor<8xf32>
  %l = fsdp.mse_loss %hb, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
