// AdamW's moments in bf16 (fsdp-insert-optimizer state-dtype=bf16): bf16
// state symbols beside the f32 parameter, an update typed `state bf16`,
// stochastic with its key by default; fsdp-shard's per-unit update keeps the
// moments' dtype, takes the unit's index as its key and its shard's stride.
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16" | FileCheck %s --check-prefix=SR
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16 state-rounding=nearest" | FileCheck %s --check-prefix=NEAR
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=bf16" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=SHARD
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 state-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=SGD
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

// SGD: state-dtype=bf16 stores AdamW's moments in bf16; optimizer=sgd keeps f32 state
// DTYPE: state-dtype must be f32 or bf16, found 'f16'
// ROUND: state-rounding must be stochastic or nearest, found 'up'

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %f = fsdp.get_param @b : tensor<8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %f : tensor<16x8xf32>, tensor<8xf32>
  %l = fsdp.mse_loss %hb, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}
