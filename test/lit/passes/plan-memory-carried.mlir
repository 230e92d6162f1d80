// RUN: fsdp-opt %s -split-input-file -fsdp-plan-memory -verify-diagnostics
// RUN: fsdp-opt %s -split-input-file -fsdp-plan-memory="host-memory-budget=580" -verify-diagnostics
// RUN: not fsdp-opt %s -split-input-file -fsdp-plan-memory="host-memory-budget=579" 2>&1 | FileCheck %s --check-prefix=HOST
// RUN: not fsdp-opt %s -split-input-file -fsdp-plan-memory="host-memory-budget=1x" 2>&1 | FileCheck %s --check-prefix=BADSIZE

// fsdp-plan-memory and fsdp-offload's next-step. The first module is
// fsdp-offload next-step's output of offload-next-step.mlir: it plans, and
// its host arena is 580 bytes (the master shards, 64, AdamW's moments,
// 128, and the transients, the carried update's operands live through the
// step), so host-memory-budget=580 passes and 579 is an error naming both.
// The second carries a wait on @b, whose update is joined in its own step
// (no async update writes @b back): the compiler refuses it, as fsdp-run
// would at load. So are copy_stream on a wait that is not carried (third)
// and a copy-stream join whose next instruction is the unit's copy made on
// compute (fourth; fsdp-offload's prefetch joins the copy stream only
// before an async copy).

// HOST: error: the host arena (580 B, 580 bytes per rank) exceeds host-memory-budget=579 (579 bytes)
// BADSIZE: error: host-memory-budget='1x' is not a positive size

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded offloaded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded offloaded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%arg0: tensor<8xf32> {fsdp.role = "input"}, %arg1: tensor<f32> {fsdp.role = "lr"}, %arg2: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %0 = fsdp.get_unit @a : tensor<8xf32>
    %1 = fsdp.get_unit @a : tensor<8xf32>
    %2 = fsdp.wait %1 {carried} : tensor<8xf32>
    %3 = fsdp.to_device %0 : tensor<8xf32>
    %4 = fsdp.add %3, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %5 = fsdp.get_unit @b : tensor<8xf32>
    %6 = fsdp.to_device %5 : tensor<8xf32>
    %7 = fsdp.add %6, %4 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %8 = fsdp.relu %7 : tensor<8xf32>
    %9 = fsdp.get_unit @a : tensor<8xf32>
    %10 = fsdp.to_host %8 : tensor<8xf32>
    %11 = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %12 = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %13 = fsdp.to_host %arg1 : tensor<f32>
    %14 = fsdp.to_host %arg2 : tensor<f32>
    %new_param, %new_exp_avg, %new_exp_avg_sq = fsdp.adamw_update %9, %10, %11, %12, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %15 = fsdp.relu %4 : tensor<8xf32>
    %16 = fsdp.get_unit @b : tensor<8xf32>
    %17 = fsdp.to_host %15 : tensor<8xf32>
    %18 = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %19 = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %new_param_0, %new_exp_avg_1, %new_exp_avg_sq_2 = fsdp.adamw_update %16, %17, %18, %19, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %20 = fsdp.wait %new_param_0 : tensor<8xf32>
    %21 = fsdp.to_device %20 : tensor<8xf32>
    %22 = fsdp.add %21, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    fsdp.set_state @a.exp_avg = %new_exp_avg : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %new_exp_avg_sq : tensor<8xf32>
    fsdp.set_unit @a = %new_param : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %new_exp_avg_1 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %new_exp_avg_sq_2 : tensor<8xf32>
    fsdp.set_unit @b = %20 : tensor<8xf32>
    return %22 : tensor<8xf32>
  }
}

