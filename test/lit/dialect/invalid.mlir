// RUN: fsdp-opt %s -split-input-file -verify-diagnostics

// Tests that an unknown initializer is rejected.
// expected-error @+1 {{expected init to be one of normal, uniform, zeros, ones; found "gaussian"}}
fsdp.param @w : tensor<4xf32> init("gaussian", 0.1)

// -----
// Tests that normal/uniform need a scale.
// expected-error @+1 {{expected a scale for init "normal"}}
fsdp.param @w : tensor<4xf32> init("normal")

// -----
// expected-error @+1 {{init "zeros" takes no scale}}
fsdp.param @w : tensor<4xf32> init("zeros", 1.0)

// -----
// expected-error @+1 {{expected a non-negative scale}}
fsdp.param @w : tensor<4xf32> init("uniform", -1.0)

// -----
// expected-error @+1 {{expected a non-empty unit name}}
fsdp.param @w : tensor<4xf32> init("ones") unit ""

// -----
// Tests that parameters must be float tensors.
// expected-error @+1 {{failed to satisfy constraint: type attribute of ranked tensor of 32-bit float or bfloat16 type or 16-bit float values}}
fsdp.param @w : tensor<4xi32> init("zeros")

// -----
// Tests that state must shadow an existing parameter of its type.
// expected-error @+1 {{shadows @nope, which is not an fsdp.param or fsdp.unit}}
fsdp.state @m : tensor<4xf32> of @nope kind "exp_avg"

// -----
fsdp.param @w : tensor<4xf32> init("zeros")
// expected-error @+1 {{expected type 'tensor<4xf32>' of the parameter it shadows (or its shape in bf16, or 8-bit moments of it), found 'tensor<5xf32>'}}
fsdp.state @m : tensor<5xf32> of @w kind "exp_avg"

// -----
fsdp.param @w : tensor<64xf32> init("zeros")
// 64 elements' 8-bit moments are 64 codes and a scale a block: 72 bytes
// in blocks of 32, 68 in blocks of 64 to 4096; 70 fits no block.
// expected-error @+1 {{expected type 'tensor<64xf32>' of the parameter it shadows (or its shape in bf16, or 8-bit moments of it), found 'tensor<70xi8>'}}
fsdp.state @m : tensor<70xi8> of @w kind "exp_avg"

// -----
// Tests that a reference to an undefined parameter is an error.
func.func @f() {
  // expected-error @+1 {{refers to undefined parameter @missing}}
  %w = fsdp.get_param @missing : tensor<4xf32>
  return
}

// -----
fsdp.param @w : tensor<4xf32> init("zeros")
func.func @f() {
  // expected-error @+1 {{expected type 'tensor<4xf32>' of @w, found 'tensor<8xf32>'}}
  %w = fsdp.get_param @w : tensor<8xf32>
  return
}

// -----
fsdp.param @w : tensor<4xf32> init("zeros") frozen
func.func @f(%g: tensor<4xf32>) {
  // expected-error @+1 {{@w is frozen and has no gradient}}
  fsdp.set_grad @w = %g : tensor<4xf32>
  return
}

// -----
fsdp.param @w : tensor<4xf32> init("zeros")
func.func @f(%g: tensor<4xf32>) {
  // expected-error @+1 {{expected @w to be an fsdp.state, found fsdp.param}}
  %m = fsdp.get_state @w : tensor<4xf32>
  return
}

// -----
func.func @f(%g: tensor<4xf32>) {
  // expected-error @+1 {{refers to undefined optimizer state @m}}
  fsdp.set_state @m = %g : tensor<4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<3xf32>) {
  // expected-error @+1 {{operand shapes 4x8 and 3 do not broadcast}}
  %0 = fsdp.add %a, %b : (tensor<4x8xf32>, tensor<3xf32>) -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<8xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<4x8xf32>', found 'tensor<8x8xf32>'}}
  %0 = fsdp.mul %a, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<8x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<8xbf16>) {
  // expected-error @+1 {{expected operands of one element type, found 'f32' and 'bf16'}}
  %0 = fsdp.sub %a, %b : (tensor<4x8xf32>, tensor<8xbf16>) -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<4xf32>) {
  // expected-error @+1 {{expected bias of type 'tensor<8xf32>', found 'tensor<4xf32>'}}
  %0 = fsdp.bias_add %a, %b : tensor<4x8xf32>, tensor<4xf32>
  return
}

// -----
// An f32 product is admitted for bf16 / f16 operands only (fsdp-fuse-
// epilogues' widened products), not the other way round or to f16.
func.func @f(%a: tensor<4x8xf32>, %b: tensor<8x4xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<4x4xf32>', found 'tensor<4x4xbf16>'}}
  %0 = fsdp.matmul %a, %b : (tensor<4x8xf32>, tensor<8x4xf32>) -> tensor<4x4xbf16>
  return
}

// -----
// An accumulator has the result's type, and rank-2 products only.
func.func @f(%a: tensor<4x8xf32>, %b: tensor<8x4xf32>, %c: tensor<4x8xf32>) {
  // expected-error @+1 {{expected acc of the result's type 'tensor<4x4xf32>', found 'tensor<4x8xf32>'}}
  %0 = fsdp.matmul %a, %b acc %c : (tensor<4x8xf32>, tensor<8x4xf32>, tensor<4x8xf32>) -> tensor<4x4xf32>
  return
}

// -----
func.func @f(%a: tensor<2x4x8xf32>, %b: tensor<2x8x4xf32>, %c: tensor<2x4x4xf32>) {
  // expected-error @+1 {{accumulates (acc) only rank-2 products, found rank 3}}
  %0 = fsdp.matmul %a, %b acc %c : (tensor<2x4x8xf32>, tensor<2x8x4xf32>, tensor<2x4x4xf32>) -> tensor<2x4x4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xbf16>, %b: tensor<8x4xbf16>) {
  // expected-error @+1 {{expected result of type 'tensor<4x4xbf16>', found 'tensor<4x4xf16>'}}
  %0 = fsdp.matmul %a, %b : (tensor<4x8xbf16>, tensor<8x4xbf16>) -> tensor<4x4xf16>
  return
}

// -----
// matmul_bias_grad's results: one type.
func.func @f(%dy: tensor<8x6xbf16>, %x: tensor<8x4xbf16>) {
  // expected-error @+1 {{expected bias_grad of type 'tensor<6xf32>', found 'tensor<6xbf16>'}}
  %0, %1 = fsdp.matmul_bias_grad %dy, %x transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>) -> (tensor<6x4xf32>, tensor<6xbf16>)
  return
}

