//===- FsdpOps.td - operations of the fsdp dialect -----------*- tablegen -*-===//
//
// Ops fall in five groups: module-level state (params, optimizer state and
// their accessors), forward compute, losses, the backward-only ops the
// autodiff pass emits (vector-Jacobian products that are cheaper fused), and
// optimizer updates. Every op verifies shapes and dtypes and names what it
// expected and what it found.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_OPS_TD
#define FSDP_OPS_TD

include "dialects/fsdp/FsdpDialect.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/Interfaces/InferTypeOpInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

//===----------------------------------------------------------------------===//
// Module-level state
//===----------------------------------------------------------------------===//

def Fsdp_ParamOp : Fsdp_Op<"param", [Symbol]> {
  let summary = "a model parameter: shape, dtype, initializer, unit";
  let description = [{
    Declares one parameter of the model at module level. `init` is one of
    `normal` (scale = standard deviation), `uniform` (values in
    [-scale, scale]), `zeros` or `ones`. `unit` names the layer the
    parameter belongs to (for example "layers.3"); the FSDP wrap policy
    groups parameters by it. `frozen` parameters get no gradient and no
    optimizer state.

    ```mlir
    fsdp.param @"layers.0.fc1.weight" : tensor<64x64xf32> init("normal", 0.02) unit "layers.0"
    fsdp.param @"ln.bias" : tensor<64xf32> init("zeros") frozen
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       TypeAttrOf<Fsdp_FloatTensor>:$type,
                       StrAttr:$init,
                       OptionalAttr<F64Attr>:$scale,
                       OptionalAttr<StrAttr>:$unit,
                       UnitAttr:$frozen);
  let assemblyFormat = [{
    $sym_name `:` $type `init` `(` $init (`,` $scale^)? `)`
    (`unit` $unit^)? (`frozen` $frozen^)? attr-dict
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::RankedTensorType getTensorType() {
      return ::llvm::cast<::mlir::RankedTensorType>(getType());
    }
    bool isTrainable() { return !getFrozen(); }
  }];
}

def Fsdp_StateOp : Fsdp_Op<"state", [Symbol]> {
  let summary = "optimizer state that shadows one parameter";
  let description = [{
    Optimizer state (momentum buffer, Adam moments) created by
    `fsdp-insert-optimizer`. It has the shape of the parameter it shadows,
    starts at zero, and is sharded with that parameter. Its dtype is the
    parameter's, or bf16 for an f32 parameter (`state-dtype=bf16`); or,
    AdamW's moments and SGD's momentum buffer of an f32 parameter with
    `state-dtype=8bit`, a packed i8 vector of its 8-bit codes and block
    scales (fsdp.adamw_update's and fsdp.sgd_momentum_update's
    `state_block`).

    ```mlir
    fsdp.state @"fc1.weight.exp_avg" : tensor<64x64xf32> of @"fc1.weight" kind "exp_avg"
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       TypeAttrOf<Fsdp_StateTensor>:$type,
                       FlatSymbolRefAttr:$param,
                       StrAttr:$kind);
  let assemblyFormat = "$sym_name `:` $type `of` $param `kind` $kind attr-dict";
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::RankedTensorType getTensorType() {
      return ::llvm::cast<::mlir::RankedTensorType>(getType());
    }
  }];
}

class Fsdp_SymbolReadOp<string mnemonic, TypeConstraint valueType = Fsdp_FloatTensor>
    : Fsdp_Op<mnemonic, [DeclareOpInterfaceMethods<SymbolUserOpInterface>,
                         MemoryEffects<[MemRead]>]> {
  let arguments = (ins FlatSymbolRefAttr:$name);
  let results = (outs valueType:$result);
  let assemblyFormat = "$name attr-dict `:` type($result)";
}

class Fsdp_SymbolWriteOp<string mnemonic, TypeConstraint valueType = Fsdp_FloatTensor>
    : Fsdp_Op<mnemonic, [DeclareOpInterfaceMethods<SymbolUserOpInterface>,
                         MemoryEffects<[MemWrite]>]> {
  let arguments = (ins FlatSymbolRefAttr:$name, valueType:$value);
  let assemblyFormat = "$name `=` $value attr-dict `:` type($value)";
}

def Fsdp_GetParamOp : Fsdp_SymbolReadOp<"get_param"> {
  let summary = "reads the current value of a parameter";
  let description = [{
    ```mlir
    %w = fsdp.get_param @"fc1.weight" : tensor<64x64xf32>
    ```
    The symbol must name an `fsdp.param` of exactly the result type.
  }];
}

def Fsdp_SetParamOp : Fsdp_SymbolWriteOp<"set_param"> {
  let summary = "writes the new value of a parameter (optimizer update)";
  let description = [{
    ```mlir
    fsdp.set_param @"fc1.weight" = %new : tensor<64x64xf32>
    ```
  }];
}

def Fsdp_GetStateOp : Fsdp_SymbolReadOp<"get_state", Fsdp_StateTensor> {
  let summary = "reads optimizer state";
  let description = [{
    ```mlir
    %m = fsdp.get_state @"fc1.weight.exp_avg" : tensor<64x64xf32>
    ```
  }];
}

def Fsdp_SetStateOp : Fsdp_SymbolWriteOp<"set_state", Fsdp_StateTensor> {
  let summary = "writes optimizer state";
  let description = [{
    ```mlir
    fsdp.set_state @"fc1.weight.exp_avg" = %m2 : tensor<64x64xf32>
    ```
  }];
}

def Fsdp_SetGradOp : Fsdp_SymbolWriteOp<"set_grad"> {
  let summary = "publishes the gradient of a trainable parameter";
  let description = [{
    Emitted by `fsdp-autodiff`: `%g` is d(loss)/d(param) for this step.
    `fsdp-insert-optimizer` consumes it. The symbol must name a trainable
    `fsdp.param` of the same type.

    ```mlir
    fsdp.set_grad @"fc1.weight" = %g : tensor<64x64xf32>
    ```
  }];
}

//===----------------------------------------------------------------------===//
// Elementwise and shape ops
//===----------------------------------------------------------------------===//

