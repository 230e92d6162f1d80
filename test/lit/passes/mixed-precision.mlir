// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision | FileCheck %s --check-prefix=MODEL
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision=reduce-dtype=bf16 -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3" | FileCheck %s --check-prefix=Z3BF
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision=reduce-dtype=bf16 -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=DDP
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=2 stage=2" | FileCheck %s --check-prefix=Z2
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision=reduce-dtype=bf16 -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw max-grad-norm=1.0" -fsdp-shard="world-size=2 stage=1" | FileCheck %s --check-prefix=CLIP
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3" -fsdp-schedule | FileCheck %s --check-prefix=SCHED
// RUN: fsdp-opt %s --split-input-file -fsdp-mixed-precision="param-dtype=f32 reduce-dtype=bf16" -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=4 stage=3" | FileCheck %s --check-prefix=F32BF
// RUN: fsdp-opt %s --split-input-file --fsdp-pipeline="world-size=4 stage=3 report=false" | FileCheck %s --check-prefix=DEFAULT

// Tests that the model is retyped to bf16 with a cast at each parameter
// read and at the float input a compute op reads; the loss reads f32 and
// the target, read only by the loss, is never rounded.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// MODEL: module attributes {fsdp.mixed_precision = {param_dtype = bf16, reduce_dtype = f32}}
// MODEL-LABEL: func.func @model
// MODEL-SAME: (%[[X:.+]]: tensor<2x4xf32> {fsdp.role = "input"}, %[[T:.+]]: tensor<2x1xf32> {fsdp.role = "target"})
// MODEL: %[[XB:.+]] = fsdp.cast %[[X]] : tensor<2x4xf32> -> tensor<2x4xbf16>
// MODEL: %[[W1:.+]] = fsdp.get_param @w1 : tensor<8x4xf32>
// MODEL: %[[W1B:.+]] = fsdp.cast %[[W1]] : tensor<8x4xf32> -> tensor<8x4xbf16>
// MODEL: %[[Y:.+]] = fsdp.matmul %[[XB]], %[[W1B]] transpose_rhs : (tensor<2x4xbf16>, tensor<8x4xbf16>) -> tensor<2x8xbf16>
// MODEL: fsdp.relu %{{.+}} : tensor<2x8xbf16>
// MODEL: %[[O:.+]] = fsdp.matmul {{.+}} -> tensor<2x1xbf16>
// MODEL: %[[OF:.+]] = fsdp.cast %[[O]] : tensor<2x1xbf16> -> tensor<2x1xf32>
// MODEL-NOT: fsdp.cast %[[T]]
// MODEL: fsdp.bce_with_logits %[[OF]], %[[T]] : tensor<2x1xf32> -> tensor<f32>

// Stage 3: the f32 shard is cast BEFORE its all-gather, so the gather moves
// bf16; gradients are computed in bf16, cast to f32 into the f32 pack
// (reduce-dtype=f32), reduce-scattered in f32 and the f32 shard updated.
// Z3-LABEL: func.func @train_step
// Z3-NOT: fsdp.get_param
// Z3: %[[S0:.+]] = fsdp.get_unit @layers.0 : tensor<10xf32>
// Z3-NEXT: %[[S0B:.+]] = fsdp.cast %[[S0]] : tensor<10xf32> -> tensor<10xbf16>
// Z3-NEXT: %[[F0:.+]] = fsdp.all_gather %[[S0B]] : tensor<10xbf16> -> tensor<40xbf16>
// Z3: fsdp.view %[[F0]] offset = 0 : tensor<40xbf16> -> tensor<8x4xbf16>
// Z3-NOT: fsdp.all_gather %{{.+}} : tensor<{{.+}}xf32>
// Z3: fsdp.bce_with_logits
// Z3: %[[DW:.+]] = fsdp.matmul {{.+}} transpose_lhs : (tensor<2x1xbf16>, tensor<2x8xbf16>) -> tensor<1x8xbf16>
// Z3: %[[DWF:.+]] = fsdp.cast %[[DW]] : tensor<1x8xbf16> -> tensor<1x8xf32>
// Z3: %[[G1:.+]] = fsdp.pack %[[DWF]] offsets = [0] : (tensor<1x8xf32>) -> tensor<8xf32>
// Z3: fsdp.reduce_scatter %[[G1]] {reduce = "mean"} : tensor<8xf32> -> tensor<2xf32>
// Z3: %[[GS0:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xf32> -> tensor<10xf32>
// Z3: %[[P0:.+]] = fsdp.get_unit @layers.0 : tensor<10xf32>
// Z3: fsdp.adamw_update %[[P0]], %[[GS0]], {{.+}} : tensor<10xf32>