// -----
// matmul_bias_grad's accumulators: two (the weight's and the bias's sums),
// each of its result's type.
func.func @f(%dy: tensor<8x6xf32>, %x: tensor<8x4xf32>, %aw: tensor<6x4xf32>) {
  // expected-error @+1 {{expected two accumulators (acc: the weight gradient's and the bias gradient's) or none, found 1}}
  %0, %1 = fsdp.matmul_bias_grad %dy, %x acc %aw transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>, tensor<6x4xf32>) -> (tensor<6x4xf32>, tensor<6xf32>)
  return
}

// -----
func.func @f(%dy: tensor<8x6xbf16>, %x: tensor<8x4xbf16>, %aw: tensor<6x4xf32>, %ab: tensor<6xbf16>) {
  // expected-error @+1 {{expected the bias gradient's accumulator of type 'tensor<6xf32>', found 'tensor<6xbf16>'}}
  %0, %1 = fsdp.matmul_bias_grad %dy, %x acc %aw, %ab transpose_lhs : (tensor<8x6xbf16>, tensor<8x4xbf16>, tensor<6x4xf32>, tensor<6xbf16>) -> (tensor<6x4xf32>, tensor<6xf32>)
  return
}

// -----
func.func @f(%dy: tensor<8x6xf32>, %x: tensor<8x4xf32>, %aw: tensor<4x6xf32>, %ab: tensor<6xf32>) {
  // expected-error @+1 {{expected the weight gradient's accumulator of type 'tensor<6x4xf32>', found 'tensor<4x6xf32>'}}
  %0, %1 = fsdp.matmul_bias_grad %dy, %x acc %aw, %ab transpose_lhs : (tensor<8x6xf32>, tensor<8x4xf32>, tensor<4x6xf32>, tensor<6xf32>) -> (tensor<6x4xf32>, tensor<6xf32>)
  return
}

// -----
// A layer norm's parameter gradients: gamma's type or f32, one type.
func.func @f(%x: tensor<4x8xbf16>, %g: tensor<8xbf16>, %dy: tensor<4x8xbf16>) {
  // expected-error @+1 {{expected d_gamma of type 'tensor<8xbf16>', found 'tensor<8xf16>'}}
  %0:3 = fsdp.layer_norm_grad %x, %g, %dy : tensor<4x8xbf16>, tensor<8xbf16> -> tensor<8xf16>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %g: tensor<8xf32>, %dy: tensor<4x8xf32>) {
  // expected-error @+1 {{expected d_beta of type 'tensor<8xf32>', found 'tensor<8xbf16>'}}
  %0:3 = "fsdp.layer_norm_grad"(%x, %g, %dy) : (tensor<4x8xf32>, tensor<8xf32>, tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<8xf32>, tensor<8xbf16>)
  return
}

// -----
// Tests the matmul shape checks.
func.func @f(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>) {
  // expected-error @+1 {{expected contracting sizes to agree, found 8 (lhs) and 4 (rhs)}}
  %0 = fsdp.matmul %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<2x8x4xf32>) {
  // expected-error @+1 {{expected operands of equal rank 2 or 3, found ranks 2 and 3}}
  %0 = fsdp.matmul %a, %b : (tensor<4x8xf32>, tensor<2x8x4xf32>) -> tensor<4x4xf32>
  return
}

// -----
func.func @f(%a: tensor<2x4x8xf32>, %b: tensor<3x8x4xf32>) {
  // expected-error @+1 {{expected equal batch sizes, found 2 and 3}}
  %0 = fsdp.matmul %a, %b : (tensor<2x4x8xf32>, tensor<3x8x4xf32>) -> tensor<2x4x4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<4x4xf32>', found 'tensor<8x8xf32>'}}
  %0 = fsdp.matmul %a, %b transpose_rhs : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %g: tensor<4xf32>) {
  // expected-error @+1 {{expected gamma of type 'tensor<8xf32>', found 'tensor<4xf32>'}}
  %0 = fsdp.layer_norm %x, %g, %g : tensor<4x8xf32>, tensor<4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %g: tensor<8xf32>) {
  // expected-error @+1 {{expected a positive epsilon}}
  %0 = fsdp.layer_norm %x, %g, %g {epsilon = 0.0 : f64} : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>) {
  // expected-error @+1 {{expected heads to divide the width 64, found heads = 5}}
  %0 = fsdp.attention %x, %x, %x heads = 5 : tensor<2x16x64xf32>
  return
}

// -----
func.func @f(%x: tensor<16x64xf32>) {
  // expected-error @+1 {{expected q, k, v of rank 3 [batch, seq, width], found rank 2}}
  %0 = fsdp.attention %x, %x, %x heads = 4 : tensor<16x64xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x48xf32>) {
  // expected-error @+1 {{expected kv_heads to divide heads = 4, found kv_heads = 3}}
  %0 = fsdp.attention %x, %kv, %kv heads = 4 kv_heads = 3 causal : tensor<2x16x64xf32>, tensor<2x16x48xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x16xf32>) {
  // expected-error @+1 {{expected k and v of type 'tensor<2x16x32xf32>', found 'tensor<2x16x16xf32>'}}
  %0 = fsdp.attention %x, %kv, %kv heads = 4 kv_heads = 2 : tensor<2x16x64xf32>, tensor<2x16x16xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x32xf32>) {
  // Grouped keys need kv_heads: without it they must have the type of q.
  // expected-error @+1 {{expected k and v of type 'tensor<2x16x64xf32>', found 'tensor<2x16x32xf32>'}}
  %0 = fsdp.attention %x, %kv, %kv heads = 4 : tensor<2x16x64xf32>, tensor<2x16x32xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>, %kv: tensor<2x16x32xf32>) {
  %lse = fsdp.fill {value = 0.0 : f64} : tensor<2x4x16xf32>
  // expected-error @+1 {{expected kv_heads to divide heads = 4, found kv_heads = 0}}
  %0:3 = fsdp.attention_grad %x, %kv, %kv, %x, %lse, %x heads = 4 kv_heads = 0 : tensor<2x16x64xf32>, tensor<2x16x32xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>) {
  // expected-error @+1 {{expected lse of type 'tensor<2x4x16xf32>', found 'tensor<2x16x4xf32>'}}
  %0:2 = fsdp.attention %x, %x, %x heads = 4 : tensor<2x16x64xf32> -> tensor<2x16x4xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xbf16>) {
  // expected-error @+1 {{result #1 must be ranked tensor of 32-bit float values}}
  %0:2 = fsdp.attention %x, %x, %x heads = 4 : tensor<2x16x64xbf16> -> tensor<2x4x16xbf16>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>, %lse: tensor<2x16x4xf32>) {
  // attention_grad's lse has the type its q and heads imply.
  // expected-note @-2 {{prior use here}}
  // expected-error @+1 {{use of value '%lse' expects different type than prior uses: 'tensor<2x4x16xf32>' vs 'tensor<2x16x4xf32>'}}
  %0:3 = fsdp.attention_grad %x, %x, %x, %x, %lse, %x heads = 4 : tensor<2x16x64xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %w: tensor<4xf32>) {
  // expected-error @+1 {{expected weight of type 'tensor<8xf32>', found 'tensor<4xf32>'}}
  %0 = fsdp.rms_norm %x, %w epsilon = 1.0e-6 : tensor<4x8xf32>, tensor<4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %w: tensor<8xf32>) {
  // expected-error @+1 {{expected a positive, finite epsilon, found 0}}
  %0 = fsdp.rms_norm %x, %w epsilon = 0.0 : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>, %w: tensor<8xf32>) {
  // epsilon is required: there is no default to disagree about.
  // expected-error @+1 {{expected 'epsilon'}}
  %0 = fsdp.rms_norm %x, %w : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x48xf32>) {
  // 48 / 8 = 6 is even, 48 / 16 = 3 is not.
  // expected-error @+1 {{expected heads to divide the width 48 into heads of even size, found heads = 16}}
  %0 = fsdp.rope %x heads = 16 theta = 10000.0 : tensor<2x16x48xf32>
  return
}

