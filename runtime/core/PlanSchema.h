//===- PlanSchema.h - the plan format's names, one table for both sides -*- C++ -*-===//
//
// The vocabulary of a plan file (docs/PLAN_FORMAT.md): its format tag and
// version, the dtype names (the plan's and safetensors'), the buffer kinds,
// and every op with its number of inputs and outputs. The compiler's
// convert-fsdp-to-plan (LLVM, no exceptions) and the runtime's plan loader
// (no LLVM) both include this header, so a name or an arity is written in
// one place. It depends on the standard library only.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_PLANSCHEMA_H
#define FSDP_RUNTIME_CORE_PLANSCHEMA_H

#include <cstdint>
#include <string_view>

namespace fsdp {

/// The "format" field of every plan file.
inline constexpr std::string_view kPlanFormat = "fsdp-plan";
/// The plan format version the compiler writes. The runtime rejects a
/// newer version (its plans may mean what this runtime cannot do), and one
/// older than kOldestPlanVersion (no migration exists).
///   1: the first format.
///   2: cross_entropy's `label_smoothing`, and a clipped plan's
///      `grad_sumsq` output without loss scaling. A runtime of version 1
///      would have ignored the attribute (a silently different loss), so
///      the bump makes it refuse these plans; a version 1 plan has neither
///      and means the same here, so it is still read.
///      cross_entropy's `ignore_index` came later within version 2: its
///      plans always hold count_labels, which an older runtime refuses
///      as an unknown op.
///      So did quantize / dequantize and the dtype i8 (weight-quantization):
///      an older runtime refuses them as an unknown op and dtype; and
///      all_to_all with quantize's `parts` / dequantize's `reduce`
///      (gradient-quantization), whose plans hold all_to_all; and the
///      mesh's `node` with quantize's `chunks` (hierarchical qgZ), whose
///      plans hold collectives over the groups "node" and "cross", which
///      an older runtime refuses as unknown groups; and a collective's
///      `stream` ("node": the node comm stream), only on those "node"
///      collectives: an older runtime would run them on its one comm
///      stream, which is correct (the same order, less overlap).
inline constexpr int kPlanVersion = 2;
inline constexpr int kOldestPlanVersion = 1;

/// The plan's `requires`: the features a runtime must have to run it
/// correctly, beyond what its version says (docs/PLAN_FORMAT.md). fsdp-opt
/// lists a feature only where the plan uses it, so a plan without them
/// stays readable by older runtimes; a runtime refuses a plan that
/// requires a feature it does not know, naming it, instead of running it
/// with what it does know. A feature belongs here when an older runtime
/// would read the plan without an error and run it differently: a new
/// op, dtype or group needs none (an older runtime refuses those).
///   optimizer-state-bf16: optimizer state in bf16 beside f32 parameters
///      (optimizer-state-dtype=bf16): AdamW's moments (the runtimes from
///      session 53 on), SGD's momentum buffer and LAMB's moments (session
///      54 on). Session 53's would run LAMB's bf16 moments widened, to
///      nearest: the reason for the list.
///   optimizer-state-8bit: AdamW's moments in 8-bit block codes
///      (optimizer-state-dtype=8bit, session 55; runtime/core/Moments8.h).
///   optimizer-state-4bit: AdamW's moments in 4-bit block codes
///      (optimizer-state-dtype=4bit, session 60; runtime/core/Moments4.h):
///      every packed i8 state of the plan is 4-bit (the updates'
///      `state_bits`), which is how checkpoints name its buffers.
///   master-bf16: trainable units stored in bf16 with no f32 master
///      (fsdp-mixed-precision master-dtype=bf16, session 57). Older
///      runtimes refuse the bf16 storage anyway; the name says why.
inline constexpr std::string_view kPlanFeatures[] = {"optimizer-state-bf16", "optimizer-state-8bit",
                                                     "optimizer-state-4bit", "master-bf16"};

/// The swap file's I/O alignment (fsdp-offload's nvme, plan
/// "swap_alignment"): every buffer in the swap file and every staging
/// buffer of a swap starts at a multiple of it, and its bytes rounded up to
/// it are reserved (in the file, and in the host arena while the staging
/// buffer is live), so the runtime may move whole blocks with O_DIRECT
/// (a page: at least the logical block size of the drives it meets).
inline constexpr int64_t kSwapAlignment = 4096;

/// I8: quantized parameters or gradients on the wire (quantize /
/// dequantize, ZeRO++'s qwZ and qgZ): int8 values and their f32 scales as
/// bytes.
enum class DType : uint8_t { F32, BF16, F16, I32, I64, I8 };

struct DTypeInfo {
  DType type;
  std::string_view name;        ///< in a plan: "f32", "bf16", ...
  std::string_view safetensors; ///< in a .safetensors header: "F32", ...
  int64_t bytes;
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::F32, "f32", "F32", 4}, {DType::BF16, "bf16", "BF16", 2}, {DType::F16, "f16", "F16", 2},
    {DType::I32, "i32", "I32", 4}, {DType::I64, "i64", "I64", 8},    {DType::I8, "i8", "I8", 1},
};

