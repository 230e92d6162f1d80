// RUN: fsdp-opt %s -fsdp-autodiff | FileCheck %s
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw world-size=2 grad-accum=2 plan=%t.plan report=false" | FileCheck %s --check-prefix=PIPE
// RUN: FileCheck %s --check-prefix=PLAN < %t.plan
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw report=false" | FileCheck %s --check-prefix=ONE
// RUN: fsdp-opt %s --fsdp-pipeline="optimizer=adamw grad-accum=3 fuse-epilogues=false report=false" | FileCheck %s --check-prefix=ACC

// ignore_index (PyTorch's): the loss is the mean over the kept labels of
// the whole step. fsdp-autodiff counts them (fsdp.count_labels) and hands
// the count to the loss and its gradient; fsdp-grad-accum counts once over
// the step's labels (all K micro-batches, divisor K) and every
// micro-batch's loss shares it; fsdp-shard takes its mean over the ranks
// (so each rank divides by the global count / (N K)); the fused
// classifier keeps it, and the plan has the op and the attributes.

fsdp.param @w : tensor<16x1000xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @train_step
// CHECK: %[[Y:.+]] = fsdp.reshape %arg1 : tensor<4x2xi32> -> tensor<8xi32>
// CHECK: %[[N:.+]] = fsdp.count_labels %[[Y]] {ignore_index = -100 : i64} : tensor<8xi32>
// CHECK: fsdp.cross_entropy %{{.+}}, %[[Y]], %[[N]] {ignore_index = -100 : i64} : (tensor<8x1000xf32>, tensor<8xi32>, tensor<f32>) -> tensor<f32>
// CHECK: fsdp.cross_entropy_grad %{{.+}}, %[[Y]], %{{.+}}, %[[N]] {ignore_index = -100 : i64} : tensor<8x1000xf32>, tensor<8xi32>

// PIPE-LABEL: func.func @train_step
// PIPE: %[[C:.+]] = fsdp.count_labels %arg1 {divisor = 2 : i64, {{.*}}ignore_index = -100 : i64} : tensor<8x2xi32>
// PIPE: %[[M:.+]] = fsdp.all_reduce %[[C]] {{{.*}}reduce = "mean"} : tensor<f32>
// PIPE: %[[W:.+]] = fsdp.wait %[[M]]
// PIPE: fsdp.cross_entropy_fused %{{.+}}, %{{.+}}, %{{.+}}, %[[W]] {{{.*}}ignore_index = -100 : i64} : tensor<8x1024xf32>, tensor<8xi32>
// PIPE: fsdp.cross_entropy %{{.+}}, %{{.+}}, %[[W]] {{{.*}}ignore_index = -100 : i64}
// PIPE: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}}, %[[W]] {{{.*}}ignore_index = -100 : i64}
// PIPE-NOT: fsdp.count_labels

// PLAN: "divisor": 2
// PLAN-NEXT: "ignore_index": -100
// PLAN: "op": "count_labels"
// PLAN: "ignore_index": -100
// PLAN: "op": "cross_entropy_fused"

// One rank, one micro-batch: the local count, no collective.
// ONE-LABEL: func.func @train_step
// ONE-NOT: fsdp.all_reduce
// ONE: %[[C:.+]] = fsdp.count_labels %{{.+}} {{{.*}}ignore_index = -100 : i64} : tensor<8xi32>
// ONE-NOT: fsdp.all_reduce
// ONE: fsdp.cross_entropy_fused %{{.+}}, %{{.+}}, %{{.+}}, %[[C]]

// Three micro-batches on one rank: one count of the 12 rows over 3,
// shared by the three losses and gradients.
// ACC-LABEL: func.func @train_step
// ACC: %[[C:.+]] = fsdp.count_labels %arg1 {divisor = 3 : i64, {{.*}}ignore_index = -100 : i64} : tensor<12x2xi32>
// ACC-NOT: fsdp.count_labels
// ACC-COUNT-3: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}}, %[[C]]
// ACC-NOT: fsdp.count_labels
func.func @model(%x: tensor<4x2x16xf32> {fsdp.role = "input"}, %y: tensor<4x2xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %x2 = fsdp.reshape %x : tensor<4x2x16xf32> -> tensor<8x16xf32>
  %w = fsdp.get_param @w : tensor<16x1000xf32>
  %l = fsdp.matmul %x2, %w : (tensor<8x16xf32>, tensor<16x1000xf32>) -> tensor<8x1000xf32>
  %y2 = fsdp.reshape %y : tensor<4x2xi32> -> tensor<8xi32>
  %loss = fsdp.cross_entropy %l, %y2 {ignore_index = -100 : i64} : (tensor<8x1000xf32>, tensor<8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