// reduce-dtype=bf16: the bf16 gradients are packed as computed (their f32
// casts are gone), reduced in bf16, and the shard is cast to f32 right
// before its update.
// Z3BF: module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>, fsdp.mixed_precision = {param_dtype = bf16, reduce_dtype = bf16}
// Z3BF-LABEL: func.func @train_step
// Z3BF: %[[DW:.+]] = fsdp.matmul {{.+}} -> tensor<1x8xbf16>
// Z3BF-NOT: fsdp.cast %[[DW]]
// Z3BF: %[[G1:.+]] = fsdp.pack %[[DW]] offsets = [0] : (tensor<1x8xbf16>) -> tensor<8xbf16>
// Z3BF: %[[R1:.+]] = fsdp.reduce_scatter %[[G1]] {reduce = "mean"} : tensor<8xbf16> -> tensor<2xbf16>
// Z3BF: %[[R0:.+]] = fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xbf16> -> tensor<10xbf16>
// Z3BF: %[[R0F:.+]] = fsdp.cast %[[R0]] : tensor<10xbf16> -> tensor<10xf32>
// Z3BF: fsdp.adamw_update %{{.+}}, %[[R0F]], {{.+}} : tensor<10xf32>
// Z3BF: %[[R1F:.+]] = fsdp.cast %[[R1]] : tensor<2xbf16> -> tensor<2xf32>
// Z3BF: fsdp.adamw_update %{{.+}}, %[[R1F]], {{.+}} : tensor<2xf32>

// Stage 0 (DDP): the whole f32 unit is cast once where it is first read;
// there is no parameter all-gather; gradients are all-reduced in bf16.
// DDP-LABEL: func.func @train_step
// DDP: %[[U:.+]] = fsdp.get_unit @layers.0 : tensor<40xf32>
// DDP-NEXT: %[[UB:.+]] = fsdp.cast %[[U]] : tensor<40xf32> -> tensor<40xbf16>
// DDP: fsdp.view %[[UB]] offset = 0 : tensor<40xbf16> -> tensor<8x4xbf16>
// DDP-NOT: fsdp.all_gather
// DDP: %[[A:.+]] = fsdp.all_reduce %{{.+}} {reduce = "mean"} : tensor<40xbf16>
// DDP: %[[AF:.+]] = fsdp.cast %[[A]] : tensor<40xbf16> -> tensor<40xf32>
// DDP: fsdp.adamw_update %{{.+}}, %[[AF]], {{.+}} : tensor<40xf32>

