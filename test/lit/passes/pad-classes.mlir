// RUN: fsdp-opt %s --split-input-file -fsdp-pad-classes | FileCheck %s
// RUN: fsdp-opt %s --split-input-file -fsdp-pad-classes -fsdp-autodiff | FileCheck %s --check-prefix=GRAD
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision -fsdp-pad-classes | FileCheck %s --check-prefix=BF16
// RUN: fsdp-opt %s --split-input-file -fsdp-pad-classes=multiple=0 | FileCheck %s --check-prefix=OFF
// RUN: fsdp-opt %s --split-input-file --fsdp-pipeline="report=false" | FileCheck %s --check-prefix=PIPE
// RUN: fsdp-opt %s --split-input-file --fsdp-pipeline="pad-classes=0 report=false" | FileCheck %s --check-prefix=PIPEOFF
// RUN: fsdp-opt %s --split-input-file -fsdp-pad-classes -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-plan-memory | FileCheck %s --check-prefix=MEM
// RUN: not fsdp-opt %s --split-input-file -fsdp-pad-classes=multiple=-1 2>&1 | FileCheck %s --check-prefix=BAD

// A tied LM head over an odd vocabulary of 251 (GPT-2's 50257 in small):
// the weight read by the head is widened with 5 zero rows to 256, the
// logits are [N, 256], and the cross-entropy counts the first 251 columns.
// The embedding's read of the same parameter is left alone, and so is the
// parameter (its checkpoint shape).

