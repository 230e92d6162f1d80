// RUN: fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=3 | FileCheck %s
// RUN: fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=2 | FileCheck %s --check-prefix=TWO
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision=param-dtype=bf16 -fsdp-autodiff -fsdp-chunk-loss=chunks=2 | FileCheck %s --check-prefix=BF16
// RUN: fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=auto | FileCheck %s --check-prefix=AUTO
// RUN: fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss | FileCheck %s --check-prefix=OFF
// RUN: fsdp-opt %s --split-input-file --fsdp-pipeline="loss-chunks=2 report=false" | FileCheck %s --check-prefix=PIPE
// RUN: fsdp-opt %s --split-input-file --fsdp-pipeline="loss-chunks=2 report=false fuse-epilogues=false" | FileCheck %s --check-prefix=UNFUSED
// RUN: not fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=0 2>&1 | FileCheck %s --check-prefix=BADN
// RUN: not fsdp-opt %s --split-input-file -fsdp-autodiff -fsdp-chunk-loss=chunks=two 2>&1 | FileCheck %s --check-prefix=BADS
// RUN: not fsdp-opt %s --split-input-file -fsdp-chunk-loss=chunks=2 2>&1 | FileCheck %s --check-prefix=NOSTEP

// A tied LM head (GPT's) over [2, 4] tokens: 8 rows, vocabulary 256,
// width 16. With 3 chunks of 3, 3 and 2 rows each chunk reads its rows of
// the head's input and of the labels through views (no copies), makes its
// [rows, 256] logits, loss and logits gradient, its rows of the input
// gradient (concatenated at the end) and its term of the weight gradient,
// summed in place (fsdp.chunk_accum). The loss is a mean: chunk i's mean
// and its gradient's seed count rows_i / 8 of the step's.
// BADN: chunks='0' is not a positive chunk count or auto (1: off)
// BADS: chunks='two' is not a positive chunk count or auto (1: off)
// NOSTEP: no @train_step: run fsdp-autodiff first

fsdp.param @wte : tensor<256x16xf32> init("normal", 0.02)