// -----
func.func @f(%x: tensor<32x64xf32>) {
  // expected-error @+1 {{expected an input of rank 3 [batch, seq, heads*head_dim], found 'tensor<32x64xf32>'}}
  %0 = fsdp.rope %x heads = 4 theta = 10000.0 : tensor<32x64xf32>
  return
}

// -----
func.func @f(%x: tensor<2x16x64xf32>) {
  // expected-error @+1 {{expected a finite theta > 1, found 1}}
  %0 = fsdp.rope_grad %x heads = 4 theta = 1.0 : tensor<2x16x64xf32>
  return
}

// -----
func.func @f(%t: tensor<256x64xf32>, %ids: tensor<2x16xi32>) {
  // expected-error @+1 {{expected result of type 'tensor<2x16x64xf32>', found 'tensor<2x16x32xf32>'}}
  %0 = fsdp.embedding %t, %ids : (tensor<256x64xf32>, tensor<2x16xi32>) -> tensor<2x16x32xf32>
  return
}

// -----
func.func @f(%t: tensor<256xf32>, %ids: tensor<2x16xi32>) {
  // expected-error @+1 {{expected a table of rank 2 [vocab, width], found 256}}
  %0 = fsdp.embedding %t, %ids : (tensor<256xf32>, tensor<2x16xi32>) -> tensor<2x16x64xf32>
  return
}

// -----
func.func @f(%t: tensor<256x64xf32>, %ids: tensor<2x16xf32>) {
  // expected-error @+1 {{operand #1 must be ranked tensor of 32-bit signless integer or 64-bit signless integer values}}
  %0 = fsdp.embedding %t, %ids : (tensor<256x64xf32>, tensor<2x16xf32>) -> tensor<2x16x64xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected the element count to be kept, found 32 -> 30}}
  %0 = fsdp.reshape %x : tensor<4x8xf32> -> tensor<5x6xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected the element type to be kept, found 'f32' -> 'f16'}}
  %0 = fsdp.reshape %x : tensor<4x8xf32> -> tensor<32xf16>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected perm to be a permutation of [0, 2)}}
  %0 = fsdp.transpose %x perm = [0, 0] : tensor<4x8xf32> -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected a permutation of 2 dimensions, found 3}}
  %0 = fsdp.transpose %x perm = [0, 1, 2] : tensor<4x8xf32> -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<8x4xf32>', found 'tensor<4x8xf32>'}}
  %0 = fsdp.transpose %x perm = [1, 0] : tensor<4x8xf32> -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{slice of size 4 at offset 6 is out of bounds of size 8}}
  %0 = fsdp.slice %x dim = 1 offset = 6 : tensor<4x8xf32> -> tensor<4x4xf32>
  return
}

// -----
// offset + size overflows int64 (found by fuzz/mlir_fuzzer.cpp): an error,
// not undefined behaviour.
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{slice of size 4 at offset 9223372036854775807 is out of bounds of size 8}}
  %0 = fsdp.slice %x dim = 1 offset = 9223372036854775807 : tensor<4x8xf32> -> tensor<4x4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected dim in [0, 2), found 2}}
  %0 = fsdp.slice %x dim = 2 offset = 0 : tensor<4x8xf32> -> tensor<4x4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected slice of type 'tensor<4x4xf32>', found 'tensor<2x4xf32>'}}
  %0 = fsdp.slice %x dim = 1 offset = 0 : tensor<4x8xf32> -> tensor<2x4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x4xf32>) {
  // expected-error @+1 {{slice of size 4 at offset 2 is out of bounds of size 4}}
  %0 = fsdp.slice_grad %x dim = 0 offset = 2 : tensor<4x4xf32> -> tensor<4x4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<3x2xf32>) {
  // expected-error @+1 {{expected input of type 'tensor<4x2xf32>', found 'tensor<3x2xf32>'}}
  %0 = fsdp.concat %a, %b dim = 1 : (tensor<4x8xf32>, tensor<3x2xf32>) -> tensor<4x10xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %b: tensor<4x2xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<4x10xf32>', found 'tensor<4x9xf32>'}}
  %0 = fsdp.concat %a, %b dim = 1 : (tensor<4x8xf32>, tensor<4x2xf32>) -> tensor<4x9xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected distinct dims in [0, 2), found 2}}
  %0 = fsdp.reduce_sum %x dims = [2] : tensor<4x8xf32> -> tensor<4xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected result of type 'tensor<4xf32>', found 'tensor<8xf32>'}}
  %0 = fsdp.reduce_mean %x dims = [1] : tensor<4x8xf32> -> tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<3x8xf32>) {
  // expected-error @+1 {{cannot broadcast 'tensor<3x8xf32>' to 'tensor<4x8xf32>'}}
  %0 = fsdp.broadcast %x : tensor<3x8xf32> -> tensor<4x8xf32>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected the result 'tensor<3xf32>' to broadcast to the input 'tensor<4x8xf32>'}}
  %0 = fsdp.sum_to %x : tensor<4x8xf32> -> tensor<3xf32>
  return
}

// -----
// sum_to keeps its input's type, or widens bf16 / f16 to f32; never narrows.
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected a result of element type 'f32' (or f32 for a bf16 / f16 input), found 'bf16'}}
  %0 = fsdp.sum_to %x : tensor<4x8xf32> -> tensor<8xbf16>
  return
}

