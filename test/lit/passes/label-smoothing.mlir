// RUN: fsdp-opt %s -fsdp-pad-classes -fsdp-autodiff | FileCheck %s
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw plan=%t.plan report=false" | FileCheck %s --check-prefix=PIPE
// RUN: FileCheck %s --check-prefix=PLAN < %t.plan
// RUN: fsdp-opt %s --fsdp-pipeline="param-dtype=bf16 optimizer=adamw report=false" | FileCheck %s --check-prefix=PIPE

// Label smoothing (cross_entropy's label_smoothing, PyTorch's): the
// padded head keeps it beside `classes`, the gradient fsdp-autodiff writes
// carries it, the pipeline's fused classifier carries it (in f32 and bf16)
// and the plan's instruction has it for the runtime.

fsdp.param @w : tensor<16x1000xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.cross_entropy %{{.+}}, %{{.+}} {classes = 1000 : i64, label_smoothing = 1.000000e-01 : f64} : (tensor<8x1024xf32>, tensor<8xi32>)
// CHECK: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}} {classes = 1000 : i64, label_smoothing = 1.000000e-01 : f64} : tensor<8x1024xf32>, tensor<8xi32>
// PIPE: fsdp.cross_entropy_fused {{.+}} {classes = 1000 : i64, {{.*}}label_smoothing = 1.000000e-01 : f64{{.*}}} : tensor<8x1024x{{f32|bf16}}>
// PLAN: "label_smoothing": 0.1
func.func @model(%x: tensor<8x16xf32> {fsdp.role = "input"}, %y: tensor<8xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<16x1000xf32>
  %l = fsdp.matmul %x, %w : (tensor<8x16xf32>, tensor<16x1000xf32>) -> tensor<8x1000xf32>
  %loss = fsdp.cross_entropy %l, %y {label_smoothing = 0.1 : f64} : (tensor<8x1000xf32>, tensor<8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