// CHECK-LABEL: func.func @train_step
// CHECK: fsdp.embedding
// CHECK: %[[W:.+]] = fsdp.get_param @wte : tensor<256x16xf32>
// CHECK: %[[SEED:.+]] = fsdp.fill {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK: %[[HF:.+]] = fsdp.reshape %{{.+}} : tensor<8x16xf32> -> tensor<128xf32>
// CHECK: %[[H0:.+]] = fsdp.view %[[HF]] offset = 0 : tensor<128xf32> -> tensor<3x16xf32>
// CHECK: %[[YF:.+]] = fsdp.reshape %arg1 : tensor<2x4xi32> -> tensor<8xi32>
// CHECK: %[[Y0:.+]] = fsdp.view %[[YF]] offset = 0 : tensor<8xi32> -> tensor<3xi32>
// CHECK: %[[L0:.+]] = fsdp.matmul %[[H0]], %[[W]] transpose_rhs : (tensor<3x16xf32>, tensor<256x16xf32>) -> tensor<3x256xf32>
// CHECK: %[[S3:.+]] = fsdp.scale %[[SEED]] {factor = 3.750000e-01 : f64} : tensor<f32>
// CHECK: %[[C0:.+]] = fsdp.cross_entropy %[[L0]], %[[Y0]] : (tensor<3x256xf32>, tensor<3xi32>) -> tensor<f32>
// CHECK: %[[D0:.+]] = fsdp.cross_entropy_grad %[[L0]], %[[Y0]], %[[S3]] : tensor<3x256xf32>, tensor<3xi32>
// CHECK: %[[DH0:.+]] = fsdp.matmul %[[D0]], %[[W]] : (tensor<3x256xf32>, tensor<256x16xf32>) -> tensor<3x16xf32>
// CHECK: %[[DW0:.+]] = fsdp.matmul %[[D0]], %[[H0]] transpose_lhs : (tensor<3x256xf32>, tensor<3x16xf32>) -> tensor<256x16xf32>
// CHECK: %[[H1:.+]] = fsdp.view %[[HF]] offset = 48 : tensor<128xf32> -> tensor<3x16xf32>
// CHECK: %[[Y1:.+]] = fsdp.view %[[YF]] offset = 3 : tensor<8xi32> -> tensor<3xi32>
// CHECK: %[[L1:.+]] = fsdp.matmul %[[H1]], %[[W]] transpose_rhs
// CHECK-NOT: fsdp.scale %[[SEED]]
// CHECK: %[[C1:.+]] = fsdp.cross_entropy %[[L1]], %[[Y1]]
// CHECK: %[[D1:.+]] = fsdp.cross_entropy_grad %[[L1]], %[[Y1]], %[[S3]]
// CHECK: %[[DH1:.+]] = fsdp.matmul %[[D1]], %[[W]]
// CHECK: %[[DW1:.+]] = fsdp.matmul %[[D1]], %[[H1]] transpose_lhs
// CHECK: %[[ACC1:.+]] = fsdp.add %[[DW0]], %[[DW1]] {fsdp.chunk_accum}
// CHECK: %[[H2:.+]] = fsdp.view %[[HF]] offset = 96 : tensor<128xf32> -> tensor<2x16xf32>
// CHECK: %[[Y2:.+]] = fsdp.view %[[YF]] offset = 6 : tensor<8xi32> -> tensor<2xi32>
// CHECK: %[[L2:.+]] = fsdp.matmul %[[H2]], %[[W]] transpose_rhs : (tensor<2x16xf32>, tensor<256x16xf32>) -> tensor<2x256xf32>
// CHECK: %[[S2:.+]] = fsdp.scale %[[SEED]] {factor = 2.500000e-01 : f64} : tensor<f32>
// CHECK: %[[C2:.+]] = fsdp.cross_entropy %[[L2]], %[[Y2]]
// CHECK: %[[D2:.+]] = fsdp.cross_entropy_grad %[[L2]], %[[Y2]], %[[S2]]
// CHECK: %[[DH2:.+]] = fsdp.matmul %[[D2]], %[[W]]
// CHECK: %[[DW2:.+]] = fsdp.matmul %[[D2]], %[[H2]] transpose_lhs
// CHECK: %[[ACC2:.+]] = fsdp.add %[[ACC1]], %[[DW2]] {fsdp.chunk_accum}
// The loss comes after every chunk's gradient (fsdp-fuse-epilogues then
// fuses each chunk's pair): the means weighed by 3/8, 3/8 and 2/8.
// CHECK: %[[C0S:.+]] = fsdp.scale %[[C0]] {factor = 3.750000e-01 : f64} : tensor<f32>
// CHECK: %[[C1S:.+]] = fsdp.scale %[[C1]] {factor = 3.750000e-01 : f64} : tensor<f32>
// CHECK: %[[LA:.+]] = fsdp.add %[[C0S]], %[[C1S]]
// CHECK: %[[C2S:.+]] = fsdp.scale %[[C2]] {factor = 2.500000e-01 : f64} : tensor<f32>
// CHECK: %[[LOSS:.+]] = fsdp.add %[[LA]], %[[C2S]]
// CHECK: %[[DH:.+]] = fsdp.concat %[[DH0]], %[[DH1]], %[[DH2]] dim = 0 : (tensor<3x16xf32>, tensor<3x16xf32>, tensor<2x16xf32>) -> tensor<8x16xf32>
// CHECK: %[[DH3:.+]] = fsdp.reshape %[[DH]] : tensor<8x16xf32> -> tensor<2x4x16xf32>
// CHECK: %[[DE:.+]] = fsdp.embedding_grad %arg0, %[[DH3]]
// CHECK: %[[G:.+]] = fsdp.add %[[DE]], %[[ACC2]]
// CHECK: fsdp.set_grad @wte = %[[G]]
// CHECK: return %[[LOSS]]
// Two equal chunks: one seed of half the step's, the losses' mean.
// TWO-LABEL: func.func @train_step
// TWO: %[[S:.+]] = fsdp.scale %{{.+}} {factor = 5.000000e-01 : f64} : tensor<f32>
// TWO: %[[C0:.+]] = fsdp.cross_entropy %{{.+}} : (tensor<4x256xf32>, tensor<4xi32>) -> tensor<f32>
// TWO: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %[[S]]
// TWO: %[[C1:.+]] = fsdp.cross_entropy %{{.+}} : (tensor<4x256xf32>, tensor<4xi32>) -> tensor<f32>
// TWO: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %[[S]]
// TWO: %[[SUM:.+]] = fsdp.add %[[C0]], %[[C1]]
// TWO: %[[MEAN:.+]] = fsdp.scale %[[SUM]] {factor = 5.000000e-01 : f64}
// TWO: return %[[MEAN]]
// bf16 compute: the weight-gradient terms are widened and summed in f32,
// and the sum replaces the f32 cast of the unchunked bf16 gradient.
// BF16-LABEL: func.func @train_step
// BF16: %[[T0:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<4x256xbf16>, tensor<4x16xbf16>) -> tensor<256x16xbf16>
// BF16: %[[W0:.+]] = fsdp.cast %[[T0]] : tensor<256x16xbf16> -> tensor<256x16xf32>
// BF16: %[[T1:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs : (tensor<4x256xbf16>, tensor<4x16xbf16>) -> tensor<256x16xbf16>
// BF16: %[[W1:.+]] = fsdp.cast %[[T1]] : tensor<256x16xbf16> -> tensor<256x16xf32>
// BF16: %[[ACC:.+]] = fsdp.add %[[W0]], %[[W1]] {fsdp.chunk_accum} : (tensor<256x16xf32>, tensor<256x16xf32>) -> tensor<256x16xf32>
// BF16: fsdp.concat %{{.+}}, %{{.+}} dim = 0 : (tensor<4x16xbf16>, tensor<4x16xbf16>) -> tensor<8x16xbf16>
// BF16: %[[DE:.+]] = fsdp.cast %{{.+}} : tensor<256x16xbf16> -> tensor<256x16xf32>
// BF16: fsdp.add %[[DE]], %[[ACC]] : (tensor<256x16xf32>, tensor<256x16xf32>) -> tensor<256x16xf32>
// auto: rows whose f32 logits take the [256, 16] f32 weight gradient's
// bytes, 16: the 8 rows stay one chunk.
// AUTO-LABEL: func.func @train_step
// AUTO-NOT: fsdp.view
// OFF-LABEL: func.func @train_step
// OFF-NOT: fsdp.view
// The pipeline fuses each chunk's loss and gradient (the chunk's loss is
// read after its gradient); the model function (evaluation) is unchunked.
// PIPE-LABEL: func.func @model
// PIPE: fsdp.cross_entropy %{{.+}} : (tensor<2x4x256xf32>, tensor<2x4xi32>)
// The second chunk's weight-gradient term is a GEMM accumulating into the
// first's (acc), in place: the same offset, no buffer for the term.
// Unfused, the term has a buffer of its own and an add writes the sum in
// place.
// PIPE-LABEL: func.func @train_step
// PIPE: fsdp.cross_entropy_fused %{{.+}} : tensor<4x256xf32>, tensor<4xi32>
// PIPE: %[[T0:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs {fsdp.offsets = array<i64: [[AT:[0-9]+]]>} : (tensor<4x256xf32>, tensor<4x16xf32>) -> tensor<256x16xf32>
// PIPE: fsdp.cross_entropy_fused %{{.+}} : tensor<4x256xf32>, tensor<4xi32>
// PIPE: fsdp.matmul %{{.+}}, %{{.+}} acc %[[T0]] transpose_lhs {fsdp.chunk_accum, fsdp.offsets = array<i64: [[AT]]>} : (tensor<4x256xf32>, tensor<4x16xf32>, tensor<256x16xf32>) -> tensor<256x16xf32>
// PIPE-NOT: fsdp.cross_entropy_fused
// UNFUSED-LABEL: func.func @train_step
// UNFUSED: %[[T0:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs {fsdp.offsets = array<i64: [[AT:[0-9]+]]>}
// UNFUSED: %[[T1:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs {fsdp.offsets = array<i64: [[AT1:[0-9]+]]>}
// UNFUSED: fsdp.add %[[T0]], %[[T1]] {fsdp.chunk_accum, fsdp.offsets = array<i64: [[AT]]>}
func.func @model(%ids: tensor<2x4xi32> {fsdp.role = "input"}, %y: tensor<2x4xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %e = fsdp.get_param @wte : tensor<256x16xf32>
  %x = fsdp.embedding %e, %ids : (tensor<256x16xf32>, tensor<2x4xi32>) -> tensor<2x4x16xf32>
  %h = fsdp.reshape %x : tensor<2x4x16xf32> -> tensor<8x16xf32>
  %w = fsdp.get_param @wte : tensor<256x16xf32>
  %l = fsdp.matmul %h, %w transpose_rhs : (tensor<8x16xf32>, tensor<256x16xf32>) -> tensor<8x256xf32>
  %l3 = fsdp.reshape %l : tensor<8x256xf32> -> tensor<2x4x256xf32>
  %loss = fsdp.cross_entropy %l3, %y : (tensor<2x4x256xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// An untransposed [C, V] head with a bias, on an input that needs no
// gradient, and ignore_index: each chunk's loss is its kept sum over the
// step's count (the shared normalizer), so the losses add up and every
// chunk takes the step's seed; the weight gradient h^T dl and the bias
// gradient sum_to(dl) are summed over the chunks. (3 chunks of 8 rows: 3,
// 3, 2; 2 chunks: 4 and 4.)
fsdp.param @w : tensor<16x96xf32> init("normal", 0.02)
fsdp.param @b : tensor<96xf32> init("zeros")

// CHECK-LABEL: func.func @train_step
// CHECK: %[[N:.+]] = fsdp.count_labels %arg1 {ignore_index = -100 : i64} : tensor<8xi32>
// CHECK: %[[SEED:.+]] = fsdp.fill {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK: %[[XF:.+]] = fsdp.reshape %arg0 : tensor<8x16xf32> -> tensor<128xf32>
// CHECK: %[[X0:.+]] = fsdp.view %[[XF]] offset = 0 : tensor<128xf32> -> tensor<3x16xf32>
// CHECK: %[[Y0:.+]] = fsdp.view %arg1 offset = 0 : tensor<8xi32> -> tensor<3xi32>
// CHECK: %[[P0:.+]] = fsdp.matmul %[[X0]], %{{.+}} : (tensor<3x16xf32>, tensor<16x96xf32>) -> tensor<3x96xf32>
// CHECK: %[[L0:.+]] = fsdp.bias_add %[[P0]], %{{.+}} : tensor<3x96xf32>, tensor<96xf32>
// CHECK: %[[C0:.+]] = fsdp.cross_entropy %[[L0]], %[[Y0]], %[[N]] {ignore_index = -100 : i64}
// CHECK: %[[D0:.+]] = fsdp.cross_entropy_grad %[[L0]], %[[Y0]], %[[SEED]], %[[N]] {ignore_index = -100 : i64}
// CHECK: %[[DW0:.+]] = fsdp.matmul %[[X0]], %[[D0]] transpose_lhs : (tensor<3x16xf32>, tensor<3x96xf32>) -> tensor<16x96xf32>
// CHECK: %[[DB0:.+]] = fsdp.sum_to %[[D0]] : tensor<3x96xf32> -> tensor<96xf32>
// CHECK: %[[C1:.+]] = fsdp.cross_entropy %{{.+}}, %{{.+}}, %[[N]]
// CHECK: fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %[[SEED]], %[[N]]
// CHECK: %[[DW1:.+]] = fsdp.matmul %{{.+}}, %{{.+}} transpose_lhs
// CHECK: %[[W1:.+]] = fsdp.add %[[DW0]], %[[DW1]] {fsdp.chunk_accum}
// CHECK: %[[DB1:.+]] = fsdp.sum_to
// CHECK: %[[B1:.+]] = fsdp.add %[[DB0]], %[[DB1]] {fsdp.chunk_accum}
// CHECK: %[[C2:.+]] = fsdp.cross_entropy %{{.+}}, %{{.+}}, %[[N]] {ignore_index = -100 : i64} : (tensor<2x96xf32>, tensor<2xi32>, tensor<f32>) -> tensor<f32>
// CHECK: %[[W2:.+]] = fsdp.add %[[W1]], %{{.+}} {fsdp.chunk_accum}
// CHECK: %[[B2:.+]] = fsdp.add %[[B1]], %{{.+}} {fsdp.chunk_accum}
// CHECK: %[[LA:.+]] = fsdp.add %[[C0]], %[[C1]]
// CHECK: %[[LOSS:.+]] = fsdp.add %[[LA]], %[[C2]]
// CHECK-NOT: fsdp.concat
// CHECK: fsdp.set_grad @w = %[[W2]]
// CHECK: fsdp.set_grad @b = %[[B2]]
// CHECK: return %[[LOSS]]
// TWO-LABEL: func.func @train_step
// TWO-NOT: fsdp.scale
// TWO: return
// The pipeline fuses each chunk's product and bias (matmul_bias) as well.
// PIPE-LABEL: func.func @model
// PIPE-LABEL: func.func @train_step
// PIPE-COUNT-2: fsdp.matmul_bias %{{.+}} : (tensor<4x16xf32>, tensor<16x96xf32>, tensor<96xf32>) -> tensor<4x96xf32>
// PIPE-NOT: fsdp.matmul_bias
// AUTO-LABEL: func.func @train_step
// AUTO-NOT: fsdp.view
func.func @model(%x: tensor<8x16xf32> {fsdp.role = "input"}, %y: tensor<8xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<16x96xf32>
  %b = fsdp.get_param @b : tensor<96xf32>
  %p = fsdp.matmul %x, %w : (tensor<8x16xf32>, tensor<16x96xf32>) -> tensor<8x96xf32>
  %l = fsdp.bias_add %p, %b : tensor<8x96xf32>, tensor<96xf32>
  %loss = fsdp.cross_entropy %l, %y {ignore_index = -100 : i64} : (tensor<8x96xf32>, tensor<8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// auto on a narrow head: rows of 4 (the [V, 4] f32 weight gradient's
// bytes), 32 rows in 8 chunks.
fsdp.param @w : tensor<64x4xf32> init("normal", 0.02)

// AUTO-LABEL: func.func @train_step
// AUTO-COUNT-8: fsdp.cross_entropy_grad %{{.+}} : tensor<4x64xf32>, tensor<4xi32>
// AUTO-NOT: fsdp.cross_entropy_grad
func.func @model(%x: tensor<32x4xf32> {fsdp.role = "input"}, %y: tensor<32xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<64x4xf32>
  %l = fsdp.matmul %x, %w transpose_rhs : (tensor<32x4xf32>, tensor<64x4xf32>) -> tensor<32x64xf32>
  %loss = fsdp.cross_entropy %l, %y : (tensor<32x64xf32>, tensor<32xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
