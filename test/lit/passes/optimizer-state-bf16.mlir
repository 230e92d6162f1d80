// AdamW's and LAMB's moments and SGD's momentum buffer in bf16 (fsdp-insert-optimizer
// state-dtype=bf16): bf16 state symbols beside the f32 parameter, an update
// typed `state bf16`, stochastic with its key by default; fsdp-shard's
// per-unit update keeps the state's dtype, takes the unit's index as its key
// and its shard's stride (LAMB's norms read the bf16 moments and round
// nothing). SGD without momentum is refused.
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16" | FileCheck %s --check-prefix=SR
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16 state-rounding=nearest" | FileCheck %s --check-prefix=NEAR
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=SHARD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 state-dtype=bf16" | FileCheck %s --check-prefix=SGD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 nesterov=true state-dtype=bf16 state-rounding=nearest" -fsdp-group-units -fsdp-shard="world-size=2 stage=1" | FileCheck %s --check-prefix=SGDSHARD
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd state-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=NOMOM
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb state-dtype=bf16" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=LAMB
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=f16" 2>&1 | FileCheck %s --check-prefix=DTYPE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16 state-rounding=up" 2>&1 | FileCheck %s --check-prefix=ROUND

fsdp.param @w : tensor<8x4xf32> init("normal", 0.02)
fsdp.param @b : tensor<8xf32> init("zeros")

// SR: fsdp.state @w.exp_avg : tensor<8x4xbf16> of @w kind "exp_avg"
// SR: fsdp.state @w.exp_avg_sq : tensor<8x4xbf16> of @w kind "exp_avg_sq"
// SR: fsdp.state @b.exp_avg : tensor<8xbf16> of @b kind "exp_avg"
// SR: fsdp.get_state @w.exp_avg : tensor<8x4xbf16>
// SR: fsdp.adamw_update {{.*}} {key = 0 : i64, stochastic} : tensor<8x4xf32> state tensor<8x4xbf16>
// SR: fsdp.set_state @w.exp_avg = %{{.*}} : tensor<8x4xbf16>
// SR: fsdp.adamw_update {{.*}} {key = 1 : i64, stochastic} : tensor<8xf32> state tensor<8xbf16>

// NEAR: fsdp.adamw_update
// NEAR-NOT: stochastic
// NEAR-SAME: : tensor<8x4xf32> state tensor<8x4xbf16>

// SHARD: fsdp.state @{{.*}}exp_avg : tensor<{{[0-9]+}}xbf16> of
// SHARD: fsdp.state @{{.*}}exp_avg_sq : tensor<{{[0-9]+}}xbf16> of
// SHARD: fsdp.adamw_update {{.*}}key = 0 : i64, shard_stride = [[S:[0-9]+]] : i64, stochastic} : tensor<[[S]]xf32> state tensor<[[S]]xbf16>

// SGD: fsdp.state @w.momentum_buffer : tensor<8x4xbf16> of @w kind "momentum_buffer"
// SGD: fsdp.state @b.momentum_buffer : tensor<8xbf16> of @b kind "momentum_buffer"
// SGD: fsdp.sgd_momentum_update {{.*}} {key = 0 : i64, momentum = 9.000000e-01 : f64, stochastic} : tensor<8x4xf32> state tensor<8x4xbf16>
// SGD: fsdp.set_state @w.momentum_buffer = %{{.*}} : tensor<8x4xbf16>
// SGD: fsdp.sgd_momentum_update {{.*}} {key = 1 : i64, momentum = 9.000000e-01 : f64, stochastic} : tensor<8xf32> state tensor<8xbf16>

// SGDSHARD: fsdp.state @{{.*}}momentum_buffer : tensor<{{[0-9]+}}xbf16> of
// SGDSHARD: fsdp.sgd_momentum_update
// SGDSHARD-NOT: stochastic
// SGDSHARD-SAME: nesterov
// SGDSHARD-NOT: stochastic
// SGDSHARD-SAME: : tensor<[[S:[0-9]+]]xf32> state tensor<[[S]]xbf16>

// NOMOM: state-dtype=bf16 stores optimizer state in bf16, and SGD without momentum keeps none
// LAMB: fsdp.state @{{.*}}exp_avg : tensor<{{[0-9]+}}xbf16> of
// LAMB: fsdp.lamb_norms
// LAMB-NOT: stochastic
// LAMB-SAME: : tensor<[[S:[0-9]+]]xf32> state tensor<[[S]]xbf16> -> tensor<4xf32>
// LAMB: fsdp.lamb_update {{.*}}key = 0 : i64{{.*}}shard_stride = [[S]] : i64, stochastic{{.*}} : tensor<[[S]]xf32>, tensor<4xf32> state tensor<[[S]]xbf16>
// DTYPE: state-dtype must be f32, bf16, 8bit or 4bit, found 'f16'
// ROUND: state-rounding must be stochastic or nearest, found 'up'

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %f = fsdp.get_param @b : tensor<8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %f : tensor<16x8xf32>, tensor<8xf32>
  %l = fsdp.mse_loss %hb, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