// -----
func.func @f(%x: tensor<4x8xbf16>) {
  // expected-error @+1 {{expected a result of element type 'bf16' (or f32 for a bf16 / f16 input), found 'f16'}}
  %0 = fsdp.sum_to %x : tensor<4x8xbf16> -> tensor<8xf16>
  return
}

// -----
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{expected the shape to be kept, found 4x8 -> 8x4}}
  %0 = fsdp.cast %x : tensor<4x8xf32> -> tensor<8x4xbf16>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %w: tensor<4xf32>) {
  // expected-error @+1 {{weight}}
  %s, %y = fsdp.residual_rms_norm %a, %a, %w epsilon = 1.000000e-05 : tensor<4x8xf32>, tensor<4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %w: tensor<8xf32>) {
  // expected-error @+1 {{expected a positive, finite epsilon, found 0}}
  %dx, %dw = fsdp.rms_norm_grad_acc %a, %w, %a, %a epsilon = 0.000000e+00 : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<8xf32>) {
  // expected-error @+1 {{stochastic rounding converts f32 to bf16, found 'f32' -> 'f16'}}
  %0 = fsdp.cast %x {stochastic, key = 0 : i64} : tensor<8xf32> -> tensor<8xf16>
  return
}

// -----
func.func @f(%x: tensor<8xf32>) {
  // expected-error @+1 {{stochastic rounding needs `key`, an integer >= 0}}
  %0 = fsdp.cast %x {stochastic} : tensor<8xf32> -> tensor<8xbf16>
  return
}

// -----
func.func @f(%x: tensor<8xf32>) {
  // expected-error @+1 {{`key` and `sharded` are the stochastic rounding's; this cast rounds to nearest}}
  %0 = fsdp.cast %x {sharded} : tensor<8xf32> -> tensor<8xbf16>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<16xi32>) {
  // expected-error @+1 {{expected labels of shape 32 (the logits without the class dimension), found 16}}
  %0 = fsdp.cross_entropy %l, %y : (tensor<32x256xf32>, tensor<16xi32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<256xf32>, %y: tensor<i32>) {
  // expected-error @+1 {{expected logits of rank >= 2 [..., classes], found 256}}
  %0 = fsdp.cross_entropy %l, %y : (tensor<256xf32>, tensor<i32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf64>, %y: tensor<32xi32>) {
  // expected-error @+1 {{operand #0 must be ranked tensor of 32-bit float or bfloat16 type or 16-bit float values}}
  %0 = fsdp.cross_entropy %l, %y : (tensor<32x256xf64>, tensor<32xi32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>) {
  // expected-error @+1 {{result #0 must be 0D tensor of 32-bit float values}}
  %0 = fsdp.cross_entropy %l, %y : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<1xf32>
  return
}

// -----
func.func @f(%p: tensor<32x1xbf16>) {
  // expected-error @+1 {{expected f32 operands, found 'bf16'}}
  %0 = fsdp.mse_loss %p, %p : tensor<32x1xbf16> -> tensor<f32>
  return
}

// -----
func.func @f(%ids: tensor<2x16xi32>, %g: tensor<2x16x32xf32>) {
  // expected-error @+1 {{expected grad of type 'tensor<2x16x64xf32>', found 'tensor<2x16x32xf32>'}}
  %0 = fsdp.embedding_grad %ids, %g : (tensor<2x16xi32>, tensor<2x16x32xf32>) -> tensor<256x64xf32>
  return
}

// -----
// embedding_grad keeps its gradient's type, or widens bf16 / f16 to f32.
func.func @f(%ids: tensor<2x16xi32>, %g: tensor<2x16x64xf32>) {
  // expected-error @+1 {{expected a result of element type 'f32' (or f32 for a bf16 / f16 gradient), found 'bf16'}}
  %0 = fsdp.embedding_grad %ids, %g : (tensor<2x16xi32>, tensor<2x16x64xf32>) -> tensor<256x64xbf16>
  return
}

// -----
func.func @f(%ids: tensor<2x16xi32>, %g: tensor<2x16x64xf16>) {
  // expected-error @+1 {{expected a result of element type 'f16' (or f32 for a bf16 / f16 gradient), found 'bf16'}}
  %0 = fsdp.embedding_grad %ids, %g : (tensor<2x16xi32>, tensor<2x16x64xf16>) -> tensor<256x64xbf16>
  return
}

// -----
// Tests that an unknown op is rejected.
func.func @f(%x: tensor<4xf32>) {
  // expected-error @+1 {{custom op 'fsdp.frobnicate' is unknown}}
  %0 = fsdp.frobnicate %x : tensor<4xf32>
  return
}

// -----
// Tests the sharding ops' verifiers.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>} {
  fsdp.param @a : tensor<8xf32> init("zeros")
  // expected-error @+1 {{expected padded size = shard count (4) x shard size, found 8 and 4}}
  fsdp.unit @u : tensor<8xf32> shard tensor<4xf32> numel 8 params [@a]
}

// -----
fsdp.param @a : tensor<8xf32> init("zeros")
// expected-error @+1 {{numel 9 does not fit the padded size 8}}
fsdp.unit @u : tensor<8xf32> shard tensor<2xf32> numel 9 params [@a]

// -----
fsdp.param @a : tensor<8xf32> init("zeros")
fsdp.unit @u : tensor<8xf32> shard tensor<2xf32> numel 8 params [@a] sharded
func.func @f() {
  // expected-error @+1 {{expected the unit's storage type 'tensor<2xf32>', found 'tensor<8xf32>'}}
  %s = fsdp.get_unit @u : tensor<8xf32>
  return
}

// -----
func.func @f(%x: tensor<8xf32>) {
  // expected-error @+1 {{view [6, 10) is out of bounds of 8}}
  %v = fsdp.view %x offset = 6 : tensor<8xf32> -> tensor<2x2xf32>
  return
}

// -----
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>} {
  func.func @f(%x: tensor<3xf32>) {
    // expected-error @+1 {{expected the whole buffer to hold 4 shards of 3, found 9 elements}}
    %v = fsdp.all_gather %x : tensor<3xf32> -> tensor<9xf32>
    return
  }
}

// -----
// Tests that on a 2-D mesh (2 replicas x 3 shards) a collective's group
// sets how many shards the whole buffer holds.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 3>} {
  fsdp.param @a : tensor<6xf32> init("zeros")
  fsdp.unit @u : tensor<6xf32> shard tensor<2xf32> numel 6 params [@a] sharded
  func.func @f(%x: tensor<2xf32>) {
    %ok = fsdp.all_gather %x {group = "shard"} : tensor<2xf32> -> tensor<6xf32>
    %all = fsdp.all_gather %x : tensor<2xf32> -> tensor<12xf32>
    %r = fsdp.all_reduce %x {group = "replica", reduce = "mean"} : tensor<2xf32>
    // expected-error @+1 {{expected the whole buffer to hold 2 shards of 2, found 6 elements}}
    %v = fsdp.all_gather %x {group = "replica"} : tensor<2xf32> -> tensor<6xf32>
    return
  }
}

