// RUN: fsdp-opt %s -fsdp-mixed-precision="master-dtype=bf16 stochastic-rounding=true" | FileCheck %s --check-prefix=MODEL
// RUN: fsdp-opt %s -fsdp-mixed-precision="master-dtype=bf16 stochastic-rounding=true" -fsdp-autodiff -fsdp-insert-optimizer=optimizer=adamw -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=Z3
// RUN: fsdp-opt %s -fsdp-mixed-precision="master-dtype=bf16 stochastic-rounding=true" -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit" -fsdp-shard="world-size=2 stage=0" | FileCheck %s --check-prefix=DDP8
// RUN: fsdp-opt %s -fsdp-mixed-precision="master-dtype=bf16" -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9" -fsdp-shard="world-size=2 stage=1" | FileCheck %s --check-prefix=NEAREST
// RUN: fsdp-opt %s --fsdp-pipeline="world-size=2 stage=3 param-dtype=bf16 master-dtype=bf16 stochastic-rounding=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT
// RUN: fsdp-opt %s --fsdp-pipeline="world-size=2 stage=3 param-dtype=bf16 stochastic-rounding=true" -o /dev/null 2>&1 | FileCheck %s --check-prefix=REPORT32
// RUN: not fsdp-opt %s -fsdp-mixed-precision="param-dtype=f16 master-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=F16
// RUN: not fsdp-opt %s --fsdp-pipeline="master-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=F16
// RUN: not fsdp-opt %s -fsdp-mixed-precision="master-dtype=f16" 2>&1 | FileCheck %s --check-prefix=KIND
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=lamb param-dtype=bf16 master-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=LAMB
// RUN: not fsdp-opt %s --fsdp-pipeline="optimizer=none param-dtype=bf16 master-dtype=bf16" 2>&1 | FileCheck %s --check-prefix=NOOPT

// Tests master-dtype=bf16: fsdp-mixed-precision records it in the policy;
// fsdp-shard stores each trainable unit in bf16 (a frozen unit keeps its
// declared f32), gathers it without a cast, and its update reads the bf16
// storage, an f32 gradient and f32 (or 8-bit) state, and writes bf16:
// `stochastic_param` with the unit's key and, sharded, the shard's stride
// (the stochastic cast's draws); without stochastic-rounding to nearest.

fsdp.param @w1 : tensor<8x4xf32> init("normal", 0.02) unit "layers.0"
fsdp.param @b1 : tensor<8xf32> init("zeros") unit "layers.0"
fsdp.param @g : tensor<8xf32> init("ones") unit "layers.0" frozen
fsdp.param @w2 : tensor<1x8xf32> init("uniform", 0.3)

// MODEL: module attributes {fsdp.mixed_precision = {master_dtype = bf16, param_dtype = bf16, reduce_dtype = f32, stochastic_rounding}}
// The plan names what a runtime needs to run it.
// RUN: fsdp-opt %s --fsdp-pipeline="world-size=2 stage=3 param-dtype=bf16 master-dtype=bf16 plan=%t.plan report=false" -o /dev/null && FileCheck %s --check-prefix=PLAN < %t.plan
// PLAN: "requires": [
// PLAN-NEXT: "master-bf16"

// Z3: fsdp.unit @layers.0 : tensor<40xbf16> shard tensor<20xbf16>
// Z3: fsdp.unit @layers.0.frozen : tensor<8xf32> shard tensor<4xf32>
// Z3: fsdp.unit @root : tensor<8xbf16> shard tensor<4xbf16>
// Z3: fsdp.state @layers.0.exp_avg : tensor<20xf32>
// Z3-LABEL: func.func @train_step
// The trainable shard is gathered as stored; the frozen one is cast first.
// Z3: %[[S0:.+]] = fsdp.get_unit @layers.0 : tensor<20xbf16>
// Z3-NEXT: fsdp.all_gather %[[S0]] : tensor<20xbf16> -> tensor<40xbf16>
// Z3: %[[F:.+]] = fsdp.get_unit @layers.0.frozen : tensor<4xf32>
// Z3-NEXT: fsdp.cast %[[F]] : tensor<4xf32> -> tensor<4xbf16>
// Z3-NOT: stochastic}
// Z3: %[[P:.+]] = fsdp.get_unit @layers.0 : tensor<20xbf16>
// Z3: %[[NP:.+]], %{{.+}}, %{{.+}} = fsdp.adamw_update %[[P]], %{{.+}} {{{.*}}key = 0 : i64, shard_stride = 20 : i64, stochastic_param} : tensor<20xbf16> grad tensor<20xf32> state tensor<20xf32>
// Z3: fsdp.set_unit @layers.0 = %[[NP]] : tensor<20xbf16>
// Z3: fsdp.adamw_update {{.*}}key = 2 : i64, shard_stride = 4 : i64, stochastic_param} : tensor<4xbf16> grad tensor<4xf32> state tensor<4xf32>

// Stage 0 with 8-bit moments: the whole unit (no stride), packed moments.
// DDP8: fsdp.unit @layers.0 : tensor<{{[0-9]+}}xbf16>
// DDP8-LABEL: func.func @train_step
// DDP8: fsdp.adamw_update {{.*}}{key = 0 : i64, state_block = 256 : i64, stochastic_param} : tensor<{{[0-9]+}}xbf16> grad tensor<{{[0-9]+}}xf32> state tensor<{{[0-9]+}}xi8>

// Rounding to nearest: no draws. SGD's buffer is f32.
// NEAREST-LABEL: func.func @train_step
// NEAREST-NOT: stochastic_param
// NEAREST: fsdp.sgd_momentum_update {{.*}} : tensor<{{[0-9]+}}xbf16> grad tensor<{{[0-9]+}}xf32> state tensor<{{[0-9]+}}xf32>
// NEAREST-NOT: stochastic_param

// The memory report counts 2 bytes a parameter: 20 + 4 elements of the
// shard, and the frozen unit's 4 in f32.
// REPORT: parameters 64 64 B
// REPORT32: parameters 112 112 B

// F16: master-dtype=bf16 stores the trainable parameters in the compute dtype; it needs param-dtype=bf16
// KIND: master-dtype='f16': expected f32 or bf16
// NOOPT: master-dtype=bf16 stores the parameters the optimizer updates in bf16; optimizer=none updates none
// LAMB: master-dtype=bf16 with LAMB is not supported: its trust ratios (fsdp.lamb_norms) read f32 parameters

func.func @model(%x: tensor<2x4xf32> {fsdp.role = "input"}, %t: tensor<2x1xf32> {fsdp.role = "target"}) -> tensor<f32> attributes {fsdp.model} {
  %w1 = fsdp.get_param @w1 : tensor<8x4xf32>
  %b1 = fsdp.get_param @b1 : tensor<8xf32>
  %g = fsdp.get_param @g : tensor<8xf32>
  %y = fsdp.matmul %x, %w1 transpose_rhs : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
  %z = fsdp.bias_add %y, %b1 : tensor<2x8xf32>, tensor<8xf32>
  %z2 = fsdp.bias_add %z, %g : tensor<2x8xf32>, tensor<8xf32>
  %r = fsdp.relu %z2 : tensor<2x8xf32>
  %w2 = fsdp.get_param @w2 : tensor<1x8xf32>
  %o = fsdp.matmul %r, %w2 transpose_rhs : (tensor<2x8xf32>, tensor<1x8xf32>) -> tensor<2x1xf32>
  %l = fsdp.bce_with_logits %o, %t : tensor<2x1xf32> -> tensor<f32>
  return %l : tensor<f32>
}