/// What a buffer holds; used for the memory breakdown and validation.
enum class BufferKind : uint8_t {
  Input,      ///< batch data, lr, step: written by the runtime each step
  Param,      ///< persistent parameter storage (a shard when sharded)
  State,      ///< persistent optimizer state
  Grad,       ///< gradient (persistent or transient)
  Activation, ///< forward values kept for backward
  Temp,       ///< everything else
  Comm,       ///< collective staging buffers
};
inline constexpr std::string_view kBufferKindNames[] = {
    "input", "param", "state", "grad", "activation", "temp", "comm"};
inline constexpr int kNumBufferKinds =
    sizeof(kBufferKindNames) / sizeof(kBufferKindNames[0]);

/// How the runtime executes an op: a kernel on the device, a collective
/// on the communication stream, or a wait for one.
enum class OpKind : uint8_t { Compute, Collective, Wait };

struct OpSchema {
  std::string_view name; ///< the dialect op name without "fsdp."
  int numInputs;         ///< -1: one or more
  int numOutputs;
  OpKind kind;
  int optionalInputs = 0; ///< trailing inputs that may be absent
  int optionalOutputs = 0; ///< trailing outputs that may be absent
};
/// Every op a plan may contain. A compute op's shape and dtype rules are in
/// runtime/core/OpRules.cpp; each device implements all of them.
inline constexpr OpSchema kOps[] = {
    {"add", 2, 1, OpKind::Compute},
    {"sub", 2, 1, OpKind::Compute},
    {"mul", 2, 1, OpKind::Compute},
    {"div", 2, 1, OpKind::Compute},
    {"neg", 1, 1, OpKind::Compute},
    {"scale", 1, 1, OpKind::Compute},
    {"dropout", 1, 1, OpKind::Compute},
    {"fill", 0, 1, OpKind::Compute},
    {"copy", 1, 1, OpKind::Compute},
    {"relu", 1, 1, OpKind::Compute},
    {"gelu", 1, 1, OpKind::Compute},
    {"softmax", 1, 1, OpKind::Compute},
    {"relu_grad", 2, 1, OpKind::Compute},
    {"gelu_grad", 2, 1, OpKind::Compute},
    {"softmax_grad", 2, 1, OpKind::Compute},
    {"bias_add", 2, 1, OpKind::Compute},
    {"matmul", 2, 1, OpKind::Compute, 1},              // + an accumulator: acc + a b
    {"matmul_bias", 3, 1, OpKind::Compute, 0, 1},      // + the pre-activation (gelu)
    {"matmul_gelu_grad", 3, 1, OpKind::Compute, 0, 1}, // + the bias gradient
    {"matmul_bias_grad", 2, 2, OpKind::Compute, 2},    // (d_weight, d_bias) + their sums
    {"layer_norm", 3, 1, OpKind::Compute},
    {"layer_norm_grad", 3, 3, OpKind::Compute},
    {"residual_layer_norm", 4, 2, OpKind::Compute}, // a, b, gamma, beta -> a + b, y
    {"layer_norm_grad_acc", 4, 3, OpKind::Compute}, // x, gamma, dy, acc -> dx + acc, ...
    {"attention", 3, 1, OpKind::Compute, 0, 1},     // + the log-sum-exp
    {"attention_grad", 6, 3, OpKind::Compute},      // q, k, v, y, lse, dy
    {"attention_qkv", 1, 1, OpKind::Compute, 0, 1}, // packed q|k|v; + the log-sum-exp
    {"attention_qkv_grad", 4, 1, OpKind::Compute},  // qkv, y, lse, dy -> dqkv
    {"silu", 1, 1, OpKind::Compute},
    {"swiglu", 2, 1, OpKind::Compute}, // gate, up -> silu(gate) * up
    {"silu_grad", 2, 1, OpKind::Compute},
    {"swiglu_grad", 3, 2, OpKind::Compute}, // gate, up, dy -> d_gate, d_up
    {"rms_norm", 2, 1, OpKind::Compute},
    {"rms_norm_grad", 3, 2, OpKind::Compute},
    {"residual_rms_norm", 3, 2, OpKind::Compute}, // a, b, w -> a + b, y
    {"rms_norm_grad_acc", 4, 2, OpKind::Compute}, // x, w, dy, acc -> dx + acc, dw
    {"rope", 1, 1, OpKind::Compute},
    {"rope_grad", 1, 1, OpKind::Compute},
    {"embedding", 2, 1, OpKind::Compute},
    {"embedding_grad", 2, 1, OpKind::Compute},
    {"reshape", 1, 1, OpKind::Compute},
    {"transpose", 1, 1, OpKind::Compute},
    {"slice", 1, 1, OpKind::Compute},
    {"slice_grad", 1, 1, OpKind::Compute},
    {"concat", -1, 1, OpKind::Compute},
    {"reduce_sum", 1, 1, OpKind::Compute},
    {"reduce_mean", 1, 1, OpKind::Compute},
    {"broadcast", 1, 1, OpKind::Compute},
    {"sum_to", 1, 1, OpKind::Compute},
    {"cast", 1, 1, OpKind::Compute},
    // a shard -> int8 + scales (ZeRO++'s qwZ); attrs block, parts, chunks
    {"quantize", 1, 1, OpKind::Compute},
    // gathered int8 + scales -> floats; attrs block, parts, reduce
    {"dequantize", 1, 1, OpKind::Compute},
    {"to_host", 1, 1, OpKind::Compute},   // device arena -> host arena
    {"to_device", 1, 1, OpKind::Compute}, // host arena -> device arena
    // + the kept-label count with ignore_index (count_labels)
    {"cross_entropy", 2, 1, OpKind::Compute, 1},
    {"cross_entropy_grad", 3, 1, OpKind::Compute, 1},
    {"cross_entropy_fused", 3, 2, OpKind::Compute, 1}, // (loss, d_logits)
    {"count_labels", 1, 1, OpKind::Compute},
    {"mse_loss", 2, 1, OpKind::Compute},
    {"mse_loss_grad", 3, 1, OpKind::Compute},
    {"bce_with_logits", 2, 1, OpKind::Compute},
    {"bce_with_logits_grad", 3, 1, OpKind::Compute},
    // + skip_nonfinite (dynamic loss scaling), then grad_scale, each
    // marked by an attribute of its name (OpRules.h: updateExtras)
    {"sgd_update", 3, 1, OpKind::Compute, 2},
    {"sgd_momentum_update", 5, 2, OpKind::Compute, 2},
    {"adamw_update", 6, 3, OpKind::Compute, 2},
    // LAMB in two passes around an all-reduce of the per-parameter sums:
    // p, g, m, v, step [+ grad_scale] -> [2K] (sum p^2, then sum u^2, per
    // segment); p, g, m, v, those sums, lr, step [+ skip, grad_scale]
    {"lamb_norms", 5, 1, OpKind::Compute, 1},
    {"lamb_update", 7, 3, OpKind::Compute, 2},
    {"squared_norm", -1, 1, OpKind::Compute},
    {"clip_coef", 1, 1, OpKind::Compute},
    {"grad_coef", 2, 1, OpKind::Compute},
    {"pack", -1, 1, OpKind::Compute},
    {"all_reduce", 1, 1, OpKind::Collective},
    {"reduce_scatter", 1, 1, OpKind::Collective},
    {"all_gather", 1, 1, OpKind::Collective},
    {"all_to_all", 1, 1, OpKind::Collective}, // ZeRO++'s qgZ: part r to rank r
    {"wait", 1, 1, OpKind::Wait},
};