// -----

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded offloaded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded offloaded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%arg0: tensor<8xf32> {fsdp.role = "input"}, %arg1: tensor<f32> {fsdp.role = "lr"}, %arg2: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %0 = fsdp.get_unit @a : tensor<8xf32>
    %1 = fsdp.get_unit @a : tensor<8xf32>
    %2 = fsdp.wait %1 {carried} : tensor<8xf32>
    %b0 = fsdp.get_unit @b : tensor<8xf32>
    // expected-error @+1 {{'fsdp.wait' op is carried (joined in the next step) but no async host update writes back @b}}
    %b1 = fsdp.wait %b0 {carried} : tensor<8xf32>
    %3 = fsdp.to_device %0 : tensor<8xf32>
    %4 = fsdp.add %3, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %5 = fsdp.get_unit @b : tensor<8xf32>
    %6 = fsdp.to_device %5 : tensor<8xf32>
    %7 = fsdp.add %6, %4 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %8 = fsdp.relu %7 : tensor<8xf32>
    %9 = fsdp.get_unit @a : tensor<8xf32>
    %10 = fsdp.to_host %8 : tensor<8xf32>
    %11 = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %12 = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %13 = fsdp.to_host %arg1 : tensor<f32>
    %14 = fsdp.to_host %arg2 : tensor<f32>
    %new_param, %new_exp_avg, %new_exp_avg_sq = fsdp.adamw_update %9, %10, %11, %12, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %15 = fsdp.relu %4 : tensor<8xf32>
    %16 = fsdp.get_unit @b : tensor<8xf32>
    %17 = fsdp.to_host %15 : tensor<8xf32>
    %18 = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %19 = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %new_param_0, %new_exp_avg_1, %new_exp_avg_sq_2 = fsdp.adamw_update %16, %17, %18, %19, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %20 = fsdp.wait %new_param_0 : tensor<8xf32>
    %21 = fsdp.to_device %20 : tensor<8xf32>
    %22 = fsdp.add %21, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    fsdp.set_state @a.exp_avg = %new_exp_avg : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %new_exp_avg_sq : tensor<8xf32>
    fsdp.set_unit @a = %new_param : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %new_exp_avg_1 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %new_exp_avg_sq_2 : tensor<8xf32>
    fsdp.set_unit @b = %20 : tensor<8xf32>
    return %22 : tensor<8xf32>
  }
}

// -----

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded offloaded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded offloaded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%arg0: tensor<8xf32> {fsdp.role = "input"}, %arg1: tensor<f32> {fsdp.role = "lr"}, %arg2: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %0 = fsdp.get_unit @a : tensor<8xf32>
    %1 = fsdp.get_unit @a : tensor<8xf32>
    %2 = fsdp.wait %1 {carried} : tensor<8xf32>
    %3 = fsdp.to_device %0 : tensor<8xf32>
    %4 = fsdp.add %3, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %5 = fsdp.get_unit @b : tensor<8xf32>
    %6 = fsdp.to_device %5 : tensor<8xf32>
    %7 = fsdp.add %6, %4 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %8 = fsdp.relu %7 : tensor<8xf32>
    %9 = fsdp.get_unit @a : tensor<8xf32>
    %10 = fsdp.to_host %8 : tensor<8xf32>
    %11 = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %12 = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %13 = fsdp.to_host %arg1 : tensor<f32>
    %14 = fsdp.to_host %arg2 : tensor<f32>
    %new_param, %new_exp_avg, %new_exp_avg_sq = fsdp.adamw_update %9, %10, %11, %12, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %15 = fsdp.relu %4 : tensor<8xf32>
    %16 = fsdp.get_unit @b : tensor<8xf32>
    %17 = fsdp.to_host %15 : tensor<8xf32>
    %18 = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %19 = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %new_param_0, %new_exp_avg_1, %new_exp_avg_sq_2 = fsdp.adamw_update %16, %17, %18, %19, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    // expected-error @+1 {{'fsdp.wait' op has copy_stream, which only a carried fsdp.wait may have}}
    %20 = fsdp.wait %new_param_0 {copy_stream} : tensor<8xf32>
    %21 = fsdp.to_device %20 : tensor<8xf32>
    %22 = fsdp.add %21, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    fsdp.set_state @a.exp_avg = %new_exp_avg : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %new_exp_avg_sq : tensor<8xf32>
    fsdp.set_unit @a = %new_param : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %new_exp_avg_1 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %new_exp_avg_sq_2 : tensor<8xf32>
    fsdp.set_unit @b = %20 : tensor<8xf32>
    return %22 : tensor<8xf32>
  }
}