// -----
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 2>} {
  func.func @f(%x: tensor<2xf32>) {
    // expected-error @+1 {{expected group = "world", "shard", "replica", "reshard", "node" or "cross", found "row"}}
    %r = fsdp.all_reduce %x {group = "row", reduce = "mean"} : tensor<2xf32>
    return
  }
}

// -----
// Tests the reshard group: sizes from the mesh, shard views over it.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 8, reshard = 2>} {
  func.func @f(%x: tensor<4xf32>, %full: tensor<16xf32>) {
    %ok = fsdp.all_gather %x {group = "reshard"} : tensor<4xf32> -> tensor<8xf32>
    %half = fsdp.shard_view %full {group = "reshard"} : tensor<16xf32> -> tensor<8xf32>
    %shard = fsdp.shard_view %full : tensor<16xf32> -> tensor<2xf32>
    // expected-error @+1 {{expected the whole buffer to hold 2 shards of 4, found 16 elements}}
    %v = fsdp.shard_view %full {group = "reshard"} : tensor<16xf32> -> tensor<4xf32>
    return
  }
}

// -----
// Tests that group "reshard" needs a mesh with one.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>} {
  func.func @f(%x: tensor<2xf32>) {
    // expected-error @+1 {{group "reshard" needs a mesh with a reshard group}}
    %v = fsdp.all_gather %x {group = "reshard"} : tensor<2xf32> -> tensor<4xf32>
    return
  }
}

// -----
// Tests that the reshard group divides the shard group and is smaller.
// expected-error @+1 {{mesh reshard group of 3 ranks: expected 1 < reshard < shards (8) and a divisor of it}}
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 8, reshard = 3>} {
}

// -----
// expected-error @+1 {{mesh reshard group of 8 ranks: expected 1 < reshard < shards (8) and a divisor of it}}
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 8, reshard = 8>} {
}

// -----
// Tests the node and cross groups (hierarchical qgZ): 6 shards on nodes of
// 3: a node group of 3, a cross group of 2.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 6, node = 3>} {
  func.func @f(%q: tensor<72xi8>, %c: tensor<24xi8>, %x: tensor<42xf32>, %r: tensor<25xi8>) {
    %a = fsdp.all_to_all %q {group = "node"} : tensor<72xi8> -> tensor<72xi8>
    %b = fsdp.all_to_all %c {group = "cross"} : tensor<24xi8> -> tensor<24xi8>
    %ok = fsdp.quantize %x {block = 8 : i64, chunks = 6 : i64, parts = 3 : i64} : tensor<42xf32> -> tensor<72xi8>
    // expected-error @+1 {{expected 2 equal parts, found 25 elements}}
    %bad = fsdp.all_to_all %r {group = "cross"} : tensor<25xi8> -> tensor<25xi8>
    return
  }
}

// -----
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 6, node = 3>} {
  func.func @f(%x: tensor<42xf32>) {
    // expected-error @+1 {{expected chunks = 4 to be a multiple of parts = 3 (given) dividing the input's 42 values}}
    %q = fsdp.quantize %x {block = 8 : i64, chunks = 4 : i64, parts = 3 : i64} : tensor<42xf32> -> tensor<72xi8>
    return
  }
}

// -----
func.func @f(%x: tensor<42xf32>) {
  // expected-error @+1 {{expected chunks = 6 to be a multiple of parts = 1 (given) dividing the input's 42 values}}
  %q = fsdp.quantize %x {block = 8 : i64, chunks = 6 : i64} : tensor<42xf32> -> tensor<56xi8>
  return
}

// -----
// Tests that groups "node" and "cross" need a mesh with a node size.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>} {
  func.func @f(%q: tensor<80xi8>) {
    // expected-error @+1 {{group "cross" needs a mesh with a node size (#fsdp.mesh<..., node = L>)}}
    %a = fsdp.all_to_all %q {group = "cross"} : tensor<80xi8> -> tensor<80xi8>
    return
  }
}

// -----
// Tests that a node divides the shard group and is smaller.
// expected-error @+1 {{mesh node of 4 ranks: expected 1 < node < shards (6) and a divisor of it}}
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 6, node = 4>} {
}

// -----
// expected-error @+1 {{mesh node of 1 ranks: expected 1 < node < shards (6) and a divisor of it}}
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 2, shards = 6, node = 1>} {
}

// -----
// Tests that a mesh needs at least one replica and one shard.
// expected-error @+1 {{mesh needs replicas >= 1 and shards >= 1, found 0 x 4}}
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 0, shards = 4>} {
}

// -----
func.func @f(%x: tensor<8xf32>) {
  // expected-error @+1 {{expected reduce = "sum" or "mean", found "max"}}
  %v = fsdp.reduce_scatter %x {reduce = "max"} : tensor<8xf32> -> tensor<2xf32>
  return
}

// -----
func.func @f(%a: tensor<4xf32>, %b: tensor<4xf32>) {
  // expected-error @+1 {{input ranges overlap at element 2}}
  %v = fsdp.pack %a, %b offsets = [0, 2] : (tensor<4xf32>, tensor<4xf32>) -> tensor<8xf32>
  return
}

// -----
// Tests that a micro-batch keeps every dimension but the rows.
func.func @f(%x: tensor<8x4xf32>) {
  // expected-error @+1 {{expected the shapes to differ in dimension 0 only, found 'tensor<8x4xf32>' -> 'tensor<4x2xf32>'}}
  %0 = fsdp.microbatch %x index = 0 : tensor<8x4xf32> -> tensor<4x2xf32>
  return
}

// -----
// Tests that the batch must hold a whole number of micro-batches.
func.func @f(%x: tensor<8x4xi32>) {
  // expected-error @+1 {{expected the input's 8 rows to hold a whole number of micro-batches of 3}}
  %0 = fsdp.microbatch %x index = 0 : tensor<8x4xi32> -> tensor<3x4xi32>
  return
}

// -----
// Tests that the micro-batch index is checked against the count.
func.func @f(%x: tensor<8x4xf32>) {
  // expected-error @+1 {{micro-batch index 2 is out of range: the input holds 2}}
  %0 = fsdp.microbatch %x index = 2 : tensor<8x4xf32> -> tensor<4x4xf32>
  return
}

// -----
// Tests that a micro-batch keeps the element type.
func.func @f(%x: tensor<8x4xf32>) {
  // expected-error @+1 {{expected the element type to be kept, found 'f32' -> 'f16'}}
  %0 = fsdp.microbatch %x index = 0 : tensor<8x4xf32> -> tensor<4x4xf16>
  return
}

