// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale=sometimes" 2>&1 | FileCheck %s --check-prefix=SCALEKIND
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-init=1000" 2>&1 | FileCheck %s --check-prefix=SCALEINIT
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-init=0.5" 2>&1 | FileCheck %s --check-prefix=SCALEINIT
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-growth-interval=0" 2>&1 | FileCheck %s --check-prefix=INTERVAL
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-growth-factor=3" 2>&1 | FileCheck %s --check-prefix=GROWTH
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-growth-factor=1" 2>&1 | FileCheck %s --check-prefix=GROWTH
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-backoff-factor=2" 2>&1 | FileCheck %s --check-prefix=BACKOFF
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 loss-scale-backoff-factor=0.3" 2>&1 | FileCheck %s --check-prefix=BACKOFF
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=none param-dtype=f16" 2>&1 | FileCheck %s --check-prefix=NOOPT
// RUN: not fsdp-opt %s -fsdp-mixed-precision=param-dtype=fp8 2>&1 | FileCheck %s --check-prefix=UNKNOWN
// RUN: not fsdp-opt %s --fsdp-pipeline="param-dtype=bfloat16" 2>&1 | FileCheck %s --check-prefix=PIPE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-mixed-precision 2>&1 | FileCheck %s --check-prefix=ORDER
// RUN: not fsdp-opt %s -fsdp-mixed-precision -fsdp-mixed-precision 2>&1 | FileCheck %s --check-prefix=TWICE
// RUN: not fsdp-opt %S/Inputs/bf16-param.mlir -fsdp-mixed-precision 2>&1 | FileCheck %s --check-prefix=MASTER

// Tests that bad mixed-precision options and orders are rejected with a
// message that says why. Loss scales must be powers of two (so scaling and
// unscaling round nothing), and scaled gradients need an optimizer to
// unscale them.

// SCALEKIND: loss-scale='sometimes': expected dynamic or none
// SCALEINIT: must be a power of two in [1, 2^127]
// INTERVAL: loss-scale-growth-interval=0 must be at least 1
// GROWTH: loss-scale-growth-factor={{[0-9.]+}} must be a power of two in [2, 2^64]
// BACKOFF: loss-scale-backoff-factor={{[0-9.]+}} must be a power of two in [2^-64, 1/2]
// NOOPT: loss scaling needs an optimizer
// UNKNOWN: param-dtype='fp8' is not a dtype: expected f32, bf16 or f16
// PIPE: param-dtype='bfloat16' is not a dtype: expected f32, bf16 or f16
// ORDER: fsdp-mixed-precision runs before fsdp-autodiff
// TWICE: fsdp-mixed-precision already ran on this module
// MASTER: 'fsdp.param' op is 'bf16': with mixed precision parameters are the f32 master copy

fsdp.param @w : tensor<1x4xf32> init("normal", 0.02)

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<1x4xf32>
  %o = fsdp.matmul %x, %w transpose_rhs : (tensor<2x4xf32>, tensor<1x4xf32>) -> tensor<2x1xf32>
  %l = fsdp.mse_loss %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