// -----

module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 1>, fsdp.stage = 3 : i64} {
  fsdp.param @w : tensor<8xf32> init("normal", 5.000000e-01) unit "a"
  fsdp.param @w2 : tensor<8xf32> init("normal", 5.000000e-01) unit "b"
  fsdp.unit @a : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w] sharded offloaded
  fsdp.unit @b : tensor<8xf32> shard tensor<8xf32> numel 8 params [@w2] sharded offloaded
  fsdp.state @a.exp_avg : tensor<8xf32> of @a kind "exp_avg"
  fsdp.state @a.exp_avg_sq : tensor<8xf32> of @a kind "exp_avg_sq"
  fsdp.state @b.exp_avg : tensor<8xf32> of @b kind "exp_avg"
  fsdp.state @b.exp_avg_sq : tensor<8xf32> of @b kind "exp_avg_sq"
  func.func @train_step(%arg0: tensor<8xf32> {fsdp.role = "input"}, %arg1: tensor<f32> {fsdp.role = "lr"}, %arg2: tensor<f32> {fsdp.role = "step"}) -> tensor<8xf32> attributes {fsdp.train_step} {
    %0 = fsdp.get_unit @a : tensor<8xf32>
    %1 = fsdp.get_unit @a : tensor<8xf32>
    // expected-error @+1 {{'fsdp.wait' op joins on the copy stream (copy_stream) but the next instruction is not an async fsdp.to_device of @a}}
    %2 = fsdp.wait %1 {carried, copy_stream} : tensor<8xf32>
    %3 = fsdp.to_device %0 : tensor<8xf32>
    %4 = fsdp.add %3, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %5 = fsdp.get_unit @b : tensor<8xf32>
    %6 = fsdp.to_device %5 : tensor<8xf32>
    %7 = fsdp.add %6, %4 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %8 = fsdp.relu %7 : tensor<8xf32>
    %9 = fsdp.get_unit @a : tensor<8xf32>
    %10 = fsdp.to_host %8 : tensor<8xf32>
    %11 = fsdp.get_state @a.exp_avg : tensor<8xf32>
    %12 = fsdp.get_state @a.exp_avg_sq : tensor<8xf32>
    %13 = fsdp.to_host %arg1 : tensor<f32>
    %14 = fsdp.to_host %arg2 : tensor<f32>
    %new_param, %new_exp_avg, %new_exp_avg_sq = fsdp.adamw_update %9, %10, %11, %12, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %15 = fsdp.relu %4 : tensor<8xf32>
    %16 = fsdp.get_unit @b : tensor<8xf32>
    %17 = fsdp.to_host %15 : tensor<8xf32>
    %18 = fsdp.get_state @b.exp_avg : tensor<8xf32>
    %19 = fsdp.get_state @b.exp_avg_sq : tensor<8xf32>
    %new_param_0, %new_exp_avg_1, %new_exp_avg_sq_2 = fsdp.adamw_update %16, %17, %18, %19, %13, %14 {async, fsdp.on_host} : tensor<8xf32>
    %20 = fsdp.wait %new_param_0 : tensor<8xf32>
    %21 = fsdp.to_device %20 : tensor<8xf32>
    %22 = fsdp.add %21, %arg0 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    fsdp.set_state @a.exp_avg = %new_exp_avg : tensor<8xf32>
    fsdp.set_state @a.exp_avg_sq = %new_exp_avg_sq : tensor<8xf32>
    fsdp.set_unit @a = %new_param : tensor<8xf32>
    fsdp.set_state @b.exp_avg = %new_exp_avg_1 : tensor<8xf32>
    fsdp.set_state @b.exp_avg_sq = %new_exp_avg_sq_2 : tensor<8xf32>
    fsdp.set_unit @b = %20 : tensor<8xf32>
    return %22 : tensor<8xf32>
  }
}
