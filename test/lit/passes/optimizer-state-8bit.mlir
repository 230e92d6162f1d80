// AdamW's and LAMB's moments (and SGD's momentum buffer) in 8-bit block codes
// (fsdp-insert-optimizer state-dtype=8bit): each one packed i8 state of its parameter's
// codes and block scales (shapes::quantizedBytes: 32 elements in blocks of
// 32 are 32 + 4 bytes, 8 are 8 + 4), the update carrying state_block and
// no stochastic rounding; fsdp-shard pads the trainable unit to whole
// blocks per shard (40 elements on 2 ranks in blocks of 32: 64, shards of
// 32) and packs each shard's moments. SGD with momentum packs its buffer
// alike, and LAMB its moments (its lamb_norms reads them packed and takes
// state_block too); SGD without momentum and optimizer=none (no state)
// and a block that is not a power of two in [32, 4096] are refused; the
// plan requires the feature.
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit state-block=32" | FileCheck %s --check-prefix=INSERT
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit state-block=32" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=SHARD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit state-block=32" -fsdp-group-units -fsdp-shard="world-size=1 stage=0" | FileCheck %s --check-prefix=ONE
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd momentum=0.9 state-dtype=8bit state-block=32" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=MOMENTUM
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=sgd state-dtype=8bit" 2>&1 | FileCheck %s --check-prefix=SGD
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb state-dtype=8bit state-block=32" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=LAMB
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=none state-dtype=8bit" 2>&1 | FileCheck %s --check-prefix=NONE
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit state-block=48" 2>&1 | FileCheck %s --check-prefix=BLOCK
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=8bit state-block=8192" 2>&1 | FileCheck %s --check-prefix=BLOCK
// RUN: fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw optimizer-state-dtype=8bit world-size=2 stage=1 plan=%t.plan report=false"
// RUN: %python -c "import json,sys; p=json.load(open(sys.argv[1])); print('requires', p.get('requires'), 'options', p['options']['state_dtype'], p['options']['state_block'], 'states', sorted({p['buffers'][s['buffer']]['dtype'] for s in p['states']}))" %t.plan | FileCheck %s --check-prefix=PLAN
// 4-bit (state-dtype=4bit, AdamW only): codes two a byte (a shard of 32 in
// blocks of 32: 16 + 4 bytes), the update carrying state_bits = 4 beside
// state_block; the block defaults to 128; another optimizer is refused;
// the plan requires optimizer-state-4bit.
// RUN: fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=adamw state-dtype=4bit state-block=32" -fsdp-group-units -fsdp-shard="world-size=2 stage=3" | FileCheck %s --check-prefix=FOUR
// RUN: not fsdp-opt %s -fsdp-autodiff -fsdp-insert-optimizer="optimizer=lamb state-dtype=4bit" 2>&1 | FileCheck %s --check-prefix=FOURLAMB
// RUN: fsdp-opt %s -o /dev/null --fsdp-pipeline="optimizer=adamw optimizer-state-dtype=4bit world-size=2 stage=3 plan=%t4.plan report=false"
// RUN: %python -c "import json,sys; p=json.load(open(sys.argv[1])); print('requires', p.get('requires'), 'options', p['options']['state_dtype'], p['options']['state_block'], p['options']['state_bits'], 'bytes', sorted({p['buffers'][s['buffer']]['bytes'] for s in p['states']}))" %t4.plan | FileCheck %s --check-prefix=FOURPLAN

// INSERT: fsdp.state @w.exp_avg : tensor<36xi8> of @w kind "exp_avg"
// INSERT: fsdp.state @w.exp_avg_sq : tensor<36xi8> of @w kind "exp_avg_sq"
// INSERT: fsdp.state @b.exp_avg : tensor<12xi8> of @b kind "exp_avg"
// INSERT: fsdp.get_state @w.exp_avg : tensor<36xi8>
// INSERT: fsdp.adamw_update {{.*}} {state_block = 32 : i64} : tensor<8x4xf32> state tensor<36xi8>
// INSERT: fsdp.set_state @w.exp_avg = %{{.*}} : tensor<36xi8>
// INSERT: fsdp.adamw_update {{.*}} {state_block = 32 : i64} : tensor<8xf32> state tensor<12xi8>