// -----
// Tests that gelu has two forms only.
func.func @f(%x: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error @+1 {{expected approximate = "tanh" or "none", found "sigmoid"}}
  %y = fsdp.gelu %x {approximate = "sigmoid"} : tensor<4xf32>
  return %y : tensor<4xf32>
}

// -----
// The fused ops of fsdp-fuse-epilogues check their operands like the ops
// they replace: a pre-activation only with gelu, a bias of [N], rank-2
// products, a bias gradient of [N], the layer norms' gamma and epsilon.
func.func @f(%x: tensor<8x4xf32>, %w: tensor<16x4xf32>, %b: tensor<16xf32>) {
  // expected-error @+1 {{has a pre-activation result without gelu}}
  %0:2 = fsdp.matmul_bias %x, %w, %b transpose_rhs : (tensor<8x4xf32>, tensor<16x4xf32>, tensor<16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>)
  return
}

// -----
func.func @f(%x: tensor<8x4xf32>, %w: tensor<16x4xf32>, %b: tensor<8xf32>) {
  // expected-error @+1 {{expected bias of type 'tensor<16xf32>', found 'tensor<8xf32>'}}
  %0 = fsdp.matmul_bias %x, %w, %b transpose_rhs : (tensor<8x4xf32>, tensor<16x4xf32>, tensor<8xf32>) -> tensor<8x16xf32>
  return
}

// -----
func.func @f(%x: tensor<2x8x4xf32>, %w: tensor<2x4x16xf32>, %b: tensor<16xf32>) {
  // expected-error @+1 {{expected rank-2 operands, found ranks 3 and 3}}
  %0 = fsdp.matmul_bias %x, %w, %b : (tensor<2x8x4xf32>, tensor<2x4x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  return
}

// -----
func.func @f(%d: tensor<8x4xf32>, %w: tensor<4x16xf32>, %pre: tensor<8x16xf32>) {
  // expected-error @+1 {{expected bias_grad of type 'tensor<16xf32>', found 'tensor<8xf32>'}}
  %0:2 = fsdp.matmul_gelu_grad %d, %w, %pre : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<8xf32>)
  return
}

// -----
func.func @f(%d: tensor<8x4xf32>, %w: tensor<4x16xf32>, %pre: tensor<8x4xf32>) {
  // expected-error @+1 {{expected pre of type 'tensor<8x16xf32>', found 'tensor<8x4xf32>'}}
  %0 = fsdp.matmul_gelu_grad %d, %w, %pre : (tensor<8x4xf32>, tensor<4x16xf32>, tensor<8x4xf32>) -> tensor<8x16xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %g: tensor<4xf32>) {
  // expected-error @+1 {{expected gamma of type 'tensor<8xf32>', found 'tensor<4xf32>'}}
  %0:2 = fsdp.residual_layer_norm %a, %a, %g, %g : tensor<4x8xf32>, tensor<4xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>, %g: tensor<8xf32>) {
  // expected-error @+1 {{expected a positive epsilon}}
  %0:3 = fsdp.layer_norm_grad_acc %a, %g, %a, %a {epsilon = 0.0 : f64} : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{must be in [0, 1)}}
  %0 = fsdp.dropout %a {p = 1.0 : f64, id = 0 : i64} : tensor<4x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{micro = 2 must be in [0, micro_count = 2)}}
  %0 = fsdp.dropout %a {p = 0.5 : f64, id = 0 : i64, micro = 2 : i64, micro_count = 2 : i64} : tensor<4x8xf32>
  return
}

// -----
func.func @f(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{id = -1 must be >= 0}}
  %0 = fsdp.dropout %a {p = 0.5 : f64, id = -1 : i64} : tensor<4x8xf32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>) {
  // expected-error @+1 {{classes = 257 must lie in [1, 256] (the logits' last dimension)}}
  %0 = fsdp.cross_entropy %l, %y {classes = 257 : i64} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %g: tensor<f32>) {
  // expected-error @+1 {{classes = 0 must lie in [1, 256] (the logits' last dimension)}}
  %0 = fsdp.cross_entropy_grad %l, %y, %g {classes = 0 : i64} : tensor<32x256xf32>, tensor<32xi32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>) {
  // expected-error @+1 {{label_smoothing = 1.500000e+00 must lie in [0, 1]}}
  %0 = fsdp.cross_entropy %l, %y {label_smoothing = 1.5 : f64} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %g: tensor<f32>) {
  // expected-error @+1 {{label_smoothing = -1.000000e-01 must lie in [0, 1]}}
  %0 = fsdp.cross_entropy_grad %l, %y, %g {label_smoothing = -0.1 : f64} : tensor<32x256xf32>, tensor<32xi32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %g: tensor<f32>) {
  // expected-error @+1 {{label_smoothing = nan must lie in [0, 1]}}
  %0:2 = fsdp.cross_entropy_fused %l, %y, %g {label_smoothing = 0x7FF8000000000000 : f64} : tensor<32x256xf32>, tensor<32xi32>
  return
}

// -----
// A normalizer divides by the kept-label count: only with ignore_index.
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %n: tensor<f32>) {
  // expected-error @+1 {{has a normalizer but no ignore_index}}
  %0 = fsdp.cross_entropy %l, %y, %n : (tensor<32x256xf32>, tensor<32xi32>, tensor<f32>) -> tensor<f32>
  return
}

// -----
func.func @f(%l: tensor<32x256xf32>, %y: tensor<32xi32>, %g: tensor<f32>, %n: tensor<f32>) {
  // expected-error @+1 {{has a normalizer but no ignore_index}}
  %0 = fsdp.cross_entropy_grad %l, %y, %g, %n : tensor<32x256xf32>, tensor<32xi32>
  return
}

// -----
func.func @f(%y: tensor<32xi32>) {
  // expected-error @+1 {{divisor = 0 must be >= 1}}
  %0 = fsdp.count_labels %y {ignore_index = -100 : i64, divisor = 0 : i64} : tensor<32xi32>
  return
}

// -----
func.func @f(%y: tensor<32xf32>) {
  // expected-error @+1 {{operand #0 must be ranked tensor of 32-bit signless integer or 64-bit signless integer values}}
  %0 = fsdp.count_labels %y {ignore_index = -100 : i64} : tensor<32xf32>
  return
}

// -----
// LAMB's layout: segments rise strictly from 0.
func.func @f(%p: tensor<40xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{segments must rise strictly, found [0, 32, 32, 40]}}
  %0 = fsdp.lamb_norms %p, %p, %p, %p, %s {segments = array<i64: 0, 32, 32, 40>} : tensor<40xf32> -> tensor<6xf32>
  return
}