class Fsdp_BinaryOp<string mnemonic, string what>
    : Fsdp_Op<mnemonic, [Pure]> {
  let summary = "elementwise " # what # " with NumPy broadcasting";
  let description = [{
    Broadcasting follows NumPy: shapes are aligned at the trailing
    dimension; each pair of sizes must be equal or one of them 1; a missing
    leading dimension counts as 1. The result has the broadcast shape and
    the operands' element type (both operands must have the same one).

    ```mlir
    %c = fsdp.}] # mnemonic # [{ %a, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Fsdp_AddOp : Fsdp_BinaryOp<"add", "addition">;
def Fsdp_SubOp : Fsdp_BinaryOp<"sub", "subtraction">;
def Fsdp_MulOp : Fsdp_BinaryOp<"mul", "multiplication">;
def Fsdp_DivOp : Fsdp_BinaryOp<"div", "division">;

class Fsdp_UnaryOp<string mnemonic, string sum, string ex>
    : Fsdp_Op<mnemonic, [Pure, SameOperandsAndResultType]> {
  let summary = sum;
  let description = "```mlir\n" # ex # "\n```";
  let arguments = (ins Fsdp_FloatTensor:$input);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
}

def Fsdp_NegOp : Fsdp_UnaryOp<"neg", "elementwise negation",
    "%y = fsdp.neg %x : tensor<4x8xf32>">;
def Fsdp_ReluOp : Fsdp_UnaryOp<"relu", "rectified linear unit, max(x, 0)",
    "%y = fsdp.relu %x : tensor<4x8xf32>">;
def Fsdp_GeluOp : Fsdp_Op<"gelu", [Pure, SameOperandsAndResultType]> {
  let summary = "GELU: tanh form (default) or exact (erf)";
  let description = [{
    `approximate = "tanh"` (the default, GPT-2's and PyTorch's
    approximate='tanh'): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    `approximate = "none"` (nn.GELU()'s default): 0.5 x (1 + erf(x / sqrt(2))).

    ```mlir
    %y = fsdp.gelu %x : tensor<4x8xf32>
    %z = fsdp.gelu %x {approximate = "none"} : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input,
                       DefaultValuedAttr<StrAttr, "\"tanh\"">:$approximate);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let hasVerifier = 1;
}
def Fsdp_SoftmaxOp : Fsdp_UnaryOp<"softmax",
    "softmax over the last dimension (max-subtracted)",
    "%y = fsdp.softmax %x : tensor<4x8xf32>">;
def Fsdp_SiluOp : Fsdp_UnaryOp<"silu",
    "SiLU (swish), x * sigmoid(x); Llama's SwiGLU MLP is silu(gate) * up",
    "%y = fsdp.silu %x : tensor<4x8xf32>">;

def Fsdp_SwigluOp : Fsdp_Op<"swiglu", [Pure, SameOperandsAndResultType]> {
  let summary = "SwiGLU's gate: silu(gate) * up in one pass (fsdp-fuse-epilogues)";
  let description = [{
    What fsdp-fuse-epilogues makes of `fsdp.mul (fsdp.silu %g), %u` when
    its backward pass fuses into `fsdp.swiglu_grad`: silu(gate) is never
    stored, so the step neither writes nor keeps it for the backward pass
    (one [tokens, ffn] tensor per layer less; Llama's MLP).

    ```mlir
    %h = fsdp.swiglu %g, %u : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$gate, Fsdp_FloatTensor:$up);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$gate `,` $up attr-dict `:` type($result)";
}

def Fsdp_ScaleOp : Fsdp_Op<"scale", [Pure, SameOperandsAndResultType]> {
  let summary = "multiplies every element by a constant";
  let description = [{
    ```mlir
    %y = fsdp.scale %x {factor = 5.000000e-01 : f64} : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, F64Attr:$factor);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
}

def Fsdp_DropoutOp : Fsdp_Op<"dropout", [Pure, SameOperandsAndResultType]> {
  let summary = "inverted dropout with a counter-based mask (training only)";
  let description = [{
    y = x * keep / (1 - p), where keep is 0 for a fraction p of the
    elements. The mask is a pure function of (run seed, training step, `id`,
    global element index): element i of micro-batch `micro` of
    `micro_count` on data-parallel rank r has global index
    (r * micro_count + micro) * numel + i, so N ranks drop exactly the
    elements one rank drops for the same global batch (a batch-major
    layout), recomputation regenerates the mask, and the VJP is the same
    dropout of the incoming gradient (nothing is saved). In evaluation
    the op is the identity. `id` tells two dropouts of a step apart
    (frontends number them); fsdp-grad-accum sets `micro`/`micro_count`.
    The mask function (runtime/core/Dropout.h) is written down so other
    code (the PyTorch oracle) can reproduce it bit for bit.

    ```mlir
    %y = fsdp.dropout %x {p = 1.000000e-01 : f64, id = 0 : i64} : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, F64Attr:$p, I64Attr:$id,
                       DefaultValuedAttr<I64Attr, "0">:$micro,
                       DefaultValuedAttr<I64Attr, "1">:$micro_count);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let hasVerifier = 1;
}

def Fsdp_FillOp : Fsdp_Op<"fill", [Pure]> {
  let summary = "a tensor with every element equal to a constant";
  let description = [{
    ```mlir
    %one = fsdp.fill {value = 1.000000e+00 : f64} : tensor<f32>
    ```
  }];
  let arguments = (ins F64Attr:$value);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

def Fsdp_BiasAddOp : Fsdp_Op<"bias_add", [Pure, AllTypesMatch<["input", "result"]>]> {
  let summary = "adds a bias vector along the last dimension";
  let description = [{
    `input` has shape [..., N] and `bias` shape [N].

    ```mlir
    %y = fsdp.bias_add %x, %b : tensor<32x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$bias);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `,` $bias attr-dict `:` type($input) `,` type($bias)";
  let hasVerifier = 1;
}

def Fsdp_MatmulOp : Fsdp_Op<"matmul", [Pure]> {
  let summary = "matrix product, optionally batched, with transpose flags";
  let description = [{
    Rank-2 operands compute `op(lhs) x op(rhs)`; rank-3 operands are batched
    over the leading dimension, which must agree. `transpose_lhs` /
    `transpose_rhs` transpose the last two dimensions of that operand first.
    A PyTorch `Linear` (weight [out, in]) is `matmul %x, %w transpose_rhs`.
    The result has the operands' element type, or f32 for bf16 / f16
    operands: the f32 accumulation written without rounding it to the
    operands' type (fsdp-fuse-epilogues writes such a matmul where the
    product was only cast to f32, e.g. a weight gradient into the f32
    gradient; models and fsdp-autodiff do not).

    With `acc` (rank-2 operands; the result's type): `acc + op(lhs) x
    op(rhs)`, a GEMM with beta = 1. fsdp-fuse-epilogues writes it where a
    product was only added to a running sum (fsdp-chunk-loss's weight
    gradient over row chunks): the memory plan then runs it in place over
    `acc`, with no buffer for the product.

    ```mlir
    %y = fsdp.matmul %x, %w transpose_rhs : (tensor<32x64xf32>, tensor<128x64xf32>) -> tensor<32x128xf32>
    %s = fsdp.matmul %dl, %h acc %s0 transpose_lhs : (tensor<8x128xf32>, tensor<8x64xf32>, tensor<128x64xf32>) -> tensor<128x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       UnitAttr:$transpose_lhs, UnitAttr:$transpose_rhs,
                       Optional<Fsdp_FloatTensor>:$acc);
  let results = (outs Fsdp_FloatTensor:$result);
  let builders = [
    // The plain product (no transposes set, no accumulator).
    OpBuilder<(ins "::mlir::Type":$result, "::mlir::Value":$lhs, "::mlir::Value":$rhs), [{
      build($_builder, $_state, result, lhs, rhs, false, false, ::mlir::Value());
    }]>
  ];
  let assemblyFormat = [{
    $lhs `,` $rhs (`acc` $acc^)? (`transpose_lhs` $transpose_lhs^)? (`transpose_rhs` $transpose_rhs^)?
    attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Fsdp_MatmulBiasOp : Fsdp_Op<"matmul_bias", [Pure]> {
  let summary = "matmul with a fused epilogue: + bias, then optionally tanh GELU";
  let description = [{
    `result = act(op(lhs) x op(rhs) + bias)` for rank-2 operands (the
    transpose flags as in `fsdp.matmul`); `bias` is [N] for an [M, N]
    result; `act` is the identity, or with `gelu` the tanh-form GELU of
    `fsdp.gelu`. With `gelu`, the optional second result `pre` holds the
    pre-activation op(lhs) x op(rhs) + bias, which the backward pass
    (`fsdp.matmul_gelu_grad`) reads. One kernel instead of matmul,
    bias_add and gelu (cuBLASLt's BIAS / GELU_AUX_BIAS epilogues): the
    product is never stored, and in bf16 it is rounded once, not three
    times. Written by fsdp-fuse-epilogues, not by models.

    ```mlir
    %y = fsdp.matmul_bias %x, %w, %b transpose_rhs : (tensor<32x64xf32>, tensor<128x64xf32>, tensor<128xf32>) -> tensor<32x128xf32>
    %g, %pre = fsdp.matmul_bias %x, %w, %b transpose_rhs gelu : (tensor<32x64xf32>, tensor<128x64xf32>, tensor<128xf32>) -> (tensor<32x128xf32>, tensor<32x128xf32>)
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       Fsdp_FloatTensor:$bias, UnitAttr:$transpose_lhs,
                       UnitAttr:$transpose_rhs, UnitAttr:$gelu);
  let results = (outs Fsdp_FloatTensor:$result, Optional<Fsdp_FloatTensor>:$pre);
  let assemblyFormat = [{
    $lhs `,` $rhs `,` $bias (`transpose_lhs` $transpose_lhs^)? (`transpose_rhs` $transpose_rhs^)?
    (`gelu` $gelu^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Fsdp_MatmulGeluGradOp : Fsdp_Op<"matmul_gelu_grad", [Pure]> {
  let summary = "matmul with a fused GELU-gradient (and bias-gradient) epilogue";
  let description = [{
    `result = (op(lhs) x op(rhs)) * gelu'(pre)` for rank-2 operands: the
    gradient reaching the pre-activation of a `fsdp.matmul_bias ... gelu`
    when `op(lhs) x op(rhs)` is the gradient of its output. The optional
    second result is the bias gradient, the sum of `result` over its rows
    ([N], as `fsdp.sum_to`), of the operands' type or, for bf16 / f16
    operands, f32 (the sum unrounded: fsdp-fuse-epilogues' widened
    parameter gradients). cuBLASLt's DGELU / DGELU_BGRAD epilogues.
    Written by fsdp-fuse-epilogues.

    ```mlir
    %dh, %db = fsdp.matmul_gelu_grad %dz, %w, %pre : (tensor<32x64xf32>, tensor<64x128xf32>, tensor<32x128xf32>) -> (tensor<32x128xf32>, tensor<128xf32>)
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       Fsdp_FloatTensor:$pre, UnitAttr:$transpose_lhs,
                       UnitAttr:$transpose_rhs);
  let results = (outs Fsdp_FloatTensor:$result, Optional<Fsdp_FloatTensor>:$bias_grad);
  let assemblyFormat = [{
    $lhs `,` $rhs `,` $pre (`transpose_lhs` $transpose_lhs^)? (`transpose_rhs` $transpose_rhs^)?
    attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Fsdp_MatmulBiasGradOp : Fsdp_Op<"matmul_bias_grad", [Pure]> {
  let summary = "a linear layer's weight gradient with its bias gradient";
  let description = [{
    `result = op(lhs) x op(rhs)` for rank-2 operands with `transpose_lhs`
    (and not `transpose_rhs`), so `result = lhs^T rhs` [N, K] from lhs
    [M, N] and rhs [M, K]: the weight gradient `dy^T x` of a linear layer
    (`x W^T + b`); `bias_grad` is the sum of `lhs` over its rows ([N], as
    `fsdp.sum_to`), the bias gradient, taken from the same operand in the
    same kernel (cuBLASLt's BGRADB epilogue, as llm.c and PyTorch use it).
    Both results have the operands' element type, or both f32 for bf16 /
    f16 operands (as `fsdp.matmul`). Written by fsdp-fuse-epilogues.

    With `acc %aw, %ab` (two accumulators of the results' types): `result
    = aw + lhs^T rhs` (a GEMM with beta = 1) and `bias_grad = ab + the
    column sums`. fsdp-fuse-epilogues writes it where both gradients were
    only added to fsdp-grad-accum's sums over the micro-batches
    (gradient-accumulation fusion for a layer with a bias): the memory plan
    then runs it in place over the two sums, with no buffers for this
    micro-batch's terms.

    ```mlir
    %dw, %db = fsdp.matmul_bias_grad %dy, %x transpose_lhs : (tensor<32x64xf32>, tensor<32x128xf32>) -> (tensor<64x128xf32>, tensor<64xf32>)
    %sw, %sb = fsdp.matmul_bias_grad %dy, %x acc %dw, %db transpose_lhs : (tensor<32x64xf32>, tensor<32x128xf32>, tensor<64x128xf32>, tensor<64xf32>) -> (tensor<64x128xf32>, tensor<64xf32>)
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       UnitAttr:$transpose_lhs, UnitAttr:$transpose_rhs,
                       Variadic<Fsdp_FloatTensor>:$acc);
  let results = (outs Fsdp_FloatTensor:$result, Fsdp_FloatTensor:$bias_grad);
  let assemblyFormat = [{
    $lhs `,` $rhs (`acc` $acc^)? (`transpose_lhs` $transpose_lhs^)? (`transpose_rhs` $transpose_rhs^)?
    attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Fsdp_LayerNormOp : Fsdp_Op<"layer_norm", [Pure, AllTypesMatch<["input", "result"]>,
                                             AllTypesMatch<["gamma", "beta"]>]> {
  let summary = "layer normalization over the last dimension";
  let description = [{
    `y = (x - mean) / sqrt(var + epsilon) * gamma + beta`, with the biased
    variance, over the last dimension of `input` ([..., C]); `gamma` and
    `beta` have shape [C].

    ```mlir
    %y = fsdp.layer_norm %x, %g, %b {epsilon = 1.000000e-05 : f64} : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$gamma,
                       Fsdp_FloatTensor:$beta,
                       DefaultValuedAttr<F64Attr, "1e-5">:$epsilon);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $input `,` $gamma `,` $beta attr-dict `:` type($input) `,` type($gamma)
  }];
  let hasVerifier = 1;
}

def Fsdp_ResidualLayerNormOp : Fsdp_Op<"residual_layer_norm",
    [Pure, AllTypesMatch<["lhs", "rhs", "sum", "result"]>,
     AllTypesMatch<["gamma", "beta"]>]> {
  let summary = "a residual add and the layer norm of the sum, in one kernel";
  let description = [{
    `sum = lhs + rhs` (same shapes) and `result = layer_norm(sum, gamma,
    beta)` (see `fsdp.layer_norm`): the pre-LN transformer's residual
    stream (llm.c's fused_residual_forward). The sum is a result because
    the next residual add and the backward pass read it. Written by
    fsdp-fuse-epilogues, not by models.

    ```mlir
    %s, %y = fsdp.residual_layer_norm %x, %h, %g, %b {epsilon = 1.000000e-05 : f64} : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       Fsdp_FloatTensor:$gamma, Fsdp_FloatTensor:$beta,
                       DefaultValuedAttr<F64Attr, "1e-5">:$epsilon);
  let results = (outs Fsdp_FloatTensor:$sum, Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $lhs `,` $rhs `,` $gamma `,` $beta attr-dict `:` type($lhs) `,` type($gamma)
  }];
  let hasVerifier = 1;
}

def Fsdp_ResidualRmsNormOp : Fsdp_Op<"residual_rms_norm",
    [Pure, AllTypesMatch<["lhs", "rhs", "sum", "result"]>]> {
  let summary = "a residual add and the RMS norm of the sum, in one kernel";
  let description = [{
    `sum = lhs + rhs` (same shapes) and `result = rms_norm(sum, weight)`
    (see `fsdp.rms_norm`): a Llama's residual stream, as
    `fsdp.residual_layer_norm` is GPT's. Written by fsdp-fuse-epilogues.

    ```mlir
    %s, %y = fsdp.residual_rms_norm %x, %h, %w epsilon = 1.000000e-05 : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$lhs, Fsdp_FloatTensor:$rhs,
                       Fsdp_FloatTensor:$weight, F64Attr:$epsilon);
  let results = (outs Fsdp_FloatTensor:$sum, Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $lhs `,` $rhs `,` $weight `epsilon` `=` $epsilon attr-dict `:` type($lhs) `,` type($weight)
  }];
  let hasVerifier = 1;
}

def Fsdp_RmsNormGradAccOp : Fsdp_Op<"rms_norm_grad_acc",
    [Pure, AllTypesMatch<["input", "grad", "acc", "d_input"]>,
     AllTypesMatch<["weight", "d_weight"]>]> {
  let summary = "rms_norm_grad whose input gradient is added to another";
  let description = [{
    As `fsdp.rms_norm_grad`, but `d_input` is `acc` plus the norm's input
    gradient: the residual stream's gradient accumulated in the same
    kernel. Written by fsdp-fuse-epilogues.

    ```mlir
    %dx, %dw = fsdp.rms_norm_grad_acc %x, %w, %dy, %dres epsilon = 1.000000e-05 : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$weight,
                       Fsdp_FloatTensor:$grad, Fsdp_FloatTensor:$acc, F64Attr:$epsilon);
  let results = (outs Fsdp_FloatTensor:$d_input, Fsdp_FloatTensor:$d_weight);
  let assemblyFormat = [{
    $input `,` $weight `,` $grad `,` $acc `epsilon` `=` $epsilon attr-dict `:` type($input) `,` type($weight)
  }];
  let hasVerifier = 1;
}

def Fsdp_LayerNormGradAccOp : Fsdp_Op<"layer_norm_grad_acc",
    [Pure, AllTypesMatch<["input", "grad", "acc", "d_input"]>]> {
  let summary = "layer_norm_grad whose input gradient is added to another";
  let description = [{
    As `fsdp.layer_norm_grad`, but `d_input` is `acc` plus the layer
    norm's input gradient: the residual stream's gradient accumulated in
    the same kernel (llm.c's layernorm_backward, dinp +=). Written by
    fsdp-fuse-epilogues. `d_gamma` and `d_beta` have gamma's type, or f32
    for a bf16 / f16 gamma, as in `fsdp.layer_norm_grad`.

    ```mlir
    %dx, %dg, %db = fsdp.layer_norm_grad_acc %x, %g, %dy, %dres {epsilon = 1.000000e-05 : f64} : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$gamma,
                       Fsdp_FloatTensor:$grad, Fsdp_FloatTensor:$acc,
                       DefaultValuedAttr<F64Attr, "1e-5">:$epsilon);
  let results = (outs Fsdp_FloatTensor:$d_input, Fsdp_FloatTensor:$d_gamma,
                      Fsdp_FloatTensor:$d_beta);
  let assemblyFormat = [{
    $input `,` $gamma `,` $grad `,` $acc attr-dict `:` type($input) `,` type($gamma)
    custom<ParamGradTypes>(ref(type($gamma)), type($d_gamma), type($d_beta))
  }];
  let hasVerifier = 1;
}

def Fsdp_AttentionOp : Fsdp_Op<"attention",
    [Pure, AllTypesMatch<["q", "result"]>, AllTypesMatch<["k", "v"]>]> {
  let summary = "multi-head (or grouped-query) scaled dot-product self-attention";
  let description = [{
    `q` and the result have shape [B, T, C]; C is split into `heads` heads
    of D = C/heads each. Scores are scaled by 1/sqrt(D); with `causal`,
    position t attends to positions <= t only. Heads are concatenated back
    along C (the output projection is a separate matmul).

    Without `kv_heads`, `k` and `v` have the shape of `q`. With `kv_heads`
    = G (grouped-query attention, Llama 2/3), `k` and `v` have shape
    [B, T, G*D] and G divides `heads`: query head h reads key/value head
    h / (heads/G), as HF's `repeat_kv` (each key/value head repeated for
    heads/G consecutive query heads); the repeated keys are never stored.
    The type after `:` is that of `q`, followed by that of `k` and `v` when
    it differs.

    An optional second result `lse`, f32 [B, heads, T], holds each query
    row's log-sum-exp of its scaled, masked scores: log sum_s exp(S_ts).
    fsdp-autodiff asks for it (the type after `->`) when it differentiates
    the op, and hands it with the output to `fsdp.attention_grad`, so the
    backward pass forms the probabilities as exp(S - lse) without
    recomputing the softmax's statistics (FlashAttention-2's layout: the
    T x T probabilities are never stored). f32 whatever the storage dtype:
    a bf16 log-sum-exp would scale every probability of a row by up to
    exp(2^-8 |lse|).

    ```mlir
    %y = fsdp.attention %q, %k, %v heads = 4 causal : tensor<2x16x64xf32>
    %z = fsdp.attention %q, %k2, %v2 heads = 4 kv_heads = 2 causal : tensor<2x16x64xf32>, tensor<2x16x32xf32>
    %w, %lse = fsdp.attention %q, %k, %v heads = 4 causal : tensor<2x16x64xbf16> -> tensor<2x4x16xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$q, Fsdp_FloatTensor:$k,
                       Fsdp_FloatTensor:$v, I64Attr:$heads, UnitAttr:$causal,
                       OptionalAttr<I64Attr>:$kv_heads);
  let results = (outs Fsdp_FloatTensor:$result, Optional<Fsdp_F32Tensor>:$lse);
  let assemblyFormat = [{
    $q `,` $k `,` $v `heads` `=` $heads (`kv_heads` `=` $kv_heads^)? (`causal` $causal^)?
    attr-dict `:` custom<AttentionTypes>(type($q), type($k)) (`->` type($lse)^)?
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    /// The number of key/value heads: `kv_heads`, or `heads` without it.
    int64_t getNumKvHeads() { return getKvHeads().value_or(getHeads()); }
  }];
}

def Fsdp_AttentionQkvOp : Fsdp_Op<"attention_qkv", [Pure]> {
  let summary = "attention on q, k and v read in place from one packed tensor";
  let description = [{
    `fsdp.attention` of three column ranges of `qkv`, [B, T, C + 2 G D]
    (C = heads * D, G = kv_heads or heads): q is columns [0, C), k
    [C, C + G D) and v [C + G D, C + 2 G D). fsdp-fuse-epilogues forms it
    from an attention whose operands are those three slices of one tensor
    (GPT-2's fused q/k/v projection), so the kernels read them in place at
    row stride C + 2 G D instead of from three copies. Results as
    attention's: y [B, T, C] in qkv's element type, and the optional f32
    log-sum-exp [B, heads, T].

    ```mlir
    %y, %lse = fsdp.attention_qkv %qkv heads = 4 causal : tensor<2x16x192xbf16> -> tensor<2x16x64xbf16>, tensor<2x4x16xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$qkv, I64Attr:$heads, UnitAttr:$causal,
                       OptionalAttr<I64Attr>:$kv_heads);
  let results = (outs Fsdp_FloatTensor:$result, Optional<Fsdp_F32Tensor>:$lse);
  let assemblyFormat = [{
    $qkv `heads` `=` $heads (`kv_heads` `=` $kv_heads^)? (`causal` $causal^)?
    attr-dict `:` type($qkv) `->` type($result) (`,` type($lse)^)?
  }];
  let hasVerifier = 1;
}

def Fsdp_RmsNormOp : Fsdp_Op<"rms_norm", [Pure, AllTypesMatch<["input", "result"]>]> {
  let summary = "RMS normalization over the last dimension (Llama's RMSNorm)";
  let description = [{
    `y = x / sqrt(mean(x^2) + epsilon) * weight` over the last dimension of
    `input` ([..., C]); `weight` has shape [C]. No mean subtraction and no
    bias: HF's `LlamaRMSNorm` and `torch.nn.RMSNorm`. `epsilon` is required
    (Llama uses 1e-5 or 1e-6; no default to disagree about).

    ```mlir
    %y = fsdp.rms_norm %x, %w epsilon = 1.000000e-06 : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$weight,
                       F64Attr:$epsilon);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $input `,` $weight `epsilon` `=` $epsilon attr-dict `:` type($input) `,` type($weight)
  }];
  let hasVerifier = 1;
}

def Fsdp_RopeOp : Fsdp_Op<"rope", [Pure, AllTypesMatch<["input", "result"]>]> {
  let summary = "rotary position embedding (rotate-half convention, as HF Llama)";
  let description = [{
    `input` has shape [B, T, heads*D] with D even; the position of row t is
    t (0-based). Within each head, element i < D/2 is paired with element
    i + D/2 (the rotate-half layout of HF transformers' Llama, not Meta's
    interleaved pairs (2i, 2i+1)) and the pair is rotated by the angle
    t * theta^(-2i/D):
      y_i       = x_i cos - x_{i+D/2} sin
      y_{i+D/2} = x_{i+D/2} cos + x_i sin.
    Applied to queries and keys before attention (`heads` = kv_heads for
    grouped keys). Checkpoints in Meta's layout need their q/k projection
    rows permuted, as HF's conversion script does.

    ```mlir
    %qr = fsdp.rope %q heads = 4 theta = 1.000000e+04 : tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, I64Attr:$heads, F64Attr:$theta);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $input `heads` `=` $heads `theta` `=` $theta attr-dict `:` type($input)
  }];
  let hasVerifier = 1;
}

def Fsdp_EmbeddingOp : Fsdp_Op<"embedding", [Pure]> {
  let summary = "embedding lookup: rows of a table selected by integer ids";
  let description = [{
    `table` is [V, C], `ids` any integer tensor of shape S; the result has
    shape S x [C]. Ids outside [0, V) are a runtime error.

    ```mlir
    %e = fsdp.embedding %wte, %ids : (tensor<256x64xf32>, tensor<2x16xi32>) -> tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$table, Fsdp_IntTensor:$ids);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$table `,` $ids attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Fsdp_ReshapeOp : Fsdp_Op<"reshape", [Pure]> {
  let summary = "reinterprets a tensor with another shape of the same size";
  let description = [{
    Row-major order is kept; the element counts and types must agree.

    ```mlir
    %y = fsdp.reshape %x : tensor<2x16x64xf32> -> tensor<32x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_AnyTensor:$input);
  let results = (outs Fsdp_AnyTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_MicrobatchOp : Fsdp_Op<"microbatch", [Pure]> {
  let summary = "one micro-batch of a batch: a contiguous range of rows";
  let description = [{
    Rows [index * R, (index + 1) * R) of the input along dimension 0, where
    R = result.shape[0]; the input holds a whole number of micro-batches
    and the other dimensions are kept. Dimension 0 is outermost, so the
    rows are contiguous in row-major order: the memory plan makes the
    result an alias of the input, not a copy, for any element type.
    fsdp-grad-accum emits it to split the step's batch into micro-batches.

    ```mlir
    %x1 = fsdp.microbatch %x index = 1 : tensor<24x16xf32> -> tensor<8x16xf32>
    ```
  }];
  let arguments = (ins Fsdp_AnyTensor:$input, I64Attr:$index);
  let results = (outs Fsdp_AnyTensor:$result);
  let assemblyFormat = "$input `index` `=` $index attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_TransposeOp : Fsdp_Op<"transpose", [Pure]> {
  let summary = "permutes dimensions";
  let description = [{
    Result dimension i is input dimension `perm[i]`.

    ```mlir
    %y = fsdp.transpose %x perm = [1, 0] : tensor<4x8xf32> -> tensor<8x4xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, DenseI64ArrayAttr:$perm);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `perm` `=` $perm attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_SliceOp : Fsdp_Op<"slice", [Pure]> {
  let summary = "a contiguous range along one dimension";
  let description = [{
    Takes `result.shape[dim]` elements starting at `offset` along `dim`;
    other dimensions are kept whole.

    ```mlir
    %q = fsdp.slice %qkv dim = 2 offset = 0 : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, I64Attr:$dim, I64Attr:$offset);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $input `dim` `=` $dim `offset` `=` $offset attr-dict `:` type($input) `->` type($result)
  }];
  let hasVerifier = 1;
}

def Fsdp_ConcatOp : Fsdp_Op<"concat", [Pure]> {
  let summary = "concatenates tensors along one dimension";
  let description = [{
    ```mlir
    %y = fsdp.concat %a, %b dim = 1 : (tensor<4x8xf32>, tensor<4x2xf32>) -> tensor<4x10xf32>
    ```
  }];
  let arguments = (ins Variadic<Fsdp_FloatTensor>:$inputs, I64Attr:$dim);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$inputs `dim` `=` $dim attr-dict `:` functional-type($inputs, results)";
  let hasVerifier = 1;
}

class Fsdp_ReduceOp<string mnemonic, string what> : Fsdp_Op<mnemonic, [Pure]> {
  let summary = what # " over the listed dimensions (which are dropped)";
  let description = [{
    The result keeps the other dimensions in order; reducing every
    dimension gives a 0-d tensor.

    ```mlir
    %s = fsdp.}] # mnemonic # [{ %x dims = [1] : tensor<4x8xf32> -> tensor<4xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, DenseI64ArrayAttr:$dims);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `dims` `=` $dims attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_ReduceSumOp : Fsdp_ReduceOp<"reduce_sum", "sum">;
def Fsdp_ReduceMeanOp : Fsdp_ReduceOp<"reduce_mean", "mean">;

def Fsdp_BroadcastOp : Fsdp_Op<"broadcast", [Pure]> {
  let summary = "broadcasts a tensor to a larger shape (NumPy rules)";
  let description = [{
    ```mlir
    %y = fsdp.broadcast %x : tensor<1x8xf32> -> tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_SumToOp : Fsdp_Op<"sum_to", [Pure]> {
  let summary = "sums a tensor down to a shape it was broadcast from";
  let description = [{
    The adjoint of `fsdp.broadcast`: dimensions that broadcasting added or
    stretched from 1 are summed over. The result has the input's element
    type, or f32 for a bf16 / f16 input: the f32 sum unrounded
    (fsdp-fuse-epilogues folds a cast of the sum to f32 into it).

    ```mlir
    %db = fsdp.sum_to %g : tensor<4x8xf32> -> tensor<8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_CastOp : Fsdp_Op<"cast", [Pure]> {
  let summary = "converts the element type (f32 / bf16 / f16)";
  let description = [{
    Rounds to nearest even when narrowing.

    `stochastic` (f32 -> bf16 only; fsdp-shard sets it on a unit's master
    parameters under fsdp-mixed-precision's stochastic-rounding=true, as
    llm.c writes its bf16 parameters): rounds up with probability equal to
    the fraction dropped, so the expected bf16 value is the f32 one. The
    draw of element g is a pure function of the run's seed, the step, `key`
    (the unit) and g, its index in the unit's flat parameters: with
    `sharded` the input is this rank's shard, so g = shard index x the
    shard's size + i (runtime/core/StochasticRounding.h).

    ```mlir
    %y = fsdp.cast %x : tensor<4x8xf32> -> tensor<4x8xbf16>
    %p = fsdp.cast %w {stochastic, key = 3 : i64} : tensor<96xf32> -> tensor<96xbf16>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, UnitAttr:$stochastic,
                       OptionalAttr<I64Attr>:$key, UnitAttr:$sharded);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_ToHostOp : Fsdp_Op<"to_host", [SameOperandsAndResultType]> {
  let summary = "copies a device value to host memory (fsdp-offload)";
  let description = [{
    The result lives in the host arena; ops marked `fsdp.on_host` read it.
    Not Pure: two copies of one value stay two (each is as short-lived as
    the work that reads it).

    ```mlir
    %h = fsdp.to_host %g : tensor<1024xf32>
    ```
  }];
  let arguments = (ins Fsdp_AnyTensor:$input);
  let results = (outs Fsdp_AnyTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Fsdp_ToDeviceOp : Fsdp_Op<"to_device", [SameOperandsAndResultType]> {
  let summary = "copies a host value to device memory (fsdp-offload)";
  let description = [{
    ```mlir
    %d = fsdp.to_device %shard : tensor<1024xf32>
    ```
  }];
  let arguments = (ins Fsdp_AnyTensor:$input);
  let results = (outs Fsdp_AnyTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

//===----------------------------------------------------------------------===//
// Losses: all return the mean over examples as a 0-d f32 tensor.
//===----------------------------------------------------------------------===//

def Fsdp_CrossEntropyOp : Fsdp_Op<"cross_entropy", [Pure]> {
  let summary = "softmax cross-entropy against integer class labels, mean";
  let description = [{
    `logits` is [..., V] and `labels` has the leading shape [...]; the loss
    is the mean over all positions of `-log softmax(logits)[label]`.

    With `classes = K` (K <= V) only the first K columns are classes: the
    columns from K on are padding (fsdp-pad-classes widens the LM head's
    output to a multiple of 64 columns so its GEMMs run on aligned rows),
    left out of the softmax; labels must lie in [0, K).

    With `label_smoothing = e` (0 <= e <= 1, PyTorch's `label_smoothing`)
    the target of each position is (1 - e) on its label plus e / K on every
    class: the loss is (1 - e) (-log p[label]) + e mean_c (-log p[c]), the
    mean over the K classes (padding columns are not classes).

    With `ignore_index = I` (PyTorch's `ignore_index`, e.g. -100 for the
    prompt and padding positions of fine-tuning data) a position whose
    label is I adds nothing to the loss and gets a zero gradient, and the
    loss is the sum over the other positions divided by their count. That
    count comes from `normalizer`, an f32 scalar: fsdp-autodiff computes it
    with fsdp.count_labels over the step's labels, and fsdp-grad-accum and
    fsdp-shard make it the count over every micro-batch and every rank
    (divided by K micro-batches and N ranks, whose mean the step takes), so
    the loss is the mean over every kept position of the global batch, N
    ranks == 1 rank. A normalizer of 0 (every label ignored) gives a loss
    and gradient of 0. Without ignore_index every label must lie in
    [0, classes) and the loss is the mean over all positions.

    ```mlir
    %l = fsdp.cross_entropy %logits, %labels : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
    %p = fsdp.cross_entropy %padded, %labels {classes = 251 : i64} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
    %s = fsdp.cross_entropy %logits, %labels {label_smoothing = 1.000000e-01 : f64} : (tensor<32x256xf32>, tensor<32xi32>) -> tensor<f32>
    %m = fsdp.cross_entropy %logits, %labels, %count {ignore_index = -100 : i64} : (tensor<32x256xf32>, tensor<32xi32>, tensor<f32>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$logits, Fsdp_IntTensor:$labels,
                       Optional<Fsdp_Scalar>:$normalizer,
                       OptionalAttr<I64Attr>:$classes,
                       OptionalAttr<F64Attr>:$label_smoothing,
                       OptionalAttr<I64Attr>:$ignore_index);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = [{
    $logits `,` $labels (`,` $normalizer^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

class Fsdp_PairLossOp<string mnemonic, string sum>
    : Fsdp_Op<mnemonic, [Pure, AllTypesMatch<["input", "target"]>]> {
  let summary = sum;
  let description = [{
    Both operands have the same shape and type; the result is the mean over
    all elements.

    ```mlir
    %l = fsdp.}] # mnemonic # [{ %pred, %target : tensor<32x1xf32> -> tensor<f32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$target);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = "$input `,` $target attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_MseLossOp : Fsdp_PairLossOp<"mse_loss", "mean squared error">;
def Fsdp_BceWithLogitsOp : Fsdp_PairLossOp<"bce_with_logits",
    "binary cross-entropy on logits (numerically stable form), mean">;

//===----------------------------------------------------------------------===//
// Backward ops emitted by fsdp-autodiff (vector-Jacobian products)
//===----------------------------------------------------------------------===//

class Fsdp_PointwiseGradOp<string mnemonic, string sum>
    : Fsdp_Op<mnemonic, [Pure, AllTypesMatch<["input", "grad", "result"]>]> {
  let summary = sum;
  let description = [{
    `input` is the forward op's operand (or result, for softmax) and `grad`
    the gradient of its result; returns the gradient of its operand.

    ```mlir
    %dx = fsdp.}] # mnemonic # [{ %x, %dy : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$grad);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `,` $grad attr-dict `:` type($input)";
}

def Fsdp_ReluGradOp : Fsdp_PointwiseGradOp<"relu_grad", "VJP of relu: dy * (x > 0)">;
def Fsdp_GeluGradOp : Fsdp_Op<"gelu_grad",
    [Pure, AllTypesMatch<["input", "grad", "result"]>]> {
  let summary = "VJP of gelu (of its `approximate` form)";
  let description = [{
    ```mlir
    %dx = fsdp.gelu_grad %x, %dy : tensor<4x8xf32>
    %dz = fsdp.gelu_grad %x, %dy {approximate = "none"} : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$grad,
                       DefaultValuedAttr<StrAttr, "\"tanh\"">:$approximate);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `,` $grad attr-dict `:` type($input)";
  let hasVerifier = 1;
}
def Fsdp_SoftmaxGradOp : Fsdp_PointwiseGradOp<"softmax_grad",
    "VJP of softmax given its output y: y * (dy - sum(dy * y))">;
def Fsdp_SiluGradOp : Fsdp_PointwiseGradOp<"silu_grad",
    "VJP of silu: dy * s (1 + x (1 - s)), s = sigmoid(x)">;

def Fsdp_SwigluGradOp : Fsdp_Op<"swiglu_grad",
    [Pure, AllTypesMatch<["gate", "up", "grad", "d_gate", "d_up"]>]> {
  let summary = "VJP of swiglu: d_gate = silu_grad(gate, dy * up), d_up = dy * silu(gate)";
  let description = [{
    The fused backward of `fsdp.swiglu` (fsdp-fuse-epilogues folds the two
    `fsdp.mul`s and the `fsdp.silu_grad` autodiff derives): reads gate, up
    and dy once, recomputes silu(gate) instead of reading a saved copy.

    ```mlir
    %dg, %du = fsdp.swiglu_grad %g, %u, %dy : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$gate, Fsdp_FloatTensor:$up,
                       Fsdp_FloatTensor:$grad);
  let results = (outs Fsdp_FloatTensor:$d_gate, Fsdp_FloatTensor:$d_up);
  let assemblyFormat = "$gate `,` $up `,` $grad attr-dict `:` type($gate)";
}

def Fsdp_RmsNormGradOp : Fsdp_Op<"rms_norm_grad",
    [Pure, AllTypesMatch<["input", "grad", "d_input"]>,
     AllTypesMatch<["weight", "d_weight"]>]> {
  let summary = "VJP of rms_norm: gradients of input and weight";
  let description = [{
    Recomputes 1 / rms from `input` instead of storing it.

    ```mlir
    %dx, %dw = fsdp.rms_norm_grad %x, %w, %dy epsilon = 1.000000e-06 : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$weight,
                       Fsdp_FloatTensor:$grad, F64Attr:$epsilon);
  let results = (outs Fsdp_FloatTensor:$d_input, Fsdp_FloatTensor:$d_weight);
  let assemblyFormat = [{
    $input `,` $weight `,` $grad `epsilon` `=` $epsilon attr-dict `:` type($input) `,` type($weight)
  }];
  let hasVerifier = 1;
}

def Fsdp_RopeGradOp : Fsdp_Op<"rope_grad", [Pure, AllTypesMatch<["grad", "result"]>]> {
  let summary = "VJP of rope: the gradient rotated back (by the negated angles)";
  let description = [{
    A rotation is orthogonal, so its VJP is the rotation by -angle.

    ```mlir
    %dq = fsdp.rope_grad %dqr heads = 4 theta = 1.000000e+04 : tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$grad, I64Attr:$heads, F64Attr:$theta);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $grad `heads` `=` $heads `theta` `=` $theta attr-dict `:` type($grad)
  }];
  let hasVerifier = 1;
}

def Fsdp_LayerNormGradOp : Fsdp_Op<"layer_norm_grad",
    [Pure, AllTypesMatch<["input", "grad", "d_input"]>]> {
  let summary = "VJP of layer_norm: gradients of input, gamma and beta";
  let description = [{
    Recomputes the mean and inverse standard deviation from `input`.
    `d_gamma` and `d_beta` have gamma's type, or f32 for a bf16 / f16
    gamma: the f32 column sums unrounded (fsdp-fuse-epilogues writes them
    where the gradients were only cast to f32), printed as
    `-> tensor<..xf32>` after the types.

    ```mlir
    %dx, %dg, %db = fsdp.layer_norm_grad %x, %g, %dy {epsilon = 1.000000e-05 : f64} : tensor<8x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$gamma,
                       Fsdp_FloatTensor:$grad,
                       DefaultValuedAttr<F64Attr, "1e-5">:$epsilon);
  let results = (outs Fsdp_FloatTensor:$d_input, Fsdp_FloatTensor:$d_gamma,
                      Fsdp_FloatTensor:$d_beta);
  let assemblyFormat = [{
    $input `,` $gamma `,` $grad attr-dict `:` type($input) `,` type($gamma)
    custom<ParamGradTypes>(ref(type($gamma)), type($d_gamma), type($d_beta))
  }];
  let hasVerifier = 1;
}

def Fsdp_AttentionGradOp : Fsdp_Op<"attention_grad",
    [Pure, AllTypesMatch<["q", "y", "grad", "d_q"]>,
     AllTypesMatch<["k", "v", "d_k", "d_v"]>]> {
  let summary = "VJP of attention: gradients of q, k and v";
  let description = [{
    Operands: the forward's inputs `q`, `k`, `v`, its output `y` and
    log-sum-exp `lse` (f32 [B, heads, T], the forward's second result), and
    the output's gradient. The probabilities are P = exp(S - lse), with S
    the scaled, masked scores recomputed from `q` and `k`; the softmax's
    VJP needs each row's delta = sum_s P_ts dP_ts = dy_t . y_t, which a
    tiled kernel reads from `y` before it visits the keys (the CPU kernel
    forms it from P and dP in the same pass). With `kv_heads`, the gradient
    of each key/value head sums over the query heads that share it. The
    type of `lse` follows from that of `q` and `heads` and is not written.

    ```mlir
    %dq, %dk, %dv = fsdp.attention_grad %q, %k, %v, %y, %lse, %dy heads = 4 causal : tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$q, Fsdp_FloatTensor:$k,
                       Fsdp_FloatTensor:$v, Fsdp_FloatTensor:$y,
                       Fsdp_F32Tensor:$lse, Fsdp_FloatTensor:$grad,
                       I64Attr:$heads, UnitAttr:$causal,
                       OptionalAttr<I64Attr>:$kv_heads);
  let results = (outs Fsdp_FloatTensor:$d_q, Fsdp_FloatTensor:$d_k,
                      Fsdp_FloatTensor:$d_v);
  let assemblyFormat = [{
    $q `,` $k `,` $v `,` $y `,` $lse `,` $grad `heads` `=` $heads (`kv_heads` `=` $kv_heads^)? (`causal` $causal^)?
    attr-dict `:` custom<AttentionGradTypes>(type($q), type($k), ref($heads), type($lse))
  }];
  let hasVerifier = 1;
}

def Fsdp_EmbeddingGradOp : Fsdp_Op<"embedding_grad", [Pure]> {
  let summary = "VJP of embedding: scatter-add of output gradients into rows";
  let description = [{
    Each row of the result sums the gradient rows whose id is its index.
    The result has the gradient's element type, or f32 for a bf16 / f16
    gradient: the f32 sums unrounded (fsdp-fuse-epilogues folds a cast of
    the result to f32 into it; a mixed-precision plan's embedding gradient).

    ```mlir
    %dw = fsdp.embedding_grad %ids, %dy : (tensor<2x16xi32>, tensor<2x16x64xf32>) -> tensor<256x64xf32>
    ```
  }];
  let arguments = (ins Fsdp_IntTensor:$ids, Fsdp_FloatTensor:$grad);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$ids `,` $grad attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Fsdp_SliceGradOp : Fsdp_Op<"slice_grad", [Pure]> {
  let summary = "VJP of slice: the gradient placed in a zero tensor";
  let description = [{
    ```mlir
    %dx = fsdp.slice_grad %dq dim = 2 offset = 0 : tensor<2x16x64xf32> -> tensor<2x16x192xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$grad, I64Attr:$dim, I64Attr:$offset);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $grad `dim` `=` $dim `offset` `=` $offset attr-dict `:` type($grad) `->` type($result)
  }];
  let hasVerifier = 1;
}

def Fsdp_CrossEntropyGradOp : Fsdp_Op<"cross_entropy_grad",
    [Pure, AllTypesMatch<["logits", "result"]>]> {
  let summary = "VJP of cross_entropy: (softmax - target) * dloss / count";
  let description = [{
    `classes`, `label_smoothing`, `ignore_index` and `normalizer` as on
    cross_entropy: the target is the one-hot label, or (1 - e) onehot + e / K
    with smoothing; the padding columns' gradient is 0, and so is an ignored
    position's row.

    ```mlir
    %dl = fsdp.cross_entropy_grad %logits, %labels, %dloss : tensor<32x256xf32>, tensor<32xi32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$logits, Fsdp_IntTensor:$labels,
                       Fsdp_Scalar:$grad, Optional<Fsdp_Scalar>:$normalizer,
                       OptionalAttr<I64Attr>:$classes,
                       OptionalAttr<F64Attr>:$label_smoothing,
                       OptionalAttr<I64Attr>:$ignore_index);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $logits `,` $labels `,` $grad (`,` $normalizer^)? attr-dict `:` type($logits) `,` type($labels)
  }];
  let hasVerifier = 1;
}

def Fsdp_CrossEntropyFusedOp : Fsdp_Op<"cross_entropy_fused",
    [Pure, AllTypesMatch<["logits", "d_logits"]>]> {
  let summary = "cross_entropy and its gradient in one pass over the logits";
  let description = [{
    llm.c's fused classifier: `loss` is `fsdp.cross_entropy %logits,
    %labels` and `d_logits` is `fsdp.cross_entropy_grad %logits, %labels,
    %grad`, both from one read of each row of the logits (the row's max
    and sum of exponentials serve both). fsdp-fuse-epilogues forms it
    when the loss is read only after its gradient (the step returns it),
    so `%grad` (the seed, or the loss scale) is known before the loss.
    `classes`, `label_smoothing`, `ignore_index` and `normalizer` as on
    cross_entropy.

    ```mlir
    %l, %dl = fsdp.cross_entropy_fused %logits, %labels, %dloss : tensor<32x256xbf16>, tensor<32xi32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$logits, Fsdp_IntTensor:$labels,
                       Fsdp_Scalar:$grad, Optional<Fsdp_Scalar>:$normalizer,
                       OptionalAttr<I64Attr>:$classes,
                       OptionalAttr<F64Attr>:$label_smoothing,
                       OptionalAttr<I64Attr>:$ignore_index);
  let results = (outs Fsdp_Scalar:$loss, Fsdp_FloatTensor:$d_logits);
  let assemblyFormat = [{
    $logits `,` $labels `,` $grad (`,` $normalizer^)? attr-dict `:` type($logits) `,` type($labels)
  }];
  let hasVerifier = 1;
}

def Fsdp_AttentionQkvGradOp : Fsdp_Op<"attention_qkv_grad",
    [Pure, AllTypesMatch<["qkv", "d_qkv"]>, AllTypesMatch<["y", "grad"]>]> {
  let summary = "VJP of attention_qkv: the packed tensor's gradient";
  let description = [{
    `fsdp.attention_grad` of attention_qkv: dq, dk and dv written into the
    column ranges of one gradient of `qkv`'s type (the concat that
    fsdp-autodiff's slice gradients become), in place.

    ```mlir
    %dqkv = fsdp.attention_qkv_grad %qkv, %y, %lse, %dy heads = 4 causal : tensor<2x16x192xbf16>, tensor<2x16x64xbf16>, tensor<2x4x16xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$qkv, Fsdp_FloatTensor:$y, Fsdp_F32Tensor:$lse,
                       Fsdp_FloatTensor:$grad, I64Attr:$heads, UnitAttr:$causal,
                       OptionalAttr<I64Attr>:$kv_heads);
  let results = (outs Fsdp_FloatTensor:$d_qkv);
  let assemblyFormat = [{
    $qkv `,` $y `,` $lse `,` $grad `heads` `=` $heads (`kv_heads` `=` $kv_heads^)? (`causal` $causal^)?
    attr-dict `:` type($qkv) `,` type($y) `,` type($lse)
  }];
  let hasVerifier = 1;
}

class Fsdp_PairLossGradOp<string mnemonic, string sum>
    : Fsdp_Op<mnemonic, [Pure, AllTypesMatch<["input", "target", "result"]>]> {
  let summary = sum;
  let description = [{
    ```mlir
    %dp = fsdp.}] # mnemonic # [{ %pred, %target, %dloss : tensor<32x1xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, Fsdp_FloatTensor:$target,
                       Fsdp_Scalar:$grad);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input `,` $target `,` $grad attr-dict `:` type($input)";
}

def Fsdp_MseLossGradOp : Fsdp_PairLossGradOp<"mse_loss_grad",
    "VJP of mse_loss: 2 (pred - target) * dloss / count">;
def Fsdp_BceWithLogitsGradOp : Fsdp_PairLossGradOp<"bce_with_logits_grad",
    "VJP of bce_with_logits: (sigmoid(x) - target) * dloss / count">;

//===----------------------------------------------------------------------===//
// Optimizer ops emitted by fsdp-insert-optimizer
//===----------------------------------------------------------------------===//

def Fsdp_SgdUpdateOp : Fsdp_Op<"sgd_update",
    [Pure, AttrSizedOperandSegments, AllTypesMatch<["param", "new_param"]>]> {
  let summary = "one plain SGD step: p' = p - lr * (g + weight_decay * p)";
  let description = [{
    Elementwise, so it applies unchanged to a shard of the parameter.

    With `skip_nonfinite %s` (dynamic loss scaling), the update is skipped
    when `%s` (the global squared norm of the scaled gradients) is inf or
    NaN: every result equals its input, as PyTorch's fused optimizers do
    with GradScaler's `found_inf`.

    With `grad_scale %c` (fsdp-fuse-epilogues) the gradient is multiplied
    by the scalar `%c` first (the clipping or loss-scale factor of
    fsdp.clip_coef / fsdp.grad_coef, in f32): the update of `g * %c`
    without the product in memory, as PyTorch's fused optimizers take
    `grad_scale` and llm.c's AdamW its grad_scale. Bitwise the update of
    fsdp.mul's product.

    With `decay_numel = D` (fsdp-shard, `weight-decay-params=matrices`) the
    weight decay applies only to the elements whose position in their
    unit's flat parameters is below D (the unit packs its decayed
    parameters first); element i of the operand is at position
    shard_index * `shard_stride` + i (`shard_stride` 0: the operand is the
    whole unit). Still elementwise.

    Parameters stored in bf16 with an f32 gradient (fsdp-mixed-precision's
    `master-dtype=bf16`: no f32 master copy) are widened, the step runs in
    f32 as above, and the new parameters are rounded to bf16 once: to
    nearest even, or with `stochastic_param` and `key` stochastically with
    the draws of the stochastic parameter cast (StochasticRounding.h's
    stochasticRoundingKey(seed, step, `key`), each element at its place in
    the unit by `shard_stride`), so an update smaller than half a bf16 ulp
    still moves the parameter in expectation.

    ```mlir
    %p2 = fsdp.sgd_update %p, %g, %lr {weight_decay = 0.0 : f64} : tensor<64xf32>
    %p3 = fsdp.sgd_update %pb, %g, %lr {key = 0 : i64, stochastic_param} : tensor<64xbf16> grad tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$param, Fsdp_FloatTensor:$grad,
                       Fsdp_Scalar:$lr,
                       Optional<Fsdp_Scalar>:$skip_nonfinite,
                       Optional<Fsdp_Scalar>:$grad_scale,
                       DefaultValuedAttr<F64Attr, "0.0">:$weight_decay,
                       OptionalAttr<I64Attr>:$decay_numel,
                       OptionalAttr<I64Attr>:$shard_stride,
                       UnitAttr:$stochastic_param,
                       OptionalAttr<I64Attr>:$key);
  let results = (outs Fsdp_FloatTensor:$new_param);
  let assemblyFormat = [{
    $param `,` $grad `,` $lr (`skip_nonfinite` $skip_nonfinite^)? (`grad_scale` $grad_scale^)? attr-dict `:` type($param) custom<GradType>(type($grad), ref(type($param)))
  }];
  let hasVerifier = 1;
}

def Fsdp_SgdMomentumUpdateOp : Fsdp_Op<"sgd_momentum_update",
    [Pure, AttrSizedOperandSegments, AllTypesMatch<["param", "new_param"]>,
     AllTypesMatch<["buffer", "new_buffer"]>]> {
  let summary = "one SGD step with momentum (PyTorch semantics)";
  let description = [{
    g' = g + weight_decay * p; buf = g' on step 1, else momentum * buf +
    (1 - dampening) * g'; d = g' + momentum * buf with `nesterov`, else buf;
    p' = p - lr * d. `step` is 1-based. Elementwise.

    With `skip_nonfinite %s` (dynamic loss scaling), the update is skipped
    when `%s` (the global squared norm of the scaled gradients) is inf or
    NaN: every result equals its input, as PyTorch's fused optimizers do
    with GradScaler's `found_inf`.

    With `grad_scale %c` (fsdp-fuse-epilogues) the gradient is multiplied
    by the scalar `%c` first (the clipping or loss-scale factor of
    fsdp.clip_coef / fsdp.grad_coef, in f32): the update of `g * %c`
    without the product in memory, as PyTorch's fused optimizers take
    `grad_scale` and llm.c's AdamW its grad_scale. Bitwise the update of
    fsdp.mul's product.

    With `decay_numel = D` (fsdp-shard, `weight-decay-params=matrices`) the
    weight decay applies only to the elements whose position in their
    unit's flat parameters is below D (the unit packs its decayed
    parameters first); element i of the operand is at position
    shard_index * `shard_stride` + i (`shard_stride` 0: the operand is the
    whole unit). Still elementwise.

    The buffer may be stored in bf16 beside f32 parameters
    (fsdp-insert-optimizer's `state-dtype=bf16`: 2 bytes of state a
    parameter instead of 4): widened, the step runs in f32 (the parameter's
    update reads the f32 buffer), and the new buffer is rounded once, to
    nearest even or, with `stochastic` and `key`, stochastically with
    adamw_update's draws (16 bits of an element's mix).

    Parameters stored in bf16 with an f32 gradient (fsdp-mixed-precision's
    `master-dtype=bf16`: no f32 master copy) are widened, the step runs in
    f32 as above, and the new parameters are rounded to bf16 once: to
    nearest even, or with `stochastic_param` and `key` stochastically with
    the draws of the stochastic parameter cast (StochasticRounding.h's
    stochasticRoundingKey(seed, step, `key`), each element at its place in
    the unit by `shard_stride`), so an update smaller than half a bf16 ulp
    still moves the parameter in expectation.

    With `state_block = B` (fsdp-insert-optimizer's `state-dtype=8bit`)
    the buffer of an f32 step is stored in about a byte an element, as
    fsdp.adamw_update's exp_avg: a packed i8 tensor of
    shapes::quantizedBytes(n, B) bytes, n codes (a sign and E4M3, relative
    to the block's largest magnitude) then one f32 scale per block of B
    elements (runtime/core/Moments8.h; bitsandbytes' 8-bit SGD keeps its
    momentum so). The update decodes a block, runs the f32 step above and
    encodes the new buffer once, to the nearest code.

    ```mlir
    %p2, %b2 = fsdp.sgd_momentum_update %p, %g, %buf, %lr, %step {momentum = 9.0e-01 : f64} : tensor<64xf32>
    %p3, %b3 = fsdp.sgd_momentum_update %p, %g, %bb, %lr, %step {key = 0 : i64, momentum = 9.0e-01 : f64, stochastic} : tensor<64xf32> state tensor<64xbf16>
    %p4, %b4 = fsdp.sgd_momentum_update %p, %g, %bq, %lr, %step {momentum = 9.0e-01 : f64, state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$param, Fsdp_FloatTensor:$grad,
                       Fsdp_StateTensor:$buffer, Fsdp_Scalar:$lr,
                       Fsdp_Scalar:$step,
                       Optional<Fsdp_Scalar>:$skip_nonfinite,
                       Optional<Fsdp_Scalar>:$grad_scale,
                       F64Attr:$momentum,
                       DefaultValuedAttr<F64Attr, "0.0">:$dampening,
                       DefaultValuedAttr<F64Attr, "0.0">:$weight_decay,
                       OptionalAttr<I64Attr>:$decay_numel,
                       OptionalAttr<I64Attr>:$shard_stride,
                       UnitAttr:$nesterov,
                       UnitAttr:$stochastic,
                       UnitAttr:$stochastic_param,
                       OptionalAttr<I64Attr>:$key,
                       OptionalAttr<I64Attr>:$state_block);
  let results = (outs Fsdp_FloatTensor:$new_param, Fsdp_StateTensor:$new_buffer);
  let assemblyFormat = [{
    $param `,` $grad `,` $buffer `,` $lr `,` $step (`skip_nonfinite` $skip_nonfinite^)? (`grad_scale` $grad_scale^)? attr-dict `:` type($param) custom<GradType>(type($grad), ref(type($param))) custom<StateType>(type($buffer), ref(type($param)))
  }];
  let hasVerifier = 1;
}

def Fsdp_AdamwUpdateOp : Fsdp_Op<"adamw_update", [Pure, AttrSizedOperandSegments,
    AllTypesMatch<["param", "new_param"]>,
    AllTypesMatch<["exp_avg", "exp_avg_sq", "new_exp_avg", "new_exp_avg_sq"]>]> {
  let summary = "one AdamW step (decoupled weight decay, bias correction)";
  let description = [{
    PyTorch's AdamW: p = p * (1 - lr * weight_decay); m = b1 m + (1-b1) g;
    v = b2 v + (1-b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t))
    + eps), t = `step` (1-based). Elementwise.

    With `skip_nonfinite %s` (dynamic loss scaling), the update is skipped
    when `%s` (the global squared norm of the scaled gradients) is inf or
    NaN: every result equals its input, as PyTorch's fused optimizers do
    with GradScaler's `found_inf`.

    With `grad_scale %c` (fsdp-fuse-epilogues) the gradient is multiplied
    by the scalar `%c` first (the clipping or loss-scale factor of
    fsdp.clip_coef / fsdp.grad_coef, in f32): the update of `g * %c`
    without the product in memory, as PyTorch's fused optimizers take
    `grad_scale` and llm.c's AdamW its grad_scale. Bitwise the update of
    fsdp.mul's product.

    With `decay_numel = D` (fsdp-shard, `weight-decay-params=matrices`) the
    weight decay applies only to the elements whose position in their
    unit's flat parameters is below D (the unit packs its decayed
    parameters first); element i of the operand is at position
    shard_index * `shard_stride` + i (`shard_stride` 0: the operand is the
    whole unit). Still elementwise.

    The moments may be stored in bf16 beside f32 parameters
    (fsdp-insert-optimizer's `state-dtype=bf16`: 4 bytes of state a
    parameter instead of 8): they are widened, the step runs in f32 as
    above (the parameter's update reads the f32 moments), and the new
    moments are rounded to bf16 once, to nearest even or, with
    `stochastic`, stochastically (runtime/core/StochasticRounding.h: the
    expected stored value is the f32 one, so v's small increments are not
    lost to rounding when beta2 is near 1). A stochastic update's draws
    are keyed by (the run's seed, the training step, `key`) and each
    element's position in its unit (`shard_stride` as above; one 64-bit
    mix an element, 16 of its bits for each moment), so N ranks, one
    rank, the CPU and the GPU store the same bits.

    With `state_block = B` (fsdp-insert-optimizer's `state-dtype=8bit`)
    the moments of f32 parameters are stored in about a byte an element:
    each is a packed i8 tensor of shapes::quantizedBytes(n, B) bytes for
    the parameter's n elements, n codes then one f32 scale per block of
    B elements (runtime/core/Moments8.h: exp_avg as a sign and E4M3,
    exp_avg_sq as its square root in E4M4, each relative to its block's
    largest magnitude, as bitsandbytes' 8-bit optimizers keep theirs).
    The update decodes a block, runs the f32 step above and encodes the
    new moments once, rounded to the nearest code. Blocks count from the
    operand's first element, so a sharded operand's blocks are its
    unit's when each shard is a whole number of blocks (fsdp-shard pads
    the unit so). B is a power of two in [32, 4096].

    With `state_bits = 4` as well (`state-dtype=4bit`) the codes are four
    bits, two a byte: shapes::packedStateBytes(n, B, 4) bytes, about half
    a byte an element (runtime/core/Moments4.h: torchao's AdamW4bit maps,
    exp_avg on the signed dynamic-exponent map, exp_avg_sq's root on the
    linear map without zero); the same decode, f32 step and one encode.

    Parameters stored in bf16 with an f32 gradient (fsdp-mixed-precision's
    `master-dtype=bf16`: no f32 master copy) are widened, the step runs in
    f32 as above, and the new parameters are rounded to bf16 once: to
    nearest even, or with `stochastic_param` and `key` stochastically with
    the draws of the stochastic parameter cast (StochasticRounding.h's
    stochasticRoundingKey(seed, step, `key`), each element at its place in
    the unit by `shard_stride`), so an update smaller than half a bf16 ulp
    still moves the parameter in expectation.
    The moments are then those of the f32 step: f32, bf16, 8-bit or 4-bit as
    above. Their draws (the state stream) and the parameters' (the
    parameter stream) never meet.

    ```mlir
    %p2, %m2, %v2 = fsdp.adamw_update %p, %g, %m, %v, %lr, %step {beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-08 : f64, weight_decay = 0.01 : f64} : tensor<64xf32>
    %p3, %m3, %v3 = fsdp.adamw_update %p, %g, %mb, %vb, %lr, %step {key = 0 : i64, stochastic} : tensor<64xf32> state tensor<64xbf16>
    %p4, %m4, %v4 = fsdp.adamw_update %p, %g, %mq, %vq, %lr, %step {state_block = 32 : i64} : tensor<64xf32> state tensor<72xi8>
    %p6, %m6, %v6 = fsdp.adamw_update %p, %g, %mh, %vh, %lr, %step {state_bits = 4 : i64, state_block = 32 : i64} : tensor<64xf32> state tensor<40xi8>
    %p5, %m5, %v5 = fsdp.adamw_update %pb, %g, %m, %v, %lr, %step {key = 0 : i64, stochastic_param} : tensor<64xbf16> grad tensor<64xf32> state tensor<64xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$param, Fsdp_FloatTensor:$grad,
                       Fsdp_StateTensor:$exp_avg, Fsdp_StateTensor:$exp_avg_sq,
                       Fsdp_Scalar:$lr, Fsdp_Scalar:$step,
                       Optional<Fsdp_Scalar>:$skip_nonfinite,
                       Optional<Fsdp_Scalar>:$grad_scale,
                       DefaultValuedAttr<F64Attr, "0.9">:$beta1,
                       DefaultValuedAttr<F64Attr, "0.999">:$beta2,
                       DefaultValuedAttr<F64Attr, "1e-8">:$eps,
                       DefaultValuedAttr<F64Attr, "0.01">:$weight_decay,
                       OptionalAttr<I64Attr>:$decay_numel,
                       OptionalAttr<I64Attr>:$shard_stride,
                       UnitAttr:$stochastic,
                       UnitAttr:$stochastic_param,
                       OptionalAttr<I64Attr>:$key,
                       OptionalAttr<I64Attr>:$state_block,
                       OptionalAttr<I64Attr>:$state_bits);
  let results = (outs Fsdp_FloatTensor:$new_param, Fsdp_StateTensor:$new_exp_avg,
                      Fsdp_StateTensor:$new_exp_avg_sq);
  let assemblyFormat = [{
    $param `,` $grad `,` $exp_avg `,` $exp_avg_sq `,` $lr `,` $step (`skip_nonfinite` $skip_nonfinite^)? (`grad_scale` $grad_scale^)? attr-dict `:` type($param) custom<GradType>(type($grad), ref(type($param))) custom<StateType>(type($exp_avg), ref(type($param)))
  }];
  let hasVerifier = 1;
}

def Fsdp_LambNormsOp : Fsdp_Op<"lamb_norms", [Pure,
    AllTypesMatch<["param", "grad"]>, AllTypesMatch<["exp_avg", "exp_avg_sq"]>]> {
  let summary = "LAMB's per-parameter squared norms of the weights and the update";
  let description = [{
    The non-elementwise half of a LAMB step (fsdp.lamb_update is the
    other). The operand holds parameters laid out as `segments`: s_0 = 0 <
    s_1 < ... < s_K, parameter k at positions [s_k, s_{k+1}), positions
    from s_K on are padding; element i of the operand is at position
    shard_index * `shard_stride` + i (`shard_stride` absent or 0: the
    operand is the whole unit). The result, f32 [2K], holds for each
    parameter k the sum over the operand's elements of p^2 (entry k) and
    of u^2 (entry K + k), where u is the update direction fsdp.lamb_update
    computes: u = m_hat / (sqrt(v_hat) + eps) + wd * p with m' and v' the
    new moments (AdamW's, from `grad` times `grad_scale` when present) and
    wd the weight decay of the position (`decay_numel` as adamw_update's).
    Padding adds nothing. The moments are not written.

    Sums over a shard are partial: fsdp-shard all-reduces them over the
    shard group, the per-shard partial sums plus a small all-reduce of
    weight-update sharding's non-elementwise updates.

    The moments may be bf16 beside f32 parameters (state-dtype=bf16, as
    fsdp.lamb_update's): widened, u as above in f32; or 8-bit block codes
    with `state_block` (state-dtype=8bit, as fsdp.adamw_update's):
    decoded, u as above in f32.

    ```mlir
    %n = fsdp.lamb_norms %p, %g, %m, %v, %step {segments = array<i64: 0, 32, 40>, weight_decay = 0.01 : f64} : tensor<40xf32> -> tensor<4xf32>
    %n2 = fsdp.lamb_norms %p, %g, %mb, %vb, %step {segments = array<i64: 0, 40>} : tensor<40xf32> state tensor<40xbf16> -> tensor<2xf32>
    %n3 = fsdp.lamb_norms %p, %g, %mq, %vq, %step {segments = array<i64: 0, 40>, state_block = 32 : i64} : tensor<40xf32> state tensor<48xi8> -> tensor<2xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$param, Fsdp_FloatTensor:$grad,
                       Fsdp_StateTensor:$exp_avg, Fsdp_StateTensor:$exp_avg_sq,
                       Fsdp_Scalar:$step,
                       Optional<Fsdp_Scalar>:$grad_scale,
                       DenseI64ArrayAttr:$segments,
                       DefaultValuedAttr<F64Attr, "0.9">:$beta1,
                       DefaultValuedAttr<F64Attr, "0.999">:$beta2,
                       DefaultValuedAttr<F64Attr, "1e-6">:$eps,
                       DefaultValuedAttr<F64Attr, "0.01">:$weight_decay,
                       OptionalAttr<I64Attr>:$decay_numel,
                       OptionalAttr<I64Attr>:$shard_stride,
                       OptionalAttr<I64Attr>:$state_block);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = [{
    $param `,` $grad `,` $exp_avg `,` $exp_avg_sq `,` $step (`grad_scale` $grad_scale^)? attr-dict `:` type($param) custom<StateType>(type($exp_avg), ref(type($param))) `->` type($result)
  }];
  let hasVerifier = 1;
}

def Fsdp_LambUpdateOp : Fsdp_Op<"lamb_update", [Pure, AttrSizedOperandSegments,
    AllTypesMatch<["param", "grad", "new_param"]>,
    AllTypesMatch<["exp_avg", "exp_avg_sq", "new_exp_avg", "new_exp_avg_sq"]>]> {
  let summary = "one LAMB step (layer-wise trust ratio over AdamW's direction)";
  let description = [{
    timm's Lamb (apex FusedLAMB's default): m' = b1 m + (1-b1) g; v' = b2
    v + (1-b2) g^2; u = (m' / (1 - b1^t)) / (sqrt(v') / sqrt(1 - b2^t) +
    eps) + wd * p; p' = p - lr * r_k * u with, for parameter k, r_k =
    ||p_k|| / ||u_k|| when its weight decay is not 0 and both norms are
    positive, else 1. The norms come from `norms`, fsdp.lamb_norms' [2K]
    sums over the whole parameters (all-reduced when the operand is a
    shard); `segments`, `shard_stride` and `decay_numel` as there.

    `skip_nonfinite` and `grad_scale` as adamw_update's, and so are bf16
    moments beside f32 parameters (state-dtype=bf16: widened, the step in
    f32, the new moments rounded once, to nearest or with `stochastic` and
    `key` with adamw_update's draws), and so are 8-bit moments with
    `state_block` (decoded, the step in f32, the new moments encoded once
    a block; the parameter's update reads the f32 moments, as fsdp.
    lamb_norms' u does, so the trust ratio and the step see one u).

    ```mlir
    %p2, %m2, %v2 = fsdp.lamb_update %p, %g, %m, %v, %n, %lr, %step {segments = array<i64: 0, 40>} : tensor<40xf32>, tensor<2xf32>
    %p3, %m3, %v3 = fsdp.lamb_update %p, %g, %mb, %vb, %n, %lr, %step {key = 0 : i64, segments = array<i64: 0, 40>, stochastic} : tensor<40xf32>, tensor<2xf32> state tensor<40xbf16>
    %p4, %m4, %v4 = fsdp.lamb_update %p, %g, %mq, %vq, %n, %lr, %step {segments = array<i64: 0, 40>, state_block = 32 : i64} : tensor<40xf32>, tensor<2xf32> state tensor<48xi8>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$param, Fsdp_FloatTensor:$grad,
                       Fsdp_StateTensor:$exp_avg, Fsdp_StateTensor:$exp_avg_sq,
                       Fsdp_FloatTensor:$norms,
                       Fsdp_Scalar:$lr, Fsdp_Scalar:$step,
                       Optional<Fsdp_Scalar>:$skip_nonfinite,
                       Optional<Fsdp_Scalar>:$grad_scale,
                       DenseI64ArrayAttr:$segments,
                       DefaultValuedAttr<F64Attr, "0.9">:$beta1,
                       DefaultValuedAttr<F64Attr, "0.999">:$beta2,
                       DefaultValuedAttr<F64Attr, "1e-6">:$eps,
                       DefaultValuedAttr<F64Attr, "0.01">:$weight_decay,
                       OptionalAttr<I64Attr>:$decay_numel,
                       OptionalAttr<I64Attr>:$shard_stride,
                       UnitAttr:$stochastic,
                       OptionalAttr<I64Attr>:$key,
                       OptionalAttr<I64Attr>:$state_block);
  let results = (outs Fsdp_FloatTensor:$new_param, Fsdp_StateTensor:$new_exp_avg,
                      Fsdp_StateTensor:$new_exp_avg_sq);
  let assemblyFormat = [{
    $param `,` $grad `,` $exp_avg `,` $exp_avg_sq `,` $norms `,` $lr `,` $step (`skip_nonfinite` $skip_nonfinite^)? (`grad_scale` $grad_scale^)? attr-dict `:` type($param) `,` type($norms) custom<StateType>(type($exp_avg), ref(type($param)))
  }];
  let hasVerifier = 1;
}

def Fsdp_CountLabelsOp : Fsdp_Op<"count_labels", [Pure]> {
  let summary = "how many labels a cross-entropy keeps, over a divisor";
  let description = [{
    The number of elements of `labels` that differ from `ignore_index`,
    divided by `divisor` (the step's micro-batches), as an f32 scalar: the
    `normalizer` of a cross-entropy with `ignore_index`. Inserted by
    fsdp-autodiff; fsdp-grad-accum makes it count the whole step's labels
    (`divisor = K`) and fsdp-shard takes its mean over the ranks. Exact
    while the kept labels of a micro-batch over all ranks number at most
    2^24 (f32's integers); beyond that within an f32 rounding.

    ```mlir
    %n = fsdp.count_labels %labels {ignore_index = -100 : i64} : tensor<8x64xi32>
    ```
  }];
  let arguments = (ins Fsdp_IntTensor:$labels, I64Attr:$ignore_index,
                       OptionalAttr<I64Attr>:$divisor);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = "$labels attr-dict `:` type($labels)";
  let hasVerifier = 1;
}

def Fsdp_SquaredNormOp : Fsdp_Op<"squared_norm", [Pure]> {
  let summary = "sum of squares of all elements of all operands";
  let description = [{
    The partial sum behind global-norm clipping: with sharded gradients each
    rank computes it over its shards and an all-reduce adds the partials.

    ```mlir
    %s = fsdp.squared_norm %g1, %g2 : tensor<64x64xf32>, tensor<64xf32>
    ```
  }];
  let arguments = (ins Variadic<Fsdp_FloatTensor>:$inputs);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = "$inputs attr-dict `:` type($inputs)";
}

def Fsdp_ClipCoefOp : Fsdp_Op<"clip_coef", [Pure]> {
  let summary = "gradient-clipping factor from a squared global norm";
  let description = [{
    min(1, max_norm / (sqrt(sumsq) + 1e-6)), as torch.nn.utils.clip_grad_norm_.

    ```mlir
    %c = fsdp.clip_coef %sumsq {max_norm = 1.0 : f64} : tensor<f32>
    ```
  }];
  let arguments = (ins Fsdp_Scalar:$sumsq, F64Attr:$max_norm);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = "$sumsq attr-dict `:` type($sumsq)";
}

def Fsdp_GradCoefOp : Fsdp_Op<"grad_coef", [Pure]> {
  let summary = "the factor that unscales (and clips) loss-scaled gradients";
  let description = [{
    Dynamic loss scaling: the backward pass was seeded with d(loss) =
    `scale`, so every gradient is `scale` times too large and `sumsq` is
    the squared global norm of the scaled gradients. The result is what
    multiplies them into unscaled (and, with `max_norm`, clipped) ones:
    1/scale * min(1, max_norm / (sqrt(sumsq)/scale + 1e-6)), the clip factor
    of `fsdp.clip_coef` applied to the unscaled norm (GradScaler.unscale_
    then clip_grad_norm_). With a power-of-two scale and no overflow this
    is exactly clip_coef's factor of the unscaled gradients divided by the
    scale. Inf/NaN `sumsq` (an overflow) gives a meaningless factor: the
    updates read `sumsq` as `skip_nonfinite` and are skipped.

    ```mlir
    %c = fsdp.grad_coef %sumsq, %scale {max_norm = 1.0 : f64} : tensor<f32>
    ```
  }];
  let arguments = (ins Fsdp_Scalar:$sumsq, Fsdp_Scalar:$scale,
                       OptionalAttr<F64Attr>:$max_norm);
  let results = (outs Fsdp_Scalar:$result);
  let assemblyFormat = "$sumsq `,` $scale attr-dict `:` type($sumsq)";
}

//===----------------------------------------------------------------------===//
// Sharding: units, views and collectives (emitted by fsdp-shard)
//===----------------------------------------------------------------------===//

def Fsdp_UnitOp : Fsdp_Op<"unit", [Symbol]> {
  let summary = "an FSDP unit: parameters packed into one flat buffer";
  let description = [{
    The parameters listed in `params` (in that order) are packed into one
    flat tensor of `numel` elements, zero-padded to `type` (a multiple of
    the shard count: the world size, or the shards of a 2-D `fsdp.mesh`).
    Rank r owns elements [i * S, (i + 1) * S) where S is the size of
    `shard_type` and i = r mod shard count. With `sharded`, only that shard persists
    between steps (ZeRO-3 / FSDP, and ZeRO-1/2 with mixed precision: the
    f32 master shard, gathered in the compute dtype); otherwise every rank
    keeps the whole flat buffer (DDP, ZeRO-1/2). One all-gather or reduce-scatter moves a
    whole unit. With `offloaded` (fsdp-offload, ZeRO-Offload) the shard and
    the optimizer state shadowing the unit live in host memory and its
    update runs on the host.

    ```mlir
    fsdp.unit @"layers.0" : tensor<264xf32> shard tensor<66xf32> numel 260 params [@a, @b] sharded
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       TypeAttrOf<Fsdp_FloatTensor>:$type,
                       TypeAttrOf<Fsdp_FloatTensor>:$shard_type,
                       I64Attr:$numel,
                       FlatSymbolRefArrayAttr:$params,
                       UnitAttr:$sharded,
                       UnitAttr:$frozen,
                       UnitAttr:$offloaded);
  let assemblyFormat = [{
    $sym_name `:` $type `shard` $shard_type `numel` $numel `params` $params
    (`sharded` $sharded^)? (`frozen` $frozen^)? (`offloaded` $offloaded^)?
    attr-dict
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    int64_t getPaddedNumel() {
      return ::llvm::cast<::mlir::RankedTensorType>(getType()).getNumElements();
    }
    int64_t getShardNumel() {
      return ::llvm::cast<::mlir::RankedTensorType>(getShardType()).getNumElements();
    }
    /// The type of the storage that persists between steps.
    ::mlir::Type getStorageType() { return getSharded() ? getShardType() : getType(); }
  }];
}

def Fsdp_GetUnitOp : Fsdp_SymbolReadOp<"get_unit"> {
  let summary = "reads a unit's persistent storage (whole or shard)";
  let description = [{
    The result type is the unit's storage type: the local shard for a
    `sharded` unit, the whole flat buffer otherwise.

    ```mlir
    %s = fsdp.get_unit @"layers.0" : tensor<66xf32>
    ```
  }];
}

def Fsdp_SetUnitOp : Fsdp_SymbolWriteOp<"set_unit"> {
  let summary = "writes a unit's persistent storage (whole or shard)";
  let description = [{
    ```mlir
    fsdp.set_unit @"layers.0" = %new : tensor<66xf32>
    ```
  }];
}

def Fsdp_ViewOp : Fsdp_Op<"view", [Pure]> {
  let summary = "a window of a flat buffer: a parameter in its unit, a chunk of rows";
  let description = [{
    Elements [offset, offset + numel(result)) of the flat input, reshaped.
    No copy: the memory plan makes the result an alias of the input.
    fsdp-shard views each parameter in its unit's buffer; fsdp-chunk-loss
    views rows of the head's input and of the (integer) labels.

    ```mlir
    %w = fsdp.view %flat offset = 32 : tensor<264xf32> -> tensor<8x4xf32>
    %y = fsdp.view %labels offset = 64 : tensor<128xi32> -> tensor<32xi32>
    ```
  }];
  let arguments = (ins Fsdp_AnyTensor:$input, I64Attr:$offset);
  let results = (outs Fsdp_AnyTensor:$result);
  let assemblyFormat = "$input `offset` `=` $offset attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_ShardViewOp : Fsdp_Op<"shard_view", [Pure]> {
  let summary = "this rank's shard of a flat buffer";
  let description = [{
    Elements [i * S, (i + 1) * S) of the input, S = numel(result), i this
    rank's index in `group` (absent: "shard", the shard index); the input
    must hold group-size * S elements. An alias, not a copy. This is the
    one place where the rank enters an offset, and it does so by a fixed
    rule the runtime applies (offset + i * S).

    ```mlir
    %p = fsdp.shard_view %full : tensor<264xf32> -> tensor<66xf32>
    %q = fsdp.shard_view %full {group = "reshard"} : tensor<264xf32> -> tensor<132xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, OptionalAttr<StrAttr>:$group);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_PackOp : Fsdp_Op<"pack", [Pure]> {
  let summary = "packs tensors into one zero-padded flat buffer";
  let description = [{
    Input i is flattened and written at element `offsets[i]`; elements no
    input covers are zero. Used to pack a unit's gradients for one
    collective.

    ```mlir
    %g = fsdp.pack %ga, %gb offsets = [0, 32] : (tensor<8x4xf32>, tensor<8xf32>) -> tensor<264xf32>
    ```
  }];
  let arguments = (ins Variadic<Fsdp_FloatTensor>:$inputs, DenseI64ArrayAttr:$offsets);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$inputs `offsets` `=` $offsets attr-dict `:` functional-type($inputs, results)";
  let hasVerifier = 1;
}

def Fsdp_AllGatherOp : Fsdp_Op<"all_gather"> {
  let summary = "concatenates every rank's shard, in rank order";
  let description = [{
    Input: this rank's S elements; result: G * S elements, G the ranks of
    its group. Every rank issues the same collectives in the same order:
    the plan is one program for all ranks.

    `group` picks the ranks on a 2-D mesh (module attribute `fsdp.mesh` =
    `#fsdp.mesh<replicas = R, shards = S>`): "shard" (the ranks sharding one replica), "replica"
    (the ranks holding one shard); absent: every rank.

    ```mlir
    %full = fsdp.all_gather %shard : tensor<66xf32> -> tensor<264xf32>
    %f2 = fsdp.all_gather %shard {group = "shard"} : tensor<66xf32> -> tensor<132xf32>
    ```
  }];
  let arguments = (ins Fsdp_GatherTensor:$input, UnitAttr:$async,
                       OptionalAttr<StrAttr>:$group);
  let results = (outs Fsdp_GatherTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_QuantizeOp : Fsdp_Op<"quantize", [Pure]> {
  let summary = "a shard as int8 in blocks, each with its f32 scale (ZeRO++'s qwZ)";
  let description = [{
    fsdp-shard's weight-quantization=int8 (ZeRO++'s quantized weight
    communication, qwZ): each rank quantizes its shard of a unit's
    parameters before their all-gather, which then moves about a byte per
    parameter instead of two (bf16) or four (f32). The shard's S values
    are cut into blocks of `block` (the last may be shorter); of a block
    of largest magnitude m the scale is m / 127 (f32) and each value
    round-half-even(x x (127 / m)) in [-127, 127] (all 0 where m is 0, and
    where it is NaN or infinite, which then dequantize to NaN).
    Result: the S int8 values, zero-padded to a multiple of 4 bytes, then
    the ceil(S / block) scales as f32 bytes: one flat buffer, so the
    all-gather is one collective (runtime/core/ShapeRules.h:
    quantizedBytes).

    ```mlir
    %q = fsdp.quantize %s {block = 256 : i64} : tensor<1000xbf16> -> tensor<1016xi8>
    ```

    With `parts = P` (fsdp-shard's gradient-quantization=int8, ZeRO++'s
    qgZ): the input is P equal parts, each quantized as above on its own
    (its own blocks and scales) and written one after another, so that an
    fsdp.all_to_all hands part r to rank r.

    ```mlir
    %q = fsdp.quantize %g {block = 256 : i64, parts = 4 : i64}
        : tensor<4000xf32> -> tensor<4064xi8>
    ```

    With `chunks = K` as well (K a multiple of P dividing the input;
    hierarchical qgZ's first level): the input is K equal chunks and part
    p is chunks p, p + P, p + 2P, ... (K / P of them) in that order: with
    K = P x M chunks of the ranks of M nodes of P, part p holds what goes
    to place p on every node, for the node all-to-all.

    ```mlir
    %q = fsdp.quantize %g {block = 256 : i64, chunks = 4 : i64, parts = 2 : i64}
        : tensor<4000xf32> -> tensor<4064xi8>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, I64Attr:$block,
                       OptionalAttr<I64Attr>:$parts, OptionalAttr<I64Attr>:$chunks);
  let results = (outs Fsdp_ByteTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_DequantizeOp : Fsdp_Op<"dequantize", [Pure]> {
  let summary = "the gathered int8 shards back in a float dtype (ZeRO++'s qwZ)";
  let description = [{
    The inverse of fsdp.quantize on the all-gather of `parts` quantized
    shards, in rank order: part r's S values are its int8 values times
    their blocks' scales, written at r x S of the result (rounded to
    nearest even into a narrow result dtype). The result is the unit's
    gathered parameters, as the all-gather of the unquantized shards would
    give them up to the quantization's error (at most half a block's scale
    per value).

    ```mlir
    %w = fsdp.dequantize %g {block = 256 : i64, parts = 4 : i64}
        : tensor<4064xi8> -> tensor<4000xbf16>
    ```

    With `reduce = "sum"` or `"mean"` (ZeRO++'s qgZ, after the
    fsdp.all_to_all of the parts): the result is one part's S values, the
    sum (or mean) of the P dequantized parts, added in f32 in part order
    (so the same on every machine) and rounded once into the result dtype.
    This rank's shard of the reduce-scatter of the unquantized gradients,
    up to the quantization's error (at most half a block's scale per part).

    ```mlir
    %s = fsdp.dequantize %r {block = 256 : i64, parts = 4 : i64, reduce = "mean"}
        : tensor<4064xi8> -> tensor<1000xf32>
    ```
  }];
  let arguments = (ins Fsdp_ByteTensor:$input, I64Attr:$block, I64Attr:$parts,
                       OptionalAttr<StrAttr>:$reduce);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_AllToAllOp : Fsdp_Op<"all_to_all", [AllTypesMatch<["input", "result"]>]> {
  let summary = "hands part r of a flat buffer to rank r, gathering what each sent";
  let description = [{
    Input and result: G parts of S elements each (G ranks of the group,
    `group` as in fsdp.all_gather). Part r of the input goes to rank r;
    part r of the result is what rank r sent this rank. Moves bytes: ZeRO++'s
    qgZ sends each rank its part of the quantized gradients (i8), which
    fsdp.dequantize with `reduce` then sums: a reduce-scatter that moves
    about a byte per value.

    ```mlir
    %r = fsdp.all_to_all %q : tensor<4064xi8> -> tensor<4064xi8>
    ```
  }];
  let arguments = (ins Fsdp_GatherTensor:$input, UnitAttr:$async,
                       OptionalAttr<StrAttr>:$group);
  let results = (outs Fsdp_GatherTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_ReduceScatterOp : Fsdp_Op<"reduce_scatter"> {
  let summary = "reduces a flat buffer across ranks; each keeps its shard";
  let description = [{
    Input: G * S elements on every rank of the group (G ranks, `group` as
    in fsdp.all_gather); result: this rank's S elements of the elementwise
    sum (or mean with `reduce = "mean"`) over the group.

    ```mlir
    %gs = fsdp.reduce_scatter %g {reduce = "mean"} : tensor<264xf32> -> tensor<66xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, StrAttr:$reduce, UnitAttr:$async,
                       OptionalAttr<StrAttr>:$group);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Fsdp_AllReduceOp : Fsdp_Op<"all_reduce",
    [AllTypesMatch<["input", "result"]>]> {
  let summary = "elementwise sum or mean across ranks";
  let description = [{
    Over every rank, or over one axis of a 2-D mesh with `group` (as in
    fsdp.all_gather): HSDP all-reduces each gradient shard over
    `group = "replica"`.

    ```mlir
    %g = fsdp.all_reduce %g0 {reduce = "mean"} : tensor<264xf32>
    %h = fsdp.all_reduce %gs {reduce = "mean", group = "replica"} : tensor<66xf32>
    ```
  }];
  let arguments = (ins Fsdp_FloatTensor:$input, StrAttr:$reduce, UnitAttr:$async,
                       OptionalAttr<StrAttr>:$group);
  let results = (outs Fsdp_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let hasVerifier = 1;
}

def Fsdp_WaitOp : Fsdp_Op<"wait", [AllTypesMatch<["input", "result"]>]> {
  let summary = "waits for an asynchronous collective or copy to complete";
  let description = [{
    A collective marked `async` is issued where it stands and runs on the
    runtime's communication thread while the following compute runs; its
    result may be read only through the `fsdp.wait` on it, which blocks
    until the collective is done. The result is the same buffer (no copy).
    Inserted by fsdp-schedule; fsdp-offload-activations makes its copies
    between the arenas (`fsdp.to_host` / `fsdp.to_device` marked `async`)
    asynchronous the same way, and fsdp-offload its host updates (an
    update marked `fsdp.on_host` and `async` runs on the runtime's host
    stream; the wait is on its parameter result). With `carried`
    (fsdp-offload's next-step) the input is a read of a unit's storage and
    the wait joins the async host update the previous step left running on
    that unit (none in a step that follows none).

    ```mlir
    %f = fsdp.all_gather %s {async} : tensor<66xf32> -> tensor<264xf32>
    // ... compute of the previous unit ...
    %g = fsdp.wait %f : tensor<264xf32>
    ```
  }];
  let arguments = (ins Fsdp_GatherTensor:$input);
  let results = (outs Fsdp_GatherTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let hasVerifier = 1;
}

#endif // FSDP_OPS_TD