// Stages 1/2 (ZeRO's mixed-precision layout): the unit keeps only its f32
// master shard; the shard is cast and gathered in bf16 once per step (half
// the bytes of an f32 gather), and the updated shard is the new storage:
// no f32 all-gather after the update.
// Z2: fsdp.unit @layers.0 : tensor<40xf32> shard tensor<20xf32> {{.*}} sharded
// Z2-LABEL: func.func @train_step
// Z2: %[[U:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// Z2-NEXT: %[[UB:.+]] = fsdp.cast %[[U]] : tensor<20xf32> -> tensor<20xbf16>
// Z2-NEXT: fsdp.all_gather %[[UB]] : tensor<20xbf16> -> tensor<40xbf16>
// Z2: fsdp.reduce_scatter %{{.+}} {reduce = "mean"} : tensor<40xf32> -> tensor<20xf32>
// Z2: fsdp.squared_norm %{{.+}}, %{{.+}} : tensor<20xf32>, tensor<4xf32>
// Z2: %[[M:.+]] = fsdp.get_unit @layers.0 : tensor<20xf32>
// Z2: %[[NP:[^,]+]], {{.*}} = fsdp.adamw_update %[[M]], {{.+}} : tensor<20xf32>
// Z2-NOT: fsdp.all_gather
// Z2: fsdp.set_unit @layers.0 = %[[NP]] : tensor<20xf32>

// Clipping with bf16 reductions: every reduced shard is cast to f32 before
// the global norm.
// CLIP-LABEL: func.func @train_step
// CLIP: %[[R0:.+]] = fsdp.reduce_scatter %{{.+}} : tensor<40xbf16> -> tensor<20xbf16>
// CLIP: %[[R1:.+]] = fsdp.reduce_scatter %{{.+}} : tensor<8xbf16> -> tensor<4xbf16>
// CLIP: %[[C0:.+]] = fsdp.cast %[[R0]] : tensor<20xbf16> -> tensor<20xf32>
// CLIP: %[[C1:.+]] = fsdp.cast %[[R1]] : tensor<4xbf16> -> tensor<4xf32>
// CLIP: fsdp.squared_norm %[[C0]], %[[C1]] : tensor<20xf32>, tensor<4xf32>

// The schedule's prefetch moves the shard read, its cast and the gather
// together: the next unit's cast + gather are issued right after the wait
// of the previous gather.
// SCHED-LABEL: func.func @train_step
// SCHED: %[[F0:.+]] = fsdp.all_gather %{{.+}} {async} : tensor<10xbf16> -> tensor<40xbf16>
// SCHED-NEXT: fsdp.wait %[[F0]] : tensor<40xbf16>
// SCHED-NEXT: %[[S1:.+]] = fsdp.get_unit @root : tensor<2xf32>
// SCHED-NEXT: %[[S1B:.+]] = fsdp.cast %[[S1]] : tensor<2xf32> -> tensor<2xbf16>
// SCHED-NEXT: fsdp.all_gather %[[S1B]] {async} : tensor<2xbf16> -> tensor<8xbf16>

// param-dtype=f32 reduce-dtype=bf16: the model computes in f32; only the
// gradient reduction is bf16 (f32 gradients cast into the bf16 pack).
// F32BF-LABEL: func.func @train_step
// F32BF: fsdp.all_gather %{{.+}} : tensor<10xf32> -> tensor<40xf32>
// F32BF: %[[DW:.+]] = fsdp.matmul {{.+}} -> tensor<1x8xf32>
// F32BF: %[[DWB:.+]] = fsdp.cast %[[DW]] : tensor<1x8xf32> -> tensor<1x8xbf16>
// F32BF: fsdp.pack %[[DWB]] offsets = [0] : (tensor<1x8xbf16>) -> tensor<8xbf16>

// The pipeline's defaults leave the pass out: no casts, no attribute.
// DEFAULT-NOT: fsdp.mixed_precision
// DEFAULT-NOT: fsdp.cast
// DEFAULT-LABEL: func.func @train_step
// DEFAULT-NOT: bf16

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %y = fsdp.matmul %x, %w1 transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %z = fsdp.bias_add %y, %b1 : tensor<2x8xf32>, tensor<8xf32>
  %r = fsdp.relu %z : tensor<2x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<2x8xf32>, tensor<1x8xf32>) -> tensor<2x1xf32>
  %l = fsdp.bce_with_logits %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that a tied parameter (embedding and LM head) is read twice in
// bf16 from one bf16 gather, that cross-entropy reads the bf16 logits (no
// f32 copy: it widens them itself), and that
// the two bf16 gradient contributions are summed in f32.