constexpr const DTypeInfo &dtypeInfo(DType t) { return kDTypes[(int)t]; }
/// Bytes per element.
constexpr int64_t dtypeSize(DType t) { return dtypeInfo(t).bytes; }
/// "f32", "bf16", ...
constexpr const char *dtypeName(DType t) { return dtypeInfo(t).name.data(); }
/// Parses a plan dtype ("f32", ...); false when unknown.
constexpr bool parseDType(std::string_view s, DType &out) {
  for (const DTypeInfo &d : kDTypes)
    if (d.name == s) {
      out = d.type;
      return true;
    }
  return false;
}
/// Parses a safetensors dtype ("F32", ...); false when unknown.
constexpr bool parseSafetensorsDType(std::string_view s, DType &out) {
  for (const DTypeInfo &d : kDTypes)
    if (d.safetensors == s) {
      out = d.type;
      return true;
    }
  return false;
}

constexpr const char *bufferKindName(BufferKind k) {
  return kBufferKindNames[(int)k].data();
}
constexpr bool parseBufferKind(std::string_view s, BufferKind &out) {
  for (int k = 0; k < kNumBufferKinds; ++k)
    if (kBufferKindNames[k] == s) {
      out = (BufferKind)k;
      return true;
    }
  return false;
}

/// The op named `name`, or null when the format has no such op.
constexpr const OpSchema *findOp(std::string_view name) {
  for (const OpSchema &op : kOps)
    if (op.name == name)
      return &op;
  return nullptr;
}
/// Whether an instruction of `op` may have `in` inputs and `out` outputs
/// (the compiler's export and the runtime's loader both ask this).
constexpr bool acceptsArity(const OpSchema &op, int in, int out) {
  bool inputs = op.numInputs < 0 ? in > 0
                                 : in >= op.numInputs && in <= op.numInputs + op.optionalInputs;
  return inputs && out >= op.numOutputs && out <= op.numOutputs + op.optionalOutputs;
}
/// all_reduce, reduce_scatter, all_gather, all_to_all and wait: run by the
/// communicator, not by a device kernel.
constexpr bool isCollectiveOp(std::string_view name) {
  const OpSchema *op = findOp(name);
  return op && op->kind != OpKind::Compute;
}

// The tables are indexed by their enums: keep them in the enums' order.
static_assert(kDTypes[(int)DType::I64].type == DType::I64 &&
              kDTypes[(int)DType::BF16].type == DType::BF16 &&
              kDTypes[(int)DType::I8].type == DType::I8);
static_assert(kNumBufferKinds == (int)BufferKind::Comm + 1);

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_PLANSCHEMA_H