// -----
func.func @f(%p: tensor<40xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{segments must start at 0 and name at least one parameter, found [0]}}
  %0 = fsdp.lamb_norms %p, %p, %p, %p, %s {segments = array<i64: 0>} : tensor<40xf32> -> tensor<0xf32>
  return
}

// -----
func.func @f(%p: tensor<40xf32>, %n: tensor<2xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{expected norms of type tensor<4xf32> (two sums for each of the 2 segments), found 'tensor<2xf32>'}}
  %0:3 = fsdp.lamb_update %p, %p, %p, %p, %n, %s, %s {segments = array<i64: 0, 32, 40>} : tensor<40xf32>, tensor<2xf32>
  return
}

// -----
func.func @f(%p: tensor<40xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{segments end at 48 past the operand's 40 elements}}
  %0 = fsdp.lamb_norms %p, %p, %p, %p, %s {segments = array<i64: 0, 48>} : tensor<40xf32> -> tensor<2xf32>
  return
}

// -----
func.func @f(%p: tensor<20xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{decay_numel = 16 falls inside a segment: a parameter decays whole}}
  %0 = fsdp.lamb_norms %p, %p, %p, %p, %s {segments = array<i64: 0, 32, 40>, decay_numel = 16 : i64, shard_stride = 20 : i64} : tensor<20xf32> -> tensor<4xf32>
  return
}

// -----
func.func @f(%p: tensor<40xbf16>, %s: tensor<f32>) {
  // expected-error @+1 {{expected f32 parameters (the master copy), found 'tensor<40xbf16>'}}
  %0 = fsdp.lamb_norms %p, %p, %p, %p, %s {segments = array<i64: 0, 40>} : tensor<40xbf16> -> tensor<2xf32>
  return
}

// -----
// A wait joins only async work: a host update not marked async has none.
func.func @f(%p: tensor<8xf32>, %s: tensor<f32>) {
  %0:3 = fsdp.adamw_update %p, %p, %p, %p, %s, %s {fsdp.on_host} : tensor<8xf32>
  // expected-error @+1 {{expected the result of an async collective, copy or host update}}
  %1 = fsdp.wait %0#0 : tensor<8xf32>
  return
}

// -----

// Tests fsdp.quantize's byte count: 10 values in blocks of 8 take 12
// bytes of int8 values (padded to 4) and two f32 scales.
func.func @f(%x: tensor<10xbf16>) {
  %ok = fsdp.quantize %x {block = 8 : i64} : tensor<10xbf16> -> tensor<20xi8>
  // expected-error @+1 {{expected 20 bytes for 1 x 10 values in blocks of 8}}
  %q = fsdp.quantize %x {block = 8 : i64} : tensor<10xbf16> -> tensor<18xi8>
  return
}

// -----

func.func @f(%x: tensor<10xf32>) {
  // expected-error @+1 {{expected block > 0, found 0}}
  %q = fsdp.quantize %x {block = 0 : i64} : tensor<10xf32> -> tensor<12xi8>
  return
}

// -----

// Tests fsdp.dequantize: the result splits into `parts` of the quantized
// parts' values.
func.func @f(%g: tensor<80xi8>) {
  %ok = fsdp.dequantize %g {block = 8 : i64, parts = 4 : i64} : tensor<80xi8> -> tensor<40xf32>
  // expected-error @+1 {{expected the result's 40 values to split into parts = 3}}
  %w = fsdp.dequantize %g {block = 8 : i64, parts = 3 : i64} : tensor<80xi8> -> tensor<40xf32>
  return
}

// -----

func.func @f(%g: tensor<80xi8>) {
  // expected-error @+1 {{expected 40 bytes for 2 x 10 values in blocks of 8}}
  %w = fsdp.dequantize %g {block = 8 : i64, parts = 2 : i64} : tensor<80xi8> -> tensor<20xbf16>
  return
}

// -----

// Tests fsdp.quantize with parts (qgZ): each part quantized on its own,
// 4 parts of 10 values in blocks of 8 take 4 x 20 bytes.
func.func @f(%x: tensor<40xf32>, %y: tensor<30xf32>) {
  %ok = fsdp.quantize %x {block = 8 : i64, parts = 4 : i64} : tensor<40xf32> -> tensor<80xi8>
  // expected-error @+1 {{expected 60 bytes for 3 x 10 values in blocks of 8}}
  %q = fsdp.quantize %y {block = 8 : i64, parts = 3 : i64} : tensor<30xf32> -> tensor<80xi8>
  return
}

// -----

func.func @f(%x: tensor<40xf32>) {
  // expected-error @+1 {{expected the input's 40 values to split into parts = 3}}
  %q = fsdp.quantize %x {block = 8 : i64, parts = 3 : i64} : tensor<40xf32> -> tensor<80xi8>
  return
}

// -----

// Tests fsdp.dequantize with reduce (qgZ): the parts summed into one
// part's values.
func.func @f(%g: tensor<80xi8>) {
  %ok = fsdp.dequantize %g {block = 8 : i64, parts = 4 : i64, reduce = "mean"} : tensor<80xi8> -> tensor<10xf32>
  // expected-error @+1 {{expected 240 bytes for 4 x 40 values in blocks of 8}}
  %w = fsdp.dequantize %g {block = 8 : i64, parts = 4 : i64, reduce = "sum"} : tensor<80xi8> -> tensor<40xf32>
  return
}

// -----

func.func @f(%g: tensor<80xi8>) {
  // expected-error @+1 {{expected reduce = "sum" or "mean", found "max"}}
  %w = fsdp.dequantize %g {block = 8 : i64, parts = 4 : i64, reduce = "max"} : tensor<80xi8> -> tensor<10xf32>
  return
}

// -----

// Tests fsdp.all_to_all: G equal parts of the mesh's group, one type.
module attributes {fsdp.mesh = #fsdp.mesh<replicas = 1, shards = 4>} {
  func.func @f(%q: tensor<80xi8>, %r: tensor<81xi8>) {
    %ok = fsdp.all_to_all %q : tensor<80xi8> -> tensor<80xi8>
    // expected-error @+1 {{expected 4 equal parts, found 81 elements}}
    %bad = fsdp.all_to_all %r : tensor<81xi8> -> tensor<81xi8>
    return
  }
}

// -----

func.func @f(%q: tensor<80xi8>) {
  // expected-error @+1 {{all of {input, result} have same type}}
  %bad = fsdp.all_to_all %q : tensor<80xi8> -> tensor<80xf32>
  return
}

// -----

