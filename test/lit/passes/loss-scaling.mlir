// RUN: fsdp-opt %s -fsdp-mixed-precision=param-dtype=f16 | FileCheck %s --check-prefix=POLICY
// RUN: fsdp-opt %s -fsdp-mixed-precision=param-dtype=f16 -fsdp-autodiff | FileCheck %s --check-prefix=SEED
// RUN: fsdp-opt %s -fsdp-mixed-precision=param-dtype=f16 -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" | FileCheck %s --check-prefix=OPT
// RUN: fsdp-opt %s -fsdp-mixed-precision=param-dtype=f16 -fsdp-autodiff -fsdp-insert-optimizer=optimizer=sgd | FileCheck %s --check-prefix=SGD
// RUN: fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 reduce-dtype=f16" -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=4 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16" -fsdp-autodiff -fsdp-grad-accum=micro-batches=2 -fsdp-insert-optimizer=optimizer=adamw | FileCheck %s --check-prefix=ACCUM
// RUN: fsdp-opt %s -fsdp-mixed-precision="param-dtype=bf16" -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw | FileCheck %s --check-prefix=BF16
// RUN: fsdp-opt %s --fsdp-pipeline="param-dtype=f16 loss-scale-init=1024 loss-scale-growth-interval=100 world-size=2 stage=3 report=false plan=%t.plan" -o /dev/null
// RUN: FileCheck %s --check-prefix=PLAN < %t.plan

// Where dynamic loss scaling (f16's default) puts its pieces:
// - fsdp-mixed-precision records the policy;
// - fsdp-autodiff seeds d(loss) with a `loss_scale` argument of @train_step
//   instead of the constant 1;
// - fsdp-insert-optimizer takes one squared norm of the (scaled) gradients,
//   unscales and clips them with one fsdp.grad_coef, skips every update
//   when that norm overflowed, and returns the norm beside the loss;
// - fsdp-shard rebuilds the same over the flat gradient shards, with the
//   partial norms all-reduced, so every rank decides the same;
// - grad-accum shares the one scale between micro-batches;
// - bf16 has no loss scaling unless asked.

// POLICY: fsdp.mixed_precision = {loss_scale = {backoff_factor = 5.000000e-01 : f64, growth_factor = 2.000000e+00 : f64, growth_interval = 2000 : i64, init = 6.553600e+04 : f64}, param_dtype = f16, reduce_dtype = f32}

// SEED-LABEL: func.func @train_step
// SEED-SAME: %[[S:[a-z0-9]+]]: tensor<f32> {fsdp.role = "loss_scale"}
// SEED-NOT: fsdp.fill
// SEED: fsdp.mse_loss_grad %{{.*}}, %{{.*}}, %[[S]]

// OPT-LABEL: func.func @train_step
// OPT-SAME: %[[S:[a-z0-9]+]]: tensor<f32> {fsdp.role = "loss_scale"}
// OPT-SAME: -> (tensor<f32>, tensor<f32>)
// OPT: %[[N:.*]] = fsdp.squared_norm
// OPT: %[[C:.*]] = fsdp.grad_coef %[[N]], %[[S]] {max_norm = 1.000000e+00 : f64}
// OPT: %[[G:.*]] = fsdp.mul %{{.*}}, %[[C]]
// OPT: fsdp.adamw_update %{{.*}}, %[[G]], {{.*}} skip_nonfinite %[[N]]
// OPT: return %{{.*}}, %[[N]] : tensor<f32>, tensor<f32>

// Without clipping the factor is 1/scale.
// SGD: fsdp.grad_coef %{{.*}}, %{{.*}} : tensor<f32>
// SGD-NOT: max_norm
// SGD: fsdp.sgd_update {{.*}} skip_nonfinite

// Z3-LABEL: func.func @train_step
// Z3: fsdp.reduce_scatter {{.*}} : tensor<8xf16> -> tensor<2xf16>
// Z3: %[[P:.*]] = fsdp.squared_norm
// Z3: %[[N:.*]] = fsdp.all_reduce %[[P]] {reduce = "sum"}
// Z3: %[[C:.*]] = fsdp.grad_coef %[[N]], %{{.*}} {max_norm = 1.000000e+00 : f64}
// Z3: fsdp.adamw_update {{.*}} skip_nonfinite %[[N]]
// Z3: return %{{.*}}, %[[N]]

// ACCUM-LABEL: func.func @train_step
// ACCUM-SAME: %[[X:[a-z0-9]+]]: tensor<4x4xf32>
// ACCUM-SAME: %[[S:[a-z0-9]+]]: tensor<f32> {fsdp.role = "loss_scale"}
// ACCUM-COUNT-2: fsdp.mse_loss_grad %{{.*}}, %{{.*}}, %[[S]]
// ACCUM: fsdp.grad_coef

// BF16-NOT: loss_scale
// BF16-NOT: grad_coef
// BF16-NOT: skip_nonfinite

// PLAN: "inputs": [
// PLAN: "role": "loss_scale"
// PLAN: "loss_scale": {
// PLAN-NEXT: "backoff_factor": 0.5,
// PLAN-NEXT: "growth_factor": 2,
// PLAN-NEXT: "growth_interval": 100,
// PLAN-NEXT: "init": 1024
// PLAN: "role": "grad_sumsq"
// PLAN: "op": "grad_coef"

fsdp.param @w : tensor<1x4xf32> init("normal", 0.02)
fsdp.param @b : tensor<1xf32> init("zeros")

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4xf32>
  %b = fsdp.get_param @b : tensor<1xf32>
  %o = fsdp.matmul %x, %w transpose_rhs : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x1xf32>
  %y = fsdp.bias_add %o, %b : tensor<2x1xf32>, tensor<1xf32>
  %l = fsdp.mse_loss %y, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