fsdp.param @wte : tensor<251x16xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @model
// CHECK: %[[E:.+]] = fsdp.get_param @wte : tensor<251x16xf32>
// CHECK: fsdp.embedding %[[E]], %{{.+}}
// CHECK: %[[W:.+]] = fsdp.get_param @wte : tensor<251x16xf32>
// CHECK: %[[Z:.+]] = fsdp.fill {value = 0.000000e+00 : f64} : tensor<5x16xf32>
// CHECK: %[[WP:.+]] = fsdp.concat %[[W]], %[[Z]] dim = 0 : (tensor<251x16xf32>, tensor<5x16xf32>) -> tensor<256x16xf32>
// CHECK: %[[L:.+]] = fsdp.matmul %{{.+}}, %[[WP]] transpose_rhs : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
// CHECK: %[[L3:.+]] = fsdp.reshape %[[L]] : tensor<8x256xf32> -> tensor<2x4x256xf32>
// CHECK: fsdp.cross_entropy %[[L3]], %{{.+}} {classes = 251 : i64} : (tensor<2x4x256xf32>, tensor<2x4xi32>) -> tensor<f32>
// The backward: the gradient of the padded logits has the attribute too,
// and the head's weight gradient is the first 251 rows of the padded one
// (concat's VJP), added to the embedding's.
// GRAD: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}} {classes = 251 : i64} : tensor<2x4x256xf32>, tensor<2x4xi32>
// GRAD: %[[DWP:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<8x256xf32>, tensor<8x16xf32>) -> tensor<256x16xf32>
// GRAD: %[[DW:.+]] = fsdp.slice %[[DWP]] dim = 0 offset = 0 : tensor<256x16xf32> -> tensor<251x16xf32>
// GRAD: fsdp.set_grad @wte
// With mixed precision first, the zeros and the padded copy are bf16.
// BF16: %[[Z:.+]] = fsdp.fill {value = 0.000000e+00 : f64} : tensor<5x16xbf16>
// BF16: fsdp.concat %{{.+}}, %[[Z]] dim = 0 : (tensor<251x16xbf16>, tensor<5x16xbf16>) -> tensor<256x16xbf16>
// BF16: fsdp.cross_entropy {{.+}} {classes = 251 : i64} : (tensor<2x4x256xbf16>, tensor<2x4xi32>) -> tensor<f32>
// The logits' gradient is planned over the logits (through the reshape):
// nothing reads them after it.
// MEM-LABEL: func.func @train_step
// MEM: fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs {fsdp.offsets = array<i64: [[L:[0-9]+]]>} : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
// MEM: fsdp.cross_entropy_grad {{.+}} {classes = 251 : i64, fsdp.offsets = array<i64: [[L]]>}
// OFF-NOT: fsdp.concat
// OFF-NOT: classes
// The pipeline fuses the loss and its gradient, still in place: the
// gradient (the fused op's second offset) is placed on the logits.
// PIPE: fsdp.matmul %{{.+}}, %{{.+}} transpose_rhs {fsdp.offsets = array<i64: [[PL:[0-9]+]]>} : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
// PIPE: fsdp.cross_entropy_fused {{.+}} {classes = 251 : i64, fsdp.offsets = array<i64: {{[0-9]+}}, [[PL]]>} : tensor<2x4x256xf32>
// PIPEOFF-NOT: classes
// BAD: fsdp-pad-classes: multiple=-1 must be >= 0 (0 disables)
func.func @model(%ids: tensor<2x4xi32> {fsdp.role = "input"}, %y: tensor<2x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %e = fsdp.get_param @wte : tensor<251x16xf32>
  %x = fsdp.embedding %e, %ids : (tensor<251x16xf32>, tensor<2x4xi32>) -> tensor<2x4x16xf32>
  %h = fsdp.reshape %x : tensor<2x4x16xf32> -> tensor<8x16xf32>
  %w = fsdp.get_param @wte : tensor<251x16xf32>
  %l = fsdp.matmul %h, %w transpose_rhs : (tensor<8x16xf32>, tensor<251x16xf32>) -> tensor<8x251xf32>
  %l3 = fsdp.reshape %l : tensor<8x251xf32> -> tensor<2x4x251xf32>
  %loss = fsdp.cross_entropy %l3, %y : (tensor<2x4x251xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// An untransposed [C, V] head (x @ W) is padded along its columns.
fsdp.param @w : tensor<16x1000xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @model
// CHECK: fsdp.fill {value = 0.000000e+00 : f64} : tensor<16x24xf32>
// CHECK: fsdp.concat %{{.+}}, %{{.+}} dim = 1 : (tensor<16x1000xf32>, tensor<16x24xf32>) -> tensor<16x1024xf32>
// CHECK: fsdp.matmul %{{.+}}, %{{.+}} : (tensor<8x16xf32>, tensor<16x1024xf32>) -> tensor<8x1024xf32>
// CHECK: fsdp.cross_entropy %{{.+}}, %{{.+}} {classes = 1000 : i64} : (tensor<8x1024xf32>, tensor<8xi32>)
func.func @model(%x: tensor<8x16xf32> {fsdp.role = "input"}, %y: tensor<8xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<16x1000xf32>
  %l = fsdp.matmul %x, %w : (tensor<8x16xf32>, tensor<16x1000xf32>) -> tensor<8x1000xf32>
  %loss = fsdp.cross_entropy %l, %y : (tensor<8x1000xf32>, tensor<8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// Left alone: a head of 100 classes (padding to 128 would add 28 > 100/16
// columns), logits with a second user, and a head that is already aligned.
fsdp.param @a : tensor<100x16xf32> init("normal", 0.02)
fsdp.param @b : tensor<251x16xf32> init("normal", 0.02)
fsdp.param @c : tensor<256x16xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @model
// CHECK-NOT: fsdp.concat
// CHECK-NOT: classes
// CHECK: return
func.func @model(%x: tensor<8x16xf32> {fsdp.role = "input"}, %y: tensor<8xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %a = fsdp.get_param @a : tensor<100x16xf32>
  %la = fsdp.matmul %x, %a transpose_rhs : (tensor<8x16xf32>, tensor<100x16xf32>) -> tensor<8x100xf32>
  %ca = fsdp.cross_entropy %la, %y : (tensor<8x100xf32>, tensor<8xi32>) -> tensor<f32>
  %b = fsdp.get_param @b : tensor<251x16xf32>
  %lb = fsdp.matmul %x, %b transpose_rhs : (tensor<8x16xf32>, tensor<251x16xf32>) -> tensor<8x251xf32>
  %cb = fsdp.cross_entropy %lb, %y : (tensor<8x251xf32>, tensor<8xi32>) -> tensor<f32>
  %s = fsdp.reduce_sum %lb dims = [0, 1] : tensor<8x251xf32> -> tensor<f32>
  %c = fsdp.get_param @c : tensor<256x16xf32>
  %lc = fsdp.matmul %x, %c transpose_rhs : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
  %cc = fsdp.cross_entropy %lc, %y : (tensor<8x256xf32>, tensor<8xi32>) -> tensor<f32>
  %t0 = fsdp.add %ca, %cb : (tensor<f32>, tensor<f32>) -> tensor<f32>
  %t1 = fsdp.add %t0, %cc : (tensor<f32>, tensor<f32>) -> tensor<f32>
  %t2 = fsdp.add %t1, %s : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %t2 : tensor<f32>
}