// bf16 moments (state-dtype=bf16) are for f32 parameters only.
func.func @f(%p: tensor<8xbf16>, %m: tensor<8xf16>, %s: tensor<f32>) {
  // expected-error @+1 {{moments of 'f16' for parameters of 'bf16': expected the parameter's dtype, or bf16 for f32 parameters}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s : tensor<8xbf16> state tensor<8xf16>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %m: tensor<4xbf16>, %s: tensor<f32>) {
  // expected-error @+1 {{moments 'tensor<4xbf16>' must have the parameter's shape 'tensor<8xf32>'}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s : tensor<8xf32> state tensor<4xbf16>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{stochastic rounds f32 moments to bf16: expected bf16 moments of f32 parameters, found 'f32' of 'f32'}}
  %0:3 = fsdp.adamw_update %p, %p, %p, %p, %s, %s {key = 0 : i64, stochastic} : tensor<8xf32>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %m: tensor<8xbf16>, %s: tensor<f32>) {
  // expected-error @+1 {{stochastic needs a key (its draws' stream)}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {stochastic} : tensor<8xf32> state tensor<8xbf16>
  return
}

// -----

// 8-bit moments (state-dtype=8bit): i8 codes need their block size.
func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{i8 moments are 8-bit block codes: expected state_block}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

// SGD's 8-bit momentum buffer: the same rules, named for the buffer.
func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{i8 buffer is 8-bit block codes: expected state_block}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %m, %s, %s {momentum = 0.9 : f64} : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<64xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit buffer of 64 elements in blocks of 32 is 72 bytes (tensor<72xi8>), found 'tensor<64xi8>'}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %m, %s, %s {momentum = 0.9 : f64, state_block = 32 : i64} : tensor<64xf32> state tensor<64xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit buffer is rounded to the nearest code}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %m, %s, %s {key = 0 : i64, momentum = 0.9 : f64, state_block = 32 : i64, stochastic} : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{state_block must be a power of two in [32, 4096], found 48}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {state_block = 48 : i64} : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<68xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit moments of 64 elements in blocks of 32 are 72 bytes (tensor<72xi8>), found 'tensor<68xi8>'}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {state_block = 32 : i64} : tensor<64xf32> state tensor<68xi8>
  return
}

// -----

func.func @f(%p: tensor<64xbf16>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{state_block keeps the moments of an f32 step in i8, found 'i8' moments of 'bf16' parameters}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {state_block = 32 : i64} : tensor<64xbf16> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit moments are rounded to the nearest code: stochastic and key (but for stochastic_param}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {key = 0 : i64, state_block = 32 : i64, stochastic} : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

// LAMB's 8-bit moments: the same rules, for its norms and its update.
func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{i8 moments are 8-bit block codes: expected state_block}}
  %0 = fsdp.lamb_norms %p, %p, %m, %m, %s {segments = array<i64: 0, 64>} : tensor<64xf32> state tensor<72xi8> -> tensor<2xf32>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<64xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit moments of 64 elements in blocks of 32 are 72 bytes (tensor<72xi8>), found 'tensor<64xi8>'}}
  %0 = fsdp.lamb_norms %p, %p, %m, %m, %s {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32> state tensor<64xi8> -> tensor<2xf32>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %n: tensor<2xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{8-bit moments are rounded to the nearest code}}
  %0:3 = fsdp.lamb_update %p, %p, %m, %m, %n, %s, %s {key = 0 : i64, segments = array<i64: 0, 64>, state_block = 32 : i64, stochastic} : tensor<64xf32>, tensor<2xf32> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<64xf32>, %n: tensor<2xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{state_block keeps the moments of an f32 step in i8, found 'f32' moments of 'f32' parameters}}
  %0:3 = fsdp.lamb_update %p, %p, %m, %m, %n, %s, %s {segments = array<i64: 0, 64>, state_block = 32 : i64} : tensor<64xf32>, tensor<2xf32>
  return
}

// -----

// A state of another dtype than its parameter's (or bf16 beside f32).
fsdp.param @w : tensor<8xbf16> init("zeros")
// expected-error @+1 {{expected type 'tensor<8xbf16>' of the parameter it shadows (or its shape in bf16, or 8-bit moments of it), found 'tensor<8xf32>'}}
fsdp.state @w.m : tensor<8xf32> of @w kind "exp_avg"

// -----

// SGD's momentum buffer in bf16 (state-dtype=bf16): the same rules.
func.func @f(%p: tensor<8xf32>, %b: tensor<8xf16>, %s: tensor<f32>) {
  // expected-error @+1 {{buffer of 'f16' for parameters of 'f32': expected the parameter's dtype, or bf16 for f32 parameters}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %b, %s, %s {momentum = 0.9 : f64} : tensor<8xf32> state tensor<8xf16>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{stochastic rounds f32 buffer to bf16: expected bf16 buffer of f32 parameters, found 'f32' of 'f32'}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %p, %s, %s {key = 0 : i64, momentum = 0.9 : f64, stochastic} : tensor<8xf32>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %b: tensor<8xbf16>, %s: tensor<f32>) {
  // expected-error @+1 {{stochastic needs a key (its draws' stream)}}
  %0:2 = fsdp.sgd_momentum_update %p, %p, %b, %s, %s {momentum = 0.9 : f64, stochastic} : tensor<8xf32> state tensor<8xbf16>
  return
}

// -----

// LAMB's moments in bf16: the same rules; the norms read them and round nothing.
func.func @f(%p: tensor<8xf32>, %m: tensor<8xf16>, %s: tensor<f32>) {
  // expected-error @+1 {{moments of 'f16' for parameters of 'f32': expected the parameter's dtype, or bf16 for f32 parameters}}
  %0 = fsdp.lamb_norms %p, %p, %m, %m, %s {segments = array<i64: 0, 8>} : tensor<8xf32> state tensor<8xf16> -> tensor<2xf32>
  return
}

// -----

func.func @f(%p: tensor<8xf32>, %m: tensor<8xbf16>, %n: tensor<2xf32>, %s: tensor<f32>) {
  // expected-error @+1 {{stochastic needs a key (its draws' stream)}}
  %0:3 = fsdp.lamb_update %p, %p, %m, %m, %n, %s, %s {segments = array<i64: 0, 8>, stochastic} : tensor<8xf32>, tensor<2xf32> state tensor<8xbf16>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<72xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{4-bit moments of 64 elements in blocks of 32 are 40 bytes (tensor<40xi8>), found 'tensor<72xi8>'}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {state_bits = 4 : i64, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
  return
}

// -----

func.func @f(%p: tensor<64xf32>, %m: tensor<40xi8>, %s: tensor<f32>) {
  // expected-error @+1 {{state_bits must be 4 (absent: 8-bit codes), found 2}}
  %0:3 = fsdp.adamw_update %p, %p, %m, %m, %s, %s {state_bits = 2 : i64, state_block = 32 : i64} : tensor<64xf32> state tensor<40xi8>
  return
}