fsdp.param @wte : tensor<16x4xf32> init("normal", 0.02)

// MODEL-LABEL: func.func @tied
// MODEL: %[[L:.+]] = fsdp.matmul {{.+}} -> tensor<2x16xbf16>
// MODEL-NOT: fsdp.cast %[[L]]
// MODEL: fsdp.cross_entropy %[[L]], %{{.+}} : (tensor<2x16xbf16>, tensor<2xi32>) -> tensor<f32>

// Z3-LABEL: func.func @train_step
// Z3: %[[S:.+]] = fsdp.get_unit @root : tensor<16xf32>
// Z3-NEXT: %[[SB:.+]] = fsdp.cast %[[S]] : tensor<16xf32> -> tensor<16xbf16>
// Z3-NEXT: %[[F:.+]] = fsdp.all_gather %[[SB]] : tensor<16xbf16> -> tensor<64xbf16>
// Z3: fsdp.embedding %{{.+}}, %{{.+}} : (tensor<16x4xbf16>, tensor<2xi32>) -> tensor<2x4xbf16>
// The logits' gradient is written in bf16 and multiplied as it is.
// Z3: %[[DL:.+]] = fsdp.cross_entropy_grad %{{.+}}, %{{.+}}, %{{.+}} : tensor<2x16xbf16>, tensor<2xi32>
// Z3-NEXT: fsdp.matmul %[[DL]], %{{.+}} : (tensor<2x16xbf16>, tensor<16x4xbf16>) -> tensor<2x4xbf16>
// Z3: %[[HEAD:.+]] = fsdp.cast %{{.+}} : tensor<16x4xbf16> -> tensor<16x4xf32>
// Z3: %[[EMB:.+]] = fsdp.cast %{{.+}} : tensor<16x4xbf16> -> tensor<16x4xf32>
// Z3: %[[SUM:.+]] = fsdp.add %[[EMB]], %[[HEAD]] : (tensor<16x4xf32>, tensor<16x4xf32>) -> tensor<16x4xf32>
// Z3: fsdp.pack %[[SUM]] offsets = [0] : (tensor<16x4xf32>) -> tensor<64xf32>

// With reduce-dtype=bf16 the two bf16 contributions are summed in bf16
// (bitwise the f32 sum rounded once) and packed without f32 copies.
// Z3BF-LABEL: func.func @train_step
// Z3BF: %[[EMB:.+]] = fsdp.embedding_grad %{{.+}}, %{{.+}} : (tensor<2xi32>, tensor<2x4xbf16>) -> tensor<16x4xbf16>
// Z3BF-NEXT: %[[SUM:.+]] = fsdp.add %[[EMB]], %{{.+}} : (tensor<16x4xbf16>, tensor<16x4xbf16>) -> tensor<16x4xbf16>
// Z3BF-NEXT: fsdp.pack %[[SUM]] offsets = [0] : (tensor<16x4xbf16>) -> tensor<64xbf16>
// Z3BF-NOT: tensor<16x4xf32>

func.func @tied(%ids: tensor<2xi32> {fsdp.role = "input"}, %labels: tensor<2xi32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %e = fsdp.get_param @wte : tensor<16x4xf32>
  %h = fsdp.embedding %e, %ids : (tensor<16x4xf32>, tensor<2xi32>) -> tensor<2x4xf32>
  %s = fsdp.scale %h {factor = 2.0 : f64} : tensor<2x4xf32>
  %e2 = fsdp.get_param @wte : tensor<16x4xf32>
  %logits = fsdp.matmul %s, %e2 transpose_rhs : (tensor<2x4xf32>, tensor<16x4xf32>) -> tensor<2x16xf32>
  %l = fsdp.cross_entropy %logits, %labels : (tensor<2x16xf32>, tensor<2xi32>) -> tensor<f32>
  return %l : tensor<f32>
}