// SHARD: fsdp.unit @root : tensor<64xf32> shard tensor<32xf32> numel 40
// SHARD: fsdp.state @root.exp_avg : tensor<36xi8> of @root kind "exp_avg"
// SHARD: fsdp.state @root.exp_avg_sq : tensor<36xi8> of @root kind "exp_avg_sq"
// SHARD: fsdp.adamw_update
// SHARD-NOT: stochastic
// SHARD-SAME: state_block = 32 : i64} : tensor<32xf32> state tensor<36xi8>

// ONE: fsdp.unit @root : tensor<64xf32> shard tensor<64xf32> numel 40
// ONE: fsdp.state @root.exp_avg : tensor<72xi8> of @root kind "exp_avg"

// MOMENTUM: fsdp.unit @root : tensor<64xf32> shard tensor<32xf32> numel 40
// MOMENTUM: fsdp.state @root.momentum_buffer : tensor<36xi8> of @root kind "momentum_buffer"
// MOMENTUM: fsdp.sgd_momentum_update
// MOMENTUM-SAME: state_block = 32 : i64} : tensor<32xf32> state tensor<36xi8>

// LAMB: fsdp.unit @root : tensor<64xf32> shard tensor<32xf32> numel 40
// LAMB: fsdp.state @root.exp_avg : tensor<36xi8> of @root kind "exp_avg"
// LAMB: fsdp.state @root.exp_avg_sq : tensor<36xi8> of @root kind "exp_avg_sq"
// LAMB: fsdp.lamb_norms
// LAMB-SAME: state_block = 32 : i64} : tensor<32xf32> state tensor<36xi8> -> tensor<4xf32>
// LAMB: fsdp.all_reduce
// LAMB: fsdp.lamb_update
// LAMB-NOT: stochastic
// LAMB-SAME: state_block = 32 : i64} : tensor<32xf32>, tensor<4xf32> state tensor<36xi8>

// SGD: state-dtype=8bit keeps AdamW's and LAMB's moments or SGD's momentum buffer in 8-bit block codes; optimizer=sgd without momentum keeps no state
// NONE: state-dtype=8bit keeps AdamW's and LAMB's moments or SGD's momentum buffer in 8-bit block codes; optimizer=none keeps no state
// BLOCK: state-block must be a power of two in [32, 4096], found

// PLAN: requires ['optimizer-state-8bit'] options 8bit 256 states ['i8']

fsdp.param @w : tensor<8x4xf32> init("normal", 0.02)
fsdp.param @b : tensor<8xf32> init("zeros")

func.func @model(%x: tensor<16x4xf32>, %y: tensor<16x8xf32>) -> tensor<f32> attributes {fsdp.model} {
  %w = fsdp.get_param @w : tensor<8x4xf32>
  %f = fsdp.get_param @b : tensor<8xf32>
  %h = fsdp.matmul %x, %w transpose_rhs : (tensor<16x4xf32>, tensor<8x4xf32>) -> tensor<16x8xf32>
  %hb = fsdp.bias_add %h, %f : tensor<16x8xf32>, tensor<8xf32>
  %l = fsdp.mse_loss %hb, %y : tensor<16x8xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// FOUR: fsdp.unit @root : tensor<64xf32> shard tensor<32xf32> numel 40
// FOUR: fsdp.state @root.exp_avg : tensor<20xi8> of @root kind "exp_avg"
// FOUR: fsdp.state @root.exp_avg_sq : tensor<20xi8> of @root kind "exp_avg_sq"
// FOUR: fsdp.adamw_update
// FOUR-SAME: {state_bits = 4 : i64, state_block = 32 : i64} : tensor<32xf32> state tensor<20xi8>
// FOURLAMB: state-dtype=4bit keeps AdamW's moments in 4-bit block codes (torchao's AdamW4bit); optimizer=lamb has no 4-bit state here: use state-dtype=8bit
// FOURPLAN: requires ['optimizer-state-4bit'] options 4bit 128 4 bytes [68]
